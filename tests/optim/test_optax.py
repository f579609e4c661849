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
from tests.optax_cases import (
    NAN_CASES,
    OBJECTIVE_STEPS,
    PER_EXAMPLE,
    PER_EXAMPLE_CLIP,
    SHAPES,
    VALUE_CASES,
    Lib,
    objective,
)

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "optax_reference.npz")
SPECS = {"w": fs.P("x"), "v": fs.P(None, "x"), "u": fs.P("x"), "b": fs.P()}  # 3+2, 4+3, 3+2
#: float64 agreement, except: adafactor's decay ``1 - t**-0.8`` is float32 in both libraries
#: (the two float32 pows may differ by an ulp); optax evaluates a schedule on its int32 step
#: counter, which JAX promotes to float32 (fshard: float64), so scheduled runs agree to ~1e-7.
RTOL = {
    "adafactor": 1e-6,
    "adafactor_momentum": 1e-6,
    "adamw_schedule": 2e-6,
    "inject_adamw": 2e-6,
    "schedule_free_adamw_warmup": 1e-5,  # its warmup schedule, float32 in optax, also weights x
}
ATOL = {"adafactor": 1e-9, "adafactor_momentum": 1e-9, "schedule_free_adamw_warmup": 1e-8}
#: fshard's side of the shared table: clip_by_global_norm's torch-style eps set to 0 (optax
#: clips by max_norm / norm); MultiSteps as optax's GradientTransformation
FSHARD = Lib(
    optim,
    clip={"eps": 0.0},
    adafactor={},
    multi_steps=lambda tx, k: optim.MultiSteps(tx, k).gradient_transformation(),
    np=torch,
    contrib=optim,
)
CASES = {name: functools.partial(make, FSHARD) for name, make in optax_cases.CASES.items()}
OBJECTIVE_CASES = {
    name: functools.partial(make, FSHARD) for name, make in optax_cases.OBJECTIVE_CASES.items()
}
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
    "novograd",
    "sm3",
    "sm3_b2",
    "polyak_sgd",
    "polyak_sgd_plus",
    "adaptive_grad_clip",
    "centralize",
    "freeze",
    "selective_transform",
    "apply_every",
    "keep_params_nonnegative",
    "rprop",
    "optimistic_gd",
    "prodigy",
    "prodigy_safeguard",
    "schedule_free_adamw",
    "schedule_free_adamw_warmup",
    "adan",
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


def _run(make, ref, grads_key, wrap=lambda k, t: t, unwrap=lambda t: t, donate=False, value=False):
    """fs.optim trajectory (one flat row per step) from the recorded params and grads (and
    losses, ``value=``, for the cases that take them)."""
    tx = make()
    params = {k: wrap(k, v) for k, v in _unflat(ref["params"]).items()}
    state = tx.init(params)
    rows = []
    for i, g in enumerate(ref[grads_key]):
        grads = {k: wrap(k, v) for k, v in _unflat(g).items()}
        extra = {"value": float(ref["values"][i])} if value else {}
        params, state = optim.step(tx, grads, state, params, donate=donate, **extra)
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
    assert {k[10:] for k in ref if k.startswith("objective/")} == set(OBJECTIVE_CASES)
    assert {k[9:] for k in ref if k.startswith("schedule/")} == set(SCHEDULES)
    assert os.path.getsize(DATA) < 1_000_000


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax_dense_float64(name):
    ref = _load()
    want = ref[f"traj/{name}"]
    got = _run(CASES[name], ref, _grads_key(name), value=name in VALUE_CASES)
    rtol, atol = RTOL.get(name, 1e-10), ATOL.get(name, 1e-12)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)
    if CASES[name]().donated_step is not None:  # the in-place torch.optim kernels too
        got = _run(CASES[name], ref, _grads_key(name), wrap=lambda k, t: t.clone(), donate=True)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{name} donated")


def test_float32_close_to_optax_float64():
    ref = _load()
    for name in ("adamw", "lamb", "adafactor", "lion", "rmsprop", "novograd", "sm3", "adan",
                 "prodigy", "schedule_free_adamw", "adaptive_grad_clip", "centralize"):  # fmt: skip
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
            got = _run(
                CASES[name], ref, _grads_key(name), wrap, fs.gather, donate, name in VALUE_CASES
            )
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


#: per-example gradients (a leading batch of PER_EXAMPLE): the batch dim split (2 + 2), a
#: parameter dim split unevenly (7 = 4 + 3, 5 = 3 + 2), and replicated
PER_EXAMPLE_SPECS = {"w": fs.P("x"), "v": fs.P(None, None, "x"), "u": fs.P(None, "x"), "b": fs.P()}


