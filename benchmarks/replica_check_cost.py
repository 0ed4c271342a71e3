"""What the replica check (``--check-replicas``, ``ddpkit.watch.replicas``) costs, against a training step of
the same model in the same run.

    ddpkit run --nproc-per-node 2 benchmarks/replica_check_cost.py [--models convnet,resnet50] [--rounds 7]

For each model: DDP over the job's processes, then rounds of one timed optimizer step (forward, backward,
all-reduce, step) and one timed check (every parameter's checksum, one all_gather, the comparison).
Reported per model, from rank 0: the median step and check times, their ratio, and what the check adds
per step when it runs every N steps (the default N and N=1). The check's cost follows the parameter
count; the step's, the batch and the image size too, so the ratio depends on both (given in the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.watch import replicas
from ddpkit import zoo

SHAPES = {"convnet": (3, 32), "net": (1, 28)}  # (channels, image size); torchvision models: 3 x --image-size


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="convnet,resnet50", help="comma list (default: convnet,resnet50)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per model (default: 7)")
    parser.add_argument("--batch-size", type=int, default=8, help="per process (default: 8)")
    parser.add_argument("--image-size", type=int, default=224, help="for torchvision models (default: 224)")
    parser.add_argument("--json", default=None, metavar="FILE", help="rank 0 also writes the results here")
    return parser.parse_args(argv)


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def measure(job: ddpkit.Job, name: str, args) -> dict:
    channels, size = SHAPES.get(name, (3, args.image_size))
    model, optimizer = job.setup(zoo.build_model(name, in_channels=channels, num_classes=10, image_size=size),
                                 torch.optim.SGD, lr=0.01)
    images = torch.randn(args.batch_size, channels, size, size)
    labels = torch.randint(0, 10, (args.batch_size,))
    named = list(ddpkit.unwrap(model).named_parameters())

    def step() -> None:
        job.backward(F.cross_entropy(model(images), labels))
        job.step(optimizer)

    def check() -> None:
        replicas.check(named, job.runtime, step=job.global_step)

    step(), check()  # warm-up
    steps, checks = [], []
    for _ in range(args.rounds):
        steps.append(timed(step))
        checks.append(timed(check))
    step_s, check_s = statistics.median(steps), statistics.median(checks)
    return {"model": name, "parameters": sum(p.numel() for _, p in named), "tensors": len(named),
            "step_s": step_s, "check_s": check_s, "check_over_step": check_s / step_s,
            "added_at_default": check_s / (replicas.DEFAULT_EVERY * step_s)}


def main(argv=None) -> int:
    args = parse_args(argv)
    with ddpkit.Job("ddp", check_replicas=0, seed=0) as job:
        rows = [measure(job, name, args) for name in args.models.split(",")]
        if job.is_main:
            print(f"replica check against one step: {job.world_size} processes, {job.device.type}, batch "
                  f"{args.batch_size} per process, median of {args.rounds} rounds")
            print(f"{'model':<10} {'params':>11} {'tensors':>7} {'step ms':>9} {'check ms':>9} {'check/step':>10} "
                  f"{'added per step, every ' + str(replicas.DEFAULT_EVERY):>28}")
            for row in rows:
                print(f"{row['model']:<10} {row['parameters']:>11,} {row['tensors']:>7} {row['step_s'] * 1e3:>9.2f} "
                      f"{row['check_s'] * 1e3:>9.3f} {row['check_over_step']:>10.4f} {row['added_at_default']:>28.6%}")
            if args.json:
                with open(args.json, "w") as out:
                    json.dump({"world_size": job.world_size, "device": job.device.type, "rows": rows}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
