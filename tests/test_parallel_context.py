"""Context parallelism (issue 23 item 2): ``fs.parallel.ring_attention`` and
``ulysses_attention`` over a sequence-split ``cp`` axis equal dense
``F.scaled_dot_product_attention`` (values and gradients, through ``torch.func.grad``, plain
``.backward()``, ``vmap`` and ``fs.value_and_grad``), causal with the load-balanced layout or
not, with a key padding mask, grouped-query heads; an HF Llama runs unedited under cp=2 through
``fs.parallel.context_parallel_loss`` (loss and gradients equal dense, 3 AdamW steps)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard.parallel import context as C

RTOL, ATOL = 2e-5, 2e-6
SPEC = fs.P(None, None, "cp")


def _close(got, want, what):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL + RTOL * scale, msg=what)


# -- layout and the ring's block arithmetic (one process) -----------------------------------


def test_load_balance_layout():
    x = torch.arange(12)
    # 6 chunks of 2: rank 0 holds chunks 0 and 5, rank 1 chunks 1 and 4, rank 2 chunks 2 and 3
    assert C.load_balance(x, 3, 0).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert torch.equal(C.load_balance_inverse(C.load_balance(x, 3, 0), 3, 0), x)
    t = torch.randn(2, 3, 8, 4)
    assert torch.equal(C.load_balance_inverse(C.load_balance(t, 2), 2), t)
    assert torch.equal(C.load_balance(t, 1), t)
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        C.load_balance(torch.arange(6), 2, 0)
    with pytest.raises(ValueError, match="cp must be a positive int"):
        C.load_balance(x, 0, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_ring_plan_covers_the_causal_pairs_once(cp, balanced):
    """Over the ring's steps each rank attends exactly the (query chunk, key chunk) pairs of
    dense causal attention (key chunk <= query chunk), each once, masked only on the diagonal;
    load-balanced, every rank does the same work."""
    work = []
    for i in range(cp):
        mine = (i, 2 * cp - 1 - i) if balanced else (i,)
        seen = []
        for _src, groups in C._ring_plan(cp, i, True, balanced):
            for g in groups:
                assert g.qchunks == mine[g.q0 : g.q1]
                pairs = [(qc, kc) for qc in g.qchunks for kc in g.kchunks]
                assert g.diagonal == any(qc == kc for qc, kc in pairs)
                assert all(kc <= qc for qc, kc in pairs)
                seen += pairs
        theirs = [c for r in range(cp) for c in ((r, 2 * cp - 1 - r) if balanced else (r,))]
        want = [(qc, kc) for qc in mine for kc in theirs if kc <= qc]
        assert sorted(seen) == sorted(want)
        work.append(len(seen))
    if balanced:
        assert len(set(work)) == 1, work
    full = C._ring_plan(cp, 0, False, balanced)
    assert all(len(groups) == 1 for _, groups in full)  # non-causal: one unmasked block a step


# -- attention against dense sdpa -----------------------------------------------------------


def _qkv(b=2, h=4, hkv=2, s=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, s - 5 :] = False  # right padding: every query keeps a key
    keep[-1, s // 3 :] = False
    return q, k, v, keep


def _dense(q, k, v, keep, causal, pad):
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = q.shape[-2]
    mask = keep[..., None, None, :] if pad else torch.ones(s, s, dtype=torch.bool)
    if causal:
        mask = mask & torch.ones(s, s, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _check_backward(attention, qkv, keep, want, what):
    """``.backward()`` of the objective through ``attention`` gives the gradients ``want``."""
    leaves = [t.clone().requires_grad_() for t in qkv]
    _objective(attention(*leaves, keep)).backward()
    for name, t, g in zip("qkv", leaves, want):
        _close(t.grad, g, f"{what}: .backward() grad {name}")


def _objective(o):
    return (o * torch.cos(o)).sum()


def _sharded(which, cp, causal, pad, balanced, mesh):
    attend = C.ring_attention if which == "ring" else C.ulysses_attention

    def body(q, k, v, keep):
        mask = keep if pad else None
        return attend(q, k, v, "cp", causal=causal, padding_mask=mask, load_balanced=balanced)

    run = fs.shard_map(body, mesh, (SPEC, SPEC, SPEC, fs.P(None, "cp")), SPEC)
    lb = (lambda t, d: C.load_balance(t, cp, d)) if balanced else (lambda t, d: t)
    ilb = (lambda t: C.load_balance_inverse(t, cp)) if balanced else (lambda t: t)

    def attention(q, k, v, keep):
        return ilb(fs.gather(run(lb(q, -2), lb(k, -2), lb(v, -2), lb(keep, -1))))

    return attention


def dense_equal_rank_fn(which, cp, cases):
    mesh = fs.Mesh.create((cp,), ("cp",))
    for causal, pad, gqa, balanced in cases:
        what = f"{which} causal={causal} pad={pad} gqa={gqa} balanced={balanced}"
        q, k, v, keep = _qkv(hkv=2 if gqa else 4, s=8 * cp)
        attention = _sharded(which, cp, causal, pad, balanced, mesh)
        want = _dense(q, k, v, keep, causal, pad)

        def dense_loss(q, k, v, keep=keep, causal=causal, pad=pad):
            return _objective(_dense(q, k, v, keep, causal, pad))

        def loss(q, k, v, keep=keep, attention=attention):
            return _objective(attention(q, k, v, keep))

        dgrads = torch.func.grad(dense_loss, (0, 1, 2))(q, k, v)
        _close(attention(q, k, v, keep), want, f"{what}: value")
        # torch.func.grad: ring attention's transfers stay asynchronous (plain data sent)
        grads = torch.func.grad(loss, (0, 1, 2))(q, k, v)
        for name, g, dg in zip("qkv", grads, dgrads):
            _close(g, dg, f"{what}: grad {name}")
        _check_backward(attention, (q, k, v), keep, dgrads, what)  # plain autograd
    return True


CASES = list(itertools.product([True, False], [True, False], [True, False], [True, False]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["ring", "ulysses"])
def test_attention_equals_dense_sdpa_two_ranks(world2, which):
    assert world2.run(dense_equal_rank_fn, which, 2, CASES) == [True, True]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["ring", "ulysses"])
def test_attention_equals_dense_sdpa_four_ranks(world4, which):
    cases = [(True, True, True, True), (True, False, False, False)]
    assert world4.run(dense_equal_rank_fn, which, 4, cases) == [True] * 4


def transforms_rank_fn(which):
    """``vmap`` over a leading batch of examples (ring attention's ppermute then runs
    synchronously, batched), ``vmap(grad)`` per-example gradients, and ``fs.value_and_grad``
    over ShardedArray inputs."""
    mesh = fs.Mesh.create((2,), ("cp",))
    q, k, v, keep = _qkv()
    attention = _sharded(which, 2, True, True, True, mesh)
    dense = lambda q, k, v: _dense(q, k, v, keep, True, True)  # noqa: E731
    examples = [t[:, None] for t in (q, k, v, keep)]  # a batch of 2 examples of batch 1
    got = torch.func.vmap(attention)(*examples)
    want = torch.func.vmap(lambda q, k, v, m: _dense(q, k, v, m, True, True))(*examples)
    _close(got, want, f"{which}: vmap value")

    def per_example(fn):
        def loss(q, k, v):
            return _objective(fn(q[None], k[None], v[None]))

        return torch.func.vmap(torch.func.grad(loss, (0, 1, 2)))(q, k, v)

    def sharded_one(q, k, v):
        return _sharded(which, 2, True, True, True, mesh)(q, k, v, keep[:1])

    got = per_example(sharded_one)
    want = per_example(lambda q, k, v: _dense(q, k, v, keep[:1], True, True))
    for name, g, w in zip("qkv", got, want):
        _close(g, w, f"{which}: vmap(grad) {name}")

    # fs.value_and_grad over inputs already laid out on the sequence
    attend = C.ring_attention if which == "ring" else C.ulysses_attention
    lbq, lbk, lbv = (C.load_balance(t, 2) for t in (q, k, v))
    lbkeep = C.load_balance(keep, 2, -1)

    def body(q, k, v, m):
        return fs.lax.psum(_objective(attend(q, k, v, "cp", causal=True, padding_mask=m)), "cp")

    run = fs.shard_map(body, mesh, (SPEC, SPEC, SPEC, fs.P(None, "cp")), fs.P())
    xs = [fs.shard(t, mesh, SPEC) for t in (lbq, lbk, lbv)]
    loss, grads = fs.value_and_grad(
        lambda q, k, v: fs.gather(run(q, k, v, lbkeep)), argnums=(0, 1, 2)
    )(*xs)
    dloss, dgrads = torch.func.grad_and_value(
        lambda q, k, v: _objective(dense(q, k, v)), (0, 1, 2)
    )(q, k, v)[::-1]
    _close(loss, dloss, f"{which}: value_and_grad loss")
    for name, g, x, dg in zip("qkv", grads, xs, dgrads):
        assert g.layout == x.layout, (name, g.layout)
        _close(C.load_balance_inverse(fs.gather(g), 2), dg, f"{which}: value_and_grad {name}")
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["ring", "ulysses"])
def test_attention_under_vmap_and_value_and_grad(world2, which):
    assert world2.run(transforms_rank_fn, which) == [True, True]


def second_derivative_rank_fn():
    """A second derivative through ring attention around a ``torch.func`` level:
    ``fs.value_and_grad`` of a function of ``fs.value_and_grad``'s gradient (the inner one runs
    as ``torch.func.grad``: its argument takes part in the outer graph). Was: the ring's
    Function ran its backward under the level without autograd (overlapped transfers), so the
    outer derivative read the inner gradient as a constant, silently (the worst difference was
    the whole dense gradient, 4.18). Now the ring runs op by op there, equal to dense."""
    mesh = fs.Mesh.create((2,), ("cp",))
    q, k, v, _ = _qkv()
    lbq, lbk, lbv = (C.load_balance(t, 2) for t in (q, k, v))

    def body(q, k, v):
        return fs.lax.psum(_objective(C.ring_attention(q, k, v, "cp", causal=True)), "cp")

    run = fs.shard_map(body, mesh, (SPEC, SPEC, SPEC), fs.P())
    ks, vs = (fs.shard(t, mesh, SPEC) for t in (lbk, lbv))

    def penalty(q):  # the squared gradient of the objective
        return (fs.gather(fs.value_and_grad(lambda q: fs.gather(run(q, ks, vs)))(q)[1]) ** 2).sum()

    _, g = fs.value_and_grad(penalty)(fs.shard(lbq, mesh, SPEC))

    def dense(q):  # attention by its formula: sdpa's CPU backward has no derivative
        kk, vv = (t.repeat_interleave(q.shape[-3] // k.shape[-3], -3) for t in (k, v))
        s = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
        causal = torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).tril()
        return _objective(s.masked_fill(~causal, float("-inf")).softmax(-1) @ vv)

    want = torch.func.grad(lambda q: (torch.func.grad(dense)(q) ** 2).sum())(q)
    _close(C.load_balance_inverse(fs.gather(g), 2), want, "second derivative around torch.func")
    return True


@pytest.mark.timeout(120)
def test_ring_attention_second_derivative_around_torch_func(world2):
    assert world2.run(second_derivative_rank_fn) == [True, True]


def global_view_rank_fn():
    """``fs.parallel.attention`` in the global view under cp (as ``parallelize`` runs a
    pipelined stage): ShardedArrays over a (cp, tp) mesh, heads over tp, the sequence (in the
    load-balanced order) over cp, gathered (a layer before gathered it), or over cp and tp
    (the body's block would be half the rank's cp chunk), inside a shard_map over cp with the
    chunk split over tp, and with one kv head split over tp: the attention splits the sequence
    over cp alone (whole in the chunk) and keeps only whole, evenly paired heads split; the
    values (and gradients) equal dense causal sdpa's for each layout."""
    mesh = fs.Mesh.create((2, 2), ("cp", "tp"))
    q, k, v, _ = _qkv(hkv=4)
    want = _dense(q, k, v, None, True, False)
    dgrads = torch.func.grad(lambda q, k, v: _objective(_dense(q, k, v, None, True, False)),
                             (0, 1, 2))(q, k, v)  # fmt: skip
    lb = [C.load_balance(t, 2) for t in (q, k, v)]
    seen = []
    for spec in (fs.P(None, "tp", "cp"), fs.P(None, "tp"), fs.P(None, None, ("cp", "tp"))):
        xs = [fs.shard(t, mesh, spec) for t in lb]

        def loss(q, k, v):
            with C._attention_of(torch.nn.Module(), mesh, "cp", C.ring_attention):
                out = fs.parallel.attention(q, k, v, is_causal=True)
            seen.append(out.spec)
            return _objective(C.load_balance_inverse(fs.gather(out), 2))

        value, grads = fs.value_and_grad(loss, argnums=(0, 1, 2))(*xs)
        _close(value, _objective(want), f"{spec}: value")
        for name, g, x, dg in zip("qkv", grads, xs, dgrads):
            assert g.layout == x.layout, (spec, name, g.layout)
            _close(C.load_balance_inverse(fs.gather(g), 2), dg, f"{spec}: grad {name}")

    # inside a shard_map over cp (parallelize without pp): each rank's chunk, its sequence split
    # over tp by a layer before; the attention needs the chunk whole
    def body(q, k, v):
        q, k, v = (fs.reshard(t, fs.P(None, None, "tp")) for t in (q, k, v))
        with C._attention_of(torch.nn.Module(), mesh, "cp", C.ring_attention):
            out = fs.parallel.attention(q, k, v, is_causal=True)
        seen.append(out.spec)
        return out

    chunk = fs.P(None, None, "cp")
    run = fs.shard_map(body, mesh, (chunk,) * 3, chunk, axis_names={"cp"})
    out = run(*(fs.shard(t, mesh, chunk) for t in lb))
    _close(C.load_balance_inverse(fs.gather(out), 2), want, "in a shard_map over cp: value")

    # grouped-query attention with one kv head, its head dim split over tp (a k projection's
    # output split over tp when the kv heads are fewer than the tp ranks), q's heads over tp:
    # each rank's block must pair its q heads with whole kv heads
    q1, k1, v1, _ = _qkv(hkv=1)
    want1 = _dense(q1, k1, v1, None, True, False)
    lq, lk, lv = (C.load_balance(t, 2) for t in (q1, k1, v1))
    xs = (fs.shard(lq, mesh, fs.P(None, "tp", "cp")),) + tuple(
        fs.shard(t, mesh, fs.P(None, None, "cp", "tp")) for t in (lk, lv)
    )
    with C._attention_of(torch.nn.Module(), mesh, "cp", C.ring_attention):
        out = fs.parallel.attention(*xs, is_causal=True)
    seen.append(out.spec)
    _close(C.load_balance_inverse(fs.gather(out), 2), want1, "one kv head split over tp")
    return seen


