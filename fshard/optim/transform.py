"""Building blocks: the ``scale_by_*`` transformations and friends, formula for formula as
optax's (``optax/_src/transform.py``, ``factorized.py``, ``transforms/``).

Each works leaf by leaf on the local shards (a sharded leaf's state has its layout), so the
element-wise ones never communicate. The ones that need a whole leaf (:func:`scale_by_trust_ratio`,
:func:`scale_by_param_block_rms`, :func:`scale_by_factored_rms`, :func:`zero_nans`) reduce over
the mesh axes that shard it, with one small all_reduce per group of leaves sharded alike.

Hyperparameters may be floats or 0-d tensors (differentiable, or injected into the state by
:func:`~fshard.optim.inject_hyperparams`); step counts are 0-d int64 tensors, never turned into
Python ints, so every ``update`` traces under ``torch.compile(fullgraph=True)`` and batches under
``torch.func.vmap``.

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.chain(fs.optim.scale_by_adam(), fs.optim.scale_by_learning_rate(0.1))
    >>> params = {"w": torch.zeros(2)}
    >>> updates, state = tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(params))
    >>> [round(u, 4) for u in updates["w"].tolist()]
    [-0.1, 0.1]
"""

from __future__ import annotations

import functools
import math

import optree
import torch

from . import _tree
from ._tree import check_bool, check_scalar, check_schedule
from .base import (
    AddNoiseState,
    ApplyEveryState,
    EmaState,
    EmptyState,
    FactoredState,
    GradientTransformation,
    ScaleByAdaDeltaState,
    ScaleByAdamState,
    ScaleByAdanState,
    ScaleByAmsgradState,
    ScaleByBeliefState,
    ScaleByLBFGSState,
    ScaleByLionState,
    ScaleByNovogradState,
    ScaleByOptimisticGradientState,
    ScaleByRmsState,
    ScaleByRmsWithCountState,
    ScaleByRpropState,
    ScaleByRssState,
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    ScaleByScheduleState,
    ScaleBySM3State,
    TraceState,
    ZeroNansState,
    identity,
    init_empty_state,
)
from .combine import masked

__all__ = [
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "trace",
    "ema",
    "scale_by_adam",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_stddev",
    "scale_by_rss",
    "scale_by_lion",
    "scale_by_sign",
    "scale_by_adamax",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_yogi",
    "scale_by_adadelta",
    "scale_by_trust_ratio",
    "scale_by_param_block_rms",
    "scale_by_factored_rms",
    "zero_nans",
    "scale_by_novograd",
    "scale_by_sm3",
    "scale_by_rprop",
    "scale_by_optimistic_gradient",
    "scale_by_polyak",
    "add_noise",
    "centralize",
    "apply_every",
    "keep_params_nonnegative",
    "scale_by_lbfgs",
    "scale_by_adan",
]


def _axpy(y: torch.Tensor, a, x: torch.Tensor) -> torch.Tensor:
    """``y + a * x`` in one pass, ``a`` a number or a 0-d tensor."""
    if isinstance(a, torch.Tensor):
        return torch.addcmul(y, x, a)
    return torch.add(y, x, alpha=a)


