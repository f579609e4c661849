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

import math

import optree
import torch

from . import _tree
from ._tree import check_bool, check_scalar, check_schedule
from .base import (
    EmaState,
    EmptyState,
    FactoredState,
    GradientTransformation,
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByRmsState,
    ScaleByRmsWithCountState,
    ScaleByRssState,
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    ScaleByScheduleState,
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
    "scale_by_trust_ratio",
    "scale_by_param_block_rms",
    "scale_by_factored_rms",
    "zero_nans",
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
