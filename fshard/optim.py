"""Optax-style optimizers over pytrees of ShardedArrays (and plain tensors).

A :class:`GradientTransformation` is a NamedTuple of two pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = fs.optim.apply_updates(params, updates)

Nothing is ever mutated: every step returns new tensors (out-of-place ``torch._foreach_*``
kernels over the *local* shards, grouped by dtype and device), so the whole step can be
differentiated (meta-learning: the gradient w.r.t. the learning rate or the initial params
through ``apply_updates``) and run under ``torch.func`` transforms. The one opt-in exception is
:func:`step` with ``donate=True`` (JAX's ``donate_argnums``): params and state buffers are then
reused in place with ``torch.optim``'s own foreach kernels, which on CPU saves the page faults
and memory passes of fresh parameter-sized tensors every step.

State tensors are ShardedArrays with the parameters' layouts (a sharded param's Adam moments
are sharded the same way), so optimizer memory is sharded with the params and no collective is
needed for element-wise transformations. :func:`clip_by_global_norm` is the one collective
transformation: it computes the true global norm (see its docstring).

Learning rates may be a float, a 0-d tensor (differentiable) or a *schedule*: a callable of the
step count (0 for the first update) returning a float, e.g. :func:`warmup_cosine_decay_schedule`.

Numerics follow ``torch.optim`` (``SGD``, ``Adam``, ``AdamW``) formula for formula, so a
trajectory matches ``torch.optim`` on dense tensors to float rounding.

Example:
    >>> import torch, fshard as fs
    >>> params = {"w": torch.ones(3)}
    >>> tx = fs.optim.adamw(1e-2, weight_decay=0.1)
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": torch.ones(3)}, state, params)
    >>> new = fs.optim.apply_updates(params, updates)
    >>> bool((new["w"] < 1).all())
    True
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from .array import ShardedArray

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "TraceState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "MaskedState",
    "MultiTransformState",
    "identity",
    "set_to_zero",
    "scale",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "sgd",
    "momentum",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "global_norm",
    "chain",
    "masked",
    "multi_transform",
    "apply_updates",
    "step",
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
]


class GradientTransformation(NamedTuple):
    """A pair of pure functions ``(init, update)``, as in optax.

    ``init(params) -> state``; ``update(updates, state, params=None) -> (updates, new_state)``.
    Neither mutates its inputs.

    Example:
        >>> tx = fs.optim.sgd(0.1)  # doctest: +SKIP
        >>> updates, state = tx.update(grads, tx.init(params), params)  # doctest: +SKIP
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


class TraceState(NamedTuple):
    """SGD momentum buffers (``trace``) and the step count."""

    count: torch.Tensor
    trace: Any


