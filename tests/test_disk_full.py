"""A full disk is named as such, in one line, with what was kept: on a real 1 MiB tmpfs (root only)."""

from __future__ import annotations

import errno
import os
import re
import subprocess

import pytest
import torch

from conftest import leftover_processes, run_ddpkit
from ddpkit import checkpoint
from ddpkit.core.errors import DiskFull, disk_full


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system of its own (tmpfs), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_file_that_does_not_fit_leaves_the_one_before_and_says_the_disk_is_full(small_disk):
    path = small_disk / "model.pt"
    checkpoint.atomic_save({"w": torch.zeros(10)}, path)
    with pytest.raises(DiskFull) as caught:
        checkpoint.atomic_save({"w": torch.randn(1_000_000)}, path)  # 4 MB
    message = str(caught.value)
    assert message.startswith(f"writing {path} failed: no space left on the device (")
    assert message.endswith("MiB free there now); nothing was written to it. Free some space, or write elsewhere")
    assert "unexpected pos" not in message
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(10))  # the one before, whole
    assert os.listdir(small_disk) == ["model.pt"]  # the temporary file is gone


def test_ddpkit_train_on_a_full_disk_ends_in_one_line_saying_so(small_disk):
    # The metrics fit; the first checkpoint (weights and Adam's state, about 2.7 MB) does not.
    result = run_ddpkit("train", "--output-dir", str(small_disk / "run"), "--epochs", "2", "--no-progress",
                        "--nproc-per-node", "2")
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ddpkit: error:" in line]
    assert len(errors) == 1, result.stderr
    assert re.fullmatch(re.escape(f"[rank0]: ddpkit: error: writing {small_disk}/run/checkpoints/step-00000022.pt "
                                  "failed: no space left on the device (") + r"[\d.]+" + re.escape(
        " MiB free there now); nothing was written to it; the last complete checkpoint, none yet, is kept. Free some "
        "space, or write elsewhere"), errors[0]), errors[0]
    assert "Traceback" not in result.stderr
    assert not [name for name in os.listdir(small_disk / "run" / "checkpoints")]
    assert not leftover_processes()


def test_the_full_disk_is_found_behind_the_error_that_reports_it():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")  # as torch.save
    except RuntimeError as error:
        full = disk_full(error, writing="/tmp/x/model.pt")
    assert str(full).startswith("writing /tmp/x/model.pt failed: the disk quota is used up (")
    assert str(full.and_("kept: step-1.pt")).endswith("; kept: step-1.pt. Free some space, or write elsewhere")
    assert disk_full(RuntimeError("unexpected pos 704 vs 598")) is None
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None


def test_any_write_in_a_job_that_fills_the_disk_is_one_line(small_disk, capfd):
    from ddpkit.core.process_group import distributed

    with pytest.raises(SystemExit) as ended:
        with distributed(device="cpu"):
            (small_disk / "metrics.jsonl").write_bytes(b"x" * 2**21)  # a user's own file, or ddpkit's metrics
    assert ended.value.code == 2
    err = capfd.readouterr().err
    line = test_any_write_in_a_job_that_fills_the_disk_is_one_line.__code__.co_firstlineno + 5
    assert (f"[rank0]: ddpkit: error: a write at {__file__}:{line} failed: no space left on the device. Free some "
            "space, or write elsewhere\n") in err
    assert "Traceback" not in err


def test_a_metrics_line_that_does_not_fit_names_the_file(small_disk):
    from ddpkit.app.train.records import append_record

    (small_disk / "filler").write_bytes(b"x" * (2**20 - 4096))  # the disk holds one block more
    with pytest.raises(DiskFull, match=f"writing {small_disk}/metrics.jsonl failed: no space left on the device"):
        append_record(str(small_disk / "metrics.jsonl"), {"epoch": 0, "notes": "x" * 10_000})
