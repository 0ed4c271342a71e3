"""Checkpoint pieces in one process: files, layouts, mismatches, RNG, the sampler's resume arithmetic."""

import collections
import io
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import child_env
from torch.utils.data import DistributedSampler, TensorDataset

from ddpkit import checkpoint
from ddpkit.checkpoint import Checkpointer, CheckpointError
from ddpkit.data import ResumableSampler, train_loader
from ddpkit.core.env import DistEnv
from ddpkit.core.process_group import Runtime
from ddpkit.app.train.lr_schedule import lr_factor, make_scheduler, place_scheduler
from ddpkit.app.train.config import TrainConfig
from ddpkit.zoo import ConvNet, Net


def runtime(rank: int = 0, world: int = 1) -> Runtime:
    return Runtime(env=DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world),
                   backend=None, device=torch.device("cpu"))


def rank_indices(sampler_type, n, world, epoch, start=0, drop_last=True):
    out = []
    for rank in range(world):
        sampler = sampler_type(TensorDataset(torch.arange(n)), num_replicas=world, rank=rank, seed=3, drop_last=drop_last)
        sampler.set_epoch(epoch)
        if start:
            sampler.start = start
        out.append(list(sampler))
        assert len(sampler) == len(out[-1])
    return out


# ---------------------------------------------------------------------------------- sampler and loader


@pytest.mark.parametrize("n,world,drop_last", [(101, 1, True), (101, 2, True), (101, 3, False), (96, 2, False)])
def test_resumable_sampler_from_the_start_is_distributed_sampler(n, world, drop_last):
    assert rank_indices(ResumableSampler, n, world, 4, drop_last=drop_last) == rank_indices(
        DistributedSampler, n, world, 4, drop_last=drop_last)


@pytest.mark.parametrize("steps_done", [1, 3, 6])
@pytest.mark.parametrize("n,world,drop_last", [(101, 2, True), (101, 3, False), (10, 4, False)])
def test_resuming_part_way_gives_each_rank_exactly_its_remaining_indices(steps_done, n, world, drop_last):
    batch = 1 if n == 10 else 4
    whole = rank_indices(DistributedSampler, n, world, 2, drop_last=drop_last)
    rest = rank_indices(ResumableSampler, n, world, 2, start=steps_done * batch * world, drop_last=drop_last)
    assert rest == [indices[steps_done * batch:] for indices in whole]


def test_resuming_with_another_world_size_deals_out_the_rest_once():
    whole = rank_indices(ResumableSampler, 101, 1, 0)[0]
    start = 3 * 16  # three steps of global batch 16 done by the old world
    rest = rank_indices(ResumableSampler, 101, 4, 0, start=start)
    counted = collections.Counter(i for indices in rest for i in indices)
    assert set(counted.values()) == {1}
    assert set(counted) <= set(whole[start:]) and len(counted) == (101 - start) // 4 * 4


def test_loader_position_counts_handed_over_batches_and_resumes_there():
    data = TensorDataset(torch.arange(64))
    loader = train_loader(data, batch_size=4, runtime=runtime(), seed=1, workers=0)
    everything = [batch[0].tolist() for batch in loader]  # epoch 0
    assert loader.state_dict() == {"epoch": 1, "samples": 0, "seed": 1}
    loader.set_epoch(0)
    batches = iter(loader)
    taken = [next(batches)[0].tolist() for _ in range(5)]
    assert taken == everything[:5]
    state = loader.state_dict()
    assert state == {"epoch": 0, "samples": 20, "seed": 1}
    fresh = train_loader(data, batch_size=4, runtime=runtime(), seed=1, workers=0)
    fresh.load_state_dict(state)
    assert len(fresh) == 11 and fresh.steps_per_epoch == 16
    assert [batch[0].tolist() for batch in fresh] == everything[5:]
    assert fresh.state_dict()["epoch"] == 1


def test_iterating_a_loader_leaves_the_global_random_stream_alone():
    loader = train_loader(TensorDataset(torch.arange(64)), batch_size=4, runtime=runtime(), seed=1, workers=0)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    list(loader)
    assert torch.equal(torch.rand(3), expected)


# ----------------------------------------------------------------------------------------------- files


