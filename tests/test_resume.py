"""Resume, restarts and preemption for real: `ddpkit train` on 2 processes (torchrun's agent, gloo).

The yardstick is bit-identity: on CPU an interrupted and resumed run must end with exactly the model.pt
of the uninterrupted one. `net` has BatchNorm (its buffers must continue too); the user's loop at the
end has dropout, so its random stream must continue exactly.
"""

import json
import re
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import finish, run_ddpkit, start_train, train

from ddpkit import checkpoint
from ddpkit.zoo import Net

RUN = ["--model", "net", "--data", "digits", "--epochs", "2", "--nproc-per-node", "2"]  # 22 steps per epoch
SKIPPED = "skipped the checkpoint at step {}: the previous one is still being written"  # what rank 0 says


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_run):
    """The uninterrupted run, with a checkpoint every 5 steps kept, and the same run without checkpoints
    (conftest's default run: RUN's settings are ddpkit train's defaults, for 2 epochs), and the steps whose mid-epoch
    checkpoint was skipped: one that comes while the previous one is still being written in the background is, and
    rank 0 says so. On a loaded machine some are (steps 10 and 15, once in CI), so the tests read the ones written."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_ddpkit("train", "--output-dir", str(folder), "--no-progress", *RUN, "--checkpoint-every", "5",
                        "--keep-checkpoints", "100")
    assert result.returncode == 0, result.stdout + result.stderr
    state = torch.load(folder / "model.pt", weights_only=True)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    plain_rows = [json.loads(line) for line in (default_run[1] / "metrics.jsonl").read_text().splitlines()]
    assert plain_rows[-1]["world_size"] == 2 and len(plain_rows) == 2  # what RUN asks for
    plain = torch.load(default_run[1] / "model.pt", weights_only=True)
    skipped = [step for step in range(5, 44, 5) if SKIPPED.format(step) in result.stderr]
    return folder, state, rows, plain, skipped


def steps_saved(folder: Path) -> list[int]:
    """The steps of the checkpoints in ``folder``/checkpoints, the oldest first."""
    return sorted(checkpoint.step_of(path) for path in checkpoint.list_checkpoints(folder / "checkpoints"))


def last_mid_epoch(folder: Path, before: int = 44) -> int:
    """The step of the newest checkpoint before step ``before`` that is not an epoch's end (22, 44)."""
    return max(step for step in steps_saved(folder) if step < before and step % 22)


def test_checkpointing_does_not_change_the_run(reference):
    folder, state, _, plain, skipped = reference
    assert identical(state, plain)
    names = [p.name for p in checkpoint.list_checkpoints(folder / "checkpoints")]
    # Every 5 steps, plus each epoch's end (22, 44); the step that ends an epoch is saved once. The first is never
    # skipped (nothing is being written before it), nor an epoch's end (it waits for the write before it).
    assert 5 not in skipped
    assert names == [checkpoint.checkpoint_name(s) for s in (44, 40, 35, 30, 25, 22, 20, 15, 10, 5) if s not in skipped]
    assert checkpoint.read_pointer(folder / "checkpoints").name == "step-00000044.pt"
    step = last_mid_epoch(folder)  # 40 where none was skipped: the second epoch's
    saved = checkpoint.load_file(folder / "checkpoints" / checkpoint.checkpoint_name(step))
    assert saved["progress"] == {"epoch": step // 22, "samples": step % 22 * 64, "global_step": step, "world_size": 2,
                                 "global_batch": 64}
    assert len(saved["ranks"]) == 2 and {"rng", "partial"} <= saved["ranks"][1].keys()
    assert saved["config"]["model"] == "net" and saved["versions"]["torch"] == str(torch.__version__)
    assert {"optimizer", "scheduler", "scaler"} <= saved.keys()


