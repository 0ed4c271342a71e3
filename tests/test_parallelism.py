"""Beyond data parallel: cutting models (model and pipeline parallel), FSDP and ZeRO, against plain DDP.

Unit tests here cut models in one process; the multi-process ones run `ddpkit train` and `ddpkit run`
on real processes (torchrun's agent, gloo) and compare the trained weights with DDP's.
"""

import copy
import json
import os
import re
import shutil
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import (DIGITS_CONVNET, finish, max_relative_difference, needs_fsdp_on_cpu, needs_pipeline, run_ddpkit,
                      start_train, train, train_here, worker_pid)
from ddpkit import checkpoint
from ddpkit.checkpoint import sharded
from ddpkit.app.cli import main
from ddpkit.core.errors import UsageError
from ddpkit.strategies import PipelineLayout, split, state
from ddpkit.zoo import build_model

# ---------------------------------------------------------------------------------------- cutting models


def _sequential_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 16), nn.Tanh()),
                         nn.Linear(16, 10))


@pytest.mark.parametrize("name", ["net", "convnet", "resnet18", "mobilenet_v3_small", "regnet_x_400mf", "sequential"])
def test_the_pieces_in_order_are_the_models_forward(name):
    torch.manual_seed(0)
    if name == "sequential":
        model, x = _sequential_mlp(), torch.randn(4, 3, 4, 4)
    else:
        channels = 1 if name == "net" else 3
        model = build_model(name, in_channels=channels, num_classes=10, image_size=32)
        x = torch.randn(4, channels, 32, 32)
    model.eval()
    steps = split.pieces(model)
    whole = split.Pieces(steps)
    with torch.no_grad():
        assert torch.equal(whole(x), model(x))
    # The pieces sit under the model's own names: its state_dict keys, no more, no fewer.
    assert list(whole.state_dict()) == list(model.state_dict())
    # Cut in two, the parts hold the model's keys between them, each key once.
    first, second = (split.Pieces(part).state_dict().keys() for part in split.balanced(steps, 2))
    assert not set(first) & set(second) and set(first) | set(second) == set(model.state_dict())


def test_a_nested_sequential_is_opened_so_a_resnet_can_be_cut_between_blocks():
    model = build_model("resnet18", in_channels=3, num_classes=10, image_size=32)
    names = [name for name, _ in split.pieces(model)]
    assert names[:6] == ["conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1"] and names[-2:] == ["_flatten", "fc"]
    parts = split.at_names(split.pieces(model), ["layer3"])
    assert [name for name, _ in parts[1]][0] == "layer3.0"


def test_balanced_cut_makes_the_heaviest_stage_as_light_as_possible():
    # Parameters 198, 100, 2, 198: [198 + 100 | 2 + 198] has the lightest heaviest stage (298; 300 otherwise).
    model = nn.Sequential(nn.Linear(1, 99), nn.Linear(99, 1), nn.Linear(1, 1), nn.Linear(1, 99))
    parts = split.balanced(split.pieces(model), 2)
    assert [[name for name, _ in part] for part in parts] == [["0", "1"], ["2", "3"]]
    # Four parts of four pieces: one each, even where the counts are lopsided.
    assert [len(part) for part in split.balanced(split.pieces(model), 4)] == [1, 1, 1, 1]
    # net in 4: every stage has weights, and the parameterless steps stay behind the layer before them.
    net = build_model("net", in_channels=1, num_classes=10, image_size=28)
    parts = split.balanced(split.pieces(net), 4)
    assert [[name for name, _ in part] for part in parts] == [
        ["conv1", "n1", "_relu1", "_pool1"], ["conv2", "n2", "_relu2", "_pool2", "_flatten"],
        ["fc1", "_relu3"], ["fc2", "_log_softmax"]]
    resnet = build_model("resnet50", in_channels=3, num_classes=1000, image_size=224)
    for stages in (2, 4, 8):
        counts = [split.parameter_count(part) for part in split.balanced(split.pieces(resnet), stages)]
        assert sum(counts) == sum(p.numel() for p in resnet.parameters()) and min(counts) > 0
        # No stage much heavier than its share (the largest block, layer4's first, is 6.0 M of 25.6 M).
        assert max(counts) <= max(1.3 * sum(counts) / stages, 6_100_000), (stages, counts)


