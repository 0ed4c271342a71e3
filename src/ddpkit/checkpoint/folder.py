"""A folder of checkpoints: their names (``step-00000123.pt`` files, ``step-00000123/`` sharded folders), the
``latest`` pointer to the newest complete one, choosing one to resume (skipping unreadable ones), pruning
old ones, and clearing what an interrupted writer left.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.files import TEMP_PREFIX, atomic_write, load_checkpoint
from ddpkit.checkpoint.format import read_contents
from ddpkit.core.errors import CheckpointError


MODEL_FILE = "model.pt"
FOLDER = "checkpoints"  # inside the output folder
POINTER = "latest"


NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # a file (full) or a folder (sharded)


def checkpoint_name(global_step: int, sharded: bool = False) -> str:
    return f"step-{global_step:08d}" + ("" if sharded else ".pt")


def is_checkpoint(entry: Path) -> bool:
    """A checkpoint's name, and what it names is there: a file for a full one, a folder for a sharded one."""
    match = NAME.match(entry.name)
    return bool(match) and (entry.is_file() if match.group(2) else entry.is_dir())


def step_of(entry: Path) -> int:
    """The optimizer step a checkpoint's name says (``step-00000123.pt`` or ``step-00000123/``: 123)."""
    return int(NAME.match(entry.name).group(1))


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The checkpoints (files and sharded folders) in ``folder``, newest (highest step) first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(step_of(entry), entry.name, entry) for entry in folder.iterdir() if is_checkpoint(entry)]
    return [entry for _, _, entry in sorted(found, reverse=True)]


def remove_entry(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def read_pointer(folder: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is no pointer (or it names nothing there)."""
    try:
        name = (Path(folder) / POINTER).read_text().strip()
    except OSError:
        return None
    target = Path(folder) / name
    return target if is_checkpoint(target) else None


def write_pointer(folder: str | os.PathLike, target: Path) -> None:
    atomic_write(Path(folder) / POINTER, lambda handle: handle.write(f"{target.name}\n".encode()))


def prune(folder: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints (never the one ``latest`` names); return the deleted."""
    pinned = read_pointer(folder)
    removed = []
    for old in list_checkpoints(folder)[keep:]:
        if old != pinned:
            remove_entry(old)
            removed.append(old)
    return removed


def remove_partial_writes(folder: str | os.PathLike) -> list[Path]:
    """Delete temporary files and folders a killed writer left behind (they were never renamed into place)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    partial = [entry for entry in folder.iterdir() if entry.name.startswith(TEMP_PREFIX)]
    for entry in partial:
        remove_entry(entry)
    return partial


def set_aside(folder: str | os.PathLike) -> Path | None:
    """Move an earlier run's checkpoint folder to ``<folder>.prev`` (replacing an older one); return it."""
    folder = Path(folder)
    if not list_checkpoints(folder):
        return None
    previous = folder.with_name(folder.name + ".prev")
    if previous.exists():
        shutil.rmtree(previous)
    folder.rename(previous)
    return previous


def find_resumable(folder: str | os.PathLike, warn: Callable[[str], None]) -> tuple[Path, Any] | None:
    """The newest complete, readable checkpoint in ``folder`` and its contents; None when there is none.

    ``latest`` is tried first, then every checkpoint from newest to oldest; each unreadable one is
    reported through ``warn`` and skipped. Checkpoints that exist but are all unreadable are an error.
    """
    candidates = list_checkpoints(folder)
    pointed = read_pointer(folder)
    if pointed is not None:
        candidates = [pointed] + [c for c in candidates if c != pointed]
    if not candidates:
        return None
    reasons = []
    for candidate in candidates:
        try:
            obj = load_checkpoint(candidate)
            read_contents(obj, candidate)
            return candidate, obj
        except CheckpointError as error:
            reasons.append(str(error))
            warn(f"skipping checkpoint {candidate}: {error}; trying the previous one")
    raise CheckpointError(f"no usable checkpoint in {folder}: {len(reasons)} found, none readable (newest: {reasons[0]})")


def retire_newer(folder: str | os.PathLike, chosen: Path, step: int, log: Callable[[str], None]) -> None:
    """Rename the checkpoints of ``folder`` past ``step`` (that of ``chosen``, the one resumed) to ``*.stale``.

    They belong to another course of the run (a corrupt file skipped, or the later checkpoints of a run
    resumed from an earlier one): left in place they would outrank the new ones in ``list_checkpoints``
    and in pruning, and a later ``--resume auto`` could pick them.
    """
    for entry in list_checkpoints(folder):
        if entry.resolve() != chosen.resolve() and step_of(entry) > step:
            stale = entry.with_name(entry.name + ".stale")
            entry.rename(stale)
            log(f"renamed {entry} to {stale.name}: it is past the step this run resumes from")
