"""The optax differential cases, one table for both sides.

``tools/record_optax.py`` builds every case with optax 0.2.8 and records its trajectory in
``tests/data/optax_reference.npz``; ``tests/optim/test_optax.py`` builds the same case with
``fshard.optim`` and compares. A case is ``lib -> GradientTransformation`` (a schedule:
``lib -> schedule``), where :class:`Lib` gives the library module and the few calls whose
spelling differs between the two. This module imports neither torch nor JAX: the recorder runs
it in its own environment.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

STEPS = 20
#: name -> shape. On 2 ranks the tests shard w and u over rows (3 + 2), v over columns (4 + 3).
SHAPES = {"w": (5, 3), "v": (4, 7), "u": (5, 8), "b": (6,)}
NAMES = list(SHAPES)
NAN_STEPS = (4, 9, 10)  # steps whose gradients get a NaN (and step 10 an inf) in "grads_nan"
MASK = {"w": True, "v": False, "u": True, "b": False}


class Lib(NamedTuple):
    """One library's side of the table."""

    #: ``optax`` or ``fshard.optim``
    o: ModuleType
    #: keywords of ``clip_by_global_norm`` giving optax's ``max_norm / norm`` (fshard: ``eps=0``)
    clip: dict
    #: extra keywords of ``adafactor`` with momentum (optax: a float64 momentum)
    adafactor: dict
    #: ``(inner, k) -> GradientTransformation`` accumulating ``k`` steps (``MultiSteps``)
    multi_steps: Callable[[Any, int], Any]
    #: the array module (``jax.numpy`` or ``torch``) the objective is written with
    np: ModuleType
    #: where ``schedule_free_*`` and ``prodigy`` live (``optax.contrib``, ``fshard.optim``)
    contrib: ModuleType


#: steps of the OBJECTIVE_CASES (driven by the objective's own gradients, not the recorded ones)
OBJECTIVE_STEPS = 8


def objective(L: Lib, params) -> Any:
    """A smooth convex objective for the line-search cases: log-cosh around 0.3 plus a small
    quartic, summed over every leaf (global-view code: fshard evaluates it on sharded params)."""
    total = 0.0
    for k in NAMES:
        x = params[k]
        total = total + L.np.log(L.np.cosh(x - 0.3)).sum() + 0.05 * (x**4).sum()
    return total


def _schedule(L: Lib):
    return L.o.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS, end_value=1e-3)


