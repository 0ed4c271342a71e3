"""Shared helpers: run the real ``ddpkit`` command, and prove no process of the run outlives the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

# Every process a test starts inherits this variable, so leftovers (workers of a torchrun agent
# included) can be found in /proc at the end whatever their parent became.
MARKER_KEY = "DDPKIT_TEST_SESSION"
MARKER = uuid.uuid4().hex
REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "SLURM_", "TORCHELASTIC"))}
    env.update({MARKER_KEY: MARKER, "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def run_ddpkit(*args: str, timeout: float = 240, cwd: Path | None = None, **extra_env: str) -> subprocess.CompletedProcess:
    """``python -m ddpkit ARGS`` as a user would run it; output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=child_env(**extra_env),
    )


def train(tmp: Path, *args: str, timeout: float = 240) -> tuple[dict, list[dict]]:
    """Run ``ddpkit train`` into ``tmp``; return (model state_dict, metrics rows). Fails the test on error."""
    result = run_ddpkit("train", "--output-dir", str(tmp), "--no-progress", *args, timeout=timeout)
    assert result.returncode == 0, f"ddpkit train {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    state = torch.load(tmp / "model.pt", weights_only=True)
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return state, rows


def max_relative_difference(a: dict, b: dict) -> float:
    """max over tensors of max|a - b| / max|b| (float tensors only; integer buffers must be equal)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        if not a[key].is_floating_point():
            assert torch.equal(a[key], b[key]), key
            continue
        scale = b[key].abs().max().item() or 1.0
        worst = max(worst, (a[key] - b[key]).abs().max().item() / scale)
    return worst


def leftover_processes() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"{MARKER_KEY}={MARKER}".encode() in environ:
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    yield
    deadline = time.monotonic() + 10  # a process that is exiting gets a moment to finish
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftover_processes()
    assert not left, "processes started by the tests are still running:\n" + "\n".join(left)
