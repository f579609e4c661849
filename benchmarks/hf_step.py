"""One forward + backward of a tiny Hugging Face Llama on 2 local Gloo ranks, as a rich table.

    python benchmarks/hf_step.py [--reps 7] [--steps 10] [--batch 8] [--seq 64]

Llama tiny (hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads, vocab 256, eager
attention, random weights built from the config), batch 8 x 64, next-token cross entropy:

* dense: the whole model on each rank, ``loss.backward()`` (no communication).
* DTensor: ``parallelize_module`` with ``ColwiseParallel`` on q/k/v/gate/up and
  ``RowwiseParallel`` on o/down (the usual HF Llama plan), ``loss.backward()``.
* fshard TP: ``fs.nn.shard_params`` with ``fs.nn.megatron_plan`` on the same modules (row
  outputs reduced right after o/down: ``fs.nn.Output(P())``), ``fs.nn.functional_call`` inside
  ``torch.func.grad_and_value``.

Each rep times ``--steps`` steps after a barrier (the slowest rank's mean); the table shows
the median over reps, the ratio to DTensor, and the collectives one step issues: fshard's from
``fs.debug.comm_log()`` (count and this rank's input bytes), DTensor's from torch's
``CommDebugMode`` (count only: it does not report bytes). Eager attention everywhere: fshard
has no rule for the ``enable_gqa`` HF's sdpa path passes. The three losses are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs
from fshard.launch import World

VOCAB = 256
COLUMN = ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"]
ROW = ["*.o_proj", "*.down_proj"]


def build():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def lm_loss(logits, ids):
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return fs.gather(loss) if isinstance(loss, fs.ShardedArray) else loss


def configs(batch: int, seq: int):
    """``{name: (step, collectives)}`` on this rank; ``collectives`` is ``(count, bytes)``."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    out = {}

    dense = build()

    def dense_step():
        dense.zero_grad(set_to_none=True)
        loss = lm_loss(dense(ids, use_cache=False).logits, ids)
        loss.backward()
        return loss.detach()

    out["dense (1 rank's work, no comm)"] = (dense_step, (0, 0))

    dmodel = build()
    dmesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    dplan = {f"model.layers.{i}.self_attn.{m}": ColwiseParallel() for i in range(2) for m in "qkv"}
    dplan = {k + "_proj": v for k, v in dplan.items()}
    for i in range(2):
        dplan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        dplan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        dplan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        dplan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(dmodel, dmesh, dplan)
    # HF splits heads with view(..., -1, head_dim): local outputs give the local head count

    def dtensor_step():
        dmodel.zero_grad(set_to_none=True)
        loss = lm_loss(dmodel(ids, use_cache=False).logits, ids)
        loss.backward()
        return loss.detach()

    with CommDebugMode() as cm:
        dtensor_step()
    out["DTensor parallelize_module"] = (dtensor_step, (cm.get_total_counts(), None))

    model = build()
    mesh = fs.Mesh.create((2,), ("tp",))
    params = fs.nn.shard_params(model, mesh, fs.nn.megatron_plan(COLUMN, ROW, model=model))
    x = fs.shard(ids, mesh, fs.P())

    def loss_fn(ps, x):
        return lm_loss(fs.nn.functional_call(model, ps, (x,), {"use_cache": False}).logits, x)

    grad_fn = torch.func.grad_and_value(loss_fn)

    def fshard_step():
        return grad_fn(params, x)[1]

    with fs.debug.comm_log() as log:
        fshard_step()
    out["fshard TP (megatron_plan, functional_call)"] = (
        fshard_step,
        (len(log), sum(r.nbytes for r in log)),
    )
    losses = [float(fn()) for fn, _ in out.values()]
    assert max(losses) - min(losses) < 1e-5 * abs(losses[0]), losses
    return out


_BUILT: dict = {}


def _names(batch, seq):
    _BUILT["c"] = configs(batch, seq)
    return [(k, comm) for k, (_, comm) in _BUILT["c"].items()]


def _time(name: str, steps: int) -> float:
    fn = _BUILT["c"][name][0]
    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dt = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def main():
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    with World(2, timeout=1800) as world:
        names = world.run(_names, a.batch, a.seq)[0]
        times = {k: [] for k, _ in names}
        for rep in range(a.reps):
            order = [k for k, _ in names]
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for k in order:
                times[k].append(world.run(_time, k, a.steps)[0])
    base = statistics.median(times["DTensor parallelize_module"])
    t = Table(
        title=f"HF Llama tiny fwd+bwd, batch {a.batch}x{a.seq}, 2 Gloo ranks, 1 thread each "
        f"(median of {a.reps} reps x {a.steps} steps)"
    )
    for col in ("configuration", "ms/step", "vs DTensor", "collectives/step", "bytes/step"):
        t.add_column(col, justify="left" if col == "configuration" else "right")
    for k, (count, nbytes) in names:
        ms = statistics.median(times[k]) * 1e3
        t.add_row(
            k,
            f"{ms:.2f}",
            f"{ms / base / 1e3:.3f}x",
            str(count),
            "n/a" if nbytes is None else f"{nbytes / 1e6:.3f} MB",
        )
    Console(width=120).print(t)


if __name__ == "__main__":
    main()
