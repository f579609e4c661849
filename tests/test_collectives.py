"""fshard.collectives: the ops as data (issue 28 items 1 and 3), the planner's steps built from
them, and the executor's programs (planned and bound once, held by an op rule's plan)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.func import grad, vmap

import fshard as fs
from fshard import collectives as C
from fshard import executor, lax

# Bytes a rank receives per input byte over n ranks, per printed name (the lowering table of
# fshard/planner.py's docstring; local ops receive nothing).
_BYTES = {
    "all_gather": lambda n: n - 1,
    "gather_blocks": lambda n: n - 1,
    "gather_parts": lambda n: n - 1,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "ppermute": lambda n: 1,
}

_M = fs.Mesh.abstract((2, 2), ("x", "y"))
_EXPLICIT = fs.Layout.explicit(
    fs.Mesh.abstract((2,), ("x",)), [((3, 0), (2, 3)), ((0, 0), (3, 3))], (5, 3)
)


#: a per-part layout pending over y, and the same parts split over (x, y)
_NESTED_PARTS = tuple(
    fs.Layout.of(_M, fs.Parts(spec, 0, (4, 2, 2)), (8, 6))
    for spec in (fs.P("x", None, partial="y"), fs.P(("x", "y"), None))
)


def _one_of_each():
    xy = ("x", "y")
    return [
        C.AllGather(xy, 1, (3, 3, 3, 1), invariant=True),
        C.AllGather(xy, 0),
        C.LocalSlice(xy, 1, (3, 3, 3, 1)),
        C.PsumScatter(xy, 0, (1, 2, 3, 4)),
        C.Psum(xy),
        C.Pcast(xy),
        C.Pmax(xy, "min"),
        C.AllToAll(xy, 0, 1, (2, 2, 2, 2), (1, 1, 1, 1)),
        C.Ppermute(xy, ((0, 1), (1, 0)), ((2,), (3,)), ((3,), (2,))),
        C.ZeroOthers(xy),
        C.PartialCotangent(xy),
        C.Unvary(xy),
        C.ScaleBySize(xy),
        C.Claim(xy),
        C.KeepFirst(xy),
        C.GatherBlocks(_EXPLICIT),
        C.KeepBlock(_EXPLICIT),
        C.GatherParts(xy, 1, (4, 2, 2)),
        C.SliceParts(xy, 0, (5, 3, 3)),
        C.PsumScatterParts(("y",), 0, *_NESTED_PARTS),
        C.AllGatherParts(("y",), 0, *_NESTED_PARTS),
    ]


def test_every_op_is_hashable_data_with_a_runner_a_transpose_and_a_cost():
    ops = _one_of_each()
    assert {type(op) for op in ops} == set(C.RUN), "one runner per op type, and no other"
    for op in ops:
        assert hash(op) == hash(type(op)(**op.__dict__)) and op == type(op)(**op.__dict__)
        n = 4
        want = _BYTES[op.name](n) if not op.local else 0
        assert op.traffic(n) == want, (op, op.traffic(n), want)
        if not op.linear:
            continue
        t = op.transpose()
        assert type(t) in C.RUN, t
        if type(op) not in (C.Unvary, C.Claim):  # these transpose to a self-transpose scale
            assert t.transpose() == op, (op, t, t.transpose())
        assert op.batched(3).transpose() == t.batched(3), op  # batching commutes with transpose


def test_plan_emits_ops_on_an_abstract_mesh():
    m = fs.Mesh.abstract((4,), ("x",))
    lay = fs.Layout(m, fs.P("x"), (10, 6), torch.float32)
    (step,) = fs.plan(lay, fs.P())
    assert step.op == C.AllGather(("x",), 0, (3, 3, 3, 1), invariant=True)
    assert repr(step) == "Step(all_gather over ('x',) dim=0: P('x') -> P(), 72 B)"
    (step,) = fs.plan(lay, fs.P(None, "x"))
    assert step.op == C.AllToAll(("x",), 1, 0, (2, 2, 2, 0), (3, 3, 3, 1))
    assert (step.dim, step.concat_dim) == (1, 0)
    part = lay.with_spec(fs.P(partial="x"))
    assert [s.op for s in fs.plan(part, fs.P("x"))] == [C.PsumScatter(("x",), 0, (3, 3, 3, 1))]
    assert [s.op for s in fs.plan(part.with_spec(fs.P()), fs.P(partial="x"))] == [
        C.ZeroOthers(("x",))
    ]
    two = fs.Layout(_M, fs.P("x", "y"), (4, 4))
    (step,) = fs.plan(two, fs.P("y", "x"))
    assert type(step.op) is C.Ppermute and step.perm == step.op.perm and step.axes == ("x", "y")
    assert step.op.in_shapes == step.op.out_shapes == ((2, 2),) * 4
    # the cost rules compare: each collective step's bytes times its op's traffic
    from fshard.ops._common import reshard_cost

    assert reshard_cost(lay, fs.P()) == 3 * 3 * 6 * 4
    assert math.isclose(reshard_cost(part, fs.P()), 2 * 3 / 4 * 10 * 6 * 4)


def test_norm_dim_one_spelling():
    from fshard.ops import _common

    assert _common.norm_dim is C.norm_dim and C.norm_dim(-1, 0) == 0
    with pytest.raises(ValueError, match="out of range"):
        C.norm_dim(2, 2)
    with pytest.raises(TypeError, match="must be an int"):
        C.norm_dim(1.0, 2)


# -- on a real mesh ------------------------------------------------------------------------------

# rank 0 holds rows 3:5, rank 1 rows 0:3 (not expressible with P)
_SWAPPED = [((3, 0), (2, 3)), ((0, 0), (3, 3))]


def gather_blocks_batched():
    """GatherBlocks under vmap (one all_gather for the batch) and its KeepBlock backward."""
    mesh = fs.Mesh.create((2,), ("x",))
    lay = fs.Layout.explicit(mesh, _SWAPPED, (5, 3), torch.float64)
    b = C.Bound(C.GatherBlocks(lay), mesh.group(("x",)))
    fulls = torch.arange(4 * 15, dtype=torch.float64).reshape(4, 5, 3)
    box = lay.shard_metadata(dist.get_rank()).slices()
    locals_ = fulls[(slice(None), *box)].clone()
    with fs.debug.comm_log() as log:
        got = vmap(lambda t: lax.apply(b, t))(locals_)
    w = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = grad(lambda t: (w * lax.apply(b, t)).sum())(locals_[0])
    gv = vmap(grad(lambda t: (w * lax.apply(b, t)).sum()))(locals_)
    return (
        torch.equal(got, fulls),
        [(r.op, r.nbytes) for r in log],
        torch.equal(g, w[box]),
        torch.equal(gv, w[box].expand(4, *w[box].shape)),
    )


def test_gather_blocks_vmap_and_grad(world2):
    # each rank's input: 4 examples of its block (rank 0: 2 x 3, rank 1: 3 x 3) in float64
    for rank, res in enumerate(world2.run(gather_blocks_batched)):
        assert res == (True, [("all_gather", 4 * (6, 9)[rank] * 8)], True, True), res


def planned_once():
    """An op rule's reshard is planned and bound once, shared with fs.reshard, and a cache
    hit plans nothing."""
    mesh = fs.Mesh.create((2,), ("x",))
    a = fs.shard(torch.arange(8.0).reshape(4, 2), mesh, fs.P("x"))
    c = fs.shard(torch.ones(4, 2), mesh, fs.P())
    executor.program.cache_clear()
    real, calls = executor.steps, []
    executor.steps = lambda *args: calls.append(args) or real(*args)
    try:
        for _ in range(3):
            out = a + c
        moved = [v for v in (a, c) if v.spec != out.spec]
        planned = len(calls)
        for v in moved:
            fs.reshard(v, out.spec)
    finally:
        executor.steps = real
    dense = torch.arange(8.0).reshape(4, 2) + 1
    return planned, len(calls), len(moved), torch.equal(fs.gather(out), dense)


def test_reshard_planned_once(world2):
    for planned, after, moved, ok in world2.run(planned_once):
        assert ok and moved >= 1 and planned == after == moved, (planned, after, moved)
