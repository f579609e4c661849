"""Schedules: functions of the step count (0 for the first update), as optax.

A schedule called with a Python int (and float parameters) returns a Python float, so it also
works as a ``torch.optim.lr_scheduler.LambdaLR`` factor. Called with a tensor count (as the
transformations do: their counters are 0-d int64 tensors), or built with tensor parameters
(e.g. a differentiable ``init_value``), it returns a 0-d tensor computed with torch ops only,
so it traces under ``torch.compile`` and batches under ``torch.func.vmap``.

Example:
    >>> import fshard as fs
    >>> lr = fs.optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
    >>> lr(5), lr(10), lr(60)
    (0.5, 1.0, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._tree import check_scalar
from .base import Schedule

__all__ = [
    "constant_schedule",
    "polynomial_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "exponential_decay",
    "warmup_exponential_decay_schedule",
    "piecewise_constant_schedule",
    "piecewise_constant",
    "join_schedules",
]


def _f(count):
    """Tensor counts in float64 (exact integers, full-precision schedule math)."""
    return count.to(torch.float64) if isinstance(count, torch.Tensor) else count


def _clip(x, lo, hi):
    if isinstance(x, torch.Tensor):
        return torch.clamp(x, lo, hi)
    return min(max(x, lo), hi)


def _cos(x):
    return torch.cos(x) if isinstance(x, torch.Tensor) else math.cos(x)


def _where(cond, a, b):
    if isinstance(cond, torch.Tensor):
        a = a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.float64)
        b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=torch.float64)
        return torch.where(cond, a, b)
    return a if cond else b


def _check_steps(n, name: str, positive: bool = False) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < (1 if positive else 0):
        raise ValueError(f"{name} must be an int >= {1 if positive else 0}, got {n!r}")
    return n


def constant_schedule(value) -> Schedule:
    """A schedule that always returns ``value``.

    Example:
        >>> import fshard as fs
        >>> fs.optim.constant_schedule(0.1)(100)
        0.1
    """
    value = check_scalar(value, "value")
    return lambda count: value


def polynomial_schedule(
    init_value, end_value, power, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """``(init - end) * (1 - frac) ** power + end`` with ``frac`` the fraction of
    ``transition_steps`` done after ``transition_begin`` (clipped to [0, 1]), as optax.

    Args:
        init_value: the first value (a float or 0-d tensor).
        end_value: the last value (a float or 0-d tensor).
        power: the polynomial's exponent (a float or 0-d tensor).
        transition_steps: steps from init to end (> 0).
        transition_begin: steps at ``init_value`` first.

    Example:
        >>> import fshard as fs
        >>> fs.optim.polynomial_schedule(1.0, 0.0, 2, 10)(5)
        0.25
    """
    init_value = check_scalar(init_value, "init_value")
    end_value = check_scalar(end_value, "end_value")
    power = check_scalar(power, "power")
    _check_steps(transition_steps, "transition_steps", positive=True)
    _check_steps(transition_begin, "transition_begin")

    def schedule(count):
        frac = 1 - _clip(_f(count) - transition_begin, 0, transition_steps) / transition_steps
        return (init_value - end_value) * frac**power + end_value

    return schedule


def linear_schedule(init_value, end_value, transition_steps: int, transition_begin: int = 0):
    """Linear interpolation from ``init_value`` to ``end_value`` over ``transition_steps``
    steps starting at ``transition_begin`` (constant before and after): a linear warmup when
    ``init_value < end_value``.

    Example:
        >>> import fshard as fs
        >>> fs.optim.linear_schedule(0.0, 1e-3, 100)(50)
        0.0005
    """
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(init_value, decay_steps: int, alpha=0.0, exponent=1.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``:
    ``init * ((1 - alpha) * (0.5 * (1 + cos(pi * min(t, T) / T))) ** exponent + alpha)``.

    Example:
        >>> import fshard as fs
        >>> fs.optim.cosine_decay_schedule(1.0, 100)(50)
        0.5
    """
    init_value = check_scalar(init_value, "init_value")
    _check_steps(decay_steps, "decay_steps", positive=True)
    alpha = check_scalar(alpha, "alpha", 0.0, 1.0)
    exponent = check_scalar(exponent, "exponent")

    def schedule(count):
        frac = _clip(_f(count), 0, decay_steps) / decay_steps
        cos = 0.5 * (1.0 + _cos(math.pi * frac))
        return init_value * ((1.0 - alpha) * cos**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i-1]`` on, called with the steps since its boundary.

    Args:
        schedules: ``n`` schedules.
        boundaries: ``n - 1`` increasing step numbers.

    Example:
        >>> import fshard as fs
        >>> s = fs.optim.join_schedules(
        ...     [fs.optim.constant_schedule(1.0), fs.optim.linear_schedule(1.0, 0.0, 10)], [5])
        >>> [s(i) for i in (0, 4, 5, 10, 20)]
        [1.0, 1.0, 1.0, 0.5, 0.0]
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules: need n schedules and n - 1 boundaries, got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries"
        )
    for b in boundaries:
        _check_steps(b, "boundaries[i]")
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"join_schedules: schedules[{i}] is not callable: {s!r}")

    def schedule(count):
        out = schedules[0](count)
        for b, s in zip(boundaries, schedules[1:]):
            out = _where(count < b, out, s(count - b))
        return out

    return schedule