def densenet121() -> torch.nn.Module:
    import torchvision  # here, not at the top: every pytest worker imports this module to collect it (about 2 s)

    return torchvision.models.densenet121()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: split.balanced(split.pieces(m), 7), "the model has 6 pieces with weights, too few for 7 stages"),
        (lambda m: split.cut(m, 3, ["_relu1", "_pool1"]), "stage 2 (_relu1) holds no weights"),
        (lambda m: split.cut(m, 2, ["fc9"]), "`split_at` fc9: no such piece; the model's pieces are conv1, n1"),
        (lambda m: split.cut(m, 2, ["conv1"]), "that is the model's first piece"),
        (lambda m: split.cut(m, 3, ["fc1", "conv2"]), "distinct and in forward order"),
        (lambda m: split.cut(m, 3, ["fc1"]), "names 1 cut(s), which makes 2 stages, but there are 3"),
        (lambda m: split.pieces(densenet121()), "cannot cut model DenseNet into stages"),
        (lambda m: PipelineLayout(world_size=4, stages=3, microbatches=2, batch_size=8), "`stages` 3 does not divide the world size 4"),
        (lambda m: PipelineLayout(world_size=2, stages=2, microbatches=3, batch_size=8), "`batch_size` 8 does not split into 3"),
    ],
)
def test_bad_cuts_and_layouts_are_clear_errors(call, message):
    model = build_model("net", in_channels=1, num_classes=10, image_size=28)
    with pytest.raises(UsageError) as error:
        call(model)
    assert message in str(error.value)


