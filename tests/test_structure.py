"""The code's shape, checked: imports run one way between the packages (docs/architecture.md), no module uses
another module's underscore names, no import cycle, no branch on a strategy's name outside ``ddpkit.strategies``,
one owner of signal handlers, and nothing registered (signal handlers, exit hooks, logging handlers) at import.

Reading of the source with ``ast``, except the import check, which imports every module in a fresh process.
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env

SRC = REPO / "src"
PACKAGE_FILES = sorted((SRC / "ddpkit").rglob("*.py"))
USER_FILES = sorted((REPO / "benchmarks").glob("*.py")) + sorted((REPO / "examples").glob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE_FILES}


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every ddpkit import in the file, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.startswith("ddpkit")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpkit") and node.level == 0:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


def private_uses(path: Path) -> list[str]:
    """Underscore names taken from another ddpkit module: imported by name, or read as module._name."""
    own = module_name(path) if path.is_relative_to(SRC) else None
    problems, aliases = [], {}
    for module, name, line in imports(path):
        if name is not None and f"{module}.{name}" in MODULES:
            aliases[name] = f"{module}.{name}"  # `from ddpkit import trainer`: trainer is a module
        elif name is not None and name.startswith("_") and not name.startswith("__") and module != own:
            problems.append(f"{path.name}:{line} imports {module}.{name}")
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != own):
            problems.append(f"{path.name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return problems


def edges() -> dict[str, set[str]]:
    """Module -> the ddpkit modules it imports (``from ddpkit.strategies import split`` is the module split). An
    import of a name from the top package (``from ddpkit import __version__``) is an edge to it, the facade above
    every module, which none may import."""
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for module, imported, _ in imports(path):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in MODULES else module
            if target != name:
                targets.add(target)
        graph[name] = targets
    return graph


# What each package may import besides itself (docs/architecture.md): the core nothing; the library's parts the
# core (a checkpoint also asks the strategies); the Job all of the library; the application everything. The top
# package, the public facade, re-exports the library and is left out (edges() drops it).
ALLOWED = {
    "core": set(),
    "strategies": {"core"},
    "data": {"core"},
    "zoo": {"core", "data"},
    "watch": {"core"},
    "launch": {"core"},
    "checkpoint": {"core", "strategies"},
    "job": {"core", "strategies", "data", "checkpoint", "watch"},
    "unchanged": {"core", "strategies", "data", "checkpoint"},
    "app": {"core", "strategies", "data", "zoo", "watch", "launch", "checkpoint", "job", "unchanged"},
}


def package_of(module: str) -> str:
    """``ddpkit.core.env`` -> core; ``ddpkit.job`` -> job; ``ddpkit.__main__`` (the command) -> app; ``ddpkit`` (the
    public facade) -> facade."""
    if module == "ddpkit":
        return "facade"
    part = module.split(".")[1]
    return "app" if part == "__main__" else part


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package that its package may not import (ALLOWED), as 'importer -> imported'."""
    return sorted(f"{source} -> {target}" for source, targets in graph.items() if source != "ddpkit"
                  for target in targets if package_of(target) != package_of(source)
                  and package_of(target) not in ALLOWED[package_of(source)])


# Strategy names, which only ddpkit.strategies may branch on: elsewhere, code asks the strategy object.
STRATEGY_NAMES = {"single", "dp", "ddp", "zero", "fsdp", "pipeline"}


def name_comparisons(path: Path) -> list[str]:
    """Comparisons (==, !=, in, not in) with a strategy's name as a literal string (or a literal collection of them)."""
    def names_in(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in STRATEGY_NAMES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names_in(item) for item in node.elts)

    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Compare) and any(names_in(side) for side in [node.left, *node.comparators])]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def signal_installers(path: Path) -> list[str]:
    """Calls of ``signal.signal`` (the one way Python installs a handler) in the file."""
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "signal"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "signal"]


