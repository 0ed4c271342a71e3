"""What each test costs the machine: a pytest plugin that records, for each test (setup, call and teardown
together), the CPU time the whole machine spent meanwhile (/proc/stat, every core and every process: the ranks and
servers a test starts included) and its wall time. Meaningful with one test at a time (``-n 0``): under xdist's
workers one test's reading holds the others'. Then ``summary`` sums them by module and names the costliest tests.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -p suite_cpu -n 0 -m "not gpu" -q
    .venv/bin/python benchmarks/suite_cpu.py summary runs/suite-cpu.jsonl

Each test is one JSON line in ``$SUITE_CPU_OUT`` (default ``runs/suite-cpu.jsonl``): its id, CPU seconds, wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT", "runs/suite-cpu.jsonl"))


def busy_seconds() -> float:
    """CPU seconds every core has spent busy since boot: user, nice, system, irq, softirq and steal."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 - pytest's signature
    cpu, wall = busy_seconds(), time.monotonic()
    yield
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as out:
        out.write(json.dumps({"id": item.nodeid, "cpu": round(busy_seconds() - cpu, 2),
                              "wall": round(time.monotonic() - wall, 2)}) + "\n")


def summary(path: Path, top: int) -> str:
    """The total, each module's CPU and wall seconds (the costliest first), and the ``top`` costliest tests."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        module = modules[row["id"].split("::")[0]]
        module[0] += row["cpu"]
        module[1] += row["wall"]
    cpu, wall = sum(row["cpu"] for row in rows), sum(row["wall"] for row in rows)
    lines = [f"{len(rows)} tests: {cpu:.0f} s of CPU, {wall:.0f} s wall", "", "  CPU s   wall s  module"]
    lines += [f"{cpu:7.1f}  {wall:7.1f}  {name}" for name, (cpu, wall) in
              sorted(modules.items(), key=lambda item: -item[1][0])]
    lines += ["", "  CPU s   wall s  test"]
    lines += [f"{row['cpu']:7.1f}  {row['wall']:7.1f}  {row['id']}"
              for row in sorted(rows, key=lambda row: -row["cpu"])[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    summing = commands.add_parser("summary", help="each module's CPU and wall seconds, and the costliest tests")
    summing.add_argument("path", type=Path, nargs="?", default=OUT)
    summing.add_argument("--top", type=int, default=30)
    options = parser.parse_args(argv)
    print(summary(options.path, options.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
