"""Reduction rules: one rule for sum, mean, amax/amin, max/min, norm, logsumexp, var/std.

Reducing unsharded dims is local. Reducing a dim split over mesh axes ``A``:

- ``sum`` and ``mean`` (and ``nansum``, ``count_nonzero``) give a *partial* value over ``A`` (a pending sum: no communication until
  a nonlinear op or ``fs.gather`` needs the total; ``mean`` divides each addend by the global
  count). They are linear, so a partial input stays partial;
- ``amax``/``amin``/``max``/``min`` reduce locally, then ``pmax`` over ``A`` (the gradient goes
  to the maxima, every tie an equal share, as dense torch: the pmax weights each rank by its
  local tie count); empty uneven shards contribute the identity (``-inf``, or the integer
  dtype's least value); ``all``/``any``:
  the local result, then ``pmin``/``pmax`` over ``A`` (a replicated result: ``if
  mask.all():`` works on a sharded mask);
- ``logsumexp``: ``pmax`` of the local max, then ``psum`` of the shifted exponentials;
- ``norm``: ``psum`` of ``|x|^p`` (``pmax`` of ``|x|`` for ``p=inf``); ``var``/``std``: two
  ``psum`` passes (mean, then squared deviations), exact for uneven shards.

Nonlinear reductions of a partial input reduce it first (refused in strict mode). ``max(dim)``
and ``min(dim)`` with indices all-gather a split reduced dim first (``amax`` does not) and
return torch's ``torch.return_types`` (``.values``, ``.indices``). Values in row blocks
(:mod:`fshard.ops.rows`) reduce over dim 0 as over a split dim.

Example:
    >>> s = x.sum(0)        # x P("x", None): s is P(None, partial="x"), no communication  # doctest: +SKIP
    >>> m = torch.amax(x, 0)  # one all_reduce(max) of the local maxima  # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch

from ..spec import BaseLayout
from . import parts, rows
from ._common import (
    group_of,
    group_pcast,
    group_pmax,
    group_psum,
    in_mesh_order,
    meta_call,
    norm_dims,
    numel,
    out_layout,
    safe_amax,
    spec,
    split_extreme,
)
from .binding import bind
from .elementwise import NONLINEAR, elementwise_rule
from .registry import OpSharding, register_rule, tensor_inputs

__all__ = ["reduction_rule"]

LINEAR = ("sum", "mean")
#: Reductions whose split dims leave a pending sum (``nansum``, ``count_nonzero``: the sum of the
#: blocks' results; being nonlinear, they reduce a pending input first).
SUMMED = (*LINEAR, "nansum", "count_nonzero")


def _dim_arg(kind, args, kwargs):
    pos = 2 if kind in ("norm", "vector_norm") else 1
    if "dim" in kwargs:
        return kwargs["dim"]
    if "axis" in kwargs:  # torch's NumPy alias (ibert's x.mean(axis=2, keepdim=True))
        return kwargs["axis"]
    if len(args) > pos and not isinstance(args[pos], bool):
        return args[pos]
    return None


def _correction(args, kwargs) -> float:
    if "correction" in kwargs and kwargs["correction"] is not None:
        return kwargs["correction"]
    unbiased = kwargs.get("unbiased")
    bools = [a for a in args[1:] if isinstance(a, bool)]
    if unbiased is None and bools:
        unbiased = bools[0]
    return 0 if unbiased is False else 1


def reduction_rule(kind: str):
    """The rule for reduction ``kind`` (sum, mean, amax, amin, max, min, norm, ...)."""
    elementwise = elementwise_rule(NONLINEAR)

    def rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        if kind in ("max", "min") and len(ins) > 1:
            return elementwise(op, args, kwargs)  # torch.max(x, other)
        x = ins[0]
        if len(ins) != 1:
            raise TypeError(f"{op.__name__}: expected one tensor input, got {len(ins)}")
        dims = norm_dims(_dim_arg(kind, args, kwargs), x.ndim) if x.ndim else ()
        meta = meta_call(op, args, kwargs)
        metas = meta if isinstance(meta, tuple) else (meta,)
        keepdim = metas[0].ndim == x.ndim and x.ndim > 0
        if x.is_explicit:
            return _rows_rule(kind, op, x, dims, keepdim, meta)
        axes = in_mesh_order(x.mesh, [a for d in dims for a in x.dim_axes[d]])
        keep_partial = x.partial if kind in LINEAR else ()
        if kind in SUMMED:
            partial = in_mesh_order(x.mesh, (*keep_partial, *axes))
        else:
            partial = ()
        out_dims = [
            () if d in dims else x.dim_axes[d] for d in range(x.ndim) if keepdim or d not in dims
        ]
        in_spec = spec(x.dim_axes, keep_partial)
        if len(metas) > 1:  # max/min(dim) with indices: gather the reduced dim first
            whole = [() if d in dims else a for d, a in enumerate(x.dim_axes)]
            outs = tuple(out_layout(x.mesh, out_dims, (), m) for m in metas)
            return OpSharding([spec(whole)], outs)
        out = out_layout(x.mesh, out_dims, partial, meta)
        group = group_of(x.mesh, axes)
        local = _local_fn(kind, op, dims, keepdim, group, x, meta.dtype)
        return OpSharding([in_spec], out, local)

    rule.explicit_layouts = True
    return parts.aligned(rule, _groups(kind))


def _groups(kind: str):
    """The reduction's dim correspondences for per-part inputs (:mod:`.parts`): each kept dim
    with its output dim, each reduced dim alone (a reduction is order-free along it)."""

    def groups(op, args, kwargs, ins, outs):
        if len(ins) != 1:
            return parts.pointwise_groups(op, args, kwargs, ins, outs)  # torch.max(x, other)
        x = ins[0]
        dims = norm_dims(_dim_arg(kind, args, kwargs), x.ndim) if x.ndim else ()
        out = outs if isinstance(outs, BaseLayout) else outs[0]
        keepdim = out.ndim == x.ndim and x.ndim > 0
        kept = [d for d in range(x.ndim) if keepdim or d not in dims]
        result = [[(("in", 0), d)] for d in dims if not keepdim]
        for o, d in enumerate(kept):
            result.append([(("in", 0), d)] + [(("out", k), o) for k in range(len(_outs(outs)))])
        return result

    return groups


def _outs(outs):
    return [outs] if isinstance(outs, BaseLayout) else list(outs)


def _rows_rule(kind, op, x, dims, keepdim, meta):
    """A reduction of a value in row blocks (:mod:`fshard.ops.rows`): reducing dim 0 runs as
    over a split dim (``sum``/``mean`` leave a sum pending over the axes the rows vary over,
    ``amax``/``norm``/``var``... reduce over them); otherwise the rows stay."""
    bounds = rows.row_bounds(x)
    if bounds is None or isinstance(meta, tuple):
        raise rows.explicit_error(getattr(op, "__name__", str(op)), [x])
    axes = rows.row_axes(x)
    if 0 not in dims:
        return OpSharding([None], rows.rows_layout(x.mesh, bounds, meta.shape, meta.dtype, axes))
    out = out_layout(x.mesh, [()] * meta.ndim, axes if kind in SUMMED else (), meta)
    group = group_of(x.mesh, axes)
    return OpSharding([None], out, _local_fn(kind, op, dims, keepdim, group, x, meta.dtype))


def _local_fn(kind, op, dims, keepdim, group, x, out_dtype):
    if group is None:
        return None  # the op itself, on local tensors
    count = numel(x.shape[d] for d in dims)
    if kind in ("sum", "nansum", "count_nonzero"):
        return None
    if kind == "mean":
        return lambda t, *a, **k: torch.sum(t, dim=dims, keepdim=keepdim, dtype=out_dtype) / count
    if kind in ("amax", "max"):
        return lambda t, *a, **k: split_extreme(t, dims, keepdim, group)
    if kind in ("amin", "min"):
        return lambda t, *a, **k: split_extreme(t, dims, keepdim, group, "min")
    if kind == "logsumexp":

        def logsumexp(t, *a, **k):
            m = group_pmax(safe_amax(t, dims, True), group).detach()
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            s = group_psum(torch.sum(torch.exp(t - m), dim=dims, keepdim=True), group)
            out = m + torch.log(s)
            return out if keepdim else out.squeeze(dims)

        return logsumexp
    if kind in ("norm", "vector_norm"):

        def norm(t, *a, **k):
            p = k.get("ord" if kind == "vector_norm" else "p", a[0] if a else 2)
            if k.get("dtype") is not None:
                t = t.to(k["dtype"])
            return _split_norm(t, p, dims, keepdim, group)

        return norm
    if kind in ("var", "std"):

        def var(t, *a, **k):
            corr = _correction((None, *a), k)
            mean = group_psum(torch.sum(t, dim=dims, keepdim=True), group) / count
            d = t - group_pcast(mean, group)
            v = group_psum(torch.sum(d * d, dim=dims, keepdim=keepdim), group) / max(
                count - corr, 0
            )
            return _root(v, 2) if kind == "std" else v

        return var
    if kind in ("all", "any"):  # pmin/pmax of the local results (as uint8: reducible)
        reduce_local, how = (torch.all, "min") if kind == "all" else (torch.any, "max")

        def logical(t, *a, **k):
            local = reduce_local(t, dim=dims, keepdim=keepdim).to(torch.uint8)
            return group_pmax(local, group, how).to(out_dtype)

        return logical
    raise AssertionError(kind)


def _split_norm(t, p, dims, keepdim, group):
    """The vector ``p``-norm over ``dims`` of a value split over ``group`` along them."""
    if p in ("fro", None):
        p = 2
    if isinstance(p, (str, bool)) or not isinstance(p, (int, float)):
        raise NotImplementedError(
            f"torch.norm with p={p!r} over a dim split across ranks is not supported (a matrix "
            "norm needs the whole matrix); gather the reduced dims first "
            "(fs.reshard(x, fs.P(...)) with those dims None) or use fs.shard_map"
        )
    if p == math.inf:
        return split_extreme(t.abs(), dims, keepdim, group)
    if p == -math.inf:
        return split_extreme(t.abs(), dims, keepdim, group, "min")
    if p == 0:  # the count of non-zeros; its gradient is zero, as torch's
        nonzero = (t != 0).to(t.dtype) + 0 * t
        return group_psum(torch.sum(nonzero, dim=dims, keepdim=keepdim), group)
    s = group_psum(torch.sum(t.abs() ** p, dim=dims, keepdim=keepdim), group)
    return _root(s, p)


def _root(s: torch.Tensor, p) -> torch.Tensor:
    """``s ** (1/p)`` with gradient 0 where ``s == 0``, as torch's ``norm`` / ``std`` backward
    (it masks a zero result: there the root's derivative is infinite and the chain rule would
    give ``0 * inf = nan``)."""
    zero = s == 0
    root = torch.where(zero, torch.ones_like(s), s) ** (1.0 / p)
    return torch.where(zero, torch.zeros_like(s), root)


def histc_rule(op, args, kwargs):
    """``torch.histc``: bin counts add up over blocks, so a split input gives each rank its
    block's histogram, a pending sum over the split axes (MoE routers count tokens per expert
    this way). Without a range (``min == max``) the bins follow the data: the input is
    gathered. A pending input is reduced first (counting is not linear in the addends)."""
    bound = bind(op, args, kwargs)
    x, lo, hi = bound["input"], bound["min"], bound["max"]
    meta = meta_call(op, args, kwargs)
    if lo == hi:
        return OpSharding([spec([()] * x.ndim)], out_layout(x.mesh, [()], (), meta))
    summed = in_mesh_order(x.mesh, [a for axes in x.dim_axes for a in axes])
    return OpSharding([spec(x.dim_axes)], out_layout(x.mesh, [()], summed, meta))


def _register():
    register_rule(torch.histc, histc_rule, aliases=(torch.Tensor.histc,))
    kinds = ("sum", "mean", "amax", "amin", "max", "min", "norm", "logsumexp", "var", "std")
    for kind in (*kinds, "all", "any", "nansum", "count_nonzero"):
        rule = reduction_rule(kind)
        register_rule(getattr(torch, kind), rule, aliases=(getattr(torch.Tensor, kind),))
    register_rule(torch.linalg.vector_norm, reduction_rule("vector_norm"))


_register()
