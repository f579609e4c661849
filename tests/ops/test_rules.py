"""Op rules: values and grads against dense torch.func for every layout combination (2 ranks),
communication counts, strict mode, errors and custom rules.

Each test runs ONE rank function that loops over many cases (world start-up dominates)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from tests._opcheck import check, randn

P = fs.P
LAYOUTS_2D = [P(), P("x"), P(None, "x"), P(partial="x")]
LAYOUTS_1D = [P(), P("x"), P(partial="x")]


def _mesh():
    return fs.Mesh.create((2,), ("x",))


# -- elementwise ----------------------------------------------------------------------------

BINARY = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: torch.sub(x, y),
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
    "maximum": lambda x, y: torch.maximum(x, y),
    "pow": lambda x, y: x.abs() ** y,
}


def elementwise_cases():
    mesh = _mesh()
    a, b, v = randn(5, 4), randn(5, 4, seed=1).abs() + 0.5, randn(4, seed=2)
    n = 0
    for (name, f), sa, sb in itertools.product(BINARY.items(), LAYOUTS_2D, LAYOUTS_2D + [None]):
        check(mesh, f, [a, b], [sa, sb], label=f"{name} {sa} {sb}")
        n += 1
    for (name, f), sa, sv in itertools.product(BINARY.items(), LAYOUTS_2D, LAYOUTS_1D):
        check(mesh, f, [a, v.abs() + 0.5], [sa, sv], label=f"bcast {name} {sa} {sv}")
        check(mesh, f, [v.abs() + 0.5, a], [sv, sa], label=f"bcast-r {name} {sv} {sa}")
        n += 2
    unary = {
        "neg": lambda x: -x,
        "exp": torch.exp,
        "log": lambda x: torch.log(x.abs() + 1),
        "sqrt": lambda x: (x * x + 1).sqrt(),
        "rsqrt": lambda x: torch.rsqrt(x * x + 1),
        "abs": lambda x: x.abs(),
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
        "tanh": torch.tanh,
        "sigmoid": lambda x: x.sigmoid(),
        "clamp": lambda x: torch.clamp(x, min=-0.5, max=0.7),
        "scalar_ops": lambda x: 2.0 - x * 3 + 1 / (x * x + 1) - x / 2,
        "float": lambda x: x.double().float(),
        "to": lambda x: x.to(torch.float64),
        "clone": lambda x: x.clone(),
        "detach": lambda x: x.detach() + x,
        "where": lambda x: torch.where(x > 0, x, x * 0.1),
    }
    for (name, f), sa in itertools.product(unary.items(), LAYOUTS_2D):
        check(mesh, f, [a], [sa], label=f"{name} {sa}")
        n += 1
    for sa in LAYOUTS_2D:
        check(mesh, lambda x: (x > 0.1, x <= 0, x == x), [a], [sa], label=f"cmp {sa}")
        check(mesh, lambda x: torch.zeros_like(x) + torch.ones_like(x), [a], [sa], label="like")
        check(mesh, lambda x: torch.full_like(x, 3.0), [a], [sa], label=f"full_like {sa}")
        n += 3
    return n


def test_elementwise_all_layouts(world2):
    assert world2.run(elementwise_cases)[0] > 300


def partial_kept():
    mesh = _mesh()
    x = fs.shard(randn(4, 4), mesh, P(partial="x"))
    r = fs.shard(randn(4, 4, seed=1), mesh, P())
    with fs.debug.comm_log() as log:
        assert (x + x).spec == P(partial="x")
        assert (x * 2.0).spec == P(partial="x")
        assert (x * r).spec == P(partial="x")
        assert (x / r).spec == P(partial="x")
        assert (x - r).spec == P(partial="x")
        assert x.sum(0).spec == P(partial="x")
        assert (x @ r).spec == P(partial="x")
        assert x.reshape(16).spec == P(partial="x")
    assert log == []
    with fs.debug.comm_log() as log:
        assert torch.exp(x).spec == P()
        assert (x + 1.0).spec == P()
    assert [r.op for r in log] == ["all_reduce", "all_reduce"]


def test_partial_values_stay_pending_under_linear_ops(world2):
    world2.run(partial_kept)


# -- reductions -----------------------------------------------------------------------------


def reduction_cases():
    mesh = _mesh()
    a = randn(5, 3)
    ops = {
        "sum": lambda x, d, k: x.sum(d, keepdim=k) if d is not None else x.sum(),
        "mean": lambda x, d, k: x.mean(d, keepdim=k) if d is not None else torch.mean(x),
        "amax": lambda x, d, k: torch.amax(x, d if d is not None else (0, 1), keepdim=k),
        "amin": lambda x, d, k: x.amin(d if d is not None else (), keepdim=k),
        "max": lambda x, d, k: x.max() if d is None or isinstance(d, tuple) else x.max(d, k)[0],
        "min": lambda x, d, k: torch.min(x) if d is None or isinstance(d, tuple) else x.amin(d),
        "norm": lambda x, d, k: torch.norm(x, dim=d, keepdim=k),
        "norm1": lambda x, d, k: x.norm(p=1, dim=d, keepdim=k),
        "logsumexp": lambda x, d, k: torch.logsumexp(x, d if d is not None else (0, 1), k),
        "var": lambda x, d, k: x.var(d, keepdim=k) if d is not None else x.var(),
        "std0": lambda x, d, k: torch.std(x, dim=d, correction=0, keepdim=k),
    }
    n = 0
    for (name, f), sa, d, k in itertools.product(
        ops.items(), LAYOUTS_2D, [0, 1, None, (0, 1)], [False, True]
    ):
        if name in ("max", "min") and k:
            continue
        check(mesh, lambda x, f=f, d=d, k=k: f(x, d, k), [a], [sa], label=f"{name} {sa} {d} {k}")
        n += 1
    return n


def test_reductions_all_layouts(world2):
    assert world2.run(reduction_cases)[0] > 150


# -- linalg ---------------------------------------------------------------------------------


def linalg_cases():
    mesh = _mesh()
    a, b = randn(5, 3), randn(3, 6, seed=1)
    n = 0
    for sa, sb in itertools.product(LAYOUTS_2D, LAYOUTS_2D + [None]):
        check(mesh, lambda x, y: x @ y, [a, b], [sa, sb], label=f"matmul {sa} {sb}")
        check(mesh, torch.mm, [a, b], [sa, sb], label=f"mm {sa} {sb}")
        check(mesh, lambda x, y: torch.einsum("ij,jk->ik", x, y), [a, b], [sa, sb], label="es")
        n += 3
    w, bias = randn(6, 3, seed=2), randn(6, seed=3)
    for sa, sw, sb in itertools.product(LAYOUTS_2D, LAYOUTS_2D, LAYOUTS_1D + [None]):
        check(mesh, F.linear, [a, w, bias], [sa, sw, sb], label=f"linear {sa} {sw} {sb}")
        n += 1
    for sa, sw in itertools.product(LAYOUTS_2D, LAYOUTS_2D):
        check(mesh, lambda x, w: F.linear(x, w), [a, w], [sa, sw], label=f"linear {sa} {sw}")
        check(
            mesh,
            lambda c, x, y: torch.addmm(c, x, y, beta=0.5),
            [bias, a, b],
            [sa, sa, sw][:1] and [P(), sa, sw],
            label="addmm",
        )
        n += 2
    x3, y3 = randn(3, 5, 4), randn(3, 4, 2, seed=4)
    for s1, s2 in itertools.product([P(), P("x"), P(None, "x"), P(None, None, "x")], repeat=2):
        check(mesh, torch.bmm, [x3, y3], [s1, s2], label=f"bmm {s1} {s2}")
        check(mesh, lambda x, y: x @ y[0], [x3, y3], [s1, s2], label=f"bcast matmul {s1} {s2}")
        check(mesh, lambda x: torch.einsum("bij,bij->b", x, x), [x3], [s1], label="einsum")
        check(mesh, lambda x, y: torch.einsum("...ij,...jk", x, y), [x3, y3], [s1, s2], label="e.")
        n += 4
    v = randn(3, seed=5)
    for sa, sv in itertools.product(LAYOUTS_2D, LAYOUTS_1D):
        check(mesh, torch.matmul, [a, v], [sa, sv], label=f"mv {sa} {sv}")
        n += 1
    return n


def test_linalg_all_layouts(world2):
    assert world2.run(linalg_cases)[0] > 150


# -- shape ----------------------------------------------------------------------------------


def shape_cases():
    mesh = _mesh()
    a, c = randn(5, 4), randn(4, 3, 6)
    n = 0
    two_d = {
        "transpose": lambda x: x.transpose(0, 1),
        "t": torch.t,
        "T": lambda x: x.T,
        "mT": lambda x: x.mT,
        "permute": lambda x: x.permute(1, 0),
        "split": lambda x: x.reshape(5, 2, 2),
        "split_view": lambda x: x.view(5, 4, 1),
        "unflatten": lambda x: x.unflatten(1, (2, 2)),
        "unsqueeze": lambda x: x.unsqueeze(0).unsqueeze(-1),
        "squeeze": lambda x: x.unsqueeze(1).squeeze(1),
        "expand": lambda x: x.unsqueeze(0).expand(3, 5, 4),
        "cat0": lambda x: torch.cat([x, x * 2], 0),
        "cat1": lambda x: torch.cat([x, x * 2], dim=1),
        "stack": lambda x: torch.stack([x, x + 1], 1),
        "split_fn": lambda x: x.split(2, dim=1),
        "chunk": lambda x: torch.chunk(x, 2, 0),
        "narrow": lambda x: x.narrow(1, 1, 2),
        "getitem": lambda x: x[:, 1:3],
        "getitem0": lambda x: x[0],
        "getitem_e": lambda x: x[..., None, 1],
        "getitem_full": lambda x: x[:, :],
        "unbind": lambda x: x.unbind(1),
        "contiguous": lambda x: x.t().contiguous(),
    }
    for (name, f), sa in itertools.product(two_d.items(), LAYOUTS_2D):
        check(mesh, f, [a], [sa], label=f"{name} {sa}")
        n += 1
    three_d = {
        "merge_lead": lambda x: x.reshape(12, 6),
        "merge_all": lambda x: x.flatten(),
        "flatten12": lambda x: x.flatten(1),
        "reshape_neg": lambda x: x.reshape(4, -1),
        "movedim": lambda x: torch.movedim(x, 0, 2),
        "split_last": lambda x: x.view(4, 3, 2, 3),
    }
    for (name, f), sa in itertools.product(three_d.items(), [P(), P("x"), P(None, None, "x")]):
        # a split trailing dim merged with the dims before it cannot stay local: the data
        # moves first (issue 37: it was refused), the values and gradients stay dense
        check(mesh, f, [c], [sa], label=f"{name} {sa}")
        n += 1
    # even merges of a split trailing dim line up; an uneven merge of a split dim keeps each
    # rank's rows (row blocks 8 | 4, which ceil-div cannot express: an explicit layout) and
    # ops that do not take row blocks gather them first (one all_gather)
    x = fs.shard(randn(3, 4), mesh, P("x"))
    flat = x.reshape(12)
    assert [m.shard_sizes for m in flat.shards_metadata()] == [(8,), (4,)]
    torch.testing.assert_close(fs.gather(flat), randn(3, 4).reshape(12))
    with fs.debug.comm_log() as log:
        summed = torch.cumsum(flat, 0)
    assert [r.op for r in log] == ["all_gather"], log
    torch.testing.assert_close(fs.gather(summed), randn(3, 4).reshape(12).cumsum(0))
    y = fs.shard(randn(4, 4), mesh, P("x"))
    assert y.reshape(16).spec == P("x")
    assert fs.shard(randn(5, 1), mesh, P("x")).reshape(5).spec == P("x")
    return n


def test_shape_ops_all_layouts(world2):
    assert world2.run(shape_cases)[0] > 80


# -- nn -------------------------------------------------------------------------------------


def nn_cases():
    mesh = _mesh()
    a = randn(5, 7)
    n = 0
    for sa, d in itertools.product(LAYOUTS_2D, [0, 1, -1]):
        check(mesh, lambda x, d=d: F.softmax(x, dim=d), [a], [sa], label=f"softmax {sa} {d}")
        check(mesh, lambda x, d=d: x.log_softmax(d), [a], [sa], label=f"log_softmax {sa} {d}")
        n += 2
    w, b = randn(7, seed=1), randn(7, seed=2)
    for sa, sw in itertools.product(LAYOUTS_2D, LAYOUTS_1D[:2]):
        check(
            mesh, lambda x, w, b: F.layer_norm(x, (7,), w, b), [a, w, b], [sa, sw, sw], label="ln"
        )
        check(mesh, lambda x: F.layer_norm(x, (7,)), [a], [sa], label=f"ln plain {sa}")
        check(mesh, lambda x, w: F.rms_norm(x, (7,), w, eps=1e-6), [a, w], [sa, sw], label="rms")
        n += 3
    ids = torch.tensor([[0, 3, 6], [9, 2, 2]])
    emb = randn(10, 4, seed=3)
    for sw, si in itertools.product(LAYOUTS_2D[:3] + [P(("x",))], [P(), P("x"), None]):
        check(mesh, F.embedding, [ids, emb], [si, sw], label=f"embedding {si} {sw}")
        n += 1
    logits, tgt = randn(6, 11, seed=4), torch.tensor([0, 10, 5, -100, 6, 3])
    for sl, st, red, ls in itertools.product(
        [P(), P("x"), P(None, "x"), P(partial="x")],
        [P(), None],
        ["mean", "sum", "none"],
        [0.0, 0.1],
    ):
        f = lambda x, t, red=red, ls=ls: F.cross_entropy(x, t, reduction=red, label_smoothing=ls)  # noqa: E731
        check(mesh, f, [logits, tgt], [sl, st], label=f"ce {sl} {st} {red} {ls}")
        n += 1
    # the K-dimensional form (N, C, d): the class dim over x is a vocab-parallel loss, d over x
    # (a sequence split over cp) a pending sum over x, nothing gathered
    logits, tgt = randn(3, 11, 4, seed=8), torch.tensor([[0, 10, 5, -100], [6, 3, 3, 1], [2] * 4])
    for sl, st, red in itertools.product(
        [P(), P("x"), P(None, "x"), P(None, None, "x"), P(partial="x")],
        [P(), None, P(None, "x")],
        ["mean", "sum", "none"],
    ):
        f = lambda x, t, red=red: F.cross_entropy(x, t, reduction=red, label_smoothing=0.1)  # noqa: E731
        check(mesh, f, [logits, tgt], [sl, st], label=f"ce (N, C, d) {sl} {st} {red}")
        n += 1
    q, k, v = randn(2, 4, 5, 3, seed=5), randn(2, 4, 6, 3, seed=6), randn(2, 4, 6, 3, seed=7)
    for s in [P(), P("x"), P(None, "x"), P(None, None, "x")]:
        check(mesh, F.scaled_dot_product_attention, [q, k, v], [s, s, P(None, "x")], label="sdpa")
        f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        check(mesh, f, [q, k[:, :, :5], v[:, :, :5]], [s, s, s], label=f"sdpa causal {s}")
        n += 2
    for s in LAYOUTS_2D[:3]:
        torch.manual_seed(3)
        got = fs.gather(F.dropout(fs.shard(a, mesh, s), p=0.4))
        torch.manual_seed(3)
        assert torch.equal(got, F.dropout(a, p=0.4)), s
        assert torch.equal(fs.gather(F.dropout(fs.shard(a, mesh, s), 0.4, training=False)), a)
        n += 1
    return n


def test_nn_ops_all_layouts(world2):
    assert world2.run(nn_cases)[0] > 60


# -- communication --------------------------------------------------------------------------


def comm_cases():
    mesh = _mesh()
    x, y = fs.shard(randn(8, 6), mesh, P("x")), fs.shard(randn(8, 6, seed=1), mesh, P("x"))
    with fs.debug.comm_log() as log:
        x + y, x * y, torch.exp(x), F.gelu(x) - y, x * 0.3, torch.where(x > y, x, y)
    assert log == []
    # Megatron MLP: column-parallel then row-parallel linear: one all_reduce each way.
    inp = randn(4, 6)
    w1 = fs.shard(randn(12, 6, seed=2), mesh, P("x"))
    w2 = fs.shard(randn(6, 12, seed=3), mesh, P(None, "x"))
    xr = fs.shard(inp, mesh, P())

    def mlp(xr, w1, w2):
        return F.relu(F.linear(F.gelu(F.linear(xr, w1)), w2))

    with fs.debug.comm_log() as log:
        out = mlp(xr, w1, w2)
    assert [r.op for r in log] == ["all_reduce"], log
    torch.testing.assert_close(
        fs.gather(out), mlp(inp, fs.gather(w1), fs.gather(w2)), atol=1e-5, rtol=1e-4
    )
    from torch.func import grad

    def loss(xr, w1, w2):
        return fs.gather(mlp(xr, w1, w2).sum(0)).sum()

    with fs.debug.comm_log() as fwd:
        mlp(xr, w1, w2)
    with fs.debug.comm_log() as both:
        gx, gw1, gw2 = grad(loss, argnums=(0, 1, 2))(xr, w1, w2)
    ops = [r.op for r in both]
    assert ops.count("all_reduce") == 2, ops  # forward 1 + backward 1 (psum of xr's grad)
    assert gw1.layout == w1.layout and gx.layout == xr.layout
    dense = grad(lambda a, b, c: mlp(a, b, c).sum(), argnums=(0, 1, 2))(
        inp, fs.gather(w1), fs.gather(w2)
    )
    for g, d in zip((gx, gw1, gw2), dense):
        torch.testing.assert_close(fs.gather(g), d, atol=1e-5, rtol=1e-4)
    # vocab-parallel cross entropy moves O(batch) bytes, not O(batch * vocab)
    batch, vocab = 8, 4096
    logits = fs.shard(randn(batch, vocab), mesh, P(None, "x"))
    tgt = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(0))
    with fs.debug.comm_log() as log:
        loss = F.cross_entropy(logits, tgt)
        fs.gather(loss)
    assert sum(r.nbytes for r in log) <= 4 * batch * 4 + 64, log
    assert len(fwd) == 1
    return True


def test_communication_counts(world2):
    world2.run(comm_cases)


# -- strict mode, errors, custom rules ------------------------------------------------------


def softclip(x, limit):
    """A custom torch-function-aware op used to show fs.ops.register_rule."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(softclip, (x,), x, limit)
    return limit * torch.tanh(x / limit)


