"""Context parallelism on local Gloo ranks (CPU): step time and peak memory of causal attention
(forward + backward) against the sequence length, cp=1 vs cp=2.

    python benchmarks/context_parallel.py [--seqs 1024 2048 4096] [--heads 4] [--dim 64] [--reps 5]
        [--configs "sdpa cp=1" "ring cp=2" ...]

Configurations, each in its own fresh rank processes (so one's memory is not in another's
heap), one thread per rank, fp32, batch 1, load-balanced layout:

- ``sdpa cp=1``: dense ``F.scaled_dot_product_attention(is_causal=True)`` on one rank.
- ``ring cp=1``: :func:`fshard.parallel.ring_attention` on a 1-rank mesh (one masked block).
- ``ring cp=2``: ring attention over 2 ranks; the next k/v block's transfer
  (``fs.lax.ppermute_start``) overlaps the current block's compute.
- ``ring cp=2 no overlap``: the same with a synchronous ``fs.lax.ppermute`` in the forward and
  the backward (the overlap's worth).
- ``ulysses cp=2``: :func:`fshard.parallel.ulysses_attention` (all_to_all, dense sdpa on half the
  heads).
- ``torch cp=2``: ``torch.distributed.tensor.experimental.context_parallel`` on the same
  attention; printed with the reason where it does not run (torch 2.13 on CPU: its ring
  dispatches on the CUDA flash / efficient / cudnn kernels, and the CPU flash kernel has no
  sharding rule).

Step time: the median over ``--reps`` of the slowest rank's forward + backward; CPU: the same
step's process CPU time (``time.process_time``, the largest rank; all of a rank's threads, so
less sensitive to other jobs on the machine than the step time). The last lines give the issue's
ratio, ring cp=2 over sdpa cp=1, per sequence length, in step time and in CPU time. Peak memory: the
growth of the process's peak resident set (``ru_maxrss``) from the inputs' creation to the end
of the steps (the warm-up's one-time allocations included: Gloo's pair buffers, ~1 MiB), the
largest rank; and the activations autograd saves for the backward (counted once per storage).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F

import fshard as fs
from fshard import _comm
from fshard.launch import World
from fshard.parallel import context as C


def _inputs(seq: int, heads: int, dim: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, seq, dim, generator=g) for _ in range(3)]


def _step_fn(name: str, seq: int, heads: int, dim: int):
    """``(step, leaves)``: one forward + backward of this rank's attention."""
    q, k, v = _inputs(seq, heads, dim)
    if name == "sdpa cp=1":
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step():
            F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()

        return step, leaves
    if name == "torch cp=2":
        return _torch_cp(q, k, v)
    cp = int(name.split("cp=")[1].split()[0])
    mesh = fs.Mesh.create((cp,), ("cp",))
    attend = C.ulysses_attention if name.startswith("ulysses") else C.ring_attention
    local = [C.load_balance(t, cp).chunk(cp, -2)[mesh.rank].clone() for t in (q, k, v)]
    leaves = [t.requires_grad_() for t in local]

    def step():
        attend(*leaves, "cp", causal=True, mesh=mesh).sum().backward()

    return step, leaves


def _torch_cp(q, k, v):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    bufs = [t.clone() for t in (q, k, v)]

    def step():
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            leaves = [t.detach().requires_grad_() for t in bufs]
            F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()

    return step, []


def rank_fn(name: str, seq: int, heads: int, dim: int, reps: int) -> dict:
    torch.set_num_threads(1)
    if "no overlap" in name:  # the synchronous transfer in place of ppermute_start
        fs.lax.ppermute_start = lambda x, axis, perm, *, mesh=None: _comm.Pending(
            fs.lax.ppermute(x, axis, perm, mesh=mesh)
        )
    try:
        step, leaves = _step_fn(name, seq, heads, dim)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step()  # warm-up (and the error of a configuration that cannot run)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"}
    saved: dict[int, int] = {}
    ptrs = {t.untyped_storage().data_ptr() for t in leaves}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in ptrs:
            saved[s.data_ptr()] = s.nbytes()
        return t.detach()  # detached: a saved output would hold its own node (a cycle)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    for t in leaves:
        t.grad = None
    times, cpu = [], []
    for _ in range(reps):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        for t in leaves:
            t.grad = None
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    return {
        "time": statistics.median(times),
        "cpu": statistics.median(cpu),
        "peak": peak,
        "saved": sum(saved.values()),
    }


CONFIGS = (
    ("sdpa cp=1", 1),
    ("ring cp=1", 1),
    ("ring cp=2", 2),
    ("ring cp=2 no overlap", 2),
    ("ulysses cp=2", 2),
    ("torch cp=2", 2),
)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--configs", nargs="+", default=[n for n, _ in CONFIGS], choices=[n for n, _ in CONFIGS]
    )
    a = ap.parse_args(argv)
    out: dict = {}
    for seq in a.seqs:
        for name, ranks in CONFIGS:
            if name not in a.configs:
                continue
            with World(ranks, timeout=600) as world:
                res = world.run(rank_fn, name, seq, a.heads, a.dim, a.reps)
            err = next((r["error"] for r in res if "error" in r), None)
            out[(name, seq)] = (
                {"error": err}
                if err
                else {k: max(r[k] for r in res) for k in ("time", "cpu", "peak", "saved")}
            )
    print(
        f"causal attention fwd+bwd, batch 1, {a.heads} heads x {a.dim}, fp32, 1 thread/rank, "
        "Gloo (CPU); peak = ru_maxrss growth over the steps, saved = autograd's "
        "activations (largest rank)"
    )
    print(f"{'config':24}{'seq':>7}{'step (s)':>10}{'CPU (s)':>9}{'peak MiB':>10}{'saved MiB':>11}")
    for (name, seq), r in out.items():
        if "error" in r:
            print(f"{name:24}{seq:>7}  not run: {r['error']}")
        else:
            print(
                f"{name:24}{seq:>7}{r['time']:>10.3f}{r['cpu']:>9.3f}{r['peak'] / 2**20:>10.1f}"
                f"{r['saved'] / 2**20:>11.1f}"
            )
    for seq in a.seqs:
        ring, sdpa = out.get(("ring cp=2", seq)), out.get(("sdpa cp=1", seq))
        if ring and sdpa and "error" not in ring and "error" not in sdpa:
            print(
                f"seq {seq}: ring cp=2 / sdpa cp=1 = {ring['time'] / sdpa['time']:.2f}x step time, "
                f"{ring['cpu'] / sdpa['cpu']:.2f}x CPU time (issue 36 item 7: at most 0.6x)"
            )
    return out


if __name__ == "__main__":
    main()
