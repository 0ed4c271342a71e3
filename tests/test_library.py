"""The library API in one process: what a user's own script calls."""

import os
import stat
import sys
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from conftest import run_command
from ddpkit.strategies.sync_bn import CPUSyncBatchNorm


def test_one_plain_process_gets_ddps_interface_without_its_work_and_is_torn_down():
    from ddpkit.strategies import DDP, OneProcessDDP, distributed_already, strategy_of

    with ddpkit.distributed(device="cpu") as rt:
        assert (rt.rank, rt.world_size, rt.backend, rt.device.type) == (0, 1, "gloo", "cpu")
        torch.manual_seed(0)
        bare = nn.Linear(3, 2)
        reference = nn.Linear(3, 2)
        reference.load_state_dict(bare.state_dict())
        model = ddpkit.prepare_model(bare, rt)
        # No DistributedDataParallel (no reducer, no buckets, no broadcast before each forward): the model itself,
        # behind DDP's interface, and still known as DDP's.
        assert type(model) is OneProcessDDP and not isinstance(model, DistributedDataParallel)
        assert model.module is bare and ddpkit.unwrap(model) is bare and strategy_of(model) == DDP()
        assert distributed_already(model) and not distributed_already(bare)  # --unchanged stands aside for the first
        assert list(model.state_dict()) == ["weight", "bias"]
        x = torch.randn(4, 3)
        with model.no_sync():
            model(x).sum().backward()
        model(x).sum().backward()
        reference(x).sum().backward()
        reference(x).sum().backward()
        assert torch.equal(bare.weight.grad, reference.weight.grad)  # what DDP averages over one process
        assert dist.is_initialized()  # the group a script's own collectives use is there all the same
        with model.join():  # DDP's context for uneven inputs: nothing to wait for
            model(x)
    assert not dist.is_initialized()


GLOO_WORK_AT_TEARDOWN = """
import torch, torch.distributed as dist, ddpkit

for _ in range(10):  # a race: each round alone hung about half the time
    with ddpkit.distributed(device="cpu"):
        # Collectives still in gloo's hands at the teardown, whose tensors have no Python reference left: gloo's
        # worker threads free them, and must take the GIL for that, while the group is being destroyed.
        for _ in range(100):
            dist.broadcast(torch.tensor([1]), src=0, async_op=True)
print("torn down")
"""


def test_the_teardown_does_not_hang_on_a_tensor_gloo_frees_meanwhile(tmp_path):
    # Before torch 2.8 a process group is destroyed holding the GIL: on torch 2.4 this hung in 5 runs of 5 without
    # ddpkit's way around it (process_group._destroy).
    script = tmp_path / "work_at_teardown.py"
    script.write_text(GLOO_WORK_AT_TEARDOWN)
    result = run_command([sys.executable, str(script)], timeout=60)
    assert result.returncode == 0 and "torn down" in result.stdout, result.stdout + result.stderr


class Batch(NamedTuple):
    images: torch.Tensor
    labels: list


def test_one_process_ddp_moves_what_ddp_moves_to_its_device():
    """Inputs in namedtuples, dicts, lists and tuples reach the model on its device, moved by DDP's own helper as its
    forward moves them (the meta device here stands for a GPU; what is not a tensor is left as it is)."""
    from ddpkit.strategies import OneProcessDDP

    class Seen(nn.Module):
        def forward(self, batch, extra, *, scale):
            return batch, extra, scale

    model = OneProcessDDP(Seen(), torch.device("meta"))
    batch, extra, scale = model(Batch(torch.zeros(2, 3), [torch.ones(2), "cat"]), {"mask": (torch.ones(1),)},
                                scale=torch.tensor(2.0))
    assert isinstance(batch, Batch) and batch.images.device.type == "meta" and batch.labels[0].device.type == "meta"
    assert batch.labels[1] == "cat" and extra["mask"][0].device.type == "meta" and scale.device.type == "meta"


