"""What a loss valued as the whole batch's costs under ``ddpkit run --unchanged``: the same training step, its loss
written ways that give the same gradient, timed in one run on 2 processes.

    .venv/bin/python benchmarks/unchanged_counted.py [--steps 60] [--width 512] [--json FILE]

- **counted**: ``F.cross_entropy(logits, labels)``, a mean whose count ddpkit reads from the call (``unchanged.counted``:
  the share's sum over the batch's count, one all-reduce of two numbers);
- **plain**: ``F.cross_entropy(logits, labels, reduction="sum") / len(labels)``, a mean over rows that ddpkit leaves
  alone (the share's weight does it);
- **mse**: ``F.mse_loss(logits, targets)``, a mean over elements, valued as the whole batch's the same way;
- **by hand**: ``((logits - targets) ** 2).mean()`` in the script, which ddpkit leaves alone (its value the share's);
- **returned**: the same mean written by hand inside the model, which returns it: valued as the whole batch's where it
  leaves the model (one all-reduce).

Each is a script of its own run under ``ddpkit run --unchanged --nproc-per-node 2``, which prints the median of its
steps after a warm-up; the ratios counted / plain, mse / by hand and returned / by hand are the costs.
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


class Returns(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x, targets):
        return ((self.net(x) - targets) ** 2).mean()


model = Returns() if way == "returned" else nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
times = []
for logits_x, labels in DataLoader(TensorDataset(x, y), batch_size=64):
    start = time.perf_counter()
    targets = F.one_hot(labels, 10).to(logits_x.dtype)
    if way == "returned":
        loss = model(logits_x, targets)
    else:
        logits = model(logits_x)
    if way == "counted":
        loss = F.cross_entropy(logits, labels)
    elif way == "plain":
        loss = F.cross_entropy(logits, labels, reduction="sum") / len(labels)
    elif way == "mse":
        loss = F.mse_loss(logits, targets)
    elif way == "by hand":
        loss = ((logits - targets) ** 2).mean()
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
        for way in ("plain", "counted", "by hand", "mse", "returned") * 3:  # alternated: drift falls on each
            done = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0",
                                   "--nproc-per-node", "2", str(script), way, str(args.steps), str(args.width)],
                                  capture_output=True, text=True, check=True)
            found.setdefault(way, []).append(float(re.findall(r"median step (\S+) ms", done.stdout)[-1]))
    best = {way: min(values) for way, values in found.items()}
    result = {"command": " ".join(sys.argv), "median step ms": found,
              "ratio counted / plain": best["counted"] / best["plain"],
              "ratio mse / by hand": best["mse"] / best["by hand"],
              "ratio returned / by hand": best["returned"] / best["by hand"]}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
