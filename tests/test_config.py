"""`ddpkit train --config FILE`: TOML settings under the flags' names, the command line overriding them,
and OUTPUT_DIR/config.toml, which repeats a run."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import train_here
from ddpkit.app import cli, parser
from ddpkit.app.config import CONFIG_FILE, file_keys, read_config_file, toml_value
from ddpkit.core.errors import UsageError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SMALL = ["--data", "synthetic:96", "--model", "convnet", "--optimizer", "sgd", "--batch-size", "16", "--epochs", "2"]


def parse(*argv: str):
    return cli._parse(cli.build_parser(), list(argv))


def test_the_file_sets_flags_and_the_command_line_overrides_them(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('epochs = 5\nbatch-size = 64\nmodel = "convnet"\nsync-bn = true\nnccl = ["NCCL_ALGO=Ring"]\n'
                      'no-progress = true\nlr = 1e-4\nlr_gamma = 0.5\n')
    ns = parse("train", "--config", str(config), "--epochs", "3", "--nccl", "no-ib")
    assert (ns.epochs, ns.batch_size, ns.model, ns.sync_bn, ns.progress) == (3, 64, "convnet", True, False)
    assert (ns.lr, ns.lr_gamma) == (1e-4, 0.5)
    assert ns.nccl == ["NCCL_ALGO=Ring", "no-ib"]  # a repeatable flag: the file's values, then the command line's
    assert parse("train", "--epochs", "3", "--config", str(config)).epochs == 3  # wherever --config stands


@pytest.mark.parametrize("text, message", [
    ("epoch = 3\n", "unknown key 'epoch' (did you mean epochs?); the keys are the long flags of `ddpkit train "
                    "--help` without their dashes, e.g. batch-size = 64"),
    ("config = 'other.toml'\n", "unknown key 'config'"),
    ("epochs = 'many'\n", "argument --epochs: invalid int value: 'many'"),
    ("epochs = true\n", "epochs must be a number or a string, got True"),
    ("sync-bn = 1\n", "sync-bn must be true or false, got 1"),
    ("optimizer = 'lamb'\n", "argument --optimizer: invalid choice: 'lamb'"),
    ("[training]\nepochs = 3\n", "unknown key 'training'"),
    ("epochs = \n", "not valid TOML (Invalid value (at line 1, column 10))"),
])
def test_a_bad_file_is_one_line_naming_it_and_status_2(tmp_path, capsys, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text)
    assert cli.main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"ddpkit: error: --config {config}: ") and message in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was created


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert f"--config {tmp_path / 'nope.toml'}: cannot read it (No such file or directory)" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["plain", 'quote " and \\ back', "tab\tnew\nline \x7f \x01", "ünï ☃", 0, -3,
                                   1e-4, 0.1, 1e308, math.inf, True, False, ["a", "b=c"], []])
def test_values_are_written_as_toml_that_reads_back_the_same(value):
    assert tomllib.loads(f"key = {toml_value(value)}")["key"] == value


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("first")
    return folder, train_here(folder, *SMALL, "--seed", "3")


def test_every_run_writes_its_resolved_settings(first_run):
    folder, _ = first_run
    text = (folder / CONFIG_FILE).read_text()
    assert text.startswith("# The settings of this run of `ddpkit train`, as it started")
    settings = tomllib.loads(text)
    assert settings["seed"] == 3 and settings["epochs"] == 2 and settings["data"] == "synthetic:96"
    assert settings["nproc-per-node"] == 1 and settings["lr"] == 0.01  # `auto` and the default rate, resolved
    assert settings["no-progress"] is True and settings["sync-bn"] is False
    assert settings["output-dir"] == str(folder)
    assert "# Left to their defaults: " in text and "workers" not in settings  # None: said, not written
    assert set(settings) | {"workers"} <= set(file_keys(parser.subcommand(parser.build_parser(), "train")))


def test_the_written_settings_repeat_the_run_bit_identically(first_run, tmp_path):
    folder, (state, rows) = first_run
    again, again_rows = train_here(tmp_path, "--config", str(folder / CONFIG_FILE))
    assert state.keys() == again.keys() and all(torch.equal(state[key], again[key]) for key in state)
    assert [row["train_loss"] for row in rows] == [row["train_loss"] for row in again_rows]
    assert tomllib.loads((tmp_path / CONFIG_FILE).read_text())["output-dir"] == str(tmp_path)  # the override


def test_a_launched_run_writes_it_once_with_its_process_count(ddp_digits):
    folder, _, _, _ = ddp_digits
    settings = tomllib.loads((folder / CONFIG_FILE).read_text())
    assert settings["nproc-per-node"] == 2 and settings["check-replicas"] == 1
    assert settings["nccl"] == ["NCCL_ALGO=Ring", "no-ib", "NCCL_ALGO=Tree"]


def test_library_errors_about_a_file_value_still_name_the_flag(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("epochs = 0\n")
    assert cli.main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    assert "--epochs must be" in capsys.readouterr().err


def test_read_config_file_raises_usage_error(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("batch_size = 'x'\n")
    with pytest.raises(UsageError, match="invalid int value"):
        read_config_file(str(config), parser.subcommand(parser.build_parser(), "train"))
