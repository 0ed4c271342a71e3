"""Each rank's own step time, and the slow rank named: the accounting, the DDP hooks on a real 2-process
job, and `ddpkit train` with one rank slowed on purpose."""

from __future__ import annotations

import json

import pytest

from conftest import leftover_processes, run_ddpkit
from ddpkit.core import progress
from ddpkit.core.progress import Pace
from ddpkit.watch import pace
from ddpkit.watch.pace import SlowRanks, compare, over_noise, slow_rank_warning


def test_the_time_between_marks_goes_to_the_phase_that_was_marked(monkeypatch):
    clock = iter([0.0, 1.0, 1.5, 3.5, 4.0, 4.25, 10.0]).__next__
    monkeypatch.setattr(progress.time, "monotonic", clock)
    p = Pace()  # 0.0, starting
    p.mark("data")  # 1.0: a second of starting
    p.mark("forward")  # 1.5
    p.mark("backward")  # 3.5
    p.grads_at = 3.75  # the last gradient came a quarter second before backward returned
    p.mark("optimizer")  # 4.0
    p.mark("data", step=1)  # 4.25
    assert p.seconds["starting"] == 1.0
    assert (p.seconds["data"], p.seconds["forward"], p.seconds["backward"], p.seconds["wait"],
            p.seconds["optimizer"]) == (0.5, 2.0, 0.25, 0.25, 0.25)
    assert p.steps == 1 and p.step == 1
    # The data phase in progress counts up to now; one step so far: no step-to-step deviation yet.
    assert p.per_step() == [0.5 + 5.75, 2.0, 0.25, 0.25, 0.25, 0.0]


