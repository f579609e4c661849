"""Wrong answers a random differential test found (issue 26 item 7), each pinned against dense
torch on 2 ranks with uneven blocks."""

import math

import torch
import torch.nn.functional as F

import fshard as fs


def pending_int_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    t = torch.tensor([[1, 2], [3, 4], [5, 6]])
    s = fs.shard(t, mesh, fs.P("x", None)).sum(0)  # a pending int64 sum: [4, 6] | [5, 6]
    ops = {
        "cumsum": lambda v: torch.cumsum(v, 0),
        "flip": lambda v: torch.flip(v, [0]),
        "roll": lambda v: torch.roll(v, 1, 0),
        "repeat": lambda v: v.repeat(2),
        "repeat_interleave": lambda v: torch.repeat_interleave(v, 2),
        "index_select": lambda v: torch.index_select(v, 0, torch.tensor([1, 0])),
        "gather": lambda v: torch.gather(v, 0, torch.tensor([1, 1, 0])),
        "tril": lambda v: torch.tril(v.reshape(1, 2)),
    }
    return {name: fs.gather(fn(s)) for name, fn in ops.items()}


def test_pending_integer_sum_through_linear_whole_dim_ops(world2):
    """A pending int64 sum passed to cumsum/flip/roll/... kept its pending sum in the input
    spec but the output claimed to be replicated: each rank returned its own addend."""
    s = torch.tensor([[1, 2], [3, 4], [5, 6]]).sum(0)
    want = {
        "cumsum": torch.cumsum(s, 0),
        "flip": torch.flip(s, [0]),
        "roll": torch.roll(s, 1, 0),
        "repeat": s.repeat(2),
        "repeat_interleave": torch.repeat_interleave(s, 2),
        "index_select": s[[1, 0]],
        "gather": s[[1, 1, 0]],
        "tril": torch.tril(s.reshape(1, 2)),
    }
    for rank in world2.run(pending_int_rank_fn):
        for name, got in rank.items():
            assert torch.equal(got, want[name]), (name, got, want[name])


def zero_norm_grads_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    t = torch.zeros(3, 2, dtype=torch.float64)
    t[:, 1] = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)  # column 0: zero std/norm
    x = fs.shard(t, mesh, fs.P("x", None))
    fns = {
        "std": lambda v: v.std(0).sum(),
        "vector_norm": lambda v: torch.linalg.vector_norm(v, dim=0).sum(),
        "norm": lambda v: torch.norm(v, dim=0).sum(),
        "norm3": lambda v: torch.linalg.vector_norm(v, ord=3, dim=0).sum(),
    }
    return {
        k: fs.gather(torch.func.grad(lambda v, f=f: fs.gather(f(v)))(x)) for k, f in fns.items()
    }


def test_norm_and_std_gradients_at_zero_over_a_split_dim(world2):
    """Gradients of std / vector_norm / norm over a split dim were NaN where the result is 0;
    dense torch gives 0 there."""
    t = torch.zeros(3, 2, dtype=torch.float64)
    t[:, 1] = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    fns = {
        "std": lambda v: v.std(0).sum(),
        "vector_norm": lambda v: torch.linalg.vector_norm(v, dim=0).sum(),
        "norm": lambda v: torch.norm(v, dim=0).sum(),
        "norm3": lambda v: torch.linalg.vector_norm(v, ord=3, dim=0).sum(),
    }
    want = {k: torch.func.grad(f)(t) for k, f in fns.items()}
    for rank in world2.run(zero_norm_grads_rank_fn):
        for k, got in rank.items():
            assert not got.isnan().any(), k
            torch.testing.assert_close(got, want[k])


def structseq_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.tensor([[1.0, 5.0], [4.0, 2.0], [0.0, 3.0]]), mesh, fs.P("x", None))
    calls = {
        "max0": torch.max(x, 0),
        "max1": torch.max(x, 1),
        "min": x.min(dim=1, keepdim=True),
        "sort": torch.sort(x, 0),
        "topk": torch.topk(x, 1, 0),
    }
    return {
        k: (type(r).__name__, fs.gather(r.values), fs.gather(r.indices)) for k, r in calls.items()
    }


