"""Heartbeats: every rank's progress, published through the job's store, and a stalled rank named in minutes.

A rank that stops advancing (stopped with SIGSTOP, asleep in Python, stuck in a read or a deadlock) makes
every other rank wait in the next collective, and PyTorch says so only when the collective's timeout runs
out (30 minutes by default), without naming the rank. Here each rank of a ``Job`` (so of ``ddpkit train``)
runs a daemon thread that publishes, every ``beat_interval_s()`` seconds, its step, its phase and how long ago it
last moved, to the job's own key-value store; ranks 0 and 1 read everyone's. A rank moves when its training
thread marks progress (``ddpkit.core.progress``: a batch from a loader ddpkit made or prepared, a forward of a
model it wrapped, a step of an optimizer it prepared) and whenever its process is seen at work without a mark (an
evaluation, sampling or upload of the script's own: ``ddpkit.watch.activity``). A stall is every rank standing
still at once: the ranks that wait for the one behind in a collective, and that one. A healthy loop, however
long its work between marks, is never called one. When no rank has moved for
``stall_after`` seconds, the lowest watcher that is not itself the culprit names the rank that holds the
others up, with its host, pid, last phase and step, how long it has been silent and its Python stack
(``py-spy dump``, taken from outside, which works on a stopped process too), then ends it, so the launcher
ends the job with the last good checkpoint intact. The others' errors are then not repeated. A stopped
rank 0 that serves the job's store (the spawn launcher, srun, mpirun, several machines; on one machine
torchrun's agent serves it) also stops the store: rank 1's guard thread names it when the store stops
answering.

``stall_after`` adapts: at least ``stall_s`` (default 60), at least ``STEP_TIMES`` of the slowest rank's
typical step, and never beyond the collective timeout. Watching starts once every rank has begun training
(setup, downloads and the first compile are not timed).

Cost: the pace's marks in the training thread, and one store write and (on two ranks) one read every few
seconds in a thread that holds the GIL for microseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from ddpkit.core.progress import PHASES, WORKING_ALONE, Pace
from ddpkit.watch import status
from ddpkit.watch.activity import Activity

INTERVAL_ENV = "DDPKIT_HEARTBEAT_S"  # how often a rank publishes its beat: a watch in seconds, not minutes


def interval_from(environ: dict[str, str]) -> float:
    """DDPKIT_HEARTBEAT_S, a number of seconds from 0.2 to 60, else 5: a shorter beat names a stalled rank sooner
    (the least stall timeout is three beats) for a store write per beat."""
    try:
        value = float(environ.get(INTERVAL_ENV, "5"))
    except ValueError:
        return 5.0
    return value if 0.2 <= value <= 60 else 5.0


def beat_interval_s() -> float:
    """How often a rank publishes its beat, and a watcher reads everyone's: DDPKIT_HEARTBEAT_S as the environment
    says when asked, not when ddpkit was imported (a process that imports ddpkit before its launcher's variables
    are set, or a notebook that sets it later, gets the interval it set)."""
    return interval_from(os.environ)


DEFAULT_STALL_S = 60.0  # `stall_s`' default: named within STALL + INTERVAL seconds, well inside 2 minutes
STEP_TIMES = 20  # a stall is never called before this many of the slowest rank's typical steps
LOST_BEATS = 3  # a rank whose beat did not change for this many intervals is stopped or frozen
WATCHERS = 2  # ranks 0 and 1 watch: one of them is always not the culprit
STALL_ENV = "DDPKIT_STALL_TIMEOUT_S"  # the default for Job(stall_timeout_s=None); set by `ddpkit run --stall-timeout`
STACK_TIMEOUT_S = 15.0
CLOSE_WAIT_S = 2.0  # at a job's normal end, how long rank 0 waits for the others' last beats for its status
STORE_TIMEOUT_S = 30.0  # the heartbeat's store calls; the job's own store waits as long as --timeout
EXIT_STALLED = 1  # a job ended for a stalled rank failed: not a usage error
KEY = "ddpkit/heartbeat"
RUNNER_FRAMES = ("ddpkit/app/watched.py", "<frozen runpy>")  # left out of a stack: below the script's own frames


def min_timeout_s() -> float:
    """Under a collective timeout this short, the timeout names the missing rank about as soon: no heartbeats."""
    return 2 * LOST_BEATS * beat_interval_s()


def stall_setting(stall_s: float | None) -> float:
    """``stall_s``, or DDPKIT_STALL_TIMEOUT_S, or DEFAULT_STALL_S; a finite number of seconds, 0 for off."""
    from ddpkit.core.errors import UsageError

    if stall_s is None:
        value = os.environ.get(STALL_ENV)
        if value is None:
            return DEFAULT_STALL_S
        try:
            stall_s = float(value)
        except ValueError:
            raise UsageError(f"{STALL_ENV} must be a number of seconds (0: off), got {value!r}") from None
    if not (math.isfinite(stall_s) and stall_s >= 0):
        raise UsageError(f"`stall_timeout_s` must be a finite number of seconds, 0 (off) or more, got {stall_s}")
    return stall_s


@dataclasses.dataclass(frozen=True)
class Seen:
    """One rank's last heartbeat as a watcher sees it now."""

    rank: int
    host: str
    pid: int
    step: int
    phase: str
    idle_s: float  # since this rank last moved (its own clock at publishing, plus the watcher's since then)
    silent_s: float  # since its beat last changed, on the watcher's clock
    step_s: float | None  # its typical step time, once measured
    memory_mb: float | None = None  # its process's resident memory, and its GPU's allocated memory (MiB)

    @property
    def lost(self) -> bool:
        return self.silent_s >= LOST_BEATS * beat_interval_s()


