"""Partition specs, layouts and per-rank shard metadata: pure layout math.

Nothing here talks to torch.distributed. A layout binds a mesh (real or abstract), a global
shape and a dtype to a rule that says, for any rank, which block of the global tensor that rank
holds. Two kinds, siblings behind :class:`BaseLayout` (as JAX's ``NamedSharding`` and
``GSPMDSharding`` behind ``Sharding``): :class:`Layout` places the blocks by a :class:`P`, and
:class:`ExplicitLayout` lists one box per rank. ``isinstance(x, BaseLayout)`` means "any layout"
(what an op rule's view holds for a tensor); ``isinstance(x, Layout)`` means "a P layout".

The one convention (DESIGN §2): a dim of size ``n`` split over mesh axes ``(a1..ak)`` has
``K = size(a1)*...*size(ak)`` chunks; a rank's chunk index is the mixed-radix number of its
coordinates on ``(a1..ak)`` with ``a1`` most significant; chunk ``j`` covers
``[min(j*c, n), min((j+1)*c, n))`` with ``c = ceil(n / K)``. Chunks may be smaller or empty
(2 over 4 gives 1, 1, 0, 0). For one axis this is ``torch.chunk`` / DTensor ``Shard``; for
even sizes it is JAX ``NamedSharding``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

AxisEntry = None | str | tuple[str, ...]

__all__ = [
    "P",
    "PartitionSpec",
    "Parts",
    "BaseLayout",
    "Layout",
    "ExplicitLayout",
    "HeldLayout",
    "PartsLayout",
    "ShardMetadata",
    "chunk_bounds",
    "chunk_index",
]


def _normalize_entry(entry: Any, position: int) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        if not entry:
            raise ValueError(f"P: entry {position} is an empty axis name; use None for 'not split'")
        return (entry,)
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) and a for a in entry):
        return tuple(entry)
    raise TypeError(
        f"P: entry {position} is {entry!r}; each entry must be None, a mesh axis name (str) "
        "or a tuple of axis names"
    )


class PartitionSpec:
    """How each tensor dim is split over mesh axes, plus pending-sum (partial) axes.

    ``P("x", None)``: dim 0 split over axis ``x``, dim 1 whole. ``P(("x", "y"))``: dim 0 split
    over the product of ``x`` and ``y`` (``x`` most significant). ``P(partial=("tp",))``: every
    rank of ``tp`` holds an addend; the value is their sum. Axes not named are replicated.
    Trailing ``None`` entries are implied, so ``P("x") == P("x", None)``.

    Example:
        >>> P("dp", None).dims
        (('dp',),)
        >>> P("dp") == P("dp", None)
        True
        >>> P(partial="tp").partial
        ('tp',)
        >>> P(("x", "y"), partial="z").axes  # every axis it names, dims first
        ('x', 'y', 'z')
    """

    __slots__ = ("_entries", "dims", "partial", "axes", "_key")

    def __init__(self, *entries: AxisEntry, partial: str | Sequence[str] = ()):
        dims = tuple(_normalize_entry(e, i) for i, e in enumerate(entries))
        if isinstance(partial, str):
            partial = (partial,)
        partial = tuple(partial)
        if not all(isinstance(a, str) and a for a in partial):
            raise TypeError(f"P: partial must be axis names (str), got {partial!r}")
        used = [a for d in dims for a in d] + list(partial)
        dup = sorted({a for a in used if used.count(a) > 1})
        if dup:
            raise ValueError(
                f"P: mesh axis {dup[0]!r} is used more than once in {self._fmt(entries, partial)}; "
                "a mesh axis may split at most one dim (or be partial), once"
            )
        object.__setattr__(self, "_entries", tuple(entries))
        object.__setattr__(self, "partial", partial)
        trimmed = list(dims)
        while trimmed and not trimmed[-1]:
            trimmed.pop()
        object.__setattr__(self, "dims", tuple(trimmed))
        # every mesh axis the spec names (dims first, then partial), e.g.
        # P(("x", "y"), partial="z").axes == ("x", "y", "z"): read by every op rule and
        # boundary, so made once
        object.__setattr__(self, "axes", tuple(a for d in self.dims for a in d) + partial)
        object.__setattr__(self, "_key", (self.dims, tuple(sorted(partial))))

    def __setattr__(self, name, value):
        raise AttributeError("P is immutable")

    def __reduce__(self):
        return (_make_spec, (self._entries, self.partial))

    @staticmethod
    def _fmt(entries, partial) -> str:
        inner = ", ".join(repr(e) for e in entries)
        if partial:
            inner += (", " if inner else "") + f"partial={tuple(partial)!r}"
        return f"P({inner})"

    def __repr__(self) -> str:
        return self._fmt(self._entries, self.partial)

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, PartitionSpec) and self._key == other._key)

    def __hash__(self) -> int:
        return hash(self._key)

    def __len__(self) -> int:
        return len(self.dims)

    def __iter__(self):
        return iter(self.dims)

    def padded(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        """The per-dim axis tuples, padded with ``()`` to ``ndim`` entries.

        Example:
            >>> P("x").padded(3)
            (('x',), (), ())
        """
        return self.dims + ((),) * (ndim - len(self.dims))


P = PartitionSpec


def _make_spec(entries, partial) -> PartitionSpec:
    return PartitionSpec(*entries, partial=partial)


class Parts:
    """A per-part split: dim ``dim`` is the concatenation of parts of ``sizes``, and *each part*
    is split on its own over the mesh axes ``spec`` gives that dim (DTensor's ``_StridedShard``,
    for parts of any sizes). ``spec`` lays out every other dim and the pending sums as usual.

    This is the layout of a fused projection: a ``[q | k | v]`` weight with fewer kv heads,
    ``[gate | up]``, GPT-2's ``c_attn``. With ``Parts(P("tp", None), 0, (q, k, v))`` rank ``r``
    holds ``[q_r | k_r | v_r]`` (its chunk of each part, by the ceil-div convention of DESIGN §2),
    so a linear layer's output holds whole heads of each part and slicing or splitting it at the
    part boundaries needs no communication. Op rules that take it: pointwise ops, casts and
    reductions, ``F.linear``/``matmul``/``addmm`` with the parts on the weight's out-features,
    reshapes that keep the parts dim, ``split``/``chunk``/slices at part boundaries (which
    give a ``P`` split) and indexing by ints / ``None`` / ``...`` that keeps the parts dim
    whole (``w[i]``); any other op first gathers the parts dim (one all_gather, in the comm
    log).

    Args:
        spec: a :class:`P` that splits ``dim`` (each part is split over those axes).
        dim: the dim made of parts (negative counts from the end).
        sizes: the parts' sizes along ``dim`` (two or more; they sum to the dim's size).

    Example:
        >>> from fshard import Layout, Mesh
        >>> fused = Parts(P("tp", None), 0, (4, 2, 2))  # [q | k | v] with half the kv heads
        >>> lay = Layout.of(Mesh.abstract((2,), ("tp",)), fused, (8, 3))
        >>> [[(m.shard_offsets[0], m.shard_sizes[0]) for m in lay.blocks(r)] for r in (0, 1)]
        [[(0, 2), (4, 1), (6, 1)], [(2, 2), (5, 1), (7, 1)]]
    """

    __slots__ = ("spec", "dim", "sizes", "_key")

    def __init__(self, spec: PartitionSpec, dim: int, sizes: Sequence[int]):
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"Parts: spec must be a fshard.P, got {type(spec).__name__} {spec!r}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"Parts: dim must be an int, got {dim!r}")
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise TypeError(f"Parts: sizes must be a sequence of ints, got {sizes!r}")
        if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
            raise ValueError(
                f"Parts: sizes must be two or more ints (one per part), got {tuple(sizes)!r}"
            )
        if any(s <= 0 for s in sizes):
            raise ValueError(f"Parts: every part must have a positive size, got {tuple(sizes)!r}")
        if dim >= 0 and not (spec.padded(dim + 1)[dim]):
            raise ValueError(
                f"Parts: {spec} does not split dim {dim}; name the axes each part is split over "
                f"in that dim's entry (e.g. P('tp', None) for dim 0), or use the P alone"
            )
        set_ = object.__setattr__
        set_(self, "spec", spec)
        set_(self, "dim", dim)
        set_(self, "sizes", tuple(sizes))
        set_(self, "_key", (spec, dim, tuple(sizes)))

    def __setattr__(self, name, value):
        raise AttributeError("Parts is immutable")

    def __reduce__(self):
        return (Parts, self._key)

    def __repr__(self) -> str:
        return f"Parts({self.spec}, dim={self.dim}, sizes={self.sizes})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Parts) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def partial(self) -> tuple[str, ...]:
        return self.spec.partial

    @property
    def axes(self) -> tuple[str, ...]:
        return self.spec.axes


def chunk_bounds(n: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of chunk ``index`` when ``n`` is split flat into ``num_chunks``.

    Example:
        >>> [chunk_bounds(2, 4, j) for j in range(4)]
        [(0, 1), (1, 2), (2, 2), (2, 2)]
    """
    c = -(-n // num_chunks)
    return min(index * c, n), min((index + 1) * c, n)


def nests(n: int, outer: int, inner: int) -> bool:
    """Whether the flat split of ``n`` into ``outer * inner`` chunks is the split into
    ``outer`` chunks each split flat again into ``inner`` (a dim split over axes ``(a, b)``
    is the concatenation of its ``a`` blocks each split over ``b``): always for ``n``
    divisible by ``outer * inner``, not for every uneven size.

    Example:
        >>> nests(8, 2, 2), nests(6, 2, 2), nests(5, 1, 2)
        (True, False, True)
    """
    for i in range(outer):
        b0, b1 = chunk_bounds(n, outer, i)
        for t in range(inner):
            a, b = chunk_bounds(b1 - b0, inner, t)
            if chunk_bounds(n, outer * inner, i * inner + t) != (b0 + a, b0 + b):
                return False
    return True


def canonical_spec(spec: PartitionSpec, axis_names: Sequence[str]) -> PartitionSpec:
    """The one spelling of ``spec``'s value that a layout holds and prints: ``None`` for a
    whole dim, an axis name for a dim split over one axis, a tuple for several, trailing whole
    dims dropped, the pending-sum axes in the mesh's order (``axis_names``).

    A :class:`P` prints as it was written (as JAX's ``PartitionSpec``), but it compares by
    value (``P(None) == P()``, ``P("x", None) == P("x")``), and layouts are cached by value: a
    layout holding the caller's spelling would print whichever spelling made it first. So a
    layout's spec is canonical, as JAX's computed shardings are (``PartitionSpec()`` for a
    replicated output, trailing ``None`` dropped): equal layouts print alike, whatever ran
    before.

    Example:
        >>> canonical_spec(P(None, ("x",), None, partial=("z", "y")), ("x", "y", "z"))
        P(None, 'x', partial=('y', 'z'))
        >>> canonical_spec(P(None), ("x",))
        P()
    """
    partial = tuple(a for a in axis_names if a in spec.partial)
    partial += tuple(a for a in spec.partial if a not in partial)  # not a mesh axis: as given
    entries = [None if not d else d[0] if len(d) == 1 else d for d in spec.dims]
    if list(spec._entries) == entries and spec.partial == partial:
        return spec
    return PartitionSpec(*entries, partial=partial)


def spec_of_dims(dims, partial=()) -> PartitionSpec:
    """A P from per-dim axis tuples, written the way a user would (``None``, ``"x"``).

    Example:
        >>> spec_of_dims([(), ("x",), ("y", "z")])
        P(None, 'x', ('y', 'z'))
    """
    entries = [None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims]
    return PartitionSpec(*entries, partial=tuple(partial))


def chunk_index(mesh, axes: tuple[str, ...], coords: tuple[int, ...]) -> tuple[int, int]:
    """``(index, count)``: which of the ``count`` chunks of a dim split over ``axes`` the mesh
    coordinates ``coords`` hold: the mixed-radix number of the coordinates on ``axes``, the first
    axis most significant (DESIGN §2). The one chunk arithmetic: layouts, ``Mesh.axis_index``
    and shard_map's size checks all call it, and :func:`chunk_bounds` turns it into a block.

    Example:
        >>> from fshard import Mesh
        >>> chunk_index(Mesh.abstract((2, 3), ("x", "y")), ("y", "x"), (1, 2))
        (5, 6)
        >>> chunk_index(Mesh.abstract((2, 3), ("x", "y")), (), (1, 2))
        (0, 1)
    """
    index, count = 0, 1
    for a in axes:
        ax = mesh.axis_index_of(a)
        index = index * mesh.shape[ax] + coords[ax]
        count *= mesh.shape[ax]
    return index, count


@dataclass(frozen=True)
class ShardMetadata:
    """One rank's block of a global tensor (field names as the seed's ShardMetadata).

    Example:
        >>> ShardMetadata((3, 0), (2, 6), "rank:1/cpu").shard_sizes
        (2, 6)
    """

    shard_offsets: tuple[int, ...]
    shard_sizes: tuple[int, ...]
    placement: str

    def __post_init__(self):
        if len(self.shard_offsets) != len(self.shard_sizes):
            raise ValueError(
                f"ShardMetadata: shard_offsets has {len(self.shard_offsets)} entries and "
                f"shard_sizes has {len(self.shard_sizes)}; they must have one entry per dim"
            )
        if any(o < 0 for o in self.shard_offsets):
            raise ValueError(f"ShardMetadata: shard_offsets must be >= 0, got {self.shard_offsets}")
        if any(s < 0 for s in self.shard_sizes):
            raise ValueError(f"ShardMetadata: shard_sizes must be >= 0, got {self.shard_sizes}")

    @property
    def numel(self) -> int:
        return math.prod(self.shard_sizes)

    def slices(self) -> tuple[slice, ...]:
        """Index into the global tensor that selects this block.

        Example:
            >>> ShardMetadata((3, 0), (2, 6), "rank:1/cpu").slices()
            (slice(3, 5, None), slice(0, 6, None))
        """
        return tuple(slice(o, o + s) for o, s in zip(self.shard_offsets, self.shard_sizes))

    def to_torch(self):
        """The equivalent ``torch.distributed._shard.metadata.ShardMetadata``."""
        from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata

        return TorchShardMetadata(list(self.shard_offsets), list(self.shard_sizes), self.placement)


def _check_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be a tuple of ints, got {type(shape).__name__} {shape!r}")
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"shape must be a tuple of ints, got {shape!r} (entry {s!r})")
        if s < 0:
            raise ValueError(f"shape must be non-negative, got {tuple(shape)!r}")
    return tuple(shape)


