"""``value_and_grad`` / ``grad`` shaped like JAX's, with DDP-style overlapped gradient reduction.

At top level (no ``torch.func`` transform active, no input taking part in an outer autograd
graph) the function runs on detached leaves with ``requires_grad`` and differentiates with
``torch.autograd.backward(loss, inputs=leaves)`` (gradients taken from the fresh leaves'
``.grad``, which the caller never sees): no per-level wrapping, no functorch Function machinery, the speed of a
hand-written ``.backward()``. Under any ``torch.func`` transform (``grad``, ``vmap``, ``jvp``,
...) it is ``torch.func.grad_and_value``, so grad of grad, ``vmap`` of it and forward mode
compose exactly.

Where the data-parallel reduction happens: on the top-level path a
:class:`fshard.gradsync.GradSync` handler takes over the ``pcast`` of every differentiated leaf
(one stand-in leaf per param and group, whatever the number of uses) and reduces its gradient
once, in buckets overlapped with the backward (``sync=False``: not at all; the gradients are
returned as pending sums, for accumulation over microbatches). A pcast of anything else (a
computed value) keeps ``fshard.lax``'s Function, whose backward all-reduces at once: correct,
not bucketed. Returned gradients never alias a buffer a later call writes.
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
from .gradsync import GradSync
from .spec import P, Parts, parts_arranged

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


def _requires_grad(tree) -> bool:
    """Whether any tensor in ``tree`` (a ShardedArray's local block included) requires grad.
    ShardedArrays are leaves of the walk: their pytree flatten is a Python call each."""
    for t in pytree.tree_iter(tree, is_leaf=is_sharded):
        if type(t) is ShardedArray:
            t = t.local
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


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


def _top_level(f, nums, has_aux, args, kwargs, sync: bool):
    every, layouts, specs = [], [], []
    new_args = list(args)
    for i in nums:
        tensors, lay, spec, new_args[i] = _fresh_leaves(i, args[i])
        every += tensors
        layouts += lay
        specs.append((spec, len(tensors)))
    reducer = GradSync(every, mode="overlap" if sync else "unreduced")
    try:
        with lax.handling(reducer), torch.enable_grad():
            loss, aux = _scalar_loss(_tensor_loss(f(*new_args, **kwargs), has_aux), has_aux)
            if loss.requires_grad:
                # backward, not autograd.grad: the stand-ins' hooks run after AccumulateGrad,
                # whose .grad no one else holds (see fshard.gradsync)
                torch.autograd.backward(loss, inputs=every + reducer.stand_ins())
        got = [t.grad for t in every]
        for t in every:
            t.grad = None
        if sync:
            got = reducer.finish(got)
        else:
            got, layouts = _unreduced(reducer, got, layouts)
    finally:
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


def _unreduced(reducer: GradSync, got: list, layouts: list) -> tuple[list, list]:
    """``sync=False``: each gradient as this rank's addend of a pending sum over the axes its
    pcasts would have reduced (``P(..., partial=axes)``; the first rank of those axes keeps the
    addends that are the same on every rank)."""

    def keep_own(i, axes):
        return layouts[i].mesh.group(axes).index == 0

    for i, layout in enumerate(layouts):
        if layout is None and any(e.leaf == i for e in reducer.entries):
            raise TypeError(
                "value_and_grad(sync=False): a plain-tensor argument met data that varies over "
                "a mesh axis, so its gradient is a pending sum, which only a ShardedArray can "
                "carry (its layout names the axes); pass it as fs.shard(t, mesh, fs.P()) or use "
                "sync=True"
            )
    out, lays = [], []
    for (g, axes, *gathered), layout in zip(reducer.unreduced(got, keep_own), layouts):
        if axes:
            g, layout = _pending(g, axes, gathered[0] if gathered else None, layout)
        out.append(g)
        lays.append(layout)
    return out, lays


def _pending(g, axes: tuple[str, ...], gathered, layout) -> tuple:
    """An unreduced gradient ``g`` and its layout: ``layout`` (a :class:`~fshard.P`'s or a
    :class:`~fshard.Parts`') pending a sum over ``axes``; ``gathered``: ``(dim, axes)`` of
    FSDP's gather (that dim whole over them: the addends of the whole param). A
    :class:`~fshard.Parts` on the gathered dim came as its blocks over those axes in chunk
    order: put back in part order (the gather's ``arranged``), its parts then split over the
    other axes only (a ``P`` where none is left)."""
    parts = layout.spec if isinstance(layout.spec, Parts) else None
    s = parts.spec if parts is not None else layout.spec
    dims = list(s.padded(len(layout.shape)))
    if gathered is not None:
        dim, over = gathered
        if parts is not None and layout.dim == dim and g is not None:
            g = parts_arranged(g, layout.part_rows(layout.mesh.group(over).ranks))
        dims[dim] = tuple(a for a in dims[dim] if a not in over)
    dims = [d[0] if isinstance(d, tuple) and len(d) == 1 else (d or None) for d in dims]
    spec = P(*dims, partial=s.partial + axes)
    if parts is not None and dims[layout.dim] is not None:
        spec = Parts(spec, layout.dim, parts.sizes)
    return g, layout.with_spec(spec)


def value_and_grad(
    f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *, sync: bool = True
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
        sync: reduce data-parallel gradients (default). ``False`` (DDP's ``no_sync``, FSDP2's
            ``set_requires_gradient_sync(False)``, JAX's unreduced gradients): nothing is sent;
            a param's gradient that would be summed over mesh axes is returned as this rank's
            addend of that pending sum (its layout: the param's spec with
            ``partial=`` those axes). Accumulate microbatches with ``+`` (local) and reduce
            once per optimizer step with ``fs.reshard(grads, specs)`` (one all_reduce per
            bucket). Top level only (under a ``torch.func`` transform the reduction is in the
            transform's backward): elsewhere ``ValueError``.

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
    if not isinstance(sync, bool):
        raise TypeError(f"value_and_grad: sync must be a bool, got {sync!r}")
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
            if not sync:
                raise ValueError(
                    "value_and_grad(sync=False) runs at top level only: under a torch.func "
                    "transform, while traced, or inside an outer autograd graph the reduction "
                    "is part of the transform's backward; call it outside (sync=True here)"
                )
            g, v = torch.func.grad_and_value(tensor_f, argnums=argnums, has_aux=has_aux)(
                *args, **kwargs
            )
            return v, g
        loss, aux, grads = _top_level(f, nums, has_aux, args, kwargs, sync)
        grads = grads[0] if isinstance(argnums, int) else tuple(grads)
        return ((loss, aux) if has_aux else loss), grads

    return run


def grad(
    f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *, sync: bool = True
) -> Callable:
    """``jax.grad``: :func:`value_and_grad` without the value.

    Args:
        f: as in :func:`value_and_grad`.
        argnums: as in :func:`value_and_grad`.
        has_aux: ``f`` returns ``(loss, aux)``; the result is then ``(grads, aux)``.
        sync: as in :func:`value_and_grad`.

    Returns:
        A function returning ``grads`` (``(grads, aux)`` with ``has_aux``).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.shard(torch.arange(4.0), mesh, fs.P("x"))
        >>> g = fs.grad(lambda w: (w**2).sum())(w)
        >>> fs.gather(g), g.spec
        (tensor([0., 2., 4., 6.]), P('x'))
    """
    vg = value_and_grad(f, argnums, has_aux, sync=sync)

    @functools.wraps(f)
    def run(*args, **kwargs):
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return run
