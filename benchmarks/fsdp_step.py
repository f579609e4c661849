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
configurations in a shuffled order; a rep's time is the slowest rank's mean step time
(``benchmarks/_runner.py``).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _runner import Pool, console, step, table
from torch import nn

import fshard as fs

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
    return _torch_step(model, dim)


def ddp_config(dim, layers):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _torch_step(DDP(_model(dim, layers)), dim)


def _torch_step(model, dim):
    """A torch training step of ``model``: ``.backward()``, ``torch.optim.AdamW(foreach)``."""
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


def build(name, dim, layers):
    """The step of configuration ``name`` (``_runner.Pool(per_config=True)`` builds one a process)."""
    return CONFIGS[name](dim, layers)


def count_bytes():
    """Collective bytes of one steady-state step, by op."""
    counts: dict = {}
    with _count_bytes(counts):
        step()()
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=512)
    a = ap.parse_args(argv)
    base = "torch FSDP2 fully_shard"
    names = list(CONFIGS)
    with Pool(
        "fsdp_step:build", (a.dim, a.layers), warmup=2, names=names, base=base, per_config=True
    ) as pool:
        counts = {k: pool.call(k, "count_bytes")[0] for k in names}
        times = pool.time(a.reps, a.steps)
        peaks = pool.peak_rss()

    nparams = sum(p.numel() for p in _model(a.dim, a.layers).parameters())
    comm, rss, growth = {}, {}, {}
    for k in names:
        comm[k] = ", ".join(f"{op} {b / 2**20:.1f}" for op, b in sorted(counts[k].items()) if b)
        if k.startswith("DDP"):  # its C++ reducer calls the process group directly
            comm[k] = f"all_reduce {nparams * 4 / 2**20:.1f} (C++ reducer: every fp32 grad)"
        rss[k], growth[k] = (f"{v:.0f}" for v in peaks[k])
    t = table(
        f"FSDP step: {a.layers} blocks {a.dim}->{4 * a.dim}->{a.dim} ({nparams / 1e6:.1f}M "
        f"params), batch {BATCH}/rank, AdamW, 2 ranks x 1 thread",
        times,
        base,
        caption="target: fshard step time <= FSDP2's, peak memory per rank <= FSDP2's",
        extra={"peak RSS MiB": rss, "growth MiB": growth, "collective MiB/step/rank": comm},
    )
    console(170).print(t)


if __name__ == "__main__":
    main()
