"""The benchmarks' shared runner: one rank pool per configuration, interleaved reps, rich tables.

A *section* is a function named ``"module:function"`` (the rank processes import ``module`` by
name, so it must be importable from ``benchmarks/``). Called with ``args`` on every rank it
returns ``(configs, base)``: ``{name: step}`` (zero-argument step functions) and the name of
the baseline configuration. With ``per_config=True`` it is instead called as
``function(name, *args)`` and returns that one configuration's step, so a process holds only
the configuration it times (what peak-memory measurements need).

Every configuration runs in its own pair of rank processes (one :class:`fshard.launch.World`
each), so no configuration's memory sits in the heap of another. Sharing processes made the
comparison a measure of glibc rather than of the libraries: a 33 MB gradient set freed at the
top of the heap is trimmed back to the OS (trim threshold 32 MiB), and whichever configuration
allocates next while another still holds its gradients page-faults 33 MB on every step (~8,000
faults, 10-15 ms here; which rank pays depends on the process's allocation history).

Each rep runs ``steps`` steps of every configuration after a barrier, in an order shuffled per
rep, so none always runs after the same neighbour; a rep's time is the slowest rank's mean step
time. :func:`table` shows the median over reps, the per-rep ratio to the baseline, and the minor
page faults per step of the rank with the most (fresh memory: ~4 KiB each).

Example::

    with Pool("train_step:tp_configs", warmup=3) as pool:
        times = pool.time(reps=7, steps=10)
    Console().print(table("TP step", times, pool.base))
"""

from __future__ import annotations

import importlib
import random
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fshard.launch import World

Times = dict[str, list[tuple[float, float]]]  # config -> [(seconds/step, faults/step) per rep]


def timed(fn: Callable[[], object], steps: int) -> tuple[float, float]:
    """Runs ``fn`` ``steps`` times after a barrier, on every rank of the process group.

    Returns:
      ``(mean seconds per step, minor page faults per step)``, each the slowest rank's.
    """
    dist.barrier()
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(steps):
        fn()
    dt = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    out = torch.tensor([dt / steps, faults / steps], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out[0]), float(out[1])


# -- on the rank processes -------------------------------------------------------------------

_SECTIONS: dict = {}  # section (all configs) -> (configs, base), built once per process
_STEP: dict = {}  # the step this process times, and its RSS high-water mark before building it


def saved_bytes(fn: Callable[[], object], params) -> int:
    """Bytes autograd saves for the backward while ``fn()`` runs (its activation memory):
    every saved tensor's storage counted once, the storages of ``params`` (tensors) not."""
    skip = {t.untyped_storage().data_ptr() for t in params}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes()
        return t.detach()  # detached: a saved output would hold its own node (a cycle)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


def _function(section: str, name: str | None = None) -> Callable:
    """The section's function, or its module's function ``name`` (the module as imported by
    name: a script's own ``__main__`` copy is another module with other globals)."""
    module, fn = section.split(":")
    return getattr(importlib.import_module(module), name or fn)


def _call(section: str, name: str, args: tuple):
    return _function(section, name)(*args)


def _section(section: str, args: tuple) -> tuple[dict, str]:
    key = (section, args)
    if key not in _SECTIONS:
        torch.set_num_threads(1)
        _SECTIONS[key] = _function(section)(*args)
    return _SECTIONS[key]


def _names(section: str, args: tuple) -> tuple[list[str], str]:
    configs, base = _section(section, args)
    return list(configs), base


