"""`ddpkit bench`: the projection's arithmetic, result rows, and tiny real runs on 2 CPU processes."""

import csv
import json

import pytest
import torch

from conftest import run_ddpkit
from ddpkit.app import bench, projection


# ------------------------------------------------------------------------------------------ projection


def test_ring_allreduce_moves_two_n_minus_one_over_n_of_the_gradients():
    assert projection.ring_allreduce_bytes(1, 100.0) == 0.0
    assert projection.ring_allreduce_bytes(2, 100.0) == 100.0
    assert projection.ring_allreduce_bytes(4, 100.0) == 150.0
    assert projection.ring_allreduce_bytes(8, 100.0) == 175.0
    with pytest.raises(ValueError, match="at least 1, got 0"):
        projection.ring_allreduce_bytes(0, 100.0)


def test_allreduce_time_is_hops_times_latency_plus_bytes_over_bandwidth():
    # 4 ranks, 1 GB of gradients, 10 GB/s links, 1 ms per hop: 6 hops + 1.5 GB / 10 GB/s.
    assert projection.allreduce_seconds(4, 1e9, 1e10, latency_s=1e-3) == pytest.approx(0.006 + 0.15)
    assert projection.allreduce_seconds(1, 1e9, 1e10) == 0.0


def test_overlap_hides_the_all_reduce_behind_the_backward_pass():
    # 300 ms of compute hides 0.6 x 300 = 180 ms: a 250 ms all-reduce adds 70 ms.
    assert projection.projected_step_seconds(0.3, 0.25, overlap=0.6) == pytest.approx(0.37)
    assert projection.projected_efficiency(0.3, 0.25, overlap=0.6) == pytest.approx(0.3 / 0.37)
    assert projection.projected_efficiency(0.3, 0.1, overlap=0.6) == 1.0  # fully hidden
    assert projection.projected_efficiency(0.3, 0.3, overlap=0.0) == pytest.approx(0.5)  # none hidden
    with pytest.raises(ValueError, match="overlap"):
        projection.projected_step_seconds(0.3, 0.1, overlap=1.5)


def test_project_rows_for_each_link_and_world_size():
    # ResNet-50-like: 102 MB of fp32 gradients, 100 ms per step, batch 64 per device, 100 Gb/s links.
    rows = projection.project(world_sizes=[2, 8], compute_s=0.1, grad_bytes=102e6, global_batch_per_device=64,
                              links={"100 Gb/s": 100e9 / 8}, latency_s=0.0)
    assert [r.world_size for r in rows] == [2, 8]
    two, eight = rows
    assert two.bandwidth_gbps == pytest.approx(100.0)
    assert two.allreduce_s == pytest.approx(102e6 / 12.5e9)  # 8.16 ms, hidden by 60 ms of backward
    assert two.efficiency == 1.0 and two.images_per_sec == pytest.approx(2 * 64 / 0.1)
    assert eight.allreduce_s == pytest.approx(1.75 * 102e6 / 12.5e9)
    assert eight.images_per_sec == pytest.approx(8 * 64 / eight.step_s)


# -------------------------------------------------------------------------------------------- results


def test_efficiency_is_per_device_throughput_over_the_one_device_run():
    raw = {"images_per_step": 32, "steps": 10, "peak_memory_bytes": [1], "grad_bytes": 4}
    rows = [
        bench.summarize("single", 1, {**raw, "times": {"ddpkit": [1.0, 1.0, 1.2], "hand": [1.0, 1.0, 1.0]}}),
        bench.summarize("ddp", 2, {**raw, "images_per_step": 64,
                                   "times": {"ddpkit": [1.6] * 3, "hand": [1.6] * 3, "no_sync": [1.2] * 3}}),
    ]
    bench.add_efficiency(rows)
    single, ddp = rows
    assert single["images_per_sec"] == 320.0 and single["spread"] == [320 / 1.2, 320.0]
    assert ddp["images_per_sec"] == 400.0 and ddp["efficiency"] == pytest.approx(400 / (2 * 320))
    assert ddp["comm_share"] == pytest.approx(0.25)  # 1.6 s with the all-reduce, 1.2 s without
    assert single["ddpkit_over_hand"] == 1.0 and single["efficiency"] == 1.0


def test_torchvision_classifiers_are_benched_at_imagenet_size_and_built_in_models_at_their_own():
    # At ddpkit train's small synthetic default (32x32) a ResNet-50 step is launch-bound: an H200 showed
    # 15,639 images/s against 4,686 at 224x224, a number nobody could compare with a published one.
    assert bench.BenchOptions(model="resnet50").resolve(0).image_size == 224
    assert bench.BenchOptions(model="resnet50", image_size=64).resolve(0).image_size == 64
    assert bench.BenchOptions(model="net").resolve(0).image_size == 28


