"""The optimizer interface: :class:`GradientTransformation` and the small states, as optax.

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.identity()
    >>> updates, state = tx.update({"w": torch.ones(2)}, tx.init({"w": torch.zeros(2)}))
    >>> updates["w"].tolist(), state
    ([1.0, 1.0], EmptyState())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _tree

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "ScaleByScheduleState",
    "TraceState",
    "EmaState",
    "ScaleByAdamState",
    "ScaleByMuonState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByAdaDeltaState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRssState",
    "ScaleByLionState",
    "ScaleByNovogradState",
    "ScaleBySM3State",
    "ScaleByRpropState",
    "ScaleByOptimisticGradientState",
    "AddNoiseState",
    "ApplyEveryState",
    "ScaleByLBFGSState",
    "ScaleByAdanState",
    "FactoredState",
    "ZeroNansState",
    "MaskedState",
    "MultiTransformState",
    "MultiStepsState",
    "ApplyIfFiniteState",
    "InjectHyperparamsState",
    "identity",
    "set_to_zero",
    "stateless",
    "init_empty_state",
    "Schedule",
    "ScalarOrSchedule",
]

#: A schedule: step count (a 0-d int64 tensor, or a Python int) -> value (tensor or float).
Schedule = Callable[[Any], Any]
#: A hyperparameter: a float, a 0-d tensor, or a :data:`Schedule`.
ScalarOrSchedule = Any


class GradientTransformation(NamedTuple):
    """A pair of pure functions ``(init, update)``, as in optax, plus an optional in-place step.

    ``init(params) -> state``; ``update(updates, state, params=None) -> (updates, new_state)``.
    Neither mutates its inputs.

    ``donated_step(grads, state, params) -> (new_params, new_state) | None`` is set by the
    transformations whose whole step ``torch.optim`` runs as in-place foreach kernels
    (:func:`fshard.optim.sgd`, :func:`~fshard.optim.adam`, :func:`~fshard.optim.adamw`, and a
    :func:`~fshard.optim.chain` that ends in one): :func:`fshard.optim.step` with
    ``donate=True`` calls it to update ``params`` and ``state`` in place. It returns ``None``
    when it cannot run exactly here (e.g. a grad's dtype differs from its param's), and the
    step then falls back to ``update`` plus an in-place ``apply_updates``. Without it
    (``None``, the default) a transformation only has the pure path.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> updates["w"].tolist()
        [-0.10000000149011612, -0.10000000149011612]
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    donated_step: Callable[..., Any] | None = None


class EmptyState(NamedTuple):
    """State of a stateless transformation.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale(0.1).init({"w": torch.zeros(2)})
        EmptyState()
    """


def init_empty_state(params) -> EmptyState:
    """``init`` of a stateless transformation.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.init_empty_state({"w": torch.zeros(2)})
        EmptyState()
    """
    return EmptyState()


def identity() -> GradientTransformation:
    """Leaves updates unchanged (optax ``identity``).

    Returns:
        A stateless :class:`GradientTransformation`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.identity().update({"w": torch.ones(1)}, fs.optim.EmptyState())[0]
        {'w': tensor([1.])}
    """
    return GradientTransformation(
        init_empty_state, lambda updates, state, params=None: (updates, state)
    )


def set_to_zero() -> GradientTransformation:
    """Replaces every update by zeros (freezes params, e.g. in :func:`multi_transform`).

    Returns:
        A stateless :class:`GradientTransformation`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.set_to_zero().update({"w": torch.ones(2)}, fs.optim.EmptyState())[0]
        {'w': tensor([0., 0.])}
    """

    def update(updates, state, params=None):
        return _tree.tree_map(torch.zeros_like, updates), state

    return GradientTransformation(init_empty_state, update)


def stateless(fn: Callable[[Any, Any], Any]) -> GradientTransformation:
    """A transformation from ``fn(updates, params) -> updates`` with no state (optax
    ``stateless``).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.stateless(lambda u, p: {k: 2 * v for k, v in u.items()})
        >>> tx.update({"w": torch.ones(1)}, tx.init(None))[0]
        {'w': tensor([2.])}
    """

    def update(updates, state, params=None):
        return fn(updates, params), state

    return GradientTransformation(init_empty_state, update)


# -- states (NamedTuples of tensors and pytrees: checkpointable, vmappable) ---------------------
# Counters are 0-d int64 tensors; moments are pytrees with the params' structure and layouts.


class ScaleByScheduleState(NamedTuple):
    """Step count of a scheduled transformation (:func:`scale_by_schedule`).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_schedule(lambda n: 0.1).init({"w": torch.zeros(2)})
        ScaleByScheduleState(count=tensor(0))
    """

    count: torch.Tensor


class TraceState(NamedTuple):
    """Momentum buffers of :func:`trace` (optax ``TraceState``).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.trace(0.9).init({"w": torch.zeros(2)})
        TraceState(trace={'w': tensor([0., 0.])})
    """

    trace: Any


