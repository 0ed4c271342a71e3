"""How the model is distributed: one plain function per strategy, chosen from ``STRATEGIES``.

    >>> from ddpkit.strategies import STRATEGIES
    >>> sorted(STRATEGIES)
    ['ddp', 'dp', 'single']

Each function takes the bare model and the ``Runtime`` and returns the module to train; the bare
model stays reachable through ``unwrap`` (for saving without a ``module.`` prefix).
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.strategies.ddp import DDPOptions, apply_ddp
from ddpkit.strategies.dp import apply_dp, check_dp_batch
from ddpkit.strategies.single import apply_single

STRATEGIES = {
    "single": apply_single,
    "dp": apply_dp,
    "ddp": apply_ddp,
}


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DataParallel / DistributedDataParallel wrapper (or the model itself)."""
    while isinstance(model, (nn.DataParallel, DistributedDataParallel)):
        model = model.module
    return model


__all__ = ["STRATEGIES", "DDPOptions", "apply_ddp", "apply_dp", "apply_single", "check_dp_batch", "unwrap"]
