"""optax.contrib's learning-rate-free and schedule-free optimizers: :func:`schedule_free`
(:func:`schedule_free_adamw`, :func:`schedule_free_sgd`, :func:`schedule_free_eval_params`)
and :func:`prodigy`, formula for formula as optax 0.2.8.

Schedule-free keeps ``z`` (the base optimizer's iterate, with the params' layouts) and returns
params that interpolate between ``z`` and the running average ``x``: element-wise, no
communication. Prodigy's step-size estimate needs two global scalars per step (an inner
product and an L1 norm over every leaf and shard): two small all_reduces per group of leaves
sharded alike.

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.schedule_free_adamw(1e-2)
    >>> p = {"w": torch.ones(2)}
    >>> s = tx.init(p)
    >>> u, s = tx.update({"w": torch.ones(2)}, s, p)
    >>> p = fs.optim.apply_updates(p, u)
    >>> fs.optim.schedule_free_eval_params(s, p)["w"]  # the averaged iterate x, for evaluation
    tensor([0.9900, 0.9900])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _tree
from ._tree import check_bool, check_scalar, check_schedule
from .alias import sgd
from .base import GradientTransformation
from .combine import _takes_extra_args, chain
from .schedule import warmup_constant_schedule
from .transform import add_decayed_weights, scale_by_learning_rate, scale_by_rms

__all__ = [
    "ScheduleFreeState",
    "ProdigyState",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "schedule_free_eval_params",
    "prodigy",
]


class ScheduleFreeState(NamedTuple):
    """State of :func:`schedule_free` (optax's fields): ``b1``, the sum of the averaging
    weights, the step count (from 1), the largest learning rate so far, the base optimizer's
    state and ``z`` (the params' layouts).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.schedule_free_sgd(0.1).init({"w": torch.zeros(1)}).z
        {'w': tensor([0.])}
    """

    b1: torch.Tensor
    weight_sum: torch.Tensor
    step_count: torch.Tensor
    max_lr: torch.Tensor
    base_optimizer_state: Any
    z: Any


class ProdigyState(NamedTuple):
    """State of :func:`prodigy` (optax's fields): moments, the weighted gradient sum, the
    initial params, the step-size estimate ``d``, the weighted numerator and the step count.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.prodigy().init({"w": torch.zeros(1)}).estim_lr
        tensor(1.0000e-06)
    """

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    params0: Any
    estim_lr: torch.Tensor
    numerator_weighted: torch.Tensor
    count: torch.Tensor


def _lowest_dtype(params) -> torch.dtype:
    """optax ``tree.dtype(params, "lowest")``: the narrowest floating dtype of the leaves."""
    dtypes = [_tree.local(x).dtype for x in _tree.flatten(params, "params")[0]]
    return min(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else torch.float32


def schedule_free(base_optimizer: GradientTransformation, learning_rate, b1=0.9, weight_lr_power=2.0) -> GradientTransformation:  # fmt: skip
    """Schedule-free wrapper (Defazio et al. 2024), as ``optax.contrib.schedule_free``: the base
    optimizer steps ``z``; the returned params are ``y = b1 * x + (1 - b1) * z`` where ``x``
    is the average of the ``z`` iterates weighted by ``max_lr**weight_lr_power``. Evaluate the
    model at ``x``: :func:`schedule_free_eval_params`.

    Args:
        base_optimizer: the optimizer of ``z`` (its ``update`` sees the params ``y``).
        learning_rate: the base optimizer's learning rate (float or schedule), for the weights.
        b1: interpolation between ``x`` and ``z``.
        weight_lr_power: exponent of the learning rate in the averaging weights.

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScheduleFreeState`); ``update``
        needs ``params``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.schedule_free(fs.optim.sgd(0.1), 0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> tx.update({"w": torch.ones(1)}, tx.init(p), p)[0]
        {'w': tensor([-0.1000])}
    """
    if not isinstance(base_optimizer, GradientTransformation):
        raise TypeError(
            f"schedule_free: base_optimizer must be a GradientTransformation, got "
            f"{type(base_optimizer).__name__}"
        )
    learning_rate = check_schedule(learning_rate)
    b1 = check_scalar(b1, "b1", 0.0, 1.0)
    weight_lr_power = check_scalar(weight_lr_power, "weight_lr_power")
    extra = _takes_extra_args(base_optimizer.update)

    def init(params):
        dtype = _lowest_dtype(params)
        z = _tree.tree_map(torch.clone, params)
        return ScheduleFreeState(
            torch.as_tensor(b1, dtype=dtype),
            torch.zeros((), dtype=dtype),
            torch.ones((), dtype=torch.int64),
            torch.zeros((), dtype=dtype),
            base_optimizer.init(params),
            z,
        )

    def update(updates, state, params=None, **extra_args):
        _tree.needs_params(params, "schedule_free")
        lr = learning_rate(state.step_count) if callable(learning_rate) else learning_rate
        max_lr = torch.maximum(state.max_lr, torch.as_tensor(lr, dtype=state.max_lr.dtype))
        weight = max_lr**weight_lr_power
        total = state.weight_sum + weight
        ck = torch.where(
            torch.isnan(weight) | torch.isnan(total),
            torch.nan,
            torch.nan_to_num(weight / total, nan=0.0, posinf=torch.inf),
        )
        args = extra_args if extra else {}
        base_updates, base_state = base_optimizer.update(
            updates, state.base_optimizer_state, params, **args
        )

        def leaf(y, z, u):
            c = ck.to(y.dtype)
            new_z = (z + u).to(z.dtype)
            x = torch.lerp((y - (1.0 - b1) * z) / b1, new_z, c)
            return (b1 * x + (1.0 - b1) * new_z) - y, new_z

        out, z = _tree.tree_map(
            leaf, params, state.z, base_updates, names=["state.z", "updates"], n_out=2
        )
        new = ScheduleFreeState(state.b1, total, state.step_count + 1, max_lr, base_state, z)
        return out, new

    return GradientTransformation(init, update)


def schedule_free_eval_params(state, params):
    """The params to evaluate a schedule-free model at: ``x = (y - (1 - b1) * z) / b1``, as
    optax.

    Args:
        state: a :class:`ScheduleFreeState` (the state of :func:`schedule_free` or its
            aliases).
        params: the current (training) params ``y``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.schedule_free_sgd(0.1)
        >>> p = {"w": torch.ones(1)}
        >>> fs.optim.schedule_free_eval_params(tx.init(p), p)
        {'w': tensor([1.])}
    """
    if not isinstance(state, ScheduleFreeState):
        raise ValueError(
            f"schedule_free_eval_params requires a ScheduleFreeState, got {type(state).__name__}"
        )
    b1 = state.b1
    return _tree.tree_map(
        lambda y, z: (y - (1.0 - b1.to(y.dtype)) * z) / b1.to(y.dtype),
        params,
        state.z,
        names=["state.z"],
    )


def _warmup(learning_rate, warmup_steps):
    if warmup_steps is None:
        return learning_rate
    return warmup_constant_schedule(0.0, learning_rate, warmup_steps)


def schedule_free_sgd(
    learning_rate=1.0, warmup_steps=None, b1=0.9, weight_decay=None, weight_lr_power=2.0
) -> GradientTransformation:
    """Schedule-free SGD, as ``optax.contrib.schedule_free_sgd``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.schedule_free_sgd(0.1, warmup_steps=10)
    """
    learning_rate = _warmup(learning_rate, warmup_steps)
    opt = sgd(learning_rate)
    if weight_decay is not None:
        opt = chain(add_decayed_weights(weight_decay), opt)
    return schedule_free(opt, learning_rate, b1, weight_lr_power)


def schedule_free_adamw(
    learning_rate=0.0025,
    warmup_steps=None,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    weight_decay=0.0,
    weight_lr_power=2.0,
) -> GradientTransformation:
    """Schedule-free AdamW, as ``optax.contrib.schedule_free_adamw``: :func:`schedule_free`
    of ``chain(scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True),
    add_decayed_weights, scale_by_learning_rate)`` (no first moment: ``b1`` interpolates).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.schedule_free_adamw(1e-3, warmup_steps=100, weight_decay=1e-4)
    """
    learning_rate = _warmup(learning_rate, warmup_steps)
    opt = chain(
        scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )
    return schedule_free(opt, learning_rate, b1, weight_lr_power)


def prodigy(
    learning_rate=1.0,
    betas=(0.9, 0.999),
    beta3=None,
    eps=1e-8,
    estim_lr0=1e-6,
    estim_lr_coef=1.0,
    weight_decay=0.0,
    safeguard_warmup: bool = False,
) -> GradientTransformation:
    """Prodigy (Mishchenko & Defazio 2023), as ``optax.contrib.prodigy``: Adam whose step size
    ``d`` is estimated from ``<g, p0 - p>`` and the L1 norm of the weighted gradient sum. Both
    are over every leaf and shard (two scalar all_reduces per group of leaves sharded alike
    per step), so every rank keeps the same ``d``; the moments keep the params' layouts.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.prodigy()
        >>> p = {"w": torch.ones(2)}
        >>> u, s = tx.update({"w": torch.ones(2)}, tx.init(p), p)
        >>> s.estim_lr  # d starts at estim_lr0; it grows once params move
        tensor(1.0000e-06)
    """
    learning_rate = check_schedule(learning_rate)
    beta1, beta2 = (check_scalar(b, n, 0.0, 1.0) for b, n in zip(betas, ("betas[0]", "betas[1]")))
    beta3 = beta2**0.5 if beta3 is None else check_scalar(beta3, "beta3", 0.0, 1.0)
    eps = check_scalar(eps, "eps", 0.0)
    estim_lr0 = check_scalar(estim_lr0, "estim_lr0", 0.0)
    estim_lr_coef = check_scalar(estim_lr_coef, "estim_lr_coef", 0.0)
    weight_decay = check_scalar(weight_decay, "weight_decay", 0.0)
    check_bool(safeguard_warmup, "safeguard_warmup")

    def init(params):
        dtype = _lowest_dtype(params)
        z = _tree.zeros_like
        return ProdigyState(
            z(params),
            z(params),
            z(params),
            params,
            torch.as_tensor(estim_lr0, dtype=dtype),
            torch.zeros((), dtype=dtype),
            _tree.count0(),
        )

    def update(updates, state, params=None, **extra_args):
        _tree.needs_params(params, "prodigy")
        count = state.count + 1
        sched = learning_rate(state.count) if callable(learning_rate) else learning_rate
        d = state.estim_lr
        t = _tree.as_float(count)
        bc = torch.sqrt(1 - beta2**t) / (1 - beta1**t)
        dlr = (d * sched * bc).to(d.dtype)
        leaves, spec = _tree.flatten(updates, "updates")
        like = lambda tree, name: _tree.flatten_like(tree, spec, leaves, name)  # noqa: E731
        p, p0 = like(params, "params"), like(state.params0, "state.params0")
        diff = [_tree.rebuild(a, _tree.local(a) - _tree.local(b)) for a, b in zip(p0, p)]
        numerator_acum = _tree.vdot(leaves, diff)
        ea, eas, gs = (like(x, n) for x, n in ((state.exp_avg, "state.exp_avg"), (state.exp_avg_sq, "state.exp_avg_sq"), (state.grad_sum, "state.grad_sum")))  # fmt: skip
        scale_sum = d / estim_lr0 if safeguard_warmup else dlr / estim_lr0
        new_ea, new_eas, new_gs = [], [], []
        for g, m, v, s in zip(leaves, ea, eas, gs):
            dg = d.to(_tree.local(g).dtype) * _tree.local(g)
            new_ea.append(_tree.rebuild(g, beta1 * _tree.local(m) + (1 - beta1) * dg))
            new_eas.append(_tree.rebuild(g, beta2 * _tree.local(v) + (1 - beta2) * dg * dg))
            new_gs.append(_tree.rebuild(g, beta3 * _tree.local(s) + scale_sum.to(dg.dtype) * dg))
        numerator = beta3 * state.numerator_weighted + (d / estim_lr0) * dlr * numerator_acum
        numerator = numerator.to(d.dtype)
        l1 = _tree.per_leaf_sums(new_gs, lambda x: x.abs().sum())
        denominator = torch.stack([x.to(d.dtype) for x in l1]).sum()
        new_d = torch.maximum(d, estim_lr_coef * numerator / denominator)
        out = []
        for m, v, w in zip(new_ea, new_eas, p):
            mm, vv, ww = _tree.local(m), _tree.local(v), _tree.local(w)
            c = dlr.to(mm.dtype)
            upd = -weight_decay * c * ww - c * mm / (torch.sqrt(vv) + new_d.to(mm.dtype) * eps)
            out.append(_tree.rebuild(m, upd))
        unflat = spec.unflatten
        new = ProdigyState(
            unflat(new_ea), unflat(new_eas), unflat(new_gs), state.params0, new_d, numerator, count
        )
        return unflat(out), new

    return GradientTransformation(init, update)
