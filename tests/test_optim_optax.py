"""fs.optim against optax 0.2.8 trajectories recorded by tools/record_optax.py (no JAX here):
20 steps of every case on plain float64 tensors, and on 2 ranks with unevenly sharded params."""

import functools
import os

import numpy as np
import pytest
import torch

import fshard as fs
from fshard import optim

DATA = os.path.join(os.path.dirname(__file__), "data", "optax_reference.npz")
SHAPES = {"w": (5, 3), "v": (4, 7), "u": (5, 8), "b": (6,)}  # as tools/record_optax.py
SPECS = {"w": fs.P("x"), "v": fs.P(None, "x"), "u": fs.P("x"), "b": fs.P()}  # 3+2, 4+3, 3+2
MASK = {"w": True, "v": False, "u": True, "b": False}
#: float64 agreement, except: adafactor's decay ``1 - t**-0.8`` is float32 in both libraries
#: (the two float32 pows may differ by an ulp); optax evaluates a schedule on its int32 step
#: counter, which JAX promotes to float32 (fshard: float64), so scheduled runs agree to ~1e-7.
RTOL = {"adafactor": 1e-6, "adafactor_momentum": 1e-6, "adamw_schedule": 2e-6, "inject_adamw": 2e-6}
ATOL = {"adafactor": 1e-9, "adafactor_momentum": 1e-9}


def _sched():
    return optim.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 20, end_value=1e-3)


CASES = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9),
    "sgd_nesterov": lambda: optim.sgd(0.05, momentum=0.8, nesterov=True),
    "adam": lambda: optim.adam(1e-2),
    "adam_eps_root": lambda: optim.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-4),
    "adam_nesterov": lambda: optim.adam(1e-2, nesterov=True),
    "nadamw": lambda: optim.nadamw(1e-2, weight_decay=0.1),
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "adamw_mask": lambda: optim.adamw(1e-2, weight_decay=0.1, mask=MASK),
    "adamw_schedule": lambda: optim.adamw(_sched(), weight_decay=0.05),
    "radam": lambda: optim.radam(1e-2),
    "lion": lambda: optim.lion(1e-3, weight_decay=0.01),
    "lamb": lambda: optim.lamb(1e-2, weight_decay=0.01),
    "lars": lambda: optim.lars(0.1, weight_decay=1e-3),
    "rmsprop": lambda: optim.rmsprop(1e-2),
    "rmsprop_nesterov": lambda: optim.rmsprop(
        1e-2, momentum=0.9, nesterov=True, eps_in_sqrt=False, bias_correction=True
    ),
    "rmsprop_centered": lambda: optim.rmsprop(1e-2, centered=True, momentum=0.5),
    "adagrad": lambda: optim.adagrad(0.1),
    "adafactor": lambda: optim.adafactor(1e-2, min_dim_size_to_factor=2),
    "adafactor_momentum": lambda: optim.adafactor(
        1e-2,
        min_dim_size_to_factor=2,
        momentum=0.9,
        weight_decay_rate=1e-3,
        clipping_threshold=None,
        multiply_by_parameter_scale=False,
    ),
    # optax clips by max_norm / norm: fshard's torch-style eps set to 0
    "clip_sgd": lambda: optim.chain(optim.clip_by_global_norm(1.0, eps=0.0), optim.sgd(0.1)),
    "clip_block_rms": lambda: optim.chain(optim.clip_by_block_rms(0.5), optim.sgd(0.1)),
    "multisteps_adam": lambda: optim.MultiSteps(optim.adam(1e-2), 3).gradient_transformation(),
    "inject_adamw": lambda: optim.inject_hyperparams(optim.adamw)(
        learning_rate=_sched(), weight_decay=0.1
    ),
    "ema_sgd": lambda: optim.chain(optim.ema(0.9), optim.sgd(0.1)),
    "apply_if_finite": lambda: optim.apply_if_finite(optim.adam(1e-2), 1),
    "zero_nans_sgd": lambda: optim.chain(optim.zero_nans(), optim.sgd(0.1)),
}
NAN_CASES = {"apply_if_finite", "zero_nans_sgd"}
#: run sharded: the ones that reduce over whole leaves, the wrappers, masks, and the donated
#: kernels (the other element-wise ones compute exactly the same per shard)
SHARDED = [
    "adafactor",
    "adafactor_momentum",
    "lamb",
    "lars",
    "clip_sgd",
    "clip_block_rms",
    "apply_if_finite",
    "zero_nans_sgd",
    "multisteps_adam",
    "inject_adamw",
    "adamw_mask",
    "adamw_schedule",
    "sgd_nesterov",
]
SCHEDULES = {
    "exponential_decay": lambda: optim.exponential_decay(
        1.0, 3, 0.5, transition_begin=2, staircase=True, end_value=0.1
    ),
    "exponential_decay_smooth": lambda: optim.exponential_decay(2.0, 4, 0.7),
    "piecewise_constant": lambda: optim.piecewise_constant_schedule(1.0, {5: 0.5, 10: 0.1}),
    "polynomial": lambda: optim.polynomial_schedule(1.0, 0.1, 2.0, 20, transition_begin=3),
    "cosine_decay": lambda: optim.cosine_decay_schedule(1.0, 20, alpha=0.1, exponent=2.0),
    "warmup_cosine": lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, 5, 25, 0.1),
    "warmup_exponential": lambda: optim.warmup_exponential_decay_schedule(
        0.0, 1.0, 4, 5, 0.5, staircase=True
    ),
    "join": lambda: optim.join_schedules(
        [optim.constant_schedule(0.5), optim.linear_schedule(1.0, 0.0, 10)], [7]
    ),
}


