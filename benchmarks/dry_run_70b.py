"""The dry run of a Llama-3-70B-shaped transformers model on a 1,024-rank mesh (issue 38 item 1).

Llama-3-70B's shape (80 layers, hidden 8192, 64 heads / 8 kv heads, intermediate 28672, vocab
128256), sequence 8192, one sequence per data-parallel rank, bf16 params and optimizer state
(the model built with ``torch_dtype=torch.bfloat16``), AdamW, ``fs.value_and_grad`` of
``fs.parallel.parallelize``'s loss. Prints the report and the wall time; measure memory with
``/usr/bin/time -v``:

    /usr/bin/time -v python benchmarks/dry_run_70b.py --dp-shard 128 --tp 8

(docs/measurements.md, "Dry run of a 70B model on 1,024 ranks").
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import fshard as fs

LLAMA3_70B = dict(
    num_hidden_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    max_position_embeddings=8192,
)


#: one H100 SXM (dense peaks; NVLink within a node for tp, 400 Gb/s InfiniBand per GPU across)
H100 = fs.Hardware(
    memory=80 * 10**9,
    flops={torch.bfloat16: 989e12, torch.float32: 67e12},
    mem_bw=3.35e12,
    axis_bw={"tp": 450e9, "cp": 450e9, "dp_shard": 50e9, "dp_replicate": 50e9, "ep": 50e9},
)


def init_fn(cfg, dims: fs.parallel.ParallelDims, seq: int, per_rank: int, dtype, remat=False):
    def init(mesh):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg).to(dtype)
        # remat: each decoder layer under fs.remat (torchtitan's full activation checkpointing)
        params, loss = fs.parallel.parallelize(model, mesh, dims, remat=remat)
        opt = fs.optim.adamw(1e-4)
        batch = dims.dp_replicate * dims.dp_shard * dims.ep * per_rank
        ids = torch.empty((batch, seq), dtype=torch.long, device="meta")
        return params, opt.init(params), {"input_ids": ids}, loss, opt

    return init


def train_step(params, opt_state, batch, loss, opt):
    value, grads = fs.value_and_grad(loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return fs.optim.apply_updates(params, updates), opt_state, value


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp-shard", type=int, default=1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--per-rank", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--remat", action="store_true", help="per-layer activation checkpointing")
    p.add_argument("--h100", action="store_true", help="estimate and check memory on H100s")
    a = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(**{**LLAMA3_70B, "num_hidden_layers": a.layers})
    dims = fs.parallel.ParallelDims(dp_shard=a.dp_shard, dp_replicate=a.dp_replicate, tp=a.tp)
    t0 = time.perf_counter()
    init = init_fn(cfg, dims, a.seq, a.per_rank, getattr(torch, a.dtype), a.remat)
    try:
        report = fs.dry_run(train_step, init, dims.abstract_mesh(), hardware=H100 if a.h100 else None)  # fmt: skip
    except fs.dryrun.OutOfMemoryError as e:
        report = e.report
        print(e)
    dt = time.perf_counter() - t0
    print(report)
    print(f"dry run: {dt:.1f} s for {dims.world_size} ranks, {len(report.classes)} rank classes")


if __name__ == "__main__":
    main()
