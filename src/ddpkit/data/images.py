"""Image files as training data: read as bytes by the loader workers, decoded and augmented on the CPU (in the
workers) or on the GPU (nvJPEG, in the training process), with the same crops either way.

    train = ddpkit.data.image_folder("/data/imagenet/train", train=True, decode="gpu")
    val = ddpkit.data.image_folder("/data/imagenet/val", train=False, classes=train.classes)
    loader = job.train_loader(train, batch_size=256)     # batches arrive decoded, normalised, on the device
    for images, labels in loader:
        ...

Every sample becomes one crop box in the source image and one resample to ``size`` x ``size``:

* training: torchvision's RandomResizedCrop (area 8-100%, aspect 3/4-4/3) and a horizontal flip half the time;
* validation: the centre square that torchvision's Resize(size*256/224) + CenterCrop(size) keeps, resampled
  once (one resample instead of two).

The crop and flip of a training sample come from a generator seeded by (seed, epoch, sample index), not from the
process's random state: a sample gets the same crop whatever the world size, whichever loader worker reads it, and
in a resumed run, so N processes x batch B see exactly the batches of 1 x N*B and a resumed run is bit-identical
on CPU. (ddpkit's loaders pass the epoch with each index; a plain DataLoader passes an index alone, and its crop is
then drawn from the worker's random state, as torchvision's transforms draw theirs.)

Decoding. ``decode="cpu"``: the loader workers decode with libjpeg-turbo (simplejpeg; other formats with
torchvision.io; training crops with the fast DCT and upsampling, validation's exactly), crop and resample the
uint8 image with torch's antialiased bilinear kernel, and hand over uint8 crops: a quarter of float32's bytes
through shared memory, pinned memory and the copy to the device, where the batch is normalised. ``decode="gpu"``:
the workers read the bytes and choose the crop from the image's header only; the training process decodes the
whole batch with nvJPEG (``torchvision.io.decode_jpeg(..., device="cuda")``), crops and resamples it with a few
batched kernels (``resample_batch``) and normalises it on the GPU, on a thread and stream of the loader's own,
ahead of the step (``ddpkit.data.loaders.ahead_on_a_thread``). Files that are not JPEGs (a PNG named .jpg) are
decoded on the CPU in either mode.

Unreadable files. A file that cannot be decoded (truncated, empty, not an image) is left out of its batch with a
warning that names it, and counted (``skipped_samples`` of the loader, in ``metrics.jsonl`` for ``ddpkit train``);
a batch with nothing readable in it stops the run with a line that names its files.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from ddpkit.core.errors import UsageError

DECODES = ("auto", "cpu", "gpu")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
JPEG_MAGIC = b"\xff\xd8"
NAMED_SKIPS = 20  # unreadable files named in a warning each; the rest are counted
# What ImageFolder takes as an image; the same for the folder check and for ``ddpkit data pack``.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# How fast nvJPEG's path (torchvision's decode_jpeg on the GPU, then ddpkit's batched crops on the loader's thread)
# hands a GPU training crops of ImageNet-sized JPEGs (500 x 375) while the model trains on it, as source pixels a
# second: 3,019 images/s beside ResNet-50 (bf16, channels_last, batch 256) on an H200, against 4,683 images/s of
# synthetic data (docs/benchmarks.md, 2026-11-28). Alone, with no model, it did 5,101 on an H100. torchvision's
# nvJPEG decodes each image's Huffman code on the host, in the one thread that calls it (the profile's GPU streams
# hold only its colour conversion and copies), and its crops share the GPU with the model.
NVJPEG_PIXELS_PER_S = 3019 * 500 * 375
RATE_SAMPLES = 16  # images one core decodes and crops to measure its pace (about 40 ms of ImageNet's)


def check_decode(decode: str, device: torch.device | str) -> str:
    """``decode`` checked against ``device``: ``auto`` is ``cpu`` on a CPU and stays ``auto`` on a CUDA device,
    where ddpkit's loaders settle it (``auto_decode``) once they know their worker count."""
    device = torch.device(device)
    if decode not in DECODES:
        raise UsageError(f"decode must be one of {', '.join(DECODES)}, got {decode!r}")
    if decode == "auto":
        return "auto" if device.type == "cuda" else "cpu"
    if decode == "gpu" and device.type != "cuda":
        raise UsageError("GPU decoding (decode='gpu') needs a CUDA device; use decode='cpu' (or 'auto') on "
                         f"{device.type}")
    return decode