def stall_after(stall_s: float, timeout_s: float, seen: list[Seen]) -> float:
    """Seconds without progress anywhere after which the job is stalled: ``stall_s`` (or less, inside a short
    collective timeout), at least STEP_TIMES typical steps, and never beyond the timeout."""
    steps = [beat.step_s for beat in seen if beat.step_s]
    # Not below the time a lost beat takes to show (LOST_BEATS intervals), unless the timeout is shorter.
    floor = min(max(stall_s, LOST_BEATS * beat_interval_s()), 0.8 * timeout_s)
    return min(timeout_s, max(floor, STEP_TIMES * max(steps, default=0.0)))


def find_stall(seen: list[Seen | None], after_s: float) -> Seen | None:
    """The rank that holds the job up, or None while anyone moves, before every rank began training (unless
    one stopped meanwhile), or while the one behind works alone (a checkpoint, a ``busy`` block: no steps to count, and its beat says it is
    alive).

    Every rank waits for the one behind: it is a rank whose beat was lost (stopped or frozen), otherwise
    the one at the lowest step and phase, the longest idle of those."""
    if not seen or any(beat is None for beat in seen):
        return None
    lost = [beat for beat in seen if beat.lost]
    if not lost and any(beat.phase == "starting" for beat in seen):
        return None  # setup, downloads, a first compile: not timed while every rank lives
    if min(beat.idle_s for beat in seen) < after_s:
        return None
    pool = lost or seen
    culprit = min(pool, key=lambda beat: (beat.step, PHASES.index(beat.phase), -beat.idle_s))
    if culprit.phase in WORKING_ALONE and not culprit.lost:
        return None
    return culprit


