"""fs.optim under torch.func.vmap (a batch of optimizers) and torch.compile(fullgraph=True),
hyperparameters in the state, gradient accumulation and skipping, and dtype rules (the
package's doctests run in every ``pytest``: pyproject's testpaths). Oracles: the same
optimizer looped / eager / on dense tensors, and the formulas written out."""

import math

import pytest
import torch

from fshard import optim


def _problem(seed=0, dtype=torch.float32, steps=6):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "b": (3,)}
    params = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
        for _ in range(steps)
    ]
    return params, grads


def _sched():
    return optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10, end_value=1e-3)


PURE = {
    "adamw_schedule": lambda: optim.adamw(_sched(), weight_decay=0.1),
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "lamb": lambda: optim.lamb(1e-2, weight_decay=0.01),
    "radam": lambda: optim.radam(1e-2),
    "lion": lambda: optim.lion(1e-2),
    "rmsprop": lambda: optim.rmsprop(1e-2, momentum=0.9, centered=True),
    "adagrad": lambda: optim.adagrad(0.1),
    "adafactor": lambda: optim.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9),
    "clip_nadam": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.nadam(1e-2)),
    "multisteps": lambda: optim.MultiSteps(optim.adam(1e-2), 2).gradient_transformation(),
    "apply_if_finite": lambda: optim.apply_if_finite(optim.sgd(0.1), 2),
    "zero_nans": lambda: optim.chain(optim.zero_nans(), optim.sgd(0.1)),
    "novograd": lambda: optim.novograd(1e-2, weight_decay=0.01),
    "sm3": lambda: optim.sm3(0.1),
    "rprop": lambda: optim.rprop(1e-2),
    "optimistic_gd": lambda: optim.optimistic_gradient_descent(1e-2),
    "adan": lambda: optim.adan(1e-2, weight_decay=0.01),
    "prodigy": lambda: optim.prodigy(),
    "schedule_free_adamw": lambda: optim.schedule_free_adamw(1e-2),
    "lbfgs_no_linesearch": lambda: optim.lbfgs(0.1, memory_size=3, linesearch=None),
    "agc_centralize_nonneg": lambda: optim.chain(
        optim.adaptive_grad_clip(0.1),
        optim.centralize(),
        optim.sgd(0.1),
        optim.apply_every(2),
        optim.keep_params_nonnegative(),
    ),
}
#: the new transformations whose update reads no tensor as a Python value: compiled whole
COMPILED = ["novograd", "sm3", "adan", "prodigy", "schedule_free_adamw", "lbfgs_no_linesearch"]


def _step(tx):
    def f(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return f


@pytest.mark.parametrize("name", sorted(PURE))
def test_vmap_batch_of_optimizers_equals_loop(name):
    """vmap over params, grads and states (each optimizer its own problem) == a Python loop."""
    tx = PURE[name]()
    problems = [_problem(seed) for seed in range(3)]
    bp = {k: torch.stack([p[k] for p, _ in problems]) for k in problems[0][0]}
    bstate = torch.func.vmap(tx.init)(bp)
    f = torch.func.vmap(_step(tx))
    loop = [(p, tx.init(p)) for p, _ in problems]
    for i in range(4):
        bg = {k: torch.stack([gs[i][k] for _, gs in problems]) for k in bp}
        bp, bstate = f(bp, bg, bstate)
        loop = [_step(tx)(p, gs[i], s) for (p, s), (_, gs) in zip(loop, problems)]
    for j, (p, _) in enumerate(loop):
        for k in p:
            torch.testing.assert_close(bp[k][j], p[k], rtol=1e-5, atol=1e-6)


def test_vmap_over_injected_learning_rates():
    """optax's batch-of-optimizers idiom: one problem, a batch of learning rates in the state."""
    tx = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-2, weight_decay=0.1)
    params, grads = _problem(1)
    state = tx.init(params)
    lrs = torch.tensor([1e-3, 1e-2, 3e-2])

    def run(lr):
        s = state._replace(hyperparams={**state.hyperparams, "learning_rate": lr})
        p = params
        for g in grads:
            p, s = _step(tx)(p, g, s)
        return p

    batched = torch.func.vmap(run)(lrs)
    for j, lr in enumerate(lrs.tolist()):
        ref_tx, p = optim.adamw(lr, weight_decay=0.1), params
        s = ref_tx.init(p)
        for g in grads:
            p, s = _step(ref_tx)(p, g, s)
        for k in p:
            torch.testing.assert_close(batched[k][j], p[k], rtol=1e-5, atol=1e-7)


def test_donated_step_under_vmap_runs_the_pure_path():
    tx = optim.adamw(1e-2)
    params, grads = _problem(2)
    bp = {k: torch.stack([v, v]) for k, v in params.items()}
    bg = {k: torch.stack([v, v]) for k, v in grads[0].items()}

    def f(p, g, s):
        return optim.step(tx, g, s, p, donate=True)

    out, _ = torch.func.vmap(f)(bp, bg, torch.func.vmap(tx.init)(bp))
    ref, _ = optim.step(tx, grads[0], tx.init(params), params)
    torch.testing.assert_close(out["w"][1], ref["w"])
    assert torch.equal(bp["w"][0], params["w"])  # nothing donated


