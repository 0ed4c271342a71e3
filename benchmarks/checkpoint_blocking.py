"""How long a checkpoint save blocks training: full, sharded, and sharded asynchronous, in one run.

    ddpkit run --nproc-per-node 2 benchmarks/checkpoint_blocking.py [--strategy fsdp] [--width 2048] [--rounds 5]

A stack of ``--layers`` Linear(width, width) layers under ``--strategy`` (fsdp or ddp), trained with Adam for a
step so the optimizer holds its two moments; the state is then parameters + 2 x moments. For each way of
saving, ``--rounds`` saves into a folder of its own (after one warm-up save), each followed by ``--steps``
training steps while it is written and then ``wait()``: *blocked* is how long ``save()`` kept the training
loop (the ranks' longest), *then waited* how long ``wait()`` still took after those steps (the write not yet
on disk), *step while writing* a step's time meanwhile, against a step's time with no save running (the
cost of the write to training). On a GPU the device is synchronised before each clock read. Reported from rank
0: the medians, and each way's blocked time against the synchronous sharded save's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import ddpkit
from ddpkit.core.process_group import synchronize

WAYS = {"full": {"sharded": False}, "sharded": {"sharded": True}, "sharded async": {"async_save": True}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp", choices=("fsdp", "ddp"), help="default: fsdp")
    parser.add_argument("--width", type=int, default=2048, help="features of each layer (default: 2048)")
    parser.add_argument("--layers", type=int, default=8, help="default: 8 (8 x 2048^2: 33.6M parameters)")
    parser.add_argument("--rounds", type=int, default=5, help="saves per way (default: 5)")
    parser.add_argument("--steps", type=int, default=3, help="training steps after each save (default: 3)")
    parser.add_argument("--batch", type=int, default=4, help="input rows per step (default: 4)")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder, removed)")
    parser.add_argument("--json", default=None, metavar="FILE", help="rank 0 also writes the results here")
    return parser.parse_args(argv)


def longest(seconds: float, device: torch.device) -> float:
    """The longest of every rank's ``seconds``: the ranks meet at the next collective, so the slowest counts."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def measure(job: ddpkit.Job, model, optimizer, step, folder: Path, way: str, args) -> dict:
    blocked, waited, stepping = [], [], []
    ckpt = job.checkpointer(folder, model=model, optimizer=optimizer, keep=2, log=lambda text: None, **WAYS[way])
    for _ in range(args.rounds + 1):  # the first is a warm-up
        synchronize(job.device)
        ddpkit.barrier(job.runtime)
        started = time.perf_counter()
        ckpt.save()
        returned = time.perf_counter()
        for _ in range(args.steps):  # training goes on while the checkpoint is written
            step()
        synchronize(job.device)  # the steps' kernels, and any copy the save queued before them
        stepped = time.perf_counter()
        ckpt.wait()
        blocked.append(longest(returned - started, job.device))
        stepping.append(longest(stepped - returned, job.device) / max(args.steps, 1))
        waited.append(longest(time.perf_counter() - stepped, job.device))
    return {"way": way, "blocked_s": statistics.median(blocked[1:]), "waited_s": statistics.median(waited[1:]),
            "step_s": statistics.median(stepping[1:])}


def idle_step_seconds(job: ddpkit.Job, step, args) -> float:
    """A step's time with no save running (the ranks' longest, median over --rounds runs of --steps steps)."""
    times = []
    for _ in range(args.rounds):
        synchronize(job.device)
        ddpkit.barrier(job.runtime)
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(job.device)
        times.append(longest(time.perf_counter() - started, job.device) / max(args.steps, 1))
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    scratch = Path(args.folder or tempfile.mkdtemp(prefix="ddpkit-ckpt-bench-"))
    with ddpkit.Job(args.strategy, seed=0) as job:
        layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
        model, optimizer = job.setup(nn.Sequential(*layers), torch.optim.Adam, lr=1e-4)
        inputs = torch.randn(args.batch, args.width, device=job.device)

        def step() -> None:
            job.backward(model(inputs).square().mean())
            job.step(optimizer)

        step()
        idle = idle_step_seconds(job, step, args)
        rows = [measure(job, model, optimizer, step, scratch / way.replace(" ", "-"), way, args) for way in WAYS]
        if job.is_main:
            whole = sum(p.numel() for layer in layers for p in layer.parameters())  # DTensors count whole
            state_mb = whole * 4 * 3 / 2**20  # parameters and Adam's two moments, float32
            base = next(row["blocked_s"] for row in rows if row["way"] == "sharded")
            print(f"checkpoint saves: {args.strategy}, {job.world_size} processes, {job.device.type}, {whole:,} "
                  f"parameters ({state_mb:.0f} MiB of state), median of {args.rounds} saves")
            print(f"a step with no save running: {idle * 1e3:.1f} ms (median of {args.rounds} x {args.steps} steps)")
            print(f"{'way':<14} {'blocked ms':>11} {'then waited ms':>15} {'step ms while writing':>22} "
                  f"{'blocked / sharded':>18}")
            for row in rows:
                row["blocked_over_sharded"] = row["blocked_s"] / base
                print(f"{row['way']:<14} {row['blocked_s'] * 1e3:>11.1f} {row['waited_s'] * 1e3:>15.1f} "
                      f"{row['step_s'] * 1e3:>22.1f} {row['blocked_over_sharded']:>18.3f}")
            if args.json:
                with open(args.json, "w") as out:
                    json.dump({"strategy": args.strategy, "world_size": job.world_size, "device": job.device.type,
                               "parameters": whole, "batch": args.batch, "idle_step_s": idle, "rows": rows}, out, indent=2)
        ddpkit.barrier(job.runtime)
    if args.folder is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
