"""Consistency checks with the DEFAULT settings (issue 26 items 2 and 9): the workers here are
spawned without FSHARD_CHECK_CONSISTENCY (the suite sets "every" for everything else), so what
they catch is what a user gets without opting in."""

import os
import tempfile

import pytest
import torch

import fshard as fs
from fshard import _comm
from fshard.consistency import ConsistencyError
from fshard.launch import World
from fshard.parallel import pipeline

from .test_faults import _DISAGREE, _disagree


@pytest.fixture(scope="module")
def world_default():
    saved = os.environ.pop("FSHARD_CHECK_CONSISTENCY", None)  # unset while workers spawn
    try:
        with World(2, timeout=60, pg_timeout=20) as world:
            yield world
    finally:
        if saved is not None:
            os.environ["FSHARD_CHECK_CONSISTENCY"] = saved


def _mesh():
    return fs.Mesh.create((2,), ("x",))


def _caught(fn, *args):
    try:
        return ("value", fn(torch.distributed.get_rank(), *args))
    except ConsistencyError as e:
        return ("error", str(e))


def _both_raise(world, fn, *args, timeout=30):
    (k0, m0), (k1, m1) = world.run(_caught, fn, *args, timeout=timeout)
    assert k0 == k1 == "error", (k0, m0, k1, m1)
    assert m0 == m1 and "rank 0" in m0 and "rank 1" in m0, (m0, m1)
    return m0


def _skip_one_of_two_gathers(rank):
    mesh = _mesh()
    u, v = torch.full((2,), 1.0 + rank), torch.full((2,), 10.0 + rank)
    fs.lax.psum(torch.ones(2), "x", mesh=mesh)  # agreed: the group's first collective
    if rank == 0:
        fs.lax.all_gather(u, "x", mesh=mesh)  # GATHER-A: skipped on rank 1
    fs.lax.all_gather(v, "x", mesh=mesh)  # GATHER-B
    if rank == 1:
        fs.lax.all_gather(u, "x", mesh=mesh)  # GATHER-C: same shape, so Gloo pairs it
    return fs.gather(fs.shard(torch.arange(4.0), mesh, fs.P("x")))


def test_default_is_on_and_catches_a_skipped_same_shaped_gather(world_default):
    """Same-shaped collectives pair silently on the wire; the call site in the running digest
    names where the ranks parted, at the next boundary (fs.gather)."""
    msg = _both_raise(world_default, _skip_one_of_two_gathers)
    first = msg.splitlines()[1]  # the first collective that differs: rank 0's skipped gather
    assert first.startswith("  collective #2 over ('x',)") and "all_gather" in first, msg
    assert first.count("_skip_one_of_two_gathers") == 2, msg


def _psum_vs_pmax_mid_run(rank):
    mesh = _mesh()
    x = torch.ones(4)
    tx = fs.optim.sgd(0.1)
    params = {"w": fs.shard(x, mesh, fs.P())}
    state = tx.init(params)
    for _ in range(3):
        fs.lax.psum(x, "x", mesh=mesh)
    (fs.lax.psum if rank == 0 else fs.lax.pmax)(x, "x", mesh=mesh)  # no exchange here
    fs.optim.step(tx, params, state, params)  # the boundary of the step


def test_default_catches_a_disagreement_mid_run_at_the_next_boundary(world_default):
    msg = _both_raise(world_default, _psum_vs_pmax_mid_run)
    assert msg.startswith("fshard consistency check failed at fs.optim.step"), msg
    assert "collective #4 over ('x',)" in msg and "'sum'" in msg and "'max'" in msg, msg


def _steps_with_a_late_disagreement(bad_step, steps):
    """``steps`` SGD steps, each with one psum; from ``bad_step`` rank 1 issues pmax. Returns the
    step whose fs.optim.step raised (or None) and the digest exchanges issued per step."""
    from fshard import consistency

    rank, mesh = torch.distributed.get_rank(), _mesh()
    x = torch.ones(4)
    tx = fs.optim.sgd(0.1)
    params = {"w": fs.shard(x, mesh, fs.P())}
    state = tx.init(params)
    exchanges, real = [], consistency._exchange

    def counting(*a):
        exchanges[-1] += 1
        return real(*a)

    consistency._exchange = counting
    try:
        for step in range(1, steps + 1):
            exchanges.append(0)
            bad = rank == 1 and step >= bad_step
            (fs.lax.pmax if bad else fs.lax.psum)(x, "x", mesh=mesh)
            try:
                fs.optim.step(tx, params, state, params)
            except ConsistencyError as e:
                return step, exchanges, str(e)
    finally:
        consistency._exchange = real
    return None, exchanges, ""


