"""Collectives as data: every communication fshard does, as a frozen op, and the one table that
runs them.

An *op* is plain hashable data keyed by mesh axes, dims and chunk sizes, never by a process
group, so the planner builds it on an abstract mesh (``Mesh.abstract``). Each op type carries

* ``name``: its printed name (``fs.plan``'s steps, the comm log's spelling of the collective);
* ``traffic(n)``: bytes a rank receives per input byte over ``n`` ranks (0 for local ops);
* ``transpose()``: the op its backward runs (linear ops), and ``batched(b)``: the op on a
  tensor with a leading batch dim of size ``b`` (the vmap rule);
* nonlinear ops (``linear = False``, :class:`Pmax`) instead save ``residuals(x, out)`` and give
  their ``vjp``/``jvp`` in terms of other ops.

A program runs on a real mesh as :class:`Bound` ops, each an op with its process group, bound
once where the program is built (``fshard.executor.program``, an op rule's compiled plan, a
``fs.lax`` call). :func:`run` looks the op's type up in :data:`RUN`, the one table from op type
to the ``_comm`` function (or the local torch code) that executes it; ``fshard.lax._Collective``
is the one autograd Function that applies a bound op.

Layering: this module imports ``_comm``, ``mesh`` and ``spec`` only; ``planner`` builds ops,
``lax`` differentiates them, ``executor`` and the op rules run them.

Example:
    >>> op = AllGather(("x",), dim=0, sizes=(3, 1), invariant=True)
    >>> op.name, op.transpose(), op.traffic(4)
    ('all_gather', LocalSlice(axes=('x',), dim=0, sizes=(3, 1)), 3)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import torch

from . import _comm
from .mesh import AxisGroup
from .spec import Layout, PartsLayout, chunk_bounds, parts_arranged, parts_chunked

__all__ = [
    "AllGather",
    "AllGatherParts",
    "AllToAll",
    "Bound",
    "Claim",
    "GatherBlocks",
    "GatherParts",
    "KeepBlock",
    "KeepFirst",
    "LocalSlice",
    "PartialCotangent",
    "Pcast",
    "Pmax",
    "Ppermute",
    "Psum",
    "PsumScatter",
    "PsumScatterParts",
    "RUN",
    "ScaleBySize",
    "SliceParts",
    "START",
    "Unvary",
    "ZeroOthers",
    "norm_dim",
    "run",
    "start",
]


def norm_dim(d: int, ndim: int, name: str = "dim") -> int:
    """``d`` as a non-negative dim of a tensor with ``ndim`` dims (a 0-d tensor takes 0 or -1).

    Example:
        >>> norm_dim(-1, 3)
        2
    """
    if isinstance(d, bool) or not isinstance(d, int):
        raise TypeError(f"{name} must be an int, got {d!r}")
    n = max(ndim, 1)
    if not -n <= d < n:
        raise ValueError(f"{name}={d} is out of range for a tensor with {ndim} dims")
    return d % n


# -- the ops ----------------------------------------------------------------------------------


class _Op:
    """Defaults of the op protocol: a linear op whose batching rule ignores the batch dim."""

    name: ClassVar[str]
    local: ClassVar[bool] = True  # no bytes on the wire
    linear: ClassVar[bool] = True

    def traffic(self, n: int) -> float:
        return 0

    def batched(self, batch: int):
        return self


class _OnDim(_Op):
    """An op on one tensor dim: batching shifts the dim."""

    def batched(self, batch: int):
        return replace(self, dim=self.dim + 1)


@dataclass(frozen=True)
class AllGather(_OnDim):
    """Concatenate every rank's block of ``dim`` in chunk order (``sizes``: uneven blocks).
    ``invariant``: the result's cotangent is taken as invariant (transpose: keep the local
    block); else varying (transpose: psum_scatter)."""

    axes: tuple[str, ...]
    dim: int
    sizes: tuple[int, ...] | None = None
    invariant: bool = False
    name: ClassVar[str] = "all_gather"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return n - 1

    def transpose(self):
        if self.invariant:
            return LocalSlice(self.axes, self.dim, self.sizes)
        return PsumScatter(self.axes, self.dim, self.sizes)


@dataclass(frozen=True)
class LocalSlice(_OnDim):
    """Keep this rank's block of ``dim`` (no communication)."""

    axes: tuple[str, ...]
    dim: int
    sizes: tuple[int, ...] | None = None
    name: ClassVar[str] = "slice"

    def transpose(self):
        return AllGather(self.axes, self.dim, self.sizes, invariant=True)


