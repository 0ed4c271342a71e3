"""What a process forked from a warm interpreter does to become what a fresh ``python`` would have started
(tests/warm_ranks.py's server forks the suite's launchers and ranks: torch, torchrun's agent and ddpkit imported once
per pytest run): its folder, variables, ``sys.path``, standard streams and ``sys.executable``, and what the interpreter
does with an exception that ends the program and at its exit.

What a fresh ``python -m ddpkit`` costs here is mostly importing torch (2.5-3 s of CPU on CI's cores), and the
suite starts about a hundred launchers: a 2-process, 1-epoch ``ddpkit train`` took 12.1 s of the machine's CPU
and 7 s started warm, 14.5-15.3 s and 9.4-10.5 s fresh (2026-11-27, two cores). What differs from a fresh
interpreter, and where a test needs the real one (``conftest.run_ddpkit(..., fresh=True)``): the process's command
line (``/proc/PID/cmdline``) and its parent are the server's, and what modules read from the environment when they
are imported was read once, from the pytest process's environment (``IMPORT_TIME`` below: such runs start fresh).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading

# Variables a module reads when it is imported (torch's logging): a run that sets one starts a fresh interpreter.
IMPORT_TIME = ("TORCH_",)

_interpreter_path: list[str] = []


def interpreter_path() -> list[str]:
    """The interpreter's own sys.path, without a script's folder and PYTHONPATH (asked of a fresh one, once)."""
    if not _interpreter_path:
        _interpreter_path[:] = json.loads(subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], env={**os.environ, "PYTHONPATH": ""},
            capture_output=True, text=True, check=True).stdout)
    return _interpreter_path


def become(env: dict[str, str], cwd: str, first: str, interpreter: list[str]) -> None:
    """In a forked process whose descriptors 1 and 2 are its output: what ``python -u`` started in ``cwd`` with ``env``
    has, its text streams unbuffered, its temporary folder found from ``TMPDIR``, and ``sys.path`` as Python makes
    it: ``first`` (a script's folder, or the current one under ``-m``), then PYTHONPATH, then ``interpreter``'s
    entries (``interpreter_path()``)."""
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from TMPDIR, as a fresh interpreter finds it
    extra = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [first, *extra, *interpreter]


def python_is(client: str) -> None:
    """In a forked process: the Python it starts is ``client`` (tests/warm_ranks.py's), so that what it starts as
    Python starts warm too: ddpkit's own children (a replica group's launcher; under a scheduler, `ddpkit run`'s
    script, which it starts with ``sys.executable``) and multiprocessing's spawn (``--launcher spawn``, a script's
    ``mp.spawn``). The client's folder holds the tools ddpkit looks for beside its Python (py-spy)."""
    sys.executable = client
    multiprocessing.set_executable(client)


def uncaught(error: BaseException):
    """What the interpreter does with an exception that ends the program, caught by its caller: ``sys.excepthook``
    (a traceback without the caller's own frame; or what the program hooked there, which may end the process itself,
    as ddpkit's one line for a UsageError does). Returns the exit code: 1, or what the hook exited with."""
    try:
        sys.excepthook(type(error), error, error.__traceback__.tb_next)
    except SystemExit as stop:
        return stop.code
    return 1


def run_exit_functions() -> None:
    """What the interpreter runs at its exit, which a forked process skips: it waits for the threads that are not
    daemons, runs atexit's functions and flushes the streams."""
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