def test_compile_fullgraph_matches_eager():
    """update + apply_updates compiles without a graph break (counters stay tensors, schedules
    use torch ops, the wrappers select with torch.where instead of reading a bool); one
    nested optimizer covers the schedule, clipping, Adam and both wrappers."""
    torch._dynamo.reset()
    inner = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(_sched(), weight_decay=0.1))
    tx = optim.MultiSteps(optim.apply_if_finite(inner, 2), 2).gradient_transformation()
    params, grads = _problem(3)
    grads[1] = {k: v.clone() for k, v in grads[1].items()}
    grads[1]["b"][0] = float("inf")  # a skipped accumulation window
    compiled = torch.compile(_step(tx), fullgraph=True, backend="aot_eager")
    p_c, s_c = params, tx.init(params)
    p_e, s_e = params, tx.init(params)
    for g in grads:
        p_c, s_c = compiled(p_c, g, s_c)
        p_e, s_e = _step(tx)(p_e, g, s_e)
    for k in params:
        torch.testing.assert_close(p_c[k], p_e[k], rtol=1e-5, atol=1e-7)
    assert not torch.equal(p_e["w"], params["w"])


@pytest.mark.parametrize("name", COMPILED)
def test_compile_fullgraph_new_optimizers(name):
    torch._dynamo.reset()
    tx = PURE[name]()
    params, grads = _problem(4)
    compiled = torch.compile(_step(tx), fullgraph=True, backend="aot_eager")
    p_c, s_c = params, tx.init(params)
    p_e, s_e = params, tx.init(params)
    for g in grads[:3]:
        p_c, s_c = compiled(p_c, g, s_c)
        p_e, s_e = _step(tx)(p_e, g, s_e)
    for k in params:
        torch.testing.assert_close(p_c[k], p_e[k], rtol=1e-5, atol=1e-7)


def test_integer_params_refused():
    ints = {"w": torch.zeros(3, dtype=torch.int64)}
    for make in (lambda: optim.sgd(0.1), lambda: optim.adam(1e-3), lambda: optim.adafactor()):
        with pytest.raises(TypeError, match="floating-point"):
            make().init(ints)
    with pytest.raises(TypeError, match="floating-point"):
        optim.scale(2.0).update(ints, optim.EmptyState())
    with pytest.raises(TypeError, match="floating-point"):
        optim.apply_updates(ints, ints)


def test_global_norm_float64_exact():
    """The sum is in the promoted dtype: float64 leaves give the float64 norm."""
    g = torch.Generator().manual_seed(0)
    tree = {"a": torch.randn(1000, dtype=torch.float64, generator=g) * 1e-3, "b": torch.randn(7)}
    want = torch.sqrt((tree["a"] ** 2).sum() + (tree["b"].double() ** 2).sum())
    got = optim.global_norm(tree)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    clipped, _ = optim.clip_by_global_norm(0.01, eps=0.0).update(tree, optim.EmptyState())
    torch.testing.assert_close(optim.global_norm(clipped), torch.tensor(0.01, dtype=torch.float64))


def test_inject_hyperparams_log_change_checkpoint(tmp_path):
    tx = optim.inject_hyperparams(optim.adamw)(learning_rate=_sched(), weight_decay=0.1)
    params, grads = _problem(4)
    state = tx.init(params)
    seen = []
    for g in grads[:3]:
        params, state = _step(tx)(params, g, state)
        seen.append(float(state.hyperparams["learning_rate"]))
    assert seen == pytest.approx([_sched()(i) for i in range(3)], rel=1e-6)
    # change a numeric one, checkpoint, reload, continue: the same as never stopping
    state = state._replace(hyperparams={**state.hyperparams, "weight_decay": torch.tensor(0.5)})
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=False)
    a, _ = _step(tx)(params, grads[3], state)
    b, _ = _step(tx)(params, grads[3], loaded)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # weight decay 0.5 is what was applied: the adamw formula with lr = schedule(3)
    ref_tx = optim.adamw(_sched()(3), weight_decay=0.5)
    inner = state.inner_state
    adam_state = inner[0]._replace(count=inner[0].count)
    ref, _ = _step(ref_tx)(params, grads[3], (adam_state, inner[1], optim.EmptyState()))
    torch.testing.assert_close(a, ref, rtol=1e-6, atol=1e-8)


def test_multisteps_is_mean_of_k_grads():
    params, grads = _problem(5)
    tx = optim.MultiSteps(optim.sgd(0.1, momentum=0.9), 3)
    state = tx.init(params)
    p = params
    for i in range(6):
        u, state = tx.update(grads[i], state, p)
        p = optim.apply_updates(p, u)
        assert bool(tx.has_updated(state)) == (i % 3 == 2)
    m1 = {k: sum(g[k] for g in grads[0:3]) / 3 for k in params}
    m2 = {k: sum(g[k] for g in grads[3:6]) / 3 for k in params}
    # momentum: buf1 = m1, buf2 = 0.9 m1 + m2
    want = {k: params[k] - 0.1 * m1[k] - 0.1 * (0.9 * m1[k] + m2[k]) for k in params}
    torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)


