"""Converters between :class:`ShardedArray` and torch's DTensor and (deprecated) ShardedTensor.

No data moves in any converter: each rank's local block is wrapped as-is (the result shares
storage with the input's local tensor).

**DTensor** (:func:`to_dtensor`, :func:`from_dtensor`). fshard mesh axis ``i`` is DeviceMesh
dim ``i`` (``mesh.device_mesh``). Per mesh axis: an axis splitting tensor dim ``d`` is
``Shard(d)``, a partial axis is ``Partial("sum")``, any other axis is ``Replicate()``. Uneven
single-axis splits agree (both follow ``torch.chunk``). A dim split over several axes
(``P(("x", "y"))``) maps to ``[Shard(0), Shard(0)]`` only when the axes are in mesh order and the
dim divides evenly by the product of their sizes: DTensor chunks such a dim *nested* (first
``x``, then ``y`` inside each piece) while fshard chunks it *flat* (one ceil-div over ``x*y``
chunks), and the two differ when the size is uneven (6 over 2x2: DTensor 2,1,2,1 and fshard
2,2,2,0). Those layouts, reversed axis orders and explicit layouts raise ``ValueError``.

**ShardedTensor** (:func:`to_sharded_tensor`, :func:`from_sharded_tensor`). ShardedTensor has no
replication and no pending sums. Decision: a replicated block is held by **one** rank only, the
first rank in mesh order holding it (the replica with index 0 on each replicated axis); other
replicas hold no local shard. Empty blocks are left out. Partial values raise (reshard them
first). Coming back, a ``ChunkShardingSpec`` whose placements are the mesh's ranks in order
becomes ``P`` with that dim split over all mesh axes; anything else (``EnumerableShardingSpec``,
other rank orders, fewer placements) becomes a :meth:`Layout.explicit` layout (a rank without a
shard holds an empty box). ShardedTensor's deprecation FutureWarnings are silenced inside the
converters.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> x = fs.shard(torch.arange(4.0), mesh, fs.P("x"))
    >>> d = fs.interop.to_dtensor(x)  # no communication
    >>> d.placements, torch.equal(fs.gather(fs.interop.from_dtensor(d)), fs.gather(x))
    ((Shard(dim=0),), True)
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from .array import ShardedArray
from .mesh import Mesh
from .spec import Layout, P, PartsLayout, _layout

__all__ = ["to_dtensor", "from_dtensor", "to_sharded_tensor", "from_sharded_tensor"]


@contextlib.contextmanager
def _quiet():
    """Silence ShardedTensor's deprecation FutureWarning (emitted on every attribute access)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*deprecating ShardedTensor.*", FutureWarning)
        yield


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _check_sharded(x, fn: str) -> ShardedArray:
    if not isinstance(x, ShardedArray):
        raise TypeError(f"{fn}: x must be a fshard.ShardedArray, got {type(x).__name__}")
    return x


# -- DTensor -----------------------------------------------------------------------------------