def auto_decode(workers: int, pixels_per_core: float) -> str:
    """What ``decode="auto"`` picks for a CUDA device: the loader processes (``cpu``) when together they decode and
    crop at least as fast as nvJPEG's path does beside a model (``NVJPEG_PIXELS_PER_S``), else nvJPEG (``gpu``).
    Ties go to the processes: their work costs the GPU nothing. On an H200, ResNet-50 from JPEGs ran at 98.9% of
    synthetic data's speed decoded by 15 processes and at 64.5% decoded by nvJPEG. Without loader processes the
    training process itself would decode between steps: then nvJPEG, on a thread of its own."""
    return "cpu" if workers * pixels_per_core >= NVJPEG_PIXELS_PER_S else "gpu"


def pixels_per_core(data: ImageData, samples: int = RATE_SAMPLES) -> float:
    """Source pixels a second that one core reads, decodes and crops of ``data``, as a loader process does with
    ``decode="cpu"``: ``samples`` images spread over the set, timed on the wall clock after a first one. Pixels,
    not images: nvJPEG's pace (``NVJPEG_PIXELS_PER_S``) was measured on images of one size, and both paths' work
    grows with the pixels (taken as in proportion: not measured across sizes)."""
    cpu = ImageData(data.source, data.crops, decode="cpu", seed=data.seed, channels=data.channels)
    indices = [round(i * (len(cpu) - 1) / samples) for i in range(samples + 1)]
    cpu[(0, indices[0])]  # the first pays for imports and caches
    pixels, spent = 0, 0.0
    for index in indices[1:]:
        start = time.perf_counter()
        crop = cpu[(0, index)][0]
        spent += time.perf_counter() - start
        if crop is not None:  # an unreadable file counts as time only: a worker pays for its read too
            pixels += math.prod(image_size_of(cpu.source.read(index)))
    return pixels / max(spent, 1e-9)


@dataclasses.dataclass(frozen=True)
class Crops:
    """Where each sample's crop lies in its source image, and the size it is resampled to."""

    size: int = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop's area range
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # and its aspect range
    resize_ratio: float = 256 / 224  # validation: the shorter side is resized to size * this, then centre-cropped

    def __post_init__(self):
        if self.size < 1:
            raise UsageError(f"image size must be at least 1 pixel, got {self.size}")

    def box(self, height: int, width: int, rng: random.Random | None) -> tuple[int, int, int, int, bool]:
        """(top, left, crop height, crop width, flip) in an image of ``height`` x ``width``."""
        if not self.train:
            side = min(height, width) / self.resize_ratio  # CenterCrop(size) of Resize(size * ratio), in source pixels
            crop_h, crop_w = min(height, round(side)), min(width, round(side))
            return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w, False
        rng = rng or random
        top, left, crop_h, crop_w = self._random_box(height, width, rng)
        return top, left, crop_h, crop_w, rng.random() < 0.5

    def _random_box(self, height: int, width: int, rng) -> tuple[int, int, int, int]:
        # torchvision's RandomResizedCrop.get_params, with a generator of the sample's own (torchvision's draws
        # from the process's global state, which differs between workers, world sizes and resumed runs).
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            crop_w, crop_h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                return rng.randint(0, height - crop_h), rng.randint(0, width - crop_w), crop_h, crop_w
        aspect = width / height  # ten misses: the centre, as large as the aspect range allows
        if aspect < self.ratio[0]:
            crop_w, crop_h = width, round(width / self.ratio[0])
        elif aspect > self.ratio[1]:
            crop_w, crop_h = round(height * self.ratio[1]), height
        else:
            crop_w, crop_h = width, height
        return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The generator of one sample's augmentation in one epoch."""
    return random.Random((seed * 1_000_003 + epoch) * 2_147_483_659 + index)


def resample(image: torch.Tensor, box: Sequence[int], size: int, flip: bool) -> torch.Tensor:
    """The ``box`` (top, left, height, width) of a (C, H, W) image, resampled to size x size with antialiasing."""
    from torchvision.transforms.v2 import functional as tvf

    top, left, height, width = (int(v) for v in box[:4])
    crop = tvf.resized_crop(image, top, left, height, width, [size, size], antialias=True)
    return crop.flip(-1) if flip else crop


# The float32 copies of images of one size resampled by one pair of matrix products, at most (a 500x375 colour
# image is 2.25 MB of them: 113 at once; a 12-megapixel photograph, 144 MB: one at a time).
RESAMPLED_BYTES = 256 << 20


