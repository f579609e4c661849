"""Optimizers: chains of the building blocks of :mod:`fshard.optim.transform`, composed as optax
composes them (``adamw = chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``),
so their states are optax's tuples.

:func:`sgd`, :func:`adam` and :func:`adamw` also carry a ``donated_step``: the same step as
``torch.optim``'s foreach kernels, in place on donated params and state (see
:func:`fshard.optim.step`). The two paths follow the same formulas; they differ only by float
rounding.

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.adamw(1e-2, weight_decay=0.1)
    >>> params = {"w": torch.ones(3)}
    >>> state = tx.init(params)
    >>> [type(s).__name__ for s in state]
    ['ScaleByAdamState', 'EmptyState', 'EmptyState']
    >>> updates, state = tx.update({"w": torch.ones(3)}, state, params)
    >>> fs.optim.apply_updates(params, updates)["w"]
    tensor([0.9890, 0.9890, 0.9890])
"""

from __future__ import annotations

import math

import torch

from . import _tree
from ._tree import check_bool, check_scalar, check_schedule
from .base import GradientTransformation, ScaleByAdamState, ScaleByScheduleState, identity
from .clipping import clip_by_block_rms
from .combine import _mask_flags, chain, masked
from .linesearch import scale_by_zoom_linesearch
from .transform import (
    add_decayed_weights,
    add_noise,
    ema,
    scale,
    scale_by_adadelta,
    scale_by_adam,
    scale_by_adamax,
    scale_by_adan,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_factored_rms,
    scale_by_lbfgs,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_novograd,
    scale_by_optimistic_gradient,
    scale_by_param_block_rms,
    scale_by_polyak,
    scale_by_radam,
    scale_by_rms,
    scale_by_rprop,
    scale_by_rss,
    scale_by_sign,
    scale_by_sm3,
    scale_by_stddev,
    scale_by_trust_ratio,
    scale_by_yogi,
    trace,
)
from .update import concrete, groups, step_operands

__all__ = [
    "sgd",
    "momentum",
    "adam",
    "adamw",
    "nadam",
    "nadamw",
    "radam",
    "lion",
    "adafactor",
    "lamb",
    "lars",
    "rmsprop",
    "adagrad",
    "adamax",
    "adamaxw",
    "amsgrad",
    "adabelief",
    "yogi",
    "adadelta",
    "novograd",
    "sm3",
    "rprop",
    "sign_sgd",
    "noisy_sgd",
    "polyak_sgd",
    "optimistic_gradient_descent",
    "lbfgs",
    "adan",
]


# -- the in-place steps (torch.optim's foreach kernels) -----------------------------------------


def _lr_now(learning_rate, lr_state):
    """The learning rate of this step as a Python float, or None (pure path needed)."""
    if callable(learning_rate):
        return concrete(learning_rate(int(lr_state.count)))
    return concrete(learning_rate)


def _next_lr_state(learning_rate, lr_state):
    return ScaleByScheduleState(lr_state.count + 1) if callable(learning_rate) else lr_state


def _sgd_donated(learning_rate, momentum: float, nesterov: bool, weight_decay: float):
    """torch.optim.SGD's foreach step: ``buf = m * buf + (g + wd * p)``, ``p -= lr * buf``
    (Nesterov: ``p -= lr * (g + m * buf)``), on the donated params and momentum buffers."""

    def donated_step(grads, state, params):
        operands = step_operands(grads, params)
        lr = _lr_now(learning_rate, state[-1])
        if operands is None or lr is None:
            return None
        _, p, g = operands
        bufs = None
        if momentum:
            bufs = [_tree.local(x) for x in _tree.flatten(state[-2].trace, "state.trace")[0]]
        for idx in groups(p).values():
            gi, pi = [g[i] for i in idx], [p[i] for i in idx]
            if weight_decay:
                gi = torch._foreach_add(gi, pi, alpha=weight_decay)
            if momentum:
                bi = [bufs[i] for i in idx]
                torch._foreach_mul_(bi, momentum)
                torch._foreach_add_(bi, gi)
                gi = torch._foreach_add(gi, bi, alpha=momentum) if nesterov else bi
            torch._foreach_add_(pi, gi, alpha=-lr)
        return params, (*state[:-1], _next_lr_state(learning_rate, state[-1]))

    return donated_step


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fusable(params, *others) -> bool:
    """Whether torch's fused Adam kernel takes these lists: CUDA tensors, one floating dtype
    (params, grads and moments alike). Elsewhere the foreach ops run (CPU has no fused kernel
    in every supported torch)."""
    p0 = params[0]
    if not p0.is_cuda or p0.dtype not in _FUSED_DTYPES:
        return False
    return all(t.is_cuda and t.dtype == p0.dtype for ts in (params, *others) for t in ts)


