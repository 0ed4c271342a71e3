"""`ddpkit train` on 2 real processes (torchrun's agent, gloo): DDP must train exactly like one process."""

import json

import pytest
import torch

from conftest import max_relative_difference, train, train_here
from ddpkit.zoo import Net

# The real digits (1,438 train / 359 val, an odd number: the ranks hold 180 and 179) with convnet, which
# has no BatchNorm, ReLU or max-pool: 22 steps of SGD that are still learning at the end (val_acc ~94%,
# train loss ~0.95), so every step's gradient counts in the comparison.
DIGITS = ["--data", "digits", "--model", "convnet", "--optimizer", "sgd", "--lr", "0.01", "--epochs", "1"]


@pytest.fixture(scope="module")
def one_process_batch_64(tmp_path_factory):
    return train_here(tmp_path_factory.mktemp("one"), *DIGITS, "--batch-size", "64")


def test_two_processes_equal_one_process_with_twice_the_batch(one_process_batch_64, ddp_digits):
    # The shared 2-process run (conftest.ddp_digits: 2 x 32, checkpointing, which changes nothing:
    # test_resume.test_checkpointing_does_not_change_the_run) against 1 x 64.
    state_1, rows_1 = one_process_batch_64
    _, state_2, rows_2, _ = ddp_digits
    assert rows_1[0]["steps"] == rows_2[0]["steps"] == 22
    assert rows_2[0]["world_size"] == 2 and rows_2[0]["global_batch"] == 64
    assert 0.5 < rows_1[0]["val_acc"] < 0.99 and rows_1[0]["train_loss"] > 0.1  # still learning: not vacuous
    assert max_relative_difference(state_2, state_1) <= 1e-5
    # Exact evaluation: every one of the 359 validation samples counted once, as on one process.
    assert rows_1[0]["val_count"] == rows_2[0]["val_count"] == 359
    assert rows_1[0]["val_acc"] == rows_2[0]["val_acc"]
    assert rows_2[0]["val_loss"] == pytest.approx(rows_1[0]["val_loss"], rel=1e-5)
    assert rows_2[0]["train_loss"] == pytest.approx(rows_1[0]["train_loss"], rel=1e-5)


def test_accumulation_under_the_spawn_launcher_equals_the_larger_batch(tmp_path, one_process_batch_64):
    # 2 processes x batch 16 x 2 micro-steps (all-reduce skipped on the first) == 1 process x batch 64,
    # with the processes started the tutorials' way (torch.multiprocessing.spawn) instead of torchrun's.
    # (That the all-reduce really is skipped is counted in test_library.)
    state_1, _ = one_process_batch_64
    state_acc, rows = train(tmp_path, *DIGITS, "--nproc-per-node", "2", "--batch-size", "16", "--accumulate", "2",
                            "--launcher", "spawn")
    assert rows[0]["world_size"] == 2 and rows[0]["global_batch"] == 64 and rows[0]["steps"] == 22
    assert max_relative_difference(state_acc, state_1) <= 1e-5


def test_static_graph_with_accumulation(tmp_path, one_process_batch_64):
    # static_graph records the graph on the first backward, which therefore must not be a no_sync one.
    state_1, _ = one_process_batch_64
    state, _ = train(tmp_path, *DIGITS, "--nproc-per-node", "2", "--batch-size", "16", "--accumulate", "2",
                     "--static-graph")
    assert max_relative_difference(state, state_1) <= 1e-5


def test_accumulation_on_one_process(tmp_path, one_process_batch_64):
    state_1, _ = one_process_batch_64
    state_acc, _ = train_here(tmp_path, *DIGITS, "--batch-size", "8", "--accumulate", "8")
    assert max_relative_difference(state_acc, state_1) <= 1e-5


