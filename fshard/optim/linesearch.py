"""Line searches: :func:`scale_by_zoom_linesearch` (optax's, the one :func:`lbfgs` uses) and
:func:`value_and_grad_from_state`.

A line search needs the objective: its ``update`` takes ``value=`` (the loss at ``params``),
``grad=`` (its gradient) and ``value_fn=`` (``params -> loss``, global-view code over sharded
params), as optax's ``GradientTransformationExtraArgs``; :func:`~fshard.optim.chain` passes
them through. Every quantity the search branches on is a scalar equal on every rank: values
are losses (replicated), slopes are inner products over every leaf and shard (one scalar
all_reduce per group of leaves sharded alike, :func:`fshard.optim.global_norm`'s way). So all
ranks take the same branches and evaluate ``value_fn`` the same number of times. The search
loop reads its "done" flag every iteration (eager Python control flow: a graph break under
``torch.compile``, where optax uses ``jax.lax.while_loop``).

Example:
    >>> import torch, fshard as fs
    >>> f = lambda p: ((p["w"] - 3.0) ** 2).sum()
    >>> tx = fs.optim.lbfgs()
    >>> p = {"w": torch.zeros(2, dtype=torch.float64)}
    >>> state = tx.init(p)
    >>> vg = fs.optim.value_and_grad_from_state(f)
    >>> for _ in range(3):
    ...     value, grad = vg(p, state=state)
    ...     u, state = tx.update(grad, state, p, value=value, grad=grad, value_fn=f)
    ...     p = fs.optim.apply_updates(p, u)
    >>> p["w"]
    tensor([3., 3.], dtype=torch.float64)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from .. import autodiff
from . import _tree
from ._tree import check_scalar
from .base import GradientTransformation

__all__ = [
    "ZoomLinesearchInfo",
    "ScaleByZoomLinesearchState",
    "scale_by_zoom_linesearch",
    "value_and_grad_from_state",
]


class ZoomLinesearchInfo(NamedTuple):
    """Diagnostics of the last line search: steps taken and the final errors.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_zoom_linesearch(10).init({"w": torch.zeros(1)}).info
        ZoomLinesearchInfo(num_linesearch_steps=tensor(0), decrease_error=tensor(inf), curvature_error=tensor(inf))
    """

    num_linesearch_steps: torch.Tensor
    decrease_error: torch.Tensor
    curvature_error: torch.Tensor


class ScaleByZoomLinesearchState(NamedTuple):
    """The accepted step size, the value and gradient at the new params (reused by
    :func:`value_and_grad_from_state`: no second evaluation) and the diagnostics.

    Example:
        >>> import torch, fshard as fs
        >>> s = fs.optim.scale_by_zoom_linesearch(10).init({"w": torch.zeros(1)})
        >>> s.learning_rate, s.value
        (tensor(1.), tensor(inf))
    """

    learning_rate: torch.Tensor
    value: torch.Tensor
    grad: Any
    info: ZoomLinesearchInfo


def _cubicmin(a, fa, fpa, b, fb, c, fc):
    """Minimizer of the cubic through ``(a, fa)`` with slope ``fpa``, ``(b, fb)``, ``(c, fc)``."""
    db, dc = b - a, c - a
    denom = (db * dc) ** 2 * (db - dc)
    x1, x2 = fb - fa - fpa * db, fc - fa - fpa * dc
    big_a = (dc**2 * x1 - db**2 * x2) / denom
    big_b = (-(dc**3) * x1 + db**3 * x2) / denom
    radical = big_b * big_b - 3.0 * big_a * fpa
    return a + (-big_b + torch.sqrt(radical)) / (3.0 * big_a)


def _quadmin(a, fa, fpa, b, fb):
    """Minimizer of the quadratic through ``(a, fa)`` with slope ``fpa`` and ``(b, fb)``."""
    db = b - a
    return a - fpa / (2.0 * ((fb - fa - fpa * db) / db**2))


def _where(flag, new: list, old: list) -> list:
    """Element by element ``new`` where ``flag`` else ``old``: scalars and gradient trees."""
    return [
        optree.tree_map(
            lambda n, o: _tree.rebuild(n, torch.where(flag, _tree.local(n), _tree.local(o))),
            n_,
            o_,
            is_leaf=_tree.is_leaf,
        )
        for n_, o_ in zip(new, old)
    ]


def _fn_kwargs(value_fn: Callable, extra: dict) -> dict:
    """The extra keyword arguments that ``value_fn`` takes; any other is an error."""
    names = set(inspect.signature(value_fn).parameters)
    unknown = sorted(set(extra) - names)
    if unknown:
        raise TypeError(
            f"scale_by_zoom_linesearch: update got keyword arguments {unknown} that value_fn "
            f"does not take (its parameters: {sorted(names)})"
        )
    return dict(extra)


class _Search:
    """One zoom line search (optax's ``zoom_linesearch``), its state as attributes."""

    def __init__(self, cfg: dict, params, updates, value, grad, value_fn, kwargs, guess):
        self.cfg, self.params, self.updates = cfg, params, updates
        self.fn, self.kwargs = autodiff.value_and_grad(value_fn), kwargs
        self.uleaves, self.spec = _tree.flatten(updates, "updates")
        dtype = _tree.promoted_dtype(_tree.flatten(params, "params")[0])
        self.dtype = dtype
        value = torch.as_tensor(value, dtype=dtype)
        slope = self.slope_of(grad)
        zero, inf = torch.zeros((), dtype=dtype), torch.full((), torch.inf, dtype=dtype)
        self.count = torch.zeros((), dtype=torch.int64)
        self.guess = guess.to(dtype)
        self.stepsize, self.value, self.grad, self.slope = zero, value, grad, slope
        self.value_init, self.slope_init = value, slope
        self.decrease_error = self.curvature_error = self.error = inf
        self.interval_found = self.done = self.failed = torch.zeros((), dtype=torch.bool)
        self.low, self.value_low, self.slope_low = zero, value, slope
        self.high, self.value_high, self.slope_high = zero, value, slope
        self.cubic_ref, self.value_cubic_ref = zero, value
        self.safe_stepsize, self.safe_value, self.safe_grad = zero, value, grad

    def slope_of(self, grad) -> torch.Tensor:
        gleaves = _tree.flatten_like(grad, self.spec, self.uleaves, "grad")
        return _tree.vdot(gleaves, self.uleaves).to(self.dtype)

    def on_line(self, stepsize):
        step = _tree.tree_map(
            lambda p, u: p + stepsize.to(p.dtype) * u, self.params, self.updates, names=["updates"]
        )
        value, grad = self.fn(step, **self.kwargs)
        value = torch.as_tensor(value).detach().to(self.dtype)
        return value, grad, self.slope_of(grad)

    def errors(self, stepsize, value, slope):
        c = self.cfg
        dec = value - self.value_init - c["slope_rtol"] * stepsize * self.slope_init
        if c["approx_dec_rtol"] is not None:
            approx = slope - (2 * c["slope_rtol"] - 1.0) * self.slope_init
            delta = value - self.value_init - c["approx_dec_rtol"] * torch.abs(self.value_init)
            dec = torch.minimum(torch.maximum(approx, delta), dec)
        dec = torch.clamp(dec, min=0.0)
        dec = torch.where(torch.isnan(dec), torch.inf, dec)
        curv = torch.clamp(torch.abs(slope) - c["curv_rtol"] * torch.abs(self.slope_init), min=0.0)
        curv = torch.where(torch.isnan(curv), torch.inf, curv)
        return dec, curv, torch.maximum(dec, curv)

    def search_interval(self):
        c = self.cfg
        first = self.count == 0
        new = torch.where(first, self.guess, c["increase_factor"] * self.stepsize)
        if c["max_stepsize"] is not None:
            max_reached = new >= c["max_stepsize"]
            new = torch.clamp(new, max=c["max_stepsize"])
        else:
            max_reached = torch.zeros((), dtype=torch.bool)
        value, grad, slope = self.on_line(new)
        dec, curv, err = self.errors(new, value, slope)
        self.safe_stepsize, self.safe_value, self.safe_grad = _where(
            dec <= c["tol"],
            [new, value, grad],
            [self.safe_stepsize, self.safe_value, self.safe_grad],
        )
        high_new = (dec > 0.0) | ((value >= self.value) & ~first)
        low_new = (slope >= 0.0) & ~high_new
        prev = [self.stepsize, self.value, self.slope]
        cur = [new, value, slope]
        (self.low, self.value_low, self.slope_low, self.high, self.value_high, self.slope_high) = (
            _where(low_new, cur + prev, prev + cur)
        )
        self.interval_found = high_new | low_new | (err <= c["tol"])
        self.done = (err <= c["tol"]) | (max_reached & ~self.interval_found)
        self.failed = (self.count + 1 >= c["max_steps"]) & ~self.done
        self.stepsize, self.value, self.grad, self.slope = new, value, grad, slope
        self.decrease_error, self.curvature_error, self.error = dec, curv, err
        self.cubic_ref, self.value_cubic_ref = self.low, self.value_low
        self.count = self.count + 1

    def zoom(self):
        c = self.cfg
        low, high = self.low, self.high
        delta = torch.abs(high - low)
        left, right = torch.minimum(high, low), torch.maximum(high, low)
        cubic = _cubicmin(low, self.value_low, self.slope_low, high, self.value_high, self.cubic_ref, self.value_cubic_ref)  # fmt: skip
        use_cubic = (cubic > left + 0.2 * delta) & (cubic < right - 0.2 * delta)
        quad = _quadmin(low, self.value_low, self.slope_low, high, self.value_high)
        use_quad = ~use_cubic & (quad > left + 0.1 * delta) & (quad < right - 0.1 * delta)
        middle = torch.where(use_cubic, cubic, self.cubic_ref)
        middle = torch.where(use_quad, quad, middle)
        middle = torch.where(~use_cubic & ~use_quad, (low + high) / 2.0, middle)
        value, grad, slope = self.on_line(middle)
        dec, curv, err = self.errors(middle, value, slope)
        better = (dec <= c["tol"]) & (value < self.safe_value)
        self.safe_stepsize, self.safe_value, self.safe_grad = _where(
            better, [middle, value, grad], [self.safe_stepsize, self.safe_value, self.safe_grad]
        )
        self.done = err <= c["tol"]
        high_mid = (dec > 0.0) | (value >= self.value_low)
        high_low = (slope * (high - low) >= 0.0) & ~high_mid
        lo, hi, mid = (
            [low, self.value_low, self.slope_low],
            [high, self.value_high, self.slope_high],
            [middle, value, slope],
        )
        new_high = _where(high_low, lo, _where(high_mid, mid, hi))
        new_low = _where(~high_mid, mid, lo)
        self.cubic_ref, self.value_cubic_ref = _where(
            high_mid | high_low, [high, self.value_high], [low, self.value_low]
        )
        self.high, self.value_high, self.slope_high = new_high
        self.low, self.value_low, self.slope_low = new_low
        too_small = delta <= c["interval_threshold"]
        maybe_failed = (self.count + 1 >= c["max_steps"]) | (too_small & (self.safe_stepsize > 0.0))
        self.failed = maybe_failed & ~self.done
        self.stepsize, self.value, self.grad, self.slope = middle, value, grad, slope
        self.decrease_error, self.curvature_error, self.error = dec, curv, err
        self.count = self.count + 1

    def try_safe_step(self):
        use_safe = (self.safe_stepsize > 0.0) | torch.isinf(self.decrease_error)
        self.stepsize, self.value, self.grad = _where(
            use_safe,
            [self.safe_stepsize, self.safe_value, self.safe_grad],
            [self.stepsize, self.value, self.grad],
        )

    def run(self):
        while not bool(self.done | self.failed):  # a rank-uniform scalar: every rank agrees
            if bool(self.interval_found):
                self.zoom()
            else:
                self.search_interval()
            if bool(self.failed):
                self.try_safe_step()
        return self


def scale_by_zoom_linesearch(
    max_linesearch_steps: int,
    max_learning_rate=None,
    tol=0.0,
    increase_factor=2.0,
    slope_rtol=1e-4,
    curv_rtol=0.9,
    approx_dec_rtol=1e-6,
    stepsize_precision=1e-5,
    initial_guess_strategy: str = "keep",
) -> GradientTransformation:
    """Scales the updates by a step size satisfying the strong Wolfe conditions, found by
    optax's zoom line search (Nocedal & Wright, algorithms 3.5 and 3.6, with cubic and
    quadratic interpolation and optax's approximate-decrease test); formula for formula as
    ``optax.scale_by_zoom_linesearch``.

    ``update(updates, state, params, *, value, grad, value_fn, **fn_kwargs)``: ``value`` and
    ``grad`` are the loss and its gradient at ``params``, ``value_fn(params, **fn_kwargs)``
    the loss (global-view code: it may take sharded params). Each trial evaluates it once
    with :func:`fshard.value_and_grad` and one slope (an inner product over every leaf and
    shard). The state keeps the value and gradient at the accepted step, which
    :func:`value_and_grad_from_state` returns on the next step instead of evaluating again.

    Args:
        max_linesearch_steps: trials per search (>= 1).
        max_learning_rate: cap on the step size (None: no cap).
        tol: tolerance on the Wolfe conditions.
        increase_factor: growth of the step size while bracketing.
        slope_rtol: sufficient-decrease constant (``c1``).
        curv_rtol: curvature constant (``c2``).
        approx_dec_rtol: relative tolerance of the approximate decrease (None: off).
        stepsize_precision: the bracket width below which the search gives up.
        initial_guess_strategy: ``"keep"`` (the last accepted step size) or ``"one"``.

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScaleByZoomLinesearchState`).

    Example:
        >>> import torch, fshard as fs
        >>> f = lambda p: ((p["w"] - 1.0) ** 2).sum()
        >>> tx = fs.optim.chain(fs.optim.scale(-1.0), fs.optim.scale_by_zoom_linesearch(10))
        >>> p = {"w": torch.zeros(1, dtype=torch.float64)}
        >>> value, grad = fs.value_and_grad(f)(p)
        >>> u, s = tx.update(grad, tx.init(p), p, value=value, grad=grad, value_fn=f)
        >>> u["w"], s[1].learning_rate  # the exact minimizer along -grad
        (tensor([1.], dtype=torch.float64), tensor(0.5000, dtype=torch.float64))
    """
    if isinstance(max_linesearch_steps, bool) or not isinstance(max_linesearch_steps, int):
        raise TypeError(f"max_linesearch_steps must be an int, got {max_linesearch_steps!r}")
    if max_linesearch_steps < 1:
        raise ValueError(f"max_linesearch_steps must be >= 1, got {max_linesearch_steps}")
    if initial_guess_strategy not in ("keep", "one"):
        raise ValueError(
            f"initial_guess_strategy must be 'keep' or 'one', got {initial_guess_strategy!r}"
        )
    cfg = {
        "max_steps": max_linesearch_steps,
        "max_stepsize": None
        if max_learning_rate is None
        else check_scalar(max_learning_rate, "max_learning_rate", 0.0),  # fmt: skip
        "tol": check_scalar(tol, "tol", 0.0),
        "increase_factor": check_scalar(increase_factor, "increase_factor", 1.0),
        "slope_rtol": check_scalar(slope_rtol, "slope_rtol", 0.0),
        "curv_rtol": check_scalar(curv_rtol, "curv_rtol", 0.0),
        "approx_dec_rtol": None
        if approx_dec_rtol is None
        else check_scalar(approx_dec_rtol, "approx_dec_rtol", 0.0),  # fmt: skip
        "interval_threshold": check_scalar(stepsize_precision, "stepsize_precision", 0.0),
    }

    def init(params):
        dtype = _tree.promoted_dtype(_tree.flatten(params, "params")[0])
        inf = torch.full((), torch.inf)
        return ScaleByZoomLinesearchState(
            torch.ones((), dtype=dtype),
            torch.full((), torch.inf, dtype=dtype),
            _tree.zeros_like(params),
            ZoomLinesearchInfo(torch.zeros((), dtype=torch.int64), inf, inf),
        )

    def update(updates, state, params=None, *, value, grad, value_fn, **extra_args):
        _tree.needs_params(params, "scale_by_zoom_linesearch")
        kwargs = _fn_kwargs(value_fn, extra_args)
        guess = state.learning_rate if initial_guess_strategy == "keep" else torch.ones(())
        s = _Search(cfg, params, updates, value, grad, value_fn, kwargs, guess).run()
        lr = s.stepsize
        out = _tree.tree_map(lambda u: u * lr.to(u.dtype), updates)
        info = ZoomLinesearchInfo(s.count, s.decrease_error, s.curvature_error)
        return out, ScaleByZoomLinesearchState(lr, s.value, s.grad, info)

    return GradientTransformation(init, update)


def _find_value_and_grad(state):
    """The first node of ``state`` with ``value`` and ``grad`` fields (optax ``tree.get``)."""
    if isinstance(state, ScaleByZoomLinesearchState):
        return state
    if isinstance(state, (tuple, list)):
        for s in state:
            found = _find_value_and_grad(s)
            if found is not None:
                return found
    if isinstance(state, dict):
        for s in state.values():
            found = _find_value_and_grad(s)
            if found is not None:
                return found
    return None


def value_and_grad_from_state(value_fn: Callable) -> Callable:
    """``value_and_grad`` of ``value_fn`` that reuses the value and gradient a line search
    left in the optimizer state (computed at the params it accepted), as optax: call it as
    ``f(params, *args, state=opt_state, **kwargs)``. Evaluates ``value_fn`` (with
    :func:`fshard.value_and_grad`) only when the stored value is not finite (the first step).

    Example:
        >>> import torch, fshard as fs
        >>> f = lambda p: (p["w"] ** 2).sum()
        >>> tx = fs.optim.lbfgs()
        >>> p = {"w": torch.ones(2)}
        >>> fs.optim.value_and_grad_from_state(f)(p, state=tx.init(p))
        (tensor(2.), {'w': tensor([2., 2.])})
    """
    vg = autodiff.value_and_grad(value_fn)

    def value_and_grad(params, *fn_args, state, **fn_kwargs):
        found = _find_value_and_grad(state)
        if found is None:
            raise ValueError(
                "value_and_grad_from_state: no value and grad in the state; use it with an "
                "optimizer that stores them (scale_by_zoom_linesearch, lbfgs)"
            )
        if bool(torch.isfinite(found.value)):
            return found.value, found.grad
        value, grad = vg(params, *fn_args, **fn_kwargs)
        return value, grad

    return value_and_grad
