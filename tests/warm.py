"""``python -m ddpkit ARGS`` without starting Python and torch each time: the command runs in a process forked
from a warm interpreter (the standard library's forkserver, with ddpkit's command line and torchrun's agent
imported once per pytest process), as ``python -m ddpkit`` would run it.

What a fresh ``python -m ddpkit`` costs here is mostly importing torch (2.5-3 s of CPU on CI's cores), and the
suite starts about a hundred launchers: a 2-process, 1-epoch ``ddpkit train`` took 12.1 s of the machine's CPU
and 7 s started warm, 14.5-15.3 s and 9.4-10.5 s fresh (2026-11-27, two cores). The workers a launcher starts
cost most of what is left (about 5 s of CPU each: torch, and torch._dynamo, which DDP's constructor imports):
``tests/warm_ranks.py`` starts them warm too. What differs from a fresh interpreter, and where a test needs the real one
(``conftest.run_ddpkit(..., fresh=True)``): the process's command line (``/proc/PID/cmdline``) and its parent are
the forkserver's, and what modules read from the environment when they are imported was read once, from the
pytest process's environment (``IMPORT_TIME`` below: such runs start fresh).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
from multiprocessing import reduction

# What the launcher of `ddpkit run` and `ddpkit train` imports, once for all the launches of this pytest process.
PRELOAD = ["ddpkit.app.cli", "ddpkit.launch.launcher", "ddpkit.launch.rank_logs", "ddpkit.launch.rendezvous",
           "torch.distributed.run", "torch.distributed.elastic.agent.server.local_elastic_agent", "warm"]
# Variables a module reads when it is imported (torch's logging): a run that sets one starts a fresh interpreter.
IMPORT_TIME = ("TORCH_",)

_context = None
_interpreter_path: list[str] = []


def wanted(extra_env: dict[str, str]) -> bool:
    """Whether a run with these extra variables can start warm."""
    return not any(key.startswith(IMPORT_TIME) for key in extra_env)


def start(argv: list[str], env: dict[str, str], cwd: str, stdout: int, stderr: int):
    """Start ``python -m ddpkit ARGV`` warm, its output on the file descriptors ``stdout`` and ``stderr``; returns
    the started ``multiprocessing`` process (``pid``, ``join``, ``exitcode``)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    process = _context.Process(target=_main, args=(argv, env, cwd, interpreter_path(), _Fd(stdout), _Fd(stderr)),
                               daemon=False)
    process.start()
    return process


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


class _Fd:
    """A file descriptor handed to the forked process (a duplicate of it, through the forkserver)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(duplicate) -> int:
    return duplicate.detach()


def _main(argv: list[str], env: dict[str, str], cwd: str, interpreter_path: list[str], stdout: int, stderr: int) -> None:
    """In the forked process: become what ``python -u -m ddpkit ARGV`` started in ``cwd`` with ``env`` would be."""
    # What the forkserver imported is left out of the collector's walks (the launcher's last gc.collect(), ddpkit's
    # freeze_for_exit): a walk touches each object's header, which copies its page in a forked process. O(1), and
    # about 0.2 s of CPU less per launch. Here, in each launcher, not once in the forkserver as tests/warm_ranks.py's
    # server does: frozen at the forkserver's import of this module instead, a 1-process launch took 0.54 and 0.56 s
    # of CPU against 0.40 and 0.43 (ten launches each, alternating).
    gc.freeze()
    os.setsid()  # as subprocess's start_new_session: a test stops the launcher's whole group
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    become(env, cwd, cwd, interpreter_path)  # `python -m`: the current folder first
    if env.get("PYTHON_EXEC"):  # a run whose ranks start warm (tests/warm_ranks.py): so does what it starts as Python
        python_is(env["PYTHON_EXEC"])
    import ddpkit
    from ddpkit.app.cli import main

    sys.argv = [os.path.join(os.path.dirname(ddpkit.__file__), "__main__.py"), *argv]  # as `python -m ddpkit` sets it

    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code
    except BaseException as error:  # noqa: BLE001 - as the interpreter would: sys.excepthook, then status 1
        status = uncaught(error)
    run_exit_functions()
    sys.exit(status)


def known_modules() -> None:
    """Have ``inspect.getmodule`` learn the file of every module imported so far, as its first call in a process does
    (a realpath for each of some 2,000 modules). Called where the preloaded modules are imported, before the forks:
    each launcher's dynamic rendezvous asks it of every frame on its stack (torch records its caller with
    ``inspect.stack()``), about 0.2 s of CPU per launch otherwise. Later calls answer as they would have."""
    import inspect

    inspect.getmodule(inspect.currentframe())


# Imported last by the forkserver (PRELOAD), which runs `python -c "from multiprocessing.forkserver import main; ..."`
# (xdist's workers run `python -c` too, without that module).
if __name__ == "warm" and sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:
    known_modules()
