"""What ``ddpkit run --unchanged`` costs where its batches come whole: the first batches of each pass, and a stream.

    .venv/bin/python benchmarks/unchanged_passes.py [--rounds 2] [--json FILE]

1. **Epochs** (``benchmarks/unchanged_loop.py``: a ResNet-18 without normalisation layers on synthetic 32-pixel
   images, SGD, a DataLoader with 2 workers): 5 epochs of 20 steps at a global batch of 32 on 2 processes,
   ``--unchanged`` against the same loop on ``job.prepare`` (``benchmarks/prepared_loop.py``, 16 a process), the same
   data set. Each pass's first batch and those its workers fetched ahead come whole under ``--unchanged`` and are cut
   at the model (its outputs gathered). Reported: each side's whole training time, every step included (the loop's
   own sum, and the process tree's wall time), the ratio unchanged / prepare (goal: at most 1.05).
2. **The ImageNet trainer** (pytorch/examples' ``imagenet/main.py`` as its authors wrote it, from the corpus beside
   the project; resnet18 at its 224-pixel crops of a small image folder, 2 epochs of 4 steps at batch 100 with 2 loader
   workers, each followed by its validation of 37 images): the original under ``--unchanged`` on 2 processes against
   its ``job.prepare`` conversion (``examples/imagenet_main.patch``, batch 50 a process) on 2, by the process tree's
   wall time (goal: at most 1.10), and by the median of its own step times but each epoch's first and last
   (``steady ratio``). Its meters read ``images.size(0)``: the gathered way, where each process reads its share of
   each batch from the second epoch (the first reads whole until its first step shows the way).
3. **A stream** (a script of its own below: an MLP 1024 wide, 4 layers, fed by an ``IterableDataset`` that makes its
   samples, batch 512, 20 steps): its training time on 2 processes under ``--unchanged`` against 1 (goal: at most 0.75).

Every process gets one thread (OMP_NUM_THREADS=1). R rounds, alternating which side goes first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unchanged import LOOP, PREPARED, ddpkit, imagenet_data, imagenet_scripts, run  # noqa: E402

STREAM = """
import sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

steps, width = int(sys.argv[1]), int(sys.argv[2])


