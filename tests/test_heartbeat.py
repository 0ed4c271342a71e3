"""Heartbeats and the stall watch: which rank holds the job up, named with its stack, and the job ended."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import AGENT_REPORTS_ENDED_RANKS, children_of, leftover_processes, run_ddpkit, warm_python, warm_ranks_env
import warm_ranks
from ddpkit import checkpoint
from ddpkit.watch import heartbeat
from ddpkit.core.errors import UsageError
from ddpkit.watch.heartbeat import Heartbeat, Seen, find_stall, stall_after


def seen(rank: int, step: int = 10, phase: str = "backward", idle_s: float = 100.0, silent_s: float = 1.0,
         step_s: float | None = 0.01) -> Seen:
    return Seen(rank=rank, host="h", pid=100 + rank, step=step, phase=phase, idle_s=idle_s, silent_s=silent_s,
                step_s=step_s)


def test_no_stall_while_any_rank_moves_or_before_every_rank_began():
    assert find_stall([seen(0), seen(1, idle_s=5.0)], after_s=60) is None
    assert find_stall([seen(0), seen(1, phase="starting")], after_s=60) is None  # setup and downloads are not timed
    assert find_stall([seen(0), None], after_s=60) is None  # rank 1 has not published yet
    # A rank stopped before its first beat in training: the others began, it is silent.
    stopped_early = seen(1, phase="starting", silent_s=60.0)
    assert find_stall([seen(0), stopped_early], after_s=60) == stopped_early


def test_the_rank_behind_is_named():
    # Lower step first, then the earlier phase of one step, then the one idle longest.
    assert find_stall([seen(0, step=11), seen(1, step=10), seen(2, step=11)], after_s=60).rank == 1
    assert find_stall([seen(0, phase="backward"), seen(1, phase="forward")], after_s=60).rank == 1
    assert find_stall([seen(0, idle_s=61.0), seen(1, idle_s=90.0)], after_s=60).rank == 1


def test_a_rank_whose_beat_stopped_is_named_before_any_other():
    # Rank 2's last beat, published before it was stopped, shows it ahead; its silence names it.
    lost = seen(2, step=12, silent_s=heartbeat.LOST_BEATS * heartbeat.beat_interval_s())
    assert lost.lost
    assert find_stall([seen(0), seen(1, step=9), lost], after_s=60).rank == 2


def test_the_beat_is_read_from_the_environment_when_asked_not_at_import(monkeypatch):
    # A worker whose launcher sets the variable after ddpkit was imported (a Ray worker, a notebook) gets it.
    monkeypatch.setenv(heartbeat.INTERVAL_ENV, "0.5")
    assert heartbeat.beat_interval_s() == 0.5 and heartbeat.min_timeout_s() == 2 * heartbeat.LOST_BEATS * 0.5
    assert seen(1, silent_s=1.5).lost and not seen(1, silent_s=1.4).lost
    for outside in ("0.1", "61", "soon"):
        monkeypatch.setenv(heartbeat.INTERVAL_ENV, outside)
        assert heartbeat.beat_interval_s() == 5.0


def test_a_rank_working_alone_is_not_a_stall_while_it_lives():
    for phase in heartbeat.WORKING_ALONE:
        assert find_stall([seen(0, phase=phase, step=9), seen(1)], after_s=60) is None
        stopped = seen(0, phase=phase, step=9, silent_s=60.0)
        assert find_stall([stopped, seen(1)], after_s=60) == stopped


def test_the_stall_threshold_adapts_to_the_step_time_and_never_passes_the_timeout():
    fast = [seen(0, step_s=0.01), seen(1, step_s=0.02)]
    assert stall_after(60, 1800, fast) == 60
    assert stall_after(60, 1800, [seen(0, step_s=9.0), seen(1, step_s=None)]) == 20 * 9.0
    assert stall_after(60, 100, [seen(0, step_s=9.0)]) == 100  # the collective timeout comes first
    assert stall_after(60, 40, fast) == 0.8 * 40
    # Never below the time a stopped beat takes to show.
    assert stall_after(1, 1800, fast) == heartbeat.LOST_BEATS * heartbeat.beat_interval_s()


def test_the_setting_comes_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv(heartbeat.STALL_ENV, raising=False)
    assert heartbeat.stall_setting(None) == heartbeat.DEFAULT_STALL_S
    assert heartbeat.stall_setting(0) == 0
    monkeypatch.setenv(heartbeat.STALL_ENV, "12.5")
    assert heartbeat.stall_setting(None) == 12.5
    monkeypatch.setenv(heartbeat.STALL_ENV, "soon")
    with pytest.raises(UsageError, match="DDPKIT_STALL_TIMEOUT_S must be a number of seconds"):
        heartbeat.stall_setting(None)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="`stall_timeout_s` must be a finite number of seconds"):
            heartbeat.stall_setting(bad)


@pytest.mark.parametrize("argv, message", [
    (["train", "--stall-timeout", "nan"], "--stall-timeout must be a finite number of seconds, 0 (off) or more, got nan"),
    (["train", "--stall-timeout", "-1"], "--stall-timeout must be a finite number of seconds, 0 (off) or more, got -1.0"),
    (["run", "--stall-timeout", "inf", "x.py"], "--stall-timeout must be a finite number of seconds, 0 (off) or more, "
                                                "got inf"),
])
def test_bad_stall_timeouts_are_one_line_errors(argv, message, capsys):
    from ddpkit.app.cli import main

    assert main(argv) == 2
    assert capsys.readouterr().err == f"ddpkit: error: {message}\n"


def test_two_heartbeats_through_a_real_store(monkeypatch):
    """Ranks 0 and 1 of one job in this process, publishing through a real TCPStore: rank 0's watch sees
    rank 1 alive but not advancing, then, its beat stopped, lost."""
    monkeypatch.setattr(heartbeat, "beat_interval_s", lambda: 0.05)  # LOST_BEATS intervals: 0.15 s
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    beats = [Heartbeat(store, rank=rank, world_size=2, stall_s=0.1, timeout_s=1800) for rank in (0, 1)]
    for beat in beats:
        beat._publish()
    assert beats[0]._check() is None  # both still "starting"
    beats[0].pace.mark("data", 1)
    beats[1].pace.mark("forward", 1)
    beats[0].pace.mark("backward")  # rank 0 went on into the all-reduce; rank 1 stays in its forward
    for beat in beats:
        beat._publish()
    assert beats[0]._check() is None  # they just moved
    time.sleep(0.1)
    for _ in range(2):
        for beat in beats:
            beat._publish()
        time.sleep(0.06)
    culprit = beats[0]._check()
    assert (culprit.rank, culprit.pid, culprit.phase, culprit.step, culprit.lost) == (1, os.getpid(), "forward", 1, False)
    assert beats[1]._check() is None  # the culprit does not report itself
    time.sleep(0.2)
    beats[0]._publish()  # rank 1 publishes no more
    culprit = beats[0]._check()
    assert culprit.rank == 1 and culprit.lost
    # The verdict, once called, reaches every rank through the store.
    store.set(f"{heartbeat.KEY}/verdict", "rank 1 stalled")
    assert beats[1].stalled() == "rank 1 stalled"


SLEEPER = """
import time, torch, torch.nn as nn, torch.nn.functional as F, ddpkit
from torch.utils.data import TensorDataset

