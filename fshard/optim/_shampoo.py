"""Blocked Shampoo with the blocks aligned to the shards: a second-order method whose
preconditioners never need a gather.

Each 2-D leaf's *local shard* is tiled into blocks of at most ``block_size`` rows and columns,
so every block lies on one rank (a replicated leaf: every rank holds all its blocks and
computes them alike). A block ``G`` keeps the statistics ``L = b2 L + (1 - b2) G Gᵀ`` and
``R = b2 R + (1 - b2) Gᵀ G``, and its direction is ``L^{-1/4} G R^{-1/4}`` (inverse roots by
``torch.linalg.eigh``, refreshed every ``precondition_frequency`` steps), rescaled to the norm
of the block's Adam-style diagonal direction (grafting, as Distributed Shampoo). Leaves that
are not matrices take the diagonal direction. A first moment (``b1``) averages the result.

Bytes moved: none. Sharded or not, a step of :func:`scale_by_shampoo` issues no collective:
statistics, roots, directions and grafting norms are all per block, and each block is local.
The price of aligning blocks to shards is that the block partition (so the numbers) depends on
the layout: a matrix sharded 3 + 2 over rows is preconditioned as blocks of 3 and 2 rows, the
same as a dense Shampoo given that partition (what ``tests/optim/test_shampoo.py`` checks),
not as one 5-row block. The alternatives move bytes every refresh: gathering a matrix's
statistics to precondition it whole costs its ``(rows² + cols²)`` floats per rank, and
Distributed Shampoo's blocks of a fixed global grid straddle uneven shard boundaries. The
per-block state is per rank (local tensors, not ShardedArrays: a rank's blocks differ in shape
from another's when shards are uneven), like ``torch``'s Distributed Shampoo.

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.shampoo(0.1, block_size=2)
    >>> p = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    >>> u, s = tx.update({"w": torch.ones(3, 2), "b": torch.ones(2)}, tx.init(p), p)
    >>> [len(s[0].left["w"]), tuple(s[0].left["w"][1].shape)]  # blocks rows 0:2 and 2:3
    [2, (1, 1)]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _tree
from ._tree import check_scalar, check_schedule
from .base import GradientTransformation
from .combine import chain
from .transform import add_decayed_weights, scale_by_learning_rate

__all__ = ["ScaleByShampooState", "scale_by_shampoo", "shampoo", "shampoo_blocks"]


class ScaleByShampooState(NamedTuple):
    """Shampoo state: step count, first moment and diagonal second moment (the params'
    layouts), and per 2-D leaf one list entry per local block: the statistics ``left``
    (``L``), ``right`` (``R``) and their inverse fourth roots (local tensors).

    Example:
        >>> import torch, fshard as fs
        >>> s = fs.optim.scale_by_shampoo(block_size=2).init({"w": torch.zeros(2, 3)})
        >>> [tuple(x.shape) for x in s.right["w"]]
        [(2, 2), (1, 1)]
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    left: Any
    right: Any
    left_root: Any
    right_root: Any


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)] if n else []


def shampoo_blocks(local_shape: tuple, block_size: int) -> list[tuple[slice, slice]]:
    """The blocks of a 2-D local shard: ``(row slice, column slice)`` tiles of at most
    ``block_size`` each, row-major.

    Example:
        >>> import fshard as fs
        >>> fs.optim.shampoo_blocks((3, 2), 2)
        [(slice(0, 2, None), slice(0, 2, None)), (slice(2, 3, None), slice(0, 2, None))]
    """
    rows, cols = local_shape
    return [
        (slice(*r), slice(*c)) for r in _chunks(rows, block_size) for c in _chunks(cols, block_size)
    ]


def _inverse_root(stat: torch.Tensor, eps: float) -> torch.Tensor:
    """``(stat + eps I)^{-1/4}`` of a symmetric PSD block by eigendecomposition (float32 at
    least: eigh takes no half precision)."""
    work = stat.to(torch.promote_types(stat.dtype, torch.float32))
    vals, vecs = torch.linalg.eigh(work)
    vals = torch.clamp(vals, min=0.0) + eps
    return ((vecs * vals.pow(-0.25)) @ vecs.T).to(stat.dtype)