def _softclip_rule(op, args, kwargs):
    x = args[0]
    keep = fs.P(*x.dim_axes)
    return fs.ops.OpSharding(in_specs=(keep,), out=x.with_spec(keep), local=softclip)


def api_cases():
    mesh = _mesh()
    x = fs.shard(randn(4, 6), mesh, P("x"))
    y = fs.shard(randn(4, 6, seed=1), mesh, P(None, "x"))
    r = fs.shard(randn(4, 6, seed=2), mesh, P())
    with fs.config.strict():
        assert fs.config.is_strict()
        (x + r), torch.exp(x), x.sum(0)  # local slices and pending sums are fine
        with pytest.raises(RuntimeError, match=r"strict mode.*add.*fs\.reshard") as e:
            x + y
        assert "P('x')" in str(e.value) or "P(None, 'x')" in str(e.value)
        with pytest.raises(RuntimeError, match="strict mode"):
            torch.exp(x.sum(0))  # nonlinear op on a pending sum
    assert not fs.config.is_strict()
    assert fs.gather(x + y).shape == (4, 6)
    with pytest.raises(
        NotImplementedError, match=r"torch\.histogram.*fs\.gather.*shard_map.*register_rule"
    ):
        torch.histogram(x, 4)
    with pytest.raises(NotImplementedError, match="register_rule"):
        x.histogram(4)
    xt = x.T  # a live view: an in-place form on x would have to update it too
    with pytest.raises(TypeError, match=r"in-place Tensor\.add_ refused.*x\.add\("):
        x.add_(1.0)
    del xt
    with pytest.raises(TypeError, match="immutable"):
        torch.exp(x, out=torch.empty(4, 6))
    x0 = x
    x += 1  # rebinds the name (jax.Array): x0 is unchanged
    torch.testing.assert_close(fs.gather(x), fs.gather(x0) + 1)
    fs.ops.register_rule(softclip, _softclip_rule)
    with fs.debug.comm_log() as log:
        out = softclip(x, 2.0)
    assert log == [] and out.spec == P("x")
    torch.testing.assert_close(fs.gather(out), softclip(fs.gather(x), 2.0))
    # Scalars are run-time values, not cache keys (pytorch#109101).
    from fshard.ops import registry

    before = len(registry._CACHE)
    for lr in (0.1, 0.2, 0.3, 0.4):
        x * lr
    assert len(registry._CACHE) - before <= 1
    # The unary fast path (one ShardedArray then static arguments) keys positional and keyword
    # arguments apart, never caches a float's value, and passes arguments through unchanged.
    dense = fs.gather(x)
    before = (len(registry._CACHE), len(registry._UNARY))
    for k in (1.5, 2.5, 3.5):
        torch.testing.assert_close(fs.gather(x.clamp(min=k)), dense.clamp(min=k))
    assert len(registry._UNARY) == before[1]
    for call in (
        lambda t: t.sum(1),
        lambda t: t.sum(dim=1),
        lambda t: t.sum(1, keepdim=True),
        lambda t: torch.softmax(t, 0),
        lambda t: F.softmax(t, dim=1),
        lambda t: F.log_softmax(t, dim=1, dtype=torch.float64),
    ):
        for _ in range(2):  # compile, then the cached fast path
            torch.testing.assert_close(fs.gather(call(x)), call(dense))
    return True


