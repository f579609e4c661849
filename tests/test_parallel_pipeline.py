"""Pipeline parallelism (issue 22 item 2): ``fs.parallel.pipeline`` / ``pipeline_schedule``.

Oracles: the schedules' per-rank orders against torch.distributed.pipelining's own order
generators; bubble fraction and stash against the published formulas; a 4-block GPT trained
3 AdamW steps on pp=2 (and pp=2 x dp=2, pp=2 x tp=2) against the dense module trained in one
process (losses, first-step gradients, trained weights)."""

import fnmatch
import functools
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import schedules as tsched

import fshard as fs
from fshard.parallel import (
    Action,
    on_stage,
    pipeline,
    pipeline_schedule,
    stack_stages,
    stage_order,
    unstack_stages,
)
from fshard.parallel.pipeline import _Stacked

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt as demo  # noqa: E402

CFG = demo.GPTConfig(d_model=32, n_heads=4, n_layers=4, ctx=16)
STEPS, BATCH, M, SEED = 3, 8, 4, 0
TOL = {"atol": 2e-5, "rtol": 1e-4}


# -- the plan: tick tables -------------------------------------------------------------------


def _orders(s):
    """Each rank's actions in execution order (the table without its idle ticks)."""
    return [[row[r] for row in s.table if row[r] is not None] for r in range(s.pp)]


def _torch_orders(p, m, v, zero_bubble):
    """torch.distributed.pipelining's per-rank orders (ScheduleInterleaved1F1B's and, with
    ``zero_bubble``, ScheduleInterleavedZeroBubble's calculation), as fshard Actions."""
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    out = []
    for r in range(p):
        warmup = tsched._get_warmup_ops(r, v, p, p, m, multiply_factor=1 if zero_bubble else 2)
        ops = v * m

        def fwd(step, r=r):
            return (step // p) % v * p + r

        def bwd(step, r=r, warmup=warmup):
            return (v - 1 - ((step - warmup) // p) % v) * p + r

        got = tsched._get_1f1b_rank_ops(
            v, p, warmup, ops - warmup, warmup, r, fwd, bwd,
            num_1f1b_microbatches=r if zero_bubble else 0, enable_zero_bubble=zero_bubble,
        )  # fmt: skip
        out.append(
            [
                Action(kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
                for a in got
                if a is not None
            ]
        )
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6), (4, 4)])
def test_orders_are_torch_pipelinings(p, m):
    # 1F1B is the interleaved order with one stage per rank and one warmup forward per hop
    # (Schedule1F1B: p - r forwards, then 1B1F); torch's interleaved warms up 2 per hop.
    f1b1 = _orders(pipeline_schedule("1f1b", p, m))
    for r, ops in enumerate(f1b1):
        fwd = [Action("F", r, i) for i in range(m)]
        bwd = [Action("B", r, i) for i in range(m)]
        w = p - r
        want = fwd[:w] + [a for i in range(m - w) for a in (bwd[i], fwd[w + i])] + bwd[m - w :]
        assert ops == want, r
    assert _orders(pipeline_schedule("zb", p, m)) == _torch_orders(p, m, 1, zero_bubble=True)
    for v in (2, 3):
        got = _orders(pipeline_schedule("interleaved", p, m, virtual=v))
        assert got == _torch_orders(p, m, v, zero_bubble=False), v
    gpipe = _orders(pipeline_schedule("gpipe", p, m))  # ScheduleGPipe: every F, then every B
    assert gpipe == [
        [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
        for r in range(p)
    ]


def _dependencies_hold(s):
    done = {}
    for t, row in enumerate(s.table):
        for a in row:
            if a is None:
                continue
            if a.kind == "F" and a.stage > 0:
                assert done[("F", a.stage - 1, a.microbatch)] < t
            if a.kind == "B":
                assert done[("F", a.stage, a.microbatch)] < t
                if a.stage < s.stages - 1:
                    assert done[("B", a.stage + 1, a.microbatch)] < t
            if a.kind == "W":
                assert done[("B", a.stage, a.microbatch)] < t
        for r, a in enumerate(row):
            if a is not None:
                assert a.stage % s.pp == r  # stage s lives on rank s % pp
                done[tuple(a)] = t
    kinds = "FBW" if s.name == "zb" else "FB"
    assert len(done) == len(kinds) * s.stages * s.microbatches


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (3, 6), (4, 12)])
def test_bubble_and_stash_are_theory(p, m, capsys):
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3)):
        s = pipeline_schedule(name, p, m, virtual=v)
        _dependencies_hold(s)
        work = {"gpipe": m, "1f1b": m, "zb": 3 * m, "interleaved": v * m}[name]
        theory = (p - 1) / (work + p - 1)
        print(f"{name:12s} v={v} p={p} m={m}: bubble {s.bubble_fraction[0]:.4f}, theory "
              f"{theory:.4f}, peak stash per rank {s.peak_stash}")  # fmt: skip
        assert s.theory_bubble == pytest.approx(theory)
        assert s.bubble_fraction == pytest.approx((theory,) * p)
        stash = {
            "gpipe": [m] * p,
            "1f1b": [min(p - r, m) for r in range(p)],  # <= p, against GPipe's m
            "zb": [min(p, m)] * p,
            "interleaved": [min(2 * (p - 1 - r) + (v - 1) * p + 1, v * m) for r in range(p)],
        }[name]
        assert list(s.peak_stash) == stash
    with capsys.disabled():
        print(capsys.readouterr().out, end="")


def test_stage_order_is_rank_major():
    assert stage_order(2) == [0, 1]
    assert stage_order(2, virtual=2) == [0, 2, 1, 3]
    assert stage_order(3, virtual=2) == [0, 3, 1, 4, 2, 5]


