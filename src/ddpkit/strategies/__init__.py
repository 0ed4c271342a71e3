"""How the model is distributed: one plain function per strategy, chosen from ``STRATEGIES``.

    >>> from ddpkit.strategies import STRATEGIES
    >>> sorted(STRATEGIES)
    ['ddp', 'dp', 'fsdp', 'pipeline', 'single']

Each function takes the bare model and the ``Runtime`` and returns the module to train; the bare
model stays reachable through ``unwrap`` (for saving without a ``module.`` prefix).
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.strategies.ddp import DDPOptions, apply_ddp
from ddpkit.strategies.dp import apply_dp, check_dp_batch
from ddpkit.strategies.fsdp import apply_fsdp
from ddpkit.strategies.pipeline import Pipeline, PipelineLayout, apply_pipeline
from ddpkit.strategies.single import apply_single
from ddpkit.strategies.split import model_parallel

STRATEGIES = {
    "single": apply_single,
    "dp": apply_dp,
    "ddp": apply_ddp,
    "fsdp": apply_fsdp,
    "pipeline": apply_pipeline,
}
# Strategies whose every rank must start the process group, even alone.
NEEDS_GROUP = ("ddp", "fsdp", "pipeline")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DataParallel / DistributedDataParallel wrapper (or the model itself).

    Under FSDP the model is its own (sharded) self; under pipeline parallel, this rank's stage.
    """
    while isinstance(model, (nn.DataParallel, DistributedDataParallel, Pipeline)):
        model = model.module
    return model


__all__ = ["NEEDS_GROUP", "STRATEGIES", "DDPOptions", "Pipeline", "PipelineLayout", "apply_ddp", "apply_dp", "apply_fsdp",
           "apply_pipeline", "apply_single", "check_dp_batch", "model_parallel", "unwrap"]
