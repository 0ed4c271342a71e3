"""What a sharded model's averaged copies and whole checkpoints cost each process (``ddpkit run --unchanged --shard``;
docs/benchmarks.md "Unchanged scripts: EMA copies and whole checkpoints, sharded").

    .venv/bin/python benchmarks/shard_state.py [--width 2048] [--depth 8] [--json FILE]
    .venv/bin/python benchmarks/shard_state.py --source OTHER/src --no-ema    # another checkout's ddpkit (before)

A one-device script (this file, run with ``--script``) builds an MLP (``depth`` blocks of two ``width`` x ``width``
layers: 67.1 M parameters at the defaults, 268 MB in float32), Adam, an EMA (``AveragedModel`` with
``get_ema_multi_avg_fn``, built before training), trains 2 steps (the EMA updated after each), takes a deep copy of
the model, then builds and saves its whole checkpoint ``{"model": model.state_dict(), "optimizer":
opt.state_dict()}`` with ``torch.save``, as a script's resume does. It runs on 2 processes, sharded (``--shard
always``) and as replicas (``--shard never``). Each process reports (to a file of its own, written with ``os.write``,
which ddpkit leaves alone):

- the bytes of the EMA copy's tensors it holds (a sharded parameter's own shard), and the resident memory that the
  deep copy added;
- the resident memory that building and saving the checkpoint added: the most, sampled every millisecond by a thread
  (``/proc/self/statm``), less what it held just before. The processes run with ``MALLOC_MMAP_THRESHOLD_=131072``:
  freed large blocks go back to the system, so that resident memory shows what is alive.

Then the saved file is loaded with ``weights_only=True`` into the plain model, in this process (never imports
ddpkit's hooks), and compared with rank 0's weights at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """The most resident memory while inside, sampled every millisecond, less the resident memory on entering."""

    def __enter__(self):
        self.start = self.most = resident()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.most = max(self.most, resident())
            time.sleep(0.001)

    def __exit__(self, *_):
        self.running = False
        self.thread.join()
        self.most = max(self.most, resident())
        self.added = self.most - self.start


def build(width: int, depth: int):
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

        def forward(self, x):
            return x + self.down(self.up(x).relu())

    return nn.Sequential(*(Block() for _ in range(depth)))


def script(out: str, width: int, depth: int, ema: bool) -> None:
    """The one-device script (each process of the run): reads nothing of ranks but the file it reports to."""
    import copy

    import torch

    torch.manual_seed(0)
    model = build(width, depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if ema:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    for _ in range(2):
        loss = model(torch.randn(8, width)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ema:
            averaged.update_parameters(model)
    report = {}
    if ema:
        report["ema bytes"] = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                                  for t in averaged.module.parameters())
        kept = []
        with Peak() as copied:
            kept.append(copy.deepcopy(model))
        report["deep copy added"] = copied.added
        kept.clear()
    with Peak() as saving:
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(checkpoint, os.path.join(out, "checkpoint.pt"))
    report["checkpoint added"] = saving.added
    with torch.no_grad():
        report["probe"] = model(torch.ones(1, width)).sum().item()
    handle = os.open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(handle, json.dumps(report).encode())
    os.close(handle)


def run(way: str, width: int, depth: int, ema: bool, source: str | None) -> dict:
    out = tempfile.mkdtemp(prefix=f"shard-state-{way}-")
    # Freed large blocks go back to the system, so that resident memory shows what is alive (glibc's default keeps
    # them, and a later allocation reuses them unseen).
    env = dict(os.environ, PYTHONPATH=source or str(ROOT / "src"), MALLOC_MMAP_THRESHOLD_="131072")
    command = [sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", "--shard",
               "always" if way == "sharded" else "never", "--nproc-per-node", "2", __file__, "--script", out,
               "--width", str(width), "--depth", str(depth), *([] if ema else ["--no-ema"])]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{way}: {done.stdout}{done.stderr}")
    ranks = [json.loads((Path(out) / f"rank{rank}.json").read_text()) for rank in range(2)]
    import torch

    model = build(width, depth)
    saved = torch.load(Path(out) / "checkpoint.pt", weights_only=True)
    model.load_state_dict(saved["model"])  # the plain model, in a process without ddpkit's hooks
    with torch.no_grad():
        probe = model(torch.ones(1, width)).sum().item()
    return {"ranks": ranks, "loads into the plain model": probe == ranks[0]["probe"], "seconds":
            round(time.perf_counter() - started, 1), "file bytes": (Path(out) / "checkpoint.pt").stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--no-ema", action="store_true", help="no EMA copy (a ddpkit before sharded EMAs: it fails)")
    parser.add_argument("--source", help="the src folder of another checkout of ddpkit to run (before and after)")
    parser.add_argument("--ways", default="sharded,replica")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--script", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.script:
        script(arguments.script, arguments.width, arguments.depth, not arguments.no_ema)
        return
    model_bytes = 4 * arguments.depth * 2 * (arguments.width * arguments.width + arguments.width)
    results = {"model bytes": model_bytes, "command": " ".join(sys.argv), "machine": platform.processor() or
               platform.machine(), "cpus": os.cpu_count()}
    for way in arguments.ways.split(","):
        results[way] = run(way, arguments.width, arguments.depth, not arguments.no_ema, arguments.source)
        for rank, report in enumerate(results[way]["ranks"]):
            said = ", ".join(f"{key} {value / 2**20:.1f} MiB ({value / model_bytes:.3f} of the model)"
                             for key, value in report.items() if key != "probe")
            print(f"{way}, rank {rank}: {said}")
        print(f"{way}: the file loads into the plain model with rank 0's weights: "
              f"{results[way]['loads into the plain model']} ({results[way]['seconds']} s)")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
