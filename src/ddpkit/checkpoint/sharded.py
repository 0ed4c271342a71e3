"""Sharded checkpoints: folders that torch.distributed.checkpoint (DCP) writes, every rank its own part.

A sharded checkpoint is a folder ``step-00000123/``: DCP's ``.metadata`` and one ``__<rank>_0.distcp`` file
per rank that wrote something, beside ddpkit's ``ddpkit.pt`` (progress, RNG states, scheduler, settings and a
CRC-32 of every other file; see ``ddpkit.checkpoint``). Under FSDP each rank writes its own shard of every
parameter and optimizer state, so no rank ever gathers the whole model; tensors every rank holds alike (DDP's
replicas, FSDP's buffers) are written once, by the lowest rank holding them. Loading reshards: a checkpoint
that two processes wrote loads on one, or on four, each rank reading the pieces of its own part.

Loading runs no code. DCP reads its ``.metadata`` with plain ``pickle`` and small values with
``torch.load(weights_only=False)``; here the metadata goes through an unpickler that builds only DCP's
own metadata classes, torch sizes and dtypes, and small values are checked with ``weights_only=True`` first.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import warnings
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only

from ddpkit.core.errors import CheckpointError, disk_full, first_line

# DCP warns on every save and load by one process alone, even when told so with no_dist=True (as here).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming")

SIDECAR = "ddpkit.pt"  # in a sharded checkpoint's folder: ddpkit's part (all but the model and optimizer)
METADATA = ".metadata"  # in a sharded checkpoint's folder: DCP's table of contents
MODEL = "model"  # the top-level keys of the state DCP saves
OPTIMIZER = "optimizer"

# What the metadata's pickle may build: DCP's metadata records, and what they hold.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Decided before anything is imported or looked up: a name outside these is refused as it stands.
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:
                return found
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not part of DCP's metadata")


def read_metadata(folder: str | os.PathLike) -> Metadata:
    """DCP's table of contents of ``folder``, read without running any code it might hold."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {METADATA}: torch.distributed.checkpoint did not finish it") from None
    except Exception as error:  # pickle raises many types for a torn or foreign file
        raise CheckpointError(f"{path} is not DCP metadata ddpkit can read safely: {first_line(error)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # noqa: ARG002
        rank = kwargs.get("rank")
        if rank is not None:
            raise CheckpointError(f"{self.path} was written without collectives (one metadata file per rank); "
                                  "ddpkit reads checkpoints with one metadata file")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with small values (learning rates, step counts) loaded as weights only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)  # raises for anything but tensors and plain values
        # What passed weights_only loading holds nothing else: DCP's own loading builds the same value from it.
        super().load_bytes(read_item, io.BytesIO(data))


def save(state: dict, folder: Path, group, *, asynchronous: bool, staging: Staging | None = None) -> Future | None:
    """Every rank writes its part of ``state`` into ``folder``; with ``asynchronous``, DCP copies it to host
    memory (``staging``'s, where it has some; a tensor on the CPU is copied here where DCP would keep it as it is)
    and returns a future that completes once every rank's part and the metadata are on disk."""
    writer = FileSystemWriter(folder, sync_files=True, overwrite=True)
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)  # replicas' tensors: rank 0's, as model.pt
    if asynchronous:
        if not _STAGING_COPIES_CPU_TENSORS:
            state = tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone() if tensor.device.type == "cpu"
                                  else tensor, state)
        stager = staging.stager_for(state) if staging is not None else None
        given = {"async_stager": stager} if stager is not None else {}  # torch before 2.9 has no such argument
        return dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group,
                              **_alone_argument(group), **given)
    dcp.save(state, storage_writer=writer, planner=planner, process_group=group, **_alone_argument(group))
    return None


class Staging:
    """The host memory that asynchronous saves of a GPU state are copied into: pinned, allocated by the first save
    and reused by the next ones for as long as the state keeps its layout (keys, shapes, dtypes).

    Without it DCP allocates pageable memory at every save and copies into it: on an H100 that kept training
    waiting 2.3 s for 1.5 GiB of FSDP state, longer than a synchronous sharded save (2.0 s;
    benchmarks/checkpoint_blocking.py, 2026-11-26). The price is one pinned copy of this rank's state, held while
    the Checkpointer lives. A save starts only once the previous one is written, so the copy is never overwritten
    while it is being written out. A state on the CPU gets none: DCP copies it as before."""

    def __init__(self) -> None:
        self._stager: BlockingAsyncStager | None = None
        self._layout: tuple | None = None

    def stager_for(self, state: dict) -> BlockingAsyncStager | None:
        leaves = tree_leaves(state)
        if not any(isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in leaves) or not _STAGER_ARGUMENT:
            return None
        shape = layout(state)
        if shape != self._layout:  # a first save, or the state changed (an optimizer's first step adds moments)
            self._stager, self._layout = BlockingAsyncStager(cache_staged_state_dict=True), shape
        return self._stager