@dataclass(frozen=True)
class PsumScatter(_OnDim):
    """Sum over the group and keep this rank's block of ``dim`` (reduce_scatter)."""

    axes: tuple[str, ...]
    dim: int
    sizes: tuple[int, ...] | None = None
    name: ClassVar[str] = "reduce_scatter"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return (n - 1) / n

    def transpose(self):
        return AllGather(self.axes, self.dim, self.sizes, invariant=False)


@dataclass(frozen=True)
class Psum(_Op):
    """Sum over the group (all_reduce): varying in, invariant out. ``dtype``: the sum runs in
    that dtype (the input cast to it, the result cast back; mixed precision's
    ``reduce_dtype``), ``None``: in the input's own."""

    axes: tuple[str, ...]
    dtype: torch.dtype | None = None
    name: ClassVar[str] = "all_reduce"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return 2 * (n - 1) / n

    def transpose(self):
        return Pcast(self.axes, self.dtype)


@dataclass(frozen=True)
class Pcast(_Op):
    """Invariant -> varying: identity forward, psum backward (in ``reduce_dtype`` when given:
    the dtype of the gradient reduction travels on the op, see :mod:`fshard.precision`)."""

    axes: tuple[str, ...]
    reduce_dtype: torch.dtype | None = None
    name: ClassVar[str] = "pcast"

    def transpose(self):
        return Psum(self.axes, self.reduce_dtype)


@dataclass(frozen=True)
class Pmax(_Op):
    """Elementwise max (``how="min"``: min) over the group. Nonlinear: the cotangent goes to the
    elements equal to the result, shared among the ties (the tie mask is the residual).

    ``ties``: the input is ``stack([x, counts], -1)``, ``counts`` saying how many elements each
    of ``x`` stands for (a local ``amax`` before the pmax): a rank's share is weighted by it, so
    every global tie gets ``1/global count``, as dense torch gives (the local ``amax`` shares
    its part among its ``count`` ties)."""

    axes: tuple[str, ...]
    how: str = "max"
    ties: bool = False
    name: ClassVar[str] = "all_reduce"
    local: ClassVar[bool] = False
    linear: ClassVar[bool] = False

    def traffic(self, n):
        return 2 * (n - 1) / n

    def residuals(self, x, out):
        if self.ties:
            return ((x[..., 0] == out) * x[..., 1],)
        return (x == out,)

    def vjp(self, t, saved, apply_here: Callable):
        """``t`` shared among the ties; ``apply_here(op, tensor)`` runs an op on this group."""
        mask = saved[0].to(t.dtype)
        share = t * mask / apply_here(Psum(self.axes), mask)
        return torch.stack([share, torch.zeros_like(share)], -1) if self.ties else share

    def jvp(self, t, saved, apply_here: Callable):
        mask = saved[0].to(t.dtype)
        t = t[..., 0] if self.ties else t
        return apply_here(Psum(self.axes), t * mask / apply_here(Psum(self.axes), mask))


@dataclass(frozen=True)
class AllToAll(_Op):
    """Split ``split_dim`` into one block per rank, send block ``j`` to rank ``j``, concatenate
    what arrives along ``concat_dim``."""

    axes: tuple[str, ...]
    split_dim: int
    concat_dim: int
    split_sizes: tuple[int, ...] | None = None
    concat_sizes: tuple[int, ...] | None = None
    name: ClassVar[str] = "all_to_all"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return (n - 1) / n

    def transpose(self):
        a = self
        return AllToAll(a.axes, a.concat_dim, a.split_dim, a.concat_sizes, a.split_sizes)

    def batched(self, batch: int):
        return replace(self, split_dim=self.split_dim + 1, concat_dim=self.concat_dim + 1)