@pytest.mark.timeout(300)
def test_attention_in_the_global_view_splits_the_sequence_over_cp(world4):
    for seen in world4.run(global_view_rank_fn):
        # the output's sequence is split over cp alone, whatever the input's layout
        assert seen == [
            fs.P(None, "tp", "cp", None), fs.P(None, "tp", "cp", None), fs.P(None, None, "cp", None),
            fs.P(None, None, None, None), fs.P(None, None, "cp", None),
        ], seen  # fmt: skip


def comm_rank_fn():
    """Ring attention moves the stacked k/v block cp - 1 times forward and its cotangent back
    (the inverse rotation); the padding mask costs one all_gather (no backward)."""
    mesh = fs.Mesh.create((2,), ("cp",))
    q, k, v, keep = _qkv()
    # local blocks outside a shard_map body (mesh=): nothing but the attention communicates
    q, k, v = (C.load_balance(t, 2).chunk(2, -2)[mesh.rank].requires_grad_() for t in (q, k, v))
    m = C.load_balance(keep, 2, -1).chunk(2, -1)[mesh.rank]
    with fs.debug.comm_log() as log:
        out = C.ring_attention(q, k, v, "cp", causal=True, padding_mask=m, mesh=mesh)
        out.sum().backward()
    records = [(r.op, r.nbytes) for r in log]
    b, hkv, s_local, d = k.shape
    kv_bytes = 2 * b * hkv * s_local * d * 4  # k and v stacked, float32
    want = [("all_gather", b * s_local), ("ppermute", kv_bytes), ("ppermute", kv_bytes)]
    assert records == want, records
    return True