# dcp.async_save takes a stager of the caller's from torch 2.9 on; before, DCP's own copy it is.
_STAGER_ARGUMENT = "async_stager" in inspect.signature(dcp.async_save).parameters


def _staging_copies_cpu_tensors() -> bool:
    """Whether DCP's own copy for an asynchronous save copies a tensor already on the CPU. torch 2.4's moves each
    tensor to the CPU, which leaves that one as it is: training went on changing what was being written."""
    probe = torch.zeros(1)
    return BlockingAsyncStager().stage({"probe": probe})["probe"] is not probe


_STAGING_COPIES_CPU_TENSORS = _staging_copies_cpu_tensors()


def layout(state: dict) -> tuple:
    """What a pinned copy of ``state`` must match to be reused: its nesting and keys, and each tensor's shape and
    dtype (each other value's type: a learning rate or a step count changes from one save to the next)."""
    leaves, spec = tree_flatten(state)
    return spec, tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf)
                       for leaf in leaves)


def _alone(group) -> bool:
    """Whether this process saves and loads by itself (no process group): DCP would warn, guessing it."""
    return group is None and not (dist.is_available() and dist.is_initialized())


# dcp.save, async_save and load take ``no_dist`` on newer torch; torch 2.4's decide it as ``_alone`` does.
_NO_DIST_ARGUMENT = "no_dist" in inspect.signature(dcp.save).parameters


def _alone_argument(group) -> dict:
    return {"no_dist": _alone(group)} if _NO_DIST_ARGUMENT else {}


def load(state: dict, folder: str | os.PathLike, group) -> None:
    """Fill ``state`` (this rank's part, as ``Strategy.sharded_state`` lays it out) from ``folder``, in place."""
    try:
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(), process_group=group,
                 **_alone_argument(group))
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"{folder} cannot be loaded into this model and optimizer: {why(error)}; resume with "
                              "the optimizer that wrote it") from None


def load_model(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model's state_dict from a sharded checkpoint, in this process alone (no process group)."""
    state = model_shapes(folder, "cpu")
    try:
        if _NO_DIST_ARGUMENT or _alone(None):
            dcp.load({MODEL: state}, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(),
                     **({"no_dist": True} if _NO_DIST_ARGUMENT else {}))
        else:  # an older dcp.load would go by the process group that is up: its deprecated form takes "alone"
            dcp.load_state_dict({MODEL: state}, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(),
                                no_dist=True)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"{folder}: its model cannot be read: {why(error)}") from None
    return state


def model_shapes(folder: str | os.PathLike, device: str = "meta") -> dict[str, torch.Tensor]:
    """The model's tensors as the checkpoint records them (whole shapes, dtypes), allocated on ``device``;
    on ``meta`` they hold no memory."""
    prefix = MODEL + "."
    entries = read_metadata(folder).state_dict_metadata.items()
    return {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
            for key, entry in entries if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}


def _first_failure(error: BaseException) -> tuple[int | None, BaseException]:
    """(rank, its own error): the lowest rank's inside DCP's CheckpointException; (None, error) otherwise."""
    if isinstance(error, CheckpointException) and error.failures:
        rank = min(error.failures)
        return rank, error.failures[rank][0]
    return None, error


def as_error(error: BaseException) -> Exception:
    """A DCP failure as one line: a ``DiskFull`` when a write found no space, else an error saying ``why``."""
    return disk_full(_first_failure(error)[1]) or RuntimeError(why(error))


def why(error: BaseException) -> str:
    """One line for an error of DCP's: the first rank's own error inside a CheckpointException."""
    rank, inner = _first_failure(error)
    full = disk_full(inner)
    if full is not None:
        return str(full)
    return first_line(inner) if rank is None else f"rank {rank}: {first_line(inner)}"


# ---------------------------------------------------------------------------------------------- checksums


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def checksums(folder: Path) -> dict[str, int]:
    """A CRC-32 of every file DCP wrote into ``folder``."""
    return {entry.name: _crc32(entry) for entry in sorted(folder.iterdir()) if entry.is_file() and entry.name != SIDECAR}


def damaged_files(folder: Path, expected: dict[str, int]) -> str | None:
    """Why the files in ``folder`` are not the ones written (missing, or changed), or None."""
    if not expected:
        return f"its {SIDECAR} records no checksums"
    missing = [name for name in expected if not (folder / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    changed = [name for name, crc in expected.items() if _crc32(folder / name) != crc]
    if changed:
        which = "fails its CRC-32 checksum" if len(changed) == 1 else "fail their CRC-32 checksums"
        return f"{', '.join(changed)} {which} (changed on disk or in a copy after it was written)"
    return None
