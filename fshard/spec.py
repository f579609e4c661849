"""Partition specs, layouts and per-rank shard metadata: pure layout math.

Nothing here talks to torch.distributed. A :class:`Layout` binds a :class:`P` to a mesh (real
or abstract), a global shape and a dtype, and answers, for any rank, which block of the
global tensor that rank holds.

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

__all__ = ["P", "PartitionSpec", "Layout", "ShardMetadata", "chunk_bounds"]


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
        (('dp',), ())
        >>> P(partial="tp").partial
        ('tp',)
    """

    __slots__ = ("_entries", "dims", "partial", "_key")

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
        return isinstance(other, PartitionSpec) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __len__(self) -> int:
        return len(self.dims)

    def __iter__(self):
        return iter(self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec names (dims first, then partial)."""
        return tuple(a for d in self.dims for a in d) + self.partial

    def padded(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        """The per-dim axis tuples, padded with ``()`` to ``ndim`` entries."""
        return self.dims + ((),) * (ndim - len(self.dims))


P = PartitionSpec


def _make_spec(entries, partial) -> PartitionSpec:
    return PartitionSpec(*entries, partial=partial)


def chunk_bounds(n: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of chunk ``index`` when ``n`` is split flat into ``num_chunks``.

    Example:
        >>> [chunk_bounds(2, 4, j) for j in range(4)]
        [(0, 1), (1, 2), (2, 2), (2, 2)]
    """
    c = -(-n // num_chunks)
    return min(index * c, n), min((index + 1) * c, n)


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
        """Index into the global tensor that selects this block."""
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


class Layout:
    """Static description of a sharded value: ``(mesh, spec, global shape, dtype)``.

    Hashable and immutable; every per-rank quantity is computed once and cached.

    Args:
        mesh: a :class:`fshard.Mesh` (real or abstract).
        spec: a :class:`P`; shorter than the shape means trailing dims are whole.
        shape: the global shape (never inferred from local sizes).
        dtype: element type of the value (default float32).

    Example:
        >>> from fshard import Mesh
        >>> lay = Layout(Mesh.abstract((4,), ("x",)), P("x"), (10, 6))
        >>> [m.shard_sizes for m in lay.shards_metadata()]
        [(3, 6), (3, 6), (3, 6), (1, 6)]
    """

    __slots__ = ("mesh", "spec", "shape", "dtype", "dim_axes", "_hash", "__weakref__")

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
        set_ = object.__setattr__
        set_(self, "mesh", mesh)
        set_(self, "spec", spec)
        set_(self, "shape", shape)
        set_(self, "dtype", dtype)
        set_(self, "dim_axes", spec.padded(len(shape)))
        set_(self, "_hash", hash((mesh, spec, shape, dtype)))

    def __setattr__(self, name, value):
        raise AttributeError("Layout is immutable")

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Layout)
            and self._hash == other._hash
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.spec == other.spec
            and self.mesh == other.mesh
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Layout({self.mesh!r}, {self.spec}, shape={self.shape}, dtype={self.dtype})"

    def __reduce__(self):
        return (Layout, (self.mesh, self.spec, self.shape, self.dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

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

    @property
    def nbytes(self) -> int:
        """Bytes of the global value."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    def with_spec(self, spec: PartitionSpec) -> Layout:
        return _layout(self.mesh, spec, self.shape, self.dtype)

    def with_dtype(self, dtype: torch.dtype) -> Layout:
        return _layout(self.mesh, self.spec, self.shape, dtype)

    def chunk_index(self, dim: int, coords: tuple[int, ...]) -> tuple[int, int]:
        """``(index, count)`` of the chunk of ``dim`` held at mesh coordinates ``coords``."""
        index, count = 0, 1
        for a in self.dim_axes[dim]:
            ax = self.mesh.axis_index_of(a)
            index = index * self.mesh.shape[ax] + coords[ax]
            count *= self.mesh.shape[ax]
        return index, count

    def shard_metadata(self, rank: int) -> ShardMetadata:
        """The block held by ``rank`` (a global rank of the mesh). Pure; works on abstract meshes."""
        return _shard_metadata(self, rank)

    def shards_metadata(self) -> list[ShardMetadata]:
        """Every rank's block, in rank order (mesh position order)."""
        return [_shard_metadata(self, r) for r in self.mesh.ranks]

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor (default: this process's rank)."""
        return _shard_metadata(self, self.mesh.rank if rank is None else rank).shard_sizes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=4096)
def _layout(mesh, spec, shape, dtype) -> Layout:
    return Layout(mesh, spec, shape, dtype)


@functools.lru_cache(maxsize=65536)
def _shard_metadata(layout: Layout, rank: int) -> ShardMetadata:
    coords = layout.mesh.coords(rank)
    offsets, sizes = [], []
    for d, n in enumerate(layout.shape):
        index, count = layout.chunk_index(d, coords)
        start, stop = chunk_bounds(n, count, index)
        offsets.append(start)
        sizes.append(stop - start)
    return ShardMetadata(tuple(offsets), tuple(sizes), layout.mesh.placement(rank))
