"""``ddpkit manifest``: every manifest it writes, for a matrix of flags, against what the operators' published CRDs
(and Kubernetes' own API, for the Job, Service and Deployment) require, checked with jsonschema; a bad combination of
flags is one line. In-process: no cluster, no process.

The schemas below are facts read from the CRDs, not copies of them: the fields these manifests use, their types and
required keys, and the values the operators' webhooks and Go constants allow where the CRD itself leaves a plain
string. ``additionalProperties: false`` where the CRD lists its fields: an API server drops a field its schema does
not know (pruning), silently, so a misspelled one must fail here.
"""

from __future__ import annotations

import json

import pytest

from ddpkit.app.cli import main
from ddpkit.app.manifests import Pods, build

jsonschema = pytest.importorskip("jsonschema", reason="the manifest tests need jsonschema (in the test extra)")

STRING, INTEGER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9.]+([KMGTPE]i?|m|[eE][0-9]+)?$"}]}
# Kubernetes' core v1 objects, as every CRD that embeds a pod template repeats them (PodSpec's required containers,
# Container's required name, VolumeMount's required name and mountPath, EmptyDirVolumeSource's medium and sizeLimit).
RESOURCES = {"type": "object", "additionalProperties": False, "properties": {
    "limits": {"type": "object", "additionalProperties": QUANTITY},
    "requests": {"type": "object", "additionalProperties": QUANTITY}}}
VOLUME_MOUNT = {"type": "object", "required": ["name", "mountPath"], "properties": {"name": STRING, "mountPath": STRING}}
VOLUME = {"type": "object", "required": ["name"], "properties": {
    "name": STRING, "emptyDir": {"type": "object", "additionalProperties": False,
                                 "properties": {"medium": {"enum": ["", "Memory"]}, "sizeLimit": QUANTITY}}}}
CONTAINER = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "name": STRING, "image": STRING, "command": {"type": "array", "items": STRING},
    "args": {"type": "array", "items": STRING}, "resources": RESOURCES,
    "env": {"type": "array", "items": {"type": "object", "required": ["name"], "additionalProperties": False,
                                       "properties": {"name": STRING, "value": STRING}}},
    "volumeMounts": {"type": "array", "items": VOLUME_MOUNT},
    "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"], "properties": {
        "name": {"type": "string", "maxLength": 15}, "containerPort": {"type": "integer", "minimum": 1,
                                                                       "maximum": 65535}}}}}}
POD_SPEC = {"type": "object", "required": ["containers"], "properties": {
    "containers": {"type": "array", "minItems": 1, "items": CONTAINER}, "volumes": {"type": "array", "items": VOLUME},
    "subdomain": STRING, "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]}}}
# metadata.name: a TrainJob's must be an RFC 1035 label of at most 63 characters (its CRD's root validation rule).
METADATA = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}, "namespace": STRING,
    "labels": {"type": "object", "additionalProperties": STRING}}}


def _object(api_version: str, kind: str, spec: dict) -> dict:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": METADATA,
                           "spec": spec}}


# Kubeflow Trainer v2.3.0, manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml (v2.2.0 alike): spec requires
# runtimeRef, which requires name (1..253); trainer.numNodes and trainer.numProcPerNode are integers (int32; on
# master numProcPerNode >= 1, numNodes >= 0); command an array of strings (at most 128); runtimePatches at most 16,
# each requiring manager, whose trainingRuntimeSpec.template.spec.replicatedJobs[] (each requiring name) patch the
# pods' template.spec.template.spec.
def _nested(path: str, leaf: dict) -> dict:
    """``{"type": "object", "properties": {"a": {... "b": leaf}}}`` for the path ``a.b``."""
    for name in reversed(path.split(".")):
        leaf = {"type": "object", "properties": {name: leaf}}
    return leaf


PATCHED_POD = {"type": "object", "properties": {
    "volumes": {"type": "array", "maxItems": 128, "items": VOLUME},
    "containers": {"type": "array", "maxItems": 64, "items": {"type": "object", "required": ["name"], "properties": {
        "name": STRING, "volumeMounts": {"type": "array", "items": VOLUME_MOUNT}}}}}}
