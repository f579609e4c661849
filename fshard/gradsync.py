"""Gradient sync: the one reducer of data-parallel gradients (DDP's reducer, FSDP2's
``set_requires_gradient_sync``, JAX's unreduced gradients).

Where the data-parallel reduction happens. A replicated value's gradient is summed over an
axis exactly once, at the ``pcast`` where it met varying data (DESIGN §4); through
``fshard.lax``'s Function that is one all_reduce per ``pcast`` in its backward, run late (the
Function's node was created early in the forward, and the engine runs low sequence numbers
last) and unbucketed. :class:`GradSync` is the :class:`fshard.lax.Handler` that takes those
pcasts over for the params a call differentiates (``fs.value_and_grad`` at top level, the
pipeline executor for a step's stage weights):

* A ``pcast`` over ``group`` of one of its leaves, or of a view of one (a block's slice of a
  stacked stage weight), reads a **stand-in**: a leaf sharing the param's storage, one per
  (param, group, reduce dtype) for the whole call, whatever the number of uses. Its gradient is
  the varying cotangent of every such use (summed by autograd), and nothing else: the param's
  uses outside a pcast (weight decay in the loss, an invariant branch) reach the param itself,
  never a stand-in, so they are not summed over ranks. A param used ``k`` times (tied weights,
  ``m`` microbatches in one loss) is reduced **once**.
* ``mode="overlap"`` (``fs.value_and_grad``): a post-accumulate-grad hook on each stand-in
  (the engine runs it as soon as its last use is back-propagated, like DDP's AccumulateGrad
  hooks) puts its gradient, a tensor no one else holds (AccumulateGrad steals an unshared
  cotangent and clones a shared one), in its bucket; a full bucket is all-reduced
  asynchronously while the rest of the backward runs.
* ``mode="step"`` (the pipeline, several backward passes per step): the stand-ins'
  gradients accumulate over the passes, and :meth:`GradSync.finish` reduces them once, every
  bucket launched before the first is waited on. FSDP's varying all_gather of a leaf (or of a
  view of one: a layer's row of a stacked stage weight) reads a stand-in too, one per (param
  view, group): a leaf that is the gathered data itself, which every use of the gather kept
  for the step reads as it is (no autograd node per use), its cotangent accumulating whole in
  the stand-in, and :meth:`GradSync.finish` reduce-scatters the whole param's
  accumulated gradient once per step (FSDP2's ``set_requires_gradient_sync(False)`` until the
  last microbatch), the params packed per bucket as FSDP2 packs a unit's. The gathered data
  itself is kept for the step (:meth:`GradSync.hold_gather`, read back by FSDP's next use
  through :meth:`GradSync.held_gather`): a unit is gathered once per step, not per microbatch.
* ``fs.remat``'s recompute (``torch.func.vjp`` in the backward, where a stand-in leaf
  would not be differentiated by the vjp): a ``pcast`` of a leaf there is deferred
  (:meth:`GradSync.defer`, remat's handler): its cotangent is handed over
  (:meth:`GradSync.deposit`) and summed with the other uses', and :meth:`GradSync.finish`
  reduces these late entries in buckets of their own (was one all_reduce per param and
  recompute: 18 a step on a 2-layer Llama with cp=2).
* ``mode="unreduced"`` (``fs.value_and_grad(..., sync=False)``): nothing is sent;
  :meth:`GradSync.finish` returns each param's gradient as the addends of a pending sum over the
  pcasts' axes (a partial layout), for accumulation over microbatches and one reduction per
  optimizer step (``fs.reshard`` of the accumulated tree to the params' specs).

Buckets: ``fs.lax.buckets`` (the bucketing ``fs.lax.psum`` of a pytree uses), cut in reverse
registration order (the order gradients are expected) per (group, reduce dtype, device): a
gradient of at least ``fs.lax.PSUM_INPLACE_MIN_BYTES`` is a bucket of its own, reduced in place
in the tensor autograd made; smaller ones are copied into a packed buffer of up to
``fs.lax.PSUM_BUCKET_BYTES``, reused across calls once the gradients returned from it (views)
are gone. The reduce dtype is the ``pcast``'s (``Pcast.reduce_dtype``, mixed precision's
``reduce_dtype``): the bucket holds that dtype and the sum is cast back to the param's.

Example:
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> w = torch.ones(3)
    >>> sync = GradSync([w], mode="step")
    >>> with fs.lax.handling(sync), torch.enable_grad():
    ...     v = fs.lax.pcast(w, "x", mesh=mesh)  # a stand-in leaf, reduced once per step
    ...     (v * (mesh.rank + 1)).sum().backward()
    ...     (v * (mesh.rank + 1)).sum().backward()  # a second microbatch: no reduction yet
    >>> sync.finish([None])[0]  # (1 + 2) summed over x, twice
    tensor([6., 6., 6.])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import _comm, _function, lax
from .collectives import AllGather, Pcast
from .mesh import AxisGroup

__all__ = ["GradSync", "MODES"]

MODES = ("overlap", "step", "unreduced")


def _chunked(g: torch.Tensor, k: int, rows: tuple[int, ...] | None) -> torch.Tensor:
    """``g``'s ``k`` chunks of dim 0 as the rows of a ``(k, -1)`` matrix (``rows``: uneven
    chunks' sizes, each padded with zeros to the largest)."""
    if rows is None:
        return g.reshape(k, -1)
    m = max(rows)
    return torch.stack([_comm.pad_dim0(c, m) for c in torch.split(g, list(rows))]).reshape(k, -1)