def test_apply_if_finite_skips_and_counts():
    params, grads = _problem(6)
    tx = optim.apply_if_finite(optim.adam(0.1), max_consecutive_errors=1)
    bad = {k: v.clone() for k, v in grads[1].items()}
    bad["w"][0, 0] = float("nan")
    state = tx.init(params)
    p1, state = _step(tx)(params, grads[0], state)
    p2, state = _step(tx)(p1, bad, state)
    assert torch.equal(p2["w"], p1["w"]) and int(state.inner_state[0].count) == 1
    assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 1
    assert not bool(state.last_finite)
    p3, state = _step(tx)(p2, grads[2], state)
    assert int(state.notfinite_count) == 0 and int(state.inner_state[0].count) == 2


def test_tensor_valued_schedule_parameters_are_differentiable():
    """d(final loss)/d(peak learning rate) through a schedule with tensor parameters, against
    central finite differences in float64."""
    target = torch.linspace(-1, 1, 5, dtype=torch.float64)

    def run(peak):
        lr = optim.warmup_cosine_decay_schedule(0.0, peak, 2, 8, end_value=peak * 0.1)
        tx = optim.adam(lr, eps_root=1e-16)  # target[2] == 0: sqrt(nu = 0) needs eps_root
        p = {"w": torch.zeros(5, dtype=torch.float64)}
        s = tx.init(p)
        for _ in range(6):
            g = {"w": 2 * (p["w"] - target)}
            p, s = _step(tx)(p, g, s)
        return ((p["w"] - target) ** 2).sum()

    peak = torch.tensor(0.05, dtype=torch.float64)
    d = torch.func.grad(run)(peak)
    h = 1e-6
    fd = (run(peak + h) - run(peak - h)) / (2 * h)
    torch.testing.assert_close(d, fd, rtol=1e-5, atol=1e-10)
    assert d.abs() > 0
    for make in (
        lambda v: optim.exponential_decay(v, 3, 0.5),
        lambda v: optim.piecewise_constant_schedule(v, {2: 0.5}),
        lambda v: optim.polynomial_schedule(v, 0.0, 2.0, 10),
    ):
        s = make(torch.tensor(2.0))
        assert math.isclose(float(s(torch.tensor(4))), make(2.0)(4), rel_tol=1e-6)


def test_nesterov_and_eps_root_formulas():
    """scale_by_adam's nesterov and eps_root against the formulas written out (first 2 steps)."""
    b1, b2, eps, eps_root = 0.8, 0.9, 1e-3, 1e-2
    g1, g2 = torch.tensor([0.5, -2.0], dtype=torch.float64), torch.tensor([1.0, 0.25]).double()
    tx = optim.scale_by_adam(b1, b2, eps, eps_root, nesterov=True)
    s = tx.init([torch.zeros(2, dtype=torch.float64)])
    _, s = tx.update([g1], s)
    (u,), s = tx.update([g2], s)
    m = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v = b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2
    m_hat = b1 * m / (1 - b1**3) + (1 - b1) * g2 / (1 - b1**2)
    want = m_hat / (torch.sqrt(v / (1 - b2**2) + eps_root) + eps)
    torch.testing.assert_close(u, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("make", [lambda: optim.sgd(0.1), lambda: optim.adamw(0.1)])
def test_optimizers_check_gradients_against_params_first(make):
    """Issue 29 item 2: (grads, loss) swapped once made sgd's update accept the scalar loss as
    the gradients (``tensor(-0.2)``) and adamw blame its own state. Every optimizer checks the
    gradients' structure, shapes and layouts against the params before anything runs, and a
    lone scalar names the likely swap."""
    params = {"w": torch.ones(3), "b": torch.zeros(2)}
    tx = make()
    state = tx.init(params)
    loss = torch.tensor(0.5)
    for call in (
        lambda: tx.update(loss, state, params),
        lambda: optim.step(tx, loss, state, params),
        lambda: optim.apply_updates(params, loss),
    ):
        with pytest.raises(ValueError, match=r"fs\.value_and_grad returns \(loss, grads\)") as e:
            call()
        assert "state" not in str(e.value).split("(a single scalar")[0]
    wrong_shape = {"w": torch.ones(4), "b": torch.zeros(2)}  # same structure, another shape
    with pytest.raises(ValueError, match=r"\['w'\].*shape \(4,\).*shape \(3,\)"):
        tx.update(wrong_shape, state, params)
    with pytest.raises(ValueError, match="shape"):
        optim.apply_updates(params, wrong_shape)
    updates, _ = tx.update({"w": torch.ones(3), "b": torch.ones(2)}, state, params)
    assert set(updates) == {"w", "b"}  # the right call still runs
