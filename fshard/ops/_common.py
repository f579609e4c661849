"""Helpers shared by the rule families: meta evaluation, spec building, local collectives."""

from __future__ import annotations

import math

import optree
import torch

from ..collectives import Bound, Pcast, Pmax, Psum, norm_dim
from ..lax import apply
from ..planner import in_mesh_order
from ..planner import plan as plan_steps
from ..spec import BaseLayout, Layout, P, _layout, spec_of_dims
from .registry import SCALAR, is_layout


def meta_call(op, args, kwargs):
    """Run ``op`` on meta tensors standing in for the Layouts: global output shape and dtype."""

    def to_meta(v):
        if isinstance(v, BaseLayout):
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        if v is SCALAR:
            return 0.5
        return v

    margs, mkwargs = optree.tree_map(to_meta, (args, kwargs), is_leaf=is_layout, none_is_leaf=True)
    # Outside every torch.func level: a rule planned inside vmap must not trip vmap's
    # randomness='error' check with the placeholder arguments (dropout's p=0.5).
    with torch._C._DisableFuncTorch():
        return op(*margs, **mkwargs)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's kernels compute a reduced-precision float in (``at::opmath_type``):
    float32 for bfloat16/float16, the dtype itself otherwise. A rule's local program for a
    normalization or softmax computes in it and rounds once at the end, as the dense kernel
    does (bf16 activations with fp32 weights are what autocast produces)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


spec = spec_of_dims  # the op rules' name for it


def out_layout(mesh, dims, partial, meta: torch.Tensor) -> Layout:
    return _layout(mesh, spec(dims, partial), tuple(meta.shape), meta.dtype)


def unreduced(layout: Layout) -> P:
    """``layout``'s spec with its pending sums removed (what a nonlinear op needs)."""
    return spec(layout.dim_axes)


def norm_dims(dims, ndim: int) -> tuple[int, ...]:
    """``None``/``()`` -> all dims; an int or sequence -> sorted non-negative dims."""
    if dims is None or (isinstance(dims, (tuple, list)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({norm_dim(d, ndim) for d in dims}))


def block_bounds(layout: Layout, dim: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s block of ``dim``."""
    block = layout.shard_metadata(rank).slices()[dim]
    return block.start, block.stop


def numel(shape) -> int:
    return math.prod(shape)


def reshard_cost(layout: Layout, target: P) -> float:
    """Bytes the mesh's first rank receives to reshard ``layout`` to ``target`` (from the
    planner's steps and each op's ``traffic``). The same number on every rank, so rules that
    compare costs decide alike (per-rank bytes differ for uneven shards)."""
    mesh = layout.mesh
    rank = mesh.ranks[0]
    return sum(
        s.op.traffic(mesh.size(s.axes)) * s.nbytes
        for s in plan_steps(layout, target, rank=rank)
        if s.collective
    )


# -- collectives of local tensors over an AxisGroup captured at plan time (None: no-op) ----
# Thin spellings of fshard.collectives ops applied with fshard.lax.apply (fs.lax.psum & co.
# take axis names and resolve the group per call; these do not).


def group_psum(t, group):
    """The sum of local ``t`` over ``group`` (:class:`fshard.collectives.Psum`)."""
    return t if group is None else apply(Bound(Psum(group.axes), group), t)


def group_pcast(t, group):
    """Local ``t`` marked varying over ``group`` (:class:`fshard.collectives.Pcast`: backward
    psum)."""
    if group is None or not t.requires_grad:
        return t
    return apply(Bound(Pcast(group.axes), group), t)


def group_pmax(t, group, how: str = "max", ties=None):
    """The elementwise max (``how="min"``: min) of local ``t`` over ``group``
    (:class:`fshard.collectives.Pmax`); ``ties``: the local tie count each element of ``t``
    stands for (see :func:`split_extreme`)."""
    if group is None:
        return t
    if ties is None:
        return apply(Bound(Pmax(group.axes, how), group), t)
    return apply(Bound(Pmax(group.axes, how, ties=True), group), torch.stack([t, ties], -1))


def split_extreme(t, dims, keepdim: bool, group, how: str = "max"):
    """``amax`` (``how="min"``: ``amin``) over ``dims`` of a value split over ``group`` along
    them: the local extreme, then a pmax weighted by each rank's tie count, so the gradient is
    shared evenly among all the global ties as dense torch shares it (the local ``amax`` shares
    among the rank's ``c`` ties, the pmax gives the rank ``c / global count``)."""
    if group is None:
        return safe_amax(t, dims, keepdim, how)
    m = safe_amax(t, dims, True, how)
    ties = None
    if t.is_floating_point() or t.is_complex():
        ties = (t == m.detach()).sum(dims, keepdim=keepdim).to(t.dtype)
    return group_pmax(m if keepdim else m.squeeze(dims), group, how, ties)


def safe_amax(x: torch.Tensor, dims, keepdim: bool, how: str = "max") -> torch.Tensor:
    """``amax`` (``how="min"``: ``amin``) that gives the reduction's identity over an empty
    (uneven) shard instead of raising: ``-inf``/``inf`` for floats, the dtype's least/greatest
    value for integers (an error here would be raised on the empty shard's rank alone)."""
    reduce = torch.amax if how == "max" else torch.amin
    if all(x.shape[d] > 0 for d in dims) or not dims:
        return reduce(x, dim=dims, keepdim=keepdim)
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    if not keepdim:
        shape = [s for d, s in enumerate(shape) if d not in dims]
    if x.dtype == torch.bool:
        return x.new_full(shape, how == "min")
    if not (x.is_floating_point() or x.is_complex()):
        info = torch.iinfo(x.dtype)
        return x.new_full(shape, info.min if how == "max" else info.max)
    fill = -math.inf if how == "max" else math.inf
    return x.new_full(shape, fill) + 0 * x.sum(dim=dims, keepdim=keepdim)  # keeps the graph


def group_of(mesh, axes):
    axes = in_mesh_order(mesh, axes)
    if not axes or mesh.is_abstract or mesh.size(axes) == 1:
        return None
    return mesh.group(axes)