@dataclass(frozen=True)
class Ppermute(_Op):
    """Send from chunk ``src`` to chunk ``dst`` for each pair of ``perm``; a chunk that receives
    nothing gets zeros. ``out_shapes[j]``: what chunk ``j`` receives (uneven blocks; default
    its input's shape), ``in_shapes`` likewise for what it sends. ``tag``: the wire tag of its
    messages (0; a pipeline's transfers :data:`fshard._comm.AHEAD_TAG`, whose receives it posts
    ahead: no other ppermute's message can match them)."""

    axes: tuple[str, ...]
    perm: tuple[tuple[int, int], ...]
    in_shapes: tuple[tuple[int, ...], ...] | None = None
    out_shapes: tuple[tuple[int, ...], ...] | None = None
    tag: int = 0
    name: ClassVar[str] = "ppermute"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return 1

    def transpose(self):
        inverse = tuple((d, s) for s, d in self.perm)
        return Ppermute(self.axes, inverse, self.out_shapes, self.in_shapes, self.tag)

    def batched(self, batch: int):
        def grow(shapes):
            return None if shapes is None else tuple((batch, *s) for s in shapes)

        return replace(self, in_shapes=grow(self.in_shapes), out_shapes=grow(self.out_shapes))


@dataclass(frozen=True)
class ZeroOthers(_Op):
    """Replicated -> partial over the group (reshard's ``zero`` step): the group's first rank
    keeps the value, the others hold zeros (:func:`no_addend`: ``-0.0``; not ``x * 0``, which
    turns an ``inf`` into ``nan``), so the addends sum to it with no communication.

    Backward: the identity (:class:`PartialCotangent`). The cotangent of a partial value is
    invariant (as :class:`Claim` also relies on), and the sum of the addends depends on the
    replicated input with weight one. Its jvp is itself (linear) and its double backward
    :class:`ZeroOthers` again, as for ``pcast`` then a mask.
    """

    axes: tuple[str, ...]
    name: ClassVar[str] = "zero"

    def transpose(self):
        return PartialCotangent(self.axes)


@dataclass(frozen=True)
class PartialCotangent(_Op):
    """The backward of :class:`ZeroOthers`: a partial value's (invariant) cotangent is the
    replicated input's cotangent as it is."""

    axes: tuple[str, ...]
    name: ClassVar[str] = "partial_cotangent"

    def transpose(self):
        return ZeroOthers(self.axes)


@dataclass(frozen=True)
class Unvary(_Op):
    """Declare a value that varies in type but is equal in value over the group as invariant.

    Forward: identity. Backward: the cotangent of an invariant value arrives identical on every
    rank of the group, and each rank's backward then sends it through the varying computation,
    whose transposes sum the ``n`` copies; :class:`ScaleBySize` (``1/n``) counts it once. Used
    by ``shard_map`` at its output boundary (e.g. ``all_gather(to="varying")`` returned as
    ``P()``).
    """

    axes: tuple[str, ...]
    name: ClassVar[str] = "unvary"

    def transpose(self):
        return ScaleBySize(self.axes)


@dataclass(frozen=True)
class ScaleBySize(_Op):
    """Multiply by ``1 / n`` (``n``: the group's size); self-transpose. The backward of
    :class:`Unvary`."""

    axes: tuple[str, ...]
    name: ClassVar[str] = "scale"

    def transpose(self):
        return self


@dataclass(frozen=True)
class Claim(_Op):
    """Where a *leaf* with a partial layout (e.g. a parameter held as addends) is first used.

    Forward: identity. Backward: the cotangent of a partial value is invariant (the same full
    cotangent on every rank: each addend contributes to the sum with weight one), and that is
    what flows upstream of a partial *intermediate*. A leaf's gradient, however, is returned
    with the leaf's partial layout, whose local values are addends; so here the first rank of
    the partial axes keeps the cotangent and the others get zeros (:class:`KeepFirst`): the
    gradient then gathers to the dense gradient and an SGD step on the addends moves the sum
    once.
    """

    axes: tuple[str, ...]
    name: ClassVar[str] = "claim"

    def transpose(self):
        return KeepFirst(self.axes)


@dataclass(frozen=True)
class KeepFirst(_Op):
    """Multiply by 1 on the group's first rank and by 0 on the others; self-transpose. The
    backward of :class:`Claim`."""

    axes: tuple[str, ...]
    name: ClassVar[str] = "scale"

    def transpose(self):
        return self


