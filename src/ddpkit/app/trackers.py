"""Experiment trackers for ``ddpkit train --tracker NAME``: the epoch scalars of ``metrics.jsonl`` and the run's
settings, written by rank 0 to TensorBoard, MLflow, Weights & Biases or a CSV file.

    >>> from ddpkit.app.trackers import scalars
    >>> scalars({"epoch": 1, "train_loss": 0.5, "rank_step_time_s": [0.1, 0.2], "slow_phase": "data"})
    {'epoch': 1.0, 'train_loss': 0.5, 'rank_step_time_s/rank0': 0.1, 'rank_step_time_s/rank1': 0.2}

- ``tensorboard``: event files in ``OUTPUT_DIR/tensorboard/`` (``tensorboard --logdir OUTPUT_DIR/tensorboard``);
- ``mlflow``: a run in the tracking store ``MLFLOW_TRACKING_URI`` names (a server, ``sqlite:///mlflow.db``), else
  in MLflow's file store ``OUTPUT_DIR/mlruns``, in experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``ddpkit``);
- ``wandb``: a run in project ``WANDB_PROJECT`` (default ``ddpkit``), offline (``OUTPUT_DIR/wandb``) unless
  a key is set (``WANDB_API_KEY`` or ``wandb login``) or ``WANDB_MODE`` says otherwise;
- ``csv``: ``OUTPUT_DIR/metrics.csv``, one row per epoch, rewritten from ``metrics.jsonl`` (so a resumed run's
  file holds each epoch once).

Each of the first three is an optional extra (``pip install 'ddpkit[tensorboard]'``); a missing one is one
line before any process starts. A tracker that fails during the run is said once and left out; training
goes on.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ddpkit.watch import status
from ddpkit.core.errors import UsageError, first_line
from ddpkit.core.logs import logger

TRACKERS = ("tensorboard", "mlflow", "wandb", "csv")
NEEDS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # tracker -> module it imports
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
CSV_FILE = "metrics.csv"


def check(names: Sequence[str]) -> None:
    """Each tracker in ``names`` is known and its package importable (found, not imported: that is slow)."""
    for name in names:
        if name not in TRACKERS:
            raise UsageError(f"`tracker` must be one of {', '.join(TRACKERS)}, got {name!r}")
        module = NEEDS.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise UsageError(f"--tracker {name} needs the {module} package, which is not installed: "
                             f"pip install 'ddpkit[{name}]'")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of an epoch's record; a list of numbers (one per rank) becomes ``KEY/rankN`` each."""
    found: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            found[key] = float(value)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in value):
            found.update({f"{key}/rank{rank}": float(v) for rank, v in enumerate(value)})
    return found


def _settings(settings: Mapping[str, Any]) -> dict[str, str]:
    """Settings as the flat strings that trackers' parameter tables take."""
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in settings.items()}


class TensorBoard:
    def __init__(self, output_dir: str, settings: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(output_dir, TENSORBOARD_DIR))
        table = "\n".join(f"| {key} | {value} |" for key, value in _settings(settings).items())
        self.writer.add_text("settings", "| setting | value |\n|---|---|\n" + table, 0)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflow:
    def __init__(self, output_dir: str, settings: Mapping[str, Any]):
        import logging

        import mlflow

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its "creating a new experiment" among the epochs
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # A folder beside the run's other files, which needs no server and no database. MLflow 3 keeps its
            # file store in maintenance and wants an opt-in for it; the user's own setting, if any, decides.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file://" + os.path.abspath(os.path.join(output_dir, MLFLOW_DIR)))
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddpkit")
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=os.path.basename(os.path.abspath(output_dir)))
        mlflow.log_params(_settings(settings))

    def log(self, record: Mapping[str, Any], step: int) -> None:
        self.mlflow.log_metrics({key.replace("/", "_"): value for key, value in scalars(record).items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class WandB:
    def __init__(self, output_dir: str, settings: Mapping[str, Any]):
        import wandb

        offline = not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") or wandb.api.api_key)
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "ddpkit", dir=output_dir,
                              config=dict(settings), name=os.path.basename(os.path.abspath(output_dir)),
                              mode="offline" if offline else None)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class CSV:
    def __init__(self, output_dir: str, settings: Mapping[str, Any]):  # noqa: ARG002 (config.toml holds them)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, CSV_FILE)

    def log(self, record: Mapping[str, Any], step: int) -> None:  # noqa: ARG002
        rows = [scalars(saved) for saved in status.read_metrics(self.output_dir)]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        pass  # every log() leaves a whole file


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB, "csv": CSV}


class Trackers:
    """The run's trackers (rank 0's; other ranks hold none). One that fails is said once and dropped."""

    def __init__(self, names: Sequence[str], output_dir: str, settings: Mapping[str, Any]):
        self.open: dict[str, Any] = {}
        for name in dict.fromkeys(names):  # each once, in the order given
            self._guard(name, lambda name=name: self.open.__setitem__(name, KINDS[name](output_dir, settings)))

    def _guard(self, name: str, action) -> None:
        try:
            action()
        except Exception as error:  # noqa: BLE001 (a tracker's trouble must not end the training)
            logger.warning(f"--tracker {name} failed ({type(error).__name__}: {first_line(error)}); "
                           "training goes on without it (metrics.jsonl has every epoch)")
            self.open.pop(name, None)

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record.get("epoch", 0))
        for name, tracker in list(self.open.items()):
            self._guard(name, lambda tracker=tracker: tracker.log(record, step))

    def close(self) -> None:
        for name, tracker in list(self.open.items()):
            self._guard(name, tracker.close)
        self.open.clear()
