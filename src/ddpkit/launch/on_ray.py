"""ddpkit on a Ray cluster: ``ddpkit run --launcher ray`` and ``ddpkit train --launcher ray``, and the metrics a job
reports to Ray Train.

    ddpkit run --launcher ray --address HEAD:6379 --nnodes 2 --nproc-per-node 4 train.py --epochs 3

The driver (this process) connects to the cluster and runs a ``ray.train.torch.TorchTrainer`` of one Ray worker per
process, placed by Ray. Each worker starts the unchanged command as a process of its own, as a scheduler's task would
be (``srun``): torchrun's variables in its environment (its rank, local rank, world size, node rank and the master,
rank 0's node with a port of the job's own), the script's argv and ``__main__``, ddpkit's watch over it. Ray's own
process group in the worker is left alone: the script starts its own (through ``ddpkit.Job``, or its
``init_process_group``) as under torchrun. ``--max-restarts K`` is Ray's ``FailureConfig(max_failures=K)``: Ray restarts
the whole group, and each restarted process gets ``TORCHELASTIC_RESTART_COUNT`` as from torchrun (``ddpkit train``
then resumes from its newest checkpoint; a script's ``ckpt.resume("auto")`` does in any case).

A ``ddpkit.Job`` made inside a Ray Train worker (a script's loop in a ``TorchTrainer`` of one's own) adopts the process
group Ray started (``ddpkit.core.process_group.adopt``). In both ways each ``job.evaluate`` (and each epoch of
``ddpkit train``) reaches ``ray.train.report`` from every rank, as Ray requires (``ddpkit.core.ray_reports``; under
``--launcher ray`` through a pipe to the rank's worker, which reports it: ``relay``).

Nothing here imports Ray until a Ray launch asks for it: ``pip install 'ddpkit[ray]'``.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence

from ddpkit.core import env as env_mod
from ddpkit.core import logs
from ddpkit.core.ray_reports import REPORTS_ENV
from ddpkit.core.signals import END_WITH_PARENT_ENV
from ddpkit.core.errors import UsageError, first_line
from ddpkit.core.logs import logger

SHARED_KEY = "ddpkit/ray/start"  # in Ray's group's store: rank 0's port for the ranks' own group and the attempt
ATTEMPTS_KEY = "ddpkit/ray/attempts/{run}"  # in Ray's key-value store: how many times this run's group has started
CONNECT_TIMEOUT_S = 5.0  # how long the driver waits for a cluster's address to answer before saying there is none
# What a rank inherits from the driver: ddpkit's settings (--timeout, --stall-timeout, --log-level, the written
# config) and the NCCL and PyTorch settings its flags set (--nccl, --find-hangs), NCCL_SOCKET_IFNAME included (a
# pattern such as ^docker,lo suits every node). Not gloo's interface, GLOO_SOCKET_IFNAME: ddpkit picks it per node.
FORWARDED_PREFIXES = ("DDPKIT_", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL")
NOT_FORWARDED = (REPORTS_ENV, END_WITH_PARENT_ENV)


# -- the driver


def import_ray():
    """``ray`` and ``ray.train.torch``, or one line naming the extra that installs them."""
    try:
        import ray
        import ray.train.torch  # noqa: F401 - TorchTrainer
    except ImportError as error:
        raise UsageError(f"--launcher ray needs Ray Train, which is not installed here ({first_line(error)}): "
                         "pip install 'ddpkit[ray]'") from None
    return ray


def check_address(address: str | None) -> None:
    """One line when ``HOST:PORT`` has no cluster behind it, before ``ray.init`` would try it for a minute or more.
    ``auto``, ``ray://`` (Ray Client) and no address at all are left to Ray."""
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address!r}: give the Ray cluster's head as HOST:PORT (its GCS port, 6379 by "
                         "default, as `ray start --head` prints it), auto, or ray://HOST:10001")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise UsageError(f"no Ray cluster answers at {address} ({error.strerror or error}): start one there with "
                         f"`ray start --head --port {port}`, or give --address of a running cluster's head") from None


def connect(address: str | None):
    """``ray.init`` on the cluster at ``address`` (None: RAY_ADDRESS, a cluster started on this machine, or a new
    local one, as Ray decides), quietly; what goes wrong in one line."""
    check_address(address)
    ray = import_ray()
    try:
        ray.init(address=address, log_to_driver=True, logging_level="warning", configure_logging=True)
    except Exception as error:  # noqa: BLE001 - Ray's own errors (authentication, versions) have no common base
        if not isinstance(error, (ConnectionError, RuntimeError, ValueError)) and \
                type(error).__module__.split(".")[0] != "ray":
            raise
        raise UsageError(f"cannot connect to the Ray cluster at {address or 'RAY_ADDRESS/local'}: {first_line(error)}") \
            from None
    return ray


