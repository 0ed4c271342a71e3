"""Files that are whole or absent: atomic writes, and reading a checkpoint without running code.

``atomic_save`` writes a temporary file in the target's folder, flushes and fsyncs it, then renames it over
the target: a crash at any moment leaves either the old file or the new one, never a torn one. Reading is
``torch.load(..., weights_only=True)`` only, after the zip archive's CRC-32 checksums are checked: a
checkpoint is untrusted input, and unpickling runs code.
"""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ddpkit.checkpoint.format import FORMAT, KEY_CHECKSUMS, KEY_FORMAT, KEY_MODEL, KEY_SHARDED
from ddpkit.core.errors import CheckpointError, disk_full, first_line


TEMP_PREFIX = ".tmp-"


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, make it durable, rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates the file readable by its owner only; give it the mode an open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as error:
        os.unlink(tmp)
        full = disk_full(error, writing=path)
        if full is not None:  # not torch's "unexpected pos": say what happened, and that path is untouched
            raise full.and_("nothing was written to it") from None
        raise
    fsync_folder(folder)


def fsync_folder(folder: str | os.PathLike) -> None:
    """A rename is durable only once its folder's entry is on disk."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` that never leaves a half-written ``path``."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def load_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``; any failure becomes a one-line ``CheckpointError``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if not zipfile.is_zipfile(path):  # torch.load's own error for these is a bare byte value ("101")
        raise CheckpointError(f"{path} is not a checkpoint: torch.save writes a zip archive and this file is not "
                              "one (truncated, or another kind of file)")
    damage = damaged_record(path)
    if damage is not None:
        raise CheckpointError(f"{path} is damaged and was not loaded: {damage}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch.load raises many types for a torn or foreign file
        text = first_line(error)
        if "Weights only load failed" in str(error):
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
            what = f" ({refused.group(1)})" if refused else ""
            raise CheckpointError(
                f"{path} holds Python objects{what} that weights_only loading refuses, because unpickling "
                "them could run any code; ddpkit reads only tensors, numbers, strings, lists and dicts"
            ) from None
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {text}") from None


def load_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> Any:
    """A checkpoint file (``load_file``) or a sharded checkpoint folder, read without running code.

    For a folder: its ``ddpkit.pt``, with the model's tensors as DCP's metadata records them (shapes and
    dtypes on the ``meta`` device: enough to check them against a model; ``Resumed.restore`` loads the
    values) and the folder under ``sharded``. ``verify``: check every file against its checksum first.
    """
    path = Path(path)
    if not path.is_dir():
        return load_file(path)
    from ddpkit.checkpoint import sharded  # imported on use: it pulls in torch.distributed.checkpoint

    sidecar = path / sharded.SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"{path} is not a complete sharded checkpoint: it has no {sharded.SIDECAR}")
    obj = load_file(sidecar)
    if not (isinstance(obj, dict) and obj.get(KEY_FORMAT) == FORMAT):
        raise CheckpointError(f"{sidecar} is not a ddpkit checkpoint's {sharded.SIDECAR}")
    if verify:
        damage = sharded.damaged_files(path, obj.get(KEY_CHECKSUMS) or {})
        if damage is not None:
            raise CheckpointError(f"{path} is damaged and was not loaded: {damage}")
    obj[KEY_MODEL] = sharded.model_shapes(path)
    obj[KEY_SHARDED] = str(path)
    return obj


def damaged_record(path: str | os.PathLike) -> str | None:
    """Why the zip archive at ``path`` is damaged, or None when every record's bytes match the CRC-32
    checksum that ``torch.save`` wrote beside them (torch.load does not check them: a flipped bit in a
    tensor loads as a wrong weight)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and compares its CRC-32
    except (zipfile.BadZipFile, EOFError, ValueError) as error:  # its table of records overwritten
        return f"its table of records is damaged ({first_line(error)})"
    if bad is None:
        return None
    what = " (a tensor's data)" if "/data/" in bad else ""
    return (f"its record {bad}{what} fails its CRC-32 checksum or header check (changed on disk or in a copy "
            "after it was written)")


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one sharded checkpoint's folder (rather than a folder of checkpoints)."""
    from ddpkit.checkpoint import sharded

    path = Path(path)
    return path.is_dir() and ((path / sharded.SIDECAR).exists() or (path / sharded.METADATA).exists())
