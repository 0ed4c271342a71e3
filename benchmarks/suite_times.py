"""The test suite's own time, run by run: what `.ci/run` measured, kept as one row per run, and drawn.

`.ci/run` calls ``check``: each part's wall time, the counts of its tests, a line for each test module whose time grew
by more than 20 s against the last recorded run (benchmarks/results/suite-modules.json), and the run's record, written
as JSON. ``record`` adds such a record (or a README (b) run timed alone) to benchmarks/results/suite-runs.csv, keeps its
modules' times as the ones the next run is compared with, and draws docs/suite-times.svg from every row: time against
commits, with the budgets across it. ``draw`` draws it again.

    python benchmarks/suite_times.py check --wall install=61 --wall session=402 --junit session=S.xml --out run.json
    python benchmarks/suite_times.py record run.json --note "what changed"
    python benchmarks/suite_times.py record --readme-b 5:07 --commit 3c94f9e --note "README (b) alone, fresh clone"
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "benchmarks" / "results" / "suite-runs.csv"
MODULES = REPO / "benchmarks" / "results" / "suite-modules.json"
PLOT = REPO / "docs" / "suite-times.svg"
COLUMNS = ["date", "commit", "readme_b_s", "install_s", "default_s", "slow_s", "session_s", "floor_s", "ci_s",
           "passed", "note"]
GREW_S = 20.0  # a module whose time grew by more than this against the last recorded run is named
BUDGETS = {"ci_s": 12 * 60, "readme_b_s": 8 * 60}  # README, "Tests": .ci/run as a whole, README (b) install included


def clock(seconds: float) -> str:
    """``405`` -> ``"6:45"``."""
    seconds = round(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


def seconds_of(text: str) -> float:
    """``"6:45"`` or ``"405"`` -> 405.0."""
    minutes, _, rest = text.rpartition(":")
    return float(rest) + 60 * float(minutes or 0)


def read_junit(path: Path) -> tuple[dict[str, float], dict[str, int]]:
    """(each test module's summed time, the counts) of a pytest ``--junitxml`` file: a test's time is its setup, call
    and teardown; a module's, its tests' (on the one xdist worker that ran the module: about its wall time there)."""
    modules: dict[str, float] = {}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x, or tests.test_x.TestClass
        split = next((i + 1 for i, part in enumerate(parts) if part.startswith("test_")), len(parts))
        module = "/".join(parts[:split]) + ".py"
        modules[module] = modules.get(module, 0.0) + float(case.get("time") or 0.0)
        kinds = {child.tag for child in case}
        counts["failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"] += 1
    return modules, counts


def grown(modules: dict[str, float], last: dict[str, float]) -> list[str]:
    """A line for each module whose time grew by more than GREW_S seconds against ``last`` (a new module counts from
    nothing)."""
    lines = []
    for name, seconds in sorted(modules.items(), key=lambda item: item[1] - last.get(item[0], 0.0), reverse=True):
        before = last.get(name, 0.0)
        if seconds - before > GREW_S:
            lines.append(f"suite time: {name} grew by {seconds - before:.0f} s against the last recorded run "
                         f"({before:.0f} s to {seconds:.0f} s)")
    return lines


def commit_here() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def check(walls: list[str], junits: list[str], out: Path | None) -> int:
    """Print each part's time, its counts and the modules that grew; write the run's record to ``out``."""
    record = {"date": datetime.date.today().isoformat(), "commit": commit_here(), "walls": {}, "counts": {},
              "modules": {}}
    for pair in walls:
        name, _, seconds = pair.partition("=")
        record["walls"][name] = float(seconds)
        print(f"suite time: {name} {clock(float(seconds))}")
    for pair in junits:
        name, _, path = pair.partition("=")
        modules, counts = read_junit(Path(path))
        record["counts"][name] = counts
        record["modules"].update({(module if name == "session" else f"{name}:{module}"): seconds
                                  for module, seconds in modules.items()})
        print(f"suite time: {name}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    last = json.loads(MODULES.read_text())["modules"] if MODULES.exists() else {}
    for line in grown(record["modules"], last):
        print(line)
    if out is not None:
        out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def read_runs() -> list[dict[str, str]]:
    with RUNS.open(newline="") as handle:
        return list(csv.DictReader(handle))


def record(path: Path | None, readme_b: str | None, commit: str | None, note: str) -> int:
    """Add a row to RUNS (from a record that ``check`` wrote, or a README (b) time), keep its modules' times, draw."""
    row = dict.fromkeys(COLUMNS, "")
    row.update(date=datetime.date.today().isoformat(), commit=commit or commit_here(), note=note)
    if path is not None:
        run = json.loads(path.read_text())
        walls = run["walls"]
        row.update(date=run["date"], commit=commit or run["commit"])
        for column, part in (("install_s", "install"), ("session_s", "session"), ("floor_s", "floor"),
                             ("ci_s", "total")):
            if part in walls:
                row[column] = f"{walls[part]:.0f}"
        row["passed"] = "/".join(str(counts["passed"]) for counts in run["counts"].values())
        MODULES.write_text(json.dumps({"commit": row["commit"], "date": row["date"], "modules": run["modules"]},
                                      indent=1, sort_keys=True) + "\n")
    if readme_b is not None:
        row["readme_b_s"] = f"{seconds_of(readme_b):.0f}"
    with RUNS.open("a", newline="") as handle:  # one row a line, "\n" as in the rest of the file (not csv's "\r\n")
        csv.DictWriter(handle, COLUMNS, lineterminator="\n").writerow(row)
    PLOT.write_text(draw(read_runs()))
    print(f"recorded {row['commit']} in {RUNS.relative_to(REPO)}; drew {PLOT.relative_to(REPO)}")
    return 0


SERIES = [("ci_s", "whole .ci/run", "#1f77b4"), ("readme_b_s", "README (b), install included", "#d62728"),
          ("default_s", "default suite", "#2ca02c"), ("slow_s", "slow or ray", "#9467bd"),
          ("session_s", "one session: default, slow and ray", "#ff7f0e"), ("floor_s", "the floor's part", "#8c564b")]


def draw(rows: list[dict[str, str]], width: int = 980, height: int = 360) -> str:
    """An SVG of each part's minutes against the runs, in order, the budgets dashed across."""
    left, right, top, bottom = 48, 310, 16, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [float(row[key]) for row in rows for key, *_ in SERIES if row.get(key)]
    top_minutes = max([*(value / 60 for value in values), *(budget / 60 for budget in BUDGETS.values())]) + 1

    def x(index: int) -> float:
        return left + plot_w * index / max(1, len(rows) - 1)

    def y(seconds: float) -> float:
        return top + plot_h * (1 - seconds / 60 / top_minutes)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>']
    for minute in range(0, int(top_minutes) + 1, 2):
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(minute * 60):.1f}" y2="{y(minute * 60):.1f}" '
                     f'stroke="#ddd"/><text x="{left - 6}" y="{y(minute * 60) + 4:.1f}" text-anchor="end">{minute}'
                     '</text>')
    parts.append(f'<text x="12" y="{top + plot_h / 2}" transform="rotate(-90 12 {top + plot_h / 2})" '
                 'text-anchor="middle">minutes</text>')
    dates = [row["date"] for row in rows]
    for index, date in enumerate(dates):
        if index == 0 or date != dates[index - 1]:
            parts.append(f'<text x="{x(index):.1f}" y="{top + plot_h + 14}" font-size="9" '
                         f'transform="rotate(30 {x(index):.1f} {top + plot_h + 14})">{date[5:]}</text>')
    for key, name, colour in SERIES:
        points = [(x(index), y(float(row[key]))) for index, row in enumerate(rows) if row.get(key)]
        if not points:
            continue
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        parts.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2" fill="{colour}"/>' for px, py in points)
    legend = [(name, colour, False) for key, name, colour in SERIES if any(row.get(key) for row in rows)]
    named = {key: (name, colour) for key, name, colour in SERIES}
    for key, budget in BUDGETS.items():
        name, colour = named[key]
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(budget):.1f}" y2="{y(budget):.1f}" '
                     f'stroke="{colour}" stroke-dasharray="6 4"/>')
        legend.append((f"budget of {name}: {clock(budget)}", colour, True))
    for index, (name, colour, dashed) in enumerate(legend):
        ly = top + 14 + 18 * index
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        parts.append(f'<line x1="{left + plot_w + 12}" x2="{left + plot_w + 36}" y1="{ly - 4}" y2="{ly - 4}" '
                     f'stroke="{colour}" stroke-width="2"{dash}/><text x="{left + plot_w + 42}" y="{ly}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser("check", help="print each part's time and the modules that grew; write the record")
    checking.add_argument("--wall", action="append", default=[], metavar="PART=SECONDS")
    checking.add_argument("--junit", action="append", default=[], metavar="PART=FILE", help="pytest --junitxml")
    checking.add_argument("--out", type=Path, help="write the run's record (JSON) here")
    recording = commands.add_parser("record", help="add a run to benchmarks/results/suite-runs.csv and draw")
    recording.add_argument("run", nargs="?", type=Path, help="a record that check wrote")
    recording.add_argument("--readme-b", help="README (b)'s time, install included (M:SS)")
    recording.add_argument("--commit", help="the commit (default: the record's, or HEAD)")
    recording.add_argument("--note", default="", help="what the run was")
    commands.add_parser("draw", help=f"draw {PLOT.relative_to(REPO)} from the rows")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.wall, args.junit, args.out)
    if args.command == "record":
        if args.run is None and args.readme_b is None:
            parser.error("record needs a run's record (from check) or --readme-b")
        return record(args.run, args.readme_b, args.commit, args.note)
    PLOT.write_text(draw(read_runs()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