def test_default_step_boundary_exchanges_at_1_2_4_8_then_every_interval():
    """fs.optim.step exchanges at its 1st, 2nd, 4th, ... crossing up to
    fs.config.consistency_boundary_interval (64), then every 64th: no other step communicates
    (the per-step cost was one all_reduce's latency, ~4.5% of the TP step of benchmarks/)."""
    saved = os.environ.pop("FSHARD_CHECK_CONSISTENCY", None)
    try:
        with World(2, timeout=60, pg_timeout=20) as world:
            out = world.run(_steps_with_a_late_disagreement, 10**6, 130)
    finally:
        if saved is not None:
            os.environ["FSHARD_CHECK_CONSISTENCY"] = saved
    for raised, exchanges, _ in out:
        assert raised is None
        due = {1, 2, 4, 8, 16, 32, 64, 128}
        # step 1 also exchanges at the group's first collective
        want = [int(s in due) + (s == 1) for s in range(1, 131)]
        assert exchanges == want, exchanges


def test_default_catches_a_late_disagreement_at_the_next_due_step(world_default):
    """Rank 1 switches psum to pmax at step 5: the crossings of steps 5-7 fold into the digest,
    step 8 exchanges and every rank raises naming the first collective that differed."""
    out = world_default.run(_steps_with_a_late_disagreement, 5, 20)
    (s0, _, m0), (s1, _, m1) = out
    assert s0 == s1 == 8, (s0, s1)
    assert m0 == m1 and m0.startswith("fshard consistency check failed at fs.optim.step"), m0
    first = m0.splitlines()[1]
    # numbered on the group: steps 1-4 issue psums #1, #2, #3, #5 (step 3's crossing, not due,
    # is #4); step 5's psum / pmax is #6
    assert first.startswith("  collective #6 over ('x',)"), m0
    assert "'sum'" in first and "'max'" in first, m0


def _checkpoint_paths(rank):
    mesh = _mesh()
    base = os.path.join(tempfile.gettempdir(), f"fshard-consist-{os.getppid()}-{rank}")
    fs.checkpoint.save(base, {"w": fs.shard(torch.ones(4), mesh, fs.P("x")), "step": 1})


def test_default_catches_checkpoint_save_to_different_paths(world_default):
    msg = _both_raise(world_default, _checkpoint_paths)
    assert "checkpoint path" in msg, msg


def _shard_src_wrong_shape(rank):
    mesh = _mesh()
    t = torch.arange(8.0).reshape(4, 2) if rank == 0 else None
    return fs.gather(fs.shard(t, mesh, fs.P("x"), src=0, shape=(4, 2 + rank), dtype=torch.float32))


def _raised(fn, *args):
    try:
        return ("value", fn(torch.distributed.get_rank(), *args))
    except Exception as e:
        return (type(e).__name__, str(e))


def test_default_catches_shard_src_with_a_shape_other_than_the_source(world_default):
    """The shapes are compared before the scatter, in every mode (issue 40 item 4): a
    ValueError naming each rank's shape (was a ConsistencyError in the default mode only)."""
    (k0, m0), (k1, m1) = world_default.run(_raised, _shard_src_wrong_shape)
    assert k0 == k1 == "ValueError" and m0 == m1, (k0, m0, k1, m1)
    assert "rank 0 (src): shape (4, 2)" in m0 and "rank 1: shape (4, 3)" in m0, m0


def _shard_src_mixed(rank, how):
    """Issue 40 item 4: ranks that pass different shapes to fs.shard(src=0). Was: a Gloo
    timeout ('Timed out waiting 5000ms for send operation') where only the others passed
    shape= (rank 0 broadcast its shape, the others went on to the next collective)."""
    mesh = _mesh()
    t = torch.arange(8.0).reshape(4, 2)
    if how == "shape on the others":
        kw = {} if rank == 0 else {"shape": (4, 3), "dtype": torch.float32}
        return fs.gather(fs.shard(t if rank == 0 else None, mesh, fs.P("x"), src=0, **kw))
    if how == "dtype on the others":
        kw = {} if rank == 0 else {"shape": (4, 2), "dtype": torch.float64}
        return fs.gather(fs.shard(t if rank == 0 else None, mesh, fs.P("x"), src=0, **kw))
    return fs.gather(fs.shard(t if rank == 0 else t[:3], mesh, fs.P("x"), src=0))