@functools.cache
def _load():
    with np.load(DATA) as z:
        return {k: z[k] for k in z.files}


def _unflat(row) -> dict:
    out, i = {}, 0
    for k, s in SHAPES.items():
        n = int(np.prod(s))
        out[k] = torch.from_numpy(np.array(row[i : i + n])).reshape(s)
        i += n
    return out


def _flat(tree) -> np.ndarray:
    return np.concatenate([tree[k].detach().reshape(-1).numpy() for k in SHAPES])


def _run(make, ref, grads_key, wrap=lambda k, t: t, unwrap=lambda t: t, donate=False):
    """fs.optim trajectory (one flat row per step) from the recorded params and grads."""
    tx = make()
    params = {k: wrap(k, v) for k, v in _unflat(ref["params"]).items()}
    state = tx.init(params)
    rows = []
    for g in ref[grads_key]:
        grads = {k: wrap(k, v) for k, v in _unflat(g).items()}
        params, state = optim.step(tx, grads, state, params, donate=donate)
        rows.append(_flat({k: unwrap(v) for k, v in params.items()}))
    return np.stack(rows)


def _grads_key(name):
    return "grads_nan" if name in NAN_CASES else "grads"


def _max_rel_err(got, want) -> float:
    """Largest relative error; equal non-finite entries (the NaN/inf cases) count as 0."""
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        err = np.where(same, 0.0, np.abs(got - want) / (np.abs(want) + 1e-3))
    return float(np.max(np.nan_to_num(err, nan=np.inf)))


def test_reference_data_covers_every_case():
    ref = _load()
    assert {k[5:] for k in ref if k.startswith("traj/")} == set(CASES)
    assert {k[9:] for k in ref if k.startswith("schedule/")} == set(SCHEDULES)
    assert os.path.getsize(DATA) < 1_000_000


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax_dense_float64(name):
    ref = _load()
    want = ref[f"traj/{name}"]
    got = _run(CASES[name], ref, _grads_key(name))
    rtol, atol = RTOL.get(name, 1e-10), ATOL.get(name, 1e-12)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)
    if CASES[name]().donated_step is not None:  # the in-place torch.optim kernels too
        got = _run(CASES[name], ref, _grads_key(name), wrap=lambda k, t: t.clone(), donate=True)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{name} donated")


def test_float32_close_to_optax_float64():
    ref = _load()
    for name in ("adamw", "lamb", "adafactor", "lion", "rmsprop"):
        got = _run(CASES[name], ref, "grads", wrap=lambda k, t: t.float(), unwrap=lambda t: t)
        want = ref[f"traj/{name}"]
        assert _max_rel_err(got, want) < 1e-4, name


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedules_match_optax(name):
    want = _load()[f"schedule/{name}"]
    s = SCHEDULES[name]()
    ints = np.array([float(s(i)) for i in range(30)])
    tensors = np.array([float(s(torch.tensor(i))) for i in range(30)])
    # optax's exponential_decay clips to a float32 end_value (0.1 -> 0.10000000149)
    rtol = 1e-7 if name == "exponential_decay" else 1e-12
    np.testing.assert_allclose(ints, want, rtol=rtol, atol=1e-15)
    np.testing.assert_allclose(tensors, want, rtol=rtol, atol=1e-15)


def sharded_optax_rank_fn(names):
    """Every case over params sharded unevenly on 2 ranks; returns {case: max rel error}."""
    ref = _load()
    mesh = fs.Mesh.create((2,), ("x",))

    def wrap(k, t):
        return fs.shard(t.clone(), mesh, SPECS[k])

    errs = {}
    for name in names:
        for donate in (False, True) if CASES[name]().donated_step is not None else (False,):
            got = _run(CASES[name], ref, _grads_key(name), wrap, fs.gather, donate=donate)
            errs[(name, donate)] = _max_rel_err(got, ref[f"traj/{name}"])
    # element-wise transformations never communicate; adafactor's factored moments must
    mesh_log = {}
    for name in ("adamw", "adafactor"):
        tx = CASES[name]()
        params = {k: wrap(k, v) for k, v in _unflat(ref["params"]).items()}
        state = tx.init(params)
        grads = {k: wrap(k, v) for k, v in _unflat(ref["grads"][0]).items()}
        with fs.debug.comm_log() as log:
            tx.update(grads, state, params)
        mesh_log[name] = len(log)
    return errs, mesh_log


def test_matches_optax_sharded_two_ranks(world2):
    """Uneven shards (rows 3 + 2, columns 4 + 3): Adafactor's row/column means, LAMB/LARS's
    trust ratios, clipping norms and NaN checks are over whole leaves; the donated step too."""
    names = sorted(SHARDED)
    (errs, comms), (errs1, _) = world2.run(sharded_optax_rank_fn, names)
    assert errs == errs1
    bad = {k: v for k, v in errs.items() if v > max(RTOL.get(k[0], 1e-10), 1e-10) * 10}
    assert not bad, bad
    assert comms["adamw"] == 0 and comms["adafactor"] > 0