# Imports every module named, then prints what ddpkit's code registered while importing: the signals whose
# handler changed, the exit hooks registered from ddpkit's modules (torch registers its own), and the
# handlers of the ddpkit logger.
IMPORT_ALL = """
import atexit, importlib, logging, signal, sys
watched = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)]
before = {s: signal.getsignal(s) for s in watched}
hooks, register = [], atexit.register
def recording(function, *args, **kwargs):
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.split(".")[0] in ("ddpkit", "this_hooks"):
        hooks.append(caller)
    return register(function, *args, **kwargs)
atexit.register = recording
for name in sys.argv[1:]:
    importlib.import_module(name)
changed = [s.name for s in watched if signal.getsignal(s) is not before[s]]
print(changed, hooks, len(logging.getLogger("ddpkit").handlers))
"""


LONGEST_FUNCTION = 60  # lines, from its `def` to its last line, docstring and comments included


def long_functions(path: Path) -> list[str]:
    """'file:line name (N lines)' for each function or method of ``path`` longer than ``LONGEST_FUNCTION`` lines."""
    return [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]


def test_no_function_is_longer_than_60_lines():
    # Past that, a function's steps want names of their own (docs/architecture.md, "Rules").
    assert [found for path in PACKAGE_FILES for found in long_functions(path)] == []


TRAIN_MODULES = sorted((SRC / "ddpkit" / "app" / "train").glob("*.py"))


def config_reaches(path: Path) -> list[str]:
    """The functions of ``path`` below ``ddpkit train``'s top (``run``, ``train``) that take the whole ``TrainConfig``
    (a ``cfg`` parameter) or reach back up for it (``<x>.cfg``); ``TrainConfig``'s own methods are its own."""
    tree = ast.parse(path.read_text())
    owners = {id(item): node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for item in node.body}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or owners.get(id(node)) == "TrainConfig":
            continue
        if id(node) not in owners and node.name in ("run", "train"):
            continue
        takes = "cfg" in {argument.arg for argument in node.args.args + node.args.kwonlyargs}
        if takes or any(isinstance(n, ast.Attribute) and n.attr == "cfg" for n in ast.walk(node)):
            found.append(f"{path.name}:{node.lineno} {node.name}")
    return found


def test_the_train_commands_settings_reach_down_to_at_most_10_functions():
    # Below run() and train(), a function gets the few settings it needs, not the whole TrainConfig
    # (docs/architecture.md, "ddpkit train by concern"): 17 did before the trainer was cut up, 7 since.
    reaching = [found for path in TRAIN_MODULES for found in config_reaches(path)]
    assert len(reaching) <= 10, reaching


def test_no_module_uses_another_modules_underscore_names():
    problems = [problem for path in PACKAGE_FILES + USER_FILES for problem in private_uses(path)]
    assert problems == []


def test_there_is_no_import_cycle():
    assert find_cycle(edges()) is None


def test_every_module_is_in_a_package_of_the_map():
    assert {package_of(name) for name in MODULES if name != "ddpkit"} == set(ALLOWED)


def test_imports_run_one_way_between_the_packages():
    assert upward_imports(edges()) == []


def test_only_the_strategies_branch_on_a_strategy_name():
    outside = [path for path in PACKAGE_FILES if "strategies" not in path.relative_to(SRC).parts]
    assert [found for path in outside for found in name_comparisons(path)] == []


def test_only_ddpkit_signals_installs_signal_handlers():
    owners = {path.name for path in PACKAGE_FILES if signal_installers(path)}
    assert owners == {"signals.py"}


def test_importing_ddpkit_registers_nothing():
    modules = [name for name in MODULES if name != "ddpkit.__main__"]
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, *modules], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[] [] 0"  # no signal handler, no exit hook, no logging handler