@pytest.mark.timeout(120)
def test_ring_attention_comm(world2):
    assert world2.run(comm_rank_fn) == [True, True]


def overlap_rank_fn():
    """The order of ring attention's transfers and block computations, from spies on
    ``fs.lax.ppermute_start`` (issue, wait) and the forward's and backward's block functions:
    every transfer is issued before a block is computed and taken after it, in the forward (the
    next k/v block) and in the backward (a block's k/v gradient on its way back), through
    ``.backward()``, ``torch.func.grad`` and ``fs.value_and_grad``; the gradients equal dense
    sdpa's. Under ``vmap`` the ring is differentiated op by op (no backward spy)."""
    mesh = fs.Mesh.create((2,), ("cp",))
    q, k, v, keep = _qkv()
    local = [C.load_balance(t, 2).chunk(2, -2)[mesh.rank] for t in (q, k, v)]
    m = C.load_balance(keep, 2, -1).chunk(2, -1)[mesh.rank]
    events = []
    real = fs.lax.ppermute_start, C._block, C._block_grads

    class Spied:
        def __init__(self, pending):
            self.pending = pending

        def wait(self):
            events.append("wait")
            return self.pending.wait()

    def start(*args, **kwargs):
        events.append("issue")
        return Spied(real[0](*args, **kwargs))

    def spy(name, fn):
        def run(*args):
            if not events or events[-1] != name:  # a step's blocks: one entry
                events.append(name)
            return fn(*args)

        return run

    def attend(q, k, v, mask=m):
        return C.ring_attention(q, k, v, "cp", causal=True, padding_mask=mask, mesh=mesh)

    fs.lax.ppermute_start = start
    C._block, C._block_grads = spy("block", real[1]), spy("grad", real[2])
    try:
        leaves = [t.clone().requires_grad_() for t in local]
        out = attend(*leaves)
        forward, events[:] = list(events), []
        _objective(out).backward()
        backward, events[:] = list(events), []
        grads = torch.func.grad(lambda *a: _objective(attend(*a)), (0, 1, 2))(*local)
        under_grad, events[:] = list(events), []
        _, vgrads = fs.value_and_grad(lambda *a: _objective(attend(*a)), argnums=(0, 1, 2))(*local)
        under_vg, events[:] = list(events), []
        torch.func.vmap(attend)(*(t[:, None] for t in (*local, m)))
        under_vmap = list(events)
    finally:
        fs.lax.ppermute_start, C._block, C._block_grads = real
    # cp = 2: one transfer each way
    assert forward == ["issue", "block", "wait", "block"], forward
    assert backward == ["grad", "issue", "grad", "wait"], backward
    assert under_grad == under_vg == forward + backward, (under_grad, under_vg)
    assert under_vmap == forward, under_vmap  # run in place under vmap: no Function
    full = [t.requires_grad_() for t in (q, k, v)]
    _objective(_dense(*full, keep, True, True)).backward()
    for got in ([t.grad for t in leaves], grads, vgrads):
        for name, g, t in zip("qkv", got, full):
            want = C.load_balance(t.grad, 2).chunk(2, -2)[mesh.rank]
            _close(g, want, f"overlapped ring: grad {name}")
    # an eager create_graph backward (differentiated op by op): a second derivative
    second = []
    sdpa = torch.nn.attention
    for attention, xs in ((attend, local), (None, (q, k, v))):
        xs = [t.detach().clone().requires_grad_() for t in xs]
        with sdpa.sdpa_kernel(sdpa.SDPBackend.MATH):  # twice differentiable
            o = attention(*xs) if attention else _dense(*xs, keep, True, True)
        (gq,) = torch.autograd.grad(_objective(o), xs[0], create_graph=True)
        (gq**2).sum().backward()
        second.append([t.grad for t in xs])
    for name, g, t in zip("qkv", *second):
        _close(g, C.load_balance(t, 2).chunk(2, -2)[mesh.rank], f"second derivative {name}")
    return True


