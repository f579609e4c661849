"""Reshard cost: fshard vs the raw torch.distributed call it lowers to vs DTensor.redistribute.

    python benchmarks/reshard.py [--mib 16] [--reps 7] [--world 2]

Global tensor of --mib MiB (float32, square), 1 thread per rank, self-launched Gloo ranks.
Each rep times every implementation of every transition in turn (interleaved), a barrier before
each loop, reporting the slowest rank's per-call time; the table shows medians over reps and the
median of per-rep ratios.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from _runner import timed

import fshard as fs


def _cases(n: int, mib: int):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    side = int((mib * 2**20 // 4) ** 0.5)
    side -= side % n
    t = torch.randn(side, side, generator=torch.Generator().manual_seed(0))
    mesh = fs.Mesh.create((n,), ("x",))
    dm = mesh.device_mesh
    me = dist.get_rank()
    rows = side // n
    s0 = fs.shard(t, mesh, fs.P("x"))
    s1 = fs.shard(t, mesh, fs.P(None, "x"))
    rep = fs.shard(t, mesh, fs.P())
    part = fs.from_local(t / n, mesh, fs.P(partial="x"))
    d_s0 = distribute_tensor(t, dm, [Shard(0)], src_data_rank=None)
    d_s1 = distribute_tensor(t, dm, [Shard(1)], src_data_rank=None)
    d_rep = distribute_tensor(t, dm, [Replicate()], src_data_rank=None)
    d_part = DTensor.from_local(t / n, dm, [Partial()], run_check=False)
    local = s0.local.contiguous()
    full = torch.empty_like(t)

    def raw_all_gather():
        dist.all_gather_single(full, local)

    def raw_all_to_all():
        send = torch.stack(torch.split(local, side // n, 1))  # layout copy: column blocks
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return torch.cat(list(recv), 0)

    def raw_all_reduce():
        buf = part.local.clone()
        dist.all_reduce(buf)

    def raw_reduce_scatter():
        out = torch.empty(rows, side)
        dist.reduce_scatter_single(out, part.local.contiguous())

    def raw_slice():
        return t[me * rows : (me + 1) * rows]

    return [
        (
            "S(0) -> R",
            lambda: fs.reshard(s0, fs.P()),
            raw_all_gather,
            "all_gather_single",
            lambda: d_s0.redistribute(dm, [Replicate()]),
        ),
        (
            "S(0) -> S(1)",
            lambda: fs.reshard(s0, fs.P(None, "x")),
            raw_all_to_all,
            "all_to_all_single (+layout copy)",
            lambda: d_s0.redistribute(dm, [Shard(1)]),
        ),
        (
            "S(1) -> S(0)",
            lambda: fs.reshard(s1, fs.P("x")),
            raw_all_to_all,
            "all_to_all_single (+layout copy)",
            lambda: d_s1.redistribute(dm, [Shard(0)]),
        ),
        (
            "R -> S(0)",
            lambda: fs.reshard(rep, fs.P("x")),
            raw_slice,
            "local slice (view)",
            lambda: d_rep.redistribute(dm, [Shard(0)]),
        ),
        (
            "P -> R",
            lambda: fs.reshard(part, fs.P()),
            raw_all_reduce,
            "all_reduce",
            lambda: d_part.redistribute(dm, [Replicate()]),
        ),
        (
            "P -> S(0)",
            lambda: fs.reshard(part, fs.P("x")),
            raw_reduce_scatter,
            "reduce_scatter_single",
            lambda: d_part.redistribute(dm, [Shard(0)]),
        ),
    ]


def bench(mib: int, reps: int):
    torch.set_num_threads(1)
    n = dist.get_world_size()
    cases = _cases(n, mib)
    results = {name: {"fshard": [], "raw": [], "dtensor": []} for name, *_ in cases}
    for _name, f, raw, _, dt in cases:  # warm-up (plans, caches, buffers)
        f(), raw(), dt()
    for _ in range(reps):
        for name, f, raw, _, dt in cases:
            calls = 3 if "->" in name else 1
            results[name]["fshard"].append(timed(f, calls)[0])
            results[name]["raw"].append(timed(raw, calls)[0])
            results[name]["dtensor"].append(timed(dt, calls)[0])
    with fs.debug.comm_log() as log:
        ops = {}
        for name, f, *_ in cases:
            del log[:]
            f()
            ops[name] = "+".join(r.op for r in log) or "none"
    return [(name, lowered, ops[name], results[name]) for name, _, _, lowered, _ in cases]


def _ratio(a, b):
    return statistics.median(x / y for x, y in zip(a, b))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    from fshard.launch import run

    rows = run(bench, args.world, (args.mib, args.reps), timeout=1800)[0]
    table = Table(title=f"reshard of a {args.mib} MiB float32 tensor, {args.world} Gloo ranks")
    for col in (
        "transition",
        "fshard issues",
        "fshard ms",
        "raw call",
        "raw ms",
        "DTensor ms",
        "fshard/raw",
        "DTensor/fshard",
    ):
        table.add_column(col)
    for name, lowered, ops, r in rows:
        med = {k: statistics.median(v) * 1e3 for k, v in r.items()}
        table.add_row(
            name,
            ops,
            f"{med['fshard']:.2f}",
            lowered,
            f"{med['raw']:.3f}",
            f"{med['dtensor']:.2f}",
            f"{_ratio(r['fshard'], r['raw']):.2f}x",
            f"{_ratio(r['dtensor'], r['fshard']):.2f}x",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
