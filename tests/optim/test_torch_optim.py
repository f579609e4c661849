"""fs.optim against torch.optim on dense tensors, and over sharded params on 2 Gloo ranks."""

import math

import pytest
import torch

import fshard as fs
from fshard import optim

STEPS = 20


def _problem(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w1": (6, 5), "b1": (6,), "w2": (3, 6), "h": (4,)}
    params = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
        for _ in range(STEPS)
    ]
    return params, grads


def _torch_traj(make_opt, params, grads):
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = make_opt(list(ps.values()))
    out = []
    for step, gs in enumerate(grads):
        for k, p in ps.items():
            p.grad = gs[k].clone()
        opt.step()
        if hasattr(opt, "_sched"):
            opt._sched.step()
        out.append({k: p.detach().clone() for k, p in ps.items()})
        assert step >= 0
    return out


def _fs_traj(tx, params, grads, wrap=lambda t: t):
    ps = {k: wrap(v) for k, v in params.items()}
    state = tx.init(ps)
    out = []
    for gs in grads:
        before = {k: v.clone() for k, v in gs.items()}
        updates, state = tx.update({k: wrap(v) for k, v in gs.items()}, state, ps)
        ps = optim.apply_updates(ps, updates)
        out.append(ps)
        assert all(torch.equal(gs[k], before[k]) for k in gs)  # inputs untouched
    return out


def _torch_clip(tree, max_norm):
    """torch.nn.utils.clip_grad_norm_ on .grad of stand-in params: (clipped tree, norm)."""
    ps = {k: torch.zeros_like(v, requires_grad=True) for k, v in tree.items()}
    for k, p in ps.items():
        p.grad = tree[k].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(ps.values()), max_norm)
    return {k: p.grad for k, p in ps.items()}, norm


def _assert_close(a, b, rtol=1e-6, atol=None):
    """Elementwise rtol, plus an atol of rtol * max|b| (float32 results differ from torch.optim
    only by rounding: torch fuses ``p + alpha * u`` into one FMA, an update-based API cannot)."""
    for k in a:
        tol = rtol * float(b[k].abs().max()) if atol is None else atol
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=tol, msg=k)


