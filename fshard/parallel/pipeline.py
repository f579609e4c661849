"""Pipeline parallelism over a ``pp`` mesh axis: GPipe, 1F1B, interleaved 1F1B and ZB-H1.

Shape of the strategy (as :mod:`fshard.parallel.sequence`): a *plan*, :func:`pipeline_schedule`
(the static tick table of a schedule, its bubble fraction and stash counts, next to theory),
and a *call*, :func:`pipeline`, which runs stacked stages over microbatches on the mesh and
returns the mean loss, differentiable with ``fs.value_and_grad`` / ``torch.func.grad``.

Design decisions (issue 22 item 2):

* **Stacked stages.** A stage is ``stage_fn(params, x) -> x`` with the same ``params``
  structure for every stage (MaxText's repeated layers, JAX pipelines' stacked weights): every
  leaf of ``stage_params`` carries the stages on dim 0, split over ``axis`` (``P('pp', ...)``),
  so each rank holds only its own stages, and the other dims keep any dp / tp / fsdp layout.
  What differs per model end runs outside the stages, on the rank of the stage that needs it
  (torchtitan's and torch.distributed.pipelining's split): the first piece is
  ``input_fn(input_params, microbatches)`` on the first stage's rank (the embedding:
  ``microbatches`` are then its data, token ids and positions), run once a step on all the
  microbatches (one call and one backward, after the schedule, with every microbatch's cotangent:
  each call of a piece costs fshard a dispatch per op; one call per microbatch cost the first
  stage of ``benchmarks/composed_step.py``'s FSDP x PP ~12 ms of CPU a step more), the last is
  ``loss_fn(loss_params, y, target)`` on the last stage (final norm, head, loss). Every rank needs
  the stage input's shape before the first stage computes one (the transfer buffers, and the zeros
  a rank that receives nothing passes to the tick's ppermute), so ``activation=`` declares one
  microbatch's (a :class:`fshard.Layout`); ``input_fn``'s output is resharded to it, stacked.
  ``input_params`` and ``loss_params`` are held by their stage's ranks (:func:`on_stage`, a
  :class:`~fshard.spec.HeldLayout`: the embedding by stage 0's, the norm and head by the last
  stage's; empty blocks elsewhere), as ``torch.distributed.pipelining`` holds them: they run
  there in their layout over the other axes, their gradient is computed there and returned in
  the held layout, and nothing about them crosses ``pp`` (no memory or optimizer work on the
  other stages, no all_reduce over ``pp``, which also made the stages wait for each other at the
  step's end). Or replicated over ``pp`` (a param both ends use: an embedding tied to the head):
  then their gradients (zero off their stage) are summed over ``pp`` once a step, in the
  replicated params' one bucket. Without
  ``input_fn``, ``microbatches`` are the stage inputs themselves, computed before the pipeline on
  every ``pp`` rank (that computation, and its backward, then runs on every rank, and the inputs'
  cotangent, the activations' size, is all-reduced over ``pp``). Virtual stages (``virtual=v``):
  stage ``s`` lives on rank ``s % pp`` (Megatron's interleaved assignment), so rank ``r``'s dim-0
  block lists stages ``r, r + pp, ...``: dim 0 of a leaf is ordered *rank-major* (row ``r * v +
  j`` is stage ``j * pp + r``); :func:`stage_order` gives the permutation.
* **The loss is inside the pipeline.** 1F1B-family schedules start a microbatch's backward as
  soon as its loss exists, so the pipeline returns the (mean over microbatches) loss, not the
  outputs.
* **One executor for every schedule.** The schedule's forward runs as one
  ``torch.autograd.Function`` (JAX's ``custom_vjp`` pipelines): its forward walks the tick
  table; at each tick every rank runs its action, then the activations (forward) and
  cotangents (backward) produced that tick move to the neighbouring stage's rank with a
  ppermute over ``axis`` (one per direction and tick, only the pairs that send; ranks that
  receive nothing get an empty block), launched with :func:`fshard.lax.apply_start` and left on
  the wire: a rank waits for what it received at the tick that uses it, and for what it sent
  by the end of the call (``torch.distributed.pipelining``'s schedules wait only for the
  receives they need; on Gloo a send completes when the peer posts its receive, so waiting for
  the whole ppermute at each tick held the sender until its peer had finished that tick),
  inside a ``shard_map`` manual over ``axis`` only (``axis_names={axis}``), so op rules run
  the dp / tp / fsdp collectives of the other axes inside each stage as usual. A stage's
  forward (F) records its autograd graph; its backward (B) is ``torch.autograd.backward`` of it with the cotangent received, in schedule
  order, accumulating the parameter gradients in fresh leaves; ZB-H1 splits B into the input gradient (B) and the
  weight gradient (W) and defers W into the bubbles: B runs the backward to the input alone,
  keeping the cotangents that reach the nodes where the graph branches off to the weights, and
  W runs those nodes for their weight edges and the weight-only graph below them (no node of B
  twice, however often a stage uses one stacked weight; a branch that reaches only vector
  weights, a norm's scale and shift, is not deferred: B computes it in the same kernel, where
  W would cost an engine run and the kernel again). Where a rank's W comes right after
  its B and the B's input gradient stays on the rank (the first stage's, whose W ZB-H1 does
  not defer), the two run as one backward: the split would only add its cost (the retained
  graph, the cut's walk, an engine call per cut node). The Function's
  backward returns those gradients times the incoming cotangent. GPipe runs through the same
  executor (all F, then all B), so every schedule gives the same numbers.
* **Ticks.** One action (F, B or W) per rank and tick; the bubble fraction is a rank's idle
  ticks over all ticks: GPipe and 1F1B ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v*m+p-1)``,
  ZB-H1 ``(p-1)/(3m+p-1)`` (its B and W are one tick each). The stash is the number of
  (stage, microbatch) activations a rank holds (F done, B or W not yet): GPipe ``m``, 1F1B
  ``p - r`` on rank ``r`` (at most ``p``), ZB-H1 ``min(p, m)``, interleaved
  ``min(2(p-1-r) + (v-1)p + 1, v*m)`` chunk activations (each ``1/v`` of a stage).

What composes: ``fs.value_and_grad``, ``torch.func.grad`` / ``vjp`` / ``grad_and_value`` (one
level), eager ``.backward()``, dp and tp layouts on the other mesh axes (tested; an FSDP-style
stage weight split over dp goes through the op rules' gathers, untested), ``fs.remat`` or
``vmap`` inside ``stage_fn``, ``fs.remat`` around the pipelined loss (the schedule runs again
in the backward's recompute, its transfers synchronous there). Values the functions
differentiate come through the pipeline's arguments: one they close over (a differentiated
param, or a value computed from it) is refused, naming the function and the argument to pass
it through, at each stage's first forward of a step (:func:`_foreign`, a walk of the stage's
graph; :class:`_NoOuterLevel` under ``torch.func.grad``): the Function returns gradients for
its inputs only, so its gradient was a silent zero. What does not compose, and why
(``NotImplementedError`` before any communication): higher-order derivatives (grad of grad,
``hessian``) and forward mode (``jvp``, ``jacfwd``): the Function's backward returns gradients
computed in its forward, which an outer derivative would take for constants (a silent zero);
``vmap`` of the pipeline: its forward is per-rank schedules of backward passes and
point-to-point collectives, with no batching rule.

Failures: a stage that raises (``stage_fn``, ``loss_fn`` or ``input_fn``, at any tick) gives
the ``axis`` group up (:func:`fshard._comm.abandon`: its error posted in the c10d store, its Gloo
connections to the group closed) before it re-raises, so the other stages, blocked on it in a
receive, a send or the group's consistency check, raise :class:`fshard.mesh.PeerFailed` naming
its stage, rank, tick and error at once, where they waited for the group's timeout (a
``fs.launch.World``'s ``pg_timeout``). Only the failure path runs any of it.

Data-parallel gradients: once per step (torchtitan's and Megatron's local accumulation, DDP's
``no_sync``). The op rules pcast a dp-replicated weight where it meets dp-split activations,
and that pcast's backward would all-reduce the weight's gradient over dp in every microbatch's
backward. The executor takes those pcasts over with the one gradient reducer,
:class:`fshard.gradsync.GradSync` in ``"step"`` mode (the handler ``fs.value_and_grad`` uses,
overlapped, at top level): a pcast of a stage weight or loss param (or of a view of one, e.g. a
block's slice of the stack) reads a per-step stand-in leaf, whose gradient accumulates the
unreduced cotangents of every microbatch; after the schedule one bucketed all_reduce per group
sums them (the weights of one stage, whatever the microbatch count: ``fs.debug.comm_log`` shows
one all_reduce over dp of the rank's weight bytes where it showed ``m`` per weight use). A
pcast of anything else (a cast or computed value, one under ``fs.remat``) keeps its reduction
in its backward. FSDP in the stages (``fs.nn.fsdp_call`` of a layer, ``parallelize`` with
``dp_shard``): its varying all_gather of a stage weight's row (or of a loss param) reads a
stand-in of the reducer too, whose gradient accumulates the whole param's cotangents over the
microbatches; after the schedule it is reduce-scattered once (packed per bucket), where each
microbatch's backward reduce-scattered each param before (FSDP2's
``set_requires_gradient_sync(False)`` until the last microbatch: the stage's full gradients are
held for the step). The gathered data is kept by the reducer for the step too: each FSDP unit
of a stage is all-gathered once per step, its first use, and every later microbatch's forward
and backward reads it (FSDP2's ``reshard_after_forward=False``, which torchtitan sets under
PP; was one gather per unit and microbatch in the forward and one in the backward: 16 of a
2-layer stage's 17 gathers a 4-microbatch step). A loss that is a pending sum over dp (a
cross entropy summed over the rank's rows) is differentiated as this rank's addend (the sum's
transpose hands the addend the cotangent as it is) and its value summed over dp once a step:
one float64 scalar all_reduce on the last stage, where there was one per microbatch (each a
wait on the dp peers inside the schedule).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import optree
import torch
from torch._C._functorch import TransformType as _TransformType
from torch._C._functorch import get_interpreter_stack as _interpreters
from torch._C._functorch import get_unwrapped as _unwrapped
from torch._C._functorch import is_dead_tensor_wrapper as _is_dead
from torch._C._functorch import is_functorch_wrapped_tensor as _is_wrapped
from torch._C._functorch import is_gradtrackingtensor as _is_grad_tracking
from torch._C._functorch import maybe_get_level as _level_of
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from .. import _comm, _compat, axis_env, config, consistency, lax
from .._function import call, plain, unwrappings
from ..api import _on_mesh_device, shard
from ..array import ShardedArray, is_sharded
from ..collectives import Bound, Ppermute, Psum
from ..executor import reshard_one
from ..gradsync import GradSync
from ..mesh import AxisGroup, Mesh, PeerFailed
from ..nn_plan import match_plan
from ..shard_map import call_signature, shard_map_checked_by_caller
from ..spec import HeldLayout, Layout, P, Parts, PartsLayout, spec_of_dims

__all__ = [
    "Action",
    "PipelineSchedule",
    "on_stage",
    "pipeline",
    "pipeline_schedule",
    "stack_stages",
    "stage_order",
    "unstack_stages",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


class Action(NamedTuple):
    """One tick of one rank: ``kind`` ``'F'`` (forward), ``'B'`` (backward; ZB-H1: input
    gradient only) or ``'W'`` (ZB-H1's weight gradient) of ``stage`` on ``microbatch``.

    Example:
        >>> Action("F", 0, 3)
        Action(kind='F', stage=0, microbatch=3)
    """

    kind: str
    stage: int
    microbatch: int


# -- the plan: schedules as tick tables ------------------------------------------------------


def _rank_orders(name: str, p: int, m: int, v: int) -> list[list[Action]]:
    """Each rank's actions in its execution order (torch.distributed.pipelining's and
    Megatron's orders)."""
    orders = []
    for r in range(p):
        if name == "interleaved":
            total = m * v
            warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)

            def fwd(k, r=r):
                return Action("F", (k // p) % v * p + r, k // (p * v) * p + k % p)

            def bwd(k, r=r):
                return Action("B", (v - 1 - (k // p) % v) * p + r, k // (p * v) * p + k % p)

        else:
            total, warmup = m, (m if name == "gpipe" else min(p - 1 - r, m))

            def fwd(k, r=r):
                return Action("F", r, k)

            def bwd(k, r=r):
                return Action("B", r, k)

        ops = [fwd(k) for k in range(warmup)]
        for i in range(total - warmup):  # steady state: one forward, one backward
            ops += [fwd(warmup + i), bwd(i)]
        ops += [bwd(k) for k in range(total - warmup, total)]
        if name == "zb":  # ZB-H1: rank r defers its weight gradients by r backwards
            split, pending = [], []
            for a in ops:
                split.append(a)
                if a.kind == "B":
                    pending.append(Action("W", a.stage, a.microbatch))
                    if len(pending) > r:
                        split.append(pending.pop(0))
            ops = split + pending
        orders.append(ops)
    return orders


def _simulate(orders: list[list[Action]], stages: int) -> tuple[tuple[Action | None, ...], ...]:
    """The tick table: each rank runs its next action as soon as what it needs arrived (a
    value sent at tick ``t`` is there at ``t + 1``)."""
    p = len(orders)
    done: dict = {}
    pos = [0] * p
    left = sum(map(len, orders))
    never = float("inf")
    table = []
    t = 0
    while left:
        row = []
        for r in range(p):
            a = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            if a is not None:
                s, mb = a.stage, a.microbatch
                if a.kind == "F":
                    ready = s == 0 or done.get(("F", s - 1, mb), never) < t
                elif a.kind == "B":
                    ready = done.get(("F", s, mb), never) < t and (
                        s == stages - 1 or done.get(("B", s + 1, mb), never) < t
                    )
                else:
                    ready = done.get(("B", s, mb), never) < t
                a = a if ready else None
            row.append(a)
        for r, a in enumerate(row):
            if a is not None:
                done[a] = t
                pos[r] += 1
                left -= 1
        table.append(tuple(row))
        t += 1
    return tuple(table)


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule's static plan: ``table[t][r]`` is the :class:`Action` rank ``r`` runs at tick
    ``t`` (``None``: idle), from each rank's order run as early as its inputs arrive.

    Attributes:
        name, pp, microbatches, virtual: what it was built for (``stages = pp * virtual``).
        table: the tick table.

    Example:
        >>> s = pipeline_schedule("1f1b", pp=2, microbatches=3)
        >>> print(s)
        rank 0: F0.0 F0.1 .    B0.0 F0.2 B0.1 .    B0.2
        rank 1: .    F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 .
        >>> s.bubble_fraction, s.theory_bubble, s.peak_stash
        ((0.25, 0.25), 0.25, (2, 1))
    """

    name: str
    pp: int
    microbatches: int
    virtual: int
    table: tuple

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    @property
    def ticks(self) -> int:
        return len(self.table)

    @functools.cached_property
    def bubble_fraction(self) -> tuple[float, ...]:
        """Per rank: idle ticks / ticks."""
        n = self.ticks
        return tuple(sum(row[r] is None for row in self.table) / n for r in range(self.pp))

    @property
    def theory_bubble(self) -> float:
        """The published bubble of the schedule in this tick model: GPipe and 1F1B
        ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v*m+p-1)``, ZB-H1 ``(p-1)/(3m+p-1)``."""
        p, m, v = self.pp, self.microbatches, self.virtual
        work = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb": 3 * m}[self.name]
        return (p - 1) / (work + p - 1)

    @functools.cached_property
    def peak_stash(self) -> tuple[int, ...]:
        """Per rank: the most (stage, microbatch) activations held at once (forward done, its
        backward, or ZB-H1's weight gradient, not yet)."""
        last = "W" if self.name == "zb" else "B"
        peaks = []
        for r in range(self.pp):
            live = peak = 0
            for row in self.table:
                a = row[r]
                live += a is not None and a.kind == "F"
                live -= a is not None and a.kind == last
                peak = max(peak, live)
            peaks.append(peak)
        return tuple(peaks)

    @functools.cached_property
    def transfers(self) -> dict[str, tuple]:
        """Per kind (``'F'``: activations, ``'B'``: cotangents) and tick, what moves after the
        tick: ``(pairs, dests)``, the ``(src, dst)`` rank pairs of its ppermute and ``{dst
        rank: (kind, stage, microbatch)}`` of what each rank receives (with ``pp == 1`` no
        pairs: the next stage is on the same rank)."""
        out: dict[str, list] = {"F": [], "B": []}
        for kind, step in (("F", 1), ("B", -1)):
            for row in self.table:
                pairs, dests = [], {}
                for src, a in enumerate(row):
                    if a is None or a.kind != kind or not 0 <= a.stage + step < self.stages:
                        continue
                    dst = (a.stage + step) % self.pp
                    dests[dst] = (kind, a.stage + step, a.microbatch)
                    if dst != src:
                        pairs.append((src, dst))
                out[kind].append((tuple(pairs), dests))
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def _joined(self) -> tuple[frozenset, ...]:
        """Per rank: the ``(stage, microbatch)`` of ZB-H1's backwards whose W is run with the B,
        as one backward: the rank's next action after the B is that W, and the B's input
        gradient does not leave the rank at its tick (the first stage: nothing to send; on
        ``pp == 1`` every stage). Split, the rank would run the same two halves back to back
        with nothing between, and pay for the split (a retained graph, the cut's walk, an
        engine call per cut node); wall clock is the same, as nobody waits for what W holds."""
        out = []
        for r in range(self.pp):
            done, nxt = set(), None
            for t in reversed(range(self.ticks)):
                a = self.table[t][r]
                if a is None:
                    continue
                if a.kind == "B" and nxt == Action("W", a.stage, a.microbatch):
                    pairs, _ = self.transfers["B"][t]
                    if not any(src == r for src, _ in pairs):
                        done.add((a.stage, a.microbatch))
                nxt = a
            out.append(frozenset(done))
        return tuple(out)

    @functools.cached_property
    def _last_weight_b(self) -> tuple[frozenset, ...]:
        """Per rank: the ``(stage, microbatch)`` of each of its stages' last weight-gradient
        accumulation where that is a B (its weights accumulate with the input's: every
        schedule's but ZB-H1's split ones, whose W accumulates them), not the last stage's
        (its cotangent is its own: nothing to wait for before it)."""
        joined = self._joined if self.name == "zb" else None
        out = []
        for r in range(self.pp):
            last: dict = {}
            for row in self.table:
                a = row[r]
                if a is not None and a.kind in "BW":
                    last[a.stage] = a
            out.append(
                frozenset(
                    (a.stage, a.microbatch)
                    for a in last.values()
                    if a.kind == "B"
                    and a.stage < self.stages - 1
                    and (joined is None or (a.stage, a.microbatch) in joined[r])
                )
            )
        return tuple(out)

    def __str__(self) -> str:
        def cell(a):
            return "." if a is None else f"{a.kind}{a.stage}.{a.microbatch}"

        cells = [[cell(row[r]) for row in self.table] for r in range(self.pp)]
        width = max(len(c) for line in cells for c in line)
        return "\n".join(
            f"rank {r}: " + " ".join(c.ljust(width) for c in line).rstrip()
            for r, line in enumerate(cells)
        )


def _check_schedule(name, pp, microbatches, virtual) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    for what, n in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive int, got {n!r}")
    if name == "interleaved":
        if virtual < 2:
            raise ValueError(
                f"virtual={virtual}: the interleaved schedule needs virtual >= 2 stages per rank"
            )
        if microbatches % pp:
            raise ValueError(
                f"microbatches={microbatches}: the interleaved schedule runs the microbatches "
                f"in rounds of pp={pp}; give a multiple of {pp}"
            )
    elif virtual != 1:
        raise ValueError(
            f"virtual={virtual}: schedule {name!r} has one stage per rank; virtual stages need "
            "schedule='interleaved'"
        )


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int, virtual: int) -> PipelineSchedule:
    orders = _rank_orders(name, pp, microbatches, virtual)
    table = _simulate(orders, pp * virtual)
    return PipelineSchedule(name, pp, microbatches, virtual, table)


def pipeline_schedule(
    schedule: str, pp: int, microbatches: int, virtual: int = 1
) -> PipelineSchedule:
    """The tick table of ``schedule`` on ``pp`` ranks for ``microbatches`` microbatches (cached).

    Args:
        schedule: ``'gpipe'``, ``'1f1b'``, ``'interleaved'`` (``virtual >= 2`` stages per rank,
            ``microbatches`` a multiple of ``pp``) or ``'zb'`` (ZB-H1).
        pp: the pipeline ranks.
        microbatches: ``m``.
        virtual: stages per rank (``'interleaved'`` only).

    Returns:
        A :class:`PipelineSchedule` (table, bubble fraction next to theory, peak stash).

    Example:
        >>> s = pipeline_schedule("gpipe", pp=4, microbatches=8)
        >>> s.ticks, s.bubble_fraction[0], s.theory_bubble, s.peak_stash
        (22, 0.2727272727272727, 0.2727272727272727, (8, 8, 8, 8))
    """
    _check_schedule(schedule, pp, microbatches, virtual)
    return _schedule(schedule, pp, microbatches, virtual)


def stage_order(pp: int, virtual: int = 1) -> list[int]:
    """Which stage each row of a stacked ``stage_params`` leaf holds (rank-major: row
    ``r * virtual + j`` is stage ``j * pp + r``, so ``P('pp')`` gives rank ``r`` its stages
    ``r, r + pp, ...``). Stack per-stage params as ``torch.stack([w[s] for s in order])``.

    Example:
        >>> stage_order(2, virtual=2)
        [0, 2, 1, 3]
    """
    return [j * pp + r for r in range(pp) for j in range(virtual)]


def stack_stages(
    params: Mapping[str, torch.Tensor],
    mesh: Mesh,
    *,
    prefix: str,
    plan: Mapping | None = None,
    axis: str = "pp",
    virtual: int = 1,
) -> dict[str, ShardedArray]:
    """A module's repeated blocks as :func:`pipeline`'s ``stage_params``: the params named
    ``{prefix}.{i}.{name}`` (a ``ModuleList``'s, e.g. ``dict(model.named_parameters())``),
    stacked to ``{name: (stages, blocks per stage, ...)}`` in :func:`stage_order` and sharded
    ``P(axis, None, *spec)``, ``spec`` the layout ``plan`` gives the blocks' param (a
    :func:`fshard.nn.megatron_plan`, for tp); a fused projection's :class:`~fshard.Parts`
    (``Parts(spec, dim, sizes)``, each part split on its own) stays one, shifted past the two
    new dims: ``Parts(P(axis, None, *spec), dim + 2, sizes)``, so each stage's slice keeps the
    per-part split. Other names are ignored. The layout half of the strategy: what
    ``fs.nn.shard_params`` is to a module.

    Args:
        params: full tensors by name (the same on every rank).
        mesh: the mesh, with ``axis``.
        prefix: the blocks' ``ModuleList`` name (``"blocks"``, ``"transformer.h"``).
        plan: ``{glob: P | Parts}`` over ``params``' names (:func:`fshard.nn.match_plan`);
            every block must get the same spec. Default: replicated over the other axes.
        axis, virtual: as in :func:`pipeline` (``pp * virtual`` stages must divide the blocks).

    Returns:
        ``{name: ShardedArray}``, ``name`` relative to a block (``"attn.qkv.weight"``), each
        rank's block in a storage of its own (not a view of the whole stack: a rank holds only
        its own stages).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("pp",))
        >>> named = {f"blocks.{i}.w": torch.full((3,), float(i)) for i in range(4)}
        >>> st = stack_stages(named, mesh, prefix="blocks")
        >>> tuple(st["w"].shape), st["w"].spec, fs.gather(st["w"])[:, :, 0].tolist()
        ((2, 2, 3), P('pp'), [[0.0, 1.0], [2.0, 3.0]])
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"stack_stages: mesh {mesh!r} has no axis {axis!r}")
    lead = f"{prefix}."
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in params.items():
        if key.startswith(lead) and (head := key[len(lead) :].split(".", 1))[0].isdigit():
            layers.setdefault(int(head[0]), {})[head[1]] = t
    n, stages = len(layers), mesh.size(axis) * virtual
    if not n or sorted(layers) != list(range(n)) or n % stages:
        raise ValueError(
            f"stack_stages: params has blocks {sorted(layers)} under prefix={prefix!r}; need "
            f"blocks 0..n-1 with n a multiple of the {stages} stages (pp x virtual)"
        )
    names = list(layers[0])
    if any(list(layers[i]) != names for i in layers):
        raise ValueError(f"stack_stages: the blocks under {prefix!r} hold different params")
    specs = match_plan(list(params), plan or {})
    per = n // stages
    out = {}
    for name in names:
        block = {specs[f"{lead}{i}.{name}"] for i in range(n)}
        if len(block) != 1:
            raise ValueError(f"stack_stages: plan gives the blocks' {name!r} different specs")
        spec = block.pop()
        inner = spec.spec if isinstance(spec, Parts) else spec
        if axis in inner.axes:
            raise ValueError(f"stack_stages: plan splits {name!r} over the pipeline axis {axis!r}")
        full = torch.stack(
            [
                torch.stack([layers[s * per + i][name] for i in range(per)])
                for s in stage_order(mesh.size(axis), virtual)
            ]
        )
        out[name] = shard(full, mesh, _stacked_spec(spec, full.ndim - 2, axis))
    return out


def _stacked_spec(spec: P | Parts, ndim: int, axis: str = "pp") -> P | Parts:
    """The layout :func:`stack_stages` gives a block's param of ``ndim`` dims laid out by
    ``spec``: two leading dims, the stages split over ``axis`` and the blocks of a stage whole,
    then ``spec``'s; a :class:`~fshard.Parts` keeps its parts, its dim moved past the two.

    Example:
        >>> _stacked_spec(P("tp"), 2)
        P('pp', None, 'tp')
        >>> _stacked_spec(Parts(P(None, "tp", None), 1, (4, 4)), 3)
        Parts(P('pp', None, None, 'tp'), dim=3, sizes=(4, 4))
    """
    inner = spec.spec if isinstance(spec, Parts) else spec
    lead = spec_of_dims(((axis,), (), *inner.dims), inner.partial)
    if not isinstance(spec, Parts):
        return lead
    dim = spec.dim + ndim if spec.dim < 0 else spec.dim
    return Parts(lead, dim + 2, spec.sizes)


def on_stage(value, mesh: Mesh, index: int, *, axis: str = "pp") -> ShardedArray:
    """``value`` held by the ranks at coordinate ``index`` of ``axis`` only (a
    :class:`~fshard.spec.HeldLayout`): a pipeline's one-stage params, the embedding on the first
    stage's ranks (``index`` 0, :func:`pipeline`'s ``input_params``) and the final norm and
    head on the last's (``pp - 1``, its ``loss_params``), as ``torch.distributed.pipelining``
    holds them. The other ranks hold an empty block: no memory, no optimizer work, and
    :func:`pipeline` computes the gradient on the holding ranks with no reduction over
    ``axis`` (replicated over ``axis``, such a param's gradient, zero off its stage, was summed
    over ``axis`` every step). ``fs.gather`` gives the whole value on every rank (one
    all_gather over the mesh), as for any layout. A placement, as :func:`fshard.shard`: not
    differentiable itself; a param used by several stages (an embedding tied to the head)
    stays replicated.

    Args:
        value: a ShardedArray on ``mesh`` whose layout does not split ``axis`` (its layout on
            the holding ranks: e.g. FSDP's rows over ``dp_shard``), or a full tensor, the same
            on every rank (replicated there).
        mesh: the pipeline's mesh.
        index: the holding coordinate of ``axis`` (the stage's rank: ``0`` first, ``pp - 1``
            last, whatever ``virtual``).
        axis: the pipeline axis.

    Returns:
        A ShardedArray of layout ``Layout.held(base, axis, index)``, its block ``value``'s own
        on the holding ranks (not copied), empty (0 rows) elsewhere.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("pp",))
        >>> head = on_stage(torch.ones(3, 2), mesh, 1)  # the last stage's
        >>> [lay.shard_sizes for lay in head.shards_metadata()]  # rank 0 holds nothing
        [(0, 2), (3, 2)]
        >>> tuple(fs.gather(head).shape)  # whole on every rank
        (3, 2)
    """
    if not isinstance(mesh, Mesh) or axis not in mesh.axis_names:
        raise ValueError(f"on_stage: mesh must be a fshard.Mesh with axis {axis!r}, got {mesh!r}")
    if isinstance(value, ShardedArray):
        lay = value.layout
        if isinstance(lay, HeldLayout) and (lay.mesh, lay.axis, lay.index) == (mesh, axis, index):
            return value
        if lay.mesh != mesh or not isinstance(lay, Layout):
            raise ValueError(
                f"on_stage: value must be laid out by a P on the pipeline's mesh {mesh!r}, "
                f"got {lay!r}"
            )
    elif isinstance(value, torch.Tensor):
        value = shard(value, mesh, P())
    else:
        raise TypeError(
            f"on_stage: value must be a tensor or ShardedArray, got {type(value).__name__}"
        )
    held = HeldLayout(value.layout, axis, index)
    local = value.local
    if not held.holds(mesh.rank):  # a block of its own: nothing of the value kept alive
        local = torch.empty(held.local_shape(mesh.rank), dtype=local.dtype, device=local.device)
    return ShardedArray._raw(local, held)


def unstack_stages(
    stages: Mapping[str, torch.Tensor], *, prefix: str, pp: int, virtual: int = 1
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`stack_stages` on full tensors (``fs.gather`` them first):
    ``{f"{prefix}.{i}.{name}": block i's tensor}``, e.g. to load the trained stages back into
    the module.

    Example:
        >>> w = torch.arange(4.0).reshape(2, 2, 1)  # 2 stages of 2 blocks
        >>> unstack_stages({"w": w}, prefix="blocks", pp=2)
        {'blocks.0.w': tensor([0.]), 'blocks.1.w': tensor([1.]), 'blocks.2.w': tensor([2.]), 'blocks.3.w': tensor([3.])}
    """
    order = stage_order(pp, virtual)
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in stages.items():  # in the blocks' param order
        per = t.shape[1]
        for row, s in enumerate(order):
            for i in range(per):
                blocks.setdefault(s * per + i, {})[name] = t[row, i]
    return {f"{prefix}.{b}.{n}": v for b in sorted(blocks) for n, v in blocks[b].items()}


# -- the call -------------------------------------------------------------------------------


class _Leaf:
    """A body input's local block and how to rebuild a value from a local tensor."""

    __slots__ = ("local", "layout")

    def __init__(self, value, drop_dim0: bool):
        self.local = value.local if isinstance(value, ShardedArray) else value
        lay = value.layout if isinstance(value, ShardedArray) else None
        if lay is not None and drop_dim0:
            lay = _without_dim0(lay)
        self.layout = lay

    def wrap(self, t: torch.Tensor):
        return t if self.layout is None else ShardedArray._raw(t, self.layout)

    @staticmethod
    def held(x: ShardedArray, auto: Mesh | None) -> _Leaf:
        """A param held by its stage's ranks (a :class:`~fshard.spec.HeldLayout`): its block, in
        the body as its ``base`` layout over the auto axes ``auto`` (``None``: a plain tensor)
        on the holding ranks (the only ones whose pieces read it)."""
        leaf = _Leaf.__new__(_Leaf)
        leaf.local = x.local
        base = x.layout.base
        held = auto is not None and x.layout.holds(auto.rank)
        leaf.layout = Layout(auto, base.spec, base.shape, base.dtype) if held else None
        return leaf


def _without_dim0(lay: Layout | PartsLayout) -> Layout | PartsLayout:
    """``lay`` with dim 0 (whole, as the body sees its stages or microbatches) dropped; a
    :class:`~fshard.spec.PartsLayout` keeps its parts, one dim nearer the front."""
    if isinstance(lay, PartsLayout):
        base = lay.base.spec
        spec = Parts(spec_of_dims(base.dims[1:], base.partial), lay.dim - 1, lay.sizes)
        return Layout.of(lay.mesh, spec, tuple(lay.shape[1:]), lay.dtype)
    spec = spec_of_dims(lay.spec.dims[1:], lay.spec.partial)
    return Layout(lay.mesh, spec, tuple(lay.shape[1:]), lay.dtype)


def _take_held(flat: tuple) -> tuple:
    """A flattened tree, ``(leaves, treedef)``, with its leaves of a
    :class:`~fshard.spec.HeldLayout` replaced by an empty placeholder, and ``{leaf index: the
    held value}``."""
    leaves, treedef = flat
    held = {
        i: x
        for i, x in enumerate(leaves)
        if type(x) is ShardedArray and isinstance(x.layout, HeldLayout)
    }
    if not held:
        return flat, held
    return ([_PLACEHOLDER if i in held else x for i, x in enumerate(leaves)], treedef), held


#: What stands for a held param in the pipeline's shard_map inputs (never read).
_PLACEHOLDER = torch.zeros(0)


class _Act:
    """A stage input's (one microbatch's activation's) local shape, dtype and layout (``None``:
    a plain tensor), what every rank needs before the first stage's rank computes one: the
    receive buffers and the zeros of ranks that receive nothing."""

    __slots__ = ("shape", "dtype", "layout")

    def __init__(self, shape: tuple, dtype: torch.dtype, layout: Layout | None):
        self.shape, self.dtype, self.layout = tuple(shape), dtype, layout

    @staticmethod
    def of_leaf(meta: _Leaf) -> _Act:
        """A ``(M, ...)`` microbatches leaf's activation (dim 0 dropped)."""
        return _Act(meta.local.shape[1:], meta.local.dtype, meta.layout)

    @staticmethod
    def described(template) -> tuple:
        """``activation=`` (a Layout, ShardedArray or tensor) as its global shape, dtype and
        spec (a tensor's: replicated; not its values, which a ``meta`` tensor does not have)."""
        if isinstance(template, ShardedArray):
            template = template.layout
        if isinstance(template, Layout):
            return template.shape, template.dtype, template.spec
        return tuple(template.shape), template.dtype, P()

    @staticmethod
    def of_template(template, auto: Mesh | None) -> _Act:
        """``activation=``'s (a Layout, ShardedArray or tensor) in a body whose auto axes form
        ``auto`` (``None``: none; values are plain local tensors there)."""
        shape, dtype, spec = _Act.described(template)
        if auto is None:
            return _Act(shape, dtype, None)
        lay = Layout(auto, spec, shape, dtype)
        return _Act(lay.local_shape(auto.rank), dtype, lay)

    def stacked(self, m: int) -> _Act:
        """The activations of ``m`` microbatches stacked on a new dim 0 (not split)."""
        lay = self.layout
        if lay is not None:
            spec = P(None, *lay.spec.dims, partial=lay.spec.partial)
            lay = Layout(lay.mesh, spec, (m, *lay.shape), lay.dtype)
        return _Act((m, *self.shape), self.dtype, lay)

    def wrap(self, t: torch.Tensor):
        return t if self.layout is None else ShardedArray._raw(t, self.layout)


def _block(v) -> torch.Tensor:
    return v.local if isinstance(v, ShardedArray) else v


def _leaf_tensor(t: torch.Tensor, need: bool) -> torch.Tensor:
    t = t.detach()
    return t.requires_grad_() if need else t


def _foreign(root: torch.Tensor, ours: set, seen: set) -> list:
    """The leaves requiring grad that ``root``'s autograd graph reaches besides ``ours`` (ids),
    nodes in ``seen`` (grown) not walked again: tensors a stage's code took from outside its
    arguments. Runs at each stage's first forward of a step: its nodes are read in C (the
    edges' nodes by ``map``, a leaf's node by its type), not by a generator and a ``getattr``
    that fails on every other node (~550 Python calls a step of a 2-block GPT pipeline, 100
    nodes a stage)."""
    found, stack = [], [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) is _ACCUMULATE_GRAD:  # a leaf that requires grad
            leaf = node.variable
            if id(leaf) not in ours:
                found.append(leaf)
            continue
        stack += map(_first, node.next_functions)
    return found


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad
_first = operator.itemgetter(0)


def _differentiated_by_caller(found: list, sync: GradSync) -> list:
    """Those of ``found`` whose gradient the caller asked for: under ``fs.value_and_grad`` its
    differentiated leaves and their stand-ins (the reducers on the handler stack but the
    pipeline's own); a tensor it does not differentiate (a module's own parameter, a
    constant that requires grad) is a constant to it, as to ``torch.func.grad``. Without it
    (``.backward()``), every one: each would get a ``.grad`` in plain autograd."""
    outer = [h for h in lax.active_handlers() if isinstance(h, GradSync) and h is not sync]
    if not outer:
        return found
    asked = {id(t) for h in outer for t in (*h.leaves, *h.stand_ins())}
    return [t for t in found if id(t) in asked]


class _NoOuterLevel(torch.overrides.TorchFunctionMode):
    """Under a ``torch.func`` grad level: refuses a tensor of that level (a differentiated
    value or one computed from it: a grad-tracking wrapper, under any wrappers of the block's
    own transforms, e.g. a ``vmap`` inside ``stage_fn``) as an argument of any torch function
    the block calls. The pipeline's Function runs its forward with that level off the
    interpreter stack (alive, not on it), where such a tensor taken from outside the Function's
    inputs (a value ``stage_fn`` closes over) counts as a constant: its gradient would be a
    silent zero.

    Level numbers are reused below the popped level: a grad transform of the block's own
    (``torch.func.vjp`` or ``fs.remat`` inside ``stage_fn``) gets the popped level's number, and
    inside it such a tensor counts as one of its own (its gradient silently lost). So a
    grad-tracking tensor of a level that was not live when the block began must have been made
    inside the block: it, or a tensor it wraps, is one of ``given`` (the block's arguments) or
    was returned by a torch function the block called (recorded here). The same holds for one of
    a level no longer live, unless that level has ended (a dead wrapper, which functorch reads
    as the tensor it wraps: a transform of the block's own that returned, whose ``vjp_fn`` the
    block calls afterwards, or one from outside, a constant). A tensor from outside the block
    that the block's own transform differentiates without an op first
    (``torch.func.vjp(f, closed_over)``) is refused too; ``.detach()`` or passing it in makes it
    the block's."""

    def __init__(self, what: str, given=()):
        super().__init__()
        self.what = what
        self.entry = _live_grad_levels()  # the block's own grad levels are the others
        self.made: set = set()  # ids of what the block was given or a torch function made
        for leaf in optree.tree_leaves(given, is_leaf=is_sharded):
            t = leaf.local if type(leaf) is ShardedArray else leaf
            self._record(t)
            self._record(getattr(t, "rows", ()))  # a _Stacked weight's rows: its w[i]

    def _record(self, out) -> None:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                # an output of the block's own transform: what the transform will hand back
                # unwrapped is the block's too
                self.made.update(map(id, unwrappings(t)))

    def _of_block(self, t: torch.Tensor) -> bool:
        return any(id(u) in self.made for u in unwrappings(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        live = None
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if type(t) is ShardedArray:
                    t = t.local
                while isinstance(t, torch.Tensor) and _is_wrapped(t):
                    # requires_grad: the transform's other inputs are lifted too
                    if _is_grad_tracking(t) and t.requires_grad:
                        live = _live_grad_levels() if live is None else live
                        level = _level_of(t)
                        if level in live:
                            foreign = level not in self.entry and not self._of_block(t)
                        else:
                            foreign = not _is_dead(t) and not self._of_block(t)
                        if foreign:
                            raise _unseen(self.what, tuple(t.shape))
                    t = _unwrapped(t)
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor and not _is_wrapped(out):  # most ops: one add
            self.made.add(id(out))
        else:
            self._record(out)
        return out


def _live_grad_levels() -> set:
    return {ci.level() for ci in _interpreters() or () if ci.key() == _TransformType.Grad}


def _unseen(what: str, shape: tuple) -> ValueError:
    return ValueError(
        f"pipeline: {what} uses a tensor of shape {shape} that is differentiated but is not "
        "one of the pipeline's arguments (a value the function closes over: a differentiated "
        "param, or one computed from it). The pipeline's backward computes gradients for "
        "stage_params, microbatches (without input_fn), input_params and loss_params only, so "
        "this tensor's gradient would be silently lost. Pass it in: stage_fn's through "
        "stage_params (its slice per stage, dim 0 the stages), loss_fn's through loss_params, "
        "input_fn's through input_params; or .detach() it where it is a constant"
    )


class _Stacked(torch.Tensor):
    """A stage's weight leaf, its layers stacked on dim 0, whose integer index (``w[i]``, the
    usual way a stage picks its layer) is a leaf of its own: autograd's select backward would
    write each use's gradient into a zero tensor of the whole stack and add that (a fill and
    an add of the stack per layer, microbatch and weight: 15-20% of a CPU step). Any other use
    accumulates into the stack's ``.grad`` as before; :meth:`fold` adds the rows' in."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(t: torch.Tensor) -> torch.Tensor:
        """``t`` (detached) as a grad-requiring stack whose rows are leaves."""
        stack = torch.Tensor._make_subclass(_Stacked, t.detach(), True)
        # one unbind for the rows' views (leaves: a leaf that requires grad refuses in-place
        # ops, what unbind's views refuse too), not an index and a detach per row
        stack.rows = [row.requires_grad_() for row in t.detach().unbind(0)]
        return stack

    def __getitem__(self, index):
        if type(index) is int:
            try:
                return self.rows[index]  # a row, negative indices as the stack's
            except IndexError:
                pass  # the tensor's error
        return super().__getitem__(index)

    def stack_rows(self) -> None:
        """The rows' gradients so far copied into one stack, each row's ``.grad`` then a view
        of it (autograd's accumulation adds into a view in place): called before the stage's
        last weight accumulation, while its cotangent is awaited, so that the step's end
        returns the stack (:meth:`stacked`) instead of stacking the rows there, on the step's
        critical path. Nothing where a row has no gradient yet or the stack has its own."""
        grads = [r.grad for r in self.rows]
        if self.grad is not None or any(g is None for g in grads):
            return
        stack = torch.stack(grads)
        for r, row in zip(self.rows, stack):
            r.grad = row
        self.rows_in = stack

    def stacked(self) -> torch.Tensor | None:
        """The rows' gradients as one stack, where :meth:`stack_rows` made them its views and
        they still are; else ``None``."""
        stack = getattr(self, "rows_in", None)
        if stack is None:
            return None
        for r, row in zip(self.rows, stack):
            if r.grad is None or r.grad.data_ptr() != row.data_ptr():
                return None
        return stack

    def fold(self) -> None:
        """The rows' gradients into the stack's ``.grad`` (the rows' then cleared)."""
        grads = [r.grad for r in self.rows]
        if all(g is None for g in grads):
            return
        rows = torch.stack(
            [torch.zeros_like(r) if g is None else g for r, g in zip(self.rows, grads)]
        )
        self.grad = rows if self.grad is None else self.grad + rows
        for r in self.rows:
            r.grad = None


class _Run:
    """One pipeline call's static parts; ``__call__`` runs the schedule on the local blocks."""

    def __init__(self, sched, group, fns, defs, metas, act, need, transformed=False):
        self.sched, self.group = sched, group
        self.transformed = transformed  # under a torch.func grad level (_watch)
        self.stage_fn, self.loss_fn, self.input_fn = fns
        self.defs, self.metas, self.need = defs, metas, need  # per input group
        self.act = act  # the stage input's local shape, dtype and layout
        # the loss's: at least float32 (a bf16 pipeline's loss is not rounded to 8 bits)
        self.loss_dtype = torch.promote_types(act.dtype, torch.float32)

    def split(self, tensors: tuple) -> list[tuple]:
        """``tensors`` per input group: stage params, microbatches, input params, loss
        params, targets."""
        out, i = [], 0
        for d in self.defs:
            out.append(tensors[i : i + d.num_leaves])
            i += d.num_leaves
        return out

    def __call__(self, tensors: tuple) -> tuple:
        """The schedule on this rank. Should it raise, no other stage is left waiting for this
        one until the group's timeout (they wait on it for activations and cotangents, in
        point-to-point receives and sends and the consistency checks of ``axis``): the rank
        gives the ``axis`` group up (:func:`fshard._comm.abandon`: the error, named, posted in
        the c10d store, and its connections to the group's ranks closed), so a peer blocked on
        it raises at once; that peer reads the note, raises :class:`fshard.mesh.PeerFailed`
        naming the failed stage and its error, and gives the group up in turn (the stages
        beyond it learn so). Nothing of this runs on a step that does not fail.

        The step's deferred consistency verdict (its plain inputs, launched at the step's start
        by every rank) is taken first: ranks that disagreed raise the same ConsistencyError on
        every rank (its exchange needs the group the failure gives up), whatever this rank's
        own error that followed from it."""
        self.tick = None
        try:
            return self._steps(tensors)
        except BaseException as e:
            consistency.wait_pending()  # a disagreement is the cause: raised from here
            failed = _peer_failed(self.group, e, self._where())
            if failed is not None:
                raise failed from e
            note = self._failure(e)  # this rank's own error
            _comm.abandon(self.group, note)
            e.add_note(f"pipeline: {note}")
            raise

    def _where(self) -> str:
        """Where this rank's schedule is (``self.tick``, set by :meth:`_steps` at each tick)."""
        t = self.tick
        a = None if t is None else self.sched.table[t][self.group.index]
        if t is None:
            return "outside the schedule's ticks (input_fn, or the step's end)"
        if a is None:
            return f"at tick {t} (idle)"
        what = {"F": "forward", "B": "backward", "W": "weight gradient"}[a.kind]
        return f"in the {what} of stage {a.stage}, microbatch {a.microbatch} (tick {t})"

    def _failure(self, e: BaseException) -> str:
        """The note a rank whose own error stopped its schedule posts for its peers."""
        g = self.group
        t = self.tick
        a = None if t is None else self.sched.table[t][g.index]
        who = f"stage {a.stage}" if a is not None else f"pipeline rank {g.index}"
        return (
            f"{who} (rank {g.ranks[g.index]}) raised {type(e).__name__}: {_short(e)} "
            f"{self._where()}"
        )

    def _steps(self, tensors: tuple) -> tuple:
        p_def, x_def, ip_def, lp_def, t_def = self.defs
        params, xs, iparams, lparams, targets = self.split(tensors)
        p_meta, x_meta, ip_meta, lp_meta, t_meta = self.metas
        grad_on = self.need is not None
        need_p, need_x, need_ip, need_lp = self.need if grad_on else (False,) * 4
        x = xs[0] if self.input_fn is None else None  # the stage inputs as given
        first = None  # input_fn's (M, ...) output on the first stage's rank
        sched, r, pp = self.sched, self.group.index, self.sched.pp
        v, m, last = sched.virtual, sched.microbatches, sched.stages - 1
        joined = sched._joined[r] if sched.name == "zb" else None  # ZB-H1's B + W run as one
        # each stage's last weight accumulation where a B, awaiting its cotangent: the stacked
        # weights' rows go into their stacks before it (_Stacked.stack_rows), with v == 1
        last_weight_b = sched._last_weight_b[r] if v == 1 else frozenset()

        # this rank's stages: chunk j is stage j * pp + r
        chunks = []
        for j in range(v):
            leaves = [
                _Stacked.of(t[j])
                if need_p and meta.layout is None and t.dim() > 1
                else meta.wrap(_leaf_tensor(t[j], need_p))
                for meta, t in zip(p_meta, params, strict=True)
            ]
            chunks.append((leaves, optree.tree_unflatten(p_def, leaves)))
        lp_leaves = [meta.wrap(_leaf_tensor(t, need_lp)) for meta, t in zip(lp_meta, lparams)]
        lp_tree = optree.tree_unflatten(lp_def, lp_leaves)
        ip_leaves = [meta.wrap(_leaf_tensor(t, need_ip)) for meta, t in zip(ip_meta, iparams)]
        ip_tree = optree.tree_unflatten(ip_def, ip_leaves)
        act_meta = self.act
        device = _block(params[0]).device
        zero = torch.zeros(act_meta.shape, dtype=act_meta.dtype, device=device)

        inbox: dict = {}  # ("F" | "B", stage, mb) -> local tensor, or its transfer pending
        ahead: dict = {}  # ("F" | "B", tick) -> this rank's receive of it, posted ahead
        sending: list = []  # this rank's transfers whose sends may be in flight
        saved: dict = {}  # (stage, mb) -> (input leaf, output) or ZB-H1's weight-grad groups
        total = torch.zeros((), dtype=torch.float64, device=device)
        pending: dict = {}  # the last stage's pending-sum losses: axes -> (group, local sum)

        own = [_block(lf) for c in chunks for lf in c[0]] if need_p else []
        own += [_block(lf) for lf in lp_leaves] if need_lp else []
        own += [_block(lf) for lf in ip_leaves] if need_ip else []
        own = [t for t in own if t.requires_grad]
        sync = GradSync(own, mode="step")  # the dp reduction, once per step

        listed: dict = {}  # stage -> (stand-ins made when read, weights(stage))
        checked: set = set()  # the stages whose first forward of the step was checked

        def made_here(*leaves) -> set:
            """The ids of ``leaves`` (this step's) and of every stand-in the reducer has made:
            what a graph of the step may reach (:meth:`_check_seen`)."""
            return {*map(id, leaves), *map(id, sync.stand_ins())}

        def weights(s: int) -> list:
            """The leaves whose gradients stage ``s`` accumulates (in their ``.grad``): its
            weights and their pcasts' stand-ins. Read once per stage while no stand-in is
            added (the reducer only adds them: its stand-ins so far fix the list), not at
            each backward (~40 us each)."""
            made = len(sync.entries) + len(sync.gathers)
            got = listed.get(s)
            if got is None or got[0] != made:
                ws = [_block(lf) for lf in chunks[s // pp][0]] if need_p else []
                ws += [r for w in ws if isinstance(w, _Stacked) for r in w.rows]
                ws += [_block(lf) for lf in lp_leaves] if s == last and need_lp else []
                got = listed[s] = (made, ws + sync.stand_ins(ws))
            return got[1]

        with lax.handling(*((sync,) if grad_on else ())):
            posting = ahead_ok = lax.computable_ahead()  # else the transfers run synchronously
            if self.input_fn is not None and r == 0:  # the first stage's piece, once a step
                data = [mt.wrap(t) for mt, t in zip(x_meta, xs)]
                with torch.set_grad_enabled(grad_on):
                    given = (ip_tree, optree.tree_unflatten(x_def, data))
                    with self._watch(grad_on, "input_fn", given):
                        out = self.input_fn(*given)
                    first = _as_layout(out, act_meta.stacked(m), "input_fn")
                if grad_on:  # input_params differentiated or not: a closed-over value
                    ours = made_here(*(_block(lf) for lf in ip_leaves))
                    self._check_seen(first, ours, set(), "input_fn", sync)
                # each microbatch's stage input a leaf, as given inputs are: their cotangents
                # gather in x_grad, and input_fn's backward runs once, after the schedule, from
                # its output's gradient edge. Each row is a copy: the output is not kept, so a
                # microbatch's input is freed with its backward, not at the end of the step
                # (torch.distributed.pipelining's first stage holds only the microbatches in
                # flight)
                need_x = need_ip and first.requires_grad
                x = [row.clone() for row in first.detach()]
                edge = first if first.grad_fn is None else _gradient_edge(first)
                first = edge if need_x else None
            # every microbatch's stage input's cotangent (need_x): made by the first stage's
            # first backward while its cotangent is on its way, not here, where the first
            # stage's start is the whole pipeline's
            x_grad = None
            x_zeros = functools.partial(
                torch.zeros, (m, *act_meta.shape), dtype=act_meta.dtype, device=device
            )
            for t, row in enumerate(sched.table):
                a = row[r]
                self.tick = t  # where a failure names (the one cost of that here)
                if posting:
                    posting = self._receive_ahead(t, zero, grad_on, ahead)
                sent_f = sent_b = None
                if a is not None and a.kind == "F":
                    s, mb = a.stage, a.microbatch
                    if s == 0:
                        src = x[mb]
                        if isinstance(x, list):  # input_fn's row: held by its leaf from now
                            x[mb] = None
                    else:
                        src = _received(inbox.pop(("F", s, mb)))
                    inp = _leaf_tensor(src, grad_on and (s > 0 or need_x))
                    # each stage's first forward of the step: what its code takes from outside
                    # its arguments is checked (_unseen)
                    check = grad_on and s not in checked
                    with torch.set_grad_enabled(grad_on):
                        # an alias: the activation is an intermediate of the step, not a leaf
                        # (a pending-sum activation gets the invariant cotangent, no Claim)
                        act = act_meta.wrap(inp.view_as(inp) if inp.requires_grad else inp)
                        given = (chunks[s // pp][1], act)
                        with self._watch(check, f"stage_fn (stage {s})", given):
                            out = self.stage_fn(*given)
                        out = _as_layout(out, act_meta, "stage_fn")
                        if check:
                            checked.add(s)
                            seen: set = set()  # the stage's nodes, not walked again for the loss
                            ours = made_here(inp, *weights(s))
                            self._check_seen(out, ours, seen, f"stage_fn (stage {s})", sync)
                        if s == last:
                            target = optree.tree_unflatten(
                                t_def, [mt.wrap(tt[mb]) for mt, tt in zip(t_meta, targets)]
                            )
                            given = (lp_tree, act_meta.wrap(out), target)
                            with self._watch(check, "loss_fn", given):
                                loss, over = _scalar(self.loss_fn(*given))
                            if check:  # with the stand-ins loss_fn's pcasts made
                                ours = made_here(inp, *weights(s))
                                self._check_seen(loss, ours, seen, "loss_fn", sync)
                            loss = loss / m
                            if over is None:
                                total = total + loss.detach().double()
                            else:  # this rank's addend: summed over ``over`` once, below
                                held = pending.get(over.axes, (over, 0.0))[1]
                                pending[over.axes] = (over, held + loss.detach().double())
                            out = loss
                        else:
                            sent_f = out.detach()
                    if grad_on:
                        saved[(s, mb)] = (inp, out)
                elif a is not None and a.kind == "B" and grad_on:
                    s, mb = a.stage, a.microbatch
                    inp, out = saved.pop((s, mb))
                    if (s, mb) in last_weight_b and not sync.entries and not sync.gathers:
                        for lf in chunks[s // pp][0]:
                            if isinstance(lf, _Stacked):
                                lf.stack_rows()
                    if s == 0 and need_x and x_grad is None:
                        x_grad = x_zeros()
                    ct = torch.ones_like(out) if s == last else _received(inbox.pop(("B", s, mb)))
                    ins = [inp] if inp.requires_grad else []
                    if joined is not None and (s, mb) not in joined:  # ZB-H1: the weights' at W
                        saved[(s, mb)] = _split_backward(out, ct, ins, weights(s))
                    else:  # none on a first stage where only loss_params are differentiated
                        inputs = ins + weights(s)
                        # an output of nothing differentiated (a first stage passing its plain
                        # input on): every gradient of this microbatch here is 0
                        if inputs and out.requires_grad:
                            torch.autograd.backward(out, ct, inputs=inputs)
                    if ins:  # no .grad where the output does not depend on it: 0
                        if s > 0:
                            sent_b = inp.grad  # None: zeros go out
                        elif inp.grad is not None:
                            x_grad[mb] = inp.grad
                elif a is not None and grad_on and (a.stage, a.microbatch) not in joined:  # W
                    saved.pop((a.stage, a.microbatch))()
                self._exchange(t, "F", sent_f, zero, inbox, sending, ahead)
                if grad_on:
                    self._exchange(t, "B", sent_b, zero, inbox, sending, ahead)
                while sending and sending[0].sent():  # completed sends let go, oldest first
                    del sending[0]  # (nothing waits here)
            self.tick = None
            if need_x and x_grad is None:  # no first stage here: its zeros
                x_grad = x_zeros()
            if first is not None and need_x:  # input_fn's backward, with every cotangent
                ws = [_block(lf) for lf in ip_leaves]
                torch.autograd.backward(first, x_grad, inputs=ws + sync.stand_ins(ws))
            for p in sending:  # by the step's end, everything this rank sent is through
                p.wait()
        # on the wire while the gradients are gathered below; launched only now, once this
        # rank's schedule is through, it is also where a rank learns that a peer's failed
        summed = self._sum_loss(total, pending, ahead, over_stages=ahead_ok)
        # A stacked stage weight whose rows alone got gradients, with nothing of the reducer's
        # to add (no dp stand-in, no FSDP gather): its gradient is its rows' stacked once, the
        # stack :meth:`_Stacked.stack_rows` made before the stage's last backward or one made
        # here, while the loss's sum is on the wire (the last stage waits for it)
        rowwise = set()
        if need_p and not sync.entries and not sync.gathers:
            for i in range(len(params)):
                lfs = [chunks[j][0][i] for j in range(v)]
                if all(
                    isinstance(lf, _Stacked)
                    and lf.grad is None
                    and all(row.grad is not None for row in lf.rows)
                    for lf in lfs
                ):
                    rowwise.add(i)
        for c in chunks:
            for i, lf in enumerate(c[0]):
                if isinstance(lf, _Stacked) and i not in rowwise:
                    lf.fold()
        if grad_on:  # once per step, whatever the microbatch count
            for t, g in zip(own, sync.finish([t.grad for t in own])):
                t.grad = g
        sync.close()

        self.summed = ahead_ok  # else pipeline's body sums over the stages
        if not grad_on:
            return (summed(),)
        grads = []
        if need_p:
            for i, t in enumerate(params):
                if i in rowwise:
                    stacked = chunks[0][0][i].stacked() if v == 1 else None
                    if stacked is None:
                        rows = [r.grad for j in range(v) for r in chunks[j][0][i].rows]
                        stacked = torch.stack(rows)
                    grads.append(stacked.view(t.shape))
                    continue
                per = [_block(chunks[j][0][i]).grad for j in range(v)]
                if v == 1 and per[0] is not None:  # a view: the stack's rows were copied once
                    grads.append(per[0].unsqueeze(0))
                    continue
                grads.append(torch.stack([torch.zeros_like(t[0]) if g is None else g for g in per]))
        grads += [x_grad] if need_x and self.input_fn is None else []
        if need_ip:
            for t, lf in zip(iparams, ip_leaves):
                g = _block(lf).grad
                grads.append(torch.zeros_like(t) if g is None else g)
        if need_lp:
            for t, lf in zip(lparams, lp_leaves):
                g = _block(lf).grad
                grads.append(torch.zeros_like(t) if g is None else g)
        return (summed(), *grads)

    def _watch(self, check: bool, what: str, given: tuple):
        """Under a ``torch.func`` grad level, the block in :class:`_NoOuterLevel` (where
        ``check``): a tensor of that level that ``what`` takes from outside its arguments
        (``given``) would be a constant to the Function's forward."""
        if check and self.transformed:
            return _NoOuterLevel(what, given)
        return contextlib.nullcontext()

    def _check_seen(self, root, ours: set, seen: set, what: str, sync: GradSync) -> None:
        """Raise where ``root``'s graph (a stage's output, the loss, input_fn's output) reaches
        a leaf that requires grad besides ``ours`` (ids of the leaves the pipeline made: the
        stage input, its weights, their stand-ins) whose gradient the caller asked for
        (:func:`_differentiated_by_caller`): the Function's backward returns gradients for
        its inputs only, so that leaf's would be silently lost. Plain autograd only: under a
        ``torch.func`` level such a tensor is not in the graph (:meth:`_watch`)."""
        if self.transformed or not isinstance(root, torch.Tensor) or root.grad_fn is None:
            return
        found = _foreign(root, ours, seen)
        if found:
            found = _differentiated_by_caller(found, sync)
        if found:
            raise _unseen(what, tuple(found[0].shape))

    def _sum_loss(
        self, total: torch.Tensor, pending: dict, ahead: dict, over_stages: bool = True
    ) -> Callable[[], torch.Tensor]:
        """The step's loss, launched: a call that takes it. The last stage's sum over the
        microbatches (``total``, this rank's float64 sum; each of ``pending``'s addends summed
        over its axes first, once a step), in :attr:`loss_dtype`, then summed over the stages
        (``over_stages``; zero on the other stages' ranks): every rank sends its part to every
        other, one cyclic shift (a ppermute) at a time, and adds the parts in stage order (the
        same sum, bit for bit, on every rank). The receives were posted as the schedule's last
        tick began (in ``ahead``, :meth:`_receive_ahead`), where they can be.

        Point to point, not an all_reduce: a rank whose schedule ends early (the last stage's,
        in 1F1B ~a backward before the first stage's) sends its part then, into the receive
        its peer posted, so the rank that ends last finds every part arrived and waits for no
        round trip; an all_reduce's round trip there, its peer's worker thread woken, took
        0.01-3.8 ms on 2 Gloo ranks, as did a receive posted only at the end, which Gloo
        answers with the data only then (docs/measurements.md). Launched when the rank's
        schedule is through, not when the loss is whole (the last stage's last forward): every
        rank receives every other's part, so this is the step's last agreement over the
        stages, where a stage whose own schedule needed nothing more from a failed one learns
        of the failure (``PeerFailed``) instead of at the step's next collective. ``_steps``
        takes it after the stage gradients are gathered. Where the ops run synchronously,
        without the sum over the stages (``pipeline``'s body sums)."""
        for g, addend in pending.values():  # one all_reduce a step, not one per microbatch
            total = total + lax.apply(Bound(Psum(g.axes), g), addend)
        loss = total.to(self.loss_dtype)
        if not over_stages:
            return lambda: loss
        g = self.group
        pp, r = g.size, g.index
        with config.consistency(False):  # as the transfers (_exchange)
            shifts = [
                lax.apply_start(
                    Bound(_shift_op(g.axes, pp, k), g), loss, ahead.pop(("loss", k), None)
                )
                for k in range(1, pp)
            ]

        def take() -> torch.Tensor:
            parts = {r: loss}
            for k, shift in enumerate(shifts, 1):  # shift k brings the part of rank r - k
                parts[(r - k) % pp] = shift.wait()
            summed = parts[0]
            for s in range(1, pp):
                summed = summed + parts[s]
            return summed

        return take

    def _receive_ahead(self, t: int, zero: torch.Tensor, grad_on: bool, ahead: dict) -> bool:
        """Tick ``t``'s receives of this rank posted now, as the tick begins, before this rank's
        own action of the tick (:func:`fshard._comm.receive_ahead`): ``ahead[(kind, t)]``,
        handed to the tick's ppermute (:meth:`_exchange`), which then only sends. What the
        peer sends at the tick's end lands while this rank computes its action; posted by the
        ppermute itself, the receive waited for this rank to finish its action first, and the
        data moved only then (Gloo delivers into a posted buffer): GPipe's second stage took
        every activation late, 1F1B's first stage its cotangents (docs/measurements.md). Posted
        in the order the ticks issue their ppermutes (F before B within a tick), as the peers
        send; the transfers carry their own wire tag (:data:`fshard._comm.AHEAD_TAG`), so no
        other message over the group lands in them. False where receives cannot be posted
        ahead (the transfers then receive at their tick): another backend than Gloo or a CUDA
        activation (:func:`fshard._comm.receive_ahead`)."""
        g, r = self.group, self.group.index
        for kind in ("F", "B") if grad_on else ("F",):
            pairs, dests = self.sched.transfers[kind][t]
            if not pairs or r not in dests:
                continue
            # what a receiving rank gets is a whole activation (_transfer_op's out_shapes)
            posted = _comm.receive_ahead(zero, g, pairs, zero.shape)
            if posted is None:  # the group's backend or the device: none can be
                return False
            ahead[(kind, t)] = posted
        if t == len(self.sched.table) - 1:  # the loss's parts (_sum_loss), sent after them
            part = zero.new_zeros((), dtype=self.loss_dtype)
            for k in range(1, g.size):
                ahead[("loss", k)] = _comm.receive_ahead(
                    part, g, _shift_op(g.axes, g.size, k).perm, ()
                )
        return True

    def _exchange(self, t: int, kind: str, sent, zero, inbox, sending: list, ahead: dict) -> None:
        """The ppermute of tick ``t``'s activations (``F``) or cotangents (``B``): every rank
        knows from the table who sends, so all issue the same collective (or none). It is put
        on the wire and left there: what this rank receives goes into ``inbox`` pending, waited
        for where it is used; what it sends joins ``sending`` (the step waits for it at its
        end, letting completed sends go each tick), as ``torch.distributed.pipelining``'s
        schedules wait only for the receives they need. Waiting for the whole ppermute here
        made each tick a barrier: a rank that sent waited for its peer to finish the tick."""
        pairs, dests = self.sched.transfers[kind][t]
        r = self.group.index
        if not pairs:
            if r in dests:  # pp == 1: the next stage is on this rank
                inbox[dests[r]] = sent
            return
        g = self.group
        sends = any(src == r for src, _ in pairs)
        buf = (sent if sent is not None else zero) if sends else None
        if buf is None:  # a scalar activation: every rank passes one; else an empty block
            buf = zero if zero.dim() == 0 else zero[:0]
        op = _transfer_op(g.axes, pairs, tuple(zero.shape), g.size)
        # checked with the step's inputs, once (_shard_plain's program): not folded one by one
        with config.consistency(False):
            pending = lax.apply_start(Bound(op, g), buf.contiguous(), ahead.pop((kind, t), None))
        if r in dests:
            inbox[dests[r]] = pending
        if sends:
            sending.append(pending)


@functools.lru_cache(maxsize=256)
def _transfer_op(axes: tuple, pairs: tuple, shape: tuple, size: int) -> Ppermute:
    """One tick's ppermute of activations of local ``shape`` over ``size`` ranks (static per
    tick: cached). What a rank that sends nothing passes, and what one that receives nothing
    gets (ppermute's zeros), are empty blocks: were a zero-filled activation each a tick. A
    scalar activation: every rank passes and gets one."""
    if not shape:
        return Ppermute(axes, pairs, tag=_comm.AHEAD_TAG)
    none = (0, *shape[1:])
    srcs, dsts = {s for s, _ in pairs}, {d for _, d in pairs}
    ins = tuple(shape if j in srcs else none for j in range(size))
    outs = tuple(shape if j in dsts else none for j in range(size))
    return Ppermute(axes, pairs, ins, outs, _comm.AHEAD_TAG)


@functools.lru_cache(maxsize=64)
def _shift_op(axes: tuple, size: int, k: int) -> Ppermute:
    """The ppermute that hands each of ``size`` ranks' scalar to the rank ``k`` after it
    (cyclically): :meth:`_Run._sum_loss`'s ``k``-th, its receives posted ahead as the
    transfers' (their tag; posted after theirs, sent after theirs)."""
    return Ppermute(axes, tuple((i, (i + k) % size) for i in range(size)), tag=_comm.AHEAD_TAG)


def _peer_failed(g: AxisGroup, e: BaseException, where: str) -> PeerFailed | None:
    """The error to raise where ``e`` (a collective's, over ``g`` or not) follows a peer's
    failure (:func:`fshard._comm.peer_failure`: a stage raised and gave ``g`` up), this rank
    having given ``g`` up in turn; ``None`` where ``e`` is this rank's own. Only the wire's
    errors (Gloo's plain ``RuntimeError`` s, torch's ``DistError`` s) can follow one: any
    other, a ``ConsistencyError`` every rank raises too, is the rank's own."""
    wire = type(e) is RuntimeError or isinstance(e, torch.distributed.DistError)
    if not wire or isinstance(e, PeerFailed):
        return None
    note = _comm.peer_failure(g)
    if note is None:
        return None
    _comm.abandon(g, note)
    return PeerFailed(
        f"pipeline: {note}; pipeline rank {g.index} (rank {g.ranks[g.index]}) stopped {where} "
        f"({type(e).__name__}: {_short(e)})"
    )


def _short(e: BaseException, limit: int = 400) -> str:
    """``e``'s message, its first ``limit`` characters."""
    text = str(e).strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def _received(v) -> torch.Tensor:
    """An inbox entry's tensor: a transfer's, once it has arrived (or a local hand-over)."""
    return v if isinstance(v, torch.Tensor) else v.result()


_gradient_edge = torch.autograd.graph.get_gradient_edge

#: A custom autograd.Function's backward node.
_FUNCTION_NODE = torch.autograd.function.BackwardCFunction

#: :func:`_weight_cut`'s stack marker: the node below it has had everything below it walked.
_BELOW_DONE = object()


def _weight_cut(root, source, targets: dict) -> tuple[dict, list] | None:
    """Where the backward graph from ``root`` leaves the input gradient's part: ``({node:
    [(next node, input nr), ...]}, early)``, the nodes on a path to ``source`` (the input's
    gradient accumulator) and those of their next edges that lead to a node in ``targets``
    (the weights' accumulators, ``{node: whether its weight is a matrix}``) but not to
    ``source`` (read now: torch 2.11 refuses a custom Function node's ``next_functions`` once
    the backward has run). Everything below such an edge is weight-only. A node whose weight
    edges reach only vector weights (a norm's scale and shift, a bias alone) is not cut: its
    gradient is a reduction its B computes in the same kernel (layer norm) or from the
    cotangent it holds anyway, and deferring it would cost W an engine run and the kernel
    again; ``early`` lists those weights' accumulators, for B (unless a cut branch reaches one
    too: then every branch is cut, as before). ``None`` where ``root`` does not reach
    ``source``, or (:data:`fshard._compat.GRAD_FROM_FUNCTION_NODES`) where a custom
    Function's node would be cut on a torch that cannot start a backward there: W is then the
    whole backward."""
    order, stack, edges = [], [root], {}
    push, pop = stack.append, stack.pop
    while stack:  # post-order: a node after everything below it
        node = pop()
        if node is _BELOW_DONE:
            order.append(pop())
            continue
        if node in edges:
            continue
        nexts = edges[node] = node.next_functions
        push(node)
        push(_BELOW_DONE)
        stack += [n for n, _ in nexts if n is not None and n not in edges]
    # per node: 1 if it reaches source, 2 a target, 4 a matrix target (ints: ~2x the speed of
    # any() over lists)
    reach = {}
    for node in order:
        f = 1 if node is source else 0
        if node in targets:
            f |= 6 if targets[node] else 2
        for n, _ in edges[node]:
            if n is not None:
                f |= reach[n]
        reach[node] = f
    if not reach[root] & 1:
        return None
    cut, kept = {}, {}
    for node in order:
        if reach[node] & 1:
            below = [(n, nr) for n, nr in edges[node] if n is not None and reach[n] & 3 == 2]
            if below:
                (cut if any(reach[n] & 4 for n, _ in below) else kept)[node] = below
    early = []
    if kept:
        deferred = _targets_below(cut, edges, targets)
        early = _targets_below(kept, edges, targets)
        if not early.isdisjoint(deferred):  # a weight reached from both halves: all in W
            cut = {node: edges_ for node in order if (edges_ := cut.get(node, kept.get(node)))}
            early = set()
    for node in cut:
        if not _compat.GRAD_FROM_FUNCTION_NODES and isinstance(node, _FUNCTION_NODE):
            return None
    return cut, list(early)


def _targets_below(branches: dict, edges: dict, targets: dict) -> set:
    """The nodes of ``targets`` in the weight-only graphs below ``branches``' edges."""
    found, seen = set(), set()
    stack = [n for below in branches.values() for n, _ in below]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in targets:
            found.add(node)
        stack += [n for n, _ in edges[node] if n is not None]
    return found


def _split_backward(out, ct, ins: list, weights: list) -> Callable[[], None]:
    """ZB-H1's B: the input gradient (into ``ins[0].grad``) now; returns W, which adds the
    weights' gradients (into their ``.grad``). B runs the backward to the input only, keeping
    the cotangents that arrive at the nodes where the graph branches off to the weights
    (:func:`_weight_cut`); W runs each such node for its weight edges alone, then the
    weight-only graph below from those edges: the weight gradients' work, none of B's again
    (a stage indexing one stacked leaf per layer reaches the same weight from every layer, so
    torch.distributed.pipelining's split, which groups by shared weights, reran the stage's
    whole backward in W). Without an input gradient wanted, W is the whole backward."""
    weights = [w for w in weights if w.requires_grad]
    if not out.requires_grad:  # an output of nothing differentiated: no gradient here
        return lambda: None
    edge = torch.autograd.graph.get_gradient_edge
    found = None
    if ins and out.grad_fn is not None:
        accs = {edge(w).node: w for w in weights}
        targets = {node: w.dim() >= 2 for node, w in accs.items()}
        found = _weight_cut(out.grad_fn, edge(ins[0]).node, targets)
    if found is None:  # B to the input, then W the whole backward again (the graph kept)
        if ins:
            torch.autograd.backward(out, ct, inputs=ins, retain_graph=True)
        return lambda: torch.autograd.backward(out, ct, inputs=weights) if weights else None
    cut, early = found
    held: dict = {}

    def hold(node, grads):
        held[node] = grads

    hooks = [node.register_prehook(functools.partial(hold, node)) for node in cut]
    try:  # the vector weights whose branches are not cut get their gradients now
        torch.autograd.backward(
            out, ct, inputs=ins + [accs[n] for n in early], retain_graph=bool(cut)
        )
    finally:
        for h in hooks:
            h.remove()

    def weight_pass():
        GradientEdge = torch.autograd.graph.GradientEdge
        seeds: dict = {}
        for node, edges in cut.items():
            roots = [
                (GradientEdge(node, i), g)
                for i, g in enumerate(held.pop(node, ()))
                if g is not None
            ]
            if not roots:
                continue
            below = [GradientEdge(*e) for e in edges]
            grads = torch.autograd.grad(
                [e for e, _ in roots], below, [g for _, g in roots], allow_unused=True
            )
            for e, g in zip(below, grads):
                if g is not None:
                    key = (e.node, e.output_nr)
                    seeds[key] = g if key not in seeds else seeds[key] + g
        if seeds:
            torch.autograd.backward(
                [GradientEdge(*k) for k in seeds], list(seeds.values()), inputs=weights
            )

    return weight_pass


def _as_layout(out, act: _Act, what: str) -> torch.Tensor:
    """A stage's (or ``input_fn``'s) output as a local tensor in the activation's layout
    (resharded over the auto axes if the op rules left it in another, e.g. partial after a
    row-parallel layer)."""
    shape = act.layout.shape if act.layout is not None else act.shape
    whose = "its input's" if what == "stage_fn" else "the activation's (activation=)"
    if isinstance(out, ShardedArray):
        if act.layout is None or (out.layout.shape, out.dtype) != (shape, act.dtype):
            raise ValueError(
                f"{what} must return {whose} shape and dtype {shape} {act.dtype}, got "
                f"{tuple(out.shape)} {out.dtype}{_autocast_hint(out, act.dtype)}"
            )
        return reshard_one(out, act.layout.spec).local
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what} must return a tensor or ShardedArray, got {type(out).__name__}")
    if tuple(out.shape) != act.shape or out.dtype != act.dtype:
        raise ValueError(
            f"{what} must return {whose} shape and dtype {act.shape} {act.dtype}, got "
            f"{tuple(out.shape)} {out.dtype}{_autocast_hint(out, act.dtype)}"
        )
    return out


def _autocast_hint(out: torch.Tensor, want: torch.dtype) -> str:
    """Where ``torch.autocast`` made the output's dtype: what to do instead (every transfer
    buffer has the activation's one dtype)."""
    device = out.device.type
    if out.dtype == want or not torch.is_autocast_enabled(device):
        return ""
    if out.dtype != torch.get_autocast_dtype(device):
        return ""
    return (
        f" (torch.autocast is on and computed it in {out.dtype}: give the pipeline "
        f"{out.dtype} activations, return out.to({want}) from the stage, or use fshard's "
        "mixed precision, fs.nn.MixedPrecisionPolicy, instead of autocast)"
    )


def _scalar(loss) -> tuple[torch.Tensor, AxisGroup | None]:
    """``loss_fn``'s value as a local scalar, and the group it is a pending sum over (``None``:
    none). A loss that is a pending sum (a cross entropy summed over a batch split over dp) is
    not summed per microbatch: its backward is the same without the sum (the sum's transpose
    hands each rank's addend the cotangent as it is), so only the value is summed, once a
    step (one all_reduce over dp on the last stage where there were ``m``)."""
    over = None
    if isinstance(loss, ShardedArray):
        spec = loss.spec
        if spec.partial and not any(spec.dims) and loss.numel() == 1:
            over, loss = loss.layout.mesh.group(spec.partial), loss.local
        else:
            loss = reshard_one(loss, P()).local
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn must return a scalar (tensor or one-element ShardedArray)")
    return loss.reshape(()), over


class _Pipeline(torch.autograd.Function):
    """Forward: the whole schedule (``run``), returning the loss and, when differentiated, the
    gradients its backward actions accumulated; backward: those times the loss cotangent."""

    @staticmethod
    def forward(run, *tensors):
        return run(tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        run = inputs[0]
        grads = output[1:]
        ctx.mark_non_differentiable(*grads)
        ctx.save_for_backward(*grads)
        # the gradients are outputs no one differentiates: no zero cotangents made for them
        # (one memset of every stage gradient a step)
        ctx.set_materialize_grads(False)
        need = (*run.need, False) if run.need is not None else (False,) * 5
        ctx.slots = [has for d, has in zip(run.defs, need) for _ in range(d.num_leaves)]
        # the differentiated inputs a plain autograd graph holds (under any torch.func level):
        # a second derivative through their gradients can reach them (_differentiable_once)
        held = [plain(t) for t, has in zip(inputs[1:], ctx.slots) if has]
        ctx.held = held if any(t.requires_grad for t in held) else None

    @staticmethod
    def backward(ctx, g, *_):
        if g is None:  # grads are not materialised: no cotangent reached the loss
            return (None,) * (1 + len(ctx.slots))
        saved = ctx.saved_tensors
        if ctx.held is not None and torch.is_grad_enabled():  # create_graph: differentiable
            saved = _differentiable_once(saved, ctx.held)
        saved = iter(saved)
        one = _is_one(g)  # a cotangent of exactly 1: the gradient itself, not a copy
        out = [(next(saved) if one else g * next(saved)) if has else None for has in ctx.slots]
        return (None, *out)


class _Once(torch.autograd.Function):
    """A gradient of the pipeline's (``grad``) under ``create_graph``, as it is (a view), with
    an edge to the input it is the gradient of (``wrt``, in a plain autograd graph): a second
    derivative that reaches it raises instead of reading it as a constant
    (:func:`_differentiable_once`)."""

    @staticmethod
    def forward(grad, wrt):
        return grad.view_as(grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, _):
        raise NotImplementedError(
            "pipeline: a second derivative reached the pipeline's gradients (a gradient of a "
            "gradient, a gradient penalty, fs.value_and_grad of fs.value_and_grad): the "
            "pipelined loss is differentiable once in reverse mode, its backward hands back "
            "gradients its forward computed, which depend on the params in a way autograd does "
            "not see. Differentiate the stages without the pipeline for higher derivatives"
        )


def _differentiable_once(saved: tuple, held: list) -> list:
    """The gradients the forward computed (``saved``), each joined to its input in the plain
    autograd graph (``held``) by :class:`_Once`: the backward runs under ``create_graph``
    (``.backward(create_graph=True)``, ``torch.func.grad``) while a plain graph holds the
    inputs, and what it hands back depends on the params through these, which autograd does not
    see, so a second derivative would read them as constants: a silent zero
    (``fs.value_and_grad`` of ``fs.value_and_grad``'s gradient gave 0 where dense gives 29.9).
    torch's ``once_differentiable`` guards only where a cotangent requires grad, which the
    loss's ``1`` does not, and its guard hangs off a leaf of its own, which a second derivative
    asked for the params' gradients never reaches. Made on the plain tensors with the
    interpreter stack cleared: a ``torch.func`` transform then lifts each as a constant of its
    level, and the plain graph below it, where a derivative around the transform runs, meets
    the guard. The gradients require grad then, as dense ones under ``create_graph`` do."""
    levels = temporarily_clear_interpreter_stack() if _interpreters() else contextlib.nullcontext()
    with levels:
        return [_Once.apply(plain(g).detach(), wrt) for g, wrt in zip(saved, held, strict=True)]


def _is_one(g: torch.Tensor) -> bool:
    """Whether the loss cotangent is exactly 1 (``fs.value_and_grad``'s, ``.backward()``'s): a
    product with it is the other factor. Read only where that costs no device sync nor meets
    a transform's wrapper (a CPU tensor torch.func does not wrap)."""
    return (
        type(g) is torch.Tensor
        and g.device.type == "cpu"
        and g.numel() == 1
        and not torch._C._functorch.is_functorch_wrapped_tensor(g)
        and bool(g == 1)
    )


def _flat_inputs(trees: tuple) -> tuple:
    """Each of ``trees`` (:data:`_INPUTS`) as ``(leaves, treedef)``, flattened once a call: every
    check and step below reads these (each tree was flattened ~4 times a step)."""
    flat = tuple(optree.tree_flatten(t, is_leaf=is_sharded) for t in trees)
    for what, (leaves, _) in zip(_INPUTS, flat):
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, (torch.Tensor, ShardedArray)):
                raise TypeError(
                    f"pipeline: {what} leaf {i} is a {type(leaf).__name__}; give tensors or "
                    "ShardedArrays"
                )
    return flat


@functools.lru_cache(maxsize=1024)
def _stage_layout_problem(lay: Layout | PartsLayout, axis: str) -> str | None:
    """What is wrong with the layout of a stage_params leaf, dim 0 the stages (a step's are the
    last step's: cached), or ``None``."""
    # a fused projection's per-part split (fs.Parts, stack_stages') keeps its parts in each
    # stage's slice: the stages on dim 0 over the axis, the parts past it
    parts = isinstance(lay, PartsLayout)
    spec = lay.base.spec if parts else None if lay.is_explicit else lay.spec
    dims = spec.padded(len(lay.shape)) if spec is not None else None
    if (
        spec is None
        or dims[0] != (axis,)
        or any(axis in d for d in dims[1:])
        or spec.partial
        or (parts and lay.dim == 0)
    ):
        return (
            f"has layout {lay.spec or lay}; dim 0 (the stages) must be split over {axis!r} "
            f"alone (P({axis!r}, ...), or a fs.Parts whose parts dim is not dim 0), the other "
            f"dims not over {axis!r}, and no pending sum"
        )
    return None


def _check_inputs(flat: tuple, mesh, axis, stages, inputs) -> int:
    """The inputs' layouts and shapes checked (``flat``: :func:`_flat_inputs`); the number of
    microbatches."""
    (p_leaves, _), (x_leaves, _), (ip_leaves, _), (lp_leaves, _), (t_leaves, _) = flat
    if not p_leaves:
        raise ValueError("pipeline: stage_params has no tensors")
    pp = mesh.size(axis)
    for i, leaf in enumerate(p_leaves):
        shape, problem = leaf.shape, None
        if not shape or shape[0] != stages:
            problem = (
                f"has shape {tuple(shape)}; its dim 0 must hold the {stages} stages (pp={pp} x "
                f"virtual), got {shape[0] if shape else 'no dim 0'}"
            )
        elif type(leaf) is ShardedArray:  # the same layouts every step: checked once each
            problem = _stage_layout_problem(leaf.layout, axis)
        if problem is not None:
            raise ValueError(f"pipeline: stage_params leaf {i} {problem}")
    if (len(x_leaves) != 1 and not inputs) or not x_leaves or x_leaves[0].ndim < 1:
        raise ValueError(
            "pipeline: microbatches must be one tensor / ShardedArray of shape (M, ...)"
            + (" (or, with input_fn, a pytree of them)" if not inputs else " per leaf")
        )
    m = x_leaves[0].shape[0]
    for what, leaves in (("microbatches", x_leaves), ("targets", t_leaves)):
        for i, leaf in enumerate(leaves):
            if leaf.ndim < 1 or leaf.shape[0] != m:
                raise ValueError(
                    f"pipeline: {what} leaf {i} has shape {tuple(leaf.shape)}; dim 0 must be "
                    f"the {m} microbatches"
                )
            if isinstance(leaf, ShardedArray) and (
                leaf.spec.padded(1)[0] or axis in leaf.spec.axes
            ):
                raise ValueError(
                    f"pipeline: {what} leaf {i} has layout {leaf.spec}; dim 0 (the "
                    f"microbatches) must not be split, and nothing over {axis!r}"
                )
    for what, leaves, who, index in (
        ("loss_params", lp_leaves, "the last stage uses it", pp - 1),
        ("input_params", ip_leaves, "the first stage uses it", 0),
    ):
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, ShardedArray):
                continue
            lay = leaf.layout
            if isinstance(lay, HeldLayout):
                if (lay.mesh, lay.axis, lay.index) != (mesh, axis, index):
                    raise ValueError(
                        f"pipeline: {what} leaf {i} is held by {lay.axis!r} coordinate "
                        f"{lay.index} of {lay.mesh!r}; {who}: hold it on {axis!r} coordinate "
                        f"{index} of the pipeline's mesh (fs.parallel.on_stage), or replicate it"
                    )
            elif (
                lay.is_explicit
                or axis in (lay.base if isinstance(lay, PartsLayout) else lay).spec.axes
            ):
                raise ValueError(
                    f"pipeline: {what} leaf {i} has layout {lay.spec if lay.spec else lay}; it "
                    f"must be replicated over {axis!r} or held by the stage's ranks "
                    f"(fs.parallel.on_stage(x, mesh, {index}), {who})"
                )
    return m


_INPUTS = ("stage_params", "microbatches", "input_params", "loss_params", "targets")


def _shard_plain(flat: tuple, specs: tuple, mesh: Mesh, program: tuple) -> tuple:
    """The input trees (``flat``: each ``(leaves, treedef)``, :func:`_flat_inputs`) with their
    plain tensors sharded to their group's spec, after one consistency
    check that every rank passes the same inputs: the plain tensors' layout and values, the
    shard_map call's signature (what shard_map's call would check in an exchange of its own)
    and ``program``, the pipeline's own arguments that, with the inputs' shapes, decide every
    transfer of the step (:func:`_program`): the transfers are not folded one by one
    (:meth:`_Run._exchange`).
    shard_map would shard each plain tensor itself, each with a check of its own: one
    all_reduce per tensor (every step, a batch's token ids, targets and each plain embedding or
    head weight; 7 of a GPT step's 8), and one more for the call. The check is deferred: its
    verdict is taken before the step's first collective (the first stage's input_fn and first
    forward overlap the exchange, which waited 0.7-3 ms at the step's start on 2 Gloo ranks, by load);
    the caller takes it at the latest when it leaves (``consistency.wait_pending``)."""
    plain: dict = {}
    held = False
    for what, (leaves, _), spec in zip(_INPUTS, flat, specs):
        for i, leaf in enumerate(leaves):
            if leaf is _PLACEHOLDER:  # a held param's stand-in: no values, its place in the
                held = True  # call's signature below; replicated as it is (no shard, no hash)
            elif not isinstance(leaf, ShardedArray):
                plain[(what, i)] = (leaf, spec)
    trees = tuple(optree.tree_unflatten(treedef, leaves) for leaves, treedef in flat)
    if consistency.enabled():
        # the layouts are static (hashed once per distinct value), the values not
        fields = {
            f"{what} leaf {i}": {"spec, global shape, dtype": consistency.Static(
                                     (spec, tuple(t.shape), t.dtype)),
                                 "values": t}
            for (what, i), (t, spec) in plain.items()
        }  # fmt: skip
        fields["shard_map"] = call_signature(trees, specs, P())
        fields["schedule, virtual, axis, activation, differentiated"] = consistency.Static(program)
        consistency.check_equal(
            fields,
            mesh,
            what="fs.parallel.pipeline's tensors (every rank must pass the same)",
            defer=True,
        )
    if not plain and not held:
        return trees
    stand_in = ShardedArray._raw(  # what shard() of it gave: it, on the mesh's device
        _on_mesh_device(_PLACEHOLDER, mesh), _replicated(mesh, (0,), _PLACEHOLDER.dtype)
    )
    out = []
    with config.consistency(False):  # checked above, all at once
        for what, (leaves, treedef) in zip(_INPUTS, flat):
            leaves = [
                _sharded(leaf, mesh, plain[(what, i)][1])
                if (what, i) in plain
                else stand_in
                if leaf is _PLACEHOLDER
                else leaf
                for i, leaf in enumerate(leaves)
            ]
            out.append(optree.tree_unflatten(treedef, leaves))
    return tuple(out)


def _sharded(t: torch.Tensor, mesh: Mesh, spec: P) -> ShardedArray:
    """``shard(t, mesh, spec)`` (checked by the caller): a replicated value on the mesh's device
    is ``t`` itself in its layout (what ``shard`` returns for it, without its checks and
    reshard plan: a step's batch, targets and plain head weights, every step)."""
    if spec.dims or spec.partial or t.device != mesh.device() or type(t) is not torch.Tensor:
        return shard(t, mesh, spec)
    if t.layout is not torch.strided:  # shard's error
        return shard(t, mesh, spec)
    return ShardedArray._raw(t, _replicated(mesh, tuple(t.shape), t.dtype))


@functools.lru_cache(maxsize=256)
def _replicated(mesh: Mesh, shape: tuple, dtype: torch.dtype) -> Layout:
    return Layout(mesh, P(), shape, dtype)


def _program(schedule: str, virtual: int, axis: str, activation, differentiated: bool) -> tuple:
    """The pipeline's arguments that, with its inputs' global shapes and dtypes, decide the
    step's transfers (who sends what to whom, at which tick, in which shape and dtype):
    ``activation=`` as the stage input it makes (:meth:`_Act.described`); ``differentiated``:
    whether the step runs its backward actions (and sends cotangents)."""
    act = None if activation is None else _Act.described(activation)
    return (schedule, virtual, axis, act, differentiated)


def _check_activation(activation, mesh: Mesh, axis: str) -> None:
    if isinstance(activation, ShardedArray):
        activation = activation.layout
    if isinstance(activation, Layout):
        if activation.mesh != mesh or axis in activation.spec.axes:
            raise ValueError(
                f"pipeline: activation {activation!r} must be a Layout on the pipeline's mesh "
                f"and not split or pending over {axis!r}"
            )
    elif not isinstance(activation, torch.Tensor):
        raise TypeError(
            "pipeline: with input_fn, activation= must describe one microbatch's stage input: a "
            "fs.Layout (global shape, dtype, spec on the mesh), a ShardedArray or a tensor (a "
            f"meta tensor will do), got {type(activation).__name__}"
        )


def _needs_grad(leaves: list) -> bool:
    """Whether any of ``leaves`` (tensors and ShardedArrays) is differentiated (requires grad,
    grad mode on)."""
    if not torch.is_grad_enabled():
        return False
    for t in leaves:  # noqa: SIM110 (a loop: no generator frame per leaf)
        if (t.local if type(t) is ShardedArray else t).requires_grad:
            return True
    return False


def _refuse_transforms() -> bool:
    """The Function's backward returns gradients its forward computed: correct for one reverse
    pass, constants (a silent zero) to a second one, and it has no jvp or vmap rule. Whether a
    ``torch.func`` grad level (the one allowed) is active."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    kinds = [ci.key() for ci in stack]
    grads = sum(k == _TransformType.Grad for k in kinds)
    other = [k.name for k in kinds if k not in (_TransformType.Grad, _TransformType.Functionalize)]
    if grads > 1 or other:
        what = "nested torch.func.grad / vjp (higher derivatives)" if grads > 1 else other[0]
        raise NotImplementedError(
            f"pipeline under {what}: the pipelined loss is differentiable once in reverse mode "
            "(fs.value_and_grad, torch.func.grad / vjp, .backward()); its backward hands back "
            "gradients its forward computed in schedule order, so higher derivatives, forward "
            "mode (jvp, jacfwd, hessian) and vmap are not available. vmap inside stage_fn "
            "instead, or differentiate the stages without the pipeline"
        )
    return grads == 1


def pipeline(
    stage_fn: Callable,
    stage_params,
    microbatches,
    mesh: Mesh,
    *,
    loss_fn: Callable,
    loss_params=None,
    targets=None,
    input_fn: Callable | None = None,
    input_params=None,
    activation=None,
    axis: str = "pp",
    schedule: str = "gpipe",
    virtual: int = 1,
):
    """The mean over microbatches of ``loss_fn(loss_params, stage_S-1(...stage_0(x_m)), t_m)``,
    run as a pipeline over mesh axis ``axis`` with ``schedule``; with ``input_fn``, ``x_m`` is
    ``input_fn(input_params, microbatches)[m]``, computed by the first stage's rank.

    Args:
        stage_fn: ``(params, x) -> y``, one stage; ``params`` one stage's slice of
            ``stage_params`` (dim 0 dropped), ``x`` one microbatch; ``y`` has ``x``'s shape
            (the op rules' collectives over the other mesh axes run inside as usual).
        stage_params: a pytree whose leaves hold the ``pp * virtual`` stages on dim 0 (in
            :func:`stage_order`), ShardedArrays split over ``axis`` on dim 0 (``P('pp',
            ...)``; other dims may be split over other axes, per part too: a fused
            projection's :class:`~fshard.Parts` with its parts past dim 0, as
            :func:`stack_stages` gives it, which ``stage_fn`` sees in its slice) or full
            tensors (split here).
        microbatches: ``(M, ...)``, microbatch ``m`` is ``microbatches[m]``; replicated over
            ``axis``; dim 0 not split (other dims may be, e.g. the batch over ``dp``). Without
            ``input_fn`` the stage inputs themselves (e.g. an embedding's output, computed on
            every pipeline rank); with it, a pytree of such ``(M, ...)`` values (e.g. token
            ids and positions), not differentiated, ``input_fn``'s data.
        mesh: a real mesh with ``axis``.
        loss_fn: ``(loss_params, y, target) -> scalar`` on the last stage's output.
        loss_params: a pytree used by ``loss_fn`` (e.g. the final norm and the head), each
            leaf held by the last stage's ranks (:func:`on_stage` with ``pp - 1``: no
            reduction over ``axis``) or replicated over ``axis`` (its gradient summed over it).
        targets: a pytree of ``(M, ...)`` values; ``target`` is its ``[m]`` slice.
        input_fn: ``(input_params, microbatches) -> x``, the first piece (e.g. the
            embedding), run by the first stage's rank only, once a step on every microbatch
            (``(M, ...)`` in, ``(M, ...)`` out, ``x[m]`` microbatch ``m``'s stage input; its
            backward runs once, after the schedule); the counterpart of ``loss_fn``. Its
            output is resharded to ``activation``'s layout (with dim 0 not split).
        input_params: a pytree used by ``input_fn``, each leaf held by the first stage's ranks
            (:func:`on_stage` with ``0``) or replicated over ``axis``; its gradient is computed
            on the first stage's ranks (a replicated leaf's summed over ``axis``, as
            ``loss_params``').
        activation: with ``input_fn``, one microbatch's stage input, which every rank needs
            before the first stage computes one (the transfer buffers): a :class:`fshard.Layout`
            on ``mesh`` (global shape, dtype, spec, not over ``axis``), a ShardedArray of that
            layout or a tensor of that shape and dtype (a ``meta`` tensor will do).
        axis: the pipeline axis.
        schedule: ``'gpipe'``, ``'1f1b'``, ``'interleaved'`` (with ``virtual >= 2``, ``M`` a
            multiple of the axis size) or ``'zb'`` (ZB-H1). See :func:`pipeline_schedule`.
        virtual: stages per rank (``'interleaved'``).

    Returns:
        The loss, a scalar ShardedArray replicated over ``mesh``, in the activation's
        dtype promoted to at least ``float32``. Differentiating it
        (``fs.value_and_grad``, ``torch.func.grad`` of ``fs.gather(loss)``) gives
        ``stage_params``, ``microbatches`` (without ``input_fn``), ``input_params`` and
        ``loss_params`` their dense gradients with their layouts. Higher-order and
        forward-mode derivatives and ``vmap`` are refused (see the module docstring).

    Raises:
        ValueError: naming the argument, before any communication: an unknown ``schedule``,
            ``virtual`` not fitting it, ``M`` not a multiple of the axis size
            (interleaved), a ``stage_params`` leaf whose dim 0 is not the ``pp * virtual``
            stages split over ``axis``, inputs split over ``axis`` or on the microbatch dim,
            ``input_fn`` without ``activation`` or with differentiated ``microbatches``.
        ConsistencyError: with checks on (the default), on every rank, before a transfer goes
            out, where ranks pass different plain inputs, layouts, ``schedule``, ``virtual``,
            ``axis`` or ``activation``, or some differentiate the step and others do not.
        ValueError: at a stage's first forward of the step, where ``stage_fn``, ``loss_fn``
            or ``input_fn`` uses a differentiated value that is not one of the pipeline's
            arguments (one it closes over), naming the argument to pass it through: its
            gradient would be lost (the other stages raise PeerFailed naming that error).
        NotImplementedError: under ``vmap``, ``jvp`` or nested grad transforms, at the call;
            and where a second derivative reaches the gradients (a gradient penalty,
            ``fs.value_and_grad`` of ``fs.value_and_grad``'s gradient), in that backward.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("pp",))
        >>> w = torch.tensor([[2.0], [3.0]])  # stage 0 multiplies by 2, stage 1 by 3
        >>> x = torch.arange(4.0).reshape(4, 1)  # 4 microbatches of one value
        >>> def loss(_, y, target):
        ...     return (y * target).sum()
        >>> run = lambda w: fs.gather(fs.parallel.pipeline(lambda w, x: w * x, w, x, mesh,
        ...     loss_fn=loss, targets=torch.ones(4, 1), schedule="1f1b"))
        >>> float(run(w))  # mean over microbatches of 6 * x
        9.0
        >>> torch.func.grad(run)(w).flatten()  # d/dw0 = w1 * mean(x), d/dw1 = w0 * mean(x)
        tensor([4.5000, 3.0000])
        >>> scale = torch.tensor([10.0])  # the first piece, on stage 0's rank only
        >>> run2 = lambda w, e: fs.gather(fs.parallel.pipeline(lambda w, x: w * x, w, x, mesh,
        ...     loss_fn=loss, targets=torch.ones(4, 1), schedule="1f1b",
        ...     input_fn=lambda e, mb: e * mb, input_params=e, activation=torch.empty(1)))
        >>> float(run2(w, scale)), torch.func.grad(run2, argnums=1)(w, scale)
        (90.0, tensor([9.]))
    """
    if not callable(stage_fn):
        raise TypeError(f"pipeline: stage_fn must be callable, got {type(stage_fn).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"pipeline: loss_fn must be callable, got {type(loss_fn).__name__}")
    if input_fn is not None and not callable(input_fn):
        raise TypeError(f"pipeline: input_fn must be callable, got {type(input_fn).__name__}")
    if input_fn is None and (input_params is not None or activation is not None):
        raise ValueError("pipeline: input_params and activation go with input_fn")
    if not isinstance(mesh, Mesh) or axis not in mesh.axis_names:
        raise ValueError(f"pipeline: mesh must be a fshard.Mesh with axis {axis!r}, got {mesh!r}")
    if input_fn is not None:
        _check_activation(activation, mesh, axis)
    transformed = _refuse_transforms()
    pp = mesh.size(axis)
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"pipeline: virtual must be a positive int, got {virtual!r}")
    flat = _flat_inputs((stage_params, microbatches, input_params, loss_params, targets))
    m = _check_inputs(flat, mesh, axis, pp * virtual, input_fn is not None)
    try:
        sched = pipeline_schedule(schedule, pp, m, virtual)
    except ValueError as e:
        raise ValueError(f"pipeline: {e}") from None
    # which gradients the backward actions compute (None: a forward-only schedule); under
    # torch.func.grad the differentiated inputs' wrappers require grad, closed-over ones not
    need = tuple(_needs_grad(leaves) for leaves, _ in flat[:4])
    if input_fn is not None and need[1]:
        raise ValueError(
            "pipeline: with input_fn the microbatches are its data and get no gradient; pass "
            "what is differentiated as input_params"
        )
    need = need if any(need) else None
    # the params held by their stage's ranks (fs.parallel.on_stage) do not cross the shard_map
    # (its in_specs are P layouts): a placeholder takes their place, the body reads them here
    ip_flat, ip_held = _take_held(flat[2])
    lp_flat, lp_held = _take_held(flat[3])
    flat = (flat[0], flat[1], ip_flat, lp_flat, flat[4])

    def body(params, xs, iparams, lparams, tgts):
        g = axis_env.current_mesh().group((axis,))
        tracker = axis_env.tracker()
        trees = (params, xs, iparams, lparams, tgts)
        flat = [optree.tree_flatten(t, is_leaf=is_sharded) for t in trees]
        # dim 0: the stages or the microbatches (dropped; input_fn's data keeps it)
        drop = (True, input_fn is None, False, False, True)
        metas = tuple([_Leaf(v, d) for v in lv] for (lv, _), d in zip(flat, drop))
        defs = tuple(td for _, td in flat)
        p0 = flat[0][0][0]
        auto = p0.layout.mesh if isinstance(p0, ShardedArray) else None  # the body's auto axes
        for group, held in ((2, ip_held), (3, lp_held)):
            for i, x in held.items():
                metas[group][i] = _Leaf.held(x, auto)
        if input_fn is None:
            act = _Act.of_leaf(metas[1][0])
        else:
            act = _Act.of_template(activation, auto)
        fns = (stage_fn, loss_fn, input_fn)
        run = _Run(sched, g, fns, defs, metas, act, need, transformed)
        # Values replicated over the axis are used by one stage's rank only: pcast them, so
        # their gradient (zero on the other ranks) is summed over the axis once. Those held by
        # their stage's ranks are not: their gradient is computed where they are held. (The
        # data of input_fn is not differentiated.)
        x_locals = [mt.local for mt in metas[1]]
        x_locals = x_locals if input_fn is not None else [lax.pcast(x_locals[0], axis)]
        ip_locals = [mt.local if i in ip_held else lax.pcast(mt.local, axis)
                     for i, mt in enumerate(metas[2])]  # fmt: skip
        lp_locals = [mt.local if i in lp_held else lax.pcast(mt.local, axis)
                     for i, mt in enumerate(metas[3])]  # fmt: skip
        tensors = (*[mt.local for mt in metas[0]], *x_locals, *ip_locals, *lp_locals)
        tensors += tuple(mt.local for mt in metas[4])
        if tracker is not None:
            tracker.paused += 1
        try:
            # paused: the tracker is off the mode stack. Outside torch.func, the Function applied
            # as fshard's collectives are (fshard._function.call: no inspect.signature binding
            # of its 20-odd arguments each step); under its grad level, by torch's apply
            if torch._C._are_functorch_transforms_active():
                out = _Pipeline.apply(run, *tensors)
            else:
                out = call(_Pipeline, run, *tensors)
        finally:
            if tracker is not None:
                tracker.paused -= 1
        loss = out[0] if isinstance(out, tuple) else out
        if tracker is not None:
            vma = frozenset({axis}).union(*(tracker.vma(t) for t in x_locals))
            tracker.tag(loss, vma - {axis} if run.summed else vma)
        if run.summed:  # summed over the stages in the schedule (_Run._sum_loss)
            return loss
        try:
            return lax.psum(loss, axis)  # the last stage's sum; zeros elsewhere
        except RuntimeError as e:  # a rank whose schedule ran through, a stage having failed
            failed = _peer_failed(g, e, "at the loss's sum over the stages")
            if failed is None:
                raise
            raise failed from e

    specs = (P(axis), P(), P(), P(), P())
    try:
        inputs = _shard_plain(
            flat, specs, mesh, _program(schedule, virtual, axis, activation, need is not None)
        )
        # checked by _shard_plain's exchange, with the inputs: one a step
        mapped = shard_map_checked_by_caller(body, mesh, specs, P(), axis_names={axis})
        loss = mapped(*inputs)
    finally:  # its verdict, if no collective took it (a rank that raised before one)
        consistency.wait_pending()
    # Each stage ran its own collectives over the other axes (MPMD): its ranks compare them
    # now, so a later check over the whole mesh (fs.optim.step) sees only common history.
    others = tuple(a for a in mesh.axis_names if a != axis and mesh.size(a) > 1)
    if others:
        consistency.settle(mesh.group(others), "fs.parallel.pipeline")
    return loss
