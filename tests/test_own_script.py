"""A user's own script on ddpkit: its DataLoaders, optimizer and scheduler prepared as they are, its own checkpoint
dict, its own evaluation loops, and a plain torch.distributed script that ddpkit run watches unedited."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, WeightedRandomSampler

import ddpkit
from conftest import leftover_processes, max_relative_difference, needs_fsdp_on_cpu, run_ddpkit
from ddpkit.core.env import DistEnv
from ddpkit.core.process_group import Runtime
from ddpkit.data import eval_loader, train_loader


def runtime(rank: int = 0, world: int = 1) -> Runtime:
    return Runtime(env=DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world),
                   backend="gloo" if world > 1 else None, device=torch.device("cpu"))


# -- the script's own DataLoader, kept


def as_dict(samples):
    """A collate_fn of the script's own."""
    x, y = torch.utils.data.default_collate(samples)
    return {"x": x, "y": y}


def note_worker(worker_id: int) -> None:
    """A worker_init_fn of the script's own: each sample says which worker made it, and that this ran."""
    os.environ["OWN_INIT"] = str(100 + worker_id)


class Marked(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        return torch.tensor(index), torch.tensor(int(os.environ.get("OWN_INIT", "-1")))


def test_a_wrapped_loader_keeps_what_the_script_set():
    mine = DataLoader(Marked(), batch_size=4, shuffle=True, collate_fn=as_dict, num_workers=2, pin_memory=True,
                      drop_last=True, persistent_workers=True, worker_init_fn=note_worker, prefetch_factor=3)
    ours = train_loader(mine, runtime=runtime(1, 2))
    inner = ours.loader
    assert (inner.batch_size, inner.num_workers, inner.pin_memory, inner.drop_last) == (4, 2, True, True)
    assert (inner.collate_fn, inner.persistent_workers, inner.prefetch_factor) == (as_dict, True, 3)
    batches = list(ours)
    assert len(batches) == 40 // (4 * 2) and all(set(batch) == {"x", "y"} for batch in batches)
    assert {int(worker) for batch in batches for worker in batch["y"]} == {100, 101}  # its worker_init_fn ran
    # Rank 1 of 2 takes every other sample of one shuffled order: half the set, no sample twice.
    seen = [int(i) for batch in batches for i in batch["x"]]
    assert len(seen) == len(set(seen)) == 20
    # A loader that does not shuffle is for evaluation: every sample on exactly one rank, nothing padded.
    plain = DataLoader(TensorDataset(torch.arange(101)), batch_size=8)
    shares = [[int(i) for (batch,) in eval_loader(plain, runtime=runtime(rank, 2)) for i in batch] for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == list(range(101)) and len(shares[0]) == 51


def test_no_worker_processes_the_script_did_not_ask_for():
    assert train_loader(Marked(), 4, runtime=runtime()).loader.num_workers == 0
    assert train_loader(DataLoader(Marked(), batch_size=4, num_workers=1), runtime=runtime()).loader.num_workers == 1
    assert train_loader(Marked(), 4, runtime=runtime(), workers="auto").loader.num_workers >= 1


def test_loaders_ddpkit_cannot_split_are_one_line_each():
    weighted = DataLoader(TensorDataset(torch.arange(8)), batch_size=2,
                          sampler=WeightedRandomSampler(torch.ones(8), num_samples=8))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    for loader, says in ((weighted, "draws with a WeightedRandomSampler"), (DataLoader(Stream(), batch_size=2),
                                                                               "over an IterableDataset (Stream)")):
        with pytest.raises(ddpkit.UsageError, match=re.escape(says)) as caught:
            train_loader(loader, runtime=runtime())
        assert "\n" not in str(caught.value) and "job.rank" in str(caught.value)


def test_an_epoch_ends_when_a_pass_does_and_set_epoch_chooses(caplog):
    loader = train_loader(TensorDataset(torch.arange(32)), 8, runtime=runtime(), seed=3)
    order = lambda: [int(i) for (batch,) in loader for i in batch]  # noqa: E731
    next(iter(loader))  # a peek, as a tutorial prints a batch's shape
    first = order()
    assert loader.epoch == 1 and order() != first  # the peek did not use up epoch 0; the pass ended it
    loader.set_epoch(0)
    assert order() == first  # as DistributedSampler's set_epoch: epoch 0's order again
    batches = iter(loader)
    next(batches), next(batches)  # a loop that broke off after two batches
    again = order()
    assert again == order_of(loader, 1) and "did not end" in caplog.text


def order_of(loader, epoch: int) -> list[int]:
    loader.set_epoch(epoch)
    return [int(i) for (batch,) in loader for i in batch]


def test_print_passes_flush_and_other_keywords(capsys):
    with ddpkit.Job("single", device="cpu") as job:
        job.print("a", "b", sep="-", flush=False)
        job.print("c", flush=True)
        ddpkit.print0(job.runtime, "d", flush=True)
    assert capsys.readouterr().out == "a-b\nc\nd\n"


def test_a_job_leaves_the_scripts_seed_alone():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    with ddpkit.Job("single", device="cpu"):
        assert torch.equal(torch.rand(3), expected)  # no seed asked for: the script's own stream goes on


# -- the script's own loop: prepared objects, its own checkpoint dict, 2 x 16 = 1 x 32

OWN_LOOP = """
import sys, torch, torch.nn as nn, torch.nn.functional as F, ddpkit
from torch.utils.data import DataLoader, TensorDataset

out, batch, stop_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resume = sys.argv[4] if len(sys.argv) > 4 else None
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))

def as_dict(samples):
    x, y = torch.utils.data.default_collate(samples)
    return {"x": x, "y": y}

model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
loader = DataLoader(data, batch_size=batch, shuffle=True, collate_fn=as_dict, drop_last=True)
job = ddpkit.Job()
model, optimizer, scheduler, loader = job.prepare(model, optimizer, scheduler, loader)
start = 0
if resume:
    state = torch.load(resume, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    job.load_state_dict(state["job"])
    start = state["epoch"]
for epoch in range(start, 3):
    for b in loader:
        # The RNG matters: a resumed run is bit-identical only with every rank's random state restored.
        loss = F.cross_entropy(model(b["x"]), b["y"]) * (1 + 0.1 * torch.rand(()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if job.global_step == stop_at:  # the script's own checkpoint, mid-epoch; the run goes on
            job.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "scheduler": scheduler.state_dict(), "epoch": epoch, "job": job.state_dict()}, out + "/own.pt")
    scheduler.step()
job.save(ddpkit.unwrap(model).state_dict(), out + "/final.pt")
job.print("steps", job.global_step)
"""


@pytest.fixture(scope="module")
def own_loop_runs(tmp_path_factory):
    """Final weights of 2 x 16 (which saves its own dict at step 10, mid-epoch 2), of 1 x 32, and of 2 x 16 resumed
    from that dict."""
    folder = tmp_path_factory.mktemp("own")
    script = folder / "own_loop.py"
    script.write_text(OWN_LOOP)
    results = {}
    for name, nproc, batch, resume in (("two", "2", "16", None), ("one", "1", "32", None),
                                       ("resumed", "2", "16", "two/own.pt")):
        out = folder / name
        out.mkdir()
        args = [str(script), str(out), batch, "10"] + ([str(folder / resume)] if resume else [])
        done = run_ddpkit("run", "--nproc-per-node", nproc, *args, timeout=120, cwd=folder)
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("steps 24") == 1, done.stdout  # 3 epochs of 256 / 32; rank 0 alone prints
        results[name] = torch.load(out / "final.pt", weights_only=True)
    return results


def test_two_processes_of_16_train_as_one_of_32_through_the_scripts_own_loaders(own_loop_runs):
    assert max_relative_difference(own_loop_runs["two"], own_loop_runs["one"]) < 1e-5


def test_the_scripts_own_checkpoint_dict_resumes_mid_epoch_bit_for_bit(own_loop_runs):
    assert all(torch.equal(own_loop_runs["two"][key], value) for key, value in own_loop_runs["resumed"].items())


# -- exact evaluation of any model

EVALUATE = """
import json, sys, torch, torch.nn as nn, torch.nn.functional as F, ddpkit
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x, y = torch.randn(101, 6), torch.randint(0, 10, (101,))

class WithLoss(nn.Module):  # returns (logits, loss), as HF models and nanoGPT do
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 10)

    def forward(self, inputs, targets=None):
        logits = self.net(inputs)
        return logits, None if targets is None else F.cross_entropy(logits, targets)

job = ddpkit.Job()
model, loader = job.prepare(WithLoss(), DataLoader(TensorDataset(x, y), batch_size=8))
# Two processes: PyTorch's DDP, with its own bucket default (a small first bucket) unless the script sets one.
ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
default_buckets = ddp and model.bucket_bytes_cap == torch.nn.parallel.DistributedDataParallel(nn.Linear(1, 1)).bucket_bytes_cap
loss, top1, top5, count = job.evaluate(model, loader, topk=(1, 5))
# The script's own loop: sums, then one line; predictions gathered once for a metric over all of them.
total, hits, seen, predictions = 0.0, 0, 0, []
with torch.no_grad():
    for inputs, targets in loader:
        logits, batch_loss = model(inputs, targets)
        total += batch_loss.item() * len(targets)
        hits += (logits.topk(5).indices == targets[:, None]).any(1).sum().item()
        seen += len(targets)
        predictions.append(logits.argmax(1))
total, hits, seen = job.sum(total, hits, seen)
gathered = job.gather(torch.cat(predictions))
# What one process makes of the whole set.
with torch.no_grad():
    logits = ddpkit.unwrap(model).net(x)
expected = {"loss": F.cross_entropy(logits, y).item(), "top1": (logits.argmax(1) == y).float().mean().item(),
            "top5": (logits.topk(5).indices == y[:, None]).any(1).float().mean().item()}
if job.is_main:
    json.dump({"evaluate": [loss, top1, top5, count], "own": [total / seen, hits / seen, seen],
               "gathered": sorted(gathered.tolist()), "expected": expected,
               "expected_predictions": sorted(logits.argmax(1).tolist()), "batches": len(loader),
               "ddp_with_default_buckets": default_buckets},
              open(sys.argv[1], "w"))
"""


def on_two_processes(tmp_path, script_text: str) -> dict:
    """What a script run by ``ddpkit run --nproc-per-node 2 SCRIPT OUT.json`` wrote to OUT.json."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    done = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path / "out.json"), timeout=120,
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "out.json").read_text())


def test_top5_and_a_model_returning_logits_and_loss_count_every_sample_once(tmp_path):
    out = on_two_processes(tmp_path, EVALUATE)
    expected = out["expected"]
    loss, top1, top5, count = out["evaluate"]
    assert count == 101 and out["batches"] == 7  # rank 0: 51 samples in batches of 8; rank 1: 50
    assert out["ddp_with_default_buckets"]
    assert loss == pytest.approx(expected["loss"], rel=1e-5)
    assert (top1, top5) == (pytest.approx(expected["top1"]), pytest.approx(expected["top5"]))
    total, hits, seen = out["own"]
    assert seen == 101 and total == pytest.approx(expected["loss"], rel=1e-5) and hits == pytest.approx(expected["top5"])
    assert out["gathered"] == out["expected_predictions"]  # 101 predictions, none twice


ACCUMULATE = """
import json, sys, torch, torch.nn as nn, torch.nn.functional as F, ddpkit
from torch.utils.data import TensorDataset

calls = []

def counting_hook(state, bucket):  # DDP's all-reduce of a bucket, counted, left out
    calls.append(bucket.index())
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future

with ddpkit.Job("ddp", accumulate=4) as job:
    model, optimizer = job.setup(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), torch.optim.SGD, lr=0.1)
    model.register_comm_hook(None, counting_hook)
    # 17 batches of 2 x 2: the 17th would start a 5th step that never completes, so the loader leaves it out.
    data = TensorDataset(torch.randn(68, 4), torch.randint(0, 3, (68,)))
    loader = job.train_loader(data, batch_size=2)
    shape = [len(loader), loader.steps_per_epoch, loader.global_batch]
    steps = 0
    for images, labels in loader:
        job.backward(F.cross_entropy(model(images), labels))
        steps += job.step(optimizer)
    if job.is_main:
        json.dump({"shape": shape, "steps": steps, "global_step": job.global_step, "calls": calls},
                  open(sys.argv[1], "w"))
"""


def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    # Without no_sync the weights would come out the same (an all-reduce per micro-step is linear), so count the
    # all-reduces themselves with a DDP communication hook, in two processes (one has no all-reduce at all).
    out = on_two_processes(tmp_path, ACCUMULATE)
    assert out["shape"] == [16, 4, 16] and out["steps"] == out["global_step"] == 4
    assert out["calls"] == [0, 0, 0, 0]  # 16 micro-steps, one bucket each, all-reduced on the 4 last ones


# -- the watch: a long evaluation of the script's own is work; a stopped rank is still named

OWN_EVALUATION = """
import os, signal, sys, time, torch, torch.nn as nn, torch.nn.functional as F, ddpkit
from torch.utils.data import DataLoader, TensorDataset

seconds, stop = float(sys.argv[1]), sys.argv[2] == "stop"
job = ddpkit.Job(stall_timeout_s=float(os.environ["STALL"]))
model, optimizer = job.setup(nn.Linear(8, 4), torch.optim.SGD, lr=0.1)
loader = job.prepare(DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,))), batch_size=8,
                                shuffle=True))
