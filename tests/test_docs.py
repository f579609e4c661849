"""The repository's documents stand on their own: no references to files outside it."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Built by concatenation so that this file does not match itself.
OUTSIDE = ("../" + "shared", "/" + "work/")


def _tracked(suffixes: tuple[str, ...]) -> list[str]:
    """Tracked files (``git ls-files``), or every file outside hidden directories without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".")]
            out += [os.path.relpath(os.path.join(d, f), ROOT) for f in files]
    return sorted(f for f in out if f.endswith(suffixes))


def test_no_references_outside_the_repository():
    files = _tracked((".md", ".py"))
    assert "README.md" in files and "tests/test_docs.py" in files, files[:5]
    bad = []
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if any(p in line for p in OUTSIDE):
                    bad.append(f"{name}:{i}: {line.strip()}")
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)


def _optimizer_table() -> list[tuple[str, str]]:
    """``(fs.optim column, optax column)`` of each row of docs/optimizers.md's table."""
    with open(os.path.join(ROOT, "docs", "optimizers.md"), encoding="utf-8") as f:
        lines = f.read().split("| fs.optim | optax |", 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], cells[1]))
    return rows


def test_optimizer_table_lists_every_public_name():
    """Each name of ``fshard.optim.__all__`` has a row of docs/optimizers.md's table with its
    optax name, and the table names nothing that is not public."""
    import fshard.optim

    rows = _optimizer_table()
    listed = {}
    for ours, theirs in rows:
        assert theirs, f"no optax name for {ours}"
        for name in re.findall(r"`([A-Za-z_]\w*)", ours):
            listed[name] = theirs
    public = set(fshard.optim.__all__)
    assert not public - set(listed), (
        f"missing from docs/optimizers.md's table: {sorted(public - set(listed))}"
    )
    assert not set(listed) - public, f"not in fshard.optim.__all__: {sorted(set(listed) - public)}"


def test_doctests_of_the_pure_modules_run_unskipped():
    """pyproject's testpaths run the doctests of spec.py, planner.py and fshard/optim in every
    ``pytest``; none of their examples is skipped."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        opts = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    pure = ["fshard/spec.py", "fshard/planner.py", "fshard/optim"]
    assert set(pure) <= set(opts["testpaths"]) and "--doctest-modules" in opts["addopts"], opts
    files = [p for p in _tracked((".py",)) if p.startswith(pure[2] + "/") or p in pure[:2]]
    assert len(files) > 5, files
    skipped = []
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            skipped += [f"{name}:{i}" for i, line in enumerate(f, 1) if "+SKIP" in line]
    assert not skipped, f"skipped doctests: {skipped}"


#: A reference to a file of the repository (``fshard/planner.py``), optionally to a name in it
#: (``tests/test_lax.py::test_level_functions``).
FILE_REF = re.compile(
    r"(?<![\w/.])((?:fshard|tests|docs|examples|benchmarks|tools|\.ci)/[\w/.-]*"
    r"\.(?:py|md|sh|txt|npz|toml|json))(?:::(\w+))?"
)


def _prose(name: str, root: str = ROOT) -> list[str]:
    """The prose of a file (``name`` relative to ``root``): a Markdown file whole; of a Python
    file its docstrings (module, class, function) and comments."""
    import ast
    import io
    import tokenize

    with open(os.path.join(root, name), encoding="utf-8") as f:
        src = f.read()
    if not name.endswith(".py"):
        return [src]
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            out += [doc] if doc else []
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    return out + [t.string for t in tokens if t.type == tokenize.COMMENT]


def test_design_references_resolve():
    """Every ``DESIGN §N`` cited in the docstrings, comments and documents of the repository
    names a section of docs/DESIGN.md (the contract, kept in the repository; the citations
    pointed outside it)."""
    with open(os.path.join(ROOT, "docs", "DESIGN.md"), encoding="utf-8") as f:
        sections = set(re.findall(r"^## (\d+)\.", f.read(), re.M))
    assert {"1", "2", "3", "4", "5", "8", "9"} <= sections, sections
    cited = {}
    for name in _tracked((".py", ".md")):
        for text in _prose(name):
            for n in re.findall(r"DESIGN §(\d+)", text):
                cited.setdefault(n, set()).add(name)
    assert len(cited) >= 3 and any(f.startswith("fshard/") for v in cited.values() for f in v)
    missing = {n: sorted(files) for n, files in cited.items() if n not in sections}
    assert not missing, missing


def test_file_references_resolve():
    """Every repository path named in a docstring, comment or document exists, and a
    ``path::name`` reference names a function, class or assignment of that file."""
    found, bad = 0, []
    for name in _tracked((".py", ".md")):
        for text in _prose(name):
            for m in FILE_REF.finditer(text):
                found += 1
                path, symbol = m.groups()
                full = os.path.join(ROOT, path)
                if not os.path.isfile(full):
                    bad.append(f"{name}: {path} does not exist")
                    continue
                if symbol:
                    with open(full, encoding="utf-8") as f:
                        body = f.read()
                    if not re.search(
                        rf"^\s*(?:def|class)\s+{symbol}\b|^\s*{symbol}\s*[:=]", body, re.M
                    ):
                        bad.append(f"{name}: {path} has no {symbol}")
    assert found > 100, found  # the scan sees the references
    assert not bad, "\n".join(bad)


def test_file_reference_scan_sees_docstrings_and_comments_only(tmp_path):
    src = '"""See fshard/spec.py and tests/nope.py::gone."""\n# fshard/x.py\nS = "fshard/y.py"\n'
    (tmp_path / "m.py").write_text(src)
    refs = [m.group(0) for text in _prose("m.py", str(tmp_path)) for m in FILE_REF.finditer(text)]
    assert refs == ["fshard/spec.py", "tests/nope.py::gone", "fshard/x.py"], refs