def _placements(layout: Layout) -> list:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if layout.is_explicit:
        raise ValueError(
            "to_dtensor: x has an explicit layout (Layout.explicit), which DTensor placements "
            "cannot express; reshard it to a fs.P layout first (fs.reshard(x, fs.P(...))) or use "
            "fs.interop.to_sharded_tensor"
        )
    if isinstance(layout, PartsLayout):
        raise ValueError(
            f"to_dtensor: x is split per part ({layout.spec}); DTensor's placements have no "
            "per-part split of parts of different sizes (its private _StridedShard takes equal "
            "ones only). Reshard it to a fs.P layout first (fs.reshard(x, fs.P(...))) or use "
            "fs.interop.to_sharded_tensor (one shard per part)"
        )
    mesh = layout.mesh
    out: list = [Replicate()] * mesh.ndim
    for a in layout.partial:
        out[mesh.axis_index_of(a)] = Partial("sum")
    for d, axes in enumerate(layout.dim_axes):
        if len(axes) > 1:
            order = [mesh.axis_index_of(a) for a in axes]
            if order != sorted(order):
                raise ValueError(
                    f"to_dtensor: dim {d} of {layout.spec} is split over axes {axes} in an order "
                    f"other than the mesh's {mesh.axis_names}; DTensor shards a dim over mesh "
                    "dims in mesh order only (the reverse needs _StridedShard). Reshard to "
                    "the mesh order first"
                )
            k = mesh.size(axes)
            if layout.shape[d] % k:
                raise ValueError(
                    f"to_dtensor: dim {d} (size {layout.shape[d]}) is split over axes {axes} "
                    f"({k} chunks) unevenly. DTensor chunks a dim split over several mesh dims "
                    "nested (per mesh dim, torch.chunk inside each piece) while fshard chunks it "
                    "flat (one ceil-div over all chunks); for uneven sizes the blocks differ, "
                    "so this layout has no DTensor equivalent. Use an even size, a single axis "
                    "for this dim, or fs.interop.to_sharded_tensor"
                )
        for a in axes:
            out[mesh.axis_index_of(a)] = Shard(d)
    return out


def to_dtensor(x: ShardedArray):
    """The ``torch.distributed.tensor.DTensor`` with the same global value and layout.

    No communication: the local block becomes the DTensor's local tensor (``shape`` and
    ``stride`` are passed explicitly, so uneven shards are described correctly).

    Args:
        x: a :class:`ShardedArray` on a real mesh.

    Returns:
        A DTensor on ``x.mesh.device_mesh`` with placements ``Shard``/``Replicate``/
        ``Partial("sum")`` per mesh axis.

    Raises:
        TypeError: ``x`` is not a ShardedArray.
        ValueError: the layout has no DTensor equivalent (explicit, multi-axis uneven, or a
            multi-axis dim whose axes are not in mesh order).

    Example:
        >>> d = fs.interop.to_dtensor(fs.shard(t, mesh, fs.P("tp")))  # doctest: +SKIP
        >>> d.placements  # doctest: +SKIP
        (Shard(dim=0),)
    """
    from torch.distributed.tensor import DTensor

    x = _check_sharded(x, "to_dtensor")
    mesh = x.mesh
    if mesh.is_abstract:
        raise ValueError(f"to_dtensor: x is on an abstract mesh ({mesh!r}); it has no DeviceMesh")
    placements = _placements(x.layout)
    shape = torch.Size(x.layout.shape)
    return DTensor.from_local(
        x.local,
        mesh.device_mesh,
        placements,
        run_check=False,
        shape=shape,
        stride=_contiguous_stride(shape),
    )


def _mesh_for(device_mesh, mesh: Mesh | None, fn: str) -> Mesh:
    shape = tuple(device_mesh.mesh.shape)
    names = device_mesh.mesh_dim_names
    ranks = tuple(int(r) for r in device_mesh.mesh.flatten().tolist())
    if mesh is None:
        if names is None:
            raise ValueError(
                f"{fn}: the DeviceMesh has no mesh_dim_names; pass mesh= (a fshard.Mesh of shape "
                f"{shape}) to name its axes"
            )
        kind = device_mesh.device_type
        mesh = Mesh.create(shape, names, device_type=kind if kind in ("cpu", "cuda") else None)
    elif not isinstance(mesh, Mesh):
        raise TypeError(f"{fn}: mesh must be a fshard.Mesh or None, got {type(mesh).__name__}")
    if mesh.shape != shape or mesh.ranks != ranks:
        raise ValueError(
            f"{fn}: mesh {mesh!r} (shape {mesh.shape}, ranks {mesh.ranks}) does not match the "
            f"DeviceMesh (shape {shape}, ranks {ranks}); give a mesh of the same shape and rank "
            "order"
        )
    return mesh


