"""Where a replica group's step spends the time that plain DDP's does not: each phase of a step, timed.

    python benchmarks/replica_step_phases.py [--steps 200] [--width 512] [--batch 64] [--json FILE]

Three launches of the training of benchmarks/replica_groups.py (an MLP of 4 x Linear(width, width), SGD, batch
``--batch`` per process, each process its half of one global batch per step), without failures:

* ``ddp``: torch's DistributedDataParallel over 2 processes (``ddpkit run --nproc-per-node 2``);
* ``ddp-unused``: the same with ``find_unused_parameters=True``, which torchft's DDP wrapper sets;
* ``groups``: 2 replica groups of one process (``ddpkit run --replica-groups 2``, ddpkit.ReplicaGroup).

Each step is cut in four phases, timed on the host clock of rank 0 / group 0: ``zero_grad`` (for the groups: the
quorum's request), ``forward`` (with the loss), ``backward`` (with the gradients' all-reduce, which DDP's hooks start
during it) and ``step`` (for the groups: the commit vote, then the optimizer). Reported: each phase's median in
ms over the steps from 20 on, and the groups' extra time per phase over plain DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from replica_groups import MODEL_AND_DATA, training_flags  # this folder's: the same training as that benchmark

WORKER = '''
import json, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import ddpkit

mode, out, steps, width, batch = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
''' + MODEL_AND_DATA + '''
def train(model, optimizer, part, current_step, write):
    rows = []
    while current_step() < steps:
        step = current_step()
        x, y = data(step, part)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        t1 = time.perf_counter()
        loss = F.mse_loss(model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        optimizer.step()
        t4 = time.perf_counter()
        rows.append({"step": step, "zero_grad": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "step_": t4 - t3})
    if write:
        with open(os.path.join(out, f"phases-{mode}.json"), "w") as handle:
            json.dump(rows, handle)

if mode == "groups":
    group = ddpkit.ReplicaGroup(timeout_s=5)
    model, optimizer = group.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01))
    train(model, optimizer, group.group, lambda: group.step, group.group == 0)
else:
    with ddpkit.distributed() as runtime:
        model = torch.nn.parallel.DistributedDataParallel(bare, find_unused_parameters=mode == "ddp-unused")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        done = [0]

        def current_step():
            return done[0]

        class Counting:  # the plain optimizer, counting its steps as the groups' manager does
            def zero_grad(self):
                optimizer.zero_grad()

            def step(self):
                optimizer.step()
                done[0] += 1

        train(model, Counting(), runtime.rank, current_step, runtime.rank == 0)
'''

PHASES = ("zero_grad", "forward", "backward", "step_")
MODES = ("ddp", "ddp-unused", "groups")


def launch(mode: str, folder: Path, args) -> dict[str, float]:
    """One launch; the median of each phase in ms, from step 20 on."""
    flags = ["--replica-groups", "2", "--nproc-per-node", "1"] if mode == "groups" else ["--nproc-per-node", "2"]
    command = [sys.executable, "-m", "ddpkit", "run", *flags, str(folder / "worker.py"), mode, str(folder),
               str(args.steps), str(args.width), str(args.batch)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    rows = [r for r in json.loads((folder / f"phases-{mode}.json").read_text()) if r["step"] >= 20]
    phases = {phase: statistics.median(r[phase] for r in rows) * 1e3 for phase in PHASES}
    return phases | {"total": statistics.median(sum(r[p] for p in PHASES) for r in rows) * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training_flags(parser, steps=200)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddpkit-replica-phases-") as name:
        folder = Path(name)
        (folder / "worker.py").write_text(WORKER)
        medians = {mode: launch(mode, folder, args) for mode in MODES}
    print(f"{args.steps} steps of 4 x Linear({args.width}) at batch {args.batch} per process; median ms per phase, "
          "steps 20 on, rank 0 / group 0")
    columns = (*PHASES, "total")
    print(f"{'launch':<12}" + "".join(f"{c.rstrip('_'):>11}" for c in columns))
    for mode in MODES:
        print(f"{mode:<12}" + "".join(f"{medians[mode][c]:>11.2f}" for c in columns))
    extra = {c: medians["groups"][c] - medians["ddp"][c] for c in columns}
    print(f"{'groups - ddp':<12}" + "".join(f"{extra[c]:>11.2f}" for c in columns))
    if args.json:
        report = {"steps": args.steps, "width": args.width, "batch": args.batch, "cpus": os.cpu_count(),
                  "median_ms": medians, "groups_minus_ddp_ms": extra}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
