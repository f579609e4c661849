"""DP-SGD with per-example gradient clipping over tensor-parallel sharded parameters.

A two-layer MLP whose first weight is column-sharded and second weight row-sharded over mesh
axis ``tp`` (Megatron style), plus a replicated bias. The model body is a ``fs.shard_map``
with one ``fs.lax.psum``; per-example gradients come from ``torch.func.vmap(torch.func.grad)``
around it and keep the parameters' layouts. Each example's gradient is clipped to a global L2
norm (sharded leaves contribute through one psum over ``tp``, the replicated bias once), the
clipped gradients are averaged, Gaussian noise is added (``fs.randn`` draws exactly the values
the dense ``torch.randn`` would), and SGD updates the parameters. ``check()`` compares one step
with the same step on dense tensors.

Run: ``python examples/per_example_grads.py`` (starts 2 local ranks), ``--device cuda`` to
hold the blocks on the GPU(s), or ``torchrun --nproc-per-node 2 examples/per_example_grads.py``.
The default device is ``cuda`` under NCCL (torchrun with a GPU per rank) and ``cpu`` otherwise.
The noise comes from a CPU generator on every device (``fs.randn`` draws where the generator
lives), so the sharded step equals the dense one anywhere.
"""

from __future__ import annotations

import optree
import torch
from _device import device_args
from torch.func import grad, vmap

import fshard as fs
from fshard import P

D, H, C, B = 6, 8, 3, 5


def body(x, w1, w2, b2, t):
    """Local loss of one example: x (D,), w1 (D, H/tp), w2 (H/tp, C), b2 (C,), t (C,)."""
    y = fs.lax.psum(torch.tanh(x @ w1) @ w2, "tp") + b2
    return ((y - t) ** 2).sum()


def example_loss(params, x, t, mesh):
    """Loss of one example as a plain scalar tensor (the same on every rank)."""
    specs = (P(), P(None, "tp"), P("tp"), P(), P())
    f = fs.shard_map(body, mesh, specs, P())
    return fs.gather(f(x, params["w1"], params["w2"], params["b2"], t))


def dense_loss(params, x, t):
    y = torch.tanh(x @ params["w1"]) @ params["w2"] + params["b2"]
    return ((y - t) ** 2).sum()


def _sumsq(g) -> torch.Tensor:
    """Per-example squared norm of one gradient leaf (leading dim = examples), all ranks agree."""
    local = (g.local**2).flatten(1).sum(1)
    if g.layout.varying_axes:  # sharded leaves: add the other ranks' blocks
        return fs.lax.psum(local, tuple(sorted(g.layout.varying_axes)), mesh=g.mesh)
    return local


def dp_sgd_step(params, xs, ts, mesh, *, clip=1.0, noise_multiplier=0.5, lr=0.1, seed=0):
    """One DP-SGD step: per-example grads, clip each to ``clip``, average, add noise, update.

    Args:
        params: dict of ShardedArrays (``w1`` P(None, "tp"), ``w2`` P("tp"), ``b2`` P()).
        xs, ts: a batch of inputs (B, D) and targets (B, C), plain tensors (same on every rank).
        mesh: the mesh with axis ``tp``.
        clip: per-example L2 norm bound.
        noise_multiplier: noise std as a multiple of ``clip``.
        lr: learning rate.
        seed: seed of the noise generator (every rank uses the same one).

    Returns:
        The updated params, with the same layouts.
    """
    per_ex = vmap(grad(example_loss), in_dims=(None, 0, 0, None))(params, xs, ts, mesh)
    leaves = optree.tree_leaves(per_ex, is_leaf=fs.tree.is_sharded)
    norms = torch.sqrt(sum(_sumsq(g) for g in leaves))  # (B,)
    scale = torch.clamp(clip / (norms + 1e-12), max=1.0)
    gen = torch.Generator().manual_seed(seed)

    def update(p, g):
        clipped = (g.local * scale.view(-1, *[1] * (g.local.dim() - 1))).sum(0)
        noise = fs.randn(p.shape, mesh, p.spec, dtype=p.dtype, generator=gen).local
        step = (clipped + noise_multiplier * clip * noise) / xs.shape[0]
        return fs.from_local(p.local - lr * step, mesh, p.spec, shape=p.shape)

    return {k: update(params[k], per_ex[k]) for k in params}