def test_metrics_describe_the_saved_model_even_with_unsynchronised_batchnorm(default_run):
    # Without --sync-bn each rank ends with its own BatchNorm running statistics (the default run's net has
    # BatchNorm); the reported val_acc must be that of model.pt (rank 0's), not a mixture of the ranks' models.
    from ddpkit.zoo import load_digits

    _, folder = default_run
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    model = Net()
    model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))
    model.eval()
    val = load_digits(channels=1, image_size=28).val
    images, labels = val.tensors
    with torch.no_grad():
        output = model(images)
    loss = torch.nn.functional.cross_entropy(output, labels).item()
    assert rows[-1]["val_count"] == len(labels)
    assert rows[-1]["val_acc"] == (output.argmax(1) == labels).sum().item() / len(labels)
    # The loss moves with the running statistics where the accuracy may not.
    assert rows[-1]["val_loss"] == pytest.approx(loss, rel=1e-6)


def test_sync_batchnorm_on_cpu_makes_batchnorm_models_equivalent(tmp_path):
    # Net has BatchNorm: per-process statistics differ from the global batch's unless synchronised.
    # Synthetic noise images, not digits: the digits' flat backgrounds make exact ties in ReLU and max-pool,
    # where a last-bit difference between batch sizes reroutes a gradient and float noise grows.
    # BatchNorm divides by the batch's spread, which magnifies float rounding from step to step; 4 steps
    # keep that below 1e-4 while unsynchronised BatchNorm is already ~5e-3 away.
    common = ["--data", "synthetic:256", "--model", "net", "--optimizer", "sgd", "--lr", "0.05", "--epochs", "1"]
    state_1, rows_1 = train_here(tmp_path / "one", *common, "--batch-size", "64")
    state_2, rows_2 = train(tmp_path / "sync", *common, "--nproc-per-node", "2", "--batch-size", "32", "--sync-bn")
    assert rows_1[0]["steps"] == rows_2[0]["steps"] == 4
    assert max_relative_difference(state_2, state_1) <= 1e-4
    state_plain, _ = train(tmp_path / "plain", *common, "--nproc-per-node", "2", "--batch-size", "32")
    # Without --sync-bn the runs really do differ: the comparison above is not vacuous.
    assert max_relative_difference(state_plain, state_1) > 1e-3


def test_default_run_learns_digits_and_writes_the_contract_files(default_run):
    result, tmp_path = default_run
    # --debug (--log-level debug): every rank's messages, each line led by its rank, on stderr; the
    # epoch lines are the command's output, on stdout, printed by rank 0 alone.
    for rank in (0, 1):
        assert f"[rank{rank}]: ddpkit: local rank {rank}, pid " in result.stderr
        assert result.stderr.count(f"[rank{rank}]: ddpkit: 2 process(es) via torchrun") == 1
    assert result.stderr.count("process group up, backend gloo, device cpu") == 2
    assert result.stderr.count("data: cpu, model: cpu") == 2 * 2  # each rank, each epoch
    assert result.stdout.count("epoch 2/2:") == 1 and "ddpkit:" not in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [0, 1]
    for key in ("epoch", "train_loss", "val_loss", "val_acc", "val_count", "images_per_sec", "world_size", "global_batch"):
        assert key in rows[-1]
    assert rows[-1]["world_size"] == 2 and rows[-1]["global_batch"] == 64 and rows[-1]["val_count"] == 359
    assert rows[-1]["val_acc"] >= 0.95
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state)
    Net().load_state_dict(state)  # a plain state_dict for the bare model


def test_each_rank_keeps_its_whole_output_in_a_file(ddp_digits):
    folder, _, _, result = ddp_digits
    rank0, rank1 = ((folder / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1))
    # Rank 1's info lines, which the console leaves out (it shows rank 0's, and every rank's warnings and errors).
    assert rank1.count("[rank1]: ddpkit: 2 process(es) via torchrun, backend gloo") == 1
    assert "[rank1]: ddpkit: 2 process(es)" not in result.stderr
    # Rank 0's file holds what it wrote to the console, stdout and stderr in one, each line once.
    assert rank0.count("[rank0]: ddpkit: 2 process(es) via torchrun") == 1 and "[rank1]" not in rank0
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert epochs and all(rank0.count(line) == 1 for line in epochs) and "epoch " not in rank1
