"""DistributedDataParallel: one process per device, gradients all-reduced during backward."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.core import progress
from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime, broadcast_buffers
from ddpkit.strategies.base import BareStateDict, Strategy, uncompiled, unwrap


class PreparedDDP(BareStateDict, DistributedDataParallel):
    """``DistributedDataParallel`` as ``Job.setup`` and ``Job.prepare`` hand it back: its ``state_dict()`` is the
    bare model's (``BareStateDict``), and an evaluation through it never waits for the other ranks.

    DDP's forward first broadcasts rank 0's buffers (BatchNorm's statistics) to every rank, a collective: in an
    evaluation whose ranks hold different numbers of batches, the rank with one more waits in it forever (a
    two-minute stall until the watch ends the job). A forward in eval mode, without gradients, or over an
    evaluation loader's batch (train mode by mistake) skips that broadcast: evaluation changes no buffer worth
    sending (in train mode it changes this rank's own, as it would on one device), and DDP's state is put back
    after it, so training goes on as if no evaluation had run. Everything else is DDP's forward: a backward after
    an eval-mode forward (a model trained with frozen BatchNorm) still averages the gradients.
    """

    def forward(self, *inputs, **kwargs):
        if self.module.training and torch.is_grad_enabled() and progress.phase() != "evaluate":
            return super().forward(*inputs, **kwargs)
        keep = self.require_forward_param_sync
        self.require_forward_param_sync = False  # what DDP reads to broadcast the buffers before the forward
        try:
            return super().forward(*inputs, **kwargs)
        finally:
            self.require_forward_param_sync = keep


@dataclasses.dataclass(frozen=True)
class DDP(Strategy):
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

    name: ClassVar[str] = "ddp"
    replicated: ClassVar[bool] = True
    with_zero: ClassVar[str | None] = "zero"
    syncs_weights: ClassVar[bool] = True  # DDP's constructor broadcasts rank 0's parameters and buffers
    in_replica_groups: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise UsageError(f"`bucket_cap_mb` must be positive, got {self.bucket_cap_mb}")

    def wrap(self, model: nn.Module, runtime: Runtime, *, example=None) -> nn.Module:  # noqa: ARG002
        if runtime.backend is None:
            raise UsageError("DDP needs a process group; start it with ddpkit.setup(force_group=True) or a launcher")
        model = model.to(runtime.device)
        on_gpu = runtime.device.type == "cuda"
        return PreparedDDP(
            model,
            device_ids=[runtime.device.index] if on_gpu else None,
            output_device=runtime.device.index if on_gpu else None,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            bucket_cap_mb=self.bucket_cap_mb,
        )

    def mark_waits(self, model: nn.Module) -> None:
        # DDP's forward broadcasts rank 0's buffers before the replica's own forward runs; its backward
        # all-reduces the gradients bucket by bucket as they are computed, and waits at its end for the last
        # all-reduce: from this rank's last gradient on, it waits for the others.
        model.register_forward_pre_hook(lambda module, args: progress.switch("wait", after=("data", "forward")))
        unwrap(model).register_forward_pre_hook(lambda module, args: progress.switch("forward", after=("wait",)))
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(progress.grads_ready)

    def set_gradient_sync(self, model: nn.Module, enabled: bool, *, first_backward: bool) -> None:
        # What DDP's no_sync() sets; read by DDP's forward, so it must be set before the forward. With
        # static_graph DDP records the graph on its first backward in this process, which must be synchronised.
        uncompiled(model).require_backward_grad_sync = enabled or (first_backward and self.static_graph)

    def sync_buffers(self, model: nn.Module, runtime: Runtime) -> None:
        # DDP copies rank 0's buffers (BatchNorm running statistics) to the others at the *start* of each
        # forward, so after the last step each rank holds its own.
        broadcast_buffers(unwrap(model), runtime)

