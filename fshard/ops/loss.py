"""Loss rules: elementwise losses (mse, l1, smooth_l1, huber, bce, bce_with_logits, soft_margin,
margin_ranking, hinge_embedding, poisson_nll, kl_div) and nll.

Inputs are aligned like elementwise ops (no communication for matching layouts). With
``reduction="none"`` the loss keeps that layout; ``"sum"`` and ``"mean"`` sum the local block
and return a value *pending* over the split axes (``fs.gather`` or the next nonlinear op adds
the addends). ``"mean"`` divides by the GLOBAL element count (``kl_div``'s ``"batchmean"`` by
the global batch size), so uneven shards give the dense mean. ``nll_loss`` needs the class dim whole; its ``"mean"`` divides by the global (weighted)
count of non-ignored targets: one ``psum`` of a scalar.

Example:
    >>> loss = F.mse_loss(pred, target)   # pred, target P("dp"): pending over "dp"  # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..spec import BaseLayout, Layout
from ._common import group_of, group_psum, in_mesh_order, meta_call, out_layout, spec
from .binding import bind
from .elementwise import align, own_dims
from .registry import OpSharding, register_rule, tensor_inputs

__all__ = []


def _reduction(op, bound) -> str:
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        raise NotImplementedError(
            f"{op.__name__} on a ShardedArray: the legacy size_average=/reduce= arguments are "
            "not supported; use reduction='mean'|'sum'|'none'"
        )
    return bound["reduction"]


def pointwise_loss_rule(op, args, kwargs):
    """A loss that is elementwise before its reduction."""
    ins = tensor_inputs(args, kwargs)
    reduction = _reduction(op, bind(op, args, kwargs))
    shape = torch.broadcast_shapes(*[x.shape for x in ins])
    dims = align(ins, shape)
    specs = [spec(own_dims(x, dims, shape)) for x in ins]
    mesh = ins[0].mesh
    meta = meta_call(op, args, kwargs)
    if reduction == "none":
        return OpSharding(specs, out_layout(mesh, dims, (), meta))
    axes = in_mesh_order(mesh, [a for d in dims for a in d])
    count = math.prod(shape)
    if reduction == "batchmean":  # F.kl_div divides by the input's batch size (0-d: by 1)
        count = ins[0].shape[0] if ins[0].ndim else 1
    name = op.__name__
    fn = getattr(F, name)

    def local(b):
        total = fn(**{**b, "reduction": "sum"})
        return total / count if reduction in ("mean", "batchmean") else total

    return OpSharding(specs, out_layout(mesh, [], axes, meta), local, by_name=True)


def nll_loss_rule(op, args, kwargs):
    bound = bind(op, args, kwargs)
    x, t = bound["input"], bound["target"]
    reduction = _reduction(op, bound)
    if not isinstance(t, BaseLayout):
        raise TypeError("nll_loss: target must be a tensor")
    # input (N, C, d...) or (C,); target (N, d...): the class dim is whole, the rest align
    class_dim = 1 if x.ndim > 1 else 0
    rest = [x.dim_axes[d] for d in range(x.ndim) if d != class_dim]
    rest_layout = Layout(x.mesh, spec(rest), tuple(t.shape), x.dtype)
    dims = align([rest_layout, t], tuple(t.shape))
    x_dims = list(dims)
    x_dims.insert(class_dim, ())
    specs = {"input": spec(x_dims), "target": spec(dims), "weight": spec([()])}
    mesh = x.mesh
    meta = meta_call(op, args, kwargs)
    if reduction == "none":
        return OpSharding(specs, out_layout(mesh, dims, (), meta))
    axes = in_mesh_order(mesh, [a for d in dims for a in d])
    group = group_of(mesh, axes)
    ignore = bound["ignore_index"]

    def local(b):
        inp, tgt, w = b["input"], b["target"], b["weight"]
        total = F.nll_loss(inp, tgt, w, ignore_index=ignore, reduction="sum")
        if reduction == "sum":
            return total
        valid = tgt != ignore
        if w is None:
            den = valid.sum().to(total.dtype)
        else:
            den = (w[torch.where(valid, tgt, 0)] * valid.to(w.dtype)).sum()
        return total / group_psum(den.detach() if w is None else den, group)

    return OpSharding(specs, out_layout(mesh, [], axes, meta), local, by_name=True)


def _register():
    for name in (
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "soft_margin_loss",
        "margin_ranking_loss",
        "hinge_embedding_loss",
        "poisson_nll_loss",
        "kl_div",
    ):
        register_rule(getattr(F, name), pointwise_loss_rule)
    register_rule(F.nll_loss, nll_loss_rule)


_register()
