"""What ddpkit reads where a platform started a node of a job (ddpkit.core.platforms): a Kubeflow TrainJob's or
PyTorchJob's pod, an Indexed Job's, a SkyPilot or dstack node. Pure functions, tested in-process with each platform's
variables as its own code sets them (docs/kubernetes.md cites where); the pods themselves, in network namespaces,
train in tests/test_multinode.py."""

from __future__ import annotations

import pytest

from ddpkit.app import doctor
from ddpkit.app.cli import main
from ddpkit.core import env as env_mod
from ddpkit.core.platforms import LaunchFlags, PlatformError, merge, read_platform

TRAINJOB = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "3",
            "PET_MASTER_ADDR": "llm-node-0-0.llm", "PET_MASTER_PORT": "29500", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# training-operator v1.9: a Master and 2 Workers, nprocPerNode defaulted to "auto" (WORLD_SIZE counts it as 1).
PYTORCHJOB = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456", "MASTER_ADDR": "pt-master-0",
              "PET_MASTER_ADDR": "pt-master-0", "WORLD_SIZE": "3", "RANK": "2", "PET_NODE_RANK": "2",
              "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "3", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
PYTORCHJOB_ELASTIC = {"PET_NPROC_PER_NODE": "2", "PET_RDZV_ENDPOINT": "pt-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
                      "PET_NNODES": "2:4", "PET_MAX_RESTARTS": "3", "PET_RDZV_ID": "pt"}
SKYPILOT = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8"}
DSTACK = {"DSTACK_NODE_RANK": "0", "DSTACK_NODES_NUM": "2", "DSTACK_MASTER_NODE_IP": "10.1.0.2",
          "DSTACK_NODES_IPS": "10.1.0.2\n10.1.0.3", "DSTACK_GPUS_PER_NODE": "4", "DSTACK_GPUS_NUM": "8"}
INDEXED_FQDN = "train-2.train.default.svc.cluster.local"


@pytest.mark.parametrize("environ, nnodes, fqdn, expected", [
    (TRAINJOB, 1, "", ("Kubeflow TrainJob", "4", 3, "llm-node-0-0.llm", 29500, "8", None)),
    (PYTORCHJOB, 1, "", ("Kubeflow PyTorchJob", "3", 2, "pt-master-0", 23456, "auto", None)),
    (PYTORCHJOB_ELASTIC, 1, "", ("Kubeflow PyTorchJob", "2:4", None, None, None, "2", "pt-worker-0:23456")),
    (SKYPILOT, 1, "", ("SkyPilot", "2", 1, "10.0.0.5", None, "8", None)),
    (DSTACK, 1, "", ("dstack", "2", 0, "10.1.0.2", None, "4", None)),
    ({"JOB_COMPLETION_INDEX": "2"}, 3, INDEXED_FQDN,
     ("Kubernetes Indexed Job", "3", 2, "train-0.train.default.svc.cluster.local", None, None, None)),
    # A JobSet's pod: <jobset>-<replicated job>-<job index>-<pod index>, its subdomain the JobSet's name.
    ({"JOB_COMPLETION_INDEX": "1"}, 2, "js-node-0-1.js",
     ("Kubernetes Indexed Job", "2", 1, "js-node-0-0.js", None, None, None)),
], ids=["trainjob", "pytorchjob", "pytorchjob-elastic", "skypilot", "dstack", "indexed-job", "jobset"])
def test_each_platforms_variables_are_read_as_its_own_code_sets_them(environ, nnodes, fqdn, expected):
    shape = read_platform(environ, nnodes=nnodes, fqdn=fqdn)
    assert (shape.platform, shape.nnodes, shape.node_rank, shape.master_addr, shape.master_port,
            shape.nproc_per_node, shape.rdzv_endpoint) == expected
    assert all(name in environ or name == "hostname" for name in shape.read), shape.read


@pytest.mark.parametrize("environ", [
    {},
    {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "pt-master-0", "MASTER_PORT": "23456"},  # an older PyTorchJob
    {**TRAINJOB, "TORCHELASTIC_RUN_ID": "x"},  # one of torchrun's workers in that pod
    {"JOB_COMPLETION_INDEX": "3"},  # an Indexed Job of independent runs: --nnodes is 1
], ids=["nothing", "pytorchjob-classic", "torchrun-worker", "indexed-job-one-node"])
def test_nothing_is_read_where_no_platform_made_a_node(environ):
    assert read_platform(environ, fqdn="run-3.runs") is None