@dataclass(frozen=True)
class GatherBlocks(_Op):
    """Explicit layout -> the full tensor on every rank: all_gather of padded flat blocks over
    the whole mesh, assembled by offsets (each rank receives ``(N-1)`` x the largest block,
    replicas included). Backward: :class:`KeepBlock` (no communication, as for ``gather``).
    ``batch``: leading batch dims (the vmap rule)."""

    layout: Layout
    batch: int = 0
    name: ClassVar[str] = "gather_blocks"
    local: ClassVar[bool] = False

    @property
    def axes(self) -> tuple[str, ...]:
        return self.layout.mesh.axis_names

    def traffic(self, n):
        return n - 1

    def transpose(self):
        return KeepBlock(self.layout, self.batch)

    def batched(self, batch: int):
        return replace(self, batch=self.batch + 1)


@dataclass(frozen=True)
class KeepBlock(_Op):
    """Keep this rank's box of an explicit layout (the backward of :class:`GatherBlocks`)."""

    layout: Layout
    batch: int = 0
    name: ClassVar[str] = "slice"

    @property
    def axes(self) -> tuple[str, ...]:
        return self.layout.mesh.axis_names

    def transpose(self):
        return GatherBlocks(self.layout, self.batch)

    def batched(self, batch: int):
        return replace(self, batch=self.batch + 1)


@dataclass(frozen=True)
class GatherParts(_OnDim):
    """A per-part layout's ``dim`` -> whole (:class:`~fshard.spec.PartsLayout`): every rank's
    block ``[its chunk of part 0 | of part 1 | ...]`` is all-gathered along ``dim``, then the
    chunks are put back in part order (a local permutation). Bytes as one all_gather of the
    dim; the result is invariant, so the backward is :class:`SliceParts` (no communication).

    ``sizes``: the parts' global sizes along ``dim``."""

    axes: tuple[str, ...]
    dim: int
    sizes: tuple[int, ...]
    name: ClassVar[str] = "gather_parts"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return n - 1

    def transpose(self):
        return SliceParts(self.axes, self.dim, self.sizes)


@dataclass(frozen=True)
class SliceParts(_OnDim):
    """Keep this rank's chunk of each part of ``dim`` (``sizes``), concatenated in part order
    (no communication). The backward of :class:`GatherParts` and the step into a per-part
    layout from one whose ``dim`` is whole."""

    axes: tuple[str, ...]
    dim: int
    sizes: tuple[int, ...]
    name: ClassVar[str] = "slice_parts"

    def transpose(self):
        return GatherParts(self.axes, self.dim, self.sizes)


@dataclass(frozen=True)
class PsumScatterParts(_OnDim):
    """A per-part layout's pending sum over ``axes`` -> each part split further over them
    (``src`` -> ``dst``, :class:`~fshard.spec.PartsLayout` s of the same parts; each rank's
    chunk of a part in ``dst`` lies inside its chunk in ``src``, in group order): one
    reduce_scatter of the block with the parts' pieces put in the group's chunk order first
    (:func:`~fshard.spec.parts_chunked`, a local permutation). FSDP's per-unit reduction of
    a param whose parts are split per part (Phi-3's ``qkv_proj`` under tp x FSDP)."""

    axes: tuple[str, ...]
    dim: int
    src: PartsLayout
    dst: PartsLayout
    name: ClassVar[str] = "reduce_scatter"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return (n - 1) / n

    def transpose(self):
        return AllGatherParts(self.axes, self.dim, self.src, self.dst)


@dataclass(frozen=True)
class AllGatherParts(_OnDim):
    """The transpose of :class:`PsumScatterParts` (``dst``'s blocks -> ``src``'s, varying):
    one all_gather over ``axes``, the pieces then put back in part order
    (:func:`~fshard.spec.parts_arranged`)."""

    axes: tuple[str, ...]
    dim: int
    src: PartsLayout
    dst: PartsLayout
    name: ClassVar[str] = "all_gather"
    local: ClassVar[bool] = False

    def traffic(self, n):
        return n - 1

    def transpose(self):
        return PsumScatterParts(self.axes, self.dim, self.src, self.dst)


def _psum_scatter_parts(op: PsumScatterParts, g: AxisGroup, x):
    # rows[j][i]: group chunk j's piece of part i in this rank's src block (its dst chunk)
    rows = op.dst.part_rows(g.ranks)
    t = parts_chunked(x.movedim(op.dim, 0), rows)  # the group's chunks in order
    out = _comm.reduce_scatter(t, g, 0, tuple(sum(r) for r in rows))
    return out.movedim(0, op.dim)