def scale_by_shampoo(
    b1=0.9,
    b2=0.999,
    block_size: int = 128,
    precondition_frequency: int = 10,
    eps=1e-12,
    graft_eps=1e-8,
) -> GradientTransformation:
    """Blocked Shampoo's direction, blocks aligned to the shards (see the module docstring).

    Per leaf: the diagonal moment ``nu = b2 nu + (1 - b2) g²`` gives the graft direction
    ``g / (sqrt(nu / (1 - b2**t)) + graft_eps)``; each block of a 2-D leaf is preconditioned
    to ``L^{-1/4} G R^{-1/4}`` and rescaled to the graft direction's norm on that block; then
    ``mu = b1 mu + (1 - b1) d`` and the update is ``mu / (1 - b1**t)``.

    Args:
        b1: first-moment decay.
        b2: decay of the statistics and the diagonal moment.
        block_size: the largest block side.
        precondition_frequency: steps between refreshes of the inverse roots (the first step
            computes them). The step reads the counter as a Python int for this.
        eps: added to the statistics' eigenvalues.
        graft_eps: the graft direction's epsilon.

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScaleByShampooState`); no
        collective for any layout.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_shampoo(b1=0.0)
        >>> u, _ = tx.update({"w": torch.eye(2)}, tx.init({"w": torch.zeros(2, 2)}))
        >>> torch.allclose(u["w"], torch.eye(2), atol=1e-5)  # already whitened: unchanged
        True
    """
    b1 = check_scalar(b1, "b1", 0.0, 1.0, open_hi=True)
    b2 = check_scalar(b2, "b2", 0.0, 1.0, open_hi=True)
    for name, v in (("block_size", block_size), ("precondition_frequency", precondition_frequency)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"scale_by_shampoo: {name} must be an int >= 1, got {v!r}")
    eps = check_scalar(eps, "eps", 0.0)
    graft_eps = check_scalar(graft_eps, "graft_eps", 0.0)

    def per_block(x, fn) -> list:
        t = _tree.local(x)
        if t.ndim != 2:
            return []
        return [fn(t[r, c]) for r, c in shampoo_blocks(tuple(t.shape), block_size)]

    def init(params):
        leaves, spec = _tree.flatten(params, "params")
        left = [per_block(x, lambda b: b.new_zeros(b.shape[0], b.shape[0])) for x in leaves]
        right = [per_block(x, lambda b: b.new_zeros(b.shape[1], b.shape[1])) for x in leaves]
        copy = lambda ls: spec.unflatten([[t.clone() for t in blocks] for blocks in ls])  # noqa: E731
        z = _tree.zeros_like
        return ScaleByShampooState(
            _tree.count0(), z(params), z(params), copy(left), copy(right), copy(left), copy(right)
        )

    def update(updates, state, params=None):
        count = state.count + 1
        refresh = (int(state.count) % precondition_frequency) == 0
        bc1, bc2 = 1 - b1 ** _tree.as_float(count), 1 - b2 ** _tree.as_float(count)
        leaves, spec = _tree.flatten(updates, "updates")
        mus = _tree.flatten_like(state.mu, spec, leaves, "state.mu")
        nus = _tree.flatten_like(state.nu, spec, leaves, "state.nu")
        lefts, rights = spec.flatten_up_to(state.left), spec.flatten_up_to(state.right)
        lroots, rroots = spec.flatten_up_to(state.left_root), spec.flatten_up_to(state.right_root)
        out, new_mu, new_nu, new_l, new_r, new_lr, new_rr = ([] for _ in range(7))
        for x, mu, nu, ls, rs, lq, rq in zip(leaves, mus, nus, lefts, rights, lroots, rroots):
            g = _tree.local(x)
            v = b2 * _tree.local(nu) + (1 - b2) * g * g
            d = g / (torch.sqrt(v / bc2.to(v.dtype)) + graft_eps)
            nl, nr, nlq, nrq = [], [], [], []
            if g.ndim == 2:
                d = d.clone()
                blocks = shampoo_blocks(tuple(g.shape), block_size)
                for (r, c), left, right, lroot, rroot in zip(blocks, ls, rs, lq, rq):
                    gb = g[r, c]
                    left = b2 * left + (1 - b2) * (gb @ gb.T)
                    right = b2 * right + (1 - b2) * (gb.T @ gb)
                    if refresh:
                        lroot, rroot = _inverse_root(left, eps), _inverse_root(right, eps)
                    p = lroot @ gb @ rroot
                    graft = torch.linalg.vector_norm(d[r, c])
                    d[r, c] = p * (graft / torch.clamp(torch.linalg.vector_norm(p), min=1e-30))
                    nl.append(left), nr.append(right), nlq.append(lroot), nrq.append(rroot)
            m = torch.lerp(_tree.local(mu), d, 1 - b1)
            out.append(_tree.rebuild(x, m / bc1.to(m.dtype)))
            new_mu.append(_tree.rebuild(x, m))
            new_nu.append(_tree.rebuild(x, v))
            new_l.append(nl), new_r.append(nr), new_lr.append(nlq), new_rr.append(nrq)
        u = spec.unflatten
        return u(out), ScaleByShampooState(
            count, u(new_mu), u(new_nu), u(new_l), u(new_r), u(new_lr), u(new_rr)
        )

    return GradientTransformation(init, update)


def shampoo(
    learning_rate,
    b1=0.9,
    b2=0.999,
    block_size: int = 128,
    precondition_frequency: int = 10,
    eps=1e-12,
    graft_eps=1e-8,
    weight_decay=0.0,
    mask=None,
) -> GradientTransformation:
    """Blocked Shampoo: ``chain(scale_by_shampoo, add_decayed_weights,
    scale_by_learning_rate)`` (decoupled weight decay, as AdamW), blocks aligned to the
    shards: no communication for any layout (see :func:`scale_by_shampoo`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.shampoo(1e-3, block_size=64, weight_decay=0.01)
    """
    return chain(
        scale_by_shampoo(b1, b2, block_size, precondition_frequency, eps, graft_eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )
