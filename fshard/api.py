"""Moving between full tensors, local shards and layouts: shard, from_local, gather, reshard,
and the creation functions.

All of these are pure: they return new values and never mutate their inputs. ``shard``,
``gather`` and ``reshard`` are differentiable and vmappable (they are built from
:mod:`fshard.lax` ops), with the gradient contract of DESIGN §4: a cotangent has the layout of
its primal, and a replicated value is *invariant* (its cotangent is the same on every rank), so
``gather``'s backward keeps the local block with no communication and ``shard``'s backward
all-gathers the cotangent.

Devices (as DTensor's ``distribute_tensor`` and ``DTensor.from_local``): a ShardedArray's local
block lives on its mesh's device for this rank, ``mesh.device()`` (``cuda:<current device>`` on
a CUDA mesh, else the CPU). ``shard``, ``from_local`` and ``fs.nn.shard_params`` copy a tensor
given on another device there (``shard`` moves only this rank's block when the tensor is not
being differentiated); tensors on the ``meta`` device stay there. ``rand``/``randn`` draw where
their generator lives, so a CPU generator gives the dense CPU values on any mesh, moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import optree
import torch

from . import _comm, consistency
from ._leaf_errors import LeafErrors, paths
from .array import ShardedArray, is_sharded
from .executor import check_plain_tensor, reshard_one
from .mesh import Mesh
from .ops import random
from .planner import plan
from .spec import Layout, P, Parts, PartsLayout, _layout

__all__ = [
    "shard",
    "from_local",
    "gather",
    "reshard",
    "plan",
    "zeros",
    "ones",
    "full",
    "empty",
    "rand",
    "randn",
]


def _check_mesh(mesh, name="mesh") -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{name} must be a fshard.Mesh, got {type(mesh).__name__}")
    if mesh.is_abstract:
        raise ValueError(
            f"{name} is abstract ({mesh!r}): sharded values need a real mesh; use Mesh.create"
        )
    return mesh


def _on_mesh_device(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """``t`` on this rank's device of ``mesh`` (a copy when it is elsewhere, differentiable);
    a ``meta`` tensor stays where it is (as in DTensor)."""
    if t.device.type == "meta":
        return t
    device = mesh.device()
    return t if t.device == device else t.to(device)


def _differentiated(t: torch.Tensor) -> bool:
    """Whether ``t`` may carry a gradient: autograd, or a ``torch.func`` transform's wrapper."""
    return t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)


def _check_spec(spec, name="spec", parts: bool = False) -> P | Parts:
    """``spec`` if it is a :class:`P` (or, with ``parts``, a :class:`Parts`)."""
    if not isinstance(spec, (P, Parts) if parts else P):
        also = " or a fshard.Parts (a per-part split)" if parts else ""
        raise TypeError(
            f"{name} must be a fshard.P (e.g. fs.P('x', None)){also}, got "
            f"{type(spec).__name__} {spec!r}"
        )
    return spec


def reshard(x, spec):
    """Move ``x`` to layout ``spec`` with the fewest bytes (see :func:`fshard.plan`).

    Args:
        x: a :class:`ShardedArray`, or a pytree of them.
        spec: a :class:`P`, or a pytree of specs matching ``x`` (a prefix: one spec for a
            whole subtree).

    Returns:
        A new value (or pytree) with the target layouts; the input is not modified.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.arange(12.0).reshape(3, 4), mesh, fs.P("x", None))
        >>> y = fs.reshard(x, fs.P(None, "x"))  # S(0) -> S(1): one all_to_all
        >>> y.spec, y.local.shape, torch.equal(fs.gather(y), fs.gather(x))
        (P(None, 'x'), torch.Size([3, 2]), True)
    """
    if isinstance(x, ShardedArray):
        spec = _check_spec(spec, parts=True)
        if isinstance(spec, Parts) and not torch.compiler.is_dynamo_compiling():
            x.layout.with_spec(spec)  # sizes that do not fit raise here, before any collective
        return reshard_one(x, spec)
    leaves, treedef = optree.tree_flatten(x, is_leaf=is_sharded, none_is_leaf=False)
    if isinstance(spec, (P, Parts)):
        specs = [spec] * len(leaves)
    else:
        is_spec = lambda s: isinstance(s, (P, Parts, ShardedArray)) or s is None  # noqa: E731
        specs = treedef.flatten_up_to(optree.tree_broadcast_prefix(spec, x, is_leaf=is_spec))
    errors = LeafErrors("reshard: leaves that cannot take their spec", "x")
    for key, v, s in zip(paths(treedef), leaves, specs):  # all checked before any collective
        if not isinstance(v, ShardedArray):
            errors.add(
                key, f"got {type(v).__name__}; expected a ShardedArray (fs.shard it)", TypeError
            )
        elif not isinstance(s, (P, Parts)):
            errors.add(key, f"spec {s!r}; expected a fshard.P (e.g. fs.P('x', None))", TypeError)
        else:
            try:
                v.layout.with_spec(s)
            except (TypeError, ValueError) as e:
                errors.add(key, f"spec {s} does not fit layout {v.layout}: {e}")
    errors.raise_if_any()
    return treedef.unflatten([reshard_one(v, s) for v, s in zip(leaves, specs)])


