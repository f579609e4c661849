"""Leaves of optimizer pytrees: flatten to ShardedArray/tensor leaves, compute on the local
shards, rebuild with the same layouts; the few reductions that need the *global* value of a
sharded leaf (norms, means over a dim, "any NaN") and their collectives; hyperparameter checks.

Element-wise math never communicates: a sharded leaf's state has the leaf's layout, so the local
shards line up. Everything here runs on plain torch ops (no ``torch._foreach_*``, no Python
``int()`` of tensors), so it composes with ``torch.func.vmap``/``grad`` and ``torch.compile``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import optree
import torch

from .. import _compat, lax
from .._function import untracked
from .._leaf_errors import LeafErrors, paths
from ..api import reshard
from ..array import ShardedArray
from ..interop import rank_boxes
from ..spec import Layout, P, Parts, PartsLayout


def is_leaf(x) -> bool:
    return isinstance(x, ShardedArray)


def local(x) -> torch.Tensor:
    return x.local if isinstance(x, ShardedArray) else x


def rebuild(like, t: torch.Tensor):
    """``t`` (a local shard) with ``like``'s layout, or ``t`` itself for a plain ``like``."""
    return ShardedArray._raw(t, like.layout) if isinstance(like, ShardedArray) else t


def _leaf_problem(leaf) -> tuple[str, type[Exception]] | None:
    if not isinstance(leaf, (torch.Tensor, ShardedArray)):
        return f"got {type(leaf).__name__}", TypeError
    dtype = local(leaf).dtype
    if not dtype.is_floating_point:
        return (
            f"got dtype {dtype}; optimizers only work on floating-point params and gradients "
            "(as torch.optim): keep integer buffers out of the optimized pytree, or cast them "
            "(e.g. .float())",
            TypeError,
        )
    return None


