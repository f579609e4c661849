"""Issue 21 items 3 and 5: ops real model code calls (aliases, type_as, one_hot, nonzero, list
and tensor indices, all/any, bool of invariant values) and an odd dp batch's loss, each against
dense torch on 2 ranks."""

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard.ops import registry as _registry
from fshard.ops import rule_for
from fshard.ops.aliases import aliases_of
from tests._opcheck import check, randn

P = fs.P
SPECS = (P(), P("x"), P(None, "x"))  # rows 5 = 3 | 2: uneven


def _mesh():
    return fs.Mesh.create((2,), ("x",))


def test_every_documented_alias_of_a_ruled_op_has_the_rule():
    """Derived from torch's own alias table, not a hand list: every op torch documents as an
    alias of an op with a rule dispatches to that rule."""
    ruled = [op for op in list(_registry._RULES) if aliases_of(op)]
    assert len(ruled) > 50
    missing = [(op, a) for op in ruled for a in aliases_of(op) if rule_for(a) is None]
    assert not missing, missing
    for op in (
        torch.greater,
        torch.less_equal,
        torch.not_equal,
        torch.absolute,
        torch.Tensor.greater_equal,
    ):
        assert rule_for(op) is not None, op


def alias_cases():
    mesh = _mesh()
    a, b = randn(5, 4), randn(5, 4, seed=1)
    fns = [
        lambda x, y: torch.greater(x, y),
        lambda x, y: torch.greater_equal(x, 0.1),
        lambda x, y: torch.less(x, y),
        lambda x, y: torch.less_equal(x, y),
        lambda x, y: torch.not_equal(x, y),
        lambda x, y: x.greater(y),
        lambda x, y: torch.absolute(x) + y.absolute(),
        lambda x, y: torch.negative(x) * y,
        lambda x, y: torch.clip(x, -0.5, 0.5) + torch.arctan2(x, y),
        lambda x, y: torch.multiply(x, y) - torch.subtract(x, y),
        lambda x, y: torch.true_divide(x, y.abs() + 1) + torch.special.expit(y),
        lambda x, y: torch.swapaxes(x, 0, 1) + torch.moveaxis(y, 0, 1),
    ]
    n = 0
    for s in SPECS:
        for i, f in enumerate(fns):
            check(mesh, f, [a, b], [s, P("x")], label=f"alias {i} {s}")
            n += 1
    return n


def test_aliases_match_dense(world2):
    assert world2.run(alias_cases)[0] == 36


def small_ops_cases():
    mesh = _mesh()
    a = randn(5, 4)
    ids = torch.tensor([[1, 2, 0, 3], [3, 1, 1, 0], [0, 0, 2, 2], [1, 3, 3, 1], [2, 2, 0, 1]])
    for s in SPECS:
        # type_as: the other tensor is read for its dtype only (no communication, no pcast)
        check(mesh, lambda i, x: i.type_as(x) * x, [ids, a], [s, P("x")], grad_wrt=(1,))
        x, i = fs.shard(a, mesh, P()), fs.shard(ids, mesh, s)
        with fs.debug.comm_log() as log:
            out = x.type_as(i)
        assert log == [] and out.dtype == torch.int64 and out.layout.spec == P(), log
        # one_hot with num_classes: elementwise with a new whole dim
        check(mesh, lambda i: F.one_hot(i, 5), [ids], [s])
        # list indices (x[..., [-2], :] picks the last-but-one position)
        b = randn(5, 6, 3, seed=2)
        for s3 in (P(), P("x"), P(None, "x"), P(None, None, "x")):
            check(mesh, lambda x: x[..., [-2], :], [b], [s3], label=f"list index {s3}")
            check(mesh, lambda x: x[[0, 4, 4], 1:], [b], [s3], label=f"rows {s3}")
            check(mesh, lambda x: x[:, [1, 3], [0, 2]], [b], [s3], label=f"pairs {s3}")
            check(mesh, lambda x: x[torch.tensor([[2], [0]]), :, torch.tensor([1, 2])], [b], [s3])
        # a list index on an unsplit dim keeps the other splits: no communication
        xb = fs.shard(b, mesh, P("x"))
        with fs.debug.comm_log() as log:
            y = xb[..., [-2], :]
        assert log == [] and y.spec == P("x"), (log, y.spec)
    # value-dependent shapes: replicated (or pending, reduced first) inputs give a replicated
    # result; a split input is refused before any communication
    r = fs.shard(a, mesh, P())
    for f in (
        lambda x: (x > 0.3).nonzero(),
        lambda x: torch.argwhere(x < 0),
        lambda x: x[x > 0],
        lambda x: torch.masked_select(x, x < 0),
    ):
        got = f(r)
        assert got.spec == P()
        assert torch.equal(fs.gather(got), f(a))
    pending = fs.shard(a, mesh, P("x")).sum(0)
    assert torch.equal(fs.gather((pending > 0).nonzero()), (a.sum(0) > 0).nonzero())
    oh = F.one_hot(fs.shard(ids, mesh, P()))  # num_classes from the values
    assert torch.equal(fs.gather(oh), F.one_hot(ids))
    split = fs.shard(a, mesh, P("x"))
    for f in (lambda: split.nonzero(), lambda: split[split > 0]):
        with pytest.raises(ValueError, match=r"different shape.*fs\.reshard"):
            f()
    with pytest.raises(ValueError, match="different shape"):
        F.one_hot(fs.shard(ids, mesh, P("x")))
    return True


