"""``ddpkit manifest``: a Kubernetes manifest that runs a ``ddpkit train`` or ``ddpkit run`` command line on every
node of a job, ready for ``kubectl apply -f -``.

    $ ddpkit manifest trainjob --image ghcr.io/me/train:1 --gpus-per-node 8 -- train --nnodes 2 --model resnet50
    $ ddpkit manifest pytorchjob --image IMAGE -- run --nnodes 1:4 --max-restarts 3 train.py --epochs 10
    $ ddpkit manifest indexed-job --image IMAGE --cpus-per-node 4 -- train --nnodes 2 --nproc-per-node 1

The launch flags of the command (``--nnodes``, ``--nproc-per-node``, ``--max-restarts``, ``--replica-groups``) become
the operator's fields; the container's command is the rest, which reads the rest of the job's shape from the
variables the operator gives each pod (``ddpkit.core.platforms``). ``--nccl`` settings become the pods' environment.
Every pod gets a memory-backed ``/dev/shm``.

The output is JSON, one document per object, separated by ``---`` lines: YAML (JSON is YAML), which kubectl
applies as it is. The objects' fields are those of Kubeflow Trainer v2.3's ``TrainJob``, training-operator v1.9's
``PyTorchJob`` and Kubernetes' ``batch/v1`` Job and ``v1`` Service (docs/kubernetes.md); the tests check each kind
against what those CRDs require.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Sequence

from ddpkit.app.parser import MANIFEST_KINDS as KINDS
from ddpkit.app.parser import build_parser, subcommand
from ddpkit.core.errors import UsageError

TRAINJOB_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for PyTorch
PYTORCHJOB_PORT = 23456  # a PyTorchJob's default pytorchjob-port
INDEXED_PORT = 29500  # ddpkit's default master port, which an Indexed Job's pods use
LIGHTHOUSE_PORT = 29510
SHM = "dshm"
# The command's flags that become the operator's fields (kept in an Indexed Job's command: --nnodes and
# --nproc-per-node, which Kubernetes does not say), and those the operator's variables give each pod.
PLATFORM_FLAGS = ("--nnodes", "--nproc-per-node", "--max-restarts")
MOVED_TO_ENV = ("--nccl",)  # NCCL settings: the pods' environment (each rank's, as --nccl would set it)
GIVEN_BY_THE_PLATFORM = ("--node-rank", "--master-addr", "--master-port", "--rdzv-endpoint", "--rdzv-id")
NAME = re.compile(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?")  # a DNS label, short enough for the names derived from it


@dataclasses.dataclass(frozen=True)
class Pods:
    """What the manifest's pods need beside the command."""

    image: str
    name: str
    namespace: str | None = None
    gpus_per_node: int = 0
    cpus_per_node: str | None = None
    memory_per_node: str | None = None
    shm_size: str = "16Gi"


def command_of(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], argparse.Namespace]:
    """The ddpkit command line after ``--`` (``train ...`` or ``run ...``, ``ddpkit`` in front or not), parsed as
    ``ddpkit`` parses it (``parser``: a mistake in it is the same one line): (its argv, its namespace)."""
    argv = list(argv[1:] if argv and argv[0] == "ddpkit" else argv)
    if not argv or argv[0] not in ("train", "run"):
        raise UsageError("ddpkit manifest KIND [options] -- train ... | run SCRIPT ...: give the ddpkit command every "
                         "pod runs after --")
    return argv, parser.parse_args(argv)


