"""DDP with ZeRO stage 1: PyTorch's ZeroRedundancyOptimizer keeps 1/world of the optimizer state on each rank.

Gradients are all-reduced as in DDP; each rank then steps only the parameters it owns and broadcasts them.
Sharded checkpoints (the default) have each rank write the optimizer state of its own share of the parameters,
named by parameter: another world size, whose shares differ, reads them back by name. Full checkpoints
consolidate the shares on rank 0, in PyTorch's plain (numbered) layout.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime
from ddpkit.strategies.base import dcp_state, held_bytes, load_dcp_state, unwrap
from ddpkit.strategies.ddp import DDP


@dataclasses.dataclass(frozen=True)
class ZeRO(DDP):
    name: ClassVar[str] = "zero"
    in_replica_groups: ClassVar[bool] = False  # torchft's optimizer wrapper steps a whole optimizer, not shards
    sharded_checkpoints: ClassVar[bool] = True
    shards_optimizer: ClassVar[bool] = True
    with_zero: ClassVar[str | None] = None  # it is ddp's

    def make_optimizer(self, optimizer_class: type, model: nn.Module, **settings) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imported on use: it pulls in RPC

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **settings)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                        names: dict[int, str]) -> torch.optim.Optimizer:
        # ZeRO's optimizer is another object: the same kind and settings, each rank stepping its share.
        if optimizer.state:
            raise UsageError("the optimizer has state already: hand it to `prepare` before its first step")
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer), **optimizer.defaults)

    def full_optimizer_state(self, model: nn.Module, optimizer, runtime: Runtime) -> dict | None:  # noqa: ARG002
        # Each rank holds the state of its own share of the parameters; rank 0 collects them all.
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if runtime.is_main else None

    def sharded_state(self, model: nn.Module, optimizer) -> dict:
        # The optimizer this rank steps: the one over its own share of the parameters.
        return dcp_state(unwrap(model), optimizer.optim if optimizer is not None else None)

    def load_sharded_state(self, model: nn.Module, optimizer, read) -> None:
        load_dcp_state(unwrap(model), optimizer.optim if optimizer is not None else None, read)
        if optimizer is None:
            return
        # ZeroRedundancyOptimizer hands its own groups' settings (the learning rate) to the inner optimizer at
        # each step: they must be the loaded ones. Groups without parameters on this rank loaded none.
        for group, loaded in zip(optimizer.param_groups, optimizer.optim.param_groups):
            if loaded["params"]:
                group.update({key: value for key, value in loaded.items() if key != "params"})

    def train_state_bytes(self, model: nn.Module, optimizer) -> int:
        return held_bytes(model, optimizer.optim if optimizer is not None else None)  # this rank's share
