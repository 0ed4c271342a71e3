"""SIGTERM (what torchrun and Slurm send) and Ctrl-C tear the process group down and leave nothing running."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import child_env

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    import ddpkit
    out = sys.argv[1]
    try:
        with ddpkit.distributed() as rt:
            dist.barrier()
            open(os.path.join(out, f"ready{rt.rank}"), "w").close()
            while True:
                time.sleep(0.05)
    finally:
        # Runs after ddpkit's teardown: the group must be gone already.
        with open(os.path.join(out, f"exit{os.environ['RANK']}"), "w") as f:
            f.write(str(dist.is_initialized()))
    """
)


@pytest.mark.parametrize("how", ["sigterm-to-launcher", "ctrl-c-to-group", "sigkill-to-launcher"])
def test_signal_tears_down_every_rank_within_seconds(tmp_path, how):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", str(script), str(tmp_path)],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers never became ready"
            time.sleep(0.1)
        sent = time.monotonic()
        if how == "sigterm-to-launcher":
            proc.send_signal(signal.SIGTERM)
        elif how == "sigkill-to-launcher":
            proc.kill()  # the launcher can do nothing: each rank learns it from Linux (PR_SET_PDEATHSIG)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        # Returns once every process holding the output pipes has ended: the ranks too, not only the launcher.
        _, stderr = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    if how == "sigkill-to-launcher":
        assert proc.returncode == -signal.SIGKILL
        # Each rank got SIGTERM when its parent died and tore its group down as on any SIGTERM (below). Its output
        # goes to a pipe of the dead launcher's (the rank logs), not to this test's: it may end after the launcher.
        while not all((tmp_path / f"exit{r}").exists() for r in (0, 1)) and time.monotonic() - sent < 30:
            time.sleep(0.1)
        assert [(tmp_path / f"exit{r}").read_text() for r in (0, 1)] == ["False", "False"], stderr
        return
    assert proc.returncode == 128 + (signal.SIGTERM if how == "sigterm-to-launcher" else signal.SIGINT)
    assert "ddpkit: stopped by signal" in stderr
    # The launcher prints no traceback of its own (a worker's KeyboardInterrupt is the script's, "[rankN]: ...").
    assert not [line for line in stderr.splitlines() if line.startswith("Traceback")], stderr
    assert [(tmp_path / f"exit{r}").read_text() for r in (0, 1)] == ["False", "False"]


REPEATED = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import ddpkit
    from ddpkit.core.signals import Terminated
    out = sys.argv[1]

    def repeat():  # the same SIGTERM again, 50 ms later: a dead launcher's next thread, or Slurm then torchrun
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        try:
            with ddpkit.distributed():
                threading.Thread(target=repeat).start()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        finally:
            time.sleep(0.3)  # the repeat comes while the script's own finally block runs
            open(os.path.join(out, "finally"), "w").close()
    except Terminated as stop:
        open(os.path.join(out, "terminated"), "w").write(str(stop.code))
    time.sleep(1.2)  # past the window: a new SIGTERM ends the process as before (the default action)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    open(os.path.join(out, "survived"), "w").close()
    """
)


def test_a_repeated_sigterm_is_the_same_stop_and_a_later_one_ends_the_process(tmp_path):
    script = tmp_path / "repeat.py"
    script.write_text(REPEATED)
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], env=child_env(), capture_output=True,
                            text=True, timeout=60)
    assert (tmp_path / "finally").exists(), result.stderr  # the repeat did not end it in its finally block
    assert (tmp_path / "terminated").read_text() == str(128 + signal.SIGTERM)  # raised once, with SIGTERM's status
    assert result.returncode == -signal.SIGTERM and not (tmp_path / "survived").exists(), result.stderr


LEAVING = textwrap.dedent(
    """
    import atexit, os, signal, sys, time
    from ddpkit.core import exits, signals

    signals.catch((signal.SIGTERM,), signals.raise_terminated)
    text, raw = open(os.path.join(sys.argv[1], "text"), "w"), open(os.path.join(sys.argv[1], "raw"), "wb")
    text.write("written, never flushed")  # flushed as the interpreter's teardown would, which leave skips
    raw.write(b"and in bytes")

    def stopped_while_leaving():  # the launcher's SIGTERM reaches a rank that is ending with its usage error
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("the exit handlers ran to their end", flush=True)

    atexit.register(stopped_while_leaving)
    exits.leave(2)
    """
)


def test_a_sigterm_while_a_rank_leaves_is_no_traceback_and_keeps_its_status_and_its_files(tmp_path):
    result = subprocess.run([sys.executable, "-c", LEAVING, str(tmp_path)], env=child_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "the exit handlers ran to their end\n", result.stdout + result.stderr
    assert (tmp_path / "text").read_text() == "written, never flushed"
    assert (tmp_path / "raw").read_bytes() == b"and in bytes"


BROKEN_DATA = textwrap.dedent(
    """
    import torch, ddpkit
    from torch.utils.data import Dataset

    class Broken(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            if index == 20:
                raise ValueError("sample 20 is corrupt")
            return torch.zeros(3), 0

    with ddpkit.Job("single", seed=0) as job:
        loader = job.train_loader(Broken(), batch_size=4, workers=2)

        def batches():  # a suspended generator holds the loader's pass (and its workers) after the error
            while True:
                yield from loader

        source = batches()
        for _ in range(30):
            next(source)
    """
)


def test_an_error_in_a_loader_worker_ends_the_process_with_the_error_and_no_worker_left(tmp_path):
    from conftest import _pids_with, run_command

    (tmp_path / "broken.py").write_text(BROKEN_DATA)
    marker = "loader-error-" + str(os.getpid())
    # Before the fix, the process never exited: its workers ignore SIGTERM, which multiprocessing's exit sends them.
    result = run_command([sys.executable, str(tmp_path / "broken.py")], timeout=60, DDPKIT_LOADER_TEST=marker)
    assert result.returncode == 1, result.stderr
    assert "ValueError: sample 20 is corrupt" in result.stderr
    assert "killed by signal" not in result.stderr  # the workers' end at exit is not reported as a second error
    assert _pids_with("DDPKIT_LOADER_TEST", marker) == []