def _adam_donated(learning_rate, b1: float, b2: float, eps: float, weight_decay: float, mask):
    """torch.optim.Adam(W)'s step on the donated params and moments: its fused CUDA kernel
    (``torch._fused_adamw_``, as ``AdamW(fused=True)``) where every tensor of a group is on
    CUDA in one floating dtype, its foreach ops otherwise."""

    def donated_step(grads, state, params):
        operands = step_operands(grads, params)
        lr = _lr_now(learning_rate, state[-1])
        adam_state = state[0]
        if operands is None or lr is None:
            return None
        pspec, p, g = operands
        m_all = [_tree.local(x) for x in _tree.flatten(adam_state.mu, "state.mu")[0]]
        v_all = [_tree.local(x) for x in _tree.flatten(adam_state.nu, "state.nu")[0]]
        if len(m_all) != len(p):
            return None  # update() raises the explanatory error
        flags = [weight_decay != 0.0] * len(p)
        if mask is not None and weight_decay != 0.0:
            flags = _mask_flags(mask, params, pspec, len(p), "mask")
        t = int(adam_state.count) + 1
        step_size = lr / (1.0 - b1**t)
        bc2_sqrt = math.sqrt(1.0 - b2**t)
        for key, idx in groups(p, flags).items():
            gi, pi = [g[i] for i in idx], [p[i] for i in idx]
            mi, vi = [m_all[i] for i in idx], [v_all[i] for i in idx]
            if _fusable(pi, gi, mi, vi):  # torch.optim.AdamW(fused=True)'s kernel, same math
                wd = weight_decay if key[2] else 0.0
                steps = [torch.full((), float(t), device=pi[0].device)] * len(pi)  # read only
                fused = torch._fused_adamw_ if key[2] else torch._fused_adam_
                fused(pi, gi, mi, vi, [], steps, amsgrad=False, lr=lr, beta1=b1, beta2=b2,
                      weight_decay=wd, eps=eps, maximize=False)  # fmt: skip
                continue
            if key[2]:
                torch._foreach_mul_(pi, 1.0 - lr * weight_decay)
            torch._foreach_lerp_(mi, gi, 1.0 - b1)
            torch._foreach_mul_(vi, b2)
            torch._foreach_addcmul_(vi, gi, gi, value=1.0 - b2)
            denom = torch._foreach_sqrt(vi)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(pi, mi, denom, value=-step_size)
        new_adam = ScaleByAdamState(adam_state.count + 1, adam_state.mu, adam_state.nu)
        return params, (new_adam, *state[1:-1], _next_lr_state(learning_rate, state[-1]))

    return donated_step


def _all_floats(*values) -> bool:
    return all(not isinstance(v, torch.Tensor) for v in values)


# -- SGD ----------------------------------------------------------------------------------------


