"""fs.nn.MixedPrecisionPolicy (issue 22 item 4): bf16 compute from fp32 master params, gradient
reductions in ``reduce_dtype``, outputs in ``output_dtype``; under ``functional_call`` (dp) and
``fsdp_call`` (FSDP), through ``fs.value_and_grad`` and ``torch.func``, 3 AdamW steps.

The oracle is the same computation on dense tensors in each rank's process with the same casts:
each rank's half batch run through the bf16 module, its gradient taken with ``torch.func.grad``
(in bf16 at the cast params, in fp32 at the masters), and the halves' gradients summed in the
reduce dtype. Two addends sum to the same value in any order, and each half runs the same kernels
on the same shapes as the rank does, so the comparisons are exact (``torch.equal``). The loss is
``(out * c).sum()`` so its cotangent is exactly ``c`` whatever the reduction's arithmetic.
"""

import pytest
import torch

import fshard as fs

BF16, F32 = torch.bfloat16, torch.float32
B, D, H, OUT = 4, 8, 6, 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(D, H)  # (6, 8): FSDP splits it (and its bias) over dp
        self.out = torch.nn.Linear(H, OUT)  # (3, 6): the FSDP test's plan keeps it whole
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, OUT))  # 3 rows: blocks of 2, 1
        self.register_buffer("shift", torch.full((OUT,), 0.25))  # buffers are never cast

    def forward(self, x):
        assert self.shift.dtype == F32
        return self.out(torch.nn.functional.gelu(self.inp(x))) * self.gain + self.shift.to(x.dtype)


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, D, generator=g), torch.randn(B, OUT, generator=g)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _dense_grads(model, master: dict, x, c, policy) -> dict:
    """The oracle: per half batch, grads through the bf16 module; summed in the reduce dtype."""
    low = {k: v.to(policy.param_dtype) for k, v in master.items()}
    reduce = policy.reduce_in(F32)

    def loss(ps, xh, ch):
        ps = {k: v.to(policy.param_dtype) for k, v in ps.items()}  # fp32 masters: cast here
        out = torch.func.functional_call(model, ps, (xh.to(policy.param_dtype),))
        return (out.to(policy.output_dtype) * ch).sum()

    total = None
    for h in range(2):
        rows = slice(h * B // 2, (h + 1) * B // 2)
        if reduce == F32:  # the cast's backward upcasts before the reduction
            g = torch.func.grad(loss)(master, x[rows], c[rows])
        else:
            g = torch.func.grad(loss)(low, x[rows], c[rows])
        total = g if total is None else {k: total[k] + g[k] for k in g}
    return {k: v.to(F32) for k, v in total.items()}


def _dense_run(policy, steps=3):
    model = _model()
    master = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = fs.optim.adamw(1e-2, weight_decay=0.1)
    state = tx.init(master)
    grads = []
    for s in range(steps):
        x, c = _data(s)
        g = _dense_grads(model, master, x, c, policy)
        grads.append(g)
        upd, state = tx.update(g, state, master)
        master = fs.optim.apply_updates(master, upd)
    return grads, master


POLICIES = {
    "reduce_f32": fs.nn.MixedPrecisionPolicy(BF16, F32, F32),
    "reduce_bf16": fs.nn.MixedPrecisionPolicy(BF16, None, F32),
}


def _train(loss, params, mesh, how: str, local: bool):
    """3 AdamW steps of ``loss`` under ``fs.value_and_grad`` or ``torch.func``: each step's
    gradients (gathered) and comm log, and the trained params. ``local``: the batch as this
    rank's block (the FSDP loss's local view)."""
    if how == "value_and_grad":
        vg = fs.value_and_grad(loss)
    else:

        def vg(ps, x, c):
            g, v = torch.func.grad_and_value(loss)(ps, x, c)
            return v, g

    tx = fs.optim.adamw(1e-2, weight_decay=0.1)
    state = tx.init(params)
    grads, logs = [], []
    for s in range(3):
        xs, cs = (fs.shard(t, mesh, fs.P("dp")) for t in _data(s))
        if local:
            xs, cs = xs.local, cs.local
        with fs.debug.comm_log() as log:
            _, g = vg(params, xs, cs)
        logs.append([(r.op, r.nbytes) for r in log])
        assert all(g[k].dtype == F32 and g[k].layout == params[k].layout for k in g)
        grads.append({k: fs.gather(v) for k, v in g.items()})
        params, state = fs.optim.step(tx, g, state, params)
    return grads, {k: fs.gather(v) for k, v in params.items()}, logs


def dp_rank_fn(which: str, how: str):
    policy = POLICIES[which]
    mesh = fs.Mesh.create((2,), ("dp",))
    model = _model()
    params = fs.nn.shard_params(model, mesh, {}, mp_policy=policy)  # replicated

    def loss(ps, x, c):
        out = fs.nn.functional_call(model, ps, (x,))  # the recorded policy
        assert out.dtype == F32 and out.spec == fs.P("dp")
        return fs.gather((out * c).sum())  # a pending sum: all-reduced (4 B)

    return _train(loss, params, mesh, how, local=False)


def fsdp_rank_fn(which: str, how: str):
    policy = POLICIES[which]
    mesh = fs.Mesh.create((2,), ("dp",))
    model = _model()
    plan = fs.nn.fsdp_plan(model, mesh)
    assert plan["inp.weight"] == fs.P("dp", None) and plan["gain"] == fs.P("dp")  # uneven
    plan |= {"out.weight": fs.P(), "out.bias": fs.P()}  # kept whole: pcast, all-reduced
    params = fs.nn.shard_params(model, mesh, plan)

    def loss(ps, x, c):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh, mp_policy=policy)
        assert out.dtype == F32
        return fs.lax.psum((out * c).sum(), "dp", mesh=mesh)

    return _train(loss, params, mesh, how, local=True)


