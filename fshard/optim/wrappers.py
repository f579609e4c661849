"""Wrappers around a whole optimizer: :class:`MultiSteps` (gradient accumulation),
:func:`apply_if_finite` (skip non-finite steps, for mixed precision) and
:func:`inject_hyperparams` (hyperparameters in the state), as optax.

Their decisions ("emit this step?", "are the grads finite?") are 0-d bool tensors. In eager
mode they are read once to skip the work not needed; under ``torch.compile`` or ``vmap`` both
branches are computed and selected with ``torch.where``, as optax does under ``jit``.

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.MultiSteps(fs.optim.sgd(1.0), every_k_schedule=2)
    >>> p = {"w": torch.zeros(1)}
    >>> s = tx.init(p)
    >>> u, s = tx.update({"w": torch.tensor([1.0])}, s, p)
    >>> u["w"]
    tensor([0.])
    >>> u, s = tx.update({"w": torch.tensor([3.0])}, s, p)
    >>> u["w"]
    tensor([-2.])
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable

import optree
import torch

from .._function import untracked
from . import _tree
from .base import (
    ApplyIfFiniteState,
    GradientTransformation,
    InjectHyperparamsState,
    MultiStepsState,
)

__all__ = ["MultiSteps", "apply_if_finite", "inject_hyperparams"]


def _known(flag: torch.Tensor) -> bool | None:
    """The value of a 0-d bool tensor when reading it costs no graph break or batching error
    (eager, untransformed), else None."""
    if torch.compiler.is_compiling() or untracked(flag) is not flag:
        return None
    return bool(flag)


def _select(flag: torch.Tensor, new, old):
    """``new`` where ``flag`` else ``old``, leaf by leaf over two trees of one structure
    (states included: ShardedArrays flatten to their local tensors)."""
    return optree.tree_map(
        lambda n, o: torch.where(flag, n, o) if isinstance(n, torch.Tensor) else n, new, old
    )


class MultiSteps:
    """Gradient accumulation (optax ``MultiSteps``): the inner optimizer steps once every ``k``
    calls with the mean (or sum) of the ``k`` gradients; in between the updates are zeros.

    Args:
        opt: the inner :class:`GradientTransformation`.
        every_k_schedule: ``k``, an int or a schedule of the number of inner steps taken.
        use_grad_mean: average (default) or sum the accumulated gradients.

    The accumulator has the params' dtypes (optax: float32). Use :meth:`gradient_transformation`
    to pass it where a :class:`GradientTransformation` is expected.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.MultiSteps(fs.optim.adam(1e-3), 4).gradient_transformation()
    """

    def __init__(self, opt: GradientTransformation, every_k_schedule, use_grad_mean=True):
        if not isinstance(opt, GradientTransformation):
            raise TypeError(
                f"MultiSteps: opt must be a GradientTransformation, got {type(opt).__name__}"
            )
        if isinstance(every_k_schedule, int) and not isinstance(every_k_schedule, bool):
            if every_k_schedule < 1:
                raise ValueError(f"every_k_schedule must be >= 1, got {every_k_schedule}")
            k = every_k_schedule
            every_k_schedule = lambda step: k  # noqa: E731
        elif not callable(every_k_schedule):
            raise TypeError(
                f"every_k_schedule must be an int or a schedule, got {every_k_schedule!r}"
            )
        self._opt = opt
        self._every_k = every_k_schedule
        self._use_grad_mean = _tree.check_bool(use_grad_mean, "use_grad_mean")

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def init(self, params) -> MultiStepsState:
        return MultiStepsState(
            _tree.count0(), _tree.count0(), self._opt.init(params), _tree.zeros_like(params)
        )

    def update(self, updates, state: MultiStepsState, params=None):
        k = self._every_k(state.gradient_step)
        n = state.mini_step
        if self._use_grad_mean:
            acc = _tree.tree_map(
                lambda g, a: a + (g - a) / (n + 1), updates, state.acc_grads, names=["acc_grads"]
            )
        else:
            acc = _tree.tree_map(lambda g, a: a + g, updates, state.acc_grads, names=["acc_grads"])
        emit = n == k - 1
        known = _known(emit)
        mini_step = (n + 1) % k
        gradient_step = state.gradient_step + emit.to(state.gradient_step.dtype)
        if known is False:
            zeros = _tree.tree_map(torch.zeros_like, updates)
            new = MultiStepsState(mini_step, gradient_step, state.inner_opt_state, acc)
            return zeros, new
        final, inner = self._opt.update(acc, state.inner_opt_state, params)
        if known:
            new = MultiStepsState(
                mini_step, gradient_step, inner, _tree.tree_map(torch.zeros_like, acc)
            )
            return final, new
        final = _tree.tree_map(lambda u: torch.where(emit, u, 0.0), final)
        inner = _select(emit, inner, state.inner_opt_state)
        acc = _tree.tree_map(lambda a: torch.where(emit, 0.0, a), acc)
        return final, MultiStepsState(mini_step, gradient_step, inner, acc)

    def has_updated(self, state: MultiStepsState) -> torch.Tensor:
        """Whether the last call stepped the inner optimizer (a 0-d bool tensor)."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int):
    """Runs ``inner`` only on steps whose updates are all finite (over every leaf and every
    shard: all ranks decide alike); otherwise returns zero updates and keeps ``inner``'s
    state, unless more than ``max_consecutive_errors`` bad steps came in a row (then the step
    is applied anyway), as optax.

    Args:
        inner: the optimizer.
        max_consecutive_errors: how many non-finite steps in a row are skipped.

    Returns:
        A :class:`GradientTransformation` (state: :class:`ApplyIfFiniteState`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.apply_if_finite(fs.optim.sgd(1.0), 3)
        >>> p = {"w": torch.zeros(1)}
        >>> u, s = tx.update({"w": torch.tensor([float("inf")])}, tx.init(p), p)
        >>> u["w"], int(s.total_notfinite)
        (tensor([0.]), 1)
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"apply_if_finite: inner must be a GradientTransformation, got {inner!r}")
    if isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int):
        raise TypeError(f"max_consecutive_errors must be an int, got {max_consecutive_errors!r}")

    def init(params):
        return ApplyIfFiniteState(
            _tree.count0(), torch.ones((), dtype=torch.bool), _tree.count0(), inner.init(params)
        )

    def update(updates, state, params=None):
        leaves, _ = _tree.flatten(updates, "updates")
        bad = _tree.per_leaf_sums(leaves, lambda t: (~torch.isfinite(t)).sum())
        isfinite = torch.stack(bad).sum() == 0 if bad else torch.ones((), dtype=torch.bool)
        notfinite_count = torch.where(isfinite, 0, state.notfinite_count + 1)
        total = state.total_notfinite + (~isfinite).to(state.total_notfinite.dtype)
        ok = isfinite | (notfinite_count > max_consecutive_errors)
        known = _known(ok)
        if known is False:
            out, inner_state = _tree.tree_map(torch.zeros_like, updates), state.inner_state
        else:
            out, inner_state = inner.update(updates, state.inner_state, params)
            if known is None:
                out = _tree.tree_map(lambda u: torch.where(ok, u, 0.0), out)
                inner_state = _select(ok, inner_state, state.inner_state)
        return out, ApplyIfFiniteState(notfinite_count, isfinite, total, inner_state)

    return GradientTransformation(init, update)


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: torch.dtype | None = None,
) -> Callable[..., GradientTransformation]:
    """Wraps an optimizer factory so that its float hyperparameters live in the state, as
    0-d tensors in ``state.hyperparams`` (log them, change them between steps with
    ``state._replace(hyperparams={**state.hyperparams, "learning_rate": torch.tensor(1e-4)})``,
    checkpoint them), as optax. A schedule argument is evaluated at every step and its
    current value stored there. The inner transformation is rebuilt each step from the
    state's values, so they may also be batched under ``torch.func.vmap`` (a batch of
    optimizers with different learning rates).

    Args:
        inner_factory: e.g. ``fs.optim.adamw``.
        static_args: argument names to keep as given (not injected). Bools, ints, None and
            other non-float arguments are never injected (optax injects ints too).
        hyperparam_dtype: dtype of the stored values; default the promoted dtype of the params.

    Returns:
        A factory with ``inner_factory``'s signature, returning a
        :class:`GradientTransformation` (state: :class:`InjectHyperparamsState`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.inject_hyperparams(fs.optim.sgd)(learning_rate=0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> s = tx.init(p)
        >>> s.hyperparams["learning_rate"]
        tensor(0.1000)
        >>> s = s._replace(hyperparams={**s.hyperparams, "learning_rate": torch.tensor(0.5)})
        >>> tx.update({"w": torch.ones(1)}, s, p)[0]
        {'w': tensor([-0.5000])}
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    sig = inspect.signature(inner_factory)
    unknown = static - set(sig.parameters)
    if unknown:
        raise ValueError(
            f"inject_hyperparams: static_args {sorted(unknown)} are not parameters of "
            f"{getattr(inner_factory, '__name__', inner_factory)}; they are {list(sig.parameters)}"
        )

    @functools.wraps(inner_factory)
    def factory(*args, **kwargs) -> GradientTransformation:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        scheds, numeric, other = {}, {}, {}
        for name, value in bound.arguments.items():
            if name in static or isinstance(value, bool):
                other[name] = value
            elif callable(value) and not isinstance(value, GradientTransformation):
                scheds[name] = value
            elif isinstance(value, (float, torch.Tensor)):
                numeric[name] = value
            else:
                other[name] = value

        def dtype_of(params):
            if hyperparam_dtype is not None:
                return hyperparam_dtype
            leaves, _ = _tree.flatten(params, "params")
            return _tree.promoted_dtype(leaves)

        def values(hp, count, dtype):
            out = dict(hp)
            for k, s in scheds.items():
                out[k] = torch.as_tensor(s(count), dtype=dtype)
            return out

        def init(params):
            dtype = dtype_of(params)
            count = _tree.count0()
            hp = {k: torch.as_tensor(v, dtype=dtype) for k, v in numeric.items()}
            hp = values(hp, count, dtype)
            return InjectHyperparamsState(count, hp, inner_factory(**other, **hp).init(params))

        def update(updates, state, params=None):
            dtype = dtype_of(updates)
            hp = values(state.hyperparams, state.count, dtype)
            out, inner_state = inner_factory(**other, **hp).update(
                updates, state.inner_state, params
            )
            return out, InjectHyperparamsState(state.count + 1, hp, inner_state)

        return GradientTransformation(init, update)

    return factory
