"""Fully sharded data parallel (PyTorch's FSDP2, ``fully_shard``): for models whose weights, gradients and
optimizer state do not fit one device.

Each rank keeps 1/world_size of every parameter, gradient and optimizer state. A block's full weights are
all-gathered just before its forward (and again before its backward) and freed after; gradients are
reduce-scattered, so each rank updates only its shard. The result equals DDP's, step for step, at about
1.5x DDP's communication volume and a fraction of its memory.

    >>> # in a process group of 2: ddpkit run --nproc-per-node 2 script.py
    >>> model = FSDP().wrap(build_model(...), runtime)          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime, broadcast_buffers
from ddpkit.core.version import require_torch
from ddpkit.strategies import split
from ddpkit.strategies.base import Strategy, state_dicts, uncompiled
from ddpkit.strategies import state as state_layouts


FSDP_ON_CPU = "2.7"  # the torch whose FSDP2 runs on the CPU (gloo)
# Where FSDP2 lives: public in torch.distributed.fsdp from torch 2.6, in torch.distributed._composable.fsdp before.
FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def fsdp2():
    """The module that holds FSDP2's ``fully_shard`` and ``FSDPModule`` on this torch (imported here)."""
    import importlib

    for name in FSDP2_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "fully_shard"):
            return module
    raise ImportError(f"no fully_shard in {' or '.join(FSDP2_MODULES)} (torch {torch.__version__})")


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by ``fully_shard``, without importing FSDP (nothing is sharded before)."""
    import sys

    return any(isinstance(model, sys.modules[name].FSDPModule) for name in FSDP2_MODULES
               if hasattr(sys.modules.get(name), "FSDPModule"))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks gathered one at a time: the model's pieces when ddpkit can cut it, else its children.

    The fewer parameters one unit holds, the less memory the gathered unit takes at its peak; each unit
    costs one all-gather and one reduce-scatter per step.
    """
    try:
        candidates = [module for _, module in split.pieces(model)]
    except UsageError:
        candidates = list(model.children())
    return [module for module in candidates if any(True for _ in module.parameters())]


@dataclasses.dataclass(frozen=True)
class FSDP(Strategy):
    name: ClassVar[str] = "fsdp"
    shards_model: ClassVar[bool] = True
    sharded_checkpoints: ClassVar[bool] = True
    shards_optimizer: ClassVar[bool] = True
    eval_lockstep: ClassVar[bool] = True  # each forward all-gathers: every rank runs as many
    in_replica_groups: ClassVar[bool] = True  # HSDP: sharded inside each group, each shard averaged across them

    def check(self, *, world_size: int, cuda_count: int, batch_size: int | None = None,  # noqa: ARG002
              build_model=None) -> None:
        if cuda_count == 0:  # the launcher says it once, before any process starts
            require_torch(FSDP_ON_CPU, "`strategy` fsdp on the CPU")

    def wrap(self, model: nn.Module, runtime: Runtime, *, example=None) -> nn.Module:  # noqa: ARG002
        """Shard ``model`` over every rank of the process group, block by block, then the rest at the root."""
        if runtime.backend is None:
            raise UsageError("`strategy` fsdp needs a process group; start it with a launcher (ddpkit run / torchrun)")
        if runtime.device.type == "cpu":
            # Before, FSDP2 makes CUDA streams whatever the device (pytorch#136843, #145935).
            require_torch(FSDP_ON_CPU, "`strategy` fsdp on the CPU")
        fully_shard = fsdp2().fully_shard  # imported on use: it adds 0.6 s to every ddpkit command
        model = model.to(runtime.device)
        for unit in shard_units(model):
            fully_shard(unit)
        fully_shard(model)
        return model

    def set_gradient_sync(self, model: nn.Module, enabled: bool, *, first_backward: bool) -> None:  # noqa: ARG002
        uncompiled(model).set_requires_gradient_sync(enabled)  # FSDP's no_sync: reduce-scatter on the last micro-step

    def sync_buffers(self, model: nn.Module, runtime: Runtime) -> None:
        broadcast_buffers(model, runtime)  # FSDP never synchronises buffers: rank 0's, as model.pt holds

    def eval_module(self, model: nn.Module) -> nn.Module:
        return model  # through FSDP, which gathers each block's weights

    def full_model_state(self, model: nn.Module, runtime: Runtime) -> dict[str, torch.Tensor] | None:
        state = state_dicts().get_model_state_dict(model, options=full_options())
        return state if runtime.is_main else None

    def full_optimizer_state(self, model: nn.Module, optimizer, runtime: Runtime) -> dict | None:
        state = state_dicts().get_optimizer_state_dict(model, optimizer, options=full_options())
        return state if runtime.is_main else None

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        # Every rank holds the whole state (each read the file): each keeps its own shard of it.
        state_dicts().set_model_state_dict(model, state, options=full_options(cpu_offload=False))

    def load_optimizer_state(self, model: nn.Module, optimizer, saved: dict, names: list[str], check) -> None:
        named = saved if state_layouts.is_named(saved) else state_layouts.numbered_to_named(saved, names)
        check(optimizer, named)
        state_dicts().set_optimizer_state_dict(model, optimizer, named, options=full_options(cpu_offload=False))


def full_options(cpu_offload: bool = True):
    """Whole (unsharded) state dicts; with ``cpu_offload`` gathered to rank 0's CPU only."""
    return state_dicts().StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
