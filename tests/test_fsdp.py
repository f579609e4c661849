"""FSDP by layouts (fs.nn.fsdp_plan / fsdp_gather / fsdp_call) against dense single-process
training, with the exact collectives from comm_log; FSDP x TP through the GPT demo."""

import gc
import math
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fshard as fs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt as demo  # noqa: E402

from tests.test_nn import TIED, dense_value_and_grads, module_state, tied_case  # noqa: E402

D, H, OUT, B, STEPS = 8, 16, 6, 4, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, H)
        self.layers = nn.ModuleList([nn.Linear(H, H) for _ in range(2)])
        self.out = nn.Linear(H, OUT)
        self.gain = nn.Parameter(torch.full((3,), 0.5))  # 3 rows over dp=2: blocks of 2 and 1
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d: stays whole, all-reduced like DDP's

    def forward(self, x):
        h = F.gelu(self.inp(x))
        for layer in self.layers:
            h = h + F.gelu(layer(h))
        return self.out(h) * (self.gain.sum() * self.scale)


def _setup():
    torch.manual_seed(0)
    model = Net().double()
    data = [
        (torch.randn(2 * B, D).double(), torch.randn(2 * B, OUT).double()) for _ in range(STEPS)
    ]
    return model, data


TX = dict(learning_rate=1e-2, weight_decay=0.1)
UNITS = fs.nn.fsdp_units(Net())  # the root (inp, out, gain, scale), layers.0, layers.1


