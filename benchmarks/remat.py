"""Activation checkpointing (``fs.remat``) on the example GPT: peak memory and step time with and
without it, on 2 local Gloo ranks (tp=2, the local view of ``examples/train_gpt.py``).

    python benchmarks/remat.py [--layers 8] [--dim 256] [--batch 8] [--ctx 128] [--reps 5]

Each configuration differentiates ``train_gpt.tp_loss`` (``remat=False`` / ``True``: every block
under ``fs.remat``, only its input and weights saved, the block's forward, all_reduces included,
recomputed in the backward) with ``fs.value_and_grad``. Measured per rank:

* *saved activations*: what autograd keeps for the backward, counted once per storage with
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward (params excluded);
* *peak*: the highest running sum of the CPU allocator's allocations minus frees over one
  step (``torch.profiler``, ``profile_memory=True``, each op's self memory), above what is
  live before the step;
* *backward comm*: ``fs.debug.comm_log``'s bytes per step (remat re-runs the forward's
  all_reduces in the backward);
* *step*: the median over ``--reps`` steps, the slowest rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from _runner import saved_bytes  # noqa: E402

import fshard as fs  # noqa: E402
from fshard.launch import World  # noqa: E402


def _peak_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = top = 0  # each op's own allocations (an op's total includes its children's)
    for e in sorted(
        (e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start
    ):
        now += e.self_cpu_memory_usage
        top = max(top, now)
    return top


def rank_fn(remat: bool, layers: int, dim: int, batch: int, ctx: int, reps: int) -> dict:
    import train_gpt as tg

    torch.set_num_threads(1)
    mesh = fs.Mesh.create((1, 2), ("dp", "tp"))
    torch.manual_seed(0)
    cfg = tg.GPTConfig(vocab=256, d_model=dim, n_heads=8, n_layers=layers, ctx=ctx)
    params = fs.nn.shard_params(tg.GPT(cfg), mesh, tg.gpt_plan("tp"))
    ids = torch.randint(0, 256, (batch, ctx + 1), generator=torch.Generator().manual_seed(1))
    vg = fs.value_and_grad(lambda ps: tg.tp_loss(ps, ids, cfg, mesh, remat=remat))

    leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
    live = {k: fs.ShardedArray._raw(leaves[k], v.layout) for k, v in params.items()}
    saved = saved_bytes(lambda: tg.tp_loss(live, ids, cfg, mesh, remat=remat), leaves.values())
    vg(params)  # warm
    peak = _peak_bytes(lambda: vg(params))
    with fs.debug.comm_log() as log:
        loss, _ = vg(params)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        vg(params)
        times.append(time.perf_counter() - t0)
    return {
        "loss": float(loss),
        "saved": saved,
        "peak": peak,
        "comm": sum(r.nbytes for r in log),
        "time": statistics.median(times),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    out = {}
    for name, remat in (("no remat", False), ("fs.remat", True)):
        with World(2, timeout=900) as world:  # each configuration in its own processes
            ranks = world.run(rank_fn, remat, a.layers, a.dim, a.batch, a.ctx, a.reps)
        out[name] = {
            **ranks[0],
            "peak": max(r["peak"] for r in ranks),
            "time": max(r["time"] for r in ranks),
        }
    assert out["no remat"]["loss"] == out["fs.remat"]["loss"]  # the same forward
    print(
        f"GPT {a.layers} layers, d={a.dim}, batch {a.batch} x ctx {a.ctx}, fp32, tp=2 "
        "(Gloo, CPU), fs.value_and_grad of train_gpt.tp_loss"
    )
    print(f"{'':10}{'saved activations':>20}{'peak':>14}{'comm/step':>14}{'step (s)':>10}")
    for name, r in out.items():
        print(
            f"{name:10}{r['saved'] / 2**20:>16.2f} MiB{r['peak'] / 2**20:>10.2f} MiB"
            f"{r['comm'] / 2**20:>10.2f} MiB{r['time']:>10.3f}"
        )
    base, rm = out["no remat"], out["fs.remat"]
    print(
        f"fs.remat: {rm['saved'] / base['saved']:.3f} x the saved activations, "
        f"{rm['peak'] / base['peak']:.3f} x the peak, {rm['time'] / base['time']:.2f} x the step"
    )
    return out


if __name__ == "__main__":
    main()