def _chunk_numel(v: torch.Tensor, k: int, rows: tuple[int, ...] | None) -> int:
    """The elements of one (padded) chunk of ``v`` over ``k`` ranks."""
    return v.numel() // k if rows is None else max(rows) * (v[0].numel() if v.dim() else 1)


class _Entry:
    """One stand-in: leaf ``leaf`` read through ``pcast`` over ``group``, reduced in
    ``dtype``; or (``gather``, ``"unreduced"`` mode) through FSDP's varying all_gather, the
    stand-in then holding the gathered value."""

    __slots__ = ("leaf", "group", "dtype", "v", "gather", "view")

    def __init__(
        self, leaf: int, group: AxisGroup, dtype: torch.dtype, v: torch.Tensor, gather=None
    ):
        self.leaf, self.group, self.dtype, self.v, self.gather = leaf, group, dtype, v, gather
        # "step" mode's gathers: the gathered view of the leaf, (size, stride, offset) in the
        # leaf's geometry; None: the leaf itself
        self.view: tuple | None = None


def _gather_key(i: int, x: torch.Tensor, group: AxisGroup) -> tuple:
    """The key of the stand-in of FSDP's varying gather over ``group`` of ``x``, leaf ``i`` or
    a view of it (its geometry in the leaf)."""
    return (i, "gather", tuple(x.shape), x.stride(), x.storage_offset(), group.axes, id(group.pg))


def _plain_view(x: torch.Tensor) -> bool:
    """Whether view ``x`` of a leaf was made by view ops alone: its cotangent, read through
    the view on a stand-in of the leaf, is then the leaf's. A view a collective returned (a
    ``LocalSlice``: ``narrow``, a block of a replicated param used with an activation split
    over tp) is not: its transpose (the all_gather of every rank's block) would be skipped,
    each rank keeping its own block zero-padded as the whole gradient."""
    node = x.grad_fn
    while node is not None and type(node).__name__ != "AccumulateGrad":
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return False
        nxt = [n for n, _ in node.next_functions if n is not None]
        node = nxt[0] if len(nxt) == 1 else None
    return True


