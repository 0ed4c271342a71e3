"""DistributedDataParallel: one process per device, gradients all-reduced during backward."""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import UsageError
from ddpkit.process_group import Runtime


@dataclasses.dataclass(frozen=True)
class DDPOptions:
    # Parameters that may get no gradient in a step (conditional branches). Costs a graph walk per step.
    find_unused_parameters: bool = False
    # The set of used parameters never changes between steps: lets DDP skip re-checking, and
    # makes activation checkpointing and unused parameters work together.
    static_graph: bool = False
    # Gradients become views into the all-reduce buckets: saves one gradient-sized copy of memory.
    gradient_as_bucket_view: bool = False
    # Gradients are all-reduced in buckets of this many MiB while backward is still running. None keeps
    # PyTorch's default (25 MiB, with a small first bucket so the first all-reduce starts early).
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise UsageError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")


def apply_ddp(model: nn.Module, runtime: Runtime, *, ddp: DDPOptions = DDPOptions(), **_options) -> nn.Module:
    """Move the model to this rank's device and wrap it; needs a started process group."""
    if runtime.backend is None:
        raise UsageError("DDP needs a process group; start it with ddpkit.setup(force_group=True) or a launcher")
    model = model.to(runtime.device)
    on_gpu = runtime.device.type == "cuda"
    return DistributedDataParallel(
        model,
        device_ids=[runtime.device.index] if on_gpu else None,
        output_device=runtime.device.index if on_gpu else None,
        find_unused_parameters=ddp.find_unused_parameters,
        static_graph=ddp.static_graph,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        bucket_cap_mb=ddp.bucket_cap_mb,
    )
