"""``ddpkit run --unchanged``: a script written for one device (tests/unchanged_script.py, and public originals from
the corpus beside the repository, ../shared/corpus) on 1 and on 2 processes, the same script and the same arguments, trains to the same weights.

The pure parts (how a batch is cut, the settings, the script check, the shared stream) are tested in this process;
the runs are shared by the tests through module fixtures.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import CORPUS, needs_corpus, once_per_run, public_scripts_data, run_command, run_ddpkit
from ddpkit.core.version import torch_at_least
from ddpkit.data.split_batches import SharedStream, share_of
from ddpkit.unchanged import Setting, stands_aside
from ddpkit.unchanged.batches import Batch
from ddpkit.unchanged.divided import KEYWORDS_SEEN
from ddpkit.unchanged.randomness import derived_seed

SCRIPT = str(Path(__file__).with_name("unchanged_script.py"))


# -- in this process ---------------------------------------------------------------------------------------------------

def test_a_batch_is_cut_into_contiguous_runs_weighed_by_their_size():
    batch = list(range(10, 15))
    shares = [share_of(batch, rank, 2) for rank in range(2)]
    assert [share.indices for share in shares] == [[10, 11, 12], [13, 14]]
    assert [share.weight for share in shares] == [0.6, 0.4] and {share.samples for share in shares} == {5}
    thirds = [share_of(list(range(7)), rank, 3) for rank in range(3)]
    assert sum((share.indices for share in thirds), []) == list(range(7))
    assert sum(share.weight for share in thirds) == pytest.approx(1.0)


def test_a_batch_smaller_than_the_world_gives_the_ranks_without_a_sample_a_stand_in_of_weight_0():
    shares = [share_of([7, 8], rank, 4) for rank in range(4)]
    assert [(share.indices, share.weight) for share in shares] == [([7], 0.5), ([8], 0.5), ([8], 0.0), ([8], 0.0)]
    with pytest.raises(ValueError, match="empty batch"):
        share_of([], 0, 2)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        share_of([1], 2, 2)


def test_the_smallest_share_a_loaders_batches_can_give_is_known_from_torchs_batch_sampler_alone():
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from ddpkit.data.split_batches import fewest_share_rows

    def batches(samples: int, size: int, drop_last: bool = False) -> BatchSampler:
        return BatchSampler(SequentialSampler(range(samples)), size, drop_last)

    assert fewest_share_rows(batches(50, 8), 2) == 1  # the last batch, of 2
    assert fewest_share_rows(batches(51, 8), 2) == 1 and fewest_share_rows(batches(52, 8), 2) == 2
    assert fewest_share_rows(batches(50, 8, drop_last=True), 2) == 4 and fewest_share_rows(batches(48, 8), 3) == 2
    assert fewest_share_rows(batches(5, 8), 2) == 2  # one batch, of 5
    assert fewest_share_rows(DataLoader(range(50), batch_size=8).batch_sampler, 2) == 1
    assert fewest_share_rows([[0, 1], [2]], 2) is None  # a batch sampler of the script's own: not known


def test_a_summed_loss_counts_its_share_as_the_whole_batch_but_a_stand_in_and_a_whole_batch_as_they_are():
    batch = Batch(world_size=2, summed=True)
    assert batch.weight == 0.5 and batch.output_scale() == 1.0  # nothing split yet: every rank has the whole batch
    batch.set(0.25)
    assert batch.output_scale() == 4.0
    batch.set(0.0)
    assert batch.output_scale() == 1.0
    assert Batch(world_size=2).output_scale() == 1.0


def test_a_batch_cut_by_hand_is_split_by_its_positional_tensors_or_else_by_its_keywords_and_refused_without_rows():
    from ddpkit.core.errors import UsageError
    from ddpkit.unchanged.at_the_model import AtTheModel

    batch = Batch(world_size=2)
    cut = AtTheModel(rank=1, world_size=2, batch=batch, current_call=lambda: None)
    (rows, name), share = cut.split((torch.arange(5), "name"))
    assert rows.tolist() == [3, 4] and name == "name" and share.samples == 5 and batch.weight == 0.4
    assert cut.split(("only words",)) == (("only words",), None)  # (its keywords decide: ``split_keywords``)
    # By keyword alone, the first tensor's rows are the batch's (a class weight, positions of one row: given whole).
    assert cut.split_keywords({"scale": 2.0, "idx": torch.zeros(6, 2), "targets": torch.zeros(6),
                               "weight": torch.ones(3), "positions": torch.zeros(1, 2)}).indices == [3, 4, 5]
    with pytest.raises(UsageError, match=r"do not share a batch size \(first dimensions \[1, 6\]\)"):
        cut.split((torch.zeros(6, 2), torch.zeros(1, 2)))
    with pytest.raises(UsageError, match="this call gives it no tensor with a row per sample to split"):
        cut.split_keywords({"scale": torch.tensor(2.0)})


@pytest.mark.parametrize("code, kept", [
    ("logits, loss = model(x, y)\nloss.backward()", None),  # (nanoGPT's loop: its logits never loaded again)
    ("_, loss = model(x, y) if x is None else model(y, x)", None),  # (past the jump that ends one branch)
    ("loss = model(x, y)[1]\nmodel(x, y)[1].backward()\nout = model(x, y)\nout[1].backward()", None),
    ("logits, loss = model(x, y)\nif x is None:\n    print(logits.argmax(-1))", "logits"),  # (a read some steps make)
    ("def step():\n    out = model(x, y)\n    return out[0]\nstep()", "out"),
    ("def step():\n    pair = model(x, y)\n    return lambda: pair[0]\nstep()", "pair"),  # (a closure's cell)
    ("def forward():\n    return model(x, y)\nlogits, loss = forward()\nprint(logits)", "logits"),  # (followed out)
    ("def forward():\n    return model(x, y)\nlogits, loss = forward()", None),
    ("def report():\n    print(logits)\nlogits, loss = model(x, y)", "logits"),  # (a function reads the global)
    ("kept = {}\nkept['logits'], loss = model(x, y)", "where ddpkit cannot follow them"),
    ("print(model(x, y))", "where ddpkit cannot follow them"),
])
def test_what_the_code_that_called_a_model_keeps_of_its_outputs_beside_its_loss_and_reads_again(code, kept):
    """A model over batches cut by hand that returns its loss: what its caller's code does with its other outputs,
    read from its bytecode, decides whether they are gathered on the shares (``kept.read_again``)."""
    from ddpkit.unchanged.at_the_model import is_a_loss
    from ddpkit.unchanged.kept import read_again

    output, seen = (torch.zeros(4, 3), torch.tensor(1.0, requires_grad=True)), []

    def model(*args):
        seen.append(read_again(sys._getframe(1), output, is_a_loss))
        return output

    exec(compile(code, "script.py", "exec"), {"model": model, "x": None, "y": None, "print": lambda *args: None})
    assert seen and set(seen) == {kept}, seen
    if kept is None and code.startswith("logits, loss"):  # (nanoGPT's own train.py: its logits are never loaded)
        from ddpkit.unchanged.kept import _loads

        needs_corpus()  # (what is above holds without it)
        train = CORPUS / "nanogpt" / "train.py"
        assert "logits, loss = model(X, Y)" in train.read_text()
        assert not list(_loads(compile(train.read_text(), str(train), "exec"), "logits", "global"))


def test_a_forward_that_reads_its_data_and_one_that_decides_from_it_whether_to_compute_a_loss_are_told_apart():
    """``branches.ReadsItsData`` around a forward: a read of a tensor's value (a branch on its data) is ``read``; a
    loss of torch's that a block of code, which its data decides whether to run, calls or may call is ``guarded``:
    an ``if`` on a tensor's truth (a detector's box loss), its ``else``, an ``if`` that tests a tensor's number on its
    own line, or a name that holds one (``nt = b.shape[0]``, then ``if nt:``), whether the block ran or not (its
    loss a module's, a closure's, a helper's). A loss behind ``if labels is not None`` (transformers' models), or
    behind an ``if`` on something else after a read on another line, or a block that calls no loss, is not. A
    sharded block that such a block may call is ``block``. Nothing a function returns changes."""
    from ddpkit.unchanged.branches import ReadsItsData

    x, labels = torch.randn(6, 3, requires_grad=True), torch.tensor([0, 1, 0, 0, 1, 0])
    background, box_loss, expert = torch.zeros(6, dtype=torch.long), nn.SmoothL1Loss(), nn.Linear(3, 3)

    def detector(x, labels):
        losses = [F.cross_entropy(x, labels)]
        positive = labels > 0
        if positive.any():
            losses.append(F.mse_loss(x[positive], torch.zeros(2, 3)))
        return sum(losses)

    def unentered(x, labels):  # (no positive at this call: the block's loss is a module's, by a closure)
        loss, positive = F.cross_entropy(x, background), background > 0
        if positive.any():
            loss = loss + box_loss(x[positive], x[positive].detach() * 0)
        return loss

    def helper(rows):
        return F.huber_loss(rows, torch.zeros_like(rows))

    def sized(x, labels):  # (YOLO's: the size of what its data picked, in a name, tested on a later line)
        b = torch.where(background > 0)[0]
        nt = b.shape[0]
        loss = x.sum()
        if nt:
            loss = loss + helper(x[b])
        return loss

    def otherwise(x, labels):
        if not (labels > 5).any():
            return x.sum()
        else:
            return F.l1_loss(x, torch.zeros_like(x))

    def labelled(x, labels):
        skip = bool((labels >= 0).all())  # (a read of its data, governing no loss: transformers' mask checks)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(x, labels)
        if skip:
            x = torch.relu(x) + helper.__name__.count("h")
        return loss if skip else None

    def counted(x, labels):
        if (labels > 0).sum().item() > 0:  # (a number read, then tested)
            return F.cross_entropy(x, labels)
        return x.sum()

    def training(x, labels):
        positives = int((labels > 0).sum())  # (a number read on its own line: not what the next `if` tests)
        if x.requires_grad:
            return F.cross_entropy(x, labels) * positives
        return x.sum()

    def routed(x, labels):
        rows = labels > 5
        return expert(x[rows]).sum() if rows.any() else x.sum()

    def per_image(x, labels):  # (a detector's loss over its images, one by one: those with no positive skipped)
        loss, mse_loss = x.sum() * 0, "mse_loss"
        for row, label in zip(x, labels):
            if not (label > 5).any():
                continue
            loss = loss + F.l1_loss(row, torch.zeros_like(row))
        if (labels > 5).any():  # (a name or a string that a loss also has is not a call of it)
            loss = loss * len(mse_loss)
        return loss

    seen = {}
    for name, forward in (("detector", detector), ("unentered", unentered), ("sized", sized),
                          ("otherwise", otherwise), ("labelled", labelled), ("counted", counted),
                          ("training", training), ("routed", routed), ("per_image", per_image),
                          ("plain", lambda x, y: x.sum())):
        reading = ReadsItsData(block=lambda module: module is expert).start()
        try:
            value = forward(x, labels)
        finally:
            read = reading.end()
        assert torch.equal(value, forward(x, labels))
        seen[name] = (read, reading.guarded or reading.block)
    assert seen == {"detector": (True, "mse_loss"), "unentered": (True, "smooth_l1_loss"),
                    "sized": (True, "huber_loss"), "otherwise": (True, "l1_loss"), "labelled": (True, ""),
                    "counted": (True, "cross_entropy"), "training": (True, ""), "routed": (True, "Linear"),
                    "per_image": (True, "l1_loss"), "plain": (False, "")}


def test_the_shared_stream_draws_the_same_order_whatever_the_global_stream_did_and_leaves_it_as_it_was():
    orders = []
    for noise in (1, 2):
        torch.manual_seed(noise)
        random.seed(noise)
        stream = SharedStream(derived_seed(7, "loader", 0))
        before = torch.get_rng_state(), random.getstate()
        with stream:
            first = torch.randperm(10).tolist()
        with stream:
            second = torch.randperm(10).tolist() + [random.random()]
        assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
        orders.append((first, second))
    assert orders[0] == orders[1] and orders[0][0] != orders[0][1][:10]


def test_a_second_derivative_with_respect_to_weights_cut_at_the_model_is_refused_in_one_line_and_a_first_is_not():
    """``torch.autograd.grad(..., create_graph=True)`` with respect to the weights of a model whose calls on this
    batch were cut (a MAML inner step, a gradient-norm penalty: 1.2e-2 and 2.6e-2 from one process before) is refused
    in one line; a first derivative, or a second where nothing was cut, is torch's own (no DDP built here: nothing to
    reduce). Under --shard, a gradient with respect to a sharded model's weights is refused in one line."""
    import types

    from ddpkit.core.errors import UsageError
    from ddpkit.unchanged.taken import TakenGradients

    model = nn.Linear(2, 1)
    replica = types.SimpleNamespace(name="Linear", parameters=list(model.parameters()), ddp=None)
    cut = [True]
    taken = TakenGradients(rank=0, owners=lambda: ([replica], []), cut=lambda: cut[0])
    loss = (model(torch.ones(3, 2)) ** 2).sum()
    expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    with pytest.raises(UsageError, match=r"^--unchanged: torch.autograd.grad\(..., create_graph=True\) with respect "
                                         r"to Linear's parameters, on a batch whose model calls are cut .* run with "
                                         r"--nproc-per-node 1$"):
        taken(loss, list(model.parameters()), create_graph=True)
    first = taken(loss, list(model.parameters()), retain_graph=True)
    cut[0] = False
    second = taken(loss, list(model.parameters()), None, True, True)  # (create_graph given by position)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(expected, first, second))
    assert second[0].requires_grad and not first[0].requires_grad
    # Under --shard, any gradient taken with respect to a sharded model's weights: FSDP makes them only in a backward.
    sharded = TakenGradients(rank=0, owners=lambda: ([], [model]), cut=lambda: False)
    with pytest.raises(UsageError, match=r"^--unchanged --shard: torch.autograd.grad with respect to Linear's "
                                         r"parameters, which are sharded: .* Run with --shard never$"):
        sharded(loss, [model.weight], retain_graph=True)
    other = torch.ones(1, requires_grad=True)  # (a gradient with respect to anything else: torch's own)
    assert torch.equal(sharded((other * 3).sum(), other)[0], torch.full((1,), 3.0))


