"""fs.shard_map: boundaries, exact global shapes, and the gradient semantics of DESIGN §4.

Oracle: the same computation on dense tensors with torch.func, in the rank process.
"""

import re

import torch
import torch.distributed as dist
from torch.func import grad, hessian, jacrev, jvp, vmap

import fshard as fs
from fshard import P, lax

DT = torch.float64


def _gen(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=1e-9, rtol=1e-7), f"{what}: {got} != {want}"


def _raises(fn, exc, pattern):
    try:
        fn()
    except exc as e:
        assert re.search(pattern, str(e)), (pattern, str(e))
        return str(e)
    raise AssertionError(f"expected {exc.__name__} matching {pattern!r}")


# -- gradient semantics ------------------------------------------------------------------------


def replicated_param_grads():
    mesh = fs.Mesh.create((2,), ("x",))
    X, W = _gen(0, 6, 3), _gen(1, 3, 2)
    x, w = fs.shard(X, mesh, P("x")), fs.shard(W, mesh, P())

    def dense(w_):
        return ((X @ w_) ** 2).sum()

    # Data parallel: the replicated w meets the batch-sharded x -> pcast -> psum'd exactly once.
    dp = fs.shard_map(
        lambda w_, x_: lax.psum(((x_ @ w_) ** 2).sum(), "x"), mesh, (P(), P("x")), P()
    )
    gw = grad(lambda w_: fs.gather(dp(w_, x)))(w)
    assert isinstance(gw, fs.ShardedArray) and gw.spec == P()
    _close(gw.local, grad(dense)(W), "data-parallel grad, every rank")
    # Same with a local (per-rank) mean and pmean, and under vmap(grad) over a stack of w.
    dpm = fs.shard_map(
        lambda w_, x_: lax.pmean((x_ @ w_).pow(2).mean(), "x"), mesh, (P(), P("x")), P()
    )
    Ws = torch.stack([W, 2 * W])
    pe = vmap(grad(lambda w_: fs.gather(dpm(w_, x))))(fs.shard(Ws, mesh, P()))
    _close(pe.local, vmap(grad(lambda w_: (X @ w_).pow(2).mean()))(Ws), "vmap(grad) pmean")
    # Invariant-only body: no psum, else the grad would be 2x too large.
    inv = fs.shard_map(lambda w_: w_ * 2, mesh, P(), P())
    _close(grad(lambda w_: fs.gather(inv(w_)).sum())(w).local, torch.full_like(W, 2.0), "w*2")
    # all_gather(to="varying") returned as P(): the boundary cast scales the cotangent by 1/n.
    ag = fs.shard_map(lambda x_: lax.all_gather(x_, "x"), mesh, P("x"), P(), check_vma=False)
    gx = grad(lambda x_: (fs.gather(ag(x_)) ** 3).sum())(x)
    assert gx.spec == P("x")
    _close(fs.gather(gx), 3 * X**2, "all_gather(varying) as P()")
    # Invariant value returned as sharded: its blocks are copies, so its gradient sums them.
    rep = fs.shard_map(lambda w_: w_ * 1.0, mesh, P(), P("x"))
    out = rep(w)
    assert out.shape == (6, 2)
    c = _gen(2, 6, 2)
    _close(grad(lambda w_: (c * fs.gather(rep(w_))).sum())(w).local, c[:3] + c[3:], "P()->P(x)")
    # psum of an invariant value is n * x, with gradient n (JAX semantics).
    ps = fs.shard_map(lambda w_: lax.psum(w_, "x"), mesh, P(), P())
    _close(fs.gather(ps(w)), 2 * W, "psum(invariant) value")
    _close(grad(lambda w_: fs.gather(ps(w_)).sum())(w).local, torch.full_like(W, 2.0), "psum(inv)")
    # Partial output: the local values are addends.
    part = fs.shard_map(lambda x_: x_.sum(0), mesh, P("x"), P(partial="x"))
    _close(fs.gather(part(x)), X.sum(0), "partial out_spec")
    gp = grad(lambda x_: (fs.gather(part(x_)) ** 2).sum())(x)
    _close(fs.gather(gp), (2 * X.sum(0)).expand(6, 3), "partial out_spec grad")
    return True


