"""Named-axis collectives with JAX semantics, differentiable under every torch.func transform.

Every collective is an op of :mod:`fshard.collectives` (frozen data keyed by mesh axes and
chunk sizes) bound to its process group (:class:`~fshard.collectives.Bound`), applied by
:func:`apply` through ONE new-style ``torch.autograd.Function``, :class:`_Collective` (with
:func:`fshard._function.call`; its twin ``_CollectiveTraced`` under ``torch.compile``). What an
op does on the wire is looked up in one table, :data:`fshard.collectives.RUN`. The Function's
``backward`` applies the op's *transpose*, which is again an op run through the same Function,
so double backward, ``vmap(grad)``, ``jacrev``, ``jacfwd`` and ``hessian`` all work. Its ``vmap``
staticmethod moves the batch dim to the front and runs the collective once on the whole batch
(no c10d op ever sees a batched tensor); its ``jvp`` applies the op to the tangent. The one
nonlinear op, ``Pmax`` (pmax/pmin), saves its tie mask as a residual and gives its backward
and jvp as ops (a psum of the mask). Every caller applies ops through here: the reshard
programs (:mod:`fshard.executor`), op rules (``fshard.ops._common.group_psum`` & co.),
shard_map's pcast/unvary, FSDP's gathered parameters (an asynchronous gather's result passed in
as ``done=``).

A value is, per mesh axis, *invariant* (I: the same on every rank of the axis) or *varying*
(V). The ops and their transposes, as in JAX with ``check_vma=True``::

    op (collectives.py)      type      forward comm         transpose (backward)
    Psum                     V -> I    all_reduce           Pcast            (no comm)
    Pcast                    I -> V    none                 Psum             (all_reduce)
    AllGather(varying)       V -> V    all_gather           PsumScatter      (reduce_scatter)
    AllGather(invariant)     V -> I    all_gather           LocalSlice       (no comm)
    LocalSlice               I -> V    none                 AllGather(invariant)
    PsumScatter              V -> V    reduce_scatter       AllGather(varying)
    AllToAll(split a, b)     V -> V    all_to_all           AllToAll(split b, concat a)
    Ppermute(perm)           V -> V    send/recv            Ppermute(inverse perm)
    Pmax(how=max/min)        V -> I    all_reduce(max/min)  mask ties, psum of the mask
    ZeroOthers (R -> P)      I -> P    none (zeros on all   PartialCotangent (identity)
                                       ranks but the first)
    GatherBlocks             explicit  all_gather of the    KeepBlock        (no comm)
                             -> I      padded flat blocks
    Unvary / Claim           identity  none                 ScaleBySize / KeepFirst

A partial value's cotangent is invariant (DESIGN §4: every addend enters the sum with weight
one), so the transpose of reshard's R -> P step is the identity; JAX's spelling of the step,
``pcast`` then a mask, would ``psum`` the masked cotangents back to that same tensor.

Inside :func:`fshard.shard_map` the axis names refer to the shard_map's mesh; elsewhere pass
``mesh=``. Inside a shard_map body each local tensor also carries its *varying axes* (tracked by
the body's ``TorchFunctionMode``, see :mod:`fshard.shard_map`): a collective that expects a
varying operand first applies ``pcast`` to an operand that is invariant over some of its axes (so
``psum`` of an invariant value is ``n * x`` with gradient ``n``, as in JAX), and tags its result
(``psum``/``pmax``/``all_gather(to="invariant")`` remove the axes; the others add them). Outside
a body nothing is tracked and the ops run as written.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> fs.lax.psum(torch.ones(2), "x", mesh=mesh)  # local view: plain tensors, named axes
    tensor([2., 2.])
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from collections.abc import Container, Iterator, Sequence
from typing import NamedTuple

import optree
import torch
from torch._C._functorch import (
    TransformType,
    get_interpreter_stack,
    get_unwrapped,
    is_functorch_wrapped_tensor,
)
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.autograd import forward_ad as _forward_ad
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import _comm, _compat, axis_env
from ._function import _dynamo_compiling, call, traced, traced_apply, untracked
from .array import ShardedArray
from .axis_env import current_mesh
from .collectives import (
    START,
    AllGather,
    AllToAll,
    Bound,
    Claim,
    Pcast,
    Pmax,
    Ppermute,
    Psum,
    PsumScatter,
    norm_dim,
    run,
    start,
)
from .mesh import AxisGroup, Mesh
from .spec import Layout

__all__ = [
    "Handler",
    "handling",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ragged_all_to_all",
    "ppermute",
    "ppermute_start",
    "pcast",
    "axis_index",
    "axis_size",
]


def _is_grad_leaf(t: torch.Tensor) -> bool:
    """Whether ``t`` is a leaf being differentiated (by autograd or an enclosing torch.func
    transform level), looking through vmap wrappers.

    While dynamo traces: never. It cannot tell (``grad_fn`` of an intermediate is refused,
    ``is_leaf`` reads False for torch.func.grad's inputs), and partial values in compiled code
    are the intermediates of op rules (a row-parallel matmul); differentiating a partial-layout
    *input* there is refused where the pytree rebuilds it (``array._unflatten``)."""
    if _dynamo_compiling():
        return False
    while True:
        if t.grad_fn is not None:
            return False
        if t.requires_grad:
            return True
        if not is_functorch_wrapped_tensor(t):
            return False
        t = get_unwrapped(t)


def claim(local: torch.Tensor, claim_op: Bound | None) -> torch.Tensor:
    """``local`` through ``claim_op`` (a bound :class:`~fshard.collectives.Claim` over the
    partial axes, see :func:`claim_of`) if it is a leaf being differentiated; otherwise
    ``local`` itself (an intermediate's cotangent stays invariant)."""
    if claim_op is None or not _is_grad_leaf(local):
        return local
    return apply(claim_op, local)


def claim_of(group: AxisGroup) -> Bound | None:
    """The bound :class:`~fshard.collectives.Claim` of a partial layout over ``group`` (None
    where nothing is claimed: a size-1 group)."""
    return None if group.size == 1 else Bound(Claim(group.axes), group)


class _Collective(torch.autograd.Function):
    """Runs bound op ``b`` (``done``: its result, already computed, e.g. by an asynchronous
    gather). Backward: a linear op's transpose through this same Function; a nonlinear op's
    ``vjp`` from its residuals.

    With ``done`` the result is a new tensor on ``done``'s data (``detach()``: an alias, not a
    view), never ``done`` itself: autograd gives a Function's output its history in place, so
    handing ``done`` back made the caller's tensor the op's result, and a second ``apply``
    with the same ``done`` (FSDP's invariant and varying gathers of one param) rewrote the
    first result's ``grad_fn``: its later uses were differentiated as the second op."""

    @staticmethod
    def forward(x, b, done):
        return run(b, x) if done is None else done[0].detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, b, _ = inputs
        ctx.b = b
        if not b.op.linear:
            saved = b.op.residuals(x, output)
            ctx.save_for_backward(*saved)
            ctx.save_for_forward(*saved)

    @staticmethod
    def backward(ctx, g):
        b = ctx.b
        if b.op.linear:
            return apply(b.transpose(), g), None, None
        return b.op.vjp(g, ctx.saved_tensors, _on(b.group)), None, None

    @staticmethod
    def jvp(ctx, x_t, _, __):
        b = ctx.b
        if b.op.linear:
            return apply(b, x_t)
        return b.op.jvp(x_t, ctx.saved_tensors, _on(b.group))

    @staticmethod
    def vmap(info, in_dims, x, b, done):
        if in_dims[0] is None:
            return apply(b, x), None
        x = x.movedim(in_dims[0], 0)
        return apply(b.batched(x.shape[0]), x), 0


def _on(group: AxisGroup):
    """``apply_here(op, t)``: what a nonlinear op's vjp/jvp runs its ops with."""
    return lambda op, t: apply(Bound(op, group), t)


def _traced_backward(ctx, g):
    # Compiled code is reverse mode only: a linear op's transpose runs bare.
    b = ctx.b
    if b.op.linear:
        return run(b.transpose(), g), None, None
    return b.op.vjp(g, ctx.saved_tensors, _on(b.group)), None, None


_CollectiveTraced = traced(_Collective, backward=_traced_backward)


class Handler:
    """One feature's say where a collective is applied: the one place every feature meets a
    collective, as every JAX transform meets a primitive in ``Trace.process_primitive``.

    :func:`apply` consults the active handlers innermost first (the last pushed with
    :func:`handling`); each gets the bound op, its input and ``done`` (the op's result when it
    was computed ahead) and ``proceed(b, x, done)``, which hands the op on to the next handler
    out and finally to the Function that runs it. A handler may change the op (mixed
    precision's reduce dtype), its input (the master param behind a cast), take it over
    (gradient sync's stand-in leaf, remat's saved result) or look at the result (shard_map's
    manual axes). The handlers, each living with its feature:

    ===============================================  ==========================================
    handler                                          what it does with a collective
    ===============================================  ==========================================
    ``fshard.remat``'s record / replay               saves the outputs its policy keeps, then
                                                     stands them in for the op in the recompute
    ``fshard.shard_map``'s manual axes               tags a partial-manual body's result with
                                                     the manual axes its input varies over
    ``fshard.module``'s mixed precision              a pcast of a cast param is taken on the
                                                     master, carrying the policy's reduce dtype
    ``fshard.gradsync.GradSync``                     a pcast of a differentiated param reads a
                                                     stand-in leaf whose gradient it reduces
                                                     once (bucketed, overlapped or per step)
    ===============================================  ==========================================

    With no handler active, :func:`apply` is one list test away from the Function.

    Example:
        >>> class Log(fs.lax.Handler):  # sees every collective the block applies
        ...     def __init__(self):
        ...         self.ops = []
        ...     def process(self, b, x, done, proceed):
        ...         self.ops.append(b.op.name)
        ...         return proceed(b, x, done)
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> log = Log()
        >>> with fs.lax.handling(log):
        ...     _ = fs.lax.all_gather(torch.ones(2), "x", mesh=mesh)
        >>> log.ops
        ['all_gather']
    """

    #: Whether it must see every collective's result as :func:`apply` makes it: nothing may be
    #: computed ahead (an FSDP prefetch, ``ppermute_start``) while it is active.
    sees_every_result: bool = False
    #: Whether a recompute of the code it saw runs under it again (``fs.remat``'s backward:
    #: shard_map's manual axes are part of the body's environment).
    recompute: bool = False

    def process(self, b: Bound, x: torch.Tensor, done, proceed) -> torch.Tensor:
        return proceed(b, x, done)


#: The active handlers, innermost last. A list, not a ContextVar, as ``axis_env``'s stack:
#: dynamo traces a global list's reads (a compiled step with no handler pays nothing).
_HANDLERS: list[Handler] = []


@contextlib.contextmanager
def handling(*handlers: Handler) -> Iterator[None]:
    """Make ``handlers`` active (the last innermost) for the block's collectives.

    Example:
        >>> class Count(fs.lax.Handler):
        ...     seen = 0
        ...     def process(self, b, x, done, proceed):
        ...         Count.seen += 1
        ...         return proceed(b, x, done)
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> with fs.lax.handling(Count()):
        ...     _ = fs.lax.psum(torch.ones(2), "x", mesh=mesh)
        >>> Count.seen
        1
    """
    for h in handlers:
        if not isinstance(h, Handler):
            raise TypeError(f"handling: expected fs.lax.Handler objects, got {type(h).__name__}")
    depth = len(_HANDLERS)
    _HANDLERS.extend(handlers)
    try:
        yield
    finally:
        del _HANDLERS[depth:]


def active_handlers() -> tuple[Handler, ...]:
    """The active handlers, outermost first (what :func:`handling` re-enters elsewhere: remat's
    recompute runs under the handlers its forward ran under)."""
    return tuple(_HANDLERS)


def apply(b: Bound, x: torch.Tensor, done: torch.Tensor | None = None) -> torch.Tensor:
    """Run bound collective op ``b`` on local tensor ``x`` (differentiable, vmappable), through
    the active :class:`Handler` s.

    ``done``: the op's result on ``x``, computed already (FSDP's prefetched gathers); the
    Function then only records the op for the backward. The result is a new tensor on
    ``done``'s data (not ``done``, not a view of it).

    A tensor no transform can see (:func:`fshard._function.untracked`: e.g. the input batch
    under ``torch.func.grad``, which wraps it but does not differentiate it) runs ``b``
    directly on the plain tensor: the Function would record nothing. Otherwise the Function runs
    through :func:`fshard._function.call`, which under ``torch.func.grad``/``jvp`` costs a
    fraction of ``Function.apply``'s per-call class building.
    """
    if not _HANDLERS:
        return _apply(b, x, done)
    return _process(len(_HANDLERS) - 1, b, x, done)


def _process(level: int, b: Bound, x: torch.Tensor, done) -> torch.Tensor:
    if level < 0:
        return _apply(b, x, done)
    return _HANDLERS[level].process(b, x, done, functools.partial(_process, level - 1))


def _apply(b: Bound, x: torch.Tensor, done: torch.Tensor | None) -> torch.Tensor:
    boxed = None if done is None else (done,)
    if _forward_ad._current_level >= 0:
        _refuse_linearize()
    if _dynamo_compiling():
        return traced_apply(_CollectiveTraced, x, b, boxed)
    plain = untracked(x)
    if plain is not None:
        return run(b, plain) if done is None else done
    return call(_Collective, x, b, boxed)


def _refuse_linearize() -> None:
    """``torch.func.linearize`` traces the jvp with ``make_fx`` and replays the graph later: a
    collective in that graph would run on one rank's replay only (a hang) or on stale buffers."""
    if get_proxy_mode() is not None:
        raise NotImplementedError(
            "torch.func.linearize cannot trace fshard collectives (it records a graph with "
            "make_fx and replays it later, outside the collective's process group schedule). "
            "Use torch.func.jvp(f, primals, tangents) for each tangent (or "
            "torch.func.vmap over jvp for many), or torch.func.jacfwd"
        )


# -- public named-axis API --------------------------------------------------------------------


def _group(axis, mesh: Mesh | None) -> AxisGroup:
    if not isinstance(axis, (str, tuple, list)):
        raise TypeError(
            f"axis must be a mesh axis name or a tuple of names, got {type(axis).__name__} {axis!r}"
        )
    return current_mesh(mesh).group(axis)


def _tensor(x, fn: str, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{fn}: {name} must be a torch.Tensor (a local block), got {type(x).__name__}; "
            "on a ShardedArray use fs.reshard / fs.gather, or call this inside fs.shard_map"
        )
    return x


def _blockwise(x, fn: str, collective, dims: Sequence[int] = (), linear: bool = True):
    """``collective(block)`` on a plain tensor; on a global-view value of a partial-manual
    ``shard_map`` body (a ShardedArray over the auto axes) the collective over manual axes maps
    each auto block (as GSPMD would): ``dims`` it resizes must not be split over the auto axes,
    and a nonlinear one needs a value that is not pending a sum."""
    if not isinstance(x, ShardedArray):
        return collective(_tensor(x, fn))
    lay = x.layout
    split = [d for d in range(x.ndim) if lay.dim_axes[d]]
    if lay.is_explicit or (not linear and lay.partial) or set(split) & set(dims):
        raise ValueError(
            f"{fn}: x is a ShardedArray laid out as {lay.spec} over {lay.mesh}; over a manual "
            f"axis {fn} maps its blocks only when the dims it changes ({list(dims)}) are not "
            "split over the auto axes"
            + ("" if linear else " and it is not partial")
            + ": fs.reshard(x, ...) it first"
        )
    y = collective(x.local)
    if y.dim() == x.ndim:
        shape = tuple(x.shape[d] if d in split else y.shape[d] for d in range(y.dim()))
    elif not split:
        shape = tuple(y.shape)
    else:
        raise ValueError(
            f"{fn}: x is split over the auto axes ({lay.spec}) and the result has another "
            "rank; fs.reshard(x, fs.P(partial=...)) to unsplit it first, or use tiled=True"
        )
    return ShardedArray._raw(y, Layout(lay.mesh, lay.spec, shape, y.dtype))


def _tracked(xs: list, g: AxisGroup, mesh: Mesh | None, run, varies: bool) -> list:
    """Run ``run(xs) -> list`` (the collective); inside a shard_map body also track varying axes.

    ``varies``: whether the result varies over ``g.axes`` (all_gather, psum_scatter, ...) or is
    invariant over them (psum, pmax, ...).
    """
    tracker = axis_env.tracker(mesh)
    if tracker is None:
        return run(xs)
    return tracker.collective(xs, g.axes, run, varies)


def _one(x, g, mesh, op, varies: bool) -> torch.Tensor:
    b = Bound(op, g)
    return _tracked([x], g, mesh, lambda xs: [apply(b, xs[0])], varies)[0]


def psum(x, axis: str | Sequence[str], *, mesh: Mesh | None = None, donate: bool = False):
    """Sum over mesh ``axis``: varying in, invariant out (all_reduce).

    Args:
        x: a tensor, or a pytree of tensors. A pytree is how data-parallel gradients are
            bucketed: leaves of one dtype are packed back to back into buffers of at most
            ``fs.lax.PSUM_BUCKET_BYTES`` (16 MiB; env ``FSHARD_PSUM_BUCKET_BYTES``; a larger
            leaf is its own bucket), one all_reduce per buffer, all launched before the first
            is waited on.
        axis: a mesh axis name or a tuple of names.
        mesh: the mesh; default the enclosing shard_map's.
        donate: JAX ``donate_argnums`` semantics for ``x``: its buffers may hold the result,
            so do not use ``x`` afterwards. Leaves of at least ``PSUM_INPLACE_MIN_BYTES``
            (1 MiB) are then reduced in place instead of being copied into a bucket (no copy,
            no fresh memory: on this CPU machine that is most of a data-parallel step's
            reduction cost). Leaves that take part in autograd or a ``torch.func`` transform,
            are not contiguous or share a buffer with another leaf are packed as usual. Without
            ``donate`` the inputs are never written.

    Returns:
        The sum, the same on every rank of ``axis``. Inside a shard_map body a value that is
        already invariant over ``axis`` sums to ``n * x`` (JAX semantics), gradient included.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> fs.lax.psum(torch.tensor(float(mesh.rank + 1)), "x", mesh=mesh)  # 1 + 2
        tensor(3.)
        >>> grads = {"w": torch.ones(2)}  # a whole gradient tree, bucketed
        >>> fs.lax.psum(grads, "x", mesh=mesh, donate=True)
        {'w': tensor([2., 2.])}
    """
    if not isinstance(donate, bool):
        raise TypeError(f"psum: donate must be a bool, got {donate!r}")
    g = _group(axis, mesh)
    if isinstance(x, torch.Tensor) and not donate:
        return _one(x, g, mesh, Psum(g.axes), varies=False)
    tops = optree.tree_leaves(x, is_leaf=lambda v: isinstance(v, ShardedArray))
    for i, leaf in enumerate(tops):
        # Summing blocks that split (or are pending over) the axis is the user's mistake
        # here; a value replicated over it sums its per-rank locals (local-view DDP code).
        if isinstance(leaf, ShardedArray) and set(g.axes) & leaf.layout.varying_axes:
            raise TypeError(
                f"psum: {'x' if isinstance(x, ShardedArray) else f'pytree leaf {i}'}"
                f" is a ShardedArray laid out over {g.axes} ({leaf.spec} on {leaf.mesh}): fs.lax "
                "collectives sum local blocks inside fs.shard_map (JAX refuses psum outside "
                "shard_map too). For a global value, fs.reshard(x, spec) moves it to another "
                "layout, and fs.from_local(block, mesh, fs.P(..., partial=axis), shape=...) "
                "declares per-rank addends whose sum fs.reshard then computes"
            )
    leaves, spec = optree.tree_flatten(x)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"psum: pytree leaf {i} is {type(leaf).__name__}, not a tensor")
    out = _tracked(leaves, g, mesh, lambda ls: _psum_bucketed(ls, g, donate), varies=False)
    return optree.tree_unflatten(spec, out)


#: Largest gradient bucket :func:`psum` of a pytree packs (bytes). Below glibc's 32 MiB mmap
#: ceiling a freed bucket's memory is reused by the next step's; above it every bucket is fresh
#: pages (measured on the 33 MB MLP: packing into fresh pages cost 24 ms, into reused 6 ms).
PSUM_BUCKET_BYTES = int(os.environ.get("FSHARD_PSUM_BUCKET_BYTES", 16 << 20))
#: Tensors at least this large are reduced in place (:func:`buckets`): donated leaves of
#: ``psum(..., donate=True)``, and ``fs.value_and_grad``'s gradients (autograd's own tensors).
PSUM_INPLACE_MIN_BYTES = 1 << 20


class Bucket(NamedTuple):
    """One all_reduce planned by :func:`buckets`: the tensors at positions ``idx``, packed back to
    back in that order, or (``own``) one tensor reduced in place in its own buffer."""

    idx: list[int]
    own: bool


def buckets(
    tensors: Sequence[torch.Tensor],
    groups: Sequence[AxisGroup],
    *,
    in_place: Container[int] | bool = (),
    order: str = "filled",
) -> list[Bucket]:
    """The bucketing of data-parallel reductions: :func:`psum` of a pytree and
    ``fs.value_and_grad``'s pcast hooks (``fshard.autodiff``) both cut their tensors here.

    Tensors reduced over ``groups[i]`` are bucketed per (group, dtype, device). A tensor of at
    least :data:`PSUM_INPLACE_MIN_BYTES` whose position is in ``in_place`` (``True``: any
    position) is a bucket of its own, reduced in place; the others are packed in list order
    into runs of at most :data:`PSUM_BUCKET_BYTES` (a larger tensor alone). Static: the same
    buckets on every rank for the same shapes. The order of the buckets (the order they are
    launched in, the comm log's order) is the caller's:

    * ``"filled"``: by each bucket's last tensor, the order the buckets fill when the tensors
      arrive in list order (``value_and_grad``: gradients arrive during the backward, and each
      bucket is launched as soon as it is full);
    * ``"in_place_first"``: the in-place buckets in list order, then the packed ones kind by
      kind (kinds in order of first appearance): ``psum`` of a pytree, where every tensor is
      ready at once; the in-place ones need no copy, so the wire starts before the first pack.
    """
    cap, min_own = PSUM_BUCKET_BYTES, PSUM_INPLACE_MIN_BYTES
    out: list[Bucket] = []
    last: list[int] = []  # per bucket: the position of its last tensor
    kind: list[int] = []  # per bucket: -1 in place, else its kind's order of first appearance
    open_: dict = {}  # kind key -> (bucket number, bytes so far)
    kinds: dict = {}
    for i, t in enumerate(tensors):
        n = _comm.nbytes(t)
        if n >= min_own and (in_place is True or (in_place is not False and i in in_place)):
            out.append(Bucket([i], True))
            last.append(i)
            kind.append(-1)
            continue
        g = groups[i]
        key = (g.axes, id(g.pg), t.dtype, t.device)
        k, size = open_.get(key, (None, 0))
        if k is None or size + n > cap:
            k, size = len(out), 0
            out.append(Bucket([], False))
            last.append(i)
            kind.append(kinds.setdefault(key, len(kinds)))
        out[k].idx.append(i)
        last[k] = i
        open_[key] = (k, size + n)
    if order == "filled":
        rank = last
    elif order == "in_place_first":
        rank = kind  # a stable sort: in place in list order, then each kind's runs in order
    else:
        raise ValueError(f"buckets: order must be 'filled' or 'in_place_first', got {order!r}")
    return [out[k] for k in sorted(range(len(out)), key=rank.__getitem__)]


def _reducible_in_place(leaves: list) -> set[int]:
    """Donated leaves that may hold their own sum: contiguous, plain, unshared (and, decided by
    :func:`buckets`, large)."""
    owners: dict = {}
    for leaf in leaves:
        key = _compat.storage_id(leaf)
        owners[key] = owners.get(key, 0) + 1
    return {
        i
        for i, leaf in enumerate(leaves)
        if leaf.is_contiguous() and owners[_compat.storage_id(leaf)] == 1
    }


def _psum_bucketed(leaves: list, g: AxisGroup, donate: bool = False) -> list:
    out = list(leaves)
    groups = [g] * len(leaves)
    plain = [untracked(leaf) for leaf in leaves]
    if any(p is None for p in plain):
        for b in buckets(leaves, groups, order="in_place_first"):
            _unpack(out, leaves, b.idx, apply(Bound(Psum(g.axes), g), _flat(leaves, b.idx)))
        return out
    leaves, out = plain, list(plain)
    # No autograd or transform: every all_reduce is launched before the first is waited on
    # (packing bucket k+1 overlaps bucket k on the wire), each in place on a buffer we own: a
    # packed bucket, or a donated leaf.
    own = _reducible_in_place(leaves) if donate else ()
    launched = [
        (
            b,
            *_comm.all_reduce_start(
                leaves[b.idx[0]] if b.own else _flat(leaves, b.idx), g, inplace=True
            ),
        )
        for b in buckets(leaves, groups, in_place=own, order="in_place_first")
    ]
    for _, _, work in launched:
        if work is not None:
            work.wait()
    for b, flat, _ in launched:
        if b.own:
            out[b.idx[0]] = flat
        else:
            _unpack(out, leaves, b.idx, flat)
    return out


def _flat(leaves: list, idx: list[int]) -> torch.Tensor:
    """A new contiguous 1-D buffer holding ``leaves[idx]`` back to back."""
    return torch.cat([leaves[i].reshape(-1) for i in idx])


def _unpack(out: list, leaves: list, idx: list[int], flat: torch.Tensor) -> None:
    for i, piece in zip(idx, torch.split(flat, [leaves[i].numel() for i in idx])):
        out[i] = piece.view_as(leaves[i])


def pmean(x, axis: str | Sequence[str], *, mesh: Mesh | None = None, donate: bool = False):
    """Mean over mesh ``axis`` (psum, then divide by the axis size).

    Args:
        x: a tensor or a pytree of tensors.
        axis: a mesh axis name or a tuple of names.
        mesh: the mesh; default the enclosing shard_map's.
        donate: as in :func:`psum`.

    Returns:
        The mean, the same on every rank of ``axis``. Outside autograd the division runs in
        place on the sums (buffers psum allocated, or the donated inputs).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> fs.lax.pmean(torch.tensor(float(mesh.rank)), "x", mesh=mesh)  # (0 + 1) / 2
        tensor(0.5000)
    """
    n = _group(axis, mesh).size
    summed = psum(x, axis, mesh=mesh, donate=donate)
    if n == 1:
        return summed
    return optree.tree_map(lambda t: t.div_(n) if untracked(t) is t else t / n, summed)


def _preduce(x, axis, mesh, how: str) -> torch.Tensor:
    g = _group(axis, mesh)
    return _blockwise(
        x, f"p{how}", lambda t: _one(t, g, mesh, Pmax(g.axes, how), varies=False), linear=False
    )


def pmax(x: torch.Tensor, axis: str | Sequence[str], *, mesh: Mesh | None = None) -> torch.Tensor:
    """Elementwise max over mesh ``axis``; the gradient goes to the maxima (ties share it).

    Args:
        x: this rank's tensor.
        axis: a mesh axis name or a tuple of names.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        The elementwise maximum, the same on every rank of ``axis``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> fs.lax.pmax(torch.tensor([mesh.rank, -mesh.rank]), "x", mesh=mesh)
        tensor([1, 0])
    """
    return _preduce(x, axis, mesh, "max")


def pmin(x: torch.Tensor, axis: str | Sequence[str], *, mesh: Mesh | None = None) -> torch.Tensor:
    """Elementwise min over mesh ``axis``; the gradient goes to the minima (ties share it).

    Args:
        x: this rank's tensor.
        axis: a mesh axis name or a tuple of names.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        The elementwise minimum, the same on every rank of ``axis``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> fs.lax.pmin(torch.tensor([mesh.rank, -mesh.rank]), "x", mesh=mesh)
        tensor([ 0, -1])
    """
    return _preduce(x, axis, mesh, "min")


def all_gather(
    x: torch.Tensor,
    axis: str | Sequence[str],
    *,
    dim: int = 0,
    tiled: bool = True,
    sizes: Sequence[int] | None = None,
    to: str = "varying",
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Gather every rank's ``x`` along ``dim`` in axis order.

    Args:
        x: this rank's block.
        axis: mesh axis name or tuple of names (first most significant).
        dim: dim to concatenate along (``tiled=True``) or to insert (``tiled=False``).
        tiled: concatenate (True) or stack along a new dim (False), as in JAX.
        sizes: per-rank sizes along ``dim`` when they differ (uneven blocks); default equal.
        to: ``"varying"`` (JAX's default: the transpose is ``psum_scatter``) or
            ``"invariant"`` (the result is the same on every rank and its cotangent is taken as
            invariant: the transpose keeps the local block, no communication).
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        The gathered tensor (the same values on every rank of ``axis``).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> block = torch.full((1, 2), float(mesh.rank))  # this rank's row
        >>> fs.lax.all_gather(block, "x", dim=0, mesh=mesh)
        tensor([[0., 0.],
                [1., 1.]])
    """
    if isinstance(x, ShardedArray):
        d = norm_dim(dim, x.ndim + (0 if tiled else 1))
        return _blockwise(
            x,
            "all_gather",
            lambda t: all_gather(t, axis, dim=d, tiled=tiled, sizes=sizes, to=to, mesh=mesh),
            (d,) if tiled else (),
        )
    _tensor(x, "all_gather")
    if to not in ("varying", "invariant"):
        raise ValueError(f"all_gather: to must be 'varying' or 'invariant', got {to!r}")
    g = _group(axis, mesh)
    if not tiled:
        if sizes is not None:
            raise ValueError("all_gather: sizes= needs tiled=True (untiled blocks are equal)")
        x = x.unsqueeze(norm_dim(dim, x.dim() + 1))
    d = norm_dim(dim, x.dim())
    sizes = _check_sizes(sizes, g.size, "all_gather", x.shape[d] if x.dim() else 0, g.index)
    op = AllGather(g.axes, d, sizes, invariant=(to == "invariant"))
    return _one(x, g, mesh, op, varies=(to == "varying"))


def _check_sizes(sizes, n, name, local, index):
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"{name}: sizes must be a sequence of ints, got {sizes!r}")
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != n:
        raise ValueError(f"{name}: sizes has {len(sizes)} entries; the axis has {n} ranks")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{name}: sizes must be >= 0, got {sizes}")
    if sizes[index] != local:
        raise ValueError(
            f"{name}: sizes[{index}] = {sizes[index]} but this rank's block has size {local}"
        )
    return sizes


def psum_scatter(
    x: torch.Tensor,
    axis: str | Sequence[str],
    *,
    dim: int = 0,
    tiled: bool = True,
    sizes: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Sum over ``axis`` and keep this rank's block of ``dim`` (reduce-scatter).

    Args:
        x: this rank's addend (the full extent of ``dim``).
        axis: a mesh axis name or a tuple of names.
        dim: the dim to scatter.
        tiled: with ``False`` the size of ``dim`` must equal the axis size and the dim is
            removed (JAX ``tiled=False``).
        sizes: uneven block sizes, one per rank, summing to the size of ``dim``.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        This rank's block of the sum.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> partial = torch.arange(4.0) * (mesh.rank + 1)  # addends of 3 * arange(4)
        >>> block = fs.lax.psum_scatter(partial, "x", dim=0, mesh=mesh)  # this rank's half of the sum
        >>> torch.equal(block, 3 * torch.arange(4.0)[2 * mesh.rank : 2 * mesh.rank + 2])
        True
    """
    if isinstance(x, ShardedArray):
        d = norm_dim(dim, x.ndim)
        return _blockwise(
            x,
            "psum_scatter",
            lambda t: psum_scatter(t, axis, dim=d, tiled=tiled, sizes=sizes, mesh=mesh),
            (d,),
        )
    _tensor(x, "psum_scatter")
    g = _group(axis, mesh)
    d = norm_dim(dim, x.dim())
    if not tiled:
        if sizes is not None:
            raise ValueError("psum_scatter: sizes= needs tiled=True")
        if x.shape[d] != g.size:
            raise ValueError(
                f"psum_scatter(tiled=False): dim {d} has size {x.shape[d]}, must equal the axis "
                f"size {g.size}"
            )
        return _one(x, g, mesh, PsumScatter(g.axes, d, None), varies=True).squeeze(d)
    if sizes is not None:
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise TypeError(f"psum_scatter: sizes must be a sequence of ints, got {sizes!r}")
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != g.size or sum(sizes) != x.shape[d] or any(s < 0 for s in sizes):
            raise ValueError(
                f"psum_scatter: sizes {sizes} must have {g.size} entries >= 0 summing to "
                f"{x.shape[d]} (the size of dim {d})"
            )
    elif x.shape[d] % g.size:
        raise ValueError(
            f"psum_scatter: dim {d} has size {x.shape[d]}, not divisible by the axis size "
            f"{g.size}; pass sizes= for uneven blocks"
        )
    return _one(x, g, mesh, PsumScatter(g.axes, d, sizes), varies=True)


def all_to_all(
    x: torch.Tensor,
    axis: str | Sequence[str],
    split_dim: int,
    concat_dim: int,
    *,
    tiled: bool = True,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Split ``split_dim`` into one block per rank, send block ``j`` to rank ``j``, and
    concatenate what arrives along ``concat_dim``.

    Args:
        x: this rank's tensor.
        axis: a mesh axis name or a tuple of names.
        split_dim: the dim cut into ``n`` equal blocks.
        concat_dim: the dim the received blocks are concatenated along.
        tiled: ``True`` keeps the rank (JAX ``tiled=True``); ``False`` needs ``split_dim`` of
            size ``n``, removes it and inserts a new dim of size ``n`` (indexed by the source
            rank) at ``concat_dim`` of the result, as JAX ``tiled=False``.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        The exchanged tensor.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = torch.full((1, 4), float(mesh.rank))  # rows split: this rank's row
        >>> y = fs.lax.all_to_all(x, "x", split_dim=1, concat_dim=0, mesh=mesh)  # now columns split
        >>> y
        tensor([[0., 0.],
                [1., 1.]])
    """
    if isinstance(x, ShardedArray):
        s_, c_ = norm_dim(split_dim, x.ndim), norm_dim(concat_dim, x.ndim)
        return _blockwise(
            x,
            "all_to_all",
            lambda t: all_to_all(t, axis, s_, c_, tiled=tiled, mesh=mesh),
            (s_, c_),
        )
    _tensor(x, "all_to_all")
    g = _group(axis, mesh)
    s, c = norm_dim(split_dim, x.dim(), "split_dim"), norm_dim(concat_dim, x.dim(), "concat_dim")
    if not tiled:
        if x.shape[s] != g.size:
            raise ValueError(
                f"all_to_all(tiled=False): split_dim {s} has size {x.shape[s]}, must equal the "
                f"axis size {g.size}"
            )
        y = _one(x, g, mesh, AllToAll(g.axes, s, s), varies=True)
        return y.movedim(s, c)
    if x.shape[s] % g.size:
        raise ValueError(
            f"all_to_all: split_dim {s} has size {x.shape[s]}, not divisible by the axis size "
            f"{g.size}"
        )
    return _one(x, g, mesh, AllToAll(g.axes, s, c), varies=True)


def ragged_all_to_all(
    x: torch.Tensor,
    axis: str | Sequence[str],
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int] | None = None,
    *,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Send rows ``[sum(send_sizes[:j]), sum(send_sizes[:j+1]))`` of ``x`` to rank ``j`` of
    ``axis``; concatenate the rows that arrive, in rank order (JAX's ``ragged_all_to_all`` with
    contiguous pieces; MoE token dispatch). Each rank has its own sizes; only those rows move.

    The transpose (the backward) is the reverse exchange: ``recv_sizes`` out, ``send_sizes`` in.

    Args:
        x: this rank's rows (dim 0).
        axis: a mesh axis name or a tuple of names.
        send_sizes: rows for each rank of ``axis`` (ints summing to ``x.shape[0]``).
        recv_sizes: rows arriving from each rank; ``None``: exchanged first (one small
            all_gather of the sizes, logged as ``size_exchange``).
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        ``(sum(recv_sizes), *x.shape[1:])``, varying over ``axis``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = torch.arange(3.0) + 10 * mesh.rank  # rank 0: [0, 1, 2], rank 1: [10, 11, 12]
        >>> sizes = [1, 2] if mesh.rank == 0 else [2, 1]  # rank 0 keeps 1 row, sends 2
        >>> y = fs.lax.ragged_all_to_all(x, "x", sizes, mesh=mesh)
        >>> y.tolist() == ([0.0, 10.0, 11.0] if mesh.rank == 0 else [1.0, 2.0, 12.0])
        True
    """
    _tensor(x, "ragged_all_to_all")
    g = _group(axis, mesh)
    send = tuple(operator.index(s) for s in send_sizes)
    if len(send) != g.size or sum(send) != (x.shape[0] if x.dim() else -1) or min(send) < 0:
        raise ValueError(
            f"ragged_all_to_all: send_sizes must be {g.size} non-negative ints (one per rank of "
            f"{g.axes}) summing to x.shape[0]; got {list(send_sizes)} for x of shape "
            f"{tuple(x.shape)}"
        )
    if recv_sizes is None:
        recv = tuple(row[g.index] for row in _comm.size_exchange(send, g, x.device))
    else:
        recv = tuple(operator.index(s) for s in recv_sizes)
        if len(recv) != g.size or min(recv) < 0:
            raise ValueError(
                f"ragged_all_to_all: recv_sizes must be {g.size} non-negative ints, got "
                f"{list(recv_sizes)}"
            )
    return _one(x, g, mesh, AllToAll(g.axes, 0, 0, send, recv), varies=True)


def ppermute(
    x: torch.Tensor,
    axis: str | Sequence[str],
    perm: Sequence[tuple[int, int]],
    *,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Send ``x`` from axis index ``src`` to ``dst`` for each pair in ``perm``; ranks that
    receive nothing get zeros (JAX semantics). The transpose is the inverse permutation.

    Args:
        x: this rank's tensor (every rank of ``axis`` passes the same shape).
        axis: a mesh axis name or a tuple of names.
        perm: pairs ``(src, dst)`` of positions along ``axis``; each used at most once.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        What this rank received (zeros if nothing).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = torch.tensor([float(mesh.rank)])
        >>> y = fs.lax.ppermute(x, "x", [(0, 1), (1, 0)], mesh=mesh)  # swap with the neighbour
        >>> float(y) == 1 - mesh.rank
        True
    """
    if isinstance(x, ShardedArray):
        return _blockwise(x, "ppermute", lambda t: ppermute(t, axis, perm, mesh=mesh))
    g, op = _ppermute_op(x, axis, perm, mesh, "ppermute")
    return _one(x, g, mesh, op, varies=True)


def _ppermute_op(x, axis, perm, mesh: Mesh | None, fn: str) -> tuple[AxisGroup, Ppermute]:
    _tensor(x, fn)
    g = _group(axis, mesh)
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(
            f"{fn}: perm must be a sequence of (src, dst) int pairs, got {perm!r}"
        ) from None
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"{fn}: perm {list(pairs)} must use each source and destination once")
    if any(not 0 <= i < g.size for i in srcs + dsts):
        raise ValueError(f"{fn}: perm {list(pairs)} has indices outside [0, {g.size})")
    return g, Ppermute(g.axes, pairs)


def ppermute_start(
    x: torch.Tensor,
    axis: str | Sequence[str],
    perm: Sequence[tuple[int, int]],
    *,
    mesh: Mesh | None = None,
) -> _comm.Pending:
    """:func:`ppermute` put on the wire now, its result taken later: ``.wait()`` returns what
    ``ppermute(x, axis, perm)`` returns (differentiable: the backward is the inverse
    permutation, run when the backward reaches it). Compute issued between the two overlaps the
    transfer (ring attention sends the next key/value block while it computes on this one).

    The transfer is asynchronous under no transform, autograd and ``torch.func.grad`` levels
    (the plain data under them is sent). Under ``vmap``, ``jvp``, ``torch.compile``, tracing
    or :func:`fshard.remat`, whose collectives must run where the transform sees them, it runs
    here as :func:`ppermute` and ``.wait()`` returns its result.

    Args:
        x, axis, perm, mesh: as in :func:`ppermute` (a local tensor, not a ShardedArray).

    Returns:
        A pending transfer; ``.wait()`` gives what this rank received (zeros if nothing).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = torch.tensor([float(mesh.rank)])
        >>> pending = fs.lax.ppermute_start(x, "x", [(0, 1), (1, 0)], mesh=mesh)
        >>> busy = torch.ones(64, 64) @ torch.ones(64, 64)  # overlaps the transfer
        >>> float(pending.wait()) == 1 - mesh.rank
        True
    """
    g, op = _ppermute_op(x, axis, perm, mesh, "ppermute_start")
    b = Bound(op, g)
    if not computable_ahead():
        return _comm.Pending(_one(x, g, mesh, op, varies=True))
    launched = _launch(b, x)
    out = _tracked([x], g, mesh, lambda xs: [apply(b, xs[0], done=launched.buffer)], True)[0]
    return launched.landing_in(out)


def apply_start(b: Bound, x: torch.Tensor, ahead: _comm.Pending | None = None) -> _comm.Pending:
    """:func:`apply` of ``b`` on ``x`` with the op put on the wire now and its result taken
    later: ``.result()`` returns what ``apply(b, x)`` returns once what this rank receives has
    arrived; ``.wait()`` also waits for what it sent (a ppermute's sends, which ``.result()``
    leaves in flight: a pipeline waits for its received activations where it uses them and
    for its sends by the end of its step, as ``torch.distributed.pipelining`` does).

    The op goes through the active :class:`Handler` s here, at launch, in the order ops are
    issued (``done=`` the buffer the result lands in, which nothing may read before
    ``.result()``), and is recorded in ``fs.debug.comm_log()`` here too. Asynchronous for the
    ops with an asynchronous lowering (``fshard.collectives.START``: ppermute, psum) where
    :func:`computable_ahead`; otherwise it runs here as :func:`apply`, and ``.result()``
    returns its result.

    ``ahead``: this rank's receives of this op, posted earlier on the wire by
    :func:`fshard._comm.receive_ahead` (a pipeline posts each tick's receives as the tick
    begins, so that what arrives lands while it computes); only where the op is launched here
    (``computable_ahead()``), else a ``ValueError``: the op run synchronously would post its
    receives again.

    Example:
        >>> from fshard.collectives import Bound, Ppermute
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> b = Bound(Ppermute(("x",), ((0, 1),)), mesh.group("x"))
        >>> pending = fs.lax.apply_start(b, torch.full((2,), float(mesh.rank + 1)))
        >>> got = pending.result()  # rank 1: tensor([1., 1.]); rank 0: zeros
        >>> _ = pending.wait()  # rank 0's send done too
    """
    if type(b.op) not in START or not computable_ahead():
        if ahead is not None:
            why = "no asynchronous lowering" if type(b.op) not in START else "not computable ahead"
            raise ValueError(
                f"apply_start: ahead= given for {b.op.name}, which runs synchronously here "
                f"({why}); post receives ahead only where the op is launched"
            )
        return _comm.Pending(apply(b, x))
    launched = _launch(b, x, ahead)
    return launched.landing_in(apply(b, x, done=launched.buffer))


_NO_LEVELS = contextlib.nullcontext()  # reusable: it holds nothing


def _launch(b: Bound, x: torch.Tensor, ahead: _comm.Pending | None = None) -> _comm.Pending:
    """``b`` put on the wire on ``x``'s plain data (under ``torch.func.grad`` levels)."""
    data = x
    while is_functorch_wrapped_tensor(data):
        data = get_unwrapped(data)
    # plain tensors stay plain under grad levels (none to clear: no context manager to enter)
    levels = temporarily_clear_interpreter_stack() if get_interpreter_stack() else _NO_LEVELS
    with levels:
        return start(b, data.detach(), ahead)


def computable_ahead() -> bool:
    """Whether a collective's result may be computed ahead of the Function that records it
    (``apply(..., done=)``) on the plain data: no transform but autograd and
    ``torch.func.grad`` levels, no tracing, no active :class:`Handler` that must see every
    result (remat's policies).

    Example:
        >>> fs.lax.computable_ahead()  # eager, no transform
        True
    """
    if (
        any(h.sees_every_result for h in _HANDLERS)
        or _forward_ad._current_level >= 0
        or _dynamo_compiling()
        or _comm.tracing()
    ):
        return False
    stack = get_interpreter_stack() or ()
    return all(ci.key() == TransformType.Grad for ci in stack)


def pcast(
    x: torch.Tensor, axis: str | Sequence[str], to: str = "varying", *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Mark an invariant value as varying over ``axis``: no forward communication; the
    gradient is summed over the axis (psum) so a replicated operand's gradient is reduced once.

    Inside a shard_map body fshard inserts this automatically where an invariant operand meets
    a varying one; axes the value already varies over are left alone.

    Args:
        x: the (invariant) tensor.
        axis: a mesh axis name or a tuple of names.
        to: only ``"varying"``.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        ``x`` (same values), typed varying over ``axis``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = torch.ones(2, requires_grad=True)  # the same on every rank (invariant)
        >>> loss = (fs.lax.pcast(w, "x", mesh=mesh) * (mesh.rank + 1)).sum()  # meets varying data
        >>> torch.autograd.grad(loss, w)[0]  # the backward sums over x: 1 + 2
        tensor([3., 3.])
    """
    if isinstance(x, ShardedArray):
        return _blockwise(x, "pcast", lambda t: pcast(t, axis, to, mesh=mesh))
    _tensor(x, "pcast")
    if to != "varying":
        raise ValueError(f"pcast: only to='varying' is supported, got {to!r}")
    g = _group(axis, mesh)
    tracker = axis_env.tracker(mesh)
    if tracker is not None:
        return tracker.pcast(x, g.axes)
    return apply(Bound(Pcast(g.axes), g), x)


def axis_index(axis: str | Sequence[str], *, mesh: Mesh | None = None) -> int:
    """This rank's position along ``axis`` (a tuple is linearised, first axis most significant).

    Args:
        axis: a mesh axis name or a tuple of names.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        Inside a ``shard_map`` body (of this mesh): a 0-dim int64 tensor that *varies* over
        ``axis``, as in JAX, so values built from it are tracked as varying (a replicated
        operand multiplied by it is ``pcast`` first, and its gradient is reduced once). It
        indexes and slices like an int. Outside a body: a Python int.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> int(fs.lax.axis_index("x", mesh=mesh)) == mesh.rank
        True
    """
    m = current_mesh(mesh)
    index = m.axis_index(axis)
    tracker = axis_env.tracker(mesh)
    if tracker is None:
        return index
    out = torch.tensor(index, dtype=torch.int64, device=m.device())
    tracker.tag(out, frozenset(m.axes_tuple(axis)))
    return out


def axis_size(axis: str | Sequence[str], *, mesh: Mesh | None = None) -> int:
    """Number of ranks along ``axis``.

    Args:
        axis: a mesh axis name or a tuple of names.
        mesh: the mesh; default the enclosing shard_map's.

    Returns:
        A Python int.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> fs.lax.axis_size("x", mesh=mesh)
        2
    """
    return current_mesh(mesh).size(axis)