def test_checkpoint_folder_keeps_the_newest_and_a_pointer(tmp_path):
    for step in (5, 10, 40, 20):
        path = tmp_path / checkpoint.checkpoint_name(step)
        checkpoint.atomic_save({"step": step}, path)
        checkpoint.write_pointer(tmp_path, path)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step-00000040.pt", "step-00000020.pt", "step-00000010.pt", "step-00000005.pt"]
    assert checkpoint.read_pointer(tmp_path).name == "step-00000020.pt"
    removed = checkpoint.prune(tmp_path, keep=2)
    # The pointer's file survives even when it is not among the newest two.
    assert sorted(p.name for p in removed) == ["step-00000005.pt", "step-00000010.pt"]
    assert (tmp_path / "step-00000020.pt").exists() and (tmp_path / "step-00000040.pt").exists()


def test_a_fresh_run_sets_the_earlier_checkpoints_aside(tmp_path):
    folder = tmp_path / "checkpoints"
    assert checkpoint.set_aside(folder) is None
    checkpoint.atomic_save({}, folder / checkpoint.checkpoint_name(3))
    moved = checkpoint.set_aside(folder)
    assert moved == tmp_path / "checkpoints.prev" and (moved / "step-00000003.pt").exists()
    assert not folder.exists()


WRITER = textwrap.dedent(
    """
    import sys, torch
    from ddpkit.checkpoint import atomic_save
    atomic_save({"weights": torch.ones(400_000_000, dtype=torch.uint8)}, sys.argv[1])
    """
)


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_intact(tmp_path):
    target = tmp_path / checkpoint.checkpoint_name(7)
    checkpoint.atomic_save({"weights": torch.arange(10)}, target)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], env=child_env())
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(checkpoint.TEMP_PREFIX) and p.stat().st_size > 1_000_000
                      for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert torch.equal(checkpoint.load_file(target)["weights"], torch.arange(10))
    left = checkpoint.remove_partial_writes(tmp_path)
    assert len(left) == 1 and not left[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_truncated_file_is_a_one_line_error(tmp_path):
    path = tmp_path / "step-00000001.pt"
    checkpoint.atomic_save(Net().state_dict(), path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match="is not a checkpoint: torch.save writes a zip archive and this file "
                                              r"is not one \(truncated, or another kind of file\)") as caught:
        checkpoint.load_file(path)
    assert "\n" not in str(caught.value)
    # Still a zip, but a tensor's record cut short: torch.load's own reason, in one line.
    records = zipfile.ZipFile(io.BytesIO(whole))
    cut = io.BytesIO()
    with zipfile.ZipFile(cut, "w") as damaged:
        for info in records.infolist():
            data = records.read(info)
            damaged.writestr(info, data[: len(data) // 2] if info.filename.endswith("/data/0") else data)
    path.write_bytes(cut.getvalue())
    if not _torch_checks_record_sizes(cut.getvalue()):
        pytest.skip(f"torch {torch.__version__}'s torch.load reads a tensor record cut short without a word")
    with pytest.raises(CheckpointError, match="is not a readable checkpoint") as caught:
        checkpoint.load_file(path)
    assert "\n" not in str(caught.value)


def _torch_checks_record_sizes(archive: bytes) -> bool:
    try:
        torch.load(io.BytesIO(archive), weights_only=True)
    except RuntimeError:
        return True
    return False


def flip_a_byte_of(path: Path, record_suffix: str, at: int = 100) -> None:
    """Invert one byte of the record whose name ends with ``record_suffix``, in place (bit rot, a bad copy)."""
    with zipfile.ZipFile(path) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith(record_suffix))
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_length + extra_length + at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_whose_bytes_changed_is_refused_by_name(tmp_path):
    path = tmp_path / checkpoint.checkpoint_name(1)
    checkpoint.atomic_save({"weights": torch.arange(1000, dtype=torch.float32)}, path)
    flip_a_byte_of(path, "/data/0")
    # torch.load alone takes it: one weight is now wrong, silently.
    assert not torch.equal(torch.load(path, weights_only=True)["weights"], torch.arange(1000, dtype=torch.float32))
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load_file(path)
    assert str(caught.value) == (f"{path} is damaged and was not loaded: its record "
                                 "archive/data/0 (a tensor's data) fails its CRC-32 checksum or header check (changed "
                                 "on disk or in a copy after it was written)")


@pytest.mark.parametrize("where, says", [
    ("record", "its record archive/data/0 (a tensor's data) fails its CRC-32 checksum or header check"),
    ("table", "its table of records is damaged (Bad magic number for central directory)"),
])
def test_a_checkpoint_with_a_damaged_header_is_refused_in_one_line(tmp_path, where, says):
    path = tmp_path / "model.pt"
    checkpoint.atomic_save({"weights": torch.arange(10)}, path)
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if info.filename.endswith("/data/0")).header_offset
        table = archive.start_dir
    data = bytearray(path.read_bytes())
    at = record if where == "record" else table
    data[at:at + 4] = b"XXXX"  # the signature of the record's header, or of the table's first entry
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load_file(path)
    assert str(caught.value).startswith(f"{path} is damaged and was not loaded: {says}")
    assert "\n" not in str(caught.value)


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_good_one(tmp_path):
    for step in (1, 2):
        checkpoint.atomic_save({checkpoint.KEY_FORMAT: checkpoint.FORMAT, checkpoint.KEY_MODEL: {"w": torch.full((64,), step)}},
                               tmp_path / checkpoint.checkpoint_name(step))
    checkpoint.write_pointer(tmp_path, tmp_path / checkpoint.checkpoint_name(2))
    flip_a_byte_of(tmp_path / checkpoint.checkpoint_name(2), "/data/0", at=10)
    warnings = []
    path, obj = checkpoint.find_resumable(tmp_path, warnings.append)
    assert path.name == "step-00000001.pt" and torch.equal(obj["model"]["w"], torch.full((64,), 1))
    assert len(warnings) == 1 and "step-00000002.pt is damaged and was not loaded" in warnings[0]


def test_a_file_of_another_kind_is_not_taken_for_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(CheckpointError, match="notes.txt is not a checkpoint: torch.save writes a zip archive"):
        checkpoint.load_file(tmp_path / "notes.txt")


class Payload:
    """Any class: unpickling it could run code, so weights_only loading must refuse it."""


def test_pickled_objects_are_refused_not_run(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": Net().state_dict(), "payload": Payload()}, path)
    with pytest.raises(CheckpointError, match="weights_only loading refuses") as caught:
        checkpoint.load_file(path)
    assert "Payload" in str(caught.value)


def test_newest_unreadable_checkpoint_falls_back_to_the_previous(tmp_path):
    for step in (1, 2, 3):
        checkpoint.atomic_save({checkpoint.KEY_FORMAT: checkpoint.FORMAT, checkpoint.KEY_MODEL: {"w": torch.full((2,), step)}},
                               tmp_path / checkpoint.checkpoint_name(step))
    checkpoint.write_pointer(tmp_path, tmp_path / checkpoint.checkpoint_name(3))
    (tmp_path / checkpoint.checkpoint_name(3)).write_bytes(b"PK\x03\x04 torn")
    warnings = []
    path, obj = checkpoint.find_resumable(tmp_path, warnings.append)
    assert path.name == "step-00000002.pt" and obj["model"]["w"][0] == 2
    assert len(warnings) == 1 and "step-00000003.pt" in warnings[0]
    for step in (1, 2):
        (tmp_path / checkpoint.checkpoint_name(step)).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint .* 3 found"):
        checkpoint.find_resumable(tmp_path, warnings.append)
    assert checkpoint.find_resumable(tmp_path / "empty", warnings.append) is None


# --------------------------------------------------------------------------------------------- layouts


def tutorial_checkpoint(epoch=None):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    # DDP's state_dict carries the "module." prefix: what the tutorials save from the wrapper.
    saved = {"model_state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
             "optimizer_state_dict": optimizer.state_dict()}
    if epoch is not None:
        saved["epoch"] = epoch
    return model, saved


def test_the_tutorials_layouts_load(tmp_path):
    model, saved = tutorial_checkpoint(epoch=4)
    torch.save(saved, tmp_path / "tutorial.pt")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    torch.save(saved["model_state_dict"], tmp_path / "prefixed.pt")
    contents = checkpoint.read_contents(checkpoint.load_file(tmp_path / "tutorial.pt"))
    assert contents.layout == "tutorial" and contents.progress["epoch"] == 5
    assert contents.optimizer["state"][0]["momentum_buffer"] is not None
    for name in ("tutorial.pt", "plain.pt", "prefixed.pt"):
        fresh = Net()
        checkpoint.load_model_state(fresh, checkpoint.read_contents(checkpoint.load_file(tmp_path / name)).model)
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    with pytest.raises(CheckpointError, match="not a checkpoint ddpkit can read"):
        checkpoint.read_contents({"weights": [1, 2, 3]}, "odd.pt")


def test_a_checkpoint_of_another_model_names_what_does_not_fit():
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load_model_state(ConvNet(num_classes=10), Net().state_dict(), "net.pt")
    message = str(caught.value)
    assert message.startswith("net.pt is for another model")
    assert "missing key(s)" in message and "unexpected key(s)" in message and "\n" not in message
    wider = nn.Linear(4, 3)
    with pytest.raises(CheckpointError, match=r"2 shape mismatch\(es\), checkpoint vs model: weight \[2, 4\] vs \[3, 4\], bias \[2\] vs \[3\]"):
        checkpoint.load_model_state(wider, nn.Linear(4, 2).state_dict(), "small.pt")


# ------------------------------------------------------------------------------------------------- RNG


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.randn(5), random.random(), np.random.rand()
    checkpoint.atomic_save({"rng": checkpoint.rng_state()}, tmp_path / "rng.pt")
    expected = (torch.randn(3), random.random(), np.random.rand(2))
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    checkpoint.set_rng_state(checkpoint.load_file(tmp_path / "rng.pt")["rng"])
    again = (torch.randn(3), random.random(), np.random.rand(2))
    assert torch.equal(again[0], expected[0]) and again[1] == expected[1] and np.array_equal(again[2], expected[2])


# ------------------------------------------------------------------------------------ the checkpointer


def test_checkpointer_round_trip_in_one_process(tmp_path):
    torch.manual_seed(0)
    model = ConvNet(num_classes=10)
    optimizer = torch.optim.Adam(model.parameters())
    loader = train_loader(TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))),
                          batch_size=8, runtime=runtime(), workers=0)
    batches = iter(loader)
    for _ in range(3):
        images, labels = next(batches)
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    ckpt = Checkpointer(tmp_path, runtime(), keep=2, log=lambda text: None)
    path = ckpt.save(model=model, optimizer=optimizer, loader=loader, config={"note": "x"})
    ckpt.wait()
    assert path.name == "step-00000003.pt" and checkpoint.read_pointer(tmp_path) == path
    after = torch.rand(2)  # the stream the resumed run must continue with

    fresh = ConvNet(num_classes=10)
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    fresh_loader = train_loader(loader.loader.dataset, batch_size=8, runtime=runtime(), workers=0)
    resumed = Checkpointer(tmp_path, runtime(), log=lambda text: None).load("auto", model=fresh)
    resumed.restore(optimizer=fresh_optimizer, loader=fresh_loader)
    assert (resumed.epoch, resumed.samples, resumed.global_step) == (0, 24, 3)
    assert resumed.contents.config == {"note": "x"} and resumed.contents.versions["torch"] == str(torch.__version__)
    assert torch.equal(torch.rand(2), after)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 3
    assert [b[0].sum() for b in fresh_loader] == [b[0].sum() for b in batches]


