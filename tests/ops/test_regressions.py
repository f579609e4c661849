"""Issue 13 regressions: ops that gave silent wrong answers or failed although a rule exists,
each checked against dense torch (values and grads) on 2 ranks, sharded and replicated."""

import math

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from tests._opcheck import check, randn

P = fs.P


def _mesh():
    return fs.Mesh.create((2,), ("x",))


def _raises(exc, fn, match=None):
    with pytest.raises(exc, match=match):
        fn()


# -- 13.2 norms over a split dim ------------------------------------------------------------


def norm_cases():
    mesh = _mesh()
    a = randn(5, 4)
    z = a.clone()
    z[1, 2] = 0.0  # p=0 counts non-zeros
    n = 0
    for s in (P(), P("x"), P(None, "x")):
        for p in (-math.inf, -1.0, 0, 0.5, 1, 2, 3.0, math.inf):
            t = z if p == 0 else a
            check(
                mesh, lambda x, p=p: torch.linalg.vector_norm(x, p), [t], [s], label=f"vn {p} {s}"
            )
            check(mesh, lambda x, p=p: torch.norm(x, p, dim=0), [t], [s], label=f"norm {p} {s}")
            n += 2
        check(mesh, lambda x: torch.norm(x, "fro"), [a], [s], label=f"fro {s}")
        check(mesh, lambda x: torch.linalg.vector_norm(x, dtype=torch.float64), [a], [s])
    check(mesh, lambda x: torch.norm(x, "nuc"), [a], [P()], label="nuc replicated")
    xs = fs.shard(a, mesh, P("x"))
    _raises(NotImplementedError, lambda: torch.norm(xs, "nuc"), match="p='nuc'")
    return n


def test_norms_over_split_dims(world2):
    assert world2.run(norm_cases)[0] == 48


# -- 13.3 embedding(scale_grad_by_freq=True) ----------------------------------------------


def embedding_freq_cases():
    mesh = _mesh()
    w = randn(7, 4)
    ids = torch.tensor([[1, 1, 3], [1, 6, 0]])
    f = lambda i, w: F.embedding(i, w, scale_grad_by_freq=True)  # noqa: E731
    check(mesh, f, [ids, w], [P(), P()], label="replicated")
    check(mesh, f, [ids, w], [P(), P(None, "x")], label="dim-split weight")
    for si, sw in [(P(), P("x")), (P("x"), P()), (P(None, "x"), P(None, "x"))]:
        i_s, w_s = fs.shard(ids, mesh, si), fs.shard(w, mesh, sw)
        with pytest.raises(NotImplementedError, match="scale_grad_by_freq"):
            f(i_s, w_s)
    return True


def test_embedding_scale_grad_by_freq(world2):
    assert all(world2.run(embedding_freq_cases))


# -- 13.4 sdpa: broadcast batch dims, k/v batch 1, enable_gqa, dropout ----------------------


def _sdpa(**kw):
    def f(q, k, v):
        if kw.get("dropout_p"):
            torch.manual_seed(3)  # the same mask for the sharded and the dense call
        return F.scaled_dot_product_attention(q, k, v, **kw)

    return f


def sdpa_cases():
    mesh = _mesh()
    n = 0
    q3, k4, v4 = randn(4, 6, 8), randn(2, 4, 6, 8, seed=1), randn(2, 4, 6, 8, seed=2)
    for sq, skv in [(P("x"), P(None, "x")), (P(), P("x")), (P("x"), P()), (P(), P())]:
        check(mesh, _sdpa(), [q3, k4, v4], [sq, skv, skv], label=f"q rank 3 {sq} {skv}")
        n += 1
    q4, k1, v1 = randn(2, 4, 6, 8, seed=3), randn(1, 4, 6, 8, seed=4), randn(1, 4, 6, 8, seed=5)
    for sq, skv in [(P("x"), P()), (P(None, "x"), P(None, "x")), (P("x"), P(None, "x"))]:
        check(mesh, _sdpa(is_causal=True), [q4, k1, v1], [sq, skv, skv], label=f"kv batch 1 {sq}")
        n += 1
    kg, vg = randn(2, 2, 6, 8, seed=6), randn(2, 2, 6, 8, seed=7)
    k3, v3 = randn(2, 3, 6, 8, seed=6), randn(2, 3, 6, 8, seed=7)
    q6 = randn(2, 6, 6, 8, seed=8)
    for kw in ({"enable_gqa": True}, {"enable_gqa": True, "dropout_p": 0.3, "is_causal": True}):
        for sq, skv in [(P(None, "x"), P(None, "x")), (P("x"), P("x")), (P(None, "x"), P())]:
            check(mesh, _sdpa(**kw), [q4, kg, vg], [sq, skv, skv], label=f"gqa {kw} {sq} {skv}")
            # 3 kv heads do not split evenly over 2 ranks: heads are kept whole
            check(mesh, _sdpa(**kw), [q6, k3, v3], [sq, skv, skv], label=f"gqa odd {kw} {sq}")
            n += 2
    for sq in (P("x"), P(None, "x"), P()):
        check(mesh, _sdpa(dropout_p=0.5), [q4, q4 + 1, q4 - 1], [sq, sq, sq], label=f"drop {sq}")
        n += 1
    return n