def dense_dp_sgd_step(params, xs, ts, *, clip=1.0, noise_multiplier=0.5, lr=0.1, seed=0):
    """The same step on dense tensors (the reference)."""
    per_ex = vmap(grad(dense_loss), in_dims=(None, 0, 0))(params, xs, ts)
    norms = torch.sqrt(sum((g**2).flatten(1).sum(1) for g in per_ex.values()))
    scale = torch.clamp(clip / (norms + 1e-12), max=1.0)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k in params:  # same key order as dp_sgd_step, so the same noise draws
        g = per_ex[k]
        clipped = (g * scale.view(-1, *[1] * (g.dim() - 1))).sum(0)
        noise = torch.randn(params[k].shape, generator=gen, dtype=params[k].dtype)
        noise = noise.to(params[k].device)  # drawn on the CPU (gen), as fs.randn draws it
        out[k] = params[k] - lr * (clipped + noise_multiplier * clip * noise) / xs.shape[0]
    return out


def make_problem(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    dense = {
        "w1": torch.randn(D, H, generator=g, dtype=dtype),
        "w2": torch.randn(H, C, generator=g, dtype=dtype),
        "b2": torch.randn(C, generator=g, dtype=dtype),
    }
    xs = torch.randn(B, D, generator=g, dtype=dtype)
    ts = torch.randn(B, C, generator=g, dtype=dtype)
    return dense, xs, ts


def check(device: str | None = None) -> dict:
    """Run one sharded step and the dense step on this rank; report the largest differences.

    ``device``: where the blocks live (``"cpu"``, ``"cuda"``, ``None``: the mesh's default);
    the dense reference runs there too."""
    mesh = fs.Mesh.create((2,), ("tp",), device_type=device)
    dense, xs, ts = make_problem()
    dense = {k: v.to(mesh.device()) for k, v in dense.items()}
    xs, ts = xs.to(mesh.device()), ts.to(mesh.device())
    specs = {"w1": P(None, "tp"), "w2": P("tp"), "b2": P()}
    params = {k: fs.shard(v, mesh, specs[k]) for k, v in dense.items()}
    per_ex = vmap(grad(example_loss), in_dims=(None, 0, 0, None))(params, xs, ts, mesh)
    want = vmap(grad(dense_loss), in_dims=(None, 0, 0))(dense, xs, ts)
    new = dp_sgd_step(params, xs, ts, mesh)
    ref = dense_dp_sgd_step(dense, xs, ts)
    return {
        # torch's max, not Python's: a NaN error anywhere must show (max() drops a later NaN)
        "per_example_grad_err": torch.stack(
            [(fs.gather(per_ex[k]) - want[k]).abs().max() for k in want]
        )
        .max()
        .item(),
        "per_example_specs": {k: per_ex[k].spec for k in per_ex},
        "step_err": torch.stack([(fs.gather(new[k]) - ref[k]).abs().max() for k in ref])
        .max()
        .item(),
        "step_specs": {k: new[k].spec for k in new},
        "device": str(new["w1"].local.device),
    }


def parse_args(argv=None) -> dict:
    return device_args(__doc__, argv)


if __name__ == "__main__":
    from fshard.launch import run

    result = run(check, 2, (parse_args()["device"],))[0]
    print(f"per-example grads vs dense: max abs error {result['per_example_grad_err']:.2e}")
    print(f"DP-SGD step vs dense:       max abs error {result['step_err']:.2e}")
    print(f"update layouts: {result['step_specs']}")
