"""The library API in one process: what a user's own script calls."""

import os
import stat

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
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
    with pytest.raises(ddpkit.UsageError, match="strategy must be one of single, dp, ddp, fsdp"):
        ddpkit.prepare_model(nn.Linear(1, 1), rt, "zero3")
    with pytest.raises(ddpkit.UsageError, match="use ddpkit.strategies.apply_pipeline"):
        ddpkit.prepare_model(nn.Linear(1, 1), rt, "pipeline")


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

    from ddpkit.trainer import TrainConfig, _Loop, _Position, make_scheduler

    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    cfg = TrainConfig(accumulate=4, progress=False)
    with ddpkit.distributed(device="cpu") as rt:
        model = ddpkit.prepare_model(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), rt)
        model.register_comm_hook(None, counting_hook)
        data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
        loader = ddpkit.train_loader(data, batch_size=4, runtime=rt, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        loop = _Loop(cfg, rt, model, optimizer, make_scheduler(cfg, optimizer, 4), scaler, loader, None, 4,
                     _Position(epoch=1, samples=0, global_step=4))
        _, steps = loop.epoch(1, 0, [0.0, 0.0])
    assert steps == 4 and calls == [0, 0, 0, 0]  # 16 micro-steps, 4 optimizer steps, one bucket each


def test_unwrap_removes_only_parallel_wrappers():
    class HasModuleChild(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.head = nn.Linear(2, 1)

    model = HasModuleChild()
    assert ddpkit.unwrap(model) is model
    assert ddpkit.unwrap(nn.DataParallel(model)) is model