for x, y in loader:
    job.backward(F.cross_entropy(model(x), y))
    job.step(optimizer)
if stop and job.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped at the start of its evaluation
# An evaluation of the script's own with no ddpkit call: plain tensor arithmetic, no hooked module, no loader.
weight, started, total = ddpkit.unwrap(model).weight.detach(), time.monotonic(), 0.0
while time.monotonic() - started < seconds:
    total += float((torch.randn(256, 8) @ weight.T).softmax(1).sum())
total = job.sum(total)
job.print("evaluated", round(time.monotonic() - started))
"""


def test_an_evaluation_three_times_the_stall_timeout_ends_well_and_a_stopped_rank_is_still_named(tmp_path):
    script = tmp_path / "own_evaluation.py"
    script.write_text(OWN_EVALUATION)
    quick = {"DDPKIT_HEARTBEAT_S": "0.5", "STALL": "2"}  # a stall after 2 s: the evaluation runs 6
    done = run_ddpkit("run", "--nproc-per-node", "2", str(script), "6", "go", timeout=120, cwd=tmp_path, **quick)
    assert done.returncode == 0, done.stderr
    assert "evaluated 6" in done.stdout and "stalled" not in done.stderr
    started = time.monotonic()
    stopped = run_ddpkit("run", "--nproc-per-node", "2", str(script), "1", "stop", timeout=120, cwd=tmp_path, **quick)
    assert stopped.returncode != 0 and time.monotonic() - started < 60
    assert stopped.stderr.count("stalled:") == 1, stopped.stderr
    assert "rank 1 (host " in stopped.stderr and "its heartbeat stopped" in stopped.stderr
    assert not leftover_processes()


# -- a plain torch.distributed script, unedited, under ddpkit run

PLAIN = """
import time, torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(600)  # never reaches the second all_reduce
dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_a_plain_script_whose_rank_1_never_arrives_is_named_within_its_timeout(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    started = time.monotonic()
    done = run_ddpkit("run", "--timeout", "10", "--nproc-per-node", "2", str(script), timeout=120, cwd=tmp_path)
    took = time.monotonic() - started
    assert done.returncode != 0 and took < 80, f"took {took:.0f} s"
    named = [line for line in done.stderr.splitlines() if "rank(s) 1 never reached it" in line]
    assert len(named) == 1, done.stderr
    assert "<module> (plain.py:8)" in done.stderr  # rank 1's stack: asleep on line 8
    assert not leftover_processes()


def test_an_unedited_script_keeps_its_argv_file_and_exit_status(tmp_path):
    script = tmp_path / "argv.py"
    script.write_text("import os, sys\nprint(sys.argv, os.path.basename(__file__), __name__)\nsys.exit(3)\n")
    done = run_ddpkit("run", "--nproc-per-node", "1", str(script), "--flag", "x", timeout=60, cwd=tmp_path)
    assert done.returncode != 0
    assert f"['{script}', '--flag', 'x'] argv.py __main__" in done.stdout


@needs_fsdp_on_cpu
def test_under_fsdp_the_scripts_optimizer_and_scheduler_drive_the_sharded_parameters():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with ddpkit.Job("fsdp", device="cpu") as job:
        model, same, scheduler = job.prepare(model, optimizer, scheduler)
        assert same is optimizer and scheduler.optimizer is optimizer  # the script's own objects, kept
        sharded = [p for group in optimizer.param_groups for p in group["params"]]
        assert [id(p) for p in sharded] == [id(p) for p in model.parameters()] and hasattr(sharded[0], "to_local")
        before = [p.full_tensor().clone() for p in sharded]
        for _ in range(2):
            model(torch.randn(5, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        assert all(not torch.equal(p.full_tensor(), b) for p, b in zip(sharded, before)) and job.global_step == 2
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


@needs_fsdp_on_cpu
def test_an_optimizer_that_stepped_is_refused_where_its_parameters_must_change():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with ddpkit.Job("fsdp", device="cpu") as job, pytest.raises(ddpkit.UsageError, match="before its first step"):
        job.prepare(model, optimizer)
