"""ddpkit on a real Ray cluster (``ray start --head`` on this machine, shared by the module's tests): a Job script in
one's own ``TorchTrainer``, ``ddpkit run --launcher ray`` on a plain ``torch.distributed`` script and on a Job script,
and Ray's restart of a group whose worker was killed, resuming from ddpkit's checkpoint to the same weights.

Marked ``ray``: the default run leaves them out; .ci/run installs ``.[ray]`` and runs them with the slow tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch

import warm_ranks
from conftest import (MARKER_KEY, REPO, _pids_with, child_env, leftover_processes, run_command, run_ddpkit,
                      warm_python, warm_ranks_env)

pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="needs Ray Train: pip install -e '.[ray]' (.ci/run installs it)")]

LIBRARY_LOOP = str(REPO / "examples" / "library_loop.py")
# Ray turns token authentication on for a cluster `ray start` makes; one on loopback for a test needs none. Ray Train's
# preemption watcher and metrics are an actor and callbacks per run that these tests do not use: off, a fifth of a
# run's CPU time less.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
           "RAY_TRAIN_METRICS_ENABLED": "0"}
# bf16 autocast: the killed worker's run resumes under it to the bit (tests/test_library_loop.py resumes in fp32).
LOOP_ARGS = ["--epochs", "1", "--checkpoint-every", "4", "--keep-checkpoints", "20", "--amp", "bf16"]


def free_port() -> int:
    """A port the kernel picks (above Ray's own worker ports, 10002 to 19999)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RAY = os.path.join(os.path.dirname(sys.executable), "ray")



def ray_node(*args: str, cluster: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """``ray start --block ARGS`` (run through ``prefix``, a namespace's say), a node of the cluster whose head is at
    ``cluster``, once it says it started; its temp folder (short: Ray's socket paths must stay so) in ``.temp``, for
    ``stop_ray``. Its processes do not carry the session's marker (a cluster outlives each test, like the warm rank
    server): the tests check that no rank is left (``ranks_left``), and ``stop_ray`` that the node's processes are
    gone."""
    temp = tempfile.mkdtemp(prefix="ddpkit-ray-", dir="/tmp")
    # The ranks a Ray worker starts run warm (tests/warm_ranks.py: the node's PYTHON_EXEC, which --launcher ray uses
    # as torchrun's agent does): about 5 s of CPU less each. So does the node: `ray start` through the warm client,
    # whose Python (sys.executable) is the client too, starts Ray's own Python processes (its agents, a worker for
    # each of Ray Train's actors) forked from the server, torch imported (Ray itself is not: a process imports it
    # afresh, its native library's settings read from that process's environment).
    env = {key: value for key, value in warm_ranks_env(**RAY_ENV).items() if key != MARKER_KEY}
    # The node outlasts a test, on purpose; every process of it holds the variable, where Ray leaves it.
    env[warm_ranks.LASTING_VARIABLE] = temp
    # Where Ray's own code on the node asks no address (Ray Train's PlacementGroupCleaner, through Ray's state API),
    # Ray finds a cluster by the GCS processes it sees on the machine: two where test_ray_nodes.py's cluster runs on
    # another pytest worker ("Found multiple active Ray instances", a .ci/run at 5498dbd). Each node names its own.
    env["RAY_ADDRESS"] = cluster
    node = subprocess.Popen([*prefix, *warm_python([sys.executable, RAY], env), "start", "--block",
                             "--disable-usage-stats", "--temp-dir", temp, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    node.temp = temp  # type: ignore[attr-defined]
    said = []
    deadline = time.monotonic() + 90
    for line in node.stdout:
        said.append(line)
        if "Ray runtime started" in line:
            return node
        if time.monotonic() > deadline:
            break
    stop_ray(node)
    raise AssertionError(f"ray start {' '.join(args)} did not start:\n{''.join(said)}")


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster of 4 CPUs (more than the 2 cores: Ray counts slots, not cores), its address."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = ray_node("--head", "--port", str(port), "--num-cpus", "4", "--include-dashboard", "false", cluster=address)
    try:
        yield address
    finally:
        stop_ray(head)


def stop_ray(head: subprocess.Popen) -> None:
    """End ``ray start --block`` and every process of its node (Ray's daemons have sessions of their own:
    ``node_processes`` finds them), then check they are gone."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):  # `ray start --block` waits for its daemons
        for pid in [head.pid, *node_processes(head)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + grace
        while (head.poll() is None or node_processes(head)) and time.monotonic() < deadline:
            time.sleep(0.1)
    head.communicate()
    left = node_processes(head)
    subprocess.run(["rm", "-rf", head.temp], check=False)
    assert not left, f"the Ray node's processes were still running: {left}"


def node_processes(node: subprocess.Popen) -> list[int]:
    """The running processes of a node ``ray_node`` started: those whose command line names its temp folder, whose
    environment holds LASTING_VARIABLE=<its temp folder>, that have a file in its temp folder open, or that the warm
    rank server forked for it. Ray's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) rename themselves
    over both their command line and their environment, outlive a killed raylet and ignore SIGTERM: their open log
    files say whose they are. Never the warm rank server, which the whole pytest run shares: it holds a node's log
    files for a moment each time it forks one of the node's processes (the raylet's stdout and stderr are there)."""
    found = (set(processes_with(node.temp.encode())) | set(_pids_with(warm_ranks.LASTING_VARIABLE, node.temp))
             | set(processes_with_files_in(node.temp)) | set(warm_ranks.lasting(node.temp)))
    return sorted(found - {warm_ranks.server_pid(), os.getpid()})


def test_a_nodes_processes_are_never_the_shared_warm_rank_server():
    """``stop_ray`` kills what ``node_processes`` finds. The server that every test of the run shares holds a node's
    log files while it forks the node's processes, and killing it ends every warm rank of the run, other clusters'
    included: it is never one of a node's. Its own folder holds its log open and names it on its command line."""
    warm_ranks_env()
    server = warm_ranks.wait_until_serving()
    folder = str(Path(f"/proc/{server}/fd/2").readlink().parent)  # its stderr: server.log in its folder
    assert server in processes_with_files_in(folder) and server in processes_with(folder.encode())
    assert server not in node_processes(types.SimpleNamespace(temp=folder))


def processes_with_files_in(folder: str) -> list[int]:
    """The processes that have a file under ``folder`` open."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            open_files = (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
            if any(path.startswith(folder + "/") for path in open_files):
                found.append(int(pid))
        except OSError:
            continue
    return found


def processes_with(text: bytes, where: str = "cmdline") -> list[int]:
    """The processes whose command line (or environment) holds ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/{where}").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def ranks_left() -> list[int]:
    """Ranks that ``--launcher ray`` started (each holds the pipe variable) and that still run, after a short grace."""
    deadline = time.monotonic() + 10
    while processes_with(b"DDPKIT_RAY_REPORTS=", "environ") and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_with(b"DDPKIT_RAY_REPORTS=", "environ")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The Job script under ddpkit's own launcher, 2 processes: the weights every Ray run must reach."""
    out = tmp_path_factory.mktemp("reference")
    result = run_ddpkit("run", "--nproc-per-node", "2", LIBRARY_LOOP, *LOOP_ARGS, "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(out / "model.pt", weights_only=True), result.stdout


def on_ray(address: str, *args: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``ddpkit COMMAND --launcher ray --address ADDRESS ARGS``, the driver forked from a warm interpreter (its ranks,
    which the Ray workers start, are fresh)."""
    return run_command([sys.executable, "-m", "ddpkit", *args[:1], "--launcher", "ray", "--address", address,
                        *args[1:]], timeout=timeout, cwd=cwd, warm=True, **RAY_ENV)


def same_weights(state: dict, expected: dict, tolerance: float = 0.0) -> bool:
    return state.keys() == expected.keys() and all(
        (state[key] - expected[key]).abs().max().item() <= tolerance for key in expected)


TRAINER_DRIVER = """
import json, os, runpy, subprocess, sys
import ray
import ray.train
from ray.train import RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchTrainer

address, script, out, reports, storage = sys.argv[1:6]


def train_func(config):  # the script's loop as it is, in each Ray Train worker
    if ray.train.get_context().get_world_rank() == 1:  # what ddpkit doctor reads in a worker (started warm: the
        # test node's PYTHON_EXEC, tests/warm_ranks.py)
        subprocess.run([os.environ.get("PYTHON_EXEC", sys.executable), "-m", "ddpkit", "doctor", "--json",
                        config["doctor"]], check=True, stdout=subprocess.DEVNULL)
    sys.argv = [config["script"], *config["args"]]
    runpy.run_path(config["script"], run_name="__main__")


class Reports(UserCallback):  # what Ray Train's own tools see of each ray.train.report
    def __init__(self, path):
        self.path = path

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as handle:
            handle.write(json.dumps(metrics) + "\\n")


ray.init(address=address)
TorchTrainer(train_func, train_loop_config={"script": script, "args": [*sys.argv[6:], "--out", out],
                                            "doctor": out + ".doctor.json"},
             scaling_config=ScalingConfig(num_workers=2),
             run_config=RunConfig(name="job-in-torchtrainer", storage_path=storage, callbacks=[Reports(reports)])).fit()
"""


def test_a_job_script_in_a_torchtrainer_trains_as_under_ddpkit_run_and_reports_each_evaluation(
        ray_cluster, reference, tmp_path):
    expected, said = reference
    (tmp_path / "driver.py").write_text(TRAINER_DRIVER)
    reports = tmp_path / "reports.jsonl"
    result = run_command([sys.executable, str(tmp_path / "driver.py"), ray_cluster, LIBRARY_LOOP, str(tmp_path / "out"),
                          str(reports), str(tmp_path / "storage"), *LOOP_ARGS], timeout=180, warm=True, **RAY_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    # Ray's workers run torch on another number of threads than torchrun's ranks, and under bf16 autocast on torch 2.15
    # the convolution's weight gradient depends on it: 1.07e-5 between 1 and 2 threads under ddpkit run alone (the
    # other tensors equal); the tolerance is ten times that.
    assert same_weights(torch.load(tmp_path / "out" / "model.pt", weights_only=True), expected, 1e-4)
    # One report per evaluation, from each of the two workers, counting every validation sample once.
    (per_worker,) = [json.loads(line) for line in reports.read_text().splitlines()]
    assert len(per_worker) == 2 and per_worker[0] == per_worker[1], per_worker
    count = per_worker[0]["val_count"]
    assert f"({count} samples)" in said and count == 359, (count, said)
    assert per_worker[0]["global_step"] == 44 and 0 < per_worker[0]["val_acc"] <= 1
    read = json.loads((tmp_path / "out.doctor.json").read_text())["launched_by"]
    assert (read["launcher"], read["rank"], read["world_size"], read["local_rank"]) == ("ray", 1, 2, 1), read
    assert read["ray"]["RAY_RAYLET_PID"].isdigit(), read
    assert not leftover_processes() and not ranks_left()


PLAIN_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")  # torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1)
for step in range(5):
    inputs = torch.randn(16 * world, 8, generator=data)[rank * 16:(rank + 1) * 16]
    optimizer.zero_grad()
    model(inputs).pow(2).mean().backward()
    optimizer.step()
print(f"rank {rank} of {world}, local rank {os.environ['LOCAL_RANK']}, argv {sys.argv[1:]}, main {__name__}", flush=True)
if rank == 0:
    torch.save(model.module.state_dict(), sys.argv[1])
dist.destroy_process_group()
"""


def test_ddpkit_run_on_ray_runs_a_plain_torch_distributed_script_unchanged(ray_cluster, tmp_path):
    (tmp_path / "plain.py").write_text(PLAIN_SCRIPT)
    local = run_ddpkit("run", "--nproc-per-node", "2", "plain.py", str(tmp_path / "local.pt"), cwd=tmp_path)
    assert local.returncode == 0, local.stdout + local.stderr
    result = on_ray(ray_cluster, "run", "--nproc-per-node", "2", "plain.py", str(tmp_path / "ray.pt"), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    said = result.stdout + result.stderr
    for rank in (0, 1):
        assert said.count(f"rank {rank} of 2, local rank {rank}, argv ['{tmp_path / 'ray.pt'}'], main __main__") == 1, said
    assert same_weights(torch.load(tmp_path / "ray.pt", weights_only=True),
                        torch.load(tmp_path / "local.pt", weights_only=True))
    assert not leftover_processes() and not ranks_left()


def test_a_killed_worker_is_restarted_by_ray_and_the_job_script_resumes_to_the_same_weights(
        ray_cluster, reference, tmp_path):
    expected, _ = reference
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "ddpkit", "run", "--launcher", "ray", "--address", ray_cluster,
            "--nproc-per-node", "2", "--max-restarts", "1", LIBRARY_LOOP, *LOOP_ARGS, "--resume", "auto",
            "--out", str(out)]
    with subprocess.Popen(argv, env=child_env(**RAY_ENV), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as driver:
        try:
            worker = ray_worker_of_rank(1, str(out), first_checkpoint=out / "checkpoints")
            os.kill(worker, signal.SIGKILL)  # mid-epoch: after the first checkpoint (step 4 of 44)
            said, _ = driver.communicate(timeout=180)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 0, said
    assert "Ray restarted the group (start 2 of the run)" in said, said
    assert same_weights(torch.load(out / "model.pt", weights_only=True), expected), "not the run without a failure"
    assert not leftover_processes() and not ranks_left()


def ray_worker_of_rank(rank: int, marker: str, first_checkpoint: Path, timeout: float = 120) -> int:
    """The Ray Train worker whose child runs rank ``rank`` of the script whose command line holds ``marker``, once
    ``first_checkpoint`` (a folder) holds a checkpoint."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if first_checkpoint.is_dir() and any(first_checkpoint.iterdir()):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes()
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                if marker.encode() in command and f"RANK={rank}".encode() in environ:
                    parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
                    if parent in processes_with(b"ray::RayTrainWorker"):
                        return parent  # (not a loader process of the rank, whose parent is the rank)
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} with a checkpoint in {first_checkpoint} after {timeout} s")


def test_a_job_larger_than_the_cluster_is_one_line_not_a_wait(ray_cluster, tmp_path):
    # (The address without a cluster, --nnodes beyond the cluster's nodes and Ray not installed: test_ray_contract.py.)
    result = on_ray(ray_cluster, "train", "--nproc-per-node", "5", "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("ddpkit: error: 1 node(s) x 5 process(es) need 5 CPU(s), but the Ray cluster has 1 "
                                    "node(s), 4 CPU(s) and 0 GPU(s): lower --nnodes or --nproc-per-node, or add nodes")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "run" / "config.toml").exists(), result.stderr
    assert not leftover_processes() and not ranks_left()
