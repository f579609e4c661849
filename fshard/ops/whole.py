"""Rules for ops that run on local blocks once some dims are whole.

One rule shape covers them: the dims an op mixes (``tril``'s last two, ``cumsum``'s ``dim``,
every dim but the batch of a convolution...) are made whole (gathered), the other dims keep
their axes, so the op runs unchanged on the local blocks:

- along ``dim``: ``cumsum``/``cumprod``, ``sort``/``argsort``/``topk``, ``argmax``/``argmin``
  (all dims when no ``dim``), ``flip``, ``roll``, ``repeat_interleave``, ``index_select``,
  ``gather``/``scatter_add``/``index_add`` (inputs of the same rank share the other dims' axes);
- the last two dims: ``tril``/``triu``;
- every dim but the batch (dim 0 of a batched input): ``conv1d/2d/3d`` (but a weight split on
  its channels: :func:`conv_rule`), ``max/avg/adaptive``
  pooling, ``interpolate``, ``group_norm``, ``instance_norm``, ``batch_norm`` in eval mode
  (``batch_norm`` in training needs the whole batch: it is gathered);
- ``repeat``: the repeated dims;
- every dim: ``torch._grouped_mm`` (``F.grouped_mm``, MoE experts: the offsets index rows).

The rule checks at plan time, on meta tensors, that the op accepts every rank's block (an
empty channel block of ``avg_pool1d`` or ``interpolate`` raises where the global shape does
not): otherwise it makes the dims with an empty block whole, then every dim, so no rank raises
alone while the others wait in a collective. ``group_norm`` runs ``torch.group_norm`` on blocks
(``F.group_norm``'s batch-size check refuses a one-row block the whole batch passes).

Weights, biases and index vectors are replicated. Pending sums pass through the ops that are
linear in their input (``cumsum``, ``tril``, ``flip``, ``roll``, ``index_select``, ``gather``,
``repeat``...) and are reduced first for the others. ``new_zeros``/``new_ones``/``new_full``/
``new_empty`` make replicated values.

Example:
    >>> y = F.conv2d(x, w)   # x (N, C, H, W) P("dp"): local per-rank conv, w replicated  # doctest: +SKIP
"""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F

from ..spec import BaseLayout, P, _layout
from ._common import meta_call, norm_dim, out_layout, spec
from .binding import bind
from .registry import OpSharding, is_layout, register_rule, tensor_inputs

__all__ = ["whole_dims_rule"]


def along(name="dim"):
    """Whole dims for an op cutting its argument ``name``; every dim when it is ``None`` (or
    empty: ``roll`` without ``dims`` rolls the flattened tensor)."""

    def whole(op, x, args, kwargs):
        d = bind(op, args, kwargs).get(name)
        if d is None or isinstance(d, BaseLayout) or (isinstance(d, (tuple, list)) and not d):
            return set(range(x.ndim))
        ds = d if isinstance(d, (tuple, list)) else (d,)
        return {norm_dim(v, x.ndim) for v in ds}

    return whole


def last_two(op, x, args, kwargs):
    return set(range(max(x.ndim - 2, 0), x.ndim))


def batched(ndim):
    """Every dim but dim 0 of an input with ``ndim`` dims (the batch); all dims otherwise."""

    def whole(op, x, args, kwargs):
        return set(range(1 if x.ndim == ndim else 0, x.ndim))

    return whole


def spatial(spatial_dims):
    """Pooling: dims 0 (and 1 when batched) are independent; the ``spatial_dims`` last are mixed."""

    def whole(op, x, args, kwargs):
        return set(range(x.ndim - spatial_dims, x.ndim))

    return whole


def repeated(op, x, args, kwargs):
    # x.repeat(2, 3) passes the sizes as varargs, which no signature binds
    sizes = args[1:] if len(args) > 1 else kwargs.get("repeats", ())
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    off = len(sizes) - x.ndim
    return {d for d in range(x.ndim) if sizes[off + d] != 1}


