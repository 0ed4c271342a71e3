"""Each rank's whole output in ``OUTPUT_DIR/logs/rank<N>.log``; on the console rank 0's as it comes, and what the
other ranks say, a line that several ranks say alike (but for their numbers) once for all of them.

torchrun hands each worker's stdout and stderr to a ``LogsSpecs`` (its plugin point for log redirection: the
entry point ``torchrun.logs_specs``, which ddpkit's package declares as ``ddpkit``, so ``torchrun --logs-specs
ddpkit --log-dir DIR`` works too). ``RankLogs`` gives each worker a named pipe for each stream, read in the
launcher by one thread per pipe, which:

* appends every byte to ``DIR/rank<N>.log`` (``N``: the global rank; a restarted job appends to the same
  file), as it comes, so what a rank wrote before it crashed is there;
* passes rank 0's bytes through to the launcher's own stdout and stderr unchanged (its progress bar too);
* shows each line of another rank prefixed ``[rank<N>]:`` (of ddpkit's own messages, its warnings and errors:
  rank 0 says the rest for the job), unless a line like it (the same text once its
  numbers are masked: ``rank 3 of 8 done`` is ``rank 1 of 8 done``) was shown in the last ``WINDOW_S``
  seconds, by that rank or another, rank 0 included. Such lines are held for that long, then shown as one:
  the first of them, prefixed with the ranks that said them (``[rank1-3,5]:``), and ``[×N]`` when there were
  more lines than ranks (a rank that says the same every step). That is Ray's log deduplication, by rank.
  With ``--log-level debug`` every line of every rank is shown at once, none held. At the end, a run that held
  any line says where the whole output is (``drain``);
* with ``ONE_VOICE`` set in the launcher (``ddpkit run --unchanged``, whose ranks all print what one process would),
  shows no other rank's stdout at all: their stderr (errors, warnings) as above.

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
import time
from collections.abc import Callable
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

RANK_PREFIX = re.compile(r"^\[(rank|default)\d+\]:")
NUMBER = re.compile(r"\d+")
DDPKIT_INFO = "ddpkit: "
DDPKIT_WARNING = re.compile(r"ddpkit: (warning|error):")
WINDOW_S = 1.0  # a line like one shown less than this long ago is held, then shown once for every rank that said it
ONE_VOICE = "DDPKIT_ONE_VOICE"  # set in the launcher: the console shows rank 0's stdout only (other ranks' in files)


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
        global _echoes
        pipes = tempfile.mkdtemp(prefix="ddpkit-pipes-")
        _pipe_dirs.append(pipes)
        every_line = os.environ.get(LEVEL_ENV, "").lower() == "debug"
        one_voice = bool(os.environ.get(ONE_VOICE))
        if _echoes is None or _echoes.log_dir != self.root_log_dir:
            _echoes = Echoes(self.root_log_dir)
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            log = path_for(self.root_log_dir, rank)
            for stream, paths in (("stdout", dest.stdouts), ("stderr", dest.stderrs)):
                pipe = os.path.join(pipes, f"{local_rank}.{stream}")
                os.mkfifo(pipe, 0o600)
                paths[local_rank] = pipe
                console = getattr(sys, stream)
                # rank 0 passes through as it is (its lines still count as shown); another rank's are prefixed
                _start(pipe, log, console, ConsoleLines(rank, console, _echoes, every_line,
                                                        hidden=one_voice and stream == "stdout" and rank != 0))
            dest.error_files[local_rank] = os.path.join(pipes, f"{local_rank}.error.json")
        return dest


def _start(pipe: str, log: str, console, lines: ConsoleLines) -> None:
    thread = threading.Thread(target=_copy, args=(pipe, log, console, lines),
                              name=f"ddpkit-rank-log-{os.path.basename(pipe)}", daemon=True)
    thread.start()
    _copiers.append(thread)


def _copy(pipe: str, log: str, console, lines: ConsoleLines) -> None:
    """Copy one pipe to the rank's file, and to the console what ``lines`` shows (and the held lines that are
    due), until every writer has closed it, or ``drain`` was called and nothing is left to read (torchrun's agent
    can keep its copy of a dead worker's pipe open)."""
    # Opened without waiting for a writer: a worker that never starts leaves nothing to wait for.
    source = os.fdopen(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0)
    with source, open(log, "ab", buffering=0) as kept:
        waiting = select.poll()
        waiting.register(source, select.POLLIN)
        while True:
            lines.echoes.show_due()
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
            lines.echoes.write(console, lines.feed(chunk), passing=lines.rank == 0)
        lines.echoes.write(console, lines.flush(), passing=lines.rank == 0)


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


def mask(line: str) -> str:
    """A line's text with each run of digits as ``#``: the lines of ranks that say the same thing match."""
    return NUMBER.sub("#", line)


def rank_ranges(ranks) -> str:
    """``[1, 2, 3, 5]`` -> ``1-3,5``."""
    ordered, parts = sorted(set(ranks)), []
    for rank in ordered:
        if parts and rank == parts[-1][1] + 1:
            parts[-1][1] = rank
        else:
            parts.append([rank, rank])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in parts)


