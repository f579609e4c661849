"""Every ```python block of README.md and docs/*.md runs as written (issue 29 item 1), so a
block that drifts from the code fails here.

How a block runs is read from the block and from an HTML comment on the line before its fence
(invisible on GitHub and in the site, visible in the source):

- a *script* (it has ``if __name__ == "__main__":``) runs as ``python block.py``, where its
  ``fs.launch.run`` starts the local ranks; ``<!-- torchrun -->`` before it runs it under
  ``torchrun --standalone --nproc-per-node 2`` too;
- ``<!-- norun: reason -->`` skips a block, with the reason shown in pytest's summary; only code
  no torch build can run belongs there (``test_norun_blocks_are_few_and_justified``);
- every other block is a *snippet*: a document's snippets run in order in one namespace, as
  cells of a notebook, on 2 Gloo ranks (the suite's ``world2``), in a fresh working directory.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"<!--\s*(norun|torchrun)\s*(?::\s*(.*?))?\s*-->\s*$")
#: At most this many blocks may be marked ``norun``: each needs what no torch build has.
MAX_NORUN = 8


def blocks(doc: str) -> list[dict]:
    """The ```python blocks of ``doc``: ``{"doc", "line", "src", "kind", "reason", "torchrun"}``,
    ``line`` the 1-based line of the block's first code line."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        src = m.group(1)
        if mark and mark.group(1) == "norun":
            kind = "norun"
        elif re.search(r'^if __name__ == "__main__":', src, re.M):
            kind = "script"
        else:
            kind = "snippet"
        out.append(
            {
                "doc": doc,
                "line": text.count("\n", 0, m.start(1)) + 1,
                "src": src,
                "kind": kind,
                "reason": (mark.group(2) or "") if mark else "",
                "torchrun": bool(mark and mark.group(1) == "torchrun"),
            }
        )
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def _id(b: dict) -> str:
    return f"{b['doc']}:{b['line']}"


def snippets_rank_fn(doc: str, snippets: list[tuple[int, str]], workdir: str) -> int:
    """Runs ``doc``'s snippets in order in one namespace; tracebacks name the document's lines."""
    ns: dict = {"__name__": "__doc__"}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for line, src in snippets:
            exec(compile("\n" * (line - 1) + src, doc, "exec"), ns)
    finally:
        os.chdir(cwd)
    return len(snippets)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "doc", [d for d in DOCS if any(b["doc"] == d and b["kind"] == "snippet" for b in ALL)]
)
def test_snippets_run_in_order_on_two_ranks(world2, doc, tmp_path):
    snippets = [(b["line"], b["src"]) for b in ALL if b["doc"] == doc and b["kind"] == "snippet"]
    assert world2.run(snippets_rank_fn, doc, snippets, str(tmp_path)) == [len(snippets)] * 2


def _script_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(PYTHONPATH=path, FSHARD_BACKEND="gloo", GLOO_SOCKET_IFNAME="lo")
    return env


def _torchrun() -> list[str]:
    """The ``torchrun`` command: the entry point where it is installed, else its module."""
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def _table_line(line: str) -> bool:
    """A line of a rich table (``fs.debug.visualize``): it starts with a space or a box-drawing
    character, and its rows repeat legitimately."""
    return line[0].isspace() or "\u2500" <= line[0] <= "\u257f"


SCRIPTS = [b for b in ALL if b["kind"] == "script"]
LAUNCHES = [(b, "python") for b in SCRIPTS] + [(b, "torchrun") for b in SCRIPTS if b["torchrun"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block,how", LAUNCHES, ids=[f"{_id(b)}-{how}" for b, how in LAUNCHES])
def test_scripts_run(block, how, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block["src"])
    head = (
        [sys.executable]
        if how == "python"
        else [*_torchrun(), "--standalone", "--nproc-per-node", "2"]
    )
    proc = subprocess.run(
        [*head, str(script)],
        cwd=tmp_path,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{_id(block)} under {how} exited {proc.returncode}:\n{out[-4000:]}"
    )
    assert "Traceback" not in out, out[-4000:]
    # Each result is printed once, by rank 0 (the tour printed everything twice): a line of
    # text (not a table's border or cell) appears at most once.
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip() and not _table_line(ln)]
    repeated = sorted({ln for ln in lines if lines.count(ln) > 1})
    assert not repeated, f"{_id(block)} under {how} printed these on several ranks: {repeated}"


NORUN = [b for b in ALL if b["kind"] == "norun"]


@pytest.mark.parametrize("block", NORUN, ids=[_id(b) for b in NORUN])
def test_norun_block(block):
    """Listed in pytest's summary (``-ra``) with its reason."""
    pytest.skip(f"norun: {block['reason']}")


def test_norun_blocks_are_few_and_justified():
    """Each ``norun`` block says why in a sentence, and they stay few."""
    assert len(ALL) > 20 and SCRIPTS and any(b["torchrun"] for b in SCRIPTS), len(ALL)
    vague = [_id(b) for b in NORUN if len(b["reason"].split()) < 4]
    assert not vague, f"norun blocks need a reason of a few words: {vague}"
    assert len(NORUN) <= MAX_NORUN, [_id(b) for b in NORUN]


def test_block_parsing(tmp_path, monkeypatch):
    """The parser sees the three kinds and the lines where blocks start."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "a\n```python\nx = 1\n```\n<!-- norun: needs a cluster of eight -->\n```python\nboom\n```\n"
        '<!-- torchrun -->\n```python\nif __name__ == "__main__":\n    pass\n```\n```bash\nls\n```\n'
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    got = [(b["line"], b["kind"], b["reason"], b["torchrun"]) for b in blocks("x.md")]
    assert got == [
        (3, "snippet", "", False),
        (7, "norun", "needs a cluster of eight", False),
        (11, "script", "", True),
    ], got
