"""Each rank's progress, marked as it goes: its phase (data, forward, backward, optimizer, ...), its step,
and the seconds spent in each phase.

The training thread of each rank marks its phase (``mark``); a ``Pace`` adds up the seconds spent in each.
Under DDP, the strategy's hooks split the time this rank spent waiting for the others out of forward (DDP's
buffer broadcast) and backward (from the last gradient computed here to the end of the all-reduce) into the
phase ``wait``. What is left, data + forward + backward + optimizer, is the rank's own step time: what it would
take alone. The watch (``ddpkit.watch``) reads these marks: the heartbeat names a rank that stopped, and
``ddpkit.watch.pace`` compares the ranks' own step times.

Cost: one clock read and a few additions per mark (a handful per step), and under DDP one clock read per
parameter in backward. Measured on the host: on a GPU, a phase's time is the time the host spent in it, and
the kernels it launched run on; the host catches up wherever it waits for the device (``.item()``, the
optimizer of a synchronising step), so a slow GPU shows in the phase where the host waits for it.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time


PHASES = ("starting", "running", "data", "forward", "backward", "wait", "optimizer", "evaluate", "checkpoint", "busy")
OWN = ("data", "forward", "backward", "optimizer")  # a rank's own step: everything but waiting for the others
WORKING_ALONE = ("checkpoint", "busy")  # phases in which a rank holds the others up by design


_current: Pace | None = None


class Pace:
    """This rank's place in training, kept by its training thread: its phase and step, when it last moved,
    its typical step time, and the seconds spent in each phase since ``reset``."""

    def __init__(self):
        self.step, self.phase, self.moved = 0, "starting", time.monotonic()
        self.step_s: float | None = None  # a moving average of the time between optimizer steps
        self._stepped_at: float | None = None
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0  # optimizer steps since reset
        self.grads_at = 0.0  # when backward last produced a gradient here (the DDP strategy's hooks)
        self.active = self.moved  # when this rank was last seen at work without a mark (``touch``, the watch)
        self._own_at_step: float | None = None  # this rank's own seconds at its last step (None: no step yet)
        self._own_steps: collections.deque[float] = collections.deque(maxlen=KEPT_STEPS)  # own step times since reset

    def mark(self, phase: str, step: int | None = None) -> None:
        now = time.monotonic()
        if self.phase == "backward" and self.grads_at > self.moved:
            # The all-reduce outlasts this rank's own backward: from its last gradient on, it waited.
            self.seconds["backward"] += self.grads_at - self.moved
            self.seconds["wait"] += now - self.grads_at
        else:
            self.seconds[self.phase] += now - self.moved
        if step is not None and step != self.step:
            if self._stepped_at is not None:  # the first step (warm-up, compile) is not typical
                took = now - self._stepped_at
                self.step_s = took if self.step_s is None else 0.8 * self.step_s + 0.2 * took
            self._stepped_at, self.step = now, step
            self.steps += 1
            own = self.own_seconds()
            if self._own_at_step is not None:
                self._own_steps.append(own - self._own_at_step)
            self._own_at_step = own
        self.phase, self.moved = phase, now

    @property
    def idle_s(self) -> float:
        """Seconds since this rank last moved: a mark, or work seen without one."""
        return time.monotonic() - max(self.moved, self.active)

    def own_seconds(self) -> float:
        """Seconds spent in this rank's own phases (``OWN``) since ``reset``, up to the last mark."""
        return sum(self.seconds[phase] for phase in OWN)

    def reset(self) -> None:
        """Count the phases' seconds and the steps from now on."""
        self.mark(self.phase)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._own_at_step = None if self._own_at_step is None else 0.0
        self._own_steps.clear()

    def per_step(self) -> list[float]:
        """Seconds per optimizer step since ``reset`` in each of OWN's phases, then in ``wait``, then how much its own
        step time varies from one step to the next (``spread``: the noise a slowdown must stand out of)."""
        self.mark(self.phase)  # the phase in progress counts up to now
        steps = max(self.steps, 1)
        return [*(self.seconds[phase] / steps for phase in (*OWN, "wait")), spread(self._own_steps)]


KEPT_STEPS = 4096  # own step times kept for their spread: the last this many since reset
MAD_TO_SD = 1.4826  # the median absolute deviation times this estimates a normal spread's standard deviation


def spread(values) -> float:
    """A robust standard deviation of ``values``: their median absolute deviation, scaled (0 for fewer than 2).
    One step that stalled (a collection, a page fault) moves it little, where it would double a standard deviation."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(value - middle) for value in values)


def current() -> Pace | None:
    """The Pace that ``mark`` reaches now (a Job's, while it is open), or None."""
    return _current


def mark(phase: str, step: int | None = None) -> None:
    """This rank is now in ``phase`` (at optimizer step ``step``, when given); a no-op outside a Job."""
    pace = _current
    if pace is not None:
        pace.mark(phase, step)


def phase() -> str | None:
    """The phase this rank is in (a Job's, while it is open), or None outside a Job."""
    pace = _current
    return None if pace is None else pace.phase


def touch() -> None:
    """This rank is at work (a forward of its model, say) without changing its phase; a no-op outside a Job."""
    pace = _current
    if pace is not None:
        pace.active = time.monotonic()


def switch(phase: str, *, after: tuple[str, ...]) -> None:
    """Mark ``phase`` if this rank is now in one of the phases ``after`` (a hook inside a model's forward,
    which runs in training and in evaluation alike, moves only a training step on)."""
    pace = _current
    if pace is not None and pace.phase in after:
        pace.mark(phase)


def grads_ready(*_) -> None:
    """A gradient was just computed here: a parameter's post-accumulate-grad hook."""
    pace = _current
    if pace is not None:
        pace.grads_at = time.monotonic()


@contextlib.contextmanager
def kept(pace: Pace | None):
    """In this block, ``mark``, ``busy`` and the strategies' hooks reach ``pace`` (nothing when None); the one
    before is back after."""
    global _current
    before, _current = _current, pace
    try:
        yield pace
    finally:
        _current = before


@contextlib.contextmanager
def busy():
    """A block in which this rank works alone while the others wait for it (rank 0 writing a large file,
    evaluating on its own): however long it takes, the stall watch does not call it a stall while the rank
    is alive."""
    pace = _current
    before = pace.phase if pace is not None else None
    mark("busy")
    try:
        yield
    finally:
        if before is not None:
            mark(before)
