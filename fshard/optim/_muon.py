"""Muon: momentum orthogonalized by Newton-Schulz, for 2-D weights (``torch.optim.Muon``).

Each 2-D update is replaced by an approximate orthogonalization of its momentum (the quintic
Newton-Schulz iteration of Keller Jordan's Muon, in bfloat16, as ``torch.optim.Muon``), scaled by
``sqrt(max(1, rows / cols))``; every other leaf (embeddings aside, biases and norms: not 2-D) is
trained by AdamW. The iteration needs the whole matrix. A matrix sharded over ``p`` ranks (tensor
parallel columns or rows, FSDP rows, uneven) is cast to bfloat16 *before* it moves and
all-gathered once per step: each rank receives ``(p - 1) / p`` of it, ``2 * numel * (p - 1) / p``
bytes, runs the iteration on the whole matrix and keeps its own block (no scatter back). The
momentum stays sharded with the param. Running the iteration with the matmul rules instead would
move ``X`` or ``X Xᵀ`` in every one of its 3 * ``ns_steps`` products; gathering to one rank and
scattering back moves the same bytes as the all-gather on 2 ranks and ``2 (p - 1) / p`` instead of
``p - 1`` times the matrix on more, at the cost of running each iteration on one rank (not done
here: fshard's tests and benchmarks run on 2).

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.muon(0.02)
    >>> p = {"w": torch.eye(3), "b": torch.zeros(3)}
    >>> u, _ = tx.update({"w": torch.ones(3, 3), "b": torch.ones(3)}, tx.init(p), p)
    >>> u["w"].shape, u["b"].shape
    (torch.Size([3, 3]), torch.Size([3]))
"""

from __future__ import annotations

import math

import optree
import torch

from ..api import reshard
from ..array import ShardedArray
from ..spec import P
from . import _tree
from ._tree import check_bool, check_scalar, check_schedule
from .alias import adamw
from .base import GradientTransformation, ScaleByMuonState
from .combine import chain, multi_transform
from .transform import add_decayed_weights, scale_by_learning_rate

__all__ = ["muon", "scale_by_muon", "orthogonalize"]

#: torch.optim.Muon's defaults (torch/optim/_muon.py)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
_ADJUST = ("original", "match_rms_adamw")


def orthogonalize(
    x: torch.Tensor, ns_coefficients=NS_COEFFICIENTS, ns_steps: int = NS_STEPS, eps: float = EPS
) -> torch.Tensor:
    """Newton-Schulz orthogonalization of a whole 2-D matrix, in bfloat16 (the result too), with
    ``torch.optim.Muon``'s operations: normalized by its Frobenius norm, then ``ns_steps`` quintic
    iterations on the wide orientation.

    Example:
        >>> import torch, fshard as fs
        >>> o = fs.optim.orthogonalize(torch.tensor([[3.0, 0.0], [0.0, 1.0]]))
        >>> bool(((o.float() - torch.eye(2)).abs() < 0.35).all())
        True
    """
    a, b, c = ns_coefficients
    o = x.bfloat16()
    wide = o.size(0) <= o.size(1)
    if not wide:
        o = o.T
    o = o / o.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = o @ o.T
        o = torch.addmm(o, torch.addmm(gram, gram, gram, beta=b, alpha=c), o, beta=a)
    return o if wide else o.T


def _lr_ratio(shape: tuple, adjust_lr_fn: str | None) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def _whole_orthogonalized(u, ns_coefficients, ns_steps, eps):
    """The orthogonalization of ``u``'s whole matrix, as ``u``'s local block (bfloat16)."""
    if not isinstance(u, ShardedArray):
        return orthogonalize(u, ns_coefficients, ns_steps, eps)
    lay = u.layout
    half = ShardedArray._raw(u.local.bfloat16(), lay.with_dtype(torch.bfloat16))
    full = reshard(half, P()).local if lay.sharded_axes or lay.partial else half.local
    o = orthogonalize(full, ns_coefficients, ns_steps, eps)
    return _tree.global_slice(u, o)


