"""What ``--unchanged``'s check that a model computes row by row costs (``AtTheModel.check_both_ways``, run once per
model at its first training call on a loader's whole batch), against one training step of that model on a process's
share of the same batch, in the same run.

    ddpkit run --nproc-per-node 2 benchmarks/rows_check_cost.py [--models mlp,resnet18] [--batch-size 32]
        [--image-size 64] [--rounds 5] [--json FILE]

For each model: rounds of one timed training step on this process's share (forward, cross-entropy, backward, SGD;
no DDP: the step a split batch takes but for its all-reduce) and one timed check (the model's calls on the whole batch
and on the share in evaluation, gradients off, the random state forked and the buffers put back; two all-reduces).
Reported from rank 0: the median of each and their ratio. The check runs once per model in a run, so a run pays that
ratio of one step once.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import ddpkit
from ddpkit import zoo
from ddpkit.data.split_batches import rows_of_share, share_of
from ddpkit.unchanged.at_the_model import AtTheModel
from ddpkit.unchanged.batches import Batch
from replica_check_cost import timed  # (this folder's: the script's own folder is on the path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,resnet18", help="comma list: mlp or a zoo model (default: "
                                                                 "mlp,resnet18)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per model (default: 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="the whole batch (default: 32)")
    parser.add_argument("--image-size", type=int, default=64, help="for image models (default: 64)")
    parser.add_argument("--json", default=None, metavar="FILE", help="rank 0 also writes the results here")
    return parser.parse_args(argv)


def model_and_batch(name: str, args) -> tuple[nn.Module, torch.Tensor]:
    if name == "mlp":
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return model, torch.randn(args.batch_size, 256)
    model = zoo.build_model(name, in_channels=3, num_classes=10, image_size=args.image_size)
    return model, torch.randn(args.batch_size, 3, args.image_size, args.image_size)


def measure(job: ddpkit.Job, name: str, args) -> dict:
    torch.manual_seed(0)
    model, images = model_and_batch(name, args)
    labels = torch.randint(0, 10, (args.batch_size,))
    share = share_of(range(args.batch_size), job.rank, job.world_size)
    mine, my_labels = rows_of_share((images, labels), share)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    at_the_model = AtTheModel(rank=job.rank, world_size=job.world_size, batch=Batch(job.world_size),
                              current_call=lambda: None)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(mine), my_labels).backward()
        optimizer.step()

    def check() -> None:
        at_the_model.rows_kept.discard(model)
        if not at_the_model.check_both_ways(model, (images,), {}, losses=False):
            raise SystemExit(f"{name} was found to compute across its rows: not what this benchmark measures")

    step(), check()  # warm-up
    rounds = [(timed(step), timed(check)) for _ in range(args.rounds)]  # (alternating)
    step_s, check_s = (statistics.median(times) for times in zip(*rounds))
    return {"model": name, "step_s": step_s, "check_s": check_s, "check_over_step": check_s / step_s}


def main(argv=None) -> int:
    args = parse_args(argv)
    with ddpkit.Job("ddp", check_replicas=0, seed=0) as job:
        rows = [measure(job, name, args) for name in args.models.split(",")]
    if job.is_main:
        lines = [f"rows check against one step on a share: {job.world_size} processes, {job.device.type}, whole "
                 f"batch {args.batch_size}, images {args.image_size}, median of {args.rounds} rounds, torch "
                 f"{torch.__version__}", f"{'model':<10} {'step ms':>9} {'check ms':>9} {'check/step':>10}"]
        lines += [f"{row['model']:<10} {row['step_s'] * 1e3:>9.2f} {row['check_s'] * 1e3:>9.2f} "
                  f"{row['check_over_step']:>10.3f}" for row in rows]
        print("\n".join(lines))
        if args.json:
            Path(args.json).write_text(json.dumps({"world_size": job.world_size, "device": job.device.type,
                                                   "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
