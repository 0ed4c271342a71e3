"""What BatchNorm over every process's rows costs (``ddpkit.strategies.sync_bn.synced_batch_norm``: ``--sync-bn``,
``job.prepare(..., sync_bn=True)``, and every BatchNorm layer of a model under ``ddpkit run --unchanged``) against
PyTorch's own BatchNorm on this process's rows alone, layer by layer, in the same run.

    ddpkit run --nproc-per-node 2 benchmarks/sync_bn_cost.py [--batch-size 50] [--image-size 224] [--rounds 5]
        [--json FILE]

For each BatchNorm layer of torchvision's resnet18 (its input's shape at ``--image-size`` pixels, ``--batch-size``
rows on each process): rounds of one forward and backward of ``nn.BatchNorm2d`` and of the synced layer, alternating,
on the job's device (each process one thread on the CPU; on a GPU, the device synchronised before each clock read). Reported from rank 0: each layer's medians and their ratio, and the sums over the network's
20 layers (the same shape repeats: 1 at the stem's size, then 4, 5, 5 and 5 at each stage's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

import ddpkit
from ddpkit.strategies.sync_bn import synced_batch_norm

# resnet18's BatchNorm inputs: (channels, the image's size divided by, layers of that shape)
RESNET18_NORMS = [(64, 2, 1), (64, 4, 4), (128, 8, 5), (256, 16, 5), (512, 32, 5)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=50, help="rows on each process (default: 50)")
    parser.add_argument("--image-size", type=int, default=224, help="pixels (default: 224)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per layer and way (default: 5)")
    parser.add_argument("--json", default=None, metavar="FILE", help="rank 0 also writes the results here")
    return parser.parse_args(argv)


def timed(work, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(channels: int, size: int, device: torch.device, args) -> dict:
    torch.manual_seed(0)
    layer = nn.BatchNorm2d(channels).to(device)
    rows = torch.randn(args.batch_size, channels, size, size, device=device, requires_grad=True)
    grad = torch.randn_like(rows)

    def native() -> None:
        layer(rows).backward(grad)

    def synced() -> None:
        synced_batch_norm(layer, rows).backward(grad)

    native(), synced()  # warm-up
    rounds = [(timed(native, device), timed(synced, device)) for _ in range(args.rounds)]
    native_s, synced_s = (statistics.median(times) for times in zip(*rounds))
    return {"channels": channels, "size": size, "native_s": native_s, "synced_s": synced_s,
            "synced_over_native": synced_s / native_s}


def main(argv=None) -> int:
    args = parse_args(argv)
    with ddpkit.Job("ddp", check_replicas=0, seed=0) as job:
        if job.device.type == "cpu":
            torch.set_num_threads(1)
        rows = [dict(measure(channels, args.image_size // down, job.device, args), layers=layers)
                for channels, down, layers in RESNET18_NORMS]
    if job.is_main:
        native = sum(row["native_s"] * row["layers"] for row in rows)
        synced = sum(row["synced_s"] * row["layers"] for row in rows)
        lines = [f"BatchNorm over {job.world_size} processes against each process's own: {job.device.type}, "
                 f"{args.batch_size} rows a process, resnet18's layers at {args.image_size} pixels, median of "
                 f"{args.rounds} rounds, torch {torch.__version__}",
                 f"{'input':<18} {'layers':>6} {'native ms':>10} {'synced ms':>10} {'synced/native':>14}"]
        lines += [f"{row['channels']:>4} x {row['size']:>3} x {row['size']:<3}    {row['layers']:>6} "
                  f"{row['native_s'] * 1e3:>10.1f} {row['synced_s'] * 1e3:>10.1f} {row['synced_over_native']:>14.3f}"
                  for row in rows]
        lines.append(f"{'resnet18, all 20':<18} {'':>6} {native * 1e3:>10.1f} {synced * 1e3:>10.1f} "
                     f"{synced / native:>14.3f}")
        print("\n".join(lines))
        if args.json:
            Path(args.json).write_text(json.dumps({"world_size": job.world_size, "device": job.device.type,
                                                   "batch_size": args.batch_size, "image_size": args.image_size,
                                                   "rows": rows, "native_s": native, "synced_s": synced}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
