"""Sharded checkpoints (torch.distributed.checkpoint folders) in one process: layout, publication, resume,
damage, export. The multi-process ones (FSDP and ZeRO shards, resharding, a kill) are in test_parallelism."""

import os
import pickle
import shutil

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import checkpoint
from ddpkit.checkpoint import sharded
from ddpkit.checkpoint import CheckpointError

DATA = TensorDataset(torch.randn(48, 6), torch.randint(0, 3, (48,)))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def train(folder, *, steps: int, resume=None, save_at=(), optimizer=torch.optim.Adam, **options):
    """Train ``steps`` optimizer steps in one process, saving at the steps in ``save_at``; (state, resumed)."""
    with ddpkit.Job("single", device="cpu") as job:
        torch.manual_seed(1)
        model, opt = job.setup(build(), optimizer, lr=0.05)
        loader = job.train_loader(DATA, batch_size=4)
        ckpt = job.checkpointer(folder, model=model, optimizer=opt, loader=loader, log=lambda text: None, **options)
        resumed = ckpt.resume(resume)
        while job.global_step < steps:
            for x, y in loader:
                job.backward(nn.functional.cross_entropy(model(x), y))
                job.step(opt)
                if job.global_step in save_at:
                    ckpt.save()
                if job.global_step == steps:
                    break
        ckpt.wait()
        return {k: v.clone() for k, v in model.state_dict().items()}, resumed


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run: 16 steps (more than an epoch of 12), no checkpoint."""
    state, _ = train(tmp_path_factory.mktemp("whole"), steps=16)
    return state


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_sharded_checkpoint_resumes_exactly_and_exports_the_model(tmp_path, whole, asynchronous):
    options = {"async_save": True} if asynchronous else {"sharded": True}
    train(tmp_path, steps=14, save_at=(5, 9), **options)  # a run that stops at 14: its newest checkpoint is 9
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000005", "step-00000009"]
    saved = tmp_path / "step-00000009"
    assert sorted(os.listdir(saved)) == [".metadata", "__0_0.distcp", "ddpkit.pt"]
    side = torch.load(saved / "ddpkit.pt", weights_only=True)  # ddpkit's part: no tensors of the model
    assert "model" not in side and side["optimizer"] == "sharded" and side["progress"]["global_step"] == 9
    assert set(side["checksums"]) == {".metadata", "__0_0.distcp"}
    state, resumed = train(tmp_path, steps=16, resume="auto", save_at=(16,), **options)
    assert resumed.path == saved and resumed.contents.layout == "ddpkit, sharded"
    assert identical(state, whole)  # weights, BatchNorm buffers, Adam's moments, dropout's random stream
    chosen, count = checkpoint.export_model(tmp_path, tmp_path / "model.pt")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert chosen.name == "step-00000016" and count == len(whole) and identical(exported, whole)


def test_only_complete_folders_count_and_old_ones_are_pruned(tmp_path):
    train(tmp_path, steps=8, save_at=(2, 4, 6, 8), sharded=True, keep=2)
    assert checkpoint.list_checkpoints(tmp_path) == [tmp_path / "step-00000008", tmp_path / "step-00000006"]
    # A writer killed mid-save leaves a temporary folder: never chosen, removed by the next run's rank 0.
    shutil.copytree(tmp_path / "step-00000008", tmp_path / ".tmp-step-00000010")
    (tmp_path / ".tmp-step-00000010" / "ddpkit.pt").unlink()
    (tmp_path / "step-00000012").mkdir()  # a folder without ddpkit.pt: not complete
    warnings = []
    found, _ = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert found == tmp_path / "step-00000008" and warnings == []  # the one `latest` names
    (tmp_path / "latest").unlink()
    found, _ = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert found == tmp_path / "step-00000008"
    assert warnings == [f"skipping checkpoint {tmp_path / 'step-00000012'}: {tmp_path / 'step-00000012'} is not a "
                        "complete sharded checkpoint: it has no ddpkit.pt; trying the previous one"]
    removed = checkpoint.remove_partial_writes(tmp_path)
    assert removed == [tmp_path / ".tmp-step-00000010"] and not removed[0].exists()


def test_a_changed_shard_is_refused_by_name_and_the_previous_one_used(tmp_path):
    train(tmp_path, steps=6, save_at=(3, 6), sharded=True)
    shard = tmp_path / "step-00000006" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of some tensor
    shard.write_bytes(bytes(data))
    warnings = []
    path, obj = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert path == tmp_path / "step-00000003" and obj["progress"]["global_step"] == 3
    assert len(warnings) == 1 and "step-00000006 is damaged and was not loaded: __0_0.distcp fails its CRC-32" in warnings[0]
    (tmp_path / "step-00000003" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="none readable .*step-00000006 is damaged"):
        checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert "step-00000003 is damaged and was not loaded: .metadata missing" in warnings[-1]


class Shell:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_metadata_that_would_run_code_is_refused_unrun(tmp_path, monkeypatch):
    train(tmp_path, steps=2, save_at=(2,), sharded=True)
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "step-00000002" / ".metadata", "wb") as handle:
        pickle.dump(Shell(), handle)
    with pytest.raises(CheckpointError, match=r"\.metadata is not DCP metadata ddpkit can read safely: it refers to "
                                              r"posix\.system, which is not part of DCP's metadata"):
        sharded.read_metadata(tmp_path / "step-00000002")
    assert not (tmp_path / "pwned.txt").exists()


def test_a_sharded_checkpoint_for_another_optimizer_is_one_line(tmp_path, capsys):
    train(tmp_path, steps=2, save_at=(2,), sharded=True, optimizer=torch.optim.SGD)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # the Job says a UsageError in one line and exits 2
        train(tmp_path, steps=3, resume="auto", sharded=True)  # Adam's moments are not in SGD's checkpoint
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"[rank0]: ddpkit: error: {tmp_path / 'step-00000002'} cannot be loaded into this model and "
                          "optimizer: rank 0: Missing key in checkpoint state_dict: optimizer.state.")
    assert err.endswith("resume with the optimizer that wrote it\n") and err.count("\n") == 1


def test_asking_for_full_checkpoints_saved_asynchronously_is_one_line(tmp_path):
    one = ddpkit.Runtime(env=ddpkit.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1), backend=None,
                         device=torch.device("cpu"))
    with pytest.raises(ddpkit.UsageError, match="asynchronous saving writes sharded checkpoints .* drop one of the two"):
        checkpoint.Checkpointer(tmp_path, one, sharded=False, async_save=True)


def test_a_failed_dcp_save_is_one_line_naming_the_rank_or_the_full_disk(tmp_path):
    full = OSError(28, "No space left on device", str(tmp_path / "__1_0.distcp"))
    failures = {1: (full, None), 0: (RuntimeError("first line\nsecond"), None)}
    assert sharded.why(sharded.CheckpointException("failed", {1: failures[1]})).startswith(
        f"writing {tmp_path / '__1_0.distcp'} failed: no space left on the device")
    assert isinstance(sharded.as_error(sharded.CheckpointException("failed", {1: failures[1]})), ddpkit.UsageError)
    assert str(sharded.as_error(sharded.CheckpointException("failed", failures))) == "rank 0: first line"


def test_an_asynchronous_save_reuses_its_host_copy_only_while_the_state_keeps_its_layout():
    # The pinned copy (GPU states only; tests/test_gpu.py saves from one) is reused for the same keys, shapes and
    # dtypes whatever the values; a new tensor (Adam's moments after its first step) or a new shape needs another.
    weights = {"model": {"w": torch.ones(2, 3)}, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}}
    later = {"model": {"w": torch.zeros(2, 3)}, "optimizer": {"state": {}, "param_groups": [{"lr": 0.5}]}}
    stepped = {"model": {"w": torch.zeros(2, 3)},
               "optimizer": {"state": {0: {"exp_avg": torch.zeros(2, 3)}}, "param_groups": [{"lr": 0.5}]}}
    assert sharded.layout(weights) == sharded.layout(later)
    assert sharded.layout(weights) != sharded.layout(stepped)
    assert sharded.layout(weights) != sharded.layout({**weights, "model": {"w": torch.ones(3, 2)}})
    assert sharded.layout(weights) != sharded.layout({**weights, "model": {"w": torch.ones(2, 3, dtype=torch.half)}})
    assert sharded.Staging().stager_for(weights) is None  # a CPU state: DCP's own copy