class Heartbeat:
    """This rank's progress and, on a watcher, everyone's. ``start()`` begins, ``close()`` ends its thread."""

    def __init__(self, store, *, rank: int, world_size: int, stall_s: float, timeout_s: float,
                 pace: Pace | None = None, interval_s: float | None = None, status_path: str | None = None,
                 store_address: tuple[str, int] | None = None, activity: Activity | None = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.store_address = store_address  # (host, port) of the job's store, probed when it stops answering
        # Rank 0 writes everyone's last beats there (``ddpkit status`` reads it); None: nowhere.
        self.status_path = status_path if rank == 0 else None
        self.stall_s, self.timeout_s = stall_s, timeout_s
        self.interval_s = interval_s if interval_s is not None else beat_interval_s()
        self.pace = pace if pace is not None else Pace()  # the training thread's marks: its phase and step
        self.activity = activity  # signs of work between marks (CPU time, allocations): a rank at work is not idle
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.beats = 0
        self.verdict: str | None = None  # this watcher's error, once it called a stall
        self._last: dict[int, tuple[int, float]] = {}  # rank -> (its beat count, when this watcher saw it change)
        self.seen: list[Seen] = []
        self._done = threading.Event()
        self.answered = time.monotonic()  # when the store last answered this rank's heartbeat
        self._threads = [threading.Thread(target=self._run, name="ddpkit-heartbeat", daemon=True)]
        if rank == 1:
            self._threads.append(threading.Thread(target=self._guard, name="ddpkit-heartbeat-guard", daemon=True))

    # -- the thread

    def start(self) -> Heartbeat:
        self._publish()
        if self.rank < WATCHERS:
            # Every rank publishes as it starts (they all just passed the process group's rendezvous): a watcher
            # knows each rank's host and pid from the start, even a rank 0 that stops before the first check.
            with contextlib.suppress(RuntimeError):
                self.store.wait([f"{KEY}/{rank}" for rank in range(self.world_size)])
                self._check()
            self._write_status("running")  # rank 0: a status from the start
        for thread in self._threads:
            thread.start()
        return self

    def close(self, state: str = "ended") -> None:
        """End the threads; rank 0 writes the job's last status: ``state`` ("ended", "failed", "stopped"), or
        "stalled" when a watcher called a stall."""
        self._done.set()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=1.0)  # a thread stuck in a store call to a stopped rank 0 is a daemon
        if any(thread.is_alive() for thread in self._threads):
            return
        with contextlib.suppress(RuntimeError, OSError, ValueError):  # the store may be gone with rank 0
            self._publish()  # the last beat, where each rank ended, for rank 0's last status
            self.store.set(f"{KEY}/closed/{self.rank}", "1")
            if self.status_path is not None:
                if state == "ended":  # every rank closes within moments of the others: wait for their last beats
                    self.store.wait([f"{KEY}/closed/{rank}" for rank in range(self.world_size)],
                                    datetime.timedelta(seconds=CLOSE_WAIT_S))
                self._check()
        if self.status_path is not None:
            self._write_status("stalled" if self.stalled() is not None else state)

    def _write_status(self, state: str) -> None:
        if self.status_path is None or not self.seen:
            return
        mine = dataclasses.replace(self.seen[0], step=self.pace.step, phase=self.pace.phase, silent_s=0.0,
                                   step_s=self.pace.step_s, memory_mb=status.memory_mb())  # its own, as of now
        try:
            status.write(self.status_path, state=state, interval_s=self.interval_s, verdict=self.stalled(),
                         ranks=[dataclasses.asdict(beat) for beat in [mine, *self.seen[1:]]])
        except OSError as error:  # a full or read-only disk: the run goes on; its checkpoints will say so
            from ddpkit.core.logs import logger

            logger.debug(f"could not write {self.status_path}: {error}")

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self._publish()
                self.answered = time.monotonic()
                if self.rank < WATCHERS and self.verdict is None:
                    culprit = self._check()
                    if culprit is not None:
                        self._end(culprit)
                    else:
                        self._write_status("running")
            except (RuntimeError, OSError, ValueError) as error:
                if self._done.is_set() or "timeout" not in str(error).lower():
                    # Refused or reset: the store went with rank 0's process, and the job is ending.
                    from ddpkit.core.logs import logger

                    logger.debug(f"heartbeat stopped: {error}")
                    return

    def _guard(self) -> None:
        """Rank 1's second thread: ddpkit's launchers have rank 0's process serve the job's store, and a
        store call to a stopped process never returns (no timeout covers an unanswered request). When the
        heartbeat thread has had no answer for as long as a stall takes, rank 0 is stopped or frozen."""
        while not self._done.wait(self.interval_s):
            silent = time.monotonic() - self.answered
            if self.verdict is None and self.seen and silent >= stall_after(self.stall_s, self.timeout_s, self.seen):
                culprit = dataclasses.replace(self.seen[0], silent_s=silent, idle_s=self.seen[0].idle_s + silent)
                if self.store_address is not None and culprit.host != self.host:
                    from ddpkit.core.network import answers

                    if not answers(*self.store_address):  # no process stops a kernel from answering
                        self._cut_off(culprit)
                        return
                self._end(culprit, store=True)
                return

    def _cut_off(self, rank_0: Seen) -> None:
        """Rank 1, on another host than rank 0, whose store neither answers nor accepts a connection: this
        rank is cut off from it (a network partition, or rank 0's host is down). Say so and end this rank."""
        from ddpkit.core.logs import logger

        host, port = self.store_address
        self.verdict = (f"rank {self.rank} (host {self.host}) is cut off from the job's store at {host}:{port}, which "
                        f"rank 0 (host {rank_0.host}, pid {rank_0.pid}) serves: no answer for {rank_0.silent_s:.0f} s, "
                        f"and {host} accepts no connection: the network between {self.host} and {rank_0.host} is cut "
                        f"(a partition), or {rank_0.host} is down. Ending this rank; no checkpoint is written now, the "
                        "last one is kept")
        logger.error(self.verdict)
        sys.stderr.flush()
        os._exit(EXIT_STALLED)

    def _publish(self) -> None:
        self.beats += 1
        pace = self.pace
        if self.activity is not None and self.activity.working():
            pace.active = time.monotonic()
        record = {"host": self.host, "pid": self.pid, "step": pace.step, "phase": pace.phase,
                  "idle_s": round(pace.idle_s, 3), "beats": self.beats, "step_s": pace.step_s,
                  "memory_mb": status.memory_mb()}
        self.store.set(f"{KEY}/{self.rank}", json.dumps(record))

    def _check(self) -> Seen | None:
        keys = [f"{KEY}/{rank}" for rank in range(self.world_size)]
        if not self.store.check(keys):  # a rank has not published yet (multi_get would wait for it)
            return None
        values = self.store.multi_get(keys)
        now = time.monotonic()
        seen = []
        for rank, value in enumerate(values):
            record = json.loads(value)
            beats, since = self._last.get(rank, (None, now))
            if beats != record["beats"]:
                since = now
                self._last[rank] = (record["beats"], now)
            silent = now - since
            seen.append(Seen(rank=rank, host=record["host"], pid=record["pid"], step=record["step"],
                             phase=record["phase"], idle_s=record["idle_s"] + silent, silent_s=silent,
                             step_s=record["step_s"], memory_mb=record.get("memory_mb")))
        self.seen = seen
        culprit = find_stall(seen, stall_after(self.stall_s, self.timeout_s, seen))
        if culprit is None or culprit.rank == self.rank:
            return None
        if self.rank > 0 and culprit.rank != 0:
            return None  # rank 0 watches and is not the culprit: it speaks
        return culprit

    def _end(self, culprit: Seen, *, store: bool = False) -> None:
        """Say which rank stalled, with its stack, then end it (or, on another host, this rank). ``store``:
        known by the job's store, which the culprit serves, no longer answering."""
        from ddpkit.core.logs import logger

        others = ", ".join(f"{beat.rank} at step {beat.step} ({beat.phase})" for beat in self.seen
                           if beat.rank != culprit.rank)
        if store:
            state = (f"the job's store, which its process serves, has not answered for {culprit.silent_s:.0f} s; "
                     f"its last heartbeat was at step {culprit.step} in phase {culprit.phase}: the process is "
                     "stopped (SIGSTOP, a debugger) or frozen")
            others = others.replace(" at step", " last seen at step")
        elif culprit.lost and culprit.host != self.host:
            state = (f"its heartbeat stopped {culprit.silent_s:.0f} s ago, at step {culprit.step} in phase "
                     f"{culprit.phase}: the process is stopped (SIGSTOP, a debugger) or frozen in C code, or "
                     f"{culprit.host} can no longer reach this node (a network partition, or {culprit.host} is down)")
        elif culprit.lost:
            state = (f"its heartbeat stopped {culprit.silent_s:.0f} s ago, at step {culprit.step} in phase "
                     f"{culprit.phase}: the process is stopped (SIGSTOP, a debugger) or frozen in C code")
        else:
            state = (f"no progress for {culprit.idle_s:.0f} s, in phase {culprit.phase} at step {culprit.step}, while "
                     "its heartbeat goes on: it is alive but not advancing (a sleep, a deadlock, a stuck read, or a "
                     "collective the others never entered)")
        self.verdict = (f"rank {culprit.rank} (host {culprit.host}, pid {culprit.pid}) stalled: {state}. The other "
                        f"ranks wait for it: {others}. Ending the job; no checkpoint is written now, the last one "
                        "is kept")
        if not store:  # for the ranks that are not watchers, whose errors then stay unsaid
            with contextlib.suppress(RuntimeError, OSError):
                self.store.set(f"{KEY}/verdict", self.verdict)
        logger.error("%s\n%s", self.verdict, stack_of(culprit.host, culprit.pid))
        sys.stderr.flush()
        self._write_status("stalled")
        if culprit.host == self.host:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(culprit.pid, signal.SIGKILL)  # its launcher sees it fail and ends the job
        else:
            os._exit(EXIT_STALLED)  # the culprit's node is not ours to signal: our launcher ends this node

    def stalled(self) -> str | None:
        """This job's stall verdict, if any watcher called one (read from the store when this rank did not)."""
        if self.verdict is None:
            with contextlib.suppress(RuntimeError, OSError):
                if self.store.check([f"{KEY}/verdict"]):
                    self.verdict = self.store.get(f"{KEY}/verdict").decode()
        return self.verdict


