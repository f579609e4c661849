"""Collectives and bytes of one training step of the example GPT under each parallelism, from
``fs.debug.comm_log`` (the README's "Parallelism" table).

    python benchmarks/parallelism_comm.py [--d-model 64] [--layers 2] [--batch 4] [--ctx 32]

Each strategy runs ``examples/train_gpt.py``'s step for its flags (forward, backward, AdamW;
the local view for dp, fsdp and tp, ``fs.parallel.parallelize`` for the others) once on 2 local
Gloo ranks, fp32, and prints per rank: each collective with its mesh axes, how many ran and the
input bytes they moved (``comm_log``'s ``nbytes``, this rank's). The model: GPT with ``--layers``
blocks, ``d = --d-model``, vocab 256, ``--batch`` sequences of ``--ctx`` tokens (global);
``--experts`` gives the MoE run 4 experts, top-2.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import fshard as fs  # noqa: E402
from fshard.launch import World  # noqa: E402

#: name -> (the demo's flags, what it splits)
STRATEGIES = {
    "dp": ("--dp 2 --tp 1", "the batch"),
    "fsdp": ("--fsdp 2 --tp 1", "the batch; params, grads, AdamW state"),
    "tp": ("--tp 2", "weights: column/row (Megatron)"),
    "tp+sp": ("--tp 2 --sp", "weights; activations between blocks on the sequence"),
    "cp": ("--cp 2 --tp 1", "the sequence (ring attention)"),
    "pp": ("--pp 2 --tp 1", "the blocks, as stages (1F1B, 4 microbatches)"),
    "ep": ("--experts 4 --ep 2 --tp 1", "the batch; the experts (MoE)"),
}


def rank_fn(name: str, d: int, layers: int, batch: int, ctx: int) -> list:
    import train_gpt as tg

    flags = f"{STRATEGIES[name][0]} --d-model {d} --layers {layers} --batch {batch} --ctx {ctx}"
    args = tg.parse_args([*flags.split(), "--microbatches", "4", "--plot", ""])
    cfg = tg.GPTConfig(**args["model"])
    mesh, model, params, loss = tg.sharded_model(args, cfg)
    tx = tg.make_optimizer(1e-3, 10, 2, 0.1, 1.0)
    state = tx.init(params)
    units = fs.nn.fsdp_units(model) if args["fsdp"] and loss is None else None
    step = tg.make_train_step(cfg, mesh, tx, loss=loss, fsdp_units=units)
    ids = torch.randint(0, 256, (batch, ctx + 1), generator=torch.Generator().manual_seed(1))
    x = ids if loss is not None else fs.shard(ids, mesh, fs.P(tg.data_axes(mesh)))
    params, state, _ = step(params, state, x)  # warm (lazily built programs)
    with fs.debug.comm_log() as log:
        step(params, state, x)
    return [(r.op, r.axes, r.nbytes) for r in log]


def summarize(log: list) -> tuple[Counter, Counter]:
    counts, nbytes = Counter(), Counter()
    for op, axes, n in log:
        counts[op, axes] += 1
        nbytes[op, axes] += n
    return counts, nbytes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=32)
    a = ap.parse_args(argv)
    out = {}
    with World(2, timeout=900) as world:
        for name in STRATEGIES:
            logs = world.run(rank_fn, name, a.d_model, a.layers, a.batch, a.ctx)
            out[name] = summarize(logs[0])
    act = a.batch * a.ctx * a.d_model * 4
    print(
        f"GPT {a.layers} layers, d={a.d_model}, batch {a.batch} x ctx {a.ctx}, fp32, 2 ranks; "
        f"one activation (batch x ctx x d) = {act / 1024:.0f} KiB; rank 0's input bytes per step"
    )
    print("| strategy | splits | collectives per step (count x op over axes: KiB) | total KiB |")
    print("|---|---|---|---|")
    for name, (counts, nbytes) in out.items():
        parts = [
            f"{counts[k]} x {k[0]} over {'/'.join(k[1])}: {nbytes[k] / 1024:.1f}"
            for k in sorted(counts, key=lambda k: -nbytes[k])
        ]
        total = sum(nbytes.values()) / 1024
        print(f"| {name} | {STRATEGIES[name][1]} | {'; '.join(parts)} | {total:.1f} |")
    return out


if __name__ == "__main__":
    main()
