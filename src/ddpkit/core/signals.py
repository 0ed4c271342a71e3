"""The one place where ddpkit installs signal handlers; none is installed at import.

    >>> import signal
    >>> from ddpkit.core import signals
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> previous = signals.catch((signal.SIGTERM,), signals.raise_terminated)
    >>> signal.getsignal(signal.SIGTERM) is signals.raise_terminated
    True
    >>> signals.restore(previous)
    >>> signal.getsignal(signal.SIGTERM) is before
    True

Who installs what, and for how long:
- ``ddpkit.setup`` (so ``distributed()`` and ``Job``): SIGTERM raises ``Terminated`` in the main thread,
  so ``finally`` blocks (teardown, a checkpoint's wait) still run; ``distributed()`` restores the
  previous handler when its block ends. A SIGTERM within ``REPEAT_WINDOW_S`` of the one that raised
  ``Terminated`` is the same stop said again, and is dropped, there and after (``restore_dropping_repeats``):
  Linux repeats a dead launcher's SIGTERM once for each of its threads as they end, and under Slurm a
  rank gets Slurm's SIGTERM and, a moment later, torchrun's agent's. Once the process is leaving
  (``leaving``: ``ddpkit.core.exits.leave``, its status decided, its exit handlers running) a SIGTERM raises
  nothing: the process ends as it was ending, and an exception raised inside an exit handler would only be
  printed as a traceback (a rank ending with its usage error while the launcher stops the others).
- ``ddpkit.stop_on_signal`` (``ddpkit train``'s loop): SIGTERM and SIGINT only raise a flag while the
  loop runs, so that every rank stops at the same step; restored when the loop ends.
- DataLoader worker processes ignore SIGTERM and SIGINT (``ignore_stop_signals``): their rank stops them.
  So at its exit a process that made such workers SIGKILLs those still running
  (``kill_children_ignoring_sigterm_at_exit``): multiprocessing's exit handler would SIGTERM them and wait
  forever (a loader whose pass an exception broke off, still held by the traceback).
- A rank a launcher started (torchrun's agent, ``ddpkit train --launcher spawn``) asks Linux for SIGTERM
  when that launcher ends (``end_with_parent``): a launcher killed with SIGKILL leaves no rank training on.
- Before a rank's first step (``starting`` to ``started``: waiting for the other ranks, in the rendezvous, in
  ``init_process_group``) SIGTERM and SIGINT end the process within a moment, in one line, with status 128 + the
  signal: there is nothing to save yet, and the wait is a call into C++ that Python's own handlers cannot interrupt
  (a rank whose peer never came outlived ``timeout 90`` by 45 minutes). A thread of ours reads the signals from
  Python's wakeup descriptor, which the C-level handler writes at once, wherever the main thread is.
Only the main thread may install handlers (Python's rule); elsewhere these functions do nothing.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType

Handler = Callable[[int, FrameType | None], object]


REPEAT_WINDOW_S = 1.0  # a second signal within this time of the first is taken as the same one


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM, so ``finally`` blocks (teardown, checkpoint) still run."""


_terminated_at: float | None = None  # when raise_terminated last raised (time.monotonic())
_leaving = False  # the process is ending (``leaving``): raise_terminated raises nothing


def leaving() -> None:
    """This process is ending with its status decided (``ddpkit.core.exits.leave``): from now on a SIGTERM
    that would raise ``Terminated`` is dropped. A launcher that stops a rank which is already leaving gets what it
    asked for, and if the exit hangs, the launcher's SIGKILL after its grace period ends it."""
    global _leaving
    _leaving = True