REPLICATED_JOB = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 253}, "template": _nested("spec.template.spec", PATCHED_POD)}}
TRAINJOB = _object("trainer.kubeflow.org/v1alpha1", "TrainJob", {
    "type": "object", "required": ["runtimeRef"], "additionalProperties": False, "properties": {
        "runtimeRef": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 253}, "apiGroup": STRING, "kind": STRING}},
        "trainer": {"type": "object", "additionalProperties": False, "properties": {
            "image": {"type": "string", "maxLength": 500},
            "command": {"type": "array", "items": STRING, "maxItems": 128},
            "args": {"type": "array", "items": STRING, "maxItems": 128},
            "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "numNodes": {"type": "integer", "minimum": 0}, "numProcPerNode": {"type": "integer", "minimum": 1},
            "resourcesPerNode": RESOURCES}},
        "runtimePatches": {"type": "array", "maxItems": 16, "items": {
            "type": "object", "required": ["manager"], "additionalProperties": False, "properties": {
                "manager": {"type": "string", "minLength": 1, "maxLength": 253}, "time": STRING,
                "trainingRuntimeSpec": _nested("template.spec", {"type": "object", "properties": {"replicatedJobs": {
                    "type": "array", "maxItems": 100, "items": REPLICATED_JOB}}})}}},
        "suspend": BOOLEAN, "managedBy": STRING, "activeDeadlineSeconds": {"type": "integer", "minimum": 1}}})

# Kubeflow training-operator v1.9.4 (kubeflow/trainer tag v1.9.4; v1.8.1 alike), manifests/base/crds/
# kubeflow.org_pytorchjobs.yaml: spec requires pytorchReplicaSpecs, a map of replica specs (replicas int32,
# restartPolicy string, template a pod template whose spec requires containers); nprocPerNode is a string;
# elasticPolicy's minReplicas, maxReplicas, maxRestarts integers and rdzvBackend a string; runPolicy's backoffLimit an
# integer, cleanPodPolicy a string. The CRD has no enums: the values below are the operator's Go constants
# (restartPolicy Always/OnFailure/Never/ExitCode, cleanPodPolicy All/Running/None, rdzvBackend c10d/etcd/etcd-v2)
# and its webhook's checks (replica types Master and Worker, exactly one Master, a container named pytorch).
REPLICA = {"type": "object", "required": ["replicas", "template"], "additionalProperties": False, "properties": {
    "replicas": {"type": "integer", "minimum": 1},
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
    "template": {"type": "object", "required": ["spec"], "properties": {"spec": {
        **POD_SPEC, "properties": {**POD_SPEC["properties"], "containers": {
            "type": "array", "items": CONTAINER, "contains": {"properties": {"name": {"const": "pytorch"}}}}}}}}}}
PYTORCHJOB = _object("kubeflow.org/v1", "PyTorchJob", {
    "type": "object", "required": ["pytorchReplicaSpecs"], "additionalProperties": False, "properties": {
        "nprocPerNode": {"type": "string", "pattern": r"^(auto|cpu|gpu|[1-9][0-9]*)$"},
        "pytorchReplicaSpecs": {"type": "object", "minProperties": 1, "propertyNames": {"enum": ["Master", "Worker"]},
                                "additionalProperties": REPLICA,
                                "properties": {"Master": {"properties": {"replicas": {"const": 1}}}}},
        "elasticPolicy": {"type": "object", "additionalProperties": False, "properties": {
            "minReplicas": INTEGER, "maxReplicas": INTEGER, "maxRestarts": INTEGER,
            "rdzvBackend": {"enum": ["c10d", "etcd", "etcd-v2"]}, "rdzvHost": STRING, "rdzvPort": INTEGER,
            "rdzvId": STRING}},
        "runPolicy": {"type": "object", "additionalProperties": False, "properties": {
            "backoffLimit": {"type": "integer", "minimum": 0}, "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
            "activeDeadlineSeconds": INTEGER, "ttlSecondsAfterFinished": INTEGER, "suspend": BOOLEAN}}}})

# Kubernetes' batch/v1 Job (an Indexed one), v1 Service and apps/v1 Deployment (the API reference, v1.33): a Job's
# pods restart Never or OnFailure; completionMode NonIndexed or Indexed; a Service's ports require port; a
# Deployment's selector is required and must match its template's labels (checked below, not expressible here).
JOB = _object("batch/v1", "Job", {"type": "object", "required": ["template"], "properties": {
    "completionMode": {"enum": ["NonIndexed", "Indexed"]}, "completions": {"type": "integer", "minimum": 1},
    "parallelism": {"type": "integer", "minimum": 1}, "backoffLimit": {"type": "integer", "minimum": 0},
    "template": {"type": "object", "required": ["spec"], "properties": {"spec": {
        **POD_SPEC, "required": ["containers", "restartPolicy"],
        "properties": {**POD_SPEC["properties"], "restartPolicy": {"enum": ["OnFailure", "Never"]}}}}}}})
