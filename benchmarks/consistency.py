"""Cost of consistency mode (``fs.config.check_consistency``) on 2 local Gloo ranks.

    flock /tmp/fshard-bench.lock python benchmarks/consistency.py [--reps 7]

Consistency mode adds one fixed-size exchange (an ``all_reduce`` of four int64 words) before
each collective. Two tables, each configuration timed with the mode off and on in the same
processes, interleaved per rep (median over reps; a rep's time is the slowest rank's mean):

1. One collective: ``fs.lax.psum`` of 4 KiB and 1 MiB, off and on, beside a raw
   ``dist.all_reduce`` and DTensor's Partial -> Replicate ``redistribute`` of the same tensor.
2. One training step of the tensor-parallel MLP of ``benchmarks/train_step.py`` (1024 -> 4096 ->
   1024, batch 64, fwd + bwd + SGD): the local view (``pcast``/``psum`` in the body, 2
   collectives per step) and the global view through the op rules (``fs.nn.functional_call``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]  # this checkout's fshard; train_step's model
from _runner import timed  # noqa: E402
from train_step import BATCH, MLP, D  # noqa: E402  (the same model as the step benchmark)

import fshard as fs  # noqa: E402
from fshard.launch import World  # noqa: E402


def _collective_configs(mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate

    configs = {}
    dmesh = mesh.device_mesh
    for label, n in (("4 KiB", 1024), ("1 MiB", 1 << 18)):
        t = torch.ones(n)

        def raw(t=t):
            dist.all_reduce(t.clone())

        def dtensor(t=t):
            DTensor.from_local(t, dmesh, [Partial()], run_check=False).redistribute(
                dmesh, [Replicate()]
            ).to_local()

        def fshard(t=t):
            fs.lax.psum(t, "tp", mesh=mesh)

        configs[label] = {
            "raw dist.all_reduce": (raw, False),
            "DTensor redistribute": (dtensor, False),
        }
        configs[label]["fs.lax.psum, consistency off"] = (fshard, False)
        configs[label]["fs.lax.psum, consistency on"] = (fshard, True)
    return configs


def _step_configs(mesh, lr=1e-3):
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    plan = fs.nn.megatron_plan(column=["fc1"], row=["fc2"])
    tx = fs.optim.sgd(lr)

    def local_loss(ps, x, y):
        xv = fs.lax.pcast(x, "tp", mesh=mesh)
        h = F.gelu(F.linear(xv, ps["fc1.weight"].local, ps["fc1.bias"].local))
        out = fs.lax.psum(F.linear(h, ps["fc2.weight"].local), "tp", mesh=mesh)
        return F.mse_loss(out + ps["fc2.bias"].local, y)

    local_grad = torch.func.grad(local_loss)
    xs = fs.shard(x, mesh, fs.P())

    def global_loss(ps):
        return F.mse_loss(fs.gather(fs.nn.functional_call(model, ps, (xs,))), y)

    global_grad = torch.func.grad(global_loss)
    state = {}
    for view in ("local", "global"):
        params = fs.nn.shard_params(model, mesh, plan)
        state[view] = {"p": params, "s": tx.init(params)}

    def local_step():
        st = state["local"]
        g = local_grad(st["p"], x, y)
        st["p"], st["s"] = fs.optim.step(tx, g, st["s"], st["p"], donate=True)

    def global_step():
        st = state["global"]
        g = global_grad(st["p"])
        st["p"], st["s"] = fs.optim.step(tx, g, st["s"], st["p"], donate=True)

    return {
        "TP MLP step": {
            "fshard local view, consistency off": (local_step, False),
            "fshard local view, consistency on": (local_step, True),
            "fshard global view, consistency off": (global_step, False),
            "fshard global view, consistency on": (global_step, True),
        }
    }


def _collectives_per_step(fn, check: bool) -> int:
    with fs.config.consistency(check), fs.debug.comm_log() as log:
        fn()
    return len(log)


def bench(reps: int, coll_iters: int, step_iters: int) -> dict:
    """Run on every rank: {section: {config: [ms per rep]}} plus collectives per step."""
    mesh = fs.Mesh.create((2,), ("tp",))
    sections = {**_collective_configs(mesh), **_step_configs(mesh)}
    out: dict = {s: {name: [] for name in cfgs} for s, cfgs in sections.items()}
    counts = {
        name: _collectives_per_step(fn, False) for name, (fn, _) in sections["TP MLP step"].items()
    }
    for cfgs in sections.values():  # warm up every configuration (plans, buffers)
        for fn, check in cfgs.values():
            with fs.config.consistency(check):
                for _ in range(3):
                    fn()
    for _ in range(reps):
        for section, cfgs in sections.items():
            iters = step_iters if section == "TP MLP step" else coll_iters
            for name, (fn, check) in cfgs.items():
                with fs.config.consistency(check):
                    out[section][name].append(timed(fn, iters)[0] * 1e3)
    return {"times": out, "collectives": counts}


def _table(section: str, per_rank: list, base: str):
    from rich.table import Table

    table = Table(title=f"{section} (2 Gloo ranks; median of reps, slowest rank)")
    for col in ("configuration", "ms", "vs " + base, "consistency cost"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    names = list(per_rank[0]["times"][section])
    reps = len(per_rank[0]["times"][section][names[0]])
    worst = {
        n: [max(r["times"][section][n][i] for r in per_rank) for i in range(reps)] for n in names
    }
    med = {n: statistics.median(v) for n, v in worst.items()}
    for n in names:
        cost = ""
        if n.endswith("consistency on"):
            off = n.replace("consistency on", "consistency off")
            cost = f"+{med[n] - med[off]:.3f} ms ({med[n] / med[off] - 1:+.1%})"
        table.add_row(n, f"{med[n]:.3f}", f"{med[n] / med[base]:.2f}x", cost)
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--coll-iters", type=int, default=200)
    ap.add_argument("--step-iters", type=int, default=5)
    args = ap.parse_args(argv)
    from rich.console import Console

    with World(2, timeout=600) as world:
        per_rank = world.run(bench, args.reps, args.coll_iters, args.step_iters)
    console = Console()
    for section in per_rank[0]["times"]:
        base = (
            "fshard local view, consistency off"
            if section == "TP MLP step"
            else "raw dist.all_reduce"
        )
        console.print(_table(section, per_rank, base))
    counts = per_rank[0]["collectives"]
    console.print(
        "collectives per step (each gets one digest exchange when on): "
        + ", ".join(f"{n.split(',')[0]}: {c}" for n, c in counts.items() if "off" in n)
    )


if __name__ == "__main__":
    main()