def _all_gather_parts(op: AllGatherParts, g: AxisGroup, x):
    rows = op.dst.part_rows(g.ranks)
    t = _comm.all_gather(x.movedim(op.dim, 0), g, 0, tuple(sum(r) for r in rows))
    return parts_arranged(t, rows).movedim(0, op.dim)


def part_pieces(sizes: tuple[int, ...], k: int) -> list[list[tuple[int, int]]]:
    """``pieces[j][i]``: ``(start, size)`` along the dim of chunk ``j`` of part ``i`` in the
    whole dim (parts of ``sizes`` each split into ``k`` ceil-div chunks).

    Example:
        >>> part_pieces((4, 2), 2)
        [[(0, 2), (4, 1)], [(2, 2), (5, 1)]]
    """
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    out = []
    for j in range(k):
        row = []
        for s, n in zip(starts, sizes):
            a, b = chunk_bounds(n, k, j)
            row.append((s + a, b - a))
        out.append(row)
    return out


class Bound(NamedTuple):
    """An op with the process group it runs over (``group.axes`` are the op's axes)."""

    op: Any
    group: AxisGroup

    def transpose(self) -> Bound:
        return Bound(self.op.transpose(), self.group)

    def batched(self, batch: int) -> Bound:
        return Bound(self.op.batched(batch), self.group)


# -- running them: one table from op type to what executes it -------------------------------


def _identity(op, g, x):
    return x.view_as(x)


def _local_slice(op: LocalSlice, g: AxisGroup, x):
    if op.sizes is None:
        start, stop = chunk_bounds(x.shape[op.dim], g.size, g.index)
    else:
        start = sum(op.sizes[: g.index])
        stop = start + op.sizes[g.index]
    # A contiguous block (a view when the slice already is one, e.g. dim 0): strided locals make
    # every later kernel and collective on them slower, in-place ones most.
    return x.narrow(op.dim, start, stop - start).contiguous()


def _ppermute_start(op: Ppermute, g: AxisGroup, x, ahead=None) -> _comm.Pending:
    out = None if op.out_shapes is None else op.out_shapes[g.index]
    return _comm.ppermute_start(x, g, op.perm, out, ahead, op.tag)


def _ppermute(op: Ppermute, g: AxisGroup, x):
    return _ppermute_start(op, g, x).wait()


def _psum(op: Psum, g: AxisGroup, x):
    if op.dtype is None or op.dtype == x.dtype:
        return _comm.all_reduce(x, g, "sum")
    return _comm.all_reduce(x.to(op.dtype), g, "sum", inplace=True).to(x.dtype)


def _psum_start(op: Psum, g: AxisGroup, x, ahead=None) -> _comm.Pending:
    if ahead is not None:
        raise ValueError("ahead= is a receive posted ahead: psum has none")
    if op.dtype is not None and op.dtype != x.dtype:  # the cast back needs the result
        return _comm.Pending(_psum(op, g, x))
    out, work = _comm.all_reduce_start(x, g, "sum")
    return _comm.Pending(out, () if work is None else (work,))


def _gather_blocks(op: GatherBlocks, g: AxisGroup, x):
    layout, lead = op.layout, tuple(x.shape[: op.batch])
    metas = [layout.shard_metadata(r) for r in g.ranks]
    sizes = [m.numel for m in metas]
    flat = x.contiguous().reshape(*lead, -1)
    if max(sizes) == 0:
        flat, sizes = flat.new_zeros(*lead, 1), [1] * len(sizes)
    flat = _comm.all_gather(flat, g, op.batch, sizes)
    out = x.new_empty(*lead, *layout.shape)
    start = 0
    for m, n in zip(metas, sizes):
        if m.numel:
            out[(..., *m.slices())] = flat[..., start : start + m.numel].view(*lead, *m.shard_sizes)
        start += n
    return out


