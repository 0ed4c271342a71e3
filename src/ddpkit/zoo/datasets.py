"""The data sets ``--data`` names: ``digits`` (scikit-learn's 1,797 handwritten 8x8 digits, resized: a real data
set that is installed with ddpkit, no download), ``synthetic[:N]`` (learnable random images, like the tutorials'
RandomDataset but with a signal in them), ``mnist[:DIR]`` (torchvision's MNIST, downloaded into DIR where the
network allows), ``folder:PATH`` (a class-per-folder tree of images; ``PATH/train`` and ``PATH/val`` if present),
``shards:PATH`` (such a tree packed by ``ddpkit data pack``), and a data set of the user's own as
``package.module:function`` (``ddpkit.zoo.user_code``). Image folders and packs are read by ``ddpkit.data.images``:
random crops and flips for training, centre crops for validation, decoded on the CPU or the GPU.

    >>> from ddpkit.zoo import parse_data_spec
    >>> parse_data_spec("synthetic:512")
    DataSpec(kind='synthetic', arg='512')
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from ddpkit.core.errors import UsageError, first_line
from ddpkit.zoo import user_code
from ddpkit.zoo.models import model_input

DATA_KINDS = ("digits", "synthetic", "mnist", "folder", "shards")
IMAGE_KINDS = ("folder", "shards")  # image files, decoded by ddpkit.data.images
USER_DATA = "function"  # DataSpec.kind of --data package.module:function
DEFAULT_SYNTHETIC_SIZE = 1024
DEFAULT_MNIST_DIR = "./data"
# The split of data sets that ship no validation part is fixed, whatever --seed says, so that
# val_acc of two runs with different seeds is measured on the same samples.
SPLIT_SEED = 20240601



@dataclasses.dataclass(frozen=True)
class DataSpec:
    kind: str
    arg: str | None = None


def parse_data_spec(spec: str) -> DataSpec:
    """Check a ``--data`` value's syntax, and that a folder exists; nothing is loaded."""
    kind, _, arg = spec.partition(":")
    arg = arg or None
    if kind not in DATA_KINDS and user_code.is_spec(spec):
        return DataSpec(USER_DATA, spec)
    if kind not in DATA_KINDS:
        raise UsageError(f"unknown data set {spec!r}; use digits, synthetic[:N], mnist[:DIR], folder:PATH, "
                         "shards:PATH, or your own as package.module:function")
    if kind == "digits" and arg is not None:
        raise UsageError(f"--data digits takes no argument, got {spec!r}")
    if kind == "synthetic" and arg is not None and not (arg.isdigit() and int(arg) >= 1):
        raise UsageError(f"--data synthetic:N needs a positive whole number of samples, got {arg!r}")
    if kind in IMAGE_KINDS:
        if arg is None:
            raise UsageError(f"--data {kind}:PATH needs a path, e.g. --data {kind}:/data/imagenet")
        if "://" in arg:
            raise UsageError(f"--data {spec}: ddpkit reads local or mounted folders; copy the data there or mount the "
                             "bucket (s3fs, gcsfuse, blobfuse)")
        if not os.path.isdir(arg):
            raise UsageError(f"--data {spec}: folder {arg!r} does not exist")
    return DataSpec(kind, arg)


@dataclasses.dataclass
class Datasets:
    train: Dataset
    val: Dataset
    num_classes: int | None  # None: a data set of the user's own that does not say


def _fit_images(images: torch.Tensor, channels: int, image_size: int) -> torch.Tensor:
    """(N, 1, H, W) in [0, 1] -> (N, channels, image_size, image_size), standardised per channel."""
    if images.shape[-1] != image_size:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    return images.expand(-1, channels, -1, -1).contiguous()


def _split(length: int, val_fraction: float) -> tuple[list[int], list[int]]:
    order = torch.randperm(length, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_val = max(1, round(length * val_fraction))
    return order[n_val:], order[:n_val]


# Where scikit-learn keeps the digits inside its package: one row per scan, 64 pixels (0-16), then the label.
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")


def digits_arrays():
    """scikit-learn's digits as numpy arrays: (images (1797, 8, 8) float64, labels (1797,) int64).

    Read from the file scikit-learn ships, as its ``load_digits`` does, without importing scikit-learn:
    that import (scipy.stats and more) takes 1.5 to 2 s on a small CPU, in every rank of every run on the
    default data set, where reading the file takes a few milliseconds. If a scikit-learn keeps the file
    elsewhere, its ``load_digits`` is used instead (tests/test_data_sources.py checks both agree).
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = os.path.join(os.path.dirname(spec.origin), *DIGITS_FILE) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        from sklearn.datasets import load_digits as sklearn_digits

        bunch = sklearn_digits()
        return bunch.images, bunch.target
    import numpy as np

    rows = np.loadtxt(path, delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


def load_digits(channels: int, image_size: int) -> Datasets:
    """scikit-learn's handwritten digits (1,797 real 8x8 scans), resized; 20% held out for validation."""
    pixels, targets = digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(targets, dtype=torch.long)
    images = _fit_images(images, channels, image_size)
    train_idx, val_idx = _split(len(labels), 0.2)
    return Datasets(
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[val_idx], labels[val_idx]),
        num_classes=10,
    )