_IDS: dict = {}


#: token -> the first Layout of that value (torch.compile plans ops from tokens: see
#: fshard.ops.registry._traced_plan)
LAYOUT_OF_ID: dict = {}


def _intern(value: tuple, layout: Layout) -> str:
    """A process-wide token per distinct layout value (``Layout._id``): equal layouts share one
    token, a string whose hash is cached and which compares by identity first. Op-dispatch
    cache keys use it because ``Layout.__hash__`` is a Python call (a dict probe keyed by two
    layouts: 347 ns, by two C-hashed keys: 170 ns); a token never equals a static argument (an
    int id would equal ``3`` or ``True``; no argument is spelled ``"\0layout<n>"``). A string,
    not an ``object()``, because dynamo guards a string attribute by value, so a compiled
    function sees every equal layout as the same constant."""
    token = _IDS.get(value)
    if token is None:
        n = len(LAYOUT_OF_ID)
        # a number no layout holds: a layout built while dynamo traced (shard_map's outputs)
        # was interned by the trace's replay, which can leave LAYOUT_OF_ID a token _IDS lacks
        while f"\0layout{n}" in LAYOUT_OF_ID:
            n += 1
        token = _IDS.setdefault(value, f"\0layout{n}")
        LAYOUT_OF_ID.setdefault(token, layout)
    return token


