"""Applying updates: :func:`apply_updates` (optax's) and :func:`step`, the whole optimizer step,
optionally with donated buffers (JAX ``donate_argnums``) and ``torch.optim``'s in-place foreach
kernels.

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.sgd(0.5, momentum=0.9)
    >>> params = {"w": torch.ones(2)}
    >>> state = tx.init(params)
    >>> params, state = fs.optim.step(tx, {"w": torch.ones(2)}, state, params, donate=True)
    >>> params["w"]
    tensor([0.5000, 0.5000])
"""

from __future__ import annotations

import optree
import torch

from .. import _compat, consistency
from .._function import untracked
from ..array import ShardedArray
from . import _tree
from .base import GradientTransformation

__all__ = ["apply_updates", "step"]


def groups(locals_: list, extra_key=None) -> dict:
    """Indices grouped by (device, dtype[, extra key]) so each foreach call sees one kind."""
    out: dict = {}
    for i, t in enumerate(locals_):
        key = (t.device, t.dtype) if extra_key is None else (t.device, t.dtype, extra_key[i])
        out.setdefault(key, []).append(i)
    return out


def donatable(*tensor_lists: list) -> bool:
    """In-place is exact here: eager mode (not being compiled), no tensor takes part in autograd
    or a ``torch.func`` transform, and no two share a buffer."""
    if torch.compiler.is_compiling():
        return False
    seen = set()
    for ts in tensor_lists:
        for t in ts:
            if t.requires_grad or untracked(t) is not t:
                return False
            if t.numel():
                ptr = _compat.data_id(t)
                if ptr in seen:
                    return False
                seen.add(ptr)
    return True


def concrete(value):
    """A hyperparameter as a Python number for the in-place kernels, or None when it is a
    tensor that autograd or a transform sees (the pure path must run)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad or untracked(value) is not value or value.dim():
            return None
        return value.item()
    return value


def step_operands(grads, params):
    """``(treespec, param locals, grad locals)``, or None when a grad's dtype or device differs
    from its param's (the out-of-place path handles the conversion)."""
    leaves, spec = _tree.flatten(grads, "grads")
    pleaves, pspec = _tree.flatten(params, "params")
    _tree.check_match(leaves, pleaves, spec, pspec, "grads", "params")
    p, g = [_tree.local(x) for x in pleaves], [_tree.local(x) for x in leaves]
    if any(a.dtype != b.dtype or a.device != b.device for a, b in zip(p, g)):
        return None
    return pspec, p, g


def apply_updates(params, updates, *, donate: bool = False):
    """``params + updates``, leaf by leaf (optax's ``apply_updates``), in the params' dtypes.

    Args:
        params: pytree of ShardedArrays / tensors.
        updates: pytree with the same structure and layouts.
        donate: reuse the params' local buffers for the result, like ``jax.jit``'s
            ``donate_argnums``: the sum is added in place (one ``torch._foreach_add_`` per
            dtype/device group), so no new parameter memory is allocated. ``params`` must not
            be used afterwards, and any tensor its local shards alias is overwritten too
            (``fs.shard`` of a replicated value and ``fs.nn.shard_params`` keep views of the
            tensors they were given). Ignored (out of place, nothing mutated) when a leaf takes
            part in autograd or a ``torch.func`` transform, under ``torch.compile``, or when
            two leaves share a buffer.

    Returns:
        The new params (same layouts). Without donation, differentiable w.r.t. both arguments
        and the inputs are untouched.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    pleaves, pspec = _tree.flatten(params, "params")
    uleaves = _tree.flatten_like(updates, pspec, pleaves, "updates", "params")
    p, u = [_tree.local(x) for x in pleaves], [_tree.local(x) for x in uleaves]
    if donate and donatable(p, u):
        for idx in groups(p).values():
            ui = [u[i] if u[i].dtype == p[i].dtype else u[i].to(p[i].dtype) for i in idx]
            torch._foreach_add_([p[i] for i in idx], ui)
        return params
    out = [a + (b if b.dtype == a.dtype else b.to(a.dtype)) for a, b in zip(p, u)]
    return optree.tree_unflatten(pspec, [_tree.rebuild(x, t) for x, t in zip(pleaves, out)])


def _tensors(tree) -> list:
    return [
        _tree.local(x)
        for x in optree.tree_leaves(tree, is_leaf=_tree.is_leaf)
        if isinstance(x, torch.Tensor) or _tree.is_leaf(x)
    ]


def _mesh_of(tree):
    """The mesh of the first ShardedArray in ``tree`` (None when it holds none)."""
    for x in optree.tree_leaves(tree, is_leaf=_tree.is_leaf):
        if isinstance(x, ShardedArray):
            return x.mesh
    return None


def step(tx: GradientTransformation, grads, state, params, *, donate: bool = False, **extra_args):
    """One optimizer step: ``tx.update`` then :func:`apply_updates`, returning
    ``(new_params, new_state)``.

    Without ``donate`` this is exactly the two-call optax step (pure; nothing is mutated).
    With ``donate=True`` the params' and the state's local buffers are reused for the results,
    as ``jax.jit(step, donate_argnums=...)`` would: a transformation with a ``donated_step``
    (:func:`sgd`, :func:`adam`, :func:`adamw`, alone or last in a :func:`chain`) runs the same
    in-place ``torch._foreach_*`` kernels as ``torch.optim`` (one pass over memory for plain
    SGD instead of three, and no fresh parameter-sized allocations, which cost page faults on
    CPU); others run ``update`` and an in-place ``apply_updates``. ``grads`` are never
    modified. Donation is skipped (the pure path runs) when any leaf takes part in autograd or
    a ``torch.func`` transform (meta-learning), under ``torch.compile``, or when two leaves
    share a buffer.

    Args:
        tx: a :class:`GradientTransformation`.
        grads: gradients, with the params' structure and layouts.
        state: ``tx``'s state (from ``tx.init`` or a previous step).
        params: the current params.
        donate: reuse ``params``' and ``state``'s buffers; do not use them afterwards (and
            note that tensors they alias, e.g. module parameters that ``fs.nn.shard_params``
            viewed, are overwritten too).
        **extra_args: passed to ``tx.update`` (``value=``, ``grad=``, ``value_fn=`` of
            :func:`polyak_sgd` and :func:`lbfgs`); the ``donated_step`` kernels take none.

    Returns:
        ``(new_params, new_state)``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adamw(0.1, weight_decay=0.0)
        >>> p = {"w": torch.zeros(1)}
        >>> p, s = fs.optim.step(tx, {"w": torch.ones(1)}, tx.init(p), p, donate=True)
        >>> p["w"]
        tensor([-0.1000])
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"step: tx must be a GradientTransformation, got {type(tx).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"step: donate must be a bool, got {donate!r}")
    if consistency.enabled():
        mesh = _mesh_of(params)
        if mesh is not None:
            consistency.boundary(mesh, "fs.optim.step")
    if donate and donatable(_tensors(params), _tensors(state), _tensors(grads)):
        if tx.donated_step is not None and not extra_args:
            res = tx.donated_step(grads, state, params)
            if res is not None:
                return res
        updates, state = tx.update(grads, state, params, **extra_args)
        return apply_updates(params, updates, donate=True), state
    updates, state = tx.update(grads, state, params, **extra_args)
    return apply_updates(params, updates), state