def _blocks(model, n, rank=None):
    """Each sharded param's float64 block bytes over ``n`` ranks: ``rank``'s own (uneven dim
    0: ``ceil(rows / n)`` rows, the last ranks fewer), or (``None``) the largest block, to which
    FSDP's packed gathers pad every rank's (as FSDP2 pads)."""
    out = {}
    for k, p in model.named_parameters():
        if p.dim():
            c = -(-p.shape[0] // n)
            rows = c if rank is None else max(0, min(c, p.shape[0] - rank * c))
            out[k] = rows * (p.numel() // p.shape[0]) * 8
    return out


def dense_run():
    model, data = _setup()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = fs.optim.adamw(**TX)
    state = tx.init(params)
    losses = []
    for x, y in data:

        def loss(ps, x, y):
            return F.mse_loss(torch.func.functional_call(model, ps, (x,)), y)

        g, v = torch.func.grad_and_value(loss)(params, x, y)
        upd, state = tx.update(g, state, params)
        params = fs.optim.apply_updates(params, upd)
        losses.append(float(v))
    return losses, params


def _value_and_grad(loss, traced: bool):
    """``(value, grads)`` of ``loss``: under torch.func (``traced``: plain
    fs.lax.all_gather(to="varying") per param) or fs.value_and_grad (the eager path)."""
    if not traced:
        return fs.value_and_grad(loss)

    def vg(*args):
        g, v = torch.func.grad_and_value(loss)(*args)
        return v, g

    return vg


def fsdp_rank_fn(traced, shape=(2,), names=("dp",), axis="dp"):
    mesh = fs.Mesh.create(shape, names)
    model, data = _setup()
    plan = fs.nn.fsdp_plan(model, mesh, axis)
    assert plan["inp.weight"] == fs.P(axis) and plan["gain"] == fs.P(axis)
    assert plan["scale"] == fs.P()
    params = fs.nn.shard_params(model, mesh, plan)
    tx = fs.optim.adamw(**TX)
    state = tx.init(params)
    moments = [  # AdamW's mu and nu of inp.weight: sharded like it
        t
        for t in fs.tree_leaves(state, is_leaf=lambda t: isinstance(t, fs.ShardedArray))
        if isinstance(t, fs.ShardedArray) and t.shape == (H, D)
    ]
    assert len(moments) == 2
    assert all(t.layout == params["inp.weight"].layout for t in moments)

    def loss(ps, x, y):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh, axis=axis)
        return fs.lax.pmean(F.mse_loss(out, y), axis, mesh=mesh)

    vg = _value_and_grad(loss, traced)
    losses, logs = [], []
    for x, y in data:
        xs, ys = fs.shard(x, mesh, fs.P(axis)).local, fs.shard(y, mesh, fs.P(axis)).local
        with fs.debug.comm_log() as log:
            v, g = vg(params, xs, ys)
        logs.append([(r.op, r.nbytes) for r in log])
        assert all(g[k].layout == params[k].layout for k in g)
        params, state = fs.optim.step(tx, g, state, params)
        losses.append(float(v))
    return losses, {k: fs.gather(v) for k, v in params.items()}, logs


class _Unreached(nn.Module):
    """A layer whose output is scaled by a value the loss reads only detached, through ops that
    save their own outputs (``exp``, ``amax``: the vocab-parallel cross entropy's max is such a
    value): the backward never reaches their nodes. ``seen``: weak references to those
    outputs, one per forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, H)
        self.seen: list = []

    def forward(self, x):
        h = self.lin(x)
        e = h.exp()
        m = e.amax(-1, keepdim=True)
        self.seen += [weakref.ref(e), weakref.ref(m)]
        return h * m.detach()


def _unreached_rank_fn():
    mesh = fs.Mesh.create((2,), ("dp",))
    torch.manual_seed(0)
    model = _Unreached().double()
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    x = torch.randn(2 * B, D, dtype=torch.float64)

    def loss(ps, x):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh)
        return fs.lax.pmean(out.square().mean(), "dp", mesh=mesh)

    grads = []
    for _ in range(2):
        _, g = fs.value_and_grad(loss)(params, fs.shard(x, mesh, fs.P("dp")).local)
        grads.append({k: fs.gather(v) for k, v in g.items()})
    gc.collect()
    return [r() is None for r in model.seen], grads


def test_fsdp_frees_what_the_backward_never_reaches(world2):
    """FSDP's saved-tensor pack hook saved a tensor it did not take over as itself: a node
    that saves its own output, never run by the backward, then held that output, whose
    ``grad_fn`` is the node, a cycle through C++ that Python's collector cannot see; the
    forward's graph, its activations and the FSDP session (the unpack hook) with its last
    regathered unit stayed alive after every step (issue 36 item 7: the composed FSDP x TP
    Llama's cross entropy, +5.5 MiB a step). The gradients stay dense's."""
    torch.manual_seed(0)
    model = _Unreached().double()
    x = torch.randn(2 * B, D, dtype=torch.float64)
    ps = {k: v.detach().clone() for k, v in model.named_parameters()}

    def dense(ps):
        return torch.func.functional_call(model, ps, (x,)).square().mean()

    want = torch.func.grad(dense)(ps)
    for freed, grads in world2.run(_unreached_rank_fn):
        assert freed == [True] * 4, freed
        for g in grads:
            for k in want:
                torch.testing.assert_close(g[k], want[k])


@pytest.fixture(scope="module")
def dense():
    return dense_run()


@pytest.mark.parametrize("traced", [False, True])
def test_fsdp_training_matches_dense(world2, dense, traced):
    ref_losses, ref_params = dense
    model, _ = _setup()
    block = _blocks(model, 2)  # gain's 3 rows: blocks of 2 and 1, a pack pads to 2 + 2
    for losses, params, logs in world2.run(fsdp_rank_fn, traced):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for k in params:
            torch.testing.assert_close(params[k], ref_params[k])
        for log in logs:
            want = [("all_reduce", 8), ("all_reduce", 8)]  # the loss pmean, scale
            # FSDP2's granularity: one all_gather per unit (the padded blocks packed), one
            # reduce_scatter per unit; eager, the backward gathers each layer again instead of
            # keeping its weights, and keeps the root's (FSDP2 applies no reshard after forward
            # to its root: was gathered again too). Traced (torch.func: fs.remat's recompute)
            # was one all_gather of each param's own block and one reduce_scatter per param (9
            # each per Llama layer); packed like the eager path's since (its blocks padded the
            # same way)
            units = [[k for k in names if k in block] for names in UNITS.values()]
            want += [("all_gather", sum(block[k] for k in u)) for u in units]
            if not traced:  # the layers' units (the root, first, kept)
                want += [("all_gather", sum(block[k] for k in u)) for u in units[1:]]
            want += [("reduce_scatter", 2 * sum(block[k] for k in u)) for u in units]
            assert sorted(log) == sorted(want)
            # no weight gradient is ever all-reduced (then sliced)
            assert not [r for r in log if r[0] == "all_reduce" and r[1] > 24]


def test_fsdp_over_reversed_axes_matches_dense(world4, dense):
    """FSDP over the axis tuple ("b", "a") of a (2, 2) mesh: params sharded over both, the batch
    too. That group's process group lists the ranks in another order than its chunks (0, 1, 2, 3
    against 0, 2, 1, 3), which kept FSDP off its eager path (prefetch, freeing) before its gathers
    went through ``_comm`` (whose fix-up puts blocks in chunk order). The eager log shows the
    backward's re-gathers (the eager path ran); params whose dim 0 does not split over 4 are
    sharded unevenly (blocks padded for the packed gathers), the 0-d one all-reduced."""
    ref_losses, ref_params = dense
    model, _ = _setup()
    block = _blocks(model, 4)  # out.weight, out.bias, gain: 6, 6, 3 rows padded to 4 x 2, 4 x 1
    for losses, params, logs in world4.run(fsdp_rank_fn, False, (2, 2), ("a", "b"), ("b", "a")):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for k in params:
            torch.testing.assert_close(params[k], ref_params[k])
        for log in logs:
            units = [[k for k in names if k in block] for names in UNITS.values()]
            want = [("all_gather", sum(block[k] for k in u)) for u in units]  # per unit
            # the backward re-gathers every layer's unit; the root's (out.weight, saved by its
            # linear) is kept from the forward, as FSDP2 keeps its root (was re-gathered too)
            want += [("all_gather", sum(block[k] for k in u)) for u in units[1:]]
            want += [("reduce_scatter", 4 * sum(block[k] for k in u)) for u in units]
            want += [("all_reduce", 8), ("all_reduce", 8)]  # the loss pmean, scale
            assert sorted(log) == sorted(want)


CFG = demo.GPTConfig(d_model=16, n_heads=2, n_layers=2, ctx=8)
OPT = {"lr": 1e-2, "steps": 10, "warmup": 2, "weight_decay": 0.1, "clip": 0.5}


def _gpt_batches():
    data = demo.load_corpus()
    gen = torch.Generator().manual_seed(1)
    return [demo.get_batch(data, 4, CFG.ctx, gen) for _ in range(STEPS)]


def gpt_fsdp_tp_rank_fn():
    mesh = fs.Mesh.create((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = demo.GPT(CFG)
    plan = fs.nn.fsdp_plan(model, mesh, "dp", base=demo.gpt_plan("tp"))
    assert plan["blocks.0.attn.qkv.weight"] == fs.P(("tp", "dp"), None)
    assert plan["blocks.0.mlp.fc2.weight"] == fs.P("dp", "tp")
    params = fs.nn.shard_params(model, mesh, plan)
    tx = demo.make_optimizer(**OPT)
    state = tx.init(params)
    step = demo.make_train_step(CFG, mesh, tx, fsdp_units=fs.nn.fsdp_units(model))
    losses = []
    for batch in _gpt_batches():
        params, state, loss = step(params, state, fs.shard(batch, mesh, fs.P("dp")))
        losses.append(float(loss))
    return losses, {k: fs.gather(v) for k, v in params.items()}


def _noop():
    return None


def test_fsdp_x_tp_gpt_matches_dense(world4):
    world4.run(_noop)  # start the workers first: on a loaded machine starting takes ~45 s
    torch.manual_seed(0)
    model = demo.GPT(CFG)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = demo.make_optimizer(**OPT)
    state = tx.init(params)
    ref = []
    for batch in _gpt_batches():
        g, v = torch.func.grad_and_value(demo.dense_loss)(params, model, batch)
        upd, state = tx.update(g, state, params)
        params = fs.optim.apply_updates(params, upd)
        ref.append(float(v))
    for losses, got in world4.run(gpt_fsdp_tp_rank_fn):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
        for k in got:
            torch.testing.assert_close(got[k], params[k], rtol=1e-4, atol=1e-5)


def test_errors_list_every_bad_entry():
    """fsdp_plan and fsdp_gather name every parameter that does not fit, before any collective
    (an abstract mesh: nothing communicates)."""
    mesh = fs.Mesh.abstract((2,), ("dp",))
    base = {"inp.weight": fs.P("dp"), "layers.0.weight": fs.P(None, "dp")}
    with pytest.raises(ValueError) as info:
        fs.nn.fsdp_plan(Net(), mesh, base=base)
    msg = str(info.value)
    assert "['inp.weight']: base spec P('dp')" in msg, msg
    assert "['layers.0.weight']: base spec P(None, 'dp')" in msg and "(2 leaves)" in msg, msg
    params = {"a": torch.zeros(2), "b": 3}
    with pytest.raises(TypeError) as info, fs.nn.fsdp_gather(params, {"u": ["a", "b"]}, mesh=mesh):
        pass
    msg = str(info.value)
    assert "params['a']: got Tensor" in msg and "params['b']: got int" in msg, msg


# -- tied parameters (fshard/_swap.py): every alias gets the gathered value -----------------------


def test_fsdp_units_put_a_tied_param_where_all_its_names_are():
    units = fs.nn.fsdp_units(tied_case("four_owners")[0])  # blocks.0.weight is held 4 times
    want = {"": ["blocks.0.weight", "head.bias"], "blocks.0": ["blocks.0.bias"]}
    assert units == {**want, "blocks.1": ["blocks.1.bias"]}
    units = fs.nn.fsdp_units(tied_case("weight_bias")[0])  # head.bias is proj.bias
    assert units[""] == ["emb.weight", "head.bias", "proj.weight"]


def fsdp_tied_rank_fn(kind, how):
    mesh = fs.Mesh.create((2,), ("dp",))
    model, ids = tied_case(kind)
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    assert any(v.spec == fs.P("dp") for v in params.values())
    start = module_state(model)

    def loss(ps, x):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh)
        return fs.lax.pmean(out.square().mean(), "dp", mesh=mesh)

    xs = fs.shard(ids, mesh, fs.P("dp")).local
    if how == "value_and_grad":
        value, grads = fs.value_and_grad(loss)(params, xs)
    else:
        grads, value = torch.func.grad_and_value(loss)(params, xs)
    assert all(grads[k].layout == params[k].layout for k in params)
    states = [module_state(model)]
    with pytest.raises(RuntimeError):  # the first block's forward raises: all restored
        fs.nn.fsdp_call(model, params, (xs,), {"cut": 3}, mesh=mesh)
    states.append(module_state(model))
    return float(value), {k: fs.gather(g) for k, g in grads.items()}, start, states


@pytest.mark.parametrize("how", ["value_and_grad", "torch.func.grad"])
@pytest.mark.parametrize("kind", list(TIED))
def test_fsdp_call_tied_matches_dense(world2, kind, how):
    """fsdp_call of a module with a tied weight, a tied weight and bias, or one tensor held by
    four modules (across units): the loss and every gradient equal dense torch.func (the tied
    head used to read the module's own frozen tensor: the embedding gradient was off), and no
    call changes which tensor a name holds or the order of named_parameters() / state_dict()
    (an nn.Linear's bias used to come back before its weight), also when the forward raises."""
    model, ids = tied_case(kind)
    value, grads = dense_value_and_grads(model, ids)
    for got_value, got_grads, start, states in world2.run(fsdp_tied_rank_fn, kind, how):
        torch.testing.assert_close(got_value, float(value))
        assert list(got_grads) == list(grads)
        for k in grads:
            torch.testing.assert_close(got_grads[k], grads[k], msg=k)
        for state in states:
            assert state == start


def test_fsdp_call_checks_units_up_front():
    """A tensor in two units, or in a unit that does not hold all its names, is refused before
    anything is gathered (an abstract mesh: nothing communicates)."""
    mesh = fs.Mesh.abstract((2,), ("dp",))
    model, ids = tied_case("four_owners")
    params = {k: v.detach() for k, v in model.named_parameters()}  # checked before the types
    before = module_state(model)
    units = {"": ["head.bias"], "blocks.0": ["blocks.0.weight", "blocks.0.bias"]}
    units["blocks.1"] = ["blocks.1.bias"]
    with pytest.raises(ValueError) as info:
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)
    msg = str(info.value)
    assert "params['blocks.0.weight']: in unit 'blocks.0', but also held as" in msg, msg
    assert "'blocks.1.weight', 'emb.weight', 'head.weight'" in msg, msg
    units = {"": ["blocks.0.weight", "head.bias"], "blocks.1": ["blocks.1.weight"]}
    params["blocks.1.weight"] = params["blocks.0.weight"]  # one tensor, two names: one value
    with pytest.raises(ValueError) as info:
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)
    msg = str(info.value)
    assert "params['blocks.1.weight']: in unit 'blocks.1', but it is (tied to) " in msg, msg
    with pytest.raises(ValueError, match="blocks.9.weight"):
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units={"": ["blocks.9.weight"]})
    assert module_state(model) == before


