"""The reshard planner: every layout transition lives here, as data.

``plan(layout, dst_spec)`` returns the steps ``reshard`` will run, each with the mesh axes it
communicates over and this rank's input bytes. The plan is pure (works on abstract meshes) and
cached per ``(layout, dst_spec)``. Lowering, per mesh axis (DESIGN §5, n ranks, local size L):

    from -> to               step             bytes received per rank
    Shard(i) -> Replicate    all_gather       (n-1)·L
    Replicate -> Shard(i)    slice (local)    0
    Shard(i) -> Shard(j)     all_to_all       (n-1)/n·L
    Partial -> Replicate     all_reduce       ~2(n-1)/n·L
    Partial -> Shard(i)      reduce_scatter   (n-1)/n·L   (all_to_all + local sum on Gloo)
    Replicate -> Partial     zero (local)     0
    any block permutation    ppermute         L           (e.g. P('x','y') -> P('y','x'))
    Shard over (a, b) <-> Shard over a, Partial(b) -> Shard over (a, b), where b splits each
    a block as the flat split does (an even dim): the all_gather, local slice or
    reduce_scatter over b alone, inside the a blocks (sequence parallelism in a cp chunk)
    Layout.explicit -> any   gather_blocks    (N-1)·max block   (then local slices)
    Parts -> any             gather_parts     (n-1)·L     (the parts dim; then as from P)
    Parts(P(a, partial=b)) -> Parts(P((a, b)))
                             reduce_scatter   (n-1)/n·L   (per part: the parts' pieces put in
                                                          b's chunk order first, where each
                                                          part's split nests)
    any -> Parts             slice_parts      0           (after making the parts dim whole)

Order: partial axes are reduced first (as a reduce_scatter where the target shards a dim over
exactly those axes, else an all_reduce), then dims move (one all_to_all, a ppermute, or
all_gathers of the dims that change followed by local slices), then new partial axes are
introduced by zeroing. Gathering a dim over an axis also gathers any other dim split over that
axis, so the intermediate layouts are always valid.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .collectives import (
    AllGather,
    AllToAll,
    GatherBlocks,
    GatherParts,
    LocalSlice,
    Ppermute,
    Psum,
    PsumScatter,
    PsumScatterParts,
    SliceParts,
    ZeroOthers,
)
from .spec import BaseLayout, Layout, P, Parts, PartsLayout, chunk_bounds, nests

__all__ = ["Step", "plan"]


@dataclass(frozen=True)
class Step:
    """One step of a reshard: collective ``op`` (a :mod:`fshard.collectives` op, over mesh
    ``op.axes``) from layout ``src`` to ``dst``.

    ``nbytes`` is the input bytes of the rank the plan was made for (0 for local steps);
    ``collective`` says whether the step communicates (local steps and size-1 axes do not).
    ``axes``, ``dim``, ``concat_dim`` and ``perm`` read the op (``dim``: the dim a one-dim op
    works on, an all_to_all's split dim).

    Example:
        >>> from fshard import Layout, Mesh, P
        >>> m = Mesh.abstract((2,), ("x",))
        >>> step = plan(Layout(m, P(partial="x"), (8, 8)), P("x"))[0]
        >>> step.op.name, step.axes, step.nbytes, step.collective
        ('reduce_scatter', ('x',), 256, True)
    """

    op: object
    src: Layout
    dst: Layout
    nbytes: int = 0

    @property
    def axes(self) -> tuple[str, ...]:
        return self.op.axes

    @property
    def dim(self) -> int | None:
        return getattr(self.op, "split_dim", getattr(self.op, "dim", None))

    @property
    def concat_dim(self) -> int | None:
        return getattr(self.op, "concat_dim", None)

    @property
    def perm(self) -> tuple[tuple[int, int], ...]:
        return getattr(self.op, "perm", ())

    @property
    def collective(self) -> bool:
        return not self.op.local and self.src.mesh.size(self.axes) > 1

    def __repr__(self) -> str:
        where = f" dim={self.dim}" if self.dim is not None else ""
        if self.concat_dim is not None:
            where = f" split={self.dim} concat={self.concat_dim}"
        return (
            f"Step({self.op.name} over {self.axes}{where}: {self.src.spec} -> "
            f"{self.dst.spec}, {self.nbytes} B)"
        )


def chunk_sizes(n: int, mesh, axes: tuple[str, ...]) -> tuple[int, ...]:
    """Sizes of the chunks of a dim of size ``n`` split over ``axes``, in chunk order.

    Example:
        >>> from fshard import Mesh
        >>> chunk_sizes(10, Mesh.abstract((4,), ("x",)), ("x",))
        (3, 3, 3, 1)
    """
    k = mesh.size(axes) if axes else 1
    return tuple(b - a for a, b in (chunk_bounds(n, k, j) for j in range(k)))


def _with(layout: Layout, dims=None, partial=None) -> Layout:
    dims = layout.dim_axes if dims is None else dims
    partial = layout.partial if partial is None else partial
    return layout.with_spec(P(*dims, partial=tuple(partial)))


def in_mesh_order(mesh, axes) -> tuple[str, ...]:
    """``axes`` in the mesh's order.

    Example:
        >>> from fshard import Mesh
        >>> in_mesh_order(Mesh.abstract((2, 2), ("x", "y")), ("y", "x"))
        ('x', 'y')
    """
    axes = set(axes)
    return tuple(a for a in mesh.axis_names if a in axes)


def plan(layout: Layout, dst_spec: P | Parts, rank: int | None = None) -> list[Step]:
    """The steps ``reshard`` takes from ``layout`` to ``dst_spec``, with this rank's bytes.

    Args:
        layout: the source layout (``x.layout``); its mesh may be abstract.
        dst_spec: the target :class:`P` (or :class:`Parts`).
        rank: whose input bytes to report; default this process's rank (rank 0 on an abstract
            mesh).

    Returns:
        A list of :class:`Step`; empty when the layouts have the same local blocks (equal, or
        differing only on size-1 mesh axes, which split nothing and sum nothing).

    Example:
        >>> from fshard import Layout, Mesh, P
        >>> m = Mesh.abstract((2,), ("x",))
        >>> [s.op.name for s in plan(Layout(m, P("x"), (8, 8)), P(None, "x"))]
        ['all_to_all']
        >>> plan(Layout(m, P("x"), (8, 8)), P())
        [Step(all_gather over ('x',) dim=0: P('x') -> P(), 128 B)]
        >>> plan(Layout(m, P("x"), (8, 8)), P("x"))
        []
    """
    if not isinstance(layout, BaseLayout):
        raise TypeError(f"plan: layout must be a fshard.Layout, got {type(layout).__name__}")
    if not isinstance(dst_spec, (P, Parts)):
        raise TypeError(
            f"plan: dst_spec must be a fshard.P or fshard.Parts, got {type(dst_spec).__name__}"
        )
    if rank is None:
        rank = layout.mesh.ranks[0] if layout.mesh.is_abstract else layout.mesh.rank
    return [_with_bytes(s, rank) for s in steps(layout, layout.with_spec(dst_spec))]


def _with_bytes(step: Step, rank: int) -> Step:
    if not step.collective:
        return step
    n = 1
    for s in step.src.local_shape(rank):
        n *= s
    return replace(step, nbytes=n * step.src.dtype.itemsize)


def _on_big_axes(layout: Layout):
    """``layout``'s placement with the mesh's size-1 axes dropped."""
    unit = {a for a in layout.mesh.axis_names if layout.mesh.size(a) == 1}
    dims = tuple(tuple(a for a in axes if a not in unit) for axes in layout.dim_axes)
    return dims, tuple(a for a in layout.partial if a not in unit)


def steps(src: Layout, dst: Layout) -> tuple[Step, ...]:
    """The steps from ``src`` to ``dst`` (no byte counts). Not cached: the decision is cached
    once, bound to process groups, by ``fshard.executor.program``; an op rule's compiled plan
    holds those programs."""
    if src == dst:
        return ()
    if isinstance(src, PartsLayout):
        scatter = _parts_scatter(src, dst)
        if scatter is not None:
            return scatter
        if _parts_stay(src, dst):  # the parts dim stays: the other dims and sums move
            inner = steps(src.base, dst.base)
            # a ppermute's shapes are the base's blocks; the parts dim must not move
            if not any(
                s.dim == src.dim or s.concat_dim == src.dim or isinstance(s.op, Ppermute)
                for s in inner
            ):
                return tuple(_per_part(s, src) for s in inner)
        whole = src.made_whole()
        op = GatherParts(src.axes, src.dim, src.sizes)
        return (Step(op, src, whole),) + steps(whole, dst)
    if isinstance(dst, PartsLayout):
        whole = dst.made_whole()
        op = SliceParts(dst.axes, dst.dim, dst.sizes)
        return steps(src, whole) + (Step(op, whole, dst),)
    if src.is_explicit:
        # Explicit boxes: gather every block over the whole mesh (padded flat blocks,
        # assembled by offsets), then plan from the replicated value.
        full = src.with_spec(P())
        return (Step(GatherBlocks(src), src, full),) + steps(full, dst)
    if _on_big_axes(src) == _on_big_axes(dst):
        return ()
    out: list[Step] = []
    cur = src
    mesh = src.mesh

    # 1. Pending sums the target no longer has.
    removing = [a for a in cur.partial if a not in dst.partial]
    if removing:
        for d in range(cur.ndim):
            have, want = cur.dim_axes[d], dst.dim_axes[d]
            # the target splits the dim over exactly those axes, or over them inside the
            # blocks it has (P("cp", partial="tp") -> P(("cp", "tp")): within each cp block)
            kept = have if want[: len(have)] == have else ()
            axes = want[len(kept) :]
            if kept and _nested(cur.shape[d], mesh, kept, axes) is None:
                continue
            if axes and (not have or kept) and set(axes) <= set(removing):
                dims = list(cur.dim_axes)
                dims[d] = want
                nxt = _with(cur, dims, [a for a in cur.partial if a not in axes])
                sizes = _nested(cur.shape[d], mesh, kept, axes)
                out.append(Step(PsumScatter(axes, d, sizes), cur, nxt))
                cur = nxt
                removing = [a for a in removing if a not in axes]
                break
        if removing:
            axes = in_mesh_order(mesh, removing)
            nxt = _with(cur, partial=[a for a in cur.partial if a not in axes])
            out.append(Step(Psum(axes), cur, nxt))
            cur = nxt

    # 2. Dims.
    target_dims = dst.dim_axes
    changed = [d for d in range(cur.ndim) if cur.dim_axes[d] != target_dims[d]]
    if changed:
        target = _with(cur, target_dims)
        gathers = [d for d in changed if cur.dim_axes[d]]
        slices = [d for d in changed if target_dims[d]]
        if (
            len(gathers) == 1
            and len(slices) == 1
            and gathers != slices
            and cur.dim_axes[gathers[0]] == target_dims[slices[0]]
            and not target_dims[gathers[0]]
            and not cur.dim_axes[slices[0]]
        ):
            i, j = gathers[0], slices[0]
            axes = cur.dim_axes[i]
            split, concat = (chunk_sizes(cur.shape[k], mesh, axes) for k in (j, i))
            out.append(Step(AllToAll(axes, j, i, split, concat), cur, target))
            cur = target
        elif gathers and (perm := _block_permutation(cur, target)) is not None:
            shapes = [tuple(lay.local_shape(r) for r in mesh.ranks) for lay in (cur, target)]
            out.append(Step(Ppermute(mesh.axis_names, perm, *shapes), cur, target))
            cur = target
        else:
            # A dim whose target keeps its leading (major) axes, each block split again over
            # the rest as the flat split does (P(("cp", "tp")) <-> P("cp") on an even dim),
            # gathers or slices only the rest, inside its blocks.
            kept = {d: _kept(cur.shape[d], mesh, cur.dim_axes[d], target_dims[d]) for d in changed}
            axes_out = set()
            for d in gathers:
                axes_out |= set(cur.dim_axes[d][len(kept[d]) :])
            # Closure: a dim split over any gathered axis is gathered too.
            grow = True
            to_gather = set(gathers)
            while grow:
                grow = False
                for d in range(cur.ndim):
                    if d not in to_gather and set(cur.dim_axes[d]) & axes_out:
                        to_gather.add(d)
                        kept[d] = ()
                        axes_out |= set(cur.dim_axes[d])
                        grow = True
            for d in sorted(to_gather):
                keep = kept.get(d, ())
                if keep == cur.dim_axes[d]:  # only split further (below)
                    continue
                dims = list(cur.dim_axes)
                dims[d] = keep
                nxt = _with(cur, dims)
                axes = cur.dim_axes[d][len(keep) :]
                sizes = _nested(cur.shape[d], mesh, keep, axes)
                out.append(Step(AllGather(axes, d, sizes, invariant=True), cur, nxt))
                cur = nxt
            for d in range(cur.ndim):
                if cur.dim_axes[d] != target_dims[d]:
                    keep = cur.dim_axes[d]  # () or what the target keeps (the gathers above)
                    dims = list(cur.dim_axes)
                    dims[d] = target_dims[d]
                    nxt = _with(cur, dims)
                    axes = target_dims[d][len(keep) :]
                    sizes = _nested(cur.shape[d], mesh, keep, axes)
                    out.append(Step(LocalSlice(axes, d, sizes), cur, nxt))
                    cur = nxt

    # 3. New pending sums.
    adding = [a for a in dst.partial if a not in cur.partial]
    if adding:
        axes = in_mesh_order(mesh, adding)
        out.append(Step(ZeroOthers(axes), cur, dst))
        cur = dst
    assert cur == dst, (cur, dst)
    return tuple(out)


def _kept(n: int, mesh, have: tuple[str, ...], want: tuple[str, ...]) -> tuple[str, ...]:
    """The leading axes a dim of size ``n`` split over ``have`` keeps on its way to ``want``:
    their common leading axes where each of their blocks splits over the rest of ``have`` and
    of ``want`` exactly as the flat splits do (:func:`_nested`), else ``()``."""
    k = 0
    while k < min(len(have), len(want)) and have[k] == want[k]:
        k += 1
    prefix = have[:k]
    if not prefix or any(_nested(n, mesh, prefix, rest) is None for rest in (have[k:], want[k:])):
        return ()
    return prefix


def _nested(n: int, mesh, outer: tuple[str, ...], inner: tuple[str, ...]):
    """The chunk sizes of a block of ``outer``'s split of a dim of size ``n``, split again over
    ``inner``, if every such block is as long and its chunks are the flat split's over
    ``outer + inner`` (``n`` divisible by ``outer``'s size, say, with even or equally uneven
    inner chunks), else None; with no ``outer``, the chunks of the dim over ``inner``.

    Example:
        >>> from fshard import Mesh
        >>> m = Mesh.abstract((2, 2), ("cp", "tp"))
        >>> _nested(8, m, ("cp",), ("tp",)), _nested(6, m, ("cp",), ("tp",))
        ((2, 2), None)
    """
    if not outer:
        return chunk_sizes(n, mesh, inner)
    ko, ki = mesh.size(outer), mesh.size(inner) if inner else 1
    if n % ko or not nests(n, ko, ki):  # equal blocks: one tuple of chunk sizes for all
        return None
    return chunk_sizes(n // ko, mesh, inner)


def _parts_stay(src: PartsLayout, dst) -> bool:
    return isinstance(dst, PartsLayout) and (src.dim, src.sizes, src.axes) == (
        dst.dim,
        dst.sizes,
        dst.axes,
    )


def _parts_scatter(src: PartsLayout, dst) -> tuple[Step, ...] | None:
    """A per-part layout pending over axes ``A`` -> the same parts split further over ``A``
    (``Parts(P("tp", partial="dp"))`` -> ``Parts(P(("tp", "dp")))``, FSDP's reduction of a
    param split per part): one :class:`PsumScatterParts`, where every part's flat split over
    the target's axes is its split over the source's axes split again over ``A`` (else
    ``None``: gather the parts, then as from P)."""
    if not isinstance(dst, PartsLayout) or (src.dim, src.sizes) != (dst.dim, dst.sizes):
        return None
    k = len(src.axes)
    axes = dst.axes[k:]
    if dst.axes[:k] != src.axes or not axes or not set(axes) <= set(src.partial):
        return None
    if set(dst.partial) != set(src.partial) - set(axes):
        return None
    others = [d for d in range(src.base.ndim) if d != src.dim]
    if any(src.base.dim_axes[d] != dst.base.dim_axes[d] for d in others):
        return None
    ko, ki = src.mesh.size(src.axes), src.mesh.size(axes)
    if not all(nests(n, ko, ki) for n in src.sizes):
        return None
    return (Step(PsumScatterParts(axes, src.dim, src, dst), src, dst),)


def _per_part(step: Step, like: PartsLayout) -> Step:
    """A step between two base layouts that leaves the parts dim alone, as the same step
    between the per-part layouts (the parts dim's blocks ride along)."""
    wrap = lambda lay: lay.with_spec(Parts(lay.spec, like.dim, like.sizes))  # noqa: E731
    return Step(step.op, wrap(step.src), wrap(step.dst), step.nbytes)


def _block_permutation(src: Layout, dst: Layout):
    """``((src_pos, dst_pos), ...)`` in mesh order if every rank's target block is exactly some
    other rank's current block (a pure permutation), else None."""
    ranks = src.mesh.ranks
    have = [src.shard_metadata(r) for r in ranks]
    want = [dst.shard_metadata(r) for r in ranks]
    if sorted(_box(m) for m in have) != sorted(_box(m) for m in want):
        return None
    used: set[int] = set()
    pairs = []
    for q, w in enumerate(want):
        box = _box(w)
        if _box(have[q]) == box and q not in used:
            p = q
        else:
            p = next((i for i, h in enumerate(have) if _box(h) == box and i not in used), None)
            if p is None:
                return None
        used.add(p)
        pairs.append((p, q))
    if all(p == q for p, q in pairs):
        return None
    return tuple(pairs)


def _box(m):
    return (m.shard_offsets, m.shard_sizes)
