"""``jacfwd`` / ``hessian`` with respect to global values, for ShardedArray arguments.

``torch.func.jacfwd`` builds its standard basis from the tensors the pytree hands it; for a
ShardedArray that is each rank's local block, which is not a basis of the global value: basis
vector ``k`` is a different global direction on every rank (and uneven blocks give the ranks
different batch sizes, so the collectives inside disagree). :func:`fshard.array` therefore
refuses it for a split or partial argument, pointing here.

:func:`jacfwd` builds the basis of the *global* value: vector ``k`` is the one-hot ``e_k`` of the
flattened global argument, laid out as the argument (each rank holds its block of ``e_k``;
a partial argument's first rank of the partial axes holds it, the others zeros, so the addends
sum to ``e_k``), and pushes all of them through ``torch.func.jvp`` under one ``torch.func.vmap``,
as torch.func does for plain tensors. Each rank computes every column for its own output
block, so the Jacobian of a ShardedArray output keeps the output's layout on the leading dims
and is replicated over the trailing (argument) dims::

    out layout P('x'), shape (m,)  ->  jacobian layout P('x', None, None), shape (m, *x.shape)

:func:`hessian` is ``jacfwd(torch.func.jacrev(f))`` (forward over reverse, as torch.func);
``jacrev`` is right as it is (its basis lives on the output).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .array import ShardedArray, is_sharded
from .autodiff import _check_argnums
from .ops._common import spec as dims_spec
from .spec import Layout

__all__ = ["jacfwd", "hessian"]


def _global_shape(v) -> tuple[int, ...]:
    return tuple(v.layout.shape) if isinstance(v, ShardedArray) else tuple(v.shape)


def _basis(leaf, start: int, total: int):
    """Basis vectors ``start .. start + numel`` of ``total`` restricted to ``leaf``: a tensor or
    a ShardedArray of ``leaf``'s layout whose local block has a leading batch dim ``total``."""
    local = leaf.local if isinstance(leaf, ShardedArray) else leaf
    shape = _global_shape(leaf)
    n = math.prod(shape)
    full = torch.zeros(total, n, dtype=local.dtype, device=local.device)
    full[start : start + n].copy_(torch.eye(n, dtype=local.dtype, device=local.device))
    full = full.reshape(total, *shape)
    if not isinstance(leaf, ShardedArray):
        return full
    layout = leaf.layout
    if layout.is_explicit:
        raise TypeError(
            "fs.jacfwd: an argument has an explicit layout (Layout.explicit); reshard it to a "
            "fs.P layout first: fs.reshard(x, fs.P(...))"
        )
    meta = layout.shard_metadata(layout.mesh.rank)
    block = full[(slice(None), *meta.slices())]
    if layout.partial and layout.mesh.axis_index(layout.partial) != 0:
        block = torch.zeros_like(block)  # addends: the first rank of the partial axes holds e_k
    return ShardedArray._raw(block.contiguous(), layout)


def _columns(jac, start: int, shape: tuple[int, ...]):
    """Columns ``start .. start + numel(shape)`` of a batched jvp output (batch dim first),
    moved to the trailing dims as ``shape``. A ShardedArray output comes out of ``vmap`` with the
    batch dim in its layout (``P(None, *out)``); its Jacobian keeps the output's layout on the
    leading dims and is replicated on the new ones."""
    n = math.prod(shape)
    local = jac.local if isinstance(jac, ShardedArray) else jac
    cols = local[start : start + n].movedim(0, -1)
    cols = cols.reshape(*cols.shape[:-1], *shape)
    if not isinstance(jac, ShardedArray):
        return cols
    out = jac.layout
    spec = dims_spec([*out.dim_axes[1:], *[()] * len(shape)], out.partial)
    return ShardedArray._raw(cols, Layout(out.mesh, spec, (*out.shape[1:], *shape), out.dtype))