def whole_dims_rule(whole, *, linear=False, align_others=False, removes=None, local=None):
    """A rule making ``whole(op, x, args, kwargs)`` dims of the first tensor input ``x`` whole.

    Args:
        whole: the dims of ``x`` the op mixes.
        linear: the op is linear in ``x`` (a pending sum of ``x`` passes through when every
            other tensor input is an integer tensor).
        align_others: other tensor inputs of ``x``'s rank share its axes on the kept dims
            (``gather``'s index); otherwise they are replicated (weights, biases).
        removes: ``removes(op, x, args, kwargs)`` -> the dim of ``x`` the output drops (``argmax``
            without ``keepdim``), or ``None``.
        local: the function run on local blocks (default: the op itself).
    """

    def rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        x = ins[0]
        cut = set(whole(op, x, args, kwargs))
        meta = meta_call(op, args, kwargs)
        metas = meta if isinstance(meta, (tuple, list)) else (meta,)
        gone = removes(op, x, args, kwargs) if removes is not None else None
        if any(m.ndim < x.ndim - (gone is not None) for m in metas):
            cut = set(range(x.ndim))  # dims merge: keep nothing split
        for d in range(x.ndim):  # a dim whose size changes is mixed too
            sizes = [m.shape[-x.ndim + d] for m in metas if m.ndim >= x.ndim and gone is None]
            if align_others:
                sizes += [o.shape[d] for o in ins[1:] if o.ndim == x.ndim]
            if any(s != x.shape[d] for s in sizes):
                cut.add(d)
        keep = [() if d in cut else a for d, a in enumerate(x.dim_axes)]
        keep = _every_block_runs(local or op, args, kwargs, x, keep, align_others)
        pending = linear and all(not o.dtype.is_floating_point for o in ins[1:])
        partial = x.partial if pending else ()
        specs = [spec(keep, partial)]
        for o in ins[1:]:
            same = align_others and o.ndim == x.ndim
            specs.append(spec(keep) if same else spec([()] * o.ndim))
        out_dims = [a for d, a in enumerate(keep) if d != gone]
        outs = []
        for m in metas:  # new dims (repeat's) lead
            dims = [()] * (m.ndim - len(out_dims)) + out_dims if m.ndim >= len(out_dims) else []
            outs.append(out_layout(x.mesh, dims, partial, m))  # pending only when linear
        out = outs[0] if not isinstance(meta, (tuple, list)) else type(meta)(outs)
        return OpSharding(specs, out, local)

    return rule


def _every_block_runs(op, args, kwargs, x, keep, align_others):
    """``keep`` (per-dim axes of ``x``), with dims made whole until ``op`` accepts every rank's
    block: a block the global shape does not have (an empty channel block for ``avg_pool1d``,
    ``interpolate``) would raise on its rank alone while the others wait in a collective. The
    dims where some rank's block is empty go first, then every dim (the dense call)."""
    if _blocks_run(op, args, kwargs, x, keep, align_others):
        return keep
    lay = x.with_spec(spec(keep))
    ranks = x.mesh.ranks
    empty = {d for d in range(x.ndim) if any(lay.local_shape(r)[d] == 0 for r in ranks)}
    keep = [() if d in empty else a for d, a in enumerate(keep)]
    if empty and _blocks_run(op, args, kwargs, x, keep, align_others):
        return keep
    return [()] * x.ndim


