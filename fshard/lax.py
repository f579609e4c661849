"""Named-axis collectives with JAX semantics, differentiable under every torch.func transform.

Every collective is a small frozen *op* (hashable static config: group, dims, chunk sizes) run
through one new-style ``torch.autograd.Function`` (:class:`_Collective`). The Function's
``backward`` applies the op's *transpose*, which is again an op run through the same Function,
so double backward, ``vmap(grad)``, ``jacrev``, ``jacfwd`` and ``hessian`` all work. Its ``vmap``
staticmethod moves the batch dim to the front and runs the collective once on the whole batch
(no c10d op ever sees a batched tensor); its ``jvp`` applies the op to the tangent (every op
here is linear).

A value is, per mesh axis, *invariant* (I: the same on every rank of the axis) or *varying*
(V). The ops and their transposes, as in JAX with ``check_vma=True``::

    op                       type      forward comm         transpose (backward)
    psum                     V -> I    all_reduce           pcast            (no comm)
    pcast                    I -> V    none                 psum             (all_reduce)
    all_gather(to=varying)   V -> V    all_gather           psum_scatter     (reduce_scatter)
    all_gather(to=invariant) V -> I    all_gather           local_slice      (no comm)
    local_slice              I -> V    none                 all_gather(to=invariant)
    psum_scatter             V -> V    reduce_scatter       all_gather(to=varying)
    all_to_all(split a, b)   V -> V    all_to_all           all_to_all(split b, concat a)
    ppermute(perm)           V -> V    send/recv            ppermute(inverse perm)
    pmax                     V -> I    all_reduce(max)      mask ties, psum of the mask

Inside :func:`fshard.shard_map` the axis names refer to the shard_map's mesh; elsewhere pass
``mesh=``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass, replace

import optree
import torch

from . import _comm
from .mesh import AxisGroup, Mesh

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pcast",
    "axis_index",
    "axis_size",
]

_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("fshard_mesh", default=None)


def current_mesh(mesh: Mesh | None = None) -> Mesh:
    """``mesh`` if given, else the mesh of the enclosing ``shard_map``."""
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a fshard.Mesh, got {type(mesh).__name__}")
        return mesh
    mesh = _MESH.get()
    if mesh is None:
        raise ValueError(
            "fs.lax collectives need a mesh: call them inside fs.shard_map, or pass mesh=..."
        )
    return mesh


# -- ops: static, hashable descriptions of one collective ------------------------------------


def _split_offset(sizes: tuple[int, ...] | None, total: int, n: int, index: int):
    if sizes is None:
        return index * (total // n), total // n
    return sum(sizes[:index]), sizes[index]


@dataclass(frozen=True, eq=False)
class AllGather:
    group: AxisGroup
    dim: int
    sizes: tuple[int, ...] | None = None
    invariant: bool = False

    def run(self, x):
        return _comm.all_gather(x, self.group, self.dim, self.sizes)

    def transpose(self):
        if self.invariant:
            return LocalSlice(self.group, self.dim, self.sizes)
        return PsumScatter(self.group, self.dim, self.sizes)

    def batched(self, batch: int):
        return replace(self, dim=self.dim + 1)


@dataclass(frozen=True, eq=False)
class LocalSlice:
    group: AxisGroup
    dim: int
    sizes: tuple[int, ...] | None = None

    def run(self, x):
        start, size = _split_offset(
            self.sizes, x.shape[self.dim], self.group.size, self.group.index
        )
        return x.narrow(self.dim, start, size)

    def transpose(self):
        return AllGather(self.group, self.dim, self.sizes, invariant=True)

    def batched(self, batch: int):
        return replace(self, dim=self.dim + 1)


@dataclass(frozen=True, eq=False)
class PsumScatter:
    group: AxisGroup
    dim: int
    sizes: tuple[int, ...] | None = None

    def run(self, x):
        return _comm.reduce_scatter(x, self.group, self.dim, self.sizes)

    def transpose(self):
        return AllGather(self.group, self.dim, self.sizes, invariant=False)

    def batched(self, batch: int):
        return replace(self, dim=self.dim + 1)


@dataclass(frozen=True, eq=False)
class Psum:
    group: AxisGroup

    def run(self, x):
        return _comm.all_reduce(x, self.group, "sum")

    def transpose(self):
        return Pcast(self.group)

    def batched(self, batch: int):
        return self


@dataclass(frozen=True, eq=False)
class Pcast:
    group: AxisGroup

    def run(self, x):
        return x.view_as(x)

    def transpose(self):
        return Psum(self.group)

    def batched(self, batch: int):
        return self


@dataclass(frozen=True, eq=False)
class AllToAll:
    group: AxisGroup
    split_dim: int
    concat_dim: int
    split_sizes: tuple[int, ...] | None = None
    concat_sizes: tuple[int, ...] | None = None

    def run(self, x):
        return _comm.all_to_all(
            x, self.group, self.split_dim, self.concat_dim, self.split_sizes, self.concat_sizes
        )

    def transpose(self):
        return AllToAll(
            self.group, self.concat_dim, self.split_dim, self.concat_sizes, self.split_sizes
        )

    def batched(self, batch: int):
        return replace(self, split_dim=self.split_dim + 1, concat_dim=self.concat_dim + 1)


@dataclass(frozen=True, eq=False)
class Ppermute:
    group: AxisGroup
    perm: tuple[tuple[int, int], ...]
    in_shape: tuple[int, ...] | None = None
    out_shape: tuple[int, ...] | None = None

    def run(self, x):
        return _comm.ppermute(x, self.group, self.perm, self.out_shape)

    def transpose(self):
        inverse = tuple((d, s) for s, d in self.perm)
        return Ppermute(self.group, inverse, self.out_shape, self.in_shape)

    def batched(self, batch: int):
        def grow(shape):
            return None if shape is None else (batch, *shape)

        return replace(self, in_shape=grow(self.in_shape), out_shape=grow(self.out_shape))


class _Collective(torch.autograd.Function):
    """Runs a linear collective op; backward runs its transpose through this same Function."""

    @staticmethod
    def forward(x, op):
        return op.run(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return apply(ctx.op.transpose(), g), None

    @staticmethod
    def jvp(ctx, x_t, _):
        return apply(ctx.op, x_t)

    @staticmethod
    def vmap(info, in_dims, x, op):
        if in_dims[0] is None:
            return apply(op, x), None
        x = x.movedim(in_dims[0], 0)
        return apply(op.batched(x.shape[0]), x), 0


def apply(op, x: torch.Tensor) -> torch.Tensor:
    """Run collective ``op`` on local tensor ``x`` (differentiable, vmappable)."""
    return _Collective.apply(x, op)


class _Pmax(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return _comm.all_reduce(x, group, "max")

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, group = inputs
        ctx.group = group
        ctx.save_for_backward(x, output)

    @staticmethod
    def _share(ctx, t):
        x, out = ctx.saved_tensors
        mask = (x == out).to(t.dtype)
        count = apply(Psum(ctx.group), mask)
        return t * mask / count

    @staticmethod
    def backward(ctx, g):
        return _Pmax._share(ctx, g), None

    @staticmethod
    def jvp(ctx, x_t, _):
        return apply(Psum(ctx.group), _Pmax._share(ctx, x_t))

    @staticmethod
    def vmap(info, in_dims, x, group):
        if in_dims[0] is None:
            return _Pmax.apply(x, group), None
        return _Pmax.apply(x.movedim(in_dims[0], 0), group), 0


# -- public named-axis API --------------------------------------------------------------------


def _group(axis, mesh: Mesh | None) -> AxisGroup:
    return current_mesh(mesh).group(axis)


def _dim(x: torch.Tensor, dim: int, name: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {dim!r}")
    nd = x.dim()
    if not -nd <= dim < max(nd, 1):
        raise ValueError(f"{name}={dim} is out of range for a tensor with {nd} dims")
    return dim % max(nd, 1)


def _tree_or_tensor(fn, x):
    if isinstance(x, torch.Tensor):
        return fn(x)
    return optree.tree_map(fn, x)


def psum(x, axis: str | Sequence[str], *, mesh: Mesh | None = None):
    """Sum over mesh ``axis``: varying in, invariant out (all_reduce).

    ``x`` may be a tensor or a pytree of tensors; a pytree is reduced with one all_reduce per
    dtype (leaves are flattened into one buffer), which is how data-parallel gradients are
    bucketed.

    Example:
        >>> total = fs.lax.psum(local_loss, "dp")  # doctest: +SKIP
    """
    g = _group(axis, mesh)
    if isinstance(x, torch.Tensor):
        return apply(Psum(g), x)
    leaves, spec = optree.tree_flatten(x)
    out = list(leaves)
    by_dtype: dict = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"psum: pytree leaf {i} is {type(leaf).__name__}, not a tensor")
        by_dtype.setdefault((leaf.dtype, leaf.device), []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        summed = apply(Psum(g), flat)
        for i, piece in zip(idx, torch.split(summed, [leaves[i].numel() for i in idx])):
            out[i] = piece.view_as(leaves[i])
    return optree.tree_unflatten(spec, out)


def pmean(x, axis: str | Sequence[str], *, mesh: Mesh | None = None):
    """Mean over mesh ``axis`` (psum, then divide by the axis size).

    Example:
        >>> avg = fs.lax.pmean(local_loss, "dp")  # doctest: +SKIP
    """
    n = _group(axis, mesh).size
    return _tree_or_tensor(lambda t: t / n, psum(x, axis, mesh=mesh))


def pmax(x: torch.Tensor, axis: str | Sequence[str], *, mesh: Mesh | None = None) -> torch.Tensor:
    """Elementwise max over mesh ``axis``; the gradient goes to the maxima (ties share it).

    Example:
        >>> m = fs.lax.pmax(local_max, "tp")  # doctest: +SKIP
    """
    return _Pmax.apply(x, _group(axis, mesh))


def all_gather(
    x: torch.Tensor,
    axis: str | Sequence[str],
    *,
    dim: int = 0,
    tiled: bool = True,
    sizes: Sequence[int] | None = None,
    to: str = "varying",
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Gather every rank's ``x`` along ``dim`` in axis order.

    Args:
        x: this rank's block.
        axis: mesh axis name or tuple of names (first most significant).
        dim: dim to concatenate along (``tiled=True``) or to insert (``tiled=False``).
        tiled: concatenate (True) or stack along a new dim (False), as in JAX.
        sizes: per-rank sizes along ``dim`` when they differ (uneven blocks); default equal.
        to: ``"varying"`` (JAX's default: the transpose is ``psum_scatter``) or
            ``"invariant"`` (the result is the same on every rank and its cotangent is taken as
            invariant: the transpose keeps the local block, no communication).

    Example:
        >>> full = fs.lax.all_gather(block, "x", dim=0)  # doctest: +SKIP
    """
    if to not in ("varying", "invariant"):
        raise ValueError(f"all_gather: to must be 'varying' or 'invariant', got {to!r}")
    g = _group(axis, mesh)
    if not tiled:
        x = x.unsqueeze(_dim(x.unsqueeze(0), dim))
        if sizes is not None:
            raise ValueError("all_gather: sizes= needs tiled=True (untiled blocks are equal)")
    d = _dim(x, dim)
    sizes = _check_sizes(sizes, g.size, "all_gather", x.shape[d] if x.dim() else 0, g.index)
    return apply(AllGather(g, d, sizes, invariant=(to == "invariant")), x)