def test_a_slow_write_is_skipped_when_asked_not_waited_for(tmp_path):
    slow = []

    def slow_writer(obj, path):
        time.sleep(1.0)
        slow.append(path.name)
        checkpoint.atomic_save(obj, path)

    model = nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, runtime(), writer=slow_writer, log=lambda text: None)
    started = time.monotonic()
    assert ckpt.save(model=model, global_step=1) is not None
    assert time.monotonic() - started < 0.5  # written in the background
    assert ckpt.save(model=model, global_step=2, if_idle=True) is None  # still busy: skipped
    ckpt.save(model=model, global_step=3)  # not skippable: waits for the first, then writes
    ckpt.wait()
    assert slow == ["step-00000001.pt", "step-00000003.pt"]


def test_a_failed_write_is_reported(tmp_path):
    def broken(obj, path):
        raise OSError(28, "No space left on device")

    ckpt = Checkpointer(tmp_path, runtime(), writer=broken, log=lambda text: None)
    ckpt.save(model=nn.Linear(2, 2), global_step=1)
    with pytest.raises(CheckpointError, match="writing checkpoint .*step-00000001.pt failed: .*No space left on device"):
        ckpt.wait()


# ------------------------------------------------------------------------------------------- schedules


def test_learning_rate_schedules():
    cosine = TrainConfig(schedule="cosine", epochs=2, warmup_steps=4).lr_schedule()
    assert [lr_factor(cosine, s, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(cosine, 4, 10) == 1.0 and lr_factor(cosine, 12, 10) == pytest.approx(0.5)
    assert lr_factor(cosine, 20, 10) == pytest.approx(0.0)
    step = TrainConfig(schedule="step", epochs=9, lr_gamma=0.5).lr_schedule()  # every 3 epochs by default
    assert [lr_factor(step, s * 10, 10) for s in (0, 2, 3, 6, 8)] == [1, 1, 0.5, 0.25, 0.25]
    assert lr_factor(TrainConfig().lr_schedule(), 1000, 10) == 1.0


def test_a_scheduler_placed_at_a_step_matches_one_stepped_there():
    cfg = TrainConfig(schedule="cosine", epochs=3, warmup_steps=2).lr_schedule()
    stepped = make_scheduler(cfg, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 5)
    for _ in range(7):
        stepped.optimizer.step()
        stepped.step()
    placed = make_scheduler(cfg, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 5)
    place_scheduler(placed, 7)
    assert placed.get_last_lr() == stepped.get_last_lr()
    assert placed.optimizer.param_groups[0]["lr"] == stepped.optimizer.param_groups[0]["lr"]


def test_an_optimizer_state_for_another_optimizer_is_refused_in_one_line():
    model, saved = tutorial_checkpoint(epoch=0)  # SGD with momentum
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(CheckpointError, match=r"for another optimizer than Adam \(it has dampening, momentum, nesterov\)"):
        checkpoint.check_optimizer_state(adam, saved["optimizer_state_dict"], "tutorial.pt")
    fewer = torch.optim.SGD(list(model.parameters())[:2], lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"covers \[\d+\] parameters per group, this model's optimizer \[2\]"):
        checkpoint.check_optimizer_state(fewer, saved["optimizer_state_dict"], "tutorial.pt")
    checkpoint.check_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                     saved["optimizer_state_dict"])


def test_resuming_an_earlier_checkpoint_retires_the_later_ones(tmp_path):
    model = nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, runtime(), keep=10, log=lambda text: None)
    for step in (5, 10, 15):
        ckpt.save(model=model, global_step=step)
        ckpt.wait()
    logged = []
    resumed = Checkpointer(tmp_path, runtime(), log=logged.append).load(tmp_path / "step-00000010.pt", model=model)
    assert resumed.global_step == 10
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000010.pt", "step-00000005.pt"]
    assert (tmp_path / "step-00000015.pt.stale").exists() and "past the step this run resumes from" in logged[0]


