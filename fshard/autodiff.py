"""``value_and_grad`` / ``grad`` shaped like JAX's, with DDP-style overlapped gradient reduction.

At top level (no ``torch.func`` transform active, no input taking part in an outer autograd
graph) the function runs on detached leaves with ``requires_grad`` and differentiates with
``torch.autograd.backward(loss, inputs=leaves)`` (gradients taken from the fresh leaves'
``.grad``, which the caller never sees): no per-level wrapping, no functorch Function machinery, the speed of a
hand-written ``.backward()``. Under any ``torch.func`` transform (``grad``, ``vmap``, ``jvp``,
...) it is ``torch.func.grad_and_value``, so grad of grad, ``vmap`` of it and forward mode
compose exactly.

Where the data-parallel reduction happens. A replicated value's gradient is summed over an
axis exactly once, at the ``pcast`` where it met varying data (DESIGN §4); under
``torch.func`` that is one all_reduce per ``pcast`` in its backward, run late (the Function's
node was created early in the forward, and the engine runs low sequence numbers last) and
unbucketed. On the top-level path a ``pcast`` of a differentiated leaf instead returns a *new
leaf* ``v`` (same values, no history). ``v``'s gradient is the varying cotangent at that pcast,
and nothing else: uses of the param outside the pcast (weight decay in the loss, an invariant
branch) reach the param itself, never ``v``, so they are not summed over ranks. A
post-accumulate-grad hook on ``v`` (the engine runs it as soon as ``v``'s last use is
back-propagated, like DDP's AccumulateGrad hooks) takes ``v.grad``, a tensor no one else holds
(AccumulateGrad steals an unshared cotangent and clones a shared one), and puts it in its
bucket; a full bucket is all-reduced asynchronously while the rest of the backward runs. A
gradient of at least ``fs.lax.PSUM_INPLACE_MIN_BYTES`` is a bucket of its own, reduced in place
in the tensor autograd made (no copy, no extra memory); smaller ones of one group and dtype are
copied into a packed buffer of up to ``fs.lax.PSUM_BUCKET_BYTES``, reused across calls once
the gradients returned from it (views) are gone. Buckets are cut in reverse forward order and
launched in the order they fill, the same on every rank. After the backward the param's
gradient is its own (outside) gradient plus the reduced bucket slices::

    op on the top-level path     forward                  backward
    pcast(w, axis), w a leaf     new leaf v (no comm)     hook: v.grad into its bucket; full
                                                          bucket -> async all_reduce;
                                                          grad w = slice (+ w's own grad)
    any other pcast / collective as in fshard.lax         as in fshard.lax

Returned gradients never alias a buffer a later call writes: in-place ones are fresh tensors,
packed ones views of a buffer reused only once nothing references it.

A pcast of anything other than a differentiated leaf itself (a cast or slice of a param)
keeps ``fshard.lax``'s Function, whose backward all-reduces at once: correct, not bucketed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

# torch's pytree registry (the nodes torch.func.grad sees, ShardedArray included), walked in C++
import torch.utils._cxx_pytree as pytree

from . import _comm, _export, lax
from .api import gather
from .array import ShardedArray, is_sharded
from .mesh import AxisGroup

__all__ = ["value_and_grad", "grad"]


def _check_argnums(argnums, nargs: int | None) -> tuple[int, ...]:
    """``argnums`` as a tuple of non-negative indices (range-checked against ``nargs``)."""
    single = isinstance(argnums, int) and not isinstance(argnums, bool)
    nums = (argnums,) if single else argnums
    if (
        not isinstance(nums, tuple)
        or not nums
        or any(isinstance(i, bool) or not isinstance(i, int) for i in nums)
    ):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    if nargs is None:
        return nums
    for i in nums:
        if not -nargs <= i < nargs:
            raise ValueError(
                f"argnums={argnums!r}: index {i} is out of range for {nargs} positional arguments"
            )
    return tuple(i % nargs for i in nums)


def _tensor_loss(out, has_aux: bool):
    """``out`` with a ShardedArray loss (a replicated or pending scalar, as global-view code
    computes it) as the plain tensor ``fs.gather`` gives: a replicated one is its local value
    (no communication), a pending sum is all-reduced."""
    loss = out[0] if has_aux and isinstance(out, tuple) and len(out) == 2 else out
    if not isinstance(loss, ShardedArray):
        return out
    loss = gather(loss)
    return (loss, out[1]) if has_aux else loss


def _scalar_loss(out, has_aux: bool):
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "value_and_grad(has_aux=True): f must return a pair (loss, aux), got "
                f"{type(out).__name__}"
            )
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)
        raise TypeError(
            f"value_and_grad: f must return a scalar loss (a torch.Tensor or a one-element "
            f"ShardedArray), got {what}"
        )
    return loss, aux


#: Packed-bucket buffers kept between calls, per (numel, dtype, device), as DDP keeps its
#: buckets: on CPU a fresh multi-MiB buffer is fresh pages every step (the faults cost more than
#: the copy). A buffer is reused only once nothing else references its storage (the gradients
#: returned from it, which are views, are gone), so returned gradients are never overwritten.
_POOL: dict[tuple, list[torch.Tensor]] = {}
_POOL_DEPTH = 2


def _buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    free = _POOL.setdefault((numel, like.dtype, like.device), [])
    for buf in free:
        # 2: the pool's tensor and the temporary storage object of this call
        if torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2:
            return buf.view(numel)  # a new tensor: it holds the storage while in use
    buf = like.new_empty(numel)
    if len(free) < _POOL_DEPTH:
        free.append(buf)
    return buf.view(numel)


class _Bucket:
    """One all_reduce: ``entries`` = ``[(entry, offset, numel)]``. ``own``: a single large
    gradient reduced in place in the tensor autograd accumulated (no copy); otherwise the
    entries are packed into a pooled buffer."""

    __slots__ = ("group", "entries", "numel", "own", "flat", "pending", "work")

    def __init__(self, group: AxisGroup, own: bool):
        self.group, self.own, self.entries, self.numel = group, own, [], 0
        self.flat, self.pending, self.work = None, 0, None

    def add(self, k: int, numel: int) -> None:
        self.entries.append((k, self.numel, numel))
        self.numel += numel
        self.pending += 1


class _Reducer:
    """The top-level pcast hook (see the module docstring) for one value_and_grad call."""

    def __init__(self, leaves: list[torch.Tensor]):
        self.leaves = leaves
        self.index = {id(t): i for i, t in enumerate(leaves)}
        self.entries: list[tuple[int, AxisGroup, torch.Tensor]] = []  # (leaf, group, v)
        self.buckets: list[_Bucket] | None = None
        self.slot: dict[int, tuple[_Bucket, int]] = {}  # entry -> (its bucket, offset)
        self.next = 0  # the first bucket not launched yet
        self.arrived: set[int] = set()

    def pcast(self, x: torch.Tensor, group: AxisGroup) -> torch.Tensor | None:
        i = self.index.get(id(x))
        if (
            i is None
            or self.leaves[i] is not x
            or self.buckets is not None
            or not torch.is_grad_enabled()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        v = x.detach().requires_grad_()
        k = len(self.entries)
        self.entries.append((i, group, v))
        # After AccumulateGrad: v.grad is then a tensor no one else holds (the engine steals an
        # unshared gradient or clones a shared one), so it may be reduced in place.
        v.register_post_accumulate_grad_hook(functools.partial(self._ready, k))
        return v

    def _plan(self) -> None:
        """Cut the entries, last registered first (the order their gradients are expected),
        with ``fs.lax.buckets`` (the bucketing ``fs.lax.psum`` of a pytree uses): per (group,
        dtype, device), a gradient of at least ``fs.lax.PSUM_INPLACE_MIN_BYTES`` alone
        (reduced in place: autograd made it, nobody else holds it), smaller ones packed up to
        ``fs.lax.PSUM_BUCKET_BYTES``. Buckets are launched in the order they are expected to
        fill (by their last entry): static, so the same on every rank."""
        ks = list(reversed(range(len(self.entries))))
        vs = [self.entries[k][2] for k in ks]
        groups = [self.entries[k][1] for k in ks]
        self.buckets = []
        for cut in lax.buckets(vs, groups, in_place=True, order="filled"):
            b = _Bucket(groups[cut.idx[0]], own=cut.own)
            for pos in cut.idx:
                self.slot[ks[pos]] = (b, b.numel)
                b.add(ks[pos], vs[pos].numel())
            self.buckets.append(b)

    def _ready(self, k: int, v: torch.Tensor) -> None:
        if self.buckets is None:
            self._plan()
        g, v.grad = v.grad, None
        b, off = self.slot[k]
        if b.own:
            b.flat = g.contiguous().view(-1)
        else:
            if b.flat is None:
                b.flat = _buffer(b.numel, g)
            b.flat[off : off + g.numel()].view_as(g).copy_(g)
        self.arrived.add(k)
        b.pending -= 1
        self._launch_ready()

    def _launch_ready(self, flush: bool = False) -> None:
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if b.pending:
                if not flush:
                    return
                # cotangents that never arrived (the pcast did not reach the loss): zeros
                if b.flat is None:
                    like = self.entries[b.entries[0][0]][2]
                    b.flat = (like.new_empty(b.numel) if b.own else _buffer(b.numel, like)).zero_()
                else:
                    for k, off, size in b.entries:
                        if k not in self.arrived:
                            b.flat[off : off + size].zero_()
                b.pending = 0
            _, b.work = _comm.all_reduce_start(b.flat, b.group, inplace=True)
            self.next += 1

    def finish(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Add every leaf's reduced pcast cotangents to its own gradient ``grads[i]`` (which
        this call owns: accumulated by autograd into a fresh leaf)."""
        if not self.entries:
            return grads
        if self.buckets is None:  # no pcast output reached the loss
            self._plan()
        self._launch_ready(flush=True)
        out = list(grads)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            for k, off, size in b.entries:
                i, _, v = self.entries[k]
                piece = b.flat[off : off + size].view(v.shape)
                out[i] = piece if out[i] is None else piece.add_(out[i])
        return out

    def close(self) -> None:
        """Drop every tensor this call held. The reducer object itself may outlive the call for
        a moment (a reference released after the call returns): what it held must not, or
        each step's gradients stay alive into the next one (fresh pages)."""
        self.leaves, self.index, self.entries, self.buckets, self.slot = [], {}, [], [], {}