class BaseLayout:
    """What every layout is (JAX's ``Sharding``): a mesh, a global shape, a dtype, and for each
    rank the block of the global tensor that rank holds.

    The members every consumer may use, on either kind: ``mesh``, ``shape``, ``dtype``,
    ``ndim``, ``nbytes``, ``spec`` (the :class:`P`, or ``None`` where no P describes the
    blocks), ``partial``, ``sharded_axes``, ``varying_axes``, ``is_explicit``,
    ``shard_metadata(rank)``, ``shards_metadata()``, ``local_shape(rank)``, ``with_spec(spec)``
    (the same value laid out by a P), ``with_dtype(dtype)``, and ``_id``, a process-wide token per
    distinct value that cache keys use. Hashable and immutable; equal values are equal layouts.
    The two kinds are :class:`Layout` and :class:`ExplicitLayout`.

    Example:
        >>> from fshard import Mesh
        >>> m = Mesh.abstract((2,), ("x",))
        >>> [isinstance(lay, BaseLayout) for lay in (Layout(m, P("x"), (4,)),
        ...                                          Layout.explicit(m, [((0,), (4,))] * 2, (4,)))]
        [True, True]
    """

    __slots__ = ("mesh", "shape", "dtype", "_hash", "_id", "__weakref__")

    #: True for an :class:`ExplicitLayout` (arbitrary per-rank boxes, no partition spec).
    is_explicit: bool = False
    #: The attribute an op rule sets to say it takes this kind of layout as it is (a rule
    #: without it sees :meth:`made_whole` instead); ``None``: every rule takes it.
    rule_flag: str | None = None

    def _set_value(self, mesh, shape: tuple[int, ...], dtype: torch.dtype, value: tuple) -> None:
        """Set the fields every layout has; ``value`` is the tuple equality and hash use."""
        set_ = object.__setattr__
        set_(self, "mesh", mesh)
        set_(self, "shape", shape)
        set_(self, "dtype", dtype)
        set_(self, "_hash", hash(value))
        set_(self, "_id", _intern(value, self))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __hash__(self) -> int:
        return self._hash

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the global value."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    def shard_metadata(self, rank: int) -> ShardMetadata:
        """The block held by ``rank`` (a global rank of the mesh). Pure; works on abstract meshes."""
        raise NotImplementedError

    def shards_metadata(self) -> list[ShardMetadata]:
        """Every rank's block, in rank order (mesh position order)."""
        return [self.shard_metadata(r) for r in self.mesh.ranks]

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor (default: this process's rank)."""
        return self.shard_metadata(self.mesh.rank if rank is None else rank).shard_sizes

    def with_spec(self, spec: PartitionSpec | Parts) -> Layout:
        """The same value (mesh, shape, dtype) laid out by ``spec`` (a :class:`P` or a
        :class:`Parts`)."""
        return _layout(self.mesh, spec, self.shape, self.dtype)

    def made_whole(self) -> Layout:
        """The :class:`Layout` an op rule that does not take this kind of layout sees instead
        (the dispatcher reshards the value to it first): the layout itself for a
        :class:`Layout`, the replicated value for an :class:`ExplicitLayout`, the parts dim
        gathered for a :class:`PartsLayout`."""
        return self.with_spec(P())


class Layout(BaseLayout):
    """Static description of a sharded value: ``(mesh, spec, global shape, dtype)`` (JAX's
    ``NamedSharding``).

    Hashable and immutable; every per-rank quantity is computed once and cached.

    Args:
        mesh: a :class:`fshard.Mesh` (real or abstract).
        spec: a :class:`P`; shorter than the shape means trailing dims are whole. The layout
            holds it in its canonical spelling (:func:`canonical_spec`): ``Layout(m, P("x",
            None), s).spec`` prints ``P('x')``, whatever spelling made an equal layout first.
        shape: the global shape (never inferred from local sizes).
        dtype: element type of the value (default float32).

    Example:
        >>> from fshard import Mesh
        >>> lay = Layout(Mesh.abstract((4,), ("x",)), P("x"), (10, 6))
        >>> [m.shard_sizes for m in lay.shards_metadata()]
        [(3, 6), (3, 6), (3, 6), (1, 6)]
        >>> lay2 = Layout(Mesh.abstract((2, 2), ("dp", "tp")), P("tp"), (10, 6))
        >>> lay2.local_shape(1), lay2.nbytes, lay2.varying_axes
        ((5, 6), 240, frozenset({'tp'}))
    """

    __slots__ = ("spec", "dim_axes")

    def __init__(self, mesh, spec: PartitionSpec, shape, dtype: torch.dtype = torch.float32):
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"spec must be a fshard.P, got {type(spec).__name__} {spec!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = _check_shape(shape)
        if len(spec) > len(shape):
            raise ValueError(
                f"spec {spec} has {len(spec)} entries but the tensor has {len(shape)} dims "
                f"(shape {shape}); a spec may not be longer than the tensor's ndim"
            )
        unknown = [a for a in spec.axes if a not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"spec {spec} names axis {unknown[0]!r}, which is not an axis of the mesh; "
                f"the mesh axes are {mesh.axis_names}"
            )
        spec = canonical_spec(spec, mesh.axis_names)  # equal layouts print alike
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "dim_axes", spec.padded(len(shape)))
        self._set_value(mesh, shape, dtype, (mesh, spec, shape, dtype))

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, Layout)
            and self._hash == other._hash
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.spec == other.spec
            and self.mesh == other.mesh
        )

    __hash__ = BaseLayout.__hash__

    def __repr__(self) -> str:
        return f"Layout({self.mesh!r}, {self.spec}, shape={self.shape}, dtype={self.dtype})"

    def __reduce__(self):
        return (Layout, (self.mesh, self.spec, self.shape, self.dtype))

    def made_whole(self) -> Layout:
        return self

    @staticmethod
    def of(mesh, spec: PartitionSpec | Parts, shape, dtype: torch.dtype = torch.float32):
        """The layout ``spec`` gives ``shape`` on ``mesh``: a :class:`Layout` for a :class:`P`,
        a :class:`PartsLayout` for a :class:`Parts`.

        Example:
            >>> from fshard import Mesh
            >>> m = Mesh.abstract((2,), ("tp",))
            >>> type(Layout.of(m, P("tp"), (6,))).__name__, Layout.of(m, Parts(P("tp"), 0, (4, 2)), (6,)).local_shape(0)
            ('Layout', (3,))
        """
        if isinstance(spec, Parts):
            return PartsLayout(mesh, spec, shape, dtype)
        return Layout(mesh, spec, shape, dtype)

    @property
    def partial(self) -> tuple[str, ...]:
        return self.spec.partial

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dim_axes for a in d)

    @property
    def varying_axes(self) -> frozenset[str]:
        """Axes over which ranks hold different data (sharded or partial)."""
        return frozenset(self.sharded_axes) | frozenset(self.partial)

    @staticmethod
    def explicit(mesh, chunks, shape, dtype: torch.dtype = torch.float32) -> ExplicitLayout:
        """A layout from arbitrary per-rank boxes (the expressiveness of ``EnumerableShardingSpec``).

        One box per rank of the mesh, in ``mesh.ranks`` order. Boxes may be empty (a size of 0
        in some dim). **Replication:** several ranks may hold the *identical* box (same offsets
        and sizes); they are replicas of that block. Distinct non-empty boxes must not overlap,
        and together they must cover the whole tensor. There are no partial (pending-sum)
        explicit layouts.

        ``fs.gather`` and ``fs.reshard`` accept explicit layouts (reshard *from* an explicit
        layout to any :class:`P`); the spec of an explicit layout is ``None``. An op whose rule
        does not take explicit layouts (most; row blocks are taken by a few, see
        ``fshard/ops/rows.py``) gathers the blocks first (one all_gather over the mesh).

        Args:
            mesh: a :class:`fshard.Mesh` (real or abstract).
            chunks: one entry per rank, in ``mesh.ranks`` order; each a :class:`ShardMetadata`
                (its placement is ignored), a torch ``ShardMetadata``, or an
                ``(offsets, sizes)`` pair of int sequences.
            shape: the global shape.
            dtype: element type (default float32).

        Returns:
            An :class:`ExplicitLayout` (a :class:`BaseLayout`, not a :class:`Layout`; hashable,
            immutable, picklable).

        Raises:
            ValueError: wrong number of boxes, wrong rank (ndim), a box out of bounds, two
                distinct boxes overlapping, or boxes that do not cover the tensor.

        Example:
            >>> from fshard import Mesh
            >>> m = Mesh.abstract((3,), ("x",))
            >>> lay = Layout.explicit(m, [((0, 0), (2, 4)), ((2, 0), (1, 4)), ((2, 0), (1, 4))], (3, 4))
            >>> lay.shard_metadata(2).shard_offsets
            (2, 0)
        """
        return ExplicitLayout(mesh, chunks, shape, dtype)

    @staticmethod
    def held(base: Layout, axis: str, index: int) -> HeldLayout:
        """``base``'s value held by the ranks at coordinate ``index`` of ``axis`` only (empty
        blocks elsewhere): a pipeline stage's params (see :class:`HeldLayout`).

        Example:
            >>> from fshard import Mesh
            >>> m = Mesh.abstract((2,), ("pp",))
            >>> Layout.held(Layout(m, P(), (2, 3)), "pp", 1).local_shape(0)
            (0, 3)
        """
        return HeldLayout(base, axis, index)

    def with_dtype(self, dtype: torch.dtype) -> Layout:
        return _layout(self.mesh, self.spec, self.shape, dtype)

    def shard_metadata(self, rank: int) -> ShardMetadata:
        """The block held by ``rank`` (a global rank of the mesh). Pure; works on abstract meshes."""
        return _shard_metadata(self, rank)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=4096)
