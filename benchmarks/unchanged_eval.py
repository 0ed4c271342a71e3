"""An evaluation under ``ddpkit run --unchanged``: divided across 2 processes against one process, with the same
counts (``benchmarks/eval_heavy.py``, docs/unchanged.md "What it costs").

    .venv/bin/python benchmarks/unchanged_eval.py [--rounds R] [--samples N] [--json FILE]

Each round runs the script on 1 process and on 2 (alternating which goes first), every process on one thread
(OMP_NUM_THREADS=1: one device's compute each), each run evaluating the test set 3 times; a run's time is the median
of its evaluations, by the script's own clock. Reported: each side's median over the rounds, the ratio 2 / 1 (goal on
this machine: at most 0.7), and whether every evaluation's count, correct and summed loss are one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("eval_heavy.py")


def evaluations(nproc: int, samples: int, folder: str) -> list[dict]:
    argv = [sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", "--nproc-per-node", str(nproc),
            str(SCRIPT), "--samples", str(samples)]
    done = subprocess.run(argv, cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"evaluation"')]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    times: dict[int, list[float]] = {1: [], 2: []}
    found: dict[int, list] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for nproc in ((1, 2) if round_ % 2 == 0 else (2, 1)):
                runs = evaluations(nproc, args.samples, folder)
                times[nproc].append(statistics.median(run["seconds"] for run in runs))
                found[nproc].append([(run["count"], run["correct"], run["loss_sum"]) for run in runs])
    one, two = statistics.median(times[1]), statistics.median(times[2])
    same = all(numbers == found[1][0] for numbers in found[1] + found[2])
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
              "samples": args.samples, "rounds": args.rounds, "one_process_s": times[1], "two_processes_s": times[2],
              "median_one_s": one, "median_two_s": two, "ratio": two / one, "same_numbers": same,
              "numbers": found[1][0]}
    print(f"evaluation of {args.samples} samples, median of {args.rounds} rounds: 1 process {one:.3f} s, "
          f"2 processes {two:.3f} s, ratio {two / one:.3f} (goal <= 0.7); counts, correct and sums one process's: "
          f"{same}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
