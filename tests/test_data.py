"""fs.data: per-rank loader batches as one global value (issue 29 item 4), against the dense
batch the sampler's indices select, on a 1-D dp mesh and a dp x tp mesh."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import fshard as fs

N, F = 11, 3


def _dataset():
    x = torch.arange(N * F, dtype=torch.float32).reshape(N, F)
    return TensorDataset(x, torch.arange(N))


def loader_rank_fn(shape, names):
    mesh = fs.Mesh.create(shape, names)
    ds = _dataset()
    sampler = fs.data.sampler(ds, mesh, "dp", shuffle=True, seed=3)
    sampler.set_epoch(1)
    steps = []
    for x, y in DataLoader(ds, batch_size=2, sampler=sampler):
        with fs.debug.comm_log() as log:
            xs, ys = fs.data.batch(x, mesh, "dp"), fs.data.batch(y, mesh, "dp")
        assert [r.op for r in log] == ["size_exchange"] * 2 * (mesh.size(mesh.axis_names) > 1)
        steps.append((xs.spec, xs.shape, fs.gather(xs), fs.gather(ys)))
    return list(sampler), steps


@pytest.mark.parametrize("shape, names", [((2,), ("dp",)), ((1, 2), ("dp", "tp"))])
def test_loader_batches_form_the_global_batch(world2, shape, names):
    ds = _dataset()
    dp = shape[0]
    indices, steps = zip(*world2.run(loader_rank_fn, shape, names))
    ref = torch.utils.data.DistributedSampler(ds, num_replicas=dp, rank=0, shuffle=True, seed=3)
    ref.set_epoch(1)
    assert indices[0] == list(ref)  # torch's sampler, replica = position along dp
    if dp == 1:
        assert indices[0] == indices[1]  # tp ranks read the same rows
    for s0, s1 in zip(*steps):
        assert s0[0] == s1[0] and s0[1] == s1[1]
        assert torch.equal(s0[2], s1[2]) and torch.equal(s0[3], s1[3])
    # the global batch of each step is every dp position's rows in position order
    per_pos = [indices[r] for r in range(dp)] if dp > 1 else [indices[0]]
    for k, (spec, gshape, x, y) in enumerate(steps[0]):
        rows = [i for pos in per_pos for i in pos[2 * k : 2 * k + 2]]
        assert spec == fs.P("dp") and gshape == (len(rows), F)
        assert torch.equal(x, ds.tensors[0][rows]) and torch.equal(y, ds.tensors[1][rows])


def mismatched_rank_fn(kind):
    mesh = fs.Mesh.create((2,), ("dp",))
    rows = {"rows": 2 + mesh.rank, "features": 2, "dtype": 2}[kind]
    feats = 3 + mesh.rank if kind == "features" else 3
    dtype = torch.float64 if kind == "dtype" and mesh.rank else torch.float32
    try:
        fs.data.batch(torch.zeros(rows, feats, dtype=dtype), mesh, "dp")
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("rows", "rows per rank [2, 3] (global 5) do not follow"),
        ("features", "rank 0: torch.float32 (2, 3), rank 1: torch.float32 (2, 4)"),
        ("dtype", "rank 1: torch.float64 (2, 3)"),
    ],
)
def test_mismatched_blocks_are_refused_on_every_rank(world2, kind, needle):
    """The global shape is checked across ranks, never inferred per rank: a rank that reads
    another row count, feature size or dtype is named, the same error on every rank."""
    msgs = world2.run(mismatched_rank_fn, kind)
    assert msgs[0] == msgs[1] and needle in msgs[0], msgs[0]


def test_argument_errors():
    mesh = fs.Mesh.abstract((2,), ("dp",))
    with pytest.raises(ValueError, match="axes='tp' must name axes"):
        fs.data.sampler(range(4), mesh, "tp")
    with pytest.raises(TypeError, match="mesh must be a fshard.Mesh"):
        fs.data.batch(torch.ones(2), "dp")
