"""How much does ddpkit add to a DDP training step? ddpkit's step against a hand-written DDP loop.

    .venv/bin/python -m ddpkit run --nproc-per-node 2 benchmarks/ddp_step_overhead.py \
        [--steps S] [--rounds R] [--warmup W] [--batch-size B] [--optimizer adam] [--json FILE]

Both sides train the same model (``ddpkit.zoo.Net``, the tutorials' MNIST CNN) on the same data
(``ddpkit.zoo.load_digits(channels=1, image_size=28)``, ddpkit's built-in digits) with the same
per-process batch, in the same processes, over the same gloo process group:

* hand: the tutorials' pattern, written out: ``DistributedSampler`` + ``DataLoader``,
  ``DistributedDataParallel(model)``, and per step ``zero_grad`` / forward / ``cross_entropy`` /
  ``backward`` / ``step``, with ``sampler.set_epoch(epoch)`` at every epoch.
* ddpkit: what ``ddpkit train`` runs, on the public ``ddpkit.Job`` as the trainer is written: the model
  and optimizer from ``job.setup``, the loader from ``job.train_loader``, and per step
  ``job.forward_backward`` and ``job.step`` (with a constant LR schedule) and the stop-signal check,
  on a loader that hands it the next S batches.

Method: W warm-up steps of each side, then R rounds; each round times S steps of each side, the order
alternating between rounds (AB, BA, AB, ...: hand first in even rounds, ddpkit first in odd ones), so
that drifting machine noise and order effects hit both sides alike. Every timed block starts and ends
with ``dist.barrier()`` before the clock is read, so a block lasts until the slower rank is done; each
block's wall time is the maximum over ranks. A step's time includes fetching its batch from the loader.
Reported: the median time per step of each side with its spread (min, quartiles, max over rounds), the
ratio of the medians ddpkit / hand (goal: <= 1.02), the median of the per-round ratios (each from two
adjacent blocks, so less sensitive to slow drift) with a 95% bootstrap interval, and the same medians
in CPU time (``time.process_time``, mean of the ranks), which other load on the machine inflates less.

``--aa`` is the A/A control: the ddpkit slot runs a second, identical hand loop. Its ratio is 1 in
truth, so how far it strays from 1 is this machine's noise floor for the ratio.

``--heartbeat`` prices the stall watch and the slow-rank timing (``ddpkit.watch.heartbeat``, ``ddpkit.watch.pace``):
both slots run ddpkit's loop, the hand slot with both off (no marks, no DDP wait hooks, the heartbeat
thread idle) and the ddpkit slot with both on (every mark, a hook per parameter in backward and two per
forward, and the thread publishing and watching every 5 s, as in any job), so the ratio is what they cost.

Sanity check: both models start from the same weights, their samplers share seed and epoch sequence,
and both take exactly W + R*S steps, so at the end they must hold the same weights (and BatchNorm
buffers); the script compares them with ``torch.allclose`` (and ``torch.equal``) and says so; it exits
with status 1 if they disagree.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import ddpkit
from ddpkit.watch import heartbeat, pace
from ddpkit.app.train import config as train_config
from ddpkit import zoo

SIDES = ("hand", "ddpkit")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=22, help="steps per timed block (default: 22, one epoch at batch 32)")
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds; each times both sides (default: 21)")
    parser.add_argument("--warmup", type=int, default=22, help="untimed steps of each side first (default: 22)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process (default: 32)")
    parser.add_argument("--optimizer", default="adam", choices=train_config.OPTIMIZERS,
                        help="the same on both sides; adam is ddpkit train's default (default: adam)")
    parser.add_argument("--seed", type=int, default=0, help="weights and sample order (default: 0)")
    parser.add_argument("--json", default=None, metavar="FILE", help="rank 0 also writes the results here")
    parser.add_argument("--aa", action="store_true",
                        help="A/A control: the ddpkit slot runs a second hand loop, to show this machine's noise floor")
    parser.add_argument("--heartbeat", action="store_true",
                        help="heartbeats' and slow-rank timing's cost: ddpkit's loop with them off (hand slot) against on "
                             "(ddpkit slot)")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    return args


# ----------------------------------------------------------------------------------------- hand side

class HandLoop:
    """The tutorials' DDP loop, one step at a time out of an endless epoch loop."""

    def __init__(self, base_model, dataset, args):
        # A tutorial calls dist.init_process_group("gloo") itself; here ddpkit.distributed() has made that
        # same call (gloo, env:// from torchrun's variables), and a process holds one default group, so
        # both sides use it. On CPU: no device_ids.
        self.model = DDP(copy.deepcopy(base_model))
        optimizer_class, settings = train_config.optimizer_settings(args.optimizer, None)
        self.optimizer = optimizer_class(self.model.parameters(), **settings)
        # drop_last as in ddpkit (every step a full global batch), so both sides see the same batches.
        self.sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
        self.loader = DataLoader(dataset, batch_size=args.batch_size, sampler=self.sampler, drop_last=True)
        self.batches = self._epochs()
        self.model.train()

    def _epochs(self):
        for epoch in itertools.count():
            self.sampler.set_epoch(epoch)
            yield from self.loader

    def run(self, steps: int) -> None:
        model, optimizer, batches = self.model, self.optimizer, self.batches
        for _ in range(steps):
            images, labels = next(batches)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()


