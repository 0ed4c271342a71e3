"""Two "nodes" on one machine: network namespaces joined by a veth pair, one ddpkit launcher in each.

Each node is a network namespace with its own address (10.231.0.1 and .2) and, through ``unshare --uts``,
its own hostname (node-a, node-b); both namespaces' /etc/hosts (``ip netns exec`` mounts
/etc/netns/NAME/hosts over it) name both nodes, as a cluster's DNS would. torchrun's c10d rendezvous
finds by its hostname which node hosts the store and tells the workers node 0's name; gloo picks its
interface from the hostname's address. Needs root (to make namespaces); skipped, saying so, elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import DIGITS_CONVNET, every_sample_once, max_relative_difference, warm_python, warm_ranks_env
from listening import listening
from nodes import SUBNET, ip as _ip, make_nodes as _make_nodes, run_on_nodes as _run_on_nodes
import warm_ranks

RUN = [*DIGITS_CONVNET, "--no-progress"]  # the job of conftest's shared 2-process run


@pytest.fixture
def two_nodes():
    """[(namespace, hostname), (namespace, hostname)], torn down afterwards whatever happened."""
    yield from _make_nodes(own_name_loopback=False)


@pytest.fixture
def two_nodes_named_loopback():
    """The same two nodes, but each one's /etc/hosts maps its own name to 127.0.1.1 (as Debian and Ubuntu
    install it, and many cloud images do) and the other's to its address."""
    yield from _make_nodes(own_name_loopback=True)


@pytest.fixture(scope="module")
def single_node(ddp_digits):
    """The same job as 2 processes on one node (conftest's shared run): what the two nodes must reproduce."""
    _, state, rows, result = ddp_digits
    return state, rows, result


def test_nccl_settings_are_said_once_and_recorded(single_node):
    _, rows, result = single_node
    # A later value wins; the preset adds its variable; said by the launcher, not again by the workers.
    assert result.stderr.count("ddpkit: NCCL settings:") == 1
    assert "ddpkit: NCCL settings: NCCL_ALGO=Tree NCCL_IB_DISABLE=1" in result.stderr
    # What rank 0 had in effect (the workers inherit the launcher's environment); the machine may set more.
    recorded = rows[-1]["nccl"]
    assert recorded["NCCL_ALGO"] == "Tree" and recorded["NCCL_IB_DISABLE"] == "1"


def _check(results, tmp_path: Path, single_node) -> None:
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank0]: ddpkit: 2 process(es) via torchrun" in "".join(result.stderr for result in results)
    # Only global rank 0 writes, on whichever node the rendezvous made node 0.
    written = [tmp_path / node / "model.pt" for node in ("node0", "node1") if (tmp_path / node / "model.pt").exists()]
    assert len(written) == 1
    assert max_relative_difference(torch.load(written[0], weights_only=True), single_node[0]) <= 1e-6


