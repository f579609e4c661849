"""Record optax 0.2.8 reference trajectories for tests/test_optim_optax.py (no JAX at test time).

Run with a separate environment that has JAX (CPU) and optax, never the test environment::

    python -m venv /tmp/optaxenv
    /tmp/optaxenv/bin/pip install jax optax==0.2.8 numpy
    /tmp/optaxenv/bin/python tools/record_optax.py

It writes ``tests/data/optax_reference.npz``: the initial params and 20 gradient steps (float64,
JAX x64), each case's params after every step (the params flattened and concatenated in
``NAMES`` order, one row per step) and schedule values for steps 0..29. The cases' fshard
counterparts are in ``tests/test_optim_optax.py`` under the same names.
"""

from __future__ import annotations

import os
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

if optax.__version__ != "0.2.8":
    sys.exit(f"record_optax.py is pinned to optax 0.2.8, found {optax.__version__}")

STEPS = 20
#: name -> shape. On 2 ranks the tests shard w and u over rows (3 + 2), v over columns (4 + 3).
SHAPES = {"w": (5, 3), "v": (4, 7), "u": (5, 8), "b": (6,)}
NAMES = list(SHAPES)
NAN_STEPS = (4, 9, 10)  # steps whose gradients get a NaN (and step 10 an inf) in "grads_nan"


def _inputs():
    rng = np.random.RandomState(0)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(STEPS)]
    nan_grads = [{k: v.copy() for k, v in g.items()} for g in grads]
    for i in NAN_STEPS:
        nan_grads[i]["w"][1, 2] = np.nan
    nan_grads[10]["v"][0, 0] = np.inf
    return params, grads, nan_grads


def _schedule():
    return optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS, end_value=1e-3)


MASK = {"w": True, "v": False, "u": True, "b": False}

CASES = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(0.05, momentum=0.8, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adam_eps_root": lambda: optax.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-4),
    "adam_nesterov": lambda: optax.adam(1e-2, nesterov=True),
    "nadamw": lambda: optax.nadamw(1e-2, weight_decay=0.1),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=MASK),
    "adamw_schedule": lambda: optax.adamw(_schedule(), weight_decay=0.05),
    "radam": lambda: optax.radam(1e-2),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "lamb": lambda: optax.lamb(1e-2, weight_decay=0.01),
    "lars": lambda: optax.lars(0.1, weight_decay=1e-3),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "rmsprop_nesterov": lambda: optax.rmsprop(
        1e-2, momentum=0.9, nesterov=True, eps_in_sqrt=False, bias_correction=True
    ),
    "rmsprop_centered": lambda: optax.rmsprop(1e-2, centered=True, momentum=0.5),
    "adagrad": lambda: optax.adagrad(0.1),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "adafactor_momentum": lambda: optax.adafactor(
        1e-2,
        min_dim_size_to_factor=2,
        momentum=0.9,
        dtype_momentum=jnp.float64,
        weight_decay_rate=1e-3,
        clipping_threshold=None,
        multiply_by_parameter_scale=False,
    ),
    "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
    "clip_block_rms": lambda: optax.chain(optax.clip_by_block_rms(0.5), optax.sgd(0.1)),
    "multisteps_adam": lambda: optax.MultiSteps(
        optax.adam(1e-2), every_k_schedule=3, accumulator_dtype=jnp.float64
    ),
    "inject_adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=_schedule(), weight_decay=0.1
    ),
    "ema_sgd": lambda: optax.chain(optax.ema(0.9), optax.sgd(0.1)),
}
#: cases fed the gradients with NaNs/infs
NAN_CASES = {
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=1),
    "zero_nans_sgd": lambda: optax.chain(optax.zero_nans(), optax.sgd(0.1)),
}

SCHEDULES = {
    "exponential_decay": lambda: optax.exponential_decay(
        1.0, 3, 0.5, transition_begin=2, staircase=True, end_value=0.1
    ),
    "exponential_decay_smooth": lambda: optax.exponential_decay(2.0, 4, 0.7),
    "piecewise_constant": lambda: optax.piecewise_constant_schedule(1.0, {5: 0.5, 10: 0.1}),
    "polynomial": lambda: optax.polynomial_schedule(1.0, 0.1, 2.0, 20, transition_begin=3),
    "cosine_decay": lambda: optax.cosine_decay_schedule(1.0, 20, alpha=0.1, exponent=2.0),
    "warmup_cosine": lambda: optax.warmup_cosine_decay_schedule(0.0, 1.0, 5, 25, 0.1),
    "warmup_exponential": lambda: optax.warmup_exponential_decay_schedule(
        0.0, 1.0, 4, 5, 0.5, staircase=True
    ),
    "join": lambda: optax.join_schedules(
        [optax.constant_schedule(0.5), optax.linear_schedule(1.0, 0.0, 10)], [7]
    ),
}


def _flat(params) -> np.ndarray:
    return np.concatenate([np.asarray(params[k]).reshape(-1) for k in NAMES])


def _trajectory(tx, params, grads) -> np.ndarray:
    params = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(params)
    rows = []
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        params = optax.apply_updates(params, updates)
        rows.append(_flat(params))
    return np.stack(rows)


def main() -> None:
    params, grads, nan_grads = _inputs()
    out = {
        "params": _flat(params),
        "grads": np.stack([_flat(g) for g in grads]),
        "grads_nan": np.stack([_flat(g) for g in nan_grads]),
    }
    for name, make in CASES.items():
        out[f"traj/{name}"] = _trajectory(make(), params, grads)
    for name, make in NAN_CASES.items():
        out[f"traj/{name}"] = _trajectory(make(), params, nan_grads)
    for name, make in SCHEDULES.items():
        s = make()
        out[f"schedule/{name}"] = np.array([float(s(jnp.asarray(i))) for i in range(30)])
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optax_reference.npz")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **out)
    print(f"wrote {os.path.normpath(path)}: {len(out)} arrays, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
