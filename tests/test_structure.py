"""The code's shape, checked: no module uses another module's underscore names, and no import cycle.

Pure reading of the source with ``ast``: nothing is imported or run.
"""

import ast
from pathlib import Path

from conftest import REPO

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
    """Module -> the ddpkit modules it imports (``from ddpkit.strategies import split`` is the module split).
    The top package, which re-exports the library, is left out: every module is below it."""
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for module, imported, _ in imports(path):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in MODULES else module
            if target not in (name, "ddpkit"):
                targets.add(target)
        graph[name] = targets
    return graph


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


def test_no_module_uses_another_modules_underscore_names():
    problems = [problem for path in PACKAGE_FILES + USER_FILES for problem in private_uses(path)]
    assert problems == []


def test_there_is_no_import_cycle():
    assert find_cycle(edges()) is None


def test_the_checks_find_what_they_look_for(tmp_path):
    # A checker that cannot fail proves nothing: each is shown a case it must catch.
    bad = tmp_path / "bad.py"
    bad.write_text("from ddpkit.trainer import _hidden\nfrom ddpkit import trainer\ntrainer._Loop\n")
    assert len(private_uses(bad)) == 2
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
