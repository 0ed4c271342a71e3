"""Training crops per second per core: ddpkit's CPU image path against torchvision's standard ImageFolder pipeline,
on the same JPEG files, in one run (docs/benchmarks.md).

    python benchmarks/image_decode.py                    # makes 400 ImageNet-sized JPEGs in a temporary folder
    python benchmarks/image_decode.py --folder /data/imagenet/train --images 2000

One process, one thread (torch.set_num_threads(1)), no loader workers: what one core does, which is what each
loader worker does. Both pipelines end in a float32 (3, 224, 224) batch normalised with ImageNet's mean and std:

* torchvision: ImageFolder (PIL decode, RGB convert), RandomResizedCrop(224), RandomHorizontalFlip, ToTensor,
  Normalize, default_collate;
* ddpkit: ddpkit.data.image_folder(decode="cpu") (libjpeg-turbo decode, one antialiased uint8 resample of the
  crop, flip), its collate, and the batch normalised as its loaders do on the device (here the CPU: what CPU
  training pays);
* ddpkit_worker: the same without the normalisation, which a GPU run does on the GPU: what one loader process
  does there.

Rounds alternate in order (warm-up first); the medians of --repeats rounds are reported, with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch


def torchvision_round(folder: str, indices: list[int], batch: int) -> float:
    from torch.utils.data import default_collate
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                    transforms.ToTensor(),
                                    transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    data = datasets.ImageFolder(folder, transform=transform)
    start = time.perf_counter()
    for first in range(0, len(indices), batch):
        images, _ = default_collate([data[i] for i in indices[first:first + batch]])
    assert images.dtype == torch.float32 and images.shape[1:] == (3, 224, 224)
    return len(indices) / (time.perf_counter() - start)


def ddpkit_round(folder: str, indices: list[int], batch: int, epoch: int, normalise: bool = True) -> float:
    from ddpkit.data.images import image_folder

    data = image_folder(folder, train=True, size=224, decode="cpu")
    cpu = torch.device("cpu")
    start = time.perf_counter()
    for first in range(0, len(indices), batch):
        images = data.collate([data[(epoch, i)] for i in indices[first:first + batch]])[0]
        if normalise:
            images, _ = data.to_device((images, None, torch.zeros(len(images), dtype=torch.long), []), cpu)
    assert images.dtype == (torch.float32 if normalise else torch.uint8) and images.shape[1:] == (3, 224, 224)
    return len(indices) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="an ImageFolder tree (default: generate --images JPEGs)")
    parser.add_argument("--images", type=int, default=400, help="images per round (default: 400)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ddpkit-jpegs-") as scratch:
        folder = args.folder
        if folder is None:
            from ddpkit.data.sample_images import write_folder

            folder = scratch
            write_folder(folder, images=args.images, classes=10)
        from ddpkit.data.images import scan_folder

        count = min(args.images, len(scan_folder(folder)))
        indices = list(range(count))
        rounds = {"torchvision": lambda repeat: torchvision_round(folder, indices, args.batch),
                  "ddpkit": lambda repeat: ddpkit_round(folder, indices, args.batch, repeat),
                  "ddpkit_worker": lambda repeat: ddpkit_round(folder, indices, args.batch, repeat, normalise=False)}
        torchvision_round(folder, indices[:args.batch], args.batch)  # warm-up: imports, page cache
        ddpkit_round(folder, indices[:args.batch], args.batch, 0)
        rates = {name: [] for name in rounds}
        for repeat in range(args.repeats):
            order = list(rounds.items())
            for name, run_round in order if repeat % 2 == 0 else reversed(order):
                rates[name].append(run_round(repeat))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    result = {"images": count, "batch": args.batch, "repeats": args.repeats, "torch": torch.__version__,
              "crops_per_s_per_core": {name: round(value, 1) for name, value in medians.items()},
              "ratio_ddpkit_to_torchvision": round(medians["ddpkit"] / medians["torchvision"], 2),
              "ratio_ddpkit_worker_to_torchvision": round(medians["ddpkit_worker"] / medians["torchvision"], 2)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
