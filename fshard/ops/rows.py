"""Row blocks: a value split along dim 0 with per-rank row counts the ceil-div convention cannot
express, as a :class:`~fshard.spec.ExplicitLayout`.

Merging a batch split unevenly over ``dp`` with the dims after it (logits ``(B, T, V)`` with
rows ``2 | 1`` reshaped to ``(B*T, V)``: ``30 | 15`` rows where ceil-div would say ``23 | 22``)
keeps every rank's block contiguous, so the reshape is local: its result is an explicit layout
whose box on each rank is a range of rows, whole in every other dim. The rules that see such a
value take it as it is: elementwise ops and casts of values with the same row blocks, the
reshape back to a ``P`` layout, and ``F.cross_entropy`` (a loss pending over the axes the rows
vary over), so a causal LM's loss on an odd dp batch needs no communication of the logits.

Example:
    >>> lay = rows_layout(mesh, [(0, 30), (30, 45)], (45, 8), torch.float32)  # doctest: +SKIP
"""

from __future__ import annotations

import math

from ..spec import ExplicitLayout, Layout, _layout
from ._common import spec
from .registry import ExplicitRefused, OpSharding

__all__ = ["row_bounds", "row_axes", "rows_layout", "reshape_rows", "same_rows"]


def row_bounds(layout: Layout) -> tuple[tuple[int, int], ...] | None:
    """Each rank's ``[start, stop)`` of dim 0 (mesh order) when every rank's block is whole in
    every other dim and the layout is not partial; else ``None``."""
    if not layout.ndim or layout.partial:
        return None
    out = []
    for r in layout.mesh.ranks:
        m = layout.shard_metadata(r)
        if any(
            o or s != n for o, s, n in zip(m.shard_offsets[1:], m.shard_sizes[1:], layout.shape[1:])
        ):
            return None
        out.append((m.shard_offsets[0], m.shard_offsets[0] + m.shard_sizes[0]))
    return tuple(out)


def row_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes along which ``layout``'s blocks differ (the axes its rows vary over)."""
    mesh = layout.mesh
    axes = []
    for i, a in enumerate(mesh.axis_names):
        for r in mesh.ranks:
            c = list(mesh.coords(r))
            if c[i] + 1 < mesh.shape[i]:
                c[i] += 1
                if _box(layout.shard_metadata(r)) != _box(layout.shard_metadata(mesh.rank_at(c))):
                    axes.append(a)
                    break
    return tuple(axes)


def _box(meta):
    return meta.shard_offsets, meta.shard_sizes


def rows_layout(mesh, bounds, shape, dtype, axes=()) -> Layout:
    """The layout whose rank ``i`` holds rows ``bounds[i]`` of ``shape``: ``P(axes)`` on dim 0
    when that gives the same blocks, else an explicit layout."""
    shape = tuple(shape)
    if axes:
        lay = _layout(mesh, spec([axes]), shape, dtype)
        if row_bounds(lay) == tuple(bounds):
            return lay
    rest = shape[1:]
    chunks = [((a, *[0] * len(rest)), (b - a, *rest)) for a, b in bounds]
    return ExplicitLayout(mesh, chunks, shape, dtype)


def reshape_rows(x: Layout, dst: tuple[int, ...]) -> Layout | None:
    """The layout of ``x`` (row blocks: one split dim 0, or an explicit row layout) reshaped to
    ``dst`` when every rank's rows stay one contiguous range of ``dst``'s dim 0; else None."""
    bounds = row_bounds(x)
    if bounds is None or not dst or math.prod(dst) != math.prod(x.shape):
        return None
    rest_in, rest_out = math.prod(x.shape[1:]), math.prod(dst[1:])
    if rest_out == 0 or rest_in == 0:
        return None
    out = []
    for a, b in bounds:
        fa, fb = a * rest_in, b * rest_in
        if fa % rest_out or fb % rest_out:
            return None
        out.append((fa // rest_out, fb // rest_out))
    axes = row_axes(x) if x.is_explicit else x.dim_axes[0]
    return rows_layout(x.mesh, out, dst, x.dtype, axes)


def same_rows(layouts) -> tuple[tuple[int, int], ...] | None:
    """The row bounds every layout in ``layouts`` shares (same dim-0 size), else ``None``."""
    bounds = {(lay.shape[0] if lay.ndim else None, row_bounds(lay)) for lay in layouts}
    if len(bounds) != 1:
        return None
    ((_, b),) = bounds
    return b


def explicit_error(name: str, layouts) -> TypeError:
    """The refusal of a rule marked ``explicit_layouts``: the dispatcher catches it and makes
    the explicit inputs whole (gathers their blocks) before asking the rule again."""
    shown = ", ".join(f"{tuple(v.shape)} {v}" for v in layouts)
    return ExplicitRefused(
        f"{name}: an input has an explicit layout (row blocks, e.g. a reshape of an unevenly "
        f"split batch) that this op cannot take as it is (inputs: {shown}). Elementwise ops "
        "and casts of values with the same row blocks, reshapes and F.cross_entropy take it; "
        "otherwise reshard it first: fs.reshard(x, fs.P(...))"
    )


def row_wise_rule(op, ins, row: Layout, meta):
    """An op whose output row ``i`` depends on row ``i`` of ``row`` (an explicit row layout)
    and on the other tensor inputs whole (``x @ w``, ``F.linear``, ``addmm``): the others are
    replicated, the output keeps ``row``'s blocks. ``None`` when the op is not of that shape."""
    others = [x for x in ins if x is not row]
    if any(x.is_explicit for x in others) or meta.ndim != row.ndim:
        return None
    if not meta.ndim or meta.shape[0] != row.shape[0]:
        return None
    axes = row_axes(row)
    live = tuple(a for a in row.mesh.axis_names if row.mesh.size(a) > 1)
    if axes != live:  # the others would be pcast over every axis: only exact when rows vary
        return None  # over all of them
    bounds = row_bounds(row)
    if bounds is None:  # blocks split another dim too (a Layout.held of a column split)
        return None
    out = rows_layout(row.mesh, bounds, tuple(meta.shape), meta.dtype, axes)
    return OpSharding([None if x is row else spec([()] * x.ndim) for x in ins], out)