@pytest.mark.parametrize("how", ["shape on the others", "dtype on the others", "tensors"])
def test_shard_src_checks_the_shapes_before_the_send(world_default, how):
    (k0, m0), (k1, m1) = world_default.run(_raised, _shard_src_mixed, how, timeout=30)
    assert k0 == k1 == "ValueError" and m0 == m1, (k0, m0, k1, m1)
    assert "rank 0 (src): shape (4, 2), torch.float32; rank 1: shape" in m0, m0
    assert "pass None" in m0, m0


def _shard_meta(rank):
    """Issue 40 item 5: a meta input gives a meta ShardedArray (was: 'Cannot copy out of meta
    tensor; no data!' from the consistency hash)."""
    mesh = _mesh()
    x = fs.shard(torch.empty(5, 3, device="meta"), mesh, fs.P("x"))
    full, mine = fs.gather(x), fs.gather(x, dst=0)
    return x.local.device.type, tuple(x.local.shape), full.device.type, tuple(full.shape), mine


def test_shard_of_a_meta_tensor_is_a_meta_sharded_array(world_default):
    out = world_default.run(_raised, _shard_meta)
    assert out[0] == ("value", ("meta", (3, 3), "meta", (5, 3), out[0][1][4])), out
    assert out[1] == ("value", ("meta", (2, 3), "meta", (5, 3), None)), out
    assert out[0][1][4].is_meta and out[0][1][4].shape == (5, 3)


def _per_rank_batch(rank, spec):
    mesh = _mesh()
    local = torch.ones(2 + rank, 3)  # rank 1's loader gave one more row
    if spec == "x":  # the global shape computed per rank from the local batch
        x = fs.from_local(local, mesh, fs.P("x"), shape=(2 * local.shape[0], 3))
    else:  # a "replicated" batch that is not
        x = fs.from_local(local, mesh, fs.P())
    return fs.gather(x.sum(0))


@pytest.mark.parametrize("spec", ["x", "replicated"])
def test_default_catches_mismatched_per_rank_batch_sizes(world_default, spec):
    msg = _both_raise(world_default, _per_rank_batch, spec)
    assert "global shape" in msg and "from_local" in msg, msg


@pytest.mark.parametrize("case", sorted(_DISAGREE))
def test_default_catches_every_disagreement_case(world_default, case):
    """The 12 disagreement cases of test_faults raise on both ranks with default settings."""
    msg = _both_raise(world_default, _disagree_case, case)
    assert _DISAGREE[case] in msg, msg


def _disagree_case(rank, case):
    return _disagree(case, rank)


def _early_return(rank):
    if rank == 0:
        fs.lax.psum(torch.ones(2), "x", mesh=_mesh())


def _psum_gather():
    mesh = _mesh()
    return fs.lax.psum(torch.ones(2), "x", mesh=mesh), fs.gather(
        fs.shard(torch.arange(4.0), mesh, fs.P("x"))
    )


def test_world_runs_after_a_timed_out_run_and_the_message_names_the_cause(world_default):
    with pytest.raises(TimeoutError, match="disagree.*FSHARD_CHECK_CONSISTENCY=every"):
        world_default.run(_caught, _early_return, timeout=4)
    for s, g in world_default.run(_psum_gather):  # fresh workers
        assert torch.equal(s, torch.full((2,), 2.0)) and torch.equal(g, torch.arange(4.0))


def _agreeing_steps(rank, n):
    mesh = _mesh()
    x = fs.shard(torch.arange(8.0), mesh, fs.P("x"))
    interval, fs.config.consistency_interval = fs.config.consistency_interval, 16
    try:
        for _ in range(n):  # more collectives than the interval: periodic exchanges line up
            x = fs.reshard(fs.reshard(x, fs.P()), fs.P("x"))
    finally:
        fs.config.consistency_interval = interval
    return fs.config.consistency_mode(), fs.gather(x)


def test_default_agreeing_ranks_pass_across_periodic_exchanges(world_default):
    (k0, (m0, g0)), (k1, (m1, g1)) = world_default.run(_caught, _agreeing_steps, 70)
    assert k0 == k1 == "value" and m0 == m1 == "default"
    assert torch.equal(g0, torch.arange(8.0)) and torch.equal(g1, g0)


@pytest.fixture(scope="module")
def world_default4():
    saved = os.environ.pop("FSHARD_CHECK_CONSISTENCY", None)
    try:  # 120 s as conftest's worlds: 4 workers starting on a loaded 2-core machine
        with World(4, timeout=120, pg_timeout=20) as world:
            yield world
    finally:
        if saved is not None:
            os.environ["FSHARD_CHECK_CONSISTENCY"] = saved