def jax_pitfall():
    """grad inside the body w.r.t. a replicated input is already reduced: psum again -> n x."""
    mesh = fs.Mesh.create((2,), ("x",))
    X, W = _gen(0, 6, 3), _gen(1, 3, 2)
    x, w = fs.shard(X, mesh, P("x")), fs.shard(W, mesh, P())
    dense = grad(lambda w_: ((X @ w_) ** 2).sum())(W)

    def inner(w_, x_):
        return grad(lambda v: ((x_ @ v) ** 2).sum())(w_)

    right = fs.shard_map(inner, mesh, (P(), P("x")), P())
    twice = fs.shard_map(lambda w_, x_: lax.psum(inner(w_, x_), "x"), mesh, (P(), P("x")), P())
    _close(fs.gather(right(w, x)), dense, "grad inside shard_map (already reduced)")
    _close(fs.gather(twice(w, x)), 2 * dense, "pitfall: psum of the reduced grad")
    return True


def test_replicated_param_grads(world2):
    assert world2.run(replicated_param_grads) == [True, True]


def test_jax_pitfall_is_pinned(world2):
    assert world2.run(jax_pitfall) == [True, True]


def mlp_body(x, w1, w2):
    return lax.psum(torch.tanh(x @ w1) @ w2, "tp")


def dense_mlp(ps, X):
    return torch.tanh(X @ ps[0]) @ ps[1]


def tensor_parallel_mlp(shape, names):
    """Column- then row-parallel MLP (plus data parallel when the mesh has 'dp')."""
    mesh = fs.Mesh.create(shape, names)
    dp = "dp" if "dp" in names else None
    X, W1, W2 = _gen(0, 4, 3), _gen(1, 3, 8), _gen(2, 8, 2)
    specs = (P(None, "tp"), P("tp"))
    ps = tuple(fs.shard(t, mesh, s) for t, s in zip((W1, W2), specs))
    x = fs.shard(X, mesh, P(dp))
    f = fs.shard_map(mlp_body, mesh, (P(dp), *specs), P(dp))

    def loss(ps_, x_):
        return (fs.gather(f(x_, *ps_)) ** 2).sum()

    _close(fs.gather(f(x, *ps)), dense_mlp((W1, W2), X), "TP MLP forward")
    gs = grad(loss)(ps, x)
    want = grad(lambda q: (dense_mlp(q, X) ** 2).sum())((W1, W2))
    for g, p, d in zip(gs, ps, want):
        assert g.layout == p.layout, (g.layout, p.layout)
        _close(fs.gather(g), d, "TP MLP grad")
    # per-example grads with sharded params (the batch is plain here: one example at a time)
    pe = vmap(grad(lambda ps_, xi: loss(ps_, xi[None])), in_dims=(None, 0))(ps, X)
    want_pe = vmap(grad(lambda q, xi: (dense_mlp(q, xi[None]) ** 2).sum()), in_dims=(None, 0))(
        (W1, W2), X
    )
    for g, d in zip(pe, want_pe):
        _close(fs.gather(g), d, "TP MLP per-example grads")
    # jacrev w.r.t. a sharded param, and jvp through the whole thing
    jr = jacrev(lambda w1: fs.gather(f(x, w1, ps[1])))(ps[0])
    assert jr.spec.dims[-1] == ("tp",)
    _close(fs.gather(jr), jacrev(lambda w1: dense_mlp((w1, W2), X))(W1), "jacrev")
    t1 = fs.shard(_gen(3, 3, 8), mesh, specs[0])
    got = jvp(lambda w1: fs.gather(f(x, w1, ps[1])), (ps[0],), (t1,))[1]
    want_t = jvp(lambda w1: dense_mlp((w1, W2), X), (W1,), (_gen(3, 3, 8),))[1]
    _close(got, want_t, "jvp through shard_map")
    return True


def test_tensor_parallel_mlp_1d(world2):
    assert world2.run(tensor_parallel_mlp, (2,), ("tp",)) == [True, True]


def test_tensor_and_data_parallel_mlp_2x2(world4):
    assert world4.run(tensor_parallel_mlp, (2, 2), ("dp", "tp")) == [True] * 4


def hessian_of_local_shard():
    """hessian w.r.t. a local shard (via from_local) through a shard_map body."""
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    X = _gen(0, 4, 3)

    def f(local):
        x = fs.from_local(local, mesh, P("x"), shape=(4, 3))
        s = fs.shard_map(lambda b: lax.psum((b**3).sum(), "x"), mesh, P("x"), P())(x)
        return fs.gather(s)

    mine = X[2 * r : 2 * r + 2]
    h = hessian(f)(mine)
    want = hessian(lambda t: (t**3).sum())(mine)
    _close(h, want, "hessian of a local shard")
    return True


