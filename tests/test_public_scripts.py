"""Three well-known public training scripts converted to ddpkit with their every feature kept, run on 2 processes, and
the line counts of docs/library.md's comparison with Accelerate and Lightning Fabric recounted.

The originals stay in the corpus beside the repository (../shared/corpus: pytorch/examples' ImageNet trainer and VAE,
nanoGPT's train.py); the project keeps each conversion as its change (examples/*.patch for ddpkit's,
benchmarks/conversions/<script>/*.patch for Accelerate's and Fabric's), written out onto the original by
benchmarks/conversions/convert.py for each run. The data are made by benchmarks/conversions/make_data.py (MNIST files
made from scikit-learn's digits, a small image folder, a character corpus).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO, conversions, needs_corpus, public_scripts_data, run_ddpkit
from ddpkit.core.version import torch_at_least


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    needs_corpus()
    return public_scripts_data(tmp_path_factory.mktemp("data"))


def converted(script: str, folder: Path) -> Path:
    """ddpkit's conversion of ``script``, written into ``folder`` (its companions beside it)."""
    return conversions().write(script, "ddpkit", folder)


def ddpkit_run(path: Path, *args: str, cwd: Path) -> str:
    done = run_ddpkit("run", "--nproc-per-node", "2", str(path), *args, timeout=180, cwd=cwd)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


def lines(out: str, pattern: str) -> list[re.Match]:
    return [match for line in out.splitlines() if (match := re.fullmatch(pattern, line))]


@pytest.mark.skipif(not torch_at_least("2.6"), reason="pytorch/examples' ImageNet trainer uses torch.accelerator (2.6)")
def test_pytorch_examples_imagenet_trains_evaluates_top5_exactly_and_resumes(data, tmp_path):
    # A small torchvision model of the script's own choices (its default, resnet18, has 11 M weights to all-reduce
    # and save, at its 224-pixel crops: many seconds more of the machine's CPU for the same checks).
    script = converted("imagenet", tmp_path)
    common = [str(data / "imagefolder"), "-a", "shufflenet_v2_x0_5", "-j", "0", "-b", "8", "--lr", "0.01", "-p", "100",
              "--seed", "0"]
    first = ddpkit_run(script, *common, "--epochs", "1", cwd=tmp_path)
    # 37 validation images, each counted once over the two processes: Acc@1 and Acc@5 are multiples of 100/37.
    (summary,) = lines(first, r" \*   Acc@1 (\S+) Acc@5 (\S+)")
    assert all(abs(float(value) * 37 / 100 - round(float(value) * 37 / 100)) < 1e-3 for value in summary.groups())
    assert len(lines(first, r"Epoch: \[0\]\[\s*1/8\].*")) == 1, first  # rank 0's progress line, once: 60 images each
    assert (tmp_path / "checkpoint.pth.tar").is_file() and (tmp_path / "model_best.pth.tar").is_file()
    resumed = ddpkit_run(script, *common, "--epochs", "2", "--resume", "checkpoint.pth.tar", cwd=tmp_path)
    assert lines(resumed, r"=> loaded checkpoint 'checkpoint.pth.tar' \(epoch 1\)") and \
        not lines(resumed, r"Epoch: \[0\].*") and lines(resumed, r"Epoch: \[1\]\[\s*1/\d+\].*"), resumed
    state = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert state["epoch"] == 2 and state["scheduler"]["last_epoch"] == 2


@pytest.mark.skipif(not torch_at_least("2.6"), reason="pytorch/examples' VAE script uses torch.accelerator (torch>=2.6)")
def test_pytorch_examples_vae_sums_its_test_loss_over_the_whole_set(data, tmp_path):
    # It reads MNIST from ../data and writes its images into results/, which must be there.
    run = tmp_path / "run"
    script = converted("vae", run)
    (run / "results").mkdir()
    (tmp_path / "data").symlink_to(data)
    out = ddpkit_run(script, "--epochs", "1", "--batch-size", "32", "--log-interval", "10", cwd=run)
    # 1,696 training digits / (32 x 2 ranks) = 27 batches per rank: lines at batches 0, 10 and 20, each once.
    progress = lines(out, r"Train Epoch: 1 \[(\d+)/1696 \(\d+%\)\]\tLoss: \d+\.\d+")
    assert [int(match.group(1)) for match in progress] == [0, 10 * 32 * 2, 20 * 32 * 2], out
    average, test = lines(out, r"====> Epoch: 1 Average loss: (\S+)"), lines(out, r"====> Test set loss: (\S+)")
    assert len(average) == len(test) == 1 and 50 < float(test[0].group(1)) < 600, out
    assert {path.name for path in (run / "results").iterdir()} == {"reconstruction_1.png", "sample_1.png"}


