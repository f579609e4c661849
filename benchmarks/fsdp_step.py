"""FSDP (ZeRO-3) training step on 2 local Gloo ranks (1 thread each), printed as a rich table.

    python benchmarks/fsdp_step.py [--reps 5] [--steps 4] [--layers 6] [--dim 512]

The same model (``--layers`` residual MLP blocks ``dim -> 4*dim -> dim`` in an ``nn.ModuleList``,
one FSDP unit each, plus a root unit with the input/output projections), the same batch and
AdamW, three ways:

* fshard: ``fs.nn.fsdp_plan`` + ``fs.nn.shard_params`` (params and AdamW moments sharded over
  ``'dp'``), the loss through ``fs.nn.fsdp_call`` (each block all-gathered just before use, the
  next one prefetched, re-gathered in the backward), ``fs.value_and_grad`` (gradients arrive
  reduce-scattered), ``fs.optim.step(adamw, donate=True)``;
* torch FSDP2: ``fully_shard`` on every block and the root, ``torch.optim.AdamW(foreach)``;
* DDP (raw torch.distributed, full replicas): the memory a non-sharded step needs.

Each configuration runs in its own pair of fresh rank processes, so ``ru_maxrss`` (the RSS
high-water mark) is that configuration's alone; the table shows it and its growth over the RSS
after building the model's inputs (imports and the process's baseline excluded). Collective
bytes per step and rank are counted by wrapping the ``torch.distributed`` collectives every
configuration calls (input bytes, as ``fs.debug.comm_log``); DDP's C++ reducer bypasses them, so
its row gives the bytes of its gradient all_reduce (every fp32 gradient once). Reps are interleaved across the
configurations in a shuffled order; a rep's time is the slowest rank's mean step time.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fshard as fs
from fshard.launch import World

BATCH = 32  # per rank
_COUNTED = (
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "all_reduce",
    "broadcast",
)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@contextlib.contextmanager
def _count_bytes(counts: dict):
    """Wrap torch.distributed's collectives: ``counts[op] += input bytes`` per call."""
    saved = {}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if name.endswith(("_tensor", "_single")):  # (output, input, ...)
                t = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            else:
                t = args[0] if args else kwargs["tensor"]
            counts[name] = counts.get(name, 0) + t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return counted

    for name in _COUNTED:
        saved[name] = getattr(dist, name)
        setattr(dist, name, wrap(name, saved[name]))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _model(dim, layers):
    torch.manual_seed(0)
    return Net(dim, layers)


def _data(dim):
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randn(BATCH, dim, generator=g), torch.randn(BATCH, dim, generator=g)


def fshard_config(dim, layers):
    mesh = fs.Mesh.create((2,), ("dp",))
    model = _model(dim, layers)
    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    model.to("meta")  # the module only provides structure and forward from here on
    tx = fs.optim.adamw(1e-3)
    st = {"p": params, "s": tx.init(params)}
    x, y = _data(dim)

    def loss(ps, x, y):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh)
        return fs.lax.pmean(F.mse_loss(out, y), "dp", mesh=mesh)

    vg = fs.value_and_grad(loss)

    def step():
        _, g = vg(st["p"], x, y)
        st["p"], st["s"] = fs.optim.step(tx, g, st["s"], st["p"], donate=True)

    return step


def fsdp2_config(dim, layers):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(dim, layers)
    dmesh = init_device_mesh("cpu", (2,))
    for b in model.blocks:
        fully_shard(b, mesh=dmesh)
    fully_shard(model, mesh=dmesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = _data(dim)

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return step


def ddp_config(dim, layers):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(dim, layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = _data(dim)

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return step


CONFIGS = {
    "fshard fsdp_plan + fsdp_call + value_and_grad": fshard_config,
    "torch FSDP2 fully_shard": fsdp2_config,
    "DDP (not sharded)": ddp_config,
}
_STEP: dict = {}


def _build(name, dim, layers, warmup):
    torch.set_num_threads(1)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _STEP["fn"] = CONFIGS[name](dim, layers)
    for _ in range(warmup):
        _STEP["fn"]()
    counts: dict = {}
    with _count_bytes(counts):  # one steady-state step
        _STEP["fn"]()
    _STEP["rss0"] = rss0
    return counts


def _time(steps):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        _STEP["fn"]()
    out = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out[0])


def _peak():
    """(peak RSS MiB, growth over the RSS before building the config, MiB): max over ranks."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = torch.tensor([peak / 1024, (peak - _STEP["rss0"]) / 1024], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=512)
    a = ap.parse_args(argv)
    worlds = {k: World(2, timeout=3600) for k in CONFIGS}
    try:
        counts = {k: w.run(_build, k, a.dim, a.layers, 2)[0] for k, w in worlds.items()}
        times = {k: [] for k in CONFIGS}
        order = list(CONFIGS)
        for rep in range(a.reps):
            random.Random(rep).shuffle(order)
            for k in order:
                times[k].append(worlds[k].run(_time, a.steps)[0])
        peaks = {k: w.run(_peak)[0] for k, w in worlds.items()}
    finally:
        for w in worlds.values():
            w.close()

    from rich.console import Console
    from rich.table import Table

    base = "torch FSDP2 fully_shard"
    nparams = sum(p.numel() for p in _model(a.dim, a.layers).parameters())
    t = Table(
        title=f"FSDP step: {a.layers} blocks {a.dim}->{4 * a.dim}->{a.dim} ({nparams / 1e6:.1f}M "
        f"params), batch {BATCH}/rank, AdamW, 2 ranks x 1 thread"
    )
    for col in ("config", "median ms/step", "min", "max", "ratio to FSDP2 (per-rep median)"):
        t.add_column(col, justify="left" if col == "config" else "right")
    t.add_column("peak RSS MiB", justify="right")
    t.add_column("growth MiB", justify="right")
    t.add_column("collective MiB/step/rank", justify="left")
    for k, reps in times.items():
        ratios = [s / b for s, b in zip(reps, times[base])]
        comm = ", ".join(f"{op} {b / 2**20:.1f}" for op, b in sorted(counts[k].items()) if b)
        if k.startswith("DDP"):  # its C++ reducer calls the process group directly
            comm = f"all_reduce {nparams * 4 / 2**20:.1f} (C++ reducer: every fp32 grad)"
        t.add_row(
            k,
            f"{statistics.median(reps) * 1e3:.1f}",
            f"{min(reps) * 1e3:.1f}",
            f"{max(reps) * 1e3:.1f}",
            f"{statistics.median(ratios):.3f}x",
            f"{peaks[k][0]:.0f}",
            f"{peaks[k][1]:.0f}",
            comm,
        )
    t.caption = "target: fshard step time <= FSDP2's, peak memory per rank <= FSDP2's"
    Console(width=max(Console().width, 140)).print(t)


if __name__ == "__main__":
    main()
