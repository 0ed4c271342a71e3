"""Public one-device scripts (pytorch/examples', written to behave as their originals in benchmarks/public/), run as
they are under ``ddpkit run --unchanged`` on 1 and on 2 processes by ``benchmarks/public_unchanged.py``, which fills
docs/unchanged.md's table with all ten. Here, the fast two: a regression whose batches are cut by hand and whose loss
is computed outside the model, and a graph attention network trained on the whole graph at once (dropout inside):
both computed whole on every process, exact."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO


def public_unchanged():
    spec = importlib.util.spec_from_file_location("public_unchanged", REPO / "benchmarks" / "public_unchanged.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["public_unchanged"] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    module = public_unchanged()
    scratch = tmp_path_factory.mktemp("public")
    module.make_data(scratch / "data")
    return module, scratch


@pytest.mark.slow
@pytest.mark.parametrize("name", ["regression", "gat"])
def test_a_public_script_trains_on_two_processes_to_one_process_weights(driver, name):
    module, scratch = driver
    [case] = [case for case in module.CASES if case.name == name]
    result = module.judge(case, {nproc: module.run_once(case, nproc, scratch, []) for nproc in (1, 2)}, [])
    assert result["verdict"] == "exact", (result["verdict"], result["runs"][2]["stderr_tail"])
    assert "every process computes each of its steps whole" in result["runs"][2]["stderr_tail"]