def test_the_setting_travels_as_one_word_and_a_bad_reduction_is_refused():
    assert Setting.decode(Setting(seed=3, loss_reduction="sum").encode()) == Setting(seed=3, loss_reduction="sum")
    assert Setting.decode(Setting().encode()) == Setting(seed=None, loss_reduction="mean")
    assert Setting.decode(Setting(shard="never", find_unused=True).encode()) == Setting(shard="never", find_unused=True)
    with pytest.raises(Exception, match="`loss_reduction` must be one of mean, sum, coupled, got 'max'"):
        Setting(loss_reduction="max")


@pytest.mark.parametrize("source, named", [
    ("dist.init_process_group('gloo')", "calls init_process_group"),
    ("model = DistributedDataParallel(model)", "calls DistributedDataParallel"),
    ("fully_shard(block)", "calls fully_shard"),
    ("import ddpkit\n", "imports ddpkit"),
    ("x = 1\nfrom ddpkit import Job\n", "imports ddpkit"),
    ("import torch\nmodel = Net()  # one device\n", None),
    # Comments and strings are words, not code: a one-device script that mentions DDP runs under --unchanged.
    ("# one device: no DistributedDataParallel / init_process_group branches\nprint('init_process_group')\n", None),
    ("import torch.distributed as dist\nif __name__ == '__main__':\n    dist.init_process_group('gloo')\n",
     "calls init_process_group"),
    ("def setup(rank):\n    for _ in range(1):\n        dist.init_process_group('gloo', rank=rank)\n",
     "calls init_process_group"),  # a function's top (a loop's body too): whenever the function runs
    ("from torch.nn.parallel import DistributedDataParallel as DDP\ndef wrap(m):\n    return DDP(m)\n",
     "calls DistributedDataParallel"),
    # A call that a condition guards is the script's to make or not (the ImageNet trainer's --dist-* flags, nanoGPT
    # under a launcher's RANK): --unchanged runs it, and stands aside at run time if the call comes.
    ("from torch.nn.parallel import DistributedDataParallel as DDP\n", None),
    ("if args.distributed:\n    dist.init_process_group('nccl')\nelse:\n    model.to(device)\n", None),
    ("ddp = 'RANK' in os.environ\ndef main():\n    if ddp:\n        init_process_group(backend)\n", None),
    ("model = DDP(model) if distributed else model\n", None),
    ("try:\n    import x\nexcept ImportError:\n    dist.init_process_group('gloo')\n", None),
    ("ok = dist.is_initialized() or dist.init_process_group('gloo')\n", None),
    ("from accelerate import Accelerator\n", "imports accelerate"),
    ("import lightning as L\nfabric = L.Fabric()\n", "imports lightning"),
    ("from lightning.fabric import Fabric\n", "imports lightning.fabric"),
    ("import deepspeed\n", "imports deepspeed"),
    ("import horovod.torch as hvd\n", "imports horovod.torch"),
    ("from transformers import Trainer, TrainingArguments\n", "trains through transformers.Trainer"),
    ("from transformers.trainer_seq2seq import Seq2SeqTrainer as S\n", "trains through transformers.Seq2SeqTrainer"),
    ("import transformers as tf\ntrainer = tf.Trainer(model=m)\n", "trains through transformers.Trainer"),
    ("from transformers import GPT2LMHeadModel\nclass Trainer: pass\n", None),  # a Trainer of the script's own
    ("from trl import SFTTrainer\n", "imports trl"),
    ("from .accelerate_helpers import x\n", None),  # a module of the script's own
    ("x = (\n", None),  # does not parse: Python says so when it runs
])
def test_a_script_that_distributes_itself_is_told_by_what_its_code_calls_not_by_its_comments(source, named):
    assert stands_aside(source) == named


def test_the_public_scripts_that_distribute_themselves_only_when_told_run_under_unchanged():
    needs_corpus()
    for script in ("pytorch-examples/imagenet/main.py", "nanogpt/train.py"):  # flags; a launcher's RANK
        assert stands_aside((CORPUS / script).read_text()) is None, script


def test_a_group_of_the_scripts_own_found_at_run_time_is_ddpkits_where_it_asks_for_that_one():
    from ddpkit.unchanged.own_group import other_group

    ours = {"backend": "gloo", "world_size": 2, "rank": 1}
    assert other_group({}, **ours) is None
    assert other_group({"backend": "gloo", "init_method": "env://", "world_size": 2, "rank": 1}, **ours) is None
    assert other_group({"backend": "nccl"}, backend="cpu:gloo,cuda:nccl", world_size=2, rank=1) is None
    assert other_group({"backend": "nccl"}, **ours) == "over nccl, where ddpkit's runs over gloo on this machine"
    assert other_group({"world_size": 4}, **ours) == "of 4 processes, where 2 run"
    assert other_group({"rank": 3}, **ours) == "in which this process is rank 3, where it is rank 1"


def test_who_asks_whether_a_group_is_up_is_told_by_the_package_of_the_code_that_asks():
    """torch's and ddpkit's code read the group as it is; the script's and a library's find none; Python's standard
    library only passes a call on (the caller below it decides). And the loss check's tolerance: the square root of
    the loss's precision, relative."""
    from ddpkit.unchanged.at_the_model import _close
    from ddpkit.unchanged.own_group import group_seen

    def asked_from(module: str, passed_on_by: str | None = None) -> bool:
        """``group_seen`` as the replaced ``is_initialized`` calls it, asked by code of ``module`` (through a function
        of the module ``passed_on_by``, where given)."""
        def ask():
            return group_seen(sys._getframe(1))

        passer = {"__name__": passed_on_by or module, "ask": ask}
        exec("def pass_on():\n    return ask()\n", passer)
        caller = {"__name__": module, "ask": ask if passed_on_by is None else passer["pass_on"]}
        exec("def call():\n    return ask()\n", caller)
        return caller["call"]()

    assert asked_from("torch.distributed.fsdp") and asked_from("ddpkit.strategies.sync_bn")
    assert not asked_from("__main__") and not asked_from("torchmetrics.metric") and not asked_from("torchvision")
    assert asked_from("torch.utils.data", passed_on_by="contextlib")  # (the standard library passes it on)
    assert not asked_from("torchmetrics.metric", passed_on_by="contextlib")
    assert not asked_from("torch.utils.data", passed_on_by="lightning_utilities")  # (the innermost package decides)
    assert _close(torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0 + 1e-9, dtype=torch.float64))
    assert not _close(torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0 + 1e-6, dtype=torch.float64))
    assert _close(torch.tensor(2.0), torch.tensor(2.0005)) and not _close(torch.tensor(2.0), torch.tensor(2.01))


