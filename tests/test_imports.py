"""The module-level imports among fshard's modules form no cycle (each module imports only
modules below it, so none needs a function-level import to break a loop)."""

import ast
import pathlib

import fshard

ROOT = pathlib.Path(fshard.__file__).parent


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = ("fshard", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports at module level}`` for every ``fshard`` module: relative
    ``from . import x`` / ``from .x import y`` statements of the module body (``y`` counts when
    it is a submodule)."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module and target in paths:
                edges.add(target)
            edges.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in paths)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_reports_the_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_level_import_cycle():
    graph = import_graph()
    assert "fshard.executor" in graph["fshard.ops.registry"]  # the graph sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_ops_never_import_the_public_api():
    """Op rules reshard through fshard.executor, never through fshard.api (which is above them)."""
    graph = import_graph()
    ops = [m for m in graph if m.startswith("fshard.ops")]
    assert len(ops) > 3
    for m in ops:
        assert "fshard.api" not in graph[m], m
