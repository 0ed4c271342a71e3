"""`ddpkit train --model package.module:function --data package.module:function`: the user's own model and
data set, imported from the folder ddpkit runs in, with their keyword arguments, and one line for each
mistake."""

from __future__ import annotations

import json
import sys
import uuid

import pytest
import torch

from conftest import run_ddpkit, train_here
from ddpkit.app import cli
from ddpkit.zoo.user_code import parse_arguments

MODULE = """
import os, warnings
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model(width=16, classes=3):
    rank = os.environ.get("RANK", "0")
    print(f"building the model on rank {rank}")
    if rank == "1":
        warnings.warn("rank 1 has a warning")
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, classes))

def data(n=96, classes=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long() * (classes - 2)
    return TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]), TensorDataset(x[n * 3 // 4:], y[n * 3 // 4:])

def images(n=64, size=28, channels=1, say_classes=True):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, channels, size, size, generator=g), torch.randint(0, 4, (n,), generator=g)
    sets = TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])
    return (*sets, 4) if say_classes else sets

def a_list():
    return [nn.Linear(8, 3)]

def one_set():
    return TensorDataset(torch.randn(8, 8), torch.zeros(8).long())

not_a_function = 3
"""


@pytest.fixture
def own(tmp_path, monkeypatch):
    """A module of the user's own, in the folder the test runs in: its (unique) name."""
    name = f"mine_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # ddpkit adds the folder it runs in
    yield name
    sys.modules.pop(name, None)


def test_a_model_and_data_of_ones_own_train_under_ddp(tmp_path, own):
    out = tmp_path / "out"
    result = run_ddpkit("train", "--model", f"{own}:model", "--model-arg", "width=32", "--data", f"{own}:data",
                        "--data-arg", "n=256", "--epochs", "3", "--nproc-per-node", "2", "--no-progress",
                        "--optimizer", "sgd", "--lr", "0.1", "--output-dir", str(out), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["0.weight"].shape == (32, 8) and state["2.weight"].shape == (3, 32)  # width=32 reached it
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(row["world_size"], row["val_count"]) for row in rows] == [(2, 64)] * 3  # each sample evaluated once
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and rows[-1]["val_acc"] > 0.5  # it learns
    assert 'model-arg = ["width=32"]' in (out / "config.toml").read_text()
    # Each rank's whole output is in its file; the console has rank 0's as it came, and rank 1's lines, prefixed
    # (ddpkit.launch.rank_logs): its print and its warning, each once.
    assert result.stdout.count("building the model on rank 0") == 1
    assert result.stdout.count("[rank1]: building the model on rank 1") == 1
    assert result.stderr.count("UserWarning: rank 1 has a warning") == 1
    assert "[rank1]: " in result.stderr.split("UserWarning: rank 1 has a warning")[0].splitlines()[-1]
    rank0, rank1 = ((out / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1))
    assert "building the model on rank 0" in rank0 and "epoch 3/3:" in rank0
    assert "building the model on rank 1" in rank1 and "UserWarning: rank 1 has a warning" in rank1
    assert "[rank1]: ddpkit: 2 process(es) via torchrun" in rank1 and "epoch 3/3:" not in rank1


@pytest.mark.parametrize("model, image_args", [("net", []), ("convnet", ["--data-arg", "channels=3",
                                                                          "--data-arg", "size=32"])])
def test_a_built_in_model_is_made_for_the_images_of_ones_own_data(tmp_path, own, model, image_args):
    state, rows = train_here(tmp_path / model, "--model", model, "--data", f"{own}:images", *image_args,
                             "--epochs", "1", "--batch-size", "16")
    assert rows[0]["val_count"] == 16
    assert next(value for key, value in reversed(state.items()) if key.endswith("weight")).shape[0] == 4  # 4 classes


def test_keyword_values_are_read_as_json_where_they_can_be():
    assert parse_arguments(["a=3", "b=0.5", "c=true", "d=[1, 2]", "e=resnet", 'f="7"', "g="], "--model-arg") == {
        "a": 3, "b": 0.5, "c": True, "d": [1, 2], "e": "resnet", "f": "7", "g": ""}


@pytest.mark.parametrize("flags, message", [
    (["--model", "nowhere_at_all:model"], "--model nowhere_at_all:model: cannot import nowhere_at_all (No module named "
                                          "'nowhere_at_all'); run ddpkit from the folder that holds it"),
    (["--model", "{own}:modle"], "--model {own}:modle: {own} ({path}) has no 'modle'; it has a_list, data, images, "
                                 "model, one_set"),
    (["--model", "{own}:not_a_function"], "not_a_function is a int, not a function"),
    (["--model", "{own}:model", "--model-arg", "depth=3"],
     "--model {own}:model(width=16, classes=3): got an unexpected keyword argument 'depth'; check --model-arg"),
    (["--model", "{own}:model", "--model-arg", "3"], "--model-arg takes KEY=VALUE with KEY a Python name, got '3'"),
    (["--model-arg", "width=3"], "--model-arg is for a --model package.module:function of your own, not net"),
    (["--data-arg", "n=3"], "--data-arg is for a --data package.module:function of your own, not digits"),
    (["--data", "{own}:data", "--image-size", "32"], "--image-size resizes the built-in data sets"),
    (["--data", "dig:its:x"], "unknown data set 'dig:its:x'; use digits, synthetic[:N], mnist[:DIR], folder:PATH, "
                              "shards:PATH, or your own as package.module:function"),
    # Found by the process that trains (here the only one): the functions' results.
    (["--model", "{own}:a_list", "--data", "{own}:data"], "--model {own}:a_list returned a list, not a torch.nn.Module"),
    (["--data", "{own}:one_set"], "--data {own}:one_set returned a TensorDataset; return (train, validation) data "
                                  "sets, or (train, validation, number of classes)"),
    (["--data", "{own}:data"], "--model net takes square images (channels, height, width), but --data {own}:data "
                               "gives (8,); give your own --model package.module:function"),
    (["--data", "{own}:images", "--data-arg", "say_classes=false"], "--model net needs the number of classes, which "
                                                                    "the data does not say"),
])
def test_each_mistake_is_one_line_and_status_2(tmp_path, own, capsys, flags, message):
    flags = [flag.format(own=own) for flag in flags]
    status = cli.main(["train", *flags, "--output-dir", str(tmp_path / "out"), "--nproc-per-node", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message.format(own=own, path=tmp_path / f"{own}.py") in err, err


def test_a_wrong_result_in_two_processes_is_said_once(tmp_path, own):
    result = run_ddpkit("train", "--data", f"{own}:one_set", "--nproc-per-node", "2", "--output-dir",
                        str(tmp_path / "out"), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("returned a TensorDataset") == 1, result.stderr
    assert "Traceback" not in result.stderr