def test_a_loader_reads_its_shares_only_where_its_workers_draw_their_own_and_it_collates_by_rows(group_of_one):
    """Which gathered loaders each rank reads a share of (``unchanged.loading``): the checks, and the shares put
    together in a group of one (the two-process run is the steps script's ``loading`` part)."""
    from torch.nn.utils.rnn import pad_sequence
    from torch.utils.data import DataLoader, TensorDataset, default_collate

    from ddpkit.unchanged.loading import collates_by_rows, gathered_rows, rows_cut, whole_here, whole_reading

    class Drawn(TensorDataset):
        def __getitem__(self, index):
            return *super().__getitem__(index), torch.rand(2)  # (a random augmentation: the states are put back)

    data = Drawn(torch.randn(7, 3), torch.arange(7), torch.arange(7) % 2 == 0)
    assert whole_reading(DataLoader(data)) == "it reads its samples in the main process"
    assert whole_reading(DataLoader(data, num_workers=2, persistent_workers=True)) is None  # (started again)
    assert "generator" in whole_reading(DataLoader(data, num_workers=2, generator=torch.Generator()))
    assert "worker_init_fn" in whole_reading(DataLoader(data, num_workers=2, worker_init_fn=print))
    if "in_order" in inspect.signature(DataLoader).parameters:  # (torch 2.6 and later)
        assert "in_order=False" in whole_reading(DataLoader(data, num_workers=2, in_order=False))
    assert whole_reading(DataLoader(data, num_workers=2)) is None
    state = torch.get_rng_state()
    assert collates_by_rows(DataLoader(data, batch_size=4), [6, 0, 3]) is None  # (torch's default_collate: no read)
    own = default_collate.__call__  # (the same function, not the same object: read, collated whole and one by one)
    assert collates_by_rows(DataLoader(data, batch_size=4, collate_fn=own), [6, 0, 3]) is None
    assert torch.equal(torch.get_rng_state(), state)
    sequences = [torch.ones(length) for length in (2, 5, 3)]
    padded = DataLoader(sequences, batch_size=3, collate_fn=lambda rows: pad_sequence(rows, batch_first=True))
    assert "(padding?)" in collates_by_rows(padded, [0, 1, 2])
    assert "not rows" in collates_by_rows(DataLoader(["a", "b"], batch_size=2, collate_fn=own), [0, 1])  # (no tensor)
    named = [(torch.ones(2) * index, f"{index}.jpg") for index in range(3)]  # (a path a sample: rows all the same)
    assert collates_by_rows(DataLoader(named, batch_size=3, collate_fn=own), [2, 0, 1]) is None
    # A share cut from a batch collated whole (a split loader's that pads: ``SplitBatchSampler.cut``).
    whole = {"x": pad_sequence(sequences, batch_first=True), "ids": ["a", "b", "c"], "pair": (torch.arange(3),)}
    cut = rows_cut(whole, 3, 1, 3)
    assert cut["x"].shape == (2, 5) and cut["ids"] == ["b", "c"] and cut["pair"][0].tolist() == [1, 2]
    assert rows_cut({**whole, "lengths": torch.tensor(3)}, 3, 0, 1) is None  # (not a row per sample)
    assert rows_cut({**whole, "ids": ["a"]}, 3, 0, 1) is None and rows_cut(["a", "b", "c"], 3, 0, 1) is None

    class Fields(dict):  # (a mapping whose constructor takes its fields one by one)
        def __init__(self, *, x):
            super().__init__(x=x)

    assert rows_cut(Fields(x=whole["x"]), 3, 0, 1) is None
    assert "cannot be read" in collates_by_rows(DataLoader(data, batch_size=2, collate_fn=own), [9])
    # A batch read whole apart from this process: the same for the same seed (its draws too), nothing drawn here.
    first, again = (whole_here(DataLoader(data), [4, 1], seed=5) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and torch.equal(torch.get_rng_state(), state)
    batch = next(iter(DataLoader(data, batch_size=5)))
    together = gathered_rows(batch, sizes=[5], rank=0)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(together, batch)) and together is not batch
    assert gathered_rows([batch[0], "a"], sizes=[5], rank=0) is None


def test_what_a_rank_writes_stays_private_only_when_it_is_the_scripts_output(monkeypatch, tmp_path):
    from ddpkit.unchanged.outputs import left_as_it_is

    output = str(tmp_path / "run" / "log.csv")  # pytest's folder is under the temporary one: still an output
    assert not left_as_it_is(output, writer="__main__") and not left_as_it_is(output, writer="PIL")
    assert left_as_it_is(output, writer="torch")  # torch's own files: inductor's, the modules it generates
    made = tempfile.mkdtemp()
    assert left_as_it_is(os.path.join(made, "module.py"), writer="mylib")  # a name tempfile made: the process's own
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hub"))
    assert left_as_it_is(str(tmp_path / "hub" / "models" / "config.json"), writer="huggingface_hub")
    assert left_as_it_is(os.path.join(sys.prefix, "lib", "x.py"), writer="mylib")
    os.rmdir(made)


def test_a_counted_mean_leaves_torchscript_compiling_torchs_own_loss():
    import torch.nn.functional as F

    from ddpkit.unchanged.counted import CountedMeans, counted

    assert counted(torch.tensor([0, 2, -100, 1]), None, -100).item() == 3
    assert counted(torch.tensor([0, 2, -100, 2]), torch.tensor([0.5, 1.0, 2.0]), -100).item() == 4.5
    original = F.cross_entropy
    means = CountedMeans(batch=Batch(world_size=2))
    means.install()
    try:
        assert F.cross_entropy is not original

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(x, y, ignore_index=-100)

        x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, -100])
        assert torch.jit.script(loss)(x, y).item() == pytest.approx(loss(x, y).item())  # (a batch whole: torch's)
    finally:
        means.uninstall()
    assert F.cross_entropy is original


def watched(batch, step, fewest_rows: int | None = None) -> str | None:
    """What ``StepWatch`` finds of ``step(batch)`` (a training step's code after the model), in this process, on a
    loader whose smallest share has ``fewest_rows``: None where the step is proven split, else the reason."""
    from ddpkit.unchanged.step_rule import StepWatch

    watch = StepWatch(fewest_rows)
    watch.begin(batch, sys._getframe(1))  # (from the test's frame: the lists it holds)
    try:
        step(batch, watch)
    finally:
        reason = watch.end()
    return reason


def test_the_step_rule_proves_a_mean_over_rows_and_nothing_that_reads_or_couples_the_batch():
    from collections import UserDict

    import numpy

    model = nn.Linear(4, 3)

    def through_model(x, watch):  # (the model's call, set aside as the hooks set it aside)
        watch.pause()
        output = model(x)
        watch.outputs(output, training=True)
        watch.resume()
        return output

    def mean(batch, watch):
        F.cross_entropy(through_model(batch["x"], watch), batch["y"].to(torch.int64)).div(2).backward()

    def size_read(batch, watch):
        loss = F.cross_entropy(through_model(batch["x"], watch), batch["y"])
        loss.backward()
        return loss.item() * batch["x"].size(0)

    def summed(batch, watch):
        F.mse_loss(through_model(batch["x"], watch), torch.zeros(6, 3), reduction="sum").backward()

    def coupled(batch, watch):
        z = through_model(batch["x"], watch)
        F.cross_entropy(z @ z.t(), batch["y"]).backward()

    collected = []  # (a list the loop held before the step: it would collect a share's rows)

    def collecting(batch, watch):
        logits = through_model(batch["x"], watch)
        F.cross_entropy(logits, batch["y"]).backward()
        collected.append((logits.detach().argmax(1), batch["y"]))

    def moved(batch, watch):  # (a dict made in the step is the step's own)
        on_device = {key: value.to("cpu") for key, value in batch.items()}
        F.cross_entropy(through_model(on_device["x"], watch), on_device["y"]).backward()

    def squeezed(batch, watch):  # (one logit a row, squeezed: a share of one row would give a tensor of no rows)
        logits = through_model(batch["x"], watch)[:, :1].squeeze()
        F.binary_cross_entropy_with_logits(logits, batch["y"].to(logits.dtype)).backward()

    rng = numpy.random.default_rng(0)  # (a random stream of the script's own, bound to a name of its frame)

    def flipped(batch, watch):  # (along another dimension than the rows': row-wise; along the rows': not)
        F.cross_entropy(through_model(batch["x"].flip(-1).roll(1, 1), watch), batch["y"]).backward()

    def coin(batch, watch):  # (draws that no torch function makes: each process's own on split batches)
        inputs = batch["x"].flip(1) if random.random() < 2 else batch["x"]
        F.cross_entropy(through_model(inputs, watch), batch["y"]).backward()

    def noised(batch, watch):
        F.cross_entropy(through_model(batch["x"] + numpy.random.normal(), watch), batch["y"]).backward()

    def scaled(batch, watch):
        (F.cross_entropy(through_model(batch["x"], watch), batch["y"]) * float(rng.uniform(0.5, 1))).backward()

    def tokens(batch, watch):  # (a token's logits a row: blocks of the batch's rows, under a counted mean)
        logits = through_model(batch["x"], watch)
        F.cross_entropy(logits.view(-1, logits.size(-1)), batch["y"].flatten(), ignore_index=0).backward()

    def shaped(batch, watch):  # (another dimension's size, read from ``shape``: as ``size(-1)``)
        logits = through_model(batch["x"], watch)
        F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["y"].flatten()).backward()

    def unpacked(batch, watch):  # (the batch's size bound to a name: whatever the code does with it, unproven)
        logits = through_model(batch["x"], watch)
        rows, tokens, classes = logits.shape
        F.cross_entropy(logits.view(rows * tokens, classes), batch["y"].flatten()).backward()

    def by_rows(batch, watch):
        logits = through_model(batch["x"], watch)
        F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["y"].flatten()).div(logits.shape[0]).backward()

    def cut_by_size(batch, watch):  # (a shape with the batch's size in it would cut a share's rows otherwise)
        F.cross_entropy(through_model(batch["x"], watch).view(6, -1, 3).flatten(0, 1), batch["y"].view(-1)).backward()

    tokened = {"x": torch.randn(6, 5, 4), "y": torch.randint(0, 3, (6, 5))}
    assert watched(tokened, tokens) is None
    assert watched(tokened, cut_by_size) == "it computes view over the batch's rows"
    assert watched(tokened, shaped) is None
    assert watched(tokened, unpacked) == watched(tokened, by_rows) == "it reads the batch's size (shape)"
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    assert watched({"x": x, "y": y}, mean) is None
    assert watched({"x": x, "y": y}, flipped) is None
    assert watched({"x": x.flip(0), "y": y}, flipped) is None
    assert watched({"x": x, "y": y}, coin) == "it draws at random outside the model (Python's random)"
    assert watched({"x": x, "y": y}, noised) == "it draws at random outside the model (NumPy's random)"
    assert watched({"x": x, "y": y}, scaled) == "it draws at random outside the model (rng, a Generator)"
    assert watched({"x": x, "y": y}, lambda batch, watch: mean({"x": batch["x"].flip(0), "y": batch["y"]}, watch)) \
        == "it computes flip over the batch's rows"
    assert watched({"x": x, "y": y}, squeezed, fewest_rows=2) is None
    assert watched({"x": x, "y": y}, moved) is None
    assert watched({"x": x, "y": y}, collecting) == "it keeps the batch's rows beyond the step, in collected, a list"
    for fewest_rows in (1, None):
        assert watched({"x": x, "y": y}, squeezed, fewest_rows) == ("it squeezes every dimension of size 1 (squeeze), "
                                                                   "the rows' too on a share of one row")
    # A mapping of a library's own (transformers' BatchEncoding is a UserDict): its tensors are followed all the same.
    assert watched(UserDict(x=x, y=y), size_read) == "it reads the batch's size (size)"
    assert watched({"x": x, "y": y}, summed) == "mse_loss with reduction='sum' (a sum over the batch)"
    assert watched({"x": x, "y": y}, coupled).startswith("it computes ")
    assert watched(object(), lambda batch, watch: None).startswith("its batch holds no tensor")


