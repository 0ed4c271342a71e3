"""The one exception type that means "the user asked for something we cannot do"."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sysconfig
import traceback
from collections.abc import Iterator


class UsageError(Exception):
    """Bad input. The CLI prints its message as one line on stderr and exits with status 2.

    The message says what was wrong and how to fix it, e.g.
    ``--batch-size must be at least 1, got 0``.

    ``said_elsewhere``: another rank (rank 0) prints the same message; this one exits 2 silently.
    """

    def __init__(self, message: str, *, said_elsewhere: bool = False):
        super().__init__(message)
        self.said_elsewhere = said_elsewhere


EXIT_USAGE = 2


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: unreadable, truncated, damaged, not a checkpoint, or for another model."""


@contextlib.contextmanager
def said_once(is_main: bool) -> Iterator[None]:
    """A UsageError that every rank meets alike (a mistake in the command line, a wrong data function of the
    user's) is said by rank 0 only: raised elsewhere, it becomes ``said_elsewhere``, exit 2 in silence."""
    try:
        yield
    except UsageError as error:
        if is_main or error.said_elsewhere:
            raise
        raise type(error)(str(error), said_elsewhere=True) from None


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (torch and torchvision write several), or its type."""
    lines = str(error).splitlines()
    return lines[0] if lines else type(error).__name__


FREE_SOME = ". Free some space, or write elsewhere"


class DiskFull(UsageError):
    """A write that found no space left on its device (or the user's quota spent): one line, status 2."""

    def and_(self, more: str) -> DiskFull:
        """The same error, saying ``more`` (what the writer kept) before its advice."""
        return DiskFull(f"{str(self).removesuffix(FREE_SOME)}; {more}{FREE_SOME}", said_elsewhere=self.said_elsewhere)


def disk_full(error: BaseException, writing: str | os.PathLike | None = None) -> DiskFull | None:
    """A DiskFull for ``error`` when a "no space left" or "quota exceeded" OSError is in its chain (torch.save
    reports one as "unexpected pos", with the OSError as its context), else None. ``writing``: the file."""
    seen: BaseException | None = error
    while seen is not None and not (isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT)):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    reason = "the disk quota is used up" if seen.errno == errno.EDQUOT else "no space left on the device"
    target = writing or seen.filename
    if target is None:  # a write() on an open file: its error names no file; name the line that wrote
        return DiskFull(f"a write {called_at(error)}failed: {reason}{FREE_SOME}")
    try:
        free = f"{shutil.disk_usage(os.path.dirname(os.path.abspath(target))).free / 2**20:.1f} MiB free there now"
    except OSError:
        free = "free space unknown"
    return DiskFull(f"writing {os.fspath(target)} failed: {reason} ({free}){FREE_SOME}")


def called_at(error: BaseException) -> str:
    """``"at FILE:LINE "``: the innermost line of the traceback outside Python's own library, or ""."""
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith(stdlib)]
    return f"at {frames[-1].filename}:{frames[-1].lineno} " if frames else ""