def _layout(mesh, spec, shape, dtype) -> Layout:
    return Layout.of(mesh, spec, shape, dtype)


@functools.lru_cache(maxsize=65536)
def _shard_metadata(layout: Layout, rank: int) -> ShardMetadata:
    coords = layout.mesh.coords(rank)
    offsets, sizes = [], []
    for n, axes in zip(layout.shape, layout.dim_axes):
        index, count = chunk_index(layout.mesh, axes, coords)
        start, stop = chunk_bounds(n, count, index)
        offsets.append(start)
        sizes.append(stop - start)
    return ShardMetadata(tuple(offsets), tuple(sizes), layout.mesh.placement(rank))


def _box_of(entry: Any, i: int, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if hasattr(entry, "shard_offsets") and hasattr(entry, "shard_sizes"):  # fshard's or torch's
        offsets, sizes = entry.shard_offsets, entry.shard_sizes
    elif isinstance(entry, (tuple, list)) and len(entry) == 2:
        offsets, sizes = entry
    else:
        raise TypeError(
            f"Layout.explicit: chunks[{i}] is {entry!r}; each chunk must be a ShardMetadata or "
            "an (offsets, sizes) pair of int sequences"
        )
    try:
        offsets = tuple(int(o) for o in offsets)
        sizes = tuple(int(s) for s in sizes)
    except (TypeError, ValueError):
        raise TypeError(
            f"Layout.explicit: chunks[{i}] has offsets {offsets!r} and sizes {sizes!r}; both must "
            "be sequences of ints"
        ) from None
    if len(offsets) != len(sizes):
        raise ValueError(
            f"Layout.explicit: chunks[{i}] has {len(offsets)} offsets and {len(sizes)} sizes; "
            "they must have one entry per dim"
        )
    if len(offsets) != ndim:
        raise ValueError(
            f"Layout.explicit: Rank of tensor is {ndim}, but shards rank is {len(offsets)} "
            f"(chunks[{i}] = offsets {offsets}, sizes {sizes})"
        )
    if any(o < 0 for o in offsets) or any(s < 0 for s in sizes):
        raise ValueError(
            f"Layout.explicit: chunks[{i}] has offsets {offsets} and sizes {sizes}; both must "
            "be >= 0"
        )
    return offsets, sizes


def _boxes_overlap(a, b) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


class ExplicitLayout(BaseLayout):
    """A layout given by one explicit box per rank (JAX's ``GSPMDSharding``, torch's
    ``EnumerableShardingSpec``); build it with :meth:`Layout.explicit`.

    ``chunks`` holds ``(offsets, sizes)`` per rank in ``mesh.ranks`` order; ``spec`` is ``None``
    (no partition spec describes the boxes). Equality and hash use ``(mesh, chunks, shape,
    dtype)``. An ExplicitLayout is not a :class:`Layout`: only op rules that declare
    ``explicit_layouts`` (row blocks, :mod:`fshard.ops.rows`) see one, and the planner gathers
    its blocks (``gather_blocks``) before any per-axis step.
    """

    __slots__ = ("chunks",)

    is_explicit = True
    rule_flag = "explicit_layouts"
    spec = None

    def __init__(self, mesh, chunks, shape, dtype: torch.dtype = torch.float32):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Layout.explicit: dtype must be a torch.dtype, got {dtype!r}")
        shape = _check_shape(shape)
        if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
            raise TypeError(
                f"Layout.explicit: chunks must be a sequence with one box per rank, got "
                f"{type(chunks).__name__}"
            )
        n = len(mesh.ranks)
        if len(chunks) != n:
            raise ValueError(
                f"Layout.explicit: got {len(chunks)} chunks for a mesh of {n} ranks "
                f"({mesh!r}); give exactly one box per rank, in mesh.ranks order (an empty box "
                "is a size of 0 in some dim)"
            )
        boxes = tuple(_box_of(c, i, len(shape)) for i, c in enumerate(chunks))
        for i, (offsets, sizes) in enumerate(boxes):
            for d, (o, s, dim) in enumerate(zip(offsets, sizes, shape)):
                if s and o + s > dim:
                    raise ValueError(
                        f"Layout.explicit: Shard offset {o} and length {s} exceeds tensor dim: "
                        f"{dim} (dim {d}) for shard chunks[{i}] = offsets {offsets}, sizes "
                        f"{sizes} of a tensor of shape {shape}"
                    )
        distinct: dict = {}
        for i, box in enumerate(boxes):
            if math.prod(box[1]) and box not in distinct:
                distinct[box] = i
        items = sorted(distinct.items(), key=lambda kv: kv[0][0])
        for a in range(len(items)):
            for b in range(a + 1, len(items)):
                (ba, ia), (bb, ib) = items[a], items[b]
                if _boxes_overlap(ba, bb):
                    first, second = sorted((ia, ib))
                    raise ValueError(
                        f"Layout.explicit: Shards chunks[{first}] (offsets {boxes[first][0]}, "
                        f"sizes {boxes[first][1]}) and chunks[{second}] (offsets "
                        f"{boxes[second][0]}, sizes {boxes[second][1]}) overlap; distinct boxes "
                        "must not overlap (ranks holding a replica must give the identical box)"
                    )
        volume = sum(math.prod(box[1]) for box in distinct)
        want = math.prod(shape)
        if volume != want:
            raise ValueError(
                f"Layout.explicit: Total volume of shards: {volume} does not match tensor "
                f"volume: {want}, in other words the distinct boxes do not cover the entire "
                f"tensor of shape {shape}"
            )
        object.__setattr__(self, "chunks", boxes)
        self._set_value(mesh, shape, dtype, ("explicit", mesh, boxes, shape, dtype))

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, ExplicitLayout)
            and self._hash == other._hash
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.chunks == other.chunks
            and self.mesh == other.mesh
        )

    __hash__ = BaseLayout.__hash__

    def __repr__(self) -> str:
        return (
            f"Layout.explicit({self.mesh!r}, {len(self.chunks)} chunks, shape={self.shape}, "
            f"dtype={self.dtype})"
        )

    def __reduce__(self):
        return (ExplicitLayout, (self.mesh, self.chunks, self.shape, self.dtype))

    @property
    def partial(self) -> tuple[str, ...]:
        return ()

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def varying_axes(self) -> frozenset[str]:
        """Conservatively every mesh axis: boxes may differ between any two ranks."""
        return frozenset(self.mesh.axis_names)

    def with_dtype(self, dtype: torch.dtype) -> ExplicitLayout:
        return ExplicitLayout(self.mesh, self.chunks, self.shape, dtype)

    def shard_metadata(self, rank: int) -> ShardMetadata:
        """The box held by ``rank`` (a global rank of the mesh)."""
        try:
            pos = self.mesh.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in the mesh (ranks {self.mesh.ranks})") from None
        offsets, sizes = self.chunks[pos]
        return ShardMetadata(offsets, sizes, self.mesh.placement(rank))

    def owner_ranks(self) -> list[int]:
        """For each distinct non-empty box, the first rank (in mesh order) that holds it."""
        seen, out = set(), []
        for r, box in zip(self.mesh.ranks, self.chunks):
            if math.prod(box[1]) and box not in seen:
                seen.add(box)
                out.append(r)
        return out