def test_strict_unsupported_inplace_and_custom_rules(world2):
    world2.run(api_cases)


# -- 2x2 mesh -------------------------------------------------------------------------------


def mesh4_cases():
    mesh = fs.Mesh.create((2, 2), ("dp", "tp"))
    a, w, b = randn(6, 5), randn(7, 5, seed=1), randn(7, seed=2)
    specs = [P(), P("dp"), P("dp", "tp"), P(("dp", "tp")), P(None, "tp"), P(partial="tp")]
    n = 0
    for sa, sw in itertools.product(specs, [P(), P("tp"), P(None, "tp"), P("dp", "tp")]):
        check(mesh, lambda x, w, b: F.linear(x, w, b), [a, w, b], [sa, sw, P()], label="lin4")
        check(mesh, lambda x, y: F.gelu(x) * y.sum(), [a, a], [sa, sw], label=f"ew4 {sa} {sw}")
        n += 2
    for sa in specs:
        check(mesh, lambda x: (x.sum(0), x.amax(1), F.softmax(x, 1)), [a], [sa], label="red4")
        f = lambda x: x.reshape(4, 2, 5).transpose(0, 2)  # noqa: E731
        check(mesh, f, [randn(8, 5)], [sa], label=f"shape4 {sa}")
        n += 2
    logits, tgt = randn(6, 9, seed=3), torch.tensor([0, 8, 5, 1, 6, 3])
    for s in [P("dp", "tp"), P(None, ("dp", "tp")), P("tp", "dp")]:
        check(mesh, lambda x, t: F.cross_entropy(x, t), [logits, tgt], [s, P()], label="ce4")
        n += 1
    return n


