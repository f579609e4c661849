"""An ensemble of tensor-parallel models, evaluated and differentiated with ``torch.func.vmap``.

``E`` two-layer MLPs are stacked along a new leading (unsharded) dim: ``w1`` is
``P(None, None, "tp")`` (column-parallel per model), ``w2`` is ``P(None, "tp")`` (row-parallel).
``vmap(model, in_dims=(0, None))`` hands each model its own weights with the per-model layouts
(``P(None, "tp")`` and ``P("tp")``) and runs the ``fs.shard_map`` body once for the whole stack
(every collective runs once on the batched tensor). ``vmap(grad(loss))`` gives every model's
gradient with the stacked layouts; ``check()`` compares both with dense ``torch.func``.

Run: ``python examples/ensemble.py`` (starts 2 local ranks), ``--device cuda`` to hold the
blocks on the GPU(s), or ``torchrun --nproc-per-node 2 examples/ensemble.py``. The default device
is ``cuda`` under NCCL (torchrun with a GPU per rank) and ``cpu`` otherwise.
"""

from __future__ import annotations

import torch
from _device import device_args
from torch.func import grad, vmap

import fshard as fs
from fshard import P

E, D, H, C, B = 4, 5, 6, 3, 7


def body(x, w1, w2):
    """x (B, D) replicated, w1 (D, H/tp), w2 (H/tp, C): the logits, replicated."""
    return fs.lax.psum(torch.relu(x @ w1) @ w2, "tp")


def model(params, x, mesh):
    """One model's predictions (B, C) as a replicated ShardedArray."""
    f = fs.shard_map(body, mesh, (P(), P(None, "tp"), P("tp")), P())
    return f(x, params["w1"], params["w2"])


def loss(params, x, t, mesh):
    return ((fs.gather(model(params, x, mesh)) - t) ** 2).mean()


def dense_model(params, x):
    return torch.relu(x @ params["w1"]) @ params["w2"]


def dense_loss(params, x, t):
    return ((dense_model(params, x) - t) ** 2).mean()


def make_problem(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    dense = {
        "w1": torch.randn(E, D, H, generator=g, dtype=dtype),
        "w2": torch.randn(E, H, C, generator=g, dtype=dtype),
    }
    return (
        dense,
        torch.randn(B, D, generator=g, dtype=dtype),
        torch.randn(B, C, generator=g, dtype=dtype),
    )


def check(device: str | None = None) -> dict:
    """Predictions and per-model gradients of the sharded ensemble vs dense, on this rank.

    ``device``: where the blocks live (``"cpu"``, ``"cuda"``, ``None``: the mesh's default);
    the dense reference runs there too."""
    mesh = fs.Mesh.create((2,), ("tp",), device_type=device)
    dense, x, t = make_problem()
    dense = {k: v.to(mesh.device()) for k, v in dense.items()}
    x, t = x.to(mesh.device()), t.to(mesh.device())
    specs = {"w1": P(None, None, "tp"), "w2": P(None, "tp")}
    stacked = {k: fs.shard(v, mesh, specs[k]) for k, v in dense.items()}
    preds = vmap(model, in_dims=(0, None, None))(stacked, x, mesh)
    want = vmap(dense_model, in_dims=(0, None))(dense, x)
    grads = vmap(grad(loss), in_dims=(0, None, None, None))(stacked, x, t, mesh)
    want_g = vmap(grad(dense_loss), in_dims=(0, None, None))(dense, x, t)
    return {
        "pred_err": (fs.gather(preds) - want).abs().max().item(),
        "pred_shape": tuple(preds.shape),
        # torch's max, not Python's: a NaN error anywhere must show (max() drops a later NaN)
        "grad_err": torch.stack([(fs.gather(grads[k]) - want_g[k]).abs().max() for k in want_g])
        .max()
        .item(),
        "grad_specs": {k: grads[k].spec for k in grads},
        "device": str(preds.local.device),
    }


def parse_args(argv=None) -> dict:
    return device_args(__doc__, argv)


if __name__ == "__main__":
    from fshard.launch import run

    result = run(check, 2, (parse_args()["device"],))[0]
    print(f"ensemble of {E} models, predictions {result['pred_shape']}")
    print(f"predictions vs dense: max abs error {result['pred_err']:.2e}")
    print(f"per-model grads vs dense: max abs error {result['grad_err']:.2e}")
    print(f"grad layouts: {result['grad_specs']}")