def _blocks_run(op, args, kwargs, x, keep, align_others) -> bool:
    """Whether ``op`` runs (on meta tensors) on the block of every rank of the inputs resharded
    to ``keep``: decided at plan time from the layouts, the same on every rank."""
    if not any(keep):
        return True
    shapes = set()
    for r in x.mesh.ranks:
        local = {}
        for o in tensor_inputs(args, kwargs):
            if o is x or (align_others and o.ndim == x.ndim):
                local[id(o)] = o.with_spec(spec(keep)).local_shape(r)
        shapes.add(tuple(sorted(local.items())))

    for shape in shapes:
        by_id = dict(shape)

        def block(v, by_id=by_id):
            if isinstance(v, BaseLayout) and id(v) in by_id:
                return torch.empty(by_id[id(v)], dtype=v.dtype, device="meta")
            return v

        local_args, local_kwargs = optree.tree_map(
            block, (args, kwargs), is_leaf=is_layout, none_is_leaf=True
        )
        try:
            meta_call(op, local_args, local_kwargs)
        except Exception:  # noqa: BLE001 -- any refusal of the block: plan around it
            return False
    return True


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """``F.group_norm`` without its batch-size check, which refuses a block of one row and
    ``C == num_groups`` (one value per group) that the whole batch passes: the statistics are
    per row, so the block's result is the dense result's rows."""
    return torch.group_norm(input, num_groups, weight, bias, eps)


def _argmax_removes(op, x, args, kwargs):
    bound = bind(op, args, kwargs)
    d, keepdim = bound["dim"], bound["keepdim"]
    return None if d is None or keepdim else norm_dim(d, x.ndim)


_REPEAT_INTERLEAVE = whole_dims_rule(along(), linear=True)


def repeat_interleave_rule(op, args, kwargs):
    bound = bind(op, args, kwargs)
    if isinstance(bound["repeats"], BaseLayout) and bound["output_size"] is None:
        raise NotImplementedError(
            "repeat_interleave with tensor repeats on a ShardedArray needs output_size= (the "
            "output shape must be known without reading the repeats); pass output_size=int"
        )
    return _REPEAT_INTERLEAVE(op, args, kwargs)


def batch_norm_rule(op, args, kwargs):
    """Eval mode (running statistics) is per example; training mixes the batch: gathered."""
    bound = bind(op, args, kwargs)
    x, training = bound["input"], bound["training"]
    cut = set(range(x.ndim)) if training else set(range(1, x.ndim))
    return whole_dims_rule(lambda *_: cut)(op, args, kwargs)


def new_rule(op, args, kwargs):
    """``x.new_zeros(shape)`` & co.: a replicated value of the given global shape."""
    x = args[0]
    meta = meta_call(op, args, kwargs)
    return OpSharding(
        [None] * len(tensor_inputs(args, kwargs)), out_layout(x.mesh, [()] * meta.ndim, (), meta)
    )


def grouped_mm_rule(op, args, kwargs):
    """``torch._grouped_mm`` (``F.grouped_mm``, MoE experts): the offsets index rows, so every
    input is made whole and the result is replicated. Its shape is computed here: torch's meta
    kernel accepts only bfloat16, the CPU kernel float32 too."""
    bound = bind(op, args, kwargs)
    a, b, offs = bound["input"], bound["mat2"], bound["offs"]
    rows = (offs.shape[0],) if a.ndim == 2 and b.ndim == 2 and offs is not None else ()
    shape = (*rows, *a.shape[:-1], b.shape[-1])
    dtype = bound.get("out_dtype") or a.dtype
    ins = tensor_inputs(args, kwargs)
    return OpSharding([spec([()] * x.ndim) for x in ins], _layout(a.mesh, P(), shape, dtype))


