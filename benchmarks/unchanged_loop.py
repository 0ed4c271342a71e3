"""A training loop written for one device, timed step by step: what ``benchmarks/unchanged.py`` runs under
``ddpkit run --unchanged``; ``benchmarks/prepared_loop.py`` runs the same loop on ``ddpkit.Job.prepare`` (each process
taking its own batch of ``--batch-size``, so the driver halves it there to keep the global batch). This file names
nothing of ddpkit: a script that does is one that distributes itself, and --unchanged stands aside for it.

    python -m ddpkit run --unchanged --nproc-per-node 2 benchmarks/unchanged_loop.py --batch-size 64
    python -m ddpkit run --nproc-per-node 2 benchmarks/prepared_loop.py --batch-size 32     # on job.prepare

Model: a torchvision ResNet (``--model``, default resnet18) on synthetic 3 x 64 x 64 images, SGD, a DataLoader over
a TensorDataset (no decoding: the step is the model's), on the GPU where there is one (``cuda``, as a one-device
script says it). Prints one JSON line (rank 0, or the one process): the median seconds per step after ``--warmup``
steps, with the quartiles, over ``--steps`` timed steps, the sum of all the steps (``total_s``: passes' first batches
included), and the GPUs the process sees. ``--samples`` and ``--workers`` size the data set and the loader's workers.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, TensorDataset

def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--norm", choices=("batch", "none"), default="batch",
                        help="the ResNet's normalisation layers: BatchNorm, or none (nn.Identity)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", type=int, default=None,
                        help="the data set's size (default: 8 batches of --batch-size)")
    parser.add_argument("--workers", type=int, default=0, help="the DataLoader's num_workers (default: 0)")
    return parser.parse_args(argv)


def build(args: argparse.Namespace):
    """(device, model, optimizer, loader), as a one-device script makes them."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as a one-device script picks it
    norm = {} if args.norm == "batch" else {"norm_layer": lambda channels: torch.nn.Identity()}
    model = torchvision.models.__dict__[args.model](num_classes=10, **norm).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.samples or args.batch_size * 8, 3, args.image_size, args.image_size)
    loader = DataLoader(TensorDataset(images, torch.randint(0, 10, (len(images),))), batch_size=args.batch_size,
                        shuffle=True, drop_last=True, num_workers=args.workers)
    return device, model, optimizer, loader


def train(args: argparse.Namespace, device, model, optimizer, loader) -> dict:
    """The loop, each step timed (wall, and this thread's CPU); the report of the steps after the warm-up."""
    times, cpu_times = [], []
    model.train()
    while len(times) < args.warmup + args.steps:
        start, cpu_start = time.perf_counter(), time.thread_time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            now, cpu_now = time.perf_counter(), time.thread_time()
            times.append(now - start)
            cpu_times.append(cpu_now - cpu_start)
            start, cpu_start = now, cpu_now
            if len(times) == args.warmup + args.steps:
                break
    timed = sorted(times[args.warmup:])
    quartiles = statistics.quantiles(timed, n=4)
    return {"median_s": statistics.median(timed), "q1_s": quartiles[0], "q3_s": quartiles[2], "steps": len(timed),
            "total_s": sum(times),  # every step, the warm-up and each pass's first batch included
            "median_thread_cpu_s": statistics.median(cpu_times[args.warmup:]), "device": str(device),
            "visible_gpus": torch.cuda.device_count(), "threads": torch.get_num_threads(),
            "batch_per_process": len(x)}


if __name__ == "__main__":
    options = parse()
    print(json.dumps(train(options, *build(options))))