def _t(x) -> torch.Tensor:
    """A scalar as a 0-d tensor (float64 for numbers) for ops that need a tensor operand."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


def _is_zero(x) -> bool:
    return not isinstance(x, torch.Tensor) and x == 0


# -- scaling ----------------------------------------------------------------------------------


def scale(step_size) -> GradientTransformation:
    """Multiplies updates by ``step_size`` (a float or a 0-d tensor).

    Args:
        step_size: the factor.

    Returns:
        A stateless :class:`GradientTransformation`.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale(-2.0).update({"w": torch.ones(2)}, fs.optim.EmptyState())[0]
        {'w': tensor([-2., -2.])}
    """
    step_size = check_scalar(step_size, "step_size")

    def update(updates, state, params=None):
        return _tree.tree_map(lambda u: u * step_size, updates), state

    return GradientTransformation(init_empty_state, update)


def scale_by_schedule(step_size_fn) -> GradientTransformation:
    """Multiplies updates by ``step_size_fn(count)``, ``count`` the number of updates so far.

    Args:
        step_size_fn: a schedule (see :mod:`fshard.optim.schedule`).

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScaleByScheduleState`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_schedule(lambda count: 0.5 ** count)
        >>> u, s = tx.update({"w": torch.ones(1)}, tx.init(None))
        >>> u, s = tx.update({"w": torch.ones(1)}, s)
        >>> u["w"].item()
        0.5
    """
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be callable (a schedule), got {step_size_fn!r}")

    def init(params):
        return ScaleByScheduleState(_tree.count0())

    def update(updates, state, params=None):
        s = step_size_fn(state.count)
        return _tree.tree_map(lambda u: u * s, updates), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiplies updates by ``-learning_rate`` (``+`` without ``flip_sign``): :func:`scale`
    for a float or 0-d tensor, :func:`scale_by_schedule` for a schedule, as optax.

    Args:
        learning_rate: float (>= 0), 0-d tensor, schedule, or None (identity).
        flip_sign: descend (the default).

    Returns:
        A :class:`GradientTransformation`.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_learning_rate(0.5)
        >>> tx.update({"w": torch.ones(1)}, tx.init(None))[0]
        {'w': tensor([-0.5000])}
    """
    if learning_rate is None:
        return identity()
    learning_rate = check_schedule(learning_rate)
    check_bool(flip_sign, "flip_sign")
    m = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: m * learning_rate(count))
    return scale(m * learning_rate)


def add_decayed_weights(weight_decay=0.0, mask=None) -> GradientTransformation:
    """Adds ``weight_decay * param`` to each update (L2 regularisation in gradient form).

    Args:
        weight_decay: float (>= 0), 0-d tensor or schedule.
        mask: optional bool pytree (or callable ``params -> pytree``) selecting the decayed
            leaves; then this is ``masked(add_decayed_weights(weight_decay), mask)``, as optax.

    Returns:
        A :class:`GradientTransformation`; ``update`` requires ``params``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.add_decayed_weights(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> tx.update({"w": torch.zeros(2)}, tx.init(p), p)[0]
        {'w': tensor([0.1000, 0.1000])}
    """
    weight_decay = check_schedule(weight_decay, "weight_decay")
    if mask is not None:
        return masked(add_decayed_weights(weight_decay), mask)
    scheduled = callable(weight_decay)

    def init(params):
        return ScaleByScheduleState(_tree.count0()) if scheduled else EmptyState()

    def update(updates, state, params=None):
        _tree.needs_params(params, "add_decayed_weights")
        wd = weight_decay(state.count) if scheduled else weight_decay
        new_state = ScaleByScheduleState(state.count + 1) if scheduled else state
        if _is_zero(wd):
            return updates, new_state
        return _tree.tree_map(lambda u, p: _axpy(u, wd, p), updates, params, names=["params"]), (
            new_state
        )

    return GradientTransformation(init, update)


# -- moments ----------------------------------------------------------------------------------


def trace(decay, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = g + decay * t`` and the update ``t`` (``g + decay * t`` with Nesterov),
    as optax (and ``torch.optim.SGD`` with dampening 0).

    Args:
        decay: the momentum factor, in [0, 1] (or a 0-d tensor).
        nesterov: Nesterov momentum.

    Returns:
        A :class:`GradientTransformation` (state: :class:`TraceState`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.trace(0.5)
        >>> u, s = tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))
        >>> tx.update({"w": torch.ones(1)}, s)[0]
        {'w': tensor([1.5000])}
    """
    decay = check_scalar(decay, "decay", 0.0, 1.0)
    check_bool(nesterov, "nesterov")

    def init(params):
        return TraceState(_tree.zeros_like(params))

    def update(updates, state, params=None):
        def leaf(g, t):
            t = _axpy(g, decay, t)
            return (_axpy(g, decay, t) if nesterov else t), t

        updates, new = _tree.tree_map(leaf, updates, state.trace, names=["state.trace"], n_out=2)
        return updates, TraceState(new)

    return GradientTransformation(init, update)


def ema(decay, debias: bool = True) -> GradientTransformation:
    """Exponential moving average of the updates, ``ema = decay * ema + (1 - decay) * g``,
    divided by ``1 - decay ** t`` with ``debias``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.ema(0.9)
        >>> tx.update({"w": torch.full((1,), 2.0)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([2.])}
    """
    decay = check_scalar(decay, "decay", 0.0, 1.0)
    check_bool(debias, "debias")

    def init(params):
        return EmaState(_tree.count0(), _tree.zeros_like(params))

    def update(updates, state, params=None):
        count = state.count + 1
        new = _tree.tree_map(lambda g, e: torch.lerp(e, g, 1 - decay), updates, state.ema)
        out = new
        if debias:
            c = 1 / (1 - decay ** _tree.as_float(count))
            out = _tree.tree_map(lambda e: e * c, new)
        return out, EmaState(count, new)

    return GradientTransformation(init, update)


def _adam_checks(b1, b2, eps, eps_root):
    return (
        check_scalar(b1, "b1", 0.0, 1.0, open_hi=True),
        check_scalar(b2, "b2", 0.0, 1.0, open_hi=True),
        check_scalar(eps, "eps", 0.0),
        check_scalar(eps_root, "eps_root", 0.0),
    )


def _adam_direction(b1, b2, eps, eps_root, nesterov, count, fresh: bool):
    """Per-leaf ``(g, mu, nu) -> (m_hat / (sqrt(nu_hat + eps_root) + eps), mu, nu)`` for step
    ``count`` (already incremented). Bias corrections are folded into two 0-d scalars, so a
    leaf costs six passes over memory (lerp, g*g, lerp, sqrt, addcmul, div). With ``fresh``
    (see :func:`_tree.fresh_ok`) the last steps reuse the temporaries made here (three new
    tensors per leaf instead of six); inputs are never written either way."""
    t = _tree.as_float(count)
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    if nesterov:  # b1 * m / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t), as optax
        k, s_m, s_g = 1.0, b1 / (1 - b1 ** (t + 1)), (1 - b1) / bc1
    else:  # m / bc1 / (sqrt(v / bc2) + eps) = m / (bc1 * sqrt(v / bc2) + bc1 * eps)
        k, s_m, s_g = bc1, None, None
    root_scale = k / torch.sqrt(bc2) if _is_zero(eps_root) else k
    scalars = {"k_eps": k * eps, "root": root_scale, "s_m": s_m, "s_g": s_g, "inv_bc2": 1 / bc2}
    by_dtype: dict = {}

    def sc(dtype):  # the 0-d scalars in the leaves' dtype (mixed-dtype kernels are slower)
        if dtype not in by_dtype:
            by_dtype[dtype] = {
                n: (_t(v).to(dtype) if v is not None else None) for n, v in scalars.items()
            }
        return by_dtype[dtype]

    def leaf(g, mu, nu):
        c = sc(g.dtype)
        mu = torch.lerp(mu, g, 1 - b1)
        if fresh:
            # torch.optim's order (lerp_ towards nu with weight b2 ~ 1 would lose digits)
            if isinstance(b2, torch.Tensor):
                nu = torch.lerp(nu, g * g, 1 - b2)
            else:
                nu = torch.mul(nu, b2).addcmul_(g, g, value=1 - b2)
            num = (mu * c["s_m"]).addcmul_(g, c["s_g"]) if nesterov else mu
        else:
            nu = torch.lerp(nu, g * g, 1 - b2)
            num = torch.addcmul(mu * c["s_m"], g, c["s_g"]) if nesterov else mu
        if _is_zero(eps_root):
            root = torch.sqrt(nu)
        else:
            root = torch.sqrt(torch.addcmul(_t(eps_root).to(g.dtype), nu, c["inv_bc2"]))
        if fresh:
            torch.addcmul(c["k_eps"], root, c["root"], out=root)
            return torch.div(num, root, out=root), mu, nu
        return num / torch.addcmul(c["k_eps"], root, c["root"]), mu, nu

    return leaf


def scale_by_adam(
    b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, *, nesterov: bool = False
) -> GradientTransformation:
    """Adam's direction: ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with bias-corrected
    moments (Nesterov's ``m_hat`` with ``nesterov``, i.e. NAdam), as optax.

    Args:
        b1: first moment decay rate in [0, 1).
        b2: second moment decay rate in [0, 1).
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (keeps the gradient through ``sqrt`` finite
            when differentiating through the step).
        nesterov: NAdam's look-ahead first moment.

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScaleByAdamState`, moments with the
        params' layouts).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_adam()
        >>> u, state = tx.update({"w": torch.tensor([3.0])}, tx.init({"w": torch.zeros(1)}))
        >>> round(u["w"].item(), 6)
        1.0
    """
    b1, b2, eps, eps_root = _adam_checks(b1, b2, eps, eps_root)
    check_bool(nesterov, "nesterov")

    def init(params):
        return ScaleByAdamState(_tree.count0(), _tree.zeros_like(params), _tree.zeros_like(params))

    def update(updates, state, params=None):
        count = state.count + 1
        fresh = _tree.fresh_ok(updates, state.mu, state.nu, b1, b2, eps, eps_root)
        leaf = _adam_direction(b1, b2, eps, eps_root, nesterov, count, fresh)
        u, mu, nu = _tree.tree_map(
            leaf, updates, state.mu, state.nu, names=["state.mu", "state.nu"], n_out=3
        )
        return u, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_radam(
    b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *, nesterov: bool = False
) -> GradientTransformation:
    """Rectified Adam's direction, as optax: Adam's, times the variance rectification ``r``,
    once the SMA length ``rho_t`` reaches ``threshold``; the bias-corrected momentum before.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_radam()
        >>> tx.update({"w": torch.tensor([3.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([3.])}
    """
    b1, b2, eps, eps_root = _adam_checks(b1, b2, eps, eps_root)
    threshold = check_scalar(threshold, "threshold")
    check_bool(nesterov, "nesterov")
    ro_inf = 2.0 / (1.0 - b2) - 1.0

    def init(params):
        return ScaleByAdamState(_tree.count0(), _tree.zeros_like(params), _tree.zeros_like(params))

    def update(updates, state, params=None):
        count = state.count + 1
        t = _tree.as_float(count)
        b2t = b2**t
        ro = ro_inf - 2 * t * b2t / (1 - b2t)
        r = torch.sqrt(
            torch.clamp((ro - 4) * (ro - 2) * ro_inf / ((ro_inf - 4) * (ro_inf - 2) * ro), min=0.0)
        )
        use_adam = ro >= threshold
        adam = _adam_direction(b1, b2, eps, eps_root, nesterov, count, False)
        bc1 = 1 - b1**t
        if nesterov:
            s_m, s_g = b1 / (1 - b1 ** (t + 1)), (1 - b1) / bc1

        def leaf(g, mu, nu):
            u, mu, nu = adam(g, mu, nu)
            m_hat = torch.addcmul(mu * s_m, g, s_g) if nesterov else mu / bc1
            return torch.where(use_adam, u * r, m_hat), mu, nu

        u, mu, nu = _tree.tree_map(
            leaf, updates, state.mu, state.nu, names=["state.mu", "state.nu"], n_out=3
        )
        return u, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def _rms_checks(decay, eps, initial_scale, eps_in_sqrt, bias_correction):
    check_bool(eps_in_sqrt, "eps_in_sqrt")
    check_bool(bias_correction, "bias_correction")
    return (
        check_scalar(decay, "decay", 0.0, 1.0),
        check_scalar(eps, "eps", 0.0),
        check_scalar(initial_scale, "initial_scale", 0.0),
    )


def _rms_debias(state, decay, bias_correction):
    """``(new count, 1 / (1 - decay**count))``, or ``(None, None)`` without bias correction."""
    if not bias_correction:
        return None, None
    count = state.count + 1
    return count, 1 / (1 - decay ** _tree.as_float(count))


def _rms_scale(g, second_moment, eps, eps_in_sqrt: bool):
    if eps_in_sqrt:
        return g * torch.rsqrt(second_moment + eps)
    return g / (torch.sqrt(second_moment) + eps)


def scale_by_rms(
    decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt: bool = True, bias_correction=False
) -> GradientTransformation:
    """RMSProp's scaling ``g / sqrt(nu + eps)`` (``g / (sqrt(nu) + eps)`` without
    ``eps_in_sqrt``), ``nu`` the moving average of ``g**2`` started at ``initial_scale``, as
    optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_rms(decay=0.75, eps=0.0)
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([2.])}
    """
    decay, eps, initial_scale = _rms_checks(decay, eps, initial_scale, eps_in_sqrt, bias_correction)

    def init(params):
        nu = _tree.full_like(params, initial_scale)
        return (
            ScaleByRmsWithCountState(_tree.count0(), nu) if bias_correction else ScaleByRmsState(nu)
        )

    def update(updates, state, params=None):
        count, c = _rms_debias(state, decay, bias_correction)

        def leaf(g, nu):
            nu = torch.lerp(nu, g * g, 1 - decay)
            return _rms_scale(g, nu if c is None else nu * c, eps, eps_in_sqrt), nu

        u, nu = _tree.tree_map(leaf, updates, state.nu, names=["state.nu"], n_out=2)
        return u, (ScaleByRmsWithCountState(count, nu) if bias_correction else ScaleByRmsState(nu))

    return GradientTransformation(init, update)


def scale_by_stddev(
    decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt: bool = True, bias_correction=False
) -> GradientTransformation:
    """Centered RMSProp's scaling ``g / sqrt(nu - mu**2 + eps)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_stddev(decay=0.5, eps=0.0, initial_scale=1.0)
        >>> tx.update({"w": torch.tensor([1.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([1.1547])}
    """
    decay, eps, initial_scale = _rms_checks(decay, eps, initial_scale, eps_in_sqrt, bias_correction)

    def init(params):
        mu, nu = _tree.zeros_like(params), _tree.full_like(params, initial_scale)
        if bias_correction:
            return ScaleByRStdDevWithCountState(_tree.count0(), mu, nu)
        return ScaleByRStdDevState(mu, nu)

    def update(updates, state, params=None):
        count, c = _rms_debias(state, decay, bias_correction)

        def leaf(g, mu, nu):
            mu = torch.lerp(mu, g, 1 - decay)
            nu = torch.lerp(nu, g * g, 1 - decay)
            mu_hat, nu_hat = (mu, nu) if c is None else (mu * c, nu * c)
            return _rms_scale(g, nu_hat - mu_hat * mu_hat, eps, eps_in_sqrt), mu, nu

        u, mu, nu = _tree.tree_map(
            leaf, updates, state.mu, state.nu, names=["state.mu", "state.nu"], n_out=3
        )
        if bias_correction:
            return u, ScaleByRStdDevWithCountState(count, mu, nu)
        return u, ScaleByRStdDevState(mu, nu)

    return GradientTransformation(init, update)


def scale_by_rss(initial_accumulator_value=0.1, eps=1e-7) -> GradientTransformation:
    """Adagrad's scaling ``g / sqrt(sum of g**2 + eps)`` (0 where the sum is 0), the sum
    started at ``initial_accumulator_value``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
        >>> tx.update({"w": torch.tensor([-2.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([-1.])}
    """
    initial_accumulator_value = check_scalar(
        initial_accumulator_value, "initial_accumulator_value", 0.0
    )
    eps = check_scalar(eps, "eps", 0.0)

    def init(params):
        return ScaleByRssState(_tree.full_like(params, initial_accumulator_value))

    def update(updates, state, params=None):
        def leaf(g, s):
            s = torch.addcmul(s, g, g)
            inv = torch.where(s > 0, torch.rsqrt(s + eps), torch.zeros((), dtype=s.dtype))
            return g * inv, s

        u, s = _tree.tree_map(
            leaf, updates, state.sum_of_squares, names=["state.sum_of_squares"], n_out=2
        )
        return u, ScaleByRssState(s)

    return GradientTransformation(init, update)


def scale_by_lion(b1=0.9, b2=0.99) -> GradientTransformation:
    """Lion's direction ``sign(b1 * mu + (1 - b1) * g)``, then ``mu = b2 * mu + (1 - b2) * g``,
    as optax (``mode='hard'``).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_lion()
        >>> tx.update({"w": torch.tensor([0.3, -2.0])}, tx.init({"w": torch.zeros(2)}))[0]
        {'w': tensor([ 1., -1.])}
    """
    b1 = check_scalar(b1, "b1", 0.0, 1.0)
    b2 = check_scalar(b2, "b2", 0.0, 1.0)

    def init(params):
        return ScaleByLionState(_tree.count0(), _tree.zeros_like(params))

    def update(updates, state, params=None):
        def leaf(g, mu):
            return torch.sign(torch.lerp(mu, g, 1 - b1)), torch.lerp(mu, g, 1 - b2)

        u, mu = _tree.tree_map(leaf, updates, state.mu, names=["state.mu"], n_out=2)
        return u, ScaleByLionState(state.count + 1, mu)

    return GradientTransformation(init, update)


def scale_by_sign() -> GradientTransformation:
    """``sign(g)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.scale_by_sign().update({"w": torch.tensor([-3.0, 0.5])}, None)[0]
        {'w': tensor([-1.,  1.])}
    """

    def update(updates, state, params=None):
        return _tree.tree_map(torch.sign, updates), state

    return GradientTransformation(init_empty_state, update)


def _bias(decay, count: torch.Tensor):
    """optax's ``1 - decay ** count`` (count already incremented), a 0-d float tensor."""
    return 1 - decay ** _tree.as_float(count)


def _moment(g, m, decay):
    """optax ``update_moment(.., order=1)``: ``(1 - decay) * g + decay * m``."""
    return (1 - decay) * g + decay * m


def _sq_moment(g, m, decay):
    """optax ``update_moment_per_elem_norm(.., order=2)``: ``(1 - decay) * g**2 + decay * m``."""
    return (1 - decay) * g * g + decay * m


def scale_by_adamax(b1=0.9, b2=0.999, eps=1e-8) -> GradientTransformation:
    """AdaMax's direction, as optax: ``m_hat / u`` with ``u = max(|g| + eps, b2 * u)`` (the
    infinity norm's moving maximum) and the bias-corrected first moment.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_adamax()
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([1.])}
    """
    b1 = check_scalar(b1, "b1", 0.0, 1.0, open_hi=True)
    b2 = check_scalar(b2, "b2", 0.0, 1.0, open_hi=True)
    eps = check_scalar(eps, "eps", 0.0)

    def init(params):
        return ScaleByAdamState(_tree.count0(), _tree.zeros_like(params), _tree.zeros_like(params))

    def update(updates, state, params=None):
        count = state.count + 1
        bc1 = _bias(b1, count)

        def leaf(g, mu, nu):
            mu = _moment(g, mu, b1)
            nu = torch.maximum(g.abs() + eps, b2 * nu)
            return mu / bc1.to(mu.dtype) / nu, mu, nu

        u, mu, nu = _tree.tree_map(
            leaf, updates, state.mu, state.nu, names=["state.mu", "state.nu"], n_out=3
        )
        return u, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_amsgrad(
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    eps_root=0.0,
    *,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    """AMSGrad's direction, as optax: Adam's, with the running maximum of the (bias-corrected)
    second moment in the denominator.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_amsgrad()
        >>> u = tx.update({"w": torch.tensor([3.0])}, tx.init({"w": torch.zeros(1)}))[0]
        >>> round(u["w"].item(), 6)
        1.0
    """
    b1, b2, eps, eps_root = _adam_checks(b1, b2, eps, eps_root)
    check_bool(bias_correction_mu, "bias_correction_mu")
    check_bool(bias_correction_nu, "bias_correction_nu")

    def init(params):
        zeros = _tree.zeros_like
        return ScaleByAmsgradState(_tree.count0(), zeros(params), zeros(params), zeros(params))

    def update(updates, state, params=None):
        count = state.count + 1
        bc1, bc2 = _bias(b1, count), _bias(b2, count)

        def leaf(g, mu, nu, nu_max):
            mu, nu = _moment(g, mu, b1), _sq_moment(g, nu, b2)
            m_hat = mu / bc1.to(mu.dtype) if bias_correction_mu else mu
            nu_max = torch.maximum(nu_max, nu / bc2.to(nu.dtype) if bias_correction_nu else nu)
            return m_hat / (torch.sqrt(nu_max + eps_root) + eps), mu, nu, nu_max

        names = ["state.mu", "state.nu", "state.nu_max"]
        u, mu, nu, nu_max = _tree.tree_map(
            leaf, updates, state.mu, state.nu, state.nu_max, names=names, n_out=4
        )
        return u, ScaleByAmsgradState(count, mu, nu, nu_max)

    return GradientTransformation(init, update)


def scale_by_belief(
    b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, nesterov: bool = False
) -> GradientTransformation:
    """AdaBelief's direction, as optax: the second moment is of the prediction error
    ``g - mu`` (plus ``eps_root``), bias-corrected like Adam's.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_belief()
        >>> u = tx.update({"w": torch.tensor([3.0])}, tx.init({"w": torch.zeros(1)}))[0]
        >>> round(u["w"].item(), 4)
        1.1111
    """
    b1, b2, eps, eps_root = _adam_checks(b1, b2, eps, eps_root)
    check_bool(nesterov, "nesterov")

    def init(params):
        return ScaleByBeliefState(_tree.count0(), _tree.zeros_like(params), _tree.zeros_like(params))  # fmt: skip

    def update(updates, state, params=None):
        count = state.count + 1
        bc1, bc2, bc1_next = _bias(b1, count), _bias(b2, count), _bias(b1, count + 1)

        def leaf(g, mu, nu):
            mu = _moment(g, mu, b1)
            nu = _sq_moment(g - mu, nu, b2) + eps_root
            if nesterov:
                m_hat = b1 * (mu / bc1_next.to(mu.dtype)) + (1 - b1) * (g / bc1.to(g.dtype))
            else:
                m_hat = mu / bc1.to(mu.dtype)
            return m_hat / (torch.sqrt(nu / bc2.to(nu.dtype)) + eps), mu, nu

        u, mu, nu = _tree.tree_map(
            leaf, updates, state.mu, state.nu, names=["state.mu", "state.nu"], n_out=3
        )
        return u, ScaleByBeliefState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_yogi(
    b1=0.9, b2=0.999, eps=1e-3, eps_root=0.0, initial_accumulator_value=1e-6
) -> GradientTransformation:
    """Yogi's direction, as optax: Adam's with the additive second-moment update
    ``nu - (1 - b2) * sign(nu - g**2) * g**2``, both moments starting at
    ``initial_accumulator_value``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_yogi()
        >>> u = tx.update({"w": torch.tensor([3.0])}, tx.init({"w": torch.zeros(1)}))[0]
        >>> round(u["w"].item(), 4)
        0.9996
    """
    b1, b2, eps, eps_root = _adam_checks(b1, b2, eps, eps_root)
    init_value = check_scalar(initial_accumulator_value, "initial_accumulator_value", 0.0)

    def init(params):
        full = _tree.full_like
        return ScaleByAdamState(_tree.count0(), full(params, init_value), full(params, init_value))

    def update(updates, state, params=None):
        count = state.count + 1
        bc1, bc2 = _bias(b1, count), _bias(b2, count)

        def leaf(g, mu, nu):
            mu, g2 = _moment(g, mu, b1), g * g
            nu = nu - (1 - b2) * torch.sign(nu - g2) * g2
            m_hat, v_hat = mu / bc1.to(mu.dtype), nu / bc2.to(nu.dtype)
            return m_hat / (torch.sqrt(v_hat + eps_root) + eps), mu, nu

        u, mu, nu = _tree.tree_map(
            leaf, updates, state.mu, state.nu, names=["state.mu", "state.nu"], n_out=3
        )
        return u, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_adadelta(rho=0.9, eps=1e-6) -> GradientTransformation:
    """AdaDelta's direction, as optax: ``g * sqrt(E[dx^2] + eps) / sqrt(E[g^2] + eps)``, then
    ``E[dx^2]`` is updated with it.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_adadelta(rho=0.0, eps=1.0)
        >>> tx.update({"w": torch.tensor([0.0])}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([0.])}
    """
    rho = check_scalar(rho, "rho", 0.0, 1.0)
    eps = check_scalar(eps, "eps", 0.0)

    def init(params):
        return ScaleByAdaDeltaState(_tree.zeros_like(params), _tree.zeros_like(params))

    def update(updates, state, params=None):
        def leaf(g, e_g, e_x):
            e_g = _sq_moment(g, e_g, rho)
            u = torch.sqrt(e_x + eps) / torch.sqrt(e_g + eps) * g
            return u, e_g, _sq_moment(u, e_x, rho)

        u, e_g, e_x = _tree.tree_map(
            leaf, updates, state.e_g, state.e_x, names=["state.e_g", "state.e_x"], n_out=3
        )
        return u, ScaleByAdaDeltaState(e_g, e_x)

    return GradientTransformation(init, update)


# -- transformations that need whole leaves (a collective for sharded ones) -------------------


def _safe(norm: torch.Tensor, min_value) -> torch.Tensor:
    """``norm`` where above ``min_value``, else ``min_value`` (optax ``safe_norm``)."""
    return torch.where(norm <= min_value, _t(min_value).to(norm.dtype), norm)


def _scale_leaves(updates, params, who: str, factors):
    """Each update leaf times a 0-d factor computed from whole leaves:
    ``factors(update leaves, param leaves)`` yields one per leaf."""
    _tree.needs_params(params, who)
    uleaves, spec = _tree.flatten(updates, "updates")
    pleaves = _tree.flatten_like(params, spec, uleaves, "params")
    out = []
    for u, f in zip(uleaves, factors(uleaves, pleaves)):
        loc = _tree.local(u)
        out.append(_tree.rebuild(u, loc * f.to(loc.dtype)))
    return optree.tree_unflatten(spec, out)


def scale_by_trust_ratio(min_norm=0.0, trust_coefficient=1.0, eps=0.0) -> GradientTransformation:
    """LARS/LAMB's per-leaf trust ratio: each update times
    ``trust_coefficient * ||param|| / (||update|| + eps)`` (1 where either norm is 0), as
    optax. The norms are of the whole leaf: a sharded leaf's squared local norms are summed
    over the mesh axes that shard it (one all_reduce per group of leaves sharded alike).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_trust_ratio()
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> tx.update({"w": torch.tensor([0.0, 1.0])}, tx.init(p), p)[0]
        {'w': tensor([0., 5.])}
    """
    min_norm = check_scalar(min_norm, "min_norm", 0.0)
    trust_coefficient = check_scalar(trust_coefficient, "trust_coefficient")
    eps = check_scalar(eps, "eps", 0.0)

    def update(updates, state, params=None):
        def factors(uleaves, pleaves):
            n = len(uleaves)
            sq = _tree.sq_sums(pleaves + uleaves)
            for i in range(n):
                pn = _safe(torch.sqrt(sq[i]), min_norm)
                un = _safe(torch.sqrt(sq[n + i]), min_norm)
                ratio = trust_coefficient * pn / (un + eps)
                yield torch.where((pn == 0) | (un == 0), torch.ones_like(ratio), ratio)

        return _scale_leaves(updates, params, "scale_by_trust_ratio", factors), state

    return GradientTransformation(init_empty_state, update)


def _block_rms(leaves: list) -> list:
    """Root mean square of each whole leaf (global over shards)."""
    sq = _tree.sq_sums(leaves)
    return [torch.sqrt(s / math.prod(_tree.global_shape(x))) for s, x in zip(sq, leaves)]


def scale_by_param_block_rms(min_scale=1e-3) -> GradientTransformation:
    """Each update times the RMS of its whole param (at least ``min_scale``), as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_param_block_rms()
        >>> p = {"w": torch.tensor([2.0, -2.0])}
        >>> u = tx.update({"w": torch.ones(2)}, tx.init(p), p)[0]
        >>> torch.testing.assert_close(u["w"], torch.tensor([2.0, 2.0]))  # RMS 2, up to rounding
    """
    min_scale = check_scalar(min_scale, "min_scale", 0.0)

    def update(updates, state, params=None):
        def factors(uleaves, pleaves):
            return [_safe(rms, min_scale) for rms in _block_rms(pleaves)]

        return _scale_leaves(updates, params, "scale_by_param_block_rms", factors), state

    return GradientTransformation(init_empty_state, update)


def _factored_dims(shape: tuple, factored: bool, min_dim: int):
    """``(d1, d0)``: the second largest and the largest dim (stable order, as numpy's argsort
    of a short shape), or None when the leaf is not factored."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda d: shape[d])
    if shape[order[-2]] < min_dim:
        return None
    return order[-2], order[-1]


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate=0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon=1e-30,
) -> GradientTransformation:
    """Adafactor's scaling, as optax: for a leaf whose two largest dims are at least
    ``min_dim_size_to_factor`` the second moment is kept as a row and a column factor (means
    of ``g**2 + epsilon`` over the largest / second largest dim), otherwise in full; the decay
    at step ``t`` is ``1 - (t + 1 - step_offset) ** -decay_rate`` (in float32, as optax).

    A sharded leaf's means over a dim split across the mesh are a local sum, an all_reduce over
    the mesh axes that split that dim and a division by the global size (exact with uneven
    shards); its factors are sharded like the leaf minus the reduced dim.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_factored_rms(min_dim_size_to_factor=2)
        >>> p = {"w": torch.zeros(2, 3)}
        >>> u, s = tx.update({"w": torch.ones(2, 3)}, tx.init(p), p)
        >>> u["w"]
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    check_bool(factored, "factored")
    decay_rate = check_scalar(decay_rate, "decay_rate")
    if isinstance(step_offset, bool) or not isinstance(step_offset, int):
        raise TypeError(f"step_offset must be an int, got {step_offset!r}")
    if isinstance(min_dim_size_to_factor, bool) or not isinstance(min_dim_size_to_factor, int):
        raise TypeError(f"min_dim_size_to_factor must be an int, got {min_dim_size_to_factor!r}")
    epsilon = check_scalar(epsilon, "epsilon", 0.0)

    def dims(x):
        return _factored_dims(_tree.global_shape(x), factored, min_dim_size_to_factor)

    def placeholder(t):
        return torch.zeros((1,), dtype=t.dtype, device=t.device)

    def init(params):
        leaves, spec = _tree.flatten(params, "params")
        rows, cols, vs = [], [], []
        for x in leaves:
            t = _tree.local(x)
            d = dims(x)
            if d is None:
                rows.append(placeholder(t))
                cols.append(placeholder(t))
                vs.append(_tree.rebuild(x, torch.zeros_like(t)))
            else:
                d1, d0 = d
                rows.append(_tree.drop_dim(x, d0, torch.zeros_like(t.sum(d0))))
                cols.append(_tree.drop_dim(x, d1, torch.zeros_like(t.sum(d1))))
                vs.append(placeholder(t))
        unflat = lambda ls: optree.tree_unflatten(spec, ls)  # noqa: E731
        return FactoredState(_tree.count0(), unflat(rows), unflat(cols), unflat(vs))

    def update(updates, state, params=None):
        _tree.needs_params(params, "scale_by_factored_rms")
        uleaves, spec = _tree.flatten(updates, "updates")
        pleaves = _tree.flatten_like(params, spec, uleaves, "params")
        rows = spec.flatten_up_to(state.v_row)
        cols = spec.flatten_up_to(state.v_col)
        vs = spec.flatten_up_to(state.v)
        t = (state.count - step_offset + 1).to(torch.float32)
        beta = 1.0 - t ** (-decay_rate)
        out, new_rows, new_cols, new_vs = [], [], [], []
        for x, p, row, col, v in zip(uleaves, pleaves, rows, cols, vs):
            g = _tree.local(x)
            b = beta.to(g.dtype)
            sq = g * g + epsilon
            d = dims(p)
            if d is None:
                nv = torch.lerp(_tree.local(v), sq, 1 - b)
                out.append(_tree.rebuild(x, g * torch.rsqrt(nv)))
                new_rows.append(row)
                new_cols.append(col)
                new_vs.append(_tree.rebuild(v, nv))
                continue
            d1, d0 = d
            nrow = torch.lerp(_tree.local(row), _tree.dim_mean(x, sq, d0), 1 - b)
            ncol = torch.lerp(_tree.local(col), _tree.dim_mean(x, sq, d1), 1 - b)
            row_leaf = _tree.drop_dim(x, d0, nrow)
            reduced_d1 = d1 - 1 if d1 > d0 else d1
            row_col_mean = _tree.dim_mean(row_leaf, nrow, reduced_d1, keepdim=True)
            row_factor = torch.rsqrt(nrow / row_col_mean)
            upd = g * row_factor.unsqueeze(d0) * torch.rsqrt(ncol).unsqueeze(d1)
            out.append(_tree.rebuild(x, upd))
            new_rows.append(row_leaf)
            new_cols.append(_tree.drop_dim(x, d1, ncol))
            new_vs.append(v)
        unflat = lambda ls: optree.tree_unflatten(spec, ls)  # noqa: E731
        return unflat(out), FactoredState(
            state.count + 1, unflat(new_rows), unflat(new_cols), unflat(new_vs)
        )

    return GradientTransformation(init, update)


def zero_nans() -> GradientTransformation:
    """Replaces NaNs in the updates by 0 and records, per leaf, whether it had any (over all
    of a sharded leaf's shards: every rank records the same), as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.zero_nans()
        >>> u, s = tx.update({"w": torch.tensor([1.0, float("nan")])}, tx.init({"w": torch.zeros(2)}))
        >>> u["w"], bool(s.found_nan["w"])
        (tensor([1., 0.]), True)
    """

    def init(params):
        leaves, spec = _tree.flatten(params, "params")
        return ZeroNansState(
            optree.tree_unflatten(spec, [torch.zeros((), dtype=torch.bool) for _ in leaves])
        )

    def update(updates, state, params=None):
        leaves, spec = _tree.flatten(updates, "updates")
        counts = _tree.per_leaf_sums(leaves, lambda t: torch.isnan(t).sum())
        found = optree.tree_unflatten(spec, [c > 0 for c in counts])
        out = _tree.tree_map(lambda u: torch.where(torch.isnan(u), 0.0, u), updates)
        return out, ZeroNansState(found)

    return GradientTransformation(init, update)


# -- optax's remaining building blocks ------------------------------------------------------------


def scale_by_novograd(
    b1=0.9, b2=0.25, eps=1e-8, eps_root=0.0, weight_decay=0.0
) -> GradientTransformation:
    """NovoGrad's direction, as optax: per leaf, ``nu`` the moving average (``b2``) of the
    squared norm of the whole leaf's gradient (the first step: that norm), and
    ``mu = b1 * mu + g / (sqrt(nu + eps_root) + eps) + weight_decay * param``. A sharded
    leaf's norm is over every shard (one all_reduce per group of leaves sharded alike).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_novograd(eps=0.0)
        >>> p = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(p), p)[0]
        {'w': tensor([0.6000, 0.8000])}
    """
    b1, b2, eps, eps_root = _adam_checks(b1, b2, eps, eps_root)
    weight_decay = check_scalar(weight_decay, "weight_decay", 0.0)

    def init(params):
        leaves, spec = _tree.flatten(params, "params")
        nu = [torch.zeros((), dtype=_tree.local(x).dtype) for x in leaves]
        return ScaleByNovogradState(_tree.count0(), _tree.zeros_like(params), spec.unflatten(nu))

    def update(updates, state, params=None):
        _tree.needs_params(params, "scale_by_novograd")
        count = state.count + 1
        leaves, spec = _tree.flatten(updates, "updates")
        pleaves = _tree.flatten_like(params, spec, leaves, "params")
        mus = _tree.flatten_like(state.mu, spec, leaves, "state.mu", "updates")
        sq = _tree.per_leaf_sums(leaves, lambda t: (t * t).sum())
        first = count == 1
        out, nus = [], []
        for x, p, m, n, s in zip(leaves, pleaves, mus, spec.flatten_up_to(state.nu), sq):
            n = torch.where(first, s.to(n.dtype), _moment(s.to(n.dtype), n, b2))
            g = _tree.local(x)
            add = g / (torch.sqrt(n + eps_root) + eps).to(g.dtype) + weight_decay * _tree.local(p)
            out.append(_tree.rebuild(x, torch.where(first, add, b1 * _tree.local(m) + add)))
            nus.append(n)
        mu = spec.unflatten(out)
        return mu, ScaleByNovogradState(count, mu, spec.unflatten(nus))

    return GradientTransformation(init, update)


def _others(d: int, ndim: int) -> list[int]:
    return [e for e in range(ndim) if e != d]


def scale_by_sm3(b1=0.9, b2=1.0, eps=1e-8) -> GradientTransformation:
    """SM3's direction, as optax: per leaf one accumulator vector per dim; the accumulator of
    an element is ``c * g**2 + b2 * min`` over its dims' vectors (``c = 1 - b2``, or 1 when
    ``b2 == 1``), the update ``g / sqrt(acc + eps)`` (0 where ``acc == 0``) averaged with
    momentum ``b1``, and each dim's vector becomes the max of ``acc`` over the other dims.
    A sharded leaf's vectors are laid out like their dim; the max over dims split across the
    mesh is one pmax per vector. 1-D leaves keep ``acc`` whole.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_sm3(b1=0.0, eps=0.0)
        >>> p = {"w": torch.zeros(1, 2)}
        >>> tx.update({"w": torch.tensor([[2.0, -3.0]])}, tx.init(p))[0]
        {'w': tensor([[ 1., -1.]])}
    """
    b1 = check_scalar(b1, "b1", 0.0, 1.0)
    b2 = check_scalar(b2, "b2", 0.0, 1.0)
    eps = check_scalar(eps, "eps", 0.0)
    c0 = (
        torch.where(b2 == 1.0, 1.0, 1 - b2)
        if isinstance(b2, torch.Tensor)
        else (1.0 if b2 == 1.0 else 1 - b2)
    )

    def vectors(x, t):
        return [_tree.dim_leaf(x, d, torch.zeros_like(t.sum(_others(d, t.ndim))))
                for d in range(t.ndim)]  # fmt: skip

    def init(params):
        leaves, spec = _tree.flatten(params, "params")
        mu = spec.unflatten([vectors(x, _tree.local(x)) for x in leaves])
        return ScaleBySM3State(mu, _tree.zeros_like(params))

    def update(updates, state, params=None):
        leaves, spec = _tree.flatten(updates, "updates")
        nus = _tree.flatten_like(state.nu, spec, leaves, "state.nu")
        out, new_mu = [], []
        for x, vs, nu in zip(leaves, spec.flatten_up_to(state.mu), nus):
            g = _tree.local(x)
            vs = [_tree.local(v) for v in vs]
            if g.ndim < 2:
                prior = vs[0]
            else:
                shaped = [v.reshape([-1 if e == d else 1 for e in range(g.ndim)])
                          for d, v in enumerate(vs)]  # fmt: skip
                prior = functools.reduce(torch.minimum, shaped)
            acc = c0 * g * g + b2 * prior
            up = g * torch.where(acc > 0, torch.rsqrt(acc + eps), 0.0)
            out.append(_tree.rebuild(x, _moment(up, _tree.local(nu), b1)))
            if g.ndim < 2:
                new_mu.append([_tree.rebuild(x, acc)] if g.ndim else [])
            else:
                new_mu.append([_tree.dim_leaf(x, d, _tree.dims_max(x, acc, _others(d, g.ndim)))
                               for d in range(g.ndim)])  # fmt: skip
        nu = spec.unflatten(out)
        return nu, ScaleBySM3State(spec.unflatten(new_mu), nu)

    return GradientTransformation(init, update)


def scale_by_rprop(
    learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0
) -> GradientTransformation:
    """Rprop's direction, as optax: each element's step size grows by ``eta_plus`` while its
    gradient keeps its sign and shrinks by ``eta_minus`` when it flips (clamped to
    ``[min_step_size, max_step_size]``). As optax, the update is the *previous* step's
    ``size * sign(g)`` (so the first update is 0), and 0 after a flip.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_rprop(0.1)
        >>> p = {"w": torch.zeros(1)}
        >>> u, s = tx.update({"w": torch.tensor([2.0])}, tx.init(p))
        >>> tx.update({"w": torch.tensor([1.0])}, s)[0]
        {'w': tensor([0.1000])}
    """
    learning_rate = check_scalar(learning_rate, "learning_rate", 0.0)
    eta_minus = check_scalar(eta_minus, "eta_minus", 0.0)
    eta_plus = check_scalar(eta_plus, "eta_plus", 0.0)
    min_step_size = check_scalar(min_step_size, "min_step_size", 0.0)
    max_step_size = check_scalar(max_step_size, "max_step_size", 0.0)

    def init(params):
        return ScaleByRpropState(_tree.full_like(params, learning_rate), _tree.zeros_like(params))

    def update(updates, state, params=None):
        def leaf(g, size, prev):
            s = g * prev
            grown = torch.where(s > 0, size * eta_plus, size * eta_minus)  # scalars stay exact
            size = torch.where(s == 0, size, torch.clamp(grown, min_step_size, max_step_size))
            new_prev = torch.where(s < 0, 0.0, size * torch.sign(g))
            return torch.where(s < 0, 0.0, prev), size, new_prev

        names = ["state.step_sizes", "state.prev_updates"]
        u, sizes, prev = _tree.tree_map(
            leaf, updates, state.step_sizes, state.prev_updates, names=names, n_out=3
        )
        return u, ScaleByRpropState(sizes, prev)

    return GradientTransformation(init, update)


def scale_by_optimistic_gradient(alpha=1.0, beta=1.0) -> GradientTransformation:
    """Optimistic gradient, as optax: ``(alpha + beta) * g - beta * g_prev`` (``g_prev = g`` on
    the first step).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_optimistic_gradient()
        >>> p = {"w": torch.zeros(1)}
        >>> u, s = tx.update({"w": torch.tensor([1.0])}, tx.init(p))
        >>> tx.update({"w": torch.tensor([3.0])}, s)[0]
        {'w': tensor([5.])}
    """
    alpha = check_scalar(alpha, "alpha")
    beta = check_scalar(beta, "beta")

    def init(params):
        return ScaleByOptimisticGradientState(
            torch.ones((), dtype=torch.bool), _tree.zeros_like(params)
        )

    def update(updates, state, params=None):
        first = state.is_initial_step

        def leaf(g, prev):
            return (alpha + beta) * g - beta * torch.where(first, g, prev)

        u = _tree.tree_map(
            leaf, updates, state.previous_gradient, names=["state.previous_gradient"]
        )
        return u, ScaleByOptimisticGradientState(torch.zeros((), dtype=torch.bool), updates)

    return GradientTransformation(init, update)


_F64_EPS = torch.finfo(torch.float64).eps  # optax's jnp.finfo(float).eps


def scale_by_polyak(
    f_min=0.0, max_learning_rate=1.0, eps=0.0, variant: str = "sps"
) -> GradientTransformation:
    """Polyak's step size, as optax: updates times ``min((value - f_min) / (||g||^2 + eps),
    max_learning_rate)`` (``relu`` of the gap with ``variant="sps+"``; 0 when the norm is 0).
    ``update`` takes the loss as ``value=``; ``||g||`` is the global norm over every leaf and
    shard.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_polyak()
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init(None), value=1.0)[0]
        {'w': tensor([0.5000])}
    """
    f_min = check_scalar(f_min, "f_min")
    max_learning_rate = check_scalar(max_learning_rate, "max_learning_rate", 0.0)
    eps = check_scalar(eps, "eps", 0.0)
    if variant not in ("sps", "sps+"):
        raise ValueError(f"scale_by_polyak: variant must be 'sps' or 'sps+', got {variant!r}")

    def update(updates, state, params=None, *, value, **extra_args):
        leaves, spec = _tree.flatten(updates, "updates")
        sq = torch.stack(_tree.sq_sums(leaves)).sum() if leaves else torch.zeros(())
        gap = torch.as_tensor(value, dtype=sq.dtype) - f_min  # a float loss: not via float32
        if variant == "sps+":
            gap = torch.relu(gap)
        step = torch.where(
            sq + eps <= _F64_EPS, 0.0, torch.clamp(gap / (sq + eps), max=max_learning_rate)
        )
        return _tree.tree_map(lambda u: u * step.to(u.dtype), updates), state

    return GradientTransformation(init_empty_state, update)


_MIX = 0x9E3779B97F4A7C15  # splitmix64's increment: decorrelates nearby (key, step, leaf) seeds


def _noise_seed(key: int, count: int, leaf: int) -> int:
    return ((key * _MIX + count) * _MIX + leaf) % (1 << 63)


def add_noise(eta, gamma, key: int = 0) -> GradientTransformation:
    """Adds Gaussian noise of variance ``eta / t**gamma`` at step ``t`` (from 1), as optax.

    The noise of leaf ``i`` at step ``t`` is drawn from a ``torch.Generator`` seeded with a
    hash of ``(key, t, i)``, over the leaf's *global* shape; each rank keeps its block. So the
    noise is the same for every layout of the params (sharded equals dense, bit for bit) and
    for every run with the same key; it is not JAX's stream (optax splits a PRNG key). Each
    rank draws the whole leaf (no communication; ``numel`` random numbers per rank), and the
    step reads the counter and key as Python ints (a graph break under ``torch.compile``).

    Args:
        eta: base variance (>= 0).
        gamma: decay exponent of the variance.
        key: an int seed.

    Returns:
        A :class:`GradientTransformation` (state: :class:`AddNoiseState`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.add_noise(0.0, 0.55)
        >>> tx.update({"w": torch.ones(2)}, tx.init(None))[0]
        {'w': tensor([1., 1.])}
    """
    eta = check_scalar(eta, "eta", 0.0)
    gamma = check_scalar(gamma, "gamma")
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"add_noise: key must be an int, got {key!r}")

    def init(params):
        return AddNoiseState(_tree.count0(), torch.tensor(key, dtype=torch.int64))

    def update(updates, state, params=None):
        count = state.count + 1
        std = torch.sqrt(eta / _tree.as_float(count) ** gamma)
        leaves, spec = _tree.flatten(updates, "updates")
        k, c = int(state.rng_key), int(count)
        out = []
        for i, x in enumerate(leaves):
            t = _tree.local(x)
            gen = torch.Generator(device=t.device).manual_seed(_noise_seed(k, c, i))
            full = torch.randn(_tree.global_shape(x), generator=gen, device=t.device, dtype=t.dtype)
            out.append(_tree.rebuild(x, _axpy(t, std.to(t.dtype), _tree.global_slice(x, full))))
        return spec.unflatten(out), AddNoiseState(count, state.rng_key)

    return GradientTransformation(init, update)


def centralize() -> GradientTransformation:
    """Gradient centralization, as optax: each leaf of 2 or more dims minus its mean over all
    dims but the first (a sharded leaf's mean over every shard: one all_reduce when those dims
    are split across the mesh).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.centralize()
        >>> tx.update({"w": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])}, tx.init(None))[0]
        {'w': tensor([[-1.,  0.,  1.],
                [-1.,  0.,  1.]])}
    """

    def update(updates, state, params=None):
        leaves, spec = _tree.flatten(updates, "updates")
        out = []
        for x in leaves:
            t = _tree.local(x)
            if t.ndim > 1:
                dims = range(1, t.ndim)
                n = math.prod(_tree.global_shape(x)[1:])
                t = t - _tree.dims_sum(x, t, dims, keepdim=True) / n
            out.append(_tree.rebuild(x, t))
        return spec.unflatten(out), state

    return GradientTransformation(init_empty_state, update)


def apply_every(k: int = 1) -> GradientTransformation:
    """Accumulates updates and emits their sum every ``k`` steps (zeros in between), as optax.
    Unlike :class:`MultiSteps`, the transformations before it in a chain still step every time.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.apply_every(2)
        >>> u, s = tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))
        >>> u["w"], tx.update({"w": torch.ones(1)}, s)[0]["w"]
        (tensor([0.]), tensor([2.]))
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"apply_every: k must be an int >= 1, got {k!r}")

    def init(params):
        return ApplyEveryState(_tree.count0(), _tree.zeros_like(params))

    def update(updates, state, params=None):
        c = state.count % k
        acc = _tree.tree_map(
            lambda g, a: torch.where(c != 0, a, 0.0) + g, updates, state.grad_acc,
            names=["state.grad_acc"],
        )  # fmt: skip
        emit = c == k - 1
        out = _tree.tree_map(lambda a: torch.where(emit, a, 0.0), acc)
        return out, ApplyEveryState((state.count + 1) % k, acc)

    return GradientTransformation(init, update)


def keep_params_nonnegative() -> GradientTransformation:
    """Clips updates so that no param goes below 0 (``-param`` where ``param + update < 0``),
    as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.keep_params_nonnegative()
        >>> p = {"w": torch.tensor([1.0, 1.0])}
        >>> tx.update({"w": torch.tensor([-2.0, 0.5])}, tx.init(p), p)[0]
        {'w': tensor([-1.0000,  0.5000])}
    """

    def update(updates, state, params=None):
        _tree.needs_params(params, "keep_params_nonnegative")
        u = _tree.tree_map(
            lambda u, p: torch.where(p + u < 0.0, -p, u), updates, params, names=["params"]
        )
        return u, state

    return GradientTransformation(init_empty_state, update)


def _at(mem: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``mem[idx]`` for a 0-d index tensor (no Python int: traceable)."""
    return mem.index_select(0, idx.reshape(1)).squeeze(0)


def _set_at(mem: torch.Tensor, idx: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``mem`` with ``mem[idx] = value``, out of place."""
    return mem.index_copy(0, idx.reshape(1), value.unsqueeze(0).to(mem.dtype))


def scale_by_lbfgs(
    memory_size: int = 10, scale_init_precond: bool = True
) -> GradientTransformation:
    """L-BFGS's direction, as optax: the updates times the inverse-Hessian approximation built
    from the last ``memory_size`` differences of params and updates (Nocedal & Wright's
    two-loop recursion), scaled by ``<dw, du> / <du, du>`` of the last pair
    (``scale_init_precond``; the first step: ``min(1, 1 / ||g||)``).

    The memory stacks ``memory_size`` copies of each leaf on a new leading dim, laid out like
    the leaf (sharded params: sharded memory). Every inner product is over every leaf and
    shard: the recursion's ``2 * memory_size`` dot products each end in one scalar all_reduce
    per group of leaves sharded alike (they depend on each other, so they cannot be batched),
    plus three for the new pair and the scale. Chain it with a line search
    (:func:`scale_by_zoom_linesearch`) or use :func:`lbfgs`.

    Args:
        memory_size: pairs kept (>= 1).
        scale_init_precond: scale the initial inverse Hessian as above (else identity).

    Returns:
        A :class:`GradientTransformation` (state: :class:`ScaleByLBFGSState`); ``update``
        needs ``params``.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_lbfgs()
        >>> p = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(p), p)[0]  # first: g / ||g||
        {'w': tensor([0.6000, 0.8000])}
    """
    if isinstance(memory_size, bool) or not isinstance(memory_size, int) or memory_size < 1:
        raise ValueError(f"scale_by_lbfgs: memory_size must be an int >= 1, got {memory_size!r}")
    check_bool(scale_init_precond, "scale_init_precond")
    m = memory_size

    def init(params):
        leaves, spec = _tree.flatten(params, "params")
        mem = [_tree.stacked(x, m, _tree.local(x).new_zeros((m, *_tree.local(x).shape))) for x in leaves]  # fmt: skip
        dtype = _tree.promoted_dtype(leaves)
        return ScaleByLBFGSState(
            _tree.count0(),
            _tree.zeros_like(params),
            _tree.zeros_like(params),
            spec.unflatten(mem),
            spec.unflatten(list(mem)),
            torch.zeros(m, dtype=dtype),
        )

    def update(updates, state, params=None):
        _tree.needs_params(params, "scale_by_lbfgs")
        leaves, spec = _tree.flatten(updates, "updates")
        like = lambda tree, name: _tree.flatten_like(tree, spec, leaves, name)  # noqa: E731
        pleaves, old_p, old_u = like(params, "params"), like(state.params, "state.params"), like(state.updates, "state.updates")  # fmt: skip
        dw_mem = spec.flatten_up_to(state.diff_params_memory)
        du_mem = spec.flatten_up_to(state.diff_updates_memory)
        count = state.count
        started = count > 0
        idx, prev_idx = count % m, (count - 1) % m
        dw = [_tree.rebuild(p, torch.where(started, _tree.local(p) - _tree.local(q), 0.0)) for p, q in zip(pleaves, old_p)]  # fmt: skip
        du = [_tree.rebuild(u, torch.where(started, _tree.local(u) - _tree.local(q), 0.0)) for u, q in zip(leaves, old_u)]  # fmt: skip
        dot = _tree.vdot(du, dw)
        weight = torch.where(started & (dot != 0), 1 / torch.where(dot == 0, 1.0, dot), 0.0)
        dw_mem = [_tree.rebuild(x, _set_at(_tree.local(x), prev_idx, _tree.local(d))) for x, d in zip(dw_mem, dw)]  # fmt: skip
        du_mem = [_tree.rebuild(x, _set_at(_tree.local(x), prev_idx, _tree.local(d))) for x, d in zip(du_mem, du)]  # fmt: skip
        rhos = _set_at(state.weights_memory, prev_idx, weight)
        if scale_init_precond:
            den = _tree.vdot(du, du)
            gamma = torch.where(den > 0, dot / torch.where(den > 0, den, 1.0), 1.0)
            norm = torch.sqrt(_tree.vdot(leaves, leaves)).detach()
            gamma = torch.where(started, gamma, torch.clamp(1 / norm, max=1.0))
        else:
            gamma = torch.ones((), dtype=rhos.dtype)

        def at(mem, i):
            return [_tree.rebuild(x, _at(_tree.local(x), i)) for x in mem]

        def axpy(vec, a, d):
            return [_tree.rebuild(v, _tree.local(v) + a.to(_tree.local(v).dtype) * _tree.local(e)) for v, e in zip(vec, d)]  # fmt: skip

        order = [(idx + k) % m for k in range(m)]
        vec, alphas = list(leaves), {}
        for k in reversed(range(m)):
            i = order[k]
            alphas[k] = _at(rhos, i) * _tree.vdot(at(dw_mem, i), vec)
            vec = axpy(vec, -alphas[k], at(du_mem, i))
        vec = [_tree.rebuild(v, _tree.local(v) * gamma.to(_tree.local(v).dtype)) for v in vec]
        for k in range(m):
            i = order[k]
            beta = _at(rhos, i) * _tree.vdot(at(du_mem, i), vec)
            vec = axpy(vec, alphas[k] - beta, at(dw_mem, i))
        unflat = spec.unflatten
        return unflat(vec), ScaleByLBFGSState(
            count + 1, params, updates, unflat(dw_mem), unflat(du_mem), rhos
        )

    return GradientTransformation(init, update)


def scale_by_adan(b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=0.0) -> GradientTransformation:
    """Adan's direction (Xie et al. 2022), as optax: moments of the gradient ``m`` (``b1``),
    of its change ``v`` (``b2``) and of ``(g + (1 - b2) * (g - g_prev))**2`` ``n`` (``b3``),
    bias-corrected; the update ``(m_hat + (1 - b2) * v_hat) / (sqrt(n_hat + eps_root) + eps)``.
    Element-wise: no communication.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.scale_by_adan()
        >>> u = tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))[0]
        >>> round(u["w"].item(), 6)
        1.0
    """
    b1 = check_scalar(b1, "b1", 0.0, 1.0, open_hi=True)
    b2 = check_scalar(b2, "b2", 0.0, 1.0, open_hi=True)
    b3 = check_scalar(b3, "b3", 0.0, 1.0, open_hi=True)
    eps = check_scalar(eps, "eps", 0.0)
    eps_root = check_scalar(eps_root, "eps_root", 0.0)

    def init(params):
        z = _tree.zeros_like
        return ScaleByAdanState(z(params), z(params), z(params), z(params), _tree.count0())

    def update(updates, state, params=None):
        first = state.t == 0
        t = state.t + 1
        bc1, bc2, bc3 = _bias(b1, t), _bias(b2, t), _bias(b3, t)

        def leaf(g, m, v, n, g_prev):
            diff = torch.where(first, 0.0, g - g_prev)
            m, v = _moment(g, m, b1), _moment(diff, v, b2)
            n = _sq_moment(g + (1 - b2) * diff, n, b3)
            u = m / bc1.to(m.dtype) + (1 - b2) * (v / bc2.to(v.dtype))
            return u / (torch.sqrt(n / bc3.to(n.dtype) + eps_root) + eps), m, v, n

        names = ["state.m", "state.v", "state.n", "state.g"]
        u, m, v, n = _tree.tree_map(
            leaf, updates, state.m, state.v, state.n, state.g, names=names, n_out=4
        )
        return u, ScaleByAdanState(m, v, n, updates, t)

    return GradientTransformation(init, update)
