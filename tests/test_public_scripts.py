"""Three well-known public training scripts, converted to ddpkit with their every feature kept (examples/), run on 2
processes, and the line counts of docs/library.md's comparison with Accelerate and Lightning Fabric recounted.

The single-device originals and the Accelerate and Fabric conversions are in benchmarks/conversions/, with the data
maker these runs share (MNIST files made from scikit-learn's digits, a small image folder, a character corpus).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, public_scripts_data, run_ddpkit
from ddpkit.core.version import torch_at_least

CONVERSIONS = REPO / "benchmarks" / "conversions"
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return public_scripts_data(tmp_path_factory.mktemp("data"))


def ddpkit_run(script: str, *args: str, cwd: Path) -> str:
    done = run_ddpkit("run", "--nproc-per-node", "2", str(EXAMPLES / script), *args, timeout=180, cwd=cwd)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


def lines(out: str, pattern: str) -> list[re.Match]:
    return [match for line in out.splitlines() if (match := re.fullmatch(pattern, line))]


def test_pytorch_examples_imagenet_trains_evaluates_top5_exactly_and_resumes(data, tmp_path):
    # A small torchvision model of the script's own choices (its default, resnet18, has 11 M weights to all-reduce
    # and save: 8 s more of the machine's CPU for the same checks).
    common = [str(data / "imagefolder"), "-a", "shufflenet_v2_x0_5", "--num-classes", "6", "--image-size", "32", "-j",
              "0", "-b", "8", "--lr", "0.01", "-p", "100", "--seed", "0"]
    first = ddpkit_run("imagenet_main.py", *common, "--epochs", "1", cwd=tmp_path)
    summaries = lines(first, r" \*   Acc@1 (\S+) Acc@5 (\S+) \((\d+) samples\)")
    assert len(summaries) == 1 and summaries[0].group(3) == "37", first  # 37 validation images, each once
    assert len(lines(first, r"Epoch: \[0\]\[\s*1/\d+\].*")) == 1, first  # rank 0's progress line, once
    assert (tmp_path / "checkpoint.pth.tar").is_file() and (tmp_path / "model_best.pth.tar").is_file()
    resumed = ddpkit_run("imagenet_main.py", *common, "--epochs", "2", "--resume", "checkpoint.pth.tar", cwd=tmp_path)
    assert lines(resumed, r"=> loaded checkpoint 'checkpoint.pth.tar' \(epoch 1\)") and \
        not lines(resumed, r"Epoch: \[0\].*") and lines(resumed, r"Epoch: \[1\]\[\s*1/\d+\].*"), resumed
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert state["epoch"] == 2 and state["scheduler"]["last_epoch"] == 2


@pytest.mark.skipif(not torch_at_least("2.6"), reason="pytorch/examples' VAE script uses torch.accelerator (torch>=2.6)")
def test_pytorch_examples_vae_sums_its_test_loss_over_the_whole_set(data, tmp_path):
    out = ddpkit_run("vae_main.py", "--data", str(data), "--epochs", "1", "--batch-size", "64", "--log-interval", "10",
                     cwd=tmp_path)
    # 1,696 training digits / (64 x 2 ranks) = 14 batches per rank: lines at batches 0 and 10, each once.
    progress = lines(out, r"Train Epoch: 1 \[(\d+)/1696 \(\d+%\)\]\tLoss: \d+\.\d+")
    assert [int(match.group(1)) for match in progress] == [0, 10 * 64 * 2], out
    average, test = lines(out, r"====> Epoch: 1 Average loss: (\S+)"), lines(out, r"====> Test set loss: (\S+)")
    assert len(average) == len(test) == 1 and 50 < float(test[0].group(1)) < 600, out
    assert {path.name for path in (tmp_path / "results").iterdir()} == {"reconstruction_1.png", "sample_1.png"}


def test_nanogpt_trains_with_accumulation_and_resumes_from_its_checkpoint(data, tmp_path):
    common = ["--dataset", str(data / "chargpt"), "--n_layer", "2", "--n_head", "2", "--n_embd", "32",
              "--block_size", "32", "--batch_size", "8", "--gradient_accumulation_steps", "4", "--eval_interval", "10",
              "--eval_iters", "4", "--log_interval", "5", "--warmup_iters", "2", "--lr_decay_iters", "30",
              "--learning_rate", "3e-3", "--min_lr", "3e-4", "--compile", "False", "--dtype", "bfloat16",
              "--device", "cpu", "--out_dir", "gpt"]
    first = ddpkit_run("nanogpt_train.py", *common, "--max_iters", "20", cwd=tmp_path)
    # 4 micro-steps of 8 x 32 tokens on one process: 2 each on 2 processes, the same tokens per iteration.
    assert lines(first, r"tokens per iteration will be: 1,024"), first
    losses = [float(match.group(1)) for match in lines(first, r"step \d+: train loss (\S+), val loss \S+")]
    assert len(losses) == 3 and losses[-1] < losses[0], first  # steps 0, 10, 20, each printed once
    assert len(lines(first, r"saving checkpoint to gpt")) == 2, first
    resumed = ddpkit_run("nanogpt_train.py", *common, "--max_iters", "30", "--init_from", "resume", cwd=tmp_path)
    assert lines(resumed, r"Resuming training from gpt") and lines(resumed, r"iter 25: loss \S+, time .*"), resumed
    assert not lines(resumed, r"iter 5: .*"), resumed  # it went on from step 20
    assert torch.load(tmp_path / "gpt" / "ckpt.pt", weights_only=False)["iter_num"] == 30


def test_the_library_docs_count_the_lines_each_conversion_changed():
    sys.path.insert(0, str(CONVERSIONS))
    try:
        import count
    finally:
        sys.path.remove(str(CONVERSIONS))
    counted = count.counts()
    table = re.findall(r"^\| (\w+) \(\d+\) \| (\d+) \+ (\d+) = \d+ \| (\d+) \+ (\d+) = \d+ \| (\d+) \+ (\d+) = \d+ \| 0\b.*\|$",
                       (REPO / "docs" / "library.md").read_text(), flags=re.M)
    assert {script: [int(n) for n in numbers] for script, *numbers in table} == {
        script: [n for library in ("accelerate", "fabric", "ddpkit") for n in counted[script][library]]
        for script in counted}
