"""docs/benchmarks.md's GPU tables from a folder that benchmarks/gpu_pass.sh wrote.

    python benchmarks/gpu_tables.py benchmarks/results/gpu-h200-2026-11-26

Prints Markdown: ResNet-50 images/s per precision and strategy (median [min-max] over the rounds), the
issue's goals as ratios of rows measured in the same pass, and the `ddpkit train` runs' speed and peak memory.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# (bench file stem, what it measured), in the order of the table
CONFIGS = [
    ("bench-fp32", "fp32 (PyTorch's default: cuDNN convolutions in TF32)"),
    ("bench-tf32", "tf32 (TF32 matmuls too)"),
    ("bench-bf16", "bf16 autocast"),
    ("bench-bf16-cl", "bf16 + channels_last"),
    ("bench-bf16-cl-compile", "bf16 + channels_last + torch.compile"),
    ("bench-bf16-cl-ddp-bucket-view", "bf16 + channels_last, DDP gradient_as_bucket_view"),
    ("bench-bf16-cl-ddp-static", "bf16 + channels_last, DDP static_graph"),
    ("bench-bf16-cl-ddp-views", "bf16 + channels_last, DDP gradient_as_bucket_view + static_graph"),
    ("bench-folder-cpu-decode", "bf16 + channels_last, JPEG folder, CPU decoding"),
    ("bench-folder-gpu-decode", "bf16 + channels_last, JPEG folder, nvJPEG decoding"),
    ("bench-shards-gpu-decode", "bf16 + channels_last, the folder packed (shards), nvJPEG decoding"),
    ("bench-shards-cpu-decode", "bf16 + channels_last, the folder packed (shards), CPU decoding"),
    ("bench-folder-auto-decode", "bf16 + channels_last, JPEG folder, `--decode auto`"),
    ("bench-folder-gpu-decode-compile", "bf16 + channels_last + torch.compile, JPEG folder, nvJPEG decoding"),
]


def rows_of(folder: Path, stem: str) -> dict[str, dict]:
    path = folder / f"{stem}.json"
    if not path.exists():
        return {}
    return {row["strategy"]: row for row in json.loads(path.read_text())["results"] if row["devices"] == 1}


def labelled(label: str, row: dict | None) -> str:
    """The configuration's name, with what `--decode auto` came to where the bench says (since 2026-11-28)."""
    return f"{label} ({row['decode']})" if row and "auto" in label and row.get("decode") else label


def cell(row: dict | None) -> str:
    if row is None:
        return "–"
    low, high = row["spread"]
    return f"{row['images_per_sec']:.0f} [{low:.0f}–{high:.0f}]"