def _per_example_batch(ref) -> dict:
    rows = [_unflat(g) for g in ref["grads"][:PER_EXAMPLE]]
    return {k: torch.stack([r[k] for r in rows]) for k in SHAPES}


def test_per_example_global_norm_clip_matches_optax():
    ref = _load()
    clipped, n = optim.per_example_global_norm_clip(_per_example_batch(ref), PER_EXAMPLE_CLIP)
    np.testing.assert_allclose(_flat(clipped), ref["per_example_clip"], rtol=1e-12, atol=1e-13)
    assert int(n) == int(ref["per_example_clipped"]) == 2


def per_example_rank_fn():
    ref = _load()
    mesh = fs.Mesh.create((2,), ("x",))
    batch = {k: fs.shard(v, mesh, PER_EXAMPLE_SPECS[k]) for k, v in _per_example_batch(ref).items()}
    clipped, n = optim.per_example_global_norm_clip(batch, PER_EXAMPLE_CLIP)
    layouts = {k: (v.layout.spec, v.layout.shape) for k, v in clipped.items()}
    return (
        _max_rel_err(_flat({k: fs.gather(v) for k, v in clipped.items()}), ref["per_example_clip"]),
        int(n),
        layouts,
    )


def test_per_example_global_norm_clip_sharded_two_ranks(world2):
    """The batch dim split over the mesh (the per-example norms are gathered, the sum over
    examples is an all_reduce) and parameter dims split unevenly: equal to optax."""
    for err, n, layouts in world2.run(per_example_rank_fn):
        assert err < 1e-10 and n == 2, (err, n)
        assert layouts["w"] == (fs.P(), SHAPES["w"]) and layouts["v"] == (
            fs.P(None, "x"),
            SHAPES["v"],
        )


def _objective_run(make, ref, wrap=lambda k, t: t, unwrap=lambda t: t) -> np.ndarray:
    """The line-search cases: each step's value and gradient from the state (the line search
    stored them) or evaluated with fs.value_and_grad, then update(value=, grad=, value_fn=)."""
    f = functools.partial(objective, FSHARD)
    tx = make()
    params = {k: wrap(k, v) for k, v in _unflat(ref["params"]).items()}
    state = tx.init(params)
    from_state = optim.value_and_grad_from_state(f)
    rows = []
    for _ in range(OBJECTIVE_STEPS):
        try:
            value, grad = from_state(params, state=state)
        except ValueError:  # no line search in the state
            value, grad = fs.value_and_grad(f)(params)
        params, state = optim.step(tx, grad, state, params, value=value, grad=grad, value_fn=f)
        rows.append(_flat({k: unwrap(v) for k, v in params.items()}))
    return np.stack(rows)


@pytest.mark.parametrize("name", sorted(OBJECTIVE_CASES))
def test_linesearch_cases_match_optax_dense_float64(name):
    ref = _load()
    got = _objective_run(OBJECTIVE_CASES[name], ref)
    np.testing.assert_allclose(got, ref[f"objective/{name}"], rtol=1e-9, atol=1e-11, err_msg=name)


def objective_rank_fn():
    ref = _load()
    mesh = fs.Mesh.create((2,), ("x",))

    def wrap(k, t):
        return fs.shard(t.clone(), mesh, SPECS[k])

    return {
        name: _max_rel_err(_objective_run(make, ref, wrap, fs.gather), ref[f"objective/{name}"])
        for name, make in OBJECTIVE_CASES.items()
    }


def test_linesearch_cases_match_optax_sharded_two_ranks(world2):
    """L-BFGS and the zoom line search on unevenly sharded params: the objective is evaluated
    on the sharded params (global view), every slope and L-BFGS inner product is over every
    shard, so all ranks take the same line-search branches and match optax's trajectory."""
    errs, errs1 = world2.run(objective_rank_fn)
    assert errs == errs1
    assert max(errs.values()) < 1e-8, errs


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.startswith("schedule_free")))
def test_schedule_free_eval_params_match_optax(name):
    ref = _load()
    tx = CASES[name]()
    params = _unflat(ref["params"])
    state = tx.init(params)
    for g in ref["grads"]:
        params, state = optim.step(tx, _unflat(g), state, params)
    got = _flat(optim.schedule_free_eval_params(state, params))
    rtol, atol = RTOL.get(name, 1e-10), ATOL.get(name, 1e-12)
    np.testing.assert_allclose(got, ref[f"eval/{name}"], rtol=rtol, atol=atol)