def sgd(
    learning_rate, momentum=0.0, nesterov: bool = False, weight_decay=0.0
) -> GradientTransformation:
    """Stochastic gradient descent: ``chain([add_decayed_weights,] trace | identity,
    scale_by_learning_rate)``, as optax's ``sgd`` (and ``torch.optim.SGD`` with dampening 0).

    With momentum ``m``: ``buf = m * buf + g`` (``buf = g`` on the first step), the update is
    ``-lr * buf`` (or ``-lr * (g + m * buf)`` with ``nesterov``). ``weight_decay`` (not in
    optax's ``sgd``) adds ``wd * param`` to the gradient first (coupled L2, as torch); the
    state then starts with its ``EmptyState``. ``momentum`` 0 or None means no momentum.

    Args:
        learning_rate: float, 0-d tensor or schedule ``count -> value``.
        momentum: momentum factor in [0, 1), or None.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        weight_decay: coupled L2 coefficient (needs ``params`` in ``update``).

    Returns:
        A :class:`GradientTransformation` with a ``donated_step``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.sgd(0.1, momentum=0.9)
        >>> p = {"w": torch.zeros(1)}
        >>> u, s = tx.update({"w": torch.ones(1)}, tx.init(p), p)
        >>> u, s = tx.update({"w": torch.ones(1)}, s, p)
        >>> u["w"]
        tensor([-0.1900])
    """
    learning_rate = check_schedule(learning_rate)
    momentum = 0.0 if momentum is None else check_scalar(momentum, "momentum", 0.0, 1.0, True)
    weight_decay = check_scalar(weight_decay, "weight_decay", 0.0)
    check_bool(nesterov, "nesterov")
    if nesterov and not isinstance(momentum, torch.Tensor) and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0")
    parts = [add_decayed_weights(weight_decay)] if _nonzero(weight_decay) else []
    has_momentum = isinstance(momentum, torch.Tensor) or momentum != 0.0
    parts += [trace(momentum, nesterov) if has_momentum else identity()]
    tx = chain(*parts, scale_by_learning_rate(learning_rate))
    if _all_floats(momentum, weight_decay):
        tx = tx._replace(donated_step=_sgd_donated(learning_rate, momentum, nesterov, weight_decay))
    return tx


def _nonzero(x) -> bool:
    return isinstance(x, torch.Tensor) or callable(x) or x != 0.0


def momentum(learning_rate, beta=0.9, nesterov: bool = False) -> GradientTransformation:
    """SGD with (heavy-ball or Nesterov) momentum: ``sgd(learning_rate, beta, nesterov)``.

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.momentum(0.1, beta=0.9)
    """
    return sgd(learning_rate, momentum=beta, nesterov=nesterov)


# -- Adam family --------------------------------------------------------------------------------


def adam(
    learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, *, nesterov: bool = False
) -> GradientTransformation:
    """Adam: ``chain(scale_by_adam, scale_by_learning_rate)``, as optax; the numbers of
    ``torch.optim.Adam`` (no amsgrad): ``-lr * m_hat / (sqrt(v_hat + eps_root) + eps)``.

    Args:
        learning_rate: float, 0-d tensor or schedule ``count -> value``.
        b1: first moment decay rate in [0, 1).
        b2: second moment decay rate in [0, 1).
        eps: added to the denominator.
        eps_root: added inside the square root.
        nesterov: NAdam (:func:`nadam`).

    Returns:
        A :class:`GradientTransformation` (state: ``(ScaleByAdamState, lr state)``, moments
        with the params' layouts), with a ``donated_step`` when ``eps_root == 0``, no
        Nesterov and float hyperparameters.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adam(1e-3)
        >>> p = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.ones(2)}, tx.init(p))[0]
        {'w': tensor([-0.0010, -0.0010])}
    """
    return _adam_chain(learning_rate, b1, b2, eps, eps_root, nesterov, None, None)


