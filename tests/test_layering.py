"""The core's imports, read with ast (module level and inside functions alike): lingua/ never
imports an app, and no lingua module imports itself through others (no circle)."""

import ast
from pathlib import Path

from tests.conftest import REPO


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, known: set) -> set:
    """The project modules `path` imports (`from lingua import x` names module lingua.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known and name.split(".")[0] in ("lingua", "apps")}


def import_graph(*tops: str) -> dict:
    paths = [p for top in tops for p in (REPO / top).rglob("*.py")]
    known = {module_name(p) for p in paths}
    return {module_name(p): project_imports(p, known) - {module_name(p)} for p in paths}


def find_circle(graph: dict) -> list:
    """One circle of modules [a, b, ..., a] (empty if there is none)."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        state[module] = "done"
        stack.pop()
        return []

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return []


def test_the_core_imports_no_app():
    graph = import_graph("lingua", "apps")
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("lingua")
                    for t in targets if t.startswith("apps"))
    assert not upward, "lingua/ must not import apps/: " + ", ".join(upward)


def test_no_circle_among_lingua_modules():
    graph = {m: {t for t in ts if t.startswith("lingua")}
             for m, ts in import_graph("lingua").items()}
    circle = find_circle(graph)
    assert not circle, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) == []
