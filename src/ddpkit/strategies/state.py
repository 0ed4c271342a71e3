"""The whole model's and optimizer's state on rank 0, whatever the strategy spread them over.

Every rank calls ``full_model_state`` / ``full_optimizer_state`` at the same point (they are collectives
for the strategies that shard); rank 0 gets the result, the others None. The model state has the bare
model's keys under every strategy, so ``model.pt`` and checkpoints load into the un-wrapped model.

Optimizer states come in two layouts. PyTorch's own ``optimizer.state_dict()`` numbers the parameters
(``state[0]``, ``param_groups[0]["params"] == [0, 1, ...]``); single, DDP and ZeRO checkpoints use it.
FSDP and pipeline checkpoints name them (``state["fc.weight"]``), as torch.distributed.checkpoint's
``get_optimizer_state_dict`` writes, because no rank has all parameters to number. ``load_optimizer_state``
reads either into any strategy's optimizer, converting between the two through the bare model's
parameter names (the trainer builds optimizers over the parameters in that order), so a checkpoint of one
strategy resumes under another.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.checkpoint import snapshot
from ddpkit.errors import UsageError
from ddpkit.process_group import Runtime, control_group
from ddpkit.strategies import unwrap
from ddpkit.strategies.fsdp import is_sharded
from ddpkit.strategies.pipeline import Pipeline


def _dcp():
    """torch.distributed.checkpoint's state_dict helpers, imported on use (they pull in FSDP: 0.6 s)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _full(cpu_offload: bool = True):
    return _dcp().StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def _is_zero(optimizer) -> bool:
    zero = sys.modules.get("torch.distributed.optim")  # not imported: no ZeroRedundancyOptimizer exists
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


def full_model_state(model: nn.Module, runtime: Runtime) -> dict[str, torch.Tensor] | None:
    """The bare model's state_dict on rank 0; None elsewhere. Every rank calls it.

    The tensors may be the model's own (on its device): ``checkpoint.snapshot`` them before the model changes.
    """
    if isinstance(model, Pipeline):
        return _merge_stages(model, runtime, snapshot(unwrap(model).state_dict()), _merge_dicts)
    if is_sharded(model):
        state = _dcp().get_model_state_dict(model, options=_full())
        return state if runtime.is_main else None
    return unwrap(model).state_dict() if runtime.is_main else None


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime) -> dict | None:
    """The optimizer's whole state on rank 0; None elsewhere. Every rank calls it."""
    if _is_zero(optimizer):
        # Each rank holds the state of its own share of the parameters; rank 0 collects them all.
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if runtime.is_main else None
    if isinstance(model, Pipeline):
        # No cpu_offload: with it only global rank 0 would get its stage's state, and every stage needs its own.
        mine = _dcp().get_optimizer_state_dict(unwrap(model), optimizer, options=_full(cpu_offload=False))
        return _merge_stages(model, runtime, snapshot(mine), _merge_optimizer_states)
    if is_sharded(model):
        state = _dcp().get_optimizer_state_dict(model, optimizer, options=_full())
        return state if runtime.is_main else None
    return optimizer.state_dict() if runtime.is_main else None


def _merge_stages(model: Pipeline, runtime: Runtime, mine, merge):
    """Gather the stages of pipeline 0 to rank 0 and merge them (the replicas hold the same values)."""
    gathered: list | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(mine if model.replica == 0 else None, gathered, dst=0, group=control_group(runtime))
    if not runtime.is_main:
        return None
    return merge([part for part in gathered if part is not None])


def _merge_dicts(parts: list[dict]) -> dict:
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def _merge_optimizer_states(parts: list[dict]) -> dict:
    """Named optimizer states of the stages as one: the states side by side, each group's names joined."""
    groups = [dict(group) for group in parts[0]["param_groups"]]
    for part in parts[1:]:
        for group, other in zip(groups, part["param_groups"]):
            group["params"] = [*group["params"], *other["params"]]
    return {"state": _merge_dicts([part["state"] for part in parts]), "param_groups": groups}


def is_named(saved: dict) -> bool:
    """Whether an optimizer state names its parameters (FSDP, pipeline) rather than numbering them."""
    for group in saved.get("param_groups", []):
        if group.get("params"):
            return isinstance(group["params"][0], str)
    return False


def named_to_numbered(saved: dict, names: list[str]) -> dict:
    """PyTorch's own layout, numbered in the bare model's parameter order.

    Each group's numbers are sorted: ``load_state_dict`` pairs them with the optimizer's parameters by
    position, and those are in the model's order, whatever order the named state listed them in (a
    pipeline's lists them stage by stage, in forward order).
    """
    index = {name: number for number, name in enumerate(names)}
    unknown = [name for group in saved["param_groups"] for name in group["params"] if name not in index]
    if unknown:
        raise UsageError(f"the checkpoint's optimizer state has parameters this model does not: {', '.join(unknown[:4])}")
    return {
        "state": {index[name]: value for name, value in saved["state"].items()},
        "param_groups": [{**group, "params": sorted(index[name] for name in group["params"])}
                         for group in saved["param_groups"]],
    }


def numbered_to_named(saved: dict, names: list[str]) -> dict:
    return {
        "state": {names[number]: value for number, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[number] for number in group["params"]]}
                         for group in saved["param_groups"]],
    }


def _only(saved: dict, names: set[str]) -> dict:
    """The part of a named optimizer state for the parameters in ``names`` (one pipeline stage's)."""
    groups = [{**group, "params": [name for name in group["params"] if name in names]} for group in saved["param_groups"]]
    return {"state": {name: value for name, value in saved["state"].items() if name in names}, "param_groups": groups}


def load_optimizer_state(model: nn.Module | None, optimizer: torch.optim.Optimizer, saved: dict, bare_names: list[str],
                         check) -> None:
    """Load a saved optimizer state of either layout into this strategy's optimizer.

    ``model``: the wrapped model the optimizer drives (None: a plain or DDP one). ``bare_names``: the
    un-wrapped model's parameter names in order (what numbered states count in).
    ``check(optimizer, state)``: raises a clear error when the state cannot drive this optimizer.
    """
    if model is None:
        if any(hasattr(p, "to_local") for group in optimizer.param_groups for p in group["params"]):
            raise UsageError("this optimizer drives sharded (FSDP) parameters: pass model= to Resumed.restore")
        model = nn.Identity()
    if isinstance(model, Pipeline) or is_sharded(model):
        named = saved if is_named(saved) else numbered_to_named(saved, bare_names)
        target = unwrap(model)
        if isinstance(model, Pipeline):
            named = _only(named, {name for name, _ in target.named_parameters()})
        check(optimizer, named)
        _dcp().set_optimizer_state_dict(target, optimizer, named, options=_full(cpu_offload=False))
        return
    numbered = named_to_numbered(saved, bare_names) if is_named(saved) else saved
    check(optimizer, numbered)
    optimizer.load_state_dict(numbered)  # moves the state to the parameters' device


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # an FSDP shard is a DTensor


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards, under FSDP and ZeRO)."""
    tensors = []
    for parameter in model.parameters():
        tensors.append(parameter)
        if parameter.grad is not None:
            tensors.append(parameter.grad)
    if optimizer is not None:
        inner = optimizer.optim if _is_zero(optimizer) else optimizer
        tensors.extend(value for per_parameter in inner.state.values() for value in per_parameter.values()
                       if isinstance(value, torch.Tensor))
    return sum(_local(tensor).numel() * tensor.element_size() for tensor in tensors)
