"""Replicas that drift apart: an exact checksum of each rank's weights, compared, naming the rank that differs."""

from __future__ import annotations

import doctest

import pytest
import torch

from conftest import leftover_processes, run_ddpkit
from ddpkit.watch import replicas
from ddpkit.core.errors import UsageError


def test_the_doctest():
    failures, tried = doctest.testmod(replicas)
    assert tried and not failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_any_one_bit_of_any_element_changes_the_checksum(dtype):
    torch.manual_seed(0)
    weight = torch.randn(64, 33).to(dtype)[:, 1:]  # not contiguous: a view of every row but its first element
    before = replicas.checksums([("w", weight)])
    as_integers = weight.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[weight.element_size()])
    bits = weight.element_size() * 8
    for bit in (0, 7, bits - 1):  # the lowest bit of the mantissa up to the sign
        changed = weight.clone()
        changed.view(as_integers.dtype)[17, 5] ^= (1 << bit) if bit < bits - 1 else -(1 << bit)  # the sign: -2**bit
        assert not torch.equal(replicas.checksums([("w", changed)]), before)
    assert torch.equal(replicas.checksums([("w", weight.clone())]), before)  # only the values count


def test_the_rank_that_differs_is_named_against_the_most_ranks():
    names = ["conv.weight", "conv.bias", "fc.weight"]
    same, other = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])
    assert replicas.differing(names, [same] * 4) is None
    assert replicas.differing(names, [same, same, other, same]) == (
        "rank 2 holds weights that differ from those of ranks 0, 1, 3 (first in fc.weight; 1 of 3 parameters differ)")
    # Rank 0 may be the odd one out.
    assert replicas.differing(names, [torch.tensor([9, 2, 4]), same, same]).startswith(
        "rank 0 holds weights that differ from those of ranks 1, 2 (first in conv.weight; 2 of 3")
    # A tie: rank 0's side is the reference (its weights are what checkpoints save).
    assert replicas.differing(names, [same, other]).startswith("rank 1 holds weights that differ from those of rank 0")
    assert replicas.differing(names, [same, other, torch.tensor([0, 2, 3]), same]).startswith(
        "ranks 1, 2 hold weights that differ from those of ranks 0, 3 (first in conv.weight; 2 of 3")


@pytest.mark.parametrize("every", [-1, 2.5, True, "10"])
def test_the_setting_is_a_whole_number_of_steps(every):
    with pytest.raises(UsageError, match=r"`check_replicas` must be 0 \(off\) or a number of optimizer steps"):
        replicas.check_every(every)
    assert replicas.check_every(None) == replicas.DEFAULT_EVERY and replicas.check_every(0) == 0


DRIFTER = """
import torch, torch.nn as nn, torch.nn.functional as F, ddpkit
from torch.utils.data import TensorDataset

data = TensorDataset(torch.randn(512, 8), torch.randint(0, 4, (512,)))
with ddpkit.Job("ddp", check_replicas=2) as job:
    model, optimizer = job.setup(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.optim.SGD, lr=0.1)
    for x, y in job.train_loader(data, batch_size=8):
        if job.rank == 1 and job.global_step == 3:
            with torch.no_grad():  # one rank's weights changed outside the optimizer step
                ddpkit.unwrap(model)[2].bias[0] += 1e-6
        job.backward(F.cross_entropy(model(x), y))
        job.step(optimizer)
    job.print("trained on")
"""


def test_a_rank_whose_weights_drifted_is_named_and_the_job_stops(tmp_path):
    script = tmp_path / "drifter.py"
    script.write_text(DRIFTER)
    result = run_ddpkit("run", "--nproc-per-node", "2", str(script), timeout=120)
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert err.count("ddpkit: error:") == 1, err  # one error for the job, from rank 0
    assert ("[rank0]: ddpkit: error: the data-parallel replicas differ at step 4: rank 1 holds weights that differ "
            "from those of rank 0 (first in 2.bias; 1 of 4 parameters differ) (of two, either may be the one that "
            "changed).") in err
    assert "`check_replicas` sets how often" in err
    assert "Traceback" not in err and "trained on" not in result.stdout
    assert not leftover_processes()


def test_the_strategies_whose_ranks_hold_the_whole_model_are_the_ones_checked():
    from ddpkit.strategies import STRATEGIES

    assert {name for name, strategy in STRATEGIES.items() if strategy.replicated} == {"ddp", "zero"}
