"""How long a checkpoint save stops the step loop: blocking vs asynchronous (issue 39 item 1).

    python benchmarks/checkpoint_save.py [--reps 3] [--layers 12] [--dim 2048] [--dir /tmp]

A model of ``--layers`` weights ``(2*dim, dim)`` (12 x 2048 x 4096: 100.7M fp32 parameters,
403 MB) sharded over 2 local Gloo ranks (FSDP layout: rows split), plus a step counter.
Per rep, in one run, side by side:

* blocking: ``fs.checkpoint.save(path, state)``: the step loop waits for the whole save (DCP
  write, checksums, commit);
* asynchronous: ``handle = fs.checkpoint.save(path, state, blocking=False)``: the loop is
  blocked only until the call returns (the blocks copied to host memory by DCP's stager, the
  lock taken); then steps run (a matmul on each rank's block and an all_reduce: collectives
  on the default group while the save's run on its own) until ``handle.done()``.

One warm-up save of each kind runs first (imports, the save's process group, DCP's first-call
costs). Times are the slowest rank's. "blocked" is the time the step loop cannot run; "to commit"
the time until the checkpoint is complete on disk; "step x" the mean step time during the
asynchronous write over the step time with no save running (the write competes for the CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import fshard as fs


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench(layers: int, dim: int, reps: int, root: str) -> dict:
    torch.set_num_threads(1)
    mesh = fs.Mesh.create((2,), ("dp",))
    g = torch.Generator().manual_seed(dist.get_rank())
    params = {
        f"layers.{i}.weight": fs.from_local(
            torch.randn(dim, dim, generator=g), mesh, fs.P("dp"), (2 * dim, dim)
        )
        for i in range(layers)
    }
    x = torch.randn(64, dim)

    def step():
        y = x @ params["layers.0.weight"].local.T
        dist.all_reduce(y[:1, :1].clone())

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    base_step = _slowest((time.perf_counter() - t0) / 10)
    warm = os.path.join(root, "warmup")  # imports, the save group, DCP's first-call costs
    fs.checkpoint.save(warm, {"w": params["layers.0.weight"]})
    fs.checkpoint.save(warm, {"w": params["layers.0.weight"]}, blocking=False).wait()
    rows = []
    for rep in range(reps):
        path = os.path.join(root, f"rep{rep}")
        state = {"params": params, "step": rep}
        dist.barrier()
        t0 = time.perf_counter()
        fs.checkpoint.save(path, state)
        blocking = _slowest(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        handle = fs.checkpoint.save(path, state, blocking=False)
        blocked = time.perf_counter() - t0
        steps = 0
        while True:  # every rank steps until every rank's save is done (no rank left alone)
            step()
            steps += 1
            flag = torch.tensor([0 if handle.done() else 1])
            dist.all_reduce(flag)
            if not int(flag):
                break
        handle.wait()
        commit = _slowest(time.perf_counter() - t0)
        rows.append(
            {
                "blocking": blocking,
                "blocked": _slowest(blocked),
                "commit": commit,
                "step_x": (commit - blocked) / max(steps, 1) / base_step,
                "steps": steps,
            }
        )
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fshard-ckpt-bench-", dir=args.dir)
    try:
        out = fs.launch.run(bench, 2, (args.layers, args.dim, args.reps, root), timeout=1800)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = args.layers * 2 * args.dim * args.dim
    print(f"checkpoint save, {n / 1e6:.1f}M fp32 parameters ({n * 4 / 1e6:.0f} MB), 2 ranks")
    print("| rep | blocking save (s) | async: step loop blocked (s) | blocked / blocking | "
          "async: to commit (s) | step time during write (x) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(out["rows"]):
        print(
            f"| {i} | {r['blocking']:.3f} | {r['blocked']:.3f} | "
            f"{100 * r['blocked'] / r['blocking']:.1f}% | {r['commit']:.3f} | {r['step_x']:.2f} |"
        )
    med = {k: statistics.median(r[k] for r in out["rows"]) for k in ("blocking", "blocked")}
    print(
        f"| median | {med['blocking']:.3f} | {med['blocked']:.3f} | "
        f"{100 * med['blocked'] / med['blocking']:.1f}% | | |"
    )


if __name__ == "__main__":
    main()
