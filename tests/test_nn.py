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
    }
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
