"""Wrong answers a random differential test found (issue 26 item 7), each pinned against dense
torch on 2 ranks with uneven blocks."""

import torch

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
