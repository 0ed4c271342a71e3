"""`ddpkit train --tracker NAME`: the epoch scalars and the settings in TensorBoard, MLflow and a CSV file, read
back with each tool's own reader; `ddpkit plot`; a missing extra is one line."""

from __future__ import annotations

import csv
import sys

import pytest

from conftest import train_here
from ddpkit.app import cli, trackers

SMALL = ["--data", "synthetic:96", "--model", "convnet", "--optimizer", "sgd", "--batch-size", "16", "--epochs", "2"]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One in-process run with three trackers: (folder, metrics rows)."""
    pytest.importorskip("tensorboard", reason="the test tools install tensorboard (pip install -e '.[test]')")
    pytest.importorskip("mlflow", reason="the test tools install mlflow-skinny (pip install -e '.[test]')")
    folder = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
            patch.setenv(name, "")  # so that the patch restores the variable's absence, whatever the run sets
            patch.delenv(name)
        _, rows = train_here(folder, *SMALL, "--tracker", "tensorboard", "--tracker", "mlflow", "--tracker", "csv")
    return folder, rows


def test_tensorboard_holds_each_epochs_scalars_and_the_settings(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, rows = tracked_run
    events = EventAccumulator(str(folder / "tensorboard")).Reload()
    tags = events.Tags()
    assert {"train_loss", "val_loss", "val_acc", "images_per_sec", "rank_step_time_s/rank0"} <= set(tags["scalars"])
    for key in ("train_loss", "val_acc"):
        assert [(event.step, pytest.approx(event.value)) for event in events.Scalars(key)] == \
            [(row["epoch"], row[key]) for row in rows]
    assert "settings/text_summary" in tags["tensors"]


def test_mlflow_holds_the_run_with_its_metrics_and_settings(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told

    folder, rows = tracked_run
    client = MlflowClient(tracking_uri="file://" + str(folder / "mlruns"))
    [run] = client.search_runs([client.get_experiment_by_name("ddpkit").experiment_id])
    assert run.info.run_name == folder.name and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(metric.step, pytest.approx(metric.value)) for metric in history] == [(row["epoch"], row["val_loss"])
                                                                                   for row in rows]
    assert run.data.params["batch_size"] == "16" and run.data.params["model"] == "convnet"


def test_csv_has_one_row_per_epoch(tracked_run):
    folder, rows = tracked_run
    with open(folder / "metrics.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [float(line["train_loss"]) for line in table] == [row["train_loss"] for row in rows]
    assert float(table[-1]["rank_step_time_s/rank0"]) == rows[-1]["rank_step_time_s"][0]


def test_plot_draws_the_run_to_a_png(tracked_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, _ = tracked_run
    assert cli.main(["plot", str(folder), "--output", str(tmp_path / "run.png")]) == 0
    assert f"wrote {tmp_path / 'run.png'}" in capsys.readouterr().out
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "run.png").stat().st_size > 20_000  # four panels drawn, not an empty figure


def test_plot_of_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0, "train_lo')  # cut by a crash in the first epoch's line
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl holds no whole record: no epoch has finished yet" in capsys.readouterr().err


def test_plot_leaves_out_a_last_line_cut_by_a_crash(tracked_run, tmp_path):
    pytest.importorskip("matplotlib")
    folder, _ = tracked_run
    (tmp_path / "metrics.jsonl").write_text((folder / "metrics.jsonl").read_text() + '{"epoch": 2, "train_')
    assert cli.main(["plot", str(tmp_path)]) == 0 and (tmp_path / "metrics.png").exists()


def test_a_tracker_whose_package_is_missing_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed, whether it is or not
    assert cli.main(["train", "--tracker", "wandb", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == ("ddpkit: error: --tracker wandb needs the wandb package, which is not installed: "
                   "pip install 'ddpkit[wandb]'\n")
    assert cli.main(["train", "--tracker", "neptune"]) == 2
    assert "argument --tracker: invalid choice: 'neptune'" in capsys.readouterr().err


def test_a_tracker_that_fails_is_said_and_training_goes_on(tmp_path, monkeypatch, caplog):
    class Broken:
        def __init__(self, output_dir, settings):
            pass

        def log(self, record, step):
            raise ConnectionError("tracking server unreachable")

        def close(self):
            pass

    from ddpkit.core.logs import logger

    monkeypatch.setitem(trackers.KINDS, "csv", Broken)
    logger.addHandler(caplog.handler)  # ddpkit's logger does not propagate to the root, where caplog listens
    try:
        tracked = trackers.Trackers(["csv"], str(tmp_path), {})
        tracked.log({"epoch": 0, "train_loss": 1.0})
        tracked.log({"epoch": 1, "train_loss": 0.5})  # dropped after the first failure: said once
    finally:
        logger.removeHandler(caplog.handler)
    assert [record.getMessage() for record in caplog.records if "--tracker" in record.getMessage()] == [
        "--tracker csv failed (ConnectionError: tracking server unreachable); training goes on without it "
        "(metrics.jsonl has every epoch)"]
    assert tracked.open == {}


def test_scalars_flatten_per_rank_lists_and_skip_the_rest():
    record = {"epoch": 2, "val_acc": 0.5, "nccl": {}, "slow_phase": "data", "ok": True, "rank_step_time_s": [0.1, 0.3]}
    assert trackers.scalars(record) == {"epoch": 2.0, "val_acc": 0.5, "rank_step_time_s/rank0": 0.1,
                                        "rank_step_time_s/rank1": 0.3}
    assert trackers.scalars({}) == {}