class ScaleByAdamState(NamedTuple):
    """Adam state: step count (0-d int64 CPU tensor), first and second moments."""

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByScheduleState(NamedTuple):
    """Step count of a scheduled transformation."""

    count: torch.Tensor


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transformation's state over the selected leaves."""

    inner_state: Any


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`: one inner state per label."""

    inner_states: dict


# -- leaves: flatten to (ShardedArray | Tensor) leaves, operate on local tensors --------------


def _is_leaf(x) -> bool:
    return isinstance(x, ShardedArray)


def _flatten(tree, name: str):
    leaves, spec = optree.tree_flatten(tree, is_leaf=_is_leaf, none_is_leaf=False)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, (torch.Tensor, ShardedArray)):
            raise TypeError(
                f"{name}: leaf {i} is a {type(leaf).__name__}; fs.optim works on pytrees whose "
                "leaves are ShardedArrays or torch.Tensors"
            )
    return leaves, spec


def _local(x):
    return x.local if isinstance(x, ShardedArray) else x


def _rebuild(like, local):
    return ShardedArray._raw(local, like.layout) if isinstance(like, ShardedArray) else local


def _check_match(leaves, ref_leaves, spec, ref_spec, name: str, ref_name: str):
    if spec != ref_spec:
        raise ValueError(
            f"{name} and {ref_name} must have the same tree structure; got {spec} and {ref_spec}"
        )
    for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
        a_sh, b_sh = isinstance(a, ShardedArray), isinstance(b, ShardedArray)
        if a_sh != b_sh or (a_sh and a.layout != b.layout):
            la = a.layout if a_sh else "a plain tensor"
            lb = b.layout if b_sh else "a plain tensor"
            raise ValueError(
                f"{name} leaf {i} has layout {la} but the matching {ref_name} leaf has {lb}; "
                "reshard them to the same layout (fs.reshard) first"
            )


def _zeros_like(leaves):
    return [_rebuild(x, torch.zeros_like(_local(x))) for x in leaves]


def _groups(locals_: list, extra_key=None) -> dict:
    """Indices grouped by (device, dtype[, extra key]) so each foreach call sees one kind."""
    groups: dict = {}
    for i, t in enumerate(locals_):
        key = (t.device, t.dtype) if extra_key is None else (t.device, t.dtype, extra_key[i])
        groups.setdefault(key, []).append(i)
    return groups


def _needs_autograd(s) -> bool:
    return isinstance(s, torch.Tensor) and (
        s.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(s)
    )


def _mul(ts: list, s) -> list:
    """``[t * s for t in ts]``; ``s`` a number or a 0-d tensor (differentiable)."""
    if _needs_autograd(s):
        # torch._foreach_mul(list, Tensor) has no working backward for the scalar tensor.
        return [t * s for t in ts]
    return list(torch._foreach_mul(ts, s))


def _count0() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _lr_value(lr, count: int):
    value = lr(count) if callable(lr) else lr
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise ValueError(f"learning rate must be a scalar, got a tensor of shape {value.shape}")
    return value


def _check_lr(lr, name: str = "learning_rate"):
    if callable(lr) or isinstance(lr, torch.Tensor):
        return lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"{name} must be a float, a 0-d tensor or a schedule, got {lr!r}")
    if lr < 0:
        raise ValueError(f"{name} must be >= 0, got {lr}")
    return float(lr)


def _check_float(value, name: str, lo: float = 0.0, hi: float | None = None, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    bad = value < lo or (hi is not None and (value >= hi if hi_open else value > hi))
    if bad:
        rng = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {rng}, got {value}")
    return float(value)


def _mask_leaves(mask, params, spec, n: int, name: str) -> list[bool]:
    if callable(mask):
        mask = mask(params)
    if isinstance(mask, bool):
        return [mask] * n
    try:
        flags = spec.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name} must be a bool, a pytree of bools with the params' structure, or a callable "
            f"params -> such a pytree ({e})"
        ) from e
    for f in flags:
        if not isinstance(f, bool):
            raise TypeError(f"{name} leaves must be bools, got {f!r}")
    return list(flags)


# -- simple transformations ------------------------------------------------------------------


def identity() -> GradientTransformation:
    """Leaves updates unchanged.

    Returns:
        A stateless :class:`GradientTransformation`.

    Example:
        >>> fs.optim.identity().update({"w": torch.ones(1)}, fs.optim.EmptyState())[0]  # doctest: +SKIP
    """
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (u, s))


def set_to_zero() -> GradientTransformation:
    """Replaces every update by zeros (freezes params, e.g. in :func:`multi_transform`).

    Returns:
        A stateless :class:`GradientTransformation`.

    Example:
        >>> tx = fs.optim.multi_transform({"train": fs.optim.sgd(0.1), "frozen": fs.optim.set_to_zero()}, labels)  # doctest: +SKIP
    """

    def update(updates, state, params=None):
        leaves, spec = _flatten(updates, "updates")
        out = [_rebuild(x, torch.zeros_like(_local(x))) for x in leaves]
        return optree.tree_unflatten(spec, out), state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale(step_size: float) -> GradientTransformation:
    """Multiplies updates by ``step_size`` (a float or a 0-d tensor).

    Args:
        step_size: the factor.

    Returns:
        A stateless :class:`GradientTransformation`.

    Example:
        >>> tx = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.scale(-0.1))  # doctest: +SKIP
    """
    if not isinstance(step_size, torch.Tensor):
        step_size = _check_float(step_size, "step_size", lo=-math.inf)

    def update(updates, state, params=None):
        leaves, spec = _flatten(updates, "updates")
        new = _foreach_grouped(leaves, lambda ls: _mul(ls, step_size))
        return optree.tree_unflatten(spec, new), state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_learning_rate(learning_rate) -> GradientTransformation:
    """Multiplies updates by ``-learning_rate`` (a float, 0-d tensor or schedule of the step).

    Args:
        learning_rate: the step size or a schedule ``count -> float``.

    Returns:
        A :class:`GradientTransformation` with a step count in its state.

    Example:
        >>> tx = fs.optim.chain(fs.optim.add_decayed_weights(1e-4), fs.optim.scale_by_learning_rate(0.1))  # doctest: +SKIP
    """
    learning_rate = _check_lr(learning_rate)

    def update(updates, state, params=None):
        count = int(state.count)
        lr = _lr_value(learning_rate, count)
        leaves, spec = _flatten(updates, "updates")
        new = _foreach_grouped(leaves, lambda ls: _mul(ls, -lr))
        return optree.tree_unflatten(spec, new), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(lambda params: ScaleByScheduleState(_count0()), update)


def add_decayed_weights(weight_decay: float = 0.0, mask=None) -> GradientTransformation:
    """Adds ``weight_decay * param`` to each update (L2 regularisation in gradient form).

    Args:
        weight_decay: the coefficient (>= 0).
        mask: optional bool pytree (or callable ``params -> pytree``) selecting decayed leaves.

    Returns:
        A stateless :class:`GradientTransformation`; ``update`` requires ``params``.

    Example:
        >>> tx = fs.optim.chain(fs.optim.add_decayed_weights(1e-4), fs.optim.sgd(0.1))  # doctest: +SKIP
    """
    weight_decay = _check_float(weight_decay, "weight_decay")

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("add_decayed_weights: update() needs params= (the current params)")
        leaves, spec = _flatten(updates, "updates")
        pleaves, pspec = _flatten(params, "params")
        _check_match(leaves, pleaves, spec, pspec, "updates", "params")
        flags = (
            [True] * len(leaves)
            if mask is None
            else _mask_leaves(mask, params, pspec, len(leaves), "mask")
        )
        u, p = [_local(x) for x in leaves], [_local(x) for x in pleaves]
        out = list(u)
        for key, idx in _groups(u, flags).items():
            if not key[2] or weight_decay == 0.0:
                continue
            res = torch._foreach_add([u[i] for i in idx], [p[i] for i in idx], alpha=weight_decay)
            for i, r in zip(idx, res):
                out[i] = r
        return optree.tree_unflatten(spec, [_rebuild(x, t) for x, t in zip(leaves, out)]), state

    return GradientTransformation(lambda params: EmptyState(), update)


def _foreach_grouped(leaves, fn) -> list:
    """Apply ``fn(list_of_local_tensors) -> list`` per dtype/device group; rebuild leaves."""
    locals_ = [_local(x) for x in leaves]
    out = list(locals_)
    for idx in _groups(locals_).values():
        for i, r in zip(idx, fn([locals_[i] for i in idx])):
            out[i] = r
    return [_rebuild(x, t) for x, t in zip(leaves, out)]


# -- SGD ------------------------------------------------------------------------------------


def sgd(
    learning_rate, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (dampening 0).

    With momentum ``m``: ``buf = m * buf + g`` (``buf = g`` on the first step), the update is
    ``-lr * buf`` (or ``-lr * (g + m * buf)`` with ``nesterov``). ``weight_decay`` adds
    ``wd * param`` to the gradient first (coupled L2, as torch).

    Args:
        learning_rate: float, 0-d tensor or schedule ``count -> float``.
        momentum: momentum factor in [0, 1).
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        weight_decay: coupled L2 coefficient (needs ``params`` in ``update``).

    Returns:
        A :class:`GradientTransformation` (state: :class:`TraceState`).

    Example:
        >>> tx = fs.optim.sgd(0.1, momentum=0.9)  # doctest: +SKIP
        >>> updates, state = tx.update(grads, tx.init(params), params)  # doctest: +SKIP
    """
    learning_rate = _check_lr(learning_rate)
    momentum = _check_float(momentum, "momentum", 0.0, 1.0, hi_open=True)
    weight_decay = _check_float(weight_decay, "weight_decay")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
    if nesterov and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0")

    def init(params):
        leaves, spec = _flatten(params, "params")
        trace = optree.tree_unflatten(spec, _zeros_like(leaves)) if momentum else None
        return TraceState(_count0(), trace)

    def update(updates, state, params=None):
        leaves, spec = _flatten(updates, "updates")
        count = int(state.count)
        lr = _lr_value(learning_rate, count)
        g = [_local(x) for x in leaves]
        if weight_decay:
            if params is None:
                raise ValueError("sgd(weight_decay>0): update() needs params=")
            pleaves, pspec = _flatten(params, "params")
            _check_match(leaves, pleaves, spec, pspec, "updates", "params")
            p = [_local(x) for x in pleaves]
        buf_leaves = _flatten(state.trace, "state.trace")[0] if momentum else None
        out, new_buf = list(g), list(g)
        for idx in _groups(g).values():
            gi = [g[i] for i in idx]
            if weight_decay:
                gi = list(torch._foreach_add(gi, [p[i] for i in idx], alpha=weight_decay))
            if momentum:
                bi = [_local(buf_leaves[i]) for i in idx]
                bi = list(torch._foreach_add(torch._foreach_mul(bi, momentum), gi))
                for i, b in zip(idx, bi):
                    new_buf[i] = b
                if nesterov:
                    gi = list(torch._foreach_add(gi, bi, alpha=momentum))
                else:
                    gi = bi
            for i, r in zip(idx, _mul(gi, -lr)):
                out[i] = r
        new_updates = optree.tree_unflatten(spec, [_rebuild(x, t) for x, t in zip(leaves, out)])
        trace = None
        if momentum:
            trace = optree.tree_unflatten(
                spec, [_rebuild(x, t) for x, t in zip(buf_leaves, new_buf)]
            )
        return new_updates, TraceState(state.count + 1, trace)

    def in_place(grads, state, params):
        # torch.optim.SGD's foreach kernels, on the donated params and momentum buffers
        operands = _step_operands(grads, params)
        lr = _lr_value(learning_rate, int(state.count))
        if operands is None or _needs_autograd(lr):
            return None
        _, p, g = operands
        bufs = [_local(x) for x in _flatten(state.trace, "state.trace")[0]] if momentum else None
        for idx in _groups(p).values():
            gi, pi = [g[i] for i in idx], [p[i] for i in idx]
            if weight_decay:
                gi = torch._foreach_add(gi, pi, alpha=weight_decay)
            if momentum:
                bi = [bufs[i] for i in idx]
                torch._foreach_mul_(bi, momentum)
                torch._foreach_add_(bi, gi)
                gi = torch._foreach_add(gi, bi, alpha=momentum) if nesterov else bi
            torch._foreach_add_(pi, gi, alpha=-lr)
        return params, TraceState(state.count + 1, state.trace)

    _IN_PLACE[update] = in_place
    return GradientTransformation(init, update)


def momentum(learning_rate, beta: float = 0.9, nesterov: bool = False) -> GradientTransformation:
    """SGD with (heavy-ball or Nesterov) momentum: ``sgd(learning_rate, beta, nesterov)``.

    Args:
        learning_rate: float, 0-d tensor or schedule.
        beta: momentum factor in [0, 1).
        nesterov: Nesterov momentum.

    Returns:
        A :class:`GradientTransformation`.

    Example:
        >>> tx = fs.optim.momentum(0.1, beta=0.9)  # doctest: +SKIP
    """
    return sgd(learning_rate, momentum=beta, nesterov=nesterov)


# -- Adam / AdamW ----------------------------------------------------------------------------


def _adam(learning_rate, b1, b2, eps, weight_decay, mask, name) -> GradientTransformation:
    learning_rate = _check_lr(learning_rate)
    b1 = _check_float(b1, "b1", 0.0, 1.0, hi_open=True)
    b2 = _check_float(b2, "b2", 0.0, 1.0, hi_open=True)
    eps = _check_float(eps, "eps")
    weight_decay = _check_float(weight_decay, "weight_decay")
    if mask is not None and not (callable(mask) or isinstance(mask, (bool, dict, list, tuple))):
        raise TypeError(f"{name}: mask must be a pytree of bools or a callable, got {mask!r}")

    def init(params):
        leaves, spec = _flatten(params, "params")
        return ScaleByAdamState(
            _count0(),
            optree.tree_unflatten(spec, _zeros_like(leaves)),
            optree.tree_unflatten(spec, _zeros_like(leaves)),
        )

    def update(updates, state, params=None):
        leaves, spec = _flatten(updates, "updates")
        count = int(state.count)
        t = count + 1
        lr = _lr_value(learning_rate, count)
        mu_leaves = _flatten(state.mu, "state.mu")[0]
        nu_leaves = _flatten(state.nu, "state.nu")[0]
        if len(mu_leaves) != len(leaves):
            raise ValueError(
                f"{name}: updates have {len(leaves)} leaves but the state has {len(mu_leaves)}; "
                "init the optimizer with params of the same structure"
            )
        decay = weight_decay != 0.0
        if decay:
            if params is None:
                raise ValueError(f"{name}(weight_decay>0): update() needs params=")
            pleaves, pspec = _flatten(params, "params")
            _check_match(leaves, pleaves, spec, pspec, "updates", "params")
            p = [_local(x) for x in pleaves]
            flags = (
                [True] * len(leaves)
                if mask is None
                else _mask_leaves(mask, params, pspec, len(leaves), "mask")
            )
        else:
            flags = [False] * len(leaves)
        g = [_local(x) for x in leaves]
        m_all, v_all = [_local(x) for x in mu_leaves], [_local(x) for x in nu_leaves]
        bc1 = 1.0 - b1**t
        bc2_sqrt = math.sqrt(1.0 - b2**t)
        step_size = lr / bc1
        out, new_m, new_v = list(g), list(m_all), list(v_all)
        # Without autograd, temporaries this function created may be updated in place (fewer
        # allocations); inputs are never touched either way.
        fast = not (
            _needs_autograd(lr)
            or any(_needs_autograd(t) for t in g)
            or any(_needs_autograd(t) for t in m_all)
            or (decay and any(_needs_autograd(t) for t in p))
        )
        for key, idx in _groups(g, flags).items():
            gi = [g[i] for i in idx]
            if fast:
                mi = torch._foreach_lerp([m_all[i] for i in idx], gi, 1.0 - b1)
                vi = torch._foreach_mul([v_all[i] for i in idx], b2)
                torch._foreach_addcmul_(vi, gi, gi, value=1.0 - b2)
                denom = torch._foreach_sqrt(vi)
                torch._foreach_div_(denom, bc2_sqrt)
                torch._foreach_add_(denom, eps)
                if key[2]:
                    ui = torch._foreach_mul([p[i] for i in idx], -lr * weight_decay)
                    torch._foreach_addcdiv_(ui, mi, denom, value=-step_size)
                else:
                    ui = torch._foreach_div(mi, denom)
                    torch._foreach_mul_(ui, -step_size)
                for j, i in enumerate(idx):
                    out[i], new_m[i], new_v[i] = ui[j], mi[j], vi[j]
                continue
            mi = torch._foreach_lerp([m_all[i] for i in idx], gi, 1.0 - b1)
            vi = torch._foreach_addcmul(
                torch._foreach_mul([v_all[i] for i in idx], b2), gi, gi, value=1.0 - b2
            )
            denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(vi), bc2_sqrt), eps)
            ui = _mul(list(torch._foreach_div(mi, denom)), -step_size)
            if key[2]:  # decoupled weight decay: -lr * wd * param
                ui = torch._foreach_add(ui, _mul([p[i] for i in idx], -lr * weight_decay))
            for j, i in enumerate(idx):
                out[i], new_m[i], new_v[i] = ui[j], mi[j], vi[j]
        new_updates = optree.tree_unflatten(spec, [_rebuild(x, u) for x, u in zip(leaves, out)])
        mu = optree.tree_unflatten(spec, [_rebuild(x, u) for x, u in zip(mu_leaves, new_m)])
        nu = optree.tree_unflatten(spec, [_rebuild(x, u) for x, u in zip(nu_leaves, new_v)])
        return new_updates, ScaleByAdamState(state.count + 1, mu, nu)

    def in_place(grads, state, params):
        # torch.optim.Adam(W)'s foreach kernels, on the donated params and moments
        operands = _step_operands(grads, params)
        count = int(state.count)
        lr = _lr_value(learning_rate, count)
        if operands is None or _needs_autograd(lr):
            return None
        pspec, p, g = operands
        m_all = [_local(x) for x in _flatten(state.mu, "state.mu")[0]]
        v_all = [_local(x) for x in _flatten(state.nu, "state.nu")[0]]
        if len(m_all) != len(p):
            return None  # update() raises the explanatory error
        flags = [weight_decay != 0.0] * len(p)
        if mask is not None and weight_decay != 0.0:
            flags = _mask_leaves(mask, params, pspec, len(p), "mask")
        t = count + 1
        step_size = lr / (1.0 - b1**t)
        bc2_sqrt = math.sqrt(1.0 - b2**t)
        for key, idx in _groups(p, flags).items():
            gi, pi = [g[i] for i in idx], [p[i] for i in idx]
            mi, vi = [m_all[i] for i in idx], [v_all[i] for i in idx]
            if key[2]:
                torch._foreach_mul_(pi, 1.0 - lr * weight_decay)
            torch._foreach_lerp_(mi, gi, 1.0 - b1)
            torch._foreach_mul_(vi, b2)
            torch._foreach_addcmul_(vi, gi, gi, value=1.0 - b2)
            denom = torch._foreach_sqrt(vi)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(pi, mi, denom, value=-step_size)
        return params, ScaleByAdamState(state.count + 1, state.mu, state.nu)

    _IN_PLACE[update] = in_place
    return GradientTransformation(init, update)


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    """Adam, as ``torch.optim.Adam`` (no amsgrad): bias-corrected moments, then
    ``-lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.

    Args:
        learning_rate: float, 0-d tensor or schedule ``count -> float``.
        b1, b2: moment decay rates in [0, 1).
        eps: added to the denominator.

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScaleByAdamState`, moments with the
        params' layouts).

    Example:
        >>> tx = fs.optim.adam(1e-3)  # doctest: +SKIP
        >>> updates, state = tx.update(grads, tx.init(params))  # doctest: +SKIP
    """
    return _adam(learning_rate, b1, b2, eps, 0.0, None, "adam")


def adamw(
    learning_rate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask=None,
) -> GradientTransformation:
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``: the Adam update plus
    ``-lr * weight_decay * param``.

    Args:
        learning_rate: float, 0-d tensor or schedule ``count -> float``.
        b1, b2: moment decay rates in [0, 1).
        eps: added to the denominator.
        weight_decay: decoupled decay coefficient (>= 0; torch's default 1e-2).
        mask: which leaves are decayed: a bool pytree with the params' structure or a callable
            ``params -> pytree`` (e.g. no decay for biases and norms); default all.

    Returns:
        A :class:`GradientTransformation`; ``update`` needs ``params`` when ``weight_decay > 0``.

    Example:
        >>> no_decay = lambda ps: {k: v.ndim > 1 for k, v in ps.items()}  # doctest: +SKIP
        >>> tx = fs.optim.adamw(3e-4, weight_decay=0.1, mask=no_decay)  # doctest: +SKIP
    """
    return _adam(learning_rate, b1, b2, eps, weight_decay, mask, "adamw")


