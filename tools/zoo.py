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
    PYTHONPATH=$PWD python tools/zoo.py --parallelize [archs]  # the causal LMs through
        # fs.parallel.parallelize on 4 ranks (hf_zoo.PARALLELIZE_CONFIGS) against dense
    PYTHONPATH=$PWD python tools/zoo.py --dropout 0.2 [archs]  # train mode with dropout and
        # router jitter: one step in dp and tp against dense from one seed (2 ranks)
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
PBEGIN, PEND = "<!-- zoo-parallelize:begin -->", "<!-- zoo-parallelize:end -->"


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


def run_parallelize(
    archs: list[str], timeout: float, log: str | None = None, only: tuple = ()
) -> dict:
    """``{arch: {config: (outcome, detail)}}``: each causal LM of ``archs`` through
    ``fs.parallel.parallelize`` for each configuration (the MoE ones with ep too), one
    world.run each (a hang or a crashed rank: ``error``, the world restarts)."""
    results: dict = {}
    world = World(4, timeout=timeout)
    try:
        for i, arch in enumerate(archs):
            t = time.time()
            try:
                kind = world.run(hf_zoo.parallelize_rank_fn, arch, None)[0]
            except Exception as e:
                kind = ("error", f"rank failure: {_first(e)}")
            if kind[0] not in ("moe", "dense"):
                results[arch] = {"build": kind}
            else:
                configs = hf_zoo.PARALLELIZE_CONFIGS
                if kind[0] == "moe":
                    configs += hf_zoo.PARALLELIZE_MOE_CONFIGS
                results[arch] = {}
                for degrees in configs:
                    name = hf_zoo.config_name(degrees)
                    if only and name not in only:
                        continue
                    try:
                        got = world.run(hf_zoo.parallelize_rank_fn, arch, degrees)
                        order = ("wrong", "error", "refused", "not buildable", "equal")
                        out = min(got, key=lambda g: order.index(g[0]))  # the worst rank's
                    except Exception as e:
                        out = ("error", f"rank failure (a hang: timeout): {_first(e)}")
                    results[arch][name] = out
            cells = " ".join(f"{c}={o[0]}" for c, o in results[arch].items())
            print(f"[{i + 1}/{len(archs)}] {arch} ({time.time() - t:.0f}s): {cells}", flush=True)
            if log:
                Path(log).write_text(json.dumps(results, indent=1))
    finally:
        world.close()
    return results


def _first(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def parallelize_table(results: dict) -> str:
    configs = [hf_zoo.config_name(d) for d in hf_zoo.PARALLELIZE_CONFIGS]
    configs += [hf_zoo.config_name(d) for d in hf_zoo.PARALLELIZE_MOE_CONFIGS]
    lines = [
        "| architecture | " + " | ".join(configs) + " |",
        "|---|" + "---|" * len(configs),
    ]
    for arch, r in sorted(results.items()):
        if "build" in r:
            cells = f"{_pcell(r['build'])} |" + " |" * (len(configs) - 1)
        else:
            cells = " | ".join(_pcell(r[c]) if c in r else "" for c in configs) + " |"
        lines.append(f"| {arch} | {cells}")
    return "\n".join(lines)


def _pcell(outcome) -> str:
    kind, detail = outcome
    if kind == "equal":
        return "equal in float64" if detail.startswith("in float64") else "equal"
    return f"{kind}: {_short(detail)}".replace("|", "\\|")


def parallelize_summary(results: dict, command: str) -> str:
    built = {a: r for a, r in results.items() if "build" not in r}
    tally = collections.Counter(o[0] for r in built.values() for o in r.values())
    return (
        f"`{command}` ({len(results)} causal LMs, {len(built)} build at a tiny size and run "
        f"their dense step under torch.func; {sum(len(r) for r in built.values())} runs): "
        + ", ".join(f"{tally.get(k, 0)} {k}" for k in ("equal", "refused", "error", "wrong"))
    )


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


def write_docs(text: str, begin: str = BEGIN, end: str = END) -> None:
    doc = DOCS.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
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
    parser.add_argument(
        "--parallelize", action="store_true", help="the causal LMs through fs.parallel.parallelize"
    )
    parser.add_argument(
        "--configs", help='with --parallelize: these configurations only ("tp2 pp2,ep2 tp2")'
    )
    parser.add_argument(
        "--dropout", type=float, help="train mode with dropout and router jitter at this p"
    )
    args = parser.parse_args(argv)
    if args.parallelize:
        return main_parallelize(args)
    if args.dropout:
        return main_dropout(args)
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


def main_parallelize(args) -> int:
    t = time.time()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        causal = [a for a, (task, _) in hf_zoo.architectures().items() if task == "causal"]
        archs = args.archs or causal[args.offset :: args.every]
        only = tuple(c.strip() for c in args.configs.split(",")) if args.configs else ()
        results = run_parallelize(archs, args.timeout, args.json, only)
    command = "python tools/zoo.py --parallelize"
    text = parallelize_summary(results, command) + "\n\n" + parallelize_table(results)
    print(text)
    print(f"{time.time() - t:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_docs:
        write_docs(f"{time.strftime('%Y-%m-%d', time.gmtime())}: {text}", PBEGIN, PEND)
    wrong = any(o[0] == "wrong" for r in results.values() for o in r.values())
    return 1 if wrong else 0


def main_dropout(args) -> int:
    """Every selected architecture through :func:`hf_zoo.dropout_rank_fn` (2 ranks): the
    counts per mode and the rows that are not equal."""
    t = time.time()
    modes = ("dp", "tp")
    results: dict = {}
    world = World(2, timeout=args.timeout)
    try:
        for arch in select(args.archs, args.every, args.offset):
            try:
                ranks = world.run(hf_zoo.dropout_rank_fn, arch, modes, args.dropout)
                got = {
                    m: next((r[m] for r in ranks if r[m][0] == "wrong"), ranks[0][m]) for m in modes
                }
            except Exception as e:
                got = dict.fromkeys(modes, ("refused", f"rank failure: {_first(e)}"))
            results[arch] = got
            if any(o[0] != "equal" for o in got.values()):
                print(arch, got, flush=True)
    finally:
        world.close()
    for m in modes:
        counts = collections.Counter(r[m][0] for r in results.values())
        print(f"{m}: {dict(counts)}")
    print(f"{len(results)} architectures, dropout {args.dropout}, {time.time() - t:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(o[0] == "wrong" for r in results.values() for o in r.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