def test_a_model_needs_ddp_to_look_for_unused_parameters_only_where_its_outputs_are_computed_from_none_other():
    from ddpkit.unchanged.models import independent_outputs

    trunk, head, auxiliary = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 1)
    hidden = trunk(torch.randn(5, 4))
    logits = head(hidden)
    assert independent_outputs((logits, auxiliary(hidden))) == 2  # a step may use one and not the other
    assert independent_outputs({"loss": F.cross_entropy(logits, torch.zeros(5, dtype=torch.int64)),
                                "logits": logits}) == 1  # transformers' loss, computed from its logits


# -- real runs on 1 and 2 processes ------------------------------------------------------------------------------------

def unchanged(tmp: Path, nproc: int, mode: str, *flags: str, expect: int = 0, script_args=()):
    """``tests/unchanged_script.py OUT MODE`` under ``ddpkit run --unchanged FLAGS`` on ``nproc`` processes."""
    out = tmp / f"{mode}{nproc}"
    out.mkdir()
    done = run_ddpkit("run", "--unchanged", *flags, "--nproc-per-node", str(nproc), SCRIPT, str(out), mode,
                      *script_args, timeout=120, cwd=tmp)
    assert done.returncode == expect, f"{done.stdout}\n{done.stderr}"
    return out, done


@pytest.fixture(scope="session")
def one_process_both(tmp_path_factory) -> tuple:
    """The script on one process, in float64, once per pytest run (``once_per_run``): the reference of this module's
    2-process runs and of tests/test_unchanged_sharded.py's. One process reads every batch whole: how a loss reduces
    does not matter there, and ``--shard`` has nothing to shard, so one run is the reference for every 2-process
    run. In float64: the same computation gives the same weights to 1e-12, where float32's rounding, grown by
    training, would leave 1e-5 (the public originals below, in float32) and hide a difference of method."""
    def make() -> tuple:
        out, done = unchanged(tmp_path_factory.mktemp("unchanged-one"), 1, "both", "--seed", "5",
                              script_args=["float64"])
        return out, done, torch.load(out / "result.pt", weights_only=True)

    return once_per_run("unchanged_one_process_both", make)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_process_both) -> dict:
    tmp = tmp_path_factory.mktemp("unchanged")
    found = {("both", 1): one_process_both}
    for nproc, mode, flags in ((2, "mean", []), (2, "sum", ["--loss-reduction", "sum"]),
                               (2, "coupled", ["--loss-reduction", "coupled"])):
        out, done = unchanged(tmp, nproc, mode, "--seed", "5", *flags, script_args=["float64"])
        found[mode, nproc] = out, done, torch.load(out / "result.pt", weights_only=True)
    return found


def worst_relative_difference(a: dict, b: dict) -> float:
    worst = 0.0
    for name, weights in a.items():
        for key, value in weights.items():
            x, y = torch.tensor(value, dtype=torch.float64), torch.tensor(b[name][key], dtype=torch.float64)
            worst = max(worst, ((x - y).abs().max() / x.abs().max().clamp(min=1e-12)).item())
    return worst


def test_two_processes_train_a_script_with_batch_norm_uneven_and_single_sample_batches_to_one_process_weights(runs):
    (_, _, one), (_, _, two) = runs["both", 1], runs["mean", 2]
    # BatchNorm over the whole batch, a last batch of 5 cut 3 + 2, two micro-steps a step, clipping, momentum; and
    # batches of one sample, where rank 1 reads a stand-in of weight 0.
    assert worst_relative_difference({name: one["weights"][name] for name in ("classifier", "ones")},
                                     {name: two["weights"][name] for name in ("classifier", "ones")}) < 1e-12
    assert one["len_loader"] == two["len_loader"] == 5  # the script's own steps per epoch, not half of them
    assert one["isinstance"] and two["isinstance"] and one["keys"] == two["keys"] and "1.running_mean" in two["keys"]


def test_an_evaluation_counts_every_sample_once_as_on_one_process(runs):
    one, two = runs["both", 1][2], runs["mean", 2][2]
    for epoch in (0, 1):
        assert one[f"eval_{epoch}"][:2] == two[f"eval_{epoch}"][:2] and two[f"eval_{epoch}"][1] == 45
        assert two[f"eval_{epoch}"][2] == pytest.approx(one[f"eval_{epoch}"][2], rel=1e-12)


def test_evaluations_written_every_way_count_every_sample_once_and_training_between_them_stays_exact(runs):
    # Gradients switched off inside a step function with the model in train mode, inference_mode, a loader over the
    # train set's data, model.eval() inside the loop with gradients on, before any training, and inside the training
    # loop (whose batch then trains as it would): one process's count, correct and summed loss, each of them.
    (_, _, one), (_, done, two) = runs["both", 1], runs["mean", 2]
    assert len(one["evaluations"]) == 11 and one["evaluations"].keys() == two["evaluations"].keys()
    for name, (samples, correct, loss) in one["evaluations"].items():
        assert two["evaluations"][name][:2] == [samples, correct] and samples in (15, 30), name
        assert two["evaluations"][name][2] == pytest.approx(loss, rel=1e-12), name
    assert worst_relative_difference({"m": one["weights"]["evaluated"]}, {"m": two["weights"]["evaluated"]}) < 1e-12
    assert "a pass over a DataLoader that trained" not in done.stderr
    # Divided: each of the 2 processes computed about half of the rows that one process computed without gradients
    # (the model's first evaluating call is whole, on every process: it shows that the model can be divided). On a
    # torch whose global hooks do not show a call's keywords, every process computes them all. Each process computes,
    # besides, its first training batch's 6 rows and its own 3 without gradients, once: they show that the model
    # computes row by row (``check_both_ways``).
    [whole] = [json.loads(path.read_text()) for path in runs["both", 1][0].glob("rows-*.json")]
    shares = [json.loads(path.read_text()) - 9 for path in runs["mean", 2][0].glob("rows-*.json")]
    assert len(shares) == 2, shares
    assert all(share < 0.6 * whole for share in shares) if KEYWORDS_SEEN else shares == [whole, whole], (whole, shares)


def test_a_gans_noise_is_one_devices_draw_and_rank_0_alone_writes_what_torch_save_writes(runs):
    """The GAN's loop reads its batch's size to draw its noise: not proven on split batches, so its loader takes the
    gathered way, and every rank draws the whole batch's noise from the shared streams, as one device does: the
    generator's weights are one process's."""
    (out, done, two), (one_out, _, one) = runs["mean", 2], runs["both", 1]
    draws = [path.read_text() for path in out.glob("draws-*.json")]  # the script's own files: one per rank
    assert len(draws) == 2 and draws[0] == draws[1] == next(one_out.glob("draws-*.json")).read_text()
    assert worst_relative_difference({"gan": one["weights"]["gan"]}, {"gan": two["weights"]["gan"]}) < 1e-12
    assert done.stderr.count("a training step that is not proven exact on split batches (it reads the batch's size") \
        == 1, done.stderr
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(("draws-", "rows-"))) == \
        ["best.pt", "log.csv", "mlruns", "result.pt", "tb", "whole.pt"]


def test_what_the_script_writes_and_prints_is_written_and_printed_once_as_on_one_process(runs):
    for key in (("both", 1), ("mean", 2)):
        out, done, result = runs[key]
        # The CSV the script appends to: a line per epoch; TensorBoard's run: one event file; the file read back.
        assert [line.split(",")[0] for line in (out / "log.csv").read_text().splitlines()] == ["0", "1"], key
        assert len(list((out / "tb").iterdir())) == 1 and result["log lines"] == 2, key
        runs_logged = [path.parent for path in (out / "mlruns").glob("*/*/metrics/eval_loss")]
        assert len(runs_logged) == 1 and len((runs_logged[0] / "eval_loss").read_text().splitlines()) == 2, key
        assert len(re.findall(r"epoch 1: \d+ of 45 right", done.stdout)) == 1, done.stdout


# A Python process that never imported ddpkit loads the whole models the script saved, as one device's files: the
# script's classes defined in its __main__ (as pickle finds them), nothing else.
# Where torch lists a file's globals (2.6), each file loads with ``weights_only=True`` too, allowed the globals that the
# first REFERENCES files (one process's) name, as a script's own list would allow its classes and torch's layers.
LOAD_WHOLE = """
import ast, importlib, json, sys, zipfile
import torch, torch.nn as nn, torch.nn.functional as F
script, references, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
tree = ast.parse(open(script).read())
exec(compile(ast.Module([node for node in tree.body if isinstance(node, ast.ClassDef)
                         or (isinstance(node, ast.FunctionDef) and node.name == "globals_named")
                         or (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "STRINGS")], []), script, "exec"))
found = {}
unsafe = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # (torch 2.6)
allowed = sorted({name for path in files[:references] for name in unsafe(path)}) if unsafe else []
allowed = [globals()[name.rpartition(".")[2]] if name.startswith("__main__.") else
           getattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2]) for name in allowed]
for path in files:
    with zipfile.ZipFile(path) as archive:
        named = globals_named(archive.read(next(name for name in archive.namelist() if name.endswith("/data.pkl"))))
    if unsafe:
        with torch.serialization.safe_globals(allowed):
            torch.load(path, weights_only=True)
    model = torch.load(path, weights_only=False)
    model = model["model"] if isinstance(model, dict) else model
    found[path] = {"classes": sorted({type(part).__module__ + "." + type(part).__qualname__ for part in model.modules()}),
                   "hooks": sum(len(part._forward_pre_hooks) + len(part._forward_hooks) for part in model.modules()),
                   "weights": {key: value.tolist() for key, value in model.state_dict().items()}, "globals": named}
found["ddpkit imported"] = "ddpkit" in sys.modules
print(json.dumps(found))
"""


