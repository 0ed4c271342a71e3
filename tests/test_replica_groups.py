"""Replica groups (torchft) for real: `ddpkit run --replica-groups 2` on one machine, gloo, one process per group.

One run, shared by the tests below: group 1's first process kills itself in the middle of the gradient all-reduce
of step DIE_AT (group 0 is inside the collective by then); its launcher restarts it, it copies the state from
group 0 over HTTP; at its own HANG_AT-th step that second process stops itself (SIGSTOP: its torchft heartbeats stop
too), the launcher's fence ends it, it is restarted again, and both train on to the end (past STEPS until both groups are back). Every committed step's
checksum is in OUT/group<G>.jsonl. About 25 s."""

import json
import socket

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'ddpkit[ft]')")

from conftest import run_ddpkit  # noqa: E402

STEPS, DIE_AT, HANG_AT, STALL_S = 50, 10, 5, 4

SCRIPT = '''
import json, os, signal, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import ddpkit
from ddpkit.watch.replicas import checksums  # the replica check's: each tensor's bits, summed

out_dir, steps, die_at, hang_at, stall_s, last_restart = sys.argv[1], *map(int, sys.argv[2:7])
group = ddpkit.ReplicaGroup(timeout_s=3, stall_timeout_s=stall_s)
if group.group == 1 and group.restarts == 1:
    time.sleep(float(os.environ.get("REJOIN_AFTER_S", "0")))  # a restart that takes longer than the others' stall limit
torch.manual_seed(0)
bare = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
model, optimizer = group.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.05, momentum=0.9))
out = open(os.path.join(out_dir, f"group{group.group}.jsonl"), "a")

def emit(**record):
    out.write(json.dumps({"group": group.group, "pid": os.getpid(), "t": time.time(), **record}) + "\\n")
    out.flush()

def die(grad):  # the first layer's gradient is backward's last: group 0 is in the all-reduce by now
    time.sleep(0.3)
    emit(event="die", step=group.step)
    os.kill(os.getpid(), signal.SIGKILL)

emit(event="start", restarts=group.restarts)
if group.group == 1 and group.restarts == last_restart:
    open(os.path.join(out_dir, "last-start"), "w").close()
deadline, mine = time.time() + 90, 0
# On to STEPS, and until group 1's last process (after the kill and the hang) has joined.
while (group.step < steps or group.participants < 2 or not os.path.exists(os.path.join(out_dir, "last-start"))) \
        and time.time() < deadline:
    step = group.step
    if step == die_at and group.group == 0:
        torch.save(bare.state_dict(), os.path.join(out_dir, "before-the-failure.pt"))
    optimizer.zero_grad()
    mine += 1
    if mine == hang_at and group.group == 1 and group.restarts == 1:  # this process's own HANG_AT-th step
        emit(event="hang", step=step)
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped inside a step, every thread with it
    generator = torch.Generator().manual_seed(1000 + step)  # the global batch of this step; each group its half
    x, y = torch.randn(16, 16, generator=generator), torch.randn(16, 4, generator=generator)
    half = slice(8 * group.group, 8 * group.group + 8)
    if step == die_at and group.group == 1 and group.restarts == 0:
        bare[0].weight.register_hook(die)
    F.mse_loss(model(x[half]), y[half]).backward()
    optimizer.step()
    emit(event="step", data=step, step=group.step, committed=group.step != step,
         checksum=checksums(bare.named_parameters()).tolist(), participants=group.participants)
    time.sleep(0.02)
emit(event="end", step=group.step, checksum=checksums(bare.named_parameters()).tolist())
'''


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """The run, with a lighthouse served by the test's process (TORCHFT_LIGHTHOUSE; a 1 s heartbeat timeout), as one
    started elsewhere would be: `ddpkit train`'s runs (slow) use the lighthouse ddpkit starts."""
    from ddpkit.launch.replica_groups import lighthouse

    folder = tmp_path_factory.mktemp("replica-groups")
    (folder / "script.py").write_text(SCRIPT)
    with lighthouse(heartbeat_timeout_s=1) as address:
        result = run_ddpkit("run", "--replica-groups", "2", "--max-restarts", "2", str(folder / "script.py"),
                            str(folder), str(STEPS), str(DIE_AT), str(HANG_AT), str(STALL_S), "2", timeout=180,
                            fresh=True, TORCHFT_LIGHTHOUSE=address)  # the fence ends only its launcher's descendants
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"2 replica groups, lighthouse at {address} (given)" in result.stderr
    records = {g: [json.loads(line) for line in (folder / f"group{g}.jsonl").read_text().splitlines()] for g in (0, 1)}
    return folder, result.stdout + result.stderr, records


