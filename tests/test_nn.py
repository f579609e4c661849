"""fs.nn.shard_params / functional_call / megatron_plan on 2 Gloo ranks, against dense torch."""

import gc
import inspect
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fshard as fs
from fshard import _swap
from fshard.nn import match_plan


class GatherLinear(nn.Module):
    """A Linear whose forward gathers its (possibly sharded) weight: needs only the core."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i))
        self.bias = nn.Parameter(torch.randn(o))

    def forward(self, x):
        w, b = self.weight, self.bias
        if isinstance(w, fs.ShardedArray):
            w, b = fs.gather(w), fs.gather(b)
        return F.linear(x, w, b)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = GatherLinear(4, 6)
        self.fc2 = GatherLinear(6, 3)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, *, shift=0.0):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale + shift


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_match_plan_globs_regex_and_errors():
    names = ["a.fc1.weight", "a.fc1.bias", "b.fc1.weight", "head.weight"]
    got = match_plan(names, {"*.fc1.weight": fs.P("tp"), "re:head\\.w.*": fs.P(None, "tp")})
    assert got == {
        "a.fc1.weight": fs.P("tp"),
        "a.fc1.bias": fs.P(),
        "b.fc1.weight": fs.P("tp"),
        "head.weight": fs.P(None, "tp"),
    }
    # first match wins; a pattern that matches nothing (or only taken names) is an error
    got = match_plan(["x.w", "y.w"], {"x.*": fs.P("a"), "*.w": fs.P("b")})
    assert got == {"x.w": fs.P("a"), "y.w": fs.P("b")}
    with pytest.raises(ValueError, match="match no parameter"):
        match_plan(names, {"*.fc3.weight": fs.P("tp")})
    with pytest.raises(ValueError, match="match no parameter"):
        match_plan(names, {"*.weight": fs.P("tp"), "head.weight": fs.P()})
    with pytest.raises(TypeError, match="fs.P"):
        match_plan(names, {"*.weight": ("tp",)})
    with pytest.raises(ValueError, match="regex"):
        match_plan(names, {"re:(": fs.P()})
    plan = fs.nn.megatron_plan(column=["*.fc1"], row=["*.fc2"], vocab=["emb"])
    assert plan == {
        "*.fc1.weight": fs.P("tp", None),
        "*.fc1.bias": fs.P("tp"),
        "*.fc2.weight": fs.P(None, "tp"),
        "emb.weight": fs.P("tp", None),
        "*.fc2": fs.nn.Output(fs.P()),
        "emb": fs.nn.Output(fs.P()),
    }
    assert "*.fc2" not in fs.nn.megatron_plan(row=["*.fc2"], row_output=None)
    # Output entries are module-output layouts, skipped by match_plan (parameter names)
    row_plan = fs.nn.megatron_plan(row=["*.fc2"])
    assert match_plan(["a.fc2.weight"], row_plan) == {"a.fc2.weight": fs.P(None, "tp")}
    with pytest.raises(TypeError, match="fs.nn.Output"):
        match_plan(names, {"*.weight": fs.nn.Output("tp")})
    with pytest.raises(TypeError, match="list of globs"):
        fs.nn.megatron_plan(column="fc1")


def test_functional_call_swaps_and_restores_dense():
    torch.manual_seed(0)
    net = Net()
    originals = {k: v for k, v in net.named_parameters()}
    x = torch.randn(5, 4)
    new = {k: torch.randn_like(v) for k, v in originals.items()}
    out = fs.nn.functional_call(net, new, (x,), {"shift": 1.0})
    want = torch.func.functional_call(net, new, (x,), {"shift": 1.0})
    torch.testing.assert_close(out, want)
    assert dict(net.named_parameters()) == originals  # restored
    assert "weight" not in net.fc1.__dict__
    # restored on error too
    with pytest.raises(RuntimeError):
        fs.nn.functional_call(net, new, (torch.randn(5, 7),))
    assert dict(net.named_parameters()) == originals and "weight" not in net.fc1.__dict__
    # buffers can be swapped; unknown names and bad values are errors naming them
    out = fs.nn.functional_call(net, {"scale": torch.tensor(3.0)}, x)
    torch.testing.assert_close(out, net(x) * 1.5)
    assert float(net.scale) == 2.0
    with pytest.raises(ValueError, match="fc9.weight"):
        fs.nn.functional_call(net, {"fc9.weight": torch.ones(1)}, (x,))
    with pytest.raises(TypeError, match="fc1.weight"):
        fs.nn.functional_call(net, {"fc1.weight": 3.0}, (x,))


def test_errors_list_every_bad_entry():
    """shard_params, functional_call and load_params name every entry that does not fit,
    before anything is sharded or swapped (an abstract mesh: nothing communicates)."""
    net, mesh = Net(), fs.Mesh.abstract((2,), ("tp",))
    plan = {"fc1.weight": fs.P(None, None, "tp"), "fc1.bias": fs.P("tp"), "fc2.*": fs.P("q")}
    with pytest.raises(ValueError) as info:
        fs.nn.shard_params(net, mesh, plan)
    msg = str(info.value)
    assert "(3 leaves)" in msg and "params['fc1.bias']" not in msg, msg
    assert "params['fc1.weight']: shape (6, 4), spec P(None, None, 'tp')" in msg, msg
    assert "params['fc2.weight']: shape (3, 6), spec P('q')" in msg and "'q'" in msg, msg
    assert "params['fc2.bias']" in msg and "fix the plan" in msg, msg
    x = torch.randn(2, 4)
    bad = {"fc1.weight": 3.0, "fc1.bias": torch.zeros(6), "fc9.weight": torch.ones(1)}
    with pytest.raises(ValueError) as info:
        fs.nn.functional_call(net, bad, (x,))
    msg = str(info.value)
    assert "params['fc1.weight']: got float" in msg and "params['fc1.bias']" not in msg, msg
    assert "params['fc9.weight']: not a parameter or buffer" in msg, msg
    assert dict(net.named_parameters())["fc1.weight"] is net.fc1.weight  # nothing swapped
    before = net.fc2.bias.detach().clone()
    with pytest.raises(ValueError) as info:
        fs.nn.load_params(
            net, {"fc1.bias": torch.zeros(5), "fc2.bias": torch.ones(3), "scale": torch.ones(2)}
        )
    msg = str(info.value)
    assert "params['fc1.bias']: shape (5,); the module's GatherLinear.bias has shape (6,)" in msg
    assert "params['scale']: shape (2,)" in msg and "params['fc2.bias']" not in msg, msg
    assert torch.equal(net.fc2.bias.detach(), before)  # nothing written: checked up front


def shard_and_grad_rank_fn():
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    net = Net()
    plan = {"fc1.*": fs.P("tp"), "re:fc2\\.weight": fs.P(None, "tp")}
    weights = net.state_dict()  # read before sharding: refused after (the params hold them)
    params = fs.nn.shard_params(net, mesh, plan)
    dense = dict(net.named_parameters())
    specs = {k: v.spec for k, v in params.items()}
    assert specs == {
        "fc1.weight": fs.P("tp"),
        "fc1.bias": fs.P("tp"),
        "fc2.weight": fs.P(None, "tp"),
        "fc2.bias": fs.P(),
    }
    for k, v in params.items():
        assert torch.equal(fs.gather(v), dense[k].detach())
    # src=0: only rank 0's values count (others hold garbage) and the result is the same
    other = Net()
    if mesh.rank == 1:
        with torch.no_grad():
            for p in other.parameters():
                p.fill_(123.0)
    else:
        other.load_state_dict(weights)
    scattered = fs.nn.shard_params(other, mesh, plan, src=0)
    for k, v in scattered.items():
        assert v.layout == params[k].layout and torch.equal(v.local, params[k].local)

    x = torch.randn(5, 4)

    def loss(ps, x):
        return fs.nn.functional_call(net, ps, (x,)).square().sum()

    grads = torch.func.grad(loss)(params, x)
    dense_grads = torch.func.grad(
        lambda ps: torch.func.functional_call(net, ps, (x,)).square().sum()
    )({k: v.detach() for k, v in dense.items()})
    for k in params:
        assert grads[k].layout == params[k].layout, k
        torch.testing.assert_close(fs.gather(grads[k]), dense_grads[k])
    # per-example gradients: vmap(grad) keep the params' layouts plus a leading batch dim
    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x.unsqueeze(1))
    for k in params:
        assert per[k].shape == (5, *params[k].shape)
        assert per[k].spec.dims[1:] == params[k].spec.dims or params[k].spec == fs.P()
        torch.testing.assert_close(fs.gather(per[k]).sum(0), dense_grads[k], rtol=1e-5, atol=1e-5)
    # the module is untouched
    assert all(isinstance(p, nn.Parameter) for p in net.parameters())
    with pytest.raises(ValueError, match="match no parameter"):
        fs.nn.shard_params(net, mesh, {"fc3.*": fs.P("tp")})
    return True


def test_shard_params_grad_and_vmap_two_ranks(world2):
    assert world2.run(shard_and_grad_rank_fn) == [True, True]


def _has_rule(op):
    from fshard.ops import registry

    return op in getattr(registry, "_RULES", {})


def megatron_mlp_rank_fn():
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    mlp = MLP()
    params = fs.nn.shard_params(mlp, mesh, fs.nn.megatron_plan(column=["fc1"], row=["fc2"]))
    x = torch.randn(3, 8)
    xs = fs.shard(x, mesh, fs.P())

    def loss(ps):
        y = fs.nn.functional_call(mlp, ps, (xs,))
        return fs.gather(fs.reshard(y, fs.P())).square().sum()

    grads = torch.func.grad(loss)(params)
    dense = {k: v.detach() for k, v in mlp.named_parameters()}
    ref = torch.func.grad(lambda ps: torch.func.functional_call(mlp, ps, (x,)).square().sum())(
        dense
    )
    for k in params:
        assert grads[k].layout == params[k].layout, k
        torch.testing.assert_close(fs.gather(grads[k]), ref[k], rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.skipif(
    not (_has_rule(F.linear) and _has_rule(F.gelu)),
    reason="global-view op rules for F.linear / F.gelu not registered yet",
)
def test_megatron_mlp_global_view_two_ranks(world2):
    assert world2.run(megatron_mlp_rank_fn) == [True, True]


class TiedLM(nn.Module):
    """Embedding + Linear head sharing one weight (GPT-2's wte / lm_head)."""

    def __init__(self, vocab=12, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


class ReadsItsParameters(nn.Module):
    """Reads its parameters through ``self.parameters()`` in the forward, as transformers'
    ``self.dtype`` / ``self.device`` and OpenAI-GPT's ``next(self.parameters()).dtype`` do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = x.to(next(self.parameters()).dtype)
        return self.fc(x) + sum(p.sum() for p in self.parameters())


def test_functional_call_parameters_iterates_the_swapped_values_dense():
    """Inside the call, ``module.parameters()`` yields the values passed (as
    ``torch.func.functional_call`` does); before, it yielded nothing (``StopIteration`` in
    layoutlm and openai-gpt) and a sum over it silently lost the parameters' gradients."""
    torch.manual_seed(0)
    net = ReadsItsParameters()
    x = torch.randn(5, 4)
    new = {k: torch.randn_like(v) for k, v in net.named_parameters()}
    originals = dict(net.named_parameters())
    got = torch.func.grad(lambda ps: fs.nn.functional_call(net, ps, (x,)).sum())(new)
    want = torch.func.grad(lambda ps: torch.func.functional_call(net, ps, (x,)).sum())(new)
    torch.testing.assert_close(got, want)
    assert dict(net.named_parameters()) == originals  # restored, in order
    assert list(net.state_dict()) == ["fc.weight", "fc.bias"]


def test_functional_call_ties_weights_dense():
    torch.manual_seed(0)
    lm = TiedLM()
    ids = torch.randint(0, 12, (3, 5))
    # named_parameters lists the tied weight once: every alias must get the swapped value
    assert [k for k, _ in lm.named_parameters()] == ["emb.weight", "mix.weight", "mix.bias"]
    new = {k: torch.randn_like(v) for k, v in lm.named_parameters()}
    want = torch.func.functional_call(lm, new, (ids,))
    torch.testing.assert_close(fs.nn.functional_call(lm, new, (ids,)), want)
    assert lm.head.weight is lm.emb.weight and isinstance(lm.head.weight, nn.Parameter)
    # the same value under both names is fine; different values for tied names are an error
    both = {**new, "head.weight": new["emb.weight"]}
    torch.testing.assert_close(fs.nn.functional_call(lm, both, (ids,)), want)
    with pytest.raises(ValueError, match="tied"):
        fs.nn.functional_call(lm, {**new, "head.weight": torch.randn(12, 6)}, (ids,))
    assert lm.head.weight is lm.emb.weight


def tied_and_write_back_rank_fn():
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    lm = TiedLM()
    dense = {k: v.detach().clone() for k, v in lm.named_parameters()}
    keys = list(lm.state_dict())
    ids = torch.randint(0, 12, (3, 5))
    ys = torch.randint(0, 12, (3, 5))

    def dense_loss(ps):
        logits = torch.func.functional_call(lm, ps, (ids,))
        return F.cross_entropy(logits.reshape(-1, 12), ys.reshape(-1))

    for plan in ({}, {"emb.weight": fs.P("tp")}):  # replicated, and vocab-parallel tied weight
        params = fs.nn.shard_params(lm, mesh, plan)

        def loss(ps):
            logits = fs.nn.functional_call(lm, ps, (fs.shard(ids, mesh, fs.P()),))
            return fs.gather(
                F.cross_entropy(logits.reshape(-1, 12), fs.shard(ys, mesh, fs.P()).reshape(-1))
            )

        tx = fs.optim.adamw(0.1)
        state, dstate = tx.init(params), tx.init(dense)
        ref = dict(dense)
        for _ in range(2):
            grads, value = torch.func.grad_and_value(loss)(params)
            dgrads, dvalue = torch.func.grad_and_value(dense_loss)(ref)
            torch.testing.assert_close(value, dvalue)
            # the embedding gradient includes the head's contribution
            for k in params:
                assert grads[k].layout == params[k].layout, k
                torch.testing.assert_close(fs.gather(grads[k]), dgrads[k], rtol=1e-5, atol=1e-6)
            # donated step: must not write into the module (shard_params copies)
            params, state = fs.optim.step(tx, grads, state, params, donate=True)
            upd, dstate = tx.update(dgrads, dstate, ref)
            ref = fs.optim.apply_updates(ref, upd)
        for k, v in lm.named_parameters():
            assert torch.equal(v.detach(), dense[k]), k  # untouched until load_params
        sd = fs.nn.state_dict(lm, params)
        assert list(sd) == keys  # tied alias head.weight included
        assert sd["head.weight"] is params["emb.weight"]
        with pytest.raises(RuntimeError, match=r"fs\.nn\.state_dict\(model, params\)"):
            lm.state_dict()  # the module ran on params: its own tensors are the initial ones
        fs.nn.load_params(lm, params)
        got = lm.state_dict()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["head.weight"], ref["emb.weight"], rtol=1e-5, atol=1e-6)
        fs.nn.load_params(lm, dense)  # plain tensors write back too (restore for next plan)
        assert all(torch.equal(v.detach(), dense[k]) for k, v in lm.named_parameters())
    # dst: only rank 0's module is written
    params = fs.nn.shard_params(lm, mesh, {"emb.weight": fs.P("tp")})
    params = {k: fs.tree_map(lambda t: t + 1, v) for k, v in params.items()}
    fs.nn.load_params(lm, params, dst=0)
    changed = not torch.equal(lm.emb.weight.detach(), dense["emb.weight"])
    assert changed == (mesh.rank == 0)
    with pytest.raises(ValueError, match="does not fit"):
        fs.nn.load_params(lm, {"mix.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="fc9"):
        fs.nn.load_params(lm, {"fc9.weight": torch.zeros(3)})
    return True


def test_tied_weights_and_write_back_two_ranks(world2):
    assert world2.run(tied_and_write_back_rank_fn) == [True, True]


def row_output_rank_fn():
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(3, 8)
    xs = fs.shard(x, mesh, fs.P())
    dense = {k: v.detach() for k, v in mlp.named_parameters()}
    ref = torch.func.functional_call(mlp, dense, (x,))
    nbytes = 3 * 8 * 4
    got = {}
    for row_output in (fs.P(), None, fs.P("tp")):
        plan = fs.nn.megatron_plan(column=["fc1"], row=["fc2"], row_output=row_output)
        params = fs.nn.shard_params(mlp, mesh, plan)
        with fs.debug.comm_log() as log:
            y = fs.nn.functional_call(mlp, params, (xs,))
        torch.testing.assert_close(fs.gather(y), ref)
        got[row_output] = (y.spec, [(r.op, r.nbytes) for r in log])
    # the row-parallel output is reduced right after fc2 where the plan asks
    assert got[fs.P()][0] == fs.P()
    assert [b for _, b in got[fs.P()][1]] == [nbytes]
    assert got[None] == (fs.P(partial=("tp",)), [])
    assert got[fs.P("tp")][0] == fs.P("tp")
    # an explicit outputs= overrides what shard_params recorded; {} disables
    y = fs.nn.functional_call(mlp, params, (xs,), outputs={})
    assert y.spec == fs.P(partial=("tp",))
    y = fs.nn.functional_call(mlp, params, (xs,), outputs={"fc*": fs.P()})
    assert y.spec == fs.P()
    with pytest.raises(ValueError, match="match no module"):
        fs.nn.functional_call(mlp, params, (xs,), outputs={"fc9": fs.P()})
    # dense calls are untouched by the recorded output layouts
    torch.testing.assert_close(fs.nn.functional_call(mlp, dense, (x,)), ref)
    return True


@pytest.mark.skipif(
    not (_has_rule(F.linear) and _has_rule(F.gelu)),
    reason="global-view op rules for F.linear / F.gelu not registered yet",
)
def test_row_output_layouts_two_ranks(world2):
    assert world2.run(row_output_rank_fn) == [True, True]


def test_megatron_plan_reads_module_types():
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(3 * 8, 8)  # GPT-2: weight (in, out), out = [q | k | v]
            self.c_fc = Conv1D(32, 8)
            self.c_proj = Conv1D(8, 32)
            self.qkv = nn.Linear(8, 24, bias=False)
            self.fc = nn.Linear(8, 32, bias=False)

    blk = Block()
    plan = fs.nn.megatron_plan(column=["c_fc", "fc"], row=["c_proj"], model=blk)
    assert plan == {
        "c_fc.weight": fs.P(None, "tp"),  # Conv1D column: out-features are dim 1
        "c_fc.bias": fs.P("tp"),
        "fc.weight": fs.P("tp", None),  # no bias entry: read from the module
        "c_proj.weight": fs.P("tp", None),  # Conv1D row: in-features are dim 0
        "c_proj": fs.nn.Output(fs.P()),
    }
    assert transformers is not None
    fused = fs.nn.megatron_plan(column=["c_attn"], model=blk)  # [q | k | v]: split per part
    assert fused == {
        "c_attn.weight": fs.Parts(fs.P(None, "tp"), 1, (8, 8, 8)),
        "c_attn.bias": fs.Parts(fs.P("tp"), 0, (8, 8, 8)),
    }
    with pytest.warns(UserWarning, match="fused q\\|k\\|v"):
        fs.nn.megatron_plan(column=["qkv"], model=blk)
    with pytest.raises(ValueError, match=r"kinds \[.conv1d., .linear.\]"):
        fs.nn.megatron_plan(column=["*fc"], model=blk)
    with pytest.raises(ValueError, match="matches no module"):
        fs.nn.megatron_plan(row=["fc9"], model=blk)


# -- tied parameters through every entry point (fshard/_swap.py), against dense torch.func --------

V, D = 8, 4


class TiedWeight(nn.Module):
    """GPT-2's tie: the head's weight is the embedding's."""

    vocab = V

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def trunk(self, ids, cut):
        h = self.emb(ids)[..., :cut]  # cut < D: the first block's forward raises
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h

    def forward(self, ids, cut=None):
        return self.head(self.trunk(ids, cut))


class TiedWeightBias(TiedWeight):
    """A decoder tied in weight (to the embedding) and in bias (to another head's)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, V)
        self.head = nn.Linear(D, V)
        self.head.weight = self.emb.weight
        self.head.bias = self.proj.bias

    def forward(self, ids, cut=None):
        h = self.trunk(ids, cut)
        return self.head(h) + torch.tanh(self.proj(h))


class FourOwners(TiedWeight):
    """One tensor held by four modules (embedding, both blocks, head), its first name inside an
    FSDP unit (``blocks.0``), the others outside it."""

    vocab = D

    def __init__(self):
        nn.Module.__init__(self)
        self.blocks = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.emb = nn.Embedding(D, D)
        self.head = nn.Linear(D, D)
        self.emb.weight = self.blocks[1].weight = self.head.weight = self.blocks[0].weight


TIED = {"weight": TiedWeight, "weight_bias": TiedWeightBias, "four_owners": FourOwners}


def tied_case(kind: str):
    """``(model, ids)``: the float64 module (same values on every process) and a (4, 3) batch."""
    torch.manual_seed(0)
    model = TIED[kind]().double()
    return model, torch.randint(0, model.vocab, (4, 3))


def module_state(module: nn.Module):
    """What a call must leave as it found: the tensor of every name (aliases included) and the
    order of ``named_parameters()`` and ``state_dict()`` (its keys, read through
    ``fs.nn.state_dict``: the module's own ``state_dict()`` is refused once it ran on params)."""
    named = [(n, id(t)) for n, t in module.named_parameters(remove_duplicate=False)]
    return named, [n for n, _ in module.named_parameters()], list(fs.nn.state_dict(module, {}))


def dense_value_and_grads(model: nn.Module, ids: torch.Tensor):
    """The loss ``mean(model(ids) ** 2)`` and its gradient by torch.func on the full tensors."""
    dense = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps):
        return torch.func.functional_call(model, ps, (ids,)).square().mean()

    grads, value = torch.func.grad_and_value(loss)(dense)
    return value, grads


def test_tied_cases_are_tied():
    owners = {"weight": 2, "weight_bias": 2, "four_owners": 4}
    for kind, n in owners.items():
        model, _ = tied_case(kind)
        named = module_state(model)[0]
        assert len(named) - len(dict(model.named_parameters())) == n - 1 + (kind == "weight_bias")
        assert model.head.weight is model.emb.weight


def tied_entry_points_rank_fn(kind):
    """functional_call (+ torch.func.grad), state_dict and load_params of a tied module on 2 ranks,
    replicated and with the tied weight split over tp; returns what the parent compares with
    dense torch, and the module's state before and after every call."""
    mesh = fs.Mesh.create((2,), ("tp",))
    model, ids = tied_case(kind)
    first = next(k for k, _ in model.named_parameters())
    start = module_state(model)
    dense = {k: v.detach().clone() for k, v in model.named_parameters()}
    out, states = [], []
    x = fs.shard(ids, mesh, fs.P())

    def loss(ps):
        y = fs.nn.functional_call(model, ps, (x,))
        return fs.gather(y * y).mean()

    for plan in ({}, {first: fs.P("tp")}):
        params = fs.nn.shard_params(model, mesh, plan)
        grads, value = torch.func.grad_and_value(loss)(params)
        assert all(grads[k].layout == params[k].layout for k in params)
        states.append(module_state(model))
        with pytest.raises(RuntimeError):  # restored when the forward raises
            fs.nn.functional_call(model, params, (x,), {"cut": 3})
        states.append(module_state(model))
        sd = {k: fs.gather(v) for k, v in fs.nn.state_dict(model, params).items()}
        states.append(module_state(model))
        fs.nn.load_params(model, {k: fs.tree_map(lambda t: t + 1, v) for k, v in params.items()})
        states.append(module_state(model))
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        fs.nn.load_params(model, dense)  # back to the initial values for the next plan
        out.append((float(value), {k: fs.gather(g) for k, g in grads.items()}, sd, loaded))
    return out, start, states


@pytest.mark.parametrize("kind", list(TIED))
def test_tied_entry_points_match_dense(world2, kind):
    """Every alias of a tied tensor (a tied weight; a tied weight and bias; one tensor with four
    owners) reads the swapped value in functional_call (values and every gradient equal dense
    torch.func), is in state_dict and is written by load_params; no call changes which tensor a
    name holds or the order of named_parameters() and state_dict()."""
    model, ids = tied_case(kind)
    value, grads = dense_value_and_grads(model, ids)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    for out, start, states in world2.run(tied_entry_points_rank_fn, kind):
        for state in states:
            assert state == start
        for got_value, got_grads, got_sd, loaded in out:
            torch.testing.assert_close(got_value, float(value))
            assert list(got_grads) == list(grads)
            for k in grads:
                torch.testing.assert_close(got_grads[k], grads[k], msg=k)
            assert list(got_sd) == list(sd) and list(loaded) == list(sd)
            for k in sd:
                torch.testing.assert_close(got_sd[k], sd[k], msg=k)
                torch.testing.assert_close(loaded[k], sd[k] + 1, msg=k)


def stale_state_dict_rank_fn():
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    mlp = MLP()
    initial = {k: v.detach().clone() for k, v in mlp.state_dict().items()}
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plan = fs.nn.megatron_plan(column=["fc1"], row=["fc2"])
    params = fs.nn.shard_params(mlp, mesh, plan)
    with pytest.raises(RuntimeError, match="shard_params"):
        mlp.state_dict()  # the params dict holds the values from here on

    def loss(ps):
        out = fs.nn.functional_call(mlp, ps, (fs.shard(x, mesh, fs.P()),))
        return fs.gather(F.mse_loss(out, fs.shard(y, mesh, fs.P())))

    def dense_loss(ps):
        return F.mse_loss(torch.func.functional_call(mlp, ps, (x,)), y)

    tx = fs.optim.sgd(0.5)
    state, ref = tx.init(params), dict(initial)
    for _ in range(2):
        params, state = fs.optim.step(tx, torch.func.grad(loss)(params), state, params)
        ref = {
            k: v - 0.5 * g
            for (k, v), g in zip(ref.items(), torch.func.grad(dense_loss)(ref).values())
        }
    # the silent bug was: mlp.state_dict() returned `initial` here
    with pytest.raises(RuntimeError, match=r"fs\.nn\.load_params\(model, params\)"):
        mlp.state_dict()
    with pytest.raises(RuntimeError, match="shard_params"):
        torch.save(mlp.state_dict(), "/dev/null")
    sharded = fs.nn.state_dict(mlp, params)  # the sharded path keeps working
    fs.nn.load_params(mlp, params)
    saved = mlp.state_dict()
    for k in ref:
        torch.testing.assert_close(saved[k], ref[k])
        torch.testing.assert_close(fs.gather(sharded[k]), ref[k])
    fs.nn.functional_call(mlp, params, (fs.shard(x, mesh, fs.P()),))  # runs on params again
    with pytest.raises(RuntimeError, match="stale"):
        mlp.state_dict()  # an eager call after load_params marks it again
    fs.nn.load_params(mlp, params)
    plain = MLP()  # a module never given to shard_params is untouched by all this
    fs.nn.functional_call(plain, dict(plain.named_parameters()), (x,))
    return sorted(mlp.state_dict()) == sorted(initial) and len(plain.state_dict()) == 4


def test_state_dict_of_a_module_trained_through_params_is_refused_until_load_params(world2):
    """Issue 26 item 6: after ``shard_params`` and training on the params dict, the module's own
    ``state_dict()`` (and so ``torch.save`` / HF ``save_pretrained`` of it) silently held the
    initial weights. It now raises, pointing to ``fs.nn.state_dict`` / ``load_params``, until
    ``load_params`` writes the trained values back (compared with dense SGD)."""
    assert world2.run(stale_state_dict_rank_fn) == [True, True]


def shard_params_checks_rank_fn(case: str):
    """shard_params under the default consistency mode: the all_reduces it issues, and the
    error (or None) when the ranks' modules or plans differ (``case``)."""
    mesh = fs.Mesh.create((2,), ("x",))
    rank = dist.get_rank()
    torch.manual_seed(rank if case == "seed" else 0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    plan = {"0.weight": fs.P(None, "x") if case == "plan" and rank else fs.P("x")}
    calls, real = [], dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        with fs.config.consistency("default"):
            fs.nn.shard_params(model, mesh, plan)
    except fs.consistency.ConsistencyError as e:
        return len(calls), str(e)
    finally:
        dist.all_reduce = real
    return len(calls), None


def test_shard_params_checks_the_whole_module_in_one_exchange(world2):
    """Every rank must pass the same module (values) and plan: compared for all parameters in
    one exchange (one all_reduce), not one per parameter (fs.shard's own check: 4 here); a
    per-rank seed or plan is named by parameter."""
    for n, error in world2.run(shard_params_checks_rank_fn, "same"):
        assert error is None and n == 1, (n, error)
    for _, error in world2.run(shard_params_checks_rank_fn, "seed"):
        assert error and "0.weight values" in error and "2.bias values" in error, error
    for _, error in world2.run(shard_params_checks_rank_fn, "plan"):
        assert error and "disagree on 0.weight." in error and "P(None, 'x')" in error, error


class _CheckpointedLinear(nn.Module):
    """A Linear and tanh under ``torch.utils.checkpoint`` (non-reentrant, or reentrant)."""

    def __init__(self, reentrant=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x):
        run = lambda t: torch.tanh(self.lin(t))  # noqa: E731
        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=self.reentrant)


def test_functional_call_checkpoint_recomputes_with_the_values_dense():
    """functional_call patches torch's ``checkpoint``: its ``context_fn`` keyword default (read
    from the unwrapped function's ``__kwdefaults__``) and the generator it calls
    (``_compat.CHECKPOINT_GENERATOR``). On the running torch both must be reached: a
    non-reentrant recompute runs with the values (else the gradients are those of the module's
    own weights), and a reentrant checkpoint, which has no recompute hook, is refused by torch
    for the non-default ``context_fn`` (else it would recompute with the module's own weights)."""
    torch.manual_seed(0)
    model, x = _CheckpointedLinear(), torch.randn(3, 4)
    new = {k: torch.randn_like(v).requires_grad_() for k, v in model.named_parameters()}
    out = fs.nn.functional_call(model, new, (x,))
    got = torch.autograd.grad(out.pow(2).sum(), [new["lin.weight"], new["lin.bias"]])
    dense = torch.tanh(F.linear(x, new["lin.weight"], new["lin.bias"])).pow(2).sum()
    want = torch.autograd.grad(dense, [new["lin.weight"], new["lin.bias"]])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    model.reentrant = True
    with pytest.raises(ValueError, match=r"Passing `context_fn`.*use_reentrant=False"):
        fs.nn.functional_call(model, new, (x,))
    # outside functional_call torch's own default is back
    checkpoint = inspect.unwrap(torch.utils.checkpoint.checkpoint)
    assert checkpoint.__kwdefaults__["context_fn"] is torch.utils.checkpoint.noop_context_fn


# -- the swap's per-module cache (fshard/_swap.py: places) against the uncached lookups ----------


def _targets_key(ts):
    return [(n, id(o), a, s, id(v)) for n, o, a, s, v in ts]


def _aliases_key(held):
    return {k: [(id(o), a, s) for o, a, s in v] for k, v in held.items()}


def _assert_swap_is_uncached(model, values):
    """The swap's targets (from the cache) are those of the uncached lookups (fresh
    ``_swap.aliases`` / ``targets``), or the same error; the cached aliases are the fresh ones.
    Returns whether the values fit."""
    try:
        want = _targets_key(_swap.targets(model, values, "functional_call"))
    except (ValueError, TypeError) as e:
        want = e
    try:
        got = _targets_key(_swap.swap(model, values, "functional_call").targets)
    except (ValueError, TypeError) as e:
        got = e
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want), (got, want)
    else:
        assert got == want
    places = _swap.places(model)
    assert places is not None and places is _swap.places(model)  # cached: the same entry
    assert _aliases_key(places.aliases()) == _aliases_key(_swap.aliases(model))
    return not isinstance(want, Exception)


def _assert_call_is_torch_func(model, values, ids):
    """functional_call's output and gradients are torch.func.functional_call's on the same values
    (``tie_weights=True``: a value given for one name of a tied tensor goes to every alias)."""

    def run(call):
        fresh = {id(v): v.detach().clone().requires_grad_() for v in values.values()}
        vals = {k: fresh[id(v)] for k, v in values.items()}  # one value per tied tensor stays one
        out = call(model, vals, (ids,))
        grads = torch.autograd.grad(out.square().sum(), list(fresh.values()), allow_unused=True)
        return out, grads

    out, grads = run(fs.nn.functional_call)
    ref, ref_grads = run(torch.func.functional_call)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r)


def test_swap_cache_sees_every_change_of_the_module():
    """The cache of where each name's tensors are held is read again whenever the module changed
    after a cached call: a tie made (HF ``tie_weights()``: ``head.weight = emb.weight``) with only
    one of its names given, a tie undone, a buffer holding a parameter, a submodule replaced (by
    one holding the very same tensors too), added or deleted, a parameter added, deleted or set
    to None;
    each time against the uncached lookups and torch.func, and ``load_params`` (values written in
    place, the same structure) keeps the entry."""
    torch.manual_seed(0)
    model, ids = tied_case("weight")
    model.head.weight = nn.Parameter(model.emb.weight.detach() + 1)  # untied to start with

    def values(**extra):
        vs = {k: v.detach() + 0.5 for k, v in model.named_parameters()}
        return {**vs, **extra}

    def check(*cases):
        for vals in cases:
            if _assert_swap_is_uncached(model, vals):
                _assert_call_is_torch_func(model, vals, ids)
        fs.nn.functional_call(model, values(), (ids,))  # cached for the next change

    w = torch.randn(V, D, dtype=torch.float64)
    check(values(), {"head.weight": w}, {"emb.weight": w})
    first = _swap.places(model)
    assert tuple(values()) in first.plans  # the call above was served from the cache

    model.head.weight = model.emb.weight  # tied after cached calls
    assert _swap.places(model) is not first
    assert "head.weight" not in values()  # named_parameters() names the tie once
    check(values(), {"head.weight": w}, {"emb.weight": w}, {"emb.weight": w, "head.weight": w})
    check({"emb.weight": w, "head.weight": w + 1})  # two values for one tensor: the error
    out = fs.nn.functional_call(model, {"head.weight": w}, (ids,))  # only the second name given
    ref = torch.func.functional_call(model, {"emb.weight": w}, (ids,))
    torch.testing.assert_close(out, ref)

    model.head.weight = nn.Parameter(w.clone())  # untied again
    check(values(), {"head.weight": w}, {"emb.weight": w})
    model.blocks[1].register_buffer("mirror", model.blocks[0].weight)  # a buffer holds a param
    check(values(), {"blocks.0.weight": w[:D, :D]}, {"blocks.1.mirror": w[:D, :D]})
    del model.blocks[1].mirror
    check(values(), {"blocks.0.weight": w[:D, :D]})

    old = model.blocks[1]
    same = nn.Linear(D, D).double()
    same.weight, same.bias = old.weight, old.bias
    model.blocks[1] = same  # a new owner of the very same tensors (the old one still alive)
    check(values())
    assert all(o is same for n, o, *_ in _swap.swap(model, values(), "x").targets if "1." in n)
    before = values()
    model.blocks[0] = nn.Linear(D, D).double()  # replaced: new tensors, new owner
    check(values(), before)  # the values of the old tensors still fit by name
    model.blocks[1].bias = None  # a parameter set to None: its name no longer fits
    check(values(), before)
    model.emb.spare = nn.Parameter(w[0].clone())  # a parameter added (unused by forward)
    before = values()
    check(before, {"emb.spare": w[1]})
    del model.emb.spare  # and deleted
    check(values(), before)
    model.extra = nn.Linear(D, D).double()  # a submodule added (unused by forward)
    check(values(), {"extra.weight": w[:D, :D]})
    del model.extra
    check(values(), {"extra.weight": w[:D, :D]})

    entry = _swap.places(model)
    fs.nn.load_params(model, values())  # written in place: the same structure
    assert _swap.places(model) is entry
    check(values())


def test_swap_cache_checks_its_owners_are_the_objects_they_were():
    """A snapshot names objects by id, and an id is reused once its object is gone: an entry
    whose snapshot matches the module's but whose owners died (what a module replaced by a new
    one at the same address would give) is not used, and the cache holds no module alive."""
    torch.manual_seed(0)
    model, ids = tied_case("weight")
    gone, _ = tied_case("weight")
    stale = _swap.Places(gone, _swap.structure(model))  # another module's, under model's key
    _swap._PLACES[model] = [stale]
    del gone
    assert not stale.alive()
    places = _swap.places(model)
    assert places is not stale and places.alive()
    assert _aliases_key(places.aliases()) == _aliases_key(_swap.aliases(model))
    _assert_call_is_torch_func(model, {"emb.weight": torch.randn(V, D).double()}, ids)
    dead = weakref.ref(model)
    del model, places
    gc.collect()
    assert dead() is None
