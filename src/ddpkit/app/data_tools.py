"""``ddpkit data``: pack an image folder into shards, check that every image decodes, make a test folder.

    $ ddpkit data make-images /tmp/jpegs --images 2000
    $ ddpkit data check folder:/tmp/jpegs
    $ ddpkit data pack /tmp/jpegs /tmp/jpegs-packed
"""

from __future__ import annotations

import argparse
import os
import sys

from ddpkit.core.errors import UsageError
from ddpkit.core.process_group import usable_cores
from ddpkit.data import images, sample_images, shards


def main(ns: argparse.Namespace) -> int:
    if ns.action == "pack":
        return pack(ns)
    if ns.action == "check":
        return check(ns.source, ns.workers)
    return make_images(ns)


def pack(ns: argparse.Namespace) -> int:
    if not os.path.isdir(ns.folder):
        raise UsageError(f"ddpkit data pack: {ns.folder} is not a folder; give an image folder (FOLDER/CLASS/IMAGE)")
    bars = []

    def progress(split: str, files: int):
        from tqdm import tqdm

        bars.append(tqdm(total=files, unit="img", desc=f"packing {split}", disable=not sys.stderr.isatty(),
                         leave=False))
        return lambda: bars[-1].update()

    try:
        counts = shards.pack(ns.folder, ns.out, shard_mb=ns.shard_mb, report=print, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    print(f"packed {sum(counts.values())} images into {ns.out}; train with --data shards:{ns.out}")
    return 0


def sources_of(spec: str) -> list:
    """The parts (train, and val when separate) of ``folder:PATH``, ``shards:PATH`` or a bare PATH (a folder)."""
    kind, _, path = spec.partition(":")
    if kind not in ("folder", "shards"):
        kind, path = "folder", spec
    if not os.path.isdir(path):
        raise UsageError(f"ddpkit data check: {path} is not a folder")
    train, val = shards.read_parts(kind, path, what=f"{kind}:")
    return [train] if val is None else [train, val]


def check(spec: str, workers: int | None) -> int:
    """Decode every image; print the unreadable ones; 1 if there are any."""
    from torch.utils.data import DataLoader

    if workers is not None and workers < 0:
        raise UsageError(f"--workers must be 0 or more, got {workers}")
    workers = usable_cores() if workers is None else workers
    bad, total = [], 0
    for source in sources_of(spec):
        # Validation crops: deterministic, and a file that decodes for them decodes for training's.
        dataset = images.ImageData(source, images.Crops(32, train=False))
        loader = DataLoader(dataset, batch_size=64, num_workers=workers, collate_fn=dataset.collate)
        for *_, unreadable in loader:
            bad.extend(unreadable)
        total += len(dataset)
    for line in bad:
        print(f"unreadable: {line}")
    print(f"{total - len(bad)} of {total} images decode; {len(bad)} cannot be read"
          + (" (remove or replace them; training skips them, counting skipped_samples)" if bad else ""))
    return 1 if bad else 0


def make_images(ns: argparse.Namespace) -> int:
    size = None
    if ns.size is not None:
        width, _, height = ns.size.lower().partition("x")
        if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
            raise UsageError(f"--size takes WIDTHxHEIGHT in pixels, e.g. 500x375, got {ns.size!r}")
        size = (int(width), int(height))
    for name, value, least in (("--images", ns.images, 1), ("--classes", ns.classes, 1), ("--val", ns.val or 0, 0)):
        if value < least:
            raise UsageError(f"{name} must be at least {least}, got {value}")
    if not 1 <= ns.quality <= 95:
        raise UsageError(f"--quality must be 1 to 95, got {ns.quality}")
    val = max(ns.classes, ns.images // 10) if ns.val is None else ns.val
    written = sample_images.write_folder(ns.out, images=ns.images, classes=ns.classes, val_images=val, size=size,
                                         quality=ns.quality, seed=ns.seed)
    print(f"wrote {written} JPEGs to {ns.out}" + (f" ({ns.images} in train/, {val} in val/)" if val else ""))
    return 0