CASES: dict[str, Callable[[Lib], Any]] = {
    "sgd": lambda L: L.o.sgd(0.1),
    "sgd_momentum": lambda L: L.o.sgd(0.1, momentum=0.9),
    "sgd_nesterov": lambda L: L.o.sgd(0.05, momentum=0.8, nesterov=True),
    "adam": lambda L: L.o.adam(1e-2),
    "adam_eps_root": lambda L: L.o.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-4),
    "adam_nesterov": lambda L: L.o.adam(1e-2, nesterov=True),
    "nadamw": lambda L: L.o.nadamw(1e-2, weight_decay=0.1),
    "adamw": lambda L: L.o.adamw(1e-2, weight_decay=0.1),
    "adamw_mask": lambda L: L.o.adamw(1e-2, weight_decay=0.1, mask=MASK),
    "adamw_schedule": lambda L: L.o.adamw(_schedule(L), weight_decay=0.05),
    "radam": lambda L: L.o.radam(1e-2),
    "lion": lambda L: L.o.lion(1e-3, weight_decay=0.01),
    "lamb": lambda L: L.o.lamb(1e-2, weight_decay=0.01),
    "lars": lambda L: L.o.lars(0.1, weight_decay=1e-3),
    "rmsprop": lambda L: L.o.rmsprop(1e-2),
    "rmsprop_nesterov": lambda L: L.o.rmsprop(
        1e-2, momentum=0.9, nesterov=True, eps_in_sqrt=False, bias_correction=True
    ),
    "rmsprop_centered": lambda L: L.o.rmsprop(1e-2, centered=True, momentum=0.5),
    "adagrad": lambda L: L.o.adagrad(0.1),
    "adafactor": lambda L: L.o.adafactor(1e-2, min_dim_size_to_factor=2),
    "adafactor_momentum": lambda L: L.o.adafactor(
        1e-2,
        min_dim_size_to_factor=2,
        momentum=0.9,
        weight_decay_rate=1e-3,
        clipping_threshold=None,
        multiply_by_parameter_scale=False,
        **L.adafactor,
    ),
    "clip_sgd": lambda L: L.o.chain(L.o.clip_by_global_norm(1.0, **L.clip), L.o.sgd(0.1)),
    "clip_block_rms": lambda L: L.o.chain(L.o.clip_by_block_rms(0.5), L.o.sgd(0.1)),
    "multisteps_adam": lambda L: L.multi_steps(L.o.adam(1e-2), 3),
    "inject_adamw": lambda L: L.o.inject_hyperparams(L.o.adamw)(
        learning_rate=_schedule(L), weight_decay=0.1
    ),
    "ema_sgd": lambda L: L.o.chain(L.o.ema(0.9), L.o.sgd(0.1)),
    "apply_if_finite": lambda L: L.o.apply_if_finite(L.o.adam(1e-2), max_consecutive_errors=1),
    "zero_nans_sgd": lambda L: L.o.chain(L.o.zero_nans(), L.o.sgd(0.1)),
    "adamax": lambda L: L.o.adamax(1e-2),
    "adamaxw": lambda L: L.o.adamaxw(1e-2, b1=0.8, weight_decay=0.1, mask=MASK),
    "amsgrad": lambda L: L.o.amsgrad(1e-2, b2=0.9),
    "amsgrad_raw": lambda L: L.o.amsgrad(
        1e-2, eps_root=1e-6, bias_correction_mu=False, bias_correction_nu=False
    ),
    "adabelief": lambda L: L.o.adabelief(1e-2),
    "adabelief_nesterov": lambda L: L.o.adabelief(1e-2, b1=0.8, eps=1e-8, nesterov=True),
    "yogi": lambda L: L.o.yogi(1e-2, eps=1e-4),
    "adadelta": lambda L: L.o.adadelta(0.5, rho=0.8, weight_decay=0.01),
    "novograd": lambda L: L.o.novograd(1e-2, weight_decay=0.01),
    "novograd_eps_root": lambda L: L.o.novograd(1e-2, b1=0.8, b2=0.5, eps=1e-3, eps_root=1e-4),
    "sm3": lambda L: L.o.sm3(0.1),
    "sm3_b2": lambda L: L.o.chain(L.o.scale_by_sm3(0.5, 0.9, 1e-6), L.o.scale(-0.1)),
    "rprop": lambda L: L.o.rprop(1e-2, max_step_size=0.05),
    "sign_sgd": lambda L: L.o.sign_sgd(1e-2),
    "optimistic_gd": lambda L: L.o.optimistic_gradient_descent(1e-2, alpha=0.8, beta=0.5),
    "polyak_sgd": lambda L: L.o.polyak_sgd(max_learning_rate=0.1, f_min=0.1, eps=1e-3),
    "polyak_sgd_plus": lambda L: L.o.polyak_sgd(0.05, scaling=0.5, f_min=1.0, variant="sps+"),
    "adaptive_grad_clip": lambda L: L.o.chain(L.o.adaptive_grad_clip(0.05), L.o.sgd(0.1)),
    "centralize": lambda L: L.o.chain(L.o.centralize(), L.o.sgd(0.1)),
    "freeze": lambda L: L.o.chain(L.o.freeze(MASK), L.o.adam(1e-2)),
    "selective_transform": lambda L: L.o.selective_transform(L.o.adam(1e-2), freeze_mask=MASK),
    "apply_every": lambda L: L.o.chain(L.o.adam(1e-2), L.o.apply_every(3)),
    "keep_params_nonnegative": lambda L: L.o.chain(L.o.sgd(0.5), L.o.keep_params_nonnegative()),
    "adan": lambda L: L.o.adan(1e-2, weight_decay=0.01),
    "adan_eps_root0": lambda L: L.o.adan(1e-2, b1=0.9, b2=0.8, b3=0.95, eps_root=0.0),
    "schedule_free_adamw": lambda L: L.contrib.schedule_free_adamw(1e-2, weight_decay=1e-3),
    "schedule_free_adamw_warmup": lambda L: L.contrib.schedule_free_adamw(
        2e-2, warmup_steps=5, b1=0.8, weight_lr_power=1.0
    ),
    "schedule_free_sgd": lambda L: L.contrib.schedule_free_sgd(0.1, weight_decay=1e-3),
    "prodigy": lambda L: L.contrib.prodigy(),
    "prodigy_safeguard": lambda L: L.contrib.prodigy(
        0.5, betas=(0.8, 0.99), weight_decay=0.01, safeguard_warmup=True, estim_lr0=1e-3
    ),
}
#: cases fed the gradients with NaNs/infs ("grads_nan")
NAN_CASES = {"apply_if_finite", "zero_nans_sgd"}
#: cases whose ``update`` takes the loss as ``value=`` (the recorded "values", one per step)
VALUE_CASES = {"polyak_sgd", "polyak_sgd_plus"}
#: per_example_global_norm_clip's input: the first PER_EXAMPLE steps' gradients stacked as a
#: batch, clipped to this norm (about the median per-example norm: some are clipped)
PER_EXAMPLE, PER_EXAMPLE_CLIP = 4, 9.2