def from_dtensor(d, mesh: Mesh | None = None) -> ShardedArray:
    """The :class:`ShardedArray` with the same global value and layout as DTensor ``d``.

    Args:
        d: a ``DTensor`` with ``Shard``, ``Replicate`` or ``Partial("sum")`` placements.
        mesh: the fshard mesh to use; default ``Mesh.create`` with the DeviceMesh's shape and
            ``mesh_dim_names`` (mesh dim ``i`` becomes axis ``i``).

    Returns:
        A ShardedArray whose local tensor is ``d.to_local()``.

    Raises:
        TypeError: ``d`` is not a DTensor, or ``mesh`` is not a Mesh.
        ValueError: an unsupported placement (``Partial`` other than sum, ``_StridedShard``),
            a dim sharded over several mesh dims unevenly, or a mesh that does not match.

    Example:
        >>> x = fs.interop.from_dtensor(distribute_tensor(t, dm, [Shard(0)]))  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(d, DTensor):
        raise TypeError(f"from_dtensor: d must be a DTensor, got {type(d).__name__}")
    mesh = _mesh_for(d.device_mesh, mesh, "from_dtensor")
    shape = tuple(d.shape)
    dims: list[list[str]] = [[] for _ in shape]
    partial: list[str] = []
    for i, p in enumerate(d.placements):
        axis = mesh.axis_names[i]
        if isinstance(p, _StridedShard):
            raise ValueError(
                f"from_dtensor: placement {p} on mesh dim {i} (_StridedShard) has no fshard "
                "equivalent; redistribute to Shard/Replicate first"
            )
        if isinstance(p, Shard):
            dims[p.dim % len(shape)].append(axis)
        elif isinstance(p, Partial):
            if p.reduce_op != "sum":
                raise ValueError(
                    f"from_dtensor: placement {p} on mesh dim {i}: fshard partial values are "
                    "pending sums; only Partial('sum') is supported"
                )
            partial.append(axis)
        elif not isinstance(p, Replicate):
            raise ValueError(
                f"from_dtensor: placement {p!r} on mesh dim {i} is not supported; accepted: "
                "Shard, Replicate, Partial('sum')"
            )
    for dim, axes in enumerate(dims):
        k = mesh.size(tuple(axes)) if axes else 1
        if len(axes) > 1 and shape[dim] % k:
            raise ValueError(
                f"from_dtensor: dim {dim} (size {shape[dim]}) is sharded over mesh dims {axes} "
                f"({k} pieces) unevenly; DTensor's nested chunking then differs from fshard's flat "
                "chunking, so the blocks have no fshard P equivalent. Redistribute to an even "
                "or single-mesh-dim sharding first"
            )
    spec = P(*(tuple(a) if a else None for a in dims), partial=tuple(partial))
    layout = _layout(mesh, spec, shape, d.dtype)
    local = d.to_local()
    if hasattr(local, "wait"):
        local = local.wait()
    want = layout.local_shape(mesh.rank)
    if tuple(local.shape) != want:
        raise ValueError(
            f"from_dtensor: rank {mesh.rank} holds a block of shape {tuple(local.shape)} but "
            f"{spec} of global shape {shape} gives {want}"
        )
    return ShardedArray._raw(local, layout)


# -- ShardedTensor ----------------------------------------------------------------------------


def rank_boxes(layout: Layout, rank: int) -> tuple:
    """``rank``'s boxes of the global tensor: one, or one per part of a per-part layout (in the
    order its local block concatenates them)."""
    if isinstance(layout, PartsLayout):
        return layout.blocks(rank)
    return (layout.shard_metadata(rank),)


def local_pieces(layout: Layout, local: torch.Tensor) -> list[torch.Tensor]:
    """This rank's ``local`` cut into its boxes (:func:`rank_boxes`, in order)."""
    if not isinstance(layout, PartsLayout):
        return [local]
    sizes = [m.shard_sizes[layout.dim] for m in layout.blocks(layout.mesh.rank)]
    return list(local.split(sizes, layout.dim))