def test_model_parallel_on_cpu_devices_gives_the_unsplit_outputs_and_gradients():
    torch.manual_seed(0)
    model = build_model("net", in_channels=1, num_classes=10, image_size=28)  # with BatchNorm, in train mode
    reference = copy.deepcopy(model)
    parallel = split.model_parallel(model, ["cpu", "cpu"])
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    out, out_ref = parallel(x), reference(x)
    assert torch.equal(out, out_ref)
    nn.functional.nll_loss(out, y).backward()
    nn.functional.nll_loss(out_ref, y).backward()
    grads = {name: p.grad for name, p in parallel.named_parameters()}
    assert grads.keys() == {name for name, _ in reference.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.equal(grads[name], p.grad), name
    # BatchNorm's running statistics moved the same way, and the keys are the model's own.
    assert max_relative_difference(parallel.state_dict(), reference.state_dict()) == 0


class _HeadFirst(nn.Module):
    """Defines its head before its body: parameter order and forward order differ."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.body = nn.Linear(5, 8)

    def forward(self, x):
        return self.head(self.body(x))


def test_optimizer_states_convert_between_numbered_and_named():
    model = _HeadFirst()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    numbered = optimizer.state_dict()
    named = state.numbered_to_named(numbered, names)
    assert state.is_named(named) and not state.is_named(numbered)
    assert set(named["state"]) == set(names) and named["param_groups"][0]["params"] == names
    # A pipeline lists the names in forward order (body before head); numbering follows the model's order.
    named["param_groups"][0]["params"] = ["body.weight", "body.bias", "head.weight", "head.bias"]
    back = state.named_to_numbered(named, names)
    assert back["param_groups"] == numbered["param_groups"]
    for number, saved in numbered["state"].items():
        assert torch.equal(back["state"][number]["exp_avg"], saved["exp_avg"]), names[number]
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(back)  # and it drives the model: each state has its parameter's shape
    assert all(fresh.state[p]["exp_avg"].shape == p.shape for p in model.parameters())


# ------------------------------------------------------------------------------------ multi-process runs

# convnet (no BatchNorm) on the real digits, SGD: one epoch of 22 steps, still learning at the end, with a
# checkpoint every 5 steps (as the shared DDP run, conftest.ddp_digits).
DIGITS = [*DIGITS_CONVNET, "--nproc-per-node", "2"]
EVERY_5 = ["--checkpoint-every", "5", "--keep-checkpoints", "10"]


@pytest.fixture(scope="module")
def ddp_run(ddp_digits):
    folder, state_ddp, rows, _ = ddp_digits
    return folder, state_ddp, rows


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    state_fsdp, rows = train(folder, *DIGITS, "--strategy", "fsdp", *EVERY_5)
    return folder, state_fsdp, rows


@needs_fsdp_on_cpu
def test_fsdp_trains_the_same_weights_as_ddp_with_less_state_per_rank(ddp_run, fsdp_run):
    _, state_ddp, rows_ddp = ddp_run
    _, state_fsdp, rows_fsdp = fsdp_run
    assert rows_fsdp[-1]["steps"] == 22 and 0.5 < rows_fsdp[-1]["val_acc"] < 0.99  # learning, not learnt
    assert max_relative_difference(state_fsdp, state_ddp) <= 1e-5
    assert rows_fsdp[-1]["val_acc"] == rows_ddp[-1]["val_acc"]
    # Each rank holds about half of the parameters, gradients and optimizer state.
    for shard, whole in zip(rows_fsdp[-1]["train_state_mb"], rows_ddp[-1]["train_state_mb"]):
        assert shard < 0.6 * whole
    assert len(rows_fsdp[-1]["peak_memory_mb"]) == 2 and min(rows_fsdp[-1]["peak_memory_mb"]) > 0


@needs_fsdp_on_cpu
def test_fsdp_saves_each_ranks_own_shard_and_resumes_it_exactly(tmp_path, ddp_run, fsdp_run):
    folder, state_fsdp, _ = fsdp_run
    # The mid-epoch checkpoints there are: a save is skipped while the one before is still being written (under CI's
    # load this took step 10 once), so only the first (step 5) is sure; the newest of them is read here.
    written = sorted(checkpoint.step_of(entry) for entry in checkpoint.list_checkpoints(folder / "checkpoints"))
    assert written[0] == 5 and written[-1] == 22, written
    saved = folder / "checkpoints" / f"step-{written[-2]:08d}"
    # Sharded, by default under FSDP: each rank wrote its own file, about half of the state; none gathered it all.
    sizes = {path.name: path.stat().st_size for path in saved.glob("*.distcp")}
    assert sorted(sizes) == ["__0_0.distcp", "__1_0.distcp"] and max(sizes.values()) < 0.6 * sum(sizes.values())
    recorded = sharded.model_shapes(saved)  # the whole model's tensors, under the bare model's names
    assert {key: value.shape for key, value in recorded.items()} == {key: value.shape for key, value in state_fsdp.items()}
    sidecar = torch.load(saved / "ddpkit.pt", weights_only=True)
    assert "model" not in sidecar and sidecar["progress"]["global_step"] == written[-2]
    start = tmp_path / "start"
    shutil.copytree(folder / "checkpoints" / "step-00000005", start)
    # Resumed from step 5 exactly; this run writes full checkpoints (FSDP's state gathered to rank 0).
    resumed, _ = train(tmp_path / "fsdp", *DIGITS, "--strategy", "fsdp", "--resume", str(start),
                       "--checkpoint-format", "full")
    assert max_relative_difference(resumed, state_fsdp) == 0
    full = torch.load(tmp_path / "fsdp" / "checkpoints" / "step-00000022.pt", weights_only=True)
    assert set(full["model"]) == set(state_fsdp) and state.is_named(full["optimizer"])  # named by parameter
    # Across strategies: the named optimizer state into a plain (numbered) one, here in one process, at the
    # epoch's end (nothing left to train); the shards into ZeRO's shares, on two processes.
    single, _ = train_here(tmp_path / "single", *DIGITS_CONVNET, "--resume",
                           str(tmp_path / "fsdp" / "checkpoints" / "step-00000022.pt"))
    assert max_relative_difference(single, state_fsdp) == 0
    _, state_ddp, _ = ddp_run
    zero, _ = train(tmp_path / "zero", *DIGITS, "--zero", "--resume", str(saved))
    assert max_relative_difference(zero, state_ddp) <= 1e-5


@needs_fsdp_on_cpu
def test_fsdp_checkpoints_load_on_one_process_and_export(tmp_path, fsdp_run):
    folder, state_fsdp, _ = fsdp_run
    # The epoch's last checkpoint, resharded onto one process (in this one: the same code, no launcher):
    # nothing left to train, and model.pt is the two processes' model, bit for bit.
    one, _ = train_here(tmp_path / "one", *DIGITS_CONVNET, "--strategy", "fsdp", "--resume",
                        str(folder / "checkpoints" / "step-00000022"))
    assert max_relative_difference(one, state_fsdp) == 0
    assert main(["checkpoint", "export", str(folder), str(tmp_path / "exported.pt")]) == 0  # its newest: step 22
    assert max_relative_difference(torch.load(tmp_path / "exported.pt", weights_only=True), state_fsdp) == 0


@needs_fsdp_on_cpu
def test_a_rank_killed_while_saving_in_the_background_restarts_the_group_from_its_last_checkpoint(tmp_path, fsdp_run):
    """kill -9 of rank 1 under --max-restarts 1, FSDP saving sharded checkpoints asynchronously: torchrun's agent
    restarts the group, which resumes from its own newest complete checkpoint and ends with the same model."""
    folder, state_fsdp, _ = fsdp_run
    # Started from another run's checkpoint: the restart must take its own newer ones, not that one again.
    start = tmp_path / "start"
    shutil.copytree(folder / "checkpoints" / "step-00000005", start)
    out = tmp_path / "out"
    proc = start_train(out, *DIGITS, "--strategy", "fsdp", "--async-checkpoint", "--checkpoint-every", "3",
                       "--max-restarts", "1", "--resume", str(start))
    try:
        deadline = time.monotonic() + 120
        victim = None
        while victim is None:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint was ever written"
            if checkpoint.list_checkpoints(out / "checkpoints"):
                victim = worker_pid(proc, rank=1)
            time.sleep(0.005)
        os.kill(victim, signal.SIGSTOP)  # no step further: the kill lands mid-epoch
        killed_after = [path.name for path in checkpoint.list_checkpoints(out / "checkpoints")]
        os.kill(victim, signal.SIGKILL)
    finally:
        stdout, stderr = finish(proc, timeout=180)
    assert proc.returncode == 0, stdout + stderr
    assert "step-00000022" not in killed_after  # it really was killed before the end
    assert "[rank0]: ddpkit: restart 1 of the group: resuming from the newest checkpoint" in stderr
    resumes = re.findall(r"resumed from (\S+) \(ddpkit, sharded\): continuing at epoch 1 after \d+ samples", stderr)
    assert len(resumes) == 2 and resumes[0] == str(start), stderr
    # From the newest checkpoint there was (or one completed as the rank stopped), in the run's own folder.
    assert Path(resumes[1]).parent == out / "checkpoints", stderr
    assert checkpoint.step_of(Path(resumes[1])) >= checkpoint.step_of(Path(killed_after[0])), stderr
    assert max_relative_difference(torch.load(out / "model.pt", weights_only=True), state_fsdp) == 0
    assert not list((out / "checkpoints").glob(".tmp-*"))  # a write the kill cut short was cleared


def test_zero_trains_the_same_weights_as_ddp_with_less_optimizer_state(tmp_path, ddp_run):
    folder, state_ddp, rows_ddp = ddp_run
    # Resumed from DDP's checkpoint at step 5: ZeRO takes a plain optimizer state, and writes its own. Its
    # replicas, each updating a share of the parameters and broadcasting them, are compared at every step. (Step 5,
    # the run's first save: a mid-epoch save is skipped while the one before is still being written, which under
    # CI's load took step 10 from two of three workers' runs once.)
    state_zero, rows = train(tmp_path, *DIGITS, "--zero", "--check-replicas", "1", "--checkpoint-format", "full",
                             "--resume", str(folder / "checkpoints" / "step-00000005.pt"))
    assert max_relative_difference(state_zero, state_ddp) <= 1e-5
    # SGD's momentum buffers are split between the ranks (by whole parameters, so not evenly).
    for zero, whole in zip(rows[-1]["train_state_mb"], rows_ddp[-1]["train_state_mb"]):
        assert zero < whole
    saved = torch.load(tmp_path / "checkpoints" / "step-00000022.pt", weights_only=True)
    assert not state.is_named(saved["optimizer"]) and len(saved["optimizer"]["state"]) == 4  # consolidated
    # That consolidated state is PyTorch's plain layout, the one this run resumed from DDP's checkpoint.
    plain = torch.load(folder / "checkpoints" / "step-00000022.pt", weights_only=True)["optimizer"]
    assert saved["optimizer"]["param_groups"] == plain["param_groups"]


@needs_pipeline
def test_pipeline_trains_like_ddp_and_checkpoints_the_whole_model(tmp_path, ddp_run):
    _, state_ddp, rows_ddp = ddp_run
    # 2 stages, one pipeline with batch 64 in 4 micro-batches: global batch 64, as DDP's.
    args = [*DIGITS, "--strategy", "pipeline", "--batch-size", "64"]
    state_pipe, rows = train(tmp_path / "a", *args, "--pipeline-schedule", "gpipe", *EVERY_5)
    assert rows[-1]["global_batch"] == 64 and rows[-1]["steps"] == 22
    assert max_relative_difference(state_pipe, state_ddp) <= 1e-5
    assert rows[-1]["val_count"] == 359 and rows[-1]["val_acc"] == rows_ddp[-1]["val_acc"]
    # Each stage holds its part: together the whole model's state, as one DDP rank holds it.
    assert sum(rows[-1]["train_state_mb"]) == pytest.approx(rows_ddp[-1]["train_state_mb"][0], abs=0.01)
    saved = torch.load(tmp_path / "a" / "checkpoints" / "step-00000010.pt", weights_only=True)
    assert set(saved["model"]) == set(state_ddp) and state.is_named(saved["optimizer"])
    assert set(saved["optimizer"]["state"]) == {name for name, value in state_ddp.items() if value.is_floating_point()}
    # (Resuming a pipeline checkpoint, under the other schedule: the slow test with replicas below.)


@pytest.mark.slow  # 4 processes on 2 cores, twice: about 35 s
@needs_pipeline
def test_pipeline_with_replicas_trains_like_ddp_and_resumes(tmp_path, ddp_run):
    _, state_ddp, rows_ddp = ddp_run
    # 2 stages x 2 replicas, each pipeline batch 32 in 4 micro-batches: global batch 64, as DDP's.
    args = [*DIGITS, "--strategy", "pipeline", "--nproc-per-node", "4", "--stages", "2"]
    state_pipe, rows = train(tmp_path / "a", *args, "--pipeline-schedule", "gpipe", *EVERY_5)
    assert rows[-1]["global_batch"] == 64 and rows[-1]["world_size"] == 4
    assert max_relative_difference(state_pipe, state_ddp) <= 1e-5
    assert rows[-1]["val_count"] == 359 and rows[-1]["val_acc"] == rows_ddp[-1]["val_acc"]
    # The checkpoint holds the whole model, merged from the stages; 1F1B continues it to the same weights.
    resumed, _ = train(tmp_path / "b", *args, "--pipeline-schedule", "1f1b", "--resume",
                       str(tmp_path / "a" / "checkpoints" / "step-00000010.pt"))
    assert max_relative_difference(resumed, state_ddp) <= 1e-5


PIPELINE_SCRIPT = textwrap.dedent("""
    import copy, json, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.data import TensorDataset
    from torch.nn.parallel import DistributedDataParallel
    import ddpkit
    from ddpkit.strategies import FSDP, PipelineParallel, model_parallel, unwrap

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(8 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))

    def close(a, b):
        return (a - b).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1.0)

    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    report = {}
    with ddpkit.distributed(force_group=True) as rt:
        for schedule in ("gpipe", "1f1b"):
            reference = build()
            strategy = PipelineParallel(stages=2, microbatches=4, pipeline_schedule=schedule)
            pipe = strategy.wrap(build(), rt, example=torch.zeros(16, 3, 8, 8))
            stage = unwrap(pipe)
            optimizer = torch.optim.Adam(stage.parameters(), lr=0.01)
            reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
            mine = dict(reference.named_parameters())
            checks = []
            for step in range(4):
                optimizer.zero_grad()
                reference_optimizer.zero_grad()
                loss = pipe.train_step(x, y)
                reference_loss = F.cross_entropy(reference(x), y)
                reference_loss.backward()
                if loss is not None:
                    checks.append(("loss", close(loss, reference_loss.detach())))
                checks += [("grad " + n, close(p.grad, mine[n].grad)) for n, p in stage.named_parameters()]
                optimizer.step()
                reference_optimizer.step()
            checks += [("weight " + n, close(p.detach(), mine[n].detach())) for n, p in stage.named_parameters()]
            pipe.eval()
            out = pipe(x[:12])  # a short batch, padded inside
            if out is not None:
                checks.append(("eval", close(out, reference.eval()(x[:12]).detach())))
            report[schedule] = {"checks": len(checks), "failed": [n for n, ok in checks if not ok],
                                "has_loss": any(n == "loss" for n, _ in checks)}
        # Model parallel inside each DDP process (device_ids=None), against plain DDP.
        split_ddp = DistributedDataParallel(model_parallel(build(), ["cpu", "cpu"]))
        plain_ddp = DistributedDataParallel(build())
        for model in (split_ddp, plain_ddp):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                opt.zero_grad()
                F.cross_entropy(model(x[rt.rank::2]), y[rt.rank::2]).backward()
                opt.step()
        split_state, plain_state = unwrap(split_ddp).state_dict(), unwrap(plain_ddp).state_dict()
        assert list(split_state) == list(plain_state) and split_state
        report["mp_ddp_failed"] = [n for n in plain_state if not close(split_state[n], plain_state[n])]
        # FSDP's evaluation: ranks with fewer batches (or none) run empty ones until the others are done.
        fsdp = FSDP().wrap(build(), rt)
        counts = []
        for size in (5, 1):  # 5 samples, batch 2: 2 batches on rank 0, 1 on rank 1; 1 sample: none on rank 1
            images = torch.randn(size, 3, 8, 8)
            dataset = TensorDataset(images, torch.arange(size) % 10)
            loss, accuracy, count = ddpkit.evaluate(fsdp, ddpkit.eval_loader(dataset, batch_size=2, runtime=rt), rt,
                                             lockstep=True)
            counts.append(count)
        report["fsdp_eval_counts"] = counts
    json.dump(report, open(sys.argv[1] + f".{rt.rank}", "w"))
""")


@needs_pipeline
def test_pipeline_stages_match_the_unsplit_model_for_both_schedules(tmp_path):
    script = tmp_path / "pipe.py"
    script.write_text(PIPELINE_SCRIPT)
    result = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path / "report"), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    for schedule in ("gpipe", "1f1b"):
        assert [r[schedule]["failed"] for r in reports] == [[], []], schedule
        # Only the last stage has the loss; each rank checked its gradients at 4 steps, its weights, the eval.
        assert [r[schedule]["has_loss"] for r in reports] == [False, True]
        assert all(r[schedule]["checks"] >= 10 for r in reports)
    assert [r["mp_ddp_failed"] for r in reports] == [[], []]
    assert [r["fsdp_eval_counts"] for r in reports] == [[5, 1], [5, 1]]  # every sample once, no hang
