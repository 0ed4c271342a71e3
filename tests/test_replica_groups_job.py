"""A script of one's own on ``ddpkit.Job`` under replica groups: plain PyTorch objects handed to ``job.prepare``, its
own loop over epochs (``optimizer.zero_grad()``, ``loss.backward()``, ``optimizer.step()``, ``scheduler.step()``),
run by ``ddpkit run --replica-groups 2`` on one machine, gloo: groups of one process (DDP: torchft's, with ddpkit's
hook), and groups of two with FSDP inside each (HSDP: each process holds half of every parameter, and torchft
averages each shard with the same rank of the other group). tests/test_replica_groups_machines.py runs these checks on
groups of two DDP processes on two machines.

One run per layout, shared by the tests below. Group 1's first processes kill themselves in the backward of
step DIE_AT (while group 0 is in the gradient all-reduce across the groups, for groups of one process). Its second start (restart 1)
makes no ``ckpt.resume`` call, so it joins where the loop reads its training loader's epoch; it SIGKILLs itself after
AGAIN_AFTER steps of its own. Its third (restart 2) joins at ``ckpt.resume("auto")``. While alone, group 0 waits for
group 1's next start (on a GPU machine that takes longer) and then trains slowly, so that the run outlasts both
restarts. Every try of a step (its batch's sample indices, the loop's epoch, the checksum of the process's weights
or, under FSDP, of its shards, the learning rate) is in OUT/group<G>-rank<R>.jsonl. About 17 s with groups of one process, 20 s with groups of two (in the
slow target). tests/test_library_loop.py checks that groups of two DDP processes train as one
process."""

import contextlib
import json
import sys

import pytest
import torch

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'ddpkit[ft]')")

from conftest import run_ddpkit  # noqa: E402
from nodes import make_nodes, run_on_nodes  # noqa: E402

EPOCHS, SAMPLES, PER_PROCESS = 3, 512, 8
DIE_AT, AGAIN_AFTER = 28, 12