def deep_in_user_code():
    time.sleep(600)

data = TensorDataset(torch.randn(2048, 8), torch.randint(0, 4, (2048,)))
with ddpkit.Job("ddp") as job:
    model, optimizer = job.setup(nn.Linear(8, 4), torch.optim.SGD, lr=0.1)
    loader = job.train_loader(data, batch_size=8)
    for epoch in range(1000):
        for x, y in loader:
            if job.rank == 1 and job.global_step == 30:
                deep_in_user_code()
            job.backward(F.cross_entropy(model(x), y))
            job.step(optimizer)
"""


def test_a_rank_asleep_in_a_library_script_is_named_with_its_stack(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    started = time.monotonic()
    # A beat a second and a stall after 5 s: the watch as at its defaults, a dozen times sooner.
    result = run_ddpkit("run", "--stall-timeout", "5", "--nproc-per-node", "2", str(script), timeout=120,
                        DDPKIT_HEARTBEAT_S="1")
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert err.count("stalled:") == 1, err  # one error for the job
    assert "[rank0]: ddpkit: error: rank 1 (host " in err
    assert "in phase forward at step 30, while its heartbeat goes on: it is alive but not advancing" in err
    assert "The other ranks wait for it: 0 at step 30 (backward)" in err
    assert "deep_in_user_code (sleeper.py:6)" in err  # its stack, read by py-spy
    assert "Traceback" not in err
    if AGENT_REPORTS_ENDED_RANKS:  # torch 2.4's agent reports the failed rank alone
        # Rank 0 waits in the step's all-reduce for rank 1, which its watch kills. The agent then ends rank 0, or, on
        # a busy machine, rank 0's all-reduce fails first (its peer gone) and it ends itself after the verdict above
        # (``heartbeat.watch``: EXIT_STALLED): one of the two, said once (a README (b) run at c60f956 lacked the first).
        ended = re.findall(r"rank 0 \(pid \d+\) (was ended by the launcher \(SIGTERM\) when another rank failed|"
                           r"exited with status 1; its output is above)", err)
        assert len(ended) == 1, err
    assert took < 90, f"took {took:.0f} s"
    assert not leftover_processes()


class StoppedRank:
    """``ddpkit train`` on 2 processes whose ``rank`` is stopped (SIGSTOP) once two epochs are done;
    once the job ended, ``result()`` is (its exit status, its stderr, seconds from the stop to the end, the
    stopped pid)."""

    def __init__(self, out: Path, rank: int, *flags: str):
        self.out, self.rank = out, rank
        self.err = out.with_name("stderr.txt")  # a file, not a pipe: nobody reads it while another job is awaited
        # The launcher, and the ranks it starts (torchrun's or spawn's), forked from a warm interpreter
        # (tests/warm_ranks.py): the stopped rank is the process that publishes its beat.
        self.env = warm_ranks_env()
        with self.err.open("w") as err:
            self.proc = subprocess.Popen(warm_python([sys.executable, "-m", "ddpkit", "train", "--nproc-per-node", "2",
                                                      "--epochs", "400", "--output-dir", str(out), "--no-progress",
                                                      *flags], self.env),
                                         env=self.env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        self.pid, self.stopped, self.ended = None, None, None
        self.status: subprocess.Popen | None = None  # `ddpkit status` while the rank is stopped

    def stop_after_two_epochs(self) -> None:
        metrics = self.out / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.5)
        # The pid each rank publishes with its heartbeat (whichever launcher started it).
        self.pid = json.loads((self.out / "status.json").read_text())["ranks"][self.rank]["pid"]
        assert self.pid in self.ranks(), f"rank {self.rank} (pid {self.pid}) is not the launcher's"
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = time.monotonic()

    def clients(self) -> list[int]:
        """The launcher's children: its ranks, or the clients that have them run warm (tests/warm_ranks.py)."""
        return children_of(warm_ranks.worker_of(self.proc.pid))

    def ranks(self) -> set[int]:
        """The processes that run the launcher's ranks."""
        return {warm_ranks.worker_of(pid) for pid in self.clients()}

    def look_while_stopped(self) -> None:
        """Once the job's status shows the stopped rank silent for 10 s, run `ddpkit status` on it (once)."""
        if self.status is not None or self.ended is not None:
            return
        with contextlib.suppress(OSError, ValueError):  # not written yet
            beats = json.loads((self.out / "status.json").read_text())["ranks"]
            if beats[self.rank]["silent_s"] >= 10:
                self.status = subprocess.Popen(warm_python([sys.executable, "-m", "ddpkit", "status", str(self.out)],
                                                           self.env),
                                               env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ended_by_now(self) -> bool:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.monotonic()
        return self.ended is not None

    def result(self) -> tuple[int, str, float, int]:
        return self.proc.returncode, self.err.read_text(), self.ended - self.stopped, self.pid

    def kill(self) -> None:
        """Not ended: end the ranks (each in a session of its own), then the launcher."""
        if self.status is not None and self.status.poll() is None:
            self.status.kill()
            self.status.communicate()
        if self.proc.poll() is None:
            clients = self.clients()
            for pid in {*clients, *map(warm_ranks.worker_of, clients)}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def stopped_ranks(tmp_path_factory):
    """The two stopped-rank runs, side by side: each spends most of its time waiting for the stall watch.
    rank -> (StoppedRank, its result). Rank 1 is stopped at default settings, rank 0 with --stall-timeout 15
    under the spawn launcher, with which rank 0 serves the job's store (under torchrun the agent does)."""
    jobs = {1: StoppedRank(tmp_path_factory.mktemp("rank1") / "run", 1),
            0: StoppedRank(tmp_path_factory.mktemp("rank0") / "run", 0, "--stall-timeout", "15", "--launcher", "spawn")}
    try:
        for job in jobs.values():
            job.stop_after_two_epochs()
        deadline = time.monotonic() + 150
        while not all([job.ended_by_now() for job in jobs.values()]) and time.monotonic() < deadline:  # each polled
            jobs[1].look_while_stopped()
            time.sleep(0.2)
        assert all(job.ended_by_now() for job in jobs.values()), "a job with a stopped rank did not end in 150 s"
        yield {rank: (job, job.result()) for rank, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()


def _stack_shown(err: str, pid: int) -> None:
    """The stalled process's stack, read from outside while it is stopped: inside the trainer, wherever in
    the epoch (its steps, evaluation, a checkpoint) the stop found it."""
    assert f"its stack (py-spy dump --pid {pid}):" in err, err
    assert "train (ddpkit/app/train/trainer.py:" in err.split("its stack", 1)[1], err


def _last_checkpoint_kept(out: Path, *, writer_killed: bool = False) -> None:
    """The last epoch's checkpoint is complete and loads; nothing half-written was left, unless the writer
    (rank 0) was the stalled rank: stopped, then killed (SIGKILL), maybe in the middle of writing its
    temporary file, which was never renamed into place and which the next run removes."""
    checkpoints = out / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    assert checkpoint.load_file(checkpoints / latest)[checkpoint.KEY_PROGRESS]["samples"] == 0  # an epoch's end
    partial = sorted(path for path in checkpoints.iterdir() if path.name.startswith(checkpoint.TEMP_PREFIX))
    if writer_killed:
        assert sorted(checkpoint.remove_partial_writes(checkpoints)) == partial
    else:
        assert not partial


@pytest.mark.slow  # the default stall timeout is a minute
def test_a_stopped_rank_of_ddpkit_train_is_named_within_two_minutes_at_default_settings(stopped_ranks):
    job, (returncode, err, took, pid) = stopped_ranks[1]
    assert returncode == 1, err
    assert took < 120, f"named and ended {took:.0f} s after the stop"
    assert err.count("stalled:") == 1, err
    assert f"rank 1 (host {os.uname().nodename}, pid {pid}) stalled: its heartbeat stopped" in err
    assert "the process is stopped (SIGSTOP, a debugger) or frozen in C code" in err
    _stack_shown(err, pid)
    _last_checkpoint_kept(job.out)
    # `ddpkit status` while the rank was stopped: rank 0 kept writing; rank 1's last beat grew old.
    assert job.status is not None, "the status never showed rank 1 silent for 10 s"
    shown, _ = job.status.communicate(timeout=60)
    lines = shown.splitlines()
    assert lines[0].startswith("running: status written "), shown
    rank_0, rank_1 = (line.split() for line in lines[2:4])
    assert rank_1[:3] == ["1", os.uname().nodename, str(pid)] and int(rank_1[5]) >= 10 > int(rank_0[5]), shown
    # Then the job's last status: stalled, and why.
    saved = json.loads((job.out / "status.json").read_text())
    assert saved["state"] == "stalled" and saved["verdict"].startswith(f"rank 1 (host {os.uname().nodename}, pid {pid}) stalled")
    assert not leftover_processes()


@pytest.mark.slow
def test_a_stopped_rank_0_which_serves_the_store_is_named_by_rank_1(stopped_ranks):
    job, (returncode, err, took, pid) = stopped_ranks[0]
    assert returncode == 1, err
    assert took < 60, f"named and ended {took:.0f} s after the stop"
    assert err.count("stalled:") == 1, err
    assert (f"[rank1]: ddpkit: error: rank 0 (host {os.uname().nodename}, pid {pid}) stalled: the job's store, which "
            "its process serves, has not answered for") in err
    _stack_shown(err, pid)
    _last_checkpoint_kept(job.out, writer_killed=True)
    # Rank 0 wrote the status; killed, it left it "running": `ddpkit status` says its process is gone.
    shown = run_ddpkit("status", str(job.out))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("running: status written ") and (
        "; its process is gone: the job died without ending") in shown.stdout.splitlines()[0], shown.stdout
    assert not leftover_processes()