def _check_sizes(sizes, n, name, local, index):
    if sizes is None:
        return None
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != n:
        raise ValueError(f"{name}: sizes has {len(sizes)} entries; the axis has {n} ranks")
    if sizes[index] != local:
        raise ValueError(
            f"{name}: sizes[{index}] = {sizes[index]} but this rank's block has size {local}"
        )
    return sizes


def psum_scatter(
    x: torch.Tensor,
    axis: str | Sequence[str],
    *,
    dim: int = 0,
    tiled: bool = True,
    sizes: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Sum over ``axis`` and keep this rank's block of ``dim`` (reduce-scatter).

    With ``tiled=False`` the size of ``dim`` must equal the axis size and the dim is removed.
    ``sizes`` gives uneven block sizes (must sum to the size of ``dim``).

    Example:
        >>> block = fs.lax.psum_scatter(partial_sum, "x", dim=0)  # doctest: +SKIP
    """
    g = _group(axis, mesh)
    d = _dim(x, dim)
    if not tiled:
        if x.shape[d] != g.size:
            raise ValueError(
                f"psum_scatter(tiled=False): dim {d} has size {x.shape[d]}, must equal the axis "
                f"size {g.size}"
            )
        return apply(PsumScatter(g, d, None), x).squeeze(d)
    if sizes is not None:
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != g.size or sum(sizes) != x.shape[d]:
            raise ValueError(
                f"psum_scatter: sizes {sizes} must have {g.size} entries summing to {x.shape[d]}"
            )
    elif x.shape[d] % g.size:
        raise ValueError(
            f"psum_scatter: dim {d} has size {x.shape[d]}, not divisible by the axis size "
            f"{g.size}; pass sizes= for uneven blocks"
        )
    return apply(PsumScatter(g, d, sizes), x)


def all_to_all(
    x: torch.Tensor,
    axis: str | Sequence[str],
    split_dim: int,
    concat_dim: int,
    *,
    tiled: bool = True,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Split ``split_dim`` into one block per rank, send block ``j`` to rank ``j``, and
    concatenate what arrives along ``concat_dim``.

    Example:
        >>> y = fs.lax.all_to_all(x, "x", split_dim=1, concat_dim=0)  # doctest: +SKIP
    """
    g = _group(axis, mesh)
    s, c = _dim(x, split_dim, "split_dim"), _dim(x, concat_dim, "concat_dim")
    if x.shape[s] % g.size:
        raise ValueError(
            f"all_to_all: split_dim {s} has size {x.shape[s]}, not divisible by the axis size "
            f"{g.size}"
        )
    if not tiled:
        raise NotImplementedError("all_to_all(tiled=False) is not supported; use tiled=True")
    return apply(AllToAll(g, s, c), x)


def ppermute(
    x: torch.Tensor,
    axis: str | Sequence[str],
    perm: Sequence[tuple[int, int]],
    *,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Send ``x`` from axis index ``src`` to ``dst`` for each pair in ``perm``; ranks that
    receive nothing get zeros (JAX semantics). The transpose is the inverse permutation.

    Example:
        >>> shifted = fs.lax.ppermute(x, "x", [(i, (i + 1) % 4) for i in range(4)])  # doctest: +SKIP
    """
    g = _group(axis, mesh)
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute: perm {list(pairs)} must use each source and destination once")
    if any(not 0 <= i < g.size for i in srcs + dsts):
        raise ValueError(f"ppermute: perm {list(pairs)} has indices outside [0, {g.size})")
    return apply(Ppermute(g, pairs), x)


def pcast(
    x: torch.Tensor, axis: str | Sequence[str], to: str = "varying", *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Mark an invariant value as varying over ``axis``: no forward communication; the
    gradient is summed over the axis (psum) so a replicated operand's gradient is reduced once.

    Example:
        >>> w_v = fs.lax.pcast(w, "dp")  # doctest: +SKIP
    """
    if to != "varying":
        raise ValueError(f"pcast: only to='varying' is supported, got {to!r}")
    return apply(Pcast(_group(axis, mesh)), x)


def axis_index(axis: str | Sequence[str], *, mesh: Mesh | None = None) -> int:
    """This rank's position along ``axis`` (a tuple is linearised, first axis most significant).

    Example:
        >>> i = fs.lax.axis_index("tp")  # doctest: +SKIP
    """
    return current_mesh(mesh).axis_index(axis)


def axis_size(axis: str | Sequence[str], *, mesh: Mesh | None = None) -> int:
    """Number of ranks along ``axis``.

    Example:
        >>> n = fs.lax.axis_size(("dp", "tp"))  # doctest: +SKIP
    """
    return current_mesh(mesh).size(axis)