def raise_terminated(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - signal's signature
    """Raise ``Terminated``, unless a signal raised it less than ``REPEAT_WINDOW_S`` ago (the same stop), or the
    process is starting (``starting``), where the start's watcher ends it, or leaving (``leaving``)."""
    global _terminated_at
    if _leaving or is_repeat() or (_starting is not None and _watcher_running):
        return
    _terminated_at = time.monotonic()
    raise Terminated(128 + signum)


def is_repeat() -> bool:
    """Whether a signal now comes within ``REPEAT_WINDOW_S`` of the one that last raised ``Terminated``."""
    return _terminated_at is not None and time.monotonic() - _terminated_at <= REPEAT_WINDOW_S


def catch(signals: Iterable[int], handler: Handler | int) -> dict[int, object]:
    """Install ``handler`` for each of ``signals``; return the handlers it replaced, for ``restore``.

    An empty dict off the main thread, where Python allows no handler to be installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in signals:
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)
    return previous


def current(signals: Iterable[int]) -> dict[int, object]:
    """The handlers installed now for ``signals`` (empty off the main thread), for ``restore`` later."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in signals}


def restore(previous: dict[int, object]) -> None:
    """Put back the handlers ``catch`` replaced."""
    for sig, handler in previous.items():
        if handler is not None:  # None: a handler installed outside Python, which cannot be put back
            signal.signal(sig, handler)


def restore_dropping_repeats(previous: dict[int, object]) -> None:
    """Like ``restore``, for a block that ends because of ``Terminated``: until ``REPEAT_WINDOW_S`` after
    the signal that raised it, a repeat of it is dropped; after that, each signal gets its previous handler
    (the default one ends the process at once, as before).

    While ``previous`` is the default handler, a signal that is no repeat ends the process only once Python
    runs again (the main thread between two bytecodes), not in the middle of a call into C++: a teardown
    that hangs there is ended by the launcher's SIGKILL after its grace period.
    """
    for sig, handler in previous.items():
        signal.signal(sig, _unless_repeat(handler))


def _unless_repeat(handler: object) -> Handler:
    def handle(signum: int, frame: FrameType | None) -> None:
        if is_repeat():
            return
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        if callable(handler):
            handler(signum, frame)
        elif handler in (signal.SIG_DFL, None):
            signal.raise_signal(signum)  # its default action, now installed: the process ends of it
    return handle


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it ends


END_WITH_PARENT_ENV = "DDPKIT_END_WITH_PARENT"  # set by a parent that is not torchrun's agent (a Ray worker)


def end_with_parent_if_asked(environ=None) -> bool:
    """``end_with_parent`` in a process whose starter asked for it through DDPKIT_END_WITH_PARENT=1 (a rank that
    ``--launcher ray`` started from a Ray worker: when Ray kills the worker, its rank goes too)."""
    if (os.environ if environ is None else environ).get(END_WITH_PARENT_ENV) != "1":
        return False
    return end_with_parent()


def end_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have Linux send ``sig`` to this process when its parent ends, whatever ends it (SIGKILL included);
    return whether that is set (not on other systems).

    For a rank whose launcher started it: otherwise a launcher killed with SIGKILL leaves its ranks training
    on, holding their GPUs and ports. SIGTERM then stops the rank as a signal from the launcher would.
    Not for a script run by hand, whose parent is a shell: ``nohup`` must keep it running.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the parent ended before the request was made: nobody will send it now
        os.kill(os.getpid(), sig)
    return True


def ignore_stop_signals(worker_id: int = 0) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn signature
    """For loader worker processes: leave SIGTERM/SIGINT to their rank, which stops at a step boundary and
    ends them. torchrun signals a worker's whole process group; a loader process dying of it would abort
    the rank in the middle of the step it is meant to finish cleanly.
    """
    catch((signal.SIGTERM, signal.SIGINT), signal.SIG_IGN)


@functools.cache
def kill_children_ignoring_sigterm_at_exit() -> None:
    """Once per process: at exit, SIGKILL this process's daemonic children that ignore SIGTERM (loader workers,
    ``ignore_stop_signals``). multiprocessing's own exit handler ends daemonic children with SIGTERM and then
    waits for them, forever for these. atexit runs the later registration first, so this runs before it."""
    import atexit
    import importlib

    importlib.import_module("multiprocessing.util")  # registers that handler on import: before this one
    atexit.register(_kill_children_ignoring_sigterm)


def _kill_children_ignoring_sigterm() -> None:
    import multiprocessing

    doomed = [child for child in multiprocessing.active_children()
              if child.daemon and _ignores(child.pid, signal.SIGTERM)]
    if doomed and threading.current_thread() is threading.main_thread():
        # DataLoader's SIGCHLD handler would raise "worker killed by signal" into this exit: the process is leaving
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in doomed:
        child.kill()


def _ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores signal ``signum`` (False where /proc cannot say: not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next(line.split()[1] for line in status if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signum - 1) & 1)


# -- before the first step: a stop ends the process at once

_starting: str | None = None  # what this process does before its first step (None: past it, or not started)
_quiet = False  # the start's stop said at debug level only (its launcher says why it stopped its ranks)
_watcher_running = False
_wakeup = None  # (reader, writer): the socket pair Python's wakeup descriptor writes to, made once
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def starting(what: str, *, quiet: bool = False) -> None:
    """From now until ``started()``, SIGTERM or SIGINT end this process within a moment: one line saying that it
    stopped while ``what`` ("waiting for the other ranks at HOST:PORT"), then ``os._exit(128 + signal)`` (143, 130),
    its loader processes killed first. ``quiet``: that line at debug level (a launcher that stops its ranks says
    why itself). Called again, it says what the process does now. From the main thread (elsewhere: nothing)."""
    global _starting, _quiet
    if threading.current_thread() is not threading.main_thread():
        return
    if not _watch_signals():
        _starting = None  # nobody reads the signals: Python's handlers (raise_terminated) act as before
        return
    _starting, _quiet = what, quiet


def started() -> None:
    """The first step is taken (or the job ended before one): stop signals get their handlers again."""
    global _starting
    _starting = None


def _watch_signals() -> bool:
    """Point Python's wakeup descriptor at the thread that reads stop signals from it (started once); False where
    another owner (asyncio's loop) holds the descriptor: that one keeps it, and a stop goes the old way."""
    global _watcher_running, _wakeup
    if _wakeup is None:
        import socket

        reader, writer = socket.socketpair()
        writer.setblocking(False)
        _wakeup = (reader, writer)
    reader, writer = _wakeup
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        return False
    if previous not in (-1, writer.fileno()):  # someone else's: give it back
        signal.set_wakeup_fd(previous)
        return False
    if not _watcher_running:
        _watcher_running = True
        threading.Thread(target=_watch, args=(reader,), name="ddpkit-start-signals", daemon=True).start()
    return True


def _watch(reader) -> None:
    while True:
        try:
            received = reader.recv(64)
        except OSError:
            return
        if not received:
            return
        for signum in received:
            if signum in STOP_SIGNALS and _starting is not None:
                _leave_now(signum)


def _leave_now(signum: int) -> None:
    from ddpkit.core.logs import logger

    name = signal.Signals(signum).name
    (logger.debug if _quiet else logger.info)(f"stopped by {name} while {_starting}: before the first step, nothing "
                                              "to save")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing to flush into
            continue
    _kill_children_ignoring_sigterm()
    os._exit(128 + signum)