def test_a_pytorchjob_pod_is_a_node_to_launch_on_and_an_older_operators_pod_is_one_rank():
    assert not env_mod.is_launched(PYTORCHJOB)  # its RANK=2 and WORLD_SIZE=3 are the node's and the job's
    assert env_mod.detect(PYTORCHJOB).world_size == 1
    classic = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "pt-master-0", "MASTER_PORT": "23456"}
    assert env_mod.is_launched(classic) and env_mod.detect(classic).rank == 1
    # torchrun's workers inherit the pod's PET_ variables: they are ranks.
    worker = {**PYTORCHJOB, "TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}
    assert env_mod.is_launched(worker) and env_mod.detect(worker).rank == 5


@pytest.mark.parametrize("environ, nnodes, fqdn, message", [
    ({**TRAINJOB, "PET_NODE_RANK": "4"}, 1, "", "PET_NODE_RANK=4 but PET_NNODES=4 says 4 node(s): a node's rank is 0..3"),
    ({key: value for key, value in TRAINJOB.items() if key != "PET_MASTER_ADDR"}, 1, "",
     "PET_MASTER_ADDR is not set, and PET_NNODES=4 nodes must find node 0"),
    ({**TRAINJOB, "PET_NNODES": "two"}, 1, "", "PET_NNODES='two' is neither a number of nodes nor MIN:MAX"),
    ({**TRAINJOB, "PET_NPROC_PER_NODE": "many"}, 1, "", "PET_NPROC_PER_NODE='many': expected a number, auto, gpu or cpu"),
    ({**TRAINJOB, "PET_MASTER_PORT": "70000"}, 1, "", "PET_MASTER_PORT=70000 is not a port"),
    ({**PYTORCHJOB_ELASTIC, "PET_RDZV_BACKEND": "etcd"}, 1, "", "PET_RDZV_BACKEND=etcd: ddpkit's elastic rendezvous"),
    ({key: value for key, value in PYTORCHJOB_ELASTIC.items() if key != "PET_RDZV_ENDPOINT"}, 1, "",
     "PET_NNODES=2:4 lets the job grow and shrink, which needs a rendezvous"),
    ({**SKYPILOT, "SKYPILOT_NODE_RANK": "2"}, 1, "", "SKYPILOT_NODE_RANK=2 but SKYPILOT_NUM_NODES=2 says 2 node(s)"),
    ({**SKYPILOT, "SKYPILOT_NODE_IPS": "10.0.0.5"}, 1, "", "SKYPILOT_NODE_IPS lists 1 address(es) but SKYPILOT_NUM_NODES=2"),
    ({**DSTACK, "DSTACK_MASTER_NODE_IP": "", "DSTACK_NODES_IPS": ""}, 1, "", "DSTACK_MASTER_NODE_IP is not set"),
    ({"JOB_COMPLETION_INDEX": "3"}, 3, "train-3.train", "JOB_COMPLETION_INDEX=3 but --nnodes 3 says 3 node(s)"),
    ({"JOB_COMPLETION_INDEX": "1"}, 2, "train-1", "has no DNS name through which the others reach pod 0"),
    ({"JOB_COMPLETION_INDEX": "1"}, 2, "laptop.lan", "host name laptop does not end in -1"),
    ({**DSTACK, "DSTACK_NODES_NUM": "0"}, 1, "", "DSTACK_NODES_NUM=0: a job has at least one node"),
], ids=["rank-beyond-nodes", "no-master", "nnodes-not-a-number", "nproc-not-a-number", "port", "etcd",
        "elastic-without-endpoint", "skypilot-rank", "skypilot-ips", "dstack-master", "index-beyond-nodes",
        "no-subdomain", "not-an-indexed-pod", "no-nodes"])
def test_variables_that_cannot_be_right_name_the_variable(environ, nnodes, fqdn, message):
    with pytest.raises(PlatformError) as raised:
        read_platform(environ, nnodes=nnodes, fqdn=fqdn)
    assert message in str(raised.value)


def test_flags_fill_in_or_override_and_a_contradiction_is_an_error():
    trainjob = read_platform(TRAINJOB)
    assert merge(trainjob, LaunchFlags(), gpus=8, cpus=64) == LaunchFlags(
        nnodes="4", node_rank=3, master_addr="llm-node-0-0.llm", master_port=29500, nproc_per_node="8")
    # --nproc-per-node, --master-addr/--master-port and --max-restarts override; the same --nnodes agrees.
    mine = LaunchFlags(nnodes="4", nproc_per_node="4", master_addr="10.0.0.1", master_port=29600, max_restarts=2)
    assert merge(trainjob, mine, gpus=8, cpus=64) == LaunchFlags(
        nnodes="4", node_rank=3, master_addr="10.0.0.1", master_port=29600, nproc_per_node="4", max_restarts=2)
    elastic_fixed = read_platform({**PYTORCHJOB_ELASTIC, "PET_NNODES": "2:2"})
    assert merge(elastic_fixed, LaunchFlags(nnodes="2"), gpus=0, cpus=8).nnodes == "2:2"  # the same two nodes
    with pytest.raises(PlatformError, match=r"--nnodes 2, but Kubeflow TrainJob says 4 node\(s\) \(PET_NNODES=4\)"):
        merge(trainjob, LaunchFlags(nnodes="2"), gpus=8, cpus=64)
    with pytest.raises(PlatformError, match=r"--node-rank 1, but Kubeflow TrainJob says this is node 3 "
                                            r"\(PET_NODE_RANK=3\)"):
        merge(trainjob, LaunchFlags(node_rank=1), gpus=8, cpus=64)
    # A PyTorchJob's "auto": one per GPU where there are GPUs, else the one per pod its WORLD_SIZE counted.
    pytorchjob = read_platform(PYTORCHJOB)
    assert merge(pytorchjob, LaunchFlags(), gpus=0, cpus=8).nproc_per_node == "1"
    assert merge(pytorchjob, LaunchFlags(), gpus=4, cpus=8).nproc_per_node == "auto"
    assert merge(read_platform({**TRAINJOB, "PET_NPROC_PER_NODE": "cpu"}), LaunchFlags(), gpus=0,
                 cpus=6).nproc_per_node == "6"
    elastic = merge(read_platform(PYTORCHJOB_ELASTIC), LaunchFlags(), gpus=0, cpus=8)
    assert elastic == LaunchFlags(nnodes="2:4", nproc_per_node="2", rdzv_endpoint="pt-worker-0:23456", rdzv_id="pt",
                                  max_restarts=3)


@pytest.mark.parametrize("argv, environ, message", [
    (["train"], {**TRAINJOB, "PET_NODE_RANK": "7"}, "this node's platform variables: PET_NODE_RANK=7 but PET_NNODES=4"),
    (["train", "--nnodes", "2"], TRAINJOB, "--nnodes 2, but Kubeflow TrainJob says 4 node(s) (PET_NNODES=4): drop"),
    (["run", "examples/ddp_demo.py"], {**SKYPILOT, "SKYPILOT_NUM_NODES": "3"},
     "SKYPILOT_NODE_IPS lists 2 address(es) but SKYPILOT_NUM_NODES=3"),
    (["train", "--nnodes", "2"], {"JOB_COMPLETION_INDEX": "5"}, "JOB_COMPLETION_INDEX=5 but --nnodes 2 says 2 node(s)"),
], ids=["train-rank", "train-nnodes", "run-skypilot", "indexed-job"])
def test_a_pod_whose_variables_disagree_is_one_line_and_status_2(argv, environ, message, monkeypatch, capsys,
                                                                  tmp_path):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if argv[0] == "train":
        argv = [*argv, "--output-dir", str(tmp_path / "run")]
    else:
        monkeypatch.chdir(__import__("conftest").REPO)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddpkit: error: ") and message in err, err


def test_doctor_names_the_platform_and_what_it_read():
    found = doctor.platform_of(TRAINJOB)
    assert found["platform"] == "Kubeflow TrainJob" and found["node_rank"] == 3 and found["nnodes"] == "4"
    assert doctor.platform_line(found).startswith("platform: Kubeflow TrainJob: node 3 of 4, master "
                                                  "llm-node-0-0.llm:29500, 8 process(es) per node (PET_NNODES=4, ")
    classic = doctor.platform_of({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RANK": "1", "WORLD_SIZE": "2",
                                  "MASTER_ADDR": "pt-master-0", "MASTER_PORT": "23456"})
    assert classic["platform"] == "Kubernetes pod" and "one rank per pod" in classic["line"]
    assert doctor.platform_of({"JOB_COMPLETION_INDEX": "0"}, fqdn="train-0.train")["master"] == "train-0.train"
    assert doctor.platform_line(doctor.platform_of({**SKYPILOT, "SKYPILOT_NODE_RANK": "9"})).startswith(
        "platform: its variables cannot be read: SKYPILOT_NODE_RANK=9")
    assert doctor.platform_of({}) is None
