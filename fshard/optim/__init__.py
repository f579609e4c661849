"""Optax-style optimizers over pytrees of ShardedArrays (and plain tensors).

A :class:`GradientTransformation` is a NamedTuple of two pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = fs.optim.apply_updates(params, updates)

Laid out as optax: :mod:`~fshard.optim.base` (the interface and the states),
:mod:`~fshard.optim.transform` (the ``scale_by_*`` building blocks),
:mod:`~fshard.optim.alias` (``sgd``, ``adamw``, ... as chains of building blocks),
:mod:`~fshard.optim.combine` (``chain``, ``masked``, ``multi_transform``),
:mod:`~fshard.optim.clipping`, :mod:`~fshard.optim.schedule`,
:mod:`~fshard.optim.wrappers` (``MultiSteps``, ``apply_if_finite``, ``inject_hyperparams``)
and :mod:`~fshard.optim.update` (``apply_updates``, ``step``).

Nothing is ever mutated: every ``update`` returns new tensors, computed leaf by leaf on the
*local* shards with plain torch ops, so the step can be differentiated (meta-learning: the
gradient w.r.t. the learning rate or the initial params through ``apply_updates``), batched
with ``torch.func.vmap`` (a batch of optimizers) and compiled with
``torch.compile(fullgraph=True)`` (step counts stay tensors). The one opt-in exception is
:func:`step` with ``donate=True`` (JAX's ``donate_argnums``): params and state buffers are then
reused in place with ``torch.optim``'s own foreach kernels where the transformation carries a
``donated_step`` (sgd, adam, adamw), which on CPU saves the page faults and memory passes of
fresh parameter-sized tensors every step.

State tensors are ShardedArrays with the parameters' layouts (a sharded param's Adam moments
are sharded the same way), so optimizer memory is sharded with the params and element-wise
transformations never communicate. The transformations that need whole leaves (global norms,
trust ratios, Adafactor's factored moments, NaN checks) reduce over the mesh axes that shard
them, with one small all_reduce per group of leaves sharded alike.

Hyperparameters may be floats, 0-d tensors (differentiable) or *schedules*: callables of the
step count (0 for the first update), e.g. :func:`warmup_cosine_decay_schedule`.

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

from .alias import (
    adafactor,
    adagrad,
    adam,
    adamw,
    lamb,
    lars,
    lion,
    momentum,
    nadam,
    nadamw,
    radam,
    rmsprop,
    sgd,
)
from .base import (
    ApplyIfFiniteState,
    EmaState,
    EmptyState,
    FactoredState,
    GradientTransformation,
    InjectHyperparamsState,
    MaskedState,
    MultiStepsState,
    MultiTransformState,
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
    set_to_zero,
    stateless,
)
from .clipping import clip, clip_by_block_rms, clip_by_global_norm, global_norm
from .combine import chain, masked, multi_transform, partition
from .schedule import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from .transform import (
    add_decayed_weights,
    ema,
    scale,
    scale_by_adam,
    scale_by_factored_rms,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_param_block_rms,
    scale_by_radam,
    scale_by_rms,
    scale_by_rss,
    scale_by_schedule,
    scale_by_sign,
    scale_by_stddev,
    scale_by_trust_ratio,
    trace,
    zero_nans,
)
from .update import apply_updates, step
from .wrappers import MultiSteps, apply_if_finite, inject_hyperparams

__all__ = [
    # base
    "GradientTransformation",
    "EmptyState",
    "ScaleByScheduleState",
    "TraceState",
    "EmaState",
    "ScaleByAdamState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRssState",
    "ScaleByLionState",
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
    # transform
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
    # alias
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
    # combine
    "chain",
    "masked",
    "multi_transform",
    "partition",
    # clipping
    "global_norm",
    "clip_by_global_norm",
    "clip_by_block_rms",
    "clip",
    # schedule
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
    # wrappers
    "MultiSteps",
    "apply_if_finite",
    "inject_hyperparams",
    # update
    "apply_updates",
    "step",
]
