"""What one ``ddpkit train`` run works with once it is built (``RunState``), and where it goes on from
(``Position``): handed from the set-up (``app/train/trainer.py``) to the resume, the records and the epoch loop."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn as nn

from ddpkit import checkpoint, data
from ddpkit.app.train.config import TrainConfig
from ddpkit.job import Job


@dataclasses.dataclass
class Position:
    """Where training goes on: an epoch, the samples of it all ranks consumed, the optimizer steps so far."""

    epoch: int = 0  # the epoch to run next
    samples: int = 0  # samples of it all ranks together have consumed
    global_step: int = 0  # optimizer steps since the run began (names the checkpoints)
    partial: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # this rank's loss sum, count so far


@dataclasses.dataclass
class RunState:
    """What one training run works with, built once by ``start``."""

    cfg: TrainConfig
    job: Job
    model: nn.Module  # wrapped
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: data.DeviceLoader
    val_loader: data.DeviceLoader
    ckpt: checkpoint.Checkpointer
    steps_per_epoch: int
    global_batch: int  # samples of one optimizer step, every replica group taking part
    position: Position
    replica: Any = None  # this process's ReplicaGroup under --replica-groups
    # A replica group restarted after the others finished the run: it stops, having asked nobody for anything.
    too_late: bool = False

    @property
    def leads(self) -> bool:
        """Whether this process writes what the run keeps (checkpoints, metrics, model.pt): rank 0, and under
        replica groups rank 0 of the group that led the last step."""
        return self.job.is_main and (self.replica is None or self.replica.leads)

    def paused(self):
        """A block between steps (evaluation, a checkpoint) that the replica groups' fence does not time."""
        return self.replica.paused() if self.replica is not None else contextlib.nullcontext()