def test_fsdp_call_checks_units_again_when_the_module_changes():
    """fsdp_call reuses its units check for a module whose structure, units and given names it
    checked before (a pipeline stage's layer: once per layer and microbatch), and checks again
    once any of them changed: a tie made after a passing call is refused, as a submodule
    shared at a second path and a buffer holding a param (an abstract mesh and plain tensors:
    the units check passes or raises before the params' types are)."""
    mesh = fs.Mesh.abstract((2,), ("dp",))
    model = nn.Sequential(nn.Linear(3, 3), nn.ModuleList([nn.Linear(3, 3) for _ in range(2)]))
    ids = torch.ones(2, 3)
    units = fs.nn.fsdp_units(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    for _ in range(2):  # the check passes (first call, then its reuse): the types are next
        with pytest.raises(TypeError, match="ShardedArrays"):
            fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)
    model[1][1].weight = model[0].weight  # now one tensor in the root and in unit '1.1'
    with pytest.raises(ValueError, match=r"params\['1.1.weight'\]: tied to params\['0.weight'\]"):
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)
    model[1][1].weight = nn.Parameter(params["1.1.weight"].clone())  # untied: passes again
    with pytest.raises(TypeError, match="ShardedArrays"):
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)
    model[1].append(model[1][0])  # no new tensor: unit '1.0's layer also at '1.2'
    with pytest.raises(ValueError, match=r"in unit '1.0', but also held as \['1.2.weight'\]"):
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)
    del model[1][2]
    with pytest.raises(TypeError, match="ShardedArrays"):
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)
    model[1][1].register_buffer("scale", model[1][0].bias)  # a buffer holding unit 1.0's bias
    with pytest.raises(ValueError, match=r"in unit '1.0', but also held as \['1.1.scale'\]"):
        fs.nn.fsdp_call(model, params, (ids,), mesh=mesh, units=units)


def hsdp_rank_fn(traced):
    """HSDP on a (2, 2) mesh: params sharded over "shard", replicated over "rep"; the batch
    split over both."""
    mesh = fs.Mesh.create((2, 2), ("rep", "shard"))
    model, data = _setup()
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh, "shard"))
    tx = fs.optim.adamw(**TX)
    state = tx.init(params)

    def loss(ps, x, y):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh, axis="shard", replicate="rep")
        return fs.lax.pmean(F.mse_loss(out, y), ("rep", "shard"), mesh=mesh)

    vg = _value_and_grad(loss, traced)
    losses, logs = [], []
    batch = fs.P(("rep", "shard"))
    for x, y in data:
        xs, ys = fs.shard(x, mesh, batch).local, fs.shard(y, mesh, batch).local
        with fs.debug.comm_log() as log:
            v, g = vg(params, xs, ys)
        logs.append([(r.op, r.axes, r.nbytes) for r in log])
        assert all(g[k].layout == params[k].layout for k in g)
        params, state = fs.optim.step(tx, g, state, params)
        losses.append(float(v))
    return losses, {k: fs.gather(v) for k, v in params.items()}, logs


@pytest.mark.parametrize("traced", [False, True])
def test_hsdp_matches_dense(world4, dense, traced):
    """HSDP (FSDP2's 2-D mesh): reduce_scatter over the shard axis, then the shard's gradient
    all-reduced over the replicate axis (half the bytes of the full gradient), equal to dense."""
    ref_losses, ref_params = dense
    model, _ = _setup()
    block = _blocks(model, 2)  # the largest block over "shard" (a pack's padding)
    for rank, (losses, params, logs) in enumerate(world4.run(hsdp_rank_fn, traced)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for k in params:
            torch.testing.assert_close(params[k], ref_params[k])
        own = _blocks(model, 2, rank % 2)  # this rank's blocks over "shard"
        for log in logs:
            gathers = [n for op, axes, n in log if op == "all_gather"]
            rs = [(axes, n) for op, axes, n in log if op == "reduce_scatter"]
            # per unit, traced too (see test_fsdp_training_matches_dense)
            units = [[k for k in names if k in block] for names in UNITS.values()]
            packs = [sum(block[k] for k in u) for u in units]
            # eager: the layers gathered again in the backward, the root kept (FSDP2's root)
            assert sorted(gathers) == sorted(packs + ([] if traced else packs[1:]))
            assert sorted(rs) == sorted((("shard",), 2 * n) for n in packs)
            reduced = [(axes, n) for op, axes, n in log if op == "all_reduce"]
            # this rank's shards of the gradients over "rep" (bucketed at top level); over
            # both axes the loss's pmean and scale's (0-d, whole) gradient
            assert sum(n for axes, n in reduced if axes == ("rep",)) == sum(own.values())
            both = [(op, n) for op, axes, n in log if axes == ("rep", "shard")]
            assert both == [("all_reduce", 8)] * 2
            if not traced:
                assert len([a for a, _ in reduced if a == ("rep",)]) == 1  # one bucket


def test_hsdp_replicate_is_checked():
    """Argument checks, raised before any collective: on an abstract mesh seen from one rank
    (Mesh.simulate), in this process."""
    _hsdp_errors(fs.Mesh.abstract((1, 1), ("rep", "shard")).simulate(0))


def _hsdp_errors(mesh):
    model, _ = _setup()
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh, "shard"))
    x = torch.ones(2, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="share"):
        fs.nn.fsdp_call(model, params, (x,), mesh=mesh, axis="shard", replicate="shard")
    with pytest.raises(ValueError, match="not a mesh axis"):
        fs.nn.fsdp_call(model, params, (x,), mesh=mesh, axis="shard", replicate="dp")
    with pytest.raises(TypeError, match="replicate"):
        fs.nn.fsdp_call(model, params, (x,), mesh=mesh, axis="shard", replicate=3)


def _dense_square_grads(model: nn.Module, x: torch.Tensor) -> dict:
    """The oracle of the one-step tests below: the gradient of ``sum(model(x) ** 2)`` over
    the module's own (dense) parameters, in one process."""
    dense = {k: p.detach() for k, p in model.named_parameters()}
    return torch.func.grad(lambda ps: (torch.func.functional_call(model, ps, (x,)) ** 2).sum())(
        dense
    )


