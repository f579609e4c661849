"""Compiled training steps on 2 local Gloo ranks (1 thread each), printed as a rich table.

    python benchmarks/compile_step.py [--reps 5] [--steps 10] [--backend inductor]

Tensor-parallel MLP 1024 -> 4096 -> 1024, batch 64, fwd + bwd + SGD (the TP setup of
``benchmarks/train_step.py``), every step a pure function returning new parameters:

- the anchor: the step on local tensors written with ``torch.distributed._functional_collectives``
  (an autograd.Function around ``all_reduce``) under ``torch.func.grad``, compiled with
  ``fullgraph=True``;
- fshard local view (``fs.lax.pcast``/``fs.lax.psum`` on the ``.local`` of ShardedArray
  params, gradients and new params as ShardedArrays), the same function compiled with
  ``fullgraph=True`` and run eagerly;
- fshard's fastest eager step (``fs.optim.step(sgd, donate=True)``), hand-written local tensors +
  ``dist.all_reduce`` + ``.backward()`` and DTensor ``parallelize_module``, all eager.

Targets (issue 15.1): compiled fshard within 1.05x of the compiled anchor and at least 1.4x
faster than the same fshard step run eagerly. Every configuration runs in its own pair of
rank processes (``benchmarks/_runner.py``); compilation happens during the warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _runner import console, run_section, table
from train_step import BATCH, MLP, _AllReduce

import fshard as fs
from fshard.array import ShardedArray

_BACKEND_ENV = "FSHARD_BENCH_COMPILE_BACKEND"  # main sets it; the rank processes inherit it


class _FuncolAllReduce(torch.autograd.Function):
    """The anchor's collective: functional all_reduce forward, identity backward."""

    @staticmethod
    def forward(x):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


def compile_configs(lr=1e-3):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    backend = os.environ.get(_BACKEND_ENV, "inductor")
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(BATCH, model.fc1.in_features)
    y = torch.randn(BATCH, model.fc2.out_features)
    plan = fs.nn.megatron_plan(column=["fc1"], row=["fc2"])

    # fshard local view: a pure step, params -> new params (ShardedArrays in and out)
    def local_loss(ps, x, y):
        h = F.gelu(
            F.linear(fs.lax.pcast(x, "tp", mesh=mesh), ps["fc1.weight"].local, ps["fc1.bias"].local)
        )
        out = fs.lax.psum(F.linear(h, ps["fc2.weight"].local), "tp", mesh=mesh)
        return F.mse_loss(out + ps["fc2.bias"].local, y)

    grad_fn = torch.func.grad(local_loss)

    def fshard_step(ps, x, y):
        g = grad_fn(ps, x, y)
        return {k: ShardedArray._raw(p.local - lr * g[k].local, p.layout) for k, p in ps.items()}

    compiled_step = torch.compile(fshard_step, fullgraph=True, backend=backend)
    cst = {"p": fs.nn.shard_params(model, mesh, plan)}
    est = {"p": fs.nn.shard_params(model, mesh, plan)}

    def fshard_compiled():
        cst["p"] = compiled_step(cst["p"], x, y)

    def fshard_eager():
        est["p"] = fshard_step(est["p"], x, y)

    tx = fs.optim.sgd(lr)
    dst = {"p": {k: v.clone() for k, v in fs.nn.shard_params(model, mesh, plan).items()}}
    dst["s"] = tx.init(dst["p"])

    def fshard_donated():
        g = grad_fn(dst["p"], x, y)
        dst["p"], dst["s"] = fs.optim.step(tx, g, dst["s"], dst["p"], donate=True)

    # the anchor: local tensors, functional collectives, the same pure step
    ws0 = [p.local.clone() for p in fs.nn.shard_params(model, mesh, plan).values()]

    def anchor_loss(ws, x, y):
        h = F.gelu(F.linear(x, ws[0], ws[1]))
        return F.mse_loss(_FuncolAllReduce.apply(F.linear(h, ws[2])) + ws[3], y)

    anchor_grad = torch.func.grad(anchor_loss)

    def anchor_step(ws, x, y):
        return [w - lr * g for w, g in zip(ws, anchor_grad(ws, x, y))]

    compiled_anchor = torch.compile(anchor_step, fullgraph=True, backend=backend)
    ast = {"w": ws0}

    def anchor_compiled():
        ast["w"] = compiled_anchor(ast["w"], x, y)

    # hand-written eager and DTensor eager, as in train_step
    r = dist.get_rank()
    hw = [t.clone().requires_grad_() for t in ws0]
    mopt = torch.optim.SGD(hw, lr=lr)

    def manual_step():
        mopt.zero_grad(set_to_none=True)
        out = _AllReduce.apply(F.linear(F.gelu(F.linear(x, hw[0], hw[1])), hw[2])) + hw[3]
        F.mse_loss(out, y).backward()
        mopt.step()

    dmodel = MLP()
    dmodel.load_state_dict(model.state_dict())
    dmesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    parallelize_module(dmodel, dmesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    dopt = torch.optim.SGD(dmodel.parameters(), lr=lr)

    def dtensor_step():
        dopt.zero_grad(set_to_none=True)
        F.mse_loss(dmodel(x), y).backward()
        dopt.step()

    # correctness: one compiled step of fshard and of the anchor give the same params
    p1 = compiled_step(fs.nn.shard_params(model, mesh, plan), x, y)
    a1 = compiled_anchor(ws0, x, y)
    for got, want in zip(p1.values(), a1):
        torch.testing.assert_close(got.local, want, rtol=1e-5, atol=1e-6)
    assert r in (0, 1)
    return {
        "funcol anchor, compiled (fullgraph)": anchor_compiled,
        "fshard local view, compiled (fullgraph)": fshard_compiled,
        "fshard local view, same step eager": fshard_eager,
        "fshard eager, fs.optim.step(donate=True)": fshard_donated,
        "hand-written eager (local + all_reduce)": manual_step,
        "DTensor parallelize_module, eager": dtensor_step,
    }, "funcol anchor, compiled (fullgraph)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    a = ap.parse_args(argv)
    os.environ[_BACKEND_ENV] = a.backend
    times, base = run_section("compile_step:compile_configs", a.reps, a.steps)
    console().print(
        table(
            f"TP MLP 1024->4096->1024, batch 64, pure step, 2 ranks x 1 thread, {a.backend}",
            times,
            base,
            {},
            "targets: fshard compiled <= 1.05x the compiled anchor, >= 1.4x faster than the same "
            "fshard step eager",
        )
    )
    eager = times["fshard local view, same step eager"]
    comp = times["fshard local view, compiled (fullgraph)"]
    speedup = statistics.median(e / c for (e, _), (c, _) in zip(eager, comp))
    print(f"fshard eager / fshard compiled (per-rep median): {speedup:.2f}x (target >= 1.4x)")


if __name__ == "__main__":
    main()