SCRIPT = '''
import json, os, signal, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import ddpkit
from ddpkit.watch.replicas import checksums  # the replica check's: each tensor's bits, summed

out_dir, epochs, samples, per_process, die_at, again_after, late = sys.argv[1], *map(int, sys.argv[2:8])
strategy = sys.argv[8]
with ddpkit.Job(seed=0, strategy=strategy) as job:    # joins this process's replica group (ddpkit run says which)
    group = job.replica
    out = open(os.path.join(out_dir, f"group{group.group}-rank{job.rank}.jsonl"), "a")

    def emit(**record):
        out.write(json.dumps({"group": group.group, "rank": job.rank, "pid": os.getpid(), "t": time.time(),
                              **record}) + "\\n")
        out.flush()

    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(samples, 16, generator=generator), torch.randn(samples, 4, generator=generator)
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(bare.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.01 * step))
    loader = DataLoader(TensorDataset(x, y, torch.arange(samples)), batch_size=per_process, shuffle=True)
    model, optimizer, scheduler, loader = job.prepare(bare, optimizer, scheduler, loader)
    ckpt = job.checkpointer(os.path.join(out_dir, "checkpoints"), model=model, optimizer=optimizer,
                            scheduler=scheduler, loader=loader)
    emit(event="start", restarts=group.restarts)
    if group.restarts != 1:  # the second process joins at its loader's first pass instead
        ckpt.resume("auto")

    def weights():  # this process's weights: under FSDP, its shards (the same rank of each group holds the same)
        return checksums((name, getattr(p, "to_local", lambda: p)()) for name, p in bare.named_parameters()).tolist()

    def die(grad):  # at the start of backward; group 0 is in the all-reduce across the groups by the time it dies
        time.sleep(0.3)
        emit(event="die", step=job.global_step)
        os.kill(os.getpid(), signal.SIGKILL)

    def group1_is_down():  # its processes have died as often as they have started (a start may take seconds)
        with open(os.path.join(out_dir, f"group1-rank{job.rank}.jsonl")) as records:
            events = [json.loads(line)["event"] for line in records if line.endswith("}\\n")]
        return events.count("die") >= events.count("start")

    mine, deadline = 0, time.time() + 120
    for epoch in range(loader.epoch, epochs):
        for inputs, targets, index in loader:
            before = job.global_step
            optimizer.zero_grad()
            loss = F.mse_loss(model(inputs), targets)
            if before + 1 == die_at and group.group == 1 and group.restarts == 0:
                loss.register_hook(die)
            loss.backward()
            optimizer.step()
            scheduler.step()
            emit(event="step", epoch=epoch, before=before, step=job.global_step, indices=index.tolist(),
                 checksum=weights(), lr=scheduler.get_last_lr()[0],
                 participants=group.participants)
            if job.global_step != before and job.global_step % 10 == 0:
                ckpt.save()
            mine += 1
            if mine == again_after and group.group == 1 and group.restarts == 1:
                emit(event="die", step=job.global_step)
                os.kill(os.getpid(), signal.SIGKILL)
            if group.group == 0 and group.participants < 2:  # alone: wait for group 1's next process to start
                while group1_is_down() and time.time() < deadline:
                    time.sleep(0.05)
            time.sleep(0.1 if group.participants < 2 else 0.01)  # slow while alone: the run outlasts the restarts
        val_loss, count = job.evaluate(model, job.eval_loader(TensorDataset(x, y), 64), loss_fn=F.mse_loss, topk=())
        job.print(f"epoch {epoch + 1}: val_loss {val_loss:.4f} over {count}")
        emit(event="epoch", epoch=epoch, step=job.global_step)
    ckpt.wait()
    emit(event="end", step=job.global_step, checksum=weights())
    if late and group.group == 1 and group.restarts == 2:  # dies once group 0 has left: restarted too late
        while time.time() < deadline and not os.path.exists(os.path.join(out_dir, f"group0-rank{job.rank}.done")):
            time.sleep(0.05)
        emit(event="die", step=job.global_step)
        os.kill(os.getpid(), signal.SIGKILL)
open(os.path.join(out_dir, f"group{group.group}-rank{job.rank}.done"), "w").close()  # left the with block
'''


class Run:
    """One run: its folder, output, the group size, and each process's records by (group, rank)."""

    def __init__(self, folder, output: str, nproc: int, strategy: str, machines: int = 1):
        self.folder, self.output, self.nproc, self.strategy, self.machines = folder, output, nproc, strategy, machines
        self.records = {(g, r): [json.loads(line) for line in (folder / f"group{g}-rank{r}.jsonl").read_text()
                                 .splitlines()] for g in (0, 1) for r in range(nproc)}
        self.global_batch = 2 * nproc * PER_PROCESS
        self.steps_per_epoch = SAMPLES // self.global_batch

    def the_batch(self, step: int, group: int, rank: int) -> list[int]:
        """The sample indices that ``rank`` of ``group`` trains on at ``step`` of a run without failures: the step's
        global batch is the next chunk of the epoch's permutation (seed 0 + epoch), and each of the 2 x nproc
        processes takes every (2 x nproc)-th sample of it, in the order group x nproc + rank."""
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()
        parts = 2 * self.nproc
        return order[k * self.global_batch:(k + 1) * self.global_batch][group * self.nproc + rank::parts]