def _build(section: str, args: tuple, name: str, per_config: bool, warmup: int) -> None:
    torch.set_num_threads(1)
    build = _function(section)  # imported before the RSS mark: the mark excludes imports
    _STEP["rss0"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _STEP["fn"] = build(name, *args) if per_config else _section(section, args)[0][name]
    for _ in range(warmup):
        _STEP["fn"]()


def _time(steps: int) -> tuple[float, float]:
    return timed(_STEP["fn"], steps)


def _peak_rss() -> list[float]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = torch.tensor([peak / 1024, (peak - _STEP["rss0"]) / 1024], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


def step() -> Callable[[], object]:
    """On a rank process of a :class:`Pool`: the step of the configuration it times."""
    return _STEP["fn"]


# -- on the driver ---------------------------------------------------------------------------


class Pool:
    """One 2-rank :class:`World` per configuration of ``section``, each built and warmed up.

    Args:
      section: ``"module:function"``, see the module docstring.
      args: Positional arguments for the section function (picklable, hashable).
      warmup: Steps each configuration runs once built (compilation, plans, buffers).
      names, base: The configurations and the baseline; required with ``per_config=True``,
        otherwise read from the section.
      per_config: Build only the timed configuration in each World (``function(name, *args)``).
    """

    def __init__(
        self,
        section: str,
        args: tuple = (),
        *,
        warmup: int = 3,
        names: list[str] | None = None,
        base: str | None = None,
        per_config: bool = False,
    ):
        if per_config and (names is None or base is None):
            raise ValueError("Pool(per_config=True) needs names= and base=")
        self.section = section
        self.worlds: dict[str, World] = {}
        first = World(2, timeout=3600)
        try:
            if names is None:
                names, base = first.run(_names, section, args)[0]
            self.names, self.base = list(names), base
            self.worlds = {
                k: first if i == 0 else World(2, timeout=3600) for i, k in enumerate(names)
            }
            for k, w in self.worlds.items():
                w.run(_build, section, args, k, per_config, warmup)
        except BaseException:
            self.close()
            first.close()
            raise

    def call(self, name: str, fn: str, *args) -> list:
        """``fn(*args)``, a function of the section's module, on every rank of configuration
        ``name``'s World (it may use :func:`step`); the results in rank order."""
        return self.worlds[name].run(_call, self.section, fn, args)

    def peak_rss(self) -> dict[str, tuple[float, float]]:
        """``{config: (peak RSS MiB, growth MiB)}``: the high-water mark, and its growth over
        the mark before the configuration was built (max over ranks; only the configuration's
        own with ``per_config=True``)."""
        return {k: tuple(w.run(_peak_rss)[0]) for k, w in self.worlds.items()}

    def time(self, reps: int, steps: int) -> Times:
        """``reps`` reps of ``steps`` steps of every configuration, in a shuffled order per rep."""
        times: Times = {k: [] for k in self.names}
        order = list(self.names)
        for rep in range(reps):
            random.Random(rep).shuffle(order)
            for k in order:
                times[k].append(self.worlds[k].run(_time, steps)[0])
        return times

    def close(self) -> None:
        for w in self.worlds.values():
            w.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_section(section: str, reps: int, steps: int, warmup: int = 3) -> tuple[Times, str]:
    """Times every configuration of ``section`` in its own World: ``(times, baseline)``."""
    with Pool(section, warmup=warmup) as pool:
        return pool.time(reps, steps), pool.base


def table(
    title: str,
    runs: Times,
    base: str,
    anchors: dict[str, str] | None = None,
    caption: str | None = None,
    extra: dict[str, dict[str, str]] | None = None,
):
    """A rich table: median/min/max ms per step, the per-rep median ratio to ``base``, page faults.

    Args:
      anchors: ``{config: text}`` for an "anchor" column (published or earlier numbers).
      caption: The target, printed under the table.
      extra: ``{column: {config: text}}``, more columns after the standard ones.
    """
    from rich.table import Table

    t = Table(title=title, caption=caption)
    t.add_column("config")
    for col in ("median ms/step", "min", "max", f"ratio to {base} (per-rep median)"):
        t.add_column(col, justify="right")
    t.add_column("page faults/step", justify="right")
    if anchors:
        t.add_column("anchor", justify="right")
    for col in extra or {}:
        t.add_column(col, justify="right")
    for k, reps in runs.items():
        v = [sec for sec, _ in reps]
        ratios = [sec / b for sec, (b, _) in zip(v, runs[base])]
        row = [
            k,
            f"{statistics.median(v) * 1e3:.2f}",
            f"{min(v) * 1e3:.2f}",
            f"{max(v) * 1e3:.2f}",
            f"{statistics.median(ratios):.3f}x",
            f"{statistics.median(f for _, f in reps):.0f}",
        ]
        if anchors:
            row.append(anchors.get(k, ""))
        row += [col.get(k, "") for col in (extra or {}).values()]
        t.add_row(*row)
    return t


def console(width: int = 120):
    """A rich Console at least ``width`` columns wide (tables are not folded in narrow terminals)."""
    from rich.console import Console

    return Console(width=max(Console().width, width))