def stack_of(host: str, pid: int) -> str:
    """The Python stack of process ``pid`` on ``host``, read from outside by py-spy (a stopped process too), or
    why not."""
    if host != socket.gethostname():
        return f"(its stack: run `py-spy dump --pid {pid}` on {host})"
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return f"(no stack: py-spy is not installed; `pip install py-spy`, then `py-spy dump --pid {pid}`)"
    try:
        done = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=STACK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"(no stack: py-spy failed: {error})"
    if done.returncode != 0:
        return f"(no stack: py-spy said: {(done.stderr or done.stdout).strip().splitlines()[-1:]})"
    # The frames below a script's own, of the runner that started it (``ddpkit run``: ddpkit.app.watched, runpy),
    # say nothing about where it is.
    lines = [line for line in done.stdout.rstrip().splitlines() if not any(frame in line for frame in RUNNER_FRAMES)]
    return f"its stack (py-spy dump --pid {pid}):\n" + "\n".join(lines)


@contextlib.contextmanager
def watch(runtime, *, pace: Pace, stall_s: float | None, timeout_s: float, status_path: str | None = None):
    """Heartbeats for this block, publishing ``pace`` (the job's), when the job has more than one rank and
    ``stall_s`` is not 0 or None. ``status_path``: rank 0 writes every rank's last beat there (``ddpkit.watch.status``).

    Yields the Heartbeat (None when off). An error out of the block after a stall was called ends the
    process with EXIT_STALLED and without a second report: the one that matters was said."""
    if not stall_s or runtime.backend is None or runtime.world_size < 2 or timeout_s < min_timeout_s():
        yield None
        return
    import torch.distributed as dist

    from ddpkit.core import process_group

    # A connection of its own: the thread never waits on ours.
    store = process_group.own_connection(dist.distributed_c10d._get_default_store())
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    address = (runtime.env.master_addr, runtime.env.master_port) if runtime.env.master_port else None
    beat = Heartbeat(store, rank=runtime.rank, world_size=runtime.world_size, stall_s=stall_s,
                     timeout_s=timeout_s, pace=pace, status_path=status_path, store_address=address,
                     activity=Activity(threading.get_ident(), runtime.device)).start()
    ended = "stopped"  # by a signal, or SystemExit: what the block raised that is not an Exception
    try:
        yield beat
        ended = "ended"
    except Exception:
        ended = "failed"
        if beat.stalled() is not None:
            raise SystemExit(EXIT_STALLED) from None
        raise
    finally:
        beat.close(ended)