def launch(folder, nproc: int, strategy: str, machines: int = 1) -> Run:
    """The run, in ``folder``: 2 groups of ``nproc`` processes, ``strategy`` inside each group; on two machines (network
    namespaces, tests/nodes.py: group 0 on node-a, which serves the lighthouse, group 1 on node-b), or on this one.
    A run of groups of two also restarts group 1 once more after group 0 has finished."""
    (folder / "script.py").write_text(SCRIPT)
    late = nproc == 2
    flags = ["run", "--replica-groups", "2", "--nproc-per-node", str(nproc), "--max-restarts", "3",
             "--replica-heartbeat-timeout", "1"]
    script = [str(folder / "script.py"), str(folder), str(EPOCHS), str(SAMPLES), str(PER_PROCESS), str(DIE_AT),
              str(AGAIN_AFTER), str(int(late)), strategy]
    if machines == 1:
        results = [run_ddpkit(*flags, *script, timeout=180)]
    else:
        with contextlib.contextmanager(make_nodes)() as nodes:
            (_, node_0), _ = nodes
            results = run_on_nodes([(name, host, [sys.executable, "-m", "ddpkit", *flags, "--nnodes", "2", "--node-rank",
                                                  str(rank), "--master-addr", node_0, *script])
                                    for rank, (name, host) in enumerate(nodes)], timeout=180)
    output = "".join(result.stdout + result.stderr for result in results)
    (folder / "output.txt").write_text(output)  # to read after a failed assertion
    assert [result.returncode for result in results] == [0] * machines, output
    return Run(folder, output, nproc, strategy, machines)


# Groups of two processes (four of them, on two cores: about 20 s alone, 50 s beside the suite) run in the slow target.
# The run on two machines is tests/test_replica_groups_machines.py's (these checks, a module of its own so that
# pytest-xdist runs it beside this module's run rather than after it).
@pytest.fixture(scope="module", params=[(1, "ddp", 1), pytest.param((2, "fsdp", 1), marks=pytest.mark.slow)],
                ids=["ddp-groups-of-1", "fsdp-groups-of-2"])
def job_run(request, tmp_path_factory):
    nproc, strategy, machines = request.param
    return launch(tmp_path_factory.mktemp(f"replica-groups-job-{strategy}-{nproc}-{machines}"), nproc, strategy,
                  machines)


def steps(records: list[dict], pid: int | None = None) -> list[dict]:
    return [r for r in records if r["event"] == "step" and pid in (None, r["pid"])]


def test_each_try_of_a_step_trains_on_the_batch_and_in_the_epoch_of_a_run_without_failures(job_run):
    tried = 0
    for (group, rank), records in job_run.records.items():
        for record in steps(records):
            if record["step"] > record["before"] + 1:
                continue  # the step in which a rejoining group copied the others' state: its own batch is not used
            step = record["before"] + 1  # tried, and committed or dropped
            assert record["indices"] == job_run.the_batch(step, group, rank), record
            assert record["epoch"] == (step - 1) // job_run.steps_per_epoch, record
            tried += 1
    assert tried > job_run.nproc * EPOCHS * job_run.steps_per_epoch  # group 0 alone tries every step


def test_a_dropped_step_is_tried_again_and_group_0_commits_every_step_once_with_its_processes(job_run):
    for rank in range(job_run.nproc):
        records = job_run.records[0, rank]
        assert len({r["pid"] for r in records}) == 1
        committed = [r["step"] for r in steps(records) if r["step"] != r["before"]]
        assert committed == list(range(1, EPOCHS * job_run.steps_per_epoch + 1))
        dropped = [r for r in steps(records) if r["step"] == r["before"]]
        assert [r["before"] + 1 for r in dropped] == [DIE_AT]
        # The step after group 1's death is committed within 5 s, without it.
        death = next(r for r in job_run.records[1, rank] if r["event"] == "die")
        first_after = next(r for r in steps(records) if r["t"] > death["t"] and r["step"] != r["before"])
        assert first_after["t"] - death["t"] < 5.0 and first_after["participants"] == 1
    assert job_run.output.count(f"replica group 0: step {DIE_AT} dropped (") == job_run.nproc