def _distinct_boxes(layout: Layout) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``(owner rank, offsets, sizes)`` per distinct non-empty block; the first holder owns it."""
    out, seen = [], set()
    for r in layout.mesh.ranks:
        for m in rank_boxes(layout, r):
            box = (m.shard_offsets, m.shard_sizes)
            if m.numel and box not in seen:
                seen.add(box)
                out.append((r, *box))
    return out


def _sharded_tensor(layout: Layout, pieces: list | None, me: int, prefer_me: bool):
    """A ShardedTensor over ``layout``'s distinct non-empty blocks (one owner each).

    ``pieces``: this rank's tensor for each of its boxes (:func:`rank_boxes`; one for a
    :class:`Layout`), or None when it holds nothing. This rank holds a piece when it owns its
    box. With ``prefer_me`` (checkpoint load), this rank's own boxes are assigned to this rank
    in the (per-rank) global metadata, so every replica gets a local shard. A zero-element
    tensor gets one empty shard on the first rank.
    """
    from torch.distributed._shard.metadata import ShardMetadata as TShardMetadata
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
    )
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    mine = {(m.shard_offsets, m.shard_sizes): i for i, m in enumerate(rank_boxes(layout, me))}
    boxes = _distinct_boxes(layout)
    if not boxes:
        first = layout.mesh.ranks[0]
        boxes = [(first, (0,) * layout.ndim, tuple(layout.shape))]
        if me == first and pieces is not None:
            pieces = [pieces[0].new_empty(layout.shape)]
            mine = {boxes[0][1:]: 0}
    metas, local_shards = [], []
    for owner, offsets, sizes in boxes:
        if prefer_me and (offsets, sizes) in mine:
            owner = me
        md = TShardMetadata(list(offsets), list(sizes), layout.mesh.placement(owner))
        metas.append(md)
        if owner == me and pieces is not None:
            local_shards.append(Shard(pieces[mine[(offsets, sizes)]].contiguous(), md))
    props = TensorProperties(dtype=layout.dtype, requires_grad=False)
    st_md = ShardedTensorMetadata(metas, torch.Size(layout.shape), props)
    with _quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, st_md)


def to_sharded_tensor(x: ShardedArray):
    """The (deprecated) ``ShardedTensor`` with the same global value; no communication.

    Each distinct non-empty block becomes one shard, held by the first rank in mesh order that
    has it: replicas other than index 0 on the replicated axes hold no local shard. The sharding
    spec is inferred by torch (``ChunkShardingSpec`` when the blocks follow chunk math, else
    ``EnumerableShardingSpec``).

    Args:
        x: a :class:`ShardedArray` (any :class:`P` layout without partial axes, or explicit).

    Returns:
        A ShardedTensor over the default process group.

    Raises:
        TypeError: ``x`` is not a ShardedArray.
        ValueError: ``x`` is partial (ShardedTensor has no pending sums; reshard it first).

    Example:
        >>> st = fs.interop.to_sharded_tensor(fs.shard(t, mesh, fs.P("x")))  # doctest: +SKIP
        >>> st.local_shards()[0].metadata.shard_offsets  # doctest: +SKIP
        [0, 0]
    """
    x = _check_sharded(x, "to_sharded_tensor")
    if x.layout.partial:
        raise ValueError(
            f"to_sharded_tensor: x is partial over {x.layout.partial} ({x.spec}); ShardedTensor "
            "cannot express pending sums. Reduce first: fs.reshard(x, fs.P(...)) without partial"
        )
    if x.mesh.is_abstract:
        raise ValueError(f"to_sharded_tensor: x is on an abstract mesh ({x.mesh!r})")
    pieces = local_pieces(x.layout, x.local.detach())
    return _sharded_tensor(x.layout, pieces, x.mesh.rank, prefer_me=False)


def from_sharded_tensor(st, mesh: Mesh) -> ShardedArray:
    """The :class:`ShardedArray` holding ShardedTensor ``st``'s value; no communication.

    Args:
        st: a ShardedTensor with at most one local shard per rank.
        mesh: the fshard mesh whose ranks hold ``st``'s shards (``st`` over the default group).

    Returns:
        With a ``ChunkShardingSpec`` whose placements are ``mesh.ranks`` in order: a
        ShardedArray with ``P`` splitting that dim over all mesh axes. Otherwise one with a
        :meth:`Layout.explicit` layout (ranks without a shard hold an empty box).

    Raises:
        TypeError: ``st`` is not a ShardedTensor or ``mesh`` is not a Mesh.
        ValueError: a rank holds more than one shard (fshard has one block per rank), or a
            placement names a rank outside ``mesh``.

    Example:
        >>> x = fs.interop.from_sharded_tensor(st, fs.Mesh.create((2,), ("x",)))  # doctest: +SKIP
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    if not isinstance(st, ShardedTensor):
        raise TypeError(f"from_sharded_tensor: st must be a ShardedTensor, got {type(st).__name__}")
    if not isinstance(mesh, Mesh) or mesh.is_abstract:
        raise TypeError(
            f"from_sharded_tensor: mesh must be a real fshard.Mesh (Mesh.create), got {mesh!r}"
        )
    with _quiet():
        md = st.metadata()
        spec = st.sharding_spec()
        shards = st.local_shards()
        shape = tuple(md.size)
        dtype = md.tensor_properties.dtype
    me = mesh.rank
    if len(shards) > 1:
        raise ValueError(
            f"from_sharded_tensor: rank {me} holds {len(shards)} local shards; fshard layouts have "
            "one block per rank. Rebuild the ShardedTensor with one shard per rank"
        )
    by_rank: dict[int, tuple] = {}
    for m in md.shards_metadata:
        r = m.placement.rank()
        if r not in mesh.ranks:
            raise ValueError(
                f"from_sharded_tensor: shard {m} is placed on rank {r}, which is not in the mesh "
                f"(ranks {mesh.ranks})"
            )
        if r in by_rank:
            raise ValueError(
                f"from_sharded_tensor: rank {r} holds more than one shard in the global metadata; "
                "fshard layouts have one block per rank"
            )
        by_rank[r] = (tuple(m.shard_offsets), tuple(m.shard_sizes))
    if shards:
        local = shards[0].tensor
    else:
        local = torch.empty((0,) * len(shape), dtype=dtype, device=mesh.device())
    if isinstance(spec, ChunkShardingSpec):
        ranks = [p.rank() for p in spec.placements]
        if ranks == list(mesh.ranks):
            dims = [None] * len(shape)
            dims[spec.dim % len(shape)] = tuple(mesh.axis_names)
            layout = _layout(mesh, P(*dims), shape, dtype)
            return ShardedArray._raw(_fit(local, layout.local_shape(me), me), layout)
    empty = ((0,) * len(shape), (0,) * len(shape))
    chunks = [by_rank.get(r, empty) for r in mesh.ranks]
    if math.prod(shape) == 0:
        chunks = [empty] * len(mesh.ranks)
        chunks[0] = ((0,) * len(shape), shape)
    layout = Layout.explicit(mesh, chunks, shape, dtype)
    return ShardedArray._raw(_fit(local, layout.local_shape(me), me), layout)


def _fit(local: torch.Tensor, want: tuple[int, ...], me: int) -> torch.Tensor:
    if tuple(local.shape) == want:
        return local
    if local.numel() == 0 and math.prod(want) == 0:
        return local.reshape(want)  # an empty block, described with another empty shape
    raise ValueError(
        f"from_sharded_tensor: rank {me}'s local shard has shape {tuple(local.shape)} but its "
        f"block in the global metadata has shape {want}"
    )
