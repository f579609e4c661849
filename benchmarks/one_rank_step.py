"""A whole training step on a one-rank mesh, fshard against plain torch, as a rich table.

    python benchmarks/one_rank_step.py [--device cpu|cuda] [--size tiny|small|medium]
                                       [--steps 30] [--warmup 5] [--compile]

On one rank nothing is communicated, so every fshard form should cost what the plain step costs.
One process, a transformers Llama (sdpa attention, random weights from a config; bf16 params on
CUDA, fp32 on CPU), step = forward + next-token cross entropy + backward + AdamW:

* eager: ``loss.backward()`` + ``torch.optim.AdamW`` (fused on CUDA, foreach on CPU): the base.
* fshard TP: ``megatron_plan`` + ``fs.value_and_grad`` + donated ``fs.optim.step(adamw)``.
* fshard TP, torch.func form: the same with ``torch.func.grad_and_value`` (the older README form).
* fshard FSDP: ``fsdp_plan`` + ``fsdp_call`` + ``fs.value_and_grad`` + donated ``fs.optim.step``.
* DTensor: ``parallelize_module`` (colwise q/k/v/gate/up, rowwise o/down) + ``torch.optim.AdamW``
  (per-parameter: its foreach and fused kernels refuse DTensors beside plain tensors).
* FSDP2: ``fully_shard`` per layer and the root + ``torch.optim.AdamW``.
* with ``--compile``: ``torch.compile(model)`` + the eager optimizer; the same whole step as
  fshard's on plain tensors (``torch.func.grad_and_value`` + ``fs.optim.adamw``) under one
  ``torch.compile(fullgraph=True)``; and the fshard TP step (grad + AdamW) under
  ``torch.compile(fullgraph=True)``: one graph, so a graph break is an error row, never a step
  left to eager (on a one-rank mesh the module traces as the plain one: the same aten program
  as the plain-tensor row).

Columns: the median step time over ``--steps`` timed steps (after ``--warmup``), the ratio to
eager, and (CUDA) the peak memory above the parameters, ``torch.cuda.max_memory_allocated``
measured per configuration after a reset. Each configuration is built, warmed and timed alone,
its losses checked equal to eager's first step (a configuration that trains something else
shows ``loss differs``). Sizes: tiny (2 layers, hidden 64, seq 32, batch 4: runs on a laptop
CPU in seconds), small (4 layers, hidden 256, seq 256, batch 8), medium (12 layers, hidden 1024,
seq 1024, batch 8, vocab 32000: the issue's medium model, CUDA only).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import fshard as fs

SIZES = {
    "tiny": dict(layers=2, hidden=64, inter=128, heads=4, kv=2, vocab=256, seq=32, batch=4),
    "small": dict(layers=4, hidden=256, inter=688, heads=8, kv=4, vocab=32000, seq=256, batch=8),
    "medium": dict(
        layers=12, hidden=1024, inter=2816, heads=16, kv=8, vocab=32000, seq=1024, batch=8
    ),
}
COLUMN = ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"]
ROW = ["*.o_proj", "*.down_proj"]
LR = 1e-4


def build(size: dict, device: str, dtype: torch.dtype):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=size["hidden"], intermediate_size=size["inter"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"], vocab_size=size["vocab"],
        max_position_embeddings=max(size["seq"], 128), attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def lm_loss(logits, ids):
    v = logits.shape[-1]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1))
    return fs.gather(loss) if isinstance(loss, fs.ShardedArray) else loss


def torch_adamw(params, device, per_param=False):
    kind = {"fused": True} if device == "cuda" else {"foreach": True}
    if per_param:  # DTensor beside plain params: foreach and fused refuse the mix
        kind = {"foreach": False}
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, **kind)


def eager(model, ids, device, per_param=False):
    opt = torch_adamw(model.parameters(), device, per_param)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(ids, use_cache=False).logits, ids)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def fshard_tp(model, ids, device, *, form="fs", compiled=False):
    mesh = fs.Mesh.create((1,), ("tp",), device_type=device)
    params = fs.nn.shard_params(model, mesh, fs.nn.megatron_plan(COLUMN, ROW, model=model))
    x = fs.shard(ids, mesh, fs.P())
    tx = fs.optim.adamw(LR, weight_decay=0.1)
    state = {"opt": tx.init(params), "params": params}

    def loss_fn(ps, x):
        return lm_loss(fs.nn.functional_call(model, ps, (x,), {"use_cache": False}).logits, x)

    if form == "fs":
        vg = fs.value_and_grad(loss_fn)
    else:
        gv = torch.func.grad_and_value(loss_fn)

        def vg(ps, x):
            g, v = gv(ps, x)
            return v, g

    def pure(ps, opt_state, x):
        loss, grads = vg(ps, x)
        ps, opt_state = fs.optim.step(tx, grads, opt_state, ps, donate=True)
        return ps, opt_state, loss

    run = torch.compile(pure, fullgraph=True) if compiled else pure

    def step():
        state["params"], state["opt"], loss = run(state["params"], state["opt"], x)
        return loss.detach()

    return step


def fshard_fsdp(model, ids, device):
    mesh = fs.Mesh.create((1,), ("dp",), device_type=device)
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    x = fs.shard(ids, mesh, fs.P("dp"))
    tx = fs.optim.adamw(LR, weight_decay=0.1)
    state = {"opt": tx.init(params), "params": params}

    def loss_fn(ps, x):
        out = fs.nn.fsdp_call(model, ps, (x,), {"use_cache": False}, mesh=mesh)
        return lm_loss(out.logits, x)

    vg = fs.value_and_grad(loss_fn)

    def step():
        loss, grads = vg(state["params"], x)
        state["params"], state["opt"] = fs.optim.step(
            tx, grads, state["opt"], state["params"], donate=True
        )
        return loss.detach()

    return step


def dtensor(model, ids, device):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dmesh = torch.distributed.device_mesh.init_device_mesh(device, (1,))
    plan = {}
    for i in range(len(model.model.layers)):
        for m in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{m}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, dmesh, plan)
    return eager(model, ids, device, per_param=True)


def fsdp2(model, ids, device):
    from torch.distributed.fsdp import fully_shard

    dmesh = torch.distributed.device_mesh.init_device_mesh(device, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dmesh)
    fully_shard(model, mesh=dmesh)
    return eager(model, ids, device)


def compiled_model(model, ids, device):
    return eager(torch.compile(model), ids, device)


def compiled_plain_step(model, ids, device):
    """The compiled fshard step's program on plain tensors: ``torch.func.functional_call`` +
    ``torch.func.grad_and_value`` + ``fs.optim.adamw`` on a dict of tensors, one
    ``torch.compile(fullgraph=True)``. What the fshard step should cost; its distance to
    ``torch.compile(model)`` is the whole-step form's (one joint graph), not fshard's."""
    tx = fs.optim.adamw(LR, weight_decay=0.1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = {"opt": tx.init(params), "params": params}

    def loss_fn(ps, x):
        return lm_loss(torch.func.functional_call(model, ps, (x,), {"use_cache": False}).logits, x)

    def pure(ps, opt_state, x):
        grads, loss = torch.func.grad_and_value(loss_fn)(ps, x)
        ps, opt_state = fs.optim.step(tx, grads, opt_state, ps, donate=True)
        return ps, opt_state, loss

    run = torch.compile(pure, fullgraph=True)

    def step():
        state["params"], state["opt"], loss = run(state["params"], state["opt"], ids)
        return loss.detach()

    return step


CONFIGS = {
    "eager torch + AdamW": eager,
    "fshard TP, fs.value_and_grad": fshard_tp,
    "fshard TP, torch.func.grad_and_value": lambda m, i, d: fshard_tp(m, i, d, form="func"),
    "fshard FSDP": fshard_fsdp,
    "DTensor parallelize_module": dtensor,
    "FSDP2 fully_shard": fsdp2,
}
COMPILED = {
    "torch.compile(model) + AdamW": compiled_model,
    "compiled torch.func step, plain tensors": compiled_plain_step,
    "fshard TP compiled": lambda m, i, d: fshard_tp(m, i, d, compiled=True),
}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(name, make, size, device, dtype, steps, warmup):
    """``(median seconds, peak bytes above the params or None, first loss)`` of one config."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model = build(size, device, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g).to(device)
    step = make(model, ids, device)
    first = float(step())
    for _ in range(warmup - 1):
        step()
    _sync(device)
    if device == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    del step, model
    return statistics.median(times), peak, first


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--size", choices=list(SIZES), default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated substrings of config names")
    a = ap.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[a.size or ("small" if device == "cuda" else "tiny")]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    warnings.filterwarnings("ignore")
    if device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(0)
    store = dist.FileStore(tempfile.mktemp(prefix="fshard-bench-"), 1)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1
    )
    configs = dict(CONFIGS, **(COMPILED if a.compile else {}))
    if a.only:
        keys = a.only.split(",")
        configs = {
            k: v
            for k, v in configs.items()
            if k == "eager torch + AdamW" or any(s in k for s in keys)
        }
    rows = {}
    for name, make in configs.items():
        try:
            rows[name] = measure(name, make, size, device, dtype, a.steps, a.warmup)
        except Exception as e:  # a configuration that cannot run is a row, not a crash
            rows[name] = e
        r = rows[name]  # as it comes, for a run that is cut short
        print(name, "|", r if isinstance(r, Exception) else f"{r[0] * 1e3:.2f} ms", flush=True)
    base_t, _, base_loss = rows["eager torch + AdamW"]
    t = Table(title=f"one-rank training step, {a.size or ('small' if device == 'cuda' else 'tiny')} "
              f"Llama, {device} {str(dtype).replace('torch.', '')}, torch {torch.__version__}")  # fmt: skip
    for c in ("configuration", "median ms", "x eager", "peak MiB above params", "first loss"):
        t.add_column(c, justify="left" if c == "configuration" else "right")
    for name, r in rows.items():
        if isinstance(r, Exception):
            t.add_row(name, "-", "-", "-", f"{type(r).__name__}: {str(r)[:60]}")
            continue
        sec, peak, loss = r
        ok = abs(loss - base_loss) <= 2e-2 * max(1.0, abs(base_loss))
        t.add_row(
            name,
            f"{sec * 1e3:.2f}",
            f"{sec / base_t:.3f}",
            "-" if peak is None else f"{peak / 2**20:.0f}",
            f"{loss:.4f}" + ("" if ok else " (loss differs)"),
        )
    Console(width=int(os.environ.get("COLUMNS", 140))).print(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