SCHEDULES: dict[str, Callable[[Lib], Any]] = {
    "exponential_decay": lambda L: L.o.exponential_decay(
        1.0, 3, 0.5, transition_begin=2, staircase=True, end_value=0.1
    ),
    "exponential_decay_smooth": lambda L: L.o.exponential_decay(2.0, 4, 0.7),
    "piecewise_constant": lambda L: L.o.piecewise_constant_schedule(1.0, {5: 0.5, 10: 0.1}),
    "polynomial": lambda L: L.o.polynomial_schedule(1.0, 0.1, 2.0, 20, transition_begin=3),
    "cosine_decay": lambda L: L.o.cosine_decay_schedule(1.0, 20, alpha=0.1, exponent=2.0),
    "warmup_cosine": lambda L: L.o.warmup_cosine_decay_schedule(0.0, 1.0, 5, 25, 0.1),
    "warmup_exponential": lambda L: L.o.warmup_exponential_decay_schedule(
        0.0, 1.0, 4, 5, 0.5, staircase=True
    ),
    "piecewise_interpolate_linear": lambda L: L.o.piecewise_interpolate_schedule(
        "linear", 1.0, {4: 2.0, 12: 0.25}
    ),
    "piecewise_interpolate_cosine": lambda L: L.o.piecewise_interpolate_schedule(
        "cosine", 0.5, {6: 3.0, 18: 0.1}
    ),
    "warmup_constant": lambda L: L.o.warmup_constant_schedule(0.1, 1.0, 7),
    "linear_onecycle": lambda L: L.o.linear_onecycle_schedule(25, 2.0),
    "cosine_onecycle": lambda L: L.o.cosine_onecycle_schedule(25, 2.0, pct_start=0.2),
    "sgdr": lambda L: L.o.sgdr_schedule(
        [
            dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=10, end_value=0.1),
            dict(init_value=0.1, peak_value=0.5, warmup_steps=3, decay_steps=15),
        ]
    ),
    "join": lambda L: L.o.join_schedules(
        [L.o.constant_schedule(0.5), L.o.linear_schedule(1.0, 0.0, 10)], [7]
    ),
}

#: cases driven by ``objective``: each step takes ``value=``, ``grad=`` and ``value_fn=``, the
#: value and gradient from ``value_and_grad_from_state`` (or evaluated, with no line search)
OBJECTIVE_CASES: dict[str, Callable[[Lib], Any]] = {
    "lbfgs": lambda L: L.o.lbfgs(),
    "lbfgs_memory3_unscaled": lambda L: L.o.lbfgs(memory_size=3, scale_init_precond=False),
    "lbfgs_no_linesearch": lambda L: L.o.lbfgs(0.1, memory_size=4, linesearch=None),
    "zoom_sgd": lambda L: L.o.chain(
        L.o.sgd(1.0),
        L.o.scale_by_zoom_linesearch(15, max_learning_rate=2.0, curv_rtol=0.5),
    ),
}

#: fs.optim.losses against optax.losses on the recorded "loss_inputs/*" (``x``): logits and
#: predictions (5, 7), integer labels, probabilities, binary labels and targets
LOSS_BATCH, LOSS_CLASSES = 5, 7
LOSSES: dict[str, Callable[[Lib, dict], Any]] = {
    "softmax_cross_entropy": lambda L, x: L.o.losses.softmax_cross_entropy(x["logits"], x["probs"]),
    "softmax_cross_entropy_axis0": lambda L, x: L.o.losses.softmax_cross_entropy(
        x["logits"].T, x["probs"].T, axis=0
    ),
    "softmax_cross_entropy_with_integer_labels": lambda L, x: (
        L.o.losses.softmax_cross_entropy_with_integer_labels(x["logits"], x["labels"])
    ),
    "sigmoid_binary_cross_entropy": lambda L, x: L.o.losses.sigmoid_binary_cross_entropy(
        x["logits"], x["binary"]
    ),
    "squared_error": lambda L, x: L.o.losses.squared_error(x["logits"], x["targets"]),
    "l2_loss": lambda L, x: L.o.losses.l2_loss(x["logits"], x["targets"]),
    "l2_loss_no_targets": lambda L, x: L.o.losses.l2_loss(x["logits"]),
    "huber_loss": lambda L, x: L.o.losses.huber_loss(x["logits"], x["targets"], delta=0.7),
    "cosine_similarity": lambda L, x: L.o.losses.cosine_similarity(
        x["logits"], x["targets"], epsilon=1e-3
    ),
    "cosine_distance": lambda L, x: L.o.losses.cosine_distance(x["logits"], x["targets"]),
    "smooth_labels": lambda L, x: L.o.losses.smooth_labels(x["probs"], 0.1),
}
