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

Each configuration runs in its own pair of rank processes, reps interleaved
(``benchmarks/_runner.py``): a rep times ``--steps`` steps after a barrier (the slowest rank's
mean); the table shows the median over reps, the per-rep ratio to DTensor, and the
collectives one step issues: fshard's from ``fs.debug.comm_log()`` (count and this rank's input bytes), DTensor's from torch's
``CommDebugMode`` (count only: it does not report bytes). Eager attention everywhere: fshard
has no rule for the ``enable_gqa`` HF's sdpa path passes. The three losses are checked equal.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from _runner import Pool, console, table

import fshard as fs

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


BASE = "DTensor parallelize_module"
_COMM: dict = {}  # config -> (collectives per step, bytes per step or None), on this rank


def configs(batch: int, seq: int):
    """``({name: step}, baseline)`` on this rank (a ``_runner`` section); each configuration's
    collectives per step (count, bytes) go to ``_COMM``."""
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
    out[BASE] = (dtensor_step, (cm.get_total_counts(), None))

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
    _COMM.update({k: comm for k, (_, comm) in out.items()})
    return {k: fn for k, (fn, _) in out.items()}, BASE


def collectives(name):
    return _COMM[name]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    with Pool("hf_step:configs", (a.batch, a.seq), warmup=1) as pool:
        comm = {k: pool.call(k, "collectives", k)[0] for k in pool.names}
        times = pool.time(a.reps, a.steps)
    t = table(
        f"HF Llama tiny fwd+bwd, batch {a.batch}x{a.seq}, 2 Gloo ranks, 1 thread each "
        f"(median of {a.reps} reps x {a.steps} steps)",
        times,
        BASE,
        extra={
            "collectives/step": {k: str(c) for k, (c, _) in comm.items()},
            "bytes/step": {
                k: "n/a" if b is None else f"{b / 1e6:.3f} MB" for k, (_, b) in comm.items()
            },
        },
    )
    console(140).print(t)


if __name__ == "__main__":
    main()
