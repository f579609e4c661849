"""fshard.gradsync (the one reducer of data-parallel gradients) and fshard.lax's handler stack:
one reduction per param per step however often it is used (tied weights, microbatches in one
loss), unreduced gradients accumulated over microbatches and reduced once, the reduce dtype
carried on the pcast, handlers consulted innermost first. Oracle: the dense gradient in one
process; exact comm-log byte counts."""

import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fshard as fs
from fshard import lax
from fshard.spec import chunk_bounds

D, H, B = 6, 10, 8
PARAM_BYTES = 8 * (H * D + H + D * H + D)  # float64


class Tied(nn.Module):
    """An MLP whose first weight is used twice (tied: ``fc1`` then ``fc1.weight.T``)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h) + h @ self.fc1.weight


def _data():
    torch.manual_seed(0)
    return Tied().double(), torch.randn(B, D, dtype=torch.float64), torch.randn(B, D).double()


def _dense(model, x, y, chunks: int):
    ps = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps):
        out = 0
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            out = out + F.mse_loss(torch.func.functional_call(model, ps, (xc,)), yc)
        return out

    g, v = torch.func.grad_and_value(loss)(ps)
    return v, g


def _loss(model):
    def loss(ps, xs, ys):
        # microbatches (each split over dp), all in one differentiated call
        total = 0
        for x, y in zip(xs, ys):
            out = fs.nn.functional_call(model, ps, (x,))
            total = total + ((out - y) ** 2).mean()
        return fs.gather(total)

    return loss


def _split(t, mesh, chunks):
    return [fs.shard(c, mesh, fs.P("dp")) for c in t.chunk(chunks)]


def once_rank_fn():
    mesh = fs.Mesh.create((2,), ("dp",))
    model, x, y = _data()
    params = fs.nn.shard_params(model, mesh)
    with fs.debug.comm_log() as log:
        v, g = fs.value_and_grad(_loss(model))(params, _split(x, mesh, 2), _split(y, mesh, 2))
    big = [(r.op, r.nbytes) for r in log if r.nbytes > 8]
    return float(v), {k: t.local for k, t in g.items()}, {k: t.spec for k, t in g.items()}, big


def test_one_reduction_per_param_however_often_used(world2):
    """Two microbatches in one loss and a tied weight: each param's gradient is all-reduced
    once (before: one pcast leaf per use, twice the parameter bytes or more)."""
    model, x, y = _data()
    v_dense, g_dense = _dense(model, x, y, 2)
    for v, g, specs, big in world2.run(once_rank_fn):
        torch.testing.assert_close(torch.tensor(v, dtype=torch.float64), v_dense)
        for k in g_dense:
            assert specs[k] == fs.P()
            torch.testing.assert_close(g[k], g_dense[k])
        assert {op for op, _ in big} == {"all_reduce"}
        assert sum(n for _, n in big) == PARAM_BYTES  # each param's bytes exactly once


def unreduced_rank_fn():
    mesh = fs.Mesh.create((2,), ("dp",))
    model, x, y = _data()
    params = fs.nn.shard_params(model, mesh)
    specs = {k: p.spec for k, p in params.items()}
    vg = fs.value_and_grad(_loss(model), sync=False)
    acc, losses = None, []
    with fs.debug.comm_log() as during:
        for xc, yc in zip(x.chunk(2), y.chunk(2)):  # two optimizer-level microbatches
            v, g = vg(params, _split(xc, mesh, 1), _split(yc, mesh, 1))
            losses.append(float(v))
            acc = g if acc is None else fs.tree_map(torch.add, acc, g)
    pending = {k: t.spec for k, t in acc.items()}
    with fs.debug.comm_log() as at_step:
        reduced = fs.reshard(acc, specs)  # the one reduction of the step
    out = {k: fs.gather(t) for k, t in reduced.items()}
    return (
        losses,
        out,
        pending,
        {k: t.spec for k, t in reduced.items()},
        [(r.op, r.nbytes) for r in during if r.nbytes > 8],
        [(r.op, r.nbytes) for r in at_step],
    )


def test_unreduced_gradients_accumulate_then_reduce_once(world2):
    """``sync=False`` (DDP's no_sync, JAX's unreduced gradients): no gradient bytes move in the
    microbatches; the accumulated pending sums reduce in one resharding of the tree."""
    model, x, y = _data()
    g_dense, v_dense = {}, []
    for xc, yc in zip(x.chunk(2), y.chunk(2)):
        v, g = _dense(model, xc, yc, 1)
        g_dense = {k: g[k] + g_dense.get(k, 0) for k in g}
        v_dense.append(float(v))
    for losses, out, pending, final, during, at_step in world2.run(unreduced_rank_fn):
        assert losses == pytest.approx(v_dense, rel=1e-12)
        for k in g_dense:
            assert pending[k].partial == ("dp",), (k, pending[k])
            assert final[k] == fs.P()
            torch.testing.assert_close(out[k], g_dense[k])
        assert during == []  # nothing but the loss scalars moved
        assert {op for op, _ in at_step} == {"all_reduce"}
        assert sum(n for _, n in at_step) == PARAM_BYTES


def reduce_dtype_rank_fn(reduce: torch.dtype):
    mesh = fs.Mesh.create((2,), ("dp",))
    torch.manual_seed(0)
    model = Tied()
    x, y = torch.randn(B, D), torch.randn(B, D)
    policy = fs.nn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    params = fs.nn.shard_params(model, mesh)
    xs, ys = fs.shard(x, mesh, fs.P("dp")), fs.shard(y, mesh, fs.P("dp"))

    def loss(ps, x, y):
        out = fs.nn.functional_call(model, ps, (x,), mp_policy=policy)
        return fs.gather(((out.float() - y) ** 2).mean())

    with fs.debug.comm_log() as log:
        _, g = fs.value_and_grad(loss)(params, xs, ys)
    ref = torch.func.grad(loss)(params, xs, ys)  # lax's Function: one all_reduce per pcast
    return (
        [(r.op, r.nbytes) for r in log if r.nbytes > 4],
        {k: (t.dtype, t.local) for k, t in g.items()},
        {k: t.local for k, t in ref.items()},
    )


@pytest.mark.parametrize("reduce", [torch.float32, torch.bfloat16])
def test_reduce_dtype_travels_on_the_pcast(world2, reduce):
    """Mixed precision's reduce dtype is data on the pcast: fs.value_and_grad buckets the
    reduction in that dtype (bf16: half the bytes) and returns fp32 gradients equal to the
    Function's per-pcast reduction."""
    size = torch.empty((), dtype=reduce).element_size()
    for big, g, ref in world2.run(reduce_dtype_rank_fn, reduce):
        n_params = PARAM_BYTES // 8
        assert sum(n for _, n in big) == size * n_params, big
        assert len(big) == 1  # one bucket: every gradient in one all_reduce
        for k, (dtype, local) in g.items():
            assert dtype == torch.float32
            torch.testing.assert_close(local, ref[k], rtol=1e-2, atol=1e-3)