class HeldLayout(ExplicitLayout):
    """A value held by the ranks at coordinate ``index`` of mesh axis ``axis`` only, laid out
    there by ``base`` (a :class:`Layout` whose spec does not name ``axis``); every other rank
    holds an empty block (0 rows). Build it with :meth:`Layout.held`.

    What it is for: a pipeline's one-stage params (issue 36 item 7). The embedding is used by
    the first stage only and the final norm and head by the last: replicated over ``pp``, every
    stage's ranks held them, the optimizer updated them on every stage, and their gradients
    (zero off their stage) were summed over ``pp`` every step (an all_reduce that also made the
    stages wait for each other at the step's end). Held by their stage, as
    ``torch.distributed.pipelining`` holds them, none of that happens:
    :func:`fshard.parallel.pipeline` takes such ``input_params`` (held by stage 0's ranks) and
    ``loss_params`` (by the last stage's), runs them on their stage's ranks in ``base``'s
    layout and returns their gradient in this layout, with no collective over ``axis``.

    Why a layout and not a spec: the ceil-div chunks of DESIGN §2 put a short dim's blocks on
    the *first* coordinates of an axis (a leading dim of size 1 split over ``pp`` is held by
    ``pp`` rank 0 only), so no :class:`P` holds a value on the last stage's ranks alone. It is an
    :class:`ExplicitLayout` (its boxes: ``base``'s blocks at coordinate ``index``, empty ones
    elsewhere), so everything that takes explicit layouts takes it as it is: ``fs.gather`` and
    ``fs.reshard`` (``gather_blocks``: one all_gather over the mesh), ``fs.checkpoint`` (one
    chunk per distinct box), the optimizers (which work on the local blocks: an empty block
    costs nothing) and the op rules that take row blocks; any other op sees it made whole.
    Unlike a general explicit layout it knows its ``sharded_axes`` exactly (``axis`` and
    ``base``'s), so reductions over it (``fs.optim.global_norm``) count each element once.
    It compares equal to the :class:`ExplicitLayout` of the same boxes.

    Example:
        >>> from fshard import Mesh
        >>> m = Mesh.abstract((2, 2), ("pp", "dp"))
        >>> lay = Layout.held(Layout(m, P("dp"), (4, 3)), "pp", 1)
        >>> [lay.local_shape(r) for r in m.ranks], lay.sharded_axes
        ([(0, 3), (0, 3), (2, 3), (2, 3)], ('pp', 'dp'))
    """

    __slots__ = ("base", "axis", "index")

    def __init__(self, base: Layout, axis: str, index: int):
        if not isinstance(base, Layout) or base.is_explicit:
            raise TypeError(f"Layout.held: base must be a Layout (a P layout), got {base!r}")
        mesh = base.mesh
        if axis not in mesh.axis_names:
            raise ValueError(f"Layout.held: mesh {mesh!r} has no axis {axis!r}")
        if axis in base.varying_axes or base.partial:
            raise ValueError(
                f"Layout.held: base {base.spec} splits over {axis!r} or is a pending sum; the "
                f"value is held whole over {axis!r} by one coordinate, and not pending"
            )
        size = mesh.size(axis)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
            raise ValueError(
                f"Layout.held: index must be in [0, {size}) (axis {axis!r}), got {index!r}"
            )
        if not base.ndim:
            raise ValueError(
                "Layout.held: a 0-d value has no empty block; give a value of ndim >= 1"
            )
        at = mesh.axis_names.index(axis)
        empty = ((0,) * base.ndim, (0, *base.shape[1:]))
        chunks = [
            _box_of(base.shard_metadata(r), i, base.ndim) if mesh.coords(r)[at] == index else empty
            for i, r in enumerate(mesh.ranks)
        ]
        super().__init__(mesh, chunks, base.shape, base.dtype)
        set_ = object.__setattr__
        set_(self, "base", base)
        set_(self, "axis", axis)
        set_(self, "index", index)

    def __repr__(self) -> str:
        return f"Layout.held({self.base!r}, {self.axis!r}, {self.index})"

    def __reduce__(self):
        return (HeldLayout, (self.base, self.axis, self.index))

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        axes = {self.axis, *self.base.sharded_axes}
        return tuple(a for a in self.mesh.axis_names if a in axes)

    @property
    def varying_axes(self) -> frozenset[str]:
        return frozenset(self.sharded_axes)

    def with_dtype(self, dtype: torch.dtype) -> HeldLayout:
        return HeldLayout(self.base.with_dtype(dtype), self.axis, self.index)

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` (a global rank of the mesh) is one of the holding coordinate's."""
        return self.mesh.coords(rank)[self.mesh.axis_names.index(self.axis)] == self.index


class PartsLayout(BaseLayout):
    """A value laid out by a :class:`Parts`: dim ``dim`` is made of parts of ``sizes``, each split
    on its own over ``axes`` (ceil-div chunks, DESIGN §2); every other dim and the pending sums
    follow ``base``, the :class:`Layout` of the same :class:`P` (as if the dim were one part).

    A rank's block is the concatenation, along ``dim``, of its chunk of each part: several
    boxes of the global tensor (:meth:`blocks`), so :meth:`shard_metadata` (one box) refuses.
    Not a :class:`Layout`: only op rules marked ``parts_layouts`` see one (:mod:`fshard.ops.parts`);
    for the others the dispatcher gathers the parts dim first (:meth:`made_whole`), and the
    planner moves it with ``gather_parts`` / ``slice_parts`` (:mod:`fshard.planner`).

    Example:
        >>> from fshard import Mesh
        >>> lay = Layout.of(Mesh.abstract((2,), ("tp",)), Parts(P(None, "tp"), 1, (6, 3)), (2, 9))
        >>> lay.local_shape(0), lay.local_shape(1), lay.made_whole().spec
        ((2, 5), (2, 4), P())
    """

    __slots__ = ("base", "dim", "sizes", "axes", "spec")

    rule_flag = "parts_layouts"

    def __init__(self, mesh, parts: Parts, shape, dtype: torch.dtype = torch.float32):
        if not isinstance(parts, Parts):
            raise TypeError(f"spec must be a fshard.Parts, got {type(parts).__name__} {parts!r}")
        base = _layout(mesh, parts.spec, _check_shape(shape), dtype)
        dim = parts.dim + base.ndim if parts.dim < 0 else parts.dim
        if not 0 <= dim < base.ndim:
            raise ValueError(
                f"{parts}: dim {parts.dim} is out of range for a tensor of shape {base.shape}"
            )
        if sum(parts.sizes) != base.shape[dim]:
            raise ValueError(
                f"{parts}: the parts sum to {sum(parts.sizes)} but dim {dim} of the tensor has "
                f"size {base.shape[dim]} (shape {base.shape}); the sizes must add up to it"
            )
        axes = base.dim_axes[dim]
        if not axes:
            raise ValueError(f"{parts}: the spec does not split dim {dim}; use the P alone")
        set_ = object.__setattr__
        if parts.dim != dim or parts.spec is not base.spec:  # base's spec: canonical
            parts = Parts(base.spec, dim, parts.sizes)
        canonical = parts
        set_(self, "base", base)
        set_(self, "dim", dim)
        set_(self, "sizes", parts.sizes)
        set_(self, "axes", axes)
        set_(self, "spec", canonical)
        self._set_value(mesh, base.shape, dtype, ("parts", mesh, canonical, base.shape, dtype))

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, PartsLayout)
            and self._hash == other._hash
            and self.spec == other.spec
            and self.base == other.base
        )

    __hash__ = BaseLayout.__hash__

    def __repr__(self) -> str:
        return f"Layout({self.mesh!r}, {self.spec}, shape={self.shape}, dtype={self.dtype})"

    def __reduce__(self):
        return (PartsLayout, (self.mesh, self.spec, self.shape, self.dtype))

    @property
    def partial(self) -> tuple[str, ...]:
        return self.base.partial

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return self.base.sharded_axes

    @property
    def varying_axes(self) -> frozenset[str]:
        return self.base.varying_axes

    def with_dtype(self, dtype: torch.dtype) -> PartsLayout:
        return _layout(self.mesh, self.spec, self.shape, dtype)

    def made_whole(self) -> Layout:
        dims = list(self.base.dim_axes)
        dims[self.dim] = ()
        entries = [None if not a else a[0] if len(a) == 1 else a for a in dims]
        while entries and entries[-1] is None:
            entries.pop()
        return _layout(self.mesh, P(*entries, partial=self.partial), self.shape, self.dtype)

    def part_chunks(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(global start, size)`` along ``dim`` of ``rank``'s chunk of each part, in order."""
        return _part_chunks(self, rank)

    def blocks(self, rank: int) -> tuple[ShardMetadata, ...]:
        """``rank``'s boxes of the global tensor, one per part, in the order its local block
        concatenates them along ``dim``."""
        meta = _shard_metadata(self.base, rank)
        out = []
        for start, size in _part_chunks(self, rank):
            offsets, sizes = list(meta.shard_offsets), list(meta.shard_sizes)
            offsets[self.dim], sizes[self.dim] = start, size
            out.append(ShardMetadata(tuple(offsets), tuple(sizes), meta.placement))
        return tuple(out)

    def part_rows(self, ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The size along ``dim`` of each part's chunk in the block of each of ``ranks``: the
        pieces of those blocks concatenated in that order (an all_gather's chunk order)."""
        return tuple(tuple(n for _, n in _part_chunks(self, r)) for r in ranks)

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        rank = self.mesh.rank if rank is None else rank
        sizes = list(_shard_metadata(self.base, rank).shard_sizes)
        sizes[self.dim] = sum(n for _, n in _part_chunks(self, rank))
        return tuple(sizes)

    def shard_metadata(self, rank: int) -> ShardMetadata:
        raise TypeError(
            f"{self}: a per-part layout holds several boxes per rank (one per part); use "
            "layout.blocks(rank), or reshard to a P layout first"
        )


def parts_arranged(full: torch.Tensor, rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Blocks of a per-part layout concatenated along dim 0 in chunk order (``rows``: each
    part's rows in each block, :meth:`PartsLayout.part_rows`) put back in part order: the
    pieces of part 0 of every block, then of part 1, ... (a local permutation).

    Example:
        >>> parts_arranged(torch.arange(6), ((2, 1), (2, 1))).tolist()  # [a0 b0 | a1 b1]
        [0, 1, 3, 4, 2, 5]
    """
    k, m = len(rows), len(rows[0])
    pieces = torch.split(full, [r for block in rows for r in block])
    return torch.cat([pieces[j * m + p] for p in range(m) for j in range(k)])


def parts_chunked(full: torch.Tensor, rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """The inverse of :func:`parts_arranged`: part order back to the blocks' chunk order.

    Example:
        >>> parts_chunked(torch.tensor([0, 1, 3, 4, 2, 5]), ((2, 1), (2, 1))).tolist()
        [0, 1, 2, 3, 4, 5]
    """
    k, m = len(rows), len(rows[0])
    pieces = torch.split(full, [rows[j][p] for p in range(m) for j in range(k)])
    return torch.cat([pieces[p * k + j] for j in range(k) for p in range(m)])


@functools.lru_cache(maxsize=65536)
def _part_chunks(layout: PartsLayout, rank: int) -> tuple[tuple[int, int], ...]:
    index, count = chunk_index(layout.mesh, layout.axes, layout.mesh.coords(rank))
    out, start = [], 0
    for n in layout.sizes:
        a, b = chunk_bounds(n, count, index)
        out.append((start + a, b - a))
        start += n
    return tuple(out)
