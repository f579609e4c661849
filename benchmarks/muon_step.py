"""Muon vs AdamW: one optimizer step on tensor-parallel matrices, 2 local Gloo ranks.

    flock /tmp/fshard-bench.lock python benchmarks/muon_step.py [--dim 512] [--layers 4] [--reps 7]

Params: ``--layers`` Megatron MLP blocks (``dim -> 4 dim`` column-parallel, ``4 dim -> dim``
row-parallel) plus a replicated ``dim`` bias each, split over ``tp``. Side by side in the same rank
processes, interleaved per rep (median over reps of the slowest rank's mean): ``fs.optim.adamw``
(element-wise, no communication), ``fs.optim.muon`` (each sharded matrix all-gathered once in
bfloat16, the Newton-Schulz iteration on the whole matrix), and ``torch.optim.Muon`` on the same
matrices dense in each process (what one rank would do without sharding). The bytes column is
this rank's ``fs.debug.comm_log`` per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]  # this checkout's fshard
from _runner import timed  # noqa: E402

import fshard as fs  # noqa: E402
from fshard.launch import World  # noqa: E402


def _configs(dim: int, layers: int) -> dict:
    mesh = fs.Mesh.create((2,), ("tp",))
    g = torch.Generator().manual_seed(0)
    shapes, specs = {}, {}
    for i in range(layers):
        shapes[f"{i}.up"], specs[f"{i}.up"] = (4 * dim, dim), fs.P("tp", None)
        shapes[f"{i}.down"], specs[f"{i}.down"] = (dim, 4 * dim), fs.P(None, "tp")
        shapes[f"{i}.bias"], specs[f"{i}.bias"] = (dim,), fs.P()
    dense = {k: torch.randn(*s, generator=g) * 0.02 for k, s in shapes.items()}
    grads = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    out = {}
    for name, tx in (("fs.optim.adamw", fs.optim.adamw(1e-3)), ("fs.optim.muon", fs.optim.muon(1e-3))):  # fmt: skip
        st = {"p": {k: fs.shard(v, mesh, specs[k]) for k, v in dense.items()}}
        st["s"] = tx.init(st["p"])
        gs = {k: fs.shard(v, mesh, specs[k]) for k, v in grads.items()}

        def step(tx=tx, st=st, gs=gs):
            st["p"], st["s"] = fs.optim.step(tx, gs, st["s"], st["p"], donate=True)

        out[name] = step
    tp = {k: v.clone().requires_grad_() for k, v in dense.items()}
    for k, v in tp.items():
        v.grad = grads[k].clone()
    muon = torch.optim.Muon([v for v in tp.values() if v.ndim == 2], lr=1e-3)
    adamw = torch.optim.AdamW([v for v in tp.values() if v.ndim != 2], lr=1e-3)

    def torch_step():
        muon.step()
        adamw.step()

    out["torch.optim.Muon, dense"] = torch_step
    return out


def bench(dim: int, layers: int, reps: int) -> dict:
    steps = _configs(dim, layers)
    nbytes = {}
    for name, fn in steps.items():
        fn()  # warm up
        with fs.debug.comm_log() as log:
            fn()
        nbytes[name] = sum(r.nbytes for r in log)
    times: dict = {n: [] for n in steps}
    for rep in range(reps):
        names = list(steps)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            times[name].append(timed(steps[name], 3)[0] * 1e3)
    return {"times": times, "bytes": nbytes}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    with World(2, timeout=1800) as world:
        res = world.run(bench, a.dim, a.layers, a.reps)[0]
    t = Table(title=f"optimizer step, {a.layers} TP MLP blocks of dim {a.dim}, 2 Gloo ranks (median of {a.reps})")  # fmt: skip
    for c in ("optimizer", "ms / step", "vs fs.optim.adamw", "bytes sent / rank / step"):
        t.add_column(c, justify="left" if c == "optimizer" else "right")
    base = statistics.median(res["times"]["fs.optim.adamw"])
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        t.add_row(name, f"{med:.2f}", f"{med / base:.2f}x", f"{res['bytes'][name]:,}")
    Console(width=120).print(t)


if __name__ == "__main__":
    main()