class _Order(lax.Handler):
    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def process(self, b, x, done, proceed):
        self.seen.append(self.name)
        return proceed(b, x, done)


def handlers_rank_fn():
    mesh = fs.Mesh.create((2,), ("x",))
    seen = []
    with lax.handling(_Order("outer", seen)), lax.handling(_Order("inner", seen)):
        got = fs.lax.psum(torch.ones(2), "x", mesh=mesh)
        inside = len(lax.active_handlers())
    return seen, got, inside, len(lax.active_handlers())


def test_handlers_are_consulted_innermost_first(world2):
    for seen, got, inside, after in world2.run(handlers_rank_fn):
        assert seen == ["inner", "outer"]
        assert torch.equal(got, torch.full((2,), 2.0))
        assert (inside, after) == (2, 0)


def test_handling_refuses_what_is_not_a_handler():
    with pytest.raises(TypeError, match="fs.lax.Handler"), lax.handling(object()):
        pass


def test_sync_is_checked():
    with pytest.raises(TypeError, match="sync must be a bool"):
        fs.value_and_grad(lambda w: w.sum(), sync="no")


def test_one_application_path():
    """The interception channels the handler stack replaced are gone, and no module reaches
    into fshard.lax's private names."""
    root = pathlib.Path(fs.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for name in ("REMAT_HOOK", "PCAST_HOOK", "MP_SOURCES", "_DeferredPcasts"):
            assert name not in text, (path, name)
        private = [
            node.attr
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "lax"
            and node.attr.startswith("_")
        ]
        assert not private, (path, private)


def fsdp_unreduced_rank_fn(view: str):
    """FSDP (local and global view) with sync=False: no reduce_scatter in the microbatches;
    each gradient the whole param's addends, reduce-scattered once per step by fs.reshard."""
    mesh = fs.Mesh.create((2,), ("dp",))
    model, x, y = _data()
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    specs = {k: p.spec for k, p in params.items()}

    def loss(ps, x, y):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh)
        if view == "global":
            return fs.gather(((out - y) ** 2).mean())
        return fs.lax.pmean(((out - y) ** 2).mean(), "dp", mesh=mesh)

    vg = fs.value_and_grad(loss, sync=False)
    acc = None
    with fs.debug.comm_log() as during:
        for xc, yc in zip(x.chunk(2), y.chunk(2)):
            xs, ys = fs.shard(xc, mesh, fs.P("dp")), fs.shard(yc, mesh, fs.P("dp"))
            if view == "local":
                xs, ys = xs.local, ys.local
            _, g = vg(params, xs, ys)
            acc = g if acc is None else fs.tree_map(torch.add, acc, g)
    pending = {k: t.spec for k, t in acc.items()}
    with fs.debug.comm_log() as at_step:
        reduced = fs.reshard(acc, specs)
    return (
        {k: fs.gather(t) for k, t in reduced.items()},
        pending,
        {k: t.spec for k, t in reduced.items()},
        sorted({r.op for r in during}),
        [(r.op, r.nbytes) for r in at_step],
    )