def test_nanogpt_trains_with_accumulation_and_resumes_from_its_checkpoint(data, tmp_path):
    # nanoGPT's own DDP (a launcher's RANK), its process group and wrapper ddpkit's: it reads its data from
    # data/<dataset> and its configurator from the folder it runs in.
    script = converted("nanogpt", tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chargpt").symlink_to(data / "chargpt")
    common = ["--dataset=chargpt", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8",
              "--gradient_accumulation_steps=4", "--eval_interval=10", "--eval_iters=4", "--log_interval=5",
              "--warmup_iters=2", "--lr_decay_iters=30", "--learning_rate=3e-3", "--min_lr=3e-4", "--compile=False",
              "--dtype=float32", "--device=cpu", "--out_dir=gpt"]
    first = ddpkit_run(script, *common, "--max_iters=20", cwd=tmp_path)
    # 4 micro-steps of 8 x 32 tokens on one process: 2 each on 2 processes, the same tokens per iteration.
    assert lines(first, r"tokens per iteration will be: 1,024"), first
    losses = [float(match.group(1)) for match in lines(first, r"step \d+: train loss (\S+), val loss \S+")]
    assert len(losses) == 3 and losses[-1] < losses[0], first  # steps 0, 10, 20, each printed once
    assert len(lines(first, r"saving checkpoint to gpt")) == 2, first
    resumed = ddpkit_run(script, *common, "--max_iters=30", "--init_from=resume", cwd=tmp_path)
    assert lines(resumed, r"Resuming training from gpt") and lines(resumed, r"iter 25: loss \S+, time .*"), resumed
    assert not lines(resumed, r"iter 5: .*"), resumed  # it went on from step 20
    assert torch.load(tmp_path / "gpt" / "ckpt.pt", weights_only=False)["iter_num"] == 30


def test_the_library_docs_count_the_lines_each_conversion_changed():
    conversions()  # (count.py imports it)
    spec = importlib.util.spec_from_file_location("conversions_count", REPO / "benchmarks" / "conversions" / "count.py")
    count = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(count)
    counted = count.counts()
    table = re.findall(r"^\| (\w+) \(\d+\) \| (\d+) \+ (\d+) = \d+ \| (\d+) \+ (\d+) = \d+ \| (\d+) \+ (\d+) = \d+ \| 0\b.*\|$",
                       (REPO / "docs" / "library.md").read_text(), flags=re.M)
    assert {script: [int(n) for n in numbers] for script, *numbers in table} == {
        script: [n for library in ("accelerate", "fabric", "ddpkit") for n in counted[script][library]]
        for script in counted}


def test_every_change_applies_to_its_original_and_one_to_another_file_is_refused_in_one_line(tmp_path):
    needs_corpus()
    convert = conversions()
    assert convert.check() == []
    # The same file as upstream changed it: one line that names it and what to do; nothing written.
    corpus = tmp_path / "corpus"
    changed = corpus / "pytorch-examples" / "vae" / "main.py"
    changed.parent.mkdir(parents=True)
    changed.write_text((convert.CORPUS / "pytorch-examples" / "vae" / "main.py").read_text().replace("128", "256"))
    with pytest.raises(convert.ConversionError, match=r"main.py is not the file that ddpkit's change was written for "
                                                      r"\(pytorch/examples at 77f55b9\w+, sha256 \w{12}...\): fetch"):
        convert.write("vae", "ddpkit", tmp_path / "out", corpus)
    assert not (tmp_path / "out" / "main.py").exists()
    done = convert.main(["vae", "ddpkit", str(tmp_path / "out"), "--corpus", str(corpus)])
    assert done == 2