def _uneven_2d(rank):
    """Issue 40 item 8: the two x groups of a (2, 2) mesh carry blocks of different shapes
    (columns split 2 + 1): correct SPMD, which the world-level check used to flag."""
    mesh = fs.Mesh.create((2, 2), ("x", "y"))
    t = torch.arange(15.0).reshape(5, 3)
    d = fs.reshard(fs.shard(t, mesh, fs.P("y", "x")), fs.P())
    e = fs.shard(t * 2, mesh, fs.P())
    f = fs.reshard(fs.shard(t, mesh, fs.P("x", "y")), fs.P("y", "x"))
    return fs.gather(d), fs.gather(e), fs.gather(f)


def test_default_passes_uneven_blocks_on_a_2d_mesh(world_default4):
    t = torch.arange(15.0).reshape(5, 3)
    for k, v in world_default4.run(_caught, _uneven_2d):
        assert k == "value", v
        assert torch.equal(v[0], t) and torch.equal(v[1], t * 2) and torch.equal(v[2], t)


def _subgroup_disagreement(rank):
    mesh = fs.Mesh.create((2, 2), ("x", "y"))
    fs.lax.psum(torch.ones(2), "x", mesh=mesh)  # agreed: the x groups' first collective
    op = fs.lax.pmax if rank == 2 else fs.lax.psum  # rank 2 parts from rank 0 (its x group)
    op(torch.ones(2), "x", mesh=mesh)
    return fs.gather(fs.shard(torch.arange(4.0), mesh, fs.P()))


def test_default_names_a_subgroup_disagreement_within_its_group(world_default4):
    """A disagreement inside one x group is caught at the mesh-level boundary, names that
    group's ranks and the differing collective (never an empty detail)."""
    out = world_default4.run(_caught, _subgroup_disagreement)
    assert [k for k, _ in out] == ["error"] * 4, out
    msg = out[0][1]
    assert all(m == msg for _, m in out)
    assert "global ranks [0, 2]" in msg and "'sum'" in msg and "'max'" in msg, msg
    assert "over mesh axes ('x',)" in msg, msg


def _per_rank_rows_as_a_plain_tensor(rank, mode):
    """Issue 40 item 2: replicated params, each rank's own rows passed as a plain tensor. Was:
    no error, the gradients not reduced, the 'replicated' params 4e-2 apart after 2 steps."""
    mesh = _mesh()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    params = fs.nn.shard_params(model, mesh, {})  # all replicated
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))  # this rank's rows

    def loss(ps):
        return fs.gather(fs.nn.functional_call(model, ps, (x,))).pow(2).mean()

    with fs.config.consistency(mode):
        for _ in range(2):
            g = fs.grad(loss)(params)
            params = {k: v - 0.1 * g[k] for k, v in params.items()}
    return fs.gather(params["weight"])


@pytest.mark.parametrize("mode", ["default", "every"])
def test_default_catches_per_rank_rows_passed_as_a_plain_tensor(world_default, mode):
    msg = _both_raise(world_default, _per_rank_rows_as_a_plain_tensor, mode)
    assert "input 0 is a plain tensor" in msg and "replicated" in msg, msg
    assert "fs.from_local(x, mesh, fs.P('dp'))" in msg and "content hash" in msg, msg


def _same_rows_as_a_plain_tensor(rank):
    return _per_rank_rows_as_a_plain_tensor(0, "default")


def test_default_passes_a_plain_tensor_that_is_replicated(world_default):
    (k0, w0), (k1, w1) = world_default.run(_caught, _same_rows_as_a_plain_tensor)
    assert k0 == k1 == "value" and torch.equal(w0, w1)


def _random_2d_programs(seed, count):
    """Random uneven layouts on a (2, 2) mesh, resharded twice, with boundaries (``fs.shard``,
    ``fs.from_local``, ``fs.optim``-like ``boundary``) in between: correct SPMD programs."""
    import random

    mesh = fs.Mesh.create((2, 2), ("x", "y"))
    rng = random.Random(seed)
    out = []
    for case in range(count):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 7) for _ in range(ndim))
        t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)

        def spec(ndim=ndim):
            dims = [None] * ndim
            for axis in ("x", "y"):
                if rng.random() < 0.7:
                    d = rng.randrange(ndim)
                    dims[d] = axis if dims[d] is None else (dims[d], axis)
            return fs.P(*dims)

        a, b, c = spec(), spec(), spec()
        try:
            x = fs.reshard(fs.reshard(fs.shard(t, mesh, a), b), c)
            fs.consistency.boundary(mesh, "step")
            y = fs.shard(t * 2, mesh, fs.P())
            ok = torch.equal(fs.gather(x), t) and torch.equal(fs.gather(y), t * 2)
            out.append((case, str(a), str(b), str(c), "ok" if ok else "wrong value"))
        except Exception as e:  # noqa: BLE001 -- reported with the case
            out.append((case, str(a), str(b), str(c), f"{type(e).__name__}: {str(e)[:300]}"))
    return out