@pytest.mark.parametrize("view", ["local", "global"])
def test_fsdp_unreduced_gradients_reduce_scatter_once(world2, view):
    model, x, y = _data()
    g_dense = {}
    for xc, yc in zip(x.chunk(2), y.chunk(2)):
        _, g = _dense(model, xc, yc, 1)
        g_dense = {k: g[k] + g_dense.get(k, 0) for k in g}
    sizes = {k: 8 * p.numel() for k, p in model.named_parameters()}
    for out, pending, final, during, at_step in world2.run(fsdp_unreduced_rank_fn, view):
        for k in g_dense:
            assert pending[k] == fs.P(partial=("dp",)), (k, pending[k])
            assert final[k] == fs.nn.fsdp_plan(model, fs.Mesh.abstract((2,), ("dp",)))[k]
            torch.testing.assert_close(out[k], g_dense[k])
        assert "reduce_scatter" not in during and "all_reduce" in during  # the loss scalars
        assert sorted(at_step) == sorted(("reduce_scatter", n) for n in sizes.values())


class _Fused(nn.Module):
    """``x @ weight`` with a fused ``(4, 14)`` weight: parts (8, 3, 3) on dim 1 (GPT-2's
    ``c_attn``, MoE experts' ``gate_up``)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 14, dtype=torch.float64))

    def forward(self, x):
        return torch.matmul(x, self.weight)


def parts_unreduced_rank_fn(case: str):
    """Two microbatches of fs.value_and_grad(..., sync=False) on dp 2 x tp 2 with fused params
    of parts (8, 3, 3) split per part over tp, accumulated with ``+`` and reduced once by
    fs.reshard. ``case``: ``"tp"`` (a Parts on dim 1, no FSDP: pending over dp), ``"fsdp"``
    (that sharded over dp on dim 0) or ``"dim0"`` (a Linear's weight and bias with the parts
    on dim 0, each part split over ('tp', 'dp'), uneven). ``(gradients gathered, pending
    specs, final layouts kept, ops in the microbatches, (op, bytes) of the step)``."""
    mesh = fs.Mesh.create((2, 2), ("dp", "tp"))
    sizes = (8, 3, 3)
    torch.manual_seed(0)
    if case == "dim0":
        model = nn.Linear(4, 14).double()
        base = {
            "weight": fs.Parts(fs.P("tp", None), 0, sizes),
            "bias": fs.Parts(fs.P("tp"), 0, sizes),
        }
    else:
        model = _Fused()
        base = {"weight": fs.Parts(fs.P(None, "tp"), 1, sizes)}
    fsdp = case != "tp"
    plan = fs.nn.fsdp_plan(model, mesh, "dp", base=base) if fsdp else base
    params = fs.nn.shard_params(model, mesh, plan)
    c = torch.arange(1, 15, dtype=torch.float64)  # a loss that sees the features' order
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(ps, xs):
        if fsdp:
            out = fs.nn.fsdp_call(model, ps, (xs,), mesh=mesh)
        else:
            out = torch.matmul(xs, ps["weight"])
        out = fs.reshard(out, fs.P("dp", None))
        return fs.gather((out * out * c).sum())

    vg = fs.value_and_grad(loss, sync=False)
    acc = None
    with fs.debug.comm_log() as during:
        for xc in x.chunk(2):
            _, g = vg(params, fs.shard(xc, mesh, fs.P("dp")))
            acc = g if acc is None else fs.tree_map(torch.add, acc, g)
    pending = {k: t.spec for k, t in acc.items()}
    with fs.debug.comm_log() as at_step:
        reduced = fs.reshard(acc, {k: p.spec for k, p in params.items()})
    return (
        {k: fs.gather(t) for k, t in reduced.items()},
        pending,
        all(reduced[k].layout == params[k].layout for k in params),
        sorted({r.op for r in during if r.axes == ("dp",) and r.nbytes > 8}),
        [(r.op, r.nbytes) for r in at_step],
    )


@pytest.mark.parametrize("case", ["tp", "fsdp", "dim0"])
def test_unreduced_gradients_of_parts_accumulate_then_reduce_once(world4, case):
    """sync=False with fs.Parts params (issue 36): each microbatch's gradient this rank's
    addend, in the param's part order (a Parts on dim 0 under FSDP comes back from the
    gather's chunk order), pending over dp; two accumulated with ``+`` and reduced once by
    fs.reshard equal the dense gradients in float64. No gradient bytes move over dp in the
    microbatches (FSDP's all_gathers and the loss scalars only); at the step one reduction per
    param over dp: a Parts on dim 1 reduces its tp block (parts (8, 3, 3) chunked 4 + 2 + 2
    rows on tp 0, 4 + 1 + 1 on tp 1, x 4 float64) in one all_reduce, or one reduce_scatter
    under FSDP; a Parts on dim 0 (to each part split over ('tp', 'dp')) in one reduce_scatter
    of its tp block too, the parts' pieces in dp's chunk order (the planner's
    PsumScatterParts; was an all_gather of the parts over tp and an all_reduce of the whole
    param over dp)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 14).double() if case == "dim0" else _Fused()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    c = torch.arange(1, 15, dtype=torch.float64)
    dense = {k: p.detach() for k, p in model.named_parameters()}
    want = {}
    for xc in x.chunk(2):
        f = lambda ps, xc=xc: (torch.func.functional_call(model, ps, (xc,)) ** 2 * c).sum()  # noqa: E731
        want = {k: g + want.get(k, 0) for k, g in torch.func.grad(f)(dense).items()}
    dim = 0 if case == "dim0" else 1
    part = fs.P("tp", None, partial="dp") if dim == 0 else fs.P(None, "tp", partial="dp")
    for rank, (out, pending, kept, during, at_step) in enumerate(
        world4.run(parts_unreduced_rank_fn, case)
    ):
        for k, w in want.items():
            torch.testing.assert_close(out[k], w, rtol=1e-12, atol=1e-12)
        assert pending["weight"] == fs.Parts(part, dim, (8, 3, 3))
        assert kept
        # this rank's tp block of the parts: each part's ceil-div chunk over tp (2) on tp
        # index rank % 2 (mesh (dp, tp)): 4 + 2 + 2 rows on tp 0, 4 + 1 + 1 on tp 1
        rows = sum(b - a for a, b in (chunk_bounds(n, 2, rank % 2) for n in (8, 3, 3)))
        if case == "tp":
            assert during == [] and at_step == [("all_reduce", rows * 4 * 8)]
        elif case == "fsdp":
            assert during == ["all_gather"] and at_step == [("reduce_scatter", rows * 4 * 8)]
        else:
            assert pending["bias"] == fs.Parts(fs.P("tp", partial="dp"), 0, (8, 3, 3))
            assert during == ["all_gather"]
            # one reduce_scatter over dp per param of its tp block (x 8 B float64): the bias's
            # rows, the weight's rows x 4 columns
            assert at_step == [("reduce_scatter", rows * 8), ("reduce_scatter", rows * 4 * 8)]


