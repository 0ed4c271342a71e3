"""ddpkit's messages, through Python's ``logging``: the ``ddpkit`` logger, one line per message, rank first.

    >>> import sys
    >>> from ddpkit.core import logs
    >>> logs.configure(rank=1, level="debug", stream=sys.stdout)
    >>> logs.logger.info("resumed from step 40")
    [rank1]: ddpkit: resumed from step 40
    >>> logs.logger.warning("rank 1 is slow")
    [rank1]: ddpkit: warning: rank 1 is slow
    >>> logs.configure(rank=1, level="info", stream=sys.stdout)
    >>> logs.logger.info("said by rank 0 only")   # below warning, ranks other than 0 keep quiet
    >>> logs.logger.error("but errors come from every rank")
    [rank1]: ddpkit: error: but errors come from every rank

What each level shows: ``info`` (the default) rank 0's messages and every rank's warnings and errors;
``debug`` every rank's messages, debug ones included; ``warning`` and ``error`` only those. The
launcher, which is no rank, writes its lines without the ``[rankN]:`` prefix. The level comes from
``--log-level`` (``ddpkit train`` and ``ddpkit run`` pass it to every worker in ``DDPKIT_LOG_LEVEL``),
from ``ddpkit.Job(log_level=...)``, or from that variable.

Nothing is configured at import: ``ddpkit.setup()`` (and so ``ddpkit.Job``) configures the logger once
it knows the rank. The ``ddpkit`` logger does not pass records on to the root logger (whose handlers
would print each line a second time); a handler the user attaches to it gets them all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from typing import TextIO

from ddpkit.core.errors import EXIT_USAGE, UsageError

LEVEL_ENV = "DDPKIT_LOG_LEVEL"
# Set by the launcher when it keeps each worker's whole output in a file of its own (ddpkit.launch.rank_logs): every
# rank then writes all its messages to its stderr, and the launcher shows the console those it would.
RANK_LOGS_ENV = "DDPKIT_RANK_LOGS"
TERMINAL_ENV = "DDPKIT_TERMINAL"  # then: the launcher's terminal (its stderr's), for rank 0's progress bar
LEVELS = ("debug", "info", "warning", "error")
logger = logging.getLogger("ddpkit")


class RankHandler(logging.Handler):
    """Writes a record as ``[rankN]: ddpkit: [warning: |error: ]message``; rank 0 alone below warning
    unless ``every_rank``."""

    def __init__(self, rank: int | None, every_rank: bool, stream: TextIO | None = None):
        super().__init__()
        self.rank, self.every_rank, self.stream = rank, every_rank, stream

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or self.every_rank or not self.rank) and super().filter(record)

    def format(self, record: logging.LogRecord) -> str:
        prefix = "" if self.rank is None else f"[rank{self.rank}]: "
        kind = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"{prefix}ddpkit: {kind}{record.getMessage()}"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # sys.stderr as it is now (a test or the user may have replaced it since), not at configure time.
            stream = self.stream or sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: logging's own policy for a failed write
            self.handleError(record)


def check_level(level: str, name: str = "`log_level`") -> str:
    """``level`` lower-cased, or a UsageError that says which of ``LEVELS`` ``name`` may be."""
    if level.lower() not in LEVELS:
        raise UsageError(f"{name} must be one of {', '.join(LEVELS)}, got {level!r}")
    return level.lower()


def configure(rank: int | None = None, level: str | None = None, stream: TextIO | None = None) -> None:
    """Give the ``ddpkit`` logger its one handler for this process (``rank`` None: the launcher).

    ``level`` None: ``DDPKIT_LOG_LEVEL``, else ``info``. Calling it again replaces ddpkit's handler.
    Handlers the user attached to the ``ddpkit`` logger stay and get every record of the level.
    """
    try:
        if level is None:
            chosen = check_level(os.environ.get(LEVEL_ENV) or "info", LEVEL_ENV)
        else:
            chosen = check_level(level)
    except UsageError:
        _install(rank, "info", stream)  # so that the error itself is said as ddpkit says errors
        raise
    _install(rank, chosen, stream)


class FileRankHandler(RankHandler):
    """A rank's own messages, every one the logger passes (no rank-0-only filter), to a file of that rank."""


@contextlib.contextmanager
def kept_in_file(path: str | os.PathLike, rank: int | None) -> Iterator[None]:
    """Inside the block, also write this process's ddpkit messages to ``path``, appended (a restart adds its
    lines): all of them at the logger's level, a rank other than 0's ``info`` lines too, which the console
    leaves out. Nothing to do where the launcher keeps this process's whole output in ``path`` already."""
    if output_kept_by_launcher():
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", buffering=1, encoding="utf-8") as handle:
        handler = FileRankHandler(rank, every_rank=True, stream=handle)
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)


def output_kept_by_launcher() -> bool:
    """Whether the launcher keeps this process's whole output in a file of its own (``RANK_LOGS_ENV``)."""
    return os.environ.get(RANK_LOGS_ENV) == "1"


@functools.lru_cache(maxsize=1)
def launcher_terminal() -> TextIO | None:
    """The launcher's terminal, opened for writing, where the launcher keeps this process's output in a file
    (``TERMINAL_ENV``); else None. Opened once per process."""
    path = os.environ.get(TERMINAL_ENV) if output_kept_by_launcher() else None
    if not path:
        return None
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - the process's, until it exits
    except OSError:
        return None  # the terminal went away: no progress bar


def _install(rank: int | None, chosen: str, stream: TextIO | None) -> None:
    for handler in [handler for handler in logger.handlers if type(handler) is RankHandler]:
        logger.removeHandler(handler)
    every_rank = chosen == "debug" or output_kept_by_launcher()
    logger.addHandler(RankHandler(rank, every_rank=every_rank, stream=stream))
    logger.setLevel(chosen.upper())
    logger.propagate = False  # one line per message, not a second one from a root handler


def report_usage_error(error: UsageError) -> int:
    """Log ``error`` as the one ``ddpkit: error:`` line (unless another rank says it); return exit status 2."""
    if not error.said_elsewhere:
        logger.error("%s", error)
    return EXIT_USAGE
