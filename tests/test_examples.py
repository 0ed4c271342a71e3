"""Run every script in examples/ for real: 2 CPU processes (gloo), tiny sizes, through the real launchers.

Each example is started as ``python -m ddpkit run --nproc-per-node 2 ...`` (conftest.run_ddpkit: warm), the spawn
demo as ``python examples/mp_spawn_demo.py``, which starts its own processes. The checks go beyond "it exited 0":
rank-0-only logging (each log line appears once, not once per process), the training set split over the ranks (the
step count per epoch), the validation set counted exactly once, the replicas in sync, and the checkpoint loadable
into the bare model.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_command, run_ddpkit

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 120  # per example; each takes ~10-20 s on 2 cores
# ddpkit.zoo.load_digits holds out 20% of scikit-learn's 1,797 digits (computed here without importing sklearn).
DIGITS_VAL_SIZE = round(1797 * 0.2)


def passed(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit status {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    return result


def run_example(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python ARGS``, and what it starts as Python (mp.spawn's processes), forked from a warm interpreter."""
    return passed(run_command([sys.executable, *args], timeout=TIMEOUT_S, cwd=cwd, warm=True))


def ddpkit_run(script: str, *script_args: str, cwd: Path) -> str:
    """The standard output of ``ddpkit run --nproc-per-node 2 examples/SCRIPT``: rank 0's lines as they are, the other
    ranks' prefixed ``[rank<N>]:`` (``count_lines`` of an unprefixed pattern counts rank 0's)."""
    return passed(run_ddpkit("run", "--nproc-per-node", "2", str(EXAMPLES / script), *script_args, timeout=TIMEOUT_S,
                             cwd=cwd)).stdout


def count_lines(stdout: str, pattern: str) -> int:
    return sum(1 for line in stdout.splitlines() if re.fullmatch(pattern, line))


def test_random_data_convnet(tmp_path):
    # 64 samples / (8 per process x 2 processes) = 4 steps per epoch (one process would take 8), each printed once.
    out = ddpkit_run("random_data_convnet.py", "--batch-size", "8", "--epochs", "2", "--samples", "64",
                     "--device", "cpu", cwd=tmp_path)
    assert count_lines(out, r"ddp: 2 process\(es\), a global batch of 16") == 1, out
    steps = re.findall(r"^epoch (\d) step (\d+): loss \S+ \(this process's share\)$", out, flags=re.M)
    assert steps == [(str(epoch), str(step)) for epoch in (0, 1) for step in range(4)], out
    # Every sample counted once over the two processes; the red channel tells the classes apart: the loss falls.
    means = [float(mean) for mean in re.findall(r"^epoch \d: mean loss (\S+) over 64 samples$", out, flags=re.M)]
    assert len(means) == 2 and means[1] < means[0], out


def test_mnist_cnn_on_digits(tmp_path):
    out = ddpkit_run("mnist_cnn.py", "--digits", "--epochs", "1", "--batch-size", "64", "--lr", "1.0",
                     "--device", "cpu", cwd=tmp_path)
    assert count_lines(out, r"epoch 0: last batch loss \d+\.\d+") == 1, out
    tests = re.findall(r"^test: loss (\S+), accuracy (\S+)% \((\d+)/(\d+) samples\)$", out, flags=re.M)
    assert len(tests) == 1, out
    _, accuracy, _, count = tests[0]
    # Each rank evaluated its own share; summed over the ranks, every held-out digit counts exactly once.
    assert int(count) == DIGITS_VAL_SIZE, out
    assert float(accuracy) > 50.0, out  # 10 classes: chance is 10%; this one epoch reaches ~85%


