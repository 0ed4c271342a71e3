"""DataParallel: one process drives every visible GPU; each batch is split across them.

Simple (one line in the tutorials) but slower than DDP: the GIL serialises the replicas' Python, and
GPU 0 gathers outputs and gradients, so it holds more memory than the others.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddpkit.errors import UsageError
from ddpkit.process_group import Runtime


def apply_dp(model: nn.Module, runtime: Runtime, *, device_ids: list[int] | None = None, **_options) -> nn.Module:
    """Replicate the model on ``device_ids`` (all visible GPUs by default) inside this one process."""
    count = torch.cuda.device_count()
    if count == 0:
        raise UsageError("--strategy dp needs at least one CUDA GPU and none is visible; use --strategy ddp")
    if runtime.world_size > 1:
        raise UsageError(
            f"--strategy dp is a single process driving all GPUs, but world size is {runtime.world_size}; "
            "use --nproc-per-node 1 with dp, or --strategy ddp"
        )
    ids = list(range(count)) if device_ids is None else device_ids
    return nn.DataParallel(model.to(torch.device("cuda", ids[0])), device_ids=ids, output_device=ids[0])


def check_dp_batch(batch_size: int, gpu_count: int) -> None:
    """DataParallel's batch is the global one; each GPU needs at least one sample of it."""
    if batch_size < gpu_count:
        raise UsageError(
            f"--strategy dp splits each batch across {gpu_count} GPUs, so --batch-size must be at least "
            f"{gpu_count}, got {batch_size}"
        )