def scale_by_muon(
    ns_coefficients=NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = EPS,
    beta: float = 0.95,
    nesterov: bool = True,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon's direction for 2-D leaves: the momentum ``mu = lerp(mu, g, 1 - beta)`` (Nesterov:
    ``lerp(g, mu, beta)``), orthogonalized whole (:func:`orthogonalize`), times
    ``sqrt(max(1, rows / cols))`` (``adjust_lr_fn="match_rms_adamw"``:
    ``0.2 * sqrt(max(rows, cols))``), as ``torch.optim.Muon``. A sharded matrix is all-gathered
    in bfloat16 once per step (see :func:`muon`).

    Args:
        ns_coefficients: the quintic's ``(a, b, c)``.
        ns_steps: Newton-Schulz iterations (< 100).
        eps: floor of the norm the matrix is divided by.
        beta: momentum decay in [0, 1).
        nesterov: use the look-ahead ``lerp(g, mu, beta)``.
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScaleByMuonState`); every leaf must
        be 2-D (use :func:`muon` for a model's mixed leaves).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_muon()
        >>> u, s = tx.update({"w": torch.ones(2, 4)}, tx.init({"w": torch.zeros(2, 4)}))
        >>> u["w"].shape, u["w"].dtype
        (torch.Size([2, 4]), torch.float32)
    """
    if not (isinstance(ns_coefficients, tuple) and len(ns_coefficients) == 3):
        raise ValueError(f"scale_by_muon: ns_coefficients must be a tuple (a, b, c), got {ns_coefficients!r}")  # fmt: skip
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 < ns_steps < 100:
        raise ValueError(f"scale_by_muon: ns_steps must be an int in [1, 99], got {ns_steps!r}")
    eps = check_scalar(eps, "eps", 0.0)
    beta = check_scalar(beta, "beta", 0.0, 1.0, open_hi=True)
    check_bool(nesterov, "nesterov")
    if adjust_lr_fn is not None and adjust_lr_fn not in _ADJUST:
        raise ValueError(f"scale_by_muon: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")  # fmt: skip

    def init(params):
        leaves, _ = _tree.flatten(params, "params")
        bad = [tuple(_tree.global_shape(x)) for x in leaves if len(_tree.global_shape(x)) != 2]
        if bad:
            raise ValueError(
                f"scale_by_muon: every leaf must be a 2-D matrix, got shapes {bad}; use "
                "fs.optim.muon (AdamW for the other leaves) or fs.optim.multi_transform"
            )
        return ScaleByMuonState(_tree.count0(), _tree.zeros_like(params))

    def update(updates, state, params=None):
        leaves, spec = _tree.flatten(updates, "updates")
        moms = _tree.flatten_like(state.mu, spec, leaves, "state.mu")
        out, mus = [], []
        for g, mu in zip(leaves, moms):  # whole ShardedArrays: the iteration needs the matrix
            gl = _tree.local(g)
            ml = _tree.local(mu).lerp(gl, 1 - beta)
            d = gl.lerp(ml, beta) if nesterov else ml
            o = _whole_orthogonalized(_tree.rebuild(g, d), ns_coefficients, ns_steps, eps)
            ratio = _lr_ratio(_tree.global_shape(g), adjust_lr_fn)
            out.append(_tree.rebuild(g, o.to(gl.dtype) * ratio))
            mus.append(_tree.rebuild(mu, ml))
        unflatten = optree.tree_unflatten
        return unflatten(spec, out), ScaleByMuonState(state.count + 1, unflatten(spec, mus))

    return GradientTransformation(init, update)


def muon(
    learning_rate,
    weight_decay=0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients=NS_COEFFICIENTS,
    eps: float = EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_weight_decay=None,
) -> GradientTransformation:
    """Muon for the 2-D leaves, AdamW for the others (labels by each leaf's global shape), as
    ``torch.optim.Muon`` (its arguments, same defaults) beside ``torch.optim.AdamW``: a 2-D
    param becomes ``p * (1 - lr * weight_decay) - lr * ratio * orthogonalize(momentum)``.

    Args:
        learning_rate: float, 0-d tensor or schedule, for both parts.
        weight_decay: decoupled decay of the 2-D leaves.
        momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: see
            :func:`scale_by_muon` (``momentum`` is its ``beta``).
        adam_b1, adam_b2, adam_eps: AdamW's, for the other leaves.
        adam_weight_decay: AdamW's decay (default: ``weight_decay``).

    Returns:
        A :class:`GradientTransformation` (a ``multi_transform`` over labels ``"muon"`` and
        ``"adam"``).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.muon(0.02)
        >>> p = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
        >>> u, _ = tx.update({"w": torch.ones(2, 3), "b": torch.ones(3)}, tx.init(p), p)
        >>> round(u["b"][0].item(), 4)
        -0.02
    """
    learning_rate = check_schedule(learning_rate)
    decay = weight_decay if adam_weight_decay is None else adam_weight_decay
    matrices = chain(
        scale_by_muon(ns_coefficients, ns_steps, eps, momentum, nesterov, adjust_lr_fn),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )
    others = adamw(learning_rate, adam_b1, adam_b2, adam_eps, weight_decay=decay)

    def labels(params):
        return optree.tree_map(
            lambda x: "muon" if len(_tree.global_shape(x)) == 2 else "adam",
            params,
            is_leaf=_tree.is_leaf,
        )

    return multi_transform({"muon": matrices, "adam": others}, labels)