def _check(results, which):
    ref_grads, ref_params = _dense_run(POLICIES[which])
    for grads, params, _ in results:
        for s in range(3):
            for k, v in ref_grads[s].items():
                assert torch.equal(grads[s][k], v), (s, k, (grads[s][k] - v).abs().max())
        for k, v in ref_params.items():
            assert params[k].dtype == F32 and torch.equal(params[k], v), k


NUMEL = {"inp.weight": H * D, "inp.bias": H, "out.weight": OUT * H, "out.bias": OUT, "gain": OUT}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["reduce_f32", "reduce_bf16"])
@pytest.mark.parametrize("how", ["value_and_grad", "torch.func"])
def test_dp_mixed_precision_equals_dense_with_the_same_casts(world2, which, how):
    results = world2.run(dp_rank_fn, which, how)
    _check(results, which)
    width = 4 if which == "reduce_f32" else 2
    for _, _, logs in results:
        for log in logs:
            # the loss sum's all_reduce is the value's (4 B); every gradient byte is reduced
            # once, in the reduce dtype; nothing else moves
            assert sorted({op for op, _ in log}) == ["all_reduce"]
            grad_bytes = sum(n for _, n in log) - 4
            assert grad_bytes == width * sum(NUMEL.values()), log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["reduce_f32", "reduce_bf16"])
@pytest.mark.parametrize("how", ["value_and_grad", "torch.func"])
def test_fsdp_mixed_precision_equals_dense_with_the_same_casts(world2, which, how):
    results = world2.run(fsdp_rank_fn, which, how)
    _check(results, which)
    width = 4 if which == "reduce_f32" else 2
    split = NUMEL["inp.weight"] + NUMEL["inp.bias"]  # even over 2; gain's 3 rows: 2 and 1
    whole = NUMEL["out.weight"] + NUMEL["out.bias"]
    for _, _, logs in results:
        # both paths pack the unit, gain's block padded to 2 rows on both ranks (under
        # torch.func each param was gathered alone from this rank's block, 2 - rank rows, and
        # scattered whole, 3: one collective per param where FSDP2 issues one per unit)
        gain_block, gain_scatter = 2, 4
        for log in logs:
            gathers = [n for op, n in log if op == "all_gather"]
            # each rank's bf16 blocks gathered (2 B per value: half the fp32 bytes), the eager
            # path's twice: the product with gain saves it, so the backward re-gathers the
            # unit. Under torch.func with an fp32 reduction the gather moves fp32 (see
            # fshard.precision)
            gather_width = 4 if (how, which) == ("torch.func", "reduce_f32") else 2
            times = 1 if how == "torch.func" else 2
            assert sum(gathers) == times * gather_width * (split // 2 + gain_block)
            scattered = sum(n for op, n in log if op == "reduce_scatter")
            assert scattered == width * (split + gain_scatter)
            assert sum(n for op, n in log if op == "all_reduce") == width * whole + 4


def test_policy_arguments_are_checked():
    with pytest.raises(TypeError, match="param_dtype must be a floating torch.dtype"):
        fs.nn.MixedPrecisionPolicy(torch.int32).check()
    with pytest.raises(TypeError, match="mp_policy must be a fs.nn.MixedPrecisionPolicy"):
        fs.nn.functional_call(torch.nn.Linear(2, 2), {}, (torch.ones(2),), mp_policy="bf16")
    with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
        fs.nn.MixedPrecisionPolicy(BF16, cast_forward_inputs=1).check()
