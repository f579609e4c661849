"""Per-op overhead of fshard vs DTensor vs plain torch on 16x16 tensors, 2 ranks.

Run: ``python benchmarks/op_overhead.py`` (self-launches 2 Gloo ranks, 1 thread each). Every
op is timed for the three variants in the same process, interleaved per rep; the table shows
the median over reps of the per-call time and fshard's overhead (fshard - plain) as a fraction
of DTensor's (DTensor - plain). No op here communicates.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs
import fshard.launch

REPS, ITERS = 15, 2000


def _ops(x, y, w, r, s):
    return {
        "add S(0)+S(0)": lambda: y + w,
        "mul S(0) by scalar": lambda: y * s,
        "matmul S(1)@S(0)->P": lambda: torch.matmul(x, w),
        "sum S(0)->P": lambda: y.sum(),
        "torch.softmax S(0), dim -1": lambda: torch.softmax(y, -1),
        "F.softmax S(0), dim -1": lambda: F.softmax(y, dim=-1),
        "F.linear S(0), R": lambda: F.linear(y, r),
    }


def _time(fn) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(ITERS):
        fn()
    return (time.perf_counter() - t0) / ITERS * 1e6


def bench():
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(16, 16, generator=g) for _ in range(3))
    mesh = fs.Mesh.create((2,), ("x",))
    dmesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    s = 0.5
    plain = _ops(a, b, c, a, s)
    # x: column-split (S1), y: row-split (S0), w: row-split (S0): matmul x @ w -> partial.
    fsh = _ops(
        fs.shard(a, mesh, fs.P(None, "x")),
        fs.shard(b, mesh, fs.P("x")),
        fs.shard(c, mesh, fs.P("x")),
        fs.shard(a, mesh, fs.P()),
        s,
    )
    dt = _ops(
        DTensor.from_local(a.chunk(2, 1)[dist.get_rank()], dmesh, [Shard(1)]),
        DTensor.from_local(b.chunk(2, 0)[dist.get_rank()], dmesh, [Shard(0)]),
        DTensor.from_local(c.chunk(2, 0)[dist.get_rank()], dmesh, [Shard(0)]),
        DTensor.from_local(a, dmesh, [Replicate()]),
        s,
    )
    results = {k: {"plain": [], "fshard": [], "dtensor": []} for k in plain}
    for _ in range(REPS):
        for k in plain:
            results[k]["plain"].append(_time(plain[k]))
            results[k]["fshard"].append(_time(fsh[k]))
            results[k]["dtensor"].append(_time(dt[k]))
    return {k: {v: statistics.median(ts) for v, ts in r.items()} for k, r in results.items()}


def main():
    from rich.console import Console
    from rich.table import Table

    res = fshard.launch.run(bench, world_size=2)[0]
    table = Table(title="per-op time, 16x16 float32, 2 ranks x 1 thread (median of reps, µs)")
    for col in ("op", "plain", "fshard", "DTensor", "fshard overhead", "DTensor overhead", "ratio"):
        table.add_column(col, justify="right")
    for op, r in res.items():
        fo, do = r["fshard"] - r["plain"], r["dtensor"] - r["plain"]
        table.add_row(
            op,
            f"{r['plain']:.1f}",
            f"{r['fshard']:.1f}",
            f"{r['dtensor']:.1f}",
            f"{fo:.1f}",
            f"{do:.1f}",
            f"{fo / do:.2f}" if do > 0 else "-",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
