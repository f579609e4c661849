"""fs.value_and_grad / fs.grad against dense torch.func in one process and against
torch.func.grad_and_value of the same sharded function (exact): DP (local and global view,
bucketed and overlapped reductions), TP, DP x TP, has_aux, argnums, composition."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fshard as fs
from fshard import lax
from fshard.gradsync import GradSync

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt as demo  # noqa: E402

D, H, OUT, B = 8, 16, 4, 6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, OUT)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _data():
    torch.manual_seed(0)
    return (
        MLP().double(),
        torch.randn(B * 2, D, dtype=torch.float64),
        torch.randn(B * 2, OUT).double(),
    )


def _dense_grads(model, x, y, wd):
    ps = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps):
        out = torch.func.functional_call(model, ps, (x,))
        return F.mse_loss(out, y) + wd * (ps["fc1.weight"] ** 2).sum()

    g, v = torch.func.grad_and_value(loss)(ps)
    return v, g


class _Mark(torch.autograd.Function):
    """Identity whose backward records how many collectives were launched by then."""

    @staticmethod
    def forward(x, log, seen):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.log, ctx.seen = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(len(ctx.log[0]))
        return g, None, None


def dp_local_rank_fn():
    """Local view: explicit pcast of each param; one weight is also used outside the pcast."""
    mesh = fs.Mesh.create((2,), ("dp",))
    model, x, y = _data()
    wd = 0.01
    xs, ys = fs.shard(x, mesh, fs.P("dp")).local, fs.shard(y, mesh, fs.P("dp")).local
    params = fs.nn.shard_params(model, mesh)
    log, seen = [], []

    def loss(ps, x, y):
        p = {k: v.local for k, v in ps.items()}

        def pc(t):
            return fs.lax.pcast(t, "dp", mesh=mesh)

        h = F.gelu(F.linear(x, pc(p["fc1.weight"]), pc(p["fc1.bias"])))
        h = _Mark.apply(h, log, seen)  # its backward runs between fc2's and fc1's
        out = F.linear(h, pc(p["fc2.weight"]), pc(p["fc2.bias"]))
        local = ((out - y) ** 2).sum() / (y.numel() * 2)
        # the weight-decay term uses fc1.weight outside the pcast: must not be summed over dp
        return fs.lax.psum(local, "dp", mesh=mesh) + wd * (p["fc1.weight"] ** 2).sum()

    old = lax.PSUM_BUCKET_BYTES
    lax.PSUM_BUCKET_BYTES = 8 * (H * OUT + OUT)  # fc2's two grads (float64) fill one bucket
    try:
        with fs.debug.comm_log() as log_:
            log.append(log_)
            v, g = fs.value_and_grad(loss)(params, xs, ys)
        records = [(r.op, r.nbytes) for r in log_]
    finally:
        lax.PSUM_BUCKET_BYTES = old
    g_ref, v_ref = torch.func.grad_and_value(loss)(params, xs, ys)
    return (
        float(v),
        float(v_ref),
        {k: (t.layout, t.local) for k, t in g.items()},
        {k: t.local for k, t in g_ref.items()},
        records,
        seen,
    )


def test_dp_local_view_bucketed_overlapped(world2):
    out = world2.run(dp_local_rank_fn)
    model, x, y = _data()
    v_dense, g_dense = _dense_grads(model, x, y, 0.01)
    for v, v_ref, g, g_ref, records, seen in out:
        torch.testing.assert_close(torch.tensor(v, dtype=torch.float64), v_dense.detach())
        assert v == v_ref
        for k, (layout, local) in g.items():
            assert layout.spec == fs.P()
            assert torch.equal(local, g_ref[k])  # exactly torch.func's
            torch.testing.assert_close(local, g_dense[k])
        # forward: the loss psum (8 B); backward: bucket [fc2.bias, fc2.weight], then fc1's
        # bias and weight in a bucket each (reverse forward order, 8-byte float64)
        assert records == [
            ("all_reduce", 8),
            ("all_reduce", 8 * (OUT + H * OUT)),
            ("all_reduce", 8 * H),
            ("all_reduce", 8 * H * D),
        ]
        # overlap: fc2's bucket was launched before fc1's backward ran (later calls: torch.func)
        assert seen[0] == 2


def dp_global_rank_fn():
    mesh = fs.Mesh.create((2,), ("dp",))
    model, x, y = _data()
    xs, ys = fs.shard(x, mesh, fs.P("dp")), fs.shard(y, mesh, fs.P("dp"))
    params = fs.nn.shard_params(model, mesh)

    def loss(ps, x, y):
        out = fs.nn.functional_call(model, ps, (x,))
        reg = 0.01 * (ps["fc1.weight"] ** 2).sum()
        return fs.gather(((out - y) ** 2).mean() + reg)

    with fs.debug.comm_log() as log:
        v, g = fs.value_and_grad(loss)(params, xs, ys)
    g_ref, v_ref = torch.func.grad_and_value(loss)(params, xs, ys)
    assert float(v) == float(v_ref)
    for k in g:
        assert g[k].layout == params[k].layout
        assert torch.equal(g[k].local, g_ref[k].local), k
    big = [r.nbytes for r in log if r.op == "all_reduce" and r.nbytes > 8]
    return float(v), {k: t.local for k, t in g.items()}, big


def test_dp_global_view(world2):
    out = world2.run(dp_global_rank_fn)
    model, x, y = _data()
    v_dense, g_dense = _dense_grads(model, x, y, 0.01)
    for v, g, big in out:
        torch.testing.assert_close(torch.tensor(v, dtype=torch.float64), v_dense.detach())
        for k in g:
            torch.testing.assert_close(g[k], g_dense[k])
        # all four grads in one 16 MiB bucket: one all_reduce of every param's bytes
        assert big == [8 * sum(p.numel() for p in model.parameters())]


def tp_rank_fn():
    mesh = fs.Mesh.create((2,), ("tp",))
    model, x, y = _data()
    params = fs.nn.shard_params(model, mesh, fs.nn.megatron_plan(column=["fc1"], row=["fc2"]))

    def loss(ps, x, y):
        p = {k: v.local for k, v in ps.items()}
        h = F.gelu(F.linear(fs.lax.pcast(x, "tp", mesh=mesh), p["fc1.weight"], p["fc1.bias"]))
        out = fs.lax.psum(F.linear(h, p["fc2.weight"]), "tp", mesh=mesh) + p["fc2.bias"]
        return F.mse_loss(out, y), {"out": out, "sharded": ps["fc1.bias"]}

    # has_aux, argnums tuple (params and the input batch)
    (v, aux), (g, gx) = fs.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, y)
    (g_ref, gx_ref), (v_ref, aux_ref) = torch.func.grad_and_value(
        loss, argnums=(0, 1), has_aux=True
    )(params, x, y)
    assert float(v) == float(v_ref) and torch.equal(gx, gx_ref)
    assert torch.equal(aux["out"], aux_ref["out"]) and not aux["out"].requires_grad
    assert isinstance(aux["sharded"], fs.ShardedArray)
    for k in g:
        assert g[k].layout == params[k].layout and torch.equal(g[k].local, g_ref[k].local)
    grads_only, aux2 = fs.grad(loss, has_aux=True)(params, x, y)
    assert all(torch.equal(grads_only[k].local, g[k].local) for k in g)
    return float(v), {k: fs.gather(t) for k, t in g.items()}, gx


def test_tp_has_aux_argnums(world2):
    out = world2.run(tp_rank_fn)
    model, x, y = _data()
    ps = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps, x):
        return F.mse_loss(torch.func.functional_call(model, ps, (x,)), y)

    (g_dense, gx_dense), v_dense = torch.func.grad_and_value(loss, argnums=(0, 1))(ps, x)
    for v, g, gx in out:
        torch.testing.assert_close(torch.tensor(v, dtype=torch.float64), v_dense)
        torch.testing.assert_close(gx, gx_dense)
        for k in g:
            torch.testing.assert_close(g[k], g_dense[k])


CFG = demo.GPTConfig(d_model=16, n_heads=2, n_layers=1, ctx=8)


def _gpt_batch():
    gen = torch.Generator().manual_seed(1)
    return demo.get_batch(demo.load_corpus(), 4, CFG.ctx, gen)


def global_loss(params: dict, model, tokens: fs.ShardedArray) -> torch.Tensor:
    """The demo GPT's mean next-byte cross entropy in the global view: the module's own
    forward on sharded params (``fs.nn.functional_call``), the op rules' collectives."""
    logits = fs.nn.functional_call(model, params, (tokens[:, :-1],))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return fs.gather(loss)


