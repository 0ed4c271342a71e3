"""The learning-rate schedule of ``ddpkit train``: a function of the optimizer step alone, so that a resumed run,
whatever wrote its checkpoint, is placed at its step from its own base rates."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

SCHEDULES = ("constant", "step", "cosine")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """``--schedule`` and the flags that shape it (``TrainConfig.lr_schedule``)."""

    kind: str = "constant"  # one of SCHEDULES
    epochs: int = 1  # of the whole run: cosine reaches 0 at its last step
    warmup_steps: int = 0
    step_epochs: int = 0  # step: every this many epochs (0: a third of ``epochs``)
    gamma: float = 0.1  # step: the factor


def lr_factor(schedule: Schedule, step: int, steps_per_epoch: int) -> float:
    """The multiplier of the base learning rate for optimizer step ``step`` (0-based) of the whole run.

    Warm-up rises linearly to 1 over ``warmup_steps``; then ``cosine`` decays to 0 at the last step of
    ``epochs``, ``step`` multiplies by ``gamma`` every ``step_epochs`` epochs, ``constant`` stays.
    """
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.kind == "cosine":
        total = max(schedule.epochs * steps_per_epoch - schedule.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - schedule.warmup_steps, total) / total))
    if schedule.kind == "step":
        every = schedule.step_epochs or max(1, schedule.epochs // 3)
        return schedule.gamma ** (step // max(steps_per_epoch, 1) // every)
    return 1.0


def make_scheduler(schedule: Schedule, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """PyTorch's LambdaLR over ``lr_factor``: its state_dict is plain numbers, loadable with weights_only."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(factor_at, schedule, steps_per_epoch))


def factor_at(schedule: Schedule, steps_per_epoch: int, step: int) -> float:
    return lr_factor(schedule, step, steps_per_epoch)


def place_scheduler(scheduler, step: int) -> None:
    """Put a LambdaLR at ``step`` from its own base rates, as if stepped there (a resume, whatever wrote it)."""
    scheduler.last_epoch = step
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base  # a loaded optimizer state brings the checkpoint's
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