class Samples(IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(steps * 512):
            x = torch.randn(width, generator=generator)
            yield x, x[:10].argmax()


torch.manual_seed(0)
layers = [layer for _ in range(4) for layer in (nn.Linear(width, width), nn.ReLU())]
model = nn.Sequential(*layers, nn.Linear(width, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
start = time.perf_counter()
for x, y in DataLoader(Samples(), batch_size=512):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"trained in {time.perf_counter() - start:.3f} s, last loss {loss.item():.4f}")
"""


def alternated(sides: dict, rounds: int, folder: str, read) -> dict:
    """Each side's argv run ``rounds`` times, alternating the order (AB, BA, ...): ``read(wall, stdout)`` of each."""
    found: dict[str, list] = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in (list(sides) if round_ % 2 == 0 else list(reversed(sides))):
            with tempfile.TemporaryDirectory(dir=folder) as here:
                wall, out = run(sides[name], here, threads=1)
            found[name].append(read(wall, out))
    return found


def trained_ratios(sides: dict, rounds: int, folder: str, ratios: dict[str, tuple[str, str]]) -> dict:
    """Each side's loop clock (its last line "trained in S s"), ``alternated``; the report with each of ``ratios``
    (a label: the two sides whose best times it divides)."""
    found = alternated(sides, rounds, folder, lambda wall, out: float(re.findall(r"trained in (\S+) s", out)[-1]))
    best = {name: min(times) for name, times in found.items()}
    return {"command": " ".join(sys.argv), "cores": os.cpu_count(), "trained_s": found,
            **{label: best[above] / best[below] for label, (above, below) in ratios.items()}}


def options(doc: str, steps: int) -> argparse.Namespace:
    """The command line of a benchmark that runs its sides ``--rounds`` times, each ``--steps`` steps."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--json", default=None, metavar="FILE")
    return parser.parse_args()


def reported(result: dict, json_file: str | None) -> None:
    """``result`` printed as one line of JSON, and written to ``json_file`` where one is given."""
    print(json.dumps(result))
    if json_file:
        Path(json_file).write_text(json.dumps(result, indent=1))


def epochs(rounds: int, folder: str) -> dict:
    common = ["--norm", "none", "--image-size", "32", "--samples", str(32 * 20), "--workers", "2", "--warmup", "0",
              "--steps", "100"]
    sides = {"unchanged": ddpkit("--unchanged", "--seed", "0", str(LOOP), "--batch-size", "32", *common),
             "prepare": ddpkit(str(PREPARED), "--batch-size", "16", *common)}

    def read(wall: float, out: str) -> dict:
        report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        return {"loop_s": report["total_s"], "wall_s": wall, "median_step_s": report["median_s"]}

    found = alternated(sides, rounds, folder, read)
    best = {name: min(value["loop_s"] for value in values) for name, values in found.items()}
    walls = {name: min(value["wall_s"] for value in values) for name, values in found.items()}
    return {"runs": found, "ratio loop": best["unchanged"] / best["prepare"],
            "ratio wall": walls["unchanged"] / walls["prepare"]}


def imagenet(rounds: int, folder: str) -> dict:
    original, converted = imagenet_scripts(folder)
    common = [str(imagenet_data(folder, 400)), "-a", "resnet18", "-j", "2", "--lr", "0.01", "--seed", "0", "--epochs",
              "2", "-p", "1"]
    sides = {"unchanged": ddpkit("--unchanged", "--seed", "0", str(original), *common, "-b", "100"),
             "prepare": ddpkit(str(converted), *common, "-b", "50")}
    found = alternated(sides, rounds, folder, lambda wall, out: (wall, steady_step(out)))
    wall = {name: [run[0] for run in runs] for name, runs in found.items()}
    steady = {name: [run[1] for run in runs] for name, runs in found.items()}
    return {"wall_s": wall, "steady_step_s": steady, "ratio": min(wall["unchanged"]) / min(wall["prepare"]),
            "steady ratio": min(steady["unchanged"]) / min(steady["prepare"])}


def steady_step(out: str) -> float:
    """The median of the ImageNet trainer's own step times (``-p 1``: "Epoch: [E][I/N]\tTime T"), rank 0's, but each
    epoch's first step (its loader's workers starting; under ``--unchanged``, the run's first also the watched step and
    the model's check, once) and last (a short batch)."""
    steps = re.findall(r"^Epoch: \[\d+\]\[\s*(\d+)/(\d+)\]\s+Time\s+(\S+)", out, flags=re.MULTILINE)
    return statistics.median(float(time) for index, count, time in steps if 1 < int(index) < int(count))


def stream(rounds: int, folder: str, steps: int = 20, width: int = 1024) -> dict:
    script = Path(folder) / "stream.py"
    script.write_text(STREAM)
    sides = {"1 process": [sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", "--nproc-per-node",
                           "1", str(script), str(steps), str(width)],
             "2 processes": ddpkit("--unchanged", "--seed", "0", str(script), str(steps), str(width))}
    found = alternated(sides, rounds, folder,
                       lambda wall, out: float(re.findall(r"trained in (\S+) s", out)[-1]))
    return {"trained_s": found, "ratio": min(found["2 processes"]) / min(found["1 process"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=("epochs", "imagenet", "stream"), default=None)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    result = {"command": " ".join(sys.argv), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as folder:
        for name, measure in (("epochs", epochs), ("imagenet", imagenet), ("stream", stream)):
            if args.only in (None, name):
                result[name] = measure(args.rounds, folder)
                print(name, json.dumps(result[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({name: value.get("ratio", value.get("ratio loop")) for name, value in result.items()
                      if isinstance(value, dict)}))


if __name__ == "__main__":
    main()
