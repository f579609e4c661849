"""Shared checker for op-rule tests: values and grads against dense torch.func."""

import torch
from torch.func import grad

import fshard as fs


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1000 * len(shape) + sum(shape))
    return torch.randn(shape, generator=g, dtype=dtype)


def check(mesh, f, tensors, specs, *, grad_wrt=None, atol=1e-5, label=""):
    """gather(f(shard(x))) == f(x); grads w.r.t. sharded inputs match dense, with their layouts."""
    xs = [fs.shard(t, mesh, s) if s is not None else t for t, s in zip(tensors, specs)]
    out = f(*xs)
    want = f(*tensors)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    wants = want if isinstance(want, (tuple, list)) else (want,)
    for o, w in zip(outs, wants):
        assert isinstance(o, fs.ShardedArray), (label, type(o))
        assert tuple(o.shape) == tuple(w.shape), (label, o.shape, w.shape)
        assert o.dtype == w.dtype, (label, o.dtype, w.dtype)
        got = fs.gather(o)
        if w.dtype == torch.bool or not w.dtype.is_floating_point:
            assert torch.equal(got, w), (label, got, w)
        else:
            torch.testing.assert_close(got, w, atol=atol, rtol=1e-4, msg=lambda m: f"{label}: {m}")
    # A partial input's cotangent is invariant (every rank holds the full gradient), so its
    # gathered gradient is not the dense one: check values only for those.
    idx = [
        i
        for i, s in enumerate(specs)
        if s is not None and not s.partial and tensors[i].is_floating_point()
    ]
    if grad_wrt is not None:
        idx = [i for i in idx if i in grad_wrt]
    if not idx or not wants[0].is_floating_point():
        return
    cot = randn(*wants[0].shape, seed=7)

    def loss(f_out):
        o = f_out[0] if isinstance(f_out, (tuple, list)) else f_out
        return (o * cot).sum()

    def sharded_loss(sel):
        args = list(xs)
        for i, v in zip(idx, sel):
            args[i] = v
        return loss(fs.gather(_first(f(*args))))

    def dense_loss(sel):
        args = list(tensors)
        for i, v in zip(idx, sel):
            args[i] = v
        return loss(_first(f(*args)))

    gs = grad(sharded_loss)([xs[i] for i in idx])
    gd = grad(dense_loss)([tensors[i] for i in idx])
    for i, g_s, g_d in zip(idx, gs, gd):
        assert isinstance(g_s, fs.ShardedArray), (label, i, type(g_s))
        assert g_s.layout == xs[i].layout, (label, i, g_s.layout, xs[i].layout)
        torch.testing.assert_close(
            fs.gather(g_s), g_d, atol=atol, rtol=1e-4, msg=lambda m, i=i: f"{label} grad {i}: {m}"
        )


def _first(o):
    return o[0] if isinstance(o, (tuple, list)) else o
