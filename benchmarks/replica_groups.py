"""What replica groups cost per step, and what a failure costs with them and with restart-and-resume, in one run.

    python benchmarks/replica_groups.py [--steps 300] [--kill-at 125] [--width 512] [--batch 64] [--json FILE]

Six launches of the same training (an MLP of 4 x Linear(width, width), SGD, batch ``--batch`` per process, each
process its half of one global batch per step, ``--steps`` steps):

* ``ddpkit run --nproc-per-node 2``: plain DDP over 2 processes (ddpkit's Job), a full checkpoint every
  ``--checkpoint-every`` steps, ``--max-restarts 1``; once without a failure, once with rank 1 SIGKILLed
  (by itself, between steps) after step ``--kill-at``: the agent restarts both processes, which resume from the
  newest checkpoint;
* ``ddpkit run --replica-groups 2``: two groups of one process (ddpkit.ReplicaGroup); once without a failure,
  once with group 1 SIGKILLed at the same step: group 0 goes on alone, group 1 restarts and copies its state;
* the same with ``--min-replicas 2``: group 0 waits for group 1 instead of going on alone.

Reported: each launch's median step time (steps 20 on, rank 0's or group 0's, never the killed one), the wall
time from launch until that process committed step ``--steps``, and per failure the wall time it added (killed run
minus clean run). The step-time cost of
replica groups is their clean step time over plain DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = '''
import json, os, signal, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import ddpkit

mode, out, steps, kill_at, width, batch, every = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
'''

# The model and the data (of WIDTH, BATCH): replica_step_phases.py's worker trains the same.
MODEL_AND_DATA = '''
torch.manual_seed(0)
bare = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)])

def data(step, part):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(2 * batch, width, generator=generator)
    return x[part * batch:(part + 1) * batch], x[part * batch:(part + 1) * batch].flip(1)
'''

WORKER += MODEL_AND_DATA + '''
log = open(os.path.join(out, f"times-{mode}-{os.environ.get('DDPKIT_REPLICA_GROUP', os.environ.get('RANK'))}.jsonl"), "a")
if mode.startswith("groups"):
    group = ddpkit.ReplicaGroup(timeout_s=5)
    model, optimizer = group.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01))
    part, victim = group.group, group.group == 1 and restarts == 0
    deadline = time.time() + 120
    # Past the last step, a group that lost its peer waits for it to come back (the peer copies its state, then
    # both stop at the same step): the clock that counts is when step `steps` was reached.
    while group.step < steps or (group.participants < 2 and time.time() < deadline):
        step = group.step
        optimizer.zero_grad()
        x, y = data(step, part)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        log.write(json.dumps({"step": group.step, "t": time.time()}) + "\\n")
        if victim and group.step == kill_at:
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
else:
    with ddpkit.Job("ddp", device="cpu", seed=0) as job:
        model, optimizer = job.setup(bare, torch.optim.SGD, lr=0.01)
        ckpt = job.checkpointer(os.path.join(out, "checkpoints"), model=model, optimizer=optimizer, keep=2)
        ckpt.resume("auto")
        part, victim = job.rank, job.rank == 1 and restarts == 0
        while job.global_step < steps:
            x, y = data(job.global_step, part)
            job.forward_backward(model, x, y, F.mse_loss)
            job.step(optimizer)
            log.write(json.dumps({"step": job.global_step, "t": time.time()}) + "\\n")
            if every and job.global_step % every == 0:
                ckpt.save()
            if victim and job.global_step == kill_at:
                log.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
log.close()
'''


MODES = ("ddp", "groups", "groups-wait")
NAMES = {"ddp": "plain DDP, 2 processes", "groups": "2 replica groups of 1",
         "groups-wait": "2 replica groups of 1, --min-replicas 2"}


def launch(mode: str, folder: Path, args, kill_at: int) -> dict:
    """One launch; its wall time and its processes' step times."""
    out = folder / f"{mode}-{'killed' if kill_at >= 0 else 'clean'}"
    out.mkdir()
    script = folder / "worker.py"
    flags = {"ddp": ["--nproc-per-node", "2"], "groups": ["--replica-groups", "2", "--nproc-per-node", "1"],
             "groups-wait": ["--replica-groups", "2", "--min-replicas", "2", "--nproc-per-node", "1"]}[mode]
    command = [sys.executable, "-m", "ddpkit", "run", *flags, "--max-restarts", "1", str(script), mode, str(out),
               str(args.steps), str(kill_at), str(args.width), str(args.batch), str(args.checkpoint_every)]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    survivor = out / f"times-{mode}-0.jsonl"  # rank 0, or group 0: the one that is never killed
    times = [json.loads(line) for line in survivor.read_text().splitlines()]
    reached = min(r["t"] for r in times if r["step"] == args.steps)  # a restarted DDP redoes steps: the last time
    reached = max(r["t"] for r in times if r["step"] == args.steps) if mode == "ddp" else reached
    steady = [b["t"] - a["t"] for a, b in zip(times, times[1:]) if a["step"] >= 20 and b["step"] == a["step"] + 1]
    return {"mode": mode, "killed_at": kill_at, "wall_s": reached - started, "step_ms": statistics.median(steady) * 1e3}


def training_flags(parser: argparse.ArgumentParser, steps: int) -> None:
    """--steps, --width, --batch and --json: the training both replica benchmarks run, and the report file."""
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps of each launch (default: {steps})")
    parser.add_argument("--width", type=int, default=512, help="features of each of the 4 layers (default: 512)")
    parser.add_argument("--batch", type=int, default=64, help="per process (default: 64)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training_flags(parser, steps=300)
    parser.add_argument("--kill-at", type=int, default=125, help="mid-way between two checkpoints (default: 125)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="plain DDP's checkpoints (default: 50)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddpkit-replica-bench-") as name:
        folder = Path(name)
        (folder / "worker.py").write_text(WORKER)
        rows = [launch(mode, folder, args, kill_at) for mode in MODES for kill_at in (-1, args.kill_at)]
    by = {(r["mode"], r["killed_at"] >= 0): r for r in rows}
    report = {"steps": args.steps, "kill_at": args.kill_at, "width": args.width, "batch": args.batch,
              "checkpoint_every": args.checkpoint_every, "cpus": os.cpu_count(), "rows": rows,
              "step_cost": by["groups", False]["step_ms"] / by["ddp", False]["step_ms"],
              "step_cost_waiting": by["groups-wait", False]["step_ms"] / by["ddp", False]["step_ms"],
              "lost_s": {mode: by[mode, True]["wall_s"] - by[mode, False]["wall_s"] for mode in MODES}}
    print(f"{args.steps} steps of 4 x Linear({args.width}) at batch {args.batch} per process; a SIGKILL after step "
          f"{args.kill_at}; plain DDP checkpoints every {args.checkpoint_every} steps")
    print(f"{'launch':<50} {'wall s':>8} {'step ms':>8}")
    for r in rows:
        name = NAMES[r["mode"]] + (", one killed" if r["killed_at"] >= 0 else "")
        print(f"{name:<50} {r['wall_s']:>8.1f} {r['step_ms']:>8.2f}")
    print(f"step time, replica groups / plain DDP: {report['step_cost']:.2f} (--min-replicas 2: "
          f"{report['step_cost_waiting']:.2f})")
    print(f"wall time a failure added: plain DDP (restart and resume) {report['lost_s']['ddp']:.1f} s, "
          f"replica groups {report['lost_s']['groups']:.1f} s, with --min-replicas 2 "
          f"{report['lost_s']['groups-wait']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