def script_index(argv: Sequence[str], ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Where ``run``'s script stands in ``argv`` (its own arguments follow, which are not ddpkit's); ``len(argv)`` for
    ``train``."""
    if argv[0] != "run":
        return len(argv)
    valued = {flag for action in subcommand(parser, "run")._actions  # noqa: SLF001 - no public list
              if action.nargs != 0 for flag in action.option_strings}
    index = 1
    while index < len(argv) and argv[index] != ns.script:
        index += 2 if argv[index] in valued else 1
    return index


def without_flags(argv: Sequence[str], flags: Sequence[str], stop: int) -> list[str]:
    """``argv`` less ``flags`` (``--flag value`` or ``--flag=value``) before ``stop``."""
    kept, index = [], 0
    while index < stop:
        flag = argv[index].split("=", 1)[0]
        if flag in flags:
            index += 1 if "=" in argv[index] else 2
            continue
        kept.append(argv[index])
        index += 1
    return [*kept, *argv[stop:]]


def build(kind: str, argv: Sequence[str], pods: Pods) -> list[dict]:
    """The objects of a ``kind`` manifest (``KINDS``) that runs the ddpkit command ``argv`` on every node."""
    if kind not in KINDS:
        raise UsageError(f"ddpkit manifest: KIND must be one of {', '.join(KINDS)}, got {kind!r}")
    _check_pods(pods)
    parser = build_parser()
    argv, ns = command_of(argv, parser)
    stop = script_index(argv, ns, parser)
    given = [flag for flag in GIVEN_BY_THE_PLATFORM if any(item.split("=", 1)[0] == flag for item in argv[:stop])]
    if given:
        raise UsageError(f"ddpkit manifest: each pod learns its node's rank and the master from the operator; drop "
                         f"{', '.join(given)} from the command")
    if ns.launcher != "torchrun":
        raise UsageError(f"ddpkit manifest: --launcher {ns.launcher} does not run in the operator's pods; drop it "
                         "(on KubeRay, run `ddpkit ... --launcher ray` from a pod of the Ray cluster: docs/ray.md)")
    min_nodes, nodes, nproc = _launch_flags(ns, pods)
    elastic = min_nodes is not None and min_nodes != nodes
    replicas = getattr(ns, "replica_groups", None)
    from ddpkit.launch import nccl

    env = [{"name": name, "value": value} for name, value in nccl.settings(ns.nccl).items()]
    moved = (*PLATFORM_FLAGS, *MOVED_TO_ENV) if kind != "indexed-job" else ("--max-restarts", *MOVED_TO_ENV)
    command = ["ddpkit", *without_flags(argv, moved, stop)]
    if kind == "indexed-job" and nproc != ns.nproc_per_node:
        command = [*command[:2], "--nproc-per-node", nproc, *command[2:]]
    objects: list[dict] = []
    if replicas is not None and getattr(ns, "lighthouse", None) is None:  # (one given: the user's own lighthouse)
        url = f"http://{pods.name}-lighthouse:{LIGHTHOUSE_PORT}"
        command = [*command[:2], "--lighthouse", url, *command[2:]]
        objects += lighthouse(pods, min_replicas=getattr(ns, "min_replicas", None) or 1)
    if kind == "trainjob":
        if elastic:
            raise UsageError(f"--nnodes {ns.nnodes}: a TrainJob's node count is fixed; give --nnodes N, or use "
                             "`ddpkit manifest pytorchjob`, whose elasticPolicy grows and shrinks")
        if ns.max_restarts:
            raise UsageError("--max-restarts: a TrainJob's restarts are its runtime's (the JobSet's failurePolicy); "
                             "drop --max-restarts, or use `ddpkit manifest pytorchjob` (its restartPolicy and "
                             "backoffLimit)")
        objects.append(trainjob(pods, command, nodes, nproc, env))
    elif kind == "pytorchjob":
        objects.append(pytorchjob(pods, command, env, nodes, min_nodes if elastic else None, nproc, ns.max_restarts))
    else:
        if elastic:
            raise UsageError(f"--nnodes {ns.nnodes}: an Indexed Job runs a fixed number of pods; give --nnodes N, or "
                             "use `ddpkit manifest pytorchjob`")
        objects += indexed_job(pods, command, env, nodes, ns.max_restarts)
    return objects


def _check_pods(pods: Pods) -> None:
    """UsageError for a name that cannot name the pods and services, or a negative GPU count."""
    if not NAME.fullmatch(pods.name):
        raise UsageError(f"--name {pods.name!r}: a lower-case DNS label of at most 42 letters, digits and '-', "
                         "starting with a letter (the pods' and services' names derive from it)")
    if pods.gpus_per_node < 0:
        raise UsageError(f"--gpus-per-node must be 0 or more, got {pods.gpus_per_node}")


def _launch_flags(ns: argparse.Namespace, pods: Pods) -> tuple[int | None, int, str]:
    """The command's ``--nnodes`` as (MIN or None, MAX) and the processes per node (auto: 1 without GPUs), checked,
    with ``--max-restarts``, against what the operator's pods can run."""
    from ddpkit.launch.launcher import parse_nnodes

    min_nodes, nodes = parse_nnodes(ns.nnodes)
    if nodes < 1 or (min_nodes is not None and not 1 <= min_nodes <= nodes):
        raise UsageError(f"--nnodes must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got {ns.nnodes}")
    nproc = ns.nproc_per_node
    if nproc != "auto" and not (nproc.isdigit() and int(nproc) >= 1):
        raise UsageError(f"--nproc-per-node must be a whole number of at least 1 or auto, got {nproc!r}")
    if nproc == "auto" and not pods.gpus_per_node:
        # auto without GPUs is 2 on a machine of one's own, and a TrainJob's runtime would make it the CPU count: one
        # process per pod, which the pod's CPU request then serves.
        nproc = "1"
    if nproc.isdigit() and pods.gpus_per_node and int(nproc) > pods.gpus_per_node:
        raise UsageError(f"--nproc-per-node {nproc} with --gpus-per-node {pods.gpus_per_node}: one process per GPU "
                         "at most")
    if ns.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {ns.max_restarts}")
    return min_nodes, nodes, nproc


def _metadata(pods: Pods, name: str, **labels: str) -> dict:
    metadata: dict = {"name": name}
    if pods.namespace:
        metadata["namespace"] = pods.namespace
    if labels:
        metadata["labels"] = labels
    return metadata