def test_resnet_imagefolder_saves_a_loadable_checkpoint(tmp_path):
    from PIL import Image

    data = tmp_path / "images"
    for label, colour in (("cat", (200, 40, 40)), ("dog", (40, 40, 200))):
        (data / label).mkdir(parents=True)
        for i in range(6):
            shade = tuple(min(255, c + 8 * i) for c in colour)
            Image.new("RGB", (40, 40), shade).save(data / label / f"{i}.png")
    checkpoints = tmp_path / "checkpoints"
    out = ddpkit_run("resnet50_imagefolder.py", "--data", str(data), "--model", "resnet18", "--image-size", "32",
                     "--steps", "2", "--epochs", "1", "--batch-size", "2", "--checkpoint-dir", str(checkpoints),
                     "--device", "cpu", cwd=tmp_path)
    assert count_lines(out, r"Epoch \[1 / 1\], Step \[2 / 2\], Loss: \d+\.\d+") == 1, out
    assert count_lines(out, rf"saved {re.escape(str(checkpoints / 'epoch_1.pt'))}") == 1, out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_1.pt"]  # no temporary file left

    import torchvision

    state = torch.load(checkpoints / "epoch_1.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state)
    model = torchvision.models.resnet18(num_classes=2)
    model.load_state_dict(state)  # strict: every key, every shape


def test_mp_spawn_demo(tmp_path):
    result = run_example([str(EXAMPLES / "mp_spawn_demo.py"), "--nproc", "2", "--steps", "2", "--device", "cpu"],
                         cwd=tmp_path)
    out = result.stdout
    assert count_lines(out, r"step 0: loss \d+\.\d+ \(rank 0's batch\)") == 1, out
    assert count_lines(out, r"step 1: loss \d+\.\d+ \(rank 0's batch\)") == 1, out
    assert count_lines(
        out, r"2 processes via spawn, backend gloo, device cpu: parameters identical on every rank: True"
    ) == 1, out


def test_the_ddp_demo_without_ddpkit_shows_every_ranks_line_and_ends_well_even_where_unchanged_stands_aside(tmp_path):
    # A torchrun-style script with nothing of ddpkit in it: each rank's last line on the console, rank 1's prefixed.
    # Asked to run it --unchanged, ddpkit sees that it starts its own group and runs it as it is, saying so once.
    done = run_ddpkit("run", "--unchanged", "--nproc-per-node", "2", str(EXAMPLES / "ddp_demo.py"), timeout=180,
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert count_lines(out, r"rank 0 of 2 done") == 1 and count_lines(out, r"\[rank1\]: rank 1 of 2 done") == 1, out
    assert count_lines(done.stderr, r".*--unchanged stood aside: .*ddp_demo\.py distributes itself "
                                    r"\(it calls init_process_group\), and runs as under ddpkit run") == 1, done.stderr


def test_model_parallel_inside_ddp(tmp_path):
    out = ddpkit_run("model_parallel_ddp.py", "--steps", "3", cwd=tmp_path)
    for step in range(3):
        assert count_lines(out, rf"step {step}: loss \d+\.\d+ \(rank 0's batch\)") == 1, out
    # Each rank trained on its own batches; DDP's averaged gradients kept the split replicas identical.
    assert count_lines(out, r"fc1 on cpu, fc2 on cpu; replicas identical: True") == 1, out


def test_pytorch_examples_mnist(tmp_path):
    out = ddpkit_run("pytorch_examples_mnist.py", "--epochs", "2", "--log-interval", "10", "--save-model", cwd=tmp_path)
    # 1,437 training digits / (64 x 2 ranks) = 11 steps per epoch: lines at batches 0 and 10, by rank 0 alone.
    assert count_lines(out, r"Train Epoch: 1 \[\d+/1408 \(\d+%\)\]\tLoss: \d+\.\d+") == 2, out
    tests = re.findall(r"^Test set: Average loss: (\S+), Accuracy: (\d+)/(\d+) \((\d+)%\)$", out, flags=re.M)
    assert len(tests) == 2 and all(int(total) == DIGITS_VAL_SIZE for _, _, total, _ in tests), out
    assert int(tests[-1][1]) > DIGITS_VAL_SIZE // 2, out  # chance is a tenth; two epochs reach ~90%
    sys.path.insert(0, str(EXAMPLES))
    try:
        from pytorch_examples_mnist import Net
    finally:
        sys.path.remove(str(EXAMPLES))
    Net().load_state_dict(torch.load(tmp_path / "mnist_cnn.pt", weights_only=True))


def test_cifar10_tutorial(tmp_path):
    out = ddpkit_run("cifar10_tutorial.py", "--epochs", "1", "--print-every", "60", "--batch-size", "8", cwd=tmp_path)
    # 1,437 digits / (8 x 2 ranks) = 89 steps: running-loss lines at mini-batches 60, printed once.
    assert count_lines(out, r"\[1,    60\] loss: \d+\.\d+") == 1 and count_lines(out, "Finished Training") == 1, out
    total = re.findall(r"^Accuracy of the network on the (\d+) test images: (\d+) %$", out, flags=re.M)
    assert total and int(total[0][0]) == DIGITS_VAL_SIZE, out
    assert count_lines(out, r"Accuracy for class: \d     is \d+\.\d %") == 10, out
    assert set(torch.load(tmp_path / "cifar_net.pth", weights_only=True)) >= {"conv1.weight", "fc3.bias"}


def tagged_lines(path: Path) -> dict[str, int]:
    """How many lines of the file carry each ``# [feature]`` tag (in comments only)."""
    import io
    import tokenize
    from collections import Counter

    counts: Counter = Counter()
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.COMMENT:
            counts.update(set(re.findall(r"\[([a-z]+)\]", token.string)))
    return dict(counts)


def test_the_library_docs_count_the_lines_each_feature_takes():
    table = re.findall(r"^\| (\w+) \| (\d+) \| (\d+) \|$", (REPO / "docs" / "library.md").read_text(), flags=re.M)
    by_hand, library = tagged_lines(EXAMPLES / "by_hand_loop.py"), tagged_lines(EXAMPLES / "library_loop.py")
    assert set(by_hand) == {feature for feature, _, _ in table}  # every feature in the table, none left out
    assert [(feature, by_hand.get(feature, 0), library.get(feature, 0)) for feature, _, _ in table] == \
        [(feature, int(hand), int(ours)) for feature, hand, ours in table]


@pytest.mark.slow  # two launches, about 25 s: the companion of docs/library.md's comparison
def test_by_hand_loop_trains_under_fsdp_and_resumes_at_the_next_epoch(tmp_path):
    args = ["--strategy", "fsdp", "--amp", "bf16", "--accumulate", "2", "--out", str(tmp_path / "out")]
    first = ddpkit_run("by_hand_loop.py", *args, "--epochs", "1", cwd=tmp_path)
    resumed = ddpkit_run("by_hand_loop.py", *args, "--epochs", "2", "--resume", str(tmp_path / "out" / "checkpoint.pt"),
                         cwd=tmp_path)
    pattern = rf"epoch {{}}: val_loss \d+\.\d+ val_acc (\d+\.\d+)% \({DIGITS_VAL_SIZE} samples\)"
    assert count_lines(first, pattern.format(1)) == 1 and count_lines(first, pattern.format(2)) == 0, first
    assert count_lines(resumed, pattern.format(1)) == 0 and count_lines(resumed, pattern.format(2)) == 1, resumed
    assert float(re.search(pattern.format(2), resumed).group(1)) > 80, resumed
    from ddpkit import zoo

    model = zoo.ConvNet(in_channels=3, num_classes=10, image_size=32)
    model.load_state_dict(torch.load(tmp_path / "out" / "model.pt", weights_only=True))
