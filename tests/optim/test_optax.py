"""fs.optim against optax 0.2.8 trajectories recorded by tools/record_optax.py (no JAX here):
20 steps of every case on plain float64 tensors, and on 2 ranks with unevenly sharded params."""

import functools
import os

import numpy as np
import pytest
import torch

import fshard as fs
from fshard import optim
from tests import optax_cases
from tests.optax_cases import NAN_CASES, SHAPES, Lib

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "optax_reference.npz")
SPECS = {"w": fs.P("x"), "v": fs.P(None, "x"), "u": fs.P("x"), "b": fs.P()}  # 3+2, 4+3, 3+2
#: float64 agreement, except: adafactor's decay ``1 - t**-0.8`` is float32 in both libraries
#: (the two float32 pows may differ by an ulp); optax evaluates a schedule on its int32 step
#: counter, which JAX promotes to float32 (fshard: float64), so scheduled runs agree to ~1e-7.
RTOL = {"adafactor": 1e-6, "adafactor_momentum": 1e-6, "adamw_schedule": 2e-6, "inject_adamw": 2e-6}
ATOL = {"adafactor": 1e-9, "adafactor_momentum": 1e-9}
#: fshard's side of the shared table: clip_by_global_norm's torch-style eps set to 0 (optax
#: clips by max_norm / norm); MultiSteps as optax's GradientTransformation
FSHARD = Lib(
    optim,
    clip={"eps": 0.0},
    adafactor={},
    multi_steps=lambda tx, k: optim.MultiSteps(tx, k).gradient_transformation(),
)
CASES = {name: functools.partial(make, FSHARD) for name, make in optax_cases.CASES.items()}
SCHEDULES = {name: functools.partial(make, FSHARD) for name, make in optax_cases.SCHEDULES.items()}
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