def test_default_never_flags_random_correct_programs_on_a_2d_mesh(world_default4):
    """Issue 40 item 8's differential run (102 of 506 (2, 2) programs flagged), in small."""
    out = world_default4.run(_random_2d_programs, 40, 40, timeout=240)
    bad = [r for r in out[0] if r[4] != "ok"]
    assert not bad, bad[:5]
    assert all(o == out[0] for o in out)


def _two_meshes_one_after_the_other():
    """Two meshes over the same 4 ranks with the axes in the other order, used one after the
    other (a composed program: one strategy's mesh, then another's). The ``dp`` groups of the
    first are {0, 2}, {1, 3}, of the second {0, 1}, {2, 3}: rank 0 is the lowest rank of a
    ``dp`` group in both."""
    rank = torch.distributed.get_rank()
    t = torch.arange(8.0).reshape(4, 2)
    out = []
    with fs.config.consistency("default"):
        for names in (("dp", "tp"), ("tp", "dp")):
            mesh = fs.Mesh.create((2, 2), names)
            s = fs.lax.psum(torch.full((2,), 1.0 + rank), "dp", mesh=mesh)
            x = fs.reshard(fs.shard(t, mesh, fs.P("dp", "tp")), fs.P("tp", "dp"))
            fs.consistency.boundary(mesh, "step")  # the mesh's step boundary: digests compared
            out.append((s, fs.gather(x)))
    return out


def test_default_passes_two_meshes_over_the_same_ranks_one_after_the_other(world4):
    """Was: ConsistencyError at the second mesh's boundary ("the 3 ranks of the group (global
    ranks [0, 1, 2]) disagree on collectives issued over ('dp',)"): the ``dp`` groups of both
    meshes whose lowest rank is 0 wrote their digests in one slot of the sub-group exchange."""
    t = torch.arange(8.0).reshape(4, 2)
    want_sums = [[4.0, 6.0, 4.0, 6.0], [3.0, 3.0, 7.0, 7.0]]  # 1 + rank over dp
    for rank, got in enumerate(world4.run(_caught_here, _two_meshes_one_after_the_other)):
        kind, out = got
        assert kind == "value", out
        for m, (s, x) in enumerate(out):
            assert torch.equal(s, torch.full((2,), want_sums[m][rank])), (rank, m, s)
            assert torch.equal(x, t)


def _caught_here(fn):
    try:
        return ("value", fn())
    except ConsistencyError as e:
        return ("error", str(e))


def test_canonical_form_of_a_signature():
    """``_canonical`` (what a check hashes): atoms (str, int, float, bool, None, dtype) as they
    are, containers tagged with their type, tensors by dtype, shape and a content hash; the
    atoms' fast path (a type test before the Mapping ABC's) gives the same form."""
    consistency = fs.consistency
    t = torch.arange(3, dtype=torch.int64)
    obj = {"a": ("x", 1, 2.5, True, None, torch.float32), "b": [t], 3: {"c": ()}}
    want = (
        "dict",
        (
            ("'a'", ("tuple", ("x", 1, 2.5, True, None, torch.float32))),
            ("'b'", ("list", (("tensor", "torch.int64", (3,), consistency._content_hash(t)),))),
            ("3", ("dict", (("'c'", ("tuple", ())),))),
        ),
    )
    assert consistency._canonical(obj) == want


def _specs_spelled_apart(rank, differ):
    """Rank 1 spells its specs as ``P('x', None)`` where rank 0 writes ``P('x')``: one spec, in
    a shard_map's in_specs and out_specs and in a check of a static value (hashed once per
    value, its cache filled by the spelling each rank met first). With ``differ`` rank 1's
    out_spec is another spec (``P(None, 'x')``): that disagreement is still caught."""
    mesh = _mesh()
    spec = fs.P("x") if rank == 0 else fs.P("x", None)
    out = fs.P(None, "x") if differ and rank == 1 else spec
    x = fs.shard(torch.arange(8.0).reshape(4, 2), mesh, fs.P("x"))
    y = fs.shard_map(lambda b: b * 2, mesh, in_specs=(spec,), out_specs=out)(x)
    fs.consistency.check_equal({"layout": fs.consistency.Static(spec)}, mesh, what="a spec")
    return fs.gather(y).tolist()


