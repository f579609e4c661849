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

import torch

from . import _tree
from ._tree import check_scalar
from .base import GradientTransformation, init_empty_state
from .transform import _block_rms

__all__ = ["global_norm", "clip_by_global_norm", "clip_by_block_rms", "clip"]


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
