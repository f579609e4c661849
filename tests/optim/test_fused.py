"""fs.optim's donated Adam/AdamW step on CUDA runs torch's fused kernel (issue 27: a one-GPU step
costs what plain torch with ``AdamW(fused=True)`` costs). CUDA only: skipped without a GPU."""

import pytest
import torch

import fshard as fs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tree(device, dtype):
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (64, 32), "b": (32,), "emb": (100, 16)}
    params = {k: torch.randn(*s, generator=g).to(device, dtype) for k, s in shapes.items()}
    grads = [{k: torch.randn(*s, generator=g).to(device, dtype) for k, s in shapes.items()}]
    grads.append({k: torch.randn(*s, generator=g).to(device, dtype) for k, s in shapes.items()})
    return params, grads


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_donated_adamw_uses_the_fused_kernel(monkeypatch, dtype, weight_decay):
    params, grads = _tree("cuda", dtype)
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=weight_decay, fused=True)
    calls = []
    for name in ("_fused_adamw_", "_fused_adam_"):
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1]
        )
    tx = fs.optim.adamw(1e-2, weight_decay=weight_decay)
    state = tx.init(params)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()  # torch's AdamW calls the (patched) fused kernels too: counted apart
        calls.clear()
        params, state = fs.optim.step(tx, g, state, params, donate=True)
    assert calls and set(calls) == {"_fused_adamw_" if weight_decay else "_fused_adam_"}
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for k, p in ref.items():
        torch.testing.assert_close(params[k], p.detach(), **tol)


@cuda
def test_fused_matches_foreach_on_cuda():
    """The fused kernel and the foreach ops (CPU, float64) give the same step, up to rounding."""
    params, grads = _tree("cuda", torch.float32)
    cpu = {k: v.cpu().double() for k, v in params.items()}
    tx = fs.optim.adamw(1e-2, weight_decay=0.1)
    s_gpu, s_cpu = tx.init(params), tx.init(cpu)
    for g in grads:
        params, s_gpu = fs.optim.step(tx, g, s_gpu, params, donate=True)
        cpu, s_cpu = fs.optim.step(
            tx, {k: v.cpu().double() for k, v in g.items()}, s_cpu, cpu, donate=True
        )
    for k, v in params.items():
        torch.testing.assert_close(v.cpu().double(), cpu[k], atol=1e-5, rtol=1e-4)