def _requires_grad(tree) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_iter(tree))


def _detach(tree):
    if tree is None:
        return None
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _fresh_leaves(i: int, arg) -> tuple[list[torch.Tensor], list, object, object]:
    """Argument ``i`` flattened once (ShardedArrays as leaves): its tensors detached into fresh
    leaves that require grad, each leaf's layout (``None`` for a plain tensor), the tree spec,
    and the argument rebuilt on the fresh leaves (ShardedArrays rebuilt directly: no pytree
    callback)."""
    leaves, spec = pytree.tree_flatten(arg, is_leaf=is_sharded)
    tensors, layouts, rebuilt = [], [], []
    for j, x in enumerate(leaves):
        layout = x.layout if is_sharded(x) else None
        t = x.local if layout is not None else x
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"value_and_grad: argument {i} leaf {j} is "
                f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}; "
                "differentiated arguments must be pytrees of floating-point tensors or "
                "ShardedArrays (pass the others as arguments not in argnums)"
            )
        t = t.detach().requires_grad_()
        tensors.append(t)
        layouts.append(layout)
        rebuilt.append(t if layout is None else ShardedArray._raw(t, layout))
    return tensors, layouts, spec, pytree.tree_unflatten(rebuilt, spec)


def _top_level(f, nums, has_aux, args, kwargs):
    every, layouts, specs = [], [], []
    new_args = list(args)
    for i in nums:
        tensors, lay, spec, new_args[i] = _fresh_leaves(i, args[i])
        every += tensors
        layouts += lay
        specs.append((spec, len(tensors)))
    reducer = _Reducer(every)
    token = lax.PCAST_HOOK.set(reducer.pcast)
    try:
        with torch.enable_grad():
            loss, aux = _scalar_loss(_tensor_loss(f(*new_args, **kwargs), has_aux), has_aux)
            if loss.requires_grad:
                # backward, not autograd.grad: the pcast hooks run after AccumulateGrad, whose
                # .grad no one else holds (see _Reducer.pcast)
                torch.autograd.backward(loss, inputs=every + [v for _, _, v in reducer.entries])
        got = [t.grad for t in every]
        for t in every:
            t.grad = None
        got = reducer.finish(got)
    finally:
        lax.PCAST_HOOK.reset(token)
        reducer.close()
    grads = []
    for t, g, layout in zip(every, got, layouts):
        g = torch.zeros_like(t) if g is None else g
        grads.append(g if layout is None else ShardedArray._raw(g, layout))
    out, k = [], 0
    for spec, n in specs:
        out.append(pytree.tree_unflatten(grads[k : k + n], spec))
        k += n
    return loss.detach(), _detach(aux), out