def test_sdpa_broadcast_gqa_dropout(world2):
    assert world2.run(sdpa_cases)[0] == 22


# -- 13.5 a layout's dtype always describes its local tensor --------------------------------


def dtype_cases():
    mesh = _mesh()
    a, w = randn(6, 4), randn(4, 3, seed=1)
    xs, ws = fs.shard(a, mesh, P("x")), fs.shard(w, mesh, P())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = xs @ ws
        want = a @ w
        z = F.linear(xs, ws.T) + 1.0
    assert y.dtype is y.local.dtype is want.dtype is torch.bfloat16, (y.dtype, y.local.dtype)
    assert z.dtype is z.local.dtype is torch.bfloat16, (z.dtype, z.local.dtype)
    torch.testing.assert_close(fs.gather(y), want)
    b = fs.tree_map(lambda t: t.bfloat16(), {"x": xs})["x"]
    assert b.dtype is b.local.dtype is torch.bfloat16, (b.dtype, b.local.dtype)
    c = b * 2 + b
    assert c.dtype is c.local.dtype is torch.bfloat16
    torch.testing.assert_close(fs.gather(c), a.bfloat16() * 3)
    return True


def test_layout_dtype_follows_local(world2):
    assert all(world2.run(dtype_cases))


# -- operators derived from the rules, casts, pad, narrow, einsum, vmap randomness ----------