def resample_batch(images: Sequence[torch.Tensor], boxes: torch.Tensor, size: int, channels: int = 3) -> torch.Tensor:
    """Every (C, H, W) uint8 image's box (``boxes``' rows: top, left, height, width, flip, ...) resampled to size x
    size with antialiasing, as (N, C, size, size) uint8 (C: ``channels`` for an empty batch): ``resample``'s
    arithmetic, batched.

    An antialiased bilinear resize is linear and separable: the crop is ``rows @ image @ columns.T``, with one
    weight matrix per axis that holds torch's antialiasing filter over the box's pixels and zeros elsewhere (a
    flip reverses the columns'). Images of one size are stacked and resampled by two batched matrix products: a
    few kernels per batch (per size in it) instead of a few per image, which on a GPU were about 1,500 launches
    per batch of 256. In float32, rounded to uint8 at the end, as torchvision rounds a uint8 image it resamples
    in float (on a GPU); torch's CPU kernel resamples uint8 in fixed point, within one level of this.
    """
    count = len(images)
    channels = images[0].shape[0] if count else channels
    device = images[0].device if count else boxes.device
    out = torch.empty(count, channels, size, size, dtype=torch.uint8, device=device)
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        by_size.setdefault(tuple(image.shape[-2:]), []).append(i)
    boxes = boxes.to(device)
    for (height, width), members in by_size.items():
        at_once = max(1, RESAMPLED_BYTES // (4 * channels * height * width))
        for start in range(0, len(members), at_once):
            chunk = members[start:start + at_once]
            box = boxes[chunk] if len(chunk) < count else boxes
            rows = filter_matrix(box[:, 0], box[:, 2], height, size)
            columns = filter_matrix(box[:, 1], box[:, 3], width, size, flip=box[:, 4].bool())
            stacked = torch.stack([images[i] for i in chunk]).float()
            crops = rows.unsqueeze(1) @ stacked @ columns.unsqueeze(1).transpose(-1, -2)
            crops = crops.round_().clamp_(0, 255).to(torch.uint8)
            if len(chunk) == count:
                return crops
            out[torch.tensor(chunk, device=device)] = crops
    return out


def filter_matrix(starts: torch.Tensor, lengths: torch.Tensor, extent: int, size: int,
                  flip: torch.Tensor | None = None) -> torch.Tensor:
    """(N, size, extent) float32: row i of matrix n weighs the input pixels that output pixel i of a resize of
    pixels [start, start + length) of an axis of ``extent`` to ``size`` takes in, as torch's antialiased bilinear
    interpolation weighs them (a triangle as wide as the scale, from one pixel when enlarging; cut at the box's
    edges and normalised); ``flip``: the outputs in reverse order."""
    starts, lengths = starts.to(torch.float32)[:, None, None], lengths.to(torch.float32)[:, None, None]
    scale = lengths / size
    support = scale.clamp(min=1.0)  # the triangle's half-width in input pixels
    outputs = torch.arange(size, dtype=torch.float32, device=starts.device)[None, :, None]
    if flip is not None:
        outputs = torch.where(flip[:, None, None], size - 1 - outputs, outputs)
    centres = scale * (outputs + 0.5)
    inputs = torch.arange(extent, dtype=torch.float32, device=starts.device)[None, None, :] - starts
    weights = (1 - ((inputs + 0.5 - centres) / support).abs()).clamp_(min=0)
    weights = weights.masked_fill_((inputs < 0) | (inputs >= lengths), 0)
    return weights / weights.sum(-1, keepdim=True)


class Unreadable(Exception):
    """A sample's file could not be decoded."""


def decode_on_cpu(data: bytes, channels: int, fast: bool = False) -> torch.Tensor:
    """(C, H, W) uint8 from an encoded image; ``Unreadable``, with the first decoder's reason, when it is not one.

    JPEGs are decoded by simplejpeg (libjpeg-turbo; ``fast``: its fast DCT and chroma upsampling, which training
    crops do not notice); what it refuses (CMYK JPEGs, PNG, WebP, GIF) by torchvision.io; the rest (BMP, TIFF, PPM)
    by PIL."""
    if not data:
        raise Unreadable("empty file")
    reasons = []
    if data[:2] == JPEG_MAGIC:
        import simplejpeg

        try:
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB" if channels == 3 else "GRAY", fastdct=fast,
                                            fastupsample=fast)
            return torch.from_numpy(pixels).permute(2, 0, 1)  # a view: (C, H, W) over the decoder's (H, W, C)
        except ValueError as error:
            reasons.append(str(error))
    from torchvision.io import ImageReadMode, decode_image

    try:
        mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
    except (RuntimeError, ValueError) as error:
        # torchvision's messages start with where in its C++ they were raised: "decode_jpeg, /path/x.cpp:171, ..."
        reasons.append(str(error).splitlines()[0].split(".cpp:", 1)[-1].lstrip("0123456789, "))
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            pixels = image.convert("RGB" if channels == 3 else "L")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        reasons.append(str(error))
        raise Unreadable(reasons[0] or type(error).__name__) from None
    return torch.frombuffer(bytearray(pixels.tobytes()), dtype=torch.uint8).view(pixels.height, pixels.width,
                                                                                  channels).permute(2, 0, 1)