def jacfwd(func: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """``torch.func.jacfwd`` with the basis of each argument's global value.

    Args:
        func: a function of tensors and ShardedArrays (pytrees of them) returning a pytree of
            tensors and ShardedArrays.
        argnums: the positional argument (int) or arguments (tuple) to differentiate.
        has_aux: ``func`` returns ``(output, aux)``; aux is returned as computed.

    Returns:
        A function with ``func``'s signature returning the Jacobian in torch.func's structure:
        per output leaf, the argument's structure (a tuple of them for a tuple ``argnums``),
        each leaf of shape ``out.shape + arg.shape`` (global shapes); a ShardedArray output's
        Jacobian keeps its layout on the leading dims.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.arange(4.0), mesh, fs.P("x"))
        >>> j = fs.jacfwd(lambda x: fs.gather(x * x))(x)
        >>> torch.equal(j, torch.diag(2 * torch.arange(4.0)))  # a plain tensor: the output is one
        True
    """
    if not callable(func):
        raise TypeError(f"jacfwd: func must be callable, got {type(func).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"jacfwd: has_aux must be a bool, got {has_aux!r}")
    _check_argnums(argnums, None)

    @functools.wraps(func)
    def run(*args):
        nums = _check_argnums(argnums, len(args))
        primals = tuple(args[i] for i in nums)
        leaves, spec = pytree.tree_flatten(primals, is_leaf=is_sharded)
        for leaf in leaves:
            if not isinstance(leaf, (torch.Tensor, ShardedArray)):
                raise TypeError(
                    f"jacfwd: the differentiated arguments must hold tensors and ShardedArrays, "
                    f"got {type(leaf).__name__}"
                )
        shapes = [_global_shape(v) for v in leaves]
        sizes = [math.prod(s) for s in shapes]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        basis = [_basis(v, s, total) for v, s in zip(leaves, starts)]

        def push(*tangent_leaves):
            tangents = pytree.tree_unflatten(list(tangent_leaves), spec)

            def at(*ps):
                full = list(args)
                for i, p in zip(nums, ps):
                    full[i] = p
                return func(*full)

            out = torch.func.jvp(at, primals, tangents, has_aux=has_aux)
            return (out[1], out[2]) if has_aux else out[1]

        results = torch.func.vmap(push)(*basis)
        aux = None
        if has_aux:
            results, aux = results
            aux = pytree.tree_map(lambda a: a[0], aux, is_leaf=is_sharded)
        outs, out_spec = pytree.tree_flatten(results, is_leaf=is_sharded)
        jac = []
        for o in outs:
            per_arg = [_columns(o, s, shape) for s, shape in zip(starts, shapes)]
            tree = pytree.tree_unflatten(per_arg, spec)
            jac.append(tree[0] if isinstance(argnums, int) else tree)
        jac = pytree.tree_unflatten(jac, out_spec)
        return (jac, aux) if has_aux else jac

    return run


def hessian(func: Callable, argnums: int | Sequence[int] = 0) -> Callable:
    """``torch.func.hessian`` with respect to global values: ``jacfwd(torch.func.jacrev(func))``
    with :func:`jacfwd`'s global basis.

    Args:
        func: a function returning a scalar (a tensor, or a replicated value through
            ``fs.gather``).
        argnums: the argument(s) to differentiate.

    Returns:
        A function returning the Hessian: for one ShardedArray argument ``x`` of layout ``L``,
        shape ``x.shape + x.shape``, laid out as ``L`` on the leading dims.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.arange(4.0), mesh, fs.P("x"))
        >>> h = fs.hessian(lambda x: fs.gather((x**3).sum()))(x)
        >>> torch.equal(fs.gather(h), torch.diag(6 * torch.arange(4.0)))
        True
    """
    if not callable(func):
        raise TypeError(f"hessian: func must be callable, got {type(func).__name__}")
    return jacfwd(torch.func.jacrev(func, argnums), argnums)
