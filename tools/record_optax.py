"""Record optax 0.2.8 reference trajectories for tests/optim/test_optax.py (no JAX at test time).

Run with a separate environment that has JAX (CPU) and optax, never the test environment::

    python -m venv /tmp/optaxenv
    /tmp/optaxenv/bin/pip install jax optax==0.2.8 numpy
    /tmp/optaxenv/bin/python tools/record_optax.py

It writes ``tests/data/optax_reference.npz``: the initial params and 20 gradient steps (float64,
JAX x64), each case's params after every step (the params flattened and concatenated in
``NAMES`` order, one row per step) and schedule values for steps 0..29. The cases are the table
in ``tests/optax_cases.py``, which ``tests/optim/test_optax.py`` builds with fshard.optim.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from optax_cases import CASES, NAMES, NAN_CASES, NAN_STEPS, SCHEDULES, SHAPES, STEPS, Lib  # noqa: E402

#: optax's side of the shared table (tests/optax_cases.py)
OPTAX = Lib(
    optax,
    clip={},
    adafactor={"dtype_momentum": jnp.float64},
    multi_steps=lambda tx, k: optax.MultiSteps(
        tx, every_k_schedule=k, accumulator_dtype=jnp.float64
    ),
)


def _inputs():
    rng = np.random.RandomState(0)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(STEPS)]
    nan_grads = [{k: v.copy() for k, v in g.items()} for g in grads]
    for i in NAN_STEPS:
        nan_grads[i]["w"][1, 2] = np.nan
    nan_grads[10]["v"][0, 0] = np.inf
    return params, grads, nan_grads


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
        out[f"traj/{name}"] = _trajectory(
            make(OPTAX), params, nan_grads if name in NAN_CASES else grads
        )
    for name, make in SCHEDULES.items():
        s = make(OPTAX)
        out[f"schedule/{name}"] = np.array([float(s(jnp.asarray(i))) for i in range(30)])
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optax_reference.npz")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **out)
    print(f"wrote {os.path.normpath(path)}: {len(out)} arrays, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