def image_size_of(data: bytes) -> tuple[int, int]:
    """(height, width) from an image's header, without decoding its pixels."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise Unreadable("empty file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise Unreadable(str(error) or type(error).__name__) from None
    return height, width


class ImageData(Dataset):
    """Encoded images and their labels (``source``: where the bytes are) as (image, label) samples.

    ``decode``: ``cpu``, ``gpu`` or ``auto`` (settled by ``for_device``; until then, ``cpu``).

    Items are intermediate: with ``decode="cpu"`` a uint8 crop, with ``decode="gpu"`` the file's bytes and its crop
    box; ``collate`` makes a batch of them and ``to_device`` finishes it (decode on the GPU, normalise) into float
    images on the device. ddpkit's loaders (``train_loader``, ``eval_loader``, ``Job.prepare``) call both.
    """

    def __init__(self, source, crops: Crops, *, decode: str = "cpu", seed: int = 0, channels: int = 3,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None):
        if channels not in (1, 3):
            raise UsageError(f"images are read with 1 or 3 channels, not {channels}")
        if decode not in DECODES:
            raise UsageError(f"decode must be one of {', '.join(DECODES)}, got {decode!r}")
        self.source = source
        self.crops = crops
        self.decode = decode
        self.seed = seed
        self.channels = channels
        default_mean, default_std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,), (0.5,))
        self.mean = tuple(mean or default_mean)
        self.std = tuple(std or default_std)
        self.skipped = 0  # samples left out of batches (unreadable files) in this process since the data set was made

    def for_device(self, device: torch.device, workers: int = 0, decide: Callable | None = None) -> None:
        """Settle ``decode="auto"`` for the device the batches go to and the loader processes that read them
        (ddpkit's loaders call it): ``cpu`` on a CPU; on CUDA ``auto_decode`` of this machine's measured pace, worked
        out by ``decide(choose)`` (the loaders pass one that lets global rank 0 choose for every rank)."""
        self.decode = check_decode(self.decode, device)
        if self.decode == "auto":
            decide = decide or (lambda choose: choose())
            self.decode = decide(functools.partial(self._measured_choice, workers))

    def _measured_choice(self, workers: int) -> str:
        from ddpkit.core.logs import logger

        pace = pixels_per_core(self)
        choice = auto_decode(workers, pace)
        logger.info(f"decode auto: {choice}: {workers} loader process{'es' if workers != 1 else ''} x "
                    f"{pace / 1e6:.0f} Mpixels/s per core {'>=' if choice == 'cpu' else '<'} nvJPEG's "
                    f"{NVJPEG_PIXELS_PER_S / 1e6:.0f}")
        return choice

    @property
    def classes(self) -> list[str]:
        return self.source.classes

    @property
    def targets(self) -> list[int]:
        return self.source.labels

    def __len__(self) -> int:
        return len(self.source)

    takes_epoch = True  # ddpkit's samplers pass (epoch, index): the crop is the sample's own in that epoch

    def __getitem__(self, key: int | tuple[int, int]) -> tuple:
        epoch, index = key if isinstance(key, tuple) else (None, key)
        rng = sample_rng(self.seed, epoch, index) if epoch is not None else None
        label = self.source.labels[index]
        try:
            data = self.source.read(index)
            if self.decode == "gpu":
                height, width = image_size_of(data)
                box = (*self.crops.box(height, width, rng), index)  # the index names the file if nvJPEG fails
                return torch.frombuffer(bytearray(data), dtype=torch.uint8), box, label
            image = decode_on_cpu(data, self.channels, fast=self.crops.train)
            *box, flip = self.crops.box(image.shape[1], image.shape[2], rng)
            return resample(image, box, self.crops.size, flip), None, label
        except (Unreadable, OSError) as error:
            return None, f"{self.source.name(index)}: {error}", label  # left out of its batch by collate

    def collate(self, items: list[tuple]) -> tuple:
        """A batch: (uint8 crops, or the files' bytes and their (top, left, height, width, flip, index) boxes; labels;
        the unreadable files)."""
        good = [item for item in items if item[0] is not None]
        bad = [item[1] for item in items if item[0] is None]
        labels = torch.tensor([item[2] for item in good], dtype=torch.long)
        if self.decode == "gpu":
            boxes = torch.tensor([item[1] for item in good], dtype=torch.long).reshape(-1, 6)
            return [item[0] for item in good], boxes, labels, bad
        size = self.crops.size
        images = torch.stack([item[0] for item in good]) if good else torch.empty(0, self.channels, size, size,
                                                                                      dtype=torch.uint8)
        return images, None, labels, bad

    def to_device(self, batch: tuple, device: torch.device, non_blocking: bool = False) -> tuple:
        """(float images normalised, labels), on ``device``, from a collated batch."""
        images, boxes, labels, bad = batch
        if boxes is not None:  # the files' bytes: decoded here, on the device
            images, kept, unreadable = self._decode_on_device(images, boxes, device)
            labels, bad = labels[kept], bad + unreadable
        if bad:
            self._leave_out(bad, len(labels))
        images = images.to(device, non_blocking=non_blocking)
        mean, std = _scaled_mean_std(self.mean, self.std, torch.device(device))
        return images.float().sub_(mean).div_(std), labels.to(device, non_blocking=non_blocking)

    def _leave_out(self, bad: list[str], readable: int) -> None:
        for line in bad:
            self.skipped += 1
            if self.skipped <= NAMED_SKIPS:
                _warn(f"skipped an unreadable image: {line}")
            if self.skipped == NAMED_SKIPS:
                _warn(f"{NAMED_SKIPS} unreadable images skipped: more are counted, not named (ddpkit data check "
                      "PATH lists them all)")
        if readable == 0:
            raise UsageError(f"a batch held no readable image ({'; '.join(bad[:3])}); check the data (ddpkit data "
                             "check PATH lists every unreadable file)")

    def _decode_on_device(self, encoded: list[torch.Tensor], boxes: torch.Tensor,
                          device: torch.device) -> tuple[torch.Tensor, list[int], list[str]]:
        """(crops, which samples they are, what could not be decoded) of a batch of encoded images."""
        decoded = decode_jpegs(encoded, device, self.channels)
        kept = [i for i, image in enumerate(decoded) if isinstance(image, torch.Tensor)]
        unreadable = [f"{self.source.name(int(boxes[i][5]))}: {decoded[i]}" for i in range(len(decoded))
                      if i not in kept]
        crops = resample_batch([decoded[i] for i in kept], boxes[kept], self.crops.size, self.channels)
        return crops, kept, unreadable


@functools.lru_cache(maxsize=8)
def _scaled_mean_std(mean: tuple[float, ...], std: tuple[float, ...],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation in uint8 units, shaped for a batch, made once per device (not once per batch:
    each would be a small host-to-device copy on the loader's hot path)."""
    return (torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255,
            torch.tensor(std, device=device).view(1, -1, 1, 1) * 255)


def _warn(message: str) -> None:
    from ddpkit.core.logs import logger

    logger.warning(message)


def decode_jpegs(encoded: list[torch.Tensor], device: torch.device, channels: int) -> list[torch.Tensor | str]:
    """Decode a batch on ``device``: the JPEGs at once (nvJPEG on a GPU), anything else on the CPU, then moved; for
    a file that cannot be decoded, the reason instead of an image."""
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    jpegs = [i for i, data in enumerate(encoded) if bytes(data[:2].tolist()) == JPEG_MAGIC]
    out: list[torch.Tensor | str | None] = [None] * len(encoded)
    try:
        decoded = decode_jpeg([encoded[i] for i in jpegs], mode=mode, device=device) if jpegs else []
    except RuntimeError:
        decoded = [None] * len(jpegs)  # one bad file fails the batch: each is decoded on its own below
    for i, image in zip(jpegs, decoded):
        out[i] = image
    for i, image in enumerate(out):
        if image is None:
            try:
                out[i] = decode_on_cpu(bytes(encoded[i].numpy()), channels).to(device)
            except Unreadable as error:
                out[i] = str(error)
    return out  # type: ignore[return-value]


@dataclasses.dataclass
class FolderSource:
    """Image files of a class-per-folder tree (torchvision's ImageFolder layout)."""

    root: str
    classes: list[str]
    paths: list[str]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> bytes:
        with open(self.paths[index], "rb") as file:
            return file.read()

    def name(self, index: int) -> str:
        return self.paths[index]

    def subset(self, indices: Sequence[int]) -> FolderSource:
        return FolderSource(self.root, self.classes, [self.paths[i] for i in indices],
                            [self.labels[i] for i in indices])


def scan_folder(root: str, classes: list[str] | None = None, what: str = "--data folder:") -> FolderSource:
    """The images of ``root``/CLASS/..., in ImageFolder's order (classes sorted, files sorted); UsageError, naming the
    folder, for a missing or empty folder and for a class folder without images."""
    from torchvision.datasets.folder import find_classes, make_dataset

    if not os.path.isdir(root):
        raise UsageError(f"{what}{root}: no such folder")
    try:
        found, _ = find_classes(root)
    except FileNotFoundError:
        raise UsageError(f"{what}{root}: no class folders in it; expected one sub-folder of images per class "
                         f"({root}/CLASS/IMAGE.jpg)") from None
    if classes is not None and found != classes:
        missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
        raise UsageError(f"{what}{root}: its class folders differ from the training set's (missing: "
                         f"{', '.join(missing[:5]) or 'none'}; extra: {', '.join(extra[:5]) or 'none'})")
    class_to_idx = {name: i for i, name in enumerate(found)}
    try:
        samples = make_dataset(root, class_to_idx, extensions=IMAGE_EXTENSIONS)
    except FileNotFoundError as error:  # torchvision names the classes that have no image
        raise UsageError(f"{what}{root}: {str(error).splitlines()[0].rstrip('. ')}; every class folder needs at "
                         f"least one image ({', '.join(IMAGE_EXTENSIONS)})") from None
    return FolderSource(root, found, [path for path, _ in samples], [label for _, label in samples])


def image_data(source, *, train: bool = True, size: int = 224, decode: str = "auto", seed: int = 0, channels: int = 3,
               **crops) -> ImageData:
    """``source``'s images as training (random crops and flips) or validation (centre crops) data of ``size`` pixels;
    further keywords are ``Crops``' (``scale``, ``ratio``, ``resize_ratio``)."""
    return ImageData(source, Crops(size, train, **crops), decode=decode, seed=seed, channels=channels)


def image_folder(root: str, *, classes: list[str] | None = None, **settings) -> ImageData:
    """A class-per-folder tree of images as training (random crops and flips) or validation (centre crops) data.

        train = ddpkit.image_folder("/data/imagenet/train")
        val = ddpkit.image_folder("/data/imagenet/val", train=False, classes=train.classes)
        loader = job.train_loader(train, batch_size=256)     # float32 batches, normalised, on job.device

    Settings (``image_data``'s): ``train`` (default True), ``size`` (224), ``decode``: ``cpu`` (loader processes),
    ``gpu`` (nvJPEG) or ``auto`` (the default: ``cpu``, or on CUDA ``gpu`` when ``auto_decode`` says the loader
    processes are too few), ``seed`` of the crops (with the epoch and the sample's index), ``channels`` (3 or 1),
    and ``Crops``' ``scale``, ``ratio``, ``resize_ratio``.
    ``classes``: the training set's, which a validation folder must match. Read it through ddpkit's loaders
    (``train_loader``, ``eval_loader``, ``Job.prepare``), which batch and finish it.
    """
    return image_data(scan_folder(root, classes, what=""), **settings)


def image_data_in(dataset: Any) -> ImageData | None:
    """The ``ImageData`` that ``dataset`` is (maybe inside Subsets), else None."""
    from torch.utils.data import Subset

    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset if isinstance(dataset, ImageData) else None


def loader_hooks(dataset: Any) -> tuple[Callable | None, Callable | None]:
    """(collate, to_device) of a data set that finishes its batches itself (``ImageData``, maybe in a Subset)."""
    found = image_data_in(dataset)
    return (found.collate, found.to_device) if found is not None else (None, None)


def takes_epoch(dataset: Any) -> bool:
    """Whether ``dataset`` takes (epoch, index) keys (its samples' augmentation is per epoch)."""
    return bool(getattr(dataset, "takes_epoch", False))