def shard(
    t: torch.Tensor | None,
    mesh: Mesh,
    spec: P,
    *,
    src: int | None = None,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> ShardedArray:
    """Split a full tensor into a :class:`ShardedArray`.

    Args:
        t: the full tensor. With ``src=None`` every rank passes the same ``t`` and keeps its
            block with no communication (differentiable: the backward all-gathers the
            cotangent). With ``src=r`` only rank ``r`` needs ``t`` (others may pass ``None``);
            each rank receives only its block (a scatter, never a broadcast of the whole). The
            scatter path is not differentiable.
        mesh: the mesh (``Mesh.create``).
        spec: the layout, e.g. ``P("dp", None)``; partial axes keep ``t`` on the first rank of
            the axis and zeros elsewhere.
        src: see ``t``. A rank other than ``src`` that passes a tensor (or ``shape`` and
            ``dtype``) claims ``src``'s shape and dtype: they are compared before the scatter
            (one small all_reduce), and ranks that differ raise the same ``ValueError``.
            A ``meta`` ``t`` gives a ``meta`` ShardedArray (shapes, layouts, planning; no
            data: ``fs.gather`` of it is a ``meta`` tensor).
        shape: with ``src=r``, ranks other than ``r`` may give the global shape and dtype
            instead of ``t``; either way rank ``r``'s are sent in the same small message.
        dtype: see ``shape``.

    Returns:
        The sharded value, its block on ``mesh.device()`` whatever device ``t`` is on (as
        DTensor's ``distribute_tensor``): a CPU tensor sharded onto a CUDA mesh is copied to
        this rank's GPU. Only the block is copied, unless ``t`` is being differentiated (then
        ``t`` moves first and the block is cut there, so that the backward gathers on the
        mesh's device and hands ``t`` its gradient on ``t``'s device). The block never keeps
        the rest of ``t`` alive: a part of ``t`` is copied out of it (a replicated value is
        ``t`` itself, as DTensor's ``Replicate``).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.arange(10.0).reshape(5, 2), mesh, fs.P("x", None))
        >>> x.shape, [m.shard_sizes for m in x.shards_metadata()]  # 5 rows: 3 | 2
        (torch.Size([5, 2]), [(3, 2), (2, 2)])
    """
    mesh, spec = _check_mesh(mesh), _check_spec(spec, parts=True)
    if src is not None:
        return _scatter(t, mesh, spec, src, shape, dtype)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"shard: t must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, ShardedArray):
        raise TypeError("shard: t is already a ShardedArray; use fs.reshard to change its layout")
    check_plain_tensor(t, "shard: t")
    full = _layout(mesh, P(), tuple(t.shape), t.dtype)
    layout = Layout.of(mesh, spec, tuple(t.shape), t.dtype)
    if consistency.enabled():
        _agree(layout, "shard (every rank must pass the same full tensor)", values=t)
    moved = _on_mesh_device(t, mesh)
    if moved is t:
        out = reshard_one(ShardedArray._raw(t, full), layout.spec)
        block = out.local
        if block._is_view() and block.numel() < t.numel():
            # A block of its own, as DTensor's distribute_tensor clones its shard: a view would
            # keep all of t alive on every rank for as long as the sharded value lives.
            return ShardedArray._raw(block.clone(), out.layout)
        return out
    if _differentiated(t):
        # The backward all-gathers the cotangent over the mesh: on its device, then `.to`'s
        # backward returns it to t's device. The block is copied out of the moved whole.
        out = reshard_one(ShardedArray._raw(moved, full), layout.spec)
        return ShardedArray._raw(out.local.clone(), out.layout)
    # replicated -> any spec is local (slices, zeros): cut the block where t is, move it alone
    out = reshard_one(ShardedArray._raw(t, full), layout.spec)
    return ShardedArray._raw(_on_mesh_device(out.local, mesh).contiguous(), out.layout)


def _scatter(t, mesh: Mesh, spec: P | Parts, src: int, shape, dtype) -> ShardedArray:
    if isinstance(src, bool) or not isinstance(src, int) or src not in mesh.ranks:
        raise ValueError(f"shard: src must be a rank of the mesh {mesh.ranks}, got {src!r}")
    me = mesh.rank
    if me == src and not isinstance(t, torch.Tensor):
        raise TypeError(f"shard: rank {src} is src and must pass a tensor, got {type(t).__name__}")
    if isinstance(t, torch.Tensor):
        check_plain_tensor(t, "shard: t")
        t = _on_mesh_device(t, mesh)  # the blocks leave from the mesh's device (NCCL: the GPU)
    given = None if shape is None or dtype is None else (tuple(shape), dtype)
    if isinstance(t, torch.Tensor):  # a tensor on any rank claims the shape and dtype
        meta = (tuple(t.shape), t.dtype)
        if given is not None and given != meta:
            raise ValueError(
                f"shard: t has shape {meta[0]} and dtype {meta[1]} but shape={given[0]}, "
                f"dtype={given[1]} were passed; pass one or the other"
            )
    else:
        meta = given
    g = mesh.group(mesh.axis_names)
    meta = _comm.agree_meta(meta, g, g.ranks.index(src))
    target = Layout.of(mesh, spec, meta[0], meta[1])
    _agree(target, f"shard(src={src}) (the shape and dtype passed must be rank {src}'s tensor's)")
    # one box per rank: the per-part dim is scattered whole, then sliced (no communication)
    layout = target.made_whole()
    layout = layout.with_spec(P(*layout.spec.dims))  # pending sums are made after the scatter
    blocks = [layout.shard_metadata(r).slices() for r in g.ranks]
    like = t if me == src else torch.empty(0, dtype=meta[1], device=mesh.device())
    local = _comm.scatter_from(t, g, g.ranks.index(src), blocks, like)
    out = ShardedArray._raw(local, layout)
    return reshard_one(out, spec) if layout != target else out


def from_local(
    local: torch.Tensor, mesh: Mesh, spec: P, shape: Sequence[int] | None = None
) -> ShardedArray:
    """Wrap this rank's block as a :class:`ShardedArray` (no communication).

    Args:
        local: this rank's block.
        mesh: the mesh.
        spec: the layout the blocks follow.
        shape: the global shape. Required whenever a dim is split (it is never inferred from
            local sizes, which is ambiguous for uneven shards); may be omitted for a fully
            replicated or purely partial spec.

    Returns:
        The sharded value; ``local`` is checked against the layout's block for this rank. A
        ``local`` on another device than ``mesh.device()`` is copied there (as
        ``DTensor.from_local`` does; differentiable), so a CPU block wrapped on a CUDA mesh
        lands on this rank's GPU; a ``meta`` block stays on ``meta``. With ``local`` already
        there, the result holds ``local`` itself (no copy).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> rows = 3 if mesh.rank == 0 else 2  # this rank's block of 5 rows: 3 | 2
        >>> x = fs.from_local(torch.ones(rows, 4), mesh, fs.P("x"), shape=(5, 4))
        >>> x.shape, float(fs.gather(x).sum())
        (torch.Size([5, 4]), 20.0)
    """
    mesh, spec = _check_mesh(mesh), _check_spec(spec, parts=True)
    if isinstance(local, ShardedArray) or not isinstance(local, torch.Tensor):
        raise TypeError(f"from_local: local must be a torch.Tensor, got {type(local).__name__}")
    check_plain_tensor(local, "from_local: local")
    if shape is None:
        if isinstance(spec, Parts) or any(spec.dims):
            raise ValueError(
                f"from_local: spec {spec} splits a dim, so shape= (the global shape) is required; "
                "fshard never infers it from local sizes"
            )
        shape = tuple(local.shape)
    layout = Layout.of(mesh, spec, shape, local.dtype)
    want = layout.local_shape(mesh.rank)
    if tuple(local.shape) != want:
        raise ValueError(
            f"from_local: rank {mesh.rank} holds a block of shape {tuple(local.shape)} but layout "
            f"{spec} of global shape {layout.shape} gives this rank {want}"
        )
    _agree(layout, "from_local")
    return ShardedArray._raw(_on_mesh_device(local, mesh), layout)


def _agree(layout: Layout, what: str, **values) -> None:
    """Consistency mode: every rank of the mesh must pass the same layout (and ``values``)."""
    if consistency.enabled():
        fields = {"spec": layout.spec, "global shape": layout.shape, "dtype": layout.dtype}
        consistency.check_equal({**fields, **values}, layout.mesh, what=what)


def gather(x: ShardedArray, dst: int | None = None) -> torch.Tensor | None:
    """The full tensor: on every rank (``dst=None``), or on rank ``dst`` only (others: None).

    ``dst=None`` is differentiable; a partial value is summed. Its backward keeps the local
    block (the full value is invariant), so no communication happens in backward.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.arange(6.0), mesh, fs.P("x"))
        >>> fs.gather(x)  # the full tensor, on every rank
        tensor([0., 1., 2., 3., 4., 5.])
    """
    if not isinstance(x, ShardedArray):
        raise TypeError(f"gather: x must be a ShardedArray, got {type(x).__name__}")
    if x.local.is_meta and x.mesh.simulated_rank is None:
        # a meta value (planning) has no data to move: the full meta tensor. On a simulated
        # mesh (fs.dry_run) gather runs as on the real mesh: its collectives are the run's.
        if dst is not None and (isinstance(dst, bool) or dst not in x.mesh.ranks):
            raise ValueError(f"gather: dst must be a rank of the mesh {x.mesh.ranks}, got {dst!r}")
        full = torch.empty(x.shape, dtype=x.dtype, device="meta")
        return full if dst is None or dst == x.mesh.rank else None
    if dst is None:
        return reshard_one(x, P()).local
    mesh = x.mesh
    consistency.boundary(mesh, f"fs.gather(dst={dst})")
    if isinstance(dst, bool) or not isinstance(dst, int) or dst not in mesh.ranks:
        raise ValueError(f"gather: dst must be a rank of the mesh {mesh.ranks}, got {dst!r}")
    if isinstance(x.layout, PartsLayout):  # one box per rank: the parts dim gathered
        x = reshard_one(x, x.layout.made_whole().spec)
    if x.layout.partial:
        x = reshard_one(x, P(*x.layout.dim_axes))
    g = mesh.group(mesh.axis_names)
    blocks = [x.layout.shard_metadata(r).slices() for r in g.ranks]
    return _comm.gather_to(x.local, g, g.ranks.index(dst), blocks, x.layout.shape)


# -- creation ---------------------------------------------------------------------------------


def _creation_layout(shape, mesh, spec, dtype) -> Layout:
    mesh, spec = _check_mesh(mesh), _check_spec(spec)
    if spec.partial:
        raise ValueError(f"creation functions make unreduced values only via reshard; got {spec}")
    if isinstance(shape, int):
        shape = (shape,)
    return Layout(mesh, spec, tuple(shape), dtype or torch.get_default_dtype())


def _filled(fill, shape, mesh, spec, dtype, value=None) -> ShardedArray:
    layout = _creation_layout(shape, mesh, spec, dtype)
    _agree(layout, "a creation function (zeros/ones/full/empty)", fill=value)
    local = fill(layout.local_shape(mesh.rank), dtype=layout.dtype, device=mesh.device())
    return ShardedArray._raw(local, layout)


def zeros(shape, mesh: Mesh, spec: P, *, dtype: torch.dtype | None = None) -> ShardedArray:
    """A sharded tensor of zeros (each rank allocates only its block).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> z = fs.zeros((5, 4), mesh, fs.P("x"))
        >>> z.shape, z.spec, z.local.shape[1], float(fs.gather(z).abs().sum())
        (torch.Size([5, 4]), P('x'), 4, 0.0)
    """
    return _filled(torch.zeros, shape, mesh, spec, dtype)


def ones(shape, mesh: Mesh, spec: P, *, dtype: torch.dtype | None = None) -> ShardedArray:
    """A sharded tensor of ones (each rank allocates only its block).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> o = fs.ones((5, 4), mesh, fs.P("x"))
        >>> o.shape, float(fs.gather(o).sum())
        (torch.Size([5, 4]), 20.0)
    """
    return _filled(torch.ones, shape, mesh, spec, dtype)


def empty(shape, mesh: Mesh, spec: P, *, dtype: torch.dtype | None = None) -> ShardedArray:
    """A sharded tensor with uninitialised values (each rank allocates only its block).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> e = fs.empty((5, 4), mesh, fs.P("x"))  # uninitialised blocks
        >>> e.shape, e.spec
        (torch.Size([5, 4]), P('x'))
    """
    return _filled(torch.empty, shape, mesh, spec, dtype)


def full(shape, fill_value, mesh: Mesh, spec: P, *, dtype: torch.dtype | None = None):
    """A sharded tensor filled with ``fill_value``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> f = fs.full((5, 4), 3.0, mesh, fs.P("x"))
        >>> f.shape, float(fs.gather(f).sum())
        (torch.Size([5, 4]), 60.0)
    """
    return _filled(
        lambda s, **kw: torch.full(s, fill_value, **kw), shape, mesh, spec, dtype, fill_value
    )


def _random(draw, shape, mesh, spec, dtype, generator) -> ShardedArray:
    layout = _creation_layout(shape, mesh, spec, dtype)
    if not (layout.dtype.is_floating_point or layout.dtype.is_complex):
        raise TypeError(
            f"{draw.__name__}: dtype must be a floating point or complex dtype (as for "
            f"torch.{draw.__name__}), got {layout.dtype}; draw floats and convert "
            f"(fs.{draw.__name__}(...).to(...)), or use torch.randint on full tensors with "
            "fs.shard"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if consistency.enabled():
        state = consistency.rng_state(generator, mesh.device())
        _agree(layout, f"{draw.__name__}: the generator state every rank draws from", rng=state)
    # Draw the whole tensor and keep this rank's block: the values equal the dense call with the
    # same seed on any mesh and spec. Cost: each rank draws and briefly holds the full tensor.
    # A generator draws on its own device (a CPU generator: the dense CPU values on a CUDA
    # mesh); only the block moves to the mesh's device.
    device = mesh.device() if generator is None else generator.device
    whole = draw(layout.shape, generator=generator, dtype=layout.dtype, device=device)
    return ShardedArray._raw(random.block_of(layout, whole, mesh.device()).contiguous(), layout)


def rand(shape, mesh: Mesh, spec: P, *, dtype=None, generator=None) -> ShardedArray:
    """Uniform [0, 1) values equal to ``torch.rand(shape, generator=g)`` for the same seed.

    Every rank must hold a generator in the same state (same seed). Memory: each rank draws the
    full tensor once (O(global size) transiently, then keeps only its block), which is what
    makes the values independent of the mesh and the spec.

    Devices: the values are drawn on the generator's device and the block is moved to
    ``mesh.device()``. So ``generator=torch.Generator().manual_seed(0)`` (a CPU generator) works
    on a CUDA mesh too and gives exactly ``torch.rand(shape, generator=g)`` (the CPU values);
    a CUDA generator gives the CUDA stream's values. Without a generator the mesh device's
    default generator draws (every rank must be seeded alike: ``torch.manual_seed``).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.rand((4, 6), mesh, fs.P(None, "x"), generator=torch.Generator().manual_seed(0))
        >>> torch.equal(fs.gather(w), torch.rand(4, 6, generator=torch.Generator().manual_seed(0)))
        True
    """
    return _random(torch.rand, shape, mesh, spec, dtype, generator)


def randn(shape, mesh: Mesh, spec: P, *, dtype=None, generator=None) -> ShardedArray:
    """Normal values equal to ``torch.randn(shape, generator=g)`` for the same seed.

    Same contract, devices and memory cost as :func:`rand`: a CPU generator gives the values
    of ``torch.randn(shape, generator=g)`` on the CPU, on any mesh.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.randn((4, 6), mesh, fs.P("x"), generator=torch.Generator().manual_seed(0))
        >>> torch.equal(fs.gather(w), torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))
        True
    """
    return _random(torch.randn, shape, mesh, spec, dtype, generator)