def committed(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "step" and r["committed"]]


def test_the_other_group_keeps_its_process_and_goes_on_within_seconds_losing_no_step(killed_run):
    _, output, records = killed_run
    death = next(r for r in records[1] if r["event"] == "die")
    assert len({r["pid"] for r in records[0]}) == 1  # never restarted
    steps = [r["step"] for r in committed(records[0])]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= STEPS  # every step committed once, in order
    first_after = next(r for r in committed(records[0]) if r["t"] > death["t"])
    assert first_after["t"] - death["t"] < 5.0 and first_after["participants"] == 1
    # The step the dead group was in is dropped on the survivor and tried again: said in one line.
    assert output.count(f"replica group 0: step {DIE_AT + 1} dropped (") == 1
    assert "replica group 0: 1 of 2 groups took part" in output


def test_the_dead_group_restarts_copies_the_state_live_and_both_end_in_agreement(killed_run):
    _, output, records = killed_run
    death = next(r for r in records[1] if r["event"] == "die")
    starts = [r for r in records[1] if r["event"] == "start"]
    assert [s["restarts"] for s in starts] == [0, 1, 2] and len({s["pid"] for s in starts}) == 3
    back = [r for r in committed(records[1]) if r["pid"] == starts[1]["pid"]]
    assert back[0]["t"] - death["t"] < 30.0
    # Right after the join, both hold the same weights: the checksums of that step are equal, exactly.
    survivor = {r["step"]: r["checksum"] for r in committed(records[0])}
    assert back[0]["step"] > DIE_AT + 1 and back[0]["checksum"] == survivor[back[0]["step"]]
    assert all(r["checksum"] == survivor[r["step"]] for r in back)
    ends = [next(r for r in records[g] if r["event"] == "end") for g in (0, 1)]
    assert ends[0]["step"] == ends[1]["step"] and ends[0]["checksum"] == ends[1]["checksum"]
    assert "replica group 1: 1 of 2 groups took part in step" in output and "copied its state from them" in output


def test_a_stopped_group_is_fenced_and_restarted_while_the_other_goes_on(killed_run):
    _, output, records = killed_run
    hang = next(r for r in records[1] if r["event"] == "hang")
    assert output.count(f"replica group 1: no step for {STALL_S} s (its process {hang['pid']} is stopped or frozen") == 1
    # Group 0 waited for the stopped group until its heartbeats had been missing 1 s and the collective's timeout.
    first_after = next(r for r in committed(records[0]) if r["t"] > hang["t"])
    assert first_after["participants"] == 1 and first_after["t"] - hang["t"] < STALL_S + 10
    third = [r for r in records[1] if r["event"] == "start"][2]
    back = [r for r in committed(records[1]) if r["pid"] == third["pid"]]
    survivor = {r["step"]: r["checksum"] for r in committed(records[0])}
    assert back and back[0]["step"] > hang["step"] and all(r["checksum"] == survivor[r["step"]] for r in back)


