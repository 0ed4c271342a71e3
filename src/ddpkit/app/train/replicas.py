"""``ddpkit train`` under ``--replica-groups``: joining this process's group, and the hand-overs between groups
that the epoch loop raises and the run catches (a group that rejoined at the others' step, a group that finds the
others finished). The groups themselves are ``ddpkit.strategies.replica_groups``."""

from __future__ import annotations

import os

from ddpkit.app.train.state import Position, RunState
from ddpkit.core.logs import logger
from ddpkit.watch import heartbeat


def in_a_replica_group() -> bool:
    """Whether ``ddpkit train --replica-groups R`` started this process as one of a group's."""
    from ddpkit.core.env import REPLICA_GROUP

    return REPLICA_GROUP in os.environ


def replica_group(stall_timeout: float):
    """This process's ``ReplicaGroup`` when ``ddpkit train --replica-groups R`` started it (None otherwise); its
    settings are checked first (``TrainConfig.check_for_replica_groups``)."""
    if not in_a_replica_group():
        return None
    from ddpkit.strategies.replica_groups import ReplicaGroup, settings_for

    return ReplicaGroup(**settings_for(heartbeat.stall_setting(stall_timeout)))


def opens_the_run(replica) -> bool:
    """Whether this process prepares the output folder for a fresh run (sets the earlier run's checkpoints aside,
    drops metrics past the resumed epoch): every process of a plain run; under replica groups group 0's first
    process only, not a group that joins or rejoins a run under way."""
    return replica is None or (replica.group == 0 and replica.restarts == 0)


def others_finished(replica, record: dict) -> dict:
    """Say that this replica group stops because the others finished the run; ``record``."""
    logger.info(f"replica group {replica.group}: the other groups have finished the run; this one stops here, "
                "writing nothing")
    return record


class OthersFinished(Exception):
    """The other replica groups trained to the end while this one was away: it stops, writing nothing."""


class Rejoined(Exception):
    """This replica group copied a healthy group's state at its last step and jumped to that group's step."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step

    def position(self, run_state: RunState) -> Position:
        """Where the groups stand at ``step``: its epoch, and the samples of it they have consumed."""
        epoch, step_in_epoch = divmod(self.step, run_state.steps_per_epoch)
        logger.info(f"replica group {run_state.replica.group} rejoined at step {self.step}: epoch {epoch + 1}, "
                    f"step {step_in_epoch} of {run_state.steps_per_epoch}")
        return Position(epoch=epoch, samples=step_in_epoch * run_state.global_batch, global_step=self.step)
