"""How the model is distributed: one object per strategy, chosen by name from ``STRATEGIES``.

    >>> from ddpkit.strategies import STRATEGIES, create
    >>> sorted(STRATEGIES)
    ['ddp', 'dp', 'fsdp', 'pipeline', 'single', 'zero']
    >>> create("ddp", static_graph=True)
    DDP(find_unused_parameters=False, static_graph=True, gradient_as_bucket_view=False, bucket_cap_mb=None)

Each strategy is a frozen dataclass of its own settings with the members of ``base.Strategy``: checks,
``wrap`` (the module to train; the bare model stays reachable through ``unwrap``), the optimizer,
gradient-sync skipping, evaluation, and whole-state saving and loading. Adding one: a file here and a
line in ``STRATEGIES`` (see ``base``).
"""

from __future__ import annotations

import dataclasses
import sys

import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.strategies.base import Strategy, unwrap
from ddpkit.strategies.ddp import DDP, OneProcessDDP
from ddpkit.strategies.dp import DataParallel
from ddpkit.strategies.fsdp import FSDP, is_fsdp2
from ddpkit.strategies.pipeline import Pipeline, PipelineLayout, PipelineParallel
from ddpkit.strategies.single import Single
from ddpkit.strategies.split import model_parallel
from ddpkit.strategies.zero import ZeRO

STRATEGIES: dict[str, type] = {
    "single": Single,
    "dp": DataParallel,
    "ddp": DDP,
    "zero": ZeRO,
    "fsdp": FSDP,
    "pipeline": PipelineParallel,
}


def create(name: str | Strategy, *, strict: bool = True, **settings) -> Strategy:
    """The strategy ``name`` with ``settings`` (its dataclass fields); a strategy object is returned as it is.

    ``strict``: a setting the strategy does not have is an error (naming the strategies that have it);
    otherwise settings of other strategies are ignored (a caller holding every strategy's settings).
    """
    if not isinstance(name, str):
        return name
    if name not in STRATEGIES:
        raise UsageError(f"`strategy` must be one of {', '.join(STRATEGIES)}, got {name!r}")
    kind = STRATEGIES[name]
    own = {field.name for field in dataclasses.fields(kind)}
    foreign = [key for key in settings if key not in own]
    if strict and foreign:
        owners = [other for other, cls in STRATEGIES.items() if foreign[0] in {f.name for f in dataclasses.fields(cls)}]
        where = f"a setting of {', '.join(owners)}" if owners else "not a setting of any strategy"
        raise UsageError(f"strategy {name} has no setting {foreign[0]!r} ({where})")
    return kind(**{key: value for key, value in settings.items() if key in own})


def strategy_of(model: nn.Module, optimizer=None) -> Strategy:
    """The strategy that produced ``model`` (and ``optimizer``), for code handed an already wrapped model.

    The only place that looks at wrapper types; the settings it returns are the defaults.
    """
    if getattr(model, "is_pipeline", False):
        return PipelineParallel()
    if is_fsdp2(model):
        return FSDP()
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return ZeRO()
    if isinstance(model, nn.DataParallel):
        return DataParallel()
    if isinstance(model, (nn.parallel.DistributedDataParallel, OneProcessDDP)):
        return DDP()
    return Single()


def distributed_already(module: nn.Module) -> bool:
    """Whether ``module`` is already spread over the processes by a wrapper of its own: DDP, or FSDP (FSDP2's
    ``fully_shard`` or FSDP1's class), as a script that distributes itself leaves its model."""
    if isinstance(strategy_of(module), (DDP, FSDP)):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel)


__all__ = ["STRATEGIES", "DDP", "DataParallel", "FSDP", "Pipeline", "PipelineLayout", "PipelineParallel", "Single",
           "Strategy", "ZeRO", "create", "distributed_already", "model_parallel", "strategy_of", "unwrap"]