def loaded_whole(files: list[str], references: int = 0) -> dict:
    """Each of ``files`` (a whole model saved by tests/unchanged_script.py) loaded in a Python process that never
    imports ddpkit, checked to be plain: no hook, no class of ddpkit's, DDP's or FSDP's; with ``weights_only``, allowed
    what the first ``references`` files name."""
    done = subprocess.run([sys.executable, "-c", LOAD_WHOLE, SCRIPT, str(references), *files], capture_output=True,
                          text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert loaded.pop("ddpkit imported") is False
    for path, model in loaded.items():
        assert model["hooks"] == 0 and not any(word in name for name in model["classes"]
                                               for word in ("ddpkit", "DDP", "FSDP")), path
    return loaded


STACK = str(Path(__file__).with_name("unchanged_stack_script.py"))


def test_a_compiled_model_a_figure_and_a_model_read_back_from_its_folder_run_cold_on_two_processes_as_on_one(tmp_path):
    """What ddpkit puts into the script leaves the libraries' own work alone (docs/unchanged.md, "What ddpkit never
    touches"): inductor's generated code and caches, torch's generated modules (a cold start: torch imported after
    ddpkit, as a user's ranks do), matplotlib, and a folder that transformers writes on rank 0 alone and reads back.
    One device's reference: the script in plain Python, its model not compiled."""
    found = {}
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        out.mkdir()
        if nproc == 1:
            done = run_command([sys.executable, STACK, str(out), "--eager"], timeout=120, cwd=tmp_path, warm=True)
        else:
            done = run_ddpkit("run", "--unchanged", "--nproc-per-node", "2", STACK, str(out), timeout=240, cwd=tmp_path,
                              fresh=True)
            assert "global hooks" not in done.stderr  # torch's warning about ddpkit's own hooks is not the script's
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        found[nproc] = json.loads((out / "result.json").read_text())
    assert worst_relative_difference({"m": found[1]["weights"]}, {"m": found[2]["weights"]}) < 1e-9
    assert found[2]["figure"] > 0 and (tmp_path / "2" / "losses.png").stat().st_size == found[2]["figure"]
    if "read back" in found[1]:  # (transformers installed)
        assert found[2]["read back"] == found[1]["read back"] == ["config.json", "generation_config.json",
                                                                   "model.safetensors"]
        assert found[2]["the same"] is True


COUNTED = str(Path(__file__).with_name("unchanged_counted_script.py"))


def counted_run(tmp: Path, nproc: int, *flags: str) -> dict:
    """tests/unchanged_counted_script.py under ``--unchanged FLAGS`` on ``nproc`` processes: its result."""
    out = tmp / f"counted{nproc}{''.join(flags)}"
    out.mkdir()
    done = run_ddpkit("run", "--unchanged", "--seed", "4", *flags, "--nproc-per-node", str(nproc), COUNTED, str(out),
                      timeout=180, cwd=tmp)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return torch.load(out / "result.pt", weights_only=True)


def relative_norm(a: dict, b: dict) -> float:
    """The norm of the difference of two state dicts over the norm of ``a``."""
    difference = sum(float(((a[key] - b[key]) ** 2).sum()) for key in a) ** 0.5
    return difference / sum(float((a[key] ** 2).sum()) for key in a) ** 0.5


def assert_counted_means_as_on_one_process(one: dict, two: dict) -> None:
    """Every part of the counted script: weights to 1e-9 of one process's, and the printed losses the same (to float32's
    rounding for transformers' models, whose loss is computed in float32)."""
    if "saved" in one:  # (where transformers is installed) the tie kept: one tensor, and save_pretrained's keys
        assert one["tied"] and two["tied"] and two["saved"] == one["saved"]
    for name in one["weights"]:
        assert relative_norm(one["weights"][name], two["weights"][name]) < 1e-9, name
        tolerance = 1e-6 if name in ("lm", "items") else 1e-12
        assert two["printed"][name] == pytest.approx(one["printed"][name], rel=tolerance), name


@pytest.fixture(scope="session")
def counted_one(tmp_path_factory) -> dict:
    """The counted script on one process, once per pytest run (``once_per_run``): the reference of the 2-process runs
    here and sharded (tests/test_unchanged_sharded.py; on one process ``--shard`` has nothing to shard)."""
    # (Not on the floor's run, which has no transformers: a loss's count does not depend on torch's release.)
    pytest.importorskip("transformers", reason="the counted script's models are transformers'")
    return once_per_run("counted_one", lambda: counted_run(tmp_path_factory.mktemp("counted"), 1))


@pytest.mark.slow  # (35 s of a worker: the default suite has no room; CI runs it with the slow ones)
def test_means_over_tokens_not_ignored_class_weights_and_counted_items_train_and_print_as_on_one_process(
        counted_one, tmp_path):
    """A transformers causal LM on padded batches (its own loss, and given num_items_in_batch), the same batches'
    ``F.cross_entropy(..., ignore_index=-100)`` in the script, a class-weighted CrossEntropyLoss: each share holds its
    own count, and 2 processes end at 1 process's weights, printing its losses (before: 1.9e-2 apart)."""
    assert_counted_means_as_on_one_process(counted_one, counted_run(tmp_path, 2))


RULES = str(Path(__file__).with_name("unchanged_rules_script.py"))


def rules_run(tmp: Path, nproc: int, *parts: str, flags=(), expect: int = 0):
    """tests/unchanged_rules_script.py PARTS under ``--unchanged FLAGS`` on ``nproc`` processes: its result (None
    where it failed as expected), and the run."""
    out = tmp / f"rules{nproc}{''.join(flags)}{''.join(parts)}"
    out.mkdir()
    done = run_ddpkit("run", "--unchanged", "--seed", "3", *flags, "--nproc-per-node", str(nproc), RULES, str(out),
                      *parts, timeout=120, cwd=tmp)
    assert done.returncode == expect, f"{done.stdout}\n{done.stderr}"
    return (torch.load(out / "result.pt", weights_only=True) if expect == 0 else None), done


def assert_rules_as_on_one_process(one: dict, two: dict) -> None:
    """Every part's weights to 1e-9 of one process's, and every printed loss the same to 1e-12."""
    assert two["weights"].keys() == one["weights"].keys()
    for name in one["weights"]:
        assert relative_norm(one["weights"][name], two["weights"][name]) < 1e-9, name
        assert two["printed"][name] == pytest.approx(one["printed"][name], rel=1e-12, abs=1e-12), name


@pytest.fixture(scope="module")
def rules_one(tmp_path_factory) -> dict:
    return rules_run(tmp_path_factory.mktemp("rules"), 1)[0]


def test_unused_parameters_reentrant_checkpointing_layers_frozen_and_unfrozen_train_and_print_as_on_one_process(
        rules_one, tmp_path):
    """DDP's rules met for the script (before: heads alternating and a layer frozen mid-run died at their second step;
    reentrant checkpointing, a backbone unfrozen after an epoch and the printed MSE were wrong, silently); a stream's
    batches cut at the model, and every pass's first batch (before: each computed whole on every process)."""
    two, done = rules_run(tmp_path, 2)
    assert_rules_as_on_one_process(rules_one, two)
    # The rows each call of the model computes: on rank 0 of two, the first half of one process's batch (rounded up),
    # the model's first call, a stream's batches and each pass's first included (before: each of those whole). (The
    # stream's 2 workers yield 15 and 14 samples: batches of 6, 6, 6, 6, 3 and 2.) After the model's first call, it
    # computes that batch whole and its share once more, without gradients: they show that its calls compute row by
    # row (``check_both_ways``).
    assert rules_one["rows"]["printed"] == [6, 6, 6, 6, 5] * 3 and rules_one["rows"]["stream"] == [6, 6, 6, 6, 3, 2] * 3
    for name in ("unfrozen", "stream", "printed"):
        halves = [(rows + 1) // 2 for rows in rules_one["rows"][name]]
        assert two["rows"][name] == halves[:1] + [rules_one["rows"][name][0], halves[0]] + halves[1:], name
    # A stream that gives each process its own samples is left as it is, said once; a parameter that is used at the
    # first step and not at a later one is refused in one line, never averaged wrong.
    _, done = rules_run(tmp_path, 2, "self-split", "later", expect=2)
    assert done.stderr.count("a DataLoader over a stream gives each process batches of its own") == 1
    assert done.stderr.count("ddpkit: error: --unchanged: Later left parameters without a gradient") == 1
    assert "--find-unused-parameters" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # (a sharded run and a third run of the script: the default suite has no room)
def test_ddp_rules_hold_under_shard_always_and_find_unused_parameters_trains_a_later_unused_head_exactly(
        rules_one, tmp_path):
    assert_rules_as_on_one_process(rules_one, rules_run(tmp_path, 2, flags=["--shard", "always"])[0])
    later_one = rules_run(tmp_path, 1, "later")[0]
    assert_rules_as_on_one_process(later_one, rules_run(tmp_path, 2, "later", flags=["--find-unused-parameters"])[0])


ASIDE = Path(__file__).with_name("unchanged_aside_script.py")


@pytest.mark.parametrize("how, said", [
    ([], "the script wraps its model in DDP"),
    (["--own-group"], "the script starts a process group of its own (init_process_group)"),
], ids=["ddp-in-a-helper", "own-group-behind-a-condition"])
def test_standing_aside_at_run_time_takes_out_every_hook_and_the_script_runs_on_as_under_ddpkit_run(tmp_path, how,
                                                                                                    said):
    """A script that distributes itself only at run time (a helper module wraps its model in DDP; the script starts a
    group of its own behind a condition): at the model's first call, or at the script's ``init_process_group``,
    --unchanged stands aside, and from there on the loaders, ``open``, ``torch.save``, the losses, the global hooks and
    ``init_process_group`` are PyTorch's and Python's own, and the launcher's variables are back: each rank writes its
    own files and saves, as under ``ddpkit run``. Before, the script saw no RANK, as on one device."""
    (tmp_path / "helper.py").write_text("from torch.nn.parallel import DistributedDataParallel\n\n\n"
                                        "def wrap(model):\n    return DistributedDataParallel(model)\n")
    shutil.copy(ASIDE, tmp_path / ASIDE.name)
    out = tmp_path / "out"
    out.mkdir()
    done = run_ddpkit("run", "--unchanged", "--nproc-per-node", "2", str(tmp_path / ASIDE.name), str(out), *how,
                      timeout=120, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stderr.count(f"--unchanged stood aside: {said}") == 1, done.stderr
    for rank in (0, 1):
        found = json.loads((out / f"rank{rank}.json").read_text())
        assert found == {"batch sizes": [4] * 8, "torch.save": "torch.serialization", "open": True,
                         "iterate": "torch.utils.data.dataloader", "batch sampler": "torch.utils.data.sampler",
                         "cross_entropy": "torch.nn.functional", "global hooks": 0, "RANK": [None, str(rank)],
                         "init_process_group": True}, rank
        assert (out / f"model{rank}.pt").exists()


COPIES = """
import torch
from ddpkit import unwrap  # a library that distributes scripts, imported: --unchanged stands aside before the start

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(unwrap(model).parameters(), lr=0.1)
for step in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    print("step", step, "done")
"""


def test_a_script_that_stood_aside_and_would_train_a_copy_per_process_stops_before_its_first_step(tmp_path):
    """--unchanged stood aside (the script imports a library that distributes scripts: Lightning's Trainer(devices=1)
    is such a one-device script), and the script starts no process group: each process would train its own copy.
    Copies are never what --unchanged asks for: every rank stops at the first step, in one line (before: N copies,
    and a warning telling the user who typed --unchanged to use --unchanged)."""
    (tmp_path / "copies.py").write_text(COPIES)
    done = run_ddpkit("run", "--unchanged", "--nproc-per-node", "2", "copies.py", timeout=120, cwd=tmp_path)
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert "step 0 done" not in done.stdout and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stderr.count("--unchanged stood aside: copies.py distributes itself (it imports ddpkit)") == 1
    assert re.search(r"ddpkit: error: --unchanged stood aside \(the script imports ddpkit\), and the script steps its "
                     r"optimizer with no process group: each of the 2 processes would train its own copy",
                     done.stderr), done.stderr
    assert "`ddpkit run --unchanged` splits" not in done.stderr


PREFETCHED = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from timm.data.loader import PrefetchLoader

torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
# Images as a decoder gives them (bytes: the wrapper normalises them), 29 in batches of 6: the last one 5 (3 + 2).
images, labels = torch.randint(0, 256, (29, 3, 8, 8), dtype=torch.uint8), torch.randint(0, 4, (29,))
def prefetched(shuffle):
    return PrefetchLoader(DataLoader(TensorDataset(images, labels), batch_size=6, shuffle=shuffle),
                          device=torch.device("cpu"), img_dtype=torch.float64)
train, val = prefetched(True), prefetched(False)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(2):
    model.train()
    for x, y in train:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"epoch {epoch}: {len(x)} rows, loss {loss.item():.9f}")
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in val)
    print(f"epoch {epoch}: {correct} of 29 right")
model.train()  # a step on a batch of the script's own, after the passes: the same on every process, computed whole
x, y = (torch.rand(7, 3, 8, 8) - 0.5) * 4, torch.randint(0, 4, (7,))
loss = F.cross_entropy(model(x), y)
optimizer.zero_grad()
loss.backward()
optimizer.step()
print(f"epoch 2: its own batch, loss {loss.item():.9f}")
torch.save(model.state_dict(), sys.argv[1])
"""


def test_a_loader_that_a_wrapper_fetches_ahead_trains_and_prints_as_on_one_process(tmp_path):
    """timm's PrefetchLoader holds a batch ahead of the step, and hands out the pass's last one after its DataLoader
    has ended (before: the run stopped there, in a message about a loss its model never returned). Its batches are
    read whole and cut at the model: float64, 2 processes against 1, every printed line and the weights, with
    BatchNorm and a short last batch. Then a step on a batch the script makes itself, the same on every process:
    computed whole (before: refused, in the same message)."""
    pytest.importorskip("timm")
    (tmp_path / "prefetched.py").write_text(PREFETCHED)
    outs, weights = [], []
    for nproc in (1, 2):
        done = run_ddpkit("run", "--unchanged", "--seed", "0", "--nproc-per-node", str(nproc), "prefetched.py",
                          f"w{nproc}.pt", timeout=120, cwd=tmp_path)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        outs.append(re.findall(r"^epoch \d: .*$", done.stdout, re.M))
        weights.append(torch.load(tmp_path / f"w{nproc}.pt"))
    assert outs[0] == outs[1] and len(outs[1]) == 13, outs
    assert relative_difference(*weights) < 1e-9
    assert done.stderr.count("a wrapper around a DataLoader fetches its batches ahead of the step") == 1


STEPS = str(Path(__file__).with_name("unchanged_steps_script.py"))


def steps_run(tmp: Path, nproc: int, *flags: str, expect: int = 0) -> tuple[dict, list[str], str]:
    """tests/unchanged_steps_script.py under ``--unchanged FLAGS`` on ``nproc`` processes, ending with status
    ``expect``: its weights, its printed lines and its stderr."""
    out = tmp / f"steps{nproc}{''.join(flags)}"
    out.mkdir()
    done = run_ddpkit("run", "--unchanged", "--seed", "3", *flags, "--nproc-per-node", str(nproc), "--log-dir",
                      str(out / "logs"), STEPS, str(out), timeout=120, cwd=tmp)
    assert done.returncode == expect, f"{done.stdout}\n{done.stderr}"
    result = torch.load(out / "result.pt")
    result["logs"] = [(out / "logs" / f"rank{rank}.log").read_text() for rank in range(nproc)]
    return result, re.findall(r"^\w+ \d: .*$", done.stdout, re.M), done.stderr


def assert_steps_as_on_one_process(one: tuple, two: tuple) -> None:
    (weights_one, printed_one, _), (weights_two, printed_two, said) = one, two
    # (whether it finds a group, 10 steps a model but 6 of the binary one and 20 of the augmented one, 2 epochs' lines
    # of five models, a call that raised, 2 of each epoch's metrics where torchmetrics is installed, and 2 of the model
    # called on each sample of a list, less the 2 batches that the hooked part skips, 2 of the straight part, 3 of the
    # regressor, 2 of the collected part, and the 17 lines of the models over batches cut by hand: 10 steps, 2 of the
    # reader's 5, 5)
    lines = (1 + (19 + ("spectral" in weights_one) + ("penalty" in weights_one) + ("sparse" in weights_one)
                  + 2 * ("taken" in weights_one) + ("scripted" in weights_one) + ("renormed" in weights_one)) * 10 + 20 + 6 + 5 * 2 + 1 + 4 * ("metrics" in weights_one) + 2 + 2 - 2 + 2
             + 3 + 2 + 17)
    assert printed_one == printed_two and len(printed_two) == lines, printed_two
    # Batches cut by hand, given by keyword: each call but the first (whole, then computed both ways: the whole batch
    # and this process's share, its loss a mean over rows) cut at the model, its keyword tensors too.
    assert weights_one["rows"]["byhand"].tolist() == [6] * 10
    assert weights_two["rows"]["byhand"].tolist() == [6, 6, 3] + [3] * 9, weights_two["rows"]["byhand"]
    # And its logits, which the loop reads from its second step on, every other step: gathered on each share from the
    # second call (the loop's code loads them again; the counts printed equal).
    assert weights_two["rows"]["read"].tolist() == [6, 6, 3, 3, 3, 3, 3], weights_two["rows"]["read"]
    # Towers whose in-batch loss the check shows not to be a mean over rows: every call whole (said below).
    assert weights_two["rows"]["inbatch"].tolist() == [6, 6, 3, 6, 6, 6, 6], weights_two["rows"]["inbatch"]
    assert said.count("the loop keeps Tokens's outputs beside its loss as `logits` and reads them, on batches cut by "
                      "hand") == 1, said
    for part, weights in weights_one.items():
        if part not in ("rows", "logs"):
            assert relative_norm(weights, weights_two[part]) < 1e-9, part
    # A model called by keyword is cut at the model: rank 0 computes 3 rows of each batch of 6 (and of the last, 5),
    # but at its first call, which is whole (it shows the way). On a torch whose global forward hooks are not given
    # a call's keywords (torch 2.4: ``KEYWORDS_SEEN``), its calls are whole, and exact all the same.
    rows = weights_two["rows"]["keywords"]
    assert weights_one["rows"]["keywords"].max() == 6 and rows[0] == 6 and rows[1:].max() == (3 if KEYWORDS_SEEN else 6)
    # The script finds no process group (its first line: "group 0: False"), nor does a model's code on a whole batch;
    # the code inside a call that computes this process's rows alone finds it, as a model's code under DDP does.
    assert printed_two[0] == "group 0: False" and not weights_one["rows"]["groups"].any()
    assert weights_two["rows"]["groups"].tolist() == (rows < weights_one["rows"]["keywords"]).tolist()
    # A loss that a model computes across its batch's rows is computed whole; a mean over rows (counted) is split.
    # (A replica's first call is tried on a share, 3 rows, and made again whole where it returns a loss; a sharded
    # one's is whole. Each pass's first step is whole: it shows the way. Rank 0's share of 5 rows is 3.)
    towers, tagger = weights_two["rows"]["towers"].tolist(), weights_two["rows"]["tagger"].tolist()
    assert towers[-10:] == weights_one["rows"]["towers"].tolist() and towers[:-10] in ([], [3]), towers
    assert tagger[-10:] == [6, 3, 3, 3, 3] * 2 and tagger[:-10] in ([], [3]), tagger
    # A model called by keyword that returns its loss (counted, or given num_items_in_batch) and its logits, on the
    # gathered way: its calls cut at the model but its first, the loss made the batch's, the logits gathered. (On a
    # torch whose global hooks do not show a call's keywords, it cannot be computed again: whole, said.)
    for counted in (0, 1):
        assert weights_two["rows"][f"returned{counted}"].tolist() == ([6] + [3] * 9 if KEYWORDS_SEEN
                                                                      else [6, 6, 6, 6, 5] * 2)
    # The binary one's last batch of 3 leaves rank 1 a share of one row, whose logits are one element: rows all the
    # same, not a loss (batches of 13, 13 and 3: rank 0 computes 7 and 2 of them).
    assert weights_two["rows"]["binary"].tolist() == ([13, 7, 2, 7, 7, 2] if KEYWORDS_SEEN else [13, 13, 3] * 2)
    assert said.count("returns a loss that is not shown to be a mean or a sum over the rows of its batch") == (
        2 if KEYWORDS_SEEN else 5), said
    assert said.count("a training step that is not proven exact on split batches") == 1, said
    assert said.count("trains on each process's shares of batches that a split pass handed out, handed out") == 1, said
    # (A model of several outputs on the gathered way, whose DDP looks for unused parameters, ddpkit's decision: DDP
    # does not tell the user to turn off a flag they never set.)
    assert "find_unused_parameters=True was specified" not in said, said
    assert said.count("Sequential is a TorchScript module (torch.jit.script or trace)") == ("scripted" in weights_two)
    assert "ParametrizationList" not in said, said
    assert "fetches its batches ahead" not in said, said  # (no wrapper: a lazy model's first call, left whole)
    assert said.count("Sequential is given fewer rows than there are processes (1 of them, 2 processes)") == 1, said
    assert said.count("Sequential runs hooks of the script's own inside it, which would read a share of its batch "
                      "(a forward hook on its layer 1, a Tanh)") == 1, said
    assert said.count("KeepsItsOwn keeps tensors that it computes on itself, which would be a share's (self.hidden)"
                      ) == 1, said
    # A model called twice before a backward (two views) on the gathered way: both calls cut at the model (rank 0's
    # share of a batch of 6, and of the last of 5, is 3), from the first step on (a sharded model's first call whole).
    # (After its first call, the check's: that batch whole and this share, without gradients: ``check_both_ways``.)
    assert weights_two["rows"]["views"].tolist()[1:] == [6, 3] + [3] * 19, weights_two["rows"]["views"]
    # A loader on the gathered way that reads in workers, and collates by rows where its first batch shows it: from its
    # second pass, each process reads its share and the collated shares are put together. Rank 0's reads (its files
    # are the run's): its first pass whole, and the first batch's 6 samples read once more in the main process (the
    # check); then its shares (3 of each batch), and whole in the main process the third and fifth batches (6 and 5),
    # whose shares are padded to lengths 3 and 4 (the second and fourth: 4 and 4, put together).
    assert weights_one["rows"]["reads"].tolist() == [29, 29] and weights_two["rows"]["reads"].tolist() == [35, 26]
    assert said.count("each process reads its share of each batch and the collated shares are gathered") == 1, said
    # A loader's persistent worker, started at its first pass from the shared streams, is started again at its second
    # (split) from each process's own: the draws for the two processes' shares differ, as two samples' of one batch do
    # (each reads 15 or 14 of the 29 samples; before, the two drew the same numbers, one sample apart).
    # (Matched by the number, not by lines: a worker writes its "drawn" and its newline apart, and the main process's
    # lines land between them.)
    def drawn(epoch: int) -> list[list[str]]:
        return [re.findall(r"drawn (\d\.\d{9})", log.split(f"augmented: epoch {epoch}")[1].split("augmented: epoch")[0])
                for log in weights_two["logs"]]

    assert min(map(len, drawn(1))) >= 14 and not set(drawn(1)[0]) & set(drawn(1)[1]), drawn(1)
    # Gathered from the third epoch, and read whole (its worker_init_fn might seed its workers alike): from the fourth,
    # its workers start again, their seeds the same on every process, which then read the same batches.
    assert len(drawn(3)[0]) == 29 and drawn(3)[0] == drawn(3)[1], drawn(3)
    assert said.count("every process reads each of its batches whole (its workers run a function") == 1, said
    # Models that compute across their batch's rows and return no loss (in-batch similarities, batch statistics
    # written by hand): their first call, tried on a share (3 rows), computed both ways without gradients (6 and 3),
    # differs, and not with the random state (the whole batch once more, from another: 6), so it is made again whole
    # (6), and every later call is whole on every process. (A sharded model's first call is whole: then the check, and
    # no call again.)
    for name in ("similarity", "centred"):
        rows = weights_two["rows"][name].tolist()
        assert rows[-9:] == [6, 6, 6, 5] + [6] * 4 + [5] and rows[:-9] in ([3, 6, 3, 6, 6], [6, 6, 3, 6]), (name, rows)
    assert said.count("computes across the rows of its batch (its outputs on a share of the batch are not") == 2, said
    # A model that draws at random in evaluation too (as a VAE does): its share's rows differ from the whole batch's,
    # and so does the whole batch from another random state (a fourth call, 6 rows): the check cannot tell, and its
    # calls are cut as before, each process drawing its rows' noise (its weights therefore not compared).
    rows = weights_two["rows"]["noisy"].tolist()
    assert rows[-9:] == [3] * 9 and rows[:-9] in ([3, 6, 3, 6], [6, 6, 3, 6]), rows
    # A BatchNorm that keeps no running statistics normalises by its batch's in evaluation too: the check computes it
    # by fixed ones (in training ddpkit's computes it over every process's rows), so its model's calls are cut and its
    # loader split, exact (before, it was computed whole).
    rows = weights_two["rows"]["free"].tolist()
    assert rows[-9:] == [3] * 9 and rows[:-9] in ([3, 6, 3], [6, 6, 3]), rows


@pytest.fixture(scope="session")
def steps_one(tmp_path_factory) -> tuple:
    """The steps script on one process, once per pytest run (``once_per_run``): the reference here and sharded."""
    return once_per_run("steps_one", lambda: steps_run(tmp_path_factory.mktemp("steps"), 1))


def test_steps_that_a_split_would_change_take_the_gathered_way_and_train_and_print_as_on_one_process(steps_one,
                                                                                                    tmp_path):
    """Each of these steps is silently different on split batches; none needs a flag: a contrastive loss over two
    views by two calls of the encoder with a learned temperature, a summed loss with SGD, a masked mean written by
    hand, a denoiser whose loop draws its noise and levels, the classic loop that prints its epoch's loss from
    ``loss.item() * inputs.size(0)`` and its accuracy from ``(preds == labels).sum()``, a model that writes a
    running mean of its inputs into a buffer in its training forward (spectral norm's buffers, written from the
    weights alone, split), a model called by keyword (its calls cut at
    the model all the same), a loss term that only the batches with a rare class have (a head left without a
    gradient in the other steps, as on one device: no exit, no flag), a summed term that the second epoch adds to
    a loader whose first epoch was split (its way decided again at each pass), and torchmetrics' sums, means and
    concatenations in training and in evaluation (which sync over any process group they find: the script started
    none). float64, 2 processes against 1: every printed line, every weight and the buffer, to 1e-9. Its last part,
    two backward passes through one call before a step (which DDP cannot average), is refused in one line, exit
    status 2, at its first step."""
    weights, printed, said = steps_run(tmp_path, 2, expect=2)
    assert said.count("--unchanged: the outputs of one call of Sequential were differentiated by a second backward "
                      "pass before its next call") == 1 and "Traceback" not in said, said
    assert "again" in steps_one[0] and "again" not in weights
    assert_steps_as_on_one_process(({part: value for part, value in steps_one[0].items() if part != "again"},
                                    *steps_one[1:]), (weights, printed, said))
    # Spectral norm's buffers, written from the weights alone: its first call tried on a share (3 rows), made again
    # whole to compare what each writes (6), then every call split (before: every call whole, no faster).
    assert weights["rows"]["spectral"].tolist() == [3, 6] + [3] * 9, weights["rows"]["spectral"]
    assert "Normalised writes" not in said and said.count("Centred writes buffers of its own in training") == 1, said


TRAINER = str(Path(__file__).with_name("unchanged_trainer_script.py"))


@pytest.mark.slow
def test_a_script_training_through_transformers_trainer_stands_aside_before_its_first_line_and_finishes(tmp_path):
    """The Trainer distributes itself (Accelerate inside): --unchanged stands aside before the script starts, saying
    what batch a step takes, and the run ends with the Trainer's own saving (before: half distributed, then dead in
    ddpkit's once-only torch.save)."""
    pytest.importorskip("transformers")
    done = run_ddpkit("run", "--unchanged", "--nproc-per-node", "2", TRAINER, str(tmp_path), timeout=180, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "stood aside: " in done.stderr and "trains through transformers.Trainer" in done.stderr
    assert "per_device_train_batch_size samples on every process" in done.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 3  # 48 samples, 8 on each of 2 processes a step
    assert "model.safetensors" in result["saved"]


def test_whole_models_saved_pickled_and_deep_copied_are_one_process_files_its_classes_weights_and_globals(runs):
    (one, _, one_result), (mean, _, two_result), (summed, _, summed_result) = \
        runs["both", 1], runs["mean", 2], runs["sum", 2]
    files = [str(one / name) for name in ("whole.pt", "best.pt", "lm.pt")]
    files += [str(mean / "whole.pt"), str(mean / "best.pt"), str(summed / "lm.pt")]
    loaded = loaded_whole(files, references=3)
    assert loaded[files[0]]["classes"] == ['torch.nn.modules.activation.ReLU', 'torch.nn.modules.batchnorm.BatchNorm1d',
                                           'torch.nn.modules.container.Sequential', 'torch.nn.modules.linear.Linear']
    assert loaded[files[-1]]["classes"][0] == "__main__.TinyLanguageModel"
    for a, b in ((0, 3), (1, 4), (2, 5)):  # 1 process against 2: the whole model, its copy, the language model
        assert worst_relative_difference({"m": loaded[files[a]]["weights"]}, {"m": loaded[files[b]]["weights"]}) < 1e-12
        # The same globals as one process's file: a script's own weights_only load with its safe_globals reads it.
        assert loaded[files[a]]["globals"] == loaded[files[b]]["globals"], (files[a], files[b])
    assert summed_result["pickled globals"] == one_result["pickled globals"]
    assert "builtins.getattr" not in summed_result["pickled globals"]
    # The copy, taken after the first epoch, evaluated on its own as a plain model: as on one process.
    assert two_result["best_plain"] == one_result["best_plain"] == ["Sequential", "BatchNorm1d", 0]
    assert two_result["best_eval"] == pytest.approx(one_result["best_eval"], rel=1e-12)
    assert summed_result["pickled"] == ["TinyLanguageModel", True]


def test_a_summed_loss_and_a_batch_cut_by_hand_with_its_loss_inside_the_model_train_as_on_one_process(runs):
    (_, _, one), (_, done, two) = runs["both", 1], runs["sum", 2]
    assert worst_relative_difference({name: one["weights"][name] for name in two["weights"]}, two["weights"]) < 1e-12
    assert one["seed_drawn"] == two["seed_drawn"]  # every rank seeded alike: the script's own draws agree
    assert len(re.findall(r"--unchanged: 2 processes train as one device would.*seed 5", done.stderr)) == 1, \
        done.stderr
    # A batch of a training pass that the script only evaluated: its share, said once.
    assert (one["counted inside a training pass"], two["counted inside a training pass"]) == (9, 5)
    assert len(re.findall(r"a pass over a DataLoader that trained its model split its batches", done.stderr)) == 1


def test_a_loss_that_couples_the_batch_trains_to_one_process_weights_with_loss_reduction_coupled(runs):
    # In-batch negatives (CLIP's loss, its targets made from the batch's size), BatchNorm in a tower, a temperature
    # returned by the model, an uneven last batch (5: 3 + 2): each rank computes its share, the outputs gathered.
    (_, _, one), (_, done, two) = runs["both", 1], runs["coupled", 2]
    assert worst_relative_difference({"clip": one["weights"]["clip"]}, two["weights"]) < 1e-12, done.stderr


@pytest.mark.slow
def test_a_loss_computed_inside_the_model_from_its_share_is_refused_with_coupled_in_one_line(tmp_path):
    _, done = unchanged(tmp_path, 2, "coupled-inside", "--loss-reduction", "coupled", expect=2)
    refusal = re.findall(r"--loss-reduction coupled: the model returns a tensor that is not one row per sample",
                         done.stderr)
    assert len(refusal) == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_batch_cut_by_hand_with_its_loss_outside_the_model_is_computed_whole_on_every_process_said_once(
        tmp_path, runs):
    # Exact against one process (in the shared runs: dropout from the shared streams), and said once. (A whole graph
    # at once is the same case: pytorch/examples' gcn and gat, benchmarks/public_unchanged.py.)
    (_, _, one), (_, mean, two) = runs["both", 1], runs["mean", 2]
    assert worst_relative_difference({"m": one["weights"]["outside"]}, {"m": two["weights"]["outside"]}) < 1e-12
    _, done = unchanged(tmp_path, 2, "outside")
    for stderr in (mean.stderr, done.stderr):
        assert len(re.findall(r"--unchanged: Sequential gets inputs that no DataLoader split .* every process computes "
                              r"each of its steps whole", stderr)) == 1, stderr
    drawn = re.findall(r"seed (\d+) \(drawn: repeat the run with --seed \1\)", done.stderr)
    assert len(drawn) == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_script_that_steps_an_optimizer_without_a_process_group_is_told_of_its_copies(tmp_path):
    done = run_ddpkit("run", "--nproc-per-node", "2", SCRIPT, str(tmp_path), "outside", timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"each of the 2 processes trains its own copy.*`ddpkit run --unchanged`", done.stderr)) == 1


# A one-device script that prints as it trains: each line once on the console under any launcher.
PRINTS = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (x, y) in enumerate(DataLoader(TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,))), batch_size=4)):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    print("step", step, "done")
"""


def printed_once(done: subprocess.CompletedProcess) -> None:
    """Each of the script's lines once on the console, and where the other ranks' output is, said once."""
    assert done.returncode == 0, done.stdout + done.stderr
    assert [len(re.findall(rf"^step {step} done$", done.stdout, re.M)) for step in range(3)] == [1, 1, 1], done.stdout
    said = re.findall(r"the other ranks' is in (\S+)rank<N>\.log", done.stderr)
    assert len(said) == 1, done.stderr
    assert Path(said[0], "rank1.log").read_text().count("done") == 3


def test_under_an_outer_torchrun_each_line_of_the_script_is_printed_once(tmp_path):
    (tmp_path / "prints.py").write_text(PRINTS)
    done = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "ddpkit", "run", "--unchanged", "prints.py"], timeout=120, cwd=tmp_path, warm=True)
    printed_once(done)


# -- the public originals, as their authors wrote them (../shared/corpus) ----------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    needs_corpus()
    return public_scripts_data(tmp_path_factory.mktemp("data"))


def original(tmp: Path, script: str, nproc: int, *args: str, flags=(), links=(), folders=()) -> tuple[Path, str]:
    """``ddpkit run --unchanged`` of the corpus's ``script`` on ``nproc`` processes, in a folder of its own that holds
    ``links`` (name, target) and ``folders`` first: where the script reads its data and companions, and writes."""
    folder = tmp / f"{Path(script).parent.name}{nproc}"
    folder.mkdir()
    for name in folders:
        (folder / name).mkdir()
    for name, target in links:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(target)
    done = run_ddpkit("run", "--unchanged", "--seed", "0", *flags, "--nproc-per-node", str(nproc),
                      str(CORPUS / script), *args, timeout=180, cwd=folder)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return folder, done.stdout


def relative_difference(a: dict, b: dict) -> float:
    """The norm of the difference of two state dicts' floating-point tensors over the norm of the first's."""
    keys = [key for key, value in a.items() if torch.is_tensor(value) and value.is_floating_point()]
    difference = sum(((a[key].double() - b[key].double()) ** 2).sum() for key in keys)
    return (difference / sum((a[key].double() ** 2).sum() for key in keys)).sqrt().item()


@pytest.mark.slow
@pytest.mark.skipif(not torch_at_least("2.6"), reason="pytorch/examples' ImageNet trainer uses torch.accelerator (2.6)")
def test_the_imagenet_original_with_batch_norm_trains_on_two_processes_as_on_one(data, tmp_path):
    # Its own code paths for DDP and DataParallel are there, each behind its flags: it runs under --unchanged. Images of
    # one colour each (its random crops and flips, drawn differently on each process, leave them as they are),
    # resnet18 with BatchNorm, 37 of them in batches of 32 then 5 (16 + 16, then 3 + 2), each cut in two (the first at
    # the model, its outputs gathered). In float32 the weights differ by float32's rounding in BatchNorm's backward,
    # grown by the step: PyTorch's kernel on one process sums in float32 (a gradient less its mean over 32 x 112 x 112
    # values a channel after conv1), over two processes the sums are float64's. 1.2e-4 of the weights' norm seen over
    # the two steps (1.9e-4 before the statistics' sums of squares were centred); a method's error (an unweighted
    # mean, a BatchNorm of the share alone) is 1e-2.
    args = [str(data / "flatfolder"), "-a", "resnet18", "-j", "0", "-b", "32", "--lr", "0.01", "-p", "100", "--seed",
            "0", "--epochs", "1"]
    (one, one_out), (two, two_out) = [original(tmp_path, "pytorch-examples/imagenet/main.py", nproc, *args)
                                      for nproc in (1, 2)]
    weights = [torch.load(folder / "checkpoint.pth.tar", weights_only=True)["state_dict"] for folder in (one, two)]
    assert relative_difference(*weights) < 3e-4
    # Its evaluation counts the 37 samples once; with weights float32's rounding apart, a prediction whose two best
    # scores nearly tie may go either way: one sample's worth, 100/37 points, at most.
    summary = r" \*   Acc@1 (\S+) Acc@5 (\S+)"
    (one_summary,), (two_summary,) = re.findall(summary, one_out), re.findall(summary, two_out)
    assert all(abs(float(a) - float(b)) <= 100 / 37 + 1e-3 for a, b in zip(one_summary, two_summary))
    assert (two / "model_best.pth.tar").is_file()  # copied by every rank from the file rank 0 wrote first


def nanogpt(tmp: Path, data: Path, nproc: int, flags=()) -> tuple[Path, str]:
    """nanoGPT's train.py, as its authors wrote it, on ``nproc`` processes: a small model, 10 iterations."""
    args = ["--dataset=chargpt", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8",
            "--gradient_accumulation_steps=4", "--eval_interval=5", "--eval_iters=2", "--log_interval=5",
            "--warmup_iters=2", "--lr_decay_iters=30", "--learning_rate=3e-3", "--min_lr=3e-4", "--compile=False",
            "--dtype=float32", "--device=cpu", "--out_dir=gpt", "--max_iters=10"]
    links = [("configurator.py", CORPUS / "nanogpt" / "configurator.py"), ("data/chargpt", data / "chargpt")]
    return original(tmp, "nanogpt/train.py", nproc, *args, flags=flags, links=links)