def test_mesh_2x2(world4):
    assert world4.run(mesh4_cases)[0] > 50


def unit_axis_cases():
    """Layouts that differ only on size-1 mesh axes have the same local blocks: the rule runs
    with no reshard and no pcast (nothing logged, strict mode passes), values and grads dense."""
    mesh = fs.Mesh.create((1, 2), ("dp", "tp"))
    a, b, v = randn(6, 4), randn(4, 5, seed=1), randn(4, seed=2)
    cases = [
        (lambda x, w: x @ w, [a, b], [P("dp"), P(None, "tp")]),  # S(0)@S(1) on dp=1: local mm
        (lambda x, w: x @ w, [a, b], [P(("dp", "tp")), P()]),
        (lambda x, y: x + y, [a, a], [P("dp"), P()]),
        (lambda x, y: x * y, [a, v], [P(None, ("tp", "dp")), P("tp")]),
        (lambda x: x.sum(0), [a], [P("dp")]),
        (lambda x: torch.softmax(x, 0), [a], [P("dp", "tp")]),
    ]
    for n, (f, ts, ss) in enumerate(cases):
        check(mesh, f, ts, ss, label=f"unit-axis case {n}")
        xs = [fs.shard(t, mesh, s) for t, s in zip(ts, ss)]
        with fs.config.strict(), fs.debug.comm_log() as log:
            f(*xs)
        assert not log, (n, log)
    # a real reshard over the size-2 axis still communicates (and strict mode refuses it)
    x, w = fs.shard(a, mesh, P(None, "tp")), fs.shard(b, mesh, P(None, "tp"))
    with pytest.raises(RuntimeError, match="strict"), fs.config.strict():
        x @ w
    return len(cases)


def test_unit_mesh_axes_need_no_reshard(world2):
    assert world2.run(unit_axis_cases) == [6, 6]
