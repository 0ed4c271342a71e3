"""What meeting DDP's rules costs under ``ddpkit run --unchanged`` (docs/unchanged.md, "DDP's rules"), where nothing
needs them, and where a model needs ``find_unused_parameters``.

    .venv/bin/python benchmarks/ddp_rules.py [--steps 40] [--json FILE]

1. **DDP's three reducers**, on 2 processes (torchrun, gloo, one thread each): the same training step of a small MLP
   (8 layers 256 wide, batch 16) and of a ResNet-18 (batch 8, 64 pixels), under DDP built plain, with
   ``find_unused_parameters`` and with ``static_graph``, each twice, alternated: the median step of each. The plain
   reducer is what ``--unchanged`` keeps after a model's first step where nothing goes unused; the other two are what
   it pays for a model that needs them (and, for one step, the probe's static graph).
2. **The check at each training call** (whether a parameter's ``requires_grad`` changed): a tuple of every
   parameter's flag, timed in this process for ResNet-50's 161 parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import torchvision

STEPS = """
import json, statistics, sys, time
import torch, torch.distributed as dist, torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
name, steps = sys.argv[1], int(sys.argv[2])


def made():
    torch.manual_seed(0)
    if name == "mlp":
        return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])
    return torchvision.models.resnet18(num_classes=10)


x = torch.randn(16, 256) if name == "mlp" else torch.randn(8, 3, 64, 64)
found = {}
for mode in ("plain", "unused parameters", "static graph") * 2:
    model = DDP(made(), find_unused_parameters=mode == "unused parameters", static_graph=mode == "static graph")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    found.setdefault(mode, []).append(statistics.median(times[5:]))
if dist.get_rank() == 0:
    print("RESULT", json.dumps(found))
"""


def reducers(steps: int) -> dict:
    result = {}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "steps.py"
        script.write_text(STEPS)
        for name in ("mlp", "resnet18"):
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--master-port", "29631", str(script), name, str(steps)],
                                  capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            found = json.loads(re.findall(r"RESULT (.*)", done.stdout)[-1])
            best = {mode: min(values) for mode, values in found.items()}
            result[name] = {"median step s": found,
                            "unused / plain": best["unused parameters"] / best["plain"],
                            "static / plain": best["static graph"] / best["plain"]}
    return result


def check_per_call() -> dict:
    parameters = list(torchvision.models.resnet50().parameters())
    number = 10000
    seconds = min(timeit.repeat(lambda: tuple(parameter.requires_grad for parameter in parameters),
                                number=number, repeat=5)) / number
    return {"parameters": len(parameters), "seconds per call": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    result = {"command": " ".join(sys.argv), "reducers": reducers(args.steps), "check": check_per_call()}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