SERVICE = _object("v1", "Service", {"type": "object", "properties": {
    "clusterIP": STRING, "publishNotReadyAddresses": BOOLEAN, "selector": {"type": "object",
                                                                            "additionalProperties": STRING},
    "ports": {"type": "array", "items": {"type": "object", "required": ["port"], "properties": {
        "name": STRING, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}}}}})
DEPLOYMENT = _object("apps/v1", "Deployment", {"type": "object", "required": ["selector", "template"], "properties": {
    "replicas": INTEGER, "selector": {"type": "object", "required": ["matchLabels"]},
    "template": {"type": "object", "required": ["metadata", "spec"], "properties": {"spec": POD_SPEC}}}})
SCHEMAS = {"TrainJob": TRAINJOB, "PyTorchJob": PYTORCHJOB, "Job": JOB, "Service": SERVICE, "Deployment": DEPLOYMENT}


def written(*argv: str, capsys) -> list[dict]:
    """``ddpkit manifest ARGV``'s output, each document read back (the stream kubectl reads: documents between
    ``---`` lines, JSON being YAML)."""
    assert main(["manifest", *argv]) == 0
    out = capsys.readouterr().out
    return [json.loads(document) for document in out.split("---\n")]


def valid(objects: list[dict]) -> dict[str, dict]:
    for item in objects:
        jsonschema.validate(item, SCHEMAS[item["kind"]])
    return {f"{item['kind']}/{item['metadata']['name']}": item for item in objects}