def test_value_and_index_results_are_torch_return_types(world2):
    """torch.max(x, dim) & co. returned a plain tuple: ``.values``/``.indices`` failed."""
    t = torch.tensor([[1.0, 5.0], [4.0, 2.0], [0.0, 3.0]])
    want = {
        "max0": torch.max(t, 0),
        "max1": torch.max(t, 1),
        "min": t.min(dim=1, keepdim=True),
        "sort": torch.sort(t, 0),
        "topk": torch.topk(t, 1, 0),
    }
    for rank in world2.run(structseq_rank_fn):
        for k, (name, values, indices) in rank.items():
            assert name == type(want[k]).__name__, (k, name)
            assert torch.equal(values, want[k].values), k
            assert torch.equal(indices, want[k].indices), k


def block_error_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    ints = fs.shard(torch.tensor([[3, -1, 7]]), mesh, fs.P("x", None))  # rank 1: empty
    one_channel = fs.shard(torch.arange(8.0).reshape(2, 1, 4), mesh, fs.P(None, "x", None))
    rows = fs.shard(torch.arange(12.0).reshape(3, 4), mesh, fs.P("x", None))  # 2 | 1 rows
    got = {
        "amax": torch.amax(ints, 0),
        "amin": torch.amin(ints, 0),
        "max": ints.max(),
        "min": ints.min(),
        "avg_pool1d": F.avg_pool1d(one_channel, 2),
        "max_pool1d": F.max_pool1d(one_channel, 2),
        "interpolate": F.interpolate(one_channel, scale_factor=2.0),
        "group_norm": F.group_norm(rows, 4),
    }
    return {k: fs.gather(v) for k, v in got.items()}


def test_errors_of_one_rank_block_are_planned_around(world2):
    """int64 amax/amin/max over an empty shard (-inf to int64), pooling/interpolate over an
    empty channel block and group_norm on a one-row block raised on one rank only while the
    other waited in a collective (a hang); dense torch computes each of them."""
    ints = torch.tensor([[3, -1, 7]])
    one_channel = torch.arange(8.0).reshape(2, 1, 4)
    rows = torch.arange(12.0).reshape(3, 4)
    want = {
        "amax": torch.amax(ints, 0),
        "amin": torch.amin(ints, 0),
        "max": ints.max(),
        "min": ints.min(),
        "avg_pool1d": F.avg_pool1d(one_channel, 2),
        "max_pool1d": F.max_pool1d(one_channel, 2),
        "interpolate": F.interpolate(one_channel, scale_factor=2.0),
        "group_norm": F.group_norm(rows, 4),
    }
    for rank in world2.run(block_error_rank_fn):
        for k, got in rank.items():
            assert got.dtype == want[k].dtype, k
            torch.testing.assert_close(got, want[k], msg=k)


def _extremes():
    return {
        "amax": lambda v: torch.amax(v, 0),
        "amin": lambda v: torch.amin(v, 0, keepdim=True),
        "max": lambda v: v.max(),
        "min": lambda v: v.min(),
        "norm_inf": lambda v: torch.linalg.vector_norm(v, math.inf, 0),
        "norm_-inf": lambda v: torch.linalg.vector_norm(v, -math.inf, 0),
    }


def _tied():
    """Ties inside a rank's block (rows 0, 1 of 2 | 1) and across ranks, per column."""
    return torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 3.0], [1.0, -1.0, 3.0]], dtype=torch.float64)


def tie_grads_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(_tied(), mesh, fs.P("x", None))
    out = {}
    for k, f in _extremes().items():
        grad = torch.func.grad(lambda v, f=f: (fs.gather(f(v)) * 1.5).sum())(x)
        _, tangent = torch.func.jvp(lambda v, f=f: fs.gather(f(v)), (x,), (x,))
        out[k] = (fs.gather(grad), tangent)
    return out


def test_extreme_gradients_share_ties_evenly_over_a_split_dim(world2):
    """amax/amin/max()/vector_norm(inf) over a split dim shared a tie's gradient per rank
    (ones(3): [.25, .25, .5]); dense torch shares it evenly among all the ties."""
    t = _tied()
    for rank in world2.run(tie_grads_rank_fn):
        for k, f in _extremes().items():
            grad, tangent = rank[k]
            torch.testing.assert_close(grad, torch.func.grad(lambda v, f=f: (f(v) * 1.5).sum())(t))
            torch.testing.assert_close(tangent, torch.func.jvp(f, (t,), (t,))[1], msg=k)


