"""`mpirun -np 2 ddpkit train` and `mpirun -np 2 ddpkit run script.py`, with Debian's Open MPI for real: each
MPI process is one rank, read from Open MPI's environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import DIGITS_CONVNET, leftover_processes, run_command

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(
    MPIRUN is None, reason="needs Open MPI's mpirun: apt-get install openmpi-bin (.ci/run installs it)")
# Open MPI refuses root unless told twice; its own launch needs no network beyond this machine.
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}


def mpirun(*command: str, cwd=None) -> subprocess.CompletedProcess:
    # Each rank's Python (mpirun starts it) forked from a warm interpreter, in the environment mpirun gave it.
    return run_command([MPIRUN, "-np", "2", "--oversubscribe", sys.executable, "-m", "ddpkit", *command],
                       timeout=120, cwd=cwd, warm=True, **AS_ROOT)


def test_mpirun_ddpkit_train_equals_ddpkits_own_launcher(ddp_digits, tmp_path):
    _, state, rows, _ = ddp_digits
    result = mpirun("train", *DIGITS_CONVNET, "--no-progress", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 process(es) via mpi" in result.stdout + result.stderr
    mine = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(mine[key], state[key]) for key in state), "not the same weights as --nproc-per-node 2"
    assert (tmp_path / "config.toml").read_text().count("nproc-per-node = 2") == 1  # written by rank 0 only
    assert not leftover_processes()


SCRIPT = """
import os
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "local", os.environ["LOCAL_RANK"],
      "master", os.environ["MASTER_ADDR"], flush=True)
"""


def test_mpirun_ddpkit_run_gives_a_script_torchruns_variables(tmp_path):
    (tmp_path / "who.py").write_text(SCRIPT)
    result = mpirun("run", "who.py", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("rank 0 of 2 local 0 master 127.0.0.1") == 1
    assert result.stdout.count("rank 1 of 2 local 1 master 127.0.0.1") == 1



def test_a_mistake_in_the_command_is_said_once_not_once_per_rank(tmp_path):
    result = mpirun("train", "--model", "nope", "--output-dir", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("ddpkit: error: unknown model 'nope'") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_mpirun_ddpkit_run_unchanged_prints_each_line_of_the_script_once(tmp_path):
    from test_unchanged import PRINTS, printed_once

    (tmp_path / "prints.py").write_text(PRINTS)
    printed_once(mpirun("run", "--unchanged", "prints.py", cwd=tmp_path))
