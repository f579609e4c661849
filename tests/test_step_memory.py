"""Peak memory of a one-rank training step (issue 27: "the torch.func.grad_and_value form, no more
memory than eager; find where the second copy lives"), measured exactly from the CPU allocator's
events (``torch.profiler``, ``profile_memory=True``: the running sum of every allocation and
free in the step, its maximum). Allocation sizes do not depend on the CPU's float rounding.

Found: the excess of the torch.func form is torch.func's own. ``torch.func.grad`` differentiates
with ``torch.autograd.grad(..., create_graph=True)`` (so that transforms can nest), which keeps
every saved activation until the whole backward ends, where ``.backward()`` frees each as its
node runs. Plain torch shows it with no fshard in sight; ``fs.value_and_grad`` (the README's
form) differentiates with ``create_graph=False`` at the top level and peaks exactly where eager
``.backward()`` does.
"""

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import fshard as fs


def _peak_bytes(fn) -> int:
    fn()  # warm: lazily made buffers are not part of the step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start
    )
    now = top = 0
    for e in events:
        now += e.cpu_memory_usage
        top = max(top, now)
    return top


def _peaks():
    torch.manual_seed(0)
    d = 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(4)])  # fmt: skip
    x = torch.randn(128, d)
    mesh = fs.Mesh.create((1,), ("dp",))
    params = {k: fs.shard(v.detach(), mesh, fs.P()) for k, v in model.named_parameters()}
    plain = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps, x):
        out = fs.nn.functional_call(model, ps, (x,))
        out = fs.gather(out) if isinstance(out, fs.ShardedArray) else out
        return out.pow(2).mean()

    def eager():
        model.zero_grad(set_to_none=True)
        torch.func.functional_call(model, dict(model.named_parameters()), (x,)).pow(2).mean().backward()  # fmt: skip

    def torch_func_plain():
        return torch.func.grad_and_value(
            lambda ps, x: torch.func.functional_call(model, ps, (x,)).pow(2).mean()
        )(plain, x)

    vg = fs.value_and_grad(loss)
    return {
        "eager": _peak_bytes(eager),
        "fs.value_and_grad": _peak_bytes(lambda: vg(params, x)),
        "torch.func, plain torch": _peak_bytes(torch_func_plain),
        "torch.func, fshard": _peak_bytes(lambda: torch.func.grad_and_value(loss)(params, x)),
    }


def test_one_rank_step_memory_equals_eager_and_torch_func_excess_is_torch_funcs(world1):
    (p,) = world1.run(_peaks)
    assert p["fs.value_and_grad"] == p["eager"], p
    # fshard adds nothing to the torch.func form; torch.func's create_graph=True keeps the
    # saved activations of the whole backward alive
    assert p["torch.func, fshard"] == p["torch.func, plain torch"] > p["eager"], p
