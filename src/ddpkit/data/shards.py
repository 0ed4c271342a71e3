"""Image folders packed into a few large tar files, for file systems where a million small files are slow.

    $ ddpkit data pack /data/imagenet /data/imagenet-shards         # train/ and val/ packed alike
    $ ddpkit train --data shards:/data/imagenet-shards --model resnet50

A pack is a folder per split (``train/``, ``val/``, or the folder itself when the source had no split) of
``shard-00000.tar``, ``shard-00001.tar``, ... in WebDataset's layout (``KEY.jpg`` with ``KEY.cls``, the class
number, beside it: ``tar tf`` lists them and WebDataset reads them), and ``index.pt``: every sample's shard, byte
offset, size, class and source path, in ImageFolder's order (classes sorted, then files).

Reading. A sample is one positional read (``os.pread``) from a shard its loader worker keeps open: no file is
opened, listed or stat-ed per sample. Because any sample can be read by index, a pack keeps what a folder has: the
sample order of ``ddpkit.data.sampler`` (world-size independent, resumable mid-epoch), and the same crops, so
``shards:PACK`` trains exactly as ``folder:SOURCE`` does (tests/test_images.py checks sample for sample).
Each rank reads its samples from every shard, a few hundred kilobytes at a time, rather than whole shards of its
own; see docs/data.md for the trade.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ddpkit.core.errors import UsageError
from ddpkit.data.images import FolderSource, ImageData, image_data, scan_folder

INDEX = "index.pt"
FORMAT = 1
SHARD_NAME = "shard-{:05d}.tar"
DEFAULT_SHARD_MB = 256
VAL_FOLDERS = ("val", "valid", "validation", "test")


@dataclasses.dataclass
class ShardSource:
    """The samples of one packed split: read by index from its shards."""

    root: str
    classes: list[str]
    shards: list[str]
    shard: torch.Tensor  # per sample: which shard
    offset: torch.Tensor  # its first byte there
    size: torch.Tensor  # its length
    labels: list[int]
    names: list[str]  # its path in the source folder (for messages)

    def __post_init__(self):
        self._open: dict[str, int] = {}  # this process's descriptors, one per shard read
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:  # to a loader worker: without the descriptors of the process that made it
        return {key: value for key, value in self.__dict__.items() if key not in ("_open", "_pid")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open, self._pid = {}, os.getpid()

    def read(self, index: int) -> bytes:
        if self._pid != os.getpid():  # forked: descriptors are shared, but keep them per process all the same
            self._open, self._pid = {}, os.getpid()
        path = os.path.join(self.root, self.shards[int(self.shard[index])])
        descriptor = self._open.get(path)
        if descriptor is None:
            descriptor = self._open[path] = os.open(path, os.O_RDONLY)
        size = int(self.size[index])
        data = os.pread(descriptor, size, int(self.offset[index]))
        if len(data) != size:
            raise OSError(f"{path} ends before this sample's {size} bytes at {int(self.offset[index])}: the pack is "
                          "truncated; pack it again")
        return data

    def name(self, index: int) -> str:
        return f"{self.names[index]} (in {self.root})"

    def subset(self, indices: Sequence[int]) -> ShardSource:
        keep = torch.as_tensor(list(indices), dtype=torch.long)
        return ShardSource(self.root, self.classes, self.shards, self.shard[keep], self.offset[keep], self.size[keep],
                           [self.labels[i] for i in indices], [self.names[i] for i in indices])


def read_pack(root: str, classes: list[str] | None = None, what: str = "--data shards:") -> ShardSource:
    """One packed split (a folder with ``index.pt``); UsageError naming what is wrong."""
    if "://" in root:
        raise UsageError(f"{what}{root}: ddpkit reads packs from local or mounted folders; copy the pack there or "
                         "mount the bucket (s3fs, gcsfuse, blobfuse)")
    index_path = os.path.join(root, INDEX)
    if not os.path.isdir(root):
        raise UsageError(f"{what}{root}: no such folder")
    if not os.path.isfile(index_path):
        raise UsageError(f"{what}{root}: no {INDEX} in it, so it is not a finished pack; make one with "
                         "ddpkit data pack FOLDER OUT")
    try:
        index = torch.load(index_path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - any damage to the file reads as one message
        raise UsageError(f"{what}{root}: {INDEX} cannot be read ({type(error).__name__}); pack the folder again") \
            from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UsageError(f"{what}{root}: {INDEX} is not a ddpkit pack of format {FORMAT}; pack the folder again")
    missing = [name for name in index["shards"] if not os.path.isfile(os.path.join(root, name))]
    if missing:
        raise UsageError(f"{what}{root}: {len(missing)} of its shards are missing ({', '.join(missing[:3])}); copy the "
                         "whole pack")
    if classes is not None and index["classes"] != classes:
        raise UsageError(f"{what}{root}: its classes differ from the training split's; pack both from one folder")
    return ShardSource(root, index["classes"], index["shards"], index["shard"], index["offset"], index["size"],
                       index["label"].tolist(), index["names"])


def splits_of(folder: str) -> tuple[str, str | None]:
    """(training part, validation part or None) of a folder laid out as ImageFolder data or as a pack."""
    train = os.path.join(folder, "train")
    if os.path.isdir(train):
        for name in VAL_FOLDERS:
            if os.path.isdir(os.path.join(folder, name)):
                return train, os.path.join(folder, name)
        return train, None
    return folder, None


def pack(folder: str, out: str, *, shard_mb: float = DEFAULT_SHARD_MB, report: Callable[[str], None] | None = None,
         progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict[str, int]:
    """Pack an image folder (``train/`` and ``val/`` when it has them) into ``out``; the samples of each split.

    ``report``: called with a line per split packed. ``progress(split, files)``: returns a function called after
    each file (a progress bar's update)."""
    if shard_mb <= 0:
        raise UsageError(f"--shard-mb must be positive, got {shard_mb}")
    if os.path.exists(out) and os.listdir(out):
        raise UsageError(f"{out} exists and is not empty; pack into a new folder")
    if Path(os.path.abspath(out)).is_relative_to(os.path.abspath(folder)):
        raise UsageError(f"{out} is inside {folder}, where it would become a class folder; pack outside it")
    train, val = splits_of(folder)
    train_source = scan_folder(train, what="")
    parts = {"train" if train != folder else ".": train_source}
    if val is not None:
        parts["val"] = scan_folder(val, train_source.classes, what="")
    counts = {}
    for name, source in parts.items():
        target = Path(out) / name
        counts[name] = pack_split(source, target, int(shard_mb * 2**20),
                                  progress(name, len(source)) if progress else None)
        if report:
            written = len(list(target.glob("shard-*.tar")))
            report(f"{name if name != '.' else os.path.basename(folder)}: {counts[name]} images in {written} "
                   f"shard{'s' if written != 1 else ''}, {target}")
    return counts


def pack_split(source: FolderSource, target: Path, shard_bytes: int, done: Callable[[], None] | None = None) -> int:
    """Write ``source``'s files into tar shards of about ``shard_bytes`` and the index, last (a pack without its
    index is unfinished, and refused)."""
    target.mkdir(parents=True, exist_ok=True)
    shard_of, offsets, sizes, shards = [], [], [], []
    writer, written = None, 0
    for index, (path, label) in enumerate(zip(source.paths, source.labels)):
        if writer is None or written >= shard_bytes:
            if writer is not None:
                _close_shard(writer, target / shards[-1])
            shards.append(SHARD_NAME.format(len(shards)))
            writer, written = tarfile.open(target / (shards[-1] + ".partial"), "w", format=tarfile.USTAR_FORMAT), 0
        with open(path, "rb") as file:
            data = file.read()
        key = f"{index:08d}"
        offset = _add(writer, f"{key}.{Path(path).suffix.lstrip('.').lower() or 'jpg'}", data)
        _add(writer, f"{key}.cls", str(label).encode())
        shard_of.append(len(shards) - 1)
        offsets.append(offset)
        sizes.append(len(data))
        written += len(data) + 1536
        if done is not None:
            done()
    if writer is not None:
        _close_shard(writer, target / shards[-1])
    index = {"format": FORMAT, "classes": source.classes, "shards": shards,
             "shard": torch.tensor(shard_of, dtype=torch.int32), "offset": torch.tensor(offsets, dtype=torch.int64),
             "size": torch.tensor(sizes, dtype=torch.int64), "label": torch.tensor(source.labels, dtype=torch.int64),
             "names": [os.path.relpath(path, source.root) for path in source.paths]}
    partial = target / (INDEX + ".partial")
    torch.save(index, partial)
    os.replace(partial, target / INDEX)
    return len(source)


def _add(writer: tarfile.TarFile, name: str, data: bytes) -> int:
    """Append a member; where its data starts in the shard (after its one 512-byte header: names are short)."""
    import io

    member = tarfile.TarInfo(name)
    member.size = len(data)
    member.mode = 0o644
    start = writer.offset
    writer.addfile(member, io.BytesIO(data))
    return start + tarfile.BLOCKSIZE


def _close_shard(writer: tarfile.TarFile, path: Path) -> None:
    writer.close()
    os.replace(str(path) + ".partial", path)


def image_shards(root: str, *, classes: list[str] | None = None, **settings) -> ImageData:
    """One packed split (``ddpkit data pack``'s ``OUT/train`` or ``OUT/val``) as training or validation data: the
    same samples, order and crops as ``image_folder`` of the folder it was packed from, with the same settings.

        train = ddpkit.image_shards("/data/imagenet-packed/train")
        val = ddpkit.image_shards("/data/imagenet-packed/val", train=False, classes=train.classes)
    """
    return image_data(read_pack(root, classes, what=""), **settings)


def read_parts(kind: str, path: str, what: str) -> tuple[FolderSource | ShardSource, FolderSource | ShardSource | None]:
    """(training part, validation part or None) of an image folder (``kind`` folder) or a pack (``shards``), the
    validation part's classes checked against the training part's; ``what`` starts each error message."""
    read = scan_folder if kind == "folder" else read_pack
    train_part, val_part = splits_of(path)
    train = read(train_part, what=what)
    return train, (read(val_part, train.classes, what=what) if val_part is not None else None)
