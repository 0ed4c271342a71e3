"""The command line: bad input is one line and exit status 2; `ddpkit run` starts real scripts."""

import socket
import textwrap

import pytest
import torch

from conftest import run_ddpkit
from ddpkit.cli import main

NO_GPU = torch.cuda.device_count() == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
        (["train", "--nproc-per-node", "many"], "whole number or auto, got 'many'"),
        (["train", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["train", "--epochs", "-1"], "--epochs must be 0 or more, got -1"),
        (["train", "--model", "resnet"], "unknown model 'resnet'"),
        (["train", "--data", "cifar"], "unknown data set 'cifar'"),
        (["train", "--data", "folder:/no/such/dir"], "folder '/no/such/dir' does not exist"),
        (["train", "--optimizer", "lion"], "invalid choice: 'lion'"),
        (["train", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0..1"),
        (["train", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["run", "--nproc-per-node", "2", "/no/such/script.py"], "script '/no/such/script.py' does not exist"),
        (["run"], "the following arguments are required: SCRIPT"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddpkit") and message in err
    assert "Traceback" not in err


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--strategy", "dp"], "--strategy dp needs at least one CUDA GPU"),
        (["train", "--backend", "nccl"], "--backend nccl needs one CUDA GPU per process"),
        (["train", "--device", "cuda"], "no CUDA GPU is visible"),
    ],
)
def test_gpu_only_options_are_refused_without_a_gpu(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_the_installed_command_exits_2_without_a_traceback():
    result = run_ddpkit("train", "--batch-size", "0", timeout=60)
    assert result.returncode == 2
    assert result.stderr == "ddpkit: error: --batch-size must be at least 1, got 0\n"


def test_an_error_found_inside_the_workers_still_exits_2(tmp_path):
    # Only after loading does a rank learn 40 samples cannot make one global batch of 2 x 32.
    result = run_ddpkit("train", "--data", "synthetic:40", "--model", "convnet", "--batch-size", "32",
                        "--output-dir", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "fewer than one global batch of 64" in result.stderr
    assert "Traceback" not in result.stderr


def test_list_models(capsys):
    assert main(["train", "--list-models"]) == 0
    names = capsys.readouterr().out.split()
    assert names[:2] == ["net", "convnet"] and "resnet50" in names


TORCHRUN_STYLE = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt")
    with open(out, "w") as f:
        f.write(f"{os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']} {t.item()} {' '.join(sys.argv[2:])}")
    dist.destroy_process_group()
    """
)

LOCAL_RANK_STYLE = textwrap.dedent(
    """
    import argparse, os
    import torch, torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(str(args.local_rank))
    dist.destroy_process_group()
    """
)


def test_run_starts_a_torchrun_style_script_unchanged(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_STYLE)
    result = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path), "--its-own", "flag", timeout=120)
    assert result.returncode == 0, result.stderr
    # 1 + 2 = 3 on both ranks: a real all-reduce went through; the script's own arguments arrived.
    assert (tmp_path / "rank0.txt").read_text() == "0 2 3.0 --its-own flag"
    assert (tmp_path / "rank1.txt").read_text() == "1 2 3.0 --its-own flag"


def test_run_passes_local_rank_like_the_legacy_launcher(tmp_path):
    script = tmp_path / "legacy.py"
    script.write_text(LOCAL_RANK_STYLE)
    result = run_ddpkit("run", "--nproc-per-node", "2", "--local-rank-arg", str(script), "--out", str(tmp_path),
                        timeout=120)
    assert result.returncode == 0, result.stderr
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["0", "1"]


def test_a_busy_default_port_does_not_break_a_single_node_run(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_STYLE)
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", 29500))
        except OSError:
            pass  # something else already holds it: just as good for this test
        busy.listen()
        result = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_failing_script_reports_the_rank_and_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = run_ddpkit("run", "--nproc-per-node", "2", str(script), timeout=120)
    assert result.returncode == 1
    assert "rank 1" in result.stderr and "exited with status 3" in result.stderr
