"""The torch.func contract of shard / from_local / gather / reshard, and the examples.

Gradient contract (DESIGN §4): the grad of a ShardedArray has the primal's layout, gathered it
equals the dense gradient, and a replicated value gets the full gradient on every rank.
"""

import importlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import fshard as fs
from fshard import P

_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

DT = torch.float64


def _gen(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=1e-9, rtol=1e-7), f"{what}: {got} != {want}"


def _loss(t):
    return (torch.sin(t) * t).sum()


def reshard_contract(shape, names, cases):
    """grad / jvp / vmap(grad) / jacrev through reshard+gather, layouts preserved."""
    mesh = fs.Mesh.create(shape, names)
    T = _gen(0, 6, 4)
    for src, dst in cases:
        x = fs.shard(T, mesh, src)

        def full(x_, dst=dst):
            return fs.gather(fs.reshard(x_, dst))

        g = grad(lambda x_: _loss(full(x_)))(x)
        assert g.layout == x.layout, (src, dst, g.layout)
        jr = jacrev(lambda x_: full(x_).sum(1))(x)
        # A partial source's gradient holds addends of the dense gradient (README: partial
        # values), so it gathers like any other layout.
        _close(fs.gather(g), grad(_loss)(T), f"grad {src}->{dst}")
        _close(fs.gather(jr), jacrev(lambda a: a.sum(1))(T), f"jacrev {src}->{dst}")
        t = fs.shard(_gen(1, 6, 4), mesh, src)
        _close(jvp(full, (x,), (t,))[1], _gen(1, 6, 4), f"jvp {src}->{dst}")
    # vmap(grad) over a stack (the stacked dim unsharded)
    Ts = _gen(2, 3, 6, 4)
    xs = fs.shard(Ts, mesh, P(None, *cases[0][0].dims))
    pe = vmap(grad(lambda x_: _loss(fs.gather(fs.reshard(x_, cases[0][1])))))(xs)
    assert pe.layout == xs.layout
    _close(fs.gather(pe), vmap(grad(_loss))(Ts), "vmap(grad) reshard")
    return True


def test_reshard_differentiable_1d(world2):
    cases = [
        (P("x"), P(None, "x")),  # S(0) -> S(1): all_to_all
        (P("x"), P()),  # S -> R
        (P(), P("x")),  # R -> S
        (P(partial="x"), P()),  # P -> R: all_reduce
        (P(partial="x"), P("x")),  # P -> S: reduce_scatter
        (P(), P(partial="x")),  # R -> P
    ]
    assert world2.run(reshard_contract, (2,), ("x",), cases) == [True, True]


def replicated_to_partial():
    """R -> P keeps the value on the first rank and zeros elsewhere; its backward is the
    identity (a partial value's cotangent is invariant), so grad through it logs only the
    forward all_reduce of the gather; an inf stays inf (zeros, not x * 0)."""
    mesh = fs.Mesh.create((2,), ("x",))
    T, W = _gen(0, 6, 4), _gen(1, 6, 4)
    T[2, 1] = float("inf")
    x = fs.shard(T, mesh, P())

    def f(x_):
        return (fs.gather(fs.reshard(x_, P(partial="x"))) * W).sum()

    assert torch.equal(fs.gather(fs.reshard(x, P(partial="x"))), T)
    with fs.debug.comm_log() as log:
        g = grad(f)(x)
    assert g.layout == x.layout
    assert torch.equal(g.local, W)  # d/dT (T * W).sum(), the full gradient on every rank
    return [(r.op, r.nbytes) for r in log]


def test_replicated_to_partial_backward_is_free(world2):
    assert world2.run(replicated_to_partial) == [[("all_reduce", 6 * 4 * 8)]] * 2


def test_reshard_differentiable_2x2(world4):
    cases = [
        (P("a", "b"), P("b", "a")),  # block permutation
        (P(("a", "b")), P(None, "b")),
        (P("a", partial="b"), P(None, "a")),
    ]
    assert world4.run(reshard_contract, (2, 2), ("a", "b"), cases) == [True] * 4


def creation_inside_transforms():
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()
    T, W = _gen(0, 6, 4), _gen(1, 4, 3)

    # fs.shard of a plain tensor inside grad (DTensor's distribute_tensor fails this)
    def f(t):
        x = fs.shard(t, mesh, P("x"))
        return _loss(fs.gather(x) @ W)

    _close(grad(f)(T), grad(lambda t: _loss(t @ W))(T), "grad through fs.shard")
    # ...and inside vmap over a plain batch, and vmap(grad)
    Ts = _gen(2, 3, 6, 4)
    _close(vmap(f)(Ts), vmap(lambda t: _loss(t @ W))(Ts), "vmap through fs.shard")
    _close(vmap(grad(f))(Ts), vmap(grad(lambda t: _loss(t @ W)))(Ts), "vmap(grad) fs.shard")

    # a random sharded value created inside a transform
    def noisy(t):
        gen = torch.Generator().manual_seed(5)
        return (fs.gather(fs.randn((6, 4), mesh, P("x"), dtype=DT, generator=gen)) * t).sum()

    want = torch.randn(6, 4, generator=torch.Generator().manual_seed(5), dtype=DT)
    _close(grad(noisy)(T), want, "fs.randn created inside grad")
    # from_local inside transforms: grad / jacfwd / hessian w.r.t. this rank's local shard
    mine = T[3 * r : 3 * r + 3]

    def h(local):
        return _loss(fs.gather(fs.from_local(local, mesh, P("x"), shape=(6, 4))))

    _close(grad(h)(mine), grad(_loss)(mine), "grad w.r.t. a local shard")
    _close(hessian(h)(mine), hessian(_loss)(mine), "hessian w.r.t. a local shard")
    jf = jacfwd(lambda local: fs.gather(fs.from_local(local, mesh, P("x"), shape=(6, 4))))(mine)
    assert jf.shape == (6, 4, 3, 4)
    # jvp through gather: the tangent gathers like the value (every rank moves its own block)
    x = fs.shard(T, mesh, P("x"))
    t = fs.shard(_gen(3, 6, 4), mesh, P("x"))
    val, tan = jvp(lambda x_: torch.sin(fs.gather(x_)), (x,), (t,))
    _close(val, torch.sin(T), "jvp gather value")
    _close(tan, torch.cos(T) * _gen(3, 6, 4), "jvp gather tangent")
    # grad(grad) through shard -> gather
    gg = grad(lambda t_: grad(f)(t_).pow(2).sum())(T)
    _close(gg, grad(lambda t_: grad(lambda a: _loss(a @ W))(t_).pow(2).sum())(T), "grad(grad)")
    return True


def test_creation_inside_transforms(world2):
    assert world2.run(creation_inside_transforms) == [True, True]


def run_example(name):
    return importlib.import_module(name).check()


def test_per_example_grads_example(world2):
    out = world2.run(run_example, "per_example_grads")
    for o in out:
        assert o["per_example_grad_err"] < 1e-10 and o["step_err"] < 1e-10, o
        assert o["step_specs"] == {"w1": P(None, "tp"), "w2": P("tp"), "b2": P()}
        assert o["per_example_specs"]["w1"] == P(None, None, "tp")


def test_ensemble_example(world2):
    out = world2.run(run_example, "ensemble")
    for o in out:
        assert o["pred_err"] < 1e-10 and o["grad_err"] < 1e-10, o
        assert o["pred_shape"] == (4, 7, 3)
        assert o["grad_specs"] == {"w1": P(None, None, "tp"), "w2": P(None, "tp")}
