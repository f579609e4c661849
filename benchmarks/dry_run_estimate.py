"""fs.dry_run's step-time estimate against the measured step, for the configurations that run on
this machine (issue 38 item 3): a small transformers Llama under DDP, TP, FSDP and FSDP x TP on
local Gloo ranks.

The hardware is this machine, calibrated first: peak FLOP/s per dtype (a square float32 matmul,
one thread) and memory bandwidth (a large copy), both shared by the ranks when there are more
ranks than cores; the bandwidth of a Gloo all_reduce between ranks and its latency (a one-float
all_reduce), measured in the world, the same for every axis (the ranks share one host); and the
kernel latency, the time per kernel of fshard's eager step on this CPU (dispatch in Python and
torch), measured per configuration on the same model 16 times narrower (hidden 16, where FLOPs
and bytes are negligible): its measured step minus its collectives' latency, over the kernels
its dry run counts. The estimate prints both bounds (no overlap / perfect overlap); the measured
time is the median of ``--steps`` steps after one warm-up step.

Run it only on an otherwise idle machine (``uptime`` load < 1):

    python benchmarks/dry_run_estimate.py --steps 5

(docs/measurements.md, "Dry run: estimate against measurement").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
import transformers

import fshard as fs

CONFIGS = [
    ("ddp", {"dp_replicate": 2}),
    ("tp", {"tp": 2}),
    ("fsdp", {"dp_shard": 2}),
    ("fsdp x tp", {"dp_shard": 2, "tp": 2}),
]


def _cfg(hidden=256):
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, vocab_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def _make(mesh, dims, device, batch, seq, hidden=256):
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(_cfg(hidden))
    params, loss = fs.parallel.parallelize(model, mesh, dims)
    opt = fs.optim.adamw(1e-4)
    ids = (
        torch.empty((batch, seq), dtype=torch.long, device="meta")
        if device == "meta"
        else torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(1))
    )
    return params, opt.init(params), {"input_ids": ids}, loss, opt


def train_step(params, opt_state, batch, loss, opt):
    value, grads = fs.value_and_grad(loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return fs.optim.apply_updates(params, updates), opt_state, value


def _measure(degrees: dict, steps: int, batch: int, seq: int, hidden: int = 256) -> float:
    dims = fs.parallel.ParallelDims(**degrees)
    params, state, b, loss, opt = _make(dims.mesh(), dims, "cpu", batch, seq, hidden)
    params, state, _ = train_step(params, state, b, loss, opt)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        params, state, _ = train_step(params, state, b, loss, opt)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _wire_bandwidth(nbytes: int = 1 << 24) -> float:
    """Bytes received per rank per second by a Gloo all_reduce (ring: 2(n-1)/n of the input)."""
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(x)
    dt = (time.perf_counter() - t0) / 5
    n = dist.get_world_size()
    return 2 * (n - 1) / n * nbytes / dt


def _wire_latency(repeats: int = 50) -> float:
    """Seconds of a one-float Gloo all_reduce (the median)."""
    x = torch.ones(1)
    dist.all_reduce(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compute_peaks() -> tuple[float, float]:
    a = torch.randn(1024, 1024)
    a @ a
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    flops = 10 * 2 * 1024**3 / (time.perf_counter() - t0)
    big = torch.empty(1 << 26, dtype=torch.uint8)
    out = torch.empty_like(big)
    out.copy_(big)
    t0 = time.perf_counter()
    for _ in range(5):
        out.copy_(big)
    bw = 5 * 2 * big.numel() / (time.perf_counter() - t0)  # read + write
    return flops, bw


def _dry_run(dims, hw, batch, seq, hidden):
    return fs.dry_run(
        train_step, lambda m: _make(m, dims, "meta", batch, seq, hidden),
        dims.abstract_mesh(), hardware=hw, backend="gloo",
    ).classes[0]  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # as each Gloo rank runs here
    flops, mem_bw = _compute_peaks()
    cores = os.cpu_count() or 1
    print(f"calibration: {flops / 1e9:.1f} GFLOP/s float32, memory {mem_bw / 1e9:.1f} GB/s, {cores} cores")  # fmt: skip
    rows = []
    for name, degrees in CONFIGS:
        dims = fs.parallel.ParallelDims(**degrees)
        world = dims.world_size
        wire = fs.launch.run(_wire_bandwidth, world_size=world)[0]
        alpha = max(fs.launch.run(_wire_latency, world_size=world))
        share = min(1.0, cores / world)  # ranks beyond the cores share them
        hw = fs.Hardware(
            flops=dict.fromkeys((torch.float32, torch.int64, torch.bool), flops * share),
            mem_bw=mem_bw * share,
            axis_bw=dict.fromkeys(fs.parallel.compose.AXES, wire),
            axis_latency=dict.fromkeys(fs.parallel.compose.AXES, alpha),
        )
        # the kernel latency, from the narrow model's step (FLOPs and bytes negligible there)
        narrow = max(fs.launch.run(_measure, world_size=world, args=(degrees, a.steps, 1, 16, 16)))
        small = _dry_run(dims, hw, 1, 16, 16)
        kernel = max(0.0, narrow - len(small.collectives) * alpha) / small.kernels
        hw = dataclasses.replace(hw, kernel_latency=kernel)
        measured = fs.launch.run(_measure, world_size=world, args=(degrees, a.steps, a.batch, a.seq))  # fmt: skip
        est = _dry_run(dims, hw, a.batch, a.seq, 256).estimate
        roof = dataclasses.replace(hw, kernel_latency=0.0, axis_latency={})
        bare = _dry_run(dims, roof, a.batch, a.seq, 256).estimate
        rows.append((name, world, kernel, alpha, bare.serial, est.overlapped, est.serial, max(measured)))  # fmt: skip
    print(
        "| configuration | ranks | kernel latency (us) | collective latency (us) | roofline only, "
        "no overlap (s) | estimate, full overlap (s) | estimate, no overlap (s) | measured (s) "
        "| measured / estimate (no overlap) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, world, kernel, alpha, bare, lo, hi, got in rows:
        print(
            f"| {name} | {world} | {kernel * 1e6:.1f} | {alpha * 1e6:.1f} | {bare:.4f} | {lo:.4f} "
            f"| {hi:.4f} | {got:.4f} | {got / hi:.2f}x |"
        )


if __name__ == "__main__":
    main()