def warmup_cosine_decay_schedule(
    init_value, peak_value, warmup_steps: int, decay_steps: int, end_value=0.0, exponent=1.0
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at step ``decay_steps`` (total, warmup included), as optax.

    Example:
        >>> import fshard as fs
        >>> lr = fs.optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 200)
        >>> lr(10)
        0.001
    """
    _check_steps(warmup_steps, "warmup_steps")
    _check_steps(decay_steps, "decay_steps")
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps}): it counts "
            "the warmup too"
        )
    peak_value = check_scalar(peak_value, "peak_value")
    end_value = check_scalar(end_value, "end_value")
    alpha = 0.0 if _is_zero(peak_value) else end_value / peak_value
    cos_part = cosine_decay_schedule(1.0, decay_steps - warmup_steps, 0.0, exponent)

    def decay(count):
        return peak_value * ((1.0 - alpha) * cos_part(count) + alpha)

    return _after_linear_warmup(init_value, peak_value, warmup_steps, decay)


def _after_linear_warmup(init_value, peak_value, warmup_steps: int, then: Schedule) -> Schedule:
    """A linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps`` (none when
    0), then ``then``, counted from the end of the warmup."""
    if warmup_steps == 0:
        return then
    warm = linear_schedule(init_value, peak_value, warmup_steps)
    return join_schedules([warm, then], [warmup_steps])


def _is_zero(x) -> bool:
    return not isinstance(x, torch.Tensor) and x == 0.0


def exponential_decay(
    init_value,
    transition_steps: int,
    decay_rate,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value=None,
) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)`` (the
    exponent floored with ``staircase``), ``init_value`` before ``transition_begin``, bounded
    by ``end_value`` (a floor when decaying, a ceiling when ``decay_rate > 1``), as optax.

    Example:
        >>> import fshard as fs
        >>> s = fs.optim.exponential_decay(1.0, transition_steps=10, decay_rate=0.5)
        >>> s(0), s(10), s(20)
        (1.0, 0.5, 0.25)
    """
    init_value = check_scalar(init_value, "init_value")
    _check_steps(transition_steps, "transition_steps", positive=True)
    decay_rate = check_scalar(decay_rate, "decay_rate", lo=0.0)
    _check_steps(transition_begin, "transition_begin")
    if not isinstance(staircase, bool):
        raise TypeError(f"staircase must be a bool, got {staircase!r}")
    if end_value is not None:
        end_value = check_scalar(end_value, "end_value")
        if isinstance(decay_rate, torch.Tensor):
            raise TypeError(
                "exponential_decay: with end_value, decay_rate must be a float (its side of 1 "
                "decides whether end_value is a floor or a ceiling)"
            )

    def schedule(count):
        n = _f(count) - transition_begin
        p = n / transition_steps
        if staircase:
            p = torch.floor(p) if isinstance(p, torch.Tensor) else math.floor(p)
        value = _where(n <= 0, init_value, init_value * decay_rate**p)
        if end_value is not None:
            if isinstance(value, torch.Tensor) or isinstance(end_value, torch.Tensor):
                value, end = torch.as_tensor(value), torch.as_tensor(end_value)
                value = torch.maximum(value, end) if decay_rate < 1 else torch.minimum(value, end)
            else:
                value = max(value, end_value) if decay_rate < 1 else min(value, end_value)
        return value

    return schedule


def warmup_exponential_decay_schedule(
    init_value,
    peak_value,
    warmup_steps: int,
    transition_steps: int,
    decay_rate,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value=None,
) -> Schedule:
    """Linear warmup to ``peak_value`` over ``warmup_steps``, then :func:`exponential_decay`
    from ``peak_value``, as optax.

    Example:
        >>> import fshard as fs
        >>> s = fs.optim.warmup_exponential_decay_schedule(0.0, 1.0, 4, 10, 0.5)
        >>> s(2), s(4), s(14)
        (0.5, 1.0, 0.5)
    """
    _check_steps(warmup_steps, "warmup_steps")
    decay = exponential_decay(
        peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value
    )
    return _after_linear_warmup(init_value, peak_value, warmup_steps, decay)


def piecewise_constant_schedule(init_value, boundaries_and_scales: dict | None = None):
    """``init_value`` times every scale whose boundary the count has reached, as optax.

    Args:
        init_value: float or 0-d tensor.
        boundaries_and_scales: ``{step: scale}``, scales >= 0.

    Example:
        >>> import fshard as fs
        >>> s = fs.optim.piecewise_constant_schedule(1.0, {10: 0.1, 20: 0.5})
        >>> s(9), s(10), s(25)
        (1.0, 0.1, 0.05)
    """
    init_value = check_scalar(init_value, "init_value")
    items = sorted((boundaries_and_scales or {}).items())
    for b, s in items:
        _check_steps(b, "boundary")
        check_scalar(s, f"scale at {b}", lo=0.0)

    def schedule(count):
        v = init_value
        for b, s in items:
            v = _where(count < b, v, v * s)
        return v

    return schedule


#: optax's short name.
piecewise_constant = piecewise_constant_schedule