def test_the_module_docstring_example_runs():
    import doctest

    from ddpkit import checkpoint

    failures, tried = doctest.testmod(checkpoint, raise_on_error=False, verbose=False)
    assert tried >= 3 and failures == 0  # the imports and the whole with-block


# ------------------------------------------------------------------------------------ ddpkit checkpoint export


def test_export_writes_the_checkpoints_model_as_model_pt_is(tmp_path, capsys):
    from conftest import train_here
    from ddpkit.app.cli import main

    run = tmp_path / "run"
    state, _ = train_here(run, "--data", "synthetic:64", "--model", "convnet", "--batch-size", "16", "--epochs", "1")
    for source in (run, run / "checkpoints", run / "checkpoints" / "step-00000004.pt"):
        assert main(["checkpoint", "export", str(source), str(tmp_path / "exported.pt")]) == 0
        assert "wrote" in capsys.readouterr().out
        exported = torch.load(tmp_path / "exported.pt", weights_only=True)
        assert exported.keys() == state.keys() and all(torch.equal(exported[k], state[k]) for k in state)
    model = ConvNet(in_channels=3, num_classes=10, image_size=32)
    model.load_state_dict(torch.load(tmp_path / "exported.pt", weights_only=True))  # into the bare model


def test_export_takes_the_tutorials_layout_with_ddps_prefix(tmp_path):
    model = nn.Linear(3, 2)
    torch.save({"model_state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 4},
               tmp_path / "tutorial.pt")
    chosen, count = checkpoint.export_model(tmp_path / "tutorial.pt", tmp_path / "model.pt")
    assert (chosen, count) == (tmp_path / "tutorial.pt", 2)
    assert torch.load(tmp_path / "model.pt", weights_only=True).keys() == {"weight", "bias"}


def test_export_mistakes_are_one_line(tmp_path, capsys):
    from ddpkit.app.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["checkpoint", "export", str(tmp_path / "empty"), str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err == f"ddpkit: error: {tmp_path / 'empty'} holds no checkpoint (step-* files or folders)\n"
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    assert main(["checkpoint", "export", str(tmp_path / "junk.pt"), str(tmp_path / "m.pt")]) == 2
    assert "is not a checkpoint: torch.save writes a zip archive" in capsys.readouterr().err
    assert main(["checkpoint", "export", str(tmp_path / "junk.pt"), str(tmp_path)]) == 2
    assert f"{tmp_path} is a folder; give the file to write" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()