# -------------------------------------------------------- CLI (bad options: in test_cli.py with the others)


def test_a_tiny_cpu_bench_from_jpegs_writes_json_csv_and_png_from_its_own_rows_and_sweeps_ddps_knobs(tmp_path):
    from ddpkit.data.sample_images import write_folder

    write_folder(str(tmp_path / "images"), images=24, classes=3, size=(40, 30))
    out = tmp_path / "bench"
    result = run_ddpkit("bench", "--model", "convnet", "--nproc", "1,2", "--batch-size", "4", "--steps", "3",
                        "--warmup", "1", "--repeats", "2", "--json", f"{out}.json", "--csv", f"{out}.csv",
                        "--data", f"folder:{tmp_path / 'images'}", "--decode", "cpu",
                        "--plot", f"{out}.png", "--nccl", "NCCL_ALGO=Ring", "--sweep", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "single img/s (eff)" in result.stdout and "PROJECTION (not measured)" in result.stdout
    assert f"folder:{tmp_path / 'images'} data (cpu decoding)" in result.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["environment"]["torch"] == str(torch.__version__)
    assert report["environment"]["variables"]["NCCL_ALGO"] == "Ring"  # --nccl, recorded
    rows = {(r["strategy"], r["devices"]): r for r in report["results"]}
    assert set(rows) == {("single", 1), ("ddp", 1), ("ddp", 2)}  # dp is skipped without GPUs
    base = rows["single", 1]["images_per_sec"]
    for (_, devices), row in rows.items():
        assert row["images_per_sec"] > 0 and row["spread"][0] <= row["images_per_sec"] <= row["spread"][1]
        assert row["efficiency"] == pytest.approx(row["images_per_sec"] / (devices * base))
        assert len(row["peak_memory_bytes"]) == devices and min(row["peak_memory_bytes"]) > 0
    assert 0 <= rows["ddp", 2]["comm_share"] < 1 and rows["ddp", 2]["allreduce_bytes_per_s"] > 0
    # From files, timed beside synthetic data in the same processes: both rates, and the files' fraction.
    for (strategy, devices), row in rows.items():
        assert row["synthetic_images_per_sec"] > 0
        assert row["fraction_of_synthetic"] == pytest.approx(row["images_per_sec"] / row["synthetic_images_per_sec"])
        label = "single" if strategy == "single" else "DDP"
        assert (f"{label} x{devices}: {row['images_per_sec']:.0f} of {row['synthetic_images_per_sec']:.0f} img/s"
                in result.stdout)
    assert report["projection"]["check"][0]["devices"] == 2
    # The sweep (on the largest process count): every bucket size and every hook, each timed or said why not.
    sweep = report["sweep"]
    assert [(r["bucket_cap_mb"], r["hook"]) for r in sweep] == [
        (1.0, "none"), (5.0, "none"), (25.0, "none"), (100.0, "none"), (None, "fp16"), (None, "bf16"), (None, "powersgd")]
    assert all(r.get("images_per_sec", 0) > 0 or r.get("error") for r in sweep)
    assert "DDP tuning sweep on 2 device(s)" in result.stdout and "best:" in result.stdout
    with open(tmp_path / "bench.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["strategy"], r["devices"]) for r in table] == [("single", "1"), ("ddp", "1"), ("ddp", "2")]
    assert float(table[2]["efficiency"]) == pytest.approx(rows["ddp", 2]["efficiency"])
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_through_a_data_loader(tmp_path):
    result = run_ddpkit("bench", "--model", "net", "--nproc", "1", "--strategies", "single", "--data", "loader",
                        "--batch-size", "8", "--steps", "3", "--warmup", "1", "--repeats", "1",
                        "--json", str(tmp_path / "b.json"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loader data" in result.stdout
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["results"][0]["images_per_sec"] > 0 and "sweep" not in report  # no --sweep, no sweep


def test_bench_data_mistakes_are_one_line(tmp_path, capsys):
    from ddpkit.app.cli import main

    for argv, message in ((["--data", "folder:/no/such/images"], "folder '/no/such/images' does not exist"),
                          (["--data", "folders:/x"], "--data must be synthetic, loader, folder:PATH or shards:PATH"),
                          (["--data", f"shards:{tmp_path}"], "is not a finished pack")):
        assert main(["bench", "--device", "cpu", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
