"""The library API in one process: what a user's own script calls."""

import os
import stat

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.strategies.sync_bn import CPUSyncBatchNorm


def test_one_plain_process_still_gets_ddp_and_is_torn_down():
    with ddpkit.distributed(device="cpu") as rt:
        assert (rt.rank, rt.world_size, rt.backend, rt.device.type) == (0, 1, "gloo", "cpu")
        model = ddpkit.prepare_model(nn.Linear(3, 2), rt)
        assert isinstance(model, DistributedDataParallel)
        # PyTorch's own bucket default (small first bucket) unless the user sets one.
        default = DistributedDataParallel(nn.Linear(3, 2))
        assert model.bucket_bytes_cap == default.bucket_bytes_cap
        model(torch.randn(4, 3)).sum().backward()
    assert not dist.is_initialized()


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
    from ddpkit.app.trainer import OTHER_FLAGS, TrainConfig

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


def test_accumulation_all_reduces_once_per_optimizer_step():
    # Without no_sync the weights would come out the same (an all-reduce per micro-step is linear), so
    # count the all-reduces themselves with a DDP communication hook.
    from torch.utils.data import TensorDataset

    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    with ddpkit.Job("ddp", accumulate=4, device="cpu") as job:
        model, optimizer = job.setup(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), torch.optim.SGD, lr=0.1)
        model.register_comm_hook(None, counting_hook)
        # 17 batches: the 17th would start a 5th step that never completes, so the loader leaves it out.
        data = TensorDataset(torch.randn(68, 4), torch.randint(0, 3, (68,)))
        loader = job.train_loader(data, batch_size=4)
        assert (len(loader), loader.steps_per_epoch, loader.global_batch) == (16, 4, 16)
        steps = 0
        for images, labels in loader:
            job.backward(F.cross_entropy(model(images), labels))
            steps += job.step(optimizer)
    assert steps == 4 and job.global_step == 4 and calls == [0, 0, 0, 0]  # 16 micro-steps, one bucket each


def test_unwrap_removes_only_parallel_wrappers():
    class HasModuleChild(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.head = nn.Linear(2, 1)

    model = HasModuleChild()
    assert ddpkit.unwrap(model) is model
    assert ddpkit.unwrap(nn.DataParallel(model)) is model