@pytest.mark.timeout(120)
def test_ring_attention_backward_overlaps_its_transfers(world2):
    assert world2.run(overlap_rank_fn) == [True, True]


def fused_rank_fn():
    """Differentiated once in reverse mode, ring attention's blocks run on CPU's fused flash
    attention kernels (issue 36 item 7): one forward call per tile (a diagonal chunk pair cut
    into its unmasked keys and the causal square), one backward call per tile, against the
    merged out and log-sum-exp; under vmap the ring is differentiated op by op (no fused call).
    Gradients equal dense sdpa's."""
    mesh = fs.Mesh.create((2,), ("cp",))
    q, k, v, keep = _qkv()
    local = [C.load_balance(t, 2).chunk(2, -2)[mesh.rank] for t in (q, k, v)]
    m = C.load_balance(keep, 2, -1).chunk(2, -1)[mesh.rank]
    fwd = "aten::_scaled_dot_product_flash_attention_for_cpu"

    def attend(q, k, v, mask=m):
        return C.ring_attention(q, k, v, "cp", causal=True, padding_mask=mask, mesh=mesh)

    def calls(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = fn()
        names = [e.name for e in prof.events()]
        return result, names.count(fwd), names.count(fwd + "_backward")

    # balanced causal cp=2: step 0 the causal square, the second chunk's unmasked key chunk and
    # its causal square; step 1 one unmasked half block
    tiles = sum(len(t) for _, t in C._ring_tiles(2, mesh.rank, True, True))
    assert tiles == 4
    leaves = [t.clone().requires_grad_() for t in local]
    _, f, b = calls(lambda: _objective(attend(*leaves)).backward())
    assert (f, b) == (tiles, tiles), (f, b)
    grads, f, b = calls(
        lambda: torch.func.grad(lambda *a: _objective(attend(*a)), (0, 1, 2))(*local)
    )
    assert (f, b) == (tiles, tiles), (f, b)
    _, f, b = calls(lambda: torch.func.vmap(attend)(*(t[:, None] for t in (*local, m))))
    assert (f, b) == (0, 0), (f, b)
    full = [t.requires_grad_() for t in (q, k, v)]
    _objective(_dense(*full, keep, True, True)).backward()
    for got in ([t.grad for t in leaves], grads):
        for name, g, t in zip("qkv", got, full):
            want = C.load_balance(t.grad, 2).chunk(2, -2)[mesh.rank]
            _close(g, want, f"fused ring: grad {name}")
    return True


@pytest.mark.timeout(300)
def test_ring_attention_runs_fused_kernels(world2):
    assert world2.run(fused_rank_fn) == [True, True]


def cut_squares_rank_fn(cp, cases):
    """The fused path's causal chunk squares cut in halves down to sub-squares
    (``C._STAIR``, 128 tokens, here 2 so that the tests' chunks of 4 and 8 tokens are cut):
    one forward and one backward kernel call per cut, values and gradients equal dense
    sdpa's (every case of :func:`dense_equal_rank_fn`: causal or not, padding, grouped
    heads, balanced or contiguous)."""
    mesh = fs.Mesh.create((cp,), ("cp",))
    fwd = "aten::_scaled_dot_product_flash_attention_for_cpu"
    stair = C._STAIR
    C._STAIR = 2
    try:
        q, k, v, keep = _qkv(s=8 * cp)
        local = [C.load_balance(t, cp).chunk(cp, -2)[mesh.rank] for t in (q, k, v)]
        m = C.load_balance(keep, cp, -1).chunk(cp, -1)[mesh.rank]
        leaves = [t.clone().requires_grad_() for t in local]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = C.ring_attention(*leaves, "cp", causal=True, padding_mask=m, mesh=mesh)
            _objective(out).backward()
        names = [e.name for e in prof.events()]
        c = 8 // 2  # a chunk's tokens: 8 per rank, 2 chunks
        cuts = sum(len(C._cuts(t, c, 2)) for _, t in C._ring_tiles(cp, mesh.rank, True, True))
        plain = sum(len(t) for _, t in C._ring_tiles(cp, mesh.rank, True, True))
        assert cuts > plain, (cuts, plain)  # the causal squares are cut
        assert names.count(fwd) == names.count(fwd + "_backward") == cuts, names.count(fwd)
        assert dense_equal_rank_fn("ring", cp, cases)
    finally:
        C._STAIR = stair
    return True


@pytest.mark.timeout(300)
def test_ring_attention_cut_causal_squares_two_ranks(world2):
    assert world2.run(cut_squares_rank_fn, 2, CASES) == [True, True]


@pytest.mark.timeout(300)
def test_ring_attention_cut_causal_squares_four_ranks(world4):
    cases = [(True, True, True, True), (True, True, False, False), (False, True, True, True)]
    assert world4.run(cut_squares_rank_fn, 4, cases) == [True] * 4


def padded_chunks_rank_fn():
    """Whole chunks of padding: a block (or the causal square) where some rows see no key.
    Values, gradients (``.backward()``: the fused kernels; ``vmap(grad)``: op by op) and an
    eager second derivative equal dense sdpa's, with no nan (``logaddexp``'s second derivative
    is nan where one side is a masked row's lowest finite log-sum-exp)."""
    mesh = fs.Mesh.create((2,), ("cp",))
    q, k, v, keep = _qkv()
    keep[-1, 4:] = False  # chunk 0 real, chunks 1-3 padding
    for causal, balanced in ((True, True), (False, True)):
        what = f"causal={causal} balanced={balanced}"
        attention = _sharded("ring", 2, causal, True, balanced, mesh)
        second = []
        sdpa = torch.nn.attention
        for fn in (attention, lambda q, k, v, m, c=causal: _dense(q, k, v, m, c, True)):
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            with sdpa.sdpa_kernel(sdpa.SDPBackend.MATH):  # twice differentiable
                o = fn(*xs, keep)
            gs = torch.autograd.grad(_objective(o), xs, create_graph=True)
            (sum((g**2).sum() for g in gs)).backward()
            second.append((o, gs, [t.grad for t in xs]))
        (o, gs, gg), (do, dgs, dgg) = second
        _close(o, do, f"{what}: value")
        for name, a, b in zip("qkv", (*gs, *gg), (*dgs, *dgg)):
            assert not a.isnan().any(), (what, name)
            _close(a, b, f"{what}: {name}")
        _check_backward(attention, (q, k, v), keep, dgs, what)
    return True


@pytest.mark.timeout(300)
def test_ring_attention_whole_chunks_of_padding(world2):
    assert world2.run(padded_chunks_rank_fn) == [True, True]


def errors_rank_fn(mesh=None):
    mesh = fs.Mesh.create((2,), ("cp",)) if mesh is None else mesh
    q, k, v, keep = _qkv(h=3, hkv=3)

    def call(fn, *args, **kw):
        return fs.shard_map(lambda q, k, v: fn(q, k, v, "cp", *args, **kw), mesh, SPEC, SPEC)(
            q, k, v
        )

    with pytest.raises(ValueError, match="q has 3 heads, not divisible by the size 2"):
        call(C.ulysses_attention)
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        call(C.ring_attention, padding_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="padding_mask has shape"):
        call(C.ring_attention, padding_mask=torch.ones(2, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be even with load_balanced=True"):
        fs.shard_map(lambda q: C.ring_attention(q, q, q, "cp"), mesh, SPEC, SPEC)(q[:, :, :6])
    with pytest.raises(ValueError, match="must agree"):
        fs.shard_map(lambda q, k: C.ring_attention(q, k, k, "cp"), mesh, SPEC, SPEC)(q, k[..., :4])
    with pytest.raises(ValueError, match="ppermute_start: perm"):
        fs.lax.ppermute_start(torch.ones(2), "cp", [(0, 1), (1, 1)], mesh=mesh)
    return True


def test_errors_before_any_collective():
    """Each rank's refusals, on a simulated mesh (one process): its wire records what the real
    one sends, and nothing was sent."""
    abstract = fs.Mesh.abstract((2,), ("cp",))
    for r in (0, 1):
        with fs.debug.comm_log() as log:
            assert errors_rank_fn(abstract.simulate(r, backend="gloo"))
        assert log == [], log


# -- an HF Llama under cp=2 -----------------------------------------------------------------


def _llama(seed=0):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def llama_rank_fn(attention, pad, steps, tp=1):
    model = _llama()
    if tp == 1:
        mesh = fs.Mesh.create((2,), ("cp",))
        plan = {}  # replicated over cp: the plan names no cp
    else:  # Megatron over tp; the attention maps the tp blocks (heads) inside the cp body
        mesh = fs.Mesh.create((2, tp), ("cp", "tp"))
        plan = fs.nn.megatron_plan(
            column=["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "lm_head"],
            row=["*.o_proj", "*.down_proj"],
            vocab=["model.embed_tokens"],
            model=model,
        )
    params = fs.nn.shard_params(model, mesh, plan)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    mask, labels = None, ids
    if pad:
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 10:] = 0
        labels = ids.masked_fill(mask == 0, -100)

    def loss_fn(ps):
        return fs.parallel.context_parallel_loss(
            model, ps, mesh, ids, labels, mask, attention=attention
        )

    def dense_loss(ps):
        kw = {"labels": labels, "attention_mask": mask}
        return torch.func.functional_call(model, ps, (ids,), kw).loss

    dense = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = fs.optim.adamw(1e-2, eps=1e-4, weight_decay=0.1)
    state, dstate = tx.init(params), tx.init(dense)
    for step in range(steps):
        grads, loss = torch.func.grad_and_value(loss_fn)(params)
        dgrads, dloss = torch.func.grad_and_value(dense_loss)(dense)
        _close(loss, dloss, f"loss, step {step}")
        assert set(grads) == set(dgrads)
        for k, g in grads.items():
            assert g.layout == params[k].layout
            _close(fs.gather(g), dgrads[k], f"grad {k}, step {step}")
        params, state = fs.optim.step(tx, grads, state, params)
        updates, dstate = tx.update(dgrads, dstate, dense)
        dense = fs.optim.apply_updates(dense, updates)
    for k, v in params.items():
        _close(fs.gather(v), dense[k], f"trained {k}")
    assert model.config._attn_implementation == "sdpa"  # restored after each call
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "attention, pad, steps", [("ring", False, 3), ("ring", True, 1), ("ulysses", True, 1)]
)
def test_hf_llama_context_parallel_two_ranks(world2, attention, pad, steps):
    pytest.importorskip("transformers")
    assert world2.run(llama_rank_fn, attention, pad, steps) == [True, True]


@pytest.mark.timeout(300)
def test_hf_llama_context_parallel_times_tensor_parallel_four_ranks(world4):
    """cp=2 x tp=2: partial-manual over cp, Megatron's op rules over tp."""
    pytest.importorskip("transformers")
    assert world4.run(llama_rank_fn, "ring", False, 1, 2) == [True] * 4


def ppermute_start_rank_fn():
    """``fs.lax.ppermute_start(...).wait()`` is ``fs.lax.ppermute``: values, ``grad`` (sent
    ahead: the cotangent comes back by the inverse rotation), ``jvp`` and ``vmap`` (run in
    place), each against the same transform of ``ppermute``."""
    mesh = fs.Mesh.create((2,), ("cp",))
    ring = [(0, 1), (1, 0)]
    x = torch.arange(6.0).reshape(2, 3) + 10 * mesh.rank
    w = torch.tensor([1.0, 2.0, 3.0]) * (mesh.rank + 1)

    def started(x):
        return fs.lax.ppermute_start(x, "cp", ring, mesh=mesh).wait()

    def plain(x):
        return fs.lax.ppermute(x, "cp", ring, mesh=mesh)

    for fn in (started, plain):
        assert torch.equal(fn(x), torch.arange(6.0).reshape(2, 3) + 10 * (1 - mesh.rank))
    grads = [torch.func.grad(lambda x, fn=fn: (fn(x) * w).sum())(x) for fn in (started, plain)]
    other_w = torch.tensor([1.0, 2.0, 3.0]) * (2 - mesh.rank)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], other_w.expand(2, 3))
    jvps = [torch.func.jvp(fn, (x,), (torch.ones_like(x),))[1] for fn in (started, plain)]
    assert torch.equal(jvps[0], jvps[1])
    maps = [torch.func.vmap(fn)(x) for fn in (started, plain)]
    assert torch.equal(maps[0], maps[1])
    return True


@pytest.mark.timeout(120)
def test_ppermute_start_is_ppermute_under_transforms(world2):
    assert world2.run(ppermute_start_rank_fn) == [True, True]
