"""Each rank's whole output in ``OUTPUT_DIR/logs/rank<N>.log``; on the console rank 0 and the others' warnings
and errors.

torchrun hands each worker's stdout and stderr to a ``LogsSpecs`` (its plugin point for log redirection: the
entry point ``torchrun.logs_specs``, which ddpkit's package declares as ``ddpkit``, so ``torchrun --logs-specs
ddpkit --log-dir DIR`` works too). ``RankLogs`` gives each worker a named pipe for each stream, read in the
launcher by one thread per pipe, which:

* appends every byte to ``DIR/rank<N>.log`` (``N``: the global rank; a restarted job appends to the same
  file), as it comes, so what a rank wrote before it crashed is there;
* passes rank 0's bytes through to the launcher's own stdout and stderr unchanged (its progress bar too);
* shows a line of another rank only when it is a warning or an error: ddpkit's ``warning:``/``error:``
  lines, Python's warnings (``...Warning:``), PyTorch's C++ ``[W``/``[E`` log lines, and a traceback from its
  first line to the exception's, each prefixed with ``[rank<N>]:`` unless it has it already. With
  ``--log-level debug`` every line of every rank is shown.

A pipe rather than torchrun's plain files: stdout and stderr must land in one file, in the order they were
written, and torchrun opens each stream's file on its own (two writers at two offsets would overwrite each
other).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import sys
import tempfile
import threading
from typing import BinaryIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ddpkit.core.logs import LEVEL_ENV, RANK_LOGS_ENV

ENV = RANK_LOGS_ENV  # set in the workers: their output is kept in the rank files
ENTRY_POINT = "ddpkit"  # torchrun --logs-specs ddpkit
DRAIN_TIMEOUT_S = 10.0  # after the workers ended: a loader process they left may hold a pipe open

_copiers: list[threading.Thread] = []
_draining = threading.Event()  # the workers have ended: copy what is left in the pipes, then stop
POLL_MS = 200
_pipe_dirs: list[str] = []

# A line of a rank other than 0 that the console shows (after any "[rankN]:" prefix).
WARNING_OR_ERROR = re.compile(r"ddpkit: (warning|error):|\w*Warning: |^\[?[WE]\d{4} |^\s*\w*(Error|Exception)\b")
TRACEBACK = "Traceback (most recent call last):"
RANK_PREFIX = re.compile(r"^\[(rank|default)\d+\]:")


def path_for(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


class RankLogs(LogsSpecs):
    """torchrun's log redirection, to one file per rank and a filtered console (module docstring).

    torchrun's ``--redirects``, ``--tee`` and ``--local-ranks-filter`` do not apply: every rank is kept.
    """

    def __init__(self, log_dir: str | None = None, redirects=None, tee=None, local_ranks_filter=None) -> None:
        if not log_dir:
            raise ValueError("--logs-specs ddpkit needs --log-dir: the folder of the rank<N>.log files")
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        pipes = tempfile.mkdtemp(prefix="ddpkit-pipes-")
        _pipe_dirs.append(pipes)
        every_line = os.environ.get(LEVEL_ENV, "").lower() == "debug"
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            log = path_for(self.root_log_dir, rank)
            for stream, paths in (("stdout", dest.stdouts), ("stderr", dest.stderrs)):
                pipe = os.path.join(pipes, f"{local_rank}.{stream}")
                os.mkfifo(pipe, 0o600)
                paths[local_rank] = pipe
                # rank 0 passes through as it is; another rank's lines are chosen and prefixed
                lines = None if rank == 0 else ConsoleLines(rank, every_line)
                _start(pipe, log, getattr(sys, stream), lines)
            dest.error_files[local_rank] = os.path.join(pipes, f"{local_rank}.error.json")
        return dest


def _start(pipe: str, log: str, console, lines: ConsoleLines | None) -> None:
    thread = threading.Thread(target=_copy, args=(pipe, log, console, lines),
                              name=f"ddpkit-rank-log-{os.path.basename(pipe)}", daemon=True)
    thread.start()
    _copiers.append(thread)


def _copy(pipe: str, log: str, console, lines: ConsoleLines | None) -> None:
    """Copy one pipe to the rank's file, and to the console all of it (``lines`` None) or the lines that
    ``lines`` chooses, until every writer has closed it, or ``drain`` was called and nothing is left to read
    (torchrun's agent can keep its copy of a dead worker's pipe open)."""
    # Opened without waiting for a writer: a worker that never starts leaves nothing to wait for.
    source = os.fdopen(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0)
    with source, open(log, "ab", buffering=0) as kept:
        waiting = select.poll()
        waiting.register(source, select.POLLIN)
        while True:
            if not waiting.poll(POLL_MS):
                if _draining.is_set():
                    break
                continue
            chunk = source.read(65536)
            if chunk is None:  # nothing to read yet
                continue
            if not chunk:  # every writer closed it
                break
            kept.write(chunk)
            _write(console, chunk if lines is None else lines.feed(chunk))
        if lines is not None:
            _write(console, lines.flush())


def _write(console, data: bytes) -> None:
    if not data:
        return
    out: BinaryIO | None = getattr(console, "buffer", None)
    if out is None:  # a stream replaced by text-only one (a test's capture)
        console.write(data.decode("utf-8", "replace"))
        console.flush()
        return
    console.flush()
    out.write(data)
    out.flush()


class ConsoleLines:
    """Which of a rank's lines the console shows: warnings, errors and tracebacks (or all: ``every_line``),
    each prefixed with ``[rank<N>]:`` unless it has a rank prefix already."""

    def __init__(self, rank: int, every_line: bool = False):
        self.rank, self.every_line = rank, every_line
        self.partial = b""
        self.in_traceback = False

    def feed(self, chunk: bytes) -> bytes:
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        return b"".join(self._line(line) for line in lines)

    def flush(self) -> bytes:
        rest, self.partial = self.partial, b""
        return self._line(rest) if rest else b""

    def _line(self, raw: bytes) -> bytes:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        prefixed = RANK_PREFIX.match(text)
        body = text[prefixed.end():].removeprefix(" ") if prefixed else text
        show = self.every_line or self.in_traceback
        if body.startswith(TRACEBACK):
            self.in_traceback = show = True
        elif self.in_traceback and body and not body[0].isspace():
            self.in_traceback = False  # the exception's own line ends the traceback, and is shown
        show = show or bool(WARNING_OR_ERROR.search(body))
        if not show:
            return b""
        prefix = "" if prefixed else f"[rank{self.rank}]: "
        return (prefix + text + "\n").encode("utf-8")


def drain(timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Wait for the copier threads to reach the end of their pipes (the workers have ended), then remove the
    pipes. A copier still copying after ``timeout_s`` (a process the workers left writes on) is left."""
    _draining.set()
    while _copiers:
        _copiers.pop().join(timeout_s)
    _draining.clear()
    while _pipe_dirs:
        shutil.rmtree(_pipe_dirs.pop(), ignore_errors=True)


def available() -> bool:
    """Whether torchrun can find ``RankLogs`` (ddpkit installed with its entry points, not only on the path)."""
    from importlib import metadata

    return bool(metadata.entry_points(group="torchrun.logs_specs", name=ENTRY_POINT))