def conv_rule(k: int):
    """``F.conv{k}d`` with a weight split on its channels (tensor-parallel convolutions,
    :func:`fshard.nn.megatron_plan`): out-channels split like the weight's dim 0 (column),
    in-channels contracted (row: a pending sum over the axes of the weight's dim 1, the bias
    added once). The batch keeps its axes, the spatial dims are made whole. Grouped
    convolutions, unbatched inputs and a replicated weight take :func:`whole_dims_rule`."""
    whole = whole_dims_rule(batched(k + 2))

    def rule(op, args, kwargs):
        bound = bind(op, args, kwargs)
        x, w, bias = bound["input"], bound["weight"], bound["bias"]
        if x.ndim != k + 2 or bound["groups"] != 1 or not (w.dim_axes[0] or w.dim_axes[1]):
            return whole(op, args, kwargs)
        from .linalg import contract

        sp = [None] * k
        letters = [["n", "c", *sp], ["o", "c", *sp]]
        (sx, sw), out_dims, partial = contract([x, w], letters, ["n", "o", *sp])
        meta = meta_call(op, args, kwargs)
        specs = {"input": sx, "weight": sw}
        if isinstance(bias, BaseLayout):
            specs["bias"] = spec([out_dims[1]], partial)
        return OpSharding(specs, out_layout(x.mesh, out_dims, partial, meta))

    return rule


def _register():
    dim1 = whole_dims_rule(along(), linear=True)
    for n in ("cumsum", "index_select"):
        register_rule(getattr(torch, n), dim1, aliases=(getattr(torch.Tensor, n),))
    flip = whole_dims_rule(along("dims"), linear=True)
    register_rule(torch.flip, flip, aliases=(torch.Tensor.flip,))
    register_rule(torch.cumprod, whole_dims_rule(along()), aliases=(torch.Tensor.cumprod,))
    roll = whole_dims_rule(along("dims"), linear=True)
    register_rule(torch.roll, roll, aliases=(torch.Tensor.roll,))
    for n in ("sort", "argsort"):
        register_rule(
            getattr(torch, n), whole_dims_rule(along()), aliases=(getattr(torch.Tensor, n),)
        )
    register_rule(torch.topk, whole_dims_rule(along()), aliases=(torch.Tensor.topk,))
    for n in ("argmax", "argmin"):
        rule = whole_dims_rule(along(), removes=_argmax_removes)
        register_rule(getattr(torch, n), rule, aliases=(getattr(torch.Tensor, n),))
    register_rule(
        torch.repeat_interleave, repeat_interleave_rule, aliases=(torch.Tensor.repeat_interleave,)
    )
    gather = whole_dims_rule(along(), linear=True, align_others=True)
    register_rule(torch.gather, gather, aliases=(torch.Tensor.gather,))
    for n in ("scatter_add", "index_add"):
        rule = whole_dims_rule(along(), align_others=True)
        register_rule(getattr(torch, n), rule, aliases=(getattr(torch.Tensor, n),))
    for n in ("tril", "triu"):
        rule = whole_dims_rule(last_two, linear=True)
        register_rule(getattr(torch, n), rule, aliases=(getattr(torch.Tensor, n),))
    register_rule(torch.Tensor.repeat, whole_dims_rule(repeated, linear=True))
    if hasattr(torch, "_grouped_mm"):
        register_rule(torch._grouped_mm, grouped_mm_rule)
    for k in (1, 2, 3):
        register_rule(getattr(F, f"conv{k}d"), conv_rule(k))
        for pool in ("max_pool", "avg_pool", "adaptive_max_pool", "adaptive_avg_pool"):
            names = (f"{pool}{k}d", f"_{pool}{k}d", f"{pool}{k}d_with_indices")
            ops = [getattr(F, n) for n in names if hasattr(F, n)]
            register_rule(ops[0], whole_dims_rule(spatial(k)), aliases=ops[1:])
    interpolate = whole_dims_rule(lambda op, x, a, k: set(range(2, x.ndim)))
    register_rule(F.interpolate, interpolate, float_valued=True)
    group_norm = whole_dims_rule(lambda op, x, a, k: set(range(1, x.ndim)), local=_group_norm)
    register_rule(F.group_norm, group_norm)
    register_rule(F.instance_norm, whole_dims_rule(lambda op, x, a, k: set(range(2, x.ndim))))
    register_rule(F.batch_norm, batch_norm_rule)
    for n in ("new_zeros", "new_ones", "new_full", "new_empty"):
        register_rule(getattr(torch.Tensor, n), new_rule)


_register()
