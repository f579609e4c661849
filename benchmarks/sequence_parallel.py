"""Sequence parallelism vs plain tensor parallelism on 2 local Gloo ranks: activation memory
per rank, collective bytes and step time of the example GPT.

    python benchmarks/sequence_parallel.py [--layers 4] [--dim 256] [--batch 2] [--ctx 96]

Both configurations run the same model (``examples/train_gpt.py``'s GPT, fp32), the same batch,
through ``fs.nn.functional_call`` under tp=2: plain TP (``megatron_plan``: row-parallel outputs
all-reduced, norms and residuals replicated) and Megatron-SP
(``fs.parallel.sequence_parallel_plan``: reduce-scattered onto the sequence, norms and
residuals on ``ctx / 2`` positions per rank). Activation memory is what autograd saves for the
backward, counted once per storage with ``torch.autograd.graph.saved_tensors_hooks`` during the
forward (the local tensors of this rank); collective bytes per step are ``fs.debug.comm_log``'s
input bytes and the bytes each rank receives (DESIGN §5: all_gather ``(n-1) L``, reduce_scatter
``(n-1)/n L``, ring all_reduce ``2 (n-1)/n L``); step time is the median over ``--reps`` forward+backward passes (the slowest rank).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from _runner import saved_bytes  # noqa: E402

import fshard as fs  # noqa: E402
from fshard.launch import World  # noqa: E402

_RECEIVED = {"all_gather": 1.0, "reduce_scatter": 0.5, "all_reduce": 1.0}  # x input, n = 2


def _plan(sp: bool) -> dict:
    column, row = (
        ["blocks.*.attn.qkv", "blocks.*.mlp.fc1"],
        ["blocks.*.attn.proj", "blocks.*.mlp.fc2"],
    )
    if sp:
        plan = fs.parallel.sequence_parallel_plan(column=column, row=row, scatter=["embed.tok"])
    else:
        plan = fs.nn.megatron_plan(column=column, row=row)
    plan.update(fs.nn.megatron_plan(column=["head"], bias=False))
    return plan


def _loss(params, model, tokens):
    """Mean next-byte cross entropy, the module's own forward on sharded params."""
    logits = fs.nn.functional_call(model, params, (tokens[:, :-1],))
    return fs.gather(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


def rank_fn(sp: bool, layers: int, dim: int, batch: int, ctx: int, reps: int) -> dict:
    import train_gpt as tg

    torch.set_num_threads(1)
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(vocab=256, d_model=dim, n_heads=8, n_layers=layers, ctx=ctx))
    params = fs.nn.shard_params(model, mesh, _plan(sp))
    for v in params.values():
        v.local.requires_grad_(True)
    ids = torch.randint(0, 256, (batch, ctx + 1), generator=torch.Generator().manual_seed(1))
    x = fs.shard(ids, mesh, fs.P())
    leaves = [v.local for v in params.values()]
    saved = saved_bytes(lambda: _loss(params, model, x), leaves)
    torch.autograd.grad(_loss(params, model, x), leaves)
    with fs.debug.comm_log() as log:
        torch.autograd.grad(_loss(params, model, x), leaves)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.autograd.grad(_loss(params, model, x), leaves)
        times.append(time.perf_counter() - t0)
    return {
        "saved": saved,
        "comm": sum(r.nbytes for r in log),
        "wire": sum(r.nbytes * _RECEIVED[r.op] for r in log),
        "ops": sorted({r.op for r in log}),
        "time": statistics.median(times),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=96)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    out = {}
    with World(2, timeout=600) as world:
        for name, sp in (("tp", False), ("tp+sp", True)):
            ranks = world.run(rank_fn, sp, a.layers, a.dim, a.batch, a.ctx, a.reps)
            out[name] = {**ranks[0], "time": max(r["time"] for r in ranks)}
    print(
        f"GPT {a.layers} layers, d={a.dim}, batch {a.batch} x ctx {a.ctx}, fp32, tp=2 (Gloo, CPU)"
    )
    print(
        f"{'':8}{'saved activations':>20}{'comm input/step':>18}{'received/step':>16}{'step (s)':>10}  ops"
    )
    for name, r in out.items():
        print(
            f"{name:8}{r['saved'] / 2**20:>16.2f} MiB{r['comm'] / 2**20:>14.2f} MiB"
            f"{r['wire'] / 2**20:>12.2f} MiB{r['time']:>10.3f}  {', '.join(r['ops'])}"
        )
    ratio = out["tp+sp"]["saved"] / out["tp"]["saved"]
    print(f"SP saves {ratio:.3f} x plain TP's activations")
    return out


if __name__ == "__main__":
    main()
