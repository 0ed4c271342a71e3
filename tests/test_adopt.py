"""A process group that is up before ddpkit's setup (Ray Train's in its workers, a script's own
``init_process_group``) is adopted: used as it is, checked against the launcher's variables, and left up at the end."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import leftover_processes, run_ddpkit
from ddpkit.core import process_group
from ddpkit.core.env import DistEnv
from ddpkit.core.errors import UsageError


def test_a_group_that_is_up_is_used_and_left_up_with_only_ddpkits_side_groups_gone(group_of_one):
    runtime = process_group.setup(environment=DistEnv(), device="cpu")
    assert (runtime.backend, runtime.rank, runtime.world_size) == ("gloo", 0, 1)
    assert process_group.set_up_by_ddpkit()  # ddpkit run's watch over the script's group stands aside
    side = process_group.control_group(runtime)
    assert side is not None and dist.get_world_size(side) == 1
    process_group.teardown()
    assert dist.is_initialized() and not process_group.set_up_by_ddpkit()  # whoever started it ends it
    assert side not in dist.distributed_c10d._world.pg_map  # noqa: SLF001 - the side group is gone


@pytest.mark.parametrize("settings, message", [
    ({"environment": DistEnv(rank=1, world_size=2, local_world_size=2, local_rank=1)},
     "a process group is up already as rank 0 of 1, but the launcher (single) says rank 1 of 2"),
    ({"environment": DistEnv(), "backend": "nccl"},
     "`backend` nccl was asked for, but the process group that is up already (started by the script) uses gloo"),
])
def test_a_group_up_that_disagrees_with_the_launcher_or_the_backend_is_one_line(group_of_one, settings, message):
    with pytest.raises(UsageError) as refused:
        process_group.setup(device="cpu", **settings)
    assert message in str(refused.value)
    assert dist.is_initialized()


OWN_GROUP_FIRST = """
import sys
import torch, torch.distributed as dist
import ddpkit

if sys.argv[2] == "own":
    dist.init_process_group("gloo")  # the script's own group, from torchrun's variables, before its Job
with ddpkit.Job(seed=0) as job:
    data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(0)),
                                          torch.randint(0, 2, (256,), generator=torch.Generator().manual_seed(1)))
    model, optimizer = job.setup(torch.nn.Linear(8, 2), torch.optim.SGD, lr=0.1)
    for inputs, labels in job.train_loader(data, batch_size=16):
        job.backward(torch.nn.functional.cross_entropy(model(inputs), labels))
        job.step(optimizer)
    loss, accuracy, count = job.evaluate(model, job.eval_loader(data, batch_size=64))
    job.print(f"evaluated {count} samples")
    # What ddpkit's loaders use to share rank 0's choice of decoding (over the control group, the script's or not)
    told = ddpkit.core.process_group.decided_by_main(job.runtime, lambda: f"rank {job.rank}'s answer")
    print(f"rank {job.rank} was told {told}")
    job.save_model(model, sys.argv[1])
print(f"rank {dist.get_rank() if dist.is_initialized() else '-'}: group up after the job: {dist.is_initialized()}")
if dist.is_initialized():
    dist.destroy_process_group()
"""


def test_a_job_in_a_script_that_started_its_own_group_trains_as_a_job_alone(tmp_path):
    (tmp_path / "script.py").write_text(OWN_GROUP_FIRST)
    weights = {}
    for how in ("own", "ddpkit"):
        result = run_ddpkit("run", "--nproc-per-node", "2", "script.py", str(tmp_path / f"{how}.pt"), how,
                            cwd=tmp_path, timeout=120)
        said = result.stdout + result.stderr
        assert result.returncode == 0, said
        assert said.count("evaluated 256 samples") == 1, said
        assert said.count("group up after the job: True") == (2 if how == "own" else 0), said
        assert said.count("was told rank 0's answer") == 2, said
        weights[how] = torch.load(tmp_path / f"{how}.pt", weights_only=True)
    assert all(torch.equal(weights["own"][key], weights["ddpkit"][key]) for key in weights["ddpkit"])
    assert not leftover_processes()