# -- gradient clipping ----------------------------------------------------------------------


def global_norm(tree) -> torch.Tensor:
    """The L2 norm of all the leaves of ``tree`` taken together, as a 0-d tensor.

    For a ShardedArray the squared sum of its local shard is summed over the mesh axes that
    shard it (one ``fs.lax.psum`` per distinct (mesh, axes) group, not per leaf); replicated
    dims are counted once; a partial leaf is reduced (resharded to non-partial) first. The
    result is the same on every rank.

    Args:
        tree: a pytree of ShardedArrays and tensors.

    Returns:
        A 0-d float32 tensor (differentiable).

    Example:
        >>> norm = fs.optim.global_norm(grads)  # doctest: +SKIP
    """
    from . import lax
    from .api import _reshard_one
    from .spec import P

    leaves, _ = _flatten(tree, "tree")
    by_group: dict = {}
    for x in leaves:
        if isinstance(x, ShardedArray):
            if x.layout.partial:
                x = _reshard_one(x, P(*x.layout.dim_axes))
            axes = tuple(sorted(x.layout.sharded_axes, key=x.mesh.axis_names.index))
            key = (x.mesh, axes)
        else:
            key = (None, ())
        by_group.setdefault(key, []).append(_local(x))
    total = None
    for (mesh, axes), ts in by_group.items():
        sq = None
        for idx in _groups(ts).values():
            norms = torch._foreach_norm([ts[i] for i in idx])
            s = torch.stack(norms).float().square().sum()
            sq = s if sq is None else sq + s
        if axes:
            sq = lax.psum(sq, axes, mesh=mesh)
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        return torch.zeros(())
    return total.sqrt()


