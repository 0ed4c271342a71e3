"""Optimizer-state layouts, and merging the state of pipeline stages.

Optimizer states come in two layouts. PyTorch's own ``optimizer.state_dict()`` numbers the parameters
(``state[0]``, ``param_groups[0]["params"] == [0, 1, ...]``); single, DDP and ZeRO checkpoints use it.
FSDP and pipeline checkpoints name them (``state["fc.weight"]``), as torch.distributed.checkpoint's
``get_optimizer_state_dict`` writes, because no rank has all parameters to number. Each strategy's
``load_optimizer_state`` reads either layout, converting between the two through the bare model's
parameter names (optimizers are built over the parameters in that order), so a checkpoint of one
strategy resumes under another.
"""

from __future__ import annotations

import torch.distributed as dist

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import Runtime, control_group

def merge_stages(replica: int, runtime: Runtime, mine, merge):
    """Gather the stages of pipeline 0 to rank 0 and merge them (the replicas hold the same values)."""
    gathered: list | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(mine if replica == 0 else None, gathered, dst=0, group=control_group(runtime))
    if not runtime.is_main:
        return None
    return merge([part for part in gathered if part is not None])


def merge_dicts(parts: list[dict]) -> dict:
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def merge_optimizer_states(parts: list[dict]) -> dict:
    """Named optimizer states of the stages as one: the states side by side, each group's names joined."""
    groups = [dict(group) for group in parts[0]["param_groups"]]
    for part in parts[1:]:
        for group, other in zip(groups, part["param_groups"]):
            group["params"] = [*group["params"], *other["params"]]
    return {"state": merge_dicts([part["state"] for part in parts]), "param_groups": groups}


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


def only(saved: dict, names: set[str]) -> dict:
    """The part of a named optimizer state for the parameters in ``names`` (one pipeline stage's)."""
    groups = [{**group, "params": [name for name in group["params"] if name in names]} for group in saved["param_groups"]]
    return {"state": {name: value for name, value in saved["state"].items() if name in names}, "param_groups": groups}
