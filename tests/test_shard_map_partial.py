"""fs.shard_map over part of a mesh (``axis_names=``, JAX's partial-manual mode) and nested.

The body is manual over the named axes (plain fs.lax collectives over them) and sees global-view
ShardedArrays over the others, whose op rules issue their own collectives. Oracle: the same
computation on dense tensors with torch.func, in the rank process; layouts compared exactly.
"""

import torch
from torch.func import grad, vmap

import fshard as fs
from fshard import P, lax

# the dense-oracle helpers of the full-manual tests
from .test_shard_map import _close, _gen, _raises

# -- partial-manual: values, layouts, gradients ---------------------------------------------------


def _stage(x, w, v):
    """A pipeline-like body, manual over pp only: x and w are global-view values over tp."""
    h = torch.tanh(x @ w)  # op rules: tp collectives as usual
    n = lax.axis_size("pp")
    whole = fs.reshard(h, P())  # a reshard over tp in the body keeps h's manual axes
    nxt = lax.ppermute(whole, "pp", [(i, (i + 1) % n) for i in range(n)])
    loss = lax.psum(((h * nxt) @ v).pow(2).sum(), "pp")
    return h, loss


def _dense_stage(X, W, V, npp):
    H = torch.tanh(X @ W)
    blocks = H.chunk(npp, 0)
    nxt = torch.cat([blocks[(i - 1) % npp] for i in range(npp)]) if npp > 1 else H
    return H, ((H * nxt) @ V).pow(2).sum()