def plan(resources: Mapping[str, float], nodes: int, *, nnodes: int, nproc_per_node: str | int,
         want_gpu: bool) -> tuple[int, bool]:
    """How many processes per node (``auto``: one per GPU of a node when the cluster has GPUs, else 2) and whether
    each Ray worker takes a GPU, for a cluster of ``nodes`` alive nodes with ``resources`` in all
    (``ray.cluster_resources()``). A job the cluster cannot hold is one line, not a wait for resources that never
    come."""
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    use_gpu = want_gpu and gpus > 0
    if nproc_per_node == "auto":
        per_node = max(1, gpus // nnodes) if use_gpu else 2
    else:
        per_node = int(nproc_per_node)
    workers = nnodes * per_node
    where = f"the Ray cluster has {nodes} node(s), {cpus} CPU(s) and {gpus} GPU(s)"
    if nnodes > nodes:
        raise UsageError(f"--nnodes {nnodes}: {where}: add nodes (`ray start --address HEAD:PORT` on each) or lower "
                         "--nnodes")
    if workers > cpus or (use_gpu and workers > gpus):
        need = f"{workers} CPU(s)" + (f" and {workers} GPU(s)" if use_gpu else "")
        raise UsageError(f"{nnodes} node(s) x {per_node} process(es) need {need}, but {where}: lower --nnodes or "
                         "--nproc-per-node, or add nodes")
    return per_node, use_gpu


def launch(command: Sequence[str], *, address: str | None, nnodes: int, nproc_per_node: str | int,
           max_restarts: int, want_gpu: bool = True, name: str = "ddpkit",
           prepare: Callable[[int, bool], None] | None = None) -> int:
    """Run ``command`` (argv after ``python -u``) once per process on the Ray cluster, as a Ray Train run; its exit
    status: 0, 2 when every failed rank said a usage error (one line each, above), else 1 with one line saying how
    the run ended. ``prepare(nproc_per_node, use_gpu)``: called once the cluster's size is known, before any rank
    starts (``ddpkit train`` checks its settings against it and writes its config)."""
    ray = connect(address)
    try:
        return _fit(ray, command, nnodes=nnodes, nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                    want_gpu=want_gpu, name=name, prepare=prepare)
    finally:
        ray.shutdown()


def _fit(ray, command: Sequence[str], *, nnodes: int, nproc_per_node: str | int, max_restarts: int, want_gpu: bool,
         name: str, prepare: Callable[[int, bool], None] | None) -> int:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    alive = [node for node in ray.nodes() if node.get("Alive")]
    per_node, use_gpu = plan(ray.cluster_resources(), len(alive), nnodes=nnodes, nproc_per_node=nproc_per_node,
                             want_gpu=want_gpu)
    if prepare is not None:
        prepare(per_node, use_gpu)
    workers = nnodes * per_node
    config = {"command": list(command), "cwd": os.getcwd(), "run": uuid.uuid4().hex,
              "env": forwarded(os.environ)}
    # One per node on several nodes: Ray must not pack two onto one; otherwise as few nodes as hold them.
    placement = "STRICT_SPREAD" if nnodes > 1 and per_node == 1 else "PACK"
    trainer = TorchTrainer(
        run_rank, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, placement_strategy=placement),
        run_config=RunConfig(name=f"{name}-{config['run'][:8]}", failure_config=FailureConfig(max_failures=max_restarts)))
    logger.info(f"starting {workers} rank(s) on the Ray cluster ({nnodes} node(s) x {per_node}, "
                f"{'one GPU' if use_gpu else 'no GPU'} each): {shlex.join(command)}")
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - Ray Train's TrainingFailedError and its kin
        return failed(error, max_restarts)
    return 0


def failed(error: BaseException, max_restarts: int) -> int:
    """The driver's status after ``trainer.fit()`` raised ``error``, and one line for it (the ranks said their own)."""
    failures = getattr(error, "worker_failures", None) or {}
    statuses = {getattr(failure, "status", None) for failure in failures.values()}
    if statuses == {2}:
        return 2  # a usage error, which each rank has said in one line
    causes = sorted({first_line(failure) for failure in failures.values()}) or [first_line(error)]
    after = f" after {max_restarts} restart(s)" if max_restarts else ""
    logger.error(f"the job failed on Ray{after}: {'; '.join(causes)} (each rank's output is above, prefixed with its "
                 "Ray worker)")
    return 1


