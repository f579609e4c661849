"""Compiled training steps on 2 local Gloo ranks (1 thread each), printed as a rich table.

    python benchmarks/compile_step.py [--reps 11] [--steps 10] [--backend inductor]

Tensor-parallel MLP 1024 -> 4096 -> 1024, batch 64, fwd + bwd + SGD (the TP setup of
``benchmarks/train_step.py``), every step a pure function returning new parameters:

- the anchor: the step on local tensors written with ``torch.distributed._functional_collectives``
  (an autograd.Function around ``all_reduce``) under ``torch.func.grad``, compiled with
  ``fullgraph=True``;
- fshard local view (``fs.lax.pcast``/``fs.lax.psum`` on the ``.local`` of ShardedArray
  params, gradients and new params as ShardedArrays), the same function compiled with
  ``fullgraph=True`` and run eagerly;
- fshard global view: the module through ``fs.nn.functional_call`` with
  ``fs.nn.megatron_plan`` (ShardedArray params, the op rules), ``torch.func.grad`` and a
  ``fs.tree_map`` SGD update, compiled with ``fullgraph=True`` and run eagerly;
- the anchor run eagerly: what compiling buys for the pure-torch program on this machine;
- fshard's fastest eager step (``fs.optim.step(sgd, donate=True)``), hand-written local tensors +
  ``dist.all_reduce`` + ``.backward()`` and DTensor ``parallelize_module``, all eager.

Targets (issue 15.1): compiled fshard within 1.05x of the compiled anchor and at least 1.4x
faster than the same fshard step run eagerly (printed under the table, with the anchor's own
eager/compiled ratio). Every configuration is built alone in its own pair of rank processes
(``benchmarks/_runner.py``, ``per_config``); compilation happens while building; every pure
step's first result is checked against the anchor's step run eagerly.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _runner import Pool, console, table
from train_step import BATCH, MLP, _AllReduce

import fshard as fs
from fshard.array import ShardedArray

_BACKEND_ENV = "FSHARD_BENCH_COMPILE_BACKEND"  # main sets it; the rank processes inherit it


class _FuncolAllReduce(_AllReduce):
    """The anchor's collective: train_step's all_reduce with the functional collective forward
    (identity backward inherited)."""

    @staticmethod
    def forward(x):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", dist.group.WORLD)


ANCHOR = "funcol anchor, compiled (fullgraph)"
ANCHOR_EAGER = "funcol anchor, same step eager"
LOCAL, LOCAL_EAGER = "fshard local view, compiled (fullgraph)", "fshard local view, same step eager"
INPLACE = "fshard local view, SGD in place in the graph, compiled (fullgraph)"
INPLACE_EAGER = "fshard local view, SGD in place, same step eager"
GLOBAL = "fshard global view (op rules), compiled (fullgraph)"
GLOBAL_EAGER = "fshard global view (op rules), same step eager"
CONFIGS = [
    ANCHOR,
    ANCHOR_EAGER,
    LOCAL,
    LOCAL_EAGER,
    INPLACE,
    INPLACE_EAGER,
    GLOBAL,
    GLOBAL_EAGER,
    "fshard eager, fs.optim.step(donate=True)",
    "hand-written eager (local + all_reduce)",
    "DTensor parallelize_module, eager",
]


def compile_config(name, lr=1e-3):
    """The step of configuration ``name`` (built alone in its rank processes). A pure step's
    first result is checked against the anchor's step run eagerly."""
    backend = os.environ.get(_BACKEND_ENV, "inductor")
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(BATCH, model.fc1.in_features)
    y = torch.randn(BATCH, model.fc2.out_features)
    plan = fs.nn.megatron_plan(column=["fc1"], row=["fc2"])

    def params():
        return fs.nn.shard_params(model, mesh, plan)

    # the anchor: local tensors, functional collectives, a pure step
    def anchor_loss(ws, x, y):
        h = F.gelu(F.linear(x, ws[0], ws[1]))
        return F.mse_loss(_FuncolAllReduce.apply(F.linear(h, ws[2])) + ws[3], y)

    anchor_grad = torch.func.grad(anchor_loss)

    def anchor_step(ws, x, y):
        return [w - lr * g for w, g in zip(ws, anchor_grad(ws, x, y))]

    # fshard local view: fs.lax on the .local of ShardedArray params, ShardedArrays out
    def local_loss(ps, x, y):
        h = F.gelu(
            F.linear(fs.lax.pcast(x, "tp", mesh=mesh), ps["fc1.weight"].local, ps["fc1.bias"].local)
        )
        out = fs.lax.psum(F.linear(h, ps["fc2.weight"].local), "tp", mesh=mesh)
        return F.mse_loss(out + ps["fc2.bias"].local, y)

    local_grad = torch.func.grad(local_loss)

    def local_step(ps, x, y):
        g = local_grad(ps, x, y)
        return {k: ShardedArray._raw(p.local - lr * g[k].local, p.layout) for k, p in ps.items()}

    # the same with the update written into the params' buffers: the compiled graph fuses it
    # into one kernel per param writing the input in place (no fresh 16 MB per step)
    def inplace_step(ps, x, y):
        g = local_grad(ps, x, y)
        for k, p in ps.items():
            p.local.sub_(lr * g[k].local)
        return ps

    # fshard global view: the module through fs.nn.functional_call and the op rules
    xs, ys = fs.shard(x, mesh, fs.P()), fs.shard(y, mesh, fs.P())

    def global_loss(ps, x, y):
        return fs.gather(((fs.nn.functional_call(model, ps, (x,)) - y) ** 2).mean())

    global_grad = torch.func.grad(global_loss)

    def global_step(ps, x, y):
        return fs.tree_map(lambda p, g: p - lr * g, ps, global_grad(ps, x, y))

    pure = {
        ANCHOR: (torch.compile(anchor_step, fullgraph=True, backend=backend), False),
        ANCHOR_EAGER: (anchor_step, False),
        LOCAL: (torch.compile(local_step, fullgraph=True, backend=backend), True),
        LOCAL_EAGER: (local_step, True),
        INPLACE: (torch.compile(inplace_step, fullgraph=True, backend=backend), True),
        INPLACE_EAGER: (inplace_step, True),
        GLOBAL: (torch.compile(global_step, fullgraph=True, backend=backend), True),
        GLOBAL_EAGER: (global_step, True),
    }
    if name in pure:
        fn, sharded = pure[name]
        args = (xs, ys) if name in (GLOBAL, GLOBAL_EAGER) else (x, y)
        ws0 = [p.local for p in params().values()]
        state = {"p": params() if sharded else ws0}
        first = fn(state["p"], *args)
        got = [p.local for p in first.values()] if sharded else first
        for g, w in zip(got, anchor_step(ws0, x, y)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)

        def pure_step():
            state["p"] = fn(state["p"], *args)

        return pure_step

    if name == "fshard eager, fs.optim.step(donate=True)":
        tx = fs.optim.sgd(lr)
        dst = {"p": {k: v.clone() for k, v in params().items()}}
        dst["s"] = tx.init(dst["p"])

        def fshard_donated():
            g = local_grad(dst["p"], x, y)
            dst["p"], dst["s"] = fs.optim.step(tx, g, dst["s"], dst["p"], donate=True)

        return fshard_donated

    if name == "hand-written eager (local + all_reduce)":
        hw = [p.local.clone().requires_grad_() for p in params().values()]
        mopt = torch.optim.SGD(hw, lr=lr)

        def manual_step():
            mopt.zero_grad(set_to_none=True)
            out = _AllReduce.apply(F.linear(F.gelu(F.linear(x, hw[0], hw[1])), hw[2])) + hw[3]
            F.mse_loss(out, y).backward()
            mopt.step()

        return manual_step

    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    assert name == "DTensor parallelize_module, eager", name
    dmesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    parallelize_module(model, dmesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    dopt = torch.optim.SGD(model.parameters(), lr=lr)
    assert dist.get_rank() in (0, 1)

    def dtensor_step():
        dopt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        dopt.step()

    return dtensor_step


def _eager_over_compiled(times, eager: str, compiled: str) -> float:
    return statistics.median(e / c for (e, _), (c, _) in zip(times[eager], times[compiled]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    a = ap.parse_args(argv)
    os.environ[_BACKEND_ENV] = a.backend
    with Pool(
        "compile_step:compile_config", warmup=3, names=CONFIGS, base=ANCHOR, per_config=True
    ) as pool:
        times = pool.time(a.reps, a.steps)
    console().print(
        table(
            f"TP MLP 1024->4096->1024, batch 64, pure step, 2 ranks x 1 thread, {a.backend}",
            times,
            ANCHOR,
            {},
            "targets: fshard compiled <= 1.05x the compiled anchor, >= 1.4x faster than the same "
            "fshard step eager",
        )
    )
    for what, eager, comp in (
        ("funcol anchor", ANCHOR_EAGER, ANCHOR),
        ("fshard local view", LOCAL_EAGER, LOCAL),
        ("fshard local view, SGD in place", INPLACE_EAGER, INPLACE),
        ("fshard global view", GLOBAL_EAGER, GLOBAL),
    ):
        speedup = _eager_over_compiled(times, eager, comp)
        print(f"{what}: eager / compiled (per-rep median) {speedup:.2f}x (target >= 1.4x)")


if __name__ == "__main__":
    main()
