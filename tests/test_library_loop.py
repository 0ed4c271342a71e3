"""One library script (examples/library_loop.py: accumulation 2, evaluation, checkpoints every 5 steps) under single,
ddp, ZeRO and fsdp, changing only --strategy: real processes, gloo.

Each strategy trains once uninterrupted, writing checkpoints; a second run starts in new processes from its
step-15 checkpoint (mid-epoch) and must end bit-identical. The 2-process strategies must equal one process
with the global batch. Both in fp32: under bf16 autocast each process's weight gradients are rounded to bf16
before they are averaged (measured: 6e-3 relative after 44 steps, against one process's rounding of the whole
batch's), which no strategy can make equal; one run per strategy then serves both checks (8 launches, not the 12
of a separate bf16 pair). The script under bf16 resumes bit for bit in tests/test_ray.py (DDP, Ray restarting the
group) and tests/test_examples.py (the by-hand loop under FSDP). The same script, unchanged, as two replica groups
must equal one process too (groups of one process, of two DDP processes, and HSDP).
"""

import pytest
import torch

from conftest import REPO, max_relative_difference, run_ddpkit

from ddpkit import checkpoint

SCRIPT = str(REPO / "examples" / "library_loop.py")
COMMON = ["--accumulate", "2", "--epochs", "2", "--checkpoint-every", "5", "--keep-checkpoints", "20"]
LAYOUT = {"single": ("1", "32"), "ddp": ("2", "16"), "zero": ("2", "16"), "fsdp": ("2", "16")}


def _run(out, strategy, *extra):
    nproc, batch = LAYOUT[strategy]
    result = run_ddpkit("run", "--nproc-per-node", nproc, SCRIPT, "--strategy", strategy, "--batch-size", batch,
                        "--out", str(out), *COMMON, *extra, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(out / "model.pt", weights_only=True), result.stdout


class Runs(dict):
    """strategy -> (uninterrupted state, resumed state, the uninterrupted run's stdout), each strategy's two launches
    made when a test first asks for it: a test's time (and its timeout) covers at most two strategies' runs, not all
    eight launches."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, strategy: str):
        folder = self.tmp_path_factory.mktemp(strategy)
        whole, stdout = _run(folder / "whole", strategy)
        # A file, or a folder where the strategy's checkpoints are sharded (zero, fsdp).
        step_15 = next(str(path) for path in checkpoint.list_checkpoints(folder / "whole" / "checkpoints")
                       if checkpoint.step_of(path) == 15)
        resumed, _ = _run(folder / "resumed", strategy, "--resume", step_15)
        self[strategy] = (whole, resumed, stdout)
        return self[strategy]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


def _as_replica_groups(out, strategy: str, nproc: str, batch: str) -> dict:
    """The same script under ``ddpkit run --replica-groups 2`` (Job joins each process's group), fp32, ``nproc``
    processes of ``batch`` per group, without accumulation: the same 64 samples a step as one process of 32 x 2
    accumulated. Its model.pt."""
    pytest.importorskip("torchft", reason="replica groups need torchft (pip install 'ddpkit[ft]')")
    flags = COMMON[2:]  # without --accumulate 2
    result = run_ddpkit("run", "--replica-groups", "2", "--nproc-per-node", nproc, SCRIPT, "--strategy", strategy,
                        "--batch-size", batch, "--out", str(out), *flags, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("(359 samples)") == 2  # each epoch's line printed once, by the leading group
    return torch.load(out / "model.pt", weights_only=True)


@pytest.mark.slow  # one launch of 2 replica groups beside the fixture's runs: about 7 s, 12 s for groups of two
@pytest.mark.parametrize("strategy, nproc, batch", [("ddp", "1", "32"), ("fsdp", "2", "16")],
                         ids=["ddp-groups-of-1", "hsdp"])
def test_the_script_unchanged_as_two_replica_groups_equals_one_process_with_the_global_batch(runs, tmp_path,
                                                                                            strategy, nproc, batch):
    """Groups of one process, and HSDP: FSDP inside groups of two processes of 16 each."""
    grouped = _as_replica_groups(tmp_path, strategy, nproc, batch)
    assert max_relative_difference(grouped, runs["single"][0]) <= 1e-5


def test_the_script_unchanged_as_two_replica_groups_of_two_ddp_processes_equals_one_process(tmp_path):
    """Groups of two DDP processes of 16 each. In the default suite, where there is room, against a one-process run
    of its own (the slow fixture's twelve launches are not made there): about 20 s."""
    grouped = _as_replica_groups(tmp_path / "groups", "ddp", "2", "16")
    one_process, _ = _run(tmp_path / "single", "single")
    assert max_relative_difference(grouped, one_process) <= 1e-5


@pytest.mark.slow  # 8 launches: about 2 minutes
@pytest.mark.parametrize("strategy", list(LAYOUT))
def test_resumed_mid_epoch_is_bit_identical(runs, strategy):
    whole, resumed, stdout = runs[strategy]
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[key], resumed[key]) for key in whole)
    assert stdout.count("(359 samples)") == 2  # each epoch evaluated every validation sample once


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero", "fsdp"])
def test_two_processes_equal_one_with_the_global_batch(runs, strategy):
    assert max_relative_difference(runs[strategy][0], runs["single"][0]) <= 1e-5
