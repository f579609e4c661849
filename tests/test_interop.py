"""fs.interop (DTensor, ShardedTensor) and Layout.explicit (validation, gather, reshard)."""

import pickle
import warnings

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import interop
from fshard.spec import BaseLayout, ExplicitLayout

# -- Layout.explicit (pure) ---------------------------------------------------------------------

M3 = fs.Mesh.abstract((3,), ("x",))
GOOD = [((0, 0), (2, 4)), ((2, 0), (1, 4)), ((2, 0), (1, 4))]  # rank 2 replicates rank 1's box


def test_explicit_layout_metadata_eq_hash_pickle():
    lay = fs.Layout.explicit(M3, GOOD, (3, 4))
    assert isinstance(lay, ExplicitLayout) and lay.is_explicit and lay.spec is None
    # siblings behind one protocol: any layout, but not a P layout (op rules refuse it)
    assert isinstance(lay, BaseLayout) and not isinstance(lay, fs.Layout)
    assert [m.shard_sizes for m in lay.shards_metadata()] == [(2, 4), (1, 4), (1, 4)]
    assert lay.shard_metadata(1) == fs.ShardMetadata((2, 0), (1, 4), "rank:1/cpu")
    same = fs.Layout.explicit(M3, [fs.ShardMetadata(o, s, "x") for o, s in GOOD], (3, 4))
    assert lay == same and hash(lay) == hash(same) and len({lay, same}) == 1
    assert lay != fs.Layout.explicit(M3, GOOD, (3, 4), torch.float64)
    assert lay != fs.Layout(M3, fs.P("x"), (3, 4)) and fs.Layout(M3, fs.P("x"), (3, 4)) != lay
    assert pickle.loads(pickle.dumps(lay)) == lay
    assert lay.owner_ranks() == [0, 1]
    empty_ok = fs.Layout.explicit(M3, [((0,), (4,)), ((0,), (0,)), ((4,), (0,))], (4,))
    assert empty_ok.local_shape(2) == (0,)


@pytest.mark.parametrize(
    "chunks, shape, err, match",
    [
        (GOOD[:2], (3, 4), ValueError, "got 2 chunks for a mesh of 3 ranks"),
        (
            [((0, 0), (2, 4)), ((1, 0), (2, 4)), ((1, 0), (2, 4))],
            (3, 4),
            ValueError,
            r"Shards chunks\[0\] \(offsets \(0, 0\), sizes \(2, 4\)\) and chunks\[1\] .* overlap",
        ),
        (
            [((0, 0), (2, 4)), ((2, 0), (1, 2)), ((2, 0), (1, 2))],
            (3, 4),
            ValueError,
            "Total volume of shards: 10 does not match tensor volume: 12",
        ),
        (
            [((0, 0), (2, 4)), ((2, 0), (2, 4)), ((2, 0), (1, 4))],
            (3, 4),
            ValueError,
            "Shard offset 2 and length 2 exceeds tensor dim: 3",
        ),
        ([((0,), (2,))] * 3, (3, 4), ValueError, "Rank of tensor is 2, but shards rank is 1"),
        ([((0, 0), (-1, 4))] * 3, (3, 4), ValueError, "must be >= 0"),
        (["ab"] * 3, (3, 4), TypeError, r"chunks\[0\] is 'ab'"),
        ("abc", (3, 4), TypeError, "chunks must be a sequence"),
    ],
)
def test_explicit_layout_validation(chunks, shape, err, match):
    with pytest.raises(err, match=match):
        fs.Layout.explicit(M3, chunks, shape)


def test_plan_from_explicit():
    lay = fs.Layout.explicit(M3, GOOD, (3, 4))
    assert [s.op.name for s in fs.plan(lay, fs.P(None, "x"))] == ["gather_blocks", "slice"]
    assert [s.op.name for s in fs.plan(lay, fs.P())] == ["gather_blocks"]


# rank 0 holds rows 3:5, rank 1 rows 0:3 (not expressible with P)
SWAPPED = [((3, 0), (2, 3)), ((0, 0), (3, 3))]


def explicit_gather_reshard():
    mesh = fs.Mesh.create((2,), ("x",))
    full = torch.arange(15.0).reshape(5, 3)
    lay = fs.Layout.explicit(mesh, SWAPPED, (5, 3))
    local = full[lay.shard_metadata(dist.get_rank()).slices()].clone().requires_grad_()
    x = fs.ShardedArray(local, lay)
    with fs.debug.comm_log() as log:
        g = fs.gather(x)
    g0 = fs.gather(x, dst=0)
    y = fs.reshard(x, fs.P(None, "x"))
    (g * torch.arange(15.0).reshape(5, 3)).sum().backward()
    expect_grad = full[lay.shard_metadata(dist.get_rank()).slices()]
    return (
        torch.equal(g, full),
        g0 is None or torch.equal(g0, full),
        y.spec == fs.P(None, "x") and torch.equal(fs.gather(y), full),
        torch.equal(local.grad, expect_grad),
        [r.op for r in log],
    )


def test_gather_and_reshard_on_explicit_layout(world2):
    for res in world2.run(explicit_gather_reshard):
        assert res == (True, True, True, True, ["all_gather"])


# -- DTensor -----------------------------------------------------------------------------------