def _gather_parts(op: GatherParts, g: AxisGroup, x):
    pieces = part_pieces(op.sizes, g.size)
    blocks = [sum(n for _, n in row) for row in pieces]
    flat = _comm.all_gather(x, g, op.dim, blocks)
    at, where = 0, []  # where each (chunk, part) piece sits in the gathered blocks
    for row in pieces:
        for _, n in row:
            where.append((at, n))
            at += n
    m = len(op.sizes)
    order = [where[j * m + i] for i in range(m) for j in range(g.size)]
    return torch.cat([flat.narrow(op.dim, a, n) for a, n in order if n], op.dim)


def _slice_parts(op: SliceParts, g: AxisGroup, x):
    row = part_pieces(op.sizes, g.size)[g.index]
    return torch.cat([x.narrow(op.dim, a, n) for a, n in row], op.dim)


def _keep_block(op: KeepBlock, g: AxisGroup, x):
    return x[(..., *op.layout.shard_metadata(g.ranks[g.index]).slices())].clone()


def no_addend(x: torch.Tensor) -> torch.Tensor:
    """Zeros like ``x`` that stand for "no addend" of a pending sum: ``-0.0`` for floating
    dtypes, the one zero with ``v + z == v`` for every ``v`` (``-0.0 + +0.0`` is ``+0.0``,
    which would turn a ``-0.0`` sum into ``+0.0``: ``atan2`` then differs by pi)."""
    if x.is_complex():
        return torch.full_like(x, complex(-0.0, -0.0))
    return torch.full_like(x, -0.0) if x.is_floating_point() else torch.zeros_like(x)


#: What executes each op type: ``RUN[type(op)](op, group, x)``.
RUN: dict[type, Callable] = {
    AllGather: lambda op, g, x: _comm.all_gather(x, g, op.dim, op.sizes),
    PsumScatter: lambda op, g, x: _comm.reduce_scatter(x, g, op.dim, op.sizes),
    Psum: _psum,
    Pmax: lambda op, g, x: _comm.all_reduce(x[..., 0] if op.ties else x, g, op.how),
    AllToAll: lambda op, g, x: _comm.all_to_all(
        x, g, op.split_dim, op.concat_dim, op.split_sizes, op.concat_sizes
    ),
    Ppermute: _ppermute,
    GatherBlocks: _gather_blocks,
    GatherParts: _gather_parts,
    PsumScatterParts: _psum_scatter_parts,
    AllGatherParts: _all_gather_parts,
    SliceParts: _slice_parts,
    LocalSlice: _local_slice,
    KeepBlock: _keep_block,
    Pcast: _identity,
    PartialCotangent: _identity,
    Unvary: _identity,
    Claim: _identity,
    ZeroOthers: lambda op, g, x: x.view_as(x) if g.index == 0 else no_addend(x),
    ScaleBySize: lambda op, g, x: x * (1.0 / g.size),
    KeepFirst: lambda op, g, x: x * (1.0 if g.index == 0 else 0.0),
}


#: The op types with an asynchronous lowering: ``START[type(op)](op, group, x, ahead)`` puts
#: the op on the wire and returns a :class:`fshard._comm.Pending` whose ``buffer`` the result
#: lands in (``RUN`` of these types is that launch, waited); ``ahead``: this rank's receives of
#: the op posted earlier (:func:`fshard._comm.receive_ahead`), or ``None``.
START: dict[type, Callable] = {
    Ppermute: _ppermute_start,
    Psum: _psum_start,
}


def run(b: Bound, x: torch.Tensor) -> torch.Tensor:
    """Execute bound op ``b`` on local tensor ``x`` (no autograd: see ``fshard.lax.apply``)."""
    return RUN[type(b.op)](b.op, b.group, x)


def start(b: Bound, x: torch.Tensor, ahead: _comm.Pending | None = None) -> _comm.Pending:
    """:func:`run` launched: a :class:`fshard._comm.Pending` whose ``.result()`` is ``run(b,
    x)`` (an op without an asynchronous lowering runs now). The comm-log record and the checks
    happen here, at launch (no autograd: see ``fshard.lax.apply_start``). ``ahead``: this
    rank's receives of the op, posted earlier (see ``START``)."""
    launch = START.get(type(b.op))
    if launch is None:
        if ahead is not None:
            raise ValueError(f"ahead= is for ops in START (ppermute, psum), not {b.op.name}")
        return _comm.Pending(run(b, x))
    return launch(b.op, b.group, x, ahead)