def adamw(
    learning_rate,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    weight_decay=1e-2,
    mask=None,
    *,
    eps_root=0.0,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdamW (decoupled weight decay): ``chain(scale_by_adam, add_decayed_weights,
    scale_by_learning_rate)``, as optax; the numbers of ``torch.optim.AdamW``: the Adam update
    plus ``-lr * weight_decay * param``.

    Differences from optax's ``adamw``: ``weight_decay`` defaults to torch's ``1e-2`` (optax:
    ``1e-4``), and ``eps_root``/``nesterov`` are keyword-only after ``mask``.

    Args:
        learning_rate: float, 0-d tensor or schedule ``count -> value``.
        b1: first moment decay rate in [0, 1).
        b2: second moment decay rate in [0, 1).
        eps: added to the denominator.
        weight_decay: decoupled decay coefficient (>= 0), 0-d tensor or schedule.
        mask: which leaves are decayed: a bool pytree with the params' structure or a callable
            ``params -> pytree`` (e.g. no decay for biases and norms); default all.
        eps_root: added inside the square root.
        nesterov: NAdamW (:func:`nadamw`).

    Returns:
        A :class:`GradientTransformation`; ``update`` needs ``params`` when
        ``weight_decay > 0``.

    Example:
        >>> import fshard as fs
        >>> no_decay = lambda ps: {k: v.ndim > 1 for k, v in ps.items()}
        >>> tx = fs.optim.adamw(3e-4, weight_decay=0.1, mask=no_decay)
    """
    return _adam_chain(learning_rate, b1, b2, eps, eps_root, nesterov, weight_decay, mask)


def _adam_chain(learning_rate, b1, b2, eps, eps_root, nesterov, weight_decay, mask):
    """``chain(scale_by_adam, [add_decayed_weights], scale_by_learning_rate)`` (no decay
    element when ``weight_decay`` is None: optax's ``adam``), with the in-place step attached
    when torch's kernels compute the same thing."""
    learning_rate = check_schedule(learning_rate)
    if mask is not None and not (callable(mask) or isinstance(mask, (bool, dict, list, tuple))):
        raise TypeError(f"adamw: mask must be a pytree of bools or a callable, got {mask!r}")
    parts = [scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov)]
    if weight_decay is not None:
        parts.append(add_decayed_weights(weight_decay, mask))
    tx = chain(*parts, scale_by_learning_rate(learning_rate))
    wd = 0.0 if weight_decay is None else weight_decay
    plain = _all_floats(b1, b2, eps, eps_root, wd) and not callable(wd)
    if plain and eps_root == 0.0 and not nesterov:
        tx = tx._replace(donated_step=_adam_donated(learning_rate, b1, b2, eps, float(wd), mask))
    return tx


def nadam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0) -> GradientTransformation:
    """NAdam: :func:`adam` with ``nesterov=True``, as optax.

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.nadam(1e-3)
    """
    return adam(learning_rate, b1, b2, eps, eps_root, nesterov=True)


def nadamw(
    learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2, mask=None, *, eps_root=0.0
) -> GradientTransformation:
    """NAdamW: :func:`adamw` with ``nesterov=True``, as optax.

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.nadamw(1e-3, weight_decay=0.1)
    """
    return adamw(learning_rate, b1, b2, eps, weight_decay, mask, eps_root=eps_root, nesterov=True)