class EmaState(NamedTuple):
    """Step count and moving average of :func:`ema`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.ema(0.9).init({"w": torch.zeros(2)})
        EmaState(count=tensor(0), ema={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    ema: Any


class ScaleByAdamState(NamedTuple):
    """Adam state: step count (0-d int64 tensor), first and second moments.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_adam().init({"w": torch.zeros(2)})
        ScaleByAdamState(count=tensor(0), mu={'w': tensor([0., 0.])}, nu={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByMuonState(NamedTuple):
    """Muon state: step count (0-d int64 tensor) and momentum (the params' layouts).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_muon().init({"w": torch.zeros(1, 2)})
        ScaleByMuonState(count=tensor(0), mu={'w': tensor([[0., 0.]])})
    """

    count: torch.Tensor
    mu: Any


class ScaleByRmsState(NamedTuple):
    """Second moment of :func:`scale_by_rms`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_rms(initial_scale=0.0).init({"w": torch.zeros(2)})
        ScaleByRmsState(nu={'w': tensor([0., 0.])})
    """

    nu: Any


class ScaleByRmsWithCountState(NamedTuple):
    """Step count and second moment of :func:`scale_by_rms` with ``bias_correction``.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_rms(bias_correction=True).init({"w": torch.zeros(2)})
        ScaleByRmsWithCountState(count=tensor(0), nu={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    nu: Any


class ScaleByRStdDevState(NamedTuple):
    """First and second moments of :func:`scale_by_stddev` (centered RMSProp).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_stddev(initial_scale=0.0).init({"w": torch.zeros(2)})
        ScaleByRStdDevState(mu={'w': tensor([0., 0.])}, nu={'w': tensor([0., 0.])})
    """

    mu: Any
    nu: Any


class ScaleByRStdDevWithCountState(NamedTuple):
    """:class:`ScaleByRStdDevState` with a step count (``bias_correction``).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_stddev(bias_correction=True).init({"w": torch.zeros(2)})
        ScaleByRStdDevWithCountState(count=tensor(0), mu={'w': tensor([0., 0.])}, nu={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByRssState(NamedTuple):
    """Sum of squared gradients of :func:`scale_by_rss` (Adagrad).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_rss(initial_accumulator_value=0.0).init({"w": torch.zeros(2)})
        ScaleByRssState(sum_of_squares={'w': tensor([0., 0.])})
    """

    sum_of_squares: Any


class ScaleByAmsgradState(NamedTuple):
    """Step count, moments and the running maximum of the second moment of
    :func:`scale_by_amsgrad`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_amsgrad().init({"w": torch.zeros(1)}).nu_max
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any


class ScaleByBeliefState(NamedTuple):
    """Step count, first moment and the second moment of the prediction error of
    :func:`scale_by_belief` (AdaBelief).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_belief().init({"w": torch.zeros(1)}).nu
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByAdaDeltaState(NamedTuple):
    """Running averages of squared gradients and squared updates of :func:`scale_by_adadelta`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_adadelta().init({"w": torch.zeros(1)}).e_x
        {'w': tensor([0.])}
    """

    e_g: Any
    e_x: Any


class ScaleByLionState(NamedTuple):
    """Step count and momentum of :func:`scale_by_lion`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_lion().init({"w": torch.zeros(2)})
        ScaleByLionState(count=tensor(0), mu={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    mu: Any


class ScaleByNovogradState(NamedTuple):
    """Step count, first moment (the params' layouts) and the per-leaf moving average of the
    squared gradient norm (0-d) of :func:`scale_by_novograd`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_novograd().init({"w": torch.zeros(2)})
        ScaleByNovogradState(count=tensor(0), mu={'w': tensor([0., 0.])}, nu={'w': tensor(0.)})
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleBySM3State(NamedTuple):
    """SM3's accumulators: per leaf, one vector per dim (laid out like that dim), and the
    momentum of the scaled updates.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_sm3().init({"w": torch.zeros(2, 3)}).mu
        {'w': [tensor([0., 0.]), tensor([0., 0., 0.])]}
    """

    mu: Any
    nu: Any


class ScaleByRpropState(NamedTuple):
    """Per-element step sizes and the previous updates of :func:`scale_by_rprop`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_rprop(0.1).init({"w": torch.zeros(2)}).step_sizes
        {'w': tensor([0.1000, 0.1000])}
    """

    step_sizes: Any
    prev_updates: Any


class ScaleByOptimisticGradientState(NamedTuple):
    """Whether no step was taken yet, and the previous gradient, of
    :func:`scale_by_optimistic_gradient`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_optimistic_gradient().init({"w": torch.zeros(1)})
        ScaleByOptimisticGradientState(is_initial_step=tensor(True), previous_gradient={'w': tensor([0.])})
    """

    is_initial_step: torch.Tensor
    previous_gradient: Any


class AddNoiseState(NamedTuple):
    """Step count and the integer key of :func:`add_noise` (0-d int64 tensors).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.add_noise(0.01, 0.55, key=3).init({"w": torch.zeros(1)})
        AddNoiseState(count=tensor(0), rng_key=tensor(3))
    """

    count: torch.Tensor
    rng_key: torch.Tensor


class ApplyEveryState(NamedTuple):
    """Counter and gradient accumulator of :func:`apply_every` (optax's ``ApplyEvery``).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.apply_every(2).init({"w": torch.zeros(1)})
        ApplyEveryState(count=tensor(0), grad_acc={'w': tensor([0.])})
    """

    count: torch.Tensor
    grad_acc: Any


class ScaleByLBFGSState(NamedTuple):
    """L-BFGS memory of :func:`scale_by_lbfgs`, optax's fields: step count, the last params and
    updates, the last ``memory_size`` differences of each (stacked on a leading dim, so a
    sharded leaf's memory is sharded like it on the other dims) and their weights.

    Example:
        >>> import torch, fshard as fs
        >>> s = fs.optim.scale_by_lbfgs(memory_size=3).init({"w": torch.zeros(2)})
        >>> s.diff_params_memory["w"].shape, s.weights_memory
        (torch.Size([3, 2]), tensor([0., 0., 0.]))
    """

    count: torch.Tensor
    params: Any
    updates: Any
    diff_params_memory: Any
    diff_updates_memory: Any
    weights_memory: torch.Tensor


class ScaleByAdanState(NamedTuple):
    """Adan's moments (of the gradient, of its difference, of the squared corrected gradient),
    the last gradient and the step count (optax's field names).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_adan().init({"w": torch.zeros(1)}).t
        tensor(0)
    """

    m: Any
    v: Any
    n: Any
    g: Any
    t: torch.Tensor


class FactoredState(NamedTuple):
    """Adafactor state: step count, row/column second-moment factors of factored leaves and
    the full second moment of the others (placeholders of shape ``(1,)`` elsewhere, as optax).
    A sharded leaf's factors are sharded like the leaf minus the reduced dim.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_factored_rms(min_dim_size_to_factor=2).init({"w": torch.zeros(2, 3)})
        FactoredState(count=tensor(0), v_row={'w': tensor([0., 0.])}, v_col={'w': tensor([0., 0., 0.])}, v={'w': tensor([0.])})
    """

    count: torch.Tensor
    v_row: Any
    v_col: Any
    v: Any


class ZeroNansState(NamedTuple):
    """Per leaf: whether the last update had a NaN anywhere (over every shard).

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.zero_nans().init({"w": torch.zeros(2)})
        ZeroNansState(found_nan={'w': tensor(False)})
    """

    found_nan: Any


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transformation's state over the selected leaves.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.masked(fs.optim.trace(0.9), {"w": True}).init({"w": torch.zeros(2)})
        MaskedState(inner_state=TraceState(trace=[tensor([0., 0.])]))
    """

    inner_state: Any


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`: one inner state per label.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.multi_transform({"a": fs.optim.trace(0.9), "b": fs.optim.identity()}, {"w": "a"}).init({"w": torch.zeros(2)})
        MultiTransformState(inner_states={'a': TraceState(trace=[tensor([0., 0.])]), 'b': EmptyState()})
    """

    inner_states: dict


class MultiStepsState(NamedTuple):
    """State of :class:`MultiSteps`: position in the accumulation window, number of inner
    steps taken, the inner state and the accumulated gradients.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.MultiSteps(fs.optim.sgd(0.1), 2).init({"w": torch.zeros(2)})
        MultiStepsState(mini_step=tensor(0), gradient_step=tensor(0), inner_opt_state=(EmptyState(), EmptyState()), acc_grads={'w': tensor([0., 0.])})
    """

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_opt_state: Any
    acc_grads: Any


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.apply_if_finite(fs.optim.sgd(0.1), 3).init({"w": torch.zeros(2)})
        ApplyIfFiniteState(notfinite_count=tensor(0), last_finite=tensor(True), total_notfinite=tensor(0), inner_state=(EmptyState(), EmptyState()))
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


class InjectHyperparamsState(NamedTuple):
    """State of :func:`inject_hyperparams`: step count, current hyperparameters (0-d tensors,
    read and overwritten by the user: logged, changed, checkpointed) and the inner state.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.inject_hyperparams(fs.optim.sgd)(learning_rate=0.1).init({"w": torch.zeros(2)})
        InjectHyperparamsState(count=tensor(0), hyperparams={'learning_rate': tensor(0.1000), 'momentum': tensor(0.), 'weight_decay': tensor(0.)}, inner_state=(EmptyState(), TraceState(trace={'w': tensor([0., 0.])}), EmptyState()))
    """

    count: torch.Tensor
    hyperparams: dict
    inner_state: Any


def _register_states_for_weights_only() -> None:
    """Every state class of ``fs.optim`` loads with ``torch.load(weights_only=True)``
    (``torch.save(opt_state)`` is how torch users checkpoint an optimizer)."""
    states = [
        v
        for k, v in globals().items()
        if isinstance(v, type) and issubclass(v, tuple) and k.endswith("State")
    ]
    torch.serialization.add_safe_globals(states)


_register_states_for_weights_only()