def partial_manual(shape):
    mesh = fs.Mesh.create(shape, ("pp", "tp"))
    npp = shape[0]
    X, W, V = _gen(0, 8, 6), _gen(1, 6, 4), _gen(2, 4, 2)
    x = fs.shard(X, mesh, P("pp", "tp"))  # the auto axis tp also splits x: it stays split
    w = fs.shard(W, mesh, P(None, "tp"))
    v = fs.shard(V, mesh, P())
    seen = {}

    def body(x_, w_, v_):
        seen["x"] = (type(x_).__name__, x_.spec, tuple(x_.shape), x_.mesh.axis_names)
        return _stage(x_, w_, v_)

    f = fs.shard_map(body, mesh, (P("pp"), P(), P()), (P("pp"), P()), axis_names={"pp"})
    h, loss = f(x, w, v)
    H, L = _dense_stage(X, W, V, npp)
    # inside: this pp block of x, global over tp and still split over it
    assert seen["x"] == ("ShardedArray", P(None, "tp"), (8 // npp, 6), ("tp",)), seen
    assert h.spec.dims[0] == ("pp",) and tuple(h.shape) == (8, 4), (h.spec, h.shape)
    _close(fs.gather(h), H, "h")
    assert loss.spec == P()
    _close(fs.gather(loss), L, "loss")
    # gradients: the params' layouts, the dense values; w and v are replicated over pp and
    # meet pp-varying data, so their gradients are summed over pp exactly once
    gx, gw, gv = grad(lambda *a: fs.gather(f(*a)[1]), argnums=(0, 1, 2))(x, w, v)
    dX, dW, dV = grad(lambda *a: _dense_stage(*a, npp)[1], argnums=(0, 1, 2))(X, W, V)
    for g, p, d, what in ((gx, x, dX, "x"), (gw, w, dW, "w"), (gv, v, dV, "v")):
        assert g.layout == p.layout, (what, g.layout, p.layout)
        _close(fs.gather(g), d, f"grad {what}")
    # the top-level fs.value_and_grad path (its own bucketed reduction of the pcast leaves)
    val, (hx, hw, hv) = fs.value_and_grad(lambda *a: fs.gather(f(*a)[1]), argnums=(0, 1, 2))(
        x, w, v
    )
    _close(val, L, "value_and_grad loss")
    for g, p, d, what in ((hx, x, dX, "x"), (hw, w, dW, "w"), (hv, v, dV, "v")):
        assert g.layout == p.layout, (what, g.layout, p.layout)
        _close(fs.gather(g), d, f"value_and_grad {what}")
    # an input only feeding pp-invariant computation is not summed over pp (w * 2, out P())
    g2 = fs.shard_map(lambda w_: w_ * 2, mesh, P(), P(), axis_names={"pp"})
    gw2 = grad(lambda w_: fs.gather(g2(w_)).sum())(w)
    _close(fs.gather(gw2), torch.full_like(W, 2.0), "grad of w * 2")
    return True


def test_partial_manual_1x2(world2):
    """pp of size 1, tp of size 2: the auto axis's op rules run their collectives in the body."""
    assert world2.run(partial_manual, (1, 2)) == [True, True]


def test_partial_manual_2x1(world2):
    """pp of size 2: ppermute / psum over the manual axis between global-view values."""
    assert world2.run(partial_manual, (2, 1)) == [True, True]


def test_partial_manual_2x2(world4):
    assert world4.run(partial_manual, (2, 2)) == [True] * 4


def partial_manual_parts():
    """A fused projection's weight (``[gate | up]`` split per part over tp, fs.Parts) enters a
    body manual over cp: the body sees it as the same Parts over the auto axis tp; the value
    and the weight's gradient (in its Parts layout) equal dense. Parts split over a manual axis
    are refused by name, before any communication."""
    mesh = fs.Mesh.create((2, 2), ("cp", "tp"))
    X, W = _gen(0, 8, 6), _gen(1, 10, 6)
    fused = fs.Parts(P("tp", None), 0, (5, 5))
    w = fs.shard(W, mesh, fused)

    def body(x, w):
        assert w.layout.spec == fused and w.layout.mesh.axis_names == ("tp",)
        gate, up = torch.nn.functional.linear(x, w).split(5, -1)
        return lax.psum((torch.sigmoid(gate) * up).pow(2).sum(), "cp")

    f = fs.shard_map(body, mesh, (P("cp"), P()), P(), axis_names={"cp"})
    x = fs.shard(X, mesh, P("cp"))

    def dense(W_):
        gate, up = (X @ W_.T).split(5, -1)
        return (torch.sigmoid(gate) * up).pow(2).sum()

    value, g = fs.value_and_grad(lambda w_: fs.gather(f(x, w_)))(w)
    _close(value, dense(W), "parts value")
    assert g.layout == w.layout
    _close(fs.gather(g), grad(dense)(W), "parts grad")
    over_cp = fs.shard(W, mesh, fs.Parts(P("cp", None), 0, (5, 5)))
    _raises(lambda: f(x, over_cp), ValueError, "parts are split over the manual axes")
    return True


def test_partial_manual_parts(world4):
    assert world4.run(partial_manual_parts) == [True] * 4


def partial_manual_vmap():
    mesh = fs.Mesh.create((2, 1), ("pp", "tp"))
    Xs, W, V = _gen(0, 3, 8, 6), _gen(1, 6, 4), _gen(2, 4, 2)
    w, v = fs.shard(W, mesh, P(None, "tp")), fs.shard(V, mesh, P())
    f = fs.shard_map(_stage, mesh, (P("pp"), P(), P()), (P("pp"), P()), axis_names={"pp"})
    xs = fs.shard(Xs, mesh, P(None, "pp"))  # a batch of 3 x's, each split over pp
    losses = vmap(lambda x_: fs.gather(f(x_, w, v)[1]))(xs)
    _close(losses, vmap(lambda X: _dense_stage(X, W, V, 2)[1])(Xs), "vmap loss")
    per = vmap(grad(lambda w_, x_: fs.gather(f(x_, w_, v)[1])), in_dims=(None, 0))(w, xs)
    want = vmap(grad(lambda W_, X: _dense_stage(X, W_, V, 2)[1]), in_dims=(None, 0))(W, Xs)
    _close(fs.gather(per), want, "vmap(grad) w")
    return True


def test_partial_manual_vmap(world2):
    assert world2.run(partial_manual_vmap) == [True, True]


def partial_manual_comm():
    """Each collective runs where it should, with this rank's bytes: the op rule's all_reduce
    over the auto axis tp (tanh of a partial value), fs.lax.psum's over the manual axis pp."""
    X, W = _gen(0, 4, 6), _gen(1, 6, 3)

    def body(x_, w_):
        y = x_ @ w_  # contraction split over tp: partial over tp, no communication yet
        return lax.psum(torch.tanh(y), "pp"), y

    logs = []
    for shape in ((1, 2), (2, 1)):
        mesh = fs.Mesh.create(shape, ("pp", "tp"))
        x, w = fs.shard(X, mesh, P(None, "tp")), fs.shard(W, mesh, P("tp"))
        f = fs.shard_map(body, mesh, P(), P(), axis_names={"pp"})
        with fs.debug.comm_log() as log:
            t, y = f(x, w)
        logs.append([(r.op, r.axes, r.nbytes) for r in log])
        _close(fs.gather(t), torch.tanh(X @ W) * shape[0], f"psum over pp {shape}")
        # the auto axes' layout is kept: y leaves the body pending its sum over tp
        assert y.spec == P(partial="tp"), y.spec
        _close(fs.gather(y), X @ W, f"y {shape}")
    block = 4 * 3 * 8  # the (4, 3) float64 block
    assert logs == [[("all_reduce", ("tp",), block)], [("all_reduce", ("pp",), block)]], logs
    return True


def test_partial_manual_comm(world2):
    assert world2.run(partial_manual_comm) == [True, True]


# -- nested ----------------------------------------------------------------------------------------


def nested(shape):
    mesh = fs.Mesh.create(shape, ("pp", "tp"))
    X, W = _gen(0, 4, 8), _gen(1, 8)
    x = fs.shard(X, mesh, P("pp", "tp"))
    w = fs.shard(W, mesh, P("tp"))

    def inner(x_, w_):  # manual over pp (outer) and tp (inner): plain local blocks
        y = x_ * x_ * x_ * w_  # w_ is invariant over pp: pcast there, grad summed over pp
        return y, lax.psum(lax.psum(y.sum(), "tp"), "pp")

    def outer(x_, w_):
        assert isinstance(x_, fs.ShardedArray) and x_.spec == P(None, "tp")
        inner_f = fs.shard_map(inner, mesh, (P(None, "tp"), P("tp")), (P(None, "tp"), P()))
        return inner_f(x_, w_)

    f = fs.shard_map(outer, mesh, (P("pp"), P()), (P("pp"), P()), axis_names={"pp"})
    y, s = f(x, w)
    assert y.layout == x.layout, (y.layout, x.layout)
    _close(fs.gather(y), X**3 * W, "nested y")
    _close(fs.gather(s), (X**3 * W).sum(), "nested sum")
    gx, gw = grad(lambda a, b: fs.gather(f(a, b)[1]), argnums=(0, 1))(x, w)
    assert gx.layout == x.layout and gw.layout == w.layout
    _close(fs.gather(gx), 3 * X**2 * W, "nested grad x")
    _close(fs.gather(gw), (X**3).sum(0), "nested grad w")
    # vmap over a stack of x (each split over pp and tp), and vmap(grad) of w
    Xs = _gen(3, 2, 4, 8)
    xs = fs.shard(Xs, mesh, P(None, "pp", "tp"))
    ys = vmap(lambda a: fs.gather(f(a, w)[0]))(xs)
    _close(ys, Xs**3 * W, "nested vmap")
    per = vmap(grad(lambda b, a: fs.gather(f(a, b)[1])), in_dims=(None, 0))(w, xs)
    _close(fs.gather(per), (Xs**3).sum(1), "nested vmap(grad) w")
    # JAX's test_grad_nested_partial_auto: grad of x * x through both levels
    g = fs.shard_map(
        lambda x_: fs.shard_map(lambda b: b * b, mesh, P(None, "tp"), P(None, "tp"))(x_),
        mesh,
        P("pp"),
        P("pp"),
        axis_names={"pp"},
    )
    _close(fs.gather(grad(lambda a: fs.gather(g(a)).sum())(x)), 2 * X, "grad x * x")

    # the outer's input used by two inner shard_maps and outside them (DiffLlama's two
    # attention calls on the same q under parallelize's cp x tp): the inner bodies' marks on
    # its block overwrote the outer's, which then read it as invariant over pp and pcast it
    # there (its other uses' gradients summed over pp)
    def twice(x_):
        sq = fs.shard_map(lambda b: b * b, mesh, P(None, "tp"), P(None, "tp"))
        return sq(x_) * 3 + sq(x_) * x_ + x_ * 5

    h = fs.shard_map(twice, mesh, P("pp"), P("pp"), axis_names={"pp"})
    _close(fs.gather(h(x)), X * X * 3 + X**3 + X * 5, "twice")
    gx = grad(lambda a: fs.gather((h(a) * h(a)).sum()))(x)
    want = torch.func.grad(lambda a: ((a * a * 3 + a**3 + a * 5) ** 2).sum())(X)
    _close(fs.gather(gx), want, "grad of twice")
    return True


def test_nested_1x2(world2):
    assert world2.run(nested, (1, 2)) == [True, True]


def test_nested_2x1(world2):
    assert world2.run(nested, (2, 1)) == [True, True]


def test_nested_2x2(world4):
    assert world4.run(nested, (2, 2)) == [True] * 4


# -- errors, up front ----------------------------------------------------------------------------


def errors(mesh):
    x = fs.shard(torch.ones(4, 2), mesh, P("pp", "tp"))
    ident = lambda a: a  # noqa: E731
    _raises(
        lambda: fs.shard_map(ident, mesh, P("pp", "tp"), P("pp"), axis_names={"pp"})(x),
        ValueError,
        r"args\[0\].*names axis 'tp', which is not manual.*in_specs may name only",
    )
    _raises(
        lambda: fs.shard_map(ident, mesh, P("pp"), P("pp", "tp"), axis_names={"pp"})(x),
        ValueError,
        r"output.*names axis 'tp', which is not manual.*out_specs may name only",
    )
    _raises(
        lambda: fs.shard_map(ident, mesh, P("pp"), P("pp"), axis_names={"dp"}),
        ValueError,
        r"axis_names=\{'dp'\} must be a non-empty subset of the mesh axes",
    )
    _raises(
        lambda: fs.shard_map(ident, mesh, P("pp"), P("pp"), axis_names="pp"),
        TypeError,
        r"axis_names must be a set",
    )
    y = fs.shard(torch.ones(4, 2), mesh, P(None, "tp"))
    _raises(
        lambda: fs.shard_map(ident, mesh, P("pp"), P("pp"), axis_names={"pp"})(y),
        ValueError,
        r"has layout P\(None, 'tp'\).*fs.reshard",
    )
    # nested: an inner shard_map over an axis the outer already made manual
    inner = fs.shard_map(ident, mesh, P("pp"), P("pp"), axis_names={"pp"})
    _raises(
        lambda: fs.shard_map(inner, mesh, P("pp"), P("pp"), axis_names={"pp"})(x),
        ValueError,
        r"axis_names=\{'pp'\} names 'pp', which the enclosing shard_map already made manual",
    )
    inner2 = fs.shard_map(ident, mesh, P("pp"), P("pp"))
    _raises(
        lambda: fs.shard_map(inner2, mesh, P("pp"), P("pp"), axis_names={"pp"})(x),
        ValueError,
        r"names axis 'pp', which the enclosing shard_map already made manual",
    )
    full = fs.shard_map(lambda a: inner2(a), mesh, P("pp", "tp"), P("pp", "tp"))
    _raises(lambda: full(x), ValueError, r"no axis is left")
    # a collective over a manual axis on a dim split over an auto axis
    gat = fs.shard_map(
        lambda a: lax.all_gather(a, "pp", dim=1), mesh, P("pp"), P("pp"), axis_names={"pp"}
    )
    _raises(lambda: gat(x), ValueError, r"all_gather: x is a ShardedArray laid out as")
    return True


def test_errors():
    """Argument checks, raised before any collective: on an abstract mesh seen from one rank
    (Mesh.simulate), in this process."""
    assert errors(fs.Mesh.abstract((1, 1), ("pp", "tp")).simulate(0))
