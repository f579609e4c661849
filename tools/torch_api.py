"""The torch names fshard uses, and the API surface of a torch install, for the compatibility check.

``python tools/torch_api.py record > tests/data/torch_api_oldest.txt``, run in a venv holding the
oldest supported torch (``tools/test_torch.sh 2.11.0`` makes one), writes ``module name`` lines:
every public and private name of each torch module that fshard refers to.
``tests/test_compat.py`` then checks that every ``torch.…`` name written anywhere in fshard, outside
``fshard/_compat.py`` (the one module allowed to choose between versions), is in that file, so a
call of a name newer than the oldest supported torch fails CI on the newest one.

``python tools/torch_api.py used`` lists the names fshard refers to.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fshard"
ALLOWED = {"_compat.py"}  # the one place that may name what only some versions have


def _is_torch_import_from(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.ImportFrom)
        and node.level == 0
        and bool(node.module)
        and (node.module == "torch" or node.module.startswith("torch."))
    )


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted torch path, from the module's imports (anywhere in the file)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif _is_torch_import_from(node):
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


FUNCOL = "torch.distributed._functional_collectives"


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Call) and _chain(node.func) in (["funcol"], ["_compat", "funcol"]):
        return [*("_FUNCOL_",), *parts[::-1]]  # fshard's lazy import of the functional collectives
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def used_names(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``{dotted torch path: {"file:line", ...}}`` for every torch name fshard's source refers
    to (attribute chains rooted at an imported torch name, and ``from torch... import`` names),
    outside :data:`ALLOWED`."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.name in ALLOWED:
            continue
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        where = path.relative_to(package.parent)
        for node in ast.walk(tree):
            dotted = None
            if isinstance(node, ast.Attribute):
                chain = _chain(node)
                if chain and chain[0] == "_FUNCOL_":
                    dotted = ".".join([FUNCOL, *chain[1:]])
                elif chain and chain[0] in aliases:
                    dotted = ".".join([aliases[chain[0]], *chain[1:]])
            elif _is_torch_import_from(node):
                for a in node.names:
                    found.setdefault(f"{node.module}.{a.name}", set()).add(f"{where}:{node.lineno}")
            if dotted:
                found.setdefault(dotted, set()).add(f"{where}:{node.lineno}")
    return found


def _modules(dotted_names) -> set[str]:
    """Every importable torch module that is a prefix of one of ``dotted_names``."""
    mods = set()
    for d in dotted_names:
        parts = d.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            if name in mods:
                continue
            try:
                importlib.import_module(name)
            except Exception:
                break
            mods.add(name)
    return mods


def record() -> list[str]:
    """``module name`` lines for every name of every torch module fshard refers to, in the
    running torch (a submodule this torch lacks is then missing from its parent's names)."""
    import torch

    lines = [f"# torch {torch.__version__}: python tools/torch_api.py record"]
    used = used_names()
    mods = _modules(used)
    for m in sorted(mods):
        mod = sys.modules[m]
        lines += [f"{m} {n}" for n in sorted(set(dir(mod)))]
    return lines


def load(path: Path) -> dict[str, set[str]]:
    """A recorded surface: ``{module: {names}}``."""
    surface: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        mod, name = line.split(" ", 1)
        surface.setdefault(mod, set()).add(name)
    return surface


def missing(used: dict[str, set[str]], surface: dict[str, set[str]]) -> dict[str, set[str]]:
    """The ``used`` names a recorded ``surface`` lacks: for each dotted name, the longest prefix
    that is a recorded module must hold the next part (deeper parts, attributes of classes and
    functions, are not checked)."""
    out = {}
    for dotted, where in used.items():
        parts = dotted.split(".")
        for k in range(len(parts) - 1, 0, -1):
            mod = ".".join(parts[:k])
            if mod in surface:
                if parts[k] not in surface[mod] and dotted not in surface:
                    out[dotted] = where
                break
    return out


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "used"
    if what == "record":
        print("\n".join(record()))
    elif what == "used":
        for d, where in sorted(used_names().items()):
            print(d, " ".join(sorted(where)))
    else:
        sys.exit(f"usage: {sys.argv[0]} [record|used]")