def dtensor_round_trip():
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = fs.Mesh.create((2,), ("x",))
    full = torch.arange(15.0).reshape(5, 3)
    out = []
    for spec, want in [
        (fs.P("x"), (Shard(0),)),  # uneven: 3, 2
        (fs.P(None, "x"), (Shard(1),)),
        (fs.P(), (Replicate(),)),
        (fs.P(partial="x"), (Partial("sum"),)),
    ]:
        x = fs.shard(full, mesh, spec)
        d = interop.to_dtensor(x)
        assert d.placements == want, (d.placements, want)
        assert tuple(d.shape) == (5, 3)
        assert torch.equal(d.full_tensor(), full)
        assert torch.equal(d.to_local(), x.local)
        back = interop.from_dtensor(d)
        assert back.layout == x.layout and torch.equal(back.local, x.local)
        out.append(spec)
    # a DTensor built by DTensor itself (uneven Shard(0))
    from torch.distributed.tensor import distribute_tensor

    d = distribute_tensor(full, mesh.device_mesh, [Shard(0)])
    y = interop.from_dtensor(d)
    assert y.spec == fs.P("x") and torch.equal(fs.gather(y), full)
    # two mesh dims on one tensor dim: even works, uneven raises with the reason
    m2 = fs.Mesh.create((1, 2), ("a", "b"))
    x = fs.shard(torch.arange(8.0), m2, fs.P(("a", "b")))
    d = interop.to_dtensor(x)
    assert d.placements == (Shard(0), Shard(0)) and torch.equal(d.full_tensor(), torch.arange(8.0))
    assert interop.from_dtensor(d).layout == x.layout
    with pytest.raises(ValueError, match="nested"):
        interop.to_dtensor(fs.shard(torch.arange(7.0), m2, fs.P(("a", "b"))))
    with pytest.raises(ValueError, match="mesh order"):
        interop.to_dtensor(fs.shard(torch.arange(8.0), m2, fs.P(("b", "a"))))
    return len(out)


def test_dtensor_round_trip(world2):
    assert world2.run(dtensor_round_trip) == [4, 4]


def test_dtensor_errors_without_a_world():
    m = fs.Mesh.abstract((2, 2), ("x", "y"))
    with pytest.raises(ValueError, match=r"size 6\) is split over axes \('x', 'y'\) \(4 chunks\)"):
        interop._placements(fs.Layout(m, fs.P(("x", "y")), (6,)))
    with pytest.raises(ValueError, match="explicit layout"):
        interop._placements(
            fs.Layout.explicit(m, [((0,), (4,))] * 4, (4,)),
        )
    with pytest.raises(TypeError, match="x must be a fshard.ShardedArray, got Tensor"):
        interop.to_dtensor(torch.ones(2))
    with pytest.raises(TypeError, match="d must be a DTensor, got Tensor"):
        interop.from_dtensor(torch.ones(2))


# -- ShardedTensor ------------------------------------------------------------------------------


def sharded_tensor_round_trip():
    from torch.distributed._shard import sharded_tensor as st_mod
    from torch.distributed._shard.metadata import ShardMetadata as TShardMetadata
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec

    rank = dist.get_rank()
    mesh = fs.Mesh.create((2,), ("x",))
    full = torch.arange(15.0).reshape(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the converters must not warn
        # chunked (uneven 3, 2) -> ChunkShardingSpec and back to P("x")
        x = fs.shard(full, mesh, fs.P("x"))
        st = interop.to_sharded_tensor(x)
        back = interop.from_sharded_tensor(st, mesh)
    assert isinstance(st.sharding_spec(), ChunkShardingSpec)
    (shard,) = st.local_shards()
    assert shard.metadata.shard_offsets == [3 * rank, 0]
    assert shard.metadata.shard_sizes == [3 - rank, 3]
    assert torch.equal(shard.tensor, x.local)
    assert back.layout == x.layout and torch.equal(back.local, x.local)
    # replicated: only the replica-0 rank holds a shard; back as an explicit layout
    r = fs.shard(full, mesh, fs.P())
    st = interop.to_sharded_tensor(r)
    assert len(st.local_shards()) == (1 if rank == 0 else 0)
    assert len(st.metadata().shards_metadata) == 1
    back = interop.from_sharded_tensor(st, mesh)
    assert back.layout.is_explicit and torch.equal(fs.gather(back), full)
    # an EnumerableShardingSpec ShardedTensor (2-D blocks) -> explicit -> gather, reshard
    spec = EnumerableShardingSpec(
        [
            TShardMetadata([0, 0], [5, 2], "rank:1/cpu"),
            TShardMetadata([0, 2], [5, 1], "rank:0/cpu"),
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = full[:, 2:].clone() if rank == 0 else full[:, :2].clone()
        meta = spec.shards[1 - rank]
        est = st_mod.init_from_local_shards([st_mod.Shard(local, meta)], [5, 3])
    e = interop.from_sharded_tensor(est, mesh)
    assert e.layout.is_explicit and e.layout.shard_metadata(rank).shard_sizes == local.shape
    assert torch.equal(fs.gather(e), full)
    assert torch.equal(fs.gather(fs.reshard(e, fs.P("x"))), full)
    # explicit -> ShardedTensor -> explicit round trip keeps the layout
    e2 = interop.from_sharded_tensor(interop.to_sharded_tensor(e), mesh)
    assert e2.layout == e.layout and torch.equal(e2.local, e.local)
    with pytest.raises(ValueError, match="cannot express pending sums"):
        interop.to_sharded_tensor(fs.shard(full, mesh, fs.P(partial="x")))
    return True


def test_sharded_tensor_round_trip(world2):
    assert world2.run(sharded_tensor_round_trip) == [True, True]