@pytest.mark.parametrize("stages,pp", [(2, 2), (4, 2), (4, 1)])
def test_unstack_stages_inverts_the_stacking(stages, pp):
    named = {k: v.detach() for k, v in demo.GPT(CFG).named_parameters()}
    tree = _to_tree(named, stages, pp)
    blocks = {k: v for k, v in named.items() if k.startswith("blocks.")}
    got = unstack_stages(tree["stages"], prefix="blocks", pp=pp, virtual=stages // pp)
    assert list(got) == list(blocks)  # the module's order
    assert all(torch.equal(got[k], blocks[k]) for k in blocks)


@pytest.mark.parametrize("virtual", [1, 2])
def test_stack_stages_keeps_a_per_part_layout(virtual):
    """A fused projection's plan entry, ``fs.Parts`` (each part split on its own over tp:
    transformers' packed experts ``[gate | up]``, ``(E, 2 I, H)``, and a ``[q | k | v]`` weight
    given by a negative dim), stacks to the same parts, its dim moved past the stages' two:
    ``Parts(P('pp', None, *spec), dim + 2, sizes)``. Each rank's boxes are its stages' rows of
    its chunk of every part (the layout math on a simulated 2 x 2 mesh, and on a 2 x 2 x 2 one
    with the Parts' P splitting another dim over dp, as FSDP may; the values' round trip,
    gathered and unstacked, on 4 ranks in tests/test_composition.py). pipeline takes
    it as a stage param and refuses, before any collective, parts on the stages' dim."""
    am = fs.Mesh.abstract((2, 2), ("pp", "tp"))
    e, i, h, n = 4, 6, 3, 4  # experts, the parts' size, hidden, blocks
    per = n // (2 * virtual)
    named = {}
    for b in range(n):
        named[f"layers.{b}.gate_up"] = torch.empty(e, 2 * i, h, device="meta")
        named[f"layers.{b}.qkv"] = torch.empty(h, 3 * i, device="meta")
        named[f"layers.{b}.norm"] = torch.empty(h, device="meta")
    plan = {
        "*.gate_up": fs.Parts(fs.P(None, "tp", None), 1, (i, i)),
        "*.qkv": fs.Parts(fs.P(None, "tp"), -1, (i, i, i)),
    }
    for rank in range(4):
        mesh = am.simulate(rank)
        st = stack_stages(named, mesh, prefix="layers", plan=plan, virtual=virtual)
        gate_up, qkv = st["gate_up"], st["qkv"]
        lead = (2 * virtual, per)
        assert gate_up.layout == fs.Layout.of(
            mesh, fs.Parts(fs.P("pp", None, None, "tp"), 3, (i, i)), (*lead, e, 2 * i, h)
        )
        assert qkv.layout == fs.Layout.of(
            mesh, fs.Parts(fs.P("pp", None, None, "tp"), 3, (i, i, i)), (*lead, h, 3 * i)
        )
        assert st["norm"].spec == fs.P("pp", None)  # a P entry as before
        pp_index, tp_index = divmod(rank, 2)
        rows = (pp_index * virtual, 0)
        for x, lead_shape, parts in ((gate_up, (e,), 2), (qkv, (h,), 3)):
            boxes = [(b.shard_offsets, b.shard_sizes) for b in x.layout.blocks(rank)]
            chunks = [p * i + tp_index * (i // 2) for p in range(parts)]
            tail = (h,) if x is gate_up else ()
            assert boxes == [
                ((*rows, *(0,) * len(lead_shape), c, *(0,) * len(tail)),
                 (virtual, per, *lead_shape, i // 2, *tail))
                for c in chunks
            ], (rank, boxes)  # fmt: skip
            assert tuple(x.local.shape) == (virtual, per, *lead_shape, parts * i // 2, *tail)
    # a Parts whose P splits another dim too (FSDP's rows over dp): kept, shifted alike
    fsdp = fs.Mesh.abstract((2, 2, 2), ("pp", "dp", "tp")).simulate(5)
    entry = fs.Parts(fs.P("dp", "tp", None), 1, (i, i))
    st = stack_stages(named, fsdp, prefix="layers", plan={"*.gate_up": entry}, virtual=virtual)
    shape = (2 * virtual, per, e, 2 * i, h)
    want = fs.Parts(fs.P("pp", None, "dp", "tp"), 3, (i, i))
    assert st["gate_up"].layout == fs.Layout.of(fsdp, want, shape)
    assert tuple(st["gate_up"].local.shape) == (virtual, per, e // 2, i, h)
    # parts on the stages' dim: refused by the pipeline, before any collective
    mesh = am.simulate(0)
    bad = fs.shard(torch.empty(2, 3, device="meta"), mesh, fs.Parts(fs.P("pp"), 0, (1, 1)))
    with pytest.raises(ValueError, match=r"stage_params leaf 0 has layout Parts.*not dim 0"):
        pipeline(
            lambda p, x: x, bad, torch.ones(2, 3), mesh, loss_fn=lambda _, y, t: y.sum(),
        )  # fmt: skip
    # a loss param split per part over the pipeline axis: named, as a P split over it is
    with pytest.raises(ValueError, match=r"loss_params leaf 0 has layout Parts.*replicated over"):
        pipeline(
            lambda p, x: x, torch.ones(2, 3), torch.ones(2, 3), mesh,
            loss_fn=lambda _, y, t: y.sum(), loss_params=bad,
        )  # fmt: skip
    with pytest.raises(ValueError, match="plan splits 'qkv' over the pipeline axis 'pp'"):
        stack_stages(
            named, mesh, prefix="layers", plan={"*.qkv": fs.Parts(fs.P(None, "pp"), 1, (i, i, i))}
        )


def stack_stages_memory_rank_fn(schedule, virtual):
    """``stack_stages``' blocks own their storage (``fs.shard`` keeps a view of the whole
    stack, every rank's stages), and what a step saves for its backward holds only this rank's
    stages: the stage weights the matmuls save (``x @ w[i]``, found by their shape) are this
    rank's stage bytes exactly (were the whole stack's: twice them on pp=2). The stages run
    without the shard_map body's torch-function mode. Values and gradients against the dense
    chain."""
    mesh = fs.Mesh.create((2,), ("pp",))
    r, blocks, per = mesh.rank, 4 * virtual, 2
    gen = torch.Generator().manual_seed(3)
    named = {f"blocks.{i}.w": torch.randn(5, 5, generator=gen) / 2 for i in range(blocks)}
    st = stack_stages(named, mesh, prefix="blocks", virtual=virtual)["w"]
    local = st.local
    assert local.untyped_storage().nbytes() == local.numel() * local.element_size()
    order = stage_order(2, virtual)
    want = torch.stack(
        [torch.stack([named[f"blocks.{s * per + i}.w"] for i in range(per)]) for s in order]
    )
    assert torch.equal(fs.gather(st), want)
    x = torch.randn(4, 3, 5, generator=gen)
    modes = []

    def stage(w, x):
        modes.append(type(torch.overrides._get_current_function_mode()).__name__)
        for i in range(per):
            x = torch.tanh(x @ w[i])
        return x

    def loss(w):
        return pipeline(stage, w, x, mesh, loss_fn=lambda _, y, t: (y * y).sum(),
                        schedule=schedule, virtual=virtual)  # fmt: skip

    saved = {}

    def pack(t):
        # a layer's weight (activations are (3, 5); the rows' gradients the Function keeps for
        # its backward are (5, 5) too, and need no grad)
        if tuple(t.shape) == (5, 5) and t.requires_grad:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value, g = fs.value_and_grad(loss)(st)
    assert sum(saved.values()) == virtual * per * 5 * 5 * 4, saved
    # the body's tracker (paused for the schedule) is off the mode stack: no Python call per op
    assert modes and "_Tracker" not in modes, modes

    def dense(w):  # the stages in order, one process
        out = 0
        for k in range(4):
            xk = x[k]
            for s in range(2 * virtual):
                xk = stage(w[order.index(s)], xk)
            out = out + (xk * xk).sum()
        return out / 4

    want_g, want_v = torch.func.grad_and_value(dense)(want)
    assert float(value) == pytest.approx(float(want_v), rel=1e-5)
    torch.testing.assert_close(fs.gather(g), want_g, **TOL)
    return r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zb", 1), ("interleaved", 2)])
def test_stack_stages_blocks_hold_only_their_stages(world2, schedule, virtual):
    assert world2.run(stack_stages_memory_rank_fn, schedule, virtual) == [0, 1]


def plain_inputs_rank_fn():
    """Plain tensors as every input (stage weights, microbatches, loss params, targets):
    the loss and gradients against dense, one consistency exchange a step for all of them and
    the shard_map call (shard_map made one per tensor: 4 here, plus its own: 5 a step; then 2,
    the inputs' and the call's), and a rank passing different values raises a
    ConsistencyError naming the input."""
    mesh = fs.Mesh.create((2,), ("pp",))
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(2, 3, 3, generator=gen) / 2, torch.randn(4, 2, 3, generator=gen)
    h, tgt = torch.randn(3, generator=gen), torch.randn(4, 2, generator=gen)

    def loss_fn(h, y, t):
        return ((y @ h - t) ** 2).sum()

    def loss(w, x, h):
        return pipeline(lambda w, x: torch.tanh(x @ w), w, x, mesh, loss_fn=loss_fn,
                        loss_params=h, targets=tgt, schedule="1f1b")  # fmt: skip

    def dense(w, x, h):
        ys = [torch.tanh(torch.tanh(x[k] @ w[0]) @ w[1]) for k in range(4)]
        return sum(loss_fn(h, y, tgt[k]) for k, y in enumerate(ys)) / 4

    exchanges = []
    real = fs.consistency._exchange

    def counted(*a):
        exchanges.append(a)
        return real(*a)

    value, grads = fs.value_and_grad(loss, argnums=(0, 1, 2))(w, x, h)
    fs.consistency._exchange = counted  # a later step's (the group's first collective checks)
    try:
        fs.value_and_grad(loss, argnums=(0, 1, 2))(w, x, h)
    finally:
        fs.consistency._exchange = real
    torch.testing.assert_close(value, dense(w, x, h), **TOL)
    for got, want in zip(grads, torch.func.grad(dense, argnums=(0, 1, 2))(w, x, h)):
        torch.testing.assert_close(
            fs.gather(got) if isinstance(got, fs.ShardedArray) else got, want, **TOL
        )
    bad = h + mesh.rank  # rank 1's head differs
    try:
        fs.value_and_grad(loss, argnums=2)(w, x, bad)
    except fs.consistency.ConsistencyError as e:
        return len(exchanges), "loss_params leaf 0" in str(e)
    return len(exchanges), "no error"


@pytest.mark.timeout(120)
def test_plain_inputs_are_checked_once(world2):
    assert world2.run(plain_inputs_rank_fn) == [(1, True)] * 2


def differing_program_rank_fn(what):
    """Ranks passing the pipeline different arguments that decide its transfers (the schedule,
    ``virtual``, ``activation=``'s shape or dtype, whether the step is differentiated) raise the
    same ConsistencyError naming them on every rank, from the check at the step's start, before
    a transfer goes out: the transfers are not folded into the digest one by one. Was: only
    each ppermute's fold compared them, at the group's next exchange, after the schedules had
    run apart (both ranks waited for Gloo's 60 s timeout)."""
    mesh = fs.Mesh.create((2,), ("pp",))
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(2, 3, 3, generator=gen) / 2, torch.randn(4, 2, 3, generator=gen)
    h, tgt = torch.randn(3, generator=gen), torch.randn(4, 2, generator=gen)
    odd = mesh.rank == 1
    kwargs = {"schedule": "gpipe" if odd and what == "schedule" else "1f1b"}
    if what == "activation":  # input_fn's stage input: float64 on rank 1
        dtype = torch.float64 if odd else torch.float32
        kwargs.update(input_fn=lambda e, mb: (mb * e).to(dtype), input_params=torch.ones(()),
                      activation=torch.empty(2, 3, dtype=dtype, device="meta"))  # fmt: skip

    def stage(w, x):
        return torch.tanh(x @ w.to(x.dtype))

    def loss_fn(h, y, t):
        return ((y @ h.to(y.dtype) - t) ** 2).sum()

    def loss(w):
        return pipeline(stage, w, x, mesh, loss_fn=loss_fn, loss_params=h, targets=tgt, **kwargs)

    log = []
    try:
        with fs.debug.comm_log() as log:
            if what == "differentiated" and odd:  # rank 1 evaluates, rank 0 trains
                with torch.no_grad():
                    loss(w)
            else:
                fs.value_and_grad(loss)(w)
    except fs.consistency.ConsistencyError as e:
        sent = [r for r in log if r.op == "ppermute"]
        return "schedule, virtual, axis, activation, differentiated" in str(e), sent
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["schedule", "activation", "differentiated"])
def test_ranks_disagreeing_on_the_schedule_raise_before_a_transfer(world2, what):
    assert world2.run(differing_program_rank_fn, what) == [(True, [])] * 2


def closed_over_rank_fn(where, how):
    """A differentiated value that ``stage_fn``, ``loss_fn`` or ``input_fn`` closes over, under
    ``fs.value_and_grad`` or ``torch.func.grad``, instead of receiving it through the pipeline's
    arguments. Its gradient through the pipeline was silently zero (the Function returns
    gradients for its inputs only: d/dk was 0 where the dense one is 27). Now the rank whose
    function uses it raises a ValueError naming that function and the argument to pass it
    through; the other rank raises PeerFailed naming that error, at once. ``where`` says which
    function closes over ``k``; the loss is ``mean_m(k^a w0 w1 x_m)`` with every ``x_m``
    through the functions. ``"vjp in stage_fn"``: ``stage_fn`` uses ``k`` only inside a
    ``torch.func.vjp`` of its own, whose level reuses the number of the outer
    ``torch.func.grad``'s (popped while the pipeline's Function runs): inside it ``k`` counted
    as that vjp's own, and d/dk was silently 0 under ``torch.func.grad`` too."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w, x, k = torch.tensor([[2.0], [3.0]]), torch.arange(4.0).reshape(4, 1), torch.tensor([1.5])

    def loss(w, k):
        stage = (lambda w, x: w * x * k) if where == "stage_fn" else (lambda w, x: w * x)
        if where == "vjp in stage_fn":
            stage = lambda w, x: torch.func.vjp(lambda h: h * k, w * x)[0]  # noqa: E731
        kw = {"input_fn": lambda e, mb: mb * k, "input_params": torch.ones(()),
              "activation": torch.empty(1)} if where == "input_fn" else {}  # fmt: skip
        scale = k if where == "loss_fn" else 1.0
        return pipeline(stage, w, x, mesh, loss_fn=lambda _, y, t: (y * t * scale).sum(),
                        targets=torch.ones(4, 1), schedule="1f1b", **kw)  # fmt: skip

    start = time.perf_counter()
    try:
        if how == "value_and_grad":
            fs.value_and_grad(loss, argnums=(0, 1))(w, k)
        else:
            torch.func.grad(lambda w, k: fs.gather(loss(w, k)), argnums=(0, 1))(w, k)
    except Exception as e:  # noqa: BLE001 (each rank's error is the result)
        text, fn = str(e), where.split()[-1]
        named = f"pipeline: {fn} " in text
        if isinstance(e, ValueError):  # the fix: the argument to pass it through
            named = named and {"stage_fn": "stage_params", "loss_fn": "loss_params",
                               "input_fn": "input_params"}[fn] in text  # fmt: skip
        return type(e).__name__, named, time.perf_counter() - start < 15
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["value_and_grad", "func.grad"])
@pytest.mark.parametrize("where", ["stage_fn", "loss_fn", "input_fn", "vjp in stage_fn"])
def test_a_closed_over_differentiated_value_is_refused(world2, where, how):
    user = 1 if where == "loss_fn" else 0  # the rank that sees it first
    got = world2.run(closed_over_rank_fn, where, how)
    assert got[user] == ("ValueError", True, True)
    assert got[1 - user] == ("PeerFailed", True, True)


def closed_over_constant_rank_fn():
    """What the functions close over that is not differentiated is a constant, as in dense
    code: a plain tensor, and a tensor that requires grad (a module's own parameter) that the
    caller does not differentiate (``fs.value_and_grad`` / ``torch.func.grad`` of ``w`` only;
    its ``.grad`` stays unset). Under plain ``.backward()`` such a tensor would get a ``.grad``
    in dense code, which the pipeline cannot give: refused. ``k`` passed in ``loss_params``
    gets its dense gradient."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w, x = torch.tensor([[2.0], [3.0]]), torch.arange(4.0).reshape(4, 1)
    plain, param = torch.tensor([1.5]), torch.nn.Parameter(torch.tensor([1.5]))

    def run(w, k):
        return fs.gather(pipeline(lambda w, x: w * x * k, w, x, mesh, schedule="1f1b",
                                  loss_fn=lambda _, y, t: (y * t).sum(),
                                  targets=torch.ones(4, 1)))  # fmt: skip

    def dense(w, k):
        return (x * w[0] * k * w[1] * k).sum() / 4

    want = torch.func.grad(dense)(w, plain)
    out = []
    for k in (plain, param):
        _, g = fs.value_and_grad(run)(w, k)
        out.append(torch.allclose(g, want) and torch.allclose(torch.func.grad(run)(w, k), want))
    out.append(param.grad is None)

    # passed in, as the error says: its dense gradient, w0 w1 mean(x) = 2 * 3 * 1.5
    def through(w, k):
        return fs.gather(pipeline(lambda w, x: w * x, w, x, mesh, schedule="1f1b", loss_params=k,
                                  loss_fn=lambda k, y, t: (y * t * k).sum(),
                                  targets=torch.ones(4, 1)))  # fmt: skip

    _, (_, gk) = fs.value_and_grad(through, argnums=(0, 1))(w, plain)
    out.append(torch.allclose(gk, torch.tensor([9.0])))
    leaf = w.clone().requires_grad_()
    try:  # last: the failing stage gives the group up
        run(leaf, param).backward()
    except Exception as e:  # noqa: BLE001 (each rank's error is the result)
        out.append((type(e).__name__, "pipeline: stage_fn (stage 0) uses" in str(e)))
    return out


@pytest.mark.timeout(120)
def test_a_closed_over_constant_is_a_constant(world2):
    got = world2.run(closed_over_constant_rank_fn)
    assert got[0] == [True, True, True, True, ("ValueError", True)]
    assert got[1] == [True, True, True, True, ("PeerFailed", True)]


def second_derivative_rank_fn() -> list:
    """A second derivative through the pipeline's gradients: ``fs.value_and_grad`` of a
    function of ``fs.value_and_grad``'s gradient (the inner one runs as ``torch.func.grad``,
    its argument taking part in the outer graph) gave **0** where dense gives its value (the
    Function hands back the gradients its forward computed, which autograd sees as constants;
    torch's ``once_differentiable`` guarded only a cotangent that requires grad). Now each
    second derivative that reaches them raises NotImplementedError on every rank; the first
    derivatives under ``create_graph`` or of an ``nn.Parameter`` under ``torch.func.grad`` stay
    the dense ones (requiring grad, as dense ones there do)."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w0, x = torch.tensor([[2.0], [3.0]]), torch.arange(4.0).reshape(4, 1) + 1

    def loss(w):
        return pipeline(lambda w, x: (w * x).sin(), w, x, mesh, schedule="1f1b",
                        loss_fn=lambda _, y, t: (y * t).sum(), targets=torch.ones(4, 1))  # fmt: skip

    def dense(w):
        y = x
        for i in range(2):
            y = (w[i] * y).sin()
        return y.sum() / 4  # the pipeline's loss: the microbatches' mean

    want = torch.func.grad(dense)(w0)
    out = []
    w = w0.clone().requires_grad_()
    fs.gather(loss(w)).backward(create_graph=True)
    out.append(torch.allclose(w.grad, want) and w.grad.requires_grad)
    g = torch.func.grad(lambda w: fs.gather(loss(w)))(torch.nn.Parameter(w0.clone()))
    out.append(torch.allclose(g, want) and g.requires_grad)
    param = torch.nn.Parameter(w0.clone())

    def of_func_grad():  # torch.func.grad's gradient of a param, differentiated by autograd
        return torch.autograd.grad(
            torch.func.grad(lambda v: fs.gather(loss(v)))(param).sum(), param
        )

    for second in (
        lambda: fs.value_and_grad(lambda w: fs.value_and_grad(loss)(w)[1].sum())(w0),
        lambda: w.grad.sum().backward(),
        of_func_grad,
    ):
        try:
            second()
            out.append("no error")
        except NotImplementedError as e:
            out.append("a second derivative reached the pipeline's gradients" in str(e))
    return out


@pytest.mark.timeout(120)
def test_a_second_derivative_through_the_pipeline_is_refused(world2):
    assert world2.run(second_derivative_rank_fn) == [[True, True, True, True, True]] * 2


def untouched_stage_rank_fn(schedule: str) -> list:
    """Stages that pass their input on untouched (``stage_fn = lambda w, x: x``): the output of
    a first stage whose input is a plain batch depends on nothing differentiated, so its
    backward has nothing to run. It raised torch's "element 0 of tensors does not require grad
    and does not have a grad_fn" (ZB-H1's split too), where dense code gives the weights a zero
    gradient. Each schedule: the weights' gradient 0 and, differentiated, the microbatches'
    the dense one, under ``fs.value_and_grad`` and ``torch.func.grad``."""
    mesh = fs.Mesh.create((2,), ("pp",))
    virtual = 2 if schedule == "interleaved" else 1
    w, x = torch.arange(1.0, 2 * virtual + 1).reshape(-1, 1), torch.arange(4.0).reshape(4, 1)

    def loss(w, x):
        return pipeline(lambda w, x: x, w, x, mesh, loss_fn=lambda _, y, t: (y * y * t).sum(),
                        targets=torch.ones(4, 1), schedule=schedule, virtual=virtual)  # fmt: skip

    want_x = x / 2  # d/dx of mean_m(x_m^2)
    out = []
    _, gw = fs.value_and_grad(loss)(w, x)
    out.append(torch.equal(gw, torch.zeros_like(w)))
    _, (gw, gx) = fs.value_and_grad(loss, argnums=(0, 1))(w, x)
    out.append(torch.equal(gw, torch.zeros_like(w)) and torch.allclose(gx, want_x))
    gw, gx = torch.func.grad(lambda w, x: fs.gather(loss(w, x)), argnums=(0, 1))(w, x)
    out.append(torch.equal(gw, torch.zeros_like(w)) and torch.allclose(gx, want_x))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb"])
def test_stages_passing_their_input_on(world2, schedule):
    assert world2.run(untouched_stage_rank_fn, schedule) == [[True, True, True]] * 2


#: stage functions with grad transforms of their own, over what they are given or make
_OWN_TRANSFORMS = {
    "vjp": lambda w, x: torch.func.vjp(lambda h: h.sin(), w * x)[0],
    "vjp of a param": lambda w, x: torch.func.vjp(lambda v: v * x, w)[0],
    "vjps chained": lambda w, x: torch.func.vjp(
        lambda h: h.sin(), torch.func.vjp(lambda h: h * w, x)[0]
    )[0],
    "vjp_fn after the vjp": lambda w, x: (
        x * w + torch.func.vjp(lambda h: h * h, x * w)[1](torch.ones_like(x))[0]
    ),
    "grad": lambda w, x: x * w + torch.func.grad(lambda h: (h * h).sum())(x * w),
    "remat": lambda w, x: fs.remat(lambda h: (h * w).sin())(x),
    "vmap": lambda w, x: torch.vmap(lambda r: r * w[0])(x),
    "a constant in a vjp": lambda w, x: torch.func.vjp(lambda h: h * _K, w * x)[0],
    "a constant, detached, as a vjp's primal": lambda w, x: (
        w * x * torch.func.vjp(lambda k: k * 2, _K.detach())[0]
    ),
}
_K = torch.tensor([1.5])


def own_transforms_rank_fn():
    """``stage_fn`` running grad transforms of its own (``torch.func.vjp`` / ``grad``,
    ``fs.remat``, ``vmap``) on its arguments and what it computes: each gradient equal to the
    dense one under ``fs.value_and_grad`` and ``torch.func.grad``. Under ``torch.func.grad``
    their levels reuse the outer one's number, which the closed-over-value check reads; the
    ``vjp_fn`` called after its vjp returned met a wrapper of a level no longer live and was
    refused as a closed-over value before the check read dead wrappers."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w, x = torch.tensor([[2.0], [3.0]]), torch.arange(4.0).reshape(4, 1) + 1
    out = {}
    for name, stage in _OWN_TRANSFORMS.items():

        def dense(w, stage=stage):
            y = x
            for i in range(2):
                y = stage(w[i], y)
            return y.sum() / 4  # the pipeline's loss: the microbatches' mean

        def run(w, stage=stage):
            return pipeline(stage, w, x, mesh, loss_fn=lambda _, y, t: (y * t).sum(),
                            targets=torch.ones(4, 1), schedule="1f1b")  # fmt: skip

        want = torch.func.grad(dense)(w)
        got_vg = fs.value_and_grad(run)(w)[1]
        got_func = torch.func.grad(lambda w: fs.gather(run(w)))(w)
        out[name] = torch.allclose(got_vg, want) and torch.allclose(got_func, want)
    return out


@pytest.mark.timeout(120)
def test_a_stages_own_transforms_equal_dense(world2):
    got = world2.run(own_transforms_rank_fn)
    assert got == [dict.fromkeys(_OWN_TRANSFORMS, True)] * 2


class _Passes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the stacks and products whose result has one of ``shapes``."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.seen = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("cat", "stack", "mul", "mul_") and tuple(out.shape) in self.shapes:
            self.seen.append(name)
        return out


def rowwise_gradients_rank_fn():
    """A stacked stage weight whose layers are indexed (``w[i]``) gets its gradient stacked
    once, within the schedule, and not scaled by a cotangent of 1 (was stacked in the
    forward and multiplied by the cotangent in the backward: two passes over every stage
    gradient); with another cotangent it is scaled, and a second backward of a retained graph
    adds the same again. On the first stage, whose backwards await their cotangents, the rows
    are stacked before its last backward (``_Stacked.stack_rows``: its rows' gradients then
    views of the stack, the last backward adding into it); on the last stage at the
    schedule's end, while the loss's sum over the stages is awaited (was in the Function's
    backward, after that wait)."""
    mesh = fs.Mesh.create((2,), ("pp",))
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(2, 2, 3, 3, generator=gen) / 2  # 2 stages of 2 layers
    x, tgt = torch.randn(4, 2, 3, generator=gen), torch.randn(4, 2, 3, generator=gen)

    def stage(w, x):
        for i in range(2):
            x = torch.tanh(x @ w[i])
        return x

    def loss_fn(_, y, t):
        return ((y - t) ** 2).sum()

    def run(w):
        return fs.gather(pipeline(stage, w, x, mesh, loss_fn=loss_fn, targets=tgt,
                                  schedule="1f1b"))  # fmt: skip

    def dense(w):
        ys = [stage(w[1], stage(w[0], x[k])) for k in range(4)]
        return sum(loss_fn(None, y, tgt[k]) for k, y in enumerate(ys)) / 4

    want = torch.func.grad(dense)(w)
    passes = _Passes({(2, 3, 3), (1, 2, 3, 3)})
    with passes:
        _, grad = fs.value_and_grad(run)(w)
    torch.testing.assert_close(grad, want, **TOL)
    assert passes.seen == ["stack"], passes.seen  # the rows stacked once, nothing multiplied
    passes = _Passes({(2, 3, 3), (1, 2, 3, 3)})
    leaf, early, stack_rows = w.clone().requires_grad_(), [], _Stacked.stack_rows

    def counted(self):
        stack_rows(self)
        early.append(getattr(self, "rows_in", None) is not None)

    _Stacked.stack_rows = counted
    try:
        with passes:
            out = run(leaf)
            in_schedule = list(passes.seen)
            out.backward()
    finally:
        _Stacked.stack_rows = stack_rows
    torch.testing.assert_close(leaf.grad, want, **TOL)
    assert passes.seen == ["stack"], passes.seen
    # under torch.func.grad the cotangent is the transform's wrapper: read as any cotangent
    torch.testing.assert_close(torch.func.grad(run)(w), want, **TOL)
    leaf = w.clone().requires_grad_()
    out = run(leaf)
    out.backward(torch.tensor(3.0), retain_graph=True)
    torch.testing.assert_close(leaf.grad, 3 * want, **TOL)
    out.backward(torch.tensor(3.0))
    torch.testing.assert_close(leaf.grad, 6 * want, **TOL)
    return in_schedule, early


@pytest.mark.timeout(120)
def test_rowwise_stage_gradients_are_stacked_once(world2):
    assert world2.run(rowwise_gradients_rank_fn) == [(["stack"], [True]), (["stack"], [])]


class _PpermuteBlocks(fs.lax.Handler):
    """Sees each ppermute's perm and the sizes of the block passed and the block got."""

    def __init__(self):
        self.seen = []

    def process(self, b, x, done, proceed):
        out = proceed(b, x, done)
        if b.op.name == "ppermute":
            self.seen.append((b.op.perm, x.numel(), out.numel()))
        return out


def _square_error(_, y, t):
    return ((y - t) ** 2).sum()


def _tanh_chain(pp: int, m: int, seed: int):
    """``pp`` stages ``tanh(x @ w[s])`` over ``m`` microbatches of (2, 3): ``(w, x, tgt,
    dense)``, ``dense(w)`` the mean squared error of the whole chain in one process."""
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(pp, 3, 3, generator=gen) / 2, torch.randn(m, 2, 3, generator=gen)
    tgt = torch.randn(m, 2, 3, generator=gen)

    def dense(w):
        total = 0
        for k in range(m):
            y = x[k]
            for s in range(pp):
                y = torch.tanh(y @ w[s])
            total = total + _square_error(None, y, tgt[k])
        return total / m

    return w, x, tgt, dense


def remat_around_rank_fn(schedule):
    """``fs.remat`` around the whole pipelined loss (its forward recomputed in the backward,
    under ``torch.func.vjp``: the schedule runs again there, its transfers synchronous): the
    dense value and gradient. Was a ``TypeError: 'NoneType' object is not iterable`` from the
    loss's sum over the stages, whose backward met a cotangent wrapped by the recompute's
    level while the interpreter stack was cleared (``_function.untracked``)."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w, x, tgt, dense = _tanh_chain(2, 4, seed=3)

    def loss(w):
        return pipeline(lambda w, x: torch.tanh(x @ w), w, x, mesh, loss_fn=_square_error,
                        targets=tgt, schedule=schedule)  # fmt: skip

    value, grad = fs.value_and_grad(fs.remat(loss))(w)
    want_value, want_grad = torch.func.grad_and_value(dense)(w)[::-1]
    return torch.allclose(value, want_value, **TOL) and torch.allclose(grad, want_grad, **TOL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_remat_around_the_pipeline(world2, schedule):
    assert world2.run(remat_around_rank_fn, schedule) == [True, True]


def autocast_rank_fn():
    """Under ``torch.autocast`` a stage computes in bfloat16 and returns a bfloat16 activation
    where the pipeline's transfers carry float32 (its input's dtype): refused, the error now
    saying autocast did it and what to do; the stage that returns ``.to(x.dtype)`` (one of the
    fixes it names) gives dense autocast's loss and gradient (the casts are exact both ways)."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w, x, tgt, _ = _tanh_chain(2, 4, seed=5)

    def loss(w, cast):
        def stage(w, x):
            y = torch.tanh(x @ w)
            return y.to(x.dtype) if cast else y

        return pipeline(stage, w, x, mesh, loss_fn=lambda _, y, t: ((y.float() - t) ** 2).sum(),
                        targets=tgt, schedule="1f1b")  # fmt: skip

    def dense(w):
        total = 0
        for k in range(4):
            y = x[k]
            for s in range(2):
                y = torch.tanh(y @ w[s])
            total = total + ((y.float() - tgt[k]) ** 2).sum()
        return total / 4

    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value, grad = fs.value_and_grad(loss)(w, True)
        want_grad, want_value = torch.func.grad_and_value(dense)(w)
        # (the microbatches' sums in another order: not bitwise)
        out.append(
            torch.allclose(value, want_value, **TOL) and torch.allclose(grad, want_grad, **TOL)
        )
        try:  # last: the failing stage gives the group up
            fs.value_and_grad(loss)(w, False)
        except (ValueError, fs.mesh.PeerFailed) as e:
            out.append((type(e).__name__, "torch.autocast is on" in str(e)))
    return out


@pytest.mark.timeout(120)
def test_autocast_is_named_in_the_dtype_refusal(world2):
    assert world2.run(autocast_rank_fn) == [[True, ("ValueError", True)],
                                            [True, ("PeerFailed", True)]]  # fmt: skip


def exchange_blocks_rank_fn(schedule):
    """A tick's ppermute takes an empty block from a rank that sends nothing and gives one to
    a rank that receives nothing (no zero-filled activation either way), with the loss,
    gradients and the bytes on the wire (the comm log) as before."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w, x, tgt, dense = _tanh_chain(2, 4, seed=7)

    def loss(w):
        return pipeline(lambda w, x: torch.tanh(x @ w), w, x, mesh, loss_fn=_square_error,
                        targets=tgt, schedule=schedule)  # fmt: skip

    blocks = _PpermuteBlocks()
    with fs.debug.comm_log() as log, fs.lax.handling(blocks):
        value, grad = fs.value_and_grad(loss)(w)
    torch.testing.assert_close(value, dense(w), **TOL)
    torch.testing.assert_close(grad, torch.func.grad(dense)(w), **TOL)
    me = mesh.rank
    # 4 activations and 4 cotangents, then the loss's parts swapped (one float32 each way)
    assert len(blocks.seen) == 9
    assert blocks.seen[8] == (((0, 1), (1, 0)), 1, 1)
    for perm, passed, got in blocks.seen[:8]:
        assert passed == (6 if any(s == me for s, _ in perm) else 0), (perm, passed)
        assert got == (6 if any(d == me for _, d in perm) else 0), (perm, got)
    wire = [r.nbytes for r in log if r.op == "ppermute"]
    sends = [any(s == me for s, _ in perm) for perm, _, _ in blocks.seen[:8]]
    assert wire == [24 if sent else 0 for sent in sends] + [4]
    return sum(sends)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_exchanges_pass_empty_blocks_where_nothing_moves(world2, schedule):
    assert world2.run(exchange_blocks_rank_fn, schedule) == [4, 4]


def waits_rank_fn(schedule):
    """The executor leaves its transfers on the wire: a tick's ppermutes are launched
    (``fs.lax.apply_start``, in table order), a received activation or cotangent is waited for
    (``.result()``) only at the tick that uses it, and the sends are waited for (``.wait()``)
    only after the last launch, all complete when the call returns; the loss, gradients and
    comm log as before. Was: each ppermute waited for its sends and receives at its tick, so
    the sender waited each tick for its peer to finish that tick. Each receive is posted as
    its tick begins, before the rank's action of the tick (``_comm.receive_ahead``), and its
    ppermute gets it (``ahead=``): was posted by the ppermute, after the action. The loss's
    parts are exchanged after the schedule, in 3 cyclic shifts (ppermutes), their receives
    posted as the last tick begins, and taken last (was an all_reduce, before that
    ``lax.psum`` after the call)."""
    mesh = fs.Mesh.create((4,), ("pp",))
    me = mesh.rank
    w, x, tgt, dense = _tanh_chain(4, 8, seed=11)

    def loss(w):
        return pipeline(lambda w, x: torch.tanh(x @ w), w, x, mesh, loss_fn=_square_error,
                        targets=tgt, schedule=schedule)  # fmt: skip

    events, launched = [], []
    shifts = {tuple((i, (i + k) % 4) for i in range(4)): k for k in (1, 2, 3)}  # perm -> k
    Pending, start, post = fs._comm.Pending, fs.lax.apply_start, fs._comm.receive_ahead
    real = Pending.result, Pending.wait

    def apply_start(b, x, ahead=None):
        p = start(b, x, ahead)
        if b.op.name != "ppermute" or b.op.perm in shifts:  # not a transfer
            events.append(("loss part", b.op.name, shifts.get(b.op.perm), ahead is not None))
            return p
        sends = any(src == me for src, _ in b.op.perm)
        events.append(("launch", sends, ahead is not None))
        launched.append((p, sends))
        return p

    def receive_ahead(*args):
        events.append("post")
        return post(*args)

    def result(self):
        events.append("result")
        return real[0](self)

    def wait(self):
        events.append("wait")
        Pending.result = real[0]  # wait's own result() is not a use
        try:
            return real[1](self)
        finally:
            Pending.result = result

    fs.lax.apply_start, Pending.result, Pending.wait = apply_start, result, wait
    fs._comm.receive_ahead = receive_ahead
    try:
        with fs.debug.comm_log() as log:
            value, grad = fs.value_and_grad(loss)(w)
    finally:
        fs.lax.apply_start, fs._comm.receive_ahead = start, post
        Pending.result, Pending.wait = real
    torch.testing.assert_close(value, dense(w), **TOL)
    torch.testing.assert_close(grad, torch.func.grad(dense)(w), **TOL)
    sched = pipeline_schedule(schedule, 4, 8)
    want, last = [], sched.stages - 1
    for t, row in enumerate(sched.table):
        a = row[me]
        for kind in "FB":  # the tick's receives, posted before its action
            pairs, dests = sched.transfers[kind][t]
            if pairs and me in dests:
                want.append("post")
        if t == len(sched.table) - 1:  # the loss's parts, one from each other rank
            want += ["post"] * 3
        if a is not None and (a.kind == "F" and a.stage > 0 or a.kind == "B" and a.stage < last):
            want.append("result")  # its input, at the tick that uses it
        for kind in "FB":
            pairs, dests = sched.transfers[kind][t]
            if pairs:
                want.append(("launch", any(src == me for src, _ in pairs), me in dests))
    # the loss's parts, each rank's to every other (shift k from rank i to i + k), received
    # where they were posted
    want += [("loss part", "ppermute", k, True) for k in (1, 2, 3)]
    uses = [e for e in events if e != "wait"]
    assert uses == want, (uses, want)
    assert events[-3:] == ["wait"] * 3  # the parts taken last, sends and receives
    waits = [i for i, e in enumerate(events) if e == "wait"]
    launches = [i for i, e in enumerate(events) if e != "wait" and e[0] == "launch"]
    assert not waits or min(waits) > max(launches)  # no send waited for within the ticks
    assert all(p.sent() for p, _ in launched)
    sends = [sent for p, sent in launched]
    wire = [r.nbytes for r in log if r.op == "ppermute"]
    assert wire == [24 if sent else 0 for sent in sends] + [4] * 3  # a float32 a shift
    return sum(sends)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_transfers_are_waited_where_used(world4, schedule):
    assert world4.run(waits_rank_fn, schedule) == [8, 16, 16, 8]


def test_bad_arguments_raise_before_any_collective():
    """On an abstract mesh (no process group): every check runs before communication."""
    mesh = fs.Mesh.abstract((2,), ("pp",))
    w, x = torch.ones(2, 3), torch.ones(4, 3)

    def call(**kw):
        args = {"stage_params": w, "microbatches": x, "loss_fn": lambda _, y, t: y.sum()}
        args.update(kw)
        sp, mb = args.pop("stage_params"), args.pop("microbatches")
        return pipeline(lambda p, x: p * x, sp, mb, mesh, **args)

    with pytest.raises(ValueError, match="schedule must be one of"):
        call(schedule="dualpipe")
    with pytest.raises(ValueError, match="microbatches=3.*multiple of 2"):
        call(schedule="interleaved", virtual=2, stage_params=torch.ones(4, 3), microbatches=x[:3])
    with pytest.raises(ValueError, match="stage_params leaf 0 .* 2 stages"):
        call(stage_params=torch.ones(3, 3))
    with pytest.raises(ValueError, match="stage_params leaf 0 .* 4 stages"):
        call(schedule="interleaved", virtual=2)
    with pytest.raises(ValueError, match="virtual=2.*interleaved"):
        call(virtual=2, stage_params=torch.ones(4, 3))
    with pytest.raises(ValueError, match="virtual=1.*virtual >= 2"):
        call(schedule="interleaved")
    with pytest.raises(ValueError, match="targets leaf 0 .* 4 microbatches"):
        call(targets=torch.ones(3))
    with pytest.raises(ValueError, match="mesh .* axis 'pp'"):
        pipeline(lambda p, x: x, w, x, fs.Mesh.abstract((2,), ("dp",)), loss_fn=lambda *a: 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline_schedule("GPipe", 2, 4)


# -- the call: a GPT trained on pp=2 ------------------------------------------------------------

_BLOCK = [n for n, _ in demo.Block(CFG).named_parameters()]
_HEAD = ["ln_f.weight", "ln_f.bias", "head.weight"]


def _to_tree(named: dict, stages: int, pp: int) -> dict:
    """The module's named params as the pipeline's pytree: embeddings, the blocks stacked
    ``(stages, blocks per stage, ...)`` in :func:`stage_order`, final norm and head."""
    per = CFG.n_layers // stages
    order = stage_order(pp, stages // pp)

    def stage(s, n):
        return torch.stack([named[f"blocks.{s * per + i}.{n}"] for i in range(per)])

    return {
        "emb": {n: named[n] for n in ("embed.tok.weight", "embed.pos.weight")},
        "stages": {n: torch.stack([stage(s, n) for s in order]) for n in _BLOCK},
        "head": {n: named[n] for n in _HEAD},
    }


def _from_tree(tree: dict, stages: int, pp: int) -> dict:
    per = CFG.n_layers // stages
    named = {**tree["emb"], **tree["head"]}
    for row, s in enumerate(stage_order(pp, stages // pp)):
        for n in _BLOCK:
            for i in range(per):
                named[f"blocks.{s * per + i}.{n}"] = tree["stages"][n][row][i]
    return named


def _stage_fn(block):
    def stage(params, x):
        for i in range(next(iter(params.values())).shape[0]):
            x = fs.nn.functional_call(block, {n: v[i] for n, v in params.items()}, (x,))
        return x

    return stage


def _head_loss(hp, y, target):
    h = F.layer_norm(y, (CFG.d_model,), hp["ln_f.weight"], hp["ln_f.bias"])
    logits = F.linear(h, hp["head.weight"])
    return F.cross_entropy(logits.reshape(-1, CFG.vocab), target.reshape(-1))


def _remat_fsdp_stage_fn(block, mesh):
    """Each block by ``fs.nn.fsdp_call`` (its params gathered over dp just before use) under
    ``fs.remat``: as a user composes them by hand, the mesh closed over the one given to the
    pipeline (the recompute gathers again, inside the pipeline's shard_map over pp)."""
    one = fs.remat(lambda p, x: fs.nn.fsdp_call(block, p, (x,), mesh=mesh, axis="dp"))

    def stage(params, x):
        for i in range(next(iter(params.values())).shape[0]):
            x = one({n: v[i] for n, v in params.items()}, x)
        return x

    return stage


def _fsdp_call_stage_fn(block, mesh):
    """Each block by ``fs.nn.fsdp_call`` (one FSDP unit: its params gathered over dp, packed,
    just before use and again in the backward)."""

    def stage(params, x):
        for i in range(next(iter(params.values())).shape[0]):
            x = fs.nn.fsdp_call(block, {n: v[i] for n, v in params.items()}, (x,), mesh=mesh, axis="dp")  # fmt: skip
        return x

    return stage


def _pp_loss(mesh, block, schedule, virtual, remat_fsdp=False):
    if remat_fsdp == "fsdp_call":
        stage = _fsdp_call_stage_fn(block, mesh)
    else:
        stage = _remat_fsdp_stage_fn(block, mesh) if remat_fsdp else _stage_fn(block)

    def loss(params, tokens, targets):
        t = tokens.shape[-1]
        x = (
            F.embedding(tokens, params["emb"]["embed.tok.weight"])
            + params["emb"]["embed.pos.weight"][:t]
        )
        return pipeline(
            stage, params["stages"], x, mesh, loss_fn=_head_loss,
            loss_params=params["head"], targets=targets, schedule=schedule, virtual=virtual,
        )  # fmt: skip

    return loss


def _batches():
    data = demo.load_corpus()
    gen = torch.Generator().manual_seed(SEED + 1)
    return [demo.get_batch(data, BATCH, CFG.ctx, gen) for _ in range(STEPS)]


def _microbatches(batch):
    mb = batch.reshape(M, BATCH // M, CFG.ctx + 1)
    return mb[..., :-1], mb[..., 1:]


def _tx():
    # eps 1e-6, not 1e-8: some gradient entries are ~1e-10, where summation-order rounding
    # (1e-9 here) would otherwise turn into updates of size lr (Adam divides by |g|)
    return fs.optim.adamw(1e-2, eps=1e-6, weight_decay=0.1)


@functools.cache
def dense_run():
    """The dense module, 3 AdamW steps on the whole batch, in one process."""
    torch.manual_seed(SEED)
    model = demo.GPT(CFG)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = _tx()
    state = tx.init(params)
    gv = torch.func.grad_and_value(demo.dense_loss)
    losses, first = [], None
    for batch in _batches():
        grads, loss = gv(params, model, batch)
        first = grads if first is None else first
        updates, state = tx.update(grads, state, params)
        params = fs.optim.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, first, params


def _specs(tree: dict, tp: bool) -> dict:
    """Each leaf's layout: stages over pp on dim 0 (then Megatron's tp plan), the rest
    replicated (the head column-parallel with tp)."""
    plan = demo.gpt_plan("tp") if tp else {}

    def tp_spec(name):
        hit = [s for g, s in plan.items() if fnmatch.fnmatchcase(name, g)]
        return tuple(hit[0].dims) if hit else ()

    out = {"emb": {n: fs.P() for n in tree["emb"]}}
    out["stages"] = {n: fs.P("pp", None, *tp_spec(f"blocks.0.{n}")) for n in tree["stages"]}
    out["head"] = {n: fs.P(*tp_spec(n)) for n in tree["head"]}
    return out


def _map(fn, tree: dict) -> dict:
    return {g: {n: fn(v) for n, v in d.items()} for g, d in tree.items()}


def _layouts(tree: dict) -> dict:
    return _map(lambda v: v.layout, tree)


def pipeline_rank_fn(
    axes, schedule, virtual, use_func_grad=False, fsdp=False, remat=False, logged=False
):
    """3 AdamW steps of the demo GPT pipelined over ``axes``: the losses, the first step's
    gradients and the trained params as dense names (with ``logged``, also the first step's
    collectives: ``(op, axes, bytes)``); ``remat``: True (each block by fsdp_call under
    fs.remat), ``"fsdp_call"`` (by fsdp_call) or False (by functional_call)."""
    shape = (2,) if len(axes) == 1 else (2, 2)
    mesh = fs.Mesh.create(shape, axes)
    stages = 2 * virtual
    torch.manual_seed(SEED)
    model = demo.GPT(CFG)
    named = {k: v.detach().clone() for k, v in model.named_parameters()}
    tree = _to_tree(named, stages, 2)
    specs = _specs(tree, tp="tp" in axes)
    params = {g: {n: fs.shard(t, mesh, specs[g][n]) for n, t in d.items()} for g, d in tree.items()}
    # fs.parallel.stack_stages lays the module's blocks out the same way
    plan = demo.gpt_plan("tp") if "tp" in axes else None
    if fsdp:  # ZeRO-3 stage weights: each block's params split over dp on their dim 0 too
        plan = {"blocks.*": fs.P("dp")}
    stacked = stack_stages(named, mesh, prefix="blocks", plan=plan, virtual=virtual)
    if fsdp:
        assert all(v.spec == fs.P("pp", None, "dp") for v in stacked.values())
    else:
        assert {n: v.layout for n, v in stacked.items()} == _layouts(params)["stages"]
        for n, v in stacked.items():
            assert torch.equal(v.local, params["stages"][n].local), n
    params["stages"] = stacked
    layouts = _layouts(params)
    loss_fn = _pp_loss(mesh, model.blocks[0], schedule, virtual, remat_fsdp=remat)
    tx = _tx()
    state = tx.init(params)
    batch_spec = fs.P(None, "dp") if "dp" in axes else fs.P()
    losses, first, records = [], None, None
    for batch in _batches():
        tokens, targets = (fs.shard(t, mesh, batch_spec) for t in _microbatches(batch))
        with fs.debug.comm_log() as log:
            if use_func_grad:
                grads, loss = torch.func.grad_and_value(
                    lambda p, x=tokens, y=targets: fs.gather(loss_fn(p, x, y))
                )(params)
            else:
                loss, grads = fs.value_and_grad(loss_fn)(params, tokens, targets)
        if records is None:
            records = [(r.op, r.axes, r.nbytes) for r in log]
        assert _layouts(grads) == layouts  # the params' layouts kept
        first = _map(fs.gather, grads) if first is None else first
        updates, state = tx.update(grads, state, params)
        params = fs.optim.apply_updates(params, updates)
        assert _layouts(params) == layouts
        losses.append(float(loss))
    trained = _from_tree(_map(fs.gather, params), stages, 2)
    if logged:
        return losses, _from_tree(first, stages, 2), trained, records
    return losses, _from_tree(first, stages, 2), trained


def _assert_dense(result):
    want_losses, want_grads, want_params = dense_run()
    losses, grads, params = result
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert want_losses[-1] < want_losses[0]  # it trains
    for k in want_params:
        torch.testing.assert_close(grads[k], want_grads[k], **TOL, msg=k)
        torch.testing.assert_close(params[k], want_params[k], **TOL, msg=k)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]
)
def test_gpt_pp2_trains_as_dense(world2, schedule, virtual):
    results = world2.run(pipeline_rank_fn, ("pp",), schedule, virtual)
    assert results[0][0] == results[1][0]  # every rank returns the same loss
    _assert_dense(results[0])


@pytest.mark.timeout(600)
def test_gpt_pp2_under_torch_func_grad(world2):
    results = world2.run(pipeline_rank_fn, ("pp",), "1f1b", 1, True)
    _assert_dense(results[0])


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "other,schedule,virtual,fsdp",
    [("dp", "zb", 1, False), ("tp", "interleaved", 2, False), ("dp", "1f1b", 1, True)],
)
def test_gpt_pp2_composes_on_4_ranks(world4, other, schedule, virtual, fsdp):
    """pp x dp, pp x tp, and pp x FSDP (stage weights split over dp too: the op rules gather
    them per use and reduce-scatter their gradients)."""
    results = world4.run(pipeline_rank_fn, ("pp", other), schedule, virtual, False, fsdp)
    for r in results:
        _assert_dense(r)


@pytest.mark.timeout(900)
def test_remat_of_fsdp_call_in_stages_matches_dense(world4):
    """pp x FSDP composed by hand: each stage's blocks by fs.nn.fsdp_call under fs.remat,
    given the pipeline's mesh (a collective over dp, an axis the pipeline's shard_map leaves
    automatic, in the recompute: its tracker pcast the param's block over dp first, so the
    gathered weights' gradients were reduce-scattered and then summed over dp again)."""
    results = world4.run(pipeline_rank_fn, ("pp", "dp"), "1f1b", 1, False, True, True)
    for r in results:
        _assert_dense(r)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_fsdp_call_in_stages_reduce_scatters_once_per_step(world4, schedule):
    """pp x FSDP composed by hand, each block one fs.nn.fsdp_call unit: equal to dense, and
    FSDP2's granularity on the wire under PP (issue 36 item 5; torchtitan's
    reshard_after_forward=False): per block ONE packed all_gather of its shards a step (the
    pipeline's step-mode gradient sync keeps the gathered weights for every microbatch's forward
    and backward; was one per block and microbatch in the forward and one in the backward,
    2 blocks x 4 x 2), and per step ONE reduce_scatter of the stage's whole weight gradients
    (the sync accumulates each gathered param's gradient over the microbatches; was one
    reduce_scatter per param per microbatch: 2 blocks x 4 params x 4)."""
    results = world4.run(pipeline_rank_fn, ("pp", "dp"), schedule, 1, False, True, "fsdp_call", True)  # fmt: skip
    block = sum(p.numel() * 4 for p in demo.GPT(CFG).blocks[0].parameters())  # full bytes
    per_stage = CFG.n_layers // 2
    for *result, records in results:
        _assert_dense(result)
        dp = [(op, b) for op, axes, b in records if axes == ("dp",) and op != "all_reduce"]
        gathers = [b for op, b in dp if op == "all_gather"]
        assert gathers == [block // 2] * per_stage, gathers
        assert [b for op, b in dp if op == "reduce_scatter"] == [per_stage * block]
        assert {op for op, _ in dp} == {"all_gather", "reduce_scatter"}


def test_parallelize_fsdp_x_pp_step_bytes_on_a_simulated_mesh():
    """parallelize(pp=2, dp_shard=2) on a transformers Llama (2 layers, 2 microbatches), one
    fs.value_and_grad + AdamW step on the abstract mesh (the dry run's collectives are
    fs.debug.comm_log's): over dp_shard, each rank's collectives at FSDP2's granularity under
    PP (torchtitan's reshard_after_forward=False). ONE packed all_gather per unit a step (the
    stage's layer; on the first stage the embedding, on the last the norm and the head, each
    called alone), kept for every microbatch's forward and backward; ONE reduce_scatter of the
    stage's whole params (its layer, and the embedding on the first stage, the norm and head on
    the last) after the schedule. The embedding is the pipeline's input_fn, on the first
    stage only: the last stage neither gathers it nor reduce-scatters its gradient (it did
    while the embedding ran before the pipeline on every pp rank). Was: a
    reduce_scatter per param per microbatch and a gather per param (here stage 0: 37
    all_gathers and 19 reduce_scatters, 328,704 bytes), then a gather per unit and microbatch
    in the forward and again in the backward (stage 0: 5 all_gathers, 16,384 + 4 x 73,984 =
    312,320 bytes); now 2 all_gathers, 16,384 + 73,984 = 90,368 bytes (this rank's halves of
    the embedding and of its layer), and ONE reduce_scatter (180,736 bytes: the embedding's
    and the layer's, packed; were 2)."""
    import transformers

    transformers.logging.set_verbosity_error()
    dims = fs.parallel.ParallelDims(dp_shard=2, pp=2, pp_microbatches=2)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, vocab_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    full = {n: p.numel() * 4 for n, p in model.named_parameters()}  # fp32 bytes

    def init(m):
        params, loss = fs.parallel.parallelize(model, m, dims)
        opt = fs.optim.adamw(1e-3)
        ids = torch.zeros((8, 16), dtype=torch.long, device="meta")
        return params, opt.init(params), {"input_ids": ids}, loss, opt

    def step(params, opt_state, batch, loss, opt):
        _, grads = fs.value_and_grad(loss)(params, batch)
        return fs.optim.step(opt, grads, opt_state, params)

    report = fs.dry_run(step, init, dims.abstract_mesh(), backend="gloo")
    assert [c.ranks for c in report.classes] == [(0, 1), (2, 3)]
    embed = full["model.embed_tokens.weight"]
    for stage, c in enumerate(report.classes):
        layer = sum(b for n, b in full.items() if n.startswith(f"model.layers.{stage}."))
        ends = [full["model.norm.weight"], full["lm_head.weight"]] if stage else [embed]
        units = [layer, *ends]
        dp = [(r.op, r.nbytes) for r in c.collectives if r.axes == ("dp_shard",)]
        gathers = sorted(b for op, b in dp if op == "all_gather")
        assert gathers == sorted(u // 2 for u in units), stage
        scatters = sorted(b for op, b in dp if op == "reduce_scatter")
        assert scatters == [sum(units)], stage
        assert len(dp) == len(gathers) + len(scatters)
        if stage == 0:
            assert (sum(gathers), sum(scatters)) == (90_368, 180_736)


def transforms_rank_fn():
    """y = w1 * w0 * x per microbatch, loss mean(y^2): every schedule, no grad / grad /
    .backward() against the closed form; higher derivatives, jvp and vmap refused."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w = torch.tensor([[2.0], [3.0]])
    x = torch.arange(4.0).reshape(4, 1)
    xs = (x**2).mean()

    def run(w, schedule="1f1b", stage=lambda w, x: w * x):
        loss = pipeline(stage, w, x, mesh, loss_fn=lambda _, y, t: (y * y).sum(),
                        schedule=schedule)  # fmt: skip
        return fs.gather(loss)

    want_g = torch.tensor([[2 * w[0, 0] * w[1, 0] ** 2], [2 * w[1, 0] * w[0, 0] ** 2]]) * xs
    for schedule in ("gpipe", "1f1b", "zb"):
        assert torch.allclose(run(w, schedule), (w.prod() ** 2) * xs)
        with fs.debug.comm_log() as log:
            assert torch.allclose(torch.func.grad(run)(w, schedule), want_g)
        # one ppermute per tick and direction that sends (activations forward, cotangents
        # back), then the loss's parts swapped (one float32 each way)
        moves = pipeline_schedule(schedule, 2, 4).transfers
        ticks = zip(moves["F"], moves["B"])
        pairs = [p for tick in ticks for p, _ in tick if p]  # in tick order, F before B
        sends = [4 if any(src == mesh.rank for src, _ in p) else 0 for p in pairs]
        assert [r.nbytes for r in log if r.op == "ppermute"] == sends + [4]
        assert sum(sends) == 4 * 4  # 4 microbatches, one float each way
        leaf = w.clone().requires_grad_()
        run(leaf, schedule).backward()
        assert torch.allclose(leaf.grad, want_g)
    # remat and vmap inside a stage
    remat = fs.remat(lambda w, x: w * x)
    mapped = lambda w, x: torch.vmap(lambda xi: w[0] * xi)(x)  # noqa: E731
    for stage in (remat, mapped):
        for schedule in ("1f1b", "zb"):
            assert torch.allclose(torch.func.grad(run)(w, schedule, stage), want_g)
    refused = []
    for f in (
        lambda: torch.func.grad(lambda w: torch.func.grad(run)(w).sum())(w),
        lambda: torch.func.jvp(run, (w,), (torch.ones_like(w),)),
        lambda: torch.func.vmap(run)(torch.stack([w, w])),
        lambda: torch.func.hessian(run)(w),
    ):
        with pytest.raises(NotImplementedError, match="differentiable once in reverse mode"):
            f()
        refused.append(True)
    return refused


@pytest.mark.timeout(300)
def test_transforms_compose_or_refuse(world2):
    assert world2.run(transforms_rank_fn) == [[True] * 4] * 2


class _Probe(torch.autograd.Function):
    """The identity, counting its backward calls."""

    calls = 0

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        _Probe.calls += 1
        return g


def zb_weight_pass_rank_fn():
    """ZB-H1's W computes the weight gradients alone: a stage using one stacked weight in two
    layers (``probe(x @ w[0]) @ w[1]``) runs the probe's backward once per microbatch, as
    1F1B does (torch.distributed.pipelining's split, grouping by the shared weight, ran the
    stage's whole backward again in W: twice); gradients equal the closed form. pp=2: rank 1
    splits each backward into B and W; rank 0 (the first stage, its W right after its B and
    nothing to send) runs them as one backward. A vector weight's branch (a scale) is not
    deferred: its gradient comes with B, and equals 1F1B's."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w = torch.tensor([[2.0, 3.0], [0.5, 1.5]]).reshape(2, 2, 1, 1)
    x = torch.arange(4.0).reshape(4, 1, 1)
    xs = (x**2).mean()
    prod = w.prod()
    want_w = 2 * prod**2 / w * xs  # loss: mean over microbatches of (prod(w) x)^2

    def run(w, x, schedule):
        loss = pipeline(lambda w, x: _Probe.apply(x @ w[0]) @ w[1], w, x, mesh,
                        loss_fn=lambda _, y, t: (y * y).sum(), schedule=schedule)  # fmt: skip
        return fs.gather(loss)

    counts = []
    for schedule in ("1f1b", "zb"):
        _Probe.calls = 0
        gw, gx = torch.func.grad(run, (0, 1))(w, x, schedule)
        counts.append(_Probe.calls)
        torch.testing.assert_close(gw, want_w)
        torch.testing.assert_close(gx, 2 * prod**2 * x / 4)
    # a matrix weight's branch deferred to W, a vector weight's (a scale) computed in B
    gen = torch.Generator().manual_seed(3)
    mixed = {"w": torch.randn(2, 3, 3, generator=gen), "s": torch.randn(2, 3, generator=gen)}
    xm = torch.randn(4, 2, 3, generator=gen)

    def run_mixed(p, schedule):
        loss = pipeline(lambda p, x: _Probe.apply(torch.tanh(x @ p["w"])) * p["s"], p, xm,
                        mesh, loss_fn=lambda _, y, t: (y * y).sum(), schedule=schedule)  # fmt: skip
        return fs.gather(loss)

    got = {}
    for schedule in ("1f1b", "zb"):
        _Probe.calls = 0
        got[schedule] = torch.func.grad(run_mixed)(mixed, schedule)
        counts.append(_Probe.calls)
    torch.testing.assert_close(got["zb"], got["1f1b"])
    # a layer picked by an int index is a leaf (no select backward writing a zero stack per
    # use); a slice still differentiates through the stack, and the two gradients add up
    nodes = []

    def stage(w, x):
        nodes.append(w[0].grad_fn)
        return w[0] * x * w[1:].sum()

    for schedule in ("gpipe", "zb"):
        loss = lambda w, s=schedule: fs.gather(pipeline(stage, w, x, mesh, schedule=s,  # noqa: E731
                                                   loss_fn=lambda _, y, t: (y * y).sum()))  # fmt: skip
        torch.testing.assert_close(torch.func.grad(loss)(w), want_w)
    assert nodes == [None] * len(nodes) and nodes, nodes
    return counts


@pytest.mark.timeout(120)
def test_zb_weight_pass_does_not_rerun_the_backward(world2):
    assert world2.run(zb_weight_pass_rank_fn) == [[4, 4, 4, 4], [4, 4, 4, 4]]
    # which backwards run B and W as one: the first stage's (nothing to send, its W next)
    assert pipeline_schedule("zb", 2, 4)._joined == ({(0, mb) for mb in range(4)}, set())
    assert pipeline_schedule("zb", 1, 3)._joined == ({(0, mb) for mb in range(3)},)
    assert pipeline_schedule("1f1b", 2, 4)._joined == (set(), set())


def loss_params_only_rank_fn():
    """Only ``loss_params`` differentiated: the first stage's backward has nothing to compute
    (no stage weight, no input gradient) and is skipped, in every schedule (it raised: the
    stage's ``backward`` got no ``inputs``); gradients equal the closed form."""
    mesh = fs.Mesh.create((2,), ("pp",))
    w, x, h = torch.tensor([[2.0], [3.0]]), torch.arange(4.0).reshape(4, 1), torch.tensor([1.5])
    xs = (x**2).mean()
    for schedule in ("gpipe", "1f1b", "zb"):

        def run(h, w, schedule=schedule):
            loss = pipeline(lambda w, x: w * x, w, x, mesh, schedule=schedule, loss_params=h,
                            loss_fn=lambda h, y, t: (h * y * y).sum())  # fmt: skip
            return fs.gather(loss)

        torch.testing.assert_close(torch.func.grad(run)(h, w), w.prod() ** 2 * xs.reshape(1))
        gw = torch.func.grad(run, argnums=1)(h, w)  # and the stage weights alone, as before
        torch.testing.assert_close(gw, 2 * h * w.prod() ** 2 / w * xs)
    return True


@pytest.mark.timeout(120)
def test_loss_params_alone_differentiated(world2):
    assert world2.run(loss_params_only_rank_fn) == [True, True]


def one_rank_fn():
    """pp=1: every stage on the one rank (handed over locally, no ppermute)."""
    mesh = fs.Mesh.create((1,), ("pp",))
    w, x = torch.tensor([[2.0], [3.0]]), torch.arange(4.0).reshape(4, 1)
    xs = (x**2).mean()
    out = []
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        sp = w[:virtual]

        def run(w, schedule=schedule, virtual=virtual):
            loss = pipeline(lambda w, x: w * x, w, x, mesh, loss_fn=lambda _, y, t: (y * y).sum(),
                            schedule=schedule, virtual=virtual)  # fmt: skip
            return fs.gather(loss)

        with fs.debug.comm_log() as log:
            value, g = float(run(sp)), torch.func.grad(run)(sp)
        assert not [r for r in log if r.op == "ppermute"]
        want = sp.prod() ** 2 * xs
        assert value == pytest.approx(float(want))
        torch.testing.assert_close(g, 2 * want / sp)  # d/dw_i of (prod w)^2 * mean(x^2)
        out.append(schedule)
    with pytest.raises(ValueError, match=r"stage_fn must return its input's shape .*\(1,\)"):
        pipeline(lambda w, x: torch.cat([x, x]), w[:1], x, mesh, loss_fn=lambda _, y, t: y.sum())
    return out


@pytest.mark.timeout(120)
def test_one_pipeline_rank(world1):
    assert world1.run(one_rank_fn) == [["gpipe", "1f1b", "zb", "interleaved"]]


def dp_reduction_rank_fn():
    """pp=2 x dp=2, a 4-block residual MLP (rows split over dp, every weight replicated over
    dp): every schedule, 2 and 4 microbatches, against the dense loss and gradients, and the
    dp all_reduces of one step: the loss value's (on the last stage ONE float64 scalar, 8
    bytes, the microbatches' pending sums added locally first; was one float32 per microbatch)
    and one coalesced all_reduce of every stage weight's (and the head's) gradient."""
    mesh = fs.Mesh.create((2, 2), ("pp", "dp"))
    d = 8
    gen = torch.Generator().manual_seed(SEED)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) / d**0.5

    blocks = {"w": rnd(4, d, d), "b": rnd(4, d), "ln": 1 + rnd(4, d)}
    head, xs, ts = rnd(d, d), rnd(4, 4, d), rnd(4, 4, d)

    def block(p, x):
        return x + torch.tanh(F.linear(F.layer_norm(x, (d,), p["ln"]), p["w"], p["b"]))

    def stage(p, x):
        for i in range(p["w"].shape[0]):
            x = block({n: v[i] for n, v in p.items()}, x)
        return x

    def head_loss(h, y, t):
        return ((F.linear(y, h) - t) ** 2).mean()

    def dense(params, m):
        losses = [
            head_loss(params["head"], stage(params["blocks"], xs[k]), ts[k]) for k in range(m)
        ]
        return sum(losses) / m

    last = mesh.group("pp").index == 1
    out = []
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        stages = 2 * virtual
        order = stage_order(2, virtual)

        def stacked(t, stages=stages, order=order):  # (stages, blocks per stage, ...)
            return torch.stack([t.reshape(stages, 4 // stages, *t.shape[1:])[s] for s in order])

        params = {
            "blocks": {n: fs.shard(stacked(t), mesh, fs.P("pp")) for n, t in blocks.items()},
            "head": fs.shard(head, mesh, fs.P()),
        }
        for m in (2, 4):
            x, t = (fs.shard(v[:m], mesh, fs.P(None, "dp")) for v in (xs, ts))

            def loss(p, x=x, t=t, schedule=schedule, virtual=virtual):
                return pipeline(stage, p["blocks"], x, mesh, loss_fn=head_loss, loss_params=p["head"],
                                targets=t, schedule=schedule, virtual=virtual)  # fmt: skip

            with fs.debug.comm_log() as log:
                value, grads = fs.value_and_grad(loss)(params)
            want = {"blocks": blocks, "head": head}
            want_g, want_v = torch.func.grad_and_value(dense)(want, m)
            assert float(value) == pytest.approx(float(want_v), rel=1e-5)
            for n in blocks:
                got = fs.gather(grads["blocks"][n])
                torch.testing.assert_close(got, stacked(want_g["blocks"][n]), **TOL, msg=n)
            torch.testing.assert_close(fs.gather(grads["head"]), want_g["head"], **TOL)
            # this rank's 2 blocks of (d x d + 2 d) floats, and on the last stage the head's
            weight_bytes = 4 * (2 * (d * d + 2 * d) + (d * d if last else 0))
            dp = [r.nbytes for r in log if r.op == "all_reduce" and r.axes == ("dp",)]
            assert dp == [8] * last + [weight_bytes], (schedule, m, dp)
            out.append((schedule, m))
    return out


@pytest.mark.timeout(300)
def test_dp_weight_gradients_reduce_once_per_step(world4):
    want = [(s, m) for s in ("gpipe", "1f1b", "interleaved", "zb") for m in (2, 4)]
    assert world4.run(dp_reduction_rank_fn) == [want] * 4


def parts_stage_rank_fn():
    """pp 2 x tp 2: a gated MLP per block whose fused ``[gate | up]`` weight is split per part
    over tp (``fs.Parts``; the row-parallel down projection ``P(None, 'tp')``), stacked by
    ``stack_stages``, each stage's blocks picked by ``w[i]``. Per schedule: the loss and every
    gradient against dense torch.func, the layouts ``stage_fn`` saw and this rank's
    collectives over tp (op, bytes)."""
    mesh = fs.Mesh.create((2, 2), ("pp", "tp"))
    gen = torch.Generator().manual_seed(3)
    d, f, n, m = 4, 6, 4, 4  # hidden, each part's size, blocks, microbatches
    named = {}
    for b in range(n):
        named[f"blocks.{b}.gate_up"] = torch.randn(2 * f, d, generator=gen) / 4
        named[f"blocks.{b}.down"] = torch.randn(d, f, generator=gen) / 4
    xs, ts = torch.randn(m, 3, d, generator=gen), torch.randn(m, 3, d, generator=gen)
    plan = {"*.gate_up": fs.Parts(fs.P("tp", None), 0, (f, f)), "*.down": fs.P(None, "tp")}

    def block(w, x):
        gate, up = F.linear(x, w["gate_up"]).split(f, -1)
        return x + F.linear(F.silu(gate) * up, w["down"])

    def loss_fn(_, y, t):
        return ((fs.reshard(y, fs.P()) - t) ** 2).sum()

    def dense(ps):
        total = 0
        for k in range(m):
            y = xs[k]
            for b in range(n):
                y = block({"gate_up": ps[f"blocks.{b}.gate_up"], "down": ps[f"blocks.{b}.down"]}, y)
            total = total + ((y - ts[k]) ** 2).sum()
        return total / m

    want_g, want_v = torch.func.grad_and_value(dense)(named)
    out = []
    for schedule, virtual in (("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        stacked = stack_stages(named, mesh, prefix="blocks", plan=plan, virtual=virtual)
        seen = set()

        def stage(p, x, seen=seen):
            seen.add((str(p["gate_up"].spec), str(p["down"].spec)))
            for i in range(p["down"].shape[0]):
                x = block({k: v[i] for k, v in p.items()}, x)
            return fs.reshard(x, fs.P())

        def loss(p, schedule=schedule, virtual=virtual):
            return pipeline(stage, p, xs, mesh, loss_fn=loss_fn, targets=ts,
                            schedule=schedule, virtual=virtual)  # fmt: skip

        with fs.debug.comm_log() as log:
            value, grads = fs.value_and_grad(loss)(stacked)
        whole = {k: fs.gather(g) for k, g in grads.items()}
        got = unstack_stages(whole, prefix="blocks", pp=2, virtual=virtual)
        close = float(value) == pytest.approx(float(want_v), rel=1e-5) and all(
            float((got[k] - want_g[k]).abs().max()) < 1e-5 * float(want_g[k].abs().max())
            for k in named
        )
        layouts = all(g.layout == stacked[k].layout for k, g in grads.items())
        tp = Counter((r.op, r.nbytes) for r in log if r.axes == ("tp",))
        out.append((close, layouts, sorted(seen), tp))
    return out


@pytest.mark.timeout(300)
def test_stage_params_split_per_part_run_as_they_are(world4):
    """Issue 36 item 1: pipeline's stages take a fused projection's per-part layout (fs.Parts,
    stack_stages'): each stage's slice keeps the parts over tp, its layer ``w[i]`` too (a
    selection of another dim is local), the loss and gradients equal dense (in the stacked
    params' layouts) under 1F1B, interleaved and ZB-H1. Over tp exactly Megatron's
    collectives, no all_gather (the per-part blocks line up with the down projection's
    columns; a contiguous split of the fused weight gathered 16 a step): per microbatch and
    block one all_reduce of its (3, 4) float32 output forward and one of its input's gradient
    backward, less the first stage's first block's (its input, the microbatches, is not
    differentiated): 4 x (2 + 2) = 16 a rank, 12 on the first stage's (its stages 0 and 2
    interleaved: the same count)."""
    seen = [("Parts(P(None, 'tp'), dim=1, sizes=(6, 6))", "P(None, None, 'tp')")]
    for rank, got in enumerate(world4.run(parts_stage_rank_fn)):
        tp = Counter({("all_reduce", 3 * 4 * 4): 12 if rank < 2 else 16})
        assert got == [(True, True, seen, tp)] * 3, (rank, got)


def pending_input_rank_fn():
    """Issue 36: the pipeline's activations are a pending sum over tp (the microbatches as an
    embedding's row-parallel output leaves them, and so every stage's input). Was: each stage
    took its input for a partial leaf and claimed it (its cotangent kept on the first tp rank
    only): every gradient before the last stage wrong (1.9 off on values of size ~1)."""
    mesh = fs.Mesh.create((2, 2), ("pp", "tp"))
    gen = torch.Generator().manual_seed(0)
    C, R = torch.randn(2, 4, 6, generator=gen), torch.randn(2, 6, 4, generator=gen) * 0.5
    X, T = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)

    def block(x, col, row):
        return x + F.gelu(x @ col) @ row

    def head(_, y, t):
        return (torch.tanh(y) ** 2 * t).sum()

    def loss(params, x):
        x = fs.reshard(x * 1.0, fs.P(partial="tp"))  # an intermediate that is a pending sum
        out = pipeline(lambda p, h: block(h, p["col"], p["row"]), params, x, mesh, loss_fn=head,
                       targets=fs.shard(T, mesh, fs.P()), schedule="1f1b")  # fmt: skip
        return fs.gather(out)

    def dense(C, R, X):
        ys = [block(block(X[mb], C[0], R[0]), C[1], R[1]) for mb in range(2)]
        return sum(head(None, y, T[mb]) for mb, y in enumerate(ys)) / 2

    params = {
        "col": fs.shard(C, mesh, fs.P("pp", None, "tp")),
        "row": fs.shard(R, mesh, fs.P("pp", "tp")),
    }
    got = fs.grad(loss, argnums=(0, 1))(params, fs.shard(X, mesh, fs.P()))
    want = torch.func.grad(dense, argnums=(0, 1, 2))(C, R, X)
    for g, w in zip((got[0]["col"], got[0]["row"], got[1]), want):
        torch.testing.assert_close(fs.gather(g), w, **TOL)
    return True


@pytest.mark.timeout(300)
def test_pipeline_of_a_pending_sum_matches_dense(world4):
    assert world4.run(pending_input_rank_fn) == [True] * 4


def input_fn_rank_fn(schedule):
    """The embedding as the pipeline's ``input_fn`` (run by the first stage's rank only)
    against the embedding computed before the pipeline on every pp rank and against dense
    (one process): the same loss and gradients. What changes is what crosses ``pp``: the
    replicated stage inputs' cotangent (this rank's rows of every microbatch) was all-reduced
    over pp; with ``input_fn`` the inputs are token ids, and only the embedding's gradient is
    summed over pp, in the one bucket of the replicated params' (with the head's)."""
    mesh = fs.Mesh.create((2, 2), ("pp", "dp"))
    gen = torch.Generator().manual_seed(0)
    V, D, M, B = 11, 6, 4, 4  # vocabulary, width, microbatches, rows per microbatch (over dp)
    E, W = torch.randn(V, D, generator=gen), torch.randn(2, D, D, generator=gen) / 2
    H = torch.randn(D, V, generator=gen)
    ids, tgt = (
        torch.randint(0, V, (M, B), generator=gen),
        torch.randint(0, V, (M, B), generator=gen),
    )

    def stage(w, x):
        return torch.tanh(x @ w)

    def head(h, y, t):  # a sum over the rows split over dp: summed once a step
        return F.cross_entropy(y @ h, t, reduction="sum") / B

    def dense(E, W, H):
        return sum(head(H, stage(W[1], stage(W[0], F.embedding(ids[m], E))), tgt[m])
                   for m in range(M)) / M  # fmt: skip

    rows = fs.P(None, "dp")
    ids_s, tgt_s = fs.shard(ids, mesh, rows), fs.shard(tgt, mesh, rows)

    def new(p):
        return fs.gather(pipeline(
            stage, p["w"], {"ids": ids_s}, mesh, loss_fn=head, loss_params=p["h"], targets=tgt_s,
            input_fn=lambda e, mb: F.embedding(mb["ids"], e), input_params=p["e"],
            activation=fs.Layout(mesh, fs.P("dp"), (B, D)), schedule=schedule,
        ))  # fmt: skip

    def old(p):
        x = F.embedding(ids_s, p["e"])  # (M, B, D), on every pp rank
        return fs.gather(pipeline(stage, p["w"], x, mesh, loss_fn=head, loss_params=p["h"],
                                  targets=tgt_s, schedule=schedule))  # fmt: skip

    params = {
        "e": fs.shard(E, mesh, fs.P()),
        "w": fs.shard(W, mesh, fs.P("pp")),
        "h": fs.shard(H, mesh, fs.P()),
    }
    want_v = dense(E, W, H)
    want_g = torch.func.grad(dense, argnums=(0, 1, 2))(E, W, H)
    logs = []
    storages = {}  # what the step saves of one microbatch's activation shape, by storage

    def pack(t):
        if tuple(t.shape) == (B // 2, D):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    for f in (new, old):
        with (
            fs.debug.comm_log() as log,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            value, grads = fs.value_and_grad(f)(params)
        if f is new:  # input_fn's rows are not views of its whole output: freed one by one
            assert storages and set(storages.values()) == {B // 2 * D * 4}, storages
        torch.testing.assert_close(value, want_v, **TOL)
        for k, w in zip("ewh", want_g):
            torch.testing.assert_close(fs.gather(grads[k]), w, **TOL)
        logs.append(sorted((r.op, r.axes, r.nbytes) for r in log if r.op != "ppermute"))
    return logs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_input_fn_runs_on_the_first_stage_only(world4, schedule):
    V, D, M, B = 11, 6, 4, 4
    for rank, (new, old) in enumerate(world4.run(input_fn_rank_fn, schedule)):
        first = rank < 2  # pp is the outer axis: ranks 0, 1 hold stage 0
        # both: the loss's float64 scalar summed over dp on the last stage, one bucket of the
        # replicated params' gradients over dp (the embedding, the head and this rank's
        # stage; the last stage reduces only what it uses); the float32 loss's parts over pp
        # go as a ppermute, as the transfers (not in these logs)
        stage, emb, hd = 2 * D * D * 4 // 2, V * D * 4, D * V * 4
        common = [] if first else [("all_reduce", ("dp",), 8)]
        # input_fn: the embedding's and the head's gradients summed over pp in one bucket
        want_new = common + [
            ("all_reduce", ("dp",), stage + (emb if first else hd)),
            ("all_reduce", ("pp",), emb + hd),
        ]
        # before: every pp rank embeds all microbatches; their cotangent (this rank's B / 2
        # rows of each) is summed over pp, the embedding's gradient over dp on every rank (in
        # a bucket of its own, outside the pipeline's), the head's over pp alone
        want_old = common + [
            ("all_reduce", ("dp",), stage + (0 if first else hd)),
            ("all_reduce", ("dp",), emb),
            ("all_reduce", ("pp",), M * B // 2 * D * 4),
            ("all_reduce", ("pp",), hd),
        ]
        assert new == sorted(want_new), (rank, new)
        assert old == sorted(want_old), (rank, old)


def per_rank_batch_rank_fn(bad_step):
    """parallelize's pipelined loss checks the batch as one boundary a step (was one exchange
    per fs.shard of its ids, targets, positions): exchanged at the 1st, 2nd, 4th ... step,
    else folded into the digest the pipeline's shard_map compares before anything is sent.
    Either way a batch that differs on one rank raises on every rank, at that step."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, vocab_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    dims = fs.parallel.ParallelDims(pp=2, pp_schedule="1f1b")
    params, loss = fs.parallel.parallelize(transformers.LlamaForCausalLM(cfg), dims.mesh(), dims)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    for step in range(1, 5):
        batch = ids
        if step == bad_step and torch.distributed.get_rank() == 1:
            batch = (ids + 1) % 32  # this rank's loader gave other tokens, same shape
        try:
            fs.value_and_grad(loss)(params, {"input_ids": batch})
        except fs.consistency.ConsistencyError as e:
            return step, "every rank must pass the same batch" in str(e)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bad_step", [1, 3])
def test_parallelize_pp_refuses_a_per_rank_batch(world2, bad_step):
    assert world2.run(per_rank_batch_rank_fn, bad_step) == [(bad_step, True)] * 2


def held_ends_rank_fn(schedule, virtual, held, tmp):
    """A pipeline whose first piece (an embedding, ``input_fn``) and last (a head, ``loss_fn``)
    have params replicated over pp or held by their stage's ranks (``on_stage``) on a (pp, dp)
    mesh: the loss and gradients against one-process dense autograd, the gradients' layouts,
    the first step's collectives ``(op, axes, bytes)``, then two AdamW steps (donated, then
    pure) and the params' global norm, all against dense, and a checkpoint round trip."""
    mesh = fs.Mesh.create((2, 2), ("pp", "dp"))
    stages, m = 2 * virtual, 4
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(stages, 4, 4, generator=gen) * 0.5
    e, h, b = (torch.randn(*s, generator=gen) for s in ((6, 4), (4, 5), (5,)))
    ids = torch.randint(0, 6, (m, 2, 3), generator=gen)
    tg = torch.randn(m, 2, 3, 5, generator=gen)
    order = stage_order(2, virtual)
    params = {
        "w": fs.shard(w[order], mesh, fs.P("pp")),
        "e": fs.shard(e, mesh, fs.P("dp")),  # FSDP-style rows over dp
        "h": fs.shard(h, mesh, fs.P()),
        "b": fs.shard(b, mesh, fs.P()),
    }
    if held:
        params["e"] = on_stage(params["e"], mesh, 0)
        params["h"], params["b"] = (on_stage(params[k], mesh, 1) for k in "hb")
    act = fs.Layout(mesh, fs.P("dp"), (2, 3, 4))
    tokens, targets = fs.shard(ids, mesh, fs.P(None, "dp")), fs.shard(tg, mesh, fs.P(None, "dp"))

    def loss(p):
        return pipeline(
            lambda w, x: torch.tanh(x @ w), p["w"], {"ids": tokens}, mesh,
            loss_fn=lambda hp, y, t: ((y @ hp["h"] + hp["b"] - t) ** 2).sum(),
            loss_params={"h": p["h"], "b": p["b"]}, targets=targets,
            input_fn=lambda ep, mb: F.embedding(mb["ids"], ep["e"]), input_params={"e": p["e"]},
            activation=act, schedule=schedule, virtual=virtual,
        )  # fmt: skip

    def dense(p):
        tot = 0.0
        for k in range(m):
            x = p["e"][ids[k]]
            for s in range(stages):
                x = torch.tanh(x @ p["w"][s])
            tot = tot + ((x @ p["h"] + p["b"] - tg[k]) ** 2).sum()
        return tot / m

    # clones: fs.shard of a replicated (or row-split) value keeps views of the tensor, which the
    # donated optimizer step below updates in place
    ref = {k: t.clone() for k, t in (("w", w), ("e", e), ("h", h), ("b", b))}
    with fs.debug.comm_log() as log:
        value, grads = fs.value_and_grad(loss)(params)
    want, want_value = torch.func.grad_and_value(dense)(ref)
    errs = [abs(float(value) - float(want_value))]
    for k in ref:
        assert grads[k].layout == params[k].layout, k
        g = fs.gather(grads[k])
        errs.append(float((g[order] if k == "w" else g).sub(want[k]).abs().max()))
    records = [(r.op, r.axes, r.nbytes) for r in log]
    tx = fs.optim.adamw(1e-2, weight_decay=0.1)
    state, dstate = tx.init(params), tx.init(ref)
    for donate in (True, False):
        _, grads = fs.value_and_grad(loss)(params)
        params, state = fs.optim.step(tx, grads, state, params, donate=donate)
        updates, dstate = tx.update(torch.func.grad(dense)(ref), dstate, ref)
        ref = fs.optim.apply_updates(ref, updates)
    for k in ref:
        got = fs.gather(params[k])
        errs.append(float((got[order] if k == "w" else got).sub(ref[k]).abs().max()))
    errs.append(abs(float(fs.optim.global_norm(params)) - float(fs.optim.global_norm(ref))))
    fs.checkpoint.save(tmp, params)
    like = fs.tree_map(lambda x: x * 0, params, is_leaf=lambda x: isinstance(x, fs.ShardedArray))
    loaded = fs.checkpoint.load(tmp, like)
    for k in ref:
        assert loaded[k].layout == params[k].layout, k
        assert torch.equal(loaded[k].local, params[k].local), k
    return max(errs), records, tuple(params[k].local.numel() for k in "ehb")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_params_held_by_their_stage_train_as_dense_with_no_pp_reduction(
    world4, tmp_path, schedule, virtual
):
    """Issue 36 item 7: ``on_stage`` holds the embedding on the first stage's ranks and the
    head on the last's (torch.distributed.pipelining's placement): equal to dense (loss,
    gradients, two AdamW steps, the global norm, a checkpoint round trip), no memory for them
    elsewhere, and the step's collectives those of the replicated params less exactly one:
    the all_reduce over pp of the ends' gradients (zeros off their stage), e's 12 rows' block
    of 3 x 4 floats on a dp rank (48 bytes; its dp reduce_scatter is the stage's, unchanged)
    plus h and b whole (80 + 20 bytes): 148 bytes, on every rank."""
    held = world4.run(held_ends_rank_fn, schedule, virtual, True, str(tmp_path / "held"))
    replicated = world4.run(held_ends_rank_fn, schedule, virtual, False, str(tmp_path / "repl"))
    ends = ("all_reduce", ("pp",), 3 * 4 * 4 + 4 * 5 * 4 + 5 * 4)
    for rank, ((err, got, sizes), (rerr, want, rsizes)) in enumerate(zip(held, replicated)):
        assert err < 1e-5 and rerr < 1e-5, (rank, err, rerr)
        assert want.count(ends) == 1, want
        want = list(want)
        want.remove(ends)
        assert got == want, rank
        assert rsizes == (12, 20, 5)
        assert sizes == ((12, 0, 0) if rank < 2 else (0, 20, 5)), (rank, sizes)


def held_ops_rank_fn():
    """Ops on values held by one pp coordinate (``on_stage``; base layouts replicated, split on
    dim 0, split on dim 1) against the dense values: which (spec, index, op) differ."""
    mesh = fs.Mesh.create((2, 2), ("pp", "dp"))
    gen = torch.Generator().manual_seed(0)
    bad = []
    for spec in (fs.P(), fs.P("dp"), fs.P(None, "dp")):
        for index in (0, 1):
            t, y = torch.randn(5, 3, generator=gen), torch.randn(3, 2, generator=gen)
            x = on_stage(fs.shard(t, mesh, spec), mesh, index)
            assert x.local.numel() == (0 if mesh.coords(mesh.rank)[0] != index else x.local.numel())
            checks = {
                "mul": (fs.gather(x * 2), t * 2),
                "add": (fs.gather(x + x), t + t),
                "sum": (fs.gather(x.sum()), t.sum()),
                "sum(0)": (fs.gather(torch.sum(x, 0)), t.sum(0)),
                # a matmul whose row operand's blocks split dim 1 too: made whole (was a
                # TypeError in the row-wise rule, for any explicit layout so)
                "matmul": (fs.gather(x @ y), t @ y),
                "global_norm": (fs.optim.global_norm([x, x]), torch.stack([t, t]).norm()),
                "reshard": (fs.gather(fs.reshard(x, fs.P("dp"))), t),
            }
            bad += [
                (str(spec), index, k)
                for k, (a, b) in checks.items()
                if not torch.allclose(a, b, atol=1e-6)
            ]
            if fs.gather(x, dst=0) is not None and mesh.rank != 0:
                bad.append((str(spec), index, "gather(dst=0)"))
    return bad


@pytest.mark.timeout(300)
def test_ops_on_params_held_by_a_stage_are_dense(world4):
    assert world4.run(held_ops_rank_fn) == [[]] * 4


# -- a stage that raises -----------------------------------------------------------------------


def failing_stage_rank_fn(pp, dp, schedule, kind=None, stage=0, mb=0):
    """A pipeline of pp stages (4 microbatches; replicated over dp: the pp groups are then
    sub-groups, dist.new_group's) whose stage ``stage`` raises in the forward
    (``kind="F"``) or the backward (``"B"``) of microbatch ``mb``: ``(error type, message with
    its notes, seconds until it raised)`` on each rank. ``kind=None``: no failure, the value and
    gradient."""
    mesh = fs.Mesh.create((pp, dp), ("pp", "dp"))
    w, x, tgt, _ = _tanh_chain(pp, 4, seed=11)
    forwards = []

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(y):
            if kind == "F":
                raise ValueError(f"boom in the forward of microbatch {mb}")
            return y.view_as(y)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            raise ValueError(f"boom in the backward of microbatch {mb}")

    def stage_fn(w, x):
        y = torch.tanh(x @ w)
        if kind is not None and mesh.rank // dp == stage:
            forwards.append(None)
            if len(forwards) == mb + 1:  # this rank's forwards run in microbatch order
                y = Boom.apply(y)
        return y

    def loss(w):
        return pipeline(stage_fn, w, x, mesh, loss_fn=_square_error, targets=tgt,
                        schedule=schedule)  # fmt: skip

    start = time.perf_counter()
    try:
        value, grad = fs.value_and_grad(loss)(w)
    except Exception as e:
        text = "\n".join([str(e), *getattr(e, "__notes__", ())])
        return type(e).__name__, text, time.perf_counter() - start
    return float(value), grad


def _failing_dense(pp):
    w, _, _, dense = _tanh_chain(pp, 4, seed=11)
    return dense(w), torch.func.grad(dense)(w)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "pp,dp,schedule,kind,stage,mb",
    [
        (2, 1, "1f1b", "F", 0, 1),
        (2, 1, "gpipe", "B", 1, 2),
        (4, 1, "1f1b", "B", 1, 2),
        (4, 1, "zb", "F", 2, 1),
        (2, 2, "1f1b", "F", 1, 1),
        (2, 1, "1f1b", "F", 0, 0),  # before the step's first collective: the deferred check
        (2, 2, "gpipe", "F", 0, 0),
    ],
)
def test_a_stage_that_raises_stops_every_stage_at_once(
    world2, world4, pp, dp, schedule, kind, stage, mb
):
    """One stage raises (a middle microbatch, its forward or its backward): it raises its own
    error, and every other rank raises PeerFailed naming that stage and error, within seconds
    (the ranks waited on it until the process group's timeout, the World's pg_timeout: 60 s;
    30 minutes for a sub-group before they took it); the ranks gave the pp group up, so the World restarts and runs a
    correct step."""
    world = world2 if pp * dp == 2 else world4
    what = {"F": "forward", "B": "backward"}[kind]
    out = world.run(failing_stage_rank_fn, pp, dp, schedule, kind, stage, mb)
    boom = f"ValueError: boom in the {what} of microbatch {mb}"
    for rank, (name, text, seconds) in enumerate(out):
        assert seconds < 15, (rank, seconds, text)  # the group's timeout: 60 s and more
        failed = stage * dp + rank % dp  # the failing rank of this rank's pp group
        assert f"stage {stage} (rank {failed}) raised {boom}" in text, (rank, text)
        assert name == ("ValueError" if rank == failed else "PeerFailed"), (rank, name, text)
    want_value, want_grad = _failing_dense(pp)
    for value, grad in world.run(failing_stage_rank_fn, pp, dp, schedule):
        assert value == pytest.approx(float(want_value), rel=1e-5)
        torch.testing.assert_close(grad, want_grad, **TOL)
