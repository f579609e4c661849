"""The module-level imports among fshard's modules follow the layer table of docs/DESIGN.md §9:
each module imports only modules of its own layer or below, and they form no cycle (so none
needs a function-level import to break a loop)."""

import ast
import fnmatch
import pathlib
import re

import fshard

ROOT = pathlib.Path(fshard.__file__).parent
DESIGN = ROOT.parent / "docs" / "DESIGN.md"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = ("fshard", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for every ``fshard`` module: relative
    ``from . import x`` / ``from .x import y`` statements anywhere in the module, function
    bodies included (``y`` counts when it is a submodule), and absolute ``fshard`` imports."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in paths and a.name != name)
                continue
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.split(".")[0] == "fshard" and node.module in paths:
                    edges.add(node.module)
                continue
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


def layer_table(text: str) -> list[tuple[int, list[str], set[str]]]:
    """``[(layer, module patterns, planned patterns)]`` from the table of DESIGN §9: each row
    ``| n | `mod`, `pkg.*`, `new` (*planned*) | what |``; names are relative to ``fshard``."""
    section = text.split("\n## 9.", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        names = re.findall(r"`([\w.*]+)`( \(\*planned\*\))?", cells[1])
        full = ["fshard" if n == "fshard" else f"fshard.{n}" for n, _ in names]
        planned = {f for f, (_, mark) in zip(full, names) if mark}
        rows.append((int(cells[0]), full, planned))
    return rows


def layer_violations(graph: dict[str, set[str]], table) -> list[str]:
    """What breaks the layer rule: a module in no layer (or in two), a listed module that does
    not exist (unless planned), and every import of a module from a higher layer."""
    layer_of: dict[str, int] = {}
    problems = []
    for module in sorted(graph):
        hits = [
            n for n, patterns, _ in table if any(fnmatch.fnmatchcase(module, p) for p in patterns)
        ]
        if len(hits) != 1:
            problems.append(f"{module} is in {len(hits)} layers of DESIGN §9 (must be in one)")
        else:
            layer_of[module] = hits[0]
    for _, patterns, planned in table:
        for p in patterns:
            if p not in planned and not any(fnmatch.fnmatchcase(m, p) for m in graph):
                problems.append(f"DESIGN §9 lists {p}, which does not exist")
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            if module in layer_of and target in layer_of and layer_of[target] > layer_of[module]:
                problems.append(
                    f"{module} (layer {layer_of[module]}) imports {target} "
                    f"(layer {layer_of[target]}, above it)"
                )
    return problems


def test_layer_check_reports_each_kind_of_violation():
    table = [
        (1, ["fshard.a", "fshard.gone", "fshard.new"], {"fshard.new"}),
        (2, ["fshard.b"], set()),
    ]
    graph = {"fshard.a": {"fshard.b"}, "fshard.b": {"fshard.a"}, "fshard.c": set()}
    assert layer_violations(graph, table) == [
        "fshard.c is in 0 layers of DESIGN §9 (must be in one)",
        "DESIGN §9 lists fshard.gone, which does not exist",
        "fshard.a (layer 1) imports fshard.b (layer 2, above it)",
    ]


def test_imports_follow_the_layers_of_design():
    """Every module of fshard sits in one layer of DESIGN §9's table and imports nothing above
    its layer."""
    table = layer_table(DESIGN.read_text(encoding="utf-8"))
    assert len(table) > 10 and table[0][0] == 1, table  # the table was found and parsed
    assert [n for n, _, _ in table] == list(range(1, len(table) + 1)), "layers are numbered 1..n"
    graph = import_graph()
    assert not layer_violations(graph, table), "\n".join(layer_violations(graph, table))


#: Third-party (and standard) modules fshard may import inside a function: optional
#: dependencies, and torch submodules that cost seconds to import or need a process group.
LAZY_ALLOWED = {"torch", "transformers", "safetensors", "rich", "matplotlib", "numpy", "io", "os"}


def lazy_imports(root: pathlib.Path = ROOT) -> list[str]:
    """``path:line module`` of every import inside a function body of fshard."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for f in ast.walk(ast.parse(path.read_text())):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if isinstance(node, ast.Import):
                    out += [f"{path.relative_to(root)}:{node.lineno} {a.name}" for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mod = "." * node.level + (node.module or "")
                    out.append(f"{path.relative_to(root)}:{node.lineno} {mod}")
    return out


def test_function_level_imports_are_third_party_and_allowed():
    """No fshard module is imported inside a function (that is how import circles hid, issue
    36); the third-party ones imported lazily are the allowed optional or heavy ones."""
    found = lazy_imports()
    assert found, "the walk found no import at all inside functions"  # the check can see them
    own = [f for f in found if f.split()[1].startswith((".", "fshard"))]
    assert not own, "fshard modules imported inside functions:\n" + "\n".join(own)
    other = [f for f in found if f.split()[1].split(".")[0] not in LAZY_ALLOWED]
    assert not other, "lazy imports outside LAZY_ALLOWED:\n" + "\n".join(other)


def test_the_graph_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "fshard"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph["fshard.a"] == {"fshard.b"} and find_cycle(graph) == [
        "fshard.a",
        "fshard.b",
        "fshard.a",
    ]