# --------------------------------------------------------------------------------------- ddpkit side

class NextBatches:
    """ddpkit's training loader seen through a window: each ``iter()`` gives the next ``steps`` batches.

    The stream underneath iterates ddpkit's loader again and again; each of its ``iter()`` is the next
    epoch (the loader calls ``sampler.set_epoch`` itself), exactly as ``ddpkit train`` goes through it.
    """

    def __init__(self, loader):
        self.loader = loader
        self.steps = 0
        self._stream = itertools.chain.from_iterable(itertools.repeat(loader))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return itertools.islice(self._stream, self.steps)


class DdpkitLoop:
    """``ddpkit train``'s step on the public library: ``Job.setup``, ``Job.train_loader``, and per step
    ``Job.forward_backward`` and ``Job.step`` with a (constant) LR schedule and the stop-signal check."""

    def __init__(self, base_model, datasets, job, args):
        self.job = job
        optimizer_class, settings = train_config.optimizer_settings(args.optimizer, None)
        self.model, self.optimizer = job.setup(copy.deepcopy(base_model), optimizer_class, **settings)
        # The call ddpkit train makes (workers=None: ddpkit's default, 0 for an in-memory TensorDataset).
        loader = job.train_loader(datasets.train, args.batch_size, seed=args.seed)
        self.batches = NextBatches(loader)
        self.last_loss = float("nan")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.stop = ddpkit.stop_on_signal(job.runtime)

    def run(self, steps: int) -> None:
        self.batches.steps = steps
        self.model.train()
        for images, labels in self.batches:
            loss = self.job.forward_backward(self.model, images, labels)
            self.job.step(self.optimizer, self.scheduler)
            self.stop.requested()
        self.last_loss = loss.item()


class HeartbeatSwitch(heartbeat.Heartbeat):
    """A job's heartbeat that can be switched off between timed blocks: no marks reach it and its thread,
    still waking, publishes and watches nothing."""

    on = True

    def _publish(self) -> None:
        if self.on:
            super()._publish()

    def _check(self):
        return super()._check() if self.on else None


class Switched:
    """A loop run with the pace (its marks and hooks) and the heartbeat on or off."""

    def __init__(self, loop, beat: HeartbeatSwitch, on: bool):
        self.loop, self.beat, self.on = loop, beat, on

    def run(self, steps: int) -> None:
        self.beat.on = self.on
        with pace.kept(self.beat.pace if self.on else None):
            self.loop.run(steps)


def heartbeat_sides(base, datasets, job, args) -> tuple[Switched, Switched]:
    """Two of ddpkit's loops from the same weights: the first with the pace and the heartbeat off (its
    model set up with no pace kept, so without the DDP wait hooks), the second with both on."""
    store = dist.distributed_c10d._get_default_store().clone()
    beat = HeartbeatSwitch(store, rank=job.rank, world_size=job.world_size, stall_s=heartbeat.DEFAULT_STALL_S,
                           timeout_s=job.runtime.timeout_s, pace=job.pace).start()
    with pace.kept(None):
        off = DdpkitLoop(base, datasets, job, args)
    return Switched(off, beat, on=False), Switched(DdpkitLoop(base, datasets, job, args), beat, on=True)


# ------------------------------------------------------------------------------------------- timing

