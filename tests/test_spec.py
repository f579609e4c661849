"""Layout math against an independent brute-force oracle (no process group needed)."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard as fs
from fshard.spec import chunk_bounds, chunk_index

MESHES = [
    ((1,), ("x",)),
    ((2,), ("x",)),
    ((4,), ("x",)),
    ((8,), ("x",)),
    ((2, 2), ("x", "y")),
    ((2, 4), ("x", "y")),
    ((4, 2), ("x", "y")),
    ((3, 2), ("x", "y")),
    ((2, 2, 2), ("x", "y", "z")),
    ((1, 2, 3), ("x", "y", "z")),
]


def brute_force_block(shape, mesh_shape, names, dim_axes, rank):
    """Assign every element index to a chunk by element (not by bounds) and read off the block."""
    coords = np.unravel_index(rank, mesh_shape)
    offsets, sizes = [], []
    for d, n in enumerate(shape):
        axes = dim_axes[d] if d < len(dim_axes) else ()
        k, j = 1, 0
        for a in axes:
            i = names.index(a)
            k *= mesh_shape[i]
            j = j * mesh_shape[i] + int(coords[i])
        c = -(-n // k) if n else 0
        owner = [i // c if c else 0 for i in range(n)]
        mine = [i for i in range(n) if owner[i] == j]
        sizes.append(len(mine))
        offsets.append(sum(1 for i in range(n) if owner[i] < j))
    return tuple(offsets), tuple(sizes)


@st.composite
def layouts(draw):
    mesh_shape, names = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=ndim, max_size=ndim)))
    free = list(names)
    draw(st.randoms()).shuffle(free)
    dim_axes = []
    for _ in range(ndim):
        k = draw(st.integers(0, min(2, len(free))))
        dim_axes.append(tuple(free[:k]))
        free = free[k:]
    n_partial = draw(st.integers(0, len(free)))
    partial = tuple(free[:n_partial])
    return mesh_shape, names, shape, tuple(dim_axes), partial


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_layout_matches_brute_force(case):
    mesh_shape, names, shape, dim_axes, partial = case
    mesh = fs.Mesh.abstract(mesh_shape, names)
    spec = fs.P(*[a if a else None for a in dim_axes], partial=partial)
    layout = fs.Layout(mesh, spec, shape)
    metas = layout.shards_metadata()
    assert len(metas) == int(np.prod(mesh_shape))
    for rank, meta in enumerate(metas):
        assert (meta.shard_offsets, meta.shard_sizes) == brute_force_block(
            shape, mesh_shape, names, dim_axes, rank
        )
        assert meta.placement == f"rank:{rank}/cpu"
    # Every element is held by exactly (number of replicas) ranks: blocks tile the tensor.
    replicas = int(
        np.prod([mesh_shape[names.index(a)] for a in names if a not in layout.sharded_axes])
    )
    count = torch.zeros(shape, dtype=torch.int64)
    for meta in metas:
        count[meta.slices()] += 1
    assert bool((count == replicas).all())


def test_jax_reference_cases():
    """Cases recorded from JAX/GSPMD (docs/peers.md): flat ceil-div over the product."""
    m = fs.Mesh.abstract((2, 4), ("x", "y"))
    lay = fs.Layout(m, fs.P(("x", "y")), (10,))
    assert [s.shard_sizes[0] for s in lay.shards_metadata()] == [2, 2, 2, 2, 2, 0, 0, 0]
    lay = fs.Layout(m, fs.P(("y", "x")), (8,))
    assert lay.shard_metadata(1).shard_offsets == (2,)  # x=0, y=1 holds rows 2:3
    lay = fs.Layout(fs.Mesh.abstract((4,), ("x",)), fs.P("x"), (10, 6))
    assert [s.shard_offsets[0] for s in lay.shards_metadata()] == [0, 3, 6, 9]
    assert [s.shard_sizes for s in lay.shards_metadata()] == [(3, 6)] * 3 + [(1, 6)]
    lay = fs.Layout(fs.Mesh.abstract((3, 2), ("x", "y")), fs.P(("x", "y")), (7,))
    assert [s.shard_sizes[0] for s in lay.shards_metadata()] == [2, 2, 2, 1, 0, 0]


@pytest.mark.parametrize("n,k", [(5, 2), (4, 3), (1, 2), (2, 4), (10, 4), (0, 3), (7, 7)])
def test_single_axis_equals_chunk_sharding_spec(n, k):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(k)])
    seed = spec.build_metadata(torch.Size([n, 3]), None).shards_metadata
    ours = fs.Layout(fs.Mesh.abstract((k,), ("x",)), fs.P("x"), (n, 3)).shards_metadata()
    for a, b in zip(seed, ours):
        assert tuple(a.shard_sizes) == b.shard_sizes
        if b.numel:  # the seed leaves an empty chunk's offset unclipped (past the end); we clip
            assert tuple(a.shard_offsets) == b.shard_offsets
        assert str(a.placement) == str(b.to_torch().placement)


def test_chunk_bounds_empty_tail():
    assert [chunk_bounds(2, 4, j) for j in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_spec_normalisation_and_hashing():
    assert fs.P("x") == fs.P("x", None) == fs.P(("x",))
    assert hash(fs.P("x")) == hash(fs.P("x", None, None))
    assert fs.P(partial="x") == fs.P(partial=("x",))
    assert fs.P("x") != fs.P(None, "x")
    m = fs.Mesh.abstract((2,), ("x",))
    a, b = fs.Layout(m, fs.P("x"), (4, 2)), fs.Layout(m, fs.P("x", None), (4, 2))
    assert a == b and hash(a) == hash(b)
    assert a != fs.Layout(m, fs.P("x"), (4, 2), torch.float64)


@pytest.mark.parametrize("first", ["user's", "planner's"])
def test_a_layouts_spec_prints_alike_whatever_made_it_first(first):
    """Layouts are cached by value (``P(None) == P()``): the printed spec is canonical, not the
    spelling of whichever call made the layout first (a doctest once printed ``P(None)`` after
    another test's layout, ``P()`` alone; keyed by spelling, the planner's ``P((), ())``)."""
    from fshard.spec import _layout

    # a mesh and shapes no other test builds, so this test makes each layout first
    m = fs.Mesh.abstract((2, 3), ("spec_order_a", "spec_order_b"))
    shape = (7, 5, 3) if first == "user's" else (7, 5, 2)
    spellings = {
        "user's": [fs.P(None), fs.P("spec_order_b", None), fs.P(partial=("spec_order_b", "spec_order_a"))],
        "planner's": [fs.P((), ()), fs.P(("spec_order_b",), (), ()), fs.P(partial=("spec_order_a", "spec_order_b"))],
    }  # fmt: skip
    orders = [spellings[first], spellings["planner's" if first == "user's" else "user's"]]
    want = ["P()", "P('spec_order_b')", "P(partial=('spec_order_a', 'spec_order_b'))"]
    for specs in orders:
        for spec, printed in zip(specs, want):
            for lay in (
                _layout(m, spec, shape, torch.float32),
                fs.Layout(m, spec, shape),
                fs.Layout(m, fs.P("spec_order_a"), shape).with_spec(spec),
            ):
                assert repr(lay.spec) == printed, (first, spec, lay)
    parts = fs.Layout.of(m, fs.Parts(fs.P(("spec_order_a",), None), 0, (4, 3)), shape)
    assert repr(parts.spec) == "Parts(P('spec_order_a'), dim=0, sizes=(4, 3))"
    assert repr(fs.P("spec_order_b", None)) == "P('spec_order_b', None)"  # a P prints as written


def test_scalar_and_zero_size():
    m = fs.Mesh.abstract((2, 2), ("x", "y"))
    assert fs.Layout(m, fs.P(), ()).shard_metadata(3).shard_sizes == ()
    lay = fs.Layout(m, fs.P("x", "y"), (0, 3))
    assert [s.shard_sizes for s in lay.shards_metadata()] == [(0, 2), (0, 1), (0, 2), (0, 1)]


def test_shard_metadata_to_torch():
    meta = fs.Layout(fs.Mesh.abstract((2,), ("x",)), fs.P("x"), (5, 2)).shard_metadata(1)
    t = meta.to_torch()
    assert list(t.shard_offsets) == [3, 0] and list(t.shard_sizes) == [2, 2]
    assert t.placement.rank() == 1 and str(t.placement.device()) == "cpu"


def test_mesh_coords_row_major():
    m = fs.Mesh.abstract((2, 3), ("a", "b"))
    for r in range(6):
        assert m.coords(r) == tuple(int(c) for c in np.unravel_index(r, (2, 3)))
        assert m.rank_at(m.coords(r)) == r
    assert m.size("b") == 3 and m.size(("a", "b")) == 6
    assert m.axis_index(("b", "a"), rank=4) == 1 * 2 + 1


def test_plan_is_pure_and_cached():
    m = fs.Mesh.abstract((4,), ("x",))
    lay = fs.Layout(m, fs.P("x"), (8, 8))
    steps = fs.plan(lay, fs.P(None, "x"))
    assert [s.op.name for s in steps] == ["all_to_all"]
    assert steps[0].nbytes == 2 * 8 * 4  # this rank's local bytes
    assert fs.plan(lay, fs.P("x")) == []
    ops = {
        fs.P(): ["all_gather"],
        fs.P(None, "x"): ["all_to_all"],
    }
    for dst, want in ops.items():
        assert [s.op.name for s in fs.plan(lay, dst)] == want
    part = lay.with_spec(fs.P(partial="x"))
    assert [s.op.name for s in fs.plan(part, fs.P())] == ["all_reduce"]
    assert [s.op.name for s in fs.plan(part, fs.P("x"))] == ["reduce_scatter"]
    assert [s.op.name for s in fs.plan(lay.with_spec(fs.P()), fs.P("x"))] == ["slice"]
    assert [s.op.name for s in fs.plan(lay.with_spec(fs.P()), fs.P(partial="x"))] == ["zero"]
    m2 = fs.Mesh.abstract((2, 2), ("x", "y"))
    lay2 = fs.Layout(m2, fs.P("x", "y"), (4, 4))
    assert [s.op.name for s in fs.plan(lay2, fs.P("y", "x"))] == ["ppermute"]


def test_layout_id_is_shared_by_equal_layouts_only():
    m = fs.Mesh.abstract((2,), ("x",))
    a, b = fs.Layout(m, fs.P("x"), (4, 4)), fs.Layout(m, fs.P("x"), (4, 4))
    assert a is not b and a._id is b._id
    others = [
        fs.Layout(m, fs.P(None, "x"), (4, 4)),
        fs.Layout(m, fs.P("x"), (4, 5)),
        fs.Layout(m, fs.P("x"), (4, 4), torch.float64),
        fs.Layout(fs.Mesh.abstract((2,), ("y",)), fs.P("y"), (4, 4)),
        fs.Layout.explicit(m, [((0, 0), (2, 4)), ((2, 0), (2, 4))], (4, 4)),
    ]
    assert len({id(o._id) for o in others} | {id(a._id)}) == len(others) + 1
    # a token, not a number: it can never equal a static argument in a dispatch key
    assert a._id != 0 and a._id != 1 and a._id is not True


def test_plan_ignores_size_one_axes():
    m = fs.Mesh.abstract((1, 2), ("dp", "tp"))
    lay = fs.Layout(m, fs.P("tp"), (4, 6))
    # same local blocks on every rank: nothing to run
    for dst in [fs.P(("tp", "dp")), fs.P(("dp", "tp")), fs.P("tp", "dp"), fs.P("tp", partial="dp")]:
        assert fs.plan(lay, dst) == [], dst
        for r in m.ranks:
            assert lay.local_shape(r) == lay.with_spec(dst).local_shape(r)
    assert fs.plan(lay.with_spec(fs.P(partial="dp")), fs.P()) == []
    # a change on the size-2 axis still moves data
    assert [s.op.name for s in fs.plan(lay, fs.P(None, "tp"))] == ["all_to_all"]
    assert [s.op.name for s in fs.plan(lay.with_spec(fs.P()), fs.P(partial="tp"))] == ["zero"]


def test_every_2x2_plan_reaches_its_target():
    m = fs.Mesh.abstract((2, 2), ("x", "y"))
    axes = [None, "x", "y", ("x", "y"), ("y", "x")]
    specs = []
    for d0, d1 in itertools.product(axes, axes):
        try:
            specs.append(fs.P(d0, d1))
        except ValueError:
            pass
    specs += [fs.P(partial="x"), fs.P("y", partial="x"), fs.P(partial=("x", "y"))]
    for a, b in itertools.product(specs, specs):
        steps = fs.plan(fs.Layout(m, a, (5, 7)), b)
        if steps:
            assert steps[0].src.spec == a and steps[-1].dst.spec == b
            for s, t in zip(steps, steps[1:]):
                assert s.dst == t.src


def test_nested_splits_move_only_their_inner_axes():
    """A dim split over ("cp", "tp") (sequence parallelism inside a cp chunk) nests in its
    split over "cp" when the dim is even: gathering, slicing or reduce-scattering tp works
    inside the cp blocks (the bytes of tp alone); where the blocks do not nest (6 over 2 x 2:
    flat chunks 2, 2, 2, 0; nested 2, 1, 2, 1) the plan goes through the whole dim."""
    m = fs.Mesh.abstract((2, 2), ("cp", "tp"))

    def moves(a, b, n=8):
        return [(s.op.name, s.axes, s.nbytes) for s in fs.plan(fs.Layout(m, a, (2, n, 4)), b)]

    seq, both = fs.P(None, "cp"), fs.P(None, ("cp", "tp"))
    assert moves(both, seq) == [("all_gather", ("tp",), 2 * 2 * 4 * 4)]
    assert moves(seq, both) == [("slice", ("tp",), 0)]
    assert moves(fs.P(None, "cp", partial="tp"), both) == [
        ("reduce_scatter", ("tp",), 2 * 4 * 4 * 4)
    ]
    assert moves(both, seq, n=6) == [
        ("all_gather", ("cp", "tp"), 2 * 2 * 4 * 4),
        ("slice", ("cp",), 0),
    ]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_chunk_index_is_the_one_mixed_radix(mesh_shape, names):
    """spec.chunk_index (which layouts, Mesh.axis_index and shard_map's size check all use)
    equals numpy's row-major ravel of the coordinates on the axes, for every rank and every
    ordered tuple of distinct axes; ranks on a non-identity rank order included."""
    ranks = list(reversed(range(int(np.prod(mesh_shape)))))
    m = fs.Mesh(mesh_shape, names, ranks)
    for k in range(len(names) + 1):
        for axes in itertools.permutations(names, k):
            dims = [names.index(a) for a in axes]
            sizes = tuple(mesh_shape[d] for d in dims)
            for pos, rank in enumerate(ranks):
                coords = np.unravel_index(pos, mesh_shape)
                want = int(np.ravel_multi_index([coords[d] for d in dims], sizes)) if axes else 0
                assert chunk_index(m, axes, m.coords(rank)) == (want, int(np.prod(sizes))), axes
                assert m.axis_index(axes, rank) == want


def test_layout_tokens_are_never_reused():
    """A layout built while dynamo traces (shard_map's outputs) is interned by the trace's
    replay, which can leave a token in LAYOUT_OF_ID that _IDS lacks; a later layout must not
    get that token (its plans would be made for the other layout: test_compile.py's order
    showed an IndexError planning x[..., 4:] on a 0-d stand-in)."""
    from fshard import spec

    m = fs.Mesh.abstract((3,), ("tokens",))
    a = fs.Layout(m, fs.P("tokens"), (6, 1))
    stray = f"\0layout{len(spec.LAYOUT_OF_ID)}"
    spec.LAYOUT_OF_ID[stray] = a  # what such a replay leaves
    try:
        b = fs.Layout(m, fs.P("tokens"), (6, 2))
        assert b._id != stray and spec.LAYOUT_OF_ID[b._id] is b
    finally:
        del spec.LAYOUT_OF_ID[stray]
