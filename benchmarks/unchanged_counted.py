"""What a mean over counted items costs under ``ddpkit run --unchanged``: the same training step, its loss written two
ways that give the same gradient when nothing is ignored, timed in one run on 2 processes.

    .venv/bin/python benchmarks/unchanged_counted.py [--steps 60] [--width 512] [--json FILE]

- **counted**: ``F.cross_entropy(logits, labels)``, a mean whose count ddpkit reads from the call (``unchanged.counted``:
  the share's sum over the batch's count, one all-reduce of two numbers);
- **plain**: ``F.cross_entropy(logits, labels, reduction="sum") / len(labels)``, a mean over rows that ddpkit leaves
  alone (the share's weight does it).

Each is a script of its own run under ``ddpkit run --unchanged --nproc-per-node 2``, which prints the median of its
steps after a warm-up; the ratio counted / plain is the cost.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import statistics, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
way, steps, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
x, y = torch.randn(64 * (steps + 10), width), torch.randint(0, 10, (64 * (steps + 10),))
model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
times = []
for logits_x, labels in DataLoader(TensorDataset(x, y), batch_size=64):
    start = time.perf_counter()
    logits = model(logits_x)
    if way == "counted":
        loss = F.cross_entropy(logits, labels)
    else:
        loss = F.cross_entropy(logits, labels, reduction="sum") / len(labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - start)
print(f"median step {statistics.median(times[10:]) * 1e3:.3f} ms")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "step.py"
        script.write_text(SCRIPT)
        for way in ("plain", "counted") * 3:  # alternated: the machine's drift falls on both
            done = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0",
                                   "--nproc-per-node", "2", str(script), way, str(args.steps), str(args.width)],
                                  capture_output=True, text=True, check=True)
            found.setdefault(way, []).append(float(re.findall(r"median step (\S+) ms", done.stdout)[-1]))
    best = {way: min(values) for way, values in found.items()}
    result = {"command": " ".join(sys.argv), "median step ms": found, "ratio counted / plain":
              best["counted"] / best["plain"]}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