def _rendezvous_listeners(port: int, found: list) -> Callable[[list[subprocess.Popen]], None]:
    """For ``meanwhile``: where node a's launcher listens once its rendezvous store is up, into ``found``."""
    def watch(procs: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and procs[0].poll() is None:
            with contextlib.suppress(OSError):  # still `ip netns exec` or `sh`, or gone meanwhile
                if b"ddpkit" in Path(f"/proc/{procs[0].pid}/cmdline").read_bytes():
                    seen = listening(warm_ranks.worker_of(procs[0].pid))  # the launcher, started warm
                    if any(listened == port for _, listened in seen):
                        found.append(seen)
                        return
            time.sleep(0.05)
    return watch


def test_two_nodes_through_the_c10d_rendezvous_train_like_one_node(tmp_path, two_nodes, single_node):
    (a, host_a), (b, host_b) = two_nodes
    # The same command on both nodes, as on a cluster; the endpoint names node a, so it hosts the rendezvous.
    common = [sys.executable, "-m", "ddpkit", "train", *RUN, "--nproc-per-node", "1", "--nnodes", "2",
              "--rdzv-endpoint", f"{host_a}:29611", "--rdzv-id", "test"]
    found = []
    results = _run_on_nodes([(a, host_a, [*common, "--output-dir", str(tmp_path / "node0")]),
                             (b, host_b, [*common, "--output-dir", str(tmp_path / "node1")])], timeout=180,
                            meanwhile=_rendezvous_listeners(29611, found))
    _check(results, tmp_path, single_node)
    # Node a's rendezvous store listens on the endpoint's address only, not on every interface.
    assert found == [{(f"{SUBNET}.1", 29611)}]


def test_two_nodes_with_static_ranks_and_names_that_resolve_to_loopback_train_like_one_node(
        tmp_path, two_nodes_named_loopback, single_node):
    # gloo would advertise 127.0.1.1 to the other node: node 0 failed ("connectFullMesh failed ...
    # remote=[127.0.0.1]") and node 1 hung until killed. Each launcher sets GLOO_SOCKET_IFNAME instead.
    # (The c10d test above has nodes whose names resolve to their addresses, as a cluster's DNS gives.)
    (a, host_a), (b, host_b) = two_nodes_named_loopback
    common = [sys.executable, "-m", "ddpkit", "train", *RUN, "--nproc-per-node", "1", "--nnodes", "2",
              "--master-addr", f"{SUBNET}.1", "--master-port", "29612"]
    found = []
    results = _run_on_nodes([(a, host_a, [*common, "--node-rank", "0", "--output-dir", str(tmp_path / "node0")]),
                             (b, host_b, [*common, "--node-rank", "1", "--output-dir", str(tmp_path / "node1")])],
                            timeout=180, meanwhile=_rendezvous_listeners(29612, found))
    _check(results, tmp_path, single_node)
    # Node 0's store (the rendezvous', which the workers share under a static launch) listens on the master
    # address only.
    assert found == [{(f"{SUBNET}.1", 29612)}]
    for result, host, address in zip(results, (host_a, host_b), (f"{SUBNET}.1", f"{SUBNET}.2")):
        assert (f"ddpkit: this machine's name {host} resolves to 127.0.1.1, a loopback address, which gloo would "
                f"advertise to the other nodes: using GLOO_SOCKET_IFNAME=v") in result.stderr, result.stderr
        assert f" ({address}), the interface that reaches {SUBNET}.1" in result.stderr


# torchrun's own client would retry for its whole timeout (static), or a minute past it (c10d), printing C++
# stack traces; a node other than the master's names what it cannot reach once --rdzv-timeout has passed.
@pytest.mark.parametrize("flags, error", [
    (["--node-rank", "1", "--master-addr", "10.232.0.1"],  # no route there
     "ddpkit: error: node 0 at 10.232.0.1:29500 did not answer in 5 s (last try: Network is unreachable); check "
     "--master-addr and --master-port"),
    (["--rdzv-endpoint", "10.232.0.1:29400"],
     "ddpkit: error: the rendezvous endpoint at 10.232.0.1:29400 did not answer in 5 s (last try: Network is "
     "unreachable); check --rdzv-endpoint, that the node it names has started"),
], ids=["static", "c10d"])
def test_a_node_whose_master_is_unreachable_ends_in_one_line_within_the_rendezvous_timeout(tmp_path, two_nodes,
                                                                                          flags, error):
    (_, _), (node_b, host_b) = two_nodes
    started = time.monotonic()
    [result] = _run_on_nodes([(node_b, host_b, [sys.executable, "-m", "ddpkit", "train", *RUN, "--nnodes", "2",
                                                *flags, "--rdzv-timeout", "5", "--output-dir", str(tmp_path / "b")])],
                             timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert error in result.stderr
    assert "Traceback" not in result.stderr and "frame #" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) <= 3, result.stderr
    assert took < 30, f"took {took:.0f} s"


def test_a_node_named_loopback_with_several_interfaces_and_no_route_says_which_to_set(tmp_path):
    """No route to node 0 tells the interfaces apart: one line naming them, exit 2, before anything starts."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, iproute2's `ip` and util-linux's `unshare` (a network namespace of its own)")
    name = f"ddpk{uuid.uuid4().hex[:6]}c"
    try:
        _ip("netns", "add", name)
        (Path("/etc/netns") / name).mkdir(parents=True, exist_ok=True)
        (Path("/etc/netns") / name / "hosts").write_text("127.0.0.1 localhost\n127.0.1.1 node-c\n")
        _ip("-n", name, "link", "add", "eth1", "type", "veth", "peer", "name", "eth2")  # two interfaces
        for index in (1, 2):
            _ip("-n", name, "addr", "add", f"10.24{index}.0.5/24", "dev", f"eth{index}")
            _ip("-n", name, "link", "set", f"eth{index}", "up")
        env = warm_ranks_env()  # its Python forked from a warm interpreter, in the namespace (tests/warm_ranks.py)
        argv = [sys.executable, "-m", "ddpkit", "train", *RUN, "--nnodes", "2", "--node-rank", "1",
                "--master-addr", "10.250.0.1", "--output-dir", str(tmp_path)]
        result = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c",
                                 'hostname node-c && exec "$@"', "node", *warm_python(argv, env)],
                                env=env, capture_output=True, text=True, timeout=60)
        # With one interface besides loopback, the node that is the rendezvous host itself (its own name, which
        # resolves to loopback here) takes that one.
        _ip("-n", name, "addr", "del", "10.242.0.5/24", "dev", "eth2")
        chosen = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c",
                                 'hostname node-c && exec "$@"', "node", *warm_python([sys.executable, "-c",
                                 "from ddpkit.core import network; print(network.gloo_interface('node-c'))"], env)],
                                env=env, capture_output=True, text=True, timeout=60)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "delete", name)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        "ddpkit: error: this machine's name node-c resolves to 127.0.1.1, a loopback address, which gloo would "
        "advertise to the other nodes; set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) to the interface "
        "that reaches them (this machine's: eth1 (10.241.0.5), eth2 (10.242.0.5))\n")
    assert chosen.stdout == "('eth1', '10.241.0.5')\n", chosen.stdout + chosen.stderr


def _cut(namespace: str) -> None:
    """Drop every packet this node sends to the other, silently (no refusal, no unreachable): a partition."""
    links = subprocess.run(["ip", "-n", namespace, "-o", "link", "show", "type", "veth"], check=True,
                           capture_output=True, text=True, timeout=30).stdout
    veth = links.split(":")[1].strip().split("@")[0]
    cut = subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", veth, "root", "blackhole"],
                         capture_output=True, text=True, timeout=30)
    if cut.returncode != 0:
        pytest.skip(f"cannot cut the link between the nodes (tc's blackhole qdisc): {cut.stderr.strip()}")


@pytest.mark.slow
def test_a_partition_between_two_nodes_ends_both_within_a_minute_each_saying_why(tmp_path, two_nodes):
    # Once a node held a worker for 480 s after a partition, and the node that stayed up blamed the wrong
    # side. Here each node has one rank; the link between them is cut after the first epoch.
    (a, host_a), (b, host_b) = two_nodes
    if shutil.which("tc") is None:
        pytest.skip("needs iproute2's `tc` (to cut the link between the nodes)")
    common = [sys.executable, "-m", "ddpkit", "train", *RUN, "--epochs", "100", "--nproc-per-node", "1", "--nnodes",
              "2", "--rdzv-endpoint", f"{host_a}:29613", "--rdzv-id", "test", "--timeout", "30", "--stall-timeout",
              "10"]
    cut_at = []

    def cut_after_an_epoch(_) -> None:
        deadline = time.monotonic() + 120
        while not any((tmp_path / node / "metrics.jsonl").exists() for node in ("node0", "node1")):
            assert time.monotonic() < deadline, "no epoch ended in 120 s"
            time.sleep(0.2)
        for namespace in (a, b):
            _cut(namespace)
        cut_at.append(time.monotonic())

    results = _run_on_nodes([(a, host_a, [*common, "--output-dir", str(tmp_path / "node0")]),
                             (b, host_b, [*common, "--output-dir", str(tmp_path / "node1")])],
                            timeout=180, meanwhile=cut_after_an_epoch)
    took = time.monotonic() - cut_at[0]
    assert took < 60, f"the nodes ended {took:.0f} s after the cut"
    outputs = [result.stderr for result in results]
    assert [result.returncode for result in results] == [1, 1], outputs
    # Rank 0's node names rank 1, and says a partition may be why; rank 1 finds its store unreachable.
    [(first, other)] = [(host, other) for host, other, out in ((host_a, host_b, outputs[0]), (host_b, host_a, outputs[1]))
                        if "[rank0]:" in out]
    stderr = "".join(outputs)
    assert (f"rank 1 (host {other}, pid " in stderr and f"or {other} can no longer reach this node (a network "
            f"partition, or {other} is down)") in stderr, stderr
    assert (f"rank 1 (host {other}) is cut off from the job's store at " in stderr
            and f"the network between {other} and {first} is cut (a partition), or {first} is down" in stderr), stderr
    assert "Traceback" not in stderr, stderr


def test_a_dead_node_ends_the_other_in_seconds_with_one_line(tmp_path, two_nodes):
    # Node b's launcher and rank killed at once (SIGKILL), its kernel still up: its connections are reset,
    # and node a's rank learns it in its next collective (a powered-off node is the partition case above).
    (a, host_a), (b, host_b) = two_nodes
    common = [sys.executable, "-m", "ddpkit", "train", *RUN, "--epochs", "100", "--nproc-per-node", "1", "--nnodes",
              "2", "--master-addr", host_a, "--master-port", "29614", "--checkpoint-every", "5"]
    killed_at = []

    def kill_node_b_after_an_epoch(procs) -> None:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "node0" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n")):  # the file is made before the epoch
            assert time.monotonic() < deadline, "no epoch ended in 120 s"
            time.sleep(0.2)
        node_b = _pids_running(str(tmp_path / "node1"))
        assert procs[1].pid in node_b and len(node_b) >= 2, node_b  # its launcher and its rank
        for pid in node_b:
            os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    results = _run_on_nodes([(a, host_a, [*common, "--node-rank", "0", "--output-dir", str(tmp_path / "node0")]),
                             (b, host_b, [*common, "--node-rank", "1", "--output-dir", str(tmp_path / "node1")])],
                            timeout=150, meanwhile=kill_node_b_after_an_epoch)
    took = time.monotonic() - killed_at[0]
    node_a = results[0]
    assert node_a.returncode == 1 and results[1].returncode == -signal.SIGKILL, node_a.stderr
    assert took < 30, f"node a ended {took:.0f} s after node b died"
    # gloo reads a reset or an end of stream, depending on where its thread was when the peer died.
    said = re.findall(r"\[rank0\]: ddpkit: error: a collective failed: another rank's connection went away "
                      r"\(Connection (?:reset|closed) by peer, from 10\.231\.0\.2:\d+\)", node_a.stderr)
    assert len(said) == 1, node_a.stderr
    assert "Traceback" not in node_a.stderr and "rank 0 (pid " in node_a.stderr
    kept = sorted(str(path.relative_to(tmp_path)) for path in (tmp_path / "node0").rglob("*"))
    assert "node0/checkpoints/latest" in kept, (kept, node_a.stderr)  # what it trained before is kept


def _pids_running(argument: str) -> list[int]:
    """The processes whose command line holds ``argument``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def test_two_nodes_read_every_sample_of_a_folder_and_a_pack_once_per_epoch(tmp_path, two_nodes, one_image_per_class):
    # The folder through the script's own DataLoader (job.prepare), the pack through job.train_loader. One process
    # per node, started as a cluster's scheduler would (torchrun's variables; ddpkit's launcher across nodes is
    # tested above): the data, not the launch, is under test, at half the processes.
    root = one_image_per_class
    script = [str(root / "ranks.py"), str(tmp_path / "seen"), f"folder:{root / 'jpegs'}", f"shards:{root / 'packed'}"]
    results = _run_on_nodes([(name, host, ["env", f"RANK={rank}", "LOCAL_RANK=0", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=1",
                                           f"MASTER_ADDR={SUBNET}.1", "MASTER_PORT=29613", sys.executable, *script])
                             for rank, (name, host) in enumerate(two_nodes)], timeout=120)
    assert all(result.returncode == 0 for result in results), [result.stderr for result in results]
    every_sample_once(tmp_path / "seen.folder")
    every_sample_once(tmp_path / "seen.shards")


# Two pods of one job, each given the variables its operator injects (ddpkit.core.platforms and docs/kubernetes.md
# say where each is set), its host name and the names a pod's /etc/hosts and a cluster's DNS give (both in its
# /etc/hosts: its fully qualified name first, as Kubernetes writes it), and each running
# the container command that `ddpkit manifest` writes for that operator: (the manifest's kind, host names, names in
# /etc/hosts, each pod's variables, the platform doctor names).
KUBERNETES = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}  # in every pod
PODS = {
    # Kubeflow Trainer v2.3's torch runtime, TrainJob "train": numNodes 2, numProcPerNode 1.
    "trainjob": ("trainjob", ("train-node-0-0", "train-node-0-1"),
                 (("train-node-0-0.train", "train-node-0-0"), ("train-node-0-1.train", "train-node-0-1")),
                 [{"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node),
                   "PET_MASTER_ADDR": "train-node-0-0.train", "PET_MASTER_PORT": "29500"} for node in (0, 1)],
                 "Kubeflow TrainJob"),
    # training-operator v1.9's PyTorchJob "train": a Master and a Worker, nprocPerNode "1".
    "pytorchjob": ("pytorchjob", ("train-master-0", "train-worker-0"), (("train-master-0",), ("train-worker-0",)),
                   [{"PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456",
                     "MASTER_ADDR": "train-master-0", "PET_MASTER_ADDR": "train-master-0", "WORLD_SIZE": "2",
                     "RANK": str(node), "PET_NODE_RANK": str(node), "PET_NPROC_PER_NODE": "1", "PET_NNODES": "2"}
                    for node in (0, 1)], "Kubeflow PyTorchJob"),
    # The same with elasticPolicy (minReplicas = maxReplicas = 2): two Workers, numbered at the c10d rendezvous.
    "pytorchjob-elastic": ("pytorchjob", ("train-worker-0", "train-worker-1"),
                           (("train-worker-0",), ("train-worker-1",)),
                           [{"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "1", "PET_RDZV_ENDPOINT": "train-worker-0:23456",
                             "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2:2"} for _ in (0, 1)], "Kubeflow PyTorchJob"),
    # An older operator's PyTorchJob: torchrun's four names only; each pod is one rank.
    "pytorchjob-classic": ("pytorchjob", ("train-master-0", "train-worker-0"), (("train-master-0",), ("train-worker-0",)),
                           [{"MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2",
                             "RANK": str(node)} for node in (0, 1)], "Kubernetes pod"),
    # An Indexed Job "train" of 2 pods whose subdomain is the headless Service "train".
    "indexed-job": ("indexed-job", ("train-0", "train-1"), (("train-0.train.default.svc.cluster.local", "train-0"),
                                                            ("train-1.train.default.svc.cluster.local", "train-1")),
                    [{"JOB_COMPLETION_INDEX": str(node)} for node in (0, 1)], "Kubernetes Indexed Job"),
}