def value_and_grad(
    f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """``jax.value_and_grad``: a function returning ``(value, grads)`` of ``f``.

    At top level it runs ``f`` once on detached leaves and calls ``torch.autograd.backward``, with
    the data-parallel gradient reduction bucketed and overlapped with the backward (see the
    module docstring); under a ``torch.func`` transform, while traced (``torch.compile``,
    ``make_fx``, export: hooks and asynchronous reductions are eager-only, the graph records the
    collectives instead), or when an argument takes part in an outer autograd graph, it is
    ``torch.func.grad_and_value`` (same results, composable).
    Gradients follow fshard's contract: the params' layouts, the dense gradient's values.

    Args:
        f: a function whose output is a scalar loss (``(loss, aux)`` with ``has_aux``): a
            tensor, or a one-element ShardedArray as global-view code computes it (replicated:
            used as it is; a pending sum: reduced first, as ``fs.gather`` does).
        argnums: the positional argument (int) or arguments (tuple) to differentiate: pytrees
            of floating-point tensors and ShardedArrays.
        has_aux: ``f`` returns ``(loss, aux)``; aux is returned detached.

    Returns:
        A function with ``f``'s signature returning ``(loss, grads)``, or ``((loss, aux),
        grads)`` with ``has_aux``; ``grads`` has argument ``argnums``' structure (a tuple of
        them for a tuple ``argnums``).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.shard(torch.arange(4.0), mesh, fs.P("x"))
        >>> loss, g = fs.value_and_grad(lambda w: (w**2).sum())(w)  # global-view loss
        >>> float(loss), fs.gather(g), g.spec  # the gradient keeps w's layout
        (14.0, tensor([0., 2., 4., 6.]), P('x'))
    """
    if not callable(f):
        raise TypeError(f"value_and_grad: f must be callable, got {type(f).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"value_and_grad: has_aux must be a bool, got {has_aux!r}")
    _check_argnums(argnums, None)

    def tensor_f(*args, **kwargs):
        return _tensor_loss(f(*args, **kwargs), has_aux)

    @functools.wraps(f)
    def run(*args, **kwargs):
        nums = _check_argnums(argnums, len(args))
        if _export.exporting():  # torch.func.grad does not export: a make_fx graph of it does
            return _export.value_and_grad(tensor_f, argnums, has_aux, args, kwargs)
        if (
            _comm.tracing()  # torch.compile, make_fx, export: the graph holds the reductions
            or torch._C._are_functorch_transforms_active()
            or _requires_grad((args, kwargs))
        ):
            g, v = torch.func.grad_and_value(tensor_f, argnums=argnums, has_aux=has_aux)(
                *args, **kwargs
            )
            return v, g
        loss, aux, grads = _top_level(f, nums, has_aux, args, kwargs)
        grads = grads[0] if isinstance(argnums, int) else tuple(grads)
        return ((loss, aux) if has_aux else loss), grads

    return run


def grad(f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """``jax.grad``: :func:`value_and_grad` without the value.

    Args:
        f: as in :func:`value_and_grad`.
        argnums: as in :func:`value_and_grad`.
        has_aux: ``f`` returns ``(loss, aux)``; the result is then ``(grads, aux)``.

    Returns:
        A function returning ``grads`` (``(grads, aux)`` with ``has_aux``).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.shard(torch.arange(4.0), mesh, fs.P("x"))
        >>> g = fs.grad(lambda w: (w**2).sum())(w)
        >>> fs.gather(g), g.spec
        (tensor([0., 2., 4., 6.]), P('x'))
    """
    vg = value_and_grad(f, argnums, has_aux)

    @functools.wraps(f)
    def run(*args, **kwargs):
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return run
