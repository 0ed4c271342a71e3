"""What ``--launcher ray`` decides before (and after) Ray runs anything, in this process and without a cluster: the
ranks per node, a cluster too small, the address, the extra to install, the driver's status, the reports' way from a
rank to its Ray worker, and a Ray worker's variables read as a launcher's (tests/test_ray.py runs the real thing)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ddpkit.app.cli import main
from ddpkit.core.env import detect
from ddpkit.core.errors import UsageError
from ddpkit.job import evaluation_metrics
from ddpkit.core import ray_reports
from ddpkit.launch import on_ray

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ddp_demo.py")


def test_ranks_per_node_come_from_the_flag_or_the_clusters_gpus():
    four_gpus = {"CPU": 32.0, "GPU": 8.0}
    assert on_ray.plan(four_gpus, 2, nnodes=2, nproc_per_node="auto", want_gpu=True) == (4, True)
    assert on_ray.plan(four_gpus, 2, nnodes=2, nproc_per_node="auto", want_gpu=False) == (2, False)  # --device cpu
    assert on_ray.plan({"CPU": 4.0}, 1, nnodes=1, nproc_per_node="auto", want_gpu=True) == (2, False)
    assert on_ray.plan({"CPU": 4.0}, 3, nnodes=2, nproc_per_node=1, want_gpu=True) == (1, False)


@pytest.mark.parametrize("resources, nodes, nnodes, nproc, message", [
    ({"CPU": 4.0}, 1, 2, 1, "--nnodes 2: the Ray cluster has 1 node(s), 4 CPU(s) and 0 GPU(s): add nodes"),
    ({"CPU": 4.0}, 1, 1, 5, "1 node(s) x 5 process(es) need 5 CPU(s), but the Ray cluster has 1 node(s), 4 CPU(s)"),
    ({"CPU": 16.0, "GPU": 2.0}, 2, 2, 2, "2 node(s) x 2 process(es) need 4 CPU(s) and 4 GPU(s), but the Ray cluster "
                                         "has 2 node(s), 16 CPU(s) and 2 GPU(s)"),
])
def test_a_job_the_cluster_cannot_hold_is_refused_before_it_waits(resources, nodes, nnodes, nproc, message):
    with pytest.raises(UsageError, match=None) as refused:
        on_ray.plan(resources, nodes, nnodes=nnodes, nproc_per_node=nproc, want_gpu=True)
    assert message in str(refused.value)


def test_without_ray_installed_the_launch_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    assert main(["run", "--launcher", "ray", DEMO]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddpkit: error: --launcher ray needs Ray Train, which is not "
                                                   "installed here"), err
    assert err.rstrip().endswith("pip install 'ddpkit[ray]'"), err


def test_an_address_left_to_ray_is_not_checked_here():
    for address in (None, "auto", "ray://head:10001"):
        on_ray.check_address(address)  # Ray's own: RAY_ADDRESS or a local cluster, its lookup, Ray Client


def test_the_driver_says_exit_2_only_when_every_failed_rank_said_a_usage_error(caplog):
    class Failed(Exception):
        def __init__(self, failures):
            super().__init__("Training failed due to worker errors")
            self.worker_failures = failures

    assert on_ray.failed(Failed({0: on_ray.RankFailed(0, 2), 1: on_ray.RankFailed(1, 2)}), 0) == 2
    assert on_ray.failed(Failed({1: on_ray.RankFailed(1, -9)}), 3) == 1
    assert "the job failed on Ray after 3 restart(s): rank 1 exited with signal 9" in caplog.text
    assert on_ray.failed(RuntimeError("placement group removed"), 0) == 1
    assert "the job failed on Ray: placement group removed" in caplog.text


def test_rank_failed_survives_pickling_as_ray_sends_it_to_the_driver():
    import pickle

    again = pickle.loads(pickle.dumps(on_ray.RankFailed(3, 2)))
    assert (again.rank, again.status, str(again)) == (3, 2, "rank 3 exited with status 2")


def test_a_rank_under_ray_hands_its_reports_to_its_worker_through_the_pipe(monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setenv(ray_reports.REPORTS_ENV, str(write_end))
    ray_reports.report({"val_loss": 0.5, "val_count": 359, "nccl": {"NCCL_ALGO": "Ring"}, "note": "ok"})
    os.close(write_end)
    with os.fdopen(read_end) as reports:
        lines = reports.read().splitlines()
    assert [json.loads(line) for line in lines] == [{"val_loss": 0.5, "val_count": 359, "note": "ok"}]


def test_outside_ray_a_report_goes_nowhere(monkeypatch):
    monkeypatch.delenv(ray_reports.REPORTS_ENV, raising=False)
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    ray_reports.report({"val_loss": 0.5})  # no pipe, no Ray Train worker: nothing to do, nothing imported
    assert not ray_reports.in_ray_train_worker()


def test_an_evaluation_is_reported_by_name():
    assert evaluation_metrics((0.25, 0.9, 359), (1,), 44) == {"val_loss": 0.25, "val_acc": 0.9, "val_count": 359,
                                                             "global_step": 44}
    assert evaluation_metrics((0.25, 0.9, 0.99, 10), (1, 5), 3) == {"val_loss": 0.25, "val_top1": 0.9,
                                                                   "val_top5": 0.99, "val_count": 10, "global_step": 3}
    assert evaluation_metrics((0.25, 10), (), 3) == {"val_loss": 0.25, "val_count": 10, "global_step": 3}


def test_a_ray_train_worker_is_read_as_a_launcher_of_its_own():
    # What Ray Train's TorchTrainer sets in a worker of a 2-node job of 4 (ray 2.60), and the raylet's pid.
    worker = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1",
              "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41234", "RAY_RAYLET_PID": "812"}
    environment = detect(worker)
    assert (environment.launcher, environment.rank, environment.local_rank, environment.world_size,
            environment.local_world_size, environment.node_rank, environment.master_addr,
            environment.master_port) == ("ray", 3, 1, 4, 2, 1, "10.0.0.5", 41234)
    assert detect({**worker, "TORCHELASTIC_RUN_ID": "x"}).launcher == "torchrun"  # torchrun under Ray: torchrun's


def test_doctor_says_it_runs_in_a_ray_worker_and_what_it_read():
    from ddpkit.app import doctor

    worker = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
              "MASTER_ADDR": "192.0.2.2", "MASTER_PORT": "41234", "RAY_RAYLET_PID": "812", "RAY_JOB_ID": "02000000",
              "TORCHELASTIC_RESTART_COUNT": "1"}
    assert doctor.launched_line(doctor.launched_by(worker)) == (
        "started by a Ray worker (Ray Train; RAY_RAYLET_PID=812, RAY_JOB_ID=02000000): rank 1 of 2, local rank 1 of 2, "
        "node 0, master 192.0.2.2:41234, restart 1")
    assert doctor.launched_by({"PATH": "/bin"}) is None
    assert doctor.launched_line(doctor.launched_by({"RANK": "2", "WORLD_SIZE": "2"})).startswith(
        "started by a launcher whose variables ddpkit cannot read: rank 2 is outside 0..1")