def test_hessian_of_local_shard(world2):
    assert world2.run(hessian_of_local_shard) == [True, True]


def vmap_and_shard_map_commute():
    mesh = fs.Mesh.create((2,), ("x",))
    Xs = _gen(0, 3, 4, 2)  # a batch of 3 values of shape (4, 2)
    body = lambda b: lax.psum(b.sum(0), "x") * b  # noqa: E731
    outer = vmap(lambda t: fs.gather(fs.shard_map(body, mesh, P("x"), P("x"))(t)))(Xs)
    inner = fs.gather(fs.shard_map(vmap(body), mesh, P(None, "x"), P(None, "x"))(Xs))
    want = vmap(lambda t: t.sum(0) * t)(Xs)
    _close(outer, want, "vmap(shard_map)")
    _close(inner, want, "shard_map(vmap)")
    return True


def test_vmap_and_shard_map_commute(world2):
    assert world2.run(vmap_and_shard_map_commute) == [True, True]


# -- outputs: exact global shapes ---------------------------------------------------------------


def global_shapes():
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    x = fs.shard(_gen(0, 5, 2), mesh, P("x"))  # blocks of 3 and 2 rows
    assert x.local.shape == ((3, 2) if r == 0 else (2, 2))
    with fs.debug.comm_log() as log:
        y = fs.shard_map(lambda b: b * 2, mesh, P("x"), P("x"))(x)
    assert y.shape == (5, 2) and [e.op for e in log] == ["size_exchange"]
    _close(fs.gather(y), 2 * _gen(0, 5, 2), "uneven output value")
    with fs.debug.comm_log() as log:
        y2 = fs.shard_map(lambda b: b * 2, mesh, P("x"), P("x"), out_shapes=(5, 2))(x)
    assert y2.shape == (5, 2) and log == []
    with fs.debug.comm_log() as log:  # nothing split: the local shape is the global shape
        z = fs.shard_map(lambda b: lax.psum(b.sum(0), "x"), mesh, P("x"), P())(x)
    assert z.shape == (2,) and [e.op for e in log] == ["all_reduce"]
    # multiple outputs, pytree out_specs prefix, one exchange for all of them
    with fs.debug.comm_log() as log:
        outs = fs.shard_map(
            lambda b: {"a": b, "b": (b[:, :1], b.sum(1))}, mesh, P("x"), {"a": P("x"), "b": P("x")}
        )(x)
    assert [e.op for e in log] == ["size_exchange"]
    assert outs["a"].shape == (5, 2) and outs["b"][0].shape == (5, 1) and outs["b"][1].shape == (5,)
    # blocks that do not follow fshard's chunking are refused, naming the output and dim
    _raises(
        lambda: fs.shard_map(lambda b: b if r else b[:1], mesh, P("x"), P("x"))(x),
        ValueError,
        r"output dim 0 is split over \('x',\) with chunk sizes \[1, 2\]",
    )
    _raises(
        lambda: fs.shard_map(lambda b: b, mesh, P("x"), P("x"), out_shapes=(7, 2))(x),
        ValueError,
        r"local shape \(\d, 2\) but out_shapes gives global shape \(7, 2\)",
    )
    _raises(
        lambda: fs.shard_map(lambda b: b[:, :1] if r else b, mesh, P("x"), P("x"))(x),
        ValueError,
        "dim 1 is not split by its out_spec but its local size differs",
    )
    return True


def test_global_shapes_are_exact(world2):
    assert world2.run(global_shapes) == [True, True]


# -- errors ---------------------------------------------------------------------------------