def test_type_as_one_hot_nonzero_list_indices(world2):
    assert world2.run(small_ops_cases) == [True, True]


def mask_cases():
    """Padding-mask code: all/any over split dims, bool()/if on invariant values, indexing a
    mask with broadcast tensor indices (transformers' sdpa mask: mask[batch_idx, kv_idx])."""
    mesh = _mesh()
    mask = torch.ones(5, 6, dtype=torch.long)
    mask[0, :2] = 0
    mask[3, -1] = 0
    b_idx, kv_idx = torch.arange(5)[:, None, None, None], torch.arange(6)[None, None, None, :]
    for s in SPECS:
        for f in (
            lambda m: m.all(),
            lambda m: m.bool().any(),
            lambda m: torch.all(m, dim=1),
            lambda m: m.any(dim=0, keepdim=True),
            lambda m: (m == 1).all(-1),
            lambda m: torch.any(m == 0),
        ):
            check(mesh, f, [mask], [s])
        m = fs.shard(mask, mesh, s)
        assert m.all().spec == P()  # reduced over the mesh: the same on every rank
        assert bool(m.all()) is False and bool((m >= 0).all()) is True
        taken = False
        if not (m == 1).all():  # `if` on an invariant value works on every rank
            taken = True
        assert taken
        if s == P():
            assert m.sum().item() == mask.sum().item()
        check(mesh, lambda m: m[b_idx, kv_idx], [mask], [s], label=f"mask[b, kv] {s}")
    one = fs.shard(torch.ones(1), mesh, P("x"))
    with pytest.raises(TypeError, match=r"bool\(\) of a ShardedArray split.*\.all\(\)"):
        bool(one)
    with pytest.raises(TypeError, match="pending over"):
        bool(fs.shard(mask, mesh, P("x")).sum())
    with pytest.raises(TypeError, match=r"item\(\)"):
        fs.shard(mask, mesh, P("x")).sum().item()
    return True


def test_padding_mask_ops(world2):
    assert world2.run(mask_cases) == [True, True]