def flatten(tree, name: str):
    """``(leaves, treespec)``; every leaf must be a floating-point ShardedArray or tensor (the
    error lists every leaf that is not, by its key path in ``name``)."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=False)
    problems = [_leaf_problem(x) for x in leaves]
    if any(problems):  # key paths only on the error path: flatten runs every step
        errors = LeafErrors(
            "fs.optim: every leaf must be a floating-point ShardedArray or torch.Tensor", name
        )
        for key, problem in zip(paths(spec), problems):
            if problem:
                errors.add(key, *problem)
        errors.raise_if_any()
    return leaves, spec


def check_match(leaves, ref_leaves, spec, ref_spec, name: str, ref_name: str) -> None:
    """``leaves`` and ``ref_leaves`` have the same structure and layouts; the error lists every
    differing key path. Skipped while dynamo traces on a torch whose dynamo cannot compare tree
    specs (:data:`fshard._compat.TRACES_TREESPEC_EQ`); eager calls still check."""
    if not _compat.TRACES_TREESPEC_EQ and torch.compiler.is_dynamo_compiling():
        return
    if spec != ref_spec:
        have, want = paths(spec), paths(ref_spec)
        errors = LeafErrors(
            f"fs.optim: {name} and {ref_name} must have the same tree structure"
            + _swapped_hint(leaves)
        )
        for key in [k for k in want if k not in set(have)]:
            errors.add(name + key, f"missing (it is a leaf of {ref_name})")
        for key in [k for k in have if k not in set(want)]:
            errors.add(name + key, f"not a leaf of {ref_name}")
        if not errors:  # same key paths, different node types (e.g. tuple vs list)
            raise ValueError(
                f"{name} and {ref_name} must have the same tree structure; got {spec} and "
                f"{ref_spec}"
            )
        errors.raise_if_any(fix=f"give {name} the structure of {ref_name}: {ref_spec}")
    bad = [i for i, (a, b) in enumerate(zip(leaves, ref_leaves)) if not _same_layout(a, b)]
    if bad:
        errors = LeafErrors(f"fs.optim: {name} and {ref_name} leaves must have the same layouts")
        keys = paths(spec)
        for i in bad:
            a, b = leaves[i], ref_leaves[i]
            errors.add(name + keys[i], f"{_describe(a)}, but {ref_name} has {_describe(b)}")
        errors.raise_if_any(fix="reshard them to the same layout (fs.reshard) first")


def _same_layout(a, b) -> bool:
    a_sh, b_sh = isinstance(a, ShardedArray), isinstance(b, ShardedArray)
    if a_sh != b_sh:
        return False
    return a.layout == b.layout if a_sh else a.shape == b.shape


def _describe(x) -> str:
    if isinstance(x, ShardedArray):
        return f"layout {x.layout}"
    return f"a plain tensor of shape {tuple(x.shape)}"


def _swapped_hint(leaves) -> str:
    """For a single scalar where a tree was expected: the usual cause."""
    if len(leaves) == 1 and math.prod(global_shape(leaves[0])) == 1:
        return (
            " (a single scalar: the loss? torch.func.grad_and_value returns (grads, loss), "
            "fs.value_and_grad returns (loss, grads))"
        )
    return ""


def flatten_like(tree, spec, ref_leaves, name: str, ref_name: str = "updates") -> list:
    leaves, tspec = flatten(tree, name)
    check_match(leaves, ref_leaves, tspec, spec, name, ref_name)
    return leaves


def tree_map(fn: Callable, tree, *rest, names: Sequence[str] = (), n_out: int = 1):
    """Apply ``fn`` to the local tensors of ``tree``'s leaves and the matching leaves of
    ``rest`` (same structure and layouts); rebuild the result(s) with ``tree``'s layouts.
    With ``n_out > 1``, ``fn`` returns a tuple and a tuple of ``n_out`` trees comes back."""
    leaves, spec = flatten(tree, "updates")
    others = [
        flatten_like(r, spec, leaves, names[k] if k < len(names) else f"tree {k + 1}")
        for k, r in enumerate(rest)
    ]
    outs = [fn(*[local(x) for x in xs]) for xs in zip(leaves, *others)]
    if n_out == 1:
        return optree.tree_unflatten(spec, [rebuild(x, o) for x, o in zip(leaves, outs)])
    return tuple(
        optree.tree_unflatten(spec, [rebuild(x, o[k]) for x, o in zip(leaves, outs)])
        for k in range(n_out)
    )


def zeros_like(tree, name: str = "params"):
    leaves, spec = flatten(tree, name)
    return optree.tree_unflatten(spec, [rebuild(x, torch.zeros_like(local(x))) for x in leaves])


def full_like(tree, value, name: str = "params"):
    leaves, spec = flatten(tree, name)
    return optree.tree_unflatten(
        spec, [rebuild(x, torch.full_like(local(x), value)) for x in leaves]
    )


def needs_params(params, who: str):
    if params is None:
        raise ValueError(f"{who}: update() needs params= (the current params)")
    return params


# -- global reductions over sharded leaves ------------------------------------------------------


def dim_axes(x) -> tuple:
    """The mesh axes of each dim of leaf ``x`` (of a per-part layout: each part's, on its
    parts dim); ``()`` per dim for a plain tensor."""
    if not isinstance(x, ShardedArray):
        return ((),) * x.ndim
    lay = x.layout
    return lay.base.dim_axes if isinstance(lay, PartsLayout) else lay.dim_axes


def _relaid(x, dims, shape, like_local, parts_dim=None):
    """``like_local`` as a leaf on ``x``'s mesh with per-dim axes ``dims`` and global ``shape``;
    per part on ``parts_dim`` (the dim of ``x``'s parts, where it is kept) when ``x`` is."""
    lay = x.layout
    spec = P(*[None if not a else a[0] if len(a) == 1 else a for a in dims])
    if isinstance(lay, PartsLayout) and parts_dim is not None:
        spec = Parts(spec, parts_dim, lay.sizes)
    return ShardedArray._raw(like_local, Layout.of(lay.mesh, spec, shape, like_local.dtype))


def _unpartial(x):
    """A partial ShardedArray reduced to its value (other leaves unchanged)."""
    if isinstance(x, ShardedArray) and x.layout.partial:
        spec = P(*dim_axes(x))
        if isinstance(x.layout, PartsLayout):
            spec = Parts(spec, x.layout.dim, x.layout.sizes)
        return reshard(x, spec)
    return x


def _axes_key(x) -> tuple:
    if not isinstance(x, ShardedArray):
        return (None, ())
    return (x.mesh, tuple(sorted(x.layout.sharded_axes, key=x.mesh.axis_names.index)))


def per_leaf_sums(leaves: list, local_fn: Callable, dtype: torch.dtype | None = None) -> list:
    """``[sum over the whole global leaf of local_fn(shard)]`` for each leaf, as 0-d tensors
    equal on every rank: ``local_fn`` maps a local shard to a 0-d partial sum; sharded leaves
    are summed over the mesh axes that split them with one ``fs.lax.psum`` per distinct
    (mesh, axes) group (replicated dims are counted once). Partial leaves are reduced first."""
    leaves = [_unpartial(x) for x in leaves]
    sums = [local_fn(local(x)) for x in leaves]
    if dtype is not None:
        sums = [s.to(dtype) for s in sums]
    groups: dict = {}
    for i, x in enumerate(leaves):
        mesh, axes = _axes_key(x)
        if axes:
            groups.setdefault((mesh, axes), []).append(i)
    for (mesh, axes), idx in groups.items():
        total = lax.psum(torch.stack([sums[i] for i in idx]), axes, mesh=mesh)
        for j, i in enumerate(idx):
            sums[i] = total[j]
    return sums


def promoted_dtype(leaves: list) -> torch.dtype:
    dtypes = [local(x).dtype for x in leaves]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def sq_sums(leaves: list) -> list:
    """Global squared L2 norm of each leaf, in the promoted dtype of all the leaves."""
    dtype = promoted_dtype(leaves)
    return per_leaf_sums(
        leaves, lambda t: torch.linalg.vector_norm(t, dtype=dtype).square(), dtype=dtype
    )


def dim_mean(x, t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Mean of the local shard ``t`` of leaf ``x`` over global dim ``dim``: local sum, psum over
    the mesh axes that shard ``dim`` (uneven shards included), divided by the global size."""
    s = t.sum(dim=dim, keepdim=keepdim)
    if isinstance(x, ShardedArray) and dim_axes(x)[dim]:
        s = lax.psum(s, dim_axes(x)[dim], mesh=x.mesh)
    size = x.layout.shape[dim] if isinstance(x, ShardedArray) else t.shape[dim]
    return s / size


def drop_dim(x, dim: int, like_local: torch.Tensor):
    """``like_local`` as a leaf with ``x``'s layout minus dim ``dim`` (replicated over the mesh
    axes that sharded it: the value was reduced over them)."""
    if not isinstance(x, ShardedArray):
        return like_local
    lay = x.layout
    axes = [a for d, a in enumerate(dim_axes(x)) if d != dim]
    shape = tuple(s for d, s in enumerate(lay.shape) if d != dim)
    parts = lay.dim if isinstance(lay, PartsLayout) and lay.dim != dim else None
    parts = None if parts is None else parts - (dim < parts)
    return _relaid(x, axes, shape, like_local, parts)


def global_shape(x) -> tuple:
    return tuple(x.layout.shape) if isinstance(x, ShardedArray) else tuple(x.shape)


# -- hyperparameters --------------------------------------------------------------------------


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def check_scalar(value, name: str, lo: float = -math.inf, hi: float | None = None, open_hi=False):
    """A float hyperparameter in a range, or a 0-d tensor (not range-checked: it may be traced,
    e.g. batched under ``torch.func.vmap`` or injected by :func:`inject_hyperparams`)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {value.shape}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {value!r}")
    bad = value < lo or (hi is not None and (value >= hi if open_hi else value > hi))
    if bad:
        rng = f"[{lo}, {hi})" if open_hi else f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {rng}, got {value}")
    return float(value)


def check_schedule(value, name: str = "learning_rate", lo: float = 0.0):
    """A float, a 0-d tensor or a schedule (callable of the step count)."""
    if callable(value):
        return value
    return check_scalar(value, name, lo=lo)


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def fresh_ok(*trees) -> bool:
    """Whether a transformation may write into the temporaries it created itself (fewer new
    tensors): true unless autograd or a ``torch.func`` transform sees one of the tensors in
    ``trees`` (in-place on a saved temporary would break the backward). Under
    ``torch.compile`` in-place ops are functionalized, so it is true there too."""
    if torch.compiler.is_compiling():
        return True
    for tree in trees:
        for x in optree.tree_leaves(tree, is_leaf=is_leaf):
            t = local(x) if isinstance(x, (torch.Tensor, ShardedArray)) else None
            if t is not None and untracked(t) is not t:
                return False
    return True


def count0() -> torch.Tensor:
    """A fresh step counter: a 0-d int64 CPU tensor (a tensor, so it can be traced/batched)."""
    return torch.zeros((), dtype=torch.int64)


def as_float(count: torch.Tensor) -> torch.Tensor:
    """The counter as float64, for bias corrections and schedules computed at full precision."""
    return count.to(torch.float64)


def _dims_axes(x, dims) -> tuple:
    """The mesh axes that shard any of ``dims`` of leaf ``x`` (none for a plain tensor)."""
    if not isinstance(x, ShardedArray):
        return ()
    return tuple(a for d in dims for a in dim_axes(x)[d])


def dims_sum(x, t: torch.Tensor, dims: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """Sum of the local shard ``t`` of leaf ``x`` over the global ``dims``: a local sum and one
    psum over the mesh axes that shard them (uneven shards included)."""
    s = t.sum(dim=tuple(dims), keepdim=keepdim)
    axes = _dims_axes(x, dims)
    return lax.psum(s, axes, mesh=x.mesh) if axes else s


def dims_max(x, t: torch.Tensor, dims: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """Max of the local shard ``t`` of leaf ``x`` over the global ``dims`` (local amax, one pmax
    over the mesh axes that shard them)."""
    m = t.amax(dim=tuple(dims), keepdim=keepdim)
    axes = _dims_axes(x, dims)
    return lax.pmax(m, axes, mesh=x.mesh) if axes else m


def dim_leaf(x, dim: int, like_local: torch.Tensor):
    """``like_local`` (a 1-D local tensor) as a leaf laid out like dim ``dim`` of ``x``."""
    if not isinstance(x, ShardedArray):
        return like_local
    parts = 0 if isinstance(x.layout, PartsLayout) and x.layout.dim == dim else None
    return _relaid(x, [dim_axes(x)[dim]], (x.layout.shape[dim],), like_local, parts)


def global_slice(x, full: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``full``, a tensor with leaf ``x``'s global shape."""
    if not isinstance(x, ShardedArray):
        return full
    boxes = rank_boxes(x.layout, x.mesh.rank)  # one, or one per part
    if len(boxes) == 1:
        return full[boxes[0].slices()]
    return torch.cat([full[m.slices()] for m in boxes], x.layout.dim)


def dim_block(x, dim: int) -> slice:
    """This rank's range of dim ``dim`` of leaf ``x`` (not its per-part dim)."""
    lay = x.layout
    if isinstance(lay, PartsLayout):
        if dim == lay.dim:
            raise ValueError(f"dim {dim} of {lay} is split per part: it is not one range")
        lay = lay.base
    return lay.shard_metadata(x.mesh.rank).slices()[dim]


def stacked(x, m: int, like_local: torch.Tensor):
    """``like_local`` (``(m, *local shape)``) as a leaf laid out like ``x`` with a leading
    whole dim of size ``m`` (a stack of ``m`` tensors like ``x``)."""
    if not isinstance(x, ShardedArray):
        return like_local
    lay = x.layout
    parts = lay.dim + 1 if isinstance(lay, PartsLayout) else None
    return _relaid(x, [(), *dim_axes(x)], (m, *lay.shape), like_local, parts)


def vdot(a_leaves: list, b_leaves: list) -> torch.Tensor:
    """``sum_i <a_i, b_i>`` over matching leaves and every shard, a 0-d tensor equal on every
    rank (one psum per group of leaves sharded alike)."""
    prods = [rebuild(a, local(a) * local(b)) for a, b in zip(a_leaves, b_leaves)]
    dtype = promoted_dtype(prods)
    sums = per_leaf_sums(prods, lambda t: t.sum(dtype=dtype))
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=dtype)