def boundary_errors():
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    x = fs.shard(_gen(0, 4, 2), mesh, P("x"))
    f = fs.shard_map(lambda b: b, mesh, P(None, "x"), P(None, "x"))
    _raises(
        lambda: f(x),
        ValueError,
        r"has layout P\('x'\) but in_specs gives P\(None, 'x'\).*fs\.reshard",
    )
    _raises(lambda: fs.shard_map(lambda b: b, mesh, P("y"), P())(x), ValueError, "'y'.*not an axis")
    _raises(lambda: fs.shard_map(lambda b: b, mesh, "x", P())(x), TypeError, "fshard.P")
    _raises(
        lambda: fs.shard_map(lambda a, b: a, mesh, (P(), P(), P()), P())(x, x), ValueError, "prefix"
    )
    _raises(lambda: fs.shard_map(lambda b: 3, mesh, P("x"), P())(x), TypeError, "returned int")
    # every input and every output that does not fit is named, by its key path, at once
    f3 = fs.shard_map(lambda a, b, c: a, mesh, (P("x"), P("y"), P(None, "x")), P("x"))
    msg = _raises(lambda: f3(x, x, x), ValueError, r"in_specs \(2 leaves\)")
    assert "args[1]: spec P('y') names axis 'y'" in msg and "args[0]" not in msg, msg
    assert "args[2]: has layout P('x') but in_specs gives P(None, 'x')" in msg, msg
    outs = {"a": P("x"), "b": P("x"), "c": P(None, None, "x")}
    g = fs.shard_map(lambda b: {"a": b, "b": 3, "c": b}, mesh, P("x"), outs)
    msg = _raises(lambda: g(x), ValueError, r"out_specs \(2 leaves\)")
    assert "output['b']: the body returned int" in msg and "output['a']" not in msg, msg
    assert "output['c']: has 2 dims but its out_spec P(None, None, 'x') has 3" in msg, msg
    _raises(lambda: fs.shard_map(lambda b: b, mesh, P("x"), P("x"))(b=x), TypeError, "positionally")
    _raises(lambda: fs.shard_map(lambda b: b, "mesh", P(), P()), TypeError, "mesh must be")
    _raises(lambda: fs.shard_map(3, mesh, P(), P()), TypeError, "callable")
    # check_replication: a per-rank value declared replicated is named with its axis
    bad = fs.shard_map(
        lambda b: {"y": b * (r + 1.0)}, mesh, P(), {"y": P()}, check_replication=True
    )
    msg = _raises(
        lambda: bad(torch.ones(2)), ValueError, r"output\['y'\].*replicated over mesh axis 'x'"
    )
    ok = fs.shard_map(lambda b: lax.psum(b, "x"), mesh, P("x"), P(), check_replication=True)
    _close(fs.gather(ok(x)), _gen(0, 4, 2)[:2] + _gen(0, 4, 2)[2:], "check_replication passes")
    # under vmap too (the check reads the physical tensors)
    vm = vmap(lambda t: fs.gather(ok(fs.shard(t, mesh, P("x")))))(_gen(1, 3, 4, 2))
    assert vm.shape == (3, 2, 2)
    return msg


def test_boundary_errors(world2):
    msgs = world2.run(boundary_errors)
    assert all("differ across that axis" in m for m in msgs)


def tracking_details():
    """In-place ops, torch.cat of mixed operands, grad and vmap inside the body."""
    mesh = fs.Mesh.create((2,), ("x",))
    X, W = _gen(0, 4, 3), _gen(1, 3)
    x, w = fs.shard(X, mesh, P("x")), fs.shard(W, mesh, P())

    def body(x_, w_):
        buf = torch.zeros_like(x_)
        buf.add_(x_ * w_)  # in-place: buf becomes varying
        both = torch.cat([buf, w_.expand(1, 3)], 0)  # w_ is pcast inside cat
        per_row = vmap(lambda row: (row * w_).sum())(x_)  # vmap inside: sees x_ varying
        return lax.psum((both**2).sum() + per_row.sum(), "x")

    f = fs.shard_map(body, mesh, (P("x"), P()), P())

    def dense(w_):
        return ((X * w_) ** 2).sum() + 2 * (w_**2).sum() + (X * w_).sum()

    _close(fs.gather(f(x, w)), dense(W), "tracking forward")
    _close(grad(lambda w_: fs.gather(f(x, w_)))(w).local, grad(dense)(W), "tracking grad")
    return True


def test_tracking_details(world2):
    assert world2.run(tracking_details) == [True, True]


# -- issue 14.2: out_specs checked from the tracked varying axes; axis_index varies; inner ----
# -- transforms keep their varying axes; linearize refused -------------------------------------


