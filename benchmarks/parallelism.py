"""Each arrangement of docs/parallelism.md on this machine: throughput and what each rank holds.

    python benchmarks/parallelism.py                       # resnet18, 2 processes, synthetic data
    python benchmarks/parallelism.py --model net --epochs 3

Runs ``ddpkit train`` once per arrangement (DDP, DDP + ZeRO, FSDP, pipeline with GPipe and 1F1B at
several micro-batch counts) with the same model, data and global batch, and prints one Markdown table
from the last epoch's line of each run's metrics.jsonl: images/s, and per rank the parameters +
gradients + optimizer state held (train_state_mb) and the peak memory (the process's peak resident set
on CPU, the allocator's peak on GPU). Every run's command is printed above the table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ARRANGEMENTS = [
    ("DDP", ["--strategy", "ddp"]),
    ("DDP + ZeRO", ["--strategy", "ddp", "--zero"]),
    ("FSDP", ["--strategy", "fsdp"]),
    ("pipeline GPipe, 2 micro-batches", ["--strategy", "pipeline", "--pipeline-schedule", "gpipe", "--microbatches", "2"]),
    ("pipeline GPipe, 8 micro-batches", ["--strategy", "pipeline", "--pipeline-schedule", "gpipe", "--microbatches", "8"]),
    ("pipeline 1F1B, 2 micro-batches", ["--strategy", "pipeline", "--pipeline-schedule", "1f1b", "--microbatches", "2"]),
    ("pipeline 1F1B, 8 micro-batches", ["--strategy", "pipeline", "--pipeline-schedule", "1f1b", "--microbatches", "8"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--data", default="synthetic:2048")
    parser.add_argument("--nproc", type=int, default=2, help="processes (pipeline: one stage each)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch; DDP/FSDP take batch/nproc per process, a pipeline all of it")
    parser.add_argument("--epochs", type=int, default=2, help="the last epoch is reported (the first warms up)")
    parser.add_argument("--only", default=None, help="comma-separated row numbers to run (1-based)")
    ns = parser.parse_args()
    chosen = ARRANGEMENTS if not ns.only else [ARRANGEMENTS[int(i) - 1] for i in ns.only.split(",")]
    rows = []
    for name, flags in chosen:
        per_process = ns.batch_size if "pipeline" in flags else ns.batch_size // ns.nproc
        with tempfile.TemporaryDirectory() as out:
            argv = [sys.executable, "-m", "ddpkit", "train", "--model", ns.model, "--data", ns.data, "--epochs",
                    str(ns.epochs), "--nproc-per-node", str(ns.nproc), "--batch-size", str(per_process),
                    "--no-progress", "--output-dir", out, *flags]
            print("$ " + shlex.join(["ddpkit", *argv[3:-len(flags) - 2], *flags]), flush=True)
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)
                return 1
            last = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()][-1]
        rows.append((name, last))
    print("\n| arrangement | images/s | state held per rank, MiB | peak memory per rank, MiB | val_acc |")
    print("|---|---|---|---|---|")
    for name, last in rows:
        held = " / ".join(f"{value:.1f}" for value in last["train_state_mb"])
        peak = " / ".join(f"{value:.0f}" for value in last["peak_memory_mb"])
        print(f"| {name} | {last['images_per_sec']:.0f} | {held} | {peak} | {last['val_acc']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