def clip_by_global_norm(max_norm: float, eps: float = 1e-6) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + eps))``, with ``norm`` the true global
    norm over every leaf and every shard (:func:`global_norm`), as
    ``torch.nn.utils.clip_grad_norm_``.

    Args:
        max_norm: the largest allowed global norm (> 0).
        eps: added to the norm in the denominator (torch uses 1e-6).

    Returns:
        A stateless :class:`GradientTransformation`. It issues one small all_reduce per group
        of leaves sharded over the same mesh axes.

    Example:
        >>> tx = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(3e-4))  # doctest: +SKIP
    """
    max_norm = _check_float(max_norm, "max_norm")
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    eps = _check_float(eps, "eps")

    def update(updates, state, params=None):
        norm = global_norm(updates)
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        leaves, spec = _flatten(updates, "updates")

        def scale_group(ts):
            c = coef.to(device=ts[0].device, dtype=ts[0].dtype)
            return _mul(ts, c)

        return optree.tree_unflatten(spec, _foreach_grouped(leaves, scale_group)), state

    return GradientTransformation(lambda params: EmptyState(), update)


# -- combinators ----------------------------------------------------------------------------


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order; the state is the tuple of their states.

    Args:
        *transforms: :class:`GradientTransformation` objects.

    Returns:
        A :class:`GradientTransformation`.

    Example:
        >>> tx = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3))  # doctest: +SKIP
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation"
            )

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain: state must be a tuple of {len(transforms)} states")
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def in_place(grads, state, params):
        if not transforms or not isinstance(state, tuple) or len(state) != len(transforms):
            return None
        *head, last = transforms
        new_state = []
        for t, s in zip(head, state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        params, s = _donated_step(last, grads, state[-1], params)
        return params, (*new_state, s)

    _IN_PLACE[update] = in_place
    return GradientTransformation(init, update)


def _select(tree, flags, spec_name):
    leaves, spec = _flatten(tree, spec_name)
    return [x for x, f in zip(leaves, flags) if f], leaves, spec


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Applies ``inner`` only to the leaves where ``mask`` is True; other updates pass through
    unchanged (and ``inner`` keeps no state for them).

    Args:
        inner: the transformation for the selected leaves.
        mask: a bool pytree with the params' structure, or a callable ``params -> pytree``.

    Returns:
        A :class:`GradientTransformation` (state: :class:`MaskedState`).

    Example:
        >>> tx = fs.optim.masked(fs.optim.add_decayed_weights(0.1), lambda ps: {k: "bias" not in k for k in ps})  # doctest: +SKIP
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"masked: inner must be a GradientTransformation, got {type(inner).__name__}"
        )

    def flags_for(tree):
        leaves, spec = _flatten(tree, "params")
        return _mask_leaves(mask, tree, spec, len(leaves), "mask")

    def init(params):
        sel, _, _ = _select(params, flags_for(params), "params")
        return MaskedState(inner.init(sel))

    def update(updates, state, params=None):
        flags = flags_for(updates if params is None else params)
        sel, leaves, spec = _select(updates, flags, "updates")
        psel = None if params is None else _select(params, flags, "params")[0]
        new_sel, inner_state = inner.update(sel, state.inner_state, psel)
        it = iter(new_sel)
        out = [next(it) if f else x for x, f in zip(leaves, flags)]
        return optree.tree_unflatten(spec, out), MaskedState(inner_state)

    return GradientTransformation(init, update)


def multi_transform(transforms: dict, param_labels) -> GradientTransformation:
    """Applies a different transformation to each group of leaves, by label.

    Args:
        transforms: ``{label: GradientTransformation}``.
        param_labels: a pytree of labels with the params' structure, or a callable
            ``params -> pytree``. Every label must be a key of ``transforms``.

    Returns:
        A :class:`GradientTransformation` (state: :class:`MultiTransformState`).

    Example:
        >>> labels = lambda ps: {k: "frozen" if k.startswith("emb") else "train" for k in ps}  # doctest: +SKIP
        >>> tx = fs.optim.multi_transform({"train": fs.optim.adam(1e-3), "frozen": fs.optim.set_to_zero()}, labels)  # doctest: +SKIP
    """
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError("multi_transform: transforms must be a non-empty dict label -> transform")
    for k, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"multi_transform: transforms[{k!r}] is not a GradientTransformation")

    def labels_for(tree):
        leaves, spec = _flatten(tree, "params")
        labels = param_labels(tree) if callable(param_labels) else param_labels
        try:
            flat = spec.flatten_up_to(labels)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"multi_transform: param_labels must match the params' structure ({e})"
            ) from e
        unknown = sorted({str(lab) for lab in flat if lab not in transforms})
        if unknown:
            raise ValueError(
                f"multi_transform: labels {unknown} have no transform; known: {sorted(transforms)}"
            )
        return flat

    def init(params):
        labels = labels_for(params)
        return MultiTransformState(
            {
                k: t.init(_select(params, [lab == k for lab in labels], "params")[0])
                for k, t in transforms.items()
            }
        )

    def update(updates, state, params=None):
        labels = labels_for(updates if params is None else params)
        leaves, spec = _flatten(updates, "updates")
        out = list(leaves)
        new_states = {}
        for k, t in transforms.items():
            flags = [lab == k for lab in labels]
            sel = [x for x, f in zip(leaves, flags) if f]
            psel = None if params is None else _select(params, flags, "params")[0]
            new_sel, new_states[k] = t.update(sel, state.inner_states[k], psel)
            it = iter(new_sel)
            for i, f in enumerate(flags):
                if f:
                    out[i] = next(it)
        return optree.tree_unflatten(spec, out), MultiTransformState(new_states)

    return GradientTransformation(init, update)


def apply_updates(params, updates, *, donate: bool = False):
    """``params + updates``, leaf by leaf (optax's ``apply_updates``).

    Args:
        params: pytree of ShardedArrays / tensors.
        updates: pytree with the same structure and layouts.
        donate: reuse the params' local buffers for the result, like ``jax.jit``'s
            ``donate_argnums``: the sum is added in place (one ``torch._foreach_add_`` per
            dtype/device group), so no new parameter memory is allocated. ``params`` must not
            be used afterwards, and any tensor its local shards alias is overwritten too
            (``fs.shard`` of a replicated value and ``fs.nn.shard_params`` keep views of the
            tensors they were given). Ignored (out of place, nothing mutated) when a leaf takes
            part in autograd or a ``torch.func`` transform, or two leaves share a buffer.

    Returns:
        The new params (same layouts). Without donation, differentiable w.r.t. both arguments
        and the inputs are untouched.

    Example:
        >>> params = fs.optim.apply_updates(params, updates)  # doctest: +SKIP
    """
    pleaves, pspec = _flatten(params, "params")
    uleaves, uspec = _flatten(updates, "updates")
    _check_match(uleaves, pleaves, uspec, pspec, "updates", "params")
    p, u = [_local(x) for x in pleaves], [_local(x) for x in uleaves]
    in_place = donate and _donatable(p, u)
    out = list(p)
    for idx in _groups(p).values():
        ui = [u[i] if u[i].dtype == p[i].dtype else u[i].to(p[i].dtype) for i in idx]
        if in_place:
            torch._foreach_add_([p[i] for i in idx], ui)
            continue
        for i, r in zip(idx, torch._foreach_add([p[i] for i in idx], ui)):
            out[i] = r
    if in_place:
        return params
    return optree.tree_unflatten(pspec, [_rebuild(x, t) for x, t in zip(pleaves, out)])


# -- whole steps, optionally with donated buffers ---------------------------------------------

#: ``update`` function -> in-place step ``(grads, state, params) -> (params, state) | None``
#: for the transformations whose step torch.optim runs as in-place foreach kernels. ``None``
#: means "not possible here" (e.g. a differentiable learning rate); the caller falls back.
_IN_PLACE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_operands(grads, params):
    """``(pspec, param locals, grad locals)``, or None when a grad's dtype or device differs
    from its param's (the out-of-place path handles the conversion)."""
    leaves, spec = _flatten(grads, "grads")
    pleaves, pspec = _flatten(params, "params")
    _check_match(leaves, pleaves, spec, pspec, "grads", "params")
    p, g = [_local(x) for x in pleaves], [_local(x) for x in leaves]
    if any(a.dtype != b.dtype or a.device != b.device for a, b in zip(p, g)):
        return None
    return pspec, p, g


def _tensors(tree) -> list:
    return [_local(x) for x in optree.tree_leaves(tree, is_leaf=_is_leaf) if _is_tensor(x)]


def _is_tensor(x) -> bool:
    return isinstance(x, (torch.Tensor, ShardedArray))


def _donatable(*groups: list) -> bool:
    """No tensor takes part in autograd and no two share a buffer (in-place is then exact)."""
    seen = set()
    for ts in groups:
        for t in ts:
            if _needs_autograd(t):
                return False
            if t.numel():
                ptr = t.data_ptr()
                if ptr in seen:
                    return False
                seen.add(ptr)
    return True


def _donated_step(tx: GradientTransformation, grads, state, params):
    fused = _IN_PLACE.get(tx.update)
    res = fused(grads, state, params) if fused is not None else None
    if res is not None:
        return res
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates, donate=True), state


