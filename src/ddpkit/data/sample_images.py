"""A folder of JPEGs that decode like photographs, for benchmarks and tests: ImageNet's sizes (500x375 and
375x500), quality 90, about 80 KB each.

    $ ddpkit data make-images /tmp/jpegs --images 2000 --classes 10        # train/ and val/
    $ ddpkit bench --data folder:/tmp/jpegs --decode cpu

Random noise would be the wrong test: it compresses badly, so it makes files three times larger and slower to
decode than photographs. Each image is a smooth field of colour (a few random colours, upsampled) with shapes
drawn over it, blurred a little, then given sensor-like noise: smooth areas, edges and fine texture, as a photograph
has. Each class tints its images with a colour of its own, so a model can learn the classes.
"""

from __future__ import annotations

import os

import numpy as np

SIZES = ((500, 375), (375, 500))  # (width, height): ImageNet's commonest, landscape three times as often


def photo_like(rng: np.random.Generator, width: int, height: int, label: int):
    """One PIL image of ``width`` x ``height`` pixels."""
    from PIL import Image, ImageDraw, ImageFilter

    field = rng.integers(0, 256, (int(rng.integers(3, 7)), int(rng.integers(3, 7)), 3)).astype(np.float32)
    tint = np.array([(label * 97) % 256, (label * 53 + 80) % 256, (label * 29 + 160) % 256], dtype=np.float32)
    image = Image.fromarray((field * 0.6 + tint * 0.4).astype(np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = (x0, y0, x0 + int(rng.integers(10, max(11, width // 2))), y0 + int(rng.integers(10, max(11, height // 2))))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.2)), dtype=np.int16)
    noise = rng.normal(0, 12, (height, width, 1)) + rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(np.clip(pixels + noise.astype(np.int16), 0, 255).astype(np.uint8))


def write_folder(out: str, *, images: int, classes: int = 10, val_images: int = 0, size: tuple[int, int] | None = None,
                 quality: int = 90, seed: int = 0, jobs: int | None = None) -> int:
    """Write ``images`` training JPEGs (``out/train/CLASS/`` when ``val_images``, else ``out/CLASS/``) and
    ``val_images`` more under ``out/val/``; ``size`` (width, height) fixes every image's size, else ImageNet's.
    Each image is drawn from a generator of its own (seed, part, index), so ``jobs`` processes (default: every core
    for more than 200 images) write the same files as one. Returns the number written."""
    parts = [("train", images), ("val", val_images)] if val_images else [("", images)]
    work = [(out, part, number, i, classes, size, quality, seed) for number, (part, count) in enumerate(parts)
            for i in range(count)]
    if jobs is None:
        from ddpkit.core.process_group import usable_cores

        jobs = usable_cores() if len(work) > 200 else 1
    if jobs <= 1:
        for item in work:
            _write_one(item)
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            list(pool.map(_write_one, work, chunksize=32))
    return len(work)


def _write_one(item: tuple) -> None:
    out, part, number, i, classes, size, quality, seed = item
    rng = np.random.default_rng([seed, number, i])
    label = i % classes
    folder = os.path.join(out, part, f"class{label:03d}")
    os.makedirs(folder, exist_ok=True)
    width, height = size or SIZES[0 if rng.random() < 0.75 else 1]
    photo_like(rng, width, height, label).save(os.path.join(folder, f"{part or 'img'}{i:06d}.jpg"), "JPEG",
                                               quality=quality)
