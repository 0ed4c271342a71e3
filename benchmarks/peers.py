"""The same small DDP training loop written four ways, timed in one harness: by hand with torch.distributed,
with ddpkit's ``Job``, with Hugging Face Accelerate, and with Lightning Fabric.

    pip install -e ".[peers]"          # accelerate and lightning-fabric, on the project's torch
    ddpkit run --nproc-per-node 2 benchmarks/peers.py --rounds 40 --json peers.json

All four sides run in the same two processes over the same gloo process group (``ddpkit.Job`` starts it;
Accelerate and Fabric find it initialised and use it), on ``ddpkit.zoo.Net`` and the built-in digits, batch
``--batch-size`` per process, Adam, each side its own copy of the same initial weights and its own loader
(the tutorials' DistributedSampler + DataLoader for the hand side; each library's own for the others).
A step is: next batch from the side's loader, forward, cross-entropy, backward (with the all-reduce), step.

Method: warm-up steps of each side; then ``--rounds`` rounds, each timing ``--steps`` steps of every side,
the order rotated every round (ABCD, BCDA, CDAB, DABC, ...) so that drift and going first hit every side
alike. Every block starts and ends with a barrier before the clock is read, and lasts until the slower rank
is done. Reported: each side's median time per step, and the median over rounds of its per-round ratio to
the hand side (two blocks of the same round), with a 95% bootstrap interval. The sides' last losses are
printed: they train the same model on the same data and should agree to within what their different
sample orders give.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ddpkit
from ddpkit import zoo

from ddp_step_overhead import HandLoop, bootstrap_median_ci, spread, timed  # noqa: E402 - this folder's script

SIDES = ("hand", "ddpkit", "accelerate", "fabric")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=22, help="steps per timed block (default: 22, one epoch)")
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds; each times every side (default: 40)")
    parser.add_argument("--warmup", type=int, default=22, help="untimed steps of each side first (default: 22)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process (default: 32)")
    parser.add_argument("--json", default=None, metavar="FILE", help="rank 0 also writes the results here")
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.batch_size) < 1 or args.warmup < 0:
        parser.error("--steps, --rounds and --batch-size must be at least 1, --warmup 0 or more")
    args.seed, args.optimizer = 0, "adam"  # what HandLoop reads
    return args


class Endless:
    """Each side's loader, epoch after epoch (each ``iter()`` of it is the next epoch)."""

    def __init__(self, loader):
        self.loader = loader
        self.stream = itertools.chain.from_iterable(itertools.repeat(loader))

    def __next__(self):
        return next(self.stream)


class HandSide(HandLoop):
    def run(self, steps: int) -> None:
        model, optimizer = self.model, self.optimizer
        for _ in range(steps):
            images, labels = next(self.batches)
            optimizer.zero_grad()
            self.loss = F.cross_entropy(model(images), labels)
            self.loss.backward()
            optimizer.step()


class DdpkitSide:
    def __init__(self, base, dataset, job: ddpkit.Job, args):
        self.job = job
        self.model, self.optimizer = job.setup(copy.deepcopy(base), torch.optim.Adam, lr=1e-3)
        self.batches = Endless(job.train_loader(dataset, args.batch_size, seed=args.seed))

    def run(self, steps: int) -> None:
        job, model, optimizer = self.job, self.model, self.optimizer
        for _ in range(steps):
            images, labels = next(self.batches)
            with job.autocast():
                self.loss = F.cross_entropy(model(images), labels)
            job.backward(self.loss)
            job.step(optimizer)


class AccelerateSide:
    def __init__(self, base, dataset, args):
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        model = copy.deepcopy(base)
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
        self.model, self.optimizer, loader = self.accelerator.prepare(
            model, torch.optim.Adam(model.parameters(), lr=1e-3), loader)
        self.batches = Endless(loader)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            images, labels = next(self.batches)
            self.optimizer.zero_grad()
            self.loss = F.cross_entropy(self.model(images), labels)
            self.accelerator.backward(self.loss)
            self.optimizer.step()


class FabricSide:
    def __init__(self, base, dataset, args, world_size: int):
        from lightning_fabric import Fabric

        self.fabric = Fabric(accelerator="cpu", strategy="ddp", devices=world_size)
        self.fabric.launch()  # under torchrun: nothing to start, the processes exist
        model = copy.deepcopy(base)
        self.model, self.optimizer = self.fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
        self.batches = Endless(self.fabric.setup_dataloaders(loader))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            images, labels = next(self.batches)
            self.optimizer.zero_grad()
            self.loss = F.cross_entropy(self.model(images), labels)
            self.fabric.backward(self.loss)
            self.optimizer.step()


def main(argv=None) -> int:
    args = parse_args(argv)
    with ddpkit.Job("ddp", backend="gloo", device="cpu", seed=None) as job:
        datasets = zoo.load_digits(channels=1, image_size=28)
        torch.manual_seed(args.seed)
        base = zoo.Net(in_channels=1, num_classes=datasets.num_classes, image_size=28)
        hand = HandSide(base, datasets.train, args)
        sides = {"hand": hand, "ddpkit": DdpkitSide(base, datasets.train, job, args),
                 "accelerate": AccelerateSide(base, datasets.train, args),
                 "fabric": FabricSide(base, datasets.train, args, job.world_size)}
        job.print(f"peers: torch {torch.__version__}, {job.world_size} processes x {torch.get_num_threads()} "
                  f"thread(s), gloo on CPU; net, digits, batch {args.batch_size} per process, Adam; warm-up "
                  f"{args.warmup} steps each, {args.rounds} rounds x {args.steps} steps, order rotated each round")
        for side in sides.values():
            side.run(args.warmup)
        times = torch.zeros(args.rounds, len(SIDES), dtype=torch.float64)
        for r in range(args.rounds):
            for name in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                times[r, SIDES.index(name)] = timed(sides[name], args.steps)[0]
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a block lasts until its slowest rank is done
        per_step = {name: [t / args.steps for t in times[:, i].tolist()] for i, name in enumerate(SIDES)}
        results = {"per_step_s": per_step, "stats_s": {name: spread(v) for name, v in per_step.items()},
                   "losses": {name: side.loss.item() for name, side in sides.items()}, "args": vars(args)}
        for name in SIDES[1:]:
            ratios = [s / h for s, h in zip(per_step[name], per_step["hand"])]
            results[f"{name}_over_hand"] = {"median": statistics.median(ratios), "ci95": bootstrap_median_ci(ratios)}
        if job.is_main:
            print(f"\n{'side':12}{'ms/step':>9}{'vs hand':>9}   95% CI of the per-round ratio   last loss")
            for name in SIDES:
                ratio = results.get(f"{name}_over_hand")
                shown = f"{ratio['median']:9.3f}   {ratio['ci95'][0]:.3f} .. {ratio['ci95'][1]:.3f}" if ratio else \
                    f"{'1':>9}   {'':17}"
                print(f"{name:12}{results['stats_s'][name]['median'] * 1e3:9.2f}{shown}{'':12}"
                      f"{results['losses'][name]:.4f}")
            if args.json:
                with open(args.json, "w") as handle:
                    json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
