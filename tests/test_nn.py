"""fs.nn.shard_params / functional_call / megatron_plan on 2 Gloo ranks, against dense torch."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fshard as fs
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
        other.load_state_dict(net.state_dict())
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
        assert list(sd) == list(lm.state_dict())  # tied alias head.weight included
        assert sd["head.weight"] is params["emb.weight"]
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
    with pytest.raises(ValueError, match="head-aligned"):
        fs.nn.megatron_plan(column=["c_attn"], model=blk)
    with pytest.warns(UserWarning, match="fused q\\|k\\|v"):
        fs.nn.megatron_plan(column=["qkv"], model=blk)
    with pytest.raises(ValueError, match="both nn.Linear and Conv1D"):
        fs.nn.megatron_plan(column=["*fc"], model=blk)
    with pytest.raises(ValueError, match="matches no module"):
        fs.nn.megatron_plan(row=["fc9"], model=blk)