def test_both_restarts_join_before_their_loop_in_the_groups_epoch_and_agree_with_group_0_to_the_bit(job_run):
    for rank in range(job_run.nproc):  # each with the same rank of group 0 (under FSDP, the same shards)
        survivor = {r["step"]: r for r in steps(job_run.records[0, rank]) if r["step"] != r["before"]}
        records = job_run.records[1, rank]
        starts = [r for r in records if r["event"] == "start"]
        assert [s["restarts"] for s in starts][:3] == [0, 1, 2]
        deaths = [r for r in records if r["event"] == "die"]
        for death, start in zip(deaths, starts[1:3]):  # the two restarts during the run
            mine = [r for r in steps(records, start["pid"]) if r["step"] != r["before"]]
            assert mine and mine[0]["before"] > 1  # the loop began at the groups' step, not at 0
            assert mine[0]["t"] - death["t"] < 30.0  # restarted, and training with the others, within 30 s
            assert mine[0]["epoch"] == mine[0]["before"] // job_run.steps_per_epoch
            for record in mine:  # the weights and the schedule's learning rate are group 0's at every step
                assert record["checksum"] == survivor[record["step"]]["checksum"]
                assert record["lr"] == survivor[record["step"]]["lr"]
        # The second restart (after DIE_AT and AGAIN_AFTER more steps) began its loop in a later epoch than the first.
        assert steps(records, starts[2]["pid"])[0]["epoch"] >= 1
    assert job_run.output.count("replica group 1: rejoined at step") == 2  # said by rank 0
    assert job_run.output.count("with the live groups' state (no checkpoint read)") == 1  # the one that called resume
    ends = {where: next(r for r in records if r["event"] == "end") for where, records in job_run.records.items()}
    assert {r["step"] for r in ends.values()} == {EPOCHS * job_run.steps_per_epoch}
    for rank in range(job_run.nproc):
        assert ends[0, rank]["checksum"] == ends[1, rank]["checksum"]
    if job_run.strategy == "ddp":  # every process of both groups holds the whole model
        assert len({tuple(r["checksum"]) for r in ends.values()}) == 1


def test_only_the_leading_group_prints_and_writes_checkpoints(job_run):
    assert job_run.output.count(f"epoch {EPOCHS}: val_loss") == 1
    from ddpkit import checkpoint

    last = EPOCHS * job_run.steps_per_epoch // 10 * 10  # a file, or a folder of shards under FSDP
    assert checkpoint.step_of(checkpoint.list_checkpoints(job_run.folder / "checkpoints")[0]) == last


@pytest.mark.parametrize("settings, message", [
    ({"strategy": "zero"}, "replica groups train with the ddp or the fsdp strategy"),
    ({"accumulate": 2}, "`accumulate` must be 1, got 2"),
])
def test_a_job_under_replica_groups_refuses_what_they_cannot_do_in_one_line(settings, message, monkeypatch):
    import ddpkit
    from ddpkit.core.env import REPLICA_GROUP
    from ddpkit.core.errors import UsageError

    monkeypatch.setenv(REPLICA_GROUP, "0")
    with pytest.raises(UsageError, match=message):
        ddpkit.Job(**settings)


def test_a_group_restarted_after_the_others_finished_stops_at_once_writing_nothing(job_run):
    if job_run.nproc == 1:
        pytest.skip("the runs of groups of two processes restart group 1 after group 0 has finished")
    for rank in range(job_run.nproc):
        late = [r for r in job_run.records[1, rank] if r["event"] == "start"][3]
        assert late["restarts"] == 3
        assert not [r for r in job_run.records[1, rank] if r["pid"] == late["pid"] and r["event"] != "start"]
    assert "replica group 1: the other groups have finished the run; this one stops here" in job_run.output


def test_under_fsdp_each_process_of_a_group_holds_only_its_shard(job_run):
    """The two ranks' checksums differ: each holds another half of the weights (under DDP they are equal)."""
    if job_run.strategy != "fsdp":
        pytest.skip("the slow run shards the model inside each group")
    ends = {where: next(r for r in records if r["event"] == "end") for where, records in job_run.records.items()}
    assert ends[0, 0]["checksum"] != ends[0, 1]["checksum"]


def test_a_group_that_dies_in_the_all_reduce_costs_the_others_one_line_each_not_a_traceback(job_run):
    """torchft's manager logs the failed collective with its traceback in every live process (its frames: the
    future's callback, ``return fut.value()``); ddpkit keeps its message and says the dropped step in one line. (A
    process whose own group's rank 0 died may still end with a traceback of its own: its group is restarted.)"""
    assert "got exception in future -- skipping remaining" in job_run.output  # torchft's line, still there
    assert "return fut.value()" not in job_run.output
