"""A real one-node Slurm (Debian's slurm-wlm and munge), started by the test: `srun -n 2 ddpkit ...` needs no
torchrun flags, each task is one rank.

Needs root and the two packages (`apt-get install slurm-wlm munge`; .ci/run installs them); skipped,
saying so, elsewhere. Everything runs from a private folder: its own slurm.conf (SLURM_CONF), munge
socket, state and spool folders and free ports; nothing of a system Slurm is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import _pids_with, child_env, run_command
from ddpkit.core.process_group import free_port

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "srun", "munged")),
    reason="needs root and Debian's slurm-wlm and munge (apt-get install slurm-wlm munge; .ci/run installs them)",
)

SLURM_CONF = """\
ClusterName=ddpkit-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket.2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_file: Path) -> None:
    with contextlib.suppress(OSError, ValueError, ProcessLookupError):
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):  # up to 10 s for it to finish
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def slurm():
    """The environment that points srun at a one-node cluster of this machine's cores."""
    # Not under pytest's tmp_path: munged runs as the munge user, which cannot enter root's 0700 folders.
    root = Path(tempfile.mkdtemp(prefix="ddpkit-slurm-"))
    root.chmod(0o755)
    for folder in ("state", "spool", "munge"):
        (root / folder).mkdir()
    shutil.chown(root / "munge", "munge", "munge")
    host = socket.gethostname().split(".")[0]
    (root / "slurm.conf").write_text(SLURM_CONF.format(host=host, root=root, ctld_port=free_port(), d_port=free_port(),
                                                       cpus=os.cpu_count()))
    env = child_env(SLURM_CONF=str(root / "slurm.conf"))
    daemons = []
    try:
        subprocess.run(["runuser", "-u", "munge", "--", "munged", f"--socket={root}/munge/munge.socket.2",
                        f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munge/munged.log",
                        f"--seed-file={root}/munge/seed"], check=True, timeout=30)
        for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            daemons.append(subprocess.Popen(daemon, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
            if state.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the test Slurm never became idle:\n{(root / 'slurmctld.log').read_text()[-3000:]}")
        yield env
    finally:
        # A job step's slurmstepd outlives its srun for a moment, reporting to slurmctld; stopped (or left without
        # slurmctld) it lingers, ignoring SIGTERM. Its environment keeps the cluster's SLURM_CONF: the steps are given
        # time to end while both daemons run, the daemons are stopped (slurmd first), and a step left is killed.
        conf = str(root / "slurm.conf")
        _wait_gone(conf, 10.0, exclude=[proc.pid for proc in daemons])
        for proc in reversed(daemons):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
        for pid in _pids_with("SLURM_CONF", conf):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        left = _wait_gone(conf, 10.0)
        _stop(root / "munge" / "munged.pid")
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes of the test Slurm still running: {left}"


def _wait_gone(conf: str, timeout_s: float, exclude: list[int] = ()) -> list[int]:
    """Wait up to ``timeout_s`` for the processes of the Slurm of ``conf`` (but ``exclude``) to end; those left."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in _pids_with("SLURM_CONF", conf) if pid not in exclude]) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _srun(env: dict, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    # run_command: on a timeout it also kills the tasks (srun passes them its environment, marker included); each
    # task's Python forked from a warm interpreter, in the environment Slurm gave the task.
    return run_command(["srun", "-n", "2", *args], timeout=timeout, warm=True, SLURM_CONF=env["SLURM_CONF"])


def test_srun_ddpkit_train_makes_each_task_one_rank(slurm, tmp_path):
    import sys

    result = _srun(slurm, sys.executable, "-m", "ddpkit", "train", "--data", "synthetic:256", "--epochs", "1",
                   "--output-dir", str(tmp_path), "--no-progress")
    assert result.returncode == 0, result.stdout + result.stderr
    # Rank 0 alone says it; the two tasks are the two ranks (nothing launched more).
    assert result.stderr.count("[rank0]: ddpkit: 2 process(es) via slurm") == 1, result.stderr
    assert "[rank1]:" not in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["world_size"] == 2 and rows[-1]["global_batch"] == 64 and rows[-1]["val_count"] == 64


def test_srun_ddpkit_run_gives_a_torchrun_style_script_its_rank(slurm, tmp_path):
    import sys

    script = tmp_path / "task.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"  # torchrun's variables, from Slurm's, through ddpkit run
        "total = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(total)\n"
        "open(os.path.join(sys.argv[1], f'task{os.environ[\"RANK\"]}.txt'), 'w').write(\n"
        "    f'{os.environ[\"RANK\"]} {os.environ[\"WORLD_SIZE\"]} {total.item()}')\n"
        "dist.destroy_process_group()\n"
    )
    result = _srun(slurm, sys.executable, "-m", "ddpkit", "run", str(script), str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "task0.txt").read_text() == "0 2 3.0"
    assert (tmp_path / "task1.txt").read_text() == "1 2 3.0"


def test_srun_ddpkit_run_unchanged_prints_each_line_of_the_script_once(slurm, tmp_path):
    import sys

    from test_unchanged import PRINTS, printed_once

    (tmp_path / "prints.py").write_text(PRINTS)
    printed_once(_srun(slurm, sys.executable, "-m", "ddpkit", "run", "--unchanged", str(tmp_path / "prints.py")))