@pytest.mark.parametrize("differ", [False, True])
def test_default_specs_compare_by_value_not_spelling(world_default, differ):
    got = world_default.run(_caught, _specs_spelled_apart, differ)
    if not differ:
        want = [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0], [12.0, 14.0]]
        assert got == [("value", want)] * 2
    else:
        assert [kind for kind, _ in got] == ["error", "error"], got
        assert "out_specs" in got[0][1] and "P(None, 'x')" in got[1][1], got[1][1]


def test_canonical_form_of_specs_is_their_value():
    """Specs (and per-part specs) that compare equal have one canonical form whatever their
    spelling; specs that differ have different ones."""
    canonical = fs.consistency._canonical
    assert canonical(fs.P("x")) == canonical(fs.P("x", None)) == ("P", (("x",),), ())
    assert canonical(fs.P(partial=("a", "b"))) == canonical(fs.P(partial=("b", "a")))
    assert canonical(fs.P("x")) != canonical(fs.P(None, "x"))
    parts = fs.Parts(fs.P("x"), 0, (2, 2))
    assert canonical(parts) == canonical(fs.Parts(fs.P("x", None), 0, (2, 2)))
    assert canonical(parts) != canonical(fs.Parts(fs.P("x"), 0, (1, 3)))


def _pipeline_plain_inputs(rank, how):
    """fs.parallel.pipeline checks its plain inputs (and its shard_map call) in one exchange
    whose verdict is deferred to the step's first collective (the first stage's input_fn and
    first forward overlap it): one agreeing step, then one where rank 1 passes another
    ``how``: "head" (its plain loss params), "ids" (its token ids); "raises": its ids differ
    and rank 0's input_fn raises an error of its own before any collective (the verdict is
    still taken, on both ranks, where rank 0 leaves). Returns what moved on the wire in the
    failing step (nothing: the verdict comes before the first transfer)."""
    mesh = fs.Mesh.create((2,), ("pp",))
    gen = torch.Generator().manual_seed(5)
    w, emb = torch.randn(2, 3, 3, generator=gen) / 2, torch.randn(6, 3, generator=gen)
    ids, h = torch.randint(0, 6, (4, 2), generator=gen), torch.randn(3, generator=gen)
    tgt = torch.randn(4, 2, generator=gen)
    bad = [False]

    def input_fn(e, ids):
        if bad[0] and how == "raises" and rank == 0:
            raise ValueError("rank 0's own error")
        return torch.nn.functional.embedding(ids, e)

    def loss(w, e, h, ids):
        return pipeline(
            lambda w, x: torch.tanh(x @ w), w, ids, mesh,
            loss_fn=lambda h, y, t: ((y @ h - t) ** 2).sum(), loss_params=h, targets=tgt,
            input_fn=input_fn, input_params=e, activation=torch.empty(2, 3, device="meta"),
            schedule="1f1b",
        )  # fmt: skip

    fs.value_and_grad(loss, argnums=(0, 1, 2))(w, emb, h, ids)
    bad[0] = True
    if rank == 1:
        h, ids = (h + 1, ids) if how == "head" else (h, (ids + 1) % 6)
    moved = []
    real = _comm._point_to_point

    def counted(ops, g, *tag):
        moved.extend(ops)
        return real(ops, g, *tag)

    _comm._point_to_point = counted
    try:
        fs.value_and_grad(loss, argnums=(0, 1, 2))(w, emb, h, ids)
    except ConsistencyError as e:
        raise ConsistencyError(f"{e}\nmoved: {len(moved)}") from None
    finally:
        _comm._point_to_point = real
    return "no error"


@pytest.mark.parametrize(
    "how,leaf", [("head", "loss_params leaf 0"), ("ids", "microbatches leaf 0"), ("raises", "")]
)
def test_default_pipeline_plain_inputs_that_differ_raise_before_any_transfer(
    world_default, how, leaf
):
    message = _both_raise(world_default, _pipeline_plain_inputs, how)
    assert "fs.parallel.pipeline's tensors" in message and leaf in message, message
    assert message.endswith("moved: 0"), message
