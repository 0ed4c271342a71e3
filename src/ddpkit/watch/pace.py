"""Which rank holds a healthy job back: the ranks' own step times side by side.

In data-parallel training every rank waits for the slowest at each all-reduce, so the job's step time is the
slowest rank's, and timing a step from outside says nothing about who is slow. Each rank's ``Pace``
(``ddpkit.core.progress``) knows its own step time without its waits for the others; ``compare`` sets them side
by side (``Job.compare_ranks``, which ``ddpkit train`` calls every epoch): the slowest rank and its slowdown
against the median of the other ranks, and the phase in which its extra time goes. ``SlowRanks`` says when that
is worth a warning: when the same rank stands out over the last ``WINDOWS`` comparisons, by more than ``SLOW_PCT``
and by more than ``NOISE_FACTOR`` times the spread of the others' step times (their step-to-step noise). Two ranks sharing two cores take turns at
being 10-40% slower, epoch after epoch: a warning at each would teach users to ignore warnings.
"""

from __future__ import annotations

import math
import statistics

import torch

from ddpkit.core.progress import OWN, Pace


SLOW_PCT = 20.0  # a rank this much slower than the median of the others may be named in a warning
NOISE_FACTOR = 5.0  # ... when its extra time per step is this many times the spread of the others' step times
WINDOWS = 2  # ... in this many comparisons in a row
GROWTH = 1.5  # a rank named once is named again when its slowdown has grown this much since


def compare(rows: list[list[float]]) -> dict:
    """The ranks' own step times side by side, from each rank's ``Pace.per_step()`` (a row per rank).

    ``rank_step_time_s``: each rank's data + forward + backward + optimizer seconds per step;
    ``slowest_rank``; ``slowdown_pct``: how much slower it is than the median of the other ranks (0 for
    one rank); ``slow_phase``: the phase in which its time exceeds the others' median most, and
    ``slow_phase_excess_s`` by how much per step.
    """
    own = [sum(row[:len(OWN)]) for row in rows]
    slowest = max(range(len(own)), key=own.__getitem__)
    others = [row for rank, row in enumerate(rows) if rank != slowest]
    typical = statistics.median([own[rank] for rank in range(len(own)) if rank != slowest]) if others else own[0]
    excess = [rows[slowest][i] - statistics.median(row[i] for row in others) if others else 0.0
              for i in range(len(OWN))]
    phase = max(range(len(OWN)), key=excess.__getitem__)
    return {
        "rank_step_time_s": [round(value, 5) for value in own],
        "slowest_rank": slowest,
        "slowdown_pct": round(100.0 * (own[slowest] / typical - 1.0), 1) if typical > 0 else 0.0,
        "slow_phase": OWN[phase],
        "slow_phase_excess_s": round(excess[phase], 5),
    }


def slow_rank_warning(compared: dict) -> str | None:
    """A line naming the slowest rank when it is more than SLOW_PCT slower than the others, else None."""
    if compared["slowdown_pct"] <= SLOW_PCT:
        return None
    rank, times = compared["slowest_rank"], compared["rank_step_time_s"]
    others = statistics.median(times[:rank] + times[rank + 1:])
    return (f"rank {rank} is {compared['slowdown_pct']:.0f}% slower than the median of the other ranks: "
            f"{times[rank]:.4f} s of its own work per step against {others:.4f} s, most of the difference in "
            f"{compared['slow_phase']} (+{compared['slow_phase_excess_s']:.4f} s per step). Every rank waits for "
            "it at each all-reduce; look at that rank's data loading, device, or the other jobs on its machine")


def over_noise(compared: dict, rows: list[list[float]]) -> float:
    """How many times the typical spread of the other ranks' own step times from one step to the next (the last
    column of ``Pace.per_step()``'s rows: ``ddpkit.core.progress.spread``) the slowest rank's extra time per step is
    (inf where there is no spread to compare with: one rank, or steady others)."""
    slowest, times = compared["slowest_rank"], compared["rank_step_time_s"]
    others = [rank for rank in range(len(rows)) if rank != slowest]
    if not others or len(rows[0]) <= len(OWN) + 1:
        return math.inf
    excess = times[slowest] - statistics.median(times[rank] for rank in others)
    noise = statistics.median(rows[rank][len(OWN) + 1] for rank in others)
    return excess / noise if noise > 0 else math.inf


def stands_out(compared: dict, rows: list[list[float]]) -> bool:
    """Whether ``compare``'s slowest rank is slower than the others by more than ``SLOW_PCT`` and by more than
    ``NOISE_FACTOR`` times the spread of their step times (``over_noise``)."""
    return compared["slowdown_pct"] > SLOW_PCT and over_noise(compared, rows) > NOISE_FACTOR


class SlowRanks:
    """When the slowest rank is worth a warning (``warning``, fed each comparison in turn): when it stood out
    (``stands_out``) in the last ``WINDOWS`` comparisons, the first time, and again only once its slowdown has
    grown by ``GROWTH`` since it was last named."""

    def __init__(self) -> None:
        self.streak: tuple[int | None, int] = (None, 0)  # the rank that stood out last, and in how many in a row
        self.named: dict[int, float] = {}  # rank -> its slowdown when last named

    def warning(self, compared: dict, rows: list[list[float]]) -> str | None:
        """The line to warn with after this comparison (``compare(rows)``), or None."""
        rank, pct = compared["slowest_rank"], compared["slowdown_pct"]
        if not stands_out(compared, rows):
            self.streak = (None, 0)
            return None
        self.streak = (rank, self.streak[1] + 1 if self.streak[0] == rank else 1)
        if self.streak[1] < WINDOWS or (rank in self.named and pct < GROWTH * self.named[rank]):
            return None
        self.named[rank] = pct
        return slow_rank_warning(compared)


def gather_rows(pace: Pace, runtime) -> list[list[float]]:
    """Every rank's ``pace.per_step()`` on every rank (one all_gather over the job's control group). Every
    rank calls it."""
    from ddpkit.core import process_group

    mine = torch.tensor(pace.per_step(), dtype=torch.float64)
    group = process_group.control_group(runtime)
    if group is None:
        return [mine.tolist()]
    import torch.distributed as dist

    every = [torch.empty_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(every, mine, group=group)
    return [row.tolist() for row in every]
