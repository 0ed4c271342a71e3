"""One process, one device: the baseline every other strategy must agree with."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime
from ddpkit.strategies.base import Strategy


@dataclasses.dataclass(frozen=True)
class Single(Strategy):
    name: ClassVar[str] = "single"
    needs_group: ClassVar[bool] = False
    one_process: ClassVar[bool] = True

    def check(self, *, world_size: int, cuda_count: int, batch_size=None, build_model=None) -> None:  # noqa: ARG002
        # One unsynchronised model copy per process would train N different models and report one.
        if world_size > 1:
            raise UsageError(f"`strategy` single trains on one device; use `nproc_per_node` 1 (not {world_size}) "
                             "or `strategy` ddp")

    def wrap(self, model: nn.Module, runtime: Runtime, *, example=None) -> nn.Module:  # noqa: ARG002
        self.check(world_size=runtime.world_size, cuda_count=0)
        return model.to(runtime.device)