# Mid-epoch in the first epoch (its last checkpoint there: 20 where none was skipped); 22: an epoch boundary. The
# fall-back below resumes mid-epoch in the second; it ends bit-identical too. (kill -9 and a restart: test_parallelism,
# under FSDP.)
@pytest.mark.parametrize("where", ["mid-epoch", "epoch end"])
def test_resume_is_bit_identical(tmp_path, reference, where):
    folder, state, rows, _, _ = reference
    step = last_mid_epoch(folder, before=22) if where == "mid-epoch" else 22
    result = run_ddpkit("train", "--output-dir", str(tmp_path), "--no-progress", *RUN,
                        "--resume", str(folder / "checkpoints" / checkpoint.checkpoint_name(step)))
    assert result.returncode == 0, result.stderr
    assert f"resumed from {folder / 'checkpoints' / checkpoint.checkpoint_name(step)}" in result.stderr
    assert identical(torch.load(tmp_path / "model.pt", weights_only=True), state)
    resumed_rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The epoch it resumed in reports the same loss over all its steps, and the next one is unchanged.
    assert resumed_rows[-1]["train_loss"] == rows[-1]["train_loss"]
    assert resumed_rows[-1]["val_acc"] == rows[-1]["val_acc"]


def test_resume_auto_falls_back_past_a_corrupt_newest_checkpoint(tmp_path, reference):
    folder, state, rows, _, _ = reference
    shutil.copytree(folder / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "step-00000044.pt").unlink()
    *_, previous, torn = steps_saved(tmp_path)  # 35 and 40 where none was skipped
    newest = tmp_path / "checkpoints" / checkpoint.checkpoint_name(torn)
    newest.write_bytes(newest.read_bytes()[:5000])  # torn, as by a disk that filled up
    checkpoint.write_pointer(tmp_path / "checkpoints", newest)
    result = run_ddpkit("train", "--output-dir", str(tmp_path), "--no-progress", *RUN, "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert f"ddpkit: warning: skipping checkpoint {newest}" in result.stderr
    assert "resumed from" in result.stderr and checkpoint.checkpoint_name(previous) in result.stderr
    assert identical(torch.load(tmp_path / "model.pt", weights_only=True), state)
    resumed_rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert resumed_rows[-1]["train_loss"] == rows[-1]["train_loss"] and resumed_rows[-1]["val_acc"] == rows[-1]["val_acc"]


def on_one_process(capsys, folder: Path, *args: str) -> tuple[int, str]:
    """``ddpkit train`` with RUN's settings on one process, in this process (no launcher, no workers, the
    same code): its exit status and what it said on stderr."""
    from ddpkit.app.cli import main

    capsys.readouterr()
    status = main(["train", "--output-dir", str(folder), "--no-progress", *RUN, "--nproc-per-node", "1", *args])
    return status, capsys.readouterr().err


def test_no_readable_checkpoint_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000003.pt").write_bytes(b"not a zip file")
    # One process is enough to read it (that rank 0 alone says such an error: the next test).
    status, said = on_one_process(capsys, tmp_path, "--resume", "auto")
    assert status == 2
    assert "ddpkit: error: no usable checkpoint in" in said


def test_a_checkpoint_of_another_model_is_refused_with_what_differs(tmp_path, reference):
    folder = reference[0]
    result = run_ddpkit("train", "--output-dir", str(tmp_path), "--no-progress", *RUN, "--model", "convnet",
                        "--resume", str(folder / "checkpoints"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "ddpkit: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("[rank0]: "), result.stderr  # said once, by rank 0
    assert "is for another model: 4 missing key(s): conv2d.weight" in errors[0]
    assert "18 unexpected key(s): conv1.weight" in errors[0] and "Traceback" not in result.stderr


def test_the_tutorials_checkpoint_resumes_at_the_next_epoch(tmp_path, capsys):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    # What the tutorials write from rank 0: the DDP wrapper's state_dict, with its "module." prefix.
    torch.save({"epoch": 0, "model_state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
                "optimizer_state_dict": optimizer.state_dict()}, tmp_path / "epoch_0.pt")
    # The format matters here, not the world size: one process reads it as two would.
    status, said = on_one_process(capsys, tmp_path / "out", "--resume", str(tmp_path / "epoch_0.pt"))
    assert status == 0, said
    assert "(tutorial): continuing at epoch 2" in said
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1]


def test_resuming_on_another_world_size_says_what_it_did_to_the_global_batch(tmp_path, reference, capsys):
    folder = reference[0]
    step = last_mid_epoch(folder)  # 40 where none was skipped
    resume = folder / "checkpoints" / checkpoint.checkpoint_name(step)
    status, said = on_one_process(capsys, tmp_path, "--resume", str(resume))
    assert status == 0, said
    assert "written with global batch 64 (2 process(es)); this run's is 32 (1 x 32)" in said
    assert "pass --batch-size 64" in said
    # Its epoch continues after the samples the two processes had consumed (64 a step), at batch 32: twice the steps.
    done = step % 22 * 64
    assert f"after {done} samples (step {done // 32} of 44)" in said
    # net has BatchNorm: even with --batch-size 64 the run would not go on as on 2 processes. Said as a warning.
    assert "ddpkit: warning: the model has BatchNorm, which normalises each process's own batch: 1 process(es) " \
           "of 32 now, 2 before" in said
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["epoch"] == step // 22 and rows[0]["resumed_at_step"] == done // 32


def _signal_when(proc: subprocess.Popen, ready, signals: list[int]) -> tuple[str, str, float]:
    """Once ``ready()``, send ``signals`` to the launcher 10 ms apart; return its output and how long it took."""
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never got ready for the signal"
            time.sleep(0.01)
        sent = time.monotonic()
        for number in signals:
            proc.send_signal(number)
            time.sleep(0.01)
        stdout, stderr = finish(proc, timeout=60)
        return stdout, stderr, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            finish(proc, timeout=1)


LONG = ["--model", "net", "--data", "digits", "--epochs", "3", "--nproc-per-node", "2"]


@pytest.mark.slow  # a run stopped, then resumed to the end: about 35 s
def test_sigterm_checkpoints_at_one_step_on_every_rank_and_the_run_resumes_exactly(tmp_path, tmp_path_factory):
    proc = start_train(tmp_path, *LONG)
    first_epoch_done = lambda: (tmp_path / "metrics.jsonl").exists() and (tmp_path / "metrics.jsonl").read_text()
    stdout, stderr, took = _signal_when(proc, first_epoch_done, [signal.SIGTERM])
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr
    assert took < 15, f"took {took:.1f} s to stop"
    # Every rank says where it stopped (a warning, shown from every rank), each line whole.
    stops = re.findall(r"\[rank(\d)\]: ddpkit: warning: stopped by SIGTERM at epoch \d+, step (\d+);", stderr)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], stderr
    steps = {step for _, step in stops}
    assert len(steps) == 1  # both ranks stopped after the same step
    step = int(steps.pop())
    assert 22 < step < 3 * 22
    assert checkpoint.read_pointer(tmp_path / "checkpoints").name == checkpoint.checkpoint_name(step)
    assert not (tmp_path / "model.pt").exists()

    resumed = run_ddpkit("train", "--output-dir", str(tmp_path), "--no-progress", *LONG, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    uninterrupted, _ = train(tmp_path_factory.mktemp("long"), *LONG)
    assert identical(torch.load(tmp_path / "model.pt", weights_only=True), uninterrupted)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(3))


def test_a_fresh_start_sets_the_earlier_checkpoints_aside_and_a_second_ctrl_c_stops_at_once(tmp_path, reference):
    shutil.copytree(reference[0] / "checkpoints", tmp_path / "checkpoints")  # an earlier run's
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    proc = start_train(tmp_path, *LONG, "--epochs", "100")
    # The folder is renamed in one step, so once checkpoints.prev exists, checkpoints/ holds this run's only.
    saved_one = lambda: (tmp_path / "checkpoints.prev").exists() and checkpoint.list_checkpoints(tmp_path / "checkpoints")
    stdout, stderr, took = _signal_when(proc, saved_one, [signal.SIGINT, signal.SIGINT])
    assert proc.returncode == 128 + signal.SIGINT, stdout + stderr
    assert took < 10
    assert "ddpkit: stopped by signal SIGINT" in stderr
    assert "[rank0]: ddpkit: starting fresh (no --resume); the earlier run's checkpoints were moved to" in stderr
    # At the default level, rank 1 says nothing but warnings and errors.
    assert not re.search(r"\[rank1\]: ddpkit: (?!warning: |error: )", stderr), stderr
    assert len(checkpoint.list_checkpoints(tmp_path / "checkpoints.prev")) == len(steps_saved(reference[0]))
    assert "{}" not in (tmp_path / "metrics.jsonl").read_text().splitlines()  # the earlier run's lines are gone


SLOW_SAVE = textwrap.dedent(
    """
    import sys, time
    import torch, torch.nn as nn
    import ddpkit
    from ddpkit.checkpoint import atomic_save

    def slow_disk(obj, path):  # far slower than the collective timeout below
        time.sleep(8)
        atomic_save(obj, path)

    with ddpkit.distributed(timeout_s=3) as rt:
        torch.manual_seed(0)
        model = ddpkit.prepare_model(nn.Linear(4, 2), rt)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = ddpkit.Checkpointer(sys.argv[1], rt)
        for step in range(20):
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 2:
                ckpt.save(model=model, optimizer=optimizer, global_step=step + 1)
            time.sleep(0.1)
        ckpt.wait()  # every rank waits here, for as long as the write takes
        ddpkit.print0(rt, "done")
    """
)


def test_a_slow_checkpoint_write_makes_no_rank_time_out(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SAVE)
    result = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path / "ckpt"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "done" in result.stdout
    assert checkpoint.read_pointer(tmp_path / "ckpt").name == "step-00000003.pt"


OWN_LOOP = textwrap.dedent(
    """
    # A user's own loop with ddpkit's checkpoints; stops (as if killed) after --crash-after steps.
    import sys
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.data import TensorDataset
    import ddpkit

    folder, crash_after = sys.argv[1], int(sys.argv[2])
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(200, 6, generator=generator), torch.randint(0, 3, (200,), generator=generator))
    with ddpkit.distributed() as rt:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        ckpt = ddpkit.Checkpointer(folder + "/checkpoints", rt)
        resumed = ckpt.load("auto", model=model)
        model = ddpkit.prepare_model(model, rt)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = ddpkit.train_loader(data, batch_size=10, runtime=rt, seed=0)
        start, steps = 0, 0
        if resumed is not None:
            resumed.restore(optimizer=optimizer, loader=loader)
            start = resumed.epoch
            ddpkit.print0(rt, f"resumed at epoch {resumed.epoch} after {resumed.samples} samples")
        for epoch in range(start, 3):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                steps += 1
                if steps == crash_after:
                    ckpt.save(model=model, optimizer=optimizer, loader=loader)
                    ckpt.wait()
                    sys.exit(3)
            ckpt.save(model=model, optimizer=optimizer, loader=loader)
        ckpt.wait()
        if rt.is_main:
            ddpkit.atomic_save(ddpkit.model_state_dict(model), folder + "/model.pt")
    """
)


@pytest.mark.slow  # three runs of a script: about 20 s
def test_the_library_resumes_a_users_own_loop_exactly(tmp_path):
    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP)
    whole = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path / "whole"), "0")
    assert whole.returncode == 0, whole.stderr
    crashed = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path / "cut"), "13")  # epoch 2, step 3
    assert crashed.returncode == 1
    finished = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path / "cut"), "0")
    assert finished.returncode == 0, finished.stderr
    assert "resumed at epoch 1 after 60 samples" in finished.stdout
    assert identical(torch.load(tmp_path / "cut" / "model.pt", weights_only=True),
                     torch.load(tmp_path / "whole" / "model.pt", weights_only=True))
