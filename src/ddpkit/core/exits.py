"""Ending a process whose work is done: everything Python's own exit does for the program, then not the
interpreter's teardown.

    >>> from ddpkit.core import exits
    >>> exits.status_of(SystemExit(None)), exits.status_of(SystemExit(3)), exits.status_of(SystemExit("bye"))
    (0, 3, 1)

Why skip the teardown: a rank whose script returned can still die in it. gloo's worker threads, still held by a
DDP model or a process group that only the interpreter's last collections free, meet a finalizing interpreter and
call ``std::terminate`` ("terminate called without an active exception", signal 6): a run that did all its work
reported failed (1 in 10 plain torchrun runs of the tutorials' DDP demo). ``leave`` runs what a program may rely
on at exit (its non-daemon threads joined, its ``atexit`` handlers, its open files flushed) and then ends the
process with ``os._exit``, before any of that teardown.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
from typing import NoReturn

from ddpkit.core import signals
from ddpkit.core.errors import EXIT_USAGE, UsageError


def status_of(stop: SystemExit) -> int:
    """The exit status ``raise SystemExit(code)`` gives: 0 for None, the number, 1 for anything else (which Python
    prints on stderr: ``say_exit_message`` does)."""
    code = stop.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def say_exit_message(stop: SystemExit) -> None:
    """What Python prints for ``sys.exit("message")``: the message, on stderr."""
    if stop.code is not None and not isinstance(stop.code, int):
        print(stop.code, file=sys.stderr)


def leave(status: int) -> NoReturn:
    """End this process with ``status`` now, as the program would see a normal exit: its non-daemon threads
    joined (and thread pools shut down), its ``atexit`` handlers run, every open file flushed; then
    ``os._exit``, skipping the interpreter's teardown. From the main thread. A SIGTERM from now on raises nothing
    (``signals.leaving``): the status is decided."""
    signals.leaving()
    if threading.current_thread() is threading.main_thread():
        # What Python's exit does first (threading's own shutdown: thread pools told to stop, non-daemon threads
        # joined), then the exit handlers, as Py_FinalizeEx runs them.
        threading._shutdown()  # noqa: SLF001 - the interpreter's own first step of an exit
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers, in the order Python's exit runs them
    flush_open_files()
    os._exit(status)


def flush_open_files() -> None:
    """Flush every open file this process writes through Python (its own, and sys.stdout and sys.stderr): the
    interpreter's teardown would have, as it freed them."""
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    # Each type asked once: io's classes are abstract ones, whose issubclass is a call into Python, and a process
    # that holds torch._dynamo (which an optimizer imports) holds some 350,000 objects: 0.15 s of CPU at each exit
    # asked per object, 0.05 s per type.
    files: dict[type, bool] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some objects (torch's deprecated ones) warn of.
        kind = type(obj)
        is_file = files.get(kind)
        if is_file is None:
            is_file = files[kind] = issubclass(kind, (io.BufferedIOBase, io.TextIOBase))
        if is_file:
            _flush(obj)


def _flush(stream) -> None:
    try:
        if stream is not None and not stream.closed and stream.writable():
            stream.flush()
    except (OSError, ValueError) as error:  # a closed pipe, a full disk: nothing more to do for it at exit
        print(f"ddpkit: could not flush {getattr(stream, 'name', stream)!r} at exit: {error}", file=sys.__stderr__)


_hooked = False


def usage_errors_in_one_line() -> None:
    """From now on, a ``UsageError`` that reaches the top of this process (a script of its own on ``ddpkit.Job``
    without ``with``) is said in one line and ends the process with status 2, as inside ``with ddpkit.Job()``:
    not a traceback from every rank and status 1. Other exceptions go to the hook that was there."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(kind, error, trace):
        if not issubclass(kind, UsageError) or threading.current_thread() is not threading.main_thread():
            previous(kind, error, trace)
            return
        from ddpkit.core.logs import report_usage_error

        if isinstance(sys.stderr, io.StringIO):
            # init_process_group's own hook, around this one, holds stderr in a buffer that it prints after this
            # hook returns, which it never does: say the line on the process's stderr.
            sys.stderr = sys.__stderr__
        report_usage_error(error)
        leave(EXIT_USAGE)

    sys.excepthook = hook