def out_specs_checked():
    mesh = fs.Mesh.create((2,), ("x",))
    X = _gen(0, 4, 3)
    x = fs.shard(X, mesh, P("x"))
    with fs.debug.comm_log() as log:
        msg = _raises(
            lambda: fs.shard_map(lambda b: b * 2, mesh, P("x"), P())(x),
            ValueError,
            r"output: declared replicated over mesh axis 'x'.*varies over 'x'.*fs\.lax\.psum"
            r".*P\('x'\)",
        )
    assert log == [], "the check reads tracked axes only: no communication"
    # JAX: all_gather's default result is varying, so out_specs=P() is rejected ...
    _raises(
        lambda: fs.shard_map(lambda b: lax.all_gather(b, "x"), mesh, P("x"), P())(x),
        ValueError,
        "to='invariant'",
    )
    # ... while the invariant gather, a psum and a varying out_spec pass.
    inv = fs.shard_map(lambda b: lax.all_gather(b, "x", to="invariant"), mesh, P("x"), P())
    _close(fs.gather(inv(x)), X, "all_gather(to='invariant') as P()")
    ps = fs.shard_map(lambda b: lax.psum(b, "x"), mesh, P("x"), P())
    _close(fs.gather(ps(x)), X[:2] + X[2:], "psum as P()")
    _close(fs.gather(fs.shard_map(lambda b: b * 2, mesh, P("x"), P("x"))(x)), 2 * X, "P(x)")
    # A nested output names its path.
    _raises(
        lambda: fs.shard_map(lambda b: {"y": b}, mesh, P("x"), {"y": P()})(x),
        ValueError,
        r"output\['y'\]",
    )
    return msg


def test_out_specs_checked_from_varying_axes(world2):
    m0, m1 = world2.run(out_specs_checked)
    assert m0 == m1


def axis_index_varies():
    """JAX: psum(w * (1 + axis_index('x'))) over 2 ranks is 3w, with gradient 3 on every rank."""
    mesh = fs.Mesh.create((2,), ("x",))
    W = _gen(1, 3)
    w = fs.shard(W, mesh, P())
    f = fs.shard_map(lambda w_: lax.psum(w_ * (1 + lax.axis_index("x")), "x"), mesh, P(), P())
    _close(fs.gather(f(w)), 3 * W, "value")
    g = grad(lambda w_: fs.gather(f(w_)).sum())(w)
    _close(g.local, torch.full_like(W, 3.0), "grad (JAX gives 3 on both ranks)")
    # It still indexes like an int.
    rows = fs.shard_map(lambda w_: w_[lax.axis_index("x")].reshape(1), mesh, P(), P("x"))
    _close(fs.gather(rows(w)), W[:2], "indexing with axis_index")
    assert isinstance(lax.axis_index("x", mesh=mesh), int)  # outside a body: an int
    return True


def test_axis_index_is_varying(world2):
    assert world2.run(axis_index_varies) == [True, True]


def axis_index_slices():
    mesh = fs.Mesh.create((2,), ("x",))
    v = torch.arange(4.0, dtype=torch.float64) / 3 + 1

    def body(v_):
        i = lax.axis_index("x")
        return lax.psum((v_[2 * i : 2 * i + 2] ** 2).sum(), "x")  # bounds from axis_index

    def narrow(v_):
        i = lax.axis_index("x")
        return lax.psum((torch.narrow(v_, 0, 2 * i, 2) ** 2).sum(), "x")

    out = []
    for fn in (body, narrow):
        f = fs.shard_map(fn, mesh, P(), P())
        vs = fs.shard(v, mesh, P())
        out.append((fs.gather(f(vs)), fs.gather(grad(lambda w, f=f: fs.gather(f(w)))(vs))))
    return out


def test_slice_at_axis_index_has_jax_gradient(world2):
    """Issue 26 item 4: a slice of a replicated value at a position computed from
    ``axis_index`` varies over the axis (JAX's ``dynamic_slice``): its gradient is summed over
    the ranks. Was: tracked invariant, the gradient was each rank's own half (1.52 off)."""
    v = torch.arange(4.0, dtype=torch.float64) / 3 + 1
    for rank in world2.run(axis_index_slices):
        for value, g in rank:
            _close(value, (v**2).sum(), "value")
            _close(g, 2 * v, "gradient summed over the ranks (JAX)")


