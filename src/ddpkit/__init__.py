"""ddpkit: a single-device PyTorch loop, data-parallel on every GPU of a machine and on many machines.

    import ddpkit

    with ddpkit.distributed() as rt:                      # rank, device, process group; torn down on exit
        model = ddpkit.prepare_model(Net(), rt)            # DDP on this rank's device
        loader = ddpkit.train_loader(dataset, batch_size=32, runtime=rt, seed=0)
        for epoch in range(epochs):
            for images, labels in loader:                  # set_epoch and device transfer done for you
                ...
            ddpkit.print0(rt, f"epoch {epoch} done")       # only global rank 0 prints

Start it with ``ddpkit run --nproc-per-node N script.py`` (or torchrun, or ``srun``).
"""

from ddpkit.checkpoint import CheckpointError, Checkpointer, Resumed, atomic_save, load_model_state, model_state_dict, read_contents
from ddpkit.preempt import StopSignal, stop_on_signal
from ddpkit.data import check_equal_batches, eval_loader, reduce_sums, to_device, train_loader
from ddpkit.env import DistEnv, detect
from ddpkit.errors import UsageError
from ddpkit import zoo
from ddpkit.process_group import Runtime, barrier, broadcast_buffers, distributed, free_port, main_process_first, setup, teardown
from ddpkit.strategies import STRATEGIES, DDPOptions, model_parallel, unwrap
from ddpkit.strategies.state import full_model_state, full_optimizer_state
from ddpkit.strategies.sync_bn import convert_sync_batchnorm

__version__ = "0.1.0"


def prepare_model(model, runtime: Runtime, strategy: str = "ddp", *, ddp: DDPOptions = DDPOptions(), sync_bn: bool = False):
    """Wrap ``model`` for ``strategy`` ("single", "dp", "ddp" or "fsdp") on this runtime's device.

    Pipelines need more than a model: ``ddpkit.strategies.apply_pipeline`` (see docs/parallelism.md).
    Under fsdp, save with ``full_model_state`` (a collective), not ``model_state_dict``.
    """
    if strategy == "pipeline":
        raise UsageError("prepare_model does not build pipelines; use ddpkit.strategies.apply_pipeline (docs/parallelism.md)")
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if sync_bn:
        model = convert_sync_batchnorm(model, runtime)
    return STRATEGIES[strategy](model, runtime, ddp=ddp)


def print0(runtime: Runtime, *args, **kwargs) -> None:
    """``print`` on global rank 0 only."""
    if runtime.is_main:
        print(*args, flush=True, **kwargs)


__all__ = [
    "CheckpointError", "Checkpointer", "DDPOptions", "DistEnv", "Resumed", "StopSignal", "check_equal_batches",
    "load_model_state", "read_contents",
    "stop_on_signal", "Runtime", "STRATEGIES", "UsageError", "atomic_save", "barrier", "broadcast_buffers", "convert_sync_batchnorm",
    "detect", "distributed", "eval_loader", "free_port", "full_model_state", "full_optimizer_state", "main_process_first",
    "model_parallel", "model_state_dict", "prepare_model", "print0",
    "reduce_sums", "setup", "teardown", "to_device", "train_loader", "unwrap", "zoo",
]
