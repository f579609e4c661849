"""Record optax 0.2.8 reference trajectories for tests/optim/test_optax.py (no JAX at test time).

Run with a separate environment that has JAX (CPU) and optax, never the test environment::

    python -m venv /tmp/optaxenv
    /tmp/optaxenv/bin/pip install jax optax==0.2.8 numpy
    /tmp/optaxenv/bin/python tools/record_optax.py

It writes ``tests/data/optax_reference.npz``: the initial params and 20 gradient steps (float64,
JAX x64), each case's params after every step (the params flattened and concatenated in
``NAMES`` order, one row per step) and schedule values for steps 0..29; the losses fed to the
``value=`` cases; the objective-driven line-search trajectories (``objective/*``); the
schedule-free cases' evaluation params (``eval/*``); ``per_example_global_norm_clip``'s output;
and ``optax.losses`` values on recorded inputs (``loss/*``, ``loss_inputs/*``). The cases are the
tables in ``tests/optax_cases.py``, which ``tests/optim/test_optax.py`` and
``tests/optim/test_losses.py`` build with fshard.optim.
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
from optax_cases import (  # noqa: E402
    CASES,
    LOSS_BATCH,
    LOSS_CLASSES,
    LOSSES,
    NAMES,
    NAN_CASES,
    NAN_STEPS,
    OBJECTIVE_CASES,
    OBJECTIVE_STEPS,
    PER_EXAMPLE,
    PER_EXAMPLE_CLIP,
    SCHEDULES,
    SHAPES,
    STEPS,
    VALUE_CASES,
    Lib,
    objective,
)

#: optax's side of the shared table (tests/optax_cases.py)
OPTAX = Lib(
    optax,
    clip={},
    adafactor={"dtype_momentum": jnp.float64},
    multi_steps=lambda tx, k: optax.MultiSteps(
        tx, every_k_schedule=k, accumulator_dtype=jnp.float64
    ),
    np=jnp,
    contrib=optax.contrib,
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


def _values() -> np.ndarray:
    """The losses fed to the ``value=`` cases (drawn after the inputs: those stay as before)."""
    return np.random.RandomState(1).uniform(0.5, 3.0, STEPS)


def _flat(params) -> np.ndarray:
    return np.concatenate([np.asarray(params[k]).reshape(-1) for k in NAMES])


def _trajectory(tx, params, grads, values=None) -> np.ndarray:
    params = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(params)
    rows = []
    for i, g in enumerate(grads):
        extra = {} if values is None else {"value": values[i]}
        g = {k: jnp.asarray(v) for k, v in g.items()}
        updates, state = tx.update(g, state, params, **extra)
        params = optax.apply_updates(params, updates)
        rows.append(_flat(params))
    return np.stack(rows)


def _eval_params(tx, params, grads) -> np.ndarray:
    """``schedule_free_eval_params`` after the whole trajectory."""
    params = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        params = optax.apply_updates(params, updates)
    return _flat(optax.contrib.schedule_free_eval_params(state, params))


def _objective_trajectory(tx, params) -> np.ndarray:
    """Steps driven by the objective, as optax's L-BFGS examples run them."""
    f = lambda p: objective(OPTAX, p)  # noqa: E731
    params = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(params)
    from_state = optax.value_and_grad_from_state(f)
    rows = []
    for _ in range(OBJECTIVE_STEPS):
        try:
            value, grad = from_state(params, state=state)
        except ValueError:  # no line search in the state
            value, grad = jax.value_and_grad(f)(params)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=f)
        params = optax.apply_updates(params, updates)
        rows.append(_flat(params))
    return np.stack(rows)


def _loss_inputs() -> dict:
    rng = np.random.RandomState(2)
    shape = (LOSS_BATCH, LOSS_CLASSES)
    z = rng.standard_normal(shape)
    return {
        "logits": 2 * rng.standard_normal(shape),
        "labels": rng.randint(0, LOSS_CLASSES, LOSS_BATCH),
        "probs": np.exp(z) / np.exp(z).sum(-1, keepdims=True),
        "binary": (rng.uniform(size=shape) > 0.5).astype(np.float64),
        "targets": rng.standard_normal(shape),
    }


def main() -> None:
    params, grads, nan_grads = _inputs()
    out = {
        "params": _flat(params),
        "grads": np.stack([_flat(g) for g in grads]),
        "grads_nan": np.stack([_flat(g) for g in nan_grads]),
        "values": _values(),
    }
    for name, make in CASES.items():
        out[f"traj/{name}"] = _trajectory(
            make(OPTAX),
            params,
            nan_grads if name in NAN_CASES else grads,
            out["values"] if name in VALUE_CASES else None,
        )
    for name, make in OBJECTIVE_CASES.items():
        out[f"objective/{name}"] = _objective_trajectory(make(OPTAX), params)
    inputs = _loss_inputs()
    out.update({f"loss_inputs/{k}": v for k, v in inputs.items()})
    for name, case in CASES.items():  # the evaluation params of the schedule-free cases
        if name.startswith("schedule_free"):
            out[f"eval/{name}"] = _eval_params(case(OPTAX), params, grads)
    for name, loss in LOSSES.items():
        out[f"loss/{name}"] = np.asarray(
            loss(OPTAX, {k: jnp.asarray(v) for k, v in inputs.items()})
        )
    batch = {k: jnp.stack([jnp.asarray(g[k]) for g in grads[:PER_EXAMPLE]]) for k in NAMES}
    clipped, n = optax.per_example_global_norm_clip(batch, PER_EXAMPLE_CLIP)
    out["per_example_clip"] = _flat(clipped)
    out["per_example_clipped"] = np.asarray(n)
    for name, make in SCHEDULES.items():
        s = make(OPTAX)
        out[f"schedule/{name}"] = np.array([float(s(jnp.asarray(i))) for i in range(30)])
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optax_reference.npz")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **out)
    print(f"wrote {os.path.normpath(path)}: {len(out)} arrays, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