def gpt_rank_fn():
    mesh = fs.Mesh.create((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = demo.GPT(CFG)
    params = fs.nn.shard_params(model, mesh, demo.gpt_plan("tp"))
    batch = fs.shard(_gpt_batch(), mesh, fs.P("dp"))
    v, g = fs.value_and_grad(global_loss)(params, model, batch)
    g_ref, v_ref = torch.func.grad_and_value(global_loss)(params, model, batch)
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=0)
    for k in g:
        assert g[k].layout == params[k].layout
        torch.testing.assert_close(g[k].local, g_ref[k].local, rtol=1e-5, atol=1e-7)
    return float(v), {k: fs.gather(t) for k, t in g.items()}


def test_dp_x_tp_gpt(world4):
    out = world4.run(gpt_rank_fn)
    torch.manual_seed(0)
    model = demo.GPT(CFG)
    ps = {k: v.detach() for k, v in model.named_parameters()}
    g_dense, v_dense = torch.func.grad_and_value(demo.dense_loss)(ps, model, _gpt_batch())
    for v, g in out:
        torch.testing.assert_close(torch.tensor(v), v_dense, rtol=1e-5, atol=0)
        for k in g:
            torch.testing.assert_close(g[k], g_dense[k], rtol=1e-4, atol=1e-6)


def test_composes_with_torch_func():
    torch.manual_seed(0)
    w, xb = torch.randn(3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)

    def f(w, x):
        return (torch.sin(w * x) ** 2).sum() + (w**3).sum()

    # top level equals torch.func exactly
    v, g = fs.value_and_grad(f)(w, xb[0])
    g_ref, v_ref = torch.func.grad_and_value(f)(w, xb[0])
    assert torch.equal(v, v_ref) and torch.equal(g, g_ref)
    # grad of grad, both ways round, and fs.grad of fs.grad
    hvp = torch.func.grad(lambda w: fs.grad(f)(w, xb[0]).sum())(w)
    hvp_ref = torch.func.grad(lambda w: torch.func.grad(f)(w, xb[0]).sum())(w)
    assert torch.equal(hvp, hvp_ref)
    assert torch.equal(fs.grad(lambda w: fs.grad(f)(w, xb[0]).sum())(w), hvp_ref)
    # vmap over examples (per-example grads) and over params
    per = torch.func.vmap(fs.grad(f), in_dims=(None, 0))(w, xb)
    assert torch.equal(per, torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(w, xb))
    # an outer .backward() through a top-level call (the argument requires grad)
    wr = w.clone().requires_grad_()
    fs.grad(f)(wr, xb[0]).sum().backward()
    assert torch.equal(wr.grad, hvp_ref)
    # unused argument: zeros, as torch.func
    g0 = fs.grad(lambda a, b: (a * 2).sum(), argnums=(0, 1))(w, xb[0])
    assert torch.equal(g0[1], torch.zeros_like(xb[0]))


def test_errors():
    w = torch.randn(3)
    with pytest.raises(TypeError, match="scalar"):
        fs.value_and_grad(lambda w: w * 2)(w)
    with pytest.raises(TypeError, match="pair"):
        fs.value_and_grad(lambda w: w.sum(), has_aux=True)(w)
    with pytest.raises(TypeError, match="argnums"):
        fs.value_and_grad(lambda w: w.sum(), argnums=[0])
    with pytest.raises(ValueError, match="out of range"):
        fs.value_and_grad(lambda w: w.sum(), argnums=1)(w)
    with pytest.raises(TypeError, match="floating-point"):
        fs.value_and_grad(lambda w: w.sum())(torch.arange(3))
    with pytest.raises(TypeError, match="has_aux"):
        fs.value_and_grad(lambda w: w.sum(), has_aux=1)


def _dp_setup():
    mesh = fs.Mesh.create((2,), ("dp",))
    model, x, y = _data()
    xs, ys = fs.shard(x, mesh, fs.P("dp")).local, fs.shard(y, mesh, fs.P("dp")).local

    def loss(ps, x, y):
        p = {k: fs.lax.pcast(v.local, "dp", mesh=mesh) for k, v in ps.items()}
        out = torch.func.functional_call(model, p, (x,))
        return fs.lax.psum(((out - y) ** 2).sum() / (y.numel() * 2), "dp", mesh=mesh)

    return mesh, model, xs, ys, loss


def dp_in_place_rank_fn():
    """Weights at least PSUM_INPLACE_MIN_BYTES are reduced in the gradient autograd made (no
    copy), each its own bucket; the biases are packed. Steps reuse the packed buffers only
    once the gradients returned from them are gone: grads kept from step 1 are not
    overwritten by step 2, and two param sets never share a buffer."""
    import gc

    mesh, model, xs, ys, loss = _dp_setup()
    params = fs.nn.shard_params(model, mesh)
    other = {k: fs.from_local(v.local * 2, mesh, fs.P(), shape=v.shape) for k, v in params.items()}
    old = lax.PSUM_INPLACE_MIN_BYTES
    lax.PSUM_INPLACE_MIN_BYTES = 8 * H * OUT  # fc2.weight (and fc1.weight) in place
    vg = fs.value_and_grad(loss)
    try:
        with fs.debug.comm_log() as log:
            _, g1 = vg(params, xs, ys)
        g1_copy = {k: t.local.clone() for k, t in g1.items()}
        _, g2 = vg(other, xs, ys)  # while g1 is alive
        _, g1_again = vg(params, xs, ys)  # after g2: same values as a first call
        del g2
        # one cotangent tensor flows to two pcast leaves (add's backward passes it to both):
        # reducing one in place must not change the other's
        a, b = params["fc1.weight"].local, params["fc1.weight"].local * 3

        def shared(a, b, x):
            s = fs.lax.pcast(a, "dp", mesh=mesh) + fs.lax.pcast(b, "dp", mesh=mesh)
            return fs.lax.psum((s @ x.T).sum(), "dp", mesh=mesh)

        gs = fs.grad(shared, argnums=(0, 1))(a, b, xs)
        gs_ref = torch.func.grad(shared, argnums=(0, 1))(a, b, xs)
        assert torch.equal(gs[0], gs_ref[0]) and torch.equal(gs[1], gs_ref[1])
        gc.collect()  # garbage of the calls above is not this call's
        gc.disable()  # nothing a call held may outlive it (no cycle waiting for gc)
        try:
            vg(params, xs, ys)
            # A reducer object may outlive its call for a moment (a reference another thread
            # drops later: the count was racy); every tensor it held must be gone already.
            left = [
                (len(o.leaves), len(o.entries), len(o.buckets), len(o.slot))
                for o in gc.get_objects()
                if isinstance(o, GradSync)
            ]
        finally:
            gc.enable()
    finally:
        lax.PSUM_INPLACE_MIN_BYTES = old
    g_ref = torch.func.grad(loss)(params, xs, ys)
    g2_ref = torch.func.grad(loss)(other, xs, ys)
    _, g2 = vg(other, xs, ys)
    for k in g1:
        assert torch.equal(g1[k].local, g_ref[k].local), k
        assert torch.equal(g1[k].local, g1_copy[k]), k  # not overwritten by later calls
        assert torch.equal(g1_again[k].local, g_ref[k].local), k
        assert torch.equal(g2[k].local, g2_ref[k].local), k

    def storages(g):
        return {t.local.untyped_storage().data_ptr() for t in g.values()}

    assert not storages(g1) & storages(g1_again)  # no two live calls share a buffer
    assert not storages(g1) & storages(g2)
    assert all(held == (0, 0, 0, 0) for held in left), left
    # fc2.weight alone (in place), then the packed biases (fc2's arrived first, fc1's
    # completes the bucket), then fc1.weight alone: launch order by when each bucket fills
    return [(r.op, r.nbytes) for r in log]


def test_dp_in_place_and_reused_buckets(world2):
    for records in world2.run(dp_in_place_rank_fn):
        assert records == [
            ("all_reduce", 8),  # the loss psum (forward)
            ("all_reduce", 8 * H * OUT),
            ("all_reduce", 8 * (OUT + H)),
            ("all_reduce", 8 * H * D),
        ]


def trees_rank_fn():
    """Mixed pytrees (nested dict/list/tuple/namedtuple/OrderedDict, plain tensors, ShardedArrays
    split, replicated and partial) through the top-level path: the same structure, layouts and
    values as torch.func.grad_and_value of the same function, and the dense gradient."""
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    full = {k: torch.randn(4, 6, dtype=torch.float64) for k in "wvu"}
    plain = torch.randn(3, dtype=torch.float64)
    # a partial param: rank 0 holds the value, rank 1 zeros (addends of full["u"])
    part = fs.from_local(
        full["u"] if mesh.rank == 0 else torch.zeros_like(full["u"]), mesh, fs.P(partial=("tp",))
    )
    tree = {
        "z": [fs.shard(full["w"], mesh, fs.P("tp", None)), plain],
        "a": Pair(fs.shard(full["v"], mesh, fs.P(None, "tp")), OrderedDict(q=part, p=plain * 2)),
    }

    def f(t, s):
        w, v = fs.gather(t["z"][0]), fs.gather(t["a"].a)
        u = fs.gather(fs.reshard(t["a"].b["q"], fs.P()))
        return (w * v).sum() * s + (u**2).sum() + (t["z"][1] * t["a"].b["p"]).sum()

    def dense(t, s):
        return (t["w"] * t["v"]).sum() * s + (t["u"] ** 2).sum() + (t["x"] * t["y"]).sum()

    s = torch.tensor(1.5, dtype=torch.float64)
    v, g = fs.value_and_grad(f)(tree, s)
    g_ref, v_ref = torch.func.grad_and_value(f)(tree, s)
    assert torch.equal(v, v_ref)

    from fshard.array import is_sharded as sharded

    flat, spec = fs.tree_flatten(g, is_leaf=sharded)
    flat_ref, spec_ref = fs.tree_flatten(g_ref, is_leaf=sharded)
    assert sum(map(sharded, flat)) == 3
    assert spec == spec_ref and type(g["a"]) is Pair and list(g["a"].b) == ["q", "p"]
    for a, b in zip(flat, flat_ref):
        assert type(a) is type(b)
        if isinstance(a, fs.ShardedArray):
            assert a.layout == b.layout
            a, b = a.local, b.local
        assert torch.equal(a, b)
    gd = torch.func.grad(dense)({**full, "x": plain, "y": plain * 2}, s)
    torch.testing.assert_close(fs.gather(g["z"][0]), gd["w"], rtol=0, atol=1e-12)
    torch.testing.assert_close(fs.gather(g["a"].a), gd["v"], rtol=0, atol=1e-12)
    assert g["a"].b["q"].layout == part.layout
    torch.testing.assert_close(fs.gather(fs.reshard(g["a"].b["q"], fs.P())), gd["u"])
    torch.testing.assert_close(g["z"][1], gd["x"])
    return True


def test_pytrees_match_torch_func(world2):
    assert world2.run(trees_rank_fn) == [True, True]


def sharded_loss_rank_fn():
    mesh = fs.Mesh.create((2,), ("dp",))
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64)
    ws = fs.shard(w, mesh, fs.P("dp"))  # 3 | 2 rows
    xs = fs.shard(x, mesh, fs.P("dp"))
    losses = {
        # a pending sum (the global sum of split rows), and the replicated value of it
        "pending": lambda w: (w * xs).sin().sum(),
        "replicated": lambda w: fs.reshard((w * xs).sin().sum(), fs.P()),
    }
    out = {}
    for name, loss in losses.items():
        assert isinstance(loss(ws), fs.ShardedArray)
        value, g = fs.value_and_grad(loss)(ws)  # top-level path
        (v2, aux), g2 = fs.value_and_grad(lambda w, loss=loss: (loss(w), 7), has_aux=True)(ws)
        g3 = fs.grad(loss)(ws)
        # under a torch.func transform: the torch.func.grad_and_value path
        g4 = torch.func.vmap(fs.grad(lambda w, s, loss=loss: loss(w) * s), in_dims=(None, 0))(
            ws, torch.tensor([1.0, 2.0], dtype=torch.float64)
        )
        assert g.layout == ws.layout and g4.layout.shape == (2, 5, 3)
        out[name] = [value, v2, aux, *[fs.gather(t) for t in (g, g2, g3, g4)]]
    return out


def test_a_sharded_scalar_loss_is_accepted(world2):
    """Issue 29 item 2: a global-view loss is a one-element ShardedArray (replicated, or a
    pending sum); fs.value_and_grad / fs.grad take it as it is (was: TypeError asking for
    fs.gather(loss)), top level and under torch.func, equal to dense."""
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64)
    dg, dv = torch.func.grad_and_value(lambda w: (w * x).sin().sum())(w)
    for rank in world2.run(sharded_loss_rank_fn):
        for value, v2, aux, g, g2, g3, g4 in rank.values():
            for v in (value, v2):
                assert type(v) is torch.Tensor
                torch.testing.assert_close(v, dv)
            assert aux == 7
            for got in (g, g2, g3):
                torch.testing.assert_close(got, dg)
            torch.testing.assert_close(g4, torch.stack([dg, 2 * dg]))