TRAIN = ["train", "--model", "resnet50", "--data", "folder:/data/imagenet", "--epochs", "90"]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob", "indexed-job"])
@pytest.mark.parametrize("pods, command, nodes", [
    (["--gpus-per-node", "8"], [*TRAIN, "--nnodes", "2", "--nccl", "no-ib", "--nccl=NCCL_SOCKET_IFNAME=eth0"], 2),
    (["--gpus-per-node", "8", "--cpus-per-node", "96", "--memory-per-node", "900Gi", "--namespace", "ml"],
     [*TRAIN, "--nnodes=4", "--nproc-per-node", "4"], 4),
    ([], ["run", "--nnodes", "2", "--nproc-per-node", "2", "train.py", "--nnodes", "7", "--lr", "0.1"], 2),
    (["--shm-size", "64Gi"], ["ddpkit", "train", "--replica-groups", "2", "--nnodes", "2"], 2),
    ([], ["train"], 1),
], ids=["gpus", "resources", "run-a-script", "replica-groups", "one-node"])
def test_every_manifest_validates_against_what_its_operator_requires(kind, pods, command, nodes, capsys):
    objects = valid(written(kind, "--image", "ghcr.io/me/train:1", "--name", "llm", *pods, "--", *command,
                            capsys=capsys))
    (main_object,) = [item for item in objects.values() if item["kind"] in ("TrainJob", "PyTorchJob", "Job")]
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi" if "64Gi" in pods else "16Gi"}}
    if kind == "trainjob":
        trainer = main_object["spec"]["trainer"]
        container_command = trainer["command"]
        assert trainer["numNodes"] == nodes and main_object["spec"]["runtimeRef"] == {"name": "torch-distributed"}
        patch = main_object["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        assert patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"] == [shm]
    elif kind == "pytorchjob":
        replicas = main_object["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] == 1 and replicas.get("Worker", {"replicas": 0})["replicas"] == nodes - 1
        container = replicas["Master"]["template"]["spec"]["containers"][0]
        container_command = container["command"]
        assert replicas["Master"]["template"]["spec"]["volumes"] == [shm]
    else:
        spec = main_object["spec"]
        assert spec["completions"] == spec["parallelism"] == nodes
        assert spec["template"]["spec"]["subdomain"] == "llm" and objects["Service/llm"]["spec"]["clusterIP"] == "None"
        assert objects["Service/llm"]["spec"]["selector"] == {"job-name": "llm"}
        container = spec["template"]["spec"]["containers"][0]
        container_command = container["command"]
        assert spec["template"]["spec"]["volumes"] == [shm]
    # The command as given, less what the operator's variables say (an Indexed Job's pods keep --nnodes: Kubernetes
    # does not say it); a script's own arguments untouched.
    assert container_command[:2] == ["ddpkit", command[1] if command[0] == "ddpkit" else command[0]]
    launch = [item for item in container_command if item.startswith(("--nnodes", "--nproc-per-node"))]
    if kind == "indexed-job":
        # Without GPUs, auto would be 2 processes a pod: one, unless the command says; with GPUs, auto is one each.
        assert ("--nproc-per-node" in launch) == ("--gpus-per-node" not in pods or "4" in command), launch
        assert nodes == 1 or any(item.startswith("--nnodes") for item in launch)
    else:
        assert launch == (["--nnodes"] if command[0] == "run" else []), container_command
    if command[0] == "run":
        assert container_command[-5:] == ["train.py", "--nnodes", "7", "--lr", "0.1"]
    if "--gpus-per-node" in pods:
        resources = main_object["spec"]["trainer"]["resourcesPerNode"] if kind == "trainjob" else container["resources"]
        assert resources == {"limits": {"nvidia.com/gpu": 8, **({"memory": "900Gi"} if "900Gi" in pods else {})},
                **({"requests": {"cpu": "96", "memory": "900Gi"}} if "96" in pods else {})}
    if "--nccl" in command:  # the pods' environment, not the command
        env = main_object["spec"]["trainer"]["env"] if kind == "trainjob" else container["env"]
        assert env == [{"name": "NCCL_IB_DISABLE", "value": "1"}, {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]
        assert not [item for item in container_command if item.startswith("--nccl")], container_command
    if "--replica-groups" in command:
        deployment, service = objects["Deployment/llm-lighthouse"], objects["Service/llm-lighthouse"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]
        assert "http://llm-lighthouse:29510" in container_command
    if "--namespace" in pods:
        assert all(item["metadata"]["namespace"] == "ml" for item in objects.values())


def test_restarts_and_elastic_nodes_become_the_operators_own():
    pods = Pods(image="img", name="job")
    (elastic,) = build("pytorchjob", ["train", "--nnodes", "2:4", "--max-restarts", "3"], pods)
    jsonschema.validate(elastic, PYTORCHJOB)
    assert elastic["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4, "rdzvBackend": "c10d",
                                                "maxRestarts": 3}
    assert list(elastic["spec"]["pytorchReplicaSpecs"]) == ["Worker"]  # elastic: workers only, numbered at rendezvous
    worker = elastic["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "OnFailure"
    assert elastic["spec"]["runPolicy"]["backoffLimit"] == 3
    _, job = build("indexed-job", ["train", "--nnodes", "2", "--max-restarts", "2"], pods)
    assert job["spec"]["backoffLimit"] == 2 and "--max-restarts" not in job["spec"]["template"]["spec"]["containers"][0]["command"]
    (trainjob,) = build("trainjob", ["train", "--nnodes", "2", "--nproc-per-node", "4"], pods)
    assert trainjob["spec"]["trainer"]["numProcPerNode"] == 4


@pytest.mark.parametrize("argv, message", [
    (["trainjob", "--image", "i", "--", "train", "--nnodes", "1:4"], "--nnodes 1:4: a TrainJob's node count is fixed"),
    (["trainjob", "--image", "i", "--", "train", "--max-restarts", "2"], "--max-restarts: a TrainJob's restarts are"),
    (["indexed-job", "--image", "i", "--", "train", "--nnodes", "2:3"], "an Indexed Job runs a fixed number of pods"),
    (["pytorchjob", "--image", "i", "--", "train", "--nnodes", "2", "--node-rank", "1"],
     "each pod learns its node's rank and the master from the operator; drop --node-rank"),
    (["pytorchjob", "--image", "i", "--", "run", "--master-addr=x", "t.py"], "drop --master-addr"),
    (["pytorchjob", "--image", "i", "--", "train", "--launcher", "ray"], "--launcher ray does not run in the operator"),
    (["trainjob", "--image", "i", "--gpus-per-node", "4", "--", "train", "--nproc-per-node", "8"],
     "--nproc-per-node 8 with --gpus-per-node 4: one process per GPU at most"),
    (["trainjob", "--image", "i", "--name", "My_Job", "--", "train"], "--name 'My_Job': a lower-case DNS label"),
    (["trainjob", "--image", "i", "--", "bench"], "give the ddpkit command every pod runs after --"),
    (["trainjob", "--image", "i"], "give the ddpkit command every pod runs after --"),
    (["trainjob", "--image", "i", "--", "train", "--epochs", "many"], "argument --epochs: invalid int value"),
    (["cronjob", "--image", "i", "--", "train"], "argument kind: invalid choice: 'cronjob'"),
], ids=["trainjob-elastic", "trainjob-restarts", "indexed-elastic", "node-rank", "master-addr", "ray", "nproc-gpus",
        "name", "not-train-or-run", "no-command", "bad-train-flag", "kind"])
def test_a_bad_combination_of_flags_is_one_line_and_status_2(argv, message, capsys):
    assert main(["manifest", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddpkit") and message in err, err
