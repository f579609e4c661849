"""Issue 37 item 1: torch code that runs on a ShardedArray without fshard's dispatch (custom
autograd Functions, torch.library custom ops, torch.utils.checkpoint, hooks) gives the dense
result or is refused naming the code and the fix; a gradient is never silently zero."""

import pytest
import torch
import torch.utils.checkpoint as cp

import fshard as fs

P = fs.P


class Double(torch.autograd.Function):  # old style: forward(ctx, ...)
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class DoubleNew(torch.autograd.Function):  # new style: setup_context (torch.func-ready)
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


class ScaledTanh(torch.autograd.Function):
    """Two tensor inputs (one may be a plain tensor), a Python constant, two outputs, saved
    tensors: a fused-activation-like Function."""

    @staticmethod
    def forward(x, scale, k):
        y = torch.tanh(x) * scale
        return y, y * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale, k = inputs
        ctx.save_for_backward(x, scale)
        ctx.k = k

    @staticmethod
    def backward(ctx, gy, gz):
        x, scale = ctx.saved_tensors
        g = gy + gz * ctx.k
        t = torch.tanh(x)
        gx = g * scale * (1 - t * t)
        gs = (g * t).sum_to_size(scale.shape)
        return gx, gs, None


def _mesh():
    return fs.Mesh.create((2,), ("x",))


def function_cases():
    mesh = _mesh()
    a = torch.arange(4.0)
    for fn in (Double, DoubleNew):
        for spec in (P(), P("x")):
            w = fs.shard(a, mesh, spec)
            loss, g = fs.value_and_grad(lambda w, fn=fn: fs.gather(fn.apply(w * 1.0).sum()))(w)
            assert float(loss) == 12.0, (fn, spec, loss)
            assert g.layout == w.layout
            torch.testing.assert_close(fs.gather(g), torch.full((4,), 2.0))
    for spec in (P(), P("x")):  # under torch.func.grad (new style: old style is torch's error)
        w = fs.shard(a, mesh, spec)
        g = torch.func.grad(lambda w: fs.gather((DoubleNew.apply(w) * w).sum()))(w)
        torch.testing.assert_close(fs.gather(g), 4 * a)
        # vmap of it, over a leading unsplit dim
        b = torch.arange(12.0).reshape(3, 4)
        wb = fs.shard(b, mesh, P(None, *spec))
        gb = torch.func.vmap(torch.func.grad(lambda w: fs.gather((DoubleNew.apply(w) * w).sum())))(
            wb
        )
        torch.testing.assert_close(fs.gather(gb), 4 * b)

    # several inputs (a ShardedArray, a plain tensor or a second ShardedArray), a constant,
    # two outputs, a loss that mixes the outputs with a split value afterwards
    x0 = torch.linspace(-2, 2, 24, dtype=torch.float64).reshape(6, 4)
    s0 = torch.linspace(0.5, 1.5, 4, dtype=torch.float64)

    def dense(x, s):
        y, z = ScaledTanh.apply(x, s, 3.0)
        return ((y * x).sum() + z.pow(2).sum()) / 7

    want = torch.func.grad(dense, argnums=(0, 1))(x0, s0)
    for xs in (P(), P("x"), P(None, "x")):
        x = fs.shard(x0, mesh, xs)
        for s in (s0, fs.shard(s0, mesh, P()), fs.shard(s0, mesh, P("x"))):

            def f(x, s):
                y, z = ScaledTanh.apply(x, s, 3.0)
                return fs.gather(((y * x).sum() + z.pow(2).sum()) / 7)

            args = (x, s)
            nums = (0, 1) if isinstance(s, fs.ShardedArray) else 0
            for how in ("value_and_grad", "torch.func.grad"):
                if how == "value_and_grad":
                    got = fs.value_and_grad(f, argnums=nums)(*args)[1]
                else:
                    got = torch.func.grad(f, argnums=nums)(*args)
                got = got if isinstance(got, tuple) else (got,)
                for gi, wi, arg in zip(got, want, args):
                    assert gi.layout == arg.layout, (how, xs)
                    torch.testing.assert_close(fs.gather(gi), wi, msg=f"{how} {xs}")
    # eager backward through the local blocks (requires_grad on the leaf's local)
    leaf = torch.arange(4.0).requires_grad_()
    w = fs.shard(leaf, mesh, P("x"))
    fs.gather(Double.apply(w).sum()).backward()
    torch.testing.assert_close(leaf.grad, torch.full((4,), 2.0))
    # arguments on two meshes are refused before any communication
    other = fs.Mesh.create((2,), ("y",))
    with pytest.raises(ValueError, match="ScaledTanh.apply: .*different meshes"):
        ScaledTanh.apply(fs.shard(x0, mesh, P()), fs.shard(s0, other, P()), 1.0)
    return True


