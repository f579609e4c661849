"""Cost of consistency checks (``fs.config.check_consistency``) on 2 local Gloo ranks.

    flock /tmp/fshard-bench.lock python benchmarks/consistency.py [--reps 7]

Three modes, timed side by side in the same rank processes, interleaved per rep (median over
reps; a rep's time is the slowest rank's mean):

* ``off``: no checks (``FSHARD_CHECK_CONSISTENCY=0``);
* ``default``: a running digest per process group, exchanged at a group's first collective
  and every ``fs.config.consistency_interval``-th, at the creation functions, and at the step
  boundaries (``fs.optim.step``, ``fs.gather(dst=)``) at their 1st, 2nd, 4th, ... crossing up
  to ``fs.config.consistency_boundary_interval`` (64), then every 64th;
* ``every``: one digest exchange (an ``all_reduce`` of four int64 words) before every
  collective (the strict mode of the test suite).

Sections: one ``fs.lax.psum`` of 4 KiB, then the training steps of ``benchmarks/``: the TP MLP
of ``train_step.py`` (local and global view), its DP step (``fs.value_and_grad``, local and
global view), and the FSDP step of ``fsdp_step.py`` (``--fsdp-dim``, ``--fsdp-layers``). The
last columns give the collectives and digest exchanges per step in each mode (mean over 8
reps' worth of steps after the warm-up), and the
default's exchanges times the cost of one exchange alone (first row), relative to the step:
the part of the default's cost that is not noise on a busy machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]  # this checkout's fshard; the step benchmarks
import fsdp_step  # noqa: E402
import train_step  # noqa: E402
from _runner import timed  # noqa: E402

import fshard as fs  # noqa: E402
from fshard import consistency  # noqa: E402
from fshard.launch import World  # noqa: E402

MODES = ("off", "default", "every")


def _steps(fsdp_dim: int, fsdp_layers: int) -> dict:
    """{section: (step function, iterations per rep)}; built on every rank."""
    mesh = fs.Mesh.create((2,), ("tp",))
    t = torch.ones(1024)
    g = mesh.group(("tp",))
    tp, _ = train_step.tp_configs()
    dp, _ = train_step.dp_configs()
    return {
        "digest exchange alone": (lambda: consistency._exchange(g, 1, 0, None), 200),
        "fs.lax.psum 4 KiB": (lambda: fs.lax.psum(t, "tp", mesh=mesh), 200),
        "TP step, local view": (tp["fshard local view (pcast/psum)"], 5),
        "TP step, global view": (tp["fshard global view (op rules)"], 5),
        "DP step, local view": (dp["fs.value_and_grad, local view (pcast)"], 5),
        "DP step, global view": (dp["fs.value_and_grad, global view (op rules)"], 5),
        "FSDP step": (fsdp_step.fshard_config(fsdp_dim, fsdp_layers), 2),
    }


def _counts(fn, n: int) -> dict:
    """Collectives and digest exchanges per call of ``fn`` in each mode, over ``n`` calls (the
    step boundaries exchange at their 1st, 2nd, 4th, ... crossing, then every 64th)."""
    calls = []
    real = consistency._exchange

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    out = {}
    consistency._exchange = counted
    try:
        for mode in MODES:
            calls.clear()
            with fs.config.consistency(mode), fs.debug.comm_log() as log:
                for _ in range(n):
                    fn()
            out[mode] = (len(log) / n, len(calls) / n)
    finally:
        consistency._exchange = real
    return out


def bench(reps: int, fsdp_dim: int, fsdp_layers: int) -> dict:
    """Run on every rank: {section: {mode: [ms per rep]}} and the per-step counts."""
    steps = _steps(fsdp_dim, fsdp_layers)
    for fn, _ in steps.values():  # warm up (plans, buffers) in every mode
        for mode in MODES:
            with fs.config.consistency(mode):
                for _ in range(2):
                    fn()
    counts = {s: _counts(fn, 8 * iters) for s, (fn, iters) in steps.items()}
    times: dict = {s: {m: [] for m in MODES} for s in steps}
    for rep in range(reps):
        for s, (fn, iters) in steps.items():
            order = MODES[rep % 3 :] + MODES[: rep % 3]  # no mode always runs first
            for mode in order:
                with fs.config.consistency(mode):
                    times[s][mode].append(timed(fn, iters)[0] * 1e3)
    return {"times": times, "counts": counts, "interval": fs.config.consistency_interval}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--fsdp-dim", type=int, default=512)
    ap.add_argument("--fsdp-layers", type=int, default=6)
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    with World(2, timeout=1800) as world:
        res = world.run(bench, args.reps, args.fsdp_dim, args.fsdp_layers)[0]
    table = Table(
        title=f"Consistency checks, 2 Gloo ranks (median of {args.reps} reps; interval "
        f"{res['interval']})"
    )
    cols = ["step", "off ms", "default ms", "default cost", "every ms", "every cost"]
    cols += ["collectives/step", "exchanges/step (default, every)", "default: exchanges x cost"]
    for c in cols:
        table.add_column(c, justify="left" if c == "step" else "right")
    for s, per in res["times"].items():
        med = {m: statistics.median(v) for m, v in per.items()}
        # the cost is the median of the per-rep ratios (the modes of a rep ran back to back)
        cost = {m: statistics.median(a / b - 1 for a, b in zip(per[m], per["off"])) for m in MODES}
        n = res["counts"][s]
        x = statistics.median(res["times"]["digest exchange alone"]["off"])
        estimate = n["default"][1] * x / med["off"]
        table.add_row(
            s,
            f"{med['off']:.3f}",
            f"{med['default']:.3f}",
            f"{cost['default']:+.1%}",
            f"{med['every']:.3f}",
            f"{cost['every']:+.1%}",
            f"{n['off'][0]:g}",
            f"{n['default'][1]:.3g}, {n['every'][1]:g}",
            f"{estimate:+.2%}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