def inner_transforms_keep_varying_axes():
    """grad / vmap(out_dims=1) inside the body give varying values: the outer gradient matches
    the dense one (treating them as replicated double-counted the cotangents)."""
    mesh = fs.Mesh.create((2,), ("x",))
    X, W = _gen(0, 4, 3), _gen(1, 3)
    x, w = fs.shard(X, mesh, P("x")), fs.shard(W, mesh, P())

    def with_grad(x_, w_):
        gx = grad(lambda v: ((v * w_) ** 2).sum())(x_)  # 2 x w^2: varies over x
        return lax.psum((gx * w_).sum(), "x")

    def with_vmap(x_, w_):
        y = vmap(lambda row: row * w_, out_dims=1)(x_)  # (3, rows): varies over x
        return lax.psum((y**2).sum(), "x")

    dense = {
        with_grad: lambda w_: (2 * X * w_**3).sum(),
        with_vmap: lambda w_: ((X * w_) ** 2).sum(),
    }
    for body, ref in dense.items():
        f = fs.shard_map(body, mesh, (P("x"), P()), P())
        _close(fs.gather(f(x, w)), ref(W), f"{body.__name__} value")
        _close(grad(lambda w_, f=f: fs.gather(f(x, w_)))(w).local, grad(ref)(W), body.__name__)
    return True


def test_inner_grad_and_vmap_keep_varying_axes(world2):
    assert world2.run(inner_transforms_keep_varying_axes) == [True, True]


def linearize_refused():
    mesh = fs.Mesh.create((2,), ("x",))
    X = _gen(0, 4, 3)
    f = fs.shard_map(lambda b: lax.psum((b**2).sum(0), "x"), mesh, P("x"), P())

    def fn(t):
        return fs.gather(f(fs.shard(t, mesh, P("x"))))

    msg = _raises(lambda: torch.func.linearize(fn, X), NotImplementedError, "torch.func.jvp")
    # The suggested replacement works: jvp against the dense jvp.
    T = _gen(2, 4, 3)
    _, tangent = jvp(fn, (X,), (T,))
    _close(tangent, jvp(lambda t: (t**2).sum(0), (X,), (T,))[1], "jvp instead of linearize")
    return msg


def test_linearize_through_a_collective_raises(world2):
    m0, m1 = world2.run(linearize_refused)
    assert m0 == m1 and "linearize" in m0


def partial_out_spec_of_invariant_value():
    """Issue 21 item 2: psum's result is invariant over the axis; declaring it P(partial=...)
    would add its n copies (the value came back 2x the dense one). check_vma refuses it, as JAX
    refuses an unreduced out_spec for an invariant value; the varying addends are accepted."""
    mesh = fs.Mesh.create((2,), ("tp",))
    X = _gen(3, 4)
    x = fs.shard(X, mesh, P())
    parts = fs.from_local(x.local / 2, mesh, P(partial="tp"), shape=(4,))
    summed = fs.shard_map(
        lambda t: lax.psum(t * 2, "tp"), mesh, (P(partial="tp"),), P(partial="tp")
    )
    msg = _raises(lambda: summed(parts), ValueError, r"invariant over 'tp'.*out_specs=P\(\)")
    invariant = fs.shard_map(lambda t: t * 2, mesh, (P(),), P(partial="tp"))
    _raises(lambda: invariant(x), ValueError, r"declared partial over mesh axis 'tp'")
    # The fixes the message names give the dense 2 * x.
    fixed = fs.shard_map(lambda t: lax.psum(t * 2, "tp"), mesh, (P(partial="tp"),), P())
    _close(fs.gather(fixed(parts)), 2 * X, "psum returned replicated")
    addends = fs.shard_map(lambda t: t * 2, mesh, (P(partial="tp"),), P(partial="tp"))
    _close(fs.gather(addends(parts)), 2 * X, "addends returned partial")
    g = grad(lambda p: fs.gather(addends(p)).sum())(parts)
    _close(fs.gather(g), torch.full_like(X, 2.0), "grad of the partial output")
    # check_vma=False trusts the out_spec (documented): the copies are taken as addends.
    trusted = fs.shard_map(lambda t: t * 2, mesh, (P(),), P(partial="tp"), check_vma=False)
    _close(fs.gather(trusted(x)), 4 * X, "check_vma=False trusts P(partial)")
    return msg


def test_partial_out_spec_of_invariant_value_is_refused(world2):
    m0, m1 = world2.run(partial_out_spec_of_invariant_value)
    assert m0 == m1