def operator_cases():
    mesh = _mesh()
    a, b = randn(5, 4), randn(5, 4, seed=1)
    pos = a.abs() + 1
    n = 0
    for s in (P(), P("x"), P(None, "x")):
        check(mesh, lambda x: +x, [a], [s], label=f"pos {s}")
        check(mesh, lambda x, y: (x > 0) ^ (y > 0), [a, b], [s, s], label=f"xor {s}")
        check(mesh, lambda x: 2 // x, [pos], [s], grad_wrt=[], label=f"rfloordiv {s}")
        check(mesh, lambda x: 7 % x, [pos], [s], grad_wrt=[], label=f"rmod {s}")
        check(mesh, lambda x: True & (x > 0), [a], [s], label=f"rand {s}")
        check(mesh, lambda x: False | (x > 0), [a], [s], label=f"ror {s}")
        check(mesh, lambda x: True ^ (x > 0), [a], [s], label=f"rxor {s}")
        n += 7
    return n


def test_operators_from_rules(world2):
    assert world2.run(operator_cases)[0] == 21


def cast_pad_cases():
    mesh = _mesh()
    a = randn(5, 4)
    n = 0
    for s in (P(), P("x"), P(None, "x"), P(partial="x")):
        cases = {
            "to cpu": lambda x: x.to("cpu"),
            "to cpu dtype": lambda x: x.to("cpu", torch.float64),
            "to dtype kw": lambda x: x.to(device="cpu", dtype=torch.float64),
            "type": lambda x: x.type(torch.float64),
            "type str": lambda x: x.type("torch.DoubleTensor"),
            "pad": lambda x: F.pad(x, (1, 2)),
            "pad 2d value": lambda x: F.pad(x, (1, 2, 0, 1), value=2.0),
            "pad reflect": lambda x: F.pad(x[None], (1, 1), mode="reflect"),
            "narrow tensor start": lambda x: torch.narrow(x, 0, torch.tensor(1), 3),
            "narrow dim 1": lambda x: x.narrow(1, torch.tensor(2), 2),
            "einsum diag": lambda x: torch.einsum("ii->i", x[:4]),
            "einsum trace": lambda x: torch.einsum("ii", x[:4]),
            "einsum ij,ij": lambda x: torch.einsum("ij,ij->i", x, x),
        }
        for name, f in cases.items():
            check(mesh, f, [a], [s], label=f"{name} {s}")
            n += 1
    xs = fs.shard(a, mesh, P("x"))
    assert xs.type() == a.type()
    _raises(NotImplementedError, lambda: xs.to("meta"), match="does not move shards")
    return n


def test_casts_pad_narrow_einsum(world2):
    assert world2.run(cast_pad_cases)[0] == 52


def vmap_random_cases():
    mesh = _mesh()
    xs = fs.shard(randn(3, 5, 4), mesh, P(None, "x"))
    xd = randn(3, 5, 4)
    fns = {
        "dropout p=0": lambda t: F.dropout(t, 0.0) * 2,
        "dropout eval": lambda t: F.dropout(t, 0.5, training=False) * 2,
        "sdpa p=0": lambda t: F.scaled_dot_product_attention(t[None], t[None], t[None])[0],
    }
    for name, f in fns.items():
        want = torch.func.vmap(f, randomness="error")(xd)
        got = torch.func.vmap(lambda t, f=f: fs.gather(f(t)), randomness="error")(
            fs.shard(xd, mesh, P(None, "x"))
        )
        torch.testing.assert_close(got, want, msg=name)
    # a random op still raises where dense does
    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(lambda t: fs.gather(F.dropout(t, 0.5)), randomness="error")(xs)
    return True


def test_random_ops_under_vmap_error_mode(world2):
    assert all(world2.run(vmap_random_cases))


# -- matmul: reduce a pending activation or gather a split weight, whichever moves less ------


def matmul_choice_cases():
    mesh = fs.Mesh.create((2,), ("tp",))
    out = []
    # (B, D, F): reduce x costs B*D*4 received bytes (all_reduce over 2 ranks); keeping the
    # sum costs the gather of w's other half (D*F/2*4) plus the later reduce of the (B, F)
    # pending output (B*F*4)
    for b, d, f, want_ops, want_spec in [
        (64, 8, 8, [("all_reduce", 64 * 8 * 4)], P(None, "tp")),
        (2, 8, 64, [("all_reduce", 2 * 8 * 4)], P(None, "tp")),
        (64, 32, 4, [("all_gather", 32 * 2 * 4)], P(partial="tp")),
    ]:
        xd, wd = randn(b, d), randn(d, f, seed=1)
        x = fs.shard(xd, mesh, P(partial="tp"))
        w = fs.shard(wd, mesh, P(None, "tp"))
        with fs.debug.comm_log() as log:
            y = x @ w
        assert [(r.op, r.nbytes) for r in log] == want_ops, (b, d, f, log)
        assert y.spec == want_spec, (b, d, f, y.spec)
        torch.testing.assert_close(fs.gather(y), xd @ wd, atol=1e-5, rtol=1e-4)
        out.append(y.spec)
    # two pending operands with one (interned) layout: only one may stay pending
    a, b = randn(4, 6), randn(4, 6, seed=2)
    for f in (lambda x, y: x @ y.T, lambda x, y: torch.matmul(x, y.transpose(0, 1))):
        check(mesh, f, [a, b], [P(partial="tp"), P(partial="tp")], label="both pending")
        check(mesh, lambda x, f=f: f(x, x), [a], [P(partial="tp")], label="x @ x.T pending")
    return out


def test_matmul_reduces_pending_activation_when_cheaper(world2):
    assert world2.run(matmul_choice_cases)[0] == [P(None, "tp"), P(None, "tp"), P(partial="tp")]


# -- issue 37 item 3: a reshape that merges an unsplit dim with a split one -------------------


def merged_heads_cases():
    """``(batch, heads / tp, seq, dim) -> (batch * heads, seq, dim)`` before ``bmm`` (several
    attention implementations): the data moves (an all_to_all to a split of the batch where its
    chunks line up, else the heads gathered), in the comm log with its bytes; values and grads
    equal the dense ones."""
    mesh = fs.Mesh.create((2,), ("tp",))
    out = []
    for b, h in ((2, 4), (3, 4), (1, 4)):
        s, d = 3, 5
        q = randn(b, h, s, d, dtype=torch.float64)
        k = randn(b, h, s, d, seed=1, dtype=torch.float64)

        def attn(q, k, b=b, h=h, s=s, d=d):
            a, c = q.reshape(b * h, s, d), k.reshape(b * h, s, d)
            return torch.bmm(a, c.transpose(1, 2)).view(b, h, s, s)

        x, y = fs.shard(q, mesh, P(None, "tp")), fs.shard(k, mesh, P(None, "tp"))
        with fs.debug.comm_log() as log:
            got = attn(x, y)
        torch.testing.assert_close(fs.gather(got), attn(q, k))
        g = torch.func.grad(lambda x, y=y, f=attn: fs.gather(f(x, y).pow(2).sum()))(x)
        want = torch.func.grad(lambda q, k=k, f=attn: f(q, k).pow(2).sum())(q)
        assert g.layout == x.layout
        torch.testing.assert_close(fs.gather(g), want)
        out.append([(r.op, r.nbytes) for r in log])
    # the three-dim reshape itself, planned on an abstract mesh: the split moved to dim 0
    lay = fs.Layout(fs.Mesh.abstract((2,), ("tp",)), P(None, "tp"), (2, 4, 3, 5))
    assert fs.ops.shape.reshape_source(lay, (8, 3, 5)) == P("tp")
    assert [s.op.name for s in fs.plan(lay, P("tp"))] == ["all_to_all"]  # what it costs
    lay = fs.Layout(fs.Mesh.abstract((2,), ("tp",)), P(None, "tp"), (3, 4, 3, 5))
    assert fs.ops.shape.reshape_source(lay, (12, 3, 5)) == P()
    return out


def test_reshape_merging_a_split_dim_moves_data(world2):
    """Before: a ValueError ("cannot reshape ... without moving data") naming an fs.reshard
    in the model's own code."""
    got = world2.run(merged_heads_cases)
    assert got[0] == got[1]
    blk = 2 * 2 * 3 * 5 * 8  # one rank's (2, 2, 3, 5) float64 block of q
    # b=2: q and k each one all_to_all of the block; b=3: each gathered;
    # b=1: the size-1 batch is its own group, the heads stay split (local)
    assert got[0][0] == [("all_to_all", blk), ("all_to_all", blk)], got[0][0]
    assert [op for op, _ in got[0][1]] == ["all_gather", "all_gather"], got[0][1]
    assert got[0][2] == [], got[0][2]