def timed(side, steps: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for ``steps`` steps of ``side``.

    All ranks are lined up (``dist.barrier``) before each clock reading. The CPU time (all threads of
    the process, gloo's included) is a second view that other load on the machine inflates far less:
    a block whose CPU time is well below its wall time spent that time waiting for a core.
    """
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    side.run(steps)
    dist.barrier()
    return time.perf_counter() - started, time.process_time() - cpu_started


def same_weights(hand: torch.nn.Module, kit: torch.nn.Module) -> tuple[bool, bool, float]:
    """(allclose, bitwise equal, largest absolute difference) over parameters and buffers."""
    a, b = ddpkit.unwrap(hand).state_dict(), ddpkit.unwrap(kit).state_dict()
    if a.keys() != b.keys():
        return False, False, float("inf")
    close = all(torch.allclose(a[k].double(), b[k].double(), rtol=1e-5, atol=1e-7) for k in a)
    equal = all(torch.equal(a[k], b[k]) for k in a)
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    return close, equal, diff


def bootstrap_median_ci(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median (fixed seed: the same data give the same interval)."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.tensor(values, dtype=torch.float64)
    picks = torch.randint(0, len(values), (n, len(values)), generator=generator)
    medians = data[picks].quantile(0.5, dim=1).sort().values
    return medians[int(0.025 * n)].item(), medians[int(0.975 * n) - 1].item()


def spread(values: list[float]) -> dict:
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
        "q1": quartiles[0], "q3": quartiles[2],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.aa and args.heartbeat:
        raise SystemExit("--aa and --heartbeat are two different comparisons: pass one")
    # With --heartbeat the job's own heartbeat is off: the benchmark switches one of its own.
    with ddpkit.Job("ddp", backend="gloo", device="cpu", seed=None, stall_timeout_s=0 if args.heartbeat else None) as job:
        rt = job.runtime
        datasets = zoo.load_digits(channels=1, image_size=28)
        torch.manual_seed(args.seed)
        base = zoo.Net(in_channels=1, num_classes=datasets.num_classes, image_size=28)
        if args.heartbeat:
            hand, kit = heartbeat_sides(base, datasets, job, args)
            steps_per_epoch = len(hand.loop.batches.loader)
        else:
            hand = HandLoop(base, datasets.train, args)
            kit = HandLoop(base, datasets.train, args) if args.aa else DdpkitLoop(base, datasets, job, args)
            steps_per_epoch = len(hand.loader)
            assert steps_per_epoch == len(kit.loader if args.aa else kit.batches.loader), "the loaders disagree on the epoch length"
        ddpkit.print0(
            rt,
            f"ddp_step_overhead: torch {torch.__version__}, {rt.world_size} processes x "
            f"{torch.get_num_threads()} thread(s), gloo on CPU; model net "
            f"({sum(p.numel() for p in base.parameters()):,} parameters), digits {len(datasets.train)} train "
            f"images, batch {args.batch_size} per process ({steps_per_epoch} steps/epoch), {args.optimizer}; "
            f"warm-up {args.warmup} steps each, {args.rounds} rounds x {args.steps} steps each"
            + ("; A/A CONTROL: the 'ddpkit' row is a second hand loop" if args.aa else "")
            + ("; HEARTBEAT: both rows are ddpkit's loop, heartbeat and pace off and on" if args.heartbeat else ""),
        )

        # Warm-up: the same number of steps on both sides, so the step counts stay matched.
        if args.warmup:
            hand.run(args.warmup)
            kit.run(args.warmup)

        sides = {"hand": hand, "ddpkit": kit}
        times = torch.zeros(args.rounds, len(SIDES), dtype=torch.float64)  # wall seconds per block
        cpu = torch.zeros(args.rounds, len(SIDES), dtype=torch.float64)  # CPU seconds per block
        orders = []
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            orders.append("".join("A" if name == "hand" else "B" for name in order))
            for name in order:
                times[r, SIDES.index(name)], cpu[r, SIDES.index(name)] = timed(sides[name], args.steps)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a block lasts until its slowest rank is done
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        cpu /= rt.world_size  # CPU seconds per block, mean over ranks

        close, equal, diff = same_weights(*(side.loop.model if args.heartbeat else side.model for side in (hand, kit)))
        # Every rank must hold the same verdict (DDP keeps each side's replicas identical).
        verdict = torch.tensor([float(close), float(equal)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        close, equal = bool(verdict[0]), bool(verdict[1])

        per_step = {name: [t / args.steps for t in times[:, i].tolist()] for i, name in enumerate(SIDES)}
        cpu_per_step = {name: [t / args.steps for t in cpu[:, i].tolist()] for i, name in enumerate(SIDES)}
        stats = {name: spread(values) for name, values in per_step.items()}
        cpu_stats = {name: spread(values) for name, values in cpu_per_step.items()}
        ratio = stats["ddpkit"]["median"] / stats["hand"]["median"]
        round_ratios = [k / h for h, k in zip(per_step["hand"], per_step["ddpkit"])]
        cpu_ratio = cpu_stats["ddpkit"]["median"] / cpu_stats["hand"]["median"]
        # Busy fraction: CPU time / wall time per block; well below the quiet-machine value = other load.
        busy = [c / w for c, w in zip(cpu.flatten().tolist(), times.flatten().tolist())]
        results = {
            "per_step_s": per_step,
            "stats_s": stats,
            "ratio_of_medians": ratio,
            "ratio_of_minima": stats["ddpkit"]["min"] / stats["hand"]["min"],
            "round_ratios": round_ratios,
            "median_round_ratio": statistics.median(round_ratios),
            "median_round_ratio_ci95": bootstrap_median_ci(round_ratios),
            "aa_control": args.aa,
            "heartbeat_comparison": args.heartbeat,
            "cpu_per_step_s": cpu_per_step,
            "cpu_stats_s": cpu_stats,
            "cpu_ratio_of_medians": cpu_ratio,
            "cpu_busy_fraction": {"min": min(busy), "median": statistics.median(busy), "max": max(busy)},
            "within_2_percent": ratio <= 1.02,
            "weights_allclose": close,
            "weights_bitwise_equal": equal,
            "weights_max_abs_diff": diff,
            "steps_per_side": args.warmup + args.rounds * args.steps,
            "round_orders": orders,
        }

        if rt.is_main:
            goal = 1.01 if args.heartbeat else 1.02  # heartbeats: under 1% of the step; ddpkit's whole step: 2%
            ms, keys = 1e3, ("median", "min", "q1", "q3", "max")
            labels = ({"hand": "hb off", "ddpkit": "hb on"} if args.heartbeat else
                      {"hand": "hand", "ddpkit": "hand2" if args.aa else "ddpkit"})
            print(f"\n{'ms/step':12}" + "".join(f"{k:>9}" for k in keys) + f"   over {args.rounds} rounds of {args.steps} steps")
            for label, table in (("wall", stats), ("cpu", cpu_stats)):
                for name in SIDES:
                    print(f"{labels[name] + ' ' + label:12}" + "".join(f"{table[name][k] * ms:9.2f}" for k in keys))
            print("(wall: per block, slowest rank; cpu: process time per step, mean of the ranks)")
            print(
                f"\nratio {labels['ddpkit']}/{labels['hand']}: {ratio:.4f} (medians); per-round ratios: median "
                f"{results['median_round_ratio']:.4f} (95% CI {results['median_round_ratio_ci95'][0]:.4f}.."
                f"{results['median_round_ratio_ci95'][1]:.4f}), min {min(round_ratios):.4f}, max {max(round_ratios):.4f}; "
                f"minima {results['ratio_of_minima']:.4f}; CPU time {cpu_ratio:.4f}"
                f"  -> {'within' if ratio <= goal else 'OVER'} the {round((goal - 1) * 100)}% goal"
            )
            b = results["cpu_busy_fraction"]
            print(f"CPU time / wall time per block: min {b['min']:.2f}, median {b['median']:.2f}, max {b['max']:.2f}"
                  " (low values: the ranks waited for a core, i.e. other load on the machine)")
            print(
                f"weights after {results['steps_per_side']} steps each: "
                + ("agree" if close else "DISAGREE")
                + f" (allclose {close}, bitwise equal {equal}, max |diff| {diff:.3g})",
                flush=True,
            )
            if args.json:
                record = {
                    "benchmark": "ddp_step_overhead",
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["python -m ddpkit run --nproc-per-node", str(rt.env.local_world_size), *sys.argv]),
                    "environment": {
                        "torch": torch.__version__,
                        "ddpkit": ddpkit.__version__,
                        "python": platform.python_version(),
                        "platform": platform.platform(),
                        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                        "world_size": rt.world_size,
                        "backend": rt.backend,
                        "device": str(rt.device),
                        "torch_threads_per_process": torch.get_num_threads(),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    },
                    "config": {
                        "model": "net", "data": "digits", "batch_size": args.batch_size, "optimizer": args.optimizer,
                        "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed,
                        "steps_per_epoch": steps_per_epoch, "aa_control": args.aa,
                        "heartbeat_comparison": args.heartbeat,
                    },
                    "results": results,
                }
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as handle:
                    json.dump(record, handle, indent=2)
                print(f"wrote {args.json}")
        return 0 if close else 1


if __name__ == "__main__":
    sys.exit(main())