def odd_batch_loss(logits, labels, vocab):
    """transformers' ForCausalLMLoss, step by step."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab)
    shift = shift.view(-1).to(logits.device)
    return F.cross_entropy(logits, shift, ignore_index=-100, reduction="mean")


def odd_batch_cases():
    """Rows 2 | 1 of (3, 15, V) flatten to 30 | 15 tokens, which ceil-div cannot express: the
    reshape keeps the rows local (row blocks), the loss reduces one count, no logits move."""
    mesh = fs.Mesh.create((2,), ("dp",))
    B, T, V = 3, 15, 11
    L = randn(B, T, V, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    ids[2, 4] = -100
    logits, labels = fs.shard(L, mesh, P("dp")), fs.shard(ids, mesh, P("dp"))
    flat = logits.view(-1, V)
    assert flat.layout.is_explicit
    assert [m.shard_sizes for m in flat.shards_metadata()] == [(30, V), (15, V)]
    assert flat.view(B, T, V).layout == logits.layout  # back to P("dp")
    with fs.debug.comm_log() as log:
        loss = odd_batch_loss(logits, labels, V)
    assert loss.spec == P(partial="dp")
    assert sum(r.nbytes for r in log) <= 8, log  # the count of targets, never the logits
    torch.testing.assert_close(fs.gather(loss), odd_batch_loss(L, ids, V))
    g = torch.func.grad(lambda x: fs.gather(odd_batch_loss(x, labels, V)))(logits)
    assert g.layout == logits.layout
    torch.testing.assert_close(
        fs.gather(g), torch.func.grad(lambda x: odd_batch_loss(x, ids, V))(L)
    )
    for red in ("sum", "none"):
        got = F.cross_entropy(flat, labels.view(-1), reduction=red, ignore_index=-100)
        want = F.cross_entropy(L.view(-1, V), ids.view(-1), reduction=red, ignore_index=-100)
        torch.testing.assert_close(fs.gather(got), want)
    # row-wise contractions keep the row blocks (GPT-2's Conv1D: addmm on x.view(-1, K))
    w, c = randn(V, 2, seed=4, dtype=torch.float64), randn(2, seed=5, dtype=torch.float64)
    ww, cc = fs.shard(w, mesh, P()), fs.shard(c, mesh, P())
    for f in (lambda x, w, c: x @ w, lambda x, w, c: torch.addmm(c, x, w)):
        y = f(flat, ww, cc)
        assert y.layout.is_explicit and y.shape == (B * T, 2)
        torch.testing.assert_close(fs.gather(y), f(L.view(-1, V), w, c))
        gw = torch.func.grad(lambda w_, f=f: fs.gather(f(flat, w_, cc).pow(2).sum()))(ww)
        want = torch.func.grad(lambda w_, f=f: f(L.view(-1, V), w_, c).pow(2).sum())(w)
        torch.testing.assert_close(fs.gather(gw), want)  # reduced over dp exactly once
    # a rule that does not take row blocks (cumsum), or not this combination (row blocks plus
    # a replicated value of their shape, as OPT's residual add after x.view(-1, H)): the row
    # blocks are gathered first (one all_gather), values as dense
    other = randn(B * T, V, seed=6, dtype=torch.float64)
    for f, o in ((lambda x, o: torch.cumsum(x, 0), None), (lambda x, o: x + o, other)):
        with fs.debug.comm_log() as log:
            y = f(flat, None if o is None else fs.shard(o, mesh, P()))
        assert [r.op for r in log] == ["all_gather"], log
        torch.testing.assert_close(fs.gather(y), f(L.view(-1, V), o))
    return True


def test_odd_dp_batch_loss_without_gathering_logits(world2):
    assert world2.run(odd_batch_cases) == [True, True]


def moe_conv_cases():
    """Issue 21 item 7: the ops MoE experts and tensor-parallel convolutions need."""
    mesh = _mesh()
    # torch.histc: a split input gives block histograms pending over the split axis (no
    # communication), a range given by the data (min == max) gathers the input
    ids = torch.randint(0, 4, (7, 2), generator=torch.Generator().manual_seed(0)).float()
    for s in (P(), P("x"), P(None, "x")):
        x = fs.shard(ids, mesh, s)
        with fs.debug.comm_log() as log:
            h = torch.histc(x, bins=4, min=0, max=3)
        assert h.spec == (P(partial="x") if s != P() else P()) and not log, (s, h.spec, log)
        assert torch.equal(fs.gather(h), torch.histc(ids, bins=4, min=0, max=3))
        check(mesh, lambda t: t.histc(bins=3), [ids], [s], label=f"histc {s}")
    # torch._grouped_mm (F.grouped_mm, transformers' default MoE experts): whole, replicated
    a, w = randn(6, 8, dtype=torch.float32), randn(3, 8, 8, seed=1, dtype=torch.float32)
    offs = torch.tensor([2, 5, 6], dtype=torch.int32)
    for sa, sw in ((P(), P()), (P("x"), P(None, None, "x"))):
        A, W = fs.shard(a, mesh, sa), fs.shard(w, mesh, sw)
        got = torch._grouped_mm(A, W, offs=fs.shard(offs, mesh, P()))
        assert got.spec == P()
        torch.testing.assert_close(fs.gather(got), torch._grouped_mm(a, w, offs=offs))
    # F.conv2d / conv1d with the weight split on out- or in-channels: no communication, the
    # output split on channels (column) or pending (row, the bias added once); gradients dense
    x, k = randn(3, 5, 6, 6), randn(4, 5, 3, 3, seed=2)
    b = randn(4, seed=3)
    cases = [  # (x spec, weight spec, bias spec, output spec)
        (P(), P("x"), P("x"), P(None, "x")),
        (P(), P(None, "x"), P(), P(partial="x")),
        (P(None, "x"), P(None, "x"), P(), P(partial="x")),
        (P("x"), P(), P(), P("x")),  # a replicated weight: the batch keeps its split
    ]
    for sx, sk, sb, want in cases:
        X, K, B = (fs.shard(t, mesh, s) for t, s in ((x, sx), (k, sk), (b, sb)))
        with fs.debug.comm_log() as log:
            y = F.conv2d(X, K, B, padding=1)
        assert not log and y.spec == want, (sx, sk, log, y.spec)
        check(mesh, lambda t, w, c: F.conv2d(t, w, c, padding=1), [x, k, b], [sx, sk, sb])
    check(mesh, lambda t, w: F.conv1d(t, w), [randn(2, 4, 7), randn(6, 4, 3, seed=4)],
          [P(), P("x")])  # fmt: skip
    # transformers' eager experts loop: torch.where(cond) (nonzero as a tuple) on a replicated
    # mask, a 0-d index tensor (x[e] for e in expert_hit) as an int; a split mask is refused
    mask = torch.rand(2, 5, generator=torch.Generator().manual_seed(5)) > 0.5
    for got, want in zip(torch.where(fs.shard(mask, mesh, P())), torch.where(mask)):
        assert got.spec == P() and torch.equal(fs.gather(got), want)
    m3 = randn(3, 4)
    for i, e in enumerate(fs.shard(torch.tensor([2, 0]), mesh, P())):
        got = fs.shard(m3, mesh, P(None, "x"))[e]
        assert e.shape == () and got.spec == P("x")
        torch.testing.assert_close(fs.gather(got), m3[[2, 0][i]])
    with pytest.raises(ValueError, match="split as P"):
        torch.where(fs.shard(mask, mesh, P(None, "x")))
    return True


def test_moe_and_conv_ops(world2):
    assert world2.run(moe_conv_cases) == [True, True]
