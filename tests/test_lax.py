"""fs.lax collectives against their dense meaning, under every torch.func transform.

Every rank builds the same stack of per-rank inputs from a fixed seed (so each rank can compute
the dense reference locally), runs the collective on its own row, and compares with torch.func
on the dense function. Conventions (DESIGN §4): the global loss of a *varying* output is the sum
of the per-rank losses; an *invariant* output (psum, pmax, all_gather(to="invariant")) is one
value, counted once (its cotangent is the same on every rank of the axis); an invariant input
(pcast) is one value shared by its group.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import fshard as fs
from fshard import lax
from fshard.collectives import AllGather, Bound, Ppermute
from fshard.launch import RankError
from fshard.mesh import _member_ranks

DT = torch.float64
SHAPE = (4, 8)


def _prims(k):
    """(name, local fn(x, axes, mesh), dense group fn(Xg) -> (k, ...), in kind, out kind)."""
    m = SHAPE[1] * SHAPE[0] // k

    def rep(y):
        return y.unsqueeze(0).expand(k, *y.shape)

    def stacked(fn):
        return lambda xg: torch.stack([fn(xg, j) for j in range(k)])

    return [
        ("psum", lambda x, a, me: lax.psum(x, a, mesh=me), lambda g: rep(g.sum(0)), "V", "I"),
        ("pmean", lambda x, a, me: lax.pmean(x, a, mesh=me), lambda g: rep(g.mean(0)), "V", "I"),
        ("pmax", lambda x, a, me: lax.pmax(x, a, mesh=me), lambda g: rep(g.amax(0)), "V", "I"),
        ("pmin", lambda x, a, me: lax.pmin(x, a, mesh=me), lambda g: rep(g.amin(0)), "V", "I"),
        (
            "all_gather",
            lambda x, a, me: lax.all_gather(x, a, mesh=me),
            lambda g: rep(torch.cat(list(g), 0)),
            "V",
            "V",
        ),
        (
            "all_gather_invariant_dim1",
            lambda x, a, me: lax.all_gather(x, a, dim=1, to="invariant", mesh=me),
            lambda g: rep(torch.cat(list(g), 1)),
            "V",
            "I",
        ),
        (
            "all_gather_untiled",
            lambda x, a, me: lax.all_gather(x, a, dim=1, tiled=False, mesh=me),
            lambda g: rep(torch.stack(list(g), 1)),
            "V",
            "V",
        ),
        (
            "psum_scatter",
            lambda x, a, me: lax.psum_scatter(x, a, mesh=me),
            stacked(lambda g, j: g.sum(0).chunk(k, 0)[j]),
            "V",
            "V",
        ),
        (
            "psum_scatter_untiled",
            lambda x, a, me: lax.psum_scatter(x.reshape(k, m), a, tiled=False, mesh=me),
            stacked(lambda g, j: g.reshape(k, k, m).sum(0)[j]),
            "V",
            "V",
        ),
        (
            "all_to_all",
            lambda x, a, me: lax.all_to_all(x, a, 1, 0, mesh=me),
            stacked(lambda g, j: torch.cat([g[s].chunk(k, 1)[j] for s in range(k)], 0)),
            "V",
            "V",
        ),
        (
            "all_to_all_untiled",
            lambda x, a, me: lax.all_to_all(x.reshape(k, m), a, 0, 1, tiled=False, mesh=me),
            stacked(lambda g, j: torch.stack([g[s].reshape(k, m)[j] for s in range(k)], 1)),
            "V",
            "V",
        ),
        (
            "ppermute_shift",
            lambda x, a, me: lax.ppermute(x, a, [(i, (i + 1) % k) for i in range(k)], mesh=me),
            stacked(lambda g, j: g[(j - 1) % k]),
            "V",
            "V",
        ),
        (
            "ppermute_partial",
            lambda x, a, me: lax.ppermute(x, a, [(0, 1)], mesh=me),
            stacked(lambda g, j: g[0] if j == 1 else torch.zeros_like(g[0])),
            "V",
            "V",
        ),
        ("pcast", lambda x, a, me: lax.pcast(x, a, mesh=me), lambda g: g, "I", "V"),
    ]


class _Dense:
    """The dense meaning of a collective over ``axes`` on ``mesh``, on stacked inputs."""

    def __init__(self, mesh, axes, group_fn, in_kind, out_kind):
        self.ranks = list(mesh.ranks)
        self.me = self.ranks.index(dist.get_rank())
        self.members = [
            [self.ranks.index(q) for q in _member_ranks(mesh, axes, r)] for r in self.ranks
        ]
        groups = sorted({tuple(sorted(m)) for m in self.members})
        self.gid = [groups.index(tuple(sorted(m))) for m in self.members]
        n = len(self.ranks)
        self.din = self.gid if in_kind == "I" else list(range(n))  # distinct input row
        self.dout = self.gid if out_kind == "I" else list(range(n))  # distinct cotangent row
        self.m_out = len(self.members[0]) if out_kind == "I" else 1
        self.group_fn = group_fn

    def F(self, xd):
        """Per-rank outputs (stacked) of the distinct inputs ``xd``."""
        x = xd[self.din]
        outs = []
        for r, mem in enumerate(self.members):
            outs.append(self.group_fn(x[mem])[mem.index(r)])
        return torch.stack(outs)


def _gen(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=1e-9, rtol=1e-7), f"{what}: {got} != {want}"


def _check_prim(name, local_fn, dense: _Dense, axes, mesh, B=3):
    r, g = dense.me, dense.din[dense.me]
    n_in = len(set(dense.din))
    xd = _gen(1, n_in, *SHAPE)
    x = xd[g]

    def f(t):
        return local_fn(t, axes, mesh)

    out_shape = f(x).shape
    cs = _gen(2, len(dense.ranks), *out_shape)[dense.dout]  # cotangent per rank

    def phi(y, c):
        return (c * y).sum() + 0.25 * (y**2).sum()

    def local_loss(t):
        return phi(f(t), cs[r])

    def dense_loss(xd_):
        ys = dense.F(xd_)
        return sum(phi(ys[q], cs[q]) for q in range(len(ys))) / dense.m_out

    def G(xd_):
        return dense.F(xd_).sum(0) / dense.m_out

    zero = torch.zeros(SHAPE, dtype=DT)
    w = f"{name} over {axes}"
    _close(f(x), dense.F(xd)[r], f"{w}: forward")
    _close(grad(local_loss)(x), grad(dense_loss)(xd)[g], f"{w}: grad")
    _, pull = vjp(f, x)
    _, dpull = vjp(dense.F, xd)
    _close(pull(cs[r])[0], dpull(cs / dense.m_out)[0][g], f"{w}: vjp")
    td = _gen(3, n_in, *SHAPE)
    _close(jvp(f, (x,), (td[g],))[1], jvp(dense.F, (xd,), (td,))[1][r], f"{w}: jvp")
    jr = jacrev(G)(xd).select(len(out_shape), g)
    _close(jacrev(f)(x), jr, f"{w}: jacrev")
    _close(jacfwd(f)(x), jacfwd(lambda u: dense.F(xd + u)[r])(zero), f"{w}: jacfwd")
    want_h = jacfwd(lambda u: grad(dense_loss)(xd + u)[g])(zero)
    _close(hessian(local_loss)(x), want_h, f"{w}: hessian")
    xs_d = _gen(4, n_in, B, *SHAPE)
    want_v = vmap(dense.F, in_dims=1)(xs_d)[:, r]
    _close(vmap(f)(xs_d[g]), want_v, f"{w}: vmap in_dims=0")
    _close(vmap(f, in_dims=1)(xs_d[g].movedim(0, 1)), want_v, f"{w}: vmap in_dims=1")
    bs = _gen(5, B)
    want_n = vmap(lambda b: dense.F(xd)[r] * b)(bs)
    _close(vmap(lambda b: f(x) * b)(bs), want_n, f"{w}: vmap in_dims=None")
    want_vg = vmap(grad(dense_loss), in_dims=1)(xs_d)[:, g]
    _close(vmap(grad(local_loss))(xs_d[g]), want_vg, f"{w}: vmap(grad)")
    gg = grad(lambda t: (grad(local_loss)(t) ** 2).sum())(x)
    _close(gg, grad(lambda a: (grad(dense_loss)(a) ** 2).sum())(xd)[g], f"{w}: grad(grad)")
    xx_d = _gen(6, n_in, 2, B, *SHAPE)
    want_vv = vmap(vmap(dense.F, in_dims=1), in_dims=1)(xx_d)[:, :, r]
    _close(vmap(vmap(f))(xx_d[g]), want_vv, f"{w}: vmap(vmap)")


def check_all_prims(shape, names, axes_list):
    mesh = fs.Mesh.create(shape, names)
    done = []
    for axes in axes_list:
        k = mesh.size(axes)
        for name, local_fn, group_fn, ik, ok in _prims(k):
            tup = (axes,) if isinstance(axes, str) else tuple(axes)
            dense = _Dense(mesh, tup, group_fn, ik, ok)
            _check_prim(name, local_fn, dense, axes, mesh)
            done.append((name, axes))
    return done


def test_primitives_1d(world2):
    done = world2.run(check_all_prims, (2,), ("x",), ["x", ("x",)])
    assert len(done[0]) == 2 * len(_prims(2)) and done[0] == done[1]


def test_primitives_2x2(world4):
    done = world4.run(check_all_prims, (2, 2), ("a", "b"), ["b", ("b", "a")])
    assert len(done[0]) == 2 * len(_prims(2))


def uneven_blocks():
    """all_gather / psum_scatter with uneven per-rank sizes (3 and 1 rows)."""
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    sizes = (3, 1)
    full = _gen(7, 4, 2)
    mine = full[:3] if r == 0 else full[3:]
    c = _gen(8, 2, 4, 2)[r]

    def ag(t):
        return lax.all_gather(t, "x", sizes=sizes, mesh=mesh)

    _close(ag(mine), full, "uneven all_gather forward")
    # varying output: global loss = sum over ranks; d/d block = its rows of sum_r c_r
    csum = _gen(8, 2, 4, 2).sum(0)
    want = csum[:3] if r == 0 else csum[3:]
    _close(grad(lambda t: (c * ag(t)).sum())(mine), want, "uneven all_gather grad")
    _close(jvp(ag, (mine,), (torch.ones_like(mine),))[1], torch.ones(4, 2, dtype=DT), "jvp")
    vg = vmap(grad(lambda t: (c * ag(t)).sum()))(torch.stack([mine, 2 * mine]))
    _close(vg, torch.stack([want, want]), "uneven all_gather vmap(grad)")
    addend = _gen(9, 2, 4, 2)[r]
    total = _gen(9, 2, 4, 2).sum(0)

    def ps(t):
        return lax.psum_scatter(t, "x", sizes=sizes, mesh=mesh)

    _close(ps(addend), total[:3] if r == 0 else total[3:], "uneven psum_scatter forward")
    cb = c[:3] if r == 0 else c[3:]
    gs = grad(lambda t: (cb * ps(t)).sum())(addend)
    _close(gs, _uneven_ps_grad(sizes), "uneven psum_scatter grad")
    return True


def _uneven_ps_grad(sizes):
    cs = _gen(8, 2, 4, 2)
    return torch.cat([cs[0][: sizes[0]], cs[1][sizes[0] :]], 0)


def test_uneven_blocks(world2):
    assert world2.run(uneven_blocks) == [True, True]


def _sq(tree):
    return sum((v**2).sum() for v in tree.values())


def psum_pytree_buckets():
    """psum of a gradient pytree: buckets of at most PSUM_BUCKET_BYTES per dtype, launched
    together; values equal the dense sum, inputs are never written, grads flow."""
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    shapes = [(4, 8), (3,), (10, 3), (5,), (60,)]
    f32 = [_gen(20 + i, 2, *s)[r].float() for i, s in enumerate(shapes)]
    tree = {
        "a": f32[0],
        "b": f32[1],
        "c": f32[2].t(),  # non-contiguous leaf
        "d": f32[3],
        "e": _gen(30, 2, 6)[r],  # float64: its own bucket
        "f": f32[4],  # larger than the cap: a bucket of its own
    }
    before = {k: v.clone() for k, v in tree.items()}
    old = lax.PSUM_BUCKET_BYTES
    lax.PSUM_BUCKET_BYTES = 192  # f32: [a + b (128 + 12 B)] [c + d (120 + 20)] [f (240)]; f64: [e]
    try:
        with fs.debug.comm_log() as log:
            out = lax.psum(tree, "x", mesh=mesh)
        with fs.debug.comm_log() as glog:  # autograd path: same buckets, through the Function
            g = grad(lambda t: _sq(lax.psum(t, "x", mesh=mesh)))(tree)
    finally:
        lax.PSUM_BUCKET_BYTES = old
    assert [(c.op, c.nbytes) for c in log] == [
        ("all_reduce", 140),
        ("all_reduce", 140),
        ("all_reduce", 240),
        ("all_reduce", 48),
    ], log
    dense = {
        "a": _gen(20, 2, 4, 8).float().sum(0),
        "b": _gen(21, 2, 3).float().sum(0),
        "c": _gen(22, 2, 10, 3).float().sum(0).t(),
        "d": _gen(23, 2, 5).float().sum(0),
        "e": _gen(30, 2, 6).sum(0),
        "f": _gen(24, 2, 60).float().sum(0),
    }
    for k in tree:
        assert out[k].shape == tree[k].shape and out[k].dtype == tree[k].dtype, k
        torch.testing.assert_close(out[k], dense[k], rtol=1e-6, atol=1e-6)
        assert torch.equal(tree[k], before[k]), f"psum wrote its input {k}"
        # loss = sum_k |psum(t)_k|^2 counted once (invariant); d/dt_k = 2 * psum(t)_k via pcast
        torch.testing.assert_close(g[k], 2 * dense[k], rtol=1e-6, atol=1e-6)
    # forward buckets + the backward's (pcast: no comm)
    assert [(c.op, c.nbytes) for c in glog] == [(c.op, c.nbytes) for c in log], glog
    return True


def psum_donated():
    """psum(donate=True): large contiguous unshared plain leaves are reduced in place (the
    result is the input tensor), the rest packed; values equal the dense sum either way."""
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    old = lax.PSUM_INPLACE_MIN_BYTES
    lax.PSUM_INPLACE_MIN_BYTES = 64  # bytes, so small test leaves qualify
    try:
        base = _gen(40, 2, 10, 4)[r].float()
        shared = _gen(41, 2, 32)[r].float()
        tree = {
            "big": base.clone(),  # 160 B: in place
            "strided": base.clone().t(),  # non-contiguous: packed
            "small": _gen(42, 2, 3)[r].float(),  # 12 B: packed
            "s1": shared[:16],  # two leaves sharing one buffer: packed, not reduced twice
            "s2": shared[16:],
        }
        dense = {
            "big": _gen(40, 2, 10, 4).float().sum(0),
            "strided": _gen(40, 2, 10, 4).float().sum(0).t(),
            "small": _gen(42, 2, 3).float().sum(0),
            "s1": _gen(41, 2, 32).float().sum(0)[:16],
            "s2": _gen(41, 2, 32).float().sum(0)[16:],
        }
        big, strided = tree["big"], tree["strided"].clone()
        with fs.debug.comm_log() as log:
            out = lax.psum(tree, "x", mesh=mesh, donate=True)
        assert out["big"] is big, "a donated large leaf is reduced in place"
        assert torch.equal(tree["strided"], strided), "a packed donated leaf is not written"
        for k in tree:
            torch.testing.assert_close(out[k], dense[k], rtol=1e-6, atol=1e-6)
        # the in-place leaf, then one bucket of the rest: 160 + 12 + 64 + 64 bytes
        assert [(c.op, c.nbytes) for c in log] == [("all_reduce", 160), ("all_reduce", 300)], log
        # pmean divides in place on what psum returned; donate=False leaves inputs untouched
        x = _gen(43, 2, 10, 4)[r]
        keep = x.clone()
        m = lax.pmean({"x": x}, "x", mesh=mesh)["x"]
        torch.testing.assert_close(m, _gen(43, 2, 10, 4).mean(0))
        assert torch.equal(x, keep)
        m2 = lax.pmean(x, "x", mesh=mesh, donate=True)
        assert m2 is x
        torch.testing.assert_close(m2, _gen(43, 2, 10, 4).mean(0))
        # under grad a donated leaf is never written: the autograd path runs
        w = _gen(44, 2, 10, 4)[r]
        gw = grad(lambda t: (lax.psum({"w": t}, "x", mesh=mesh, donate=True)["w"] ** 2).sum())(w)
        torch.testing.assert_close(gw, 2 * _gen(44, 2, 10, 4).sum(0))
        assert torch.equal(w, _gen(44, 2, 10, 4)[r])
    finally:
        lax.PSUM_INPLACE_MIN_BYTES = old
    with pytest.raises(TypeError, match="donate must be a bool"):
        lax.psum(x, "x", mesh=mesh, donate="yes")
    return True


def plain_and_forward_ad():
    """A tensor no transform sees skips the Function (plain result, no graph); a forward-AD
    dual tensor (torch.autograd.forward_ad, not torch.func) still gets its tangent reduced."""
    import torch.autograd.forward_ad as fwad

    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    x, t = _gen(50, 2, 3)[r], _gen(51, 2, 3)[r]
    y = lax.psum(x, "x", mesh=mesh)
    assert y.grad_fn is None and not y.requires_grad
    _close(y, _gen(50, 2, 3).sum(0), "plain psum")
    assert lax.pcast(x, "x", mesh=mesh).grad_fn is None
    with fwad.dual_level():
        out = lax.psum(fwad.make_dual(x, t), "x", mesh=mesh)
        primal, tangent = fwad.unpack_dual(out)
    _close(primal, _gen(50, 2, 3).sum(0), "forward-AD psum primal")
    _close(tangent, _gen(51, 2, 3).sum(0), "forward-AD psum tangent")
    with fwad.dual_level():  # a pytree of duals (the bucketed path) keeps its tangents too
        out = lax.pmean({"a": fwad.make_dual(x, t), "b": x}, "x", mesh=mesh)
        primal, tangent = fwad.unpack_dual(out["a"])
    _close(primal, _gen(50, 2, 3).mean(0), "forward-AD pytree pmean primal")
    _close(tangent, _gen(51, 2, 3).mean(0), "forward-AD pytree pmean tangent")
    _close(out["b"], _gen(50, 2, 3).mean(0), "forward-AD pytree pmean, plain leaf")
    return True


def level_functions():
    """Under torch.func grad/jvp the collectives' Function runs through fshard's one-class
    level wrapper (fshard._function), never torch's per-call generated class, and stays exact:
    grad, grad of grad, jvp, vmap(grad), torch.autograd.grad(create_graph=True) inside
    torch.func.grad, and a collective that returns its operand (a size-1 axis)."""
    import torch._functorch.autograd_function as taf

    mesh = fs.Mesh.create((2, 1), ("x", "one"))
    r = dist.get_rank()
    X = _gen(60, 2, 3)
    generated = []
    original = taf.generate_single_level_function
    taf.generate_single_level_function = lambda *a: generated.append(a) or original(*a)
    try:

        def local(x):  # varying x -> invariant psum -> loss counted once
            return (lax.psum(x, "x", mesh=mesh) ** 3).sum()

        def dense(xs):
            return (xs.sum(0) ** 3).sum()

        _close(grad(local)(X[r]), grad(dense)(X)[r], "grad")
        # grad of a varying loss built from a grad: the per-rank losses sum
        _close(
            grad(lambda x: (grad(local)(x) ** 2).sum())(X[r]),
            grad(lambda xs: (grad(dense)(xs) ** 2).sum())(X)[r],
            "grad(grad)",
        )

        def inner_autograd(x):  # create_graph inside torch.func.grad: the same level twice
            (gx,) = torch.autograd.grad(local(x), x, create_graph=True)
            return (gx**2).sum()

        _close(
            grad(inner_autograd)(X[r]),
            grad(lambda xs: (grad(dense)(xs) ** 2).sum())(X)[r],
            "autograd.grad(create_graph) inside grad",
        )
        T = _gen(61, 2, 3)
        _close(jvp(lambda x: lax.psum(x, "x", mesh=mesh), (X[r],), (T[r],))[1], T.sum(0), "jvp")
        XB = _gen(62, 4, 2, 3)  # vmap over 4 examples of the stacked per-rank inputs
        _close(vmap(grad(local))(XB[:, r]), vmap(grad(dense))(XB)[:, r], "vmap(grad)")
        # an argument grad does not differentiate is wrapped but untracked: its pcast runs no
        # Function (2 applies per step: psum and its transpose); differentiated, it runs one and
        # reduces the cotangent (4: pcast, psum and their transposes)
        W, x0 = _gen(63, 2, 3), _gen(64, 3)

        def f(w, x):
            return (lax.psum(w * lax.pcast(x, "x", mesh=mesh), "x", mesh=mesh) ** 2).sum()

        def fd(ws, x):
            return ((ws * x).sum(0) ** 2).sum()

        applied = []
        real_call = lax.call
        lax.call = lambda fn, *a: applied.append(type(a[1].op).__name__) or real_call(fn, *a)
        try:
            _close(grad(f)(W[r], x0), grad(fd)(W, x0)[r], "grad w.r.t. the varying operand")
            assert applied == ["Psum", "Pcast"], applied
            applied.clear()
            _close(grad(f, argnums=1)(W[r], x0), grad(fd, argnums=1)(W, x0), "grad via pcast")
            assert sorted(applied) == ["Pcast", "Pcast", "Psum", "Psum"], applied
        finally:
            lax.call = real_call
        # a size-1 axis: the collective returns its operand; the grad is the identity's
        _close(grad(lambda x: (lax.psum(x, "one", mesh=mesh) ** 2).sum())(X[r]), 2 * X[r], "n=1")
    finally:
        taf.generate_single_level_function = original
    assert not generated, f"torch built {len(generated)} per-call Function classes"
    return True


def test_level_functions(world2):
    assert world2.run(level_functions) == [True, True]


def test_plain_and_forward_ad(world2):
    assert world2.run(plain_and_forward_ad) == [True, True]


def test_psum_donated(world2):
    assert world2.run(psum_donated) == [True, True]


def test_psum_pytree_buckets(world2):
    assert world2.run(psum_pytree_buckets) == [True, True]


def apply_with_done():
    """Two ops applied with the same ``done`` (FSDP's invariant and varying gathers of one
    param on the data gathered ahead): each result is a tensor of its own (not ``done``, not
    a view of it) and differentiates as its own op. Was: both were ``done`` itself, the second
    apply rewrote its ``grad_fn``, and the invariant gather's gradient came out summed over
    the axis (2, not 1)."""
    mesh = fs.Mesh.create((2,), ("x",))
    g = mesh.group("x")
    x = torch.full((2,), float(mesh.rank + 1), requires_grad=True)
    full = lax.all_gather(x.detach(), "x", mesh=mesh, to="varying")
    inv = lax.apply(Bound(AllGather(g.axes, 0, None, invariant=True), g), x, done=full)
    var = lax.apply(Bound(AllGather(g.axes, 0, None), g), x, done=full)
    assert inv is not full and var is not full and var is not inv
    assert inv._base is None and var._base is None and torch.equal(inv, var)
    (g_inv,) = torch.autograd.grad(inv.sum(), x)  # transpose: this rank's block, no comm
    (g_var,) = torch.autograd.grad(var.sum(), x)  # transpose: a reduce_scatter (2 ranks)
    return g_inv.tolist(), g_var.tolist()


def test_apply_with_done_gives_each_op_its_own_result(world2):
    assert world2.run(apply_with_done) == [([1.0, 1.0], [2.0, 2.0])] * 2


class _SeenOps(lax.Handler):
    def __init__(self):
        self.ops = []

    def process(self, b, x, done, proceed):
        self.ops.append(b.op.name)
        return proceed(b, x, done)


def apply_start_sends_in_flight():
    """``fs.lax.apply_start`` of a ppermute: the op is recorded (comm log, exact bytes) and
    seen by the handlers at launch; ``.result()`` on the sending rank returns what it received
    (nothing: zeros) without waiting for its send, which is still in flight while the peer has
    not posted its receive (Gloo sends on a posted receive); ``.wait()`` waits for it. The
    received value is ``ppermute``'s, differentiable as one (the backward sends the cotangent
    back)."""
    mesh = fs.Mesh.create((2,), ("x",))
    g, me = mesh.group("x"), mesh.rank
    b = Bound(Ppermute(g.axes, ((0, 1),)), g)
    x = torch.full((3,), float(me + 1), requires_grad=True)
    seen = _SeenOps()
    out = {}
    # no cross-rank check: its exchange at the launch would meet the peer's barrier
    with fs.config.consistency(False), fs.debug.comm_log() as log, lax.handling(seen):
        if me == 0:
            pending = lax.apply_start(b, x)
            out["logged"] = [(r.op, r.nbytes) for r in log]
            out["seen"] = list(seen.ops)
            y = pending.result()  # receives nothing: no wait for the peer
            out["in flight"] = not pending.sent()
            dist.barrier()  # the peer posts its receive only after this
            assert pending.wait() is y and pending.sent()
        else:
            dist.barrier()
            pending = lax.apply_start(b, x)
            out["logged"] = [(r.op, r.nbytes) for r in log]
            out["seen"] = list(seen.ops)
            y = pending.result()
            assert pending.sent()  # nothing sent
    out["y"] = y.tolist()
    (out["grad"],) = torch.autograd.grad((y * torch.tensor([1.0, 2.0, 3.0])).sum(), x)
    out["grad"] = out["grad"].tolist()
    return out


def test_apply_start_leaves_sends_in_flight(world2):
    r0, r1 = world2.run(apply_start_sends_in_flight)
    assert r0 == {
        "logged": [("ppermute", 12)], "seen": ["ppermute"], "in flight": True,
        "y": [0.0, 0.0, 0.0], "grad": [1.0, 2.0, 3.0],
    }  # fmt: skip
    assert r1 == {
        "logged": [("ppermute", 0)], "seen": ["ppermute"], "y": [1.0, 1.0, 1.0],
        "grad": [0.0, 0.0, 0.0],
    }  # fmt: skip


def bad_arguments(mesh=None):
    mesh = fs.Mesh.create((2,), ("x",)) if mesh is None else mesh
    x = torch.ones(4, 2)
    cases = [
        (lambda: lax.psum(x, "y", mesh=mesh), ValueError, "not an axis of the mesh"),
        (lambda: lax.psum(x, 3, mesh=mesh), TypeError, "axis must be"),
        (lambda: lax.psum(x, "x"), ValueError, "inside fs.shard_map, or pass mesh="),
        (lambda: lax.all_gather([1.0], "x", mesh=mesh), TypeError, "must be a torch.Tensor"),
        (lambda: lax.all_gather(x, "x", to="both", mesh=mesh), ValueError, "'varying' or"),
        (lambda: lax.all_gather(x, "x", dim=2, mesh=mesh), ValueError, "out of range"),
        (lambda: lax.all_gather(x, "x", sizes=(4, 4, 4), mesh=mesh), ValueError, "3 entries"),
        (lambda: lax.all_gather(x, "x", sizes=(3, 1), mesh=mesh), ValueError, "sizes\\["),
        (lambda: lax.psum_scatter(torch.ones(3), "x", mesh=mesh), ValueError, "divisible"),
        (lambda: lax.psum_scatter(x, "x", sizes=(3, 2), mesh=mesh), ValueError, "summing to 4"),
        (lambda: lax.psum_scatter(x, "x", tiled=False, mesh=mesh), ValueError, "equal the axis"),
        (lambda: lax.all_to_all(torch.ones(4, 3), "x", 1, 0, mesh=mesh), ValueError, "divisible"),
        (lambda: lax.all_to_all(x, "x", 0, 1, tiled=False, mesh=mesh), ValueError, "tiled=False"),
        (lambda: lax.ppermute(x, "x", [(0, 1), (1, 1)], mesh=mesh), ValueError, "once"),
        (lambda: lax.ppermute(x, "x", [(0, 2)], mesh=mesh), ValueError, "outside"),
        (lambda: lax.ppermute(x, "x", [0, 1], mesh=mesh), TypeError, "pairs"),
        (lambda: lax.pcast(x, "x", to="invariant", mesh=mesh), ValueError, "only to="),
        (lambda: lax.pmax("a", "x", mesh=mesh), TypeError, "pmax: x must be"),
    ]
    for fn, exc, pattern in cases:
        try:
            fn()
        except exc as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"no {exc.__name__} for {pattern}")
    return lax.axis_index("x", mesh=mesh), lax.axis_size("x", mesh=mesh)


def test_bad_arguments_fail_locally():
    """Each refusal comes before any collective, so each rank's is seen on a simulated mesh
    (one process); the same cases on real ranks: test_collective_on_some_ranks_fails_not_hangs."""
    abstract = fs.Mesh.abstract((2,), ("x",))
    for r in (0, 1):
        with fs.debug.comm_log() as log:
            assert bad_arguments(abstract.simulate(r, backend="gloo")) == (r, 2)
        assert log == [], log  # the simulated wire records what the real one sends: nothing


def psum_on_rank0_only():
    mesh = fs.Mesh.create((2,), ("x",))
    if dist.get_rank() == 0:
        lax.psum(torch.ones(2), "x", mesh=mesh)
    return dist.get_rank()


@pytest.mark.timeout(60)
def test_collective_on_some_ranks_fails_not_hangs(world2):
    start = time.monotonic()
    with pytest.raises((TimeoutError, RankError)) as info:
        world2.run(psum_on_rank0_only, timeout=3)  # rank 1 returns at once
    assert time.monotonic() - start < 25
    assert "did not finish within 3 s" in str(info.value) or "rank 0" in str(info.value)
    assert world2.run(bad_arguments)[0] == (0, 2)  # the world restarted and works


def _psum_of_sharded_refused():
    mesh = fs.Mesh.create((2,), ("dp",))
    x = fs.shard(torch.arange(4.0), mesh, fs.P("dp"))
    errors = []
    for call in (
        lambda: fs.lax.psum(x, "dp", mesh=mesh),
        lambda: fs.lax.psum({"a": x}, "dp", mesh=mesh),
        lambda: fs.lax.psum(x, "dp", mesh=mesh, donate=True),
        lambda: fs.lax.pmean(x, "dp", mesh=mesh),
    ):
        try:
            call()
            errors.append(None)
        except TypeError as e:
            errors.append(str(e))
    r = fs.from_local(torch.full((2,), float(dist.get_rank() + 1)), mesh, fs.P(), shape=(2,))
    summed = fs.lax.psum({"r": r}, "dp", mesh=mesh)["r"]  # replicated over dp: allowed
    return errors, summed.local.tolist()


def test_psum_of_a_sharded_value_is_refused(world2):
    """``fs.lax.psum(x, "dp")`` of a ShardedArray split over dp summed its blocks under the old
    layout (arange(4) in P('dp') gathered to [2, 4, 2, 4]); JAX refuses psum outside shard_map.
    Refused before any collective, naming fs.reshard and partial layouts. A value replicated
    over the axis (local-view DDP code, examples/train_gpt.py) still sums its per-rank locals."""
    for errors, summed in world2.run(_psum_of_sharded_refused):
        assert summed == [3.0, 3.0]
        assert all(e is not None for e in errors), errors
        for e in errors:
            assert "is a ShardedArray laid out over ('dp',) (P('dp') on Mesh(dp=2))" in e, e
            assert "fs.reshard" in e and "partial=" in e, e
