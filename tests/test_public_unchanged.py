"""Other people's one-device scripts, as their authors wrote them (the corpus beside the project,
``../shared/corpus/pytorch-examples``), under ``ddpkit run --unchanged`` on 1 and on 2 processes: every one that runs
here, each held to the verdict that ``benchmarks/public_unchanged.py`` gives it and docs/unchanged.md's table shows
(exact, trains like one device, or cannot run here on one process either, with why). The runs start warm
(tests/warm_ranks.py); their stand-in data is made once for the module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_ddpkit


def public_unchanged():
    spec = importlib.util.spec_from_file_location("public_unchanged", REPO / "benchmarks" / "public_unchanged.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["public_unchanged"] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


DRIVER = public_unchanged()
RUN_HERE = [case.name for case in DRIVER.CASES if not case.own and not case.not_run]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    if not DRIVER.CORPUS.is_dir():
        pytest.skip(f"no corpus at {DRIVER.CORPUS}: the shared folder beside the repository")
    folder = tmp_path_factory.mktemp("corpus")
    DRIVER.make_data(folder / "data")
    return folder


def warm(args: list[str], cwd: Path) -> tuple:
    done = run_ddpkit(*args, timeout=240, cwd=cwd)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN_HERE)
def test_a_public_script_as_its_authors_wrote_it_gives_on_two_processes_what_one_gives(scratch, name):
    [case] = [case for case in DRIVER.CASES if case.name == name]
    result = DRIVER.judge(case, DRIVER.run_both(case, scratch, [], runner=warm))
    assert result["verdict"] == case.expect, (result["verdict"], result.get("why"), result["runs"][2]["stderr_tail"])