def fsdp_in_cp_body_rank_fn(bf16: bool):
    """One fs.value_and_grad step of FSDP inside a shard_map body over ``cp`` (partial-manual,
    the global view: what ``parallelize`` does for FSDP x CP) on a Linear whose weight and bias
    form one unit (``bf16``: gathered in bfloat16, gradients reduced in float32):
    ``(gradient errors, comm_log records)``."""
    mesh = fs.Mesh.create((2, 2), ("dp", "cp"))
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    x = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    policy = (
        fs.nn.MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if bf16 else None
    )

    def body(ps, xs):
        out = fs.nn.fsdp_call(model, ps, (xs,), mesh=mesh, mp_policy=policy)
        return fs.lax.psum(fs.gather((out * out).sum()), "cp")

    def loss(ps, x):
        run = fs.shard_map(body, mesh, (fs.P(), fs.P(None, "cp")), fs.P(), axis_names={"cp"})
        return fs.gather(run(ps, fs.shard(x, mesh, fs.P("dp", "cp"))))

    with fs.debug.comm_log() as log:
        _, grads = fs.value_and_grad(loss)(params, x)
    want = _dense_square_grads(model, x)
    errors = {
        k: float((fs.gather(grads[k]) - w).abs().max() / w.abs().max()) for k, w in want.items()
    }
    return errors, sorted((r.op, r.axes, r.nbytes) for r in log)


@pytest.mark.parametrize("bf16", [False, True])
def test_fsdp_in_a_cp_body_packs_the_unit_and_matches_dense(world4, bf16):
    """In a shard_map body over cp the unit's blocks are gathered in ONE all_gather (weight
    2x4 + bias 2: 40 bytes in float32, 20 in bfloat16; was one per param, 32 and 8), and the
    gradients equal dense: ONE reduce_scatter over dp of the unit's gathered gradients (80
    bytes; was one per param, 64 + 16), then the sum over cp (the param is invariant over cp,
    the sequence split over it: a pcast, summed in the backward) of the shards, bucketed: one
    all_reduce of 2x4 + 2 values (was one per param of the whole gathered gradient, 64 + 16
    bytes), both in the reduce dtype (float32). Packed, this lost the cp sums
    (the weight's gradient 0.68 off): the body's tracker pcasts the gathered param over cp
    before the op rule pcasts it over dp, and FSDP stood its varying gather in for a view of
    that pcast's result (pcast's forward is a view: found by ``_base``). Per param, the lookup
    missed instead: each gradient all-reduced over dp (the whole gradient's bytes) where a
    reduce_scatter does; in bfloat16 it matched, and the cp sums were lost there too."""
    for errors, log in world4.run(fsdp_in_cp_body_rank_fn, bf16):
        # bfloat16: its rounding of the weights and activations (as test_composition's bf16)
        assert max(errors.values()) < (3e-2 if bf16 else 1e-5), errors
        assert log == sorted(
            [
                ("all_gather", ("dp",), 20 if bf16 else 40),  # the unit: weight (2, 4) + bias (2,)
                ("all_reduce", ("cp",), 4),  # the loss's psum
                ("all_reduce", ("cp",), 40),  # the shards' gradients over cp, one bucket
                ("all_reduce", ("dp",), 4),  # the loss's gather over dp (a sum)
                ("reduce_scatter", ("dp",), 80),  # the unit's gradients, gathered size
            ]
        )


def test_fsdp_plan_splits_uneven_rows_and_keeps_unnestable_ones_whole():
    """FSDP2 shards every param, padding uneven ones: so does fsdp_plan (fshard's uneven
    chunks). Only a dim 0 its base already splits unevenly over base x dp stays whole (the dp
    blocks would not nest in the base blocks), and a param of a hand-written plan like that is
    refused by name before anything is gathered."""
    mesh = fs.Mesh.abstract((2, 2), ("tp", "dp"))
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(3, 8))
    plan = fs.nn.fsdp_plan(model, mesh, "dp", base={"1.weight": fs.P("tp"), "2.weight": fs.P("tp")})
    assert plan == {
        "0.weight": fs.P("dp", None),  # 6 rows over 2: even
        "0.bias": fs.P("dp"),
        "1.weight": fs.P("tp"),  # 3 rows over tp x dp: whole over dp
        "1.bias": fs.P("dp"),  # 3 rows over dp: blocks of 2 and 1
        "2.weight": fs.P(("tp", "dp"), None),  # 8 over 4: nests
        "2.bias": fs.P("dp"),
    }
    rank = mesh.simulate(0)
    params = fs.nn.shard_params(model, rank, {"1.weight": fs.P(("tp", "dp"))})
    with pytest.raises(ValueError, match=r"over \('tp',\) and the FSDP axes \('dp',\) unevenly"):
        fs.nn.fsdp_call(model, params, (torch.ones(2, 4),), mesh=rank, axis="dp")