def test_until_the_failure_two_groups_train_as_one_process_on_the_whole_batch(killed_run):
    folder, _, _ = killed_run
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(DIE_AT):
        generator = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(16, 16, generator=generator), torch.randn(16, 4, generator=generator)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    grouped = torch.load(folder / "before-the-failure.pt", weights_only=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(grouped[name], value, rtol=0, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--replica-groups", "0"], "--replica-groups must be at least 1, got 0"),
    (["--replica-groups", "2", "--min-replicas", "3"], "--min-replicas must be between 1 and --replica-groups (2), got 3"),
    (["--min-replicas", "2"], "--min-replicas is for --replica-groups R"),
    (["--replica-groups", "2", "--lighthouse", "http://127.0.0.1:1", "--min-replicas", "2"],
     "--min-replicas is the lighthouse's own setting"),
    (["--replica-groups", "2", "--nproc-per-node", "gpu"],
     "--nproc-per-node with --replica-groups is the processes of each group"),
    (["--replica-groups", "3", "--nnodes", "2", "--master-addr", "127.0.0.1"],
     "--replica-groups 3 on --nnodes 2 machines: every machine runs as many groups, so give a multiple of 2"),
    (["--replica-groups", "2", "--nnodes", "2"], "--nnodes 2 needs --master-addr"),
    (["--replica-groups", "2", "--nnodes", "1:2", "--master-addr", "127.0.0.1"],
     "--replica-groups runs on a fixed number of machines: give --nnodes 2, not 1:2"),
    (["--replica-groups", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "meets its machines at machine 0"),
    (["--replica-groups", "2", "--master-port", "29555"], "--master-addr, --master-port and --node-rank are for"),
    (["--replica-groups", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
     "--node-rank must be in 0..1"),
    (["--replica-groups", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--lighthouse", "http://localhost:29510"],
     "--lighthouse http://localhost:29510 names this machine by a loopback address, which the other machines cannot"),
    (["--replica-groups", "2", "--replica-heartbeat-timeout", "0"], "--replica-heartbeat-timeout must be positive"),
    (["--replica-heartbeat-timeout", "1"], "--replica-heartbeat-timeout is for --replica-groups R"),
    (["--lighthouse", "http://127.0.0.1:1"], "--lighthouse is for --replica-groups R"),
    (["--replica-groups", "2", "--lighthouse", "127.0.0.1:29510"], "a lighthouse's address is http://HOST:PORT"),
    (["--replica-groups", "2", "--lighthouse", "http://127.0.0.1:1"], "no lighthouse answers at http://127.0.0.1:1"),
    (["--replica-groups", "2", "--lighthouse", "http://127.0.0.1:1", "--replica-heartbeat-timeout", "1"],
     "--replica-heartbeat-timeout is the lighthouse's own setting"),
])
def test_bad_replica_group_settings_are_one_line(argv, message, tmp_path, capsys):
    from ddpkit.app.cli import main

    script = tmp_path / "script.py"
    script.write_text("pass\n")
    assert main(["run", *argv, str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_machine_0_gives_up_on_a_machine_that_does_not_join_in_one_line(tmp_path, capsys):
    from ddpkit.app.cli import main

    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('no group may start')\n")
    assert main(["run", "--replica-groups", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                 "--master-port", str(_unused_port()), "--rdzv-timeout", "1", str(script)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "ddpkit: error: 1 of the other 1 machines did not join within 1 s: start ddpkit with the same command and "
        "--node-rank 1 there (--rdzv-timeout waits longer)")


def test_a_machine_whose_machine_0_does_not_answer_ends_in_one_line(tmp_path, capsys):
    from ddpkit.app.cli import main

    script = tmp_path / "script.py"
    script.write_text("pass\n")
    port = _unused_port()
    assert main(["run", "--replica-groups", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "--rdzv-timeout", "1", str(script)]) == 2
    assert f"machine 0's replica groups at 127.0.0.1:{port} did not answer in 1 s" in capsys.readouterr().err


def test_the_fence_ends_a_step_that_outlasts_its_limit_whether_the_process_still_answers_or_not():
    from ddpkit.launch.replica_groups import fence_reason

    beat = {"pid": 7, "t": 100.0, "moved_s": 1.0, "stall_s": 5.0, "where": 'File "x.py", line 3'}
    assert fence_reason(beat, 101.0) is None and fence_reason(beat, 104.0) is None  # a step of 2 s, then 5 s
    assert fence_reason(beat | {"t": 104.0, "moved_s": 5.5}, 104.1) == 'no step for 5 s (stuck at File "x.py", line 3)'
    assert fence_reason(beat, 104.5) == ("no step for 5 s (its process 7 is stopped or frozen, silent for 4 s, last "
                                         'at File "x.py", line 3)')
    before_training = beat | {"moved_s": None}  # only a process that stopped answering is fenced then
    assert fence_reason(before_training, 104.9) is None and "stopped or frozen" in fence_reason(before_training, 105.1)
    assert fence_reason(beat | {"stall_s": 0}, 1000.0) is None  # the fence is off


def test_each_group_gets_a_gpu_of_its_own_in_turn_and_a_cpu_machine_none(monkeypatch):
    from ddpkit.launch.replica_groups import group_gpus, visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5,7")
    gpus = visible_gpus()
    assert [group_gpus(group, gpus) for group in range(4)] == ["2", "5", "7", "2"]  # more groups than GPUs: shared
    assert group_gpus(0, gpus + ["9"], 2, 2) == "2,5" and group_gpus(1, gpus + ["9"], 2, 2) == "7,9"  # 2 each
    assert group_gpus(0, gpus, 2, 2) is None  # too few for 2 groups of 2: left alone
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == [] and group_gpus(0, []) is None  # no GPU: the variable is left alone


def test_a_fence_that_would_end_a_healthy_group_waiting_for_a_hung_one_is_refused(monkeypatch):
    import ddpkit

    monkeypatch.setenv("DDPKIT_REPLICA_GROUP", "0")
    monkeypatch.setenv("DDPKIT_REPLICA_GROUPS", "2")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    with pytest.raises(ddpkit.UsageError, match=r"stall_timeout_s must be 0 \(off\) or between timeout_s \(10\)"):
        ddpkit.ReplicaGroup(timeout_s=10, stall_timeout_s=5)
    ddpkit.ReplicaGroup(timeout_s=10, stall_timeout_s=0)  # off


def test_a_replica_group_outside_such_a_launch_is_one_line(monkeypatch):
    import ddpkit

    for name in ("DDPKIT_REPLICA_GROUP", "DDPKIT_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ddpkit.UsageError, match="start the script with ddpkit run --replica-groups N"):
        ddpkit.ReplicaGroup()



MODEL = '''
import os, signal, time
import torch.nn as nn

def model(kill_at=0, late=False):
    """A small classifier; group 1's first process kills itself (SIGKILL) at its kill_at-th training forward.
    late=False: group 0 then takes 0.1 s a step until group 1's second process has taken its first step (up to 60 s),
    so that it rejoins. late=True: that process waits, before anything else, until group 0 has finished the run."""
    group, restarts = os.environ.get("DDPKIT_REPLICA_GROUP"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    started = time.time()
    if late and group == "1" and restarts == "1":
        done = lambda: os.path.exists("out/model.pt") and os.path.getmtime("out/model.pt") > os.path.getmtime("killed")
        while not done() and time.time() < started + 60:
            time.sleep(0.1)
    net = nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(192, 64), nn.ReLU(), nn.Linear(64, 10))
    forwards = []

    def count(module, args):
        if module.training:
            forwards.append(1)
            if len(forwards) == kill_at and group == "1" and restarts == "0":
                open("killed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if len(forwards) == 2 and group == "1" and restarts == "1":
                open("rejoined", "w").close()  # its first step is committed
            if (not late and len(forwards) > kill_at > 0 and group == "0" and not os.path.exists("rejoined")
                    and time.time() < started + 60):
                time.sleep(0.1)

    net.register_forward_pre_hook(count)
    return net
'''
TRAIN_EPOCHS, KILL_AT = 8, 30  # digits, 22 steps an epoch of 2 x 32: group 1 dies in epoch 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`ddpkit train --replica-groups 2`, group 1 killed in its second epoch; then two more epochs resumed from the
    run's checkpoint, in replica-group mode, in which group 1 is killed again and comes back only after group 0 has
    finished the run."""
    folder = tmp_path_factory.mktemp("replica-train")
    (folder / "groupnet.py").write_text(MODEL)
    common = ["train", "--replica-groups", "2", "--replica-heartbeat-timeout", "1", "--max-restarts", "1",
              "--model", "groupnet:model", "--output-dir", "out", "--no-progress", "--stall-timeout", "6"]
    first = run_ddpkit(*common, "--epochs", str(TRAIN_EPOCHS), "--model-arg", f"kill_at={KILL_AT}", cwd=folder,
                       timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    records = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    second = run_ddpkit(*common, "--epochs", str(TRAIN_EPOCHS + 2), "--resume", "auto", "--model-arg", "kill_at=5",
                        "--model-arg", "late=true", cwd=folder, timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    return folder / "out", first.stdout + first.stderr, records, second.stdout + second.stderr


@pytest.mark.slow  # two ddpkit train runs of two groups: about 35 s, 55 s of CPU
def test_train_goes_on_with_one_group_and_records_how_many_took_part(trained):
    out, output, records, _ = trained
    assert [r["epoch"] for r in records] == list(range(TRAIN_EPOCHS))  # every epoch once, whoever led it
    hit = records[KILL_AT // 22]
    assert hit["replicas_min"] == 1 and 1 < hit["replicas"] < 2 and hit["replica_groups"] == 2
    assert 32 < hit["effective_global_batch"] < 64 and hit["global_batch"] == 64
    # Before the kill, and after the rejoin, both groups trained: every step, but for one or two on a busy machine
    # (the slow suite's three workers on two cores), where a group starved of CPU for a second misses a quorum's
    # heartbeat (--replica-heartbeat-timeout 1): seen once, 20 of 22 steps in epoch 1.
    assert records[0]["replicas"] > 1.8 and records[-1]["replicas"] > 1.8
    assert records[0]["replicas_min"] >= 1 and max(r["replicas"] for r in records) == 2.0
    assert "replica group 0: 1 of 2 groups took part in step" in output
    assert output.count("replica group 1 rejoined at step") == 1
    assert "saved out/model.pt" in output and (out / "model.pt").exists()
    from ddpkit.watch import status

    assert "replica groups 1." in status.describe(None, hit) and "effective global batch" in status.describe(None, hit)


@pytest.mark.slow  # two ddpkit train runs of two groups: about 35 s, 55 s of CPU
def test_train_resumes_from_its_checkpoint_in_replica_group_mode(trained):
    out, _, _, output = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(TRAIN_EPOCHS + 2))  # once each: group 1 wrote none again
    assert records[TRAIN_EPOCHS]["replica_groups"] == 2 and records[TRAIN_EPOCHS]["replicas_min"] == 1
    assert f"continuing at epoch {TRAIN_EPOCHS + 1}" in output and "rejoined" not in output
    # Restarted after group 0 had finished: nobody to copy from, so it stops instead of training alone again, asking
    # nothing of the finished group (before: a quorum whose set-up spent seconds on group 0's store, gone, and
    # printed torchft's and c10d's tracebacks of it).
    assert output.count("replica group 1: the other groups have finished the run; this one stops here") == 1
    assert "Traceback" not in output and "socket.cpp" not in output and "exception in pg configure" not in output, output


@pytest.mark.parametrize("argv, message", [
    (["--accumulate", "2"], "--replica-groups takes one micro-step per optimizer step for now"),
    (["--strategy", "pipeline"], "--replica-groups trains with --strategy ddp or fsdp"),
    (["--launcher", "spawn"], "--replica-groups starts each group with torchrun's agent"),
])
def test_bad_replica_group_training_settings_are_one_line(argv, message, tmp_path, capsys):
    from ddpkit.app.cli import main

    assert main(["train", "--replica-groups", "2", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_machine_0_serves_while_another_machines_launcher_beats_and_not_after_it_ended_or_went_silent(monkeypatch):
    """What machine 0 waits for after its own groups ended, on a real store: a launcher that says it is done, or one
    whose beats stopped for MACHINE_GONE_S (its machine died), does not hold it; one that still beats does."""
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ddpkit.launch import replica_groups

    monkeypatch.setattr(replica_groups, "MACHINE_GONE_S", 1.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    machines = replica_groups.Machines(count=3)
    store.set("machine1.done", "1")  # machine 1 ended; machine 2 beats for 1.2 s, then its beats stop (it died)

    def beat_for_a_while() -> None:
        for _ in range(4):
            store.add("machine2", 1)
            time.sleep(0.3)

    beating = threading.Thread(target=beat_for_a_while)
    start = time.monotonic()
    beating.start()
    replica_groups._outlive_other_machines(store, machines)
    waited = time.monotonic() - start
    beating.join()
    assert 1.2 + 1.0 - 0.5 < waited < 1.2 + 1.0 + 2.0  # its last beat, then MACHINE_GONE_S, checked twice a second
    store.set("machine2.done", "1")
    start = time.monotonic()
    replica_groups._outlive_other_machines(store, machines)  # every other machine done: no wait
    assert time.monotonic() - start < 0.5


def test_another_machine_starts_its_groups_on_machine_0s_word_and_a_node_rank_has_one_launcher():
    """``_joined`` against a store made here in machine 0's place: it yields (its groups start) only once machine 0
    says every machine has joined; a second launcher of the same --node-rank is refused in one line; one started
    after that machine's launcher ended takes its place; one given other settings than machine 0's is refused,
    naming each difference."""
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ddpkit.core.errors import UsageError
    from ddpkit.launch import replica_groups as rg

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    settings = {"--replica-groups": 2, "--nproc-per-node": 1, "--min-replicas": 1, "--replica-heartbeat-timeout": 2.0,
                "--lighthouse": None}
    # the store's own port stands in for the lighthouse: _joined only checks that it answers
    store.set(rg.JOB_KEY, json.dumps({**settings, "lighthouse": f"http://127.0.0.1:{store.port}"}))
    machine_1 = rg.Machines(count=2, rank=1, master_port=store.port, wait_s=10)
    threading.Timer(1.0, store.set, (rg.START_KEY, "1")).start()
    start = time.monotonic()
    with rg._joined(machine_1, settings) as (_, where, lighthouse):
        assert time.monotonic() - start > 0.9 and store.add("joined", 0) == 1
        assert (where, lighthouse) == (f"127.0.0.1:{store.port}", f"http://127.0.0.1:{store.port}")
        with pytest.raises(UsageError, match="^another launcher runs machine 1 of the replica groups already: give "
                                             "each machine its own --node-rank$"):
            with rg._joined(machine_1, settings):
                pass
    assert store.check(["machine1.done"])
    with rg._joined(machine_1, settings):  # started again after its launcher ended: joins in its place, not twice
        assert not store.check(["machine1.done"]) and store.add("joined", 0) == 1
    machine_2 = rg.Machines(count=3, rank=2, master_port=store.port, wait_s=10)
    with pytest.raises(UsageError, match=r"^every machine of the replica groups takes the same settings: "
                                         r"--replica-groups 4 here, 2 on machine 0; --min-replicas 2 here, 1 on machine 0$"):
        with rg._joined(machine_2, {**settings, "--replica-groups": 4, "--min-replicas": 2}):
            pass
    assert not store.check(["machine2.claimed"])  # refused before it took part


def test_a_group_of_n_splits_any_gradient_into_n_parts_that_make_it_up_again():
    from ddpkit.launch.replica_groups import Machines
    from ddpkit.strategies.replica_groups import advertised_host, part_of

    for numel, parts in [(0, 2), (1, 2), (5, 2), (6, 3), (7, 3), (7, 4), (676, 2)]:
        flat = torch.arange(1, numel + 1, dtype=torch.float32)
        pieces = [part_of(flat, rank, parts) for rank in range(parts)]
        whole = pieces[0][0]
        assert whole.numel() % parts == 0 and torch.equal(whole[:numel], flat) and not whole[numel:].any()
        assert torch.equal(torch.cat([piece for _, piece in pieces]), whole)
        assert all(piece.data_ptr() == own[rank * piece.numel():].data_ptr() or not piece.numel()
                   for rank, (own, piece) in enumerate(pieces))  # views: what each averages lands in its whole
    assert list(Machines(count=2, rank=1).groups_here(6)) == [3, 4, 5]
    assert advertised_host("127.0.0.1:29500") == "127.0.0.1" and advertised_host("[::1]:29500") == "127.0.0.1"
    assert advertised_host(None) == "127.0.0.1"  # no launchers' store: groups started by hand, on one machine
    assert advertised_host("node-a:29500") == socket.gethostname()  # a name: the machines meet at machine 0's
