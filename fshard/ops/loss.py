"""Loss rules: elementwise losses (mse, l1, smooth_l1, huber, bce, bce_with_logits) and nll.

Inputs are aligned like elementwise ops (no communication for matching layouts). With
``reduction="none"`` the loss keeps that layout; ``"sum"`` and ``"mean"`` sum the local block
and return a value *pending* over the split axes (``fs.gather`` or the next nonlinear op adds
the addends). ``"mean"`` divides by the GLOBAL element count, so uneven shards give the dense
mean. ``nll_loss`` needs the class dim whole; its ``"mean"`` divides by the global (weighted)
count of non-ignored targets: one ``psum`` of a scalar.

Example:
    >>> loss = F.mse_loss(pred, target)   # pred, target P("dp"): pending over "dp"  # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..spec import Layout
from ._common import group_of, in_mesh_order, meta_call, out_layout, psum, spec
from .elementwise import align, own_dims
from .registry import Plan, register_rule, tensor_inputs

__all__ = []


def _reduction(op, args, kwargs, pos):
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        raise NotImplementedError(
            f"{op.__name__} on a ShardedArray: the legacy size_average=/reduce= arguments are "
            "not supported; use reduction='mean'|'sum'|'none'"
        )
    return kwargs.get("reduction", args[pos] if len(args) > pos else "mean")


def pointwise_loss_rule(reduction_pos):
    """A loss that is elementwise before its reduction (``reduction`` at ``args[pos]``)."""

    def rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        reduction = _reduction(op, args, kwargs, reduction_pos)
        shape = torch.broadcast_shapes(*[x.shape for x in ins])
        dims = align(ins, shape)
        specs = [spec(own_dims(x, dims, shape)) for x in ins]
        mesh = ins[0].mesh
        meta = meta_call(op, args, kwargs)
        if reduction == "none":
            return Plan(specs, out_layout(mesh, dims, (), meta))
        axes = in_mesh_order(mesh, [a for d in dims for a in d])
        count = math.prod(shape)
        name = op.__name__
        fn = getattr(F, name)

        def local(*a, **k):
            if len(a) > reduction_pos:
                a = (*a[:reduction_pos], "sum", *a[reduction_pos + 1 :])
            else:
                k = {**k, "reduction": "sum"}
            total = fn(*a, **k)
            return total / count if reduction == "mean" else total

        return Plan(specs, out_layout(mesh, [], axes, meta), local)

    return rule


_NLL = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")


def nll_loss_rule(op, args, kwargs):
    bound = dict(zip(_NLL, args)) | kwargs
    x, t = bound["input"], bound["target"]
    reduction = _reduction(op, (), bound, 99)
    if not isinstance(t, Layout):
        raise TypeError("nll_loss: target must be a tensor")
    # input (N, C, d...) or (C,); target (N, d...): the class dim is whole, the rest align
    class_dim = 1 if x.ndim > 1 else 0
    rest = [x.dim_axes[d] for d in range(x.ndim) if d != class_dim]
    rest_layout = Layout(x.mesh, spec(rest), tuple(t.shape), x.dtype)
    dims = align([rest_layout, t], tuple(t.shape))
    x_dims = list(dims)
    x_dims.insert(class_dim, ())
    specs = {"input": spec(x_dims), "target": spec(dims), "weight": spec([()])}
    order = [n for n in _NLL[: len(args)] if isinstance(bound.get(n), Layout)]
    order += [n for n in sorted(kwargs) if isinstance(kwargs[n], Layout)]
    mesh = x.mesh
    meta = meta_call(op, args, kwargs)
    if reduction == "none":
        return Plan([specs[n] for n in order], out_layout(mesh, dims, (), meta))
    axes = in_mesh_order(mesh, [a for d in dims for a in d])
    group = group_of(mesh, axes)
    ignore = bound.get("ignore_index", -100)

    def local(*a, **k):
        b = dict(zip(_NLL, a)) | k
        inp, tgt, w = b["input"], b["target"], b.get("weight")
        total = F.nll_loss(inp, tgt, w, ignore_index=ignore, reduction="sum")
        if reduction == "sum":
            return total
        valid = tgt != ignore
        if w is None:
            den = valid.sum().to(total.dtype)
        else:
            den = (w[torch.where(valid, tgt, 0)] * valid.to(w.dtype)).sum()
        return total / psum(den.detach() if w is None else den, group)

    return Plan([specs[n] for n in order], out_layout(mesh, [], axes, meta), local)


def _register():
    for name, pos in (
        ("mse_loss", 4),
        ("l1_loss", 4),
        ("smooth_l1_loss", 4),
        ("huber_loss", 2),
        ("binary_cross_entropy", 5),
        ("binary_cross_entropy_with_logits", 5),
    ):
        register_rule(getattr(F, name), pointwise_loss_rule(pos))
    register_rule(F.nll_loss, nll_loss_rule)


_register()