@pytest.fixture(scope="module")
def nanogpt_one(data, tmp_path_factory) -> tuple[Path, str]:
    """nanoGPT on one process: the reference of its runs replicated and sharded (on one process, --shard has nothing
    to shard)."""
    return nanogpt(tmp_path_factory.mktemp("nanogpt"), data, 1)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [[], ["--shard", "always"]], ids=["replica", "sharded"])
def test_the_nanogpt_original_cutting_its_batches_by_hand_trains_and_prints_as_on_one_process(data, nanogpt_one,
                                                                                              tmp_path, sharding):
    # nanoGPT distributes itself where a launcher's RANK is set: under --unchanged it finds none, and takes its one-device
    # way. Its batches are drawn by hand (no DataLoader) and cut at the model. Sharded too: AdamW's two parameter groups
    # built before the first call, tied weights, a checkpoint with the optimizer's state dict.
    (one, one_out), (two, two_out) = nanogpt_one, nanogpt(tmp_path, data, 2, sharding)
    weights = [torch.load(folder / "gpt" / "ckpt.pt", weights_only=False)["model"] for folder in (one, two)]
    assert relative_difference(*weights) < 1e-5
    printed = r"(step \d+: train loss \S+, val loss \S+|iter \d+: loss \S+)"
    assert re.findall(printed, one_out) == re.findall(printed, two_out) and len(re.findall(printed, two_out)) == 6
    optimizer = torch.load(two / "gpt" / "ckpt.pt", weights_only=False)["optimizer"]
    assert all(type(value) is torch.Tensor for state in optimizer["state"].values() for value in state.values())


@pytest.mark.slow
@pytest.mark.skipif(not torch_at_least("2.6"), reason="pytorch/examples' VAE uses torch.accelerator (torch>=2.6)")
def test_the_vae_original_summing_its_loss_reaches_one_process_test_loss_with_no_flag(data, tmp_path):
    # Its summed loss takes the gathered way, found from its step. Its noise (the reparameterisation, inside the
    # model) is each sample's own draw: the runs agree in what they reach, not bit for bit.
    # It reads MNIST from ../data and writes its images into results/, which must be there.
    (tmp_path / "data").symlink_to(data)
    args = ["--epochs", "1", "--batch-size", "64", "--log-interval", "100"]
    losses = []
    for nproc in (1, 2):
        folder, out = original(tmp_path, "pytorch-examples/vae/main.py", nproc, *args, folders=["results"])
        losses.append([float(value) for value in re.findall(r"====> Test set loss: (\S+)", out)])
        assert {path.name for path in (folder / "results").iterdir()} == {"sample_1.png", "reconstruction_1.png"}
    assert len(losses[1]) == 1 and losses[1][-1] == pytest.approx(losses[0][-1], rel=0.01), losses