def _same_data(v: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` is ``v``'s data: the same storage, offset, shape, strides and dtype."""
    return (
        t.data_ptr() == v.data_ptr()
        and t.dtype == v.dtype
        and t.shape == v.shape
        and t.stride() == v.stride()
        and t.device == v.device
    )


class _Alias(torch.autograd.Function):
    """``done`` (a gather's result, computed already) as a function of the stand-in ``v``:
    the cotangent goes to ``v`` whole (it is accumulated, then reduce-scattered once)."""

    @staticmethod
    def forward(v, done):
        return done

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Bucket:
    """One all_reduce: ``entries`` = ``[(entry, offset, numel)]``. ``own``: a single large
    gradient reduced in place in the tensor autograd accumulated (no copy); otherwise the
    entries are packed into a pooled buffer."""

    __slots__ = ("group", "dtype", "entries", "numel", "own", "flat", "pending", "work")

    def __init__(self, group: AxisGroup, dtype: torch.dtype, own: bool):
        self.group, self.dtype, self.own, self.entries, self.numel = group, dtype, own, [], 0
        self.flat, self.pending, self.work = None, 0, None

    def add(self, k: int, numel: int) -> None:
        self.entries.append((k, self.numel, numel))
        self.numel += numel
        self.pending += 1


class GradSync(lax.Handler):
    """The reducer of one call's data-parallel gradients (see the module docstring).

    Args:
        leaves: the differentiated tensors (params' local blocks) whose pcasts it takes over.
        mode: ``"overlap"`` (buckets launched as the backward fills them), ``"step"`` (once,
            in :meth:`finish`, after any number of backward passes) or ``"unreduced"`` (no
            communication: :meth:`finish` returns the addends).

    Example:
        >>> GradSync([torch.ones(2)], mode="overlap").mode
        'overlap'
    """

    def __init__(self, leaves: Sequence[torch.Tensor], mode: str = "overlap"):
        if mode not in MODES:
            raise ValueError(f"GradSync: mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.leaves = list(leaves)
        self.index = {id(t): i for i, t in enumerate(self.leaves)}
        self.entries: list[_Entry] = []
        self.gathers: list[_Entry] = []  # "step" mode: FSDP's gathers of leaves (or views)
        self.keys: dict[tuple, int] = {}  # (leaf, axes, id(pg), dtype) -> entry (or gather)
        self.buckets: list[_Bucket] | None = None
        self.slot: dict[int, tuple[_Bucket, int]] = {}  # entry -> (its bucket, offset)
        self.next = 0  # the first bucket not launched yet
        self.arrived: set[int] = set()
        self.held: dict[tuple, torch.Tensor] = {}  # "step" mode: FSDP's gathers, for the step
        # fs.remat's recompute (torch.func.vjp in the backward): the pcasts of leaves it defers
        # (:meth:`defer`) and their cotangents, summed (:meth:`deposit`); reduced in finish
        self.late: list[_Entry] = []
        self.deposits: dict[int, torch.Tensor] = {}

    # -- the handler ------------------------------------------------------------------------

    def process(self, b, x, done, proceed):
        if type(b.op) is Pcast:
            v = self._stand_in(x, b.group, b.op.reduce_dtype)
            return proceed(b, x, done) if v is None else v
        if type(b.op) is AllGather and not b.op.invariant and self.mode != "overlap":
            if self.mode == "unreduced":
                v = self._gathered(b, x, done, proceed)
            else:
                v = self._gather_stand_in(b, x, done, proceed)
            return proceed(b, x, done) if v is None else v
        return proceed(b, x, done)

    def _leaf(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """``x``'s base (``x`` itself unless it is a view) and its index among the leaves, or
        ``None`` when it is not one of them."""
        base = x if x._base is None else x._base
        i = self.index.get(id(base))
        if i is None or self.leaves[i] is not base or (x is not base and not _plain_view(x)):
            return base, None
        return base, i

    def _gather_stand_in(self, b, x, done, proceed) -> torch.Tensor | None:
        """``"step"`` mode: FSDP's varying gather (dim 0, even or uneven blocks) of a leaf, or
        of a view of one (a layer's row of a stacked stage weight), reads a stand-in per (param view,
        group) for the whole call: the gathered data (``done``, or gathered now without a
        graph) whose cotangent goes whole to the stand-in, so the whole param's gradient
        accumulates over every use and microbatch, and :meth:`finish` reduce-scatters it once
        (bucketed). The stand-in is the first use's gathered data, detached, as a leaf: FSDP
        keeps the gather for the step (:meth:`hold_gather`), so a later use of the same data
        returns the stand-in itself; a use of other data (a gather not kept) is an alias of it
        whose cotangent goes to the stand-in (:class:`_Alias`)."""
        op = b.op
        base, i = self._leaf(x)
        if (
            op.dim != 0
            or i is None
            or self.buckets is not None
            or not torch.is_grad_enabled()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        if done is None:
            with torch.no_grad():
                done = proceed(b, x.detach(), None)
        if done.dtype != x.dtype or done.shape[1:] != x.shape[1:]:
            return None
        key = _gather_key(i, x, b.group)
        k = self.keys.get(key)
        if k is None:
            k = self.keys[key] = len(self.gathers)
            # the stand-in is the gathered data itself, detached (the graph that made ``done``,
            # FSDP's invariant gather of the same data, is not reached: the engine ran that node
            # on a zero cotangent per use otherwise): FSDP keeps a unit's gather for the step
            # (hold_gather), so every later use passes this same tensor back as ``done``
            e = _Entry(i, b.group, x.dtype, done.detach().requires_grad_(), gather=op)
            if x is not base:  # its geometry in the leaf's (offset from the leaf's start)
                e.view = (tuple(x.shape), x.stride(), x.storage_offset() - base.storage_offset())
            self.gathers.append(e)
        v = self.gathers[k].v
        if _same_data(v, done):
            # the use reads the stand-in leaf itself: its cotangent accumulates in v.grad, with
            # no node per use (was a Python autograd Function per param, use and microbatch:
            # 72 forward and 72 backward calls a step on a stage of benchmarks/composed_step.py's
            # FSDP x PP)
            return v
        # other data for the same param (a gather not kept): its value, the stand-in's gradient
        # (the C++ apply: torch's Python one binds the arguments through inspect.signature)
        return _function.call(_Alias, v, done.detach())

    def _gathered(self, b, x, done, proceed) -> torch.Tensor | None:
        """FSDP's varying gather of a leaf, unreduced: a stand-in holding the gathered value,
        whose gradient (the whole param's addend) is returned as a pending sum, not
        reduce-scattered."""
        i = self.index.get(id(x))
        if (
            i is None
            or self.leaves[i] is not x
            or not torch.is_grad_enabled()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        key = (i, "gather", b.op)
        k = self.keys.get(key)
        if k is None:
            if done is None:
                with torch.no_grad():
                    done = proceed(b, x.detach(), None)
            k = self.keys[key] = len(self.entries)
            v = done.detach().requires_grad_()
            self.entries.append(_Entry(i, b.group, x.dtype, v, gather=b.op))
        return self.entries[k].v

    def _stand_in(self, x: torch.Tensor, group: AxisGroup, dtype) -> torch.Tensor | None:
        base, i = self._leaf(x)
        if (
            i is None
            or self.buckets is not None
            or not torch.is_grad_enabled()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        dtype = dtype or base.dtype
        key = (i, group.axes, id(group.pg), dtype)
        k = self.keys.get(key)
        if k is None:
            k = self.keys[key] = len(self.entries)
            v = base.detach().requires_grad_()
            self.entries.append(_Entry(i, group, dtype, v))
            if self.mode == "overlap":
                # After AccumulateGrad: v.grad is then a tensor no one else holds (the engine
                # steals an unshared gradient or clones a shared one), so it may be reduced in
                # place.
                v.register_post_accumulate_grad_hook(functools.partial(self._ready, k))
        v = self.entries[k].v
        return v if x is base else x._view_func(v)

    # -- fs.remat's recompute: pcasts under its torch.func.vjp --------------------------------

    def leaf_index(self, t: torch.Tensor) -> int | None:
        """The index of ``t`` among the leaves (``t`` itself, not a view), or ``None``.

        Example:
            >>> w = torch.ones(3)
            >>> GradSync([w]).leaf_index(w), GradSync([w]).leaf_index(w[:2])
            (0, None)
        """
        i = self.index.get(id(t))
        return i if i is not None and self.leaves[i] is t else None

    def defer(self, i: int, group: AxisGroup, dtype) -> int | None:
        """A ``pcast`` over ``group`` of leaf ``i`` (as a whole) that ``fs.remat``'s recompute
        makes under its ``torch.func.vjp`` in the backward, where no stand-in can be read (a
        leaf of the vjp's level would not be differentiated by it): the number of a late
        entry, one per (leaf, group, reduce dtype) for the call, whose cotangents the
        recompute hands over (:meth:`deposit`) instead of all-reducing each use's, and which
        :meth:`finish` reduces in buckets (was one all_reduce per param and recompute);
        ``None`` where it does not take the pcast over (``"unreduced"`` mode, no gradient
        being computed).

        Example:
            >>> w = torch.ones(3)
            >>> sync = GradSync([w])
            >>> with torch.enable_grad():
            ...     sync.defer(0, fs.Mesh.abstract((1,), ("x",)).simulate(0).group(("x",)), None)
            0
        """
        if self.mode == "unreduced" or not torch.is_grad_enabled():
            return None
        base = self.leaves[i]
        dtype = dtype or base.dtype
        key = (i, group.axes, id(group.pg), dtype, "late")
        k = self.keys.get(key)
        if k is None:
            k = self.keys[key] = len(self.late)
            self.late.append(_Entry(i, group, dtype, base))
        return k

    def deposit(self, k: int, g: torch.Tensor) -> None:
        """Late entry ``k``'s cotangent of one use (a plain tensor), summed with the others,
        in the entry's reduce dtype."""
        e = self.late[k]
        g = g.detach().to(e.dtype)
        have = self.deposits.get(k)
        self.deposits[k] = g if have is None else have + g

    def _launch_late(self) -> list:
        """The late entries' sums, bucketed (``fs.lax.buckets``, per group and dtype; zeros
        where no cotangent arrived: every rank issues the same collectives) and launched:
        ``[(entries, flat, work)]``."""
        es = self.late
        shapes = [torch.empty(e.v.shape, dtype=e.dtype, device="meta") for e in es]
        launched = []
        for cut in lax.buckets(shapes, [e.group for e in es], order="in_place_first"):
            first = es[cut.idx[0]]
            sizes = [es[k].v.numel() for k in cut.idx]
            flat = torch.zeros(sum(sizes), dtype=first.dtype, device=first.v.device)
            for k, piece in zip(cut.idx, torch.split(flat, sizes)):
                if k in self.deposits:
                    piece.copy_(self.deposits[k].reshape(-1))
            _, work = _comm.all_reduce_start(flat, first.group, inplace=True)
            launched.append((cut.idx, sizes, flat, work))
        self.deposits = {}
        return launched

    def _add_late(self, out: list, launched: list) -> None:
        for ks, sizes, flat, work in launched:
            if work is not None:
                work.wait()
            for k, piece in zip(ks, torch.split(flat, sizes)):
                e = self.late[k]
                piece = piece.view(e.v.shape).to(e.v.dtype)
                i = e.leaf
                out[i] = piece if out[i] is None else piece.add_(out[i])

    # -- "step" mode: FSDP's gathered params, kept for the step ------------------------------

    def _held_key(self, x: torch.Tensor, group: AxisGroup, dtype: torch.dtype) -> tuple | None:
        i = self._leaf(x)[1]
        if self.mode != "step" or i is None:
            return None
        return (i, tuple(x.shape), x.stride(), x.storage_offset(), group.axes, id(group.pg), dtype)

    def holds(self, x: torch.Tensor) -> bool:
        """``"step"`` mode: whether :meth:`hold_gather` keeps a gather of ``x`` (one of the
        leaves or a view of one) while the step's reduction has not begun.

        Example:
            >>> GradSync([torch.ones(2)], mode="step").holds(torch.ones(2))
            False
        """
        if self.mode != "step" or self.buckets is not None:
            return False
        return self._leaf(x)[1] is not None

    def held_gather(
        self, x: torch.Tensor, group: AxisGroup, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``"step"`` mode: the gathered value over ``group`` (in ``dtype``) of param block
        ``x`` (one of the leaves, or a view of one: a layer's row of a stacked stage weight)
        that FSDP handed to :meth:`hold_gather` earlier in the step; ``None`` if none. A
        pipeline's stages gather each FSDP unit once per step and keep it for every
        microbatch's forward and backward (FSDP2's ``reshard_after_forward=False``, as
        torchtitan runs FSDP under pipelining): the params do not change within a step.

        Example:
            >>> w = torch.ones(2)
            >>> sync = GradSync([w], mode="step")
            >>> g = fs.Mesh.create((2,), ("x",)).group(("x",))  # 2 ranks
            >>> sync.hold_gather(w, g, torch.ones(4))  # FSDP's gather of w over x, kept
            True
            >>> sync.held_gather(w, g, torch.float32)
            tensor([1., 1., 1., 1.])
        """
        if self.mode != "step" or not self.held:
            return None
        key = self._held_key(x, group, dtype)
        return None if key is None else self.held.get(key)

    def kept_use(
        self, x: torch.Tensor, group: AxisGroup, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``"step"`` mode: what a use of the kept gather over ``group`` (in ``dtype``) of
        param block ``x`` reads, once a use made it: the gather's stand-in, the kept data
        itself as a leaf (its cotangent accumulated for the step's one reduce_scatter), what
        the use's varying all_gather would come back as from this reducer (read here without
        the op's dispatch: ~20 Python calls per param, use and microbatch). ``None`` before
        the first use, for other data, and where this reducer is not the innermost handler
        (the all_gather then goes through the handlers inside it).

        Example:
            >>> GradSync([torch.ones(2)], mode="step").kept_use(torch.ones(2), None, torch.float32)
        """
        if (
            self.mode != "step"
            or not self.held
            or self.buckets is not None
            or not torch.is_grad_enabled()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        handlers = lax.active_handlers()
        if not handlers or handlers[-1] is not self:
            return None
        key = self._held_key(x, group, dtype)
        full = None if key is None else self.held.get(key)
        if full is None:
            return None
        k = self.keys.get(_gather_key(key[0], x, group))
        if k is None:
            return None
        v = self.gathers[k].v
        return v if _same_data(v, full) else None

    def hold_gather(self, x: torch.Tensor, group: AxisGroup, full: torch.Tensor) -> bool:
        """``"step"`` mode: keep ``full``, FSDP's gather of param block ``x`` over ``group``,
        until :meth:`close` (see :meth:`held_gather`). Returns whether it is kept (``x`` is
        one of the leaves or a view of one, and the step's reduction has not begun).

        Example:
            >>> w = torch.ones(2)
            >>> GradSync([w], mode="overlap").hold_gather(w, None, torch.ones(4))
            False
        """
        if self.mode != "step" or self.buckets is not None:
            return False
        key = self._held_key(x, group, full.dtype)
        if key is None:
            return False
        self.held[key] = full
        return True

    def stand_ins(self, leaves: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The stand-ins made so far (of ``leaves`` only, when given): the leaves a backward
        must reach besides the params.

        Example:
            >>> GradSync([torch.ones(2)]).stand_ins()
            []
        """
        es = self.entries + self.gathers
        if leaves is None:
            return [e.v for e in es]
        ids = {id(t) for t in leaves}
        return [e.v for e in es if id(self.leaves[e.leaf]) in ids]

    # -- buckets ----------------------------------------------------------------------------

    def _plan(self) -> None:
        """Cut the entries, last registered first (the order their gradients are expected),
        with ``fs.lax.buckets``; launched in the order they are expected to fill (by their last
        entry): static, so the same on every rank."""
        ks = list(reversed(range(len(self.entries))))
        shapes = [
            torch.empty(self.entries[k].v.shape, dtype=self.entries[k].dtype, device="meta")
            for k in ks
        ]
        groups = [self.entries[k].group for k in ks]
        in_place = {
            pos for pos, k in enumerate(ks) if self.entries[k].dtype == self.entries[k].v.dtype
        }
        self.buckets = []
        for cut in lax.buckets(shapes, groups, in_place=in_place, order="filled"):
            first = self.entries[ks[cut.idx[0]]]
            b = _Bucket(first.group, first.dtype, own=cut.own)
            for pos in cut.idx:
                self.slot[ks[pos]] = (b, b.numel)
                b.add(ks[pos], self.entries[ks[pos]].v.numel())
            self.buckets.append(b)

    def _ready(self, k: int, v: torch.Tensor) -> None:
        if self.buckets is None:
            self._plan()
        g, v.grad = v.grad, None
        self._put(k, g)
        self._launch_ready()

    def _put(self, k: int, g: torch.Tensor) -> None:
        b, off = self.slot[k]
        if b.own:
            b.flat = g.contiguous().view(-1)
        else:
            if b.flat is None:
                b.flat = _comm.pooled(b.numel, b.dtype, g.device)
            b.flat[off : off + g.numel()].view_as(g).copy_(g)
        self.arrived.add(k)
        b.pending -= 1

    def _launch_ready(self, flush: bool = False) -> None:
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if b.pending:
                if not flush:
                    return
                # cotangents that never arrived (the pcast did not reach the loss): zeros
                if b.flat is None:
                    like = self.entries[b.entries[0][0]].v
                    b.flat = (
                        like.new_empty(b.numel)
                        if b.own
                        else _comm.pooled(b.numel, b.dtype, like.device)
                    ).zero_()
                else:
                    for k, off, size in b.entries:
                        if k not in self.arrived:
                            b.flat[off : off + size].zero_()
                b.pending = 0
            _, b.work = _comm.all_reduce_start(b.flat, b.group, inplace=True)
            self.next += 1

    def finish(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Every leaf's gradient: its own ``grads[i]`` (which this call owns: accumulated by
        autograd into a fresh leaf) plus its stand-ins' reduced gradients. In
        ``"unreduced"`` mode see :meth:`unreduced` instead.

        Example:
            >>> GradSync([torch.ones(2)], mode="step").finish([torch.ones(2)])
            [tensor([1., 1.])]
        """
        if self.mode == "unreduced":
            raise ValueError("GradSync.finish: an 'unreduced' reducer is read with unreduced()")
        self.held = {}  # every backward has run: the step's gathered params go
        late = self._launch_late() if self.late else []
        if not self.entries and not self.gathers:
            out = list(grads)
            self._add_late(out, late)
            return out
        if self.buckets is None:  # no gradient arrived through a hook (mode "step")
            self._plan()
        if self.mode == "step":
            for k, e in enumerate(self.entries):
                if e.v.grad is not None:
                    self._put(k, e.v.grad)
                    e.v.grad = None
        self._launch_ready(flush=True)
        out = list(grads)
        # while the all_reduces are on the wire: the gathered params' reduce_scatters
        for e, piece in self._scatter_gathers():
            i = e.leaf
            leaf = self.leaves[i]
            total = out[i]
            if total is None:
                total = torch.zeros_like(leaf, memory_format=torch.preserve_format)
            elif total.stride() != leaf.stride():  # the view's geometry is the leaf's
                total = torch.empty_strided(
                    leaf.shape, leaf.stride(), dtype=total.dtype, device=total.device
                ).copy_(total)
            if e.view is None:
                dst = total
            else:
                size, stride, offset = e.view
                dst = total.as_strided(size, stride, total.storage_offset() + offset)
            dst.add_(piece.view(dst.shape).to(dst.dtype))
            out[i] = total
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            for k, off, size in b.entries:
                e = self.entries[k]
                piece = b.flat[off : off + size].view(e.v.shape)
                if piece.dtype != e.v.dtype:
                    piece = piece.to(e.v.dtype)
                i = e.leaf
                out[i] = piece if out[i] is None else piece.add_(out[i])
        self._add_late(out, late)
        return out

    def _scatter_gathers(self) -> list[tuple[_Entry, torch.Tensor]]:
        """``"step"`` mode: each gathered param's accumulated gradient (zeros where none
        arrived: every rank issues the same collectives), reduce-scattered over its gather's
        group: one reduce_scatter per bucket (``fs.lax.buckets``, per group and dtype, up to
        ``fs.lax.PSUM_BUCKET_BYTES``), the gradients packed as FSDP2 packs a unit's (each
        one's chunks side by side, so the scattered buffer holds this rank's block of each).
        Returns ``[(entry, this rank's block)]``, bucket by bucket."""
        es = self.gathers
        if not es:
            return []
        taken = []
        for e in es:  # the stand-ins hold the step's gathered data: it goes now, as the held
            taken.append(e.v.grad)  # gathers go, before the reduce_scatters' buffers
            e.v = torch.empty_strided(e.v.shape, (0,) * e.v.dim(), dtype=e.v.dtype, device=e.v.device)  # fmt: skip
        shapes = [torch.empty(e.v.shape, dtype=e.dtype, device="meta") for e in es]
        out = []
        for cut in lax.buckets(shapes, [e.group for e in es], order="in_place_first"):
            group = es[cut.idx[0]].group
            k = group.size
            grads = []
            for j in cut.idx:
                e = es[j]
                g, taken[j] = taken[j], None
                grads.append(torch.zeros(e.v.shape, dtype=e.dtype, device=e.v.device) if g is None else g)  # fmt: skip
            rows = [es[j].gather.sizes for j in cut.idx]
            if len(grads) == 1 and rows[0] is None:
                flat = grads[0].reshape(-1)
            else:  # each one's chunks side by side (an uneven one's padded to its largest)
                parts = [_chunked(g, k, r) for g, r in zip(grads, rows)]
                numel = sum(p.numel() for p in parts)
                flat = _comm.pooled(numel, parts[0].dtype, parts[0].device)
                torch.cat(parts, 1, out=flat.view(k, numel // k))
                del parts
            del grads
            # the same bytes every step: the pack and the received chunks from the pool
            mine = _comm.reduce_scatter(flat, group, 0, None, pool=True)
            del flat
            sizes = [_chunk_numel(es[j].v, k, r) for j, r in zip(cut.idx, rows)]
            for j, r, piece in zip(cut.idx, rows, torch.split(mine, sizes)):
                if r is not None:  # this rank's rows of the padded chunk
                    piece = piece.view(max(r), *es[j].v.shape[1:])[: r[group.index]]
                out.append((es[j], piece))
        return out

    def unreduced(self, grads: list[torch.Tensor | None], keep_own) -> list:
        """``"unreduced"`` mode: per leaf ``(addend, axes)``: this rank's addend of the leaf's
        gradient as a pending sum over ``axes`` (the union of its pcasts' axes; ``()`` where
        nothing is pending). ``keep_own(i, axes)``: whether this rank keeps an addend that is
        the same on every rank of ``axes`` (the first rank of them does: each pcast's
        cotangent over a smaller group, and the leaf's own gradient).

        Example:
            >>> GradSync([torch.ones(2)], mode="unreduced").unreduced([None], None)
            [(None, ())]
        """
        axes_of: dict[int, tuple[str, ...]] = {}
        for e in self.entries:
            have = axes_of.get(e.leaf, ())
            axes_of[e.leaf] = have + tuple(a for a in e.group.axes if a not in have)
        out = []
        for i, own in enumerate(grads):
            gathers = [e for e in self.entries if e.leaf == i and e.gather is not None]
            if gathers:
                out.append(self._unreduced_gather(i, own, gathers))
                continue
            axes = axes_of.get(i, ())
            total = None
            if own is not None:
                total = own if not axes or keep_own(i, axes) else torch.zeros_like(own)
            for e in self.entries:
                if e.leaf != i or e.v.grad is None:
                    continue
                g = e.v.grad
                rest = tuple(a for a in axes if a not in e.group.axes)
                if rest and not keep_own(i, rest):
                    g = torch.zeros_like(g)
                total = g if total is None else total + g
            out.append((total, axes))
        return out

    def _unreduced_gather(self, i: int, own, gathers: list) -> tuple:
        """A leaf FSDP gathered: ``(addend, axes, (dim, axes))``, the addend the whole param's
        (its gathered dim whole): the stand-in's gradient plus, at this rank's block, the
        leaf's own gradient (already complete for the block)."""
        others = [e for e in self.entries if e.leaf == i and e.gather is None]
        if len(gathers) > 1 or others:
            raise NotImplementedError(
                "value_and_grad(sync=False): a parameter both all-gathered by FSDP and pcast "
                "over other axes (HSDP's replicate axes) or gathered twice cannot be returned "
                "unreduced yet; use sync=True (one reduction per microbatch)"
            )
        e = gathers[0]
        op, g = e.gather, e.group
        total = torch.zeros_like(e.v) if e.v.grad is None else e.v.grad
        if own is not None:
            n = total.shape[op.dim]
            if op.sizes is None:
                size = n // g.size
                start = g.index * size
            else:
                size, start = op.sizes[g.index], sum(op.sizes[: g.index])
            total = total.clone() if total is e.v.grad else total
            total.narrow(op.dim, start, size).add_(own)
        return total, tuple(g.axes), (op.dim, tuple(g.axes))

    def close(self) -> None:
        """Drop every tensor this call held. The reducer object itself may outlive the call for
        a moment (a reference released after the call returns): what it held must not, or
        each step's gradients stay alive into the next one (fresh pages)."""
        self.leaves, self.index, self.entries, self.keys = [], {}, [], {}
        self.buckets, self.slot, self.gathers, self.held = [], {}, [], {}
        self.late, self.deposits = [], {}