def load_synthetic(size: int, channels: int, image_size: int, num_classes: int = 10) -> Datasets:
    """``size`` training and ``size // 4`` validation images: a fixed pattern per class plus noise.

    Generated from a fixed seed, so every rank builds the same data without communicating.
    """
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    prototypes = torch.randn(num_classes, channels, image_size, image_size, generator=generator)
    total = size + max(1, size // 4)
    labels = torch.randint(0, num_classes, (total,), generator=generator)
    images = prototypes[labels] * 0.5 + torch.randn(total, channels, image_size, image_size, generator=generator)
    return Datasets(
        TensorDataset(images[:size], labels[:size]),
        TensorDataset(images[size:], labels[size:]),
        num_classes=num_classes,
    )


def load_mnist(root: str, channels: int, image_size: int) -> Datasets:
    """torchvision's MNIST (60,000 train / 10,000 test), downloaded into ``root`` if not there."""
    from torchvision import datasets, transforms

    steps = []
    if image_size != 28:
        steps.append(transforms.Resize(image_size))
    if channels != 1:
        steps.append(transforms.Grayscale(num_output_channels=channels))
    steps += [transforms.ToTensor(), transforms.Normalize((0.1307,) * channels, (0.3081,) * channels)]
    transform = transforms.Compose(steps)
    try:
        train = datasets.MNIST(root, train=True, download=True, transform=transform)
        val = datasets.MNIST(root, train=False, download=True, transform=transform)
    except (RuntimeError, OSError) as error:
        # torchvision's message runs over several lines (one per mirror tried): keep the first.
        raise UsageError(
            f"MNIST is not in {os.path.join(root, 'MNIST', 'raw')} and could not be downloaded ({first_line(error)}); "
            "copy the four *-idx?-ubyte files there or use --data digits"
        ) from None
    return Datasets(train, val, num_classes=10)


def load_images(kind: str, path: str, channels: int, image_size: int, *, decode: str = "cpu",
                seed: int = 0) -> Datasets:
    """An image folder (``kind`` folder) or a pack of one (``shards``): ``path/train`` + ``path/val`` (or valid,
    validation, test) when present, else the training part split 90/10.

    A folder without ``train/`` is itself the class-per-folder root. Training samples get random crops and flips
    (seeded by ``seed``, the epoch and the sample), validation samples centre crops (``ddpkit.data.images``).
    """
    from ddpkit.data import images, shards

    what = f"--data {kind}:"
    train, val = shards.read_parts(kind, path, what)
    if val is None:
        if len(train) < 2:
            raise UsageError(f"{what}{path} holds {len(train)} image; a split into training and validation needs "
                             "at least 2 (or give train/ and val/ folders)")
        train_idx, val_idx = _split(len(train), 0.1)
        train, val = train.subset(train_idx), train.subset(val_idx)
    made = [images.image_data(source, train=part == "train", size=image_size, decode=decode, seed=seed,
                              channels=channels) for part, source in (("train", train), ("val", val))]
    return Datasets(*made, num_classes=len(train.classes))


def load_for_model(model: str, spec: DataSpec, image_size: int | None,
                   arguments: dict | None = None, *, decode: str = "cpu", seed: int = 0) -> tuple[Datasets, int, int]:
    """The data sets ``spec`` says, made for ``model``, and (channels, image size) of the model's input.

    The built-in data are made in the channels and size the model takes; a data set of the user's own
    (``arguments``: its function's) is as it is, and a built-in model is made for its images.
    """
    if spec.kind != USER_DATA:
        channels, image_size = model_input(model, spec.kind, image_size)
        return load_data(spec, channels=channels, image_size=image_size, decode=decode, seed=seed), channels, image_size
    sets = Datasets(*user_code.load_data(spec.arg, arguments or {}))
    inputs = sets.train[0][0]
    if user_code.is_spec(model):
        return sets, 0, 0  # the user's model takes the user's inputs, whatever they are
    if not (isinstance(inputs, torch.Tensor) and inputs.dim() == 3 and inputs.shape[1] == inputs.shape[2]):
        shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise UsageError(f"--model {model} takes square images (channels, height, width), but --data {spec.arg} gives "
                         f"{shape}; give your own --model package.module:function")
    return sets, inputs.shape[0], inputs.shape[1]


def example_batch(sets: Datasets, batch_size: int, channels: int, image_size: int) -> torch.Tensor | None:
    """A batch shaped as the model's input (values unused; a pipeline sizes its stages with it)."""
    if channels:
        return torch.zeros(batch_size, channels, image_size, image_size)
    inputs = sets.train[0][0]
    return inputs.unsqueeze(0).expand(batch_size, *inputs.shape) if isinstance(inputs, torch.Tensor) else None


def load_data(spec: DataSpec, *, channels: int, image_size: int, decode: str = "cpu", seed: int = 0) -> Datasets:
    """The data sets ``spec`` names; ``decode`` and ``seed``: of image folders and packs (``load_images``)."""
    if spec.kind == "digits":
        return load_digits(channels, image_size)
    if spec.kind == "synthetic":
        return load_synthetic(int(spec.arg or DEFAULT_SYNTHETIC_SIZE), channels, image_size)
    if spec.kind == "mnist":
        return load_mnist(spec.arg or DEFAULT_MNIST_DIR, channels, image_size)
    return load_images(spec.kind, spec.arg, channels, image_size, decode=decode, seed=seed)