def sliced_leaf_rank_fn():
    """A replicated param used with an activation split over (dp, tp): the op rule slices
    the param's tp block (a view of the leaf a collective returned), then pcasts it over dp."""
    mesh = fs.Mesh.create((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, generator=g), torch.randn(4, 8, generator=g)

    def loss(w, x):  # an RMSNorm's weight times an activation split on its features
        var = x.pow(2).mean(-1, keepdim=True)
        return (w * x * torch.rsqrt(var + 1e-5)).pow(2).sum()

    want_value, want = loss(w, x), torch.func.grad(loss)(w, x)
    xs = fs.shard(x, mesh, fs.P("dp", "tp"))
    value, got = fs.value_and_grad(lambda w: loss(w, xs))(fs.shard(w, mesh, fs.P()))
    return float(value - want_value), got.spec, float((fs.gather(got) - want).abs().max())


def test_a_sliced_view_of_a_leaf_keeps_its_slices_transpose(world4):
    """The gradient sync's stand-in for a pcast of a view of a leaf (one sum per param)
    read the view's cotangent as the leaf's: for a view a collective made (the tp block the op
    rule sliced), the slice's transpose (the all_gather of the blocks) was skipped, and each
    rank kept its own block zero-padded (OLMo-2's and OlmoE's q/k norm weights under tp x dp:
    half of every gradient zero, silently)."""
    for dv, spec, diff in world4.run(sliced_leaf_rank_fn):
        assert abs(dv) < 1e-4 and spec == fs.P()
        assert diff < 1e-4, diff