def forwarded(environ: Mapping[str, str]) -> dict[str, str]:
    """The driver's settings that every rank gets (``FORWARDED_PREFIXES``)."""
    return {name: value for name, value in environ.items()
            if name.startswith(FORWARDED_PREFIXES) and name not in NOT_FORWARDED}


# -- in each Ray worker


class RankFailed(RuntimeError):
    """A rank's process ended with a status other than 0; Ray then ends (or restarts) the whole group."""

    def __init__(self, rank: int, status: int):
        self.rank, self.status = rank, status
        how = f"signal {-status}" if status < 0 else f"status {status}"
        super().__init__(f"rank {rank} exited with {how}")

    def __reduce__(self):
        return RankFailed, (self.rank, self.status)


def run_rank(config: dict) -> None:
    """Ray Train's training function for ``launch``: start this worker's rank as a process of its own, hand its
    reports to Ray, and fail when it fails."""
    import ray.train
    import torch.distributed as dist

    context = ray.train.get_context()
    rank = context.get_world_rank()
    logs.configure(rank=rank)
    master = os.environ.get("MASTER_ADDR") or env_mod.DEFAULT_MASTER_ADDR  # Ray's: rank 0's node
    start = shared_start(dist.distributed_c10d._get_default_store(), rank, master, config["run"])  # noqa: SLF001
    if start["attempt"] and rank == 0:
        logger.warning(f"Ray restarted the group (start {start['attempt'] + 1} of the run): the ranks start again, "
                       "and a script on ddpkit's checkpoints resumes from its newest (TORCHELASTIC_RESTART_COUNT="
                       f"{start['attempt']})")
    ranked = env_mod.DistEnv(rank=rank, local_rank=context.get_local_rank(), world_size=context.get_world_size(),
                             local_world_size=context.get_local_world_size(), node_rank=context.get_node_rank(),
                             master_addr=master, master_port=start["port"], launcher="ray")
    environ = {**os.environ, **config["env"], **env_mod.torchrun_variables(ranked),
               "TORCHELASTIC_RESTART_COUNT": str(start["attempt"]), END_WITH_PARENT_ENV: "1"}
    if not os.path.isdir(config["cwd"]):
        raise UsageError(f"rank {rank} on {socket.gethostname()}: the driver's folder {config['cwd']} is not on this "
                         "node; run the driver from a folder every node has (a shared file system, or the image)")
    read_end, write_end = os.pipe()
    environ[REPORTS_ENV] = str(write_end)
    try:
        # The worker's own Python (the driver's may not exist on this node), as `python -u ...` would run it; or, as
        # torchrun's agent does, the interpreter PYTHON_EXEC names in the node's environment (`ray start`'s).
        python = os.environ.get("PYTHON_EXEC") or sys.executable
        child = subprocess.Popen([python, "-u", *config["command"]], env=environ, cwd=config["cwd"],
                                 pass_fds=(write_end,))
    finally:
        os.close(write_end)
    with os.fdopen(read_end) as reports:
        relay(reports)
    status = child.wait()
    if status != 0:
        raise RankFailed(rank, status)


def relay(reports) -> None:
    """Each JSON line a rank writes, to ``ray.train.report``, until the rank (and whatever inherited the pipe) ends."""
    import ray.train

    for line in reports:
        try:
            metrics = json.loads(line)
        except ValueError:
            logger.warning(f"not a report, ignored: {line.strip()!r}")
            continue
        ray.train.report(metrics)


def shared_start(store, rank: int, master: str, run: str) -> dict:
    """What every rank of this start needs alike, set by rank 0 in Ray's group's store: a free port on rank 0's node
    for the ranks' own group (Ray's store holds MASTER_PORT), and which start of the run this is (0, then 1 after
    Ray's first restart: the group's attempt count, kept in Ray's key-value store across restarts)."""
    if rank == 0:
        from ray.experimental import internal_kv

        from ddpkit.core.process_group import free_port

        key = ATTEMPTS_KEY.format(run=run)
        attempt = int(internal_kv._internal_kv_get(key) or 0)  # noqa: SLF001 - Ray's GCS store, no public wrapper
        internal_kv._internal_kv_put(key, str(attempt + 1))  # noqa: SLF001
        store.set(SHARED_KEY, json.dumps({"port": free_port(master), "attempt": attempt}))
    return json.loads(store.get(SHARED_KEY))
