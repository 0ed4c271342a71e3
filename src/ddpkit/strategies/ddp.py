"""DistributedDataParallel: one process per device, gradients all-reduced during backward; in a job of one process,
the model itself behind DDP's interface (``OneProcessDDP``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
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


class OneProcessDDP(BareStateDict, nn.Module):
    """What ``DDP().wrap`` hands back in a job of one process: the model, called directly, behind DDP's interface
    (``module``, ``no_sync()``, the bare model's ``state_dict()``, inputs moved to the model's GPU as DDP's
    ``device_ids`` move them), so that a script reads the same at one process as at eight.

    DDP over one process all-reduces nothing, yet its work on every step (its autograd hooks, copies into and out
    of its buckets, the checks and buffer broadcast before each forward) cost 1.6-2.3% of a ResNet-50 step on an
    H100 with any of its settings, and a fifth of a small model's step on a CPU (docs/benchmarks.md). DataParallel
    on one GPU calls its module directly too. Gradients, weights, ``model.pt`` and checkpoints are those DDP would
    give (it averages over one process). One thing DDP does that this does not: with ``find_unused_parameters``
    False, a parameter that got no gradient in a step is DDP's error from two processes on, not here. A
    communication hook (``register_comm_hook``) is kept, not run: one process has nothing to communicate.
    """

    calls_module_directly = True  # what ``unwrap`` looks through

    def __init__(self, module: nn.Module, device: torch.device | None = None):
        super().__init__()
        self.module = module
        self.device = device  # a GPU: inputs elsewhere are moved there, as DDP moves them to its device_ids[0]
        self.require_backward_grad_sync = True  # what DDP's no_sync() sets (and ddpkit's accumulation): no effect
        self.comm_hook = None
        # Read once, as DDP's constructor reads it: copies to the GPU on a side stream unless set to 0.
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"

    def forward(self, *inputs, **kwargs):
        if self.device is not None:
            # With DDP's own helper, as its forward moves them: tensors in tuples, lists, dicts, namedtuples and
            # PackedSequences.
            from torch.distributed.utils import _to_kwargs

            moved, moved_kwargs = _to_kwargs(inputs, kwargs, self.device, self.use_side_stream_for_tensor_copies)
            inputs, kwargs = moved[0], moved_kwargs[0]
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's context for accumulation micro-steps; with one process there is no all-reduce to skip."""
        yield

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,  # noqa: ARG002 - DDP's
             throw_on_early_termination: bool = False):
        """DDP's context for ranks with uneven numbers of batches; one process has no other rank to wait for."""
        return contextlib.nullcontext()

    def register_comm_hook(self, state, hook) -> None:
        """Kept for DDP's interface, not run: one process has no gradients of others to combine."""
        self.comm_hook = (state, hook)


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
        if runtime.world_size == 1:
            return OneProcessDDP(model, runtime.device if on_gpu else None)
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

