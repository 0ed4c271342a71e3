"""DataParallel: one process drives every visible GPU; each batch is split across them.

Simple (one line in the tutorials) but slower than DDP: the GIL serialises the replicas' Python, and
GPU 0 gathers outputs and gradients, so it holds more memory than the others.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime
from ddpkit.strategies.base import BareStateDict, Strategy


class PreparedDataParallel(BareStateDict, nn.DataParallel):
    """``nn.DataParallel`` whose ``state_dict()`` is the bare model's (``BareStateDict``)."""


@dataclasses.dataclass(frozen=True)
class DataParallel(Strategy):
    device_ids: tuple[int, ...] | None = None  # the GPUs to drive (default: every visible one)

    name: ClassVar[str] = "dp"
    needs_group: ClassVar[bool] = False
    one_process: ClassVar[bool] = True

    def check(self, *, world_size: int, cuda_count: int, batch_size: int | None = None, build_model=None) -> None:  # noqa: ARG002
        if cuda_count == 0:
            raise UsageError("`strategy` dp needs at least one CUDA GPU and none is visible; use `strategy` ddp")
        if world_size > 1:
            raise UsageError(f"`strategy` dp is one process driving all GPUs; use `nproc_per_node` 1, not {world_size}")
        gpus = self.devices_per_process(cuda_count)
        # DataParallel's batch is the global one; each GPU needs at least one sample of it.
        if batch_size is not None and batch_size < gpus:
            raise UsageError(f"`strategy` dp splits each batch across {gpus} GPUs, so `batch_size` must be at least "
                             f"{gpus}, got {batch_size}")

    def devices_per_process(self, cuda_count: int) -> int:
        return len(self.device_ids) if self.device_ids else cuda_count

    def wrap(self, model: nn.Module, runtime: Runtime, *, example=None) -> nn.Module:  # noqa: ARG002
        self.check(world_size=runtime.world_size, cuda_count=torch.cuda.device_count())
        ids = list(self.device_ids or range(torch.cuda.device_count()))
        return PreparedDataParallel(model.to(torch.device("cuda", ids[0])), device_ids=ids, output_device=ids[0])

    def eval_module(self, model: nn.Module) -> nn.Module:
        return model  # through the wrapper: the batch is split over the GPUs as in training
