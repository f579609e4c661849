"""Clipping: :func:`clip_by_global_norm` (the one transformation that reduces over every leaf),
:func:`clip_by_block_rms`, :func:`clip`, and :func:`global_norm`.

Example:
    >>> import torch, fshard as fs
    >>> g = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    >>> fs.optim.global_norm(g)
    tensor(5.)
    >>> clipped, _ = fs.optim.clip_by_global_norm(1.0, eps=0.0).update(g, fs.optim.EmptyState())
    >>> clipped["a"], clipped["b"]
    (tensor([0.6000]), tensor([0.8000]))
"""

from __future__ import annotations

import functools

import optree
import torch

from .. import lax
from ..api import reshard
from ..array import ShardedArray
from ..spec import P
from . import _tree
from ._tree import check_scalar
from .base import GradientTransformation, init_empty_state
from .transform import _block_rms

__all__ = [
    "global_norm",
    "clip_by_global_norm",
    "clip_by_block_rms",
    "clip",
    "adaptive_grad_clip",
    "per_example_global_norm_clip",
]


def global_norm(tree) -> torch.Tensor:
    """The L2 norm of all the leaves of ``tree`` taken together, as a 0-d tensor.

    Summed in the promoted dtype of the leaves (float64 leaves give a float64 norm, exact to
    float64 rounding). For a ShardedArray the squared norm of its local shard is summed over
    the mesh axes that shard it (one ``fs.lax.psum`` per distinct (mesh, axes) group, not per
    leaf); replicated dims are counted once; a partial leaf is reduced first. The result is
    the same on every rank.

    Args:
        tree: a pytree of ShardedArrays and tensors.

    Returns:
        A 0-d tensor (differentiable), float32 for an empty tree.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.global_norm([torch.ones(4, dtype=torch.float64)])
        tensor(2., dtype=torch.float64)
    """
    leaves, _ = _tree.flatten(tree, "tree")
    if not leaves:
        return torch.zeros(())
    sq = _tree.sq_sums(leaves)
    return torch.sqrt(torch.stack([s.to(sq[0].device) for s in sq]).sum())


def clip_by_global_norm(max_norm, eps: float = 1e-6) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + eps))``, with ``norm`` the true global
    norm over every leaf and every shard (:func:`global_norm`), as
    ``torch.nn.utils.clip_grad_norm_``.

    optax's ``clip_by_global_norm(max_norm)`` is this with ``eps=0`` (it scales by
    ``max_norm / norm`` when ``norm >= max_norm``); the default ``eps=1e-6`` follows torch.

    Args:
        max_norm: the largest allowed global norm (> 0), a float or 0-d tensor.
        eps: added to the norm in the denominator (torch uses 1e-6).

    Returns:
        A stateless :class:`GradientTransformation`. It issues one small all_reduce per group
        of leaves sharded over the same mesh axes.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.sgd(0.1))
        >>> p = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([30.0, 40.0])}, tx.init(p), p)[0]["w"]
        tensor([-0.0600, -0.0800])
    """
    max_norm = check_scalar(max_norm, "max_norm")
    if not isinstance(max_norm, torch.Tensor) and max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    eps = check_scalar(eps, "eps", 0.0)

    def update(updates, state, params=None):
        coef = torch.clamp(max_norm / (global_norm(updates) + eps), max=1.0)
        return _tree.tree_map(lambda u: u * coef.to(u.dtype), updates), state

    return GradientTransformation(init_empty_state, update)


def clip_by_block_rms(threshold) -> GradientTransformation:
    """Divides each leaf by ``max(1, rms(leaf) / threshold)`` (the RMS of the whole leaf, over
    every shard), as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.clip_by_block_rms(1.0)
        >>> tx.update({"w": torch.full((4,), 2.0)}, tx.init(None))[0]
        {'w': tensor([1., 1., 1., 1.])}
    """
    threshold = check_scalar(threshold, "threshold")

    def update(updates, state, params=None):
        leaves, spec = _tree.flatten(updates, "updates")
        rms = _block_rms(leaves)
        out = []
        for x, r in zip(leaves, rms):
            t = _tree.local(x)
            out.append(_tree.rebuild(x, t / torch.clamp(r / threshold, min=1.0).to(t.dtype)))
        return spec.unflatten(out), state

    return GradientTransformation(init_empty_state, update)


def clip(max_delta) -> GradientTransformation:
    """Clamps each update element to ``[-max_delta, max_delta]``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.clip(1.0).update({"w": torch.tensor([-3.0, 0.5])}, None)[0]
        {'w': tensor([-1.0000,  0.5000])}
    """
    max_delta = check_scalar(max_delta, "max_delta", 0.0)

    def update(updates, state, params=None):
        return _tree.tree_map(lambda u: torch.clamp(u, -max_delta, max_delta), updates), state

    return GradientTransformation(init_empty_state, update)


def _unit_dims(shape: tuple, axis) -> tuple:
    """The dims optax's ``unitwise_norm`` reduces over for a leaf of ``shape``."""
    if axis is not None:
        return tuple(a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis))
    if sum(s != 1 for s in shape) <= 1:  # scalars and vectors (after squeezing)
        return tuple(range(len(shape)))
    by_rank = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}
    if len(shape) not in by_rank:
        raise ValueError(
            f"adaptive_grad_clip: a leaf of shape {shape} needs axis= (the reduced dims); "
            "without it leaves of 1 to 5 dims are handled"
        )
    return by_rank[len(shape)]


