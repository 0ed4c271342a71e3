"""--min-replicas: while fewer groups than that are alive, the others wait for them instead of training on.

A module of its own, beside test_replica_groups.py (whose script it runs): pytest-xdist gives each module to one
worker, and the two runs, about 25 s each, then go on side by side."""

import json

import pytest

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'ddpkit[ft]')")

from conftest import run_ddpkit  # noqa: E402
from test_replica_groups import DIE_AT, SCRIPT, STALL_S, committed  # noqa: E402


def test_with_min_replicas_the_other_group_waits_for_the_dead_one_and_takes_no_step_alone(tmp_path):
    """--min-replicas 2: group 1 dies in step DIE_AT's all-reduce; group 0 waits (longer than its stall limit, not
    fenced) until group 1 is back, and no step is taken by one group. 16 to 25 s, 4 of them asleep."""
    (tmp_path / "script.py").write_text(SCRIPT)
    steps = DIE_AT + 5
    result = run_ddpkit("run", "--replica-groups", "2", "--min-replicas", "2", "--replica-heartbeat-timeout", "1",
                        "--max-restarts", "1", str(tmp_path / "script.py"), str(tmp_path), str(steps), str(DIE_AT),
                        "0", str(STALL_S), "1", timeout=120, REJOIN_AFTER_S=str(STALL_S))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 replica groups, lighthouse at http://127.0.0.1:" in result.stderr
    assert "a step waits for 2 of them" in result.stderr and "no step for" not in result.stderr
    records = {g: [json.loads(line) for line in (tmp_path / f"group{g}.jsonl").read_text().splitlines()] for g in (0, 1)}
    assert len({r["pid"] for r in records[0]}) == 1  # waited, never fenced or restarted
    # Every step group 0 committed, it took with group 1. (The restarted group's first record is its jump to the
    # others' step by copying their state, which it took no part in; the step after it, both took.)
    assert all(r["participants"] == 2 for r in committed(records[0]))
    steps_taken = [r["step"] for r in committed(records[0])]
    assert steps_taken == list(range(1, len(steps_taken) + 1)) and steps_taken[-1] >= steps
    death = next(r for r in records[1] if r["event"] == "die")
    back = [r for r in records[1] if r["event"] == "start"][1]
    first_after = next(r for r in committed(records[0]) if r["t"] > death["t"])
    # It waited for the restarted group (which slept STALL_S before joining), past its own stall limit.
    assert first_after["t"] > back["t"] and first_after["t"] - death["t"] > STALL_S
    ends = [next(r for r in records[g] if r["event"] == "end") for g in (0, 1)]
    assert ends[0]["step"] == ends[1]["step"] and ends[0]["checksum"] == ends[1]["checksum"]
