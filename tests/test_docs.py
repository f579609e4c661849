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
    """``(fs.optim column, optax column)`` of each row of the README's optimizer table."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().split("| fs.optim | optax |", 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], cells[1]))
    return rows


def test_readme_optimizer_table_lists_every_public_name():
    """Each name of ``fshard.optim.__all__`` has a row of the README's table with its optax
    name, and the table names nothing that is not public."""
    import fshard.optim

    rows = _optimizer_table()
    listed = {}
    for ours, theirs in rows:
        assert theirs, f"no optax name for {ours}"
        for name in re.findall(r"`([A-Za-z_]\w*)", ours):
            listed[name] = theirs
    public = set(fshard.optim.__all__)
    assert not public - set(listed), (
        f"missing from the README table: {sorted(public - set(listed))}"
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


def test_design_references_resolve():
    """Every ``DESIGN §N`` cited in fshard/ names a section of docs/DESIGN.md (the contract,
    kept in the repository; the citations pointed outside it)."""
    import re
    from pathlib import Path

    root = Path(ROOT)
    sections = set(re.findall(r"^## (\d+)\.", (root / "docs" / "DESIGN.md").read_text(), re.M))
    assert {"1", "2", "3", "4", "5"} <= sections, sections
    cited = {}
    for path in (root / "fshard").rglob("*.py"):
        for n in re.findall(r"DESIGN §(\d+)", path.read_text()):
            cited.setdefault(n, []).append(str(path.relative_to(root)))
    assert cited, "no DESIGN references found: the scan is broken"
    missing = {n: files for n, files in cited.items() if n not in sections}
    assert not missing, missing