def test_the_checks_find_what_they_look_for(tmp_path):
    # A checker that cannot fail proves nothing: each is shown a case it must catch.
    bad = tmp_path / "bad.py"
    bad.write_text("from ddpkit.app.train.trainer import _hidden\nfrom ddpkit.app.train import trainer\ntrainer._Loop\n")
    assert len(private_uses(bad)) == 2
    # The core importing the launcher and the application; the Job the launcher; the app anything.
    graph = {"ddpkit.core.env": {"ddpkit.launch.launcher", "ddpkit.core.errors"},
             "ddpkit.core.errors": {"ddpkit.app.cli"}, "ddpkit.job": {"ddpkit.launch.nccl", "ddpkit.data.loaders"},
             "ddpkit.app.cli": {"ddpkit.job", "ddpkit.launch.launcher"}}
    assert upward_imports(graph) == ["ddpkit.core.env -> ddpkit.launch.launcher",
                                     "ddpkit.core.errors -> ddpkit.app.cli", "ddpkit.job -> ddpkit.launch.nccl"]
    # A name taken from the top package (the facade that imports everything) by a module below it: up, whatever
    # the module (checkpoint/format.py once took __version__ from there).
    (tmp_path / "format.py").write_text("def versions():\n    from ddpkit import __version__\n")
    MODULES["ddpkit.checkpoint.bad_format"] = tmp_path / "format.py"
    try:
        assert "ddpkit.checkpoint.bad_format -> ddpkit" in upward_imports(edges())
    finally:
        del MODULES["ddpkit.checkpoint.bad_format"]
    bad.write_text('if job.strategy.name == "ddp":\n    pass\nok = kind in ("single", "dp")\nfine = name == "sweep"\n'
                   'also_fine = s.name\n')
    assert name_comparisons(bad) == ["bad.py:1", "bad.py:3"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    bad.write_text("import signal\nsignal.signal(signal.SIGTERM, print)\n")
    assert signal_installers(bad) == ["bad.py:2"]
    (tmp_path / "this_hooks.py").write_text("import atexit, signal\natexit.register(print)\n"
                                            "signal.signal(signal.SIGTERM, print)\n")
    hooked = subprocess.run([sys.executable, "-c", IMPORT_ALL, "this_hooks"], capture_output=True, text=True,
                            cwd=tmp_path, env=child_env(PYTHONPATH=str(tmp_path)), timeout=60)
    assert hooked.stdout.split("\n")[0] == "['SIGTERM'] ['this_hooks'] 0", hooked.stderr
    body = "".join(f"    x = {i}\n" for i in range(59))  # with its `def` line, 60 lines: allowed
    bad.write_text(f"def fits():\n{body}")
    assert long_functions(bad) == []
    method = body.replace("    x", "        x") + "        return x\n"  # 61 lines
    bad.write_text(f"def fits():\n{body}\n\nclass C:\n    def too_long(self):\n{method}")
    assert long_functions(bad) == ["bad.py:64 too_long (61 lines)"]
    bad.write_text("def run(cfg):\n    pass\ndef lower(cfg):\n    pass\nclass TrainConfig:\n    def own(self, cfg):\n"
                   "        pass\nclass Loop:\n    def steps(self):\n        return self.run.cfg\n")
    assert config_reaches(bad) == ["bad.py:3 lower", "bad.py:9 steps"]


def _docs_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_of_the_library_has_a_docstring_for_the_api_reference():
    assert _docs_hook().undocumented() == []  # `mkdocs build` (docs/hooks.py) fails otherwise


def test_the_docstring_check_finds_a_bare_function_and_a_bare_property(monkeypatch):
    import ddpkit

    def bare():
        return None

    class Thing:
        """Has a docstring; its property has none."""

        @property
        def value(self):
            return 1

    monkeypatch.setattr(ddpkit, "bare", bare, raising=False)
    monkeypatch.setattr(ddpkit, "Thing", Thing, raising=False)
    monkeypatch.setattr(ddpkit, "__all__", [*ddpkit.__all__, "bare", "Thing"])
    assert _docs_hook().undocumented() == ["ddpkit.bare", "ddpkit.Thing.value"]


def test_the_readmes_first_screen_says_what_ddpkit_is_in_at_most_180_words():
    # The front door: what ddpkit is and the two commands; the rest below it, and in docs/.
    first_screen = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    assert len(first_screen.split()) <= 180, len(first_screen.split())
    assert "# (a)" in first_screen and "# (b)" in first_screen and "--unchanged" in first_screen


# Python 3.10 is the floor pyproject.toml declares (requires-python), and only 3.11 runs on these machines: what can be
# checked here is the grammar. Every file of the package, the tests and the benchmarks parses as Python 3.10 would
# (``ast.parse``'s ``feature_version``: no ``except*``, no 3.11-only syntax). It proves nothing of the standard library
# calls a file makes (``tomllib`` is 3.11's: config.py imports tomli below 3.11, a dependency pyproject.toml declares).
PYTHON_FLOOR = (3, 10)


def sources_newer_than(version: tuple[int, int], paths) -> list[str]:
    found = []
    for path in paths:
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=version)
        except SyntaxError as error:
            found.append(f"{path.name}:{error.lineno} {error.msg}")
    return found


