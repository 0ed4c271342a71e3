"""HSDP: the tests of test_replica_groups_job.py on a run with FSDP inside each group of two processes (each
process holds half of every parameter; torchft averages each shard with the same rank of the other group).

Its own module, so that under xdist (``--dist loadscope``) it runs beside the groups of DDP rather than after them.
Group 1 is killed in backward, restarted, copies its shards live from the same rank of group 0, is killed again,
rejoins at its loader's first pass and finally is restarted once more after group 0 has finished. About 20 s alone
(four processes), in the slow target."""

import pytest

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'ddpkit[ft]')")

from test_replica_groups_job import (  # noqa: E402 - collected here again, against this module's run
    launch,
    test_a_dropped_step_is_tried_again_and_group_0_commits_every_step_once_with_its_processes,
    test_a_group_restarted_after_the_others_finished_stops_at_once_writing_nothing,
    test_both_restarts_join_before_their_loop_in_the_groups_epoch_and_agree_with_group_0_to_the_bit,
    test_each_try_of_a_step_trains_on_the_batch_and_in_the_epoch_of_a_run_without_failures,
    test_only_the_leading_group_prints_and_writes_checkpoints,
)

__all__ = [  # the tests imported above are this module's too
    "test_a_dropped_step_is_tried_again_and_group_0_commits_every_step_once_with_its_processes",
    "test_a_group_restarted_after_the_others_finished_stops_at_once_writing_nothing",
    "test_both_restarts_join_before_their_loop_in_the_groups_epoch_and_agree_with_group_0_to_the_bit",
    "test_each_try_of_a_step_trains_on_the_batch_and_in_the_epoch_of_a_run_without_failures",
    "test_only_the_leading_group_prints_and_writes_checkpoints",
]


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.slow)], ids=["fsdp-groups-of-2"])
def job_run(request, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("replica-groups-hsdp"), request.param, "fsdp")


def test_each_process_of_a_group_holds_only_its_shard(job_run):
    """The checksums of the two ranks differ: each holds another half of the weights (under DDP they are equal)."""
    ends = {where: next(r for r in records if r["event"] == "end") for where, records in job_run.records.items()}
    assert ends[0, 0]["checksum"] != ends[0, 1]["checksum"]