def bench_table(folder: Path) -> list[str]:
    lines = ["| configuration | no DDP (single) | DDP, world size 1 | DataParallel, 1 GPU | DDP / single "
             "| ddpkit / hand (DDP) | peak memory (DDP) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for stem, label in CONFIGS:
        rows = rows_of(folder, stem)
        if not rows:
            continue
        single, ddp, dp = rows.get("single"), rows.get("ddp"), rows.get("dp")
        ratio = f"{ddp['images_per_sec'] / single['images_per_sec']:.1%}" if single and ddp else "–"
        memory = f"{ddp['peak_memory_bytes'][0] / 2**30:.1f} GiB" if ddp else "–"
        hand = f"{ddp['ddpkit_over_hand']:.3f}" if ddp else "–"
        lines.append(f"| {labelled(label, ddp)} | {cell(single)} | {cell(ddp)} | {cell(dp)} | {ratio} | {hand} "
                     f"| {memory} |")
    return lines


def ddp_rate(folder: Path, stem: str, strategy: str = "ddp") -> float | None:
    row = rows_of(folder, stem).get(strategy)
    return row["images_per_sec"] if row else None


def fraction(folder: Path, stem: str) -> float | None:
    row = rows_of(folder, stem).get("ddp")
    return row.get("fraction_of_synthetic") if row else None


def goals(folder: Path) -> list[str]:
    headline = ddp_rate(folder, "bench-bf16-cl", "single")
    checks = [
        ("ResNet-50 bf16 + channels_last, no DDP: ≥ 3,000 images/s", headline, 3000.0, "{:.0f} images/s"),
        ("DDP at world size 1 ≥ 99% of no DDP (bf16 + channels_last)",
         _ratio(ddp_rate(folder, "bench-bf16-cl"), headline), 0.99, "{:.1%}"),
        ("DDP at world size 1 ≥ 98% of no DDP (fp32)",
         _ratio(ddp_rate(folder, "bench-fp32"), ddp_rate(folder, "bench-fp32", "single")), 0.98, "{:.1%}"),
        ("DDP at world size 1 with gradient_as_bucket_view + static_graph ≥ 99% of no DDP",
         _ratio(ddp_rate(folder, "bench-bf16-cl-ddp-views"), ddp_rate(folder, "bench-bf16-cl-ddp-views", "single")),
         0.99, "{:.1%}"),
        # From files, against synthetic data timed in the same processes (the bench's fraction_of_synthetic).
        ("JPEG folder, CPU decoding: ≥ 90% of synthetic", fraction(folder, "bench-folder-cpu-decode"), 0.90, "{:.1%}"),
        ("packed folder, CPU decoding: ≥ 90% of synthetic", fraction(folder, "bench-shards-cpu-decode"), 0.90,
         "{:.1%}"),
        ("JPEG folder, nvJPEG: ≥ 90% of synthetic", fraction(folder, "bench-folder-gpu-decode"), 0.90, "{:.1%}"),
        ("packed folder, nvJPEG: ≥ 90% of synthetic", fraction(folder, "bench-shards-gpu-decode"), 0.90, "{:.1%}"),
        ("JPEG folder, the path --decode auto picks: ≥ 90% of synthetic", fraction(folder, "bench-folder-auto-decode"),
         0.90, "{:.1%}"),
        ("JPEG folder, nvJPEG, compiled: ≥ 90% of synthetic (compiled)",
         fraction(folder, "bench-folder-gpu-decode-compile"), 0.90, "{:.1%}"),
        ("torch.compile faster than eager (DDP, bf16 + channels_last)",
         _ratio(ddp_rate(folder, "bench-bf16-cl-compile"), ddp_rate(folder, "bench-bf16-cl")), 1.0, "{:.2f}×"),
    ]
    lines = ["| goal | measured | met |", "| --- | --- | --- |"]
    for name, value, floor, form in checks:
        if value is not None:
            lines.append(f"| {name} | {form.format(value)} | {'yes' if value >= floor else 'no'} |")
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def train_table(folder: Path) -> list[str]:
    lines = ["| run | images/s (epoch) | peak memory | train state | val accuracy |", "| --- | --- | --- | --- | --- |"]
    for metrics in sorted(folder.glob("train-*/metrics.jsonl")):
        row = json.loads(metrics.read_text().splitlines()[-1])
        lines.append(f"| {metrics.parent.name.removeprefix('train-')} | {row['images_per_sec']:.0f} "
                     f"| {row['peak_memory_mb'][0]:.0f} MiB | {row['train_state_mb'][0]:.0f} MiB | {row['val_acc']:.2%} |")
    return lines


def files_table(folder: Path) -> list[str]:
    """From files against synthetic data in the same process (the bench's rounds), and the loader alone."""
    lines = ["| run | from files (images/s) | synthetic, same process | fraction |", "| --- | --- | --- | --- |"]
    for stem, label in CONFIGS:
        row = rows_of(folder, stem).get("ddp")
        if row and "fraction_of_synthetic" in row:
            lines.append(f"| {labelled(label, row)} | {row['images_per_sec']:.0f} "
                         f"| {row['synthetic_images_per_sec']:.0f} "
                         f"| {row['fraction_of_synthetic']:.1%} |")
    throughput = folder / "loader-throughput.txt"
    if throughput.exists():
        text = throughput.read_text()
        report = json.loads(text[text.index("{"):])
        for row in report["results"]:
            low, high = row["spread"]
            lines.append(f"| the loader alone, {row['decode']} decoding ({row['workers']} workers, no model) "
                         f"| {row['images_per_sec']:.0f} [{low:.0f}–{high:.0f}] | – | – |")
    return lines


def unchanged_table(folder: Path) -> list[str]:
    """`ddpkit run --unchanged` at one process against plain `python script.py` (the unchanged-one-process step):
    the median over the rounds of each run's median step."""
    path = folder / "unchanged-one-process.txt"
    if not path.exists():
        return []
    runs: dict[str, list[dict]] = {"plain": [], "unchanged": []}
    for line in path.read_text().splitlines():
        kind, _, report = line.partition(" ")
        if kind in runs and report.startswith("{"):
            runs[kind].append(json.loads(report))
    if not runs["plain"] or not runs["unchanged"]:
        return []
    lines = ["| run | rounds | median step (ms) [min–max of the rounds] | GPUs it sees | over plain |",
             "| --- | --- | --- | --- | --- |"]
    plain = statistics.median(run["median_s"] for run in runs["plain"])
    for kind, reports in runs.items():
        steps = [run["median_s"] * 1e3 for run in reports]
        lines.append(f"| {kind} | {len(steps)} | {statistics.median(steps):.2f} [{min(steps):.2f}–{max(steps):.2f}] "
                     f"| {', '.join(sorted({str(run['visible_gpus']) for run in reports}))} "
                     f"| {statistics.median(steps) / (plain * 1e3):.3f} |")
    return lines


def checkpoint_table(folder: Path) -> list[str]:
    path = folder / "checkpoint-blocking.json"
    if not path.exists():
        return []
    report = json.loads(path.read_text())
    lines = [f"{report['strategy']}, {report['world_size']} process(es), {report['device']}, {report['parameters']:,} "
             f"parameters; a step with no save running: {report.get('idle_step_s', float('nan')) * 1e3:.1f} ms", "",
             "| way | blocked (ms) | then waited (ms) | step while writing (ms) | blocked / sharded |",
             "| --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        lines.append(f"| {row['way']} | {row['blocked_s'] * 1e3:.1f} | {row['waited_s'] * 1e3:.1f} "
                     f"| {row['step_s'] * 1e3:.1f} | {row['blocked_over_sharded']:.3f} |")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python benchmarks/gpu_tables.py RESULTS_DIR (a folder benchmarks/gpu_pass.sh wrote)", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    for block in (bench_table(folder), goals(folder), files_table(folder), unchanged_table(folder), checkpoint_table(folder),
                  train_table(folder)):
        if len(block) <= 2:  # a header alone: nothing of that kind in this pass
            continue
        print("\n".join(block), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