def radam(
    learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *, nesterov=False
) -> GradientTransformation:
    """Rectified Adam: ``chain(scale_by_radam, scale_by_learning_rate)``, as optax.

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.radam(1e-3)
    """
    return chain(
        scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


def lion(learning_rate, b1=0.9, b2=0.99, weight_decay=1e-3, mask=None) -> GradientTransformation:
    """Lion: ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.lion(0.1, weight_decay=0.0)
        >>> p = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([2.0, -0.1])}, tx.init(p), p)[0]
        {'w': tensor([-0.1000,  0.1000])}
    """
    return chain(
        scale_by_lion(b1, b2),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


def lamb(
    learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0, mask=None
) -> GradientTransformation:
    """LAMB: ``chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio,
    scale_by_learning_rate)``, as optax. The trust ratio uses the norms of whole leaves: over
    every shard of a sharded param (one all_reduce per group of leaves sharded alike).

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.lamb(1e-3, weight_decay=0.01)
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


def lars(
    learning_rate,
    weight_decay=0.0,
    weight_decay_mask=True,
    trust_coefficient=0.001,
    eps=0.0,
    trust_ratio_mask=True,
    momentum=0.9,
    nesterov: bool = False,
) -> GradientTransformation:
    """LARS: ``chain(add_decayed_weights, masked(scale_by_trust_ratio), scale_by_learning_rate,
    trace)``, as optax (momentum on the scaled update). Trust ratios use whole-leaf norms, over
    every shard.

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.lars(0.1, weight_decay=1e-4)
    """
    return chain(
        add_decayed_weights(weight_decay, mask=weight_decay_mask),
        masked(
            scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask
        ),
        scale_by_learning_rate(check_schedule(learning_rate)),
        trace(momentum, nesterov),
    )


def rmsprop(
    learning_rate,
    decay=0.9,
    eps=1e-8,
    initial_scale=0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum=None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformation:
    """RMSProp: ``chain(scale_by_rms | scale_by_stddev (centered), scale_by_learning_rate,
    trace | identity)``, as optax. Note optax's ``eps`` is inside the square root
    (``eps_in_sqrt=True``); ``torch.optim.RMSprop`` adds it outside (``eps_in_sqrt=False``).

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.rmsprop(1e-3, momentum=0.9)
    """
    scaler = scale_by_stddev if check_bool(centered, "centered") else scale_by_rms
    return chain(
        scaler(decay, eps, initial_scale, eps_in_sqrt, bias_correction),
        scale_by_learning_rate(check_schedule(learning_rate)),
        trace(momentum, nesterov) if momentum is not None else identity(),
    )


def adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7) -> GradientTransformation:
    """Adagrad: ``chain(scale_by_rss, scale_by_learning_rate)``, as optax.

    Example:
        >>> import fshard as fs
        >>> tx = fs.optim.adagrad(0.1)
    """
    return chain(
        scale_by_rss(initial_accumulator_value, eps),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


def adafactor(
    learning_rate=None,
    min_dim_size_to_factor: int = 128,
    decay_rate=0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold=1.0,
    momentum=None,
    weight_decay_rate=None,
    eps=1e-30,
    factored: bool = True,
    weight_decay_mask=None,
) -> GradientTransformation:
    """Adafactor, as optax: ``chain(scale_by_factored_rms, [clip_by_block_rms],
    [scale_by_learning_rate], [scale_by_param_block_rms], [ema], [add_decayed_weights],
    scale(-1))``. On sharded params the factored second moments and the block RMSs are over
    whole leaves (collectives over the mesh axes that split the reduced dims; exact with
    uneven shards). The momentum accumulator has the params' dtype (optax: float32).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adafactor(1e-2, min_dim_size_to_factor=2)
        >>> p = {"w": torch.ones(2, 3)}
        >>> u, s = tx.update({"w": torch.ones(2, 3)}, tx.init(p), p)
        >>> u["w"][0]
        tensor([-0.0100, -0.0100, -0.0100])
    """
    parts = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        parts.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        parts.append(scale_by_learning_rate(check_schedule(learning_rate), flip_sign=False))
    if check_bool(multiply_by_parameter_scale, "multiply_by_parameter_scale"):
        parts.append(scale_by_param_block_rms())
    if momentum is not None:
        parts.append(ema(momentum, debias=False))
    if weight_decay_rate is not None:
        parts.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    parts.append(scale(-1))
    return chain(*parts)


def adamax(learning_rate, b1=0.9, b2=0.999, eps=1e-8) -> GradientTransformation:
    """AdaMax: ``chain(scale_by_adamax, scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adamax(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init(p), p)[0]
        {'w': tensor([-0.1000])}
    """
    return chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(check_schedule(learning_rate)))  # fmt: skip


def adamaxw(
    learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, mask=None
) -> GradientTransformation:
    """AdaMax with decoupled weight decay: ``chain(scale_by_adamax, add_decayed_weights,
    scale_by_learning_rate)``, as optax (default ``weight_decay=1e-4``, optax's).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adamaxw(0.1, weight_decay=0.0)
        >>> p = {"w": torch.zeros(1)}
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init(p), p)[0]
        {'w': tensor([-0.1000])}
    """
    return chain(
        scale_by_adamax(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


def amsgrad(
    learning_rate,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    eps_root=0.0,
    *,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    """AMSGrad: ``chain(scale_by_amsgrad, scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.amsgrad(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init(p), p)[0]
        {'w': tensor([-0.1000])}
    """
    return chain(
        scale_by_amsgrad(
            b1, b2, eps, eps_root,
            bias_correction_mu=bias_correction_mu, bias_correction_nu=bias_correction_nu,
        ),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )  # fmt: skip


def adabelief(
    learning_rate, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, nesterov: bool = False
) -> GradientTransformation:
    """AdaBelief: ``chain(scale_by_belief, scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adabelief(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> u = tx.update({"w": torch.tensor([3.0])}, tx.init(p), p)[0]
        >>> round(u["w"].item(), 4)
        -0.1111
    """
    return chain(
        scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


def yogi(learning_rate, b1=0.9, b2=0.999, eps=1e-3) -> GradientTransformation:
    """Yogi: ``chain(scale_by_yogi, scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.yogi(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> u = tx.update({"w": torch.tensor([3.0])}, tx.init(p), p)[0]
        >>> round(u["w"].item(), 5)
        -0.09996
    """
    return chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(check_schedule(learning_rate)))


def adadelta(
    learning_rate=None, rho=0.9, eps=1e-6, weight_decay=0.0, weight_decay_mask=None
) -> GradientTransformation:
    """AdaDelta: ``chain(add_decayed_weights, scale_by_adadelta, scale_by_learning_rate)``, as
    optax (``learning_rate=None``: no scaling).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adadelta(1.0, eps=1.0)
        >>> p = {"w": torch.zeros(1)}
        >>> u = tx.update({"w": torch.tensor([1.0])}, tx.init(p), p)[0]
        >>> round(u["w"].item(), 4)
        -0.9535
    """
    lr = None if learning_rate is None else check_schedule(learning_rate)
    return chain(
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_adadelta(rho, eps),
        scale_by_learning_rate(lr),
    )


def novograd(
    learning_rate, b1=0.9, b2=0.25, eps=1e-6, eps_root=0.0, weight_decay=0.0
) -> GradientTransformation:
    """NovoGrad: ``chain(scale_by_novograd, scale_by_learning_rate)``, as optax (layer-wise
    second moments: one all_reduce per group of sharded leaves per step).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.novograd(0.1, eps=0.0)
        >>> p = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(p), p)[0]
        {'w': tensor([-0.0600, -0.0800])}
    """
    return chain(
        scale_by_novograd(b1, b2, eps, eps_root, weight_decay),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


def sm3(learning_rate, momentum=0.9) -> GradientTransformation:
    """SM3: ``chain(scale_by_sm3(momentum), scale(-learning_rate))``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.sm3(0.1, momentum=0.0)
        >>> p = {"w": torch.zeros(2, 2)}
        >>> tx.update({"w": torch.full((2, 2), 4.0)}, tx.init(p), p)[0]["w"][0]
        tensor([-0.1000, -0.1000])
    """
    return chain(scale_by_sm3(momentum), scale(-check_scalar(learning_rate, "learning_rate")))


def rprop(
    learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0
) -> GradientTransformation:
    """Rprop: ``chain(scale_by_rprop, scale(-1))``, as optax (``learning_rate`` is the
    initial step size).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.rprop(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> u, s = tx.update({"w": torch.tensor([2.0])}, tx.init(p), p)
        >>> tx.update({"w": torch.tensor([1.0])}, s, p)[0]
        {'w': tensor([-0.1000])}
    """
    return chain(
        scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
        scale(-1.0),
    )


def sign_sgd(learning_rate) -> GradientTransformation:
    """signSGD: ``chain(scale_by_sign, scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.sign_sgd(0.1)
        >>> tx.update({"w": torch.tensor([3.0, -0.5])}, tx.init(None))[0]
        {'w': tensor([-0.1000,  0.1000])}
    """
    return chain(scale_by_sign(), scale_by_learning_rate(check_schedule(learning_rate)))


def noisy_sgd(learning_rate, eta=0.01, gamma=0.55, key: int = 0) -> GradientTransformation:
    """Noisy SGD: ``chain(add_noise(eta, gamma, key), scale_by_learning_rate)``, as optax
    (the noise is torch's, the same for every layout: see :func:`add_noise`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.noisy_sgd(0.1, eta=0.0)
        >>> tx.update({"w": torch.ones(1)}, tx.init(None))[0]
        {'w': tensor([-0.1000])}
    """
    return chain(add_noise(eta, gamma, key), scale_by_learning_rate(check_schedule(learning_rate)))


def polyak_sgd(
    max_learning_rate=1.0, scaling=1.0, f_min=0.0, eps=0.0, variant: str = "sps"
) -> GradientTransformation:
    """SGD with Polyak's step size: ``chain(sgd(scaling), scale_by_polyak)``, as optax;
    ``update`` takes the loss as ``value=``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.polyak_sgd()
        >>> p = {"w": torch.zeros(1)}
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init(p), p, value=1.0)[0]
        {'w': tensor([-0.5000])}
    """
    return chain(sgd(scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant))


def optimistic_gradient_descent(learning_rate, alpha=1.0, beta=1.0) -> GradientTransformation:
    """Optimistic gradient descent: ``chain(scale_by_optimistic_gradient,
    scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.optimistic_gradient_descent(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> tx.update({"w": torch.ones(1)}, tx.init(p), p)[0]
        {'w': tensor([-0.1000])}
    """
    return chain(
        scale_by_optimistic_gradient(alpha, beta),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )


_DEFAULT_LINESEARCH = object()


def lbfgs(
    learning_rate=None,
    memory_size: int = 10,
    scale_init_precond: bool = True,
    linesearch=_DEFAULT_LINESEARCH,
) -> GradientTransformation:
    """L-BFGS: ``chain(scale_by_lbfgs, scale(-1) | scale_by_learning_rate, linesearch)``, as
    optax; the default line search is ``scale_by_zoom_linesearch(max_linesearch_steps=20,
    initial_guess_strategy="one")`` (None: no line search). With the line search, ``update``
    takes ``value=``, ``grad=`` and ``value_fn=`` (see :mod:`fshard.optim.linesearch`);
    on sharded params every inner product is over every leaf and shard.

    Example:
        >>> import torch, fshard as fs
        >>> f = lambda p: ((p["w"] - 2.0) ** 2).sum()
        >>> tx, p = fs.optim.lbfgs(), {"w": torch.zeros(3, dtype=torch.float64)}
        >>> value, grad = fs.value_and_grad(f)(p)
        >>> u, s = tx.update(grad, tx.init(p), p, value=value, grad=grad, value_fn=f)
        >>> fs.optim.apply_updates(p, u)["w"]  # first step: along -g / ||g||, Wolfe at 1
        tensor([0.5774, 0.5774, 0.5774], dtype=torch.float64)
    """
    if linesearch is _DEFAULT_LINESEARCH:
        linesearch = scale_by_zoom_linesearch(20, initial_guess_strategy="one")
    if linesearch is None:
        linesearch = identity()
    scaling = scale(-1.0) if learning_rate is None else scale_by_learning_rate(check_schedule(learning_rate))  # fmt: skip
    return chain(scale_by_lbfgs(memory_size, scale_init_precond), scaling, linesearch)


def adan(
    learning_rate, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8, weight_decay=0.0, mask=None
) -> GradientTransformation:
    """Adan: ``chain(scale_by_adan, add_decayed_weights, scale_by_learning_rate)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.adan(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> u = tx.update({"w": torch.tensor([2.0])}, tx.init(p), p)[0]
        >>> round(u["w"].item(), 6)
        -0.1
    """
    return chain(
        scale_by_adan(b1, b2, b3, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(check_schedule(learning_rate)),
    )
