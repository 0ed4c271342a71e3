"""``ddpkit status``: every rank's step, phase, last heartbeat, step time and memory, read from a run's folder."""

from __future__ import annotations

import doctest
import json
import signal
import socket
import subprocess
import time

import pytest

from conftest import run_ddpkit
from ddpkit.watch import status


def test_the_doctest():
    failures, tried = doctest.testmod(status)
    assert tried and not failures


def test_a_finished_run_shows_every_rank_where_it_ended_and_its_last_epoch(ddp_digits):
    folder, _, rows, _ = ddp_digits
    saved = json.loads((folder / "status.json").read_text())
    assert saved["state"] == "ended" and saved["verdict"] is None and saved["world_size"] == 2
    steps = sum(row["steps"] for row in rows)
    assert [beat["step"] for beat in saved["ranks"]] == [steps, steps]  # each rank's last beat, at the end
    assert all(beat["memory_mb"] > 50 and beat["step_s"] > 0 for beat in saved["ranks"])
    result = run_ddpkit("status", str(folder), "--watch")  # an ended run: shown once, not watched
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ended: status written ") and f"by rank 0 (pid {saved['ranks'][0]['pid']} on " in lines[0]
    assert lines[1].split() == ["rank", "host", "pid", "step", "phase", "last", "beat", "step", "time", "memory"]
    for rank, line in enumerate(lines[2:4]):
        assert line.split()[:4] == [str(rank), saved["ranks"][rank]["host"], str(saved["ranks"][rank]["pid"]), str(steps)]
    assert lines[4] == status.epoch_line(rows[-1]) and f"val_acc {rows[-1]['val_acc']:.2%}" in lines[4]
    assert len(lines) == 5


def _running(pid: int, host: str, updated: float) -> dict:
    beat = {"rank": 0, "host": host, "pid": pid, "step": 9, "phase": "forward", "idle_s": 0.0, "silent_s": 0.0,
            "step_s": None, "memory_mb": None}
    return {"state": "running", "updated": updated, "interval_s": 5.0, "verdict": None, "ranks": [beat]}


def test_a_running_status_that_is_no_longer_written_says_why():
    now = 10_000.0
    fresh = status.headline(_running(1, "here", now - 3), now, "here")
    assert fresh == "running: status written 3 s ago by rank 0 (pid 1 on here)"
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert status.headline(_running(ended.pid, "here", now - 40), now, "here").endswith(
        "which writes it every 5 s; its process is gone: the job died without ending (killed, or its machine lost)")
    assert status.gone(_running(ended.pid, socket.gethostname(), now - 40))
    stopped = subprocess.Popen(["sleep", "60"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert status.headline(_running(stopped.pid, "here", now - 40), now, "here").endswith(
            "its process is stopped (SIGSTOP, a debugger)")
    finally:
        stopped.kill()
        stopped.wait()
    assert status.headline(_running(1, "node7", now - 200), now, "here") == (
        "running: status written 3 min ago by rank 0 (pid 1 on node7), which writes it every 5 s; look at its "
        "processes on node7")


@pytest.mark.parametrize("make, message", [
    (lambda folder: folder, "no status.json or metrics.jsonl there: not a ddpkit train output folder"),
    (lambda folder: (folder / "status.json").write_text("{not json") and folder, "status.json is not a ddpkit status file"),
])
def test_a_folder_without_a_run_is_one_line_and_status_2(tmp_path, make, message):
    result = run_ddpkit("status", str(make(tmp_path)))
    assert result.returncode == 2
    assert result.stderr.count("ddpkit: error:") == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