def step(tx: GradientTransformation, grads, state, params, *, donate: bool = False):
    """One optimizer step: ``tx.update`` then :func:`apply_updates`, returning
    ``(new_params, new_state)``.

    Without ``donate`` this is exactly the two-call optax step (pure; nothing is mutated).
    With ``donate=True`` the params' and the state's local buffers are reused for the results,
    as ``jax.jit(step, donate_argnums=...)`` would: :func:`sgd`, :func:`adam`, :func:`adamw`
    (alone or last in a :func:`chain`) then run the same in-place ``torch._foreach_*`` kernels
    as ``torch.optim`` (one pass over memory for plain SGD instead of three, and no fresh
    parameter-sized allocations, which cost page faults on CPU); other transformations run
    ``update`` and an in-place ``apply_updates``. ``grads`` are never modified. Donation is
    skipped (the pure path runs) when any leaf takes part in autograd or a ``torch.func``
    transform (meta-learning) or two leaves share a buffer.

    Args:
        tx: a :class:`GradientTransformation`.
        grads: gradients, with the params' structure and layouts.
        state: ``tx``'s state (from ``tx.init`` or a previous step).
        params: the current params.
        donate: reuse ``params``' and ``state``'s buffers; do not use them afterwards (and
            note that tensors they alias, e.g. module parameters that ``fs.nn.shard_params``
            viewed, are overwritten too).

    Returns:
        ``(new_params, new_state)``.

    Example:
        >>> tx = fs.optim.adamw(1e-3)  # doctest: +SKIP
        >>> params, state = fs.optim.step(tx, grads, state, params, donate=True)  # doctest: +SKIP
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"step: tx must be a GradientTransformation, got {type(tx).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"step: donate must be a bool, got {donate!r}")
    if donate and _donatable(_tensors(params), _tensors(state), _tensors(grads)):
        return _donated_step(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state


# -- schedules ------------------------------------------------------------------------------


def constant_schedule(value: float) -> Callable[[int], float]:
    """A schedule that always returns ``value``.

    Example:
        >>> fs.optim.constant_schedule(0.1)(100)  # doctest: +SKIP
        0.1
    """
    value = _check_float(value, "value", lo=-math.inf)
    return lambda count: value


def _check_steps(n, name):
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return n


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Callable[[int], float]:
    """Linear interpolation from ``init_value`` to ``end_value`` over ``transition_steps``
    steps starting at ``transition_begin`` (constant before and after): a linear warmup when
    ``init_value < end_value``.

    Example:
        >>> warm = fs.optim.linear_schedule(0.0, 1e-3, 100)  # doctest: +SKIP
        >>> warm(50)  # doctest: +SKIP
        0.0005
    """
    init_value = _check_float(init_value, "init_value", lo=-math.inf)
    end_value = _check_float(end_value, "end_value", lo=-math.inf)
    _check_steps(transition_steps, "transition_steps")
    _check_steps(transition_begin, "transition_begin")

    def schedule(count: int) -> float:
        if transition_steps == 0:
            return end_value if count >= transition_begin else init_value
        frac = min(max(count - transition_begin, 0), transition_steps) / transition_steps
        return init_value + frac * (end_value - init_value)

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0
) -> Callable[[int], float]:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Example:
        >>> fs.optim.cosine_decay_schedule(1.0, 100)(50)  # doctest: +SKIP
        0.5
    """
    init_value = _check_float(init_value, "init_value", lo=-math.inf)
    _check_steps(decay_steps, "decay_steps")
    if decay_steps == 0:
        raise ValueError("decay_steps must be > 0")
    alpha = _check_float(alpha, "alpha", 0.0, 1.0)

    def schedule(count: int) -> float:
        frac = min(max(count, 0), decay_steps) / decay_steps
        cos = 0.5 * (1.0 + math.cos(math.pi * frac))
        return init_value * ((1.0 - alpha) * cos + alpha)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
) -> Callable[[int], float]:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at step ``decay_steps`` (total, warmup included), as optax.

    Example:
        >>> lr = fs.optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 200)  # doctest: +SKIP
        >>> tx = fs.optim.adamw(lr)  # doctest: +SKIP
    """
    init_value = _check_float(init_value, "init_value", lo=-math.inf)
    peak_value = _check_float(peak_value, "peak_value", lo=-math.inf)
    end_value = _check_float(end_value, "end_value", lo=-math.inf)
    _check_steps(warmup_steps, "warmup_steps")
    _check_steps(decay_steps, "decay_steps")
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps}): it counts "
            "the warmup too"
        )

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return init_value + (peak_value - init_value) * count / warmup_steps
        frac = min(count - warmup_steps, decay_steps - warmup_steps) / (decay_steps - warmup_steps)
        cos = 0.5 * (1.0 + math.cos(math.pi * frac))
        return end_value + (peak_value - end_value) * cos

    return schedule
