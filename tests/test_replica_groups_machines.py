"""tests/test_replica_groups_job.py's run and checks on two machines: network namespaces (tests/nodes.py), group 0 of
two DDP processes on node-a, which serves the lighthouse and the launchers' store, group 1 on node-b, each group
killed and restarted by its own machine's launcher, the last restart after group 0 has finished (node-a's launcher
still serves then). Each process averages its half of the group's gradient across the groups. About 23 s alone.
A module of its own so that pytest-xdist (``--dist loadscope``) runs it beside the one-machine run."""

import inspect

import pytest

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'ddpkit[ft]')")

import test_replica_groups_job as checks  # noqa: E402

# Every check of the one-machine runs, collected here too, on this module's run (its fixture of the same name).
globals().update({name: check for name, check in vars(checks).items()
                  if name.startswith("test_") and "job_run" in inspect.signature(check).parameters})


@pytest.fixture(scope="module")
def job_run(tmp_path_factory):
    return checks.launch(tmp_path_factory.mktemp("replica-groups-job-on-two-machines"), 2, "ddp", machines=2)


def test_machine_0_serves_the_lighthouse_and_each_machine_runs_its_own_group(job_run):
    assert "2 replica groups (1 on this machine, 0 of 2), lighthouse at http://node-a:" in job_run.output
    assert "2 replica groups (1 on this machine, 1 of 2), lighthouse at http://node-a:" in job_run.output
    # node-a's launcher waited for node-b's: group 1 restarted after group 0 had finished found it serving
    assert "waiting for the other machines' groups to end (this machine serves their lighthouse and store" in job_run.output