def test_every_source_parses_as_the_python_floor_declares():
    declared = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert declared is not None and tuple(map(int, declared.groups())) == PYTHON_FLOOR
    paths = [*PACKAGE_FILES, *(REPO / "tests").glob("*.py"), *(REPO / "benchmarks").rglob("*.py"),
             *(REPO / "examples").glob("*.py")]
    assert sources_newer_than(PYTHON_FLOOR, paths) == []


def test_the_python_floor_check_finds_newer_syntax(tmp_path):
    newer = tmp_path / "newer.py"
    newer.write_text("try:\n    pass\nexcept* ValueError:\n    pass\n")  # exception groups: Python 3.11
    assert sources_newer_than((3, 10), [newer]) != [] and sources_newer_than((3, 11), [newer]) == []


# -- only our own text: other people's scripts stay in the corpus beside the repository ----------------------------------

SHARED = REPO.parent / "shared"
SHARED_LINES = SHARED / "tools" / "shared_lines.py"


def shared_lines(tree: Path, *references: Path) -> subprocess.CompletedProcess:
    """``../shared/tools/shared_lines.py``: each file of ``tree`` that shares more than 14 lines over 30 characters
    with one of ``references``' files, or more than 20% of that file's lines, listed; exit status 1 if any."""
    return subprocess.run([sys.executable, str(SHARED_LINES), str(tree), *map(str, references)], capture_output=True,
                          text=True, timeout=120)


def needs_shared() -> None:
    import pytest

    if not (SHARED_LINES.is_file() and (SHARED / "corpus").is_dir() and (SHARED / "seeds").is_dir()):
        pytest.skip(f"no {SHARED_LINES} with the corpus and seeds beside it: the shared folder beside the repository")


def test_no_file_of_the_project_repeats_other_peoples_text():
    needs_shared()
    done = shared_lines(REPO, SHARED / "corpus", SHARED / "seeds")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_text_check_finds_a_planted_copy_and_a_planted_excerpt(tmp_path):
    needs_shared()
    original = SHARED / "corpus" / "pytorch-examples" / "imagenet" / "main.py"
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "borrowed.py").write_text(original.read_text())
    long_lines = [line for line in original.read_text().splitlines() if len(line.strip()) > 30]
    (tmp_path / "docs.md").write_text("# notes\n\n" + "\n".join(long_lines[100:115]) + "\n")  # 15 of its lines
    (tmp_path / "ours.py").write_text("\n".join(long_lines[100:114]) + "\n")  # 14: the most a file may share
    done = shared_lines(tmp_path, SHARED / "corpus", SHARED / "seeds")
    assert done.returncode == 1
    listed = sorted(line.split(":")[0] for line in done.stdout.splitlines())
    assert listed == [str(tmp_path / "docs.md"), str(tmp_path / "examples" / "borrowed.py")], done.stdout


