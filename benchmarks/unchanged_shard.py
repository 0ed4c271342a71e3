"""``ddpkit run --unchanged --shard always`` against the replica and against one process: the memory each process
holds for training, the time of a step, and the weights (docs/benchmarks.md "Unchanged scripts: sharded").

    .venv/bin/python benchmarks/unchanged_shard.py [--width 1024] [--depth 6] [--epochs 1] [--dtype float64]
                                                   [--json FILE]

The script is tests/unchanged_sharded_script.py's MLP (residual blocks, Adam, its own DataLoader of 53 samples in
batches of 8, two micro-steps a step, clipping), unchanged, run three ways: 1 process; 2 processes, replicas
(``--shard never``); 2 processes, sharded (``--shard always``). Each process runs it through this file's ``probe``,
which reads what a user would read: the resident memory (``ru_maxrss``, the peak) less the resident memory before the
script's first line (torch and ddpkit loaded), at the last optimizer step (training's peak: the script saves its
checkpoint after) and at the end (its checkpoint included), and the time between the script's optimizer steps (the
median; a global ``torch.optim`` step hook). The script builds its whole model on every process before ddpkit shards it at its
first call: the peak counts that too. Reported: each way's figures, the sharded peak over one process's (goal: at most
0.6) and over the replica's, the step time sharded over replica, and the largest relative difference of the final
weights from one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "unchanged_sharded_script.py"
WAYS = {"one process": (1, "never"), "replica": (2, "never"), "sharded": (2, "always")}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes() -> int:
    """The bytes of every tensor storage alive in this process (a sharded parameter's local shard, not its global
    shape), each storage once: the training state itself, whatever the allocator keeps besides."""
    import gc

    import torch

    storages: dict[int, int] = {}
    for found in gc.get_objects():
        if isinstance(found, torch.Tensor):
            local = getattr(found, "_local_tensor", found)  # a DTensor's own shard
            if local.device.type == "cpu" and not local.is_meta:
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def probe(report: str, script: str, arguments: list[str]) -> None:
    """Run ``script`` as ``__main__`` (this process is one of the job's ranks), then write what it held and how long
    its steps took to ``report``-<rank>.json (through os.open, which --unchanged leaves to every rank)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    before = resident_bytes()
    steps: list[float] = []
    peaks: list[int] = []  # ru_maxrss after each step: the peak of training, before the script's first checkpoint
    held: list[int] = []  # the resident memory after each step, less the start's
    live: list[int] = []  # the tensors alive after each step

    def stepped(*_) -> None:
        steps.append(time.perf_counter())
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        held.append(resident_bytes() - before)
        live.append(live_tensor_bytes())

    register_optimizer_step_post_hook(stepped)
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    intervals = [later - earlier for earlier, later in zip(steps, steps[1:])]
    found = {"before_bytes": before, "peak_bytes": peak, "with_saving_bytes": peak - before,
             "added_bytes": peaks[-1] - before, "held_bytes": max(held), "live_bytes": max(live), "steps": len(steps),
             "step_s": statistics.median(intervals) if intervals else None}
    handle = os.open(f"{report}-{os.environ.get('RANK', '0')}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(handle, json.dumps(found).encode())
    os.close(handle)


MEMORY = {"live_bytes": "tensors alive after a step (each storage once)",
          "held_bytes": "resident after a step, less the start's",
          "added_bytes": "resident at its peak through the last step (ru_maxrss), less the start's",
          "with_saving_bytes": "the same through the end, the script's checkpoint included"}
# glibc keeps large freed blocks for reuse once one was freed (its mmap threshold rises to them): resident memory then
# reads what the process once held. A fixed threshold returns them to the system when freed.
ALLOCATORS = {"glibc's default": {}, "blocks returned when freed": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def run(way: str, folder: Path, args: argparse.Namespace, allocator: dict) -> dict:
    nproc, shard = WAYS[way]
    out = Path(tempfile.mkdtemp(dir=folder))
    argv = [sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", "--shard", shard, "--nproc-per-node",
            str(nproc), __file__, "probe", str(out / "probe"), str(SCRIPT), str(out), "mlp", str(args.width),
            str(args.depth), str(args.epochs)]
    started = time.perf_counter()
    done = subprocess.run(argv, env={**os.environ, "DTYPE": args.dtype, **allocator}, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("probe-*.json"))]
    import torch

    return {"processes": nproc, "shard": shard, "wall_s": time.perf_counter() - started, "ranks": ranks,
            **{kind: max(rank[kind] for rank in ranks) for kind in MEMORY},
            "step_s": statistics.median(rank["step_s"] for rank in ranks),
            "weights": torch.load(out / "result.pt", weights_only=True)["state"],
            "said": [line for line in done.stderr.splitlines() if "--unchanged:" in line]}


def worst(one: dict, other: dict) -> float:
    return max(((one[key].double() - other[key].double()).abs().max()
                / one[key].double().abs().max().clamp_min(1e-30)).item() for key in one if one[key].is_floating_point())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch

    mib = 2**20
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
              "torch": torch.__version__, "command": " ".join(["benchmarks/unchanged_shard.py", *sys.argv[1:]]),
              "dtype": args.dtype, "allocators": {}}
    with tempfile.TemporaryDirectory() as folder:
        for allocator, environment in ALLOCATORS.items():
            found = {way: run(way, Path(folder), args, environment) for way in WAYS}
            one, replica, sharded = found["one process"], found["replica"], found["sharded"]
            result["parameters"] = sum(value.numel() for value in one["weights"].values() if value.is_floating_point())
            figures = {"ways": {way: {key: value for key, value in numbers.items() if key != "weights"}
                                for way, numbers in found.items()},
                       "sharded_over_one_process": {kind: sharded[kind] / one[kind] for kind in MEMORY},
                       "sharded_over_replica": {kind: sharded[kind] / replica[kind] for kind in MEMORY},
                       "step_sharded_over_replica": sharded["step_s"] / replica["step_s"],
                       "worst_relative_sharded": worst(one["weights"], sharded["weights"]),
                       "worst_relative_replica": worst(one["weights"], replica["weights"])}
            result["allocators"][allocator] = figures
            print(f"{result['parameters'] / 1e6:.1f} M parameters in {args.dtype}, Adam; {allocator}: each process's "
                  "memory, one process / 2 replicas / 2 sharded (sharded over one process):")
            for kind, what in MEMORY.items():
                print(f"  {what}: {one[kind] / mib:.0f} / {replica[kind] / mib:.0f} / {sharded[kind] / mib:.0f} MiB "
                      f"({figures['sharded_over_one_process'][kind]:.3f})")
            print(f"  step (median between optimizer steps): one process {one['step_s'] * 1e3:.1f} ms, replica "
                  f"{replica['step_s'] * 1e3:.1f} ms, sharded {sharded['step_s'] * 1e3:.1f} ms (sharded / replica "
                  f"{figures['step_sharded_over_replica']:.2f})")
            print(f"  weights against one process's, largest relative difference: sharded "
                  f"{figures['worst_relative_sharded']:.1e}, replica {figures['worst_relative_replica']:.1e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        probe(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
