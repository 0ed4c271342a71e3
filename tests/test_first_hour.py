"""What a new user meets in the first hour, each once a defect: a shuffling evaluation loader padded, an evaluation
through the prepared model that hung, the other ranks' output hidden, a rank that did its work reported failed at
exit, a prepared model's ``module.`` keys, ``None`` refused by ``prepare``, a traceback for a usage error outside
``with``, and SIGTERM ignored before the first step.

Most checks read one ``ddpkit run`` of two processes (``first_hour``): the script writes what it saw, each rank to
its own file, and the checks read those and the console.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit
from conftest import REPO, leftover_processes, run_ddpkit, warm_python, warm_ranks_env

SCRIPT = r'''
import json, os, sys
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
import ddpkit

out = sys.argv[1]
torch.manual_seed(0)
train_set = TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
test_set = TensorDataset(torch.randn(101, 1, 8, 8), torch.randint(0, 10, (101,)))
val_set = TensorDataset(torch.randn(9, 1, 8, 8), torch.randint(0, 10, (9,)))  # 2 ranks x batch 4: 2 and 1 batches


def loader_for(dataset):  # minGPT's way: one helper, shuffle=True, for the training and the test loader alike
    return DataLoader(dataset, batch_size=8, shuffle=True)


model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
job = ddpkit.Job()  # no `with`
model, optimizer, no_scheduler, train_dl, test_dl, val_dl = job.prepare(
    model, optimizer, None, loader_for(train_set), loader_for(test_set), DataLoader(val_set, batch_size=4))
seen = {"no_scheduler": no_scheduler is None, "keys": sorted(model.state_dict())[:2]}


def train_epoch():
    model.train()
    for x, y in train_dl:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


train_epoch()
# minGPT's evaluation: eval mode, gradients switched off inside the loop only
model.train(False)
count = 0
for x, y in test_dl:
    with torch.set_grad_enabled(False):
        model(x)
    count += len(y)
seen["mingpt_count"] = job.sum(count)
# Through the prepared (DDP) model, ranks holding 2 and 1 batches, with gradients on: eval mode, then train mode.
for mode in ("eval", "train"):
    model.train(mode == "train")
    count = 0
    for x, y in val_dl:
        model(x)
        count += len(y)
    seen[f"uneven_{mode}_count"] = job.sum(count)
train_epoch()  # training goes on after those: the replicas still agree
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
every = [torch.empty_like(weights) for _ in range(job.world_size)]
dist.all_gather(every, weights)
seen["replicas_agree"] = all(torch.equal(w, weights) for w in every)
# A padded training loader whose passes take no step: said once, not at every pass.
padded = job.train_loader(test_set, batch_size=8, drop_last=False)
for _ in range(2):
    for batch in padded:
        pass
# Under a strategy whose forwards are collectives, unequal evaluation batches are refused in one line, at once.
lockstep = ddpkit.eval_loader(val_set, 4, runtime=job.runtime, lockstep=True)
try:
    next(iter(lockstep))
except ddpkit.UsageError as error:
    seen["lockstep"] = str(error)
loss, acc, n = ddpkit.evaluate(ddpkit.unwrap(model), lockstep, job.runtime, lockstep=True)  # evened out in there
seen["lockstep_evaluated"] = n
# Loading a state saved from a plain DDP model, its keys prefixed.
model.load_state_dict({f"module.{key}": value for key, value in model.state_dict().items()})
seen["loaded_prefixed"] = True
with open(os.path.join(out, f"seen{job.rank}.json"), "w") as handle:
    json.dump(seen, handle)


class AbortAtTeardown:  # as gloo's threads can at the interpreter's teardown, after the work is done
    def __del__(self):
        os.abort()


json._ddpkit_teardown_canary = AbortAtTeardown()  # freed only when the interpreter clears its modules
print(f"rank {job.rank} of {job.world_size} done", flush=True)
'''


@pytest.fixture(scope="module")
def first_hour(tmp_path_factory):
    folder = tmp_path_factory.mktemp("first-hour")
    script = folder / "first_hour.py"
    script.write_text(SCRIPT)
    done = run_ddpkit("run", "--nproc-per-node", "2", "--stall-timeout", "20", "--log-dir", str(folder / "logs"),
                      str(script), str(folder), cwd=folder, timeout=150)
    seen = [json.loads((folder / f"seen{rank}.json").read_text()) if (folder / f"seen{rank}.json").exists() else None
            for rank in range(2)]
    return done, seen, folder


def test_a_rank_whose_script_returned_is_not_failed_by_the_interpreters_teardown(first_hour):
    done, seen, _ = first_hour
    # Before: the canary's abort at teardown failed the run (SIGABRT), as gloo's threads did 1 run in 6.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert None not in seen
    assert not leftover_processes()


def test_every_ranks_lines_reach_the_console(first_hour):
    done, _, folder = first_hour
    assert done.stdout.count("rank 0 of 2 done") == 1  # rank 0's, as it came
    assert done.stdout.count("[rank1]: rank 1 of 2 done") == 1, done.stdout  # before: not shown, its file deleted
    assert "rank 1 of 2 done" in (folder / "logs" / "rank1.log").read_text()


def test_a_shuffling_test_loader_counts_each_sample_once(first_hour):
    _, seen, _ = first_hour
    # minGPT's test loader shuffles like its training loader; evaluated in eval mode it deals each sample once.
    assert [s["mingpt_count"] for s in seen] == [101, 101]  # before: 102, a padded sample counted twice


def test_evaluating_through_the_prepared_model_never_hangs_on_uneven_batches(first_hour):
    _, seen, _ = first_hour
    # Before: DDP's buffer broadcast in each forward waited for the rank without a second batch (a stall).
    assert [s["uneven_eval_count"] for s in seen] == [9, 9]
    assert [s["uneven_train_count"] for s in seen] == [9, 9]
    assert all(s["replicas_agree"] for s in seen)


def test_a_padded_training_pass_without_a_step_is_said_once(first_hour):
    done, _, _ = first_hour
    assert done.stderr.count("a whole pass over a training loader took no optimizer step") == 1, done.stderr[-3000:]
    assert "(1 of 101 here), and sums over it (job.sum, job.gather) count 102 samples, not 101" in done.stderr


def test_unequal_batches_under_collective_forwards_are_one_error_not_a_hang(first_hour):
    _, seen, _ = first_hour
    for s in seen:
        assert "different numbers of evaluation batches (rank 0: 2, rank 1: 1)" in s["lockstep"]
        assert s["lockstep_evaluated"] == 9  # ddpkit.evaluate runs such ranks in lockstep


def test_a_prepared_model_has_the_bare_models_keys_and_takes_either(first_hour):
    _, seen, _ = first_hour
    for s in seen:
        assert s["keys"] == ["0.bias", "0.weight"]  # before: "module.0.bias", ...
        assert s["loaded_prefixed"] and s["no_scheduler"]  # None came back as None (before: a UsageError)


USAGE_ERROR = """
import torch.nn as nn, ddpkit
job = ddpkit.Job("single", device="cpu")
job.prepare(nn.Linear(2, 2), "not a loader")
"""


def test_a_usage_error_outside_with_is_one_line_and_status_2(tmp_path):
    script = tmp_path / "oops.py"
    script.write_text(USAGE_ERROR)
    env = warm_ranks_env()
    done = subprocess.run(warm_python([sys.executable, str(script)], env), capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2, done.stderr  # before: 1, after a traceback
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "[rank0]: ddpkit: error: `prepare` takes models, optimizers, LR schedulers and DataLoaders (and None, handed back as it "
        "is), not str"]


WAITS_FOR_A_PEER = "import ddpkit; ddpkit.Job(device='cpu'); print('not reached')"


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_stop_before_the_first_step_ends_the_rank_at_once(tmp_path):
    # Rank 0 of 2 whose peer never comes waits in C++ for it (the store, then gloo's mesh): Python's handlers never
    # ran, and SIGTERM was ignored for as long as it waited.
    from ddpkit.core.process_group import free_port

    waiting = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        port = free_port()
        # Forked from a warm interpreter (tests/warm_ranks.py): the signal reaches it through its client, as a
        # launcher's reaches a rank.
        env = warm_ranks_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=str(port))
        waiting[sig] = (port, subprocess.Popen(warm_python([sys.executable, "-c", WAITS_FOR_A_PEER], env), env=env,
                                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        for sig, (port, proc) in waiting.items():
            deadline = time.monotonic() + 60
            while not _listening(port) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert _listening(port), proc.communicate()[1]
            time.sleep(0.5)  # in the store's wait for its peer
            sent = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=10)
            assert time.monotonic() - sent < 3
            assert proc.returncode == 128 + sig, err
            name = signal.Signals(sig).name
            assert err.strip().splitlines() == [
                f"[rank0]: ddpkit: stopped by {name} while starting the process group at 127.0.0.1:{port} (rank 0 of "
                "2): before the first step, nothing to save"], err
    finally:
        for _, proc in waiting.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_a_training_step_in_a_pass_dealt_as_an_evaluation_is_refused():
    # A loader prepare took for training (it shuffles), iterated with the model in eval mode (frozen BatchNorm, say):
    # dealt as an evaluation, so a step in it is refused in one line instead of ranks with unequal batches.
    data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    with ddpkit.Job("single", device="cpu") as job:
        model, optimizer, loader = job.prepare(nn.Linear(3, 2), None, DataLoader(data, batch_size=4, shuffle=True))
        assert optimizer is None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        job.prepare(optimizer)
        model.eval()
        with pytest.raises(ddpkit.UsageError, match="call model.train\\(\\) before a training loop"):
            for x, y in loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        model.train()
        steps = 0
        for x, y in loader:  # in train mode: a training pass, as before
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
        assert steps == 4