def test_autograd_function_on_sharded_arguments_is_dense(world2):
    """Before: Function.apply ran forward on the ShardedArray as a constant, and every
    gradient behind it came back zero ([0, 0, 0, 0] instead of [2, 2, 2, 2])."""
    assert world2.run(function_cases) == [True, True]


@torch.library.custom_op("fshard_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_twice.register_autograd(lambda ctx, g: g * 2)


def checkpoint_hook_cases():
    mesh = _mesh()
    a = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(2, 4)
    p0 = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)

    def block(t, p):
        return (t * p).sin() * t

    want = torch.autograd.functional.vjp(lambda p: block(a, p).pow(2).sum(), p0)[1]
    for reentrant in (True, False):
        for spec, pspec in ((P(), P()), (P(None, "x"), P("x"))):
            x = fs.shard(a, mesh, spec)
            p = fs.shard(p0, mesh, pspec)

            def f(p, x=x, reentrant=reentrant):  # p: a closure of the block, as in a model
                out = cp.checkpoint(lambda t: block(t, p), x * 1.0, use_reentrant=reentrant)
                return fs.gather(out.pow(2).sum())

            got = fs.grad(f)(p)
            assert got.layout == p.layout
            torch.testing.assert_close(fs.gather(got), want, msg=f"{reentrant} {spec}")
    w = fs.shard(a, mesh, P("x"))
    # a torch.library custom op: refused naming it and the fix
    with pytest.raises(NotImplementedError, match=r"fshard_test::twice.*register_rule"):
        fs.grad(lambda w: fs.gather(_twice(w * 1.0).sum()))(w)
    # a tensor hook: refused naming it
    with pytest.raises(NotImplementedError, match=r"Tensor.register_hook"):
        fs.grad(lambda w: fs.gather((w * 1.0).register_hook(lambda g: g * 3).sum()))(w)
    # torch's own autograd entry points on a ShardedArray: refused naming them
    leaf = torch.arange(4.0).requires_grad_()
    loss = (fs.shard(leaf, mesh, P("x")) ** 2).sum()
    with pytest.raises(NotImplementedError, match=r"torch.Tensor.backward.*fs.shard_map"):
        loss.backward()
    with pytest.raises(NotImplementedError, match=r"torch.grad \("):
        torch.autograd.grad(loss, leaf)
    # a module's full backward hook would never run on ShardedArrays: refused
    m = torch.nn.Linear(4, 4, dtype=torch.float64)
    handle = m.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0,))
    with pytest.raises(TypeError, match=r"Linear has full backward hooks.*never run"):
        fs.grad(lambda w: fs.gather(m(w * 1.0).sum()))(w)
    handle.remove()
    with torch.no_grad():  # no backward: nothing to refuse (torch runs no hook either)
        m.register_full_backward_hook(lambda mod, gi, go: None)
        assert m(w).shape == (2, 4)
    return True


def test_checkpoint_custom_ops_and_hooks(world2):
    """Before: checkpoint(use_reentrant=True) gave zero gradients, a module's full backward
    hook never ran (a torch UserWarning only)."""
    assert world2.run(checkpoint_hook_cases) == [True, True]
