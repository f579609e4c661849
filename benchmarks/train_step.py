"""Training-step benchmarks on 2 local Gloo ranks (1 thread each), printed as rich tables.

    python benchmarks/train_step.py [--reps 7] [--steps 10] [--only tp,dp,optim]

1. Tensor-parallel MLP 1024 -> 4096 -> 1024, batch 64, fwd + bwd + SGD: fshard (local view:
   ``pcast``/``psum`` + ``torch.func.grad`` + ``fs.optim.step(sgd, donate=True)``, the same
   with the pure ``update`` + ``apply_updates`` pair, and global view through the op rules
   with ``fs.nn.functional_call``) vs DTensor ``parallelize_module``
   (ColwiseParallel/RowwiseParallel) vs hand-written local tensors + ``dist.all_reduce``, and
   that hand-written model stepped with ``torch.func.grad`` + a foreach update (the functional
   floor, no fshard), and the local view through ``fs.value_and_grad`` (top level:
   ``torch.autograd.backward`` on detached leaves). Anchors (docs/peers.md): DTensor 27.3 ms,
   hand-written 23.0 ms.
2. Data parallel, the same MLP, global batch 64: fshard (local grads, then one
   ``fs.lax.psum(grads, donate=True)`` of the gradient pytree: large grads reduced in place,
   small ones bucketed, all launched together), and ``fs.value_and_grad`` with each param
   ``pcast`` over dp (local view, and global view through the op rules): buckets all-reduced
   asynchronously during the backward, as DDP does; vs DistributedDataParallel (anchor 77 ms).
3. AdamW step over 100 sharded params: fs.optim.adamw (pure, and ``fs.optim.step`` with
   donation) vs torch.optim.AdamW(foreach) on DTensors vs on plain local tensors.

Every configuration runs in its own pair of rank processes, reps interleaved in a shuffled
order; a rep's time is the slowest rank's mean step time (``benchmarks/_runner.py`` says why).
Tables show the median over reps, the per-rep ratio to the baseline, and the minor page faults
per step of the rank with the most.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _runner import console, run_section, table
from torch import nn

import fshard as fs

D, H, BATCH = 1024, 4096, 64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


# -- 1. tensor parallel ---------------------------------------------------------------------


def tp_configs(lr=1e-3):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(BATCH, D)
    y = torch.randn(BATCH, D)

    # fshard, local view
    weights = model.state_dict()  # the copies below start here (refused once model is sharded)
    plan = fs.nn.megatron_plan(column=["fc1"], row=["fc2"])
    params = fs.nn.shard_params(model, mesh, plan)
    tx = fs.optim.sgd(lr)
    st = {"p": params, "s": tx.init(params)}

    def local_loss(ps, x, y):
        h = F.gelu(
            F.linear(fs.lax.pcast(x, "tp", mesh=mesh), ps["fc1.weight"].local, ps["fc1.bias"].local)
        )
        out = (
            fs.lax.psum(F.linear(h, ps["fc2.weight"].local), "tp", mesh=mesh) + ps["fc2.bias"].local
        )
        return F.mse_loss(out, y)

    grad_fn = torch.func.grad(local_loss)

    def fshard_step():
        g = grad_fn(st["p"], x, y)
        st["p"], st["s"] = fs.optim.step(tx, g, st["s"], st["p"], donate=True)

    vst = {"p": {k: v.clone() for k, v in fs.nn.shard_params(model, mesh, plan).items()}}
    vst["s"] = tx.init(vst["p"])
    vg = fs.value_and_grad(local_loss)

    def fshard_vg_step():  # top level: torch.autograd.backward on detached leaves
        _, g = vg(vst["p"], x, y)
        vst["p"], vst["s"] = fs.optim.step(tx, g, vst["s"], vst["p"], donate=True)

    pst = {"p": fs.nn.shard_params(model, mesh, plan)}
    pst["p"] = {k: v.clone() for k, v in pst["p"].items()}
    pst["s"] = tx.init(pst["p"])

    def fshard_pure_step():  # the optax two-call step: fresh params every step
        g = grad_fn(pst["p"], x, y)
        upd, pst["s"] = tx.update(g, pst["s"], pst["p"])
        pst["p"] = fs.optim.apply_updates(pst["p"], upd)

    # fshard, global view (op rules through __torch_function__)
    gmodel = MLP()
    gmodel.load_state_dict(weights)
    gst = {"p": fs.nn.shard_params(gmodel, mesh, plan)}
    gst["s"] = tx.init(gst["p"])
    xs, ys = fs.shard(x, mesh, fs.P()), y

    def global_loss(ps):
        out = fs.nn.functional_call(gmodel, ps, (xs,))
        return F.mse_loss(fs.gather(out), ys)

    ggrad = torch.func.grad(global_loss)

    def fshard_global_step():
        g = ggrad(gst["p"])
        gst["p"], gst["s"] = fs.optim.step(tx, g, gst["s"], gst["p"], donate=True)

    # DTensor
    dmodel = MLP()
    dmodel.load_state_dict(weights)
    dmesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    parallelize_module(dmodel, dmesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    dopt = torch.optim.SGD(dmodel.parameters(), lr=lr)

    def dtensor_step():
        dopt.zero_grad(set_to_none=True)
        F.mse_loss(dmodel(x), y).backward()
        dopt.step()

    # hand-written local tensors
    r = dist.get_rank()
    w1 = model.fc1.weight.detach()[r * H // 2 : (r + 1) * H // 2].clone().requires_grad_()
    b1 = model.fc1.bias.detach()[r * H // 2 : (r + 1) * H // 2].clone().requires_grad_()
    w2 = model.fc2.weight.detach()[:, r * H // 2 : (r + 1) * H // 2].clone().requires_grad_()
    b2 = model.fc2.bias.detach().clone().requires_grad_()
    mopt = torch.optim.SGD([w1, b1, w2, b2], lr=lr)

    def manual_step():
        mopt.zero_grad(set_to_none=True)
        out = _AllReduce.apply(F.linear(F.gelu(F.linear(x, w1, b1)), w2)) + b2
        F.mse_loss(out, y).backward()
        mopt.step()

    # the same hand-written model as a torch.func step (no fshard): the floor a functional
    # step starts from (torch.func.grad instead of .backward(), foreach update)
    fw = [t.detach().clone() for t in (w1, b1, w2, b2)]

    def func_loss(ws, x, y):
        out = _AllReduce.apply(F.linear(F.gelu(F.linear(x, ws[0], ws[1])), ws[2])) + ws[3]
        return F.mse_loss(out, y)

    func_grad = torch.func.grad(func_loss)

    def func_step():
        torch._foreach_add_(fw, func_grad(fw, x, y), alpha=-lr)

    # correctness: one step of each from the same start gives the same loss
    with torch.no_grad():
        l_f = float(local_loss(st["p"], x, y))
        l_m = float(F.mse_loss(_AllReduce.apply(F.linear(F.gelu(F.linear(x, w1, b1)), w2)) + b2, y))
    assert abs(l_f - l_m) < 1e-5 * abs(l_m), (l_f, l_m)
    configs = {
        "hand-written (local + all_reduce)": manual_step,
        "DTensor parallelize_module": dtensor_step,
        "torch.func.grad, local tensors, no fshard": func_step,
        "fshard local view (pcast/psum)": fshard_step,
        "fs.value_and_grad, local view": fshard_vg_step,
        "fshard local view, pure update+apply": fshard_pure_step,
        "fshard global view (op rules)": fshard_global_step,
    }
    return configs, "hand-written (local + all_reduce)"


# -- 2. data parallel -----------------------------------------------------------------------


def dp_configs(lr=1e-3):
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = fs.Mesh.create((2,), ("dp",))
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(BATCH, D)
    y = torch.randn(BATCH, D)
    xs, ys = fs.shard(x, mesh, fs.P("dp")), fs.shard(y, mesh, fs.P("dp"))
    weights = model.state_dict()  # for the DDP copy (refused once model is sharded)
    params = fs.nn.shard_params(model, mesh)  # replicated
    tx = fs.optim.sgd(lr)
    st = {"p": params, "s": tx.init(params)}

    n = mesh.size("dp")

    def local_loss(ps, x, y):
        # divided by the dp size here, so one psum of the grads is their mean (no extra pass)
        out = torch.func.functional_call(model, {k: v.local for k, v in ps.items()}, (x,))
        return F.mse_loss(out, y) / n

    grad_fn = torch.func.grad(local_loss)

    def fshard_step():
        g = grad_fn(st["p"], xs.local, ys.local)
        # the whole gradient pytree, bucketed; donated: the large grads are reduced in place
        g = fs.lax.psum(g, "dp", mesh=mesh, donate=True)
        st["p"], st["s"] = fs.optim.step(tx, g, st["s"], st["p"], donate=True)

    vst = {"p": {k: v.clone() for k, v in fs.nn.shard_params(model, mesh).items()}}
    vst["s"] = tx.init(vst["p"])

    def pcast_loss(ps, x, y):
        # each param pcast over dp where it meets the local batch: fs.value_and_grad reduces
        # those gradients in buckets launched during the backward
        local = {k: fs.lax.pcast(v.local, "dp", mesh=mesh) for k, v in ps.items()}
        out = torch.func.functional_call(model, local, (x,))
        return fs.lax.pmean(F.mse_loss(out, y), "dp", mesh=mesh)

    vg = fs.value_and_grad(pcast_loss)

    def fshard_vg_step():
        _, g = vg(vst["p"], xs.local, ys.local)
        vst["p"], vst["s"] = fs.optim.step(tx, g, vst["s"], vst["p"], donate=True)

    gst = {"p": {k: v.clone() for k, v in fs.nn.shard_params(model, mesh).items()}}
    gst["s"] = tx.init(gst["p"])

    def global_loss(ps):  # the op rules pcast each replicated param where it meets the batch
        out = fs.nn.functional_call(model, ps, (xs,))
        return fs.gather(((out - ys) ** 2).mean())

    gvg = fs.value_and_grad(global_loss)

    def fshard_global_step():
        _, g = gvg(gst["p"])
        gst["p"], gst["s"] = fs.optim.step(tx, g, gst["s"], gst["p"], donate=True)

    dmodel = MLP()
    dmodel.load_state_dict(weights)
    ddp = DDP(dmodel)
    dopt = torch.optim.SGD(ddp.parameters(), lr=lr)

    def ddp_step():
        dopt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(xs.local), ys.local).backward()
        dopt.step()

    return {
        "DDP": ddp_step,
        "fshard (grad + psum(donate=True))": fshard_step,
        "fs.value_and_grad, local view (pcast)": fshard_vg_step,
        "fs.value_and_grad, global view (op rules)": fshard_global_step,
    }, "DDP"


# -- 3. optimizer step ----------------------------------------------------------------------


def optim_configs(n=100, shape=(256, 256)):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = fs.Mesh.create((2,), ("x",))
    dmesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(shape, generator=g) for _ in range(n)]
    grads_full = [torch.randn(shape, generator=g) * 1e-2 for _ in range(n)]

    params = {f"p{i}": fs.shard(t, mesh, fs.P("x")) for i, t in enumerate(full)}
    grads = {f"p{i}": fs.shard(t, mesh, fs.P("x")) for i, t in enumerate(grads_full)}
    tx = fs.optim.adamw(1e-3, weight_decay=0.01)
    st = {"p": params, "s": tx.init(params)}

    def fshard_step():
        upd, st["s"] = tx.update(grads, st["s"], st["p"])
        st["p"] = fs.optim.apply_updates(st["p"], upd)

    dparams = {k: v.clone() for k, v in params.items()}
    dst = {"p": dparams, "s": tx.init(dparams)}

    def fshard_donated_step():
        dst["p"], dst["s"] = fs.optim.step(tx, grads, dst["s"], dst["p"], donate=True)

    def torch_opt(tensors, grads_):
        ps = [nn.Parameter(t) for t in tensors]
        for p, gr in zip(ps, grads_):
            p.grad = gr
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True)
        return opt.step

    dt_params = [distribute_tensor(t, dmesh, [Shard(0)]) for t in full]
    dt_grads = [distribute_tensor(t, dmesh, [Shard(0)]) for t in grads_full]
    plain = [p.local.clone() for p in params.values()]
    plain_g = [gr.local.clone() for gr in grads.values()]
    return {
        "torch.optim.AdamW, plain local tensors": torch_opt(plain, plain_g),
        "torch.optim.AdamW on DTensors": torch_opt(dt_params, dt_grads),
        "fs.optim.adamw (+ apply_updates)": fshard_step,
        "fs.optim.step(adamw, donate=True)": fshard_donated_step,
    }, "torch.optim.AdamW, plain local tensors"


SECTIONS = {
    "tp": "train_step:tp_configs",
    "dp": "train_step:dp_configs",
    "optim": "train_step:optim_configs",
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--only", default=",".join(SECTIONS), help="comma-separated sections: tp,dp,optim"
    )
    a = ap.parse_args(argv)
    only = tuple(a.only.split(","))
    if not set(only) <= set(SECTIONS):
        ap.error(f"--only takes sections from {sorted(SECTIONS)}, got {a.only!r}")
    res = {
        name: run_section(SECTIONS[name], a.reps, a.steps if name != "dp" else max(2, a.steps // 2))
        for name in only
    }
    out = console()
    anchors = {
        "hand-written (local + all_reduce)": "23.0 ms",
        "DTensor parallelize_module": "27.3 ms",
        "DDP": "77.3 ms",
    }
    targets = {
        "tp": "target: fshard <= 1.05x hand-written; fs.value_and_grad <= 1.0x",
        "dp": "target: fshard <= DDP; fs.value_and_grad <= 0.9x DDP",
        "optim": "target: fshard <= 1.5x plain",
    }
    titles = {
        "tp": "TP MLP 1024->4096->1024, batch 64, fwd+bwd+SGD, 2 ranks x 1 thread",
        "dp": "DP MLP 1024->4096->1024, global batch 64, fwd+bwd+SGD, 2 ranks x 1 thread",
        "optim": "AdamW step, 100 params 256x256 sharded P('x') on 2 ranks",
    }
    for name, (times, base) in res.items():
        out.print(table(titles[name], times, base, anchors, targets[name]))


if __name__ == "__main__":
    main()
