"""Run the transformers zoo (issue 37): every architecture of the installed transformers whose
config builds offline at a tiny size (``tests/hf_zoo.py``), in dp, tp (the shipped plan, else a
Megatron plan) and fsdp against dense on 2 local Gloo ranks; print the table (architecture x
mode: equal / refused with the message / wrong) and write the counts into docs/models.md.

Usage::

    PYTHONPATH=$PWD python tools/zoo.py                 # the whole zoo
    PYTHONPATH=$PWD python tools/zoo.py --every 5       # a stratified fifth (every 5th per task)
    PYTHONPATH=$PWD python tools/zoo.py llama bert vit  # named architectures
    ... --json out.json --write-docs
    PYTHONPATH=$PWD python tools/zoo.py --from-json out.json --write-docs  # a saved run's table
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fshard.launch import World  # noqa: E402
from tests import hf_zoo  # noqa: E402

MODES = ("dp", "tp", "fsdp")
DOCS = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- zoo:begin -->", "<!-- zoo:end -->"


def select(names: list[str], every: int, offset: int = 0) -> list[str]:
    """``names`` (all when empty), every ``every``-th architecture of each task from the
    ``offset``-th on."""
    archs = hf_zoo.architectures()
    if names:
        unknown = [n for n in names if n not in archs]
        if unknown:
            raise SystemExit(f"unknown architectures {unknown}")
        return names
    by_task = collections.defaultdict(list)
    for arch, (task, _) in archs.items():
        by_task[task].append(arch)
    return sorted(a for task in by_task.values() for a in task[offset::every])


def run(archs: list[str], timeout: float, log: str | None = None) -> dict:
    results = {}
    world = World(2, timeout=timeout)
    try:
        for i, arch in enumerate(archs):
            t = time.time()
            try:
                ranks = world.run(hf_zoo.zoo_rank_fn, arch)
                merged = {}
                for mode in MODES:  # the worse outcome of the two ranks
                    got = [r[mode] for r in ranks]
                    merged[mode] = next((g for g in got if g[0] == "wrong"), got[0])
            except Exception as e:  # a hang or a crashed rank: the world restarts
                why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                merged = dict.fromkeys(MODES, ("refused", f"rank failure: {why}"))
            results[arch] = merged
            cells = " ".join(f"{m}={merged[m][0]}" for m in MODES)
            print(f"[{i + 1}/{len(archs)}] {arch} ({time.time() - t:.0f}s): {cells}", flush=True)
            if log:  # what ran so far survives an interrupted run
                Path(log).write_text(json.dumps(results, indent=1))
    finally:
        world.close()
    return results


def counts(results: dict) -> dict:
    built = {a: r for a, r in results.items() if r["dp"][0] != "not buildable"}
    functorch = [a for a, r in results.items() if r["dp"][1].startswith("torch.func refuses")]
    out = {"architectures": len(results), "buildable": len(built), "functorch": len(functorch)}
    for mode in MODES:
        out[mode] = dict(collections.Counter(r[mode][0] for r in built.values()))
    return out


def table(results: dict) -> str:
    archs = hf_zoo.architectures()
    lines = ["| architecture | task | dp | tp | fsdp |", "|---|---|---|---|---|"]
    for arch, r in sorted(results.items()):
        cell = _cell
        if r["dp"][0] == "not buildable":  # one reason for the three modes
            cells = f"{cell(r['dp'])} | | "
        else:
            cells = " | ".join(cell(r[m]).replace("|", "\\|") for m in MODES)
        lines.append(f"| {arch} | {archs[arch][0]} | {cells} |")
    return "\n".join(lines)


def _cell(outcome) -> str:
    kind, detail = outcome
    if kind == "equal":  # equal in float64 only: the float32 difference was rounding
        return "equal in float64" if detail.startswith("in float64") else "equal"
    return f"{kind}: {_short(detail)}"


def _short(text: str) -> str:
    """An outcome's message without machine paths, cut to one line of the table, its
    brackets escaped (``size[4, 8] [torch/nn/functional.py]`` reads as a Markdown link)."""
    text = re.sub(r"/\S*/(site-packages/|tests/)", "", text)
    text = text if len(text) <= 200 else text[:197] + "..."
    return text.replace("[", "\\[").replace("]", "\\]")


def summary(results: dict, command: str) -> str:
    c = counts(results)
    lines = [
        f"`{command}` ({c['architectures']} architectures, {c['buildable']} build at a tiny "
        "size and run their dense step under torch.func; of those not counted, "
        f"{c['functorch']} build but torch.func refuses their dense step):",
        "",
        "| mode | equal | refused | wrong |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        m = c[mode]
        lines.append(
            f"| {mode} | {m.get('equal', 0)} | {m.get('refused', 0)} | {m.get('wrong', 0)} |"
        )
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        doc += f"\n{block}\n"
    DOCS.write_text(doc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", help="architectures (default: the whole zoo)")
    parser.add_argument("--every", type=int, default=1, help="every n-th architecture per task")
    parser.add_argument("--offset", type=int, default=0, help="with --every: the first one")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per architecture")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--write-docs", action="store_true", help="update docs/models.md")
    parser.add_argument("--from-json", help="no run: the table of the results saved here")
    args = parser.parse_args(argv)
    command = "python tools/zoo.py" + (f" --every {args.every}" if args.every > 1 else "")
    command += f" --offset {args.offset}" if args.offset else ""
    t = time.time()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run(select(args.archs, args.every, args.offset), args.timeout, args.json)
    print(table(results))
    print(summary(results, command))
    print(f"{time.time() - t:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_docs:
        write_docs(summary(results, command) + "\n\n" + table(results))
    return 1 if any(r[m][0] == "wrong" for r in results.values() for m in MODES) else 0


if __name__ == "__main__":
    raise SystemExit(main())