def _benchmark(name: str = "suite_times"):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_suites_record_reads_junit_names_a_module_grown_by_over_20_s_and_draws_every_row(tmp_path):
    import xml.etree.ElementTree as ElementTree

    times = _benchmark()
    junit = tmp_path / "session.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="x" time="30.5"/>'
                     '<testcase classname="tests.test_a" name="y" time="1.5"><skipped/></testcase>'
                     '<testcase classname="tests.test_b" name="z" time="4"><failure/></testcase>'
                     '</testsuite></testsuites>')
    modules, counts = times.read_junit(junit)
    assert modules == {"tests/test_a.py": 32.0, "tests/test_b.py": 4.0}
    assert counts == {"passed": 1, "failed": 1, "skipped": 1}
    said = times.grown(modules, {"tests/test_a.py": 11.0, "tests/test_b.py": 4.0})
    assert said == ["suite time: tests/test_a.py grew by 21 s against the last recorded run (11 s to 32 s)"]
    assert times.grown(modules, {"tests/test_a.py": 12.0}) == []  # 20 s more is not more than 20
    assert (times.clock(405), times.seconds_of("6:45"), times.seconds_of("405")) == ("6:45", 405.0, 405.0)
    # The record of runs draws as an SVG: a line for each part that has values, the budgets across.
    rows = times.read_runs()
    assert len(rows) > 50 and all(row["date"] and row["commit"] is not None for row in rows)
    drawn = ElementTree.fromstring(times.draw(rows))
    lines = drawn.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) >= 4
    assert (REPO / "docs" / "suite-times.svg").read_text() == times.draw(rows)  # drawn from the rows as they are
    # A row recorded is one more line, ended as the others are (csv writes "\r\n" unless told).
    times.REPO, times.RUNS = tmp_path, tmp_path / "runs.csv"
    times.MODULES, times.PLOT = tmp_path / "modules.json", tmp_path / "times.svg"
    times.RUNS.write_bytes((REPO / "benchmarks" / "results" / "suite-runs.csv").read_bytes())
    assert times.record(None, "4:10", "abc1234", "a note, with a comma") == 0
    written = times.RUNS.read_bytes()
    assert b"\r" not in written and written.endswith(b',abc1234,250,,,,,,,,"a note, with a comma"\n')
    assert len(times.read_runs()) == len(rows) + 1


def test_the_suites_cpu_summary_sums_each_module_and_names_the_costliest_tests_first(tmp_path):
    rows = tmp_path / "cpu.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in (
        {"id": "tests/test_a.py::x", "cpu": 2.5, "wall": 3.0}, {"id": "tests/test_b.py::y", "cpu": 4.0, "wall": 2.0},
        {"id": "tests/test_a.py::z[1]", "cpu": 3.0, "wall": 1.0})))
    lines = _benchmark("suite_cpu").summary(rows, top=2).splitlines()
    assert lines[0] == "3 tests: 10 s of CPU, 6 s wall"
    assert [line.split() for line in lines[3:5]] == [["5.5", "4.0", "tests/test_a.py"],
                                                      ["4.0", "2.0", "tests/test_b.py"]]
    assert [line.split()[-1] for line in lines[7:]] == ["tests/test_b.py::y", "tests/test_a.py::z[1]"]


def test_no_file_the_repository_holds_is_larger_than_4_mb():
    # A script run by hand in the repository's folder once left two 93 MB checkpoints that a commit took in.
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode().strip()}")
    names = [name for name in listed.stdout.decode().split("\0") if (REPO / name).is_file()]
    sizes = {name: (REPO / name).stat().st_size for name in names}
    assert len(sizes) > 100 and not {name: size for name, size in sizes.items() if size > 4 * 2**20}
