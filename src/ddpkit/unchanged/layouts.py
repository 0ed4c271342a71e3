"""Where a model's training state lives (``ddpkit run --unchanged --shard auto|always|never``).

- ``replica``: every rank holds it all, parameters, gradients and optimizer state (DDP, ``in_place``);
- ``zero2``: gradients and optimizer state sharded, parameters whole from a block's forward to its backward (FSDP2
  with ``reshard_after_forward=False``, ZeRO-2's layout);
- ``full``: parameters too, each block gathered for its forward and again for its backward (ZeRO-3's).

``auto`` decides on CUDA at a model's first training call, from an estimate: its gradients (its parameters' bytes)
and its optimizer's state (bytes per parameter byte by the optimizer's kind: ``STATE_PER_PARAMETER``), against the
device's free memory less a quarter of its total kept for activations. The least sharding that fits wins; on the CPU
``auto`` keeps the replica.
"""

from __future__ import annotations

import dataclasses

import torch

SHARDING = ("auto", "always", "never")
# The oldest torch that shards an unchanged script as one device trains it: before, clip_grad_norm_ over FSDP2's
# sharded gradients adds its epsilon to each rank's part of the norm (2.7 to 2.9; nanoGPT's original ends 1e-2 from
# one process on 2.7, 8.6e-5 without clipping), measured exact on 2.10, 2.11 and 2.15. Below it ``auto`` keeps
# replicas and ``always`` is refused.
SHARD_IN_PLACE = "2.10"
LAYOUTS = ("replica", "zero2", "full")
SAID = {"replica": "stays a whole replica on each of the {n} processes",
        "zero2": "has its gradients and optimizer state sharded {n} ways, its parameters whole during a step "
                 "(ZeRO-2's layout)",
        "full": "is sharded {n} ways in place: its parameters, gradients and optimizer state (FSDP2)"}
ACTIVATIONS = 0.25  # the share of the device's memory kept for activations, which no estimate at the first call sees
ASSUMED = 2.0  # an optimizer of a kind not known here, or none built yet: Adam's two moments

# The optimizer's state, in bytes per byte of the parameter it steps (its moments are the parameter's dtype).
STATE_PER_PARAMETER = {"SGD": 0.0, "Adam": 2.0, "AdamW": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adamax": 2.0,
                       "Adagrad": 1.0, "Adadelta": 2.0, "RMSprop": 1.0, "Rprop": 2.0, "ASGD": 1.0, "LBFGS": 2.0}


def state_per_parameter(optimizer) -> tuple[float, str]:
    """The bytes of ``optimizer``'s state per parameter byte, and how it is known, from its kind and settings."""
    kind = type(optimizer).__name__
    if kind not in STATE_PER_PARAMETER:
        return ASSUMED, f"{kind}: assumed as Adam's"
    factor = STATE_PER_PARAMETER[kind]
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if kind == "SGD" and group.get("momentum", 0):
        return 1.0, "SGD's momentum"
    if group.get("amsgrad"):
        factor += 1.0
    if kind == "RMSprop":
        factor += float(bool(group.get("momentum", 0))) + float(bool(group.get("centered")))
    return factor, {0.0: f"{kind}: none", 1.0: f"{kind}'s one buffer"}.get(factor, f"{kind}'s {factor:g} buffers")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A model's training state at its first call, in bytes: its parameters, and its optimizer's state per
    parameter byte (``how`` says where the factor comes from)."""

    parameter_bytes: int
    state_factor: float
    how: str
    arriving: bool = False  # the parameters are not on the device yet: the script is moving them there

    def added(self, layout: str, world_size: int) -> float:
        """What ``layout`` adds on each rank to the memory in use now, where the whole parameters lie already (or,
        ``arriving``, are still to come)."""
        parameters, state = self.parameter_bytes, self.parameter_bytes * self.state_factor
        coming = parameters if self.arriving else 0
        if layout == "replica":
            return coming + parameters + state  # gradients and state, whole
        shards = (2 * parameters + state) / world_size  # the parameters' shards, the gradients' and the state's
        if layout == "zero2":
            return coming + shards  # the whole parameters stay, gathered from forward to backward
        return coming + shards - parameters  # the whole parameters freed: a block at a time is gathered


def estimate(parameters, optimizers, *, arriving: bool = False) -> Estimate:
    """The training state of a model with ``parameters``, stepped by ``optimizers`` (those that hold them);
    ``arriving``: the parameters are on their way to the device, not there yet."""
    parameters = list(parameters)
    parameter_bytes = sum(parameter.numel() * parameter.element_size() for parameter in parameters)
    if not optimizers:
        return Estimate(parameter_bytes, ASSUMED, "no optimizer yet: assumed Adam's two moments", arriving)
    factors = [state_per_parameter(optimizer) for optimizer in optimizers]
    return Estimate(parameter_bytes, sum(factor for factor, _ in factors), ", ".join(how for _, how in factors),
                    arriving)


def choose(estimate: Estimate, *, world_size: int, free: int, total: int) -> tuple[str, str]:
    """The least sharding whose state fits ``free`` bytes less the activations' room (``ACTIVATIONS`` of
    ``total``), and the figures that chose it, as one line's end."""
    budget = free - ACTIVATIONS * total
    layout = next((name for name in LAYOUTS[:2] if estimate.added(name, world_size) <= budget), "full")
    figures = (f"its training state adds {_size(estimate.added('replica', world_size))} as a replica "
               f"(parameters {_size(estimate.parameter_bytes)}{' arriving' if estimate.arriving else ''}, their "
               f"gradients, {estimate.how}), "
               f"{_size(estimate.added('zero2', world_size))} with gradients and optimizer state sharded {world_size} "
               f"ways; {_size(free)} free of {_size(total)}, {ACTIVATIONS:.0%} of it kept for activations")
    return layout, figures


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of ``device``; None for the CPU, where ``auto`` keeps the replica."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def least_of_all_ranks(memory: tuple[int, int], device: torch.device) -> tuple[int, int]:
    """The least (free, total) of any rank's: every rank then decides alike."""
    import torch.distributed as dist

    least = torch.tensor(memory, dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least[0]), int(least[1])


def _size(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if abs(size) >= 2**30 else f"{size / 2**20:.1f} MiB"
