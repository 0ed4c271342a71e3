"""The command line: bad input is one line and exit status 2; `ddpkit run` starts real scripts."""

import json
import os
import re
import socket
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import AGENT_REPORTS_ENDED_RANKS, leftover_processes, run_ddpkit, warm_ranks_env
from listening import not_loopback
from ddpkit.app.cli import main

NO_GPU = torch.cuda.device_count() == 0
DEMO = str(Path(__file__).resolve().parents[1] / "examples" / "ddp_demo.py")  # a script that exists


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
        (["run", "--seed", "3", DEMO], "--seed is for --unchanged (the script's own flags go after SCRIPT)"),
        (["run", "--loss-reduction", "sum", DEMO], "--loss-reduction is for --unchanged"),
        (["run", "--unchanged", "--loss-reduction", "max", DEMO], "invalid choice: 'max'"),
        (["run", "--shard", "always", DEMO], "--shard is for --unchanged"),
        (["run", "--find-unused-parameters", DEMO], "--find-unused-parameters is for --unchanged"),
        (["run", "--unchanged", "--shard", "half", DEMO], "invalid choice: 'half'"),
        (["run", "--unchanged", "--replica-groups", "2", DEMO], "--unchanged and --replica-groups do not go together"),
        (["train", "--nproc-per-node", "many"], "whole number or auto, got 'many'"),
        (["train", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["train", "--epochs", "0"], "--epochs must be at least 1, got 0"),
        (["train", "--output-dir", ""], "--output-dir needs a folder, got an empty name"),
        (["train", "--timeout", "nan"], "--timeout must be a finite number of seconds, at least 1, got nan"),
        (["train", "--timeout", "inf"], "--timeout must be a finite number of seconds, at least 1, got inf"),
        (["train", "--timeout", "1e-9"], "--timeout must be a finite number of seconds, at least 1, got 1e-09"),
        (["train", "--model", "resnet"], "unknown model 'resnet'"),
        (["train", "--data", "cifar"], "unknown data set 'cifar'"),
        (["train", "--data", "folder:/no/such/dir"], "folder '/no/such/dir' does not exist"),
        (["train", "--optimizer", "lion"], "invalid choice: 'lion'"),
        (["train", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0..1"),
        (["train", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["train", "--resume", "/no/such/ckpt.pt"], "--resume /no/such/ckpt.pt: no such file or folder"),
        (["train", "--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1, got 0"),
        (["train", "--checkpoint-every", "-5"], "--checkpoint-every must be 0 (epoch ends only) or more, got -5"),
        (["train", "--schedule", "linear"], "invalid choice: 'linear'"),
        (["train", "--lr-gamma", "2"], "--lr-gamma must be in (0, 1], got 2.0"),
        (["train", "--warmup-steps", "-1"], "--warmup-steps must be 0 or more, got -1"),
        (["train", "--check-replicas", "-1"], "--check-replicas must be 0 (off) or a number of optimizer steps, got -1"),
        (["train", "--strategy", "pipeline", "--nproc-per-node", "2", "--stages", "3"],
         "--stages 3 does not divide the world size 2"),
        (["train", "--strategy", "pipeline", "--nproc-per-node", "2", "--model", "densenet121"],
         "cannot cut model DenseNet into stages"),
        (["train", "--strategy", "pipeline", "--nproc-per-node", "2", "--split-at", "fc9"], "--split-at fc9: no such piece"),
        (["train", "--strategy", "pipeline", "--nproc-per-node", "2", "--microbatches", "5"],
         "--batch-size 32 does not split into 5 equal micro-batches"),
        (["train", "--strategy", "pipeline", "--accumulate", "2"], "--accumulate with --strategy pipeline"),
        (["train", "--strategy", "pipeline", "--amp", "bf16"], "--amp bf16 is not supported with --strategy pipeline"),
        (["train", "--strategy", "fsdp", "--zero"], "--zero shards the optimizer state across DDP processes; it needs "
                                                    "--strategy ddp, not fsdp (fsdp shards the optimizer state already)"),
        (["train", "--strategy", "dp", "--zero"], "it needs --strategy ddp, not dp"),
        (["train", "--strategy", "fsdp", "--sync-bn"], "--sync-bn synchronises BatchNorm across DDP processes"),
        (["train", "--async-checkpoint", "--checkpoint-format", "full"],
         "--async-checkpoint writes sharded checkpoints; full ones are written in the background by rank 0 already"),
        (["train", "--strategy", "pipeline", "--checkpoint-format", "sharded"],
         "sharded checkpoints (--checkpoint-format sharded, --async-checkpoint) are not available for --strategy pipeline"),
        (["train", "--checkpoint-format", "shards"], "argument --checkpoint-format: invalid choice: 'shards'"),
        (["train", "--stages", "2"], "--stages is for --strategy pipeline, not ddp"),
        (["train", "--nccl", "NCCL_ALGO"], "--nccl takes NCCL_NAME=VALUE or a preset (debug, no-p2p, no-ib), got 'NCCL_ALGO'"),
        (["bench", "--nccl", "GLOO_SOCKET_IFNAME=lo"], "--nccl takes NCCL_NAME=VALUE or a preset"),
        (["train", "--nnodes", "1:3"], "--nnodes 1:3 lets the job grow and shrink, which needs a rendezvous"),
        (["train", "--nnodes", "two"], "--nnodes takes a whole number or MIN:MAX, got 'two'"),
        (["train", "--rdzv-endpoint", "node0"], "--rdzv-endpoint takes HOST:PORT with a port in 1..65535"),
        (["train", "--rdzv-endpoint", "no-such-host.invalid:29400", "--nnodes", "2"],
         "--rdzv-endpoint: cannot resolve host 'no-such-host.invalid' on this machine"),
        (["train", "--rdzv-id", "job7"], "--rdzv-id names the job at a rendezvous: it needs --rdzv-endpoint"),
        (["train", "--rdzv-endpoint", "node0:29400", "--node-rank", "1", "--nnodes", "2"],
         "--rdzv-endpoint numbers the nodes itself; drop --master-addr, --master-port and --node-rank"),
        (["run", "--nproc-per-node", "2", "/no/such/script.py"], "script '/no/such/script.py' does not exist"),
        (["run"], "the following arguments are required: SCRIPT"),
        (["run", "--timeout", "0", "x.py"], "--timeout must be a finite number of seconds, at least 1, got 0.0"),
        (["run", "--timeout", "nan", "x.py"], "--timeout must be a finite number of seconds, at least 1, got nan"),
        (["bench", "--nproc", "0"], "--nproc takes whole numbers of at least 1, got 0"),
        (["bench", "--nproc", "one,two"], "--nproc takes a comma-separated list, got 'one,two'"),
        (["bench", "--strategies", "ddp,fsdp"], "--strategies takes a comma list of single, dp, ddp"),
        (["bench", "--steps", "0"], "--steps must be at least 1, got 0"),
        (["bench", "--image-size", "0"], "--image-size must be at least 1, got 0"),
        (["bench", "--model", "resnet"], "unknown model 'resnet'"),
        (["bench", "--link-gbps", "0"], "--link-gbps takes positive numbers"),
        (["bench", "--precision", "fp8"], "invalid choice: 'fp8'"),
        (["bench", "--nproc", "1", "--sweep"], "--sweep times DDP's buckets and compression hooks, which one process "
                                               "does not use (ddpkit runs it without DDP): give --nproc 2 or more"),
        (["status", "/no/such/dir"], "ddpkit status /no/such/dir: no such folder (give a run's --output-dir)"),
        (["status", "/tmp", "--every", "0"], "--every must be a number of seconds above 0, got 0.0"),
        (["run", "--launcher", "spawn", DEMO], "ddpkit run starts a script with torchrun's agent or on Ray: drop "
                                              "--launcher spawn (it is for ddpkit train)"),
        (["run", "--address", "head:6379", DEMO], "--address names a Ray cluster: add --launcher ray, or drop --address"),
        (["train", "--address", "head:6379"], "--address names a Ray cluster: add --launcher ray"),
        (["run", "--launcher", "ray", "--master-addr", "10.0.0.1", "--nnodes", "2", DEMO],
         "--launcher ray: Ray places the ranks and picks rank 0's node as the master; drop --master-addr"),
        (["run", "--launcher", "ray", "--nnodes", "1:2", DEMO], "--launcher ray runs on a fixed number of nodes: give "
                                                               "--nnodes 2, not 1:2"),
        (["run", "--launcher", "ray", "--log-dir", "logs", DEMO], "--log-dir: under --launcher ray each rank's output"),
        (["run", "--launcher", "ray", "--replica-groups", "2", DEMO],
         "--replica-groups starts each group with torchrun's agent: drop --launcher ray"),
        (["train", "--launcher", "ray", "--address", "localhost"],
         "--address 'localhost': give the Ray cluster's head as HOST:PORT"),
        (["run", "--launcher", "ray", "--address", "127.0.0.1:1", DEMO],
         "no Ray cluster answers at 127.0.0.1:1 (Connection refused): start one there with `ray start --head --port 1`"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddpkit") and message in err
    assert "Traceback" not in err


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--strategy", "dp"], "--strategy dp needs at least one CUDA GPU"),
        (["train", "--backend", "nccl"], "--backend nccl needs one CUDA GPU per process"),
        (["train", "--device", "cuda"], "no CUDA GPU is visible"),
        (["bench", "--strategies", "dp"], "--strategies dp needs at least one CUDA GPU and none is visible; drop dp"),
        (["bench", "--precision", "tf32"], "--precision tf32 is a GPU mode"),
        (["bench", "--device", "cuda"], "no CUDA GPU is visible"),
    ],
)
def test_gpu_only_options_are_refused_without_a_gpu(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_the_installed_command_exits_2_without_a_traceback():
    result = run_ddpkit("train", "--batch-size", "0", timeout=60)
    assert result.returncode == 2
    assert result.stderr == "ddpkit: error: --batch-size must be at least 1, got 0\n"


def test_an_error_found_inside_the_workers_still_exits_2(tmp_path):
    # Only after loading does a rank learn 40 samples cannot make one global batch of 2 x 32.
    result = run_ddpkit("train", "--data", "synthetic:40", "--model", "convnet", "--batch-size", "32",
                        "--output-dir", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "fewer than one global batch of 64" in result.stderr
    assert "; lower --batch-size" in result.stderr  # the library's `batch_size`, said as this command's flag
    assert "Traceback" not in result.stderr
    # One line, from rank 0, and none from torchrun's agent about the workers it stopped or saw fail.
    assert result.stderr.count("ddpkit: error:") == 1 and "[rank0]: ddpkit: error:" in result.stderr
    assert "torch/distributed/elastic" not in result.stderr, result.stderr


def test_an_output_folder_that_cannot_be_written_is_refused_before_anything_starts(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    for folder, message in ((tmp_path / "file", f"--output-dir {tmp_path / 'file'} is a file, not a folder"),
                            (tmp_path / "file" / "sub", f"--output-dir {tmp_path / 'file' / 'sub'}: cannot write there "
                                                        "(Not a directory)")):
        assert main(["train", "--output-dir", str(folder), "--data", "synthetic:64"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ddpkit: error: {message}") and err.count("\n") == 1


@pytest.mark.skipif(os.getuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_output_folder_is_refused(tmp_path, capsys):
    (tmp_path / "ro").mkdir(mode=0o500)
    assert main(["train", "--output-dir", str(tmp_path / "ro"), "--data", "synthetic:64"]) == 2
    assert "cannot write there (Permission denied)" in capsys.readouterr().err


def test_a_diverged_run_stops_before_it_saves_anything(tmp_path, capsys):
    # An absurd learning rate: the first step makes the weights infinite, so the checkpoint due after it
    # must not be written, and neither must model.pt.
    status = main(["train", "--nproc-per-node", "1", "--data", "synthetic:64", "--epochs", "2", "--lr", "1e308",
                   "--checkpoint-every", "1", "--output-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "ddpkit: error: training diverged: the model's parameters are not finite in epoch 1, by step 1; no " \
           "checkpoint or model.pt was written from there on. Lower --lr (it is 1e+308 now)" in err
    assert not (tmp_path / "model.pt").exists() and not list((tmp_path / "checkpoints").glob("step-*"))


def test_list_models(capsys):
    assert main(["train", "--list-models"]) == 0
    names = capsys.readouterr().out.split()
    assert names[:2] == ["net", "convnet"] and "resnet50" in names


TORCHRUN_STYLE = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt")
    with open(out, "w") as f:
        f.write(f"{os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']} {t.item()} {' '.join(sys.argv[2:])}")
    if dist.get_rank() == 0 and os.environ.get("LISTENING_HELPER"):
        # Where the job's stores listen: the agent (this process's parent) hosts them all.
        sys.path.insert(0, os.environ["LISTENING_HELPER"])
        import json, listening
        found = {"agent": sorted(listening.listening(os.getppid())), "rank0": sorted(listening.listening(os.getpid())),
                 "master_port": int(os.environ["MASTER_PORT"])}
        with open(os.path.join(sys.argv[1], "listening.json"), "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()
    """
)

LOCAL_RANK_STYLE = textwrap.dedent(
    """
    import argparse, os
    import torch, torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    dist.barrier()  # without a collective, rank 0 can close its sockets while rank 1 still connects to them
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(str(args.local_rank))
    dist.destroy_process_group()
    """
)


def test_run_starts_a_torchrun_style_script_unchanged_with_the_default_port_busy(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_STYLE)
    # A busy 29500 (torchrun's default) must not break a single-node run: its rendezvous picks a free port.
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", 29500))
        except OSError:
            pass  # something else already holds it: just as good for this test
        busy.listen()
        (tmp_path / "tmp").mkdir()
        # Fresh: the script reads what its parent, the agent, listens on (a warm rank's parent is the rank server).
        result = run_ddpkit("run", "--nproc-per-node", "2", str(script), str(tmp_path), "--its-own", "flag",
                            timeout=120, fresh=True, LISTENING_HELPER=str(Path(__file__).parent),
                            TMPDIR=str(tmp_path / "tmp"))
    assert result.returncode == 0, result.stderr
    # Every line reached the console and nothing failed: the temporary folder of the ranks' output is gone.
    assert list((tmp_path / "tmp").glob("ddpkit-run-*")) == []
    # 1 + 2 = 3 on both ranks: a real all-reduce went through; the script's own arguments arrived.
    assert (tmp_path / "rank0.txt").read_text() == "0 2 3.0 --its-own flag"
    assert (tmp_path / "rank1.txt").read_text() == "1 2 3.0 --its-own flag"
    # The stores of a one-machine run listen on loopback only, a plain torch.distributed script's included:
    # the agent hosts the rendezvous store and the workers' (MASTER_PORT); rank 0 hosts none.
    found = json.loads((tmp_path / "listening.json").read_text())
    agent = {(address, port) for address, port in found["agent"]}
    assert len(agent) >= 2 and not_loopback(agent) == set(), agent
    assert ("127.0.0.1", found["master_port"]) in agent
    assert found["master_port"] not in {port for _, port in found["rank0"]}


def test_a_failing_script_reports_the_rank_and_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    (tmp_path / "tmp").mkdir()
    result = run_ddpkit("run", "--nproc-per-node", "2", str(script), timeout=120, TMPDIR=str(tmp_path / "tmp"))
    assert result.returncode == 1
    assert "rank 1" in result.stderr and "exited with status 3" in result.stderr
    # A rank failed: its output is kept where the error says.
    kept = list((tmp_path / "tmp").glob("ddpkit-run-*"))
    assert len(kept) == 1 and str(kept[0] / "rank1.log") in result.stderr


def test_a_launcher_started_warm_says_and_exits_as_a_fresh_one(tmp_path):
    # The suite's launchers run forked from a warm interpreter (tests/warm.py): a mistake reads and exits the same
    # as from a fresh one (a worker's mistake, warm: test_an_error_found_inside_the_workers_still_exits_2), and the
    # folder, the variables and the module path are the test's.
    warm, fresh = (run_ddpkit("train", "--epochs", "0", fresh=fresh) for fresh in (False, True))
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr) != (0, "", "")
    (tmp_path / "here.py").write_text("import os, sys\nprint(os.getcwd(), os.environ['WHO'], sys.argv[1:])\n")
    here = run_ddpkit("run", "--nproc-per-node", "1", "-m", "here", "x", cwd=tmp_path, WHO="me", PYTHONPATH=str(tmp_path))
    assert (here.returncode, here.stdout) == (0, f"{tmp_path} me ['x']\n"), here.stderr


WARM_RANK = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    out, how = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    print(json.dumps([rank, sys.argv[2:], sys.path[0], os.getcwd(), os.environ["WHO"], torch.get_num_threads(), __name__,
                      signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                      signal.getsignal(signal.SIGPIPE) is signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL]))
    with open(os.path.join(out, f"parent{rank}"), "w") as f:
        f.write(str(os.getppid()))
    if rank == 0:
        time.sleep(60)  # until the launcher ends it, when rank 1 has failed
    while not os.path.exists(os.path.join(out, "parent0")):
        time.sleep(0.05)
    if how == "raise":
        raise ValueError("rank 1 gives up")
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_started_warm_runs_and_ends_as_a_fresh_one(tmp_path, how):
    """The suite's ranks run forked from a warm interpreter (tests/warm_ranks.py): a script sees what it would see
    fresh; a rank that raises or is killed is reported as fresh; a rank the launcher ends gets its SIGTERM."""
    import warm_ranks

    (tmp_path / "script.py").write_text(WARM_RANK)
    warm_ranks_env()  # the server starts ...
    server = warm_ranks.wait_until_serving()  # ... and serves this run's ranks
    result = run_ddpkit("run", "--nproc-per-node", "2", str(tmp_path / "script.py"), str(tmp_path), how, cwd=tmp_path,
                        timeout=40, WHO="me")
    facts = sorted(json.loads(re.sub(r"^\[rank\d\]: ", "", line)) for line in result.stdout.splitlines())
    assert facts == [[rank, [how], str(tmp_path), str(tmp_path), "me", 1, "__main__", True, True, True] for rank in (0, 1)]
    assert [int((tmp_path / f"parent{rank}").read_text()) for rank in (0, 1)] == [server, server]  # warm indeed
    assert result.returncode == 1
    ended = "exited with status 1" if how == "raise" else "killed by signal 9"
    assert re.search(rf"ddpkit: error: rank 1 \(pid \d+\) {ended}; its errors are above", result.stderr), result.stderr
    if how == "raise":
        assert 'raise ValueError("rank 1 gives up")' in result.stderr and "ValueError: rank 1 gives up" in result.stderr
    if AGENT_REPORTS_ENDED_RANKS:  # torch 2.4's agent reports the failed rank alone
        assert re.search(r"rank 0 \(pid \d+\) was ended by the launcher \(SIGTERM\) when another rank failed",
                         result.stderr)
    assert not leftover_processes()


def test_a_missing_module_is_bad_input(capsys):
    assert main(["run", "-m", "no_such_module_here.train"]) == 2
    assert "module 'no_such_module_here.train' cannot be imported" in capsys.readouterr().err


def test_run_of_a_module_that_takes_local_rank_like_the_legacy_launcher(tmp_path):
    # -m: the module is found on the workers' path; --local-rank-arg: torch.distributed.launch's --local-rank=N.
    (tmp_path / "legacy.py").write_text(LOCAL_RANK_STYLE)
    result = run_ddpkit("run", "--nproc-per-node", "2", "--local-rank-arg", "-m", "legacy", "--out", str(tmp_path),
                        cwd=tmp_path, PYTHONPATH=str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["0", "1"]


def test_this_machine_is_an_address_it_can_bind():
    from ddpkit.launch.launcher import is_this_machine

    assert is_this_machine("127.0.0.1") and is_this_machine("localhost") and is_this_machine(socket.gethostname())
    assert not is_this_machine("192.0.2.1")  # TEST-NET-1: never a local address (only a bind is tried, no packet)


def test_a_busy_master_port_is_a_clear_error(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_STYLE)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = run_ddpkit("run", "--nproc-per-node", "2", "--master-port", port, str(script), str(tmp_path),
                            timeout=120)
        # A stale MASTER_PORT in the environment of a one-process run: the same answer.
        stale = run_ddpkit("train", "--nproc-per-node", "1", "--epochs", "1", "--output-dir", str(tmp_path / "o"),
                           MASTER_PORT=port, timeout=120)
    for outcome in (result, stale):
        assert outcome.returncode == 2, outcome.stderr
        assert "Traceback" not in outcome.stderr
        assert f":{port}" in outcome.stderr and "in use" in outcome.stderr
    # Before starting anything, the launcher named who holds the port (here: this test's own process).
    assert f"ddpkit: warning: port {port} is held by pid {os.getpid()} (" in result.stderr
    assert f"if it is a leftover of an earlier run, end it: kill {os.getpid()}" in result.stderr


def test_single_strategy_runs_one_process_with_the_default_nproc(tmp_path, capsys):
    assert main(["train", "--strategy", "single", "--model", "convnet", "--data", "synthetic:64", "--epochs", "1",
                 "--output-dir", str(tmp_path), "--no-progress"]) == 0
    assert "[rank0]: ddpkit: 1 process(es) via single, backend none" in capsys.readouterr().err


def test_spawn_reports_a_worker_usage_error_as_status_2(tmp_path):
    result = run_ddpkit("train", "--launcher", "spawn", "--model", "convnet", "--data", "synthetic:256",
                        "--accumulate", "100", "--output-dir", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "fewer than --accumulate 100" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("ddpkit: error:") == 1, result.stderr  # every rank finds it; rank 0 says it


def test_spawn_shows_a_worker_exception_and_fails(tmp_path):
    # A bug in the user's own data set (not a mistake ddpkit can name in one line): its traceback is shown.
    (tmp_path / "crashing_data.py").write_text(textwrap.dedent("""
        from torch.utils.data import Dataset

        class Crashing(Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, index):
                raise ZeroDivisionError("a bug in the data set")

        def make():
            return Crashing(), Crashing(), 10
    """))
    result = run_ddpkit("train", "--launcher", "spawn", "--model", "convnet", "--data", "crashing_data:make",
                        "--batch-size", "2", "--workers", "0", "--output-dir", str(tmp_path / "o"), timeout=120,
                        PYTHONPATH=str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "raised the exception above" in result.stderr


SLURM_TASK = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    with open(os.path.join(sys.argv[1], f"task{os.environ['SLURM_PROCID']}.txt"), "w") as f:
        f.write(f"{os.environ['RANK']} {os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']} {t.item()}")
    dist.destroy_process_group()
    """
)


# tests/test_slurm.py runs the same under a real Slurm where one is installed
def test_run_under_srun_makes_each_task_one_rank(tmp_path):
    # What `srun -n 2 ddpkit run script.py` gives each task: Slurm's variables, no torchrun ones.
    import subprocess
    import sys

    from conftest import warm_python, warm_ranks_env
    from ddpkit.core.process_group import free_port

    script = tmp_path / "task.py"
    script.write_text(SLURM_TASK)
    common = {"SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost",
              "SLURM_TASKS_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    envs = [warm_ranks_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **common) for r in (0, 1)]
    tasks = [subprocess.Popen(warm_python([sys.executable, "-m", "ddpkit", "run", str(script), str(tmp_path)], env),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]
    outputs = [task.communicate(timeout=120) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    # Two processes in all (no extra launch), ranks from SLURM_PROCID, and a real all-reduce: 1 + 2.
    assert (tmp_path / "task0.txt").read_text() == "0 0 2 3.0"
    assert (tmp_path / "task1.txt").read_text() == "1 1 2 3.0"


def test_ranks_stopped_after_another_ranks_usage_error_are_not_reported_as_failures(capsys):
    from ddpkit.launch.launcher import report_failures

    # Rank 1 rejected its input (it printed why); the agent then stopped rank 0 with SIGTERM.
    assert report_failures({0: (-15, 100), 1: (2, 101)}) == 2
    assert capsys.readouterr().err == ""
    # Without a usage error, every failure is reported.
    assert report_failures({0: (-15, 100), 1: (1, 101)}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "ddpkit: rank 0 (pid 100) was ended by the launcher (SIGTERM) when another rank failed",
        "ddpkit: error: rank 1 (pid 101) exited with status 1; its output is above",
    ]
    # A rank whose own SIGTERM handler ran exits 128 + 15: ended by the launcher all the same.
    assert report_failures({0: (143, 100), 1: (-9, 101)}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "ddpkit: rank 0 (pid 100) was ended by the launcher (SIGTERM) when another rank failed",
        "ddpkit: error: rank 1 (pid 101) killed by signal 9; its output is above",
    ]
    # Every rank ended by SIGTERM (the job was stopped): each is said, as before.
    assert report_failures({0: (-15, 100), 1: (-15, 101)}) == 1
    assert capsys.readouterr().err.count("killed by signal 15; its output is above") == 2
    # Where each rank's output is kept in a file (ddpkit train), a failed rank other than 0 is named with it.
    assert report_failures({0: (-15, 100), 1: (1, 101)}, "/run/logs") == 1
    assert capsys.readouterr().err.splitlines()[1] == (
        "ddpkit: error: rank 1 (pid 101) exited with status 1; its errors are above, all its output in /run/logs/rank1.log")


def test_rank_logs_started_for_workers_that_never_came_end_and_leave_no_pipe(tmp_path):
    from ddpkit.launch import rank_logs

    dest = rank_logs.RankLogs(str(tmp_path / "logs")).reify({0: {"RANK": "4"}, 1: {"RANK": "5"}})
    pipes = [*dest.stdouts.values(), *dest.stderrs.values()]
    assert len(set(pipes)) == 4 and all(os.path.exists(pipe) for pipe in pipes)
    copiers = list(rank_logs._copiers)
    rank_logs.drain(timeout_s=5)  # each copier waits for a writer that will never open its pipe
    assert not any(thread.is_alive() for thread in copiers) and not any(os.path.exists(pipe) for pipe in pipes)
    assert sorted(path.name for path in (tmp_path / "logs").iterdir()) == ["rank4.log", "rank5.log"]


def test_a_run_in_a_folder_whose_earlier_run_is_still_alive_names_its_processes(tmp_path):
    """The earlier run's workers, frozen (SIGSTOP) as by a stuck file system after their launcher died:
    the next run in the same folder says they are alive and names them, then trains."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import child_env, children_of, leftover_processes, rank_pid

    out = tmp_path / "run"
    earlier = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--nproc-per-node", "2", "--epochs", "400",
                                "--output-dir", str(out), "--no-progress"], env=child_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, pids = time.monotonic() + 60, [None, None]
        while None in pids and time.monotonic() < deadline:
            pids = [rank_pid(earlier.pid, rank) for rank in (0, 1)]
            time.sleep(0.2)
        assert None not in pids, "the earlier run's ranks did not start"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        result = run_ddpkit("train", "--nproc-per-node", "2", "--epochs", "1", "--output-dir", str(out),
                            "--no-progress")
    finally:
        for pid in children_of(earlier.pid):
            os.kill(pid, signal.SIGKILL)
        earlier.kill()
        earlier.wait()
        deadline = time.monotonic() + 10  # a stopped process dies of SIGKILL once it is scheduled: on a busy machine
        while leftover_processes() and time.monotonic() < deadline:  # (the suite's), a moment later
            time.sleep(0.1)
    assert result.returncode == 0, result.stderr
    named = ", ".join(map(str, sorted(pids)))
    assert (f"ddpkit: warning: processes of an earlier run writing {out} are still alive: pid {named} (launched by "
            f"{earlier.pid}); they write the same checkpoints and metrics as this run. End them (kill "
            f"{named.replace(', ', ' ')}) or give this run another --output-dir") in result.stderr
    assert not leftover_processes()


def test_a_node_whose_master_never_starts_ends_in_one_line_after_the_rendezvous_timeout(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run_ddpkit("train", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                        str(port), "--rdzv-timeout", "3", "--output-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"ddpkit: waiting for node 0 at 127.0.0.1:{port} (up to 3 s: --rdzv-timeout)",
        f"ddpkit: error: node 0 at 127.0.0.1:{port} did not answer in 3 s (last try: Connection refused); check "
        "--master-addr and --master-port, that node 0 has started, and that the machines reach each other on that "
        "port (--rdzv-timeout waits longer)"], result.stderr


def test_a_busy_master_port_on_one_machine_is_one_line_and_status_2(tmp_path):
    # --master-port on one machine: torchrun's static rendezvous, whose store ddpkit binds on loopback itself.
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        result = run_ddpkit("train", "--data", "synthetic:64", "--epochs", "1", "--master-port", str(port),
                            "--output-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert (f"ddpkit: error: could not set up the rendezvous at 127.0.0.1:{port} (cannot listen on 127.0.0.1:{port}: "
            "Address already in use); check --master-addr, and that --master-port is free") in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("strategy, needs", [("fsdp", "2.7"), ("pipeline", "2.9")])
def test_a_strategy_that_needs_a_newer_torch_is_refused_there_in_one_line(tmp_path, strategy, needs):
    from ddpkit.core.version import torch_at_least

    if torch_at_least(needs):
        pytest.skip(f"this torch ({torch.__version__}) has what --strategy {strategy} needs: its own tests train it")
    done = run_ddpkit("train", "--strategy", strategy, "--nproc-per-node", "2", "--epochs", "1", "--output-dir",
                      str(tmp_path), timeout=60)
    assert done.returncode == 2, done.stderr
    said = re.findall(rf"ddpkit: error: --strategy {strategy}.* needs torch>={needs} \(this is torch ", done.stderr)
    assert len(said) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not leftover_processes()


def test_sharding_an_unchanged_script_needs_torch_2_10_and_is_refused_before_in_one_line(tmp_path):
    from ddpkit.core.version import torch_at_least
    from ddpkit.unchanged.layouts import SHARD_IN_PLACE

    if torch_at_least(SHARD_IN_PLACE):
        pytest.skip(f"this torch ({torch.__version__}) shards: tests/test_unchanged_sharded.py trains it")
    done = run_ddpkit("run", "--unchanged", "--shard", "always", "--nproc-per-node", "2", DEMO, timeout=60)
    assert done.returncode == 2, done.stderr
    said = re.findall(r"ddpkit: error: --unchanged --shard always needs torch>=2.10 \(this is torch ", done.stderr)
    assert len(said) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not leftover_processes()