def _resources(pods: Pods) -> dict:
    limits: dict = {}
    requests: dict = {}
    if pods.gpus_per_node:
        limits["nvidia.com/gpu"] = pods.gpus_per_node
    if pods.cpus_per_node:
        requests["cpu"] = pods.cpus_per_node
    if pods.memory_per_node:
        requests["memory"] = limits["memory"] = pods.memory_per_node
    return {key: value for key, value in (("limits", limits), ("requests", requests)) if value}


def _shm_volume(pods: Pods) -> dict:
    return {"name": SHM, "emptyDir": {"medium": "Memory", "sizeLimit": pods.shm_size}}


SHM_MOUNT = {"name": SHM, "mountPath": "/dev/shm"}


def _container(pods: Pods, name: str, command: list[str], env: list[dict], port: int) -> dict:
    container = {"name": name, "image": pods.image, "command": command,
                 "ports": [{"name": "ddpkit", "containerPort": port}], "volumeMounts": [SHM_MOUNT]}
    if env:
        container["env"] = env
    resources = _resources(pods)
    if resources:
        container["resources"] = resources
    return container


def trainjob(pods: Pods, command: list[str], nodes: int, nproc: str, env: list[dict]) -> dict:
    """A Kubeflow Trainer ``TrainJob`` on the ``torch-distributed`` runtime; ``/dev/shm`` through its runtime patch."""
    trainer: dict = {"image": pods.image, "command": command, "numNodes": nodes}
    if env:
        trainer["env"] = env
    if nproc != "auto":
        trainer["numProcPerNode"] = int(nproc)
    resources = _resources(pods)
    if resources:
        trainer["resourcesPerNode"] = resources
    pod_spec = {"volumes": [_shm_volume(pods)], "containers": [{"name": "node", "volumeMounts": [SHM_MOUNT]}]}
    patch = {"manager": "ddpkit", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": pod_spec}}}}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(pods, pods.name),
            "spec": {"runtimeRef": {"name": TRAINJOB_RUNTIME}, "trainer": trainer, "runtimePatches": [patch]}}


def pytorchjob(pods: Pods, command: list[str], env: list[dict], nodes: int, min_nodes: int | None, nproc: str,
               max_restarts: int) -> dict:
    """A Kubeflow ``PyTorchJob`` (training-operator v1): a Master and N-1 Workers, or, elastic, MIN..MAX Workers."""
    restart = "OnFailure" if max_restarts else "Never"

    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": restart, "template": {"spec": {
            "containers": [_container(pods, "pytorch", command, env, PYTORCHJOB_PORT)],
            "volumes": [_shm_volume(pods)]}}}

    spec: dict = {"nprocPerNode": nproc, "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": max_restarts}}
    if min_nodes is not None:
        spec["elasticPolicy"] = {"minReplicas": min_nodes, "maxReplicas": nodes, "rdzvBackend": "c10d",
                                 "maxRestarts": max_restarts}
        spec["pytorchReplicaSpecs"] = {"Worker": replica(nodes)}
    else:
        spec["pytorchReplicaSpecs"] = {"Master": replica(1), **({"Worker": replica(nodes - 1)} if nodes > 1 else {})}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(pods, pods.name),
            "spec": spec}


def indexed_job(pods: Pods, command: list[str], env: list[dict], nodes: int, max_restarts: int) -> list[dict]:
    """A headless Service and an Indexed Job of ``nodes`` pods whose subdomain it is: pod 0 is
    ``NAME-0.NAME``. A pod that fails fails the job after ``max_restarts`` retries (the others end with it through
    ddpkit's own timeouts), and the Job starts it again."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(pods, pods.name),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": pods.name},
                        "ports": [{"name": "ddpkit", "port": INDEXED_PORT}]}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(pods, pods.name),
           "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                    "backoffLimit": max_restarts, "template": {"spec": {
                        "subdomain": pods.name, "restartPolicy": "Never",
                        "containers": [_container(pods, "ddpkit", command, env, INDEXED_PORT)],
                        "volumes": [_shm_volume(pods)]}}}}
    return [service, job]


def lighthouse(pods: Pods, min_replicas: int) -> list[dict]:
    """torchft's lighthouse for ``--replica-groups``, as a Deployment of one pod and a Service in front of it."""
    name = f"{pods.name}-lighthouse"
    labels = {"app.kubernetes.io/name": name}
    container = {"name": "lighthouse", "image": pods.image,
                 "command": ["torchft_lighthouse", "--min_replicas", str(min_replicas), "--bind",
                             f"[::]:{LIGHTHOUSE_PORT}"],
                 "ports": [{"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT}]}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(pods, name, **labels),
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(pods, name, **labels),
               "spec": {"selector": labels, "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT}]}}
    return [deployment, service]


def render(objects: Sequence[dict]) -> str:
    """The objects as a YAML stream that ``kubectl apply -f -`` reads: each a JSON document, ``---`` between."""
    return "---\n".join(json.dumps(item, indent=2) + "\n" for item in objects)