def signed_zero_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    t = torch.tensor([-0.0, 0.0, -1.0], dtype=torch.float64)
    r = fs.reshard(fs.shard(t, mesh, fs.P()), fs.P(partial="x"))  # rank 1 holds no addend
    c = fs.reshard(fs.shard(t.to(torch.complex128), mesh, fs.P()), fs.P(partial="x"))
    m1 = torch.tensor(-1.0, dtype=torch.float64)
    scattered = fs.reshard(r, fs.P("x"))  # reduce_scatter of the addends
    return fs.gather(torch.atan2(r, m1)), fs.gather(c), fs.gather(torch.atan2(scattered, m1))


def test_pending_sum_keeps_negative_zero(world2):
    """reshard R -> P gave the non-first ranks +0.0 addends, and reduce_scatter (P -> S)
    summed -0.0 addends to +0.0: a -0.0 came back +0.0 and atan2 differed by pi."""
    t = torch.tensor([-0.0, 0.0, -1.0], dtype=torch.float64)
    want = torch.atan2(t, torch.tensor(-1.0, dtype=torch.float64))
    for got, complex_sum, scattered in world2.run(signed_zero_rank_fn):
        assert torch.equal(got, want), (got, want)
        assert torch.equal(scattered, want), (scattered, want)
        assert torch.equal(torch.signbit(complex_sum.real), torch.signbit(t))


def vmap_rows_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.arange(18.0).reshape(2, 3, 3), mesh, fs.P(None, "x", None))
    return fs.gather(torch.func.vmap(lambda a: a.reshape(-1))(x))


def test_vmap_returns_row_blocks(world2):
    """vmap of a reshape whose result is in row blocks (rows 2 | 1 of (3, 3) -> (9,): an
    explicit layout) failed at vmap's output ('Value after * must be an iterable')."""
    want = torch.arange(18.0).reshape(2, 9)
    for got in world2.run(vmap_rows_rank_fn):
        assert torch.equal(got, want)


def _row_reductions():
    return {
        "amax": lambda v: torch.amax(v, 0),
        "amin_keepdim": lambda v: torch.amin(v, 0, keepdim=True),
        "max": lambda v: v.max(),
        "logsumexp": lambda v: torch.logsumexp(v, 0),
        "std": lambda v: torch.std(v, 0),
        "norm_inf": lambda v: torch.linalg.vector_norm(v, math.inf),
        "norm": lambda v: torch.linalg.vector_norm(v, 2, 0),
    }


def row_reductions_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    t = torch.tensor([[1.0, 5.0, 2.0], [4.0, 5.0, 0.0], [-3.0, 2.0, 6.0]], dtype=torch.float64)
    x = fs.shard(t, mesh, fs.P("x", None))
    out = {}
    for k, f in _row_reductions().items():
        rowed = lambda v, f=f: f(v.reshape(9))  # noqa: E731 -- rows 2 | 1: row blocks (6 | 3)
        grad = torch.func.grad(lambda v, g=rowed: fs.gather(g(v)).sum())(x)
        out[k] = (fs.gather(rowed(x)), fs.gather(grad))
    return out


def test_reductions_of_row_blocks(world2):
    """amax/max/logsumexp/std/norm of a value in row blocks (reshape of uneven rows) raised
    'an input has an explicit layout'; sum and mean took it."""
    t = torch.tensor([[1.0, 5.0, 2.0], [4.0, 5.0, 0.0], [-3.0, 2.0, 6.0]], dtype=torch.float64)
    for rank in world2.run(row_reductions_rank_fn):
        for k, f in _row_reductions().items():
            value, grad = rank[k]
            torch.testing.assert_close(value, f(t.reshape(9)), msg=k)
            want = torch.func.grad(lambda v, f=f: f(v.reshape(9)).sum())(t)
            torch.testing.assert_close(grad, want, msg=k)
