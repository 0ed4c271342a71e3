"""One process, one device: the baseline every other strategy must agree with."""

from __future__ import annotations

import torch.nn as nn

from ddpkit.errors import UsageError
from ddpkit.process_group import Runtime


def apply_single(model: nn.Module, runtime: Runtime, **_options) -> nn.Module:
    """Move the model to this process's device. Refuses to run one model copy per rank silently."""
    if runtime.world_size > 1:
        raise UsageError(
            f"--strategy single trains one unsynchronised copy per process, but world size is "
            f"{runtime.world_size}; use --strategy ddp or --nproc-per-node 1"
        )
    return model.to(runtime.device)