def _container_command(kind: str) -> list[str]:
    """The container command of ``ddpkit manifest KIND`` for the 2-node job of RUN, one process per node."""
    from ddpkit.app.manifests import Pods, build

    objects = build(kind, ["train", *RUN, "--nnodes", "2", "--nproc-per-node", "1", "--output-dir", "out"],
                    Pods(image="ddpkit", name="train"))
    job = objects[-1]["spec"]
    if kind == "trainjob":
        return job["trainer"]["command"]
    template = job["pytorchReplicaSpecs"]["Master"]["template"] if kind == "pytorchjob" else job["template"]
    return template["spec"]["containers"][0]["command"]


@pytest.mark.parametrize("platform", list(PODS))
def test_the_same_command_in_two_pods_trains_like_one_node(tmp_path, single_node, platform):
    kind, hosts, names, variables, named = PODS[platform]
    command = _container_command(kind)
    assert command[:2] == ["ddpkit", "train"] and ("--nnodes" in command) == (kind == "indexed-job"), command
    folders = [tmp_path / "pod0", tmp_path / "pod1"]  # each pod's own working folder: the same relative --output-dir
    for folder in folders:
        folder.mkdir()

    def in_pods(*argv: str) -> list[list[str]]:
        return [["env", "-C", str(folder), *(f"{key}={value}" for key, value in {**KUBERNETES, **pod}.items()),
                 sys.executable, "-m", *argv] for folder, pod in zip(folders, variables)]

    with contextlib.contextmanager(_make_nodes)(names=names) as nodes:
        results = _run_on_nodes([(name, host, argv) for (name, _), host, argv in zip(nodes, hosts, in_pods(*command))],
                                timeout=180)
        reports = _run_on_nodes([(name, host, argv) for (name, _), host, argv in
                                 zip(nodes, hosts, in_pods("ddpkit", "doctor", "--json", "-"))], timeout=60)
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    said = "".join(result.stderr for result in results)
    if platform != "pytorchjob-classic":  # there each pod is one rank already: nothing to launch
        assert said.count(f"ddpkit: launching as a node of a job that {named}: ") == 2, said
    # Only global rank 0 writes: in pod 0, or, elastic, in the pod the rendezvous made node 0.
    (written,) = [folder / "out" / "model.pt" for folder in folders if (folder / "out" / "model.pt").exists()]
    assert written.parent.parent == folders[0] or platform == "pytorchjob-elastic"
    assert max_relative_difference(torch.load(written, weights_only=True), single_node[0]) <= 1e-6
    for node, report in enumerate(reports):
        assert report.returncode == 0, report.stdout + report.stderr
        if platform == "pytorchjob-classic" and node == 1:
            # Each pod is a rank already: doctor checks the two ranks' connection, and rank 0 reports for both.
            assert report.stdout == "" and json.loads(reports[0].stdout)["connectivity"]["world_size"] == 2
            continue
        found = json.loads(report.stdout)["platform"]
        assert found["platform"] == named, found
        assert found.get("node_rank", node) == (None if platform == "pytorchjob-elastic" else node), found
