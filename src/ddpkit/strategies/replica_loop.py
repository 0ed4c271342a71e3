"""What ``ddpkit.Job`` does under replica groups (``ddpkit run --replica-groups R``), so that a script's own loop
runs unchanged: the model and optimizer wrapped by ``ReplicaGroup.setup``, each batch tried again until its step
is committed, the step count and the schedulers following the committed steps, and a restarted group's copy of
the live groups' state taken before its loop starts.

The state a joining group copies (``Loop.state_dict``) is read by torchft in a thread of the group that sends it,
while that group's loop goes on. What it holds is stable from one commit to the next quorum: the loaders' positions
are the ones noted at the last commit (the loop fetches the next batch meanwhile), the schedulers step right after
the commit, before the next quorum is asked for.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from ddpkit.core.errors import UsageError
from ddpkit.core.logs import logger


class RunFinished(SystemExit):
    """The other replica groups trained to the end while this one was away: it stops (exit status 0), writing
    nothing, instead of training alone from an older state."""

    def __init__(self, group: int):
        logger.info(f"replica group {group}: the other groups have finished the run; this one stops here, "
                    "writing nothing")
        super().__init__(0)


class Loop:
    """The replica-group side of one ``Job``'s loop: ``job`` (its loaders, ``global_step``) and its ``group``."""

    def __init__(self, job, group):
        self.job, self.group = job, group
        self.schedulers: list[Any] = []  # stepped once per committed step; copied by a joining group
        self.loaders: list[Any] = []  # the training loaders (DeviceLoader), whose positions a joining group copies
        self.joined = False  # the loop may begin (after the join, if this group copied anything)
        self.copied = False  # this group copied the live groups' state before its loop
        self.joining = False
        self._positions: list[dict[str, int]] = []  # every loader's position at the last commit
        self._handed_at = 0  # the groups' step count when the training loader handed its last batch over

    # -- the state a joining group copies

    def state_dict(self) -> dict[str, Any]:
        return {"loaders": self._positions, "schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
                "scaler": self.job.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler, saved in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(saved)
        if state["scaler"]:
            self.job.scaler.load_state_dict(state["scaler"])
        if self.joined:
            return  # copied inside the loop (a group left behind): the loaders move on by replay()
        positions = state["loaders"]
        if len(positions) != len(self.loaders):
            raise UsageError(f"the live groups have {len(positions)} training loader(s) and this one "
                             f"{len(self.loaders)}: every group must run the same script, and make its training "
                             "loaders before ckpt.resume and the loop")
        for loader, position in zip(self.loaders, positions):
            loader.load_state_dict(position)
            if position["samples"] >= loader.steps_per_epoch * loader.global_batch:  # at an epoch's end: the next
                loader.load_state_dict({**position, "epoch": position["epoch"] + 1, "samples": 0})

    def note_positions(self) -> None:
        """After a commit: where each loader stands (the next batch's position)."""
        self._positions = [loader.state_dict() for loader in self.loaders]

    # -- the loop

    def join(self, read=None):
        """Before the loop's first step, at the first of ``Checkpointer.resume`` (``read``: its reading of a
        checkpoint, which sets the job's step), a read of a training loader's ``epoch`` and its first pass: a
        restarted process copies the live groups' state (and reads no checkpoint); otherwise ``read()``, and the
        groups count the steps from the job's. Returns what ``read`` returned (None without it, or when this group
        copied the others' state). A ``read`` after the join reads the checkpoint and counts from it, unless this
        group copied the others' state, which is newer."""
        if self.joining:
            return None  # reading the loaders' position while joining
        if self.joined:
            if read is None:
                return None
            if self.copied:  # the live groups' state is newer than any checkpoint
                logger.info(f"replica group {self.group.group}: not resuming from a checkpoint: this group has the "
                            "live groups' state")
                return None
            resumed = read()
            self.group.resume_at(self.job.global_step)
            self.note_positions()
            self._handed_at = self.job.global_step
            return resumed
        self.joining = True
        try:
            return self._join(read)
        finally:
            self.joining = False

    def _join(self, read):
        group = self.group
        if group.restarts > 0:
            if group.others_finished():
                raise RunFinished(group.group)
            group.resume_at(self.job.global_step)
            self.note_positions()
            if group.join():
                self.joined = self.copied = True
                self.job.global_step = self._handed_at = group.step
                epoch = f", epoch {self.loaders[0].epoch + 1}" if self.loaders else ""
                logger.info(f"replica group {group.group}: rejoined at step {group.step}{epoch}, with the live "
                            "groups' state" + (" (no checkpoint read)" if read is not None else ""))
                return None
        resumed = read() if read is not None else None
        group.resume_at(self.job.global_step)
        self.note_positions()
        self.joined, self._handed_at = True, self.job.global_step
        return resumed

    def replay(self) -> int:
        """What a training loader hands next (``DeviceLoader.replay``): the same batch (-1) after a dropped step,
        the next (0), or k batches further after a step in which this group copied the others' state (the groups
        committed the steps between without it)."""
        outcome, self.group.last_outcome = self.group.last_outcome, None
        if outcome is None:  # no step on the last batch
            return 0
        # From the job's count, not the outcome's: a copy taken in the step's quorum moved the groups' count before
        # the step began.
        before, self._handed_at = self._handed_at, self.group.step
        return self._handed_at - before - 1

    def committed(self) -> bool:
        """After an optimizer step: whether the groups committed it (a dropped one leaves their step count as the
        job's)."""
        return self.group.step != self.job.global_step

    def after_commit(self) -> None:
        """The job's step count follows the groups' (more than one step on when this group copied their state);
        the loaders' positions noted for a group that joins. Raises ``RunFinished`` when this group trains alone
        because the others have finished."""
        group = self.group
        self.job.global_step = group.step
        self.note_positions()
        if group.last_participants < group.groups and group.others_finished():
            raise RunFinished(group.group)

    def dropped(self) -> bool:
        """Whether the last optimizer step was dropped (its batch comes again)."""
        outcome = self.group.last_outcome
        return outcome is not None and outcome[0] == outcome[1]

    def follow_commits(self, scheduler):
        """``scheduler``, whose ``step()`` (the script's own, after ``optimizer.step()``) does nothing after a dropped
        step, and whose state a joining group copies. Its class becomes a subclass of its own with that ``step``
        (an attribute of the object would go into its ``state_dict()``, which is pickled for a joining group)."""
        if scheduler in self.schedulers:
            return scheduler
        self.schedulers.append(scheduler)
        FOLLOWED[scheduler] = self
        scheduler.__class__ = committed_only(type(scheduler))
        return scheduler


FOLLOWED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> the Loop whose commits it follows


@functools.cache
def committed_only(kind: type) -> type:
    """``kind`` (an LR scheduler's class) whose ``step()`` does nothing after a dropped optimizer step."""
    if getattr(kind, "follows_commits", False):
        return kind

    def step(self, *args, **kwargs):
        loop = FOLLOWED.get(self)
        if loop is not None and loop.dropped():
            return None  # the optimizer's step was dropped: so is the schedule's
        return super(following, self).step(*args, **kwargs)

    following = type(kind.__name__, (kind,), {"step": step, "follows_commits": True, "__module__": kind.__module__,
                                              "__qualname__": kind.__qualname__})
    return following