CASES = [
    (lambda: optim.sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    (lambda: optim.sgd(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    (
        lambda: optim.sgd(0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
    ),
    (lambda: optim.adam(1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    (
        lambda: optim.adam(3e-3, b1=0.8, b2=0.99, eps=1e-6),
        lambda ps: torch.optim.Adam(ps, lr=3e-3, betas=(0.8, 0.99), eps=1e-6),
    ),
    (
        lambda: optim.adamw(1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_torch_optim_dense(case):
    make_fs, make_torch = CASES[case]
    for dtype, rtol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        params, grads = _problem(case, dtype)
        ref = _torch_traj(make_torch, params, grads)
        got = _fs_traj(make_fs(), params, grads)
        for r, g in zip(ref, got):
            _assert_close(g, r, rtol=rtol)


DONATED_CASES = CASES + [
    (
        lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1)),
        lambda ps: _ClippedAdamW(ps),
    ),
    (
        lambda: optim.adamw(
            1e-2, weight_decay=0.1, mask={"w1": True, "b1": False, "w2": True, "h": False}
        ),
        lambda ps: torch.optim.AdamW(
            [{"params": [ps[0], ps[2]]}, {"params": [ps[1], ps[3]], "weight_decay": 0.0}],
            lr=1e-2,
            weight_decay=0.1,
        ),
    ),
]


class _ClippedAdamW(torch.optim.AdamW):
    def __init__(self, ps):
        super().__init__(ps, lr=1e-2, weight_decay=0.1)
        self._ps = ps

    def step(self):
        torch.nn.utils.clip_grad_norm_(self._ps, 1.0)
        return super().step()


@pytest.mark.parametrize("case", range(len(DONATED_CASES)))
def test_donated_step_matches_torch_optim_dense(case):
    """fs.optim.step(donate=True) reuses the params' and state's buffers (checked by pointer)
    and follows torch.optim's trajectory; donate=False equals update + apply_updates."""
    make_fs, make_torch = DONATED_CASES[case]
    for dtype, rtol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        params, grads = _problem(case, dtype)
        ref = _torch_traj(make_torch, params, grads)
        pure = _fs_traj(make_fs(), params, grads)
        tx = make_fs()
        ps = {k: v.clone() for k, v in params.items()}
        ptrs = {k: v.data_ptr() for k, v in ps.items()}
        state = tx.init(ps)
        state_ptrs = [t.data_ptr() for t in optree_leaves(state) if t.dim() > 0]
        for i, gs in enumerate(grads):
            before = {k: v.clone() for k, v in gs.items()}
            ps, state = optim.step(tx, gs, state, ps, donate=True)
            assert {k: v.data_ptr() for k, v in ps.items()} == ptrs  # written in place
            assert all(torch.equal(gs[k], before[k]) for k in gs)  # grads never touched
            # vs torch at float32 precision (global_norm is float32, as documented);
            # vs the pure fs trajectory at the dtype's precision
            _assert_close(ps, ref[i], rtol=1e-6)
            _assert_close(ps, pure[i], rtol=rtol)
        moments = [t.data_ptr() for t in optree_leaves(state) if t.dim() > 0]
        assert moments == state_ptrs  # momentum / Adam moments updated in place
        # without donation: identical to the two-call step, inputs untouched
        tx = make_fs()
        ps0 = {k: v.clone() for k, v in params.items()}
        st0 = tx.init(ps0)
        new, _ = optim.step(tx, grads[0], st0, ps0)
        assert all(torch.equal(ps0[k], params[k]) for k in params)
        _assert_close(new, pure[0], rtol=0, atol=0)


def optree_leaves(tree):
    import optree

    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def test_donation_skipped_when_unsafe():
    params, grads = _problem(5)
    tx = optim.sgd(0.1, momentum=0.9)
    # leaves sharing one buffer: in place would apply the update twice -> pure path
    shared = torch.ones(4)
    ps = {"a": shared, "b": shared}
    out, _ = optim.step(tx, {"a": torch.ones(4), "b": torch.ones(4)}, tx.init(ps), ps, donate=True)
    assert torch.equal(shared, torch.ones(4)) and torch.allclose(out["a"], torch.full((4,), 0.9))
    # under torch.func.grad (meta-learning through the step): pure and differentiable
    w0 = params["w1"]

    def outer(lr):
        t = optim.sgd(lr)
        new, _ = optim.step(t, {"w": grads[0]["w1"]}, t.init({"w": w0}), {"w": w0}, donate=True)
        return new["w"].sum()

    d = torch.func.grad(outer)(torch.tensor(0.1))
    torch.testing.assert_close(d, -grads[0]["w1"].sum())
    assert torch.equal(w0, _problem(5)[0]["w1"])
    with pytest.raises(TypeError, match="GradientTransformation"):
        optim.step(lambda g: g, grads[0], None, params)
    with pytest.raises(TypeError, match="donate"):
        optim.step(tx, grads[0], tx.init(params), params, donate="yes")


def test_schedule_matches_torch_lambda_lr():
    sched = optim.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS, end_value=1e-3)
    params, grads = _problem(7)

    def make(ps):
        opt = torch.optim.AdamW(ps, lr=1.0, weight_decay=0.05)
        opt._sched = torch.optim.lr_scheduler.LambdaLR(opt, sched)
        return opt

    ref = _torch_traj(make, params, grads)
    got = _fs_traj(optim.adamw(sched, weight_decay=0.05), params, grads)
    for r, g in zip(ref, got):
        _assert_close(g, r)


def test_schedules_values():
    warm = optim.linear_schedule(0.0, 1.0, 10, transition_begin=2)
    assert [warm(i) for i in (0, 2, 7, 12, 100)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    cos = optim.cosine_decay_schedule(2.0, 100, alpha=0.1)
    assert cos(0) == 2.0 and math.isclose(cos(100), 0.2) and math.isclose(cos(50), 1.1)
    wc = optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, end_value=0.0)
    assert wc(5) == 0.5 and wc(10) == 1.0 and math.isclose(wc(60), 0.5) and wc(500) == 0.0
    assert optim.constant_schedule(0.3)(1000) == 0.3
    with pytest.raises(ValueError, match="decay_steps"):
        optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10)


def test_adamw_mask_and_multi_transform_and_masked():
    params, grads = _problem(3)
    mask = {"w1": True, "b1": False, "w2": True, "h": False}
    # torch: two param groups with different weight decay
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(
        [
            {"params": [ps[k] for k in ps if mask[k]], "weight_decay": 0.2},
            {"params": [ps[k] for k in ps if not mask[k]], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    ref = []
    for gs in grads:
        for k in ps:
            ps[k].grad = gs[k].clone()
        opt.step()
        ref.append({k: p.detach().clone() for k, p in ps.items()})
    got = _fs_traj(optim.adamw(1e-2, weight_decay=0.2, mask=mask), params, grads)
    _assert_close(got[-1], ref[-1])
    # callable mask gives the same
    got2 = _fs_traj(
        optim.adamw(1e-2, weight_decay=0.2, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
        params,
        grads,
    )
    _assert_close(got2[-1], got[-1], rtol=0, atol=0)

    # multi_transform: sgd on weights, frozen vectors
    labels = {k: ("sgd" if v.ndim > 1 else "frozen") for k, v in params.items()}
    tx = optim.multi_transform({"sgd": optim.sgd(0.1), "frozen": optim.set_to_zero()}, labels)
    out = _fs_traj(tx, params, grads[:3])[-1]
    for k in params:
        if labels[k] == "frozen":
            assert torch.equal(out[k], params[k])
        else:
            want = params[k] - 0.1 * sum(g[k] for g in grads[:3])
            torch.testing.assert_close(out[k], want)

    # masked(inner): inner only sees selected leaves, others pass through
    tx = optim.masked(optim.scale(-2.0), {"w1": True, "b1": False, "w2": False, "h": True})
    upd, state = tx.update(grads[0], tx.init(params), params)
    assert isinstance(state, optim.MaskedState)
    assert torch.equal(upd["w1"], -2 * grads[0]["w1"]) and upd["b1"] is grads[0]["b1"]

    with pytest.raises(ValueError, match="labels"):
        optim.multi_transform({"sgd": optim.sgd(0.1)}, labels).init(params)


def test_clip_by_global_norm_dense_and_chain():
    params, grads = _problem(5)
    gs = {k: v * 10 for k, v in grads[0].items()}
    ref, total = _torch_clip(gs, 1.5)
    torch.testing.assert_close(optim.global_norm(gs), total)
    clipped, _ = optim.clip_by_global_norm(1.5).update(gs, optim.EmptyState())
    _assert_close(clipped, ref)
    small = {k: v * 1e-3 for k, v in gs.items()}
    unchanged, _ = optim.clip_by_global_norm(1.5).update(small, optim.EmptyState())
    _assert_close(unchanged, small, rtol=0, atol=0)
    # chain(clip, sgd) == torch clip + SGD
    tx = optim.chain(optim.clip_by_global_norm(1.5), optim.sgd(0.1))
    upd, state = tx.update(gs, tx.init(params), params)
    assert isinstance(state, tuple) and len(state) == 2
    _assert_close(optim.apply_updates(params, upd), {k: params[k] - 0.1 * ref[k] for k in params})


def test_mixed_dtypes_grouped():
    params = {"a": torch.randn(4, dtype=torch.float64), "b": torch.randn(3), "c": torch.randn(2)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = optim.adam(1e-2)
    upd, state = tx.update(grads, tx.init(params), params)
    assert state[0].mu["a"].dtype == torch.float64 and upd["b"].dtype == torch.float32
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.Adam(list(ref.values()), lr=1e-2)
    for k in ref:
        ref[k].grad = grads[k]
    opt.step()
    _assert_close(optim.apply_updates(params, upd), {k: v.detach() for k, v in ref.items()})


def test_meta_gradient_through_update():
    """grad w.r.t. the learning rate and the initial params through tx.update + apply_updates."""
    torch.manual_seed(0)
    w0 = torch.randn(5)
    target = torch.randn(5)

    def inner_loss(w):
        return ((w - target) ** 2).sum()

    def outer(lr, w, tx_fn):
        tx = tx_fn(lr)
        state = tx.init({"w": w})
        params = {"w": w}
        for _ in range(3):
            g = torch.func.grad(lambda p: inner_loss(p["w"]))(params)
            upd, state = tx.update(g, state, params)
            params = optim.apply_updates(params, upd)
        return inner_loss(params["w"])

    def outer_dense(lr, w):  # the same with plain torch SGD-momentum formula
        buf = torch.zeros_like(w)
        for _ in range(3):
            g = 2 * (w - target)
            buf = 0.9 * buf + g
            w = w - lr * buf
        return inner_loss(w)

    lr = torch.tensor(0.05)
    tx_fn = lambda lr: optim.sgd(lr, momentum=0.9)  # noqa: E731
    g_lr, g_w = torch.func.grad(outer, argnums=(0, 1))(lr, w0, tx_fn)
    r_lr, r_w = torch.func.grad(outer_dense, argnums=(0, 1))(lr, w0)
    torch.testing.assert_close(g_lr, r_lr)
    torch.testing.assert_close(g_w, r_w)
    assert g_lr.abs() > 0
    # Adam: against finite differences of the function itself
    tx_adam = lambda lr: optim.adamw(lr, weight_decay=0.1)  # noqa: E731
    g = torch.func.grad(outer)(lr.double(), w0.double(), tx_adam)
    h = 1e-6
    fd = (
        outer(lr.double() + h, w0.double(), tx_adam) - outer(lr.double() - h, w0.double(), tx_adam)
    ) / (2 * h)
    torch.testing.assert_close(g, fd, rtol=1e-5, atol=1e-8)


def test_argument_validation():
    with pytest.raises(ValueError, match="momentum"):
        optim.sgd(0.1, momentum=1.5)
    with pytest.raises(TypeError, match="learning_rate"):
        optim.adam("fast")
    with pytest.raises(ValueError, match="learning_rate"):
        optim.adamw(-1.0)
    with pytest.raises(ValueError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(0.0)
    with pytest.raises(TypeError, match="chain"):
        optim.chain(optim.sgd(0.1), "adam")
    tx = optim.adamw(0.1)
    with pytest.raises(ValueError, match="params="):
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))
    with pytest.raises(ValueError, match="structure"):
        optim.apply_updates({"w": torch.ones(2)}, {"v": torch.ones(2)})
    with pytest.raises(TypeError, match="leaf"):
        optim.apply_updates({"w": "x"}, {"w": "y"})


# -- sharded params on 2 ranks ----------------------------------------------------------------


def sharded_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    g = torch.Generator().manual_seed(11)
    dense = {
        "col": torch.randn(5, 3, generator=g),  # uneven over 2 ranks: 3 + 2 rows
        "row": torch.randn(4, 6, generator=g),
        "rep": torch.randn(7, generator=g),
    }
    specs = {"col": fs.P("x"), "row": fs.P(None, "x"), "rep": fs.P()}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in dense.items()} for _ in range(STEPS)]

    def sh(tree):
        return {k: fs.shard(v, mesh, specs[k]) for k, v in tree.items()}

    results = {}
    for name, make_fs, make_torch in [
        (
            "adamw",
            lambda: optim.adamw(1e-2, weight_decay=0.1),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        ),
        (
            "sgdm",
            lambda: optim.sgd(0.1, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        ),
    ]:
        ref = _torch_traj(make_torch, dense, grads)[-1]
        tx = make_fs()
        ps = sh(dense)
        state = tx.init(ps)
        if name == "adamw":  # state has the params' layouts
            for k in ps:
                assert (
                    state[0].mu[k].layout == ps[k].layout and state[0].nu[k].layout == ps[k].layout
                )
        dps = {k: fs.shard(v.clone(), mesh, specs[k]) for k, v in dense.items()}
        dstate = tx.init(dps)
        with fs.debug.comm_log() as log:
            for gs in grads:
                upd, state = tx.update(sh(gs), state, ps)
                ps = optim.apply_updates(ps, upd)
                dps, dstate = optim.step(tx, sh(gs), dstate, dps, donate=True)
        assert len(log) == 0  # element-wise optimizers never communicate
        for k in ps:
            assert ps[k].layout == fs.Layout(mesh, specs[k], dense[k].shape)
            assert dps[k].layout == ps[k].layout
            torch.testing.assert_close(fs.gather(ps[k]), ref[k], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(fs.gather(dps[k]), ref[k], rtol=1e-6, atol=1e-7)
        results[name] = True

    # clip_by_global_norm: true global norm; sharded summed over shards, replicated once,
    # partial reduced first.
    gs = {k: v * 5 for k, v in grads[0].items()}
    part_dense = torch.randn(4, 2, generator=g)
    addend = part_dense if mesh.rank == 0 else torch.zeros(4, 2)
    addend = addend * 0.25 if mesh.rank == 0 else part_dense * 0.75
    tree = sh(gs)
    tree["partial"] = fs.from_local(addend, mesh, fs.P(partial="x"))
    dense_tree = dict(gs, partial=part_dense)
    want = torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in dense_tree.values()]))
    norm = optim.global_norm(tree)
    torch.testing.assert_close(norm, want)
    ref, _ = _torch_clip(dense_tree, 2.0)
    clipped, _ = optim.clip_by_global_norm(2.0).update(tree, optim.EmptyState())
    for k in ref:
        assert clipped[k].layout == tree[k].layout
        torch.testing.assert_close(fs.gather(clipped[k]), ref[k])
    # layout mismatch between updates and params is an error naming the fix
    try:
        optim.apply_updates(sh(dense), {**sh(gs), "rep": fs.shard(gs["rep"], mesh, fs.P("x"))})
    except ValueError as e:
        assert "reshard" in str(e)
    else:
        raise AssertionError("layout mismatch not caught")
    return results, float(norm)


def test_sharded_optimizers_two_ranks(world2):
    out = world2.run(sharded_rank_fn)
    assert out[0][0] == {"adamw": True, "sgdm": True}
    assert out[0][1] == out[1][1]  # the norm is the same on every rank


def test_errors_list_every_bad_leaf():
    """Each tree check names every failing leaf by its key path, not only the first."""
    tx = optim.adam(1e-3)
    with pytest.raises(TypeError) as info:
        tx.init({"a": torch.zeros(2), "b": [torch.zeros(2, dtype=torch.int64), 3]})
    msg = str(info.value)
    assert "(2 leaves)" in msg and "params['a']" not in msg, msg
    assert "params['b'][0]: got dtype torch.int64" in msg and ".float()" in msg, msg
    assert "params['b'][1]: got int" in msg, msg
    params = {"a": torch.zeros(2), "b": [torch.zeros(2)], "c": torch.zeros(1)}
    updates = {"a": torch.zeros(2), "b": [torch.zeros(2), torch.zeros(1)], "d": torch.zeros(1)}
    with pytest.raises(ValueError) as info:
        optim.apply_updates(params, updates)
    msg = str(info.value)
    for line in (
        "updates['c']: missing",
        "updates['b'][1]: not a leaf of params",
        "updates['d']: not a leaf of params",
    ):
        assert line in msg, (line, msg)
    # layouts: two of three leaves differ; both named with the layouts and the fix
    mesh = fs.Mesh.abstract((2,), ("x",))

    def sharded(spec):
        layout = fs.Layout(mesh, spec, (4,))
        return fs.ShardedArray._raw(torch.zeros(layout.local_shape(0)), layout)

    ps = {"u": sharded(fs.P("x")), "v": sharded(fs.P()), "w": sharded(fs.P("x"))}
    us = {"u": sharded(fs.P()), "v": sharded(fs.P()), "w": torch.zeros(2)}
    with pytest.raises(ValueError) as info:
        optim.apply_updates(ps, us)
    msg = str(info.value)
    assert "updates['u']: layout" in msg and "updates['w']: a plain tensor" in msg, msg
    assert "updates['v']" not in msg and "fs.reshard" in msg, msg
    # at most 10 listed, then a count
    with pytest.raises(TypeError) as info:
        tx.init({f"p{i:02d}": i for i in range(13)})
    msg = str(info.value)
    assert "(13 leaves)" in msg and "params['p09']" in msg and "params['p10']" not in msg
    assert msg.endswith("... and 3 more"), msg
    # masks and labels: every bad leaf of the mask / label tree
    p3 = {"a": torch.zeros(1), "b": torch.zeros(1), "c": torch.zeros(1)}
    with pytest.raises(TypeError) as info:
        optim.masked(optim.sgd(1.0), {"a": 1, "b": True, "c": "x"}).init(p3)
    msg = str(info.value)
    assert "mask['a']: got int 1" in msg and "mask['c']: got str 'x'" in msg, msg
    with pytest.raises(ValueError) as info:
        optim.multi_transform({"t": optim.sgd(1.0)}, {"a": "t", "b": "u", "c": "v"}).init(p3)
    msg = str(info.value)
    assert "param_labels['b']: label 'u'" in msg and "param_labels['c']: label 'v'" in msg, msg