def adaptive_grad_clip(clipping, eps=1e-3, axis=None) -> GradientTransformation:
    """Adaptive gradient clipping (NFNets), as optax: each unit of an update (a column of a
    2-D ``(in, out)`` leaf: the norm is over dim 0; over the first 3 dims of a 4-D HWIO
    kernel; the whole of a vector) is scaled to at most ``clipping * max(||param unit||,
    eps)``. The unit norms of a sharded leaf are over every shard (one all_reduce over the
    mesh axes that split the reduced dims).

    Args:
        clipping: the maximum ratio of update norm to param norm.
        eps: floor of the param norm.
        axis: the reduced dims, overriding the rank-based default.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adaptive_grad_clip(0.5)
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> tx.update({"w": torch.tensor([30.0, 40.0])}, tx.init(p), p)[0]
        {'w': tensor([1.5000, 2.0000])}
    """
    clipping = check_scalar(clipping, "clipping", 0.0)
    eps = check_scalar(eps, "eps", 0.0)

    def update(updates, state, params=None):
        _tree.needs_params(params, "adaptive_grad_clip")
        leaves, spec = _tree.flatten(updates, "updates")
        pleaves = _tree.flatten_like(params, spec, leaves, "params")
        out = []
        for x, p in zip(leaves, pleaves):
            g, w = _tree.local(x), _tree.local(p)
            dims = _unit_dims(_tree.global_shape(x), axis)
            g_norm = torch.sqrt(_tree.dims_sum(x, g * g, dims, keepdim=True))
            p_norm = torch.sqrt(_tree.dims_sum(p, w * w, dims, keepdim=True))
            max_norm = clipping * torch.clamp(p_norm, min=eps)
            clipped = g * (max_norm / torch.clamp(g_norm, min=1e-6))
            out.append(_tree.rebuild(x, torch.where(g_norm < max_norm, g, clipped)))
        return spec.unflatten(out), state

    return GradientTransformation(init_empty_state, update)


def _replicated(x, t: torch.Tensor) -> torch.Tensor:
    """The whole of a small 1-D per-example vector laid out like dim 0 of leaf ``x``."""
    if not isinstance(x, ShardedArray) or not _tree.dim_axes(x)[0]:
        return t
    return reshard(_tree.dim_leaf(x, 0, t), P()).local


def per_example_global_norm_clip(grads, l2_norm_clip):
    """Clips each example's gradient (leading dim of every leaf) to global norm
    ``l2_norm_clip`` and sums over the examples; returns ``(clipped_sum, num_clipped)``, as
    optax (DP-SGD).

    The per-example norms are over every leaf and shard: per leaf a local sum over the other
    dims and one all_reduce over the mesh axes that split them; a leaf whose batch dim is
    sharded gathers its ``batch``-long vector of norms (a few bytes). The sum over examples of
    such a leaf is an all_reduce over the axes that split the batch; the result is laid out
    like the leaf minus its batch dim.

    Args:
        grads: a pytree of per-example gradients, every leaf with the same leading dim.
        l2_norm_clip: the maximum norm of an example's gradient.

    Returns:
        ``(clipped_sum, num_clipped)``: the summed clipped gradients and how many examples
        were clipped (a 0-d tensor).

    Example:
        >>> import torch, fshard as fs
        >>> g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}
        >>> s, n = fs.optim.per_example_global_norm_clip(g, 1.0)
        >>> s["w"], int(n)
        (tensor([0.9000, 1.2000]), 1)
    """
    l2_norm_clip = check_scalar(l2_norm_clip, "l2_norm_clip", 0.0)
    leaves, spec = _tree.flatten(grads, "grads")
    shapes = [_tree.global_shape(x) for x in leaves]
    if not leaves or any(len(s) < 1 or s[0] != shapes[0][0] for s in shapes):
        raise ValueError(
            "per_example_global_norm_clip: every leaf of grads needs the same leading (batch) "
            f"dim; got shapes {shapes}"
        )
    sq = []
    for x in leaves:
        t = _tree.local(x)
        per = _tree.dims_sum(x, t * t, range(1, t.ndim)) if t.ndim > 1 else t * t
        sq.append(_replicated(x, per))
    norms = torch.sqrt(functools.reduce(torch.add, sq))
    mult = torch.nan_to_num(torch.clamp(l2_norm_clip / norms, max=1.0), nan=1.0)
    out = []
    for x in leaves:
        t = _tree.local(x)
        sharded = isinstance(x, ShardedArray)
        m = mult[_tree.dim_block(x, 0)] if sharded else mult
        s = torch.tensordot(m.to(t.dtype), t, dims=1)
        axes = _tree.dim_axes(x)[0] if isinstance(x, ShardedArray) else ()
        if axes:
            s = lax.psum(s, axes, mesh=x.mesh)
        out.append(_tree.drop_dim(x, 0, s))
    return optree.tree_unflatten(spec, out), (mult < 1.0).sum()
