"""What ``ddpkit run --unchanged`` costs: the same one-device loop unchanged against its ``job.prepare`` conversion at
the same global batch, and pytorch/examples' ImageNet trainer on 1 and 2 processes.

    .venv/bin/python benchmarks/unchanged.py [--rounds R] [--json FILE]

1. **Step time** (``benchmarks/unchanged_loop.py``, a ResNet-18 on synthetic 64-pixel images): ``ddpkit run
   --unchanged --nproc-per-node 2`` at ``--batch-size 2B`` against the same loop on ``job.prepare``
   (``benchmarks/prepared_loop.py``) at ``--batch-size B``: the same global batch, the same model, one gloo group. R rounds, alternating which goes
   first (AB, BA, ...); each run reports its median step after a warm-up. Reported: each side's median over rounds
   and the ratio unchanged / prepare (goal: at most 1.05).
2. **The ImageNet trainer** (pytorch/examples' ``imagenet/main.py`` as its authors wrote it, from the corpus beside
   the project, ``../shared/corpus``; resnet18 at its 224-pixel crops of a small image folder, one epoch): the
   original as ``python main.py`` on one process, the same file under ``--unchanged`` on 2, and its ``job.prepare``
   conversion (``examples/imagenet_main.patch``, written out onto the original) on 2 at half the batch.
   Every process gets one thread (OMP_NUM_THREADS=1). Reported: the wall time of each run and the script's own
   average batch time.

Each measurement is a real process tree started as a user would start it; the clock is the driver's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOP = REPO / "benchmarks" / "unchanged_loop.py"
PREPARED = REPO / "benchmarks" / "prepared_loop.py"
CONVERSIONS = REPO / "benchmarks" / "conversions"
sys.path.insert(0, str(CONVERSIONS))
import convert  # noqa: E402  (benchmarks/conversions/convert.py: the public scripts and their conversions)


def imagenet_scripts(folder: str) -> tuple[Path, Path]:
    """The ImageNet trainer as its authors wrote it, and its ``job.prepare`` conversion written into ``folder``."""
    return convert.original_of("imagenet", "ddpkit"), convert.write("imagenet", "ddpkit", Path(folder) / "converted")


def imagenet_data(folder: str, images: int) -> Path:
    """An image folder of about ``images`` training images in 6 classes (and 37 to validate), made in ``folder``."""
    out = Path(folder) / "data"
    subprocess.run([sys.executable, str(CONVERSIONS / "make_data.py"), "--out", str(out), "--no-check",
                    "--train-per-class", str(-(-images // 6))], check=True, capture_output=True)
    return out / "imagefolder"


def run(argv: list[str], cwd: str, threads: int | None = None) -> tuple[float, str]:
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return wall, done.stdout


def ddpkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", *args]


def step_times(rounds: int, batch: int, folder: str, norm: str) -> dict:
    model = ["--norm", norm]
    sides = {"unchanged": ddpkit("--unchanged", "--seed", "0", str(LOOP), "--batch-size", str(2 * batch), *model),
             "prepare": ddpkit(str(PREPARED), "--batch-size", str(batch), *model),
             "prepare --sync-bn": ddpkit(str(PREPARED), "--batch-size", str(batch), "--sync-bn", *model)}
    medians: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in (list(sides) if round_ % 2 == 0 else list(reversed(sides))):  # ABC, CBA, ...
            _, out = run(sides[name], folder)
            line = [line for line in out.splitlines() if line.startswith("{")][-1]  # the loop's own report
            medians[name].append(json.loads(line)["median_s"])
    result = {name: {"median_s": statistics.median(values), "rounds_s": values} for name, values in medians.items()}
    result["ratio"] = result["unchanged"]["median_s"] / result["prepare"]["median_s"]
    result["ratio_sync_bn"] = result["unchanged"]["median_s"] / result["prepare --sync-bn"]["median_s"]
    return result


def imagenet(folder: str, batch: int, images: int) -> dict:
    original, converted = imagenet_scripts(folder)
    data = imagenet_data(folder, images)
    images = 6 * -(-images // 6)
    common = [str(data), "-a", "resnet18", "-j", "0", "--lr", "0.01", "--seed", "0", "--epochs", "1"]
    last = images // batch - 1  # the progress line of the last batch: its average is the epoch's
    runs = {
        "original, 1 process": [sys.executable, str(original), *common, "-b", str(batch), "-p", str(last)],
        "original --unchanged, 2 processes": ddpkit("--unchanged", "--seed", "0", str(original), *common,
                                                    "-b", str(batch), "-p", str(last)),
        "job.prepare conversion, 2 processes": ddpkit(str(converted), *common, "-b", str(batch // 2),
                                                      "-p", str(last)),
    }
    result = {}
    for name, argv in runs.items():
        with tempfile.TemporaryDirectory(dir=folder) as here:
            wall, out = run(argv, here, threads=1)
        batch_times = re.findall(rf"Epoch: \[0\]\[\s*{last + 1}/\d+\]\tTime\s+\S+ \(\s*(\S+)\)", out)
        result[name] = {"wall_s": wall, "batch_s": float(batch_times[-1]) if batch_times else None}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per process, with --prepare (default: 16)")
    parser.add_argument("--norm", choices=("batch", "none"), default="batch", help="the ResNet's (default: batch)")
    parser.add_argument("--skip-imagenet", action="store_true")
    parser.add_argument("--imagenet-images", type=int, default=512)
    parser.add_argument("--imagenet-batch-size", type=int, default=32, help="the script's own (default: 32)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        steps = step_times(args.rounds, args.batch_size, folder, args.norm)
        print(f"step, global batch {2 * args.batch_size} on 2 processes ({args.norm}): --unchanged "
              f"{steps['unchanged']['median_s'] * 1000:.1f} ms, job.prepare {steps['prepare']['median_s'] * 1000:.1f} "
              f"ms, job.prepare with SyncBatchNorm {steps['prepare --sync-bn']['median_s'] * 1000:.1f} ms; "
              f"ratios {steps['ratio']:.3f} and {steps['ratio_sync_bn']:.3f}")
        walls = {} if args.skip_imagenet else imagenet(folder, args.imagenet_batch_size, args.imagenet_images)
        for name, numbers in walls.items():
            batch = "" if numbers["batch_s"] is None else f", {numbers['batch_s']:.3f} s per batch"
            print(f"imagenet, {name}: {numbers['wall_s']:.1f} s{batch}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "steps": steps, "imagenet": walls,
                                               "cores": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
