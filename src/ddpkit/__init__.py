"""ddpkit: a single-device PyTorch loop, data-parallel on every GPU of a machine and on many machines.

    import ddpkit

    with ddpkit.Job(strategy="ddp", amp="bf16", accumulate=2) as job:   # rank, device, process group
        model, optimizer = job.setup(Net(), torch.optim.Adam, lr=1e-3)  # wrapped for the strategy
        loader = job.train_loader(dataset, batch_size=32)                # this rank's share, on its device
        for epoch in range(epochs):
            for images, labels in loader:
                with job.autocast():
                    loss = F.cross_entropy(model(images), labels)
                job.backward(loss)
                job.step(optimizer)                                      # every 2nd micro-step
            job.print(f"epoch {epoch} done")                             # only global rank 0 prints

Start it with ``ddpkit run --nproc-per-node N script.py`` (or torchrun, or ``srun``). The functions
below (``distributed``, ``prepare_model``, ``train_loader``, ...) are the same pieces one at a time.
"""

from ddpkit.checkpoint import CheckpointError, Checkpointer, Resumed, atomic_save, load_model_state, model_state_dict, read_contents
from ddpkit.core.preempt import StopSignal, stop_on_signal
from ddpkit.data import check_equal_batches, eval_loader, image_folder, image_shards, reduce_sums, to_device, train_loader
from ddpkit.core.env import DistEnv, detect, from_spawn
from ddpkit.core.errors import UsageError
from ddpkit import zoo
from ddpkit.core.process_group import Runtime, barrier, broadcast_buffers, distributed, free_port, main_process_first, setup, teardown
from ddpkit.data.evaluation import evaluate
from ddpkit.job import Job
from ddpkit.strategies import STRATEGIES, Strategy, create, model_parallel, strategy_of, unwrap
from ddpkit.strategies.replica_groups import ReplicaGroup
from ddpkit.strategies.sync_bn import convert_sync_batchnorm

from ddpkit.core.version import __version__


def prepare_model(model, runtime: Runtime, strategy: str | Strategy = "ddp", *, sync_bn: bool = False, **settings):
    """Wrap ``model`` for ``strategy`` (a name from ``STRATEGIES`` with its settings as keywords, or a strategy
    object) on this runtime's device. Under fsdp, save with ``full_model_state`` (a collective).
    """
    chosen = create(strategy, **settings)
    if sync_bn:
        model = convert_sync_batchnorm(model, runtime)
    return chosen.wrap(model, runtime)


def full_model_state(model, runtime: Runtime, strategy: Strategy | None = None):
    """The bare model's state_dict on rank 0 (None elsewhere), whatever the strategy; every rank calls it."""
    return (strategy or strategy_of(model)).full_model_state(model, runtime)


def full_optimizer_state(model, optimizer, runtime: Runtime, strategy: Strategy | None = None):
    """The optimizer's whole state on rank 0 (None elsewhere), whatever the strategy; every rank calls it."""
    return (strategy or strategy_of(model, optimizer)).full_optimizer_state(model, optimizer, runtime)


def print0(runtime: Runtime, *args, **kwargs) -> None:
    """``print`` on global rank 0 only (flushed, unless ``flush=False``)."""
    if runtime.is_main:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


__all__ = [
    "CheckpointError", "Checkpointer", "DistEnv", "Job", "Strategy", "create", "evaluate", "strategy_of", "Resumed", "StopSignal", "check_equal_batches",
    "load_model_state", "read_contents",
    "stop_on_signal", "Runtime", "STRATEGIES", "UsageError", "atomic_save", "barrier", "broadcast_buffers", "convert_sync_batchnorm",
    "detect", "distributed", "from_spawn", "eval_loader", "free_port", "full_model_state", "full_optimizer_state", "image_folder", "image_shards",
    "main_process_first",
    "model_parallel", "model_state_dict", "prepare_model", "print0", "ReplicaGroup",
    "reduce_sums", "setup", "teardown", "to_device", "train_loader", "unwrap", "zoo",
]
