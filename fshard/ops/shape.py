"""Shape rules: permutations, reshape family, expand, cat/stack, split family.

- Permutations (``transpose``, ``permute``, ``t``, ``.T``, ``.mT``, ``movedim``) permute the
  spec; no communication.
- ``reshape``/``view``/``flatten``/``unflatten``/``squeeze``/``unsqueeze`` work on groups of
  dims whose products match. A group may be split over mesh axes only on its first input dim,
  and only when every rank's block stays one contiguous block of the first output dim under the
  flat ceil-div chunking. That covers every even split and uneven shards whenever the result is
  well defined (e.g. ``(5, 4)`` split on dim 0 -> ``(5, 2, 2)``). A split dim 0 merged with
  the dims after it whose uneven blocks ceil-div cannot express (rows ``2 | 1`` of
  ``(3, 15, V)`` -> ``(45, V)``) stays local too, in row blocks (:mod:`.rows`). Any other
  reshape moves the data first, as torch's ``reshape`` may copy: the split moved onto the
  group's first dim (an all_to_all: ``(batch, heads / tp, seq, dim) -> (batch * heads, seq,
  dim)`` before a ``bmm``) or the group gathered, whichever moves fewer bytes; the collective
  is in the op's plan and the comm log.
- ``expand`` keeps the spec (expanded size-1 dims must be unsplit; new dims are unsplit).
- ``cat``/``stack`` align inputs like elementwise ops with the cat dim unsplit; ``split``,
  ``chunk``, ``unbind``, ``narrow`` and ``select`` are local on unsplit dims and gather a split
  dim they cut first (indexing: :mod:`.indexing`).

Pending sums pass through every shape op (they are linear).

Example:
    >>> y = x.reshape(5, 2, 2)  # x (5, 4) P("x"): y P("x", None, None), no communication  # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..spec import BaseLayout, Layout, P
from . import parts, rows
from ._common import meta_call, norm_dim, out_layout, reshard_cost, spec
from .binding import bind
from .elementwise import align, own_dims
from .registry import SHAPE_ONLY, OpSharding, register_rule, tensor_inputs

__all__ = ["reshape_dims", "reshape_source", "permutation_rule", "reshape_rule"]


# -- permutations ---------------------------------------------------------------------------


def _permutation(op, args, kwargs, ndim: int) -> list[int]:
    """The input dim of each output dim, read off a meta tensor with distinct sizes."""
    probe = torch.empty([d + 2 for d in range(ndim)], device="meta")
    margs = [probe if isinstance(a, BaseLayout) else a for a in args]
    return [s - 2 for s in op(*margs, **kwargs).shape]


def permutation_rule(op, args, kwargs):
    """Ops that only reorder dims: no communication, the spec permuted."""
    (x,) = tensor_inputs(args, kwargs)
    perm = _permutation(op, args, kwargs, x.ndim)
    meta = meta_call(op, args, kwargs)
    dims = [x.dim_axes[p] for p in perm]
    return OpSharding([None], out_layout(x.mesh, dims, x.partial, meta))


def permutation_groups(op, args, kwargs, ins, outs) -> list:
    """A permutation keeps every dim whole: each output dim with the input dim it is (an
    :func:`fshard.ops.parts.aligned` op: a per-part dim moves, still per part)."""
    if len(ins) != 1 or not isinstance(outs, BaseLayout):
        return []
    perm = _permutation(op, args, kwargs, ins[0].ndim)
    return [[(("in", 0), p), (("out", 0), o)] for o, p in enumerate(perm)]


# -- reshape family -------------------------------------------------------------------------


def _groups(src, dst):
    """Pair dim groups of equal product: list of (src dims, dst dims)."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                pj *= dst[j]
                gj.append(j)
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def _group_axes(mesh, dim_axes, src, dst, gi, gj):
    """The mesh axes output dim ``gj[0]`` keeps when input dims ``gi`` (split as
    ``dim_axes[d]``) are reshaped locally into ``gj``; ``None`` when a rank's block would not
    stay one contiguous block of ``gj[0]`` (a split other than on ``gi[0]``, or chunks that do
    not line up)."""
    split = [d for d in gi if dim_axes[d]]
    if not split:
        return ()
    first = gi[0]
    if split != [first] or not gj:
        return None
    k = mesh.size(dim_axes[first])
    rest_in = math.prod(src[d] for d in gi[1:])
    rest_out = math.prod(dst[d] for d in gj[1:])
    if -(-src[first] // k) * rest_in != -(-dst[gj[0]] // k) * rest_out:
        return None
    return dim_axes[first]


def reshape_dims(layout: Layout, dst: tuple[int, ...]) -> list[tuple[str, ...]]:
    """The output dim axes of reshaping ``layout`` to ``dst`` locally, or a ``ValueError``
    (:func:`reshape_source` gives the layout to move the data to first)."""
    src = layout.shape
    out: list[tuple[str, ...]] = [()] * len(dst)
    if math.prod(src) == 0:
        if layout.sharded_axes:
            raise ValueError(
                f"reshape of an empty tensor {src} split as {layout.spec}; reshard it first"
            )
        return out
    for gi, gj in _groups(src, dst):
        axes = _group_axes(layout.mesh, layout.dim_axes, src, dst, gi, gj)
        if axes is None:
            dims = [() if d in gi else a for d, a in enumerate(layout.dim_axes)]
            raise ValueError(
                f"cannot reshape {src} with {layout.spec} to {tuple(dst)} without moving data: "
                f"dims {list(gi)} map to {list(gj)} and their split does not stay one "
                "contiguous block per rank (only the first dim of a merged/split group may be "
                "split, with chunks that line up); e.g. "
                f"x = fs.reshard(x, fs.{spec(dims, layout.partial)!r}) makes it local"
            )
        if axes:
            out[gj[0]] = axes
    return out


def reshape_source(layout: Layout, dst: tuple[int, ...]) -> P:
    """The spec to move ``layout`` to before reshaping it to ``dst``, for a reshape that cannot
    stay local (torch's ``reshape`` may copy too): per group of dims whose split breaks, the
    cheapest (:func:`reshard_cost`) of its splits moved onto the group's first dim (an
    all_to_all, e.g. ``(batch, heads / tp, seq, dim) -> (batch * heads, seq, dim)`` becomes a
    split of the batch), the first dim's own split kept alone, or the group whole (an
    all_gather); the other groups as they are."""
    src, mesh = layout.shape, layout.mesh
    dims = list(layout.dim_axes)
    for gi, gj in _groups(src, dst):
        if _group_axes(mesh, dims, src, dst, gi, gj) is not None:
            continue
        moved = tuple(a for d in gi for a in dims[d])
        options = []
        for first in (moved, dims[gi[0]], ()):
            cand = list(dims)
            for d in gi:
                cand[d] = ()
            cand[gi[0]] = first
            if _group_axes(mesh, cand, src, dst, gi, gj) is not None:
                options.append(cand)
        dims = min(options, key=lambda c: reshard_cost(layout, spec(c, layout.partial)))
    return spec(dims, layout.partial)


def reshape_rule(op, args, kwargs):
    """Reshapes: local where the split stays contiguous (:func:`reshape_dims`). A split batch
    merged with the dims after it whose uneven blocks ceil-div cannot express (rows ``2 | 1``
    of ``(3, 15, V)`` to ``(45, V)``) stays local too: its result has row blocks
    (:mod:`fshard.ops.rows`). Any other reshape moves the input first
    (:func:`reshape_source`: an all_to_all or an all_gather, in the op's plan)."""
    (x,) = tensor_inputs(args, kwargs)[:1]
    meta = meta_call(op, args, kwargs)
    dst = tuple(meta.shape)
    source = None
    try:
        if x.is_explicit:
            raise ValueError(f"cannot reshape {x} to {dst} without moving data")
        out = out_layout(x.mesh, reshape_dims(x, dst), x.partial, meta)
    except ValueError:
        out = rows.reshape_rows(x, dst)
        if out is not None:
            out = out.with_dtype(meta.dtype)
        elif x.is_explicit or math.prod(x.shape) == 0:
            raise
        else:
            source = reshape_source(x, dst)
            moved = x.with_spec(source)
            out = out_layout(x.mesh, reshape_dims(moved, dst), x.partial, meta)
    shape = None if x.mesh.is_abstract else out.local_shape()
    n_in = len(tensor_inputs(args, kwargs))
    return OpSharding(
        [source] + [SHAPE_ONLY] * (n_in - 1), out, lambda t, *a, **k: t.reshape(shape)
    )


# -- expand ---------------------------------------------------------------------------------


def expand_rule(op, args, kwargs):
    ins = tensor_inputs(args, kwargs)
    x = ins[0]
    meta = meta_call(op, args, kwargs)
    shape = tuple(meta.shape)
    off = len(shape) - x.ndim
    dims = [()] * off + [
        a if x.shape[d] == shape[off + d] else () for d, a in enumerate(x.dim_axes)
    ]
    out = out_layout(x.mesh, dims, x.partial, meta)
    local_shape = None if x.mesh.is_abstract else out.local_shape()
    specs = [spec(dims[off:], x.partial)] + [SHAPE_ONLY] * (len(ins) - 1)
    return OpSharding(specs, out, lambda t, *a, **k: t.expand(local_shape))


# -- cat / stack ----------------------------------------------------------------------------


def cat_rule(op, args, kwargs):
    ins = tensor_inputs(args, kwargs)
    meta = meta_call(op, args, kwargs)
    shape = tuple(meta.shape)
    stack = op is torch.stack
    dim = norm_dim(bind(op, args, kwargs)["dim"], len(shape))
    partials = {x.partial for x in ins}
    partial = ins[0].partial if len(partials) == 1 else ()
    if stack:
        shape_in = shape[:dim] + shape[dim + 1 :]
        dims = align(ins, shape_in, reserved=partial)
        out_dims = dims[:dim] + [()] + dims[dim:]
        specs = [spec(dims, partial) for _ in ins]
    else:
        same_rank = [x for x in ins if x.ndim == len(shape)]
        dims = align(same_rank, shape, reserved=(*partial, *_cat_dim_axes(same_rank, dim)))
        out_dims = dims
        specs = [spec(dims, partial) if x.ndim == len(shape) else None for x in ins]
    return OpSharding(specs, out_layout(ins[0].mesh, out_dims, partial, meta))


def _cat_dim_axes(ins, dim):
    return [a for x in ins for a in x.dim_axes[dim]]


# -- split family and indexing --------------------------------------------------------------


def _unsplit(x: Layout, dims) -> list:
    return [() if d in dims else a for d, a in enumerate(x.dim_axes)]


def split_rule(removes_dim: bool = False):
    """Rule for ops cutting their ``dim`` argument (split, chunk, unbind, select)."""

    def rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        x = ins[0]
        dim = norm_dim(bind(op, args, kwargs)["dim"], x.ndim)
        dims = _unsplit(x, {dim})
        meta = meta_call(op, args, kwargs)
        out_dims = [a for d, a in enumerate(dims) if not (removes_dim and d == dim)]
        specs = [spec(dims, x.partial)] + [None] * (len(ins) - 1)
        if isinstance(meta, torch.Tensor):
            return OpSharding(specs, out_layout(x.mesh, out_dims, x.partial, meta))
        outs = tuple(out_layout(x.mesh, out_dims, x.partial, m) for m in meta)
        return OpSharding(specs, outs)

    return rule


def atleast_rule(op, args, kwargs):
    """``atleast_1d/2d/3d``: each input reshaped as the op reshapes it (its new dims whole);
    the op runs on the blocks, which gain the same size-1 dims."""
    ins = tensor_inputs(args, kwargs)
    meta = meta_call(op, args, kwargs)
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    outs = [
        out_layout(x.mesh, reshape_dims(x, tuple(m.shape)), x.partial, m)
        for x, m in zip(ins, metas)
    ]
    out = outs[0] if not isinstance(meta, (tuple, list)) else type(meta)(outs)
    return OpSharding([None] * len(ins), out)


def broadcast_rule(op, args, kwargs):
    """``broadcast_tensors``: the inputs aligned as an elementwise op aligns them; each output
    has the common layout."""
    ins = tensor_inputs(args, kwargs)
    meta = meta_call(op, args, kwargs)
    shape = tuple(meta[0].shape)
    dims = align(ins, shape)
    specs = [spec(own_dims(x, dims, shape)) for x in ins]
    return OpSharding(specs, type(meta)(out_layout(ins[0].mesh, dims, (), m) for m in meta))


def pad_rule(op, args, kwargs):
    """``F.pad``: the padded (last ``len(pad) // 2``) dims are made whole, the others keep their
    axes. A pending sum survives zero padding only (``mode="constant"`` with no or int 0 value)."""
    bound = bind(op, args, kwargs)
    x, pad, mode, value = bound["input"], bound["pad"], bound["mode"], bound["value"]
    padded = set(range(x.ndim - len(pad) // 2, x.ndim))
    if mode != "constant":  # torch allows an empty block on the batch dim of (N, C, *) only
        batched = x.ndim == len(pad) // 2 + 2
        padded = set(range(1 if batched else 0, x.ndim))
    zero_fill = mode == "constant" and (value is None or (type(value) is int and value == 0))
    partial = x.partial if zero_fill else ()
    dims = _unsplit(x, padded)
    meta = meta_call(op, args, kwargs)
    return OpSharding([spec(dims, partial)], out_layout(x.mesh, dims, partial, meta))


def narrow_rule(op, args, kwargs):
    """``narrow(x, dim, start, length)``: ``start`` may be a 0-d tensor (plain or replicated)."""
    bound = bind(op, args, kwargs)
    x = bound["input"]
    dim = norm_dim(bound["dim"], x.ndim)
    start = bound["start"]
    if isinstance(start, BaseLayout):
        if start.ndim != 0 or start.dtype.is_floating_point or start.sharded_axes:
            raise TypeError(
                f"narrow: a tensor start must be a 0-d integer tensor, got {tuple(start.shape)} "
                f"{start.dtype} {start.spec}"
            )
        start = 0  # the output shape does not depend on it
    dims = _unsplit(x, {dim})
    meta = meta_call(op, (x, dim, start, bound["length"]), {})
    specs = [spec(dims, x.partial)] + [None] * (len(tensor_inputs(args, kwargs)) - 1)
    return OpSharding(specs, out_layout(x.mesh, dims, x.partial, meta))


def complex_view_rule(op, args, kwargs):
    """``view_as_real`` adds a whole trailing dim of 2; ``view_as_complex`` drops it (it must be
    whole). Other dims and pending sums pass through (both are linear views)."""
    x = args[0]
    meta = meta_call(op, args, kwargs)
    dims = list(x.dim_axes)
    if meta.ndim > x.ndim:
        in_spec, out_dims, local = None, [*dims, ()], None
    else:  # a last dim gathered from its blocks is a strided view: view_as_complex needs stride 1
        in_spec, out_dims = spec([*dims[:-1], ()], x.partial), dims[:-1]
        local = lambda t: torch.view_as_complex(t.contiguous())  # noqa: E731
    return OpSharding([in_spec], out_layout(x.mesh, out_dims, x.partial, meta), local)


def _register():
    perms = [torch.transpose, torch.permute, torch.t, torch.movedim, torch.swapaxes]
    perms += [torch.swapdims, torch.adjoint]
    permutation = parts.aligned(permutation_rule, permutation_groups)
    for op in perms:
        register_rule(op, permutation, aliases=(getattr(torch.Tensor, op.__name__),))
    for name in ("T", "mT", "H", "mH"):
        register_rule(getattr(torch.Tensor, name).__get__, permutation)
    reshape_rule.explicit_layouts = True
    local = lambda out: lambda t, *a, **k: t.reshape(out.local_shape())  # noqa: E731
    reshape = parts.aligned(reshape_rule, parts.reshape_groups, local)
    for n in ("reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "ravel"):
        register_rule(getattr(torch, n), reshape, aliases=(getattr(torch.Tensor, n),))
    for n in ("view", "view_as", "reshape_as"):
        register_rule(getattr(torch.Tensor, n), reshape)
    for n in ("atleast_1d", "atleast_2d", "atleast_3d"):
        register_rule(getattr(torch, n), atleast_rule)
    register_rule(torch.broadcast_tensors, broadcast_rule)
    register_rule(torch.Tensor.expand, expand_rule)
    register_rule(torch.Tensor.expand_as, expand_rule)
    register_rule(torch.broadcast_to, expand_rule, aliases=(torch.Tensor.broadcast_to,))
    for op in (torch.cat, torch.concat, torch.concatenate, torch.stack):
        register_rule(op, cat_rule)
    split = parts.cuts(split_rule(), parts.split_ranges)
    register_rule(torch.split, split, aliases=(torch.Tensor.split,))
    register_rule(torch.chunk, split, aliases=(torch.Tensor.chunk,))
    register_rule(
        torch.narrow, parts.cuts(narrow_rule, parts.narrow_range), aliases=(torch.Tensor.narrow,)
    )
    register_rule(F.pad, pad_rule)
    register_rule(torch.view_as_real, complex_view_rule)
    register_rule(torch.view_as_complex, complex_view_rule)
    register_rule(torch.unbind, split_rule(removes_dim=True), aliases=(torch.Tensor.unbind,))
    register_rule(torch.select, split_rule(removes_dim=True), aliases=(torch.Tensor.select,))


_register()