def fsdp_uneven_rank_fn(where: str):
    """One fs.value_and_grad step of FSDP on params whose rows do not split over dp=2 (3 and 5
    rows: blocks of 2 and 1, 3 and 2), in the global view (the batch a ShardedArray split over
    dp) or in a shard_map body over cp (FSDP x CP): ``(gradient errors, comm_log)``."""
    mesh = fs.Mesh.create((2, 2), ("dp", "cp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 5)).double()
    plan = fs.nn.fsdp_plan(model, mesh)
    assert all(spec.axes == ("dp",) for spec in plan.values()), plan
    params = fs.nn.shard_params(model, mesh, plan)
    x = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def body(ps, xs):
        out = fs.nn.fsdp_call(model, ps, (xs,), mesh=mesh)
        return fs.lax.psum(fs.gather((out * out).sum()), "cp")

    def loss(ps, x):
        if where == "global":
            out = fs.nn.fsdp_call(model, ps, (fs.shard(x, mesh, fs.P("dp")),), mesh=mesh)
            return fs.gather((out * out).sum())
        run = fs.shard_map(body, mesh, (fs.P(), fs.P(None, "cp")), fs.P(), axis_names={"cp"})
        return fs.gather(run(ps, fs.shard(x, mesh, fs.P("dp", "cp"))))

    with fs.debug.comm_log() as log:
        _, grads = fs.value_and_grad(loss)(params, x)
    want = _dense_square_grads(model, x)
    assert all(grads[k].layout == params[k].layout for k in grads)
    errors = {k: float((fs.gather(grads[k]) - w).abs().max()) for k, w in want.items()}
    return errors, [(r.op, r.axes, r.nbytes) for r in log if r.axes == ("dp",)]


@pytest.mark.parametrize("where", ["global", "cp body"])
def test_fsdp_of_uneven_params_matches_dense(world4, where):
    """The unit's blocks padded to the largest (2 rows of (3, 4) + 3 of (5, 3) + biases 2 + 3:
    8 + 2 + 9 + 3 = 22 float64 values) in one all_gather; the gradients reduce-scattered, never
    all-reduced over dp, equal to dense in float64."""
    for errors, log in world4.run(fsdp_uneven_rank_fn, where):
        assert max(errors.values()) < 1e-12, errors
        assert ("all_gather", ("dp",), 22 * 8) in log, log
        scattered = sorted(n for op, _, n in log if op == "reduce_scatter")
        # the unit's gradients, packed and padded: 2 x 22 values (in a body too: was one per
        # param there, each the gathered gradient's size, 12, 3, 15 and 5 values)
        assert scattered == [2 * 22 * 8], log
        assert not [r for r in log if r[0] == "all_reduce" and r[2] > 8], log


def fsdp_uneven_pp_rank_fn():
    """A pipeline over pp=2 of one Linear(5, 5) + tanh per stage, its params FSDP-sharded over
    dp=2 with 5 rows (blocks of 3 and 2), by fs.nn.fsdp_call in the stage; 4 microbatches,
    1F1B: ``(gradient errors against dense, the dp collectives)``."""
    mesh = fs.Mesh.create((2, 2), ("pp", "dp"))
    gen = torch.Generator().manual_seed(2)
    f64 = torch.float64
    block = nn.Linear(5, 5).double()
    dense = {"weight": torch.randn(2, 1, 5, 5, generator=gen, dtype=f64) / 2}
    dense["bias"] = torch.randn(2, 1, 5, generator=gen, dtype=f64)
    x = torch.randn(4, 4, 5, generator=gen, dtype=f64)  # 4 microbatches of 4 rows
    t = torch.randn(4, 4, 5, generator=gen, dtype=f64)
    specs = {"weight": fs.P("pp", None, "dp"), "bias": fs.P("pp", None, "dp")}
    params = {k: fs.shard(v, mesh, specs[k]) for k, v in dense.items()}

    def stage(ps, h):
        for i in range(next(iter(ps.values())).shape[0]):
            p = {n: v[i] for n, v in ps.items()}
            h = torch.tanh(fs.nn.fsdp_call(block, p, (h,), mesh=mesh, axis="dp"))
        return h

    def loss(ps, x, t):
        return fs.parallel.pipeline(
            stage, ps, x, mesh, loss_fn=lambda _, y, tm: ((y - tm) ** 2).mean(), targets=t,
            schedule="1f1b",
        )  # fmt: skip

    batch = fs.P(None, "dp")
    xs, ts = fs.shard(x, mesh, batch), fs.shard(t, mesh, batch)
    with fs.debug.comm_log() as log:
        _, grads = fs.value_and_grad(loss)(params, xs, ts)

    def dense_loss(ps):
        total = 0
        for m in range(4):
            h = x[m]
            for s in range(2):
                h = torch.tanh(F.linear(h, ps["weight"][s, 0], ps["bias"][s, 0]))
            total = total + ((h - t[m]) ** 2).mean()
        return total / 4

    want = torch.func.grad(dense_loss)(dense)
    errors = {k: float((fs.gather(grads[k]) - w).abs().max()) for k, w in want.items()}
    return errors, [(r.op, r.nbytes) for r in log if r.axes == ("dp",)]


def test_fsdp_of_uneven_params_in_pipeline_stages_reduces_once_per_step(world4):
    """Uneven FSDP params in pipeline stages: each stage's unit gathered once a step (its
    blocks padded to 3 rows: weight 15 + bias 3 float64 values) and reduce-scattered once a
    step (the pipeline's step-mode gradient sync pads the accumulated gradient's chunks, 2 x
    18 values), never all-reduced over dp; equal to dense."""
    for rank, (errors, log) in enumerate(world4.run(fsdp_uneven_pp_rank_fn)):
        assert max(errors.values()) < 1e-12, errors
        want = [("all_gather", 18 * 8), ("reduce_scatter", 2 * 18 * 8)]
        if rank >= 2:  # the last stage: the loss (a mean over dp's rows) summed once a step
            want += [("all_reduce", 8)]
        assert sorted(log) == sorted(want), log


def fsdp_prefix_rank_fn(where: str):
    """One step of FSDP over ``("dp", "cp")`` (parallelize's dp_shard x cp) of a module whose
    first Linear is split by its base plan over ``ep`` (size 1 here) on dim 0: its 6 rows do
    not split over ep x dp x cp = 4, so fsdp_plan splits it over the prefix ``("ep", "dp")``
    (an expert's layout under FSDP x EP x CP), the second Linear over ``("dp", "cp")``; one
    unit holding both groups. ``where``: ``"global"`` (fs.value_and_grad, the batch's rows
    over dp x cp) or ``"cp body"`` (parallelize's FSDP x CP: a shard_map body over cp, the
    params split over cp entering it as they are), each with ``" traced"``: under torch.func.
    Returns ``(gradient errors against dense, the specs, comm_log records)``."""
    mesh = fs.Mesh.create((1, 2, 2), ("ep", "dp", "cp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 8)).double()
    base = {"0.weight": fs.P("ep"), "0.bias": fs.P("ep")}
    plan = fs.nn.fsdp_plan(model, mesh, ("dp", "cp"), base=base)
    params = fs.nn.shard_params(model, mesh, plan)
    axes = ("dp", "cp")
    x = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def body(ps, xs):
        out = fs.nn.fsdp_call(model, ps, (xs,), mesh=mesh, axis=axes)
        return fs.lax.psum(fs.gather((out * out).sum()), "cp")

    def loss(ps, x):
        if not where.startswith("cp body"):
            xs = fs.shard(x.reshape(8, 4), mesh, fs.P(axes))
            out = fs.nn.fsdp_call(model, ps, (xs,), mesh=mesh, axis=axes)
            return fs.gather((out * out).sum())
        specs = {k: None if "cp" in v.spec.axes else fs.P() for k, v in ps.items()}
        run = fs.shard_map(body, mesh, (specs, fs.P(None, "cp")), fs.P(), axis_names={"cp"})
        return fs.gather(run(ps, fs.shard(x, mesh, fs.P("dp", "cp"))))

    vg = _value_and_grad(loss, where.endswith("traced"))
    with fs.debug.comm_log() as log:
        _, grads = vg(params, x)
    want = _dense_square_grads(model, x.reshape(8, 4))
    assert all(grads[k].layout == params[k].layout for k in grads)
    errors = {k: float((fs.gather(grads[k]) - w).abs().max()) for k, w in want.items()}
    specs = {k: v.spec for k, v in params.items()}
    return errors, specs, sorted((r.op, r.axes, r.nbytes) for r in log)


@pytest.mark.parametrize("where", ["global", "global traced", "cp body", "cp body traced"])
def test_fsdp_splits_params_over_a_prefix_of_the_axes_that_nests(world4, where):
    """FSDP over ("dp", "cp") with a param whose base split (ep) leaves rows for dp but not
    dp x cp (an expert of parallelize's FSDP x EP x CP): it is split over ("ep", "dp") (was
    whole over both FSDP axes, all-reduced like DDP's), one unit holding both groups. Each
    group is gathered in one all_gather and reduce-scattered in one reduce_scatter over its
    own axes: the prefix pack over ("dp",) (0.weight's 3 x 4 rows + 0.bias's 3: 15 float64,
    120 bytes), the rest over ("dp", "cp") (2.weight's 2 x 6 + 2.bias's 2: 14 float64, 112
    bytes; the reduce_scatters take the gathered gradients: 2 x 120 and 4 x 112); the prefix
    params' gradients summed over cp on their shards (one bucketed all_reduce of 120 bytes
    under fs.value_and_grad, one per param under torch.func: 96 and 24), no all_reduce of
    a gathered gradient. Equal to dense."""
    traced = where.endswith("traced")
    prefix, rest = ("dp",), ("dp", "cp")
    for errors, specs, log in world4.run(fsdp_prefix_rank_fn, where):
        assert max(errors.values()) < 1e-12, errors
        assert specs == {
            "0.weight": fs.P(("ep", "dp"), None),  # 6 rows: over ep x dp = 2, not 4
            "0.bias": fs.P(("ep", "dp")),
            "2.weight": fs.P(("dp", "cp"), None),
            "2.bias": fs.P(("dp", "cp")),
        }
        # eager: the unit (the root of a module with no layers) gathered again in the backward
        gathers = [("all_gather", prefix, 120), ("all_gather", rest, 112)] * (1 if traced else 2)
        sums = [("all_reduce", ("cp",), 96), ("all_reduce", ("cp",), 24)] if traced else [
            ("all_reduce", ("cp",), 120)
        ]  # fmt: skip
        if where.startswith("cp body"):  # the loss's psum over cp, its gather over dp
            loss = [("all_reduce", ("cp",), 8), ("all_reduce", ("dp",), 8)]
        else:
            loss = [("all_reduce", rest, 8)]
        scatters = [("reduce_scatter", prefix, 240), ("reduce_scatter", rest, 448)]
        assert log == sorted(gathers + sums + loss + scatters), log


def test_fsdp_call_refuses_fsdp_axes_before_others_in_dim_0():
    """A hand-written spec splitting dim 0 over the FSDP axis before another (P(("dp", "tp"))
    with axis "dp") is refused by name before anything is gathered: its blocks over dp are not
    contiguous rows of its tp block, so the gather gave a wrong weight silently (main c2f6699:
    the output 1.86 off dense on 4 ranks)."""
    rank = fs.Mesh.abstract((2, 2), ("tp", "dp")).simulate(0)
    model = nn.Linear(4, 8)
    params = fs.nn.shard_params(model, rank, {"weight": fs.P(("dp", "tp")), "bias": fs.P("dp")})
    with pytest.raises(ValueError, match=r"'weight'.*FSDP axes \('dp',\) before \('tp',\)"):
        fs.nn.fsdp_call(model, params, (torch.ones(2, 4),), mesh=rank, axis="dp")


def test_fsdp_plan_adds_the_axes_a_base_split_of_dim_0_leaves():
    """A base plan may split dim 0 over FSDP axes other than the first (parallelize's FSDP x
    EP: experts over ep, FSDP over ("dp_shard", "ep")): FSDP adds the others after them,
    the longest prefix that nests; a base over the first FSDP axis, over one outside dim 0 or
    over one before a non-FSDP axis in dim 0 is refused by name (fsdp_call could not tell
    the base's split from FSDP's, or gathering would not give the block)."""
    am = fs.Mesh.abstract((2, 2, 2), ("dp_shard", "ep", "tp"))
    plan = fs.nn.fsdp_plan(
        nn.Linear(4, 4), am, ("dp_shard", "ep"), base={"weight": fs.P("ep"), "bias": fs.P()}
    )
    assert plan == {"weight": fs.P(("ep", "dp_shard"), None), "bias": fs.P(("dp_shard", "ep"))}
    for spec in (fs.P("dp_shard"), fs.P(None, "ep"), fs.P(("ep", "tp"))):
        with pytest.raises(ValueError, match=r"\['weight'\]: base spec"):
            fs.nn.fsdp_plan(nn.Linear(4, 4), am, ("dp_shard", "ep"), base={"weight": spec})
    # stacked experts over ep with their [gate | up] halves over tp (a Parts on dim 1): dim 0
    # is the P's, the experts' split over ep, and FSDP adds dp_shard after it as for a P
    experts = fs.Parts(fs.P("ep", "tp", None), 1, (2, 2))
    plan = fs.nn.fsdp_plan(
        nn.Linear(4, 4), am, ("dp_shard", "ep"), base={"weight": experts, "bias": fs.P()}
    )
    assert plan["weight"] == fs.Parts(fs.P(("ep", "dp_shard"), "tp", None), 1, (2, 2))


def _hf_fsdp_tp_step(arch: str, row_outputs: tuple, fused):
    """One fs.value_and_grad step of fsdp_call on the zoo's tiny transformers ``arch`` with
    FSDP over dp x its TP plan over tp (2 x 2), the row-parallel outputs (modules ending in
    ``row_outputs``) reduced where they leave their layer, rows kept over dp: ``(worst
    gradient / loss difference from dense, the specs of the params ``fused(name, spec)``
    picks, every gradient in its param's layout, the comm_log records (op, axes, bytes), each
    unit's block bytes)``."""
    from tests import hf_zoo

    mesh = fs.Mesh.create((2, 2), ("dp", "tp"))
    model = hf_zoo.build(arch)
    tp, which = hf_zoo.tp_plan(model)
    plan = fs.nn.fsdp_plan(model, mesh, "dp", base=tp)
    params = fs.nn.shard_params(model, mesh, plan)
    units = fs.nn.fsdp_units(model)
    outputs = {n: fs.P("dp") for n, _ in model.named_modules() if n.endswith(row_outputs)}
    ids = torch.randint(
        0, hf_zoo.VOCAB, (4, hf_zoo.SEQ), generator=torch.Generator().manual_seed(1)
    )
    x = fs.shard(ids, mesh, fs.P("dp"))

    def loss(ps, x):
        kwargs = {"labels": x, "use_cache": False}
        out = fs.nn.fsdp_call(model, ps, (x,), kwargs, mesh=mesh, axis="dp", outputs=outputs)
        return fs.gather(out.loss)

    def dense_loss(ps):
        kwargs = {"labels": ids, "use_cache": False}
        return torch.func.functional_call(model, ps, (ids,), kwargs).loss

    with fs.debug.comm_log() as log:
        value, grads = fs.value_and_grad(loss)(params, x)
    dense = {k: p.detach() for k, p in model.named_parameters()}
    want, want_value = torch.func.grad_and_value(dense_loss)(dense)
    worst = abs(float(value) - float(want_value))
    for k, g in grads.items():
        scale = float(want[k].abs().max()) + 1e-6
        worst = max(worst, float((fs.gather(g) - want[k]).abs().max()) / scale)
    layouts = all(grads[k].layout == params[k].layout for k in grads)
    specs = {k: v.spec for k, v in params.items() if fused(k, v.spec)}
    # each unit's bytes of this rank's blocks of its params split over dp, from the global
    # shapes and the specs (every dim here splits evenly: a block is the param's 1 / the
    # product of its axes' sizes); FSDP's packed gather sends exactly these
    blocks = {
        u: sum(
            4 * params[n].numel() // math.prod(mesh.size(a) for a in params[n].spec.axes)
            for n in ns
            if "dp" in params[n].spec.axes
        )
        for u, ns in units.items()
    }
    return which, (worst, specs, layouts, [(r.op, r.axes, r.nbytes) for r in log], blocks)


def gpt2_fsdp_tp_rank_fn():
    """:func:`_hf_fsdp_tp_step` on GPT-2 (2 layers) with a Megatron plan by the module names,
    the c_attn specs."""
    which, out = _hf_fsdp_tp_step(
        "gpt2", (".attn.c_proj", ".mlp.c_proj"), lambda name, _: "c_attn" in name
    )
    assert which == "megatron"
    return out


@pytest.mark.timeout(600)
def test_fsdp_x_tp_shards_gpt2s_fused_c_attn_and_matches_dense(world4):
    """fsdp_call on a transformers GPT-2 (tiny: 2 layers, hidden 32) with FSDP over dp and a
    Megatron TP plan over tp (2 x 2): c_attn's Conv1D weight (32, 96), split per part over tp
    on dim 1 (fs.Parts), is split over dp on dim 0 too (was whole over dp, its gradient
    all-reduced: 2 x 6,144 bytes a step), and c_attn's bias (96, a Parts on dim 0) has each part
    split over ('tp', 'dp') (was whole over dp: 2 x 48 values all-reduced), both gathered in
    their layer's one all_gather and reduce-scattered in its one reduce_scatter. The step's
    FSDP bytes are the per-strategy sums of docs/parallelism.md: per layer unit its blocks,
    12,896 bytes a rank (the tp-split weights and c_fc's and c_attn's biases, 12,512 values,
    over dp x tp; the norms and row biases, 192, over dp), gathered in the forward and again
    in the backward; the root's (wte 128 x 32, wpe 64 x 32, ln_f: 12,416 bytes) once, kept for
    the backward; each reduce_scatter dp x those bytes. Over dp besides: the loss's two
    scalars and the position embedding's output (8 x 32, the invariant lookup meeting the
    batch's rows): no all_reduce of a c_attn param. Loss and
    every gradient equal to dense, each gradient in its param's layout."""
    pytest.importorskip("transformers")
    for worst, specs, layouts, log, blocks in world4.run(gpt2_fsdp_tp_rank_fn):
        assert worst < 1e-5, worst
        assert layouts
        for i in range(2):
            assert specs[f"transformer.h.{i}.attn.c_attn.weight"] == fs.Parts(
                fs.P("dp", "tp"), 1, (32, 32, 32)
            )
            assert specs[f"transformer.h.{i}.attn.c_attn.bias"] == fs.Parts(
                fs.P(("tp", "dp")), 0, (32, 32, 32)
            )
        layers = ["transformer.h.0", "transformer.h.1"]
        assert blocks == {"": 12416, layers[0]: 12896, layers[1]: 12896}
        dp = ("dp",)
        want = [("all_gather", dp, blocks[u]) for u in ["", *layers, *layers]]
        want += [("reduce_scatter", dp, 2 * b) for b in blocks.values()]
        want += [("all_reduce", dp, 4)] * 2
        want += [("all_reduce", dp, 8 * 32 * 4)]
        assert sorted(r for r in log if r[1] == dp) == sorted(want)
        # TP's: one all_reduce per row-parallel output forward and column input backward
        assert sorted(r for r in log if r[1] != dp) == [("all_reduce", ("tp",), 2 * 8 * 32 * 4)] * 8


def test_fsdp_plan_splits_each_part_of_a_parts_param_on_dim_0():
    """A fused projection split per part over tp on dim 0 (fs.Parts: Phi-3's qkv_proj and
    gate_up_proj weights, GPT-2's c_attn bias) has each part split over tp and then the FSDP
    axes (FSDP2 shards it on dim 0 too): rank (dp, tp)'s block is sub-chunk dp of its tp chunk
    of every part, uneven parts included where those ceil-div chunks nest in the tp chunks
    (DESIGN §2); parts that do not (6 rows: tp chunks of 3 do not split into the flat chunks
    of 2 over tp x dp) keep the base spec, whole over the FSDP axes; a tuple of FSDP axes
    gets the longest prefix that nests."""
    qkv = fs.Parts(fs.P("tp", None), 0, (8, 4, 4))
    odd = fs.Parts(fs.P("tp", None), 0, (8, 3, 3))  # 3 over tp x dp: chunks 1, 1, 1, 0
    bad = fs.Parts(fs.P("tp", None), 0, (8, 6))
    bias = fs.Parts(fs.P("tp"), 0, (8, 8, 8))
    model = _params_of(qkv=(16, 8), odd=(14, 8), bad=(14, 8), bias=(24,))
    base = {"qkv": qkv, "odd": odd, "bad": bad, "bias": bias}
    am = fs.Mesh.abstract((2, 2), ("dp", "tp"))
    assert fs.nn.fsdp_plan(model, am, "dp", base=base) == {
        "qkv": fs.Parts(fs.P(("tp", "dp"), None), 0, (8, 4, 4)),
        "odd": fs.Parts(fs.P(("tp", "dp"), None), 0, (8, 3, 3)),
        "bad": bad,
        "bias": fs.Parts(fs.P(("tp", "dp")), 0, (8, 8, 8)),
    }
    # the blocks: rank (dp, tp) holds sub-chunk dp of its tp chunk of each part, so the
    # blocks over dp, in dp order, are each part's tp block cut in order
    lay = fs.Layout.of(am, fs.Parts(fs.P(("tp", "dp"), None), 0, (8, 3, 3)), (14, 8))
    base_lay = fs.Layout.of(am, odd, (14, 8))
    for tp in range(2):
        ranks = [2 * dp + tp for dp in range(2)]
        for p, whole in enumerate(base_lay.blocks(ranks[0])):
            subs = [lay.blocks(r)[p] for r in ranks]
            start, size = whole.shard_offsets[0], whole.shard_sizes[0]
            assert subs[0].shard_offsets[0] == start
            assert subs[1].shard_offsets[0] == start + subs[0].shard_sizes[0]
            assert subs[0].shard_sizes[0] + subs[1].shard_sizes[0] == size
    assert [[m.shard_sizes[0] for m in lay.blocks(r)] for r in range(4)] == [
        [2, 1, 1],  # (dp 0, tp 0): chunk 0 of 4 of each part
        [2, 1, 1],  # (dp 0, tp 1): chunk 2
        [2, 1, 1],  # (dp 1, tp 0): chunk 1
        [2, 0, 0],  # (dp 1, tp 1): chunk 3, none of k and v
    ]
    # FSDP over a tuple: 8 rows over tp x dp_shard x cp = 8 nest, 4 do not: the prefix
    am = fs.Mesh.abstract((2, 2, 2), ("dp_shard", "cp", "tp"))
    plan = fs.nn.fsdp_plan(model, am, ("dp_shard", "cp"), base={"qkv": qkv})
    assert plan["qkv"] == fs.Parts(fs.P(("tp", "dp_shard"), None), 0, (8, 4, 4))


def fsdp_uneven_parts_rank_fn(where: str):
    """One step of FSDP x TP (dp 2 x tp 2) on a Linear(4, 14) whose weight and bias are fused
    ``[q | k | v]`` of (8, 3, 3) rows split per part over tp on dim 0 (fs.Parts): each part
    split over ('tp', 'dp'), uneven (tp 1's blocks over dp: 2 + 1 + 1 and 2 + 0 + 0 rows,
    padded to 4 for the gather). ``where``: ``"global"`` (the batch a ShardedArray, under
    fs.value_and_grad: the eager packed gather), ``"remat"`` (that under fs.remat: its
    recompute the typed traced gather), ``"local"`` (fsdp_call on the local blocks,
    the loss psum'd: the untyped eager path) or ``"traced"`` (``"local"`` under
    torch.func.grad: the traced packed gather). ``(gradient errors, layouts kept, dp comm_log)``."""
    mesh = fs.Mesh.create((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Linear(4, 14).double()
    sizes = (8, 3, 3)
    base = {"weight": fs.Parts(fs.P("tp", None), 0, sizes), "bias": fs.Parts(fs.P("tp"), 0, sizes)}
    plan = fs.nn.fsdp_plan(model, mesh, "dp", base=base)
    assert plan == {
        "weight": fs.Parts(fs.P(("tp", "dp"), None), 0, sizes),
        "bias": fs.Parts(fs.P(("tp", "dp")), 0, sizes),
    }
    params = fs.nn.shard_params(model, mesh, plan)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # each output feature weighted by its index: a loss that sees the features' order (a sum
    # of squares alone does not: a weight and bias permuted alike give it unchanged)
    c = torch.arange(1, 15, dtype=torch.float64)
    boxes = fs.Layout.of(mesh, base["weight"], (14, 4)).blocks(mesh.rank)
    c_local = torch.cat([c[m.shard_offsets[0] :][: m.shard_sizes[0]] for m in boxes])

    def loss(ps, x):
        if where in ("global", "remat"):
            xs = fs.shard(x, mesh, fs.P("dp"))
            call = lambda ps, xs: fs.nn.fsdp_call(model, ps, (xs,), mesh=mesh)  # noqa: E731
            out = (fs.remat(call) if where == "remat" else call)(ps, xs)
            out = fs.reshard(out, fs.P("dp", None))  # the features whole, in order
            return fs.gather((out * out * c).sum())
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh)  # [q_r | k_r | v_r] of its rows
        return fs.lax.psum((out * out * c_local).sum(), ("dp", "tp"), mesh=mesh)

    with fs.debug.comm_log() as log:
        if where in ("global", "remat"):
            _, grads = fs.value_and_grad(loss)(params, x)
        else:
            xs = fs.shard(x, mesh, fs.P("dp")).local
            vg = _value_and_grad(loss, where == "traced")
            _, grads = vg(params, xs)
    dense = {k: p.detach() for k, p in model.named_parameters()}
    want = torch.func.grad(lambda ps: (torch.func.functional_call(model, ps, (x,)) ** 2 * c).sum())(
        dense
    )
    layouts = all(grads[k].layout == params[k].layout for k in grads)
    errors = {k: float((fs.gather(grads[k]) - w).abs().max()) for k, w in want.items()}
    return errors, layouts, [(r.op, r.nbytes) for r in log if r.axes == ("dp",)]


@pytest.mark.parametrize("where", ["global", "remat", "local", "traced"])
def test_fsdp_of_uneven_parts_on_dim_0_matches_dense(world4, where):
    """A fused weight and bias of uneven parts (8, 3, 3) on dim 0, each part split over
    ('tp', 'dp'): gathered over dp in one all_gather (the weight's 4 rows x 4 and the bias's 4,
    tp 1's dp 1 block padded from 2 rows: 20 float64 values a rank), put back in part order,
    the gradients equal to dense in float64 and reduce-scattered in one reduce_scatter (2 x
    20 values), never all-reduced over dp."""
    for errors, layouts, log in world4.run(fsdp_uneven_parts_rank_fn, where):
        assert max(errors.values()) < 1e-12, errors
        assert layouts
        collectives = sorted(r for r in log if r[0] != "all_reduce" or r[1] > 8)
        gathers = 2 if where == "remat" else 1  # the recompute gathers the unit again
        want = [("all_gather", 20 * 8)] * gathers + [("reduce_scatter", 2 * 20 * 8)]
        assert collectives == want, log


def phi3_fsdp_tp_rank_fn():
    """:func:`_hf_fsdp_tp_step` on Phi-3 (2 layers) with its shipped TP plan (fused qkv_proj /
    gate_up_proj: fs.Parts on dim 0), the fused params' specs."""
    return _hf_fsdp_tp_step(
        "phi3", (".o_proj", ".down_proj"), lambda _, spec: isinstance(spec, fs.Parts)
    )[1]


@pytest.mark.timeout(600)
def test_fsdp_x_tp_shards_phi3s_fused_qkv_and_gate_up_on_dim_0_and_matches_dense(world4):
    """fsdp_call on a transformers Phi-3 (tiny: 2 layers, hidden 32, 4 heads, 2 kv heads) with
    FSDP over dp and its shipped TP plan over tp (2 x 2): the fused qkv_proj (64, 32) and
    gate_up_proj (128, 32) Linear weights, split per part over tp on dim 0 (fs.Parts), have
    each part split over ('tp', 'dp') (were whole over dp, their gradients all-reduced):
    gathered in their layer's one all_gather, put back in part order, and reduce-scattered in
    its one reduce_scatter. Every param is split over dp, so each unit's block bytes are its
    params' bytes / 4 (tp-split) or / 2 (norms over dp alone) and its all_gathers and
    reduce_scatters move exactly those; no all_reduce over dp but the loss's two scalars. Loss
    and every gradient equal to dense, in the params' layouts."""
    pytest.importorskip("transformers")
    for worst, specs, layouts, log, blocks in world4.run(phi3_fsdp_tp_rank_fn):
        assert worst < 1e-5, worst
        assert layouts
        for i in range(2):
            pre = f"model.layers.{i}."
            assert specs[pre + "self_attn.qkv_proj.weight"] == fs.Parts(
                fs.P(("tp", "dp"), None), 0, (32, 16, 16)
            )
            assert specs[pre + "mlp.gate_up_proj.weight"] == fs.Parts(
                fs.P(("tp", "dp"), None), 0, (64, 64)
            )
        layers = ["model.layers.0", "model.layers.1"]
        # per layer: qkv 64 x 32, gate_up 128 x 32, o_proj 32 x 32, down 32 x 64 over 4, the
        # two norms (32 each) over dp; the root: embed and head (128 x 32) over 4, norm over 2
        assert blocks == {"": 4 * (2 * 128 * 32 // 4 + 16), layers[0]: 9344, layers[1]: 9344}
        assert 9344 == 4 * ((64 + 128 + 32 + 64) * 32 // 4 + 2 * 16)
        dp = ("dp",)
        want = [("all_gather", dp, blocks[u]) for u in ["", *layers, *layers]]
        want += [("reduce_scatter", dp, 2 * b) for b in blocks.values()]
        want += [("all_reduce", dp, 4)] * 2  # the loss's two scalars: no param's
        assert sorted(r for r in log if r[1] == dp) == sorted(want)


def _params_of(**shapes) -> nn.Module:
    """A module holding one parameter of each of ``shapes`` (zeros: only the shapes matter)."""
    m = nn.Module()
    for name, shape in shapes.items():
        m.register_parameter(name, nn.Parameter(torch.zeros(shape)))
    return m


def test_fsdp_plan_splits_dim_0_of_a_parts_param_split_per_part_on_another_dim():
    """A fused projection split per part over tp on a dim other than 0 (fs.Parts: GPT-2's
    Conv1D c_attn weight (in, 3 x out), transformers' packed experts gate_up (E, 2I, H)) has
    its dim 0 split over the FSDP axes as a P's is (FSDP2's fully_shard shards it on dim 0,
    _StridedShard keeping the tp parts), nested in a base split of dim 0 (experts over ep, the
    longest prefix of the FSDP axes that nests), its parts dim keeping its per-part split (a
    Parts on dim 0: test_fsdp_plan_splits_each_part_of_a_parts_param_on_dim_0)."""
    c_attn = fs.Parts(fs.P(None, "tp"), 1, (8, 8, 8))
    bias = fs.Parts(fs.P("tp"), 0, (8, 8, 8))
    qkv = fs.Parts(fs.P("tp", None), 0, (8, 4, 4))
    gate_up = fs.Parts(fs.P(None, "tp", None), 1, (4, 4))
    model = _params_of(c_attn=(8, 24), bias=(24,), qkv=(16, 8), gate_up=(4, 8, 6), odd=(5, 24))
    base = {"c_attn": c_attn, "bias": bias, "qkv": qkv, "gate_up": gate_up, "odd": c_attn}
    am = fs.Mesh.abstract((2, 2), ("dp", "tp"))
    assert fs.nn.fsdp_plan(model, am, "dp", base=base) == {
        "c_attn": fs.Parts(fs.P("dp", "tp"), 1, (8, 8, 8)),
        "bias": fs.Parts(fs.P(("tp", "dp")), 0, (8, 8, 8)),
        "qkv": fs.Parts(fs.P(("tp", "dp"), None), 0, (8, 4, 4)),
        "gate_up": fs.Parts(fs.P("dp", "tp", None), 1, (4, 4)),
        # 5 rows over dp: blocks of 3 and 2, padded for the gather as a P's
        "odd": fs.Parts(fs.P("dp", "tp"), 1, (8, 8, 8)),
    }
    # a tuple of FSDP axes, the experts over ep by the base: ep, then the longest prefix of the
    # others whose product with ep divides the 4 experts (as a P's, fsdp_plan's nesting rule)
    experts = fs.Parts(fs.P("ep", "tp", None), -2, (4, 4))
    am = fs.Mesh.abstract((2, 2, 2, 2), ("ep", "dp_shard", "cp", "tp"))
    plan = fs.nn.fsdp_plan(model, am, ("dp_shard", "cp"), base={"gate_up": experts})
    assert plan["gate_up"] == fs.Parts(fs.P(("ep", "dp_shard"), "tp", None), -2, (4, 4))
    am = fs.Mesh.abstract((2, 2, 2), ("dp_shard", "ep", "tp"))
    plan = fs.nn.fsdp_plan(model, am, ("dp_shard", "ep"), base={"gate_up": experts})
    assert plan["gate_up"] == fs.Parts(fs.P(("ep", "dp_shard"), "tp", None), -2, (4, 4))
    # 6 experts over ep = 2 do not split over ep x dp_shard: the base spec, whole over FSDP
    six = _params_of(gate_up=(6, 8, 6))
    assert fs.nn.fsdp_plan(six, am, ("dp_shard", "ep"), base={"gate_up": experts}) == {
        "gate_up": experts
    }
    # the layout of the sharded param: rank (dp, tp)'s block is its dp rows of its tp chunk of
    # every part, and gathering dim 0 over dp gives its block under the base plan
    am = fs.Mesh.abstract((2, 2), ("dp", "tp"))
    lay = fs.Layout.of(am, fs.Parts(fs.P("dp", "tp"), 1, (8, 8, 8)), (8, 24))
    base_lay = fs.Layout.of(am, c_attn, (8, 24))
    for rank in range(4):
        blocks = [(m.shard_offsets, m.shard_sizes) for m in lay.blocks(rank)]
        dp, tp = divmod(rank, 2)
        assert blocks == [((4 * dp, 8 * j + 4 * tp), (4, 4)) for j in range(3)]
        assert [m.shard_offsets[1] for m in base_lay.blocks(rank)] == [b[0][1] for b in blocks]