def test_prepare_model_single_and_sync_bn():
    with ddpkit.distributed(device="cpu", force_group=False) as rt:
        assert rt.backend is None
        model = ddpkit.prepare_model(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), rt, "single", sync_bn=True)
        assert isinstance(model[1], CPUSyncBatchNorm)
        # One process: the synchronised BatchNorm is plain BatchNorm, numerically.
        x = torch.randn(5, 2, 6, 6)
        reference = nn.BatchNorm2d(2)
        reference.load_state_dict(model[1].state_dict())
        torch.testing.assert_close(model[1](x), reference(x))
    with pytest.raises(ddpkit.UsageError, match="`strategy` must be one of single, dp, ddp, zero, fsdp, pipeline"):
        ddpkit.prepare_model(nn.Linear(1, 1), rt, "zero3")
    with pytest.raises(ddpkit.UsageError, match="`strategy` pipeline needs a process group"):
        ddpkit.prepare_model(nn.Linear(1, 1), rt, "pipeline")
    with pytest.raises(ddpkit.UsageError, match="strategy ddp has no setting 'stages' \\(a setting of pipeline\\)"):
        ddpkit.prepare_model(nn.Linear(1, 1), rt, "ddp", stages=2)


def test_library_errors_name_its_parameters_and_the_command_line_says_its_flags():
    from ddpkit.app.config import in_flag_terms
    from ddpkit.app.train.config import OTHER_FLAGS, TrainConfig

    with pytest.raises(ddpkit.UsageError) as caught:
        ddpkit.create("ddp", bucket_cap_mb=0)
    assert str(caught.value) == "`bucket_cap_mb` must be positive, got 0"
    with pytest.raises(ddpkit.UsageError) as caught:
        ddpkit.create("single").check(world_size=2, cuda_count=0, batch_size=8)
    said = in_flag_terms(str(caught.value), TrainConfig, OTHER_FLAGS)
    assert said == "--strategy single trains on one device; use --nproc-per-node 1 (not 2) or --strategy ddp"
    with pytest.raises(ddpkit.UsageError, match="--bucket-cap-mb must be positive, got 0"):
        TrainConfig(bucket_cap_mb=0).validate()
    # A job's timeout, before any group starts: `timeout_s` in the library, --timeout on the command line.
    with pytest.raises(ddpkit.UsageError) as caught:
        ddpkit.Job("single", timeout_s=float("inf"))
    assert str(caught.value) == "`timeout_s` must be a finite number of seconds, at least 1, got inf"
    assert in_flag_terms(str(caught.value), TrainConfig, OTHER_FLAGS).startswith("--timeout must be a finite")


def test_atomic_save_leaves_no_temporary_file_and_the_usual_permissions(tmp_path):
    target = tmp_path / "sub" / "model.pt"
    ddpkit.atomic_save({"w": torch.ones(2)}, target)
    ddpkit.atomic_save({"w": torch.zeros(2)}, target)  # replaces the old one in one rename
    assert os.listdir(target.parent) == ["model.pt"]
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.zeros(2))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


def test_atomic_save_failure_keeps_the_previous_file(tmp_path):
    target = tmp_path / "model.pt"
    ddpkit.atomic_save({"w": torch.ones(2)}, target)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        ddpkit.atomic_save({"w": Unpicklable()}, target)
    assert os.listdir(tmp_path) == ["model.pt"]
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(2))


def test_model_state_dict_has_no_module_prefix():
    with ddpkit.distributed(device="cpu") as rt:
        model = ddpkit.prepare_model(nn.Linear(3, 2), rt)
        assert sorted(ddpkit.model_state_dict(model)) == ["bias", "weight"]


def test_unwrap_removes_only_parallel_wrappers():
    class HasModuleChild(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.head = nn.Linear(2, 1)

    model = HasModuleChild()
    assert ddpkit.unwrap(model) is model
    assert ddpkit.unwrap(nn.DataParallel(model)) is model