def test_the_step_to_step_deviation_of_a_ranks_own_time(monkeypatch):
    # Own time (data + forward + backward + optimizer, not the waits) from one step to the next: 2, 1 and 3 s.
    marks = [("data", 1, 1.0), ("forward", None, 2.0), ("data", 2, 3.0), ("forward", None, 3.5), ("wait", None, 4.0),
             ("data", 3, 10.0), ("forward", None, 11.0), ("data", 4, 13.0)]
    monkeypatch.setattr(progress.time, "monotonic", iter([0.0, *(t for *_, t in marks), 13.0]).__next__)
    p = Pace()
    for phase, step, _ in marks:
        p.mark(phase, step)
    # Their median absolute deviation (median 2, deviations 0, 1, 1), scaled to a standard deviation's size.
    assert p.per_step()[-1] == pytest.approx(1.4826)
    assert progress.spread([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0  # one stalled step is not noise


def test_a_backward_without_gradients_here_is_all_backward(monkeypatch):
    clock = iter([0.0, 1.0, 2.0]).__next__
    monkeypatch.setattr(progress.time, "monotonic", clock)
    p = Pace()
    p.grads_at = 0.5  # from an earlier backward
    p.mark("backward")
    p.mark("optimizer")
    assert (p.seconds["backward"], p.seconds["wait"]) == (1.0, 0.0)


def test_marks_reach_the_pace_that_is_kept_and_busy_restores_the_phase():
    p = Pace()
    progress.mark("data")  # no pace kept: nothing happens
    assert p.phase == "starting"
    with progress.kept(p):
        progress.mark("forward", step=3)
        with progress.busy():
            assert p.phase == "busy"
        assert (p.phase, p.step) == ("forward", 3)
        progress.grads_ready()
        assert p.grads_at > 0
    assert progress.current() is None


def test_the_slowest_rank_against_the_median_of_the_others():
    # Rows: data, forward, backward, optimizer, wait (seconds per step).
    rows = [[0.01, 0.02, 0.04, 0.01, 0.05],
            [0.01, 0.02, 0.05, 0.01, 0.04],
            [0.06, 0.02, 0.04, 0.01, 0.00],  # its data loading holds the job back
            [0.01, 0.02, 0.04, 0.01, 0.05]]
    compared = compare(rows)
    assert compared["rank_step_time_s"] == [0.08, 0.09, 0.13, 0.08]
    assert compared["slowest_rank"] == 2
    assert compared["slowdown_pct"] == 62.5  # 0.13 against the others' median, 0.08
    assert (compared["slow_phase"], compared["slow_phase_excess_s"]) == ("data", 0.05)
    warning = slow_rank_warning(compared)
    assert warning.startswith("rank 2 is 62% slower than the median of the other ranks: 0.1300 s of its own work "
                              "per step against 0.0800 s, most of the difference in data (+0.0500 s per step)")


def test_a_healthy_job_and_a_single_rank_get_no_warning():
    assert slow_rank_warning(compare([[0.01, 0.02, 0.04, 0.01, 0.0], [0.01, 0.02, 0.045, 0.01, 0.0]])) is None
    single = compare([[0.01, 0.02, 0.04, 0.01, 0.0]])
    assert (single["slowest_rank"], single["slowdown_pct"]) == (0, 0.0)
    assert slow_rank_warning(single) is None


def window(times: list[float], noise: float) -> list[list[float]]:
    """Rows of ``Pace.per_step()`` for ranks of these own step times (all in forward) and this step-to-step deviation."""
    return [[0.0, t, 0.0, 0.0, 0.0, noise] for t in times]


def test_a_slow_rank_is_named_once_it_stays_slow_beyond_the_noise_and_again_only_if_it_grows():
    slow = SlowRanks()
    said = []
    for times, noise in [([0.10, 0.13], 0.005),   # 30% slower, 6 deviations: stands out (1 of 2 in a row)
                         ([0.10, 0.13], 0.005),   # 2 in a row: named
                         ([0.10, 0.14], 0.005),   # still slow, not by half more: said already
                         ([0.10, 0.21], 0.005),   # 110%: grew by more than half: named again
                         ([0.10, 0.25], 0.005)]:  # 150%: not 1.5 x 110
        rows = window(times, noise)
        said.append(slow.warning(compare(rows), rows))
    assert [w is not None for w in said] == [False, True, False, True, False]
    assert said[1].startswith("rank 1 is 30% slower") and said[3].startswith("rank 1 is 110% slower")


def test_two_ranks_taking_turns_or_slow_within_their_noise_are_not_named():
    slow = SlowRanks()
    # What two ranks on two cores do: 25-45% apart, but the slow one changes, or the difference is within 3
    # deviations of their step-to-step noise.
    for times, noise in [([0.10, 0.13], 0.005), ([0.145, 0.10], 0.005), ([0.10, 0.125], 0.005),
                         ([0.13, 0.10], 0.005), ([0.10, 0.14], 0.02), ([0.10, 0.145], 0.02), ([0.10, 0.13], 0.02)]:
        rows = window(times, noise)
        assert slow.warning(compare(rows), rows) is None
    assert over_noise(compare(window([0.10, 0.14], 0.02)), window([0.10, 0.14], 0.02)) == pytest.approx(2.0)


# ddpkit train's own model (net, with BatchNorm), whose forward sleeps on rank 1: that rank's own work per step grows by
# a fixed time, whatever else the machine runs.
SLOWED_MODEL = """
import os, time
import torch.nn as nn
from ddpkit.zoo.models import build_model


class Slowed(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        # (the digits as ddpkit hands them to a model of the user's: 3 channels of 32 x 32)
        self.net, self.seconds = build_model("net", in_channels=3, num_classes=10, image_size=32), seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.net(x)


def net_slow_on_rank_1(seconds):
    return Slowed(seconds if os.environ["RANK"] == "1" else 0.0)
"""


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory):
    """`ddpkit train` on 2 processes whose rank 1 sleeps 0.2 s in each forward: (metrics records, stderr).

    A sleep, not a stopped process: rank 1's extra own time per step is the same whatever else the machine runs, so
    the test shares the machine (it had it to itself while rank 1 was stopped on and off by the test, about 21 s).
    Alone, rank 1's own step took 0.23 s against rank 0's 0.025 s (810% slower)."""
    out = tmp_path_factory.mktemp("slowed")
    (out / "slowed.py").write_text(SLOWED_MODEL)
    done = run_ddpkit("train", "--nproc-per-node", "2", "--epochs", "2", "--model", "slowed:net_slow_on_rank_1",
                      "--model-arg", "seconds=0.2", "--output-dir", str(out), "--no-progress", cwd=out, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, done.stderr


def test_a_slowed_rank_is_named_in_metrics_and_in_a_warning(slowed_run):
    records, err = slowed_run
    assert len(records) == 2
    for record in records:
        assert len(record["rank_step_time_s"]) == 2
        assert record["slowest_rank"] == 1, record
        assert record["slowdown_pct"] > pace.SLOW_PCT and record["slow_phase"] == "forward", record
    # Named once, at the second epoch in a row it stood out (not at every epoch), from rank 0 only.
    assert err.count("ddpkit: warning: rank 1 is ") == 1, err
    assert "slower than the median of the other ranks" in err
    assert not leftover_processes()