class Echoes:
    """The lines the console showed lately, and those held because they echo one (``WINDOW_S``): one per launcher,
    shared by the copier threads of every rank and stream, which write through it. ``clock``: for tests."""

    def __init__(self, log_dir: str | None = None, *, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.log_dir, self.window_s, self.clock = log_dir, window_s, clock
        self._lock = threading.Lock()
        self._shown: dict[str, float] = {}  # masked line -> when one like it was last said
        self._held: dict[tuple[int, str], dict] = {}  # (console, masked line) -> the held lines like it
        self.hidden = 0  # lines held and never shown themselves (another like them was)
        self.held_ranks: set[int] = set()
        self.pointed_to = False  # whether ``where_it_all_is`` named the folder (it must then be kept)
        # Consoles on which rank 0's bytes end mid-line (a print writes its text, then its newline), since when, and
        # the other ranks' lines that wait for that line's end (the console first).
        self._mid_line: dict[int, float] = {}
        self._waiting: dict[int, list] = {}

    def write(self, console, data: bytes, *, passing: bool = False) -> None:
        """Write to ``console``: rank 0's bytes as they come (``passing``); another rank's lines between rank 0's
        lines, never inside one (they wait for its end, ``window_s`` at most: ``show_due``)."""
        if not data:
            return
        with self._lock:
            key = id(console)
            if passing:
                _write(console, data)
                if data.endswith(b"\n"):
                    self._mid_line.pop(key, None)
                    _write(console, b"".join(self._waiting.pop(key, [console])[1:]))
                else:
                    self._mid_line.setdefault(key, self.clock())
            elif key in self._mid_line:
                self._waiting.setdefault(key, [console]).append(data)
            else:
                _write(console, data)

    def said(self, text: str) -> None:
        """A line shown as it came (rank 0's)."""
        with self._lock:
            self._shown[mask(text)] = self.clock()

    def offer(self, console, rank: int, text: str) -> bool:
        """Whether another rank's line is to be shown now; if not, it is held with the lines like it."""
        key, now = mask(text), self.clock()
        with self._lock:
            last = self._shown.get(key)
            self._shown[key] = now
            if last is None or now - last > self.window_s:
                return True
            held = self._held.setdefault((id(console), key), {"console": console, "text": text, "ranks": set(),
                                                              "lines": 0, "since": now})
            held["ranks"].add(rank)
            held["lines"] += 1
            return False

    def show_due(self, *, everything: bool = False) -> None:
        """Show each group of held lines whose time has come (all of them: ``everything``), oldest first; and, on a
        line of their own, the lines that waited for a rank-0 line unfinished for as long (a progress bar)."""
        now = self.clock()
        with self._lock:
            due = [key for key, held in self._held.items() if everything or now - held["since"] >= self.window_s]
            groups = [self._held.pop(key) for key in due]
            for held in groups:
                self.hidden += held["lines"] - 1
                self.held_ranks |= held["ranks"]
            for key in [key for key, since in self._mid_line.items() if everything or now - since >= self.window_s]:
                del self._mid_line[key]
                waiting = self._waiting.pop(key, None)
                if waiting:
                    _write(waiting[0], b"\n" + b"".join(waiting[1:]))
        for held in sorted(groups, key=lambda held: held["since"]):
            more = f" [×{held['lines']}]" if held["lines"] > len(held["ranks"]) else ""
            self.write(held["console"], f"[rank{rank_ranges(held['ranks'])}]: {held['text']}{more}\n".encode())

    def where_it_all_is(self) -> str | None:
        """After the run: the line that says where the held lines are, once (None when none was held)."""
        with self._lock:
            if not self.hidden or self.log_dir is None:
                return None
            hidden, ranks, self.hidden = self.hidden, self.held_ranks, 0
            self.pointed_to = True
        return (f"{hidden} line(s) of rank(s) {rank_ranges(ranks)} were shown as one with others like them; every "
                f"rank's whole output is in {os.path.join(self.log_dir, 'rank<N>.log')}")


_echoes: Echoes | None = None


class ConsoleLines:
    """What the console shows of one rank's stream: rank 0's bytes as they come, another rank's whole lines
    prefixed ``[rank<N>]:`` unless they echo a line shown a moment ago (``Echoes``: held, then shown once for
    all the ranks that said it), or every one of them at once (``every_line``: --log-level debug)."""

    def __init__(self, rank: int, console=None, echoes: Echoes | None = None, every_line: bool = False,
                 hidden: bool = False):
        self.rank, self.console, self.every_line, self.hidden = rank, console, every_line, hidden
        self.echoes = echoes if echoes is not None else Echoes()
        self.partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """What to write to the console now for ``chunk`` of this rank's stream."""
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        if self.rank == 0:
            for line in lines:
                self.echoes.said(self._text(line)[1])
            return chunk
        return b"".join(self._line(line) for line in lines)

    def flush(self) -> bytes:
        rest, self.partial = self.partial, b""
        if self.rank == 0:
            return b""  # fed through already
        return self._line(rest) if rest else b""

    @staticmethod
    def _text(raw: bytes) -> tuple[bool, str]:
        """(whether it has a rank prefix of its own, the line as a terminal shows it, without that prefix)."""
        text = raw.decode("utf-8", "replace").rstrip("\r").rpartition("\r")[2]  # a progress bar: its last state
        prefixed = RANK_PREFIX.match(text)
        return bool(prefixed), (text[prefixed.end():].removeprefix(" ") if prefixed else text)

    def _line(self, raw: bytes) -> bytes:
        _, body = self._text(raw)
        if self.hidden or not body.strip():
            return b""
        if not self.every_line and body.startswith(DDPKIT_INFO) and not DDPKIT_WARNING.match(body):
            return b""  # ddpkit's own notes: rank 0 says them for the job (the rank's file keeps its own)
        if not self.every_line and not self.echoes.offer(self.console, self.rank, body):
            return b""
        return f"[rank{self.rank}]: {body}\n".encode("utf-8")


def drain(timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Wait for the copier threads to reach the end of their pipes (the workers have ended), show the lines still
    held, say where the whole output is if any line was shown as one with others, then remove the pipes. A copier
    still copying after ``timeout_s`` (a process the workers left writes on) is left."""
    _draining.set()
    while _copiers:
        _copiers.pop().join(timeout_s)
    _draining.clear()
    if _echoes is not None:
        _echoes.show_due(everything=True)
        where = _echoes.where_it_all_is()
        if where:
            from ddpkit.core.logs import logger

            logger.info(where)
    while _pipe_dirs:
        shutil.rmtree(_pipe_dirs.pop(), ignore_errors=True)


def folder_named() -> bool:
    """Whether this launcher named the rank logs' folder on the console, as the place of lines it showed as one
    with others (``ddpkit run`` then keeps a temporary one)."""
    return _echoes is not None and _echoes.pointed_to


def available() -> bool:
    """Whether torchrun can find ``RankLogs`` (ddpkit installed with its entry points, not only on the path)."""
    from importlib import metadata

    return bool(metadata.entry_points(group="torchrun.logs_specs", name=ENTRY_POINT))
