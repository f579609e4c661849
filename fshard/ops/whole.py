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
- the table at the end (:func:`register_table`, one line per rule): reductions that gather
  the dim they reduce (``prod``, ``median``, ``var_mean``...), ``cummax``, ``glu``,
  ``softmin``, ``normalize``, the split family (``tensor_split``, ``hsplit``...), the index
  and scatter ops, ``fft.*`` over their ``dim``, ``pixel_shuffle``, ``grid_sample``, and
  global ops whose every input is gathered (``kron``, ``trace``, ``quantile``, most
  margin losses...);
- :func:`batched_rule`: functions of the matrices in the last dims (``torch.linalg``), whose
  batch dims keep their axes;
- every dim: ``torch._grouped_mm`` (``F.grouped_mm``, MoE experts: the offsets index rows);
- every dim, drawn: random ops whose draw depends on their input's values (``bernoulli`` with
  a tensor of probabilities, ``multinomial``, ``normal`` with a tensor mean or std,
  ``poisson``, ``F.rrelu``, ``F.gumbel_softmax``: :func:`drawn_rule`). Every rank
  runs the dense op on the whole input from its generator, after the generators of the mesh's
  ranks are compared (:func:`fshard.consistency.check_draw`): the dense op's values for the
  same seed, replicated.

A dim where some rank's block would be empty is made whole (an empty channel block of
``avg_pool1d`` or ``interpolate`` raises where the global shape does not; some backward
kernels mishandle empty blocks), and the rule checks at plan time, on meta tensors, that the
op accepts every rank's block, else makes every dim whole, so no rank raises alone while the
others wait in a collective. ``group_norm`` runs ``torch.group_norm`` on blocks
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

from .. import consistency
from ..spec import BaseLayout, P, _layout
from . import random
from ._common import meta_call, norm_dim, norm_dims, out_layout, spec
from .binding import bind
from .contraction import contract
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
        removes: ``removes(op, x, args, kwargs)`` -> the dims of ``x`` the output drops
            (``argmax``, ``median`` without ``keepdim``).
        local: the function run on local blocks (default: the op itself).
    """

    def rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        x = ins[0]
        cut = set(whole(op, x, args, kwargs))
        meta = meta_call(op, args, kwargs)
        metas = meta if isinstance(meta, (tuple, list)) else (meta,)
        if not all(isinstance(m, torch.Tensor) for m in metas):  # torch.allclose: a bool
            return OpSharding([spec([()] * o.ndim) for o in ins], None, local)
        gone = set(removes(op, x, args, kwargs)) if removes is not None else set()
        kept = [d for d in range(x.ndim) if d not in gone]
        if any(m.ndim < len(kept) for m in metas):
            cut = set(range(x.ndim))  # dims merge: keep nothing split
        for i, d in enumerate(kept):  # a dim whose size changes is mixed too
            sizes = [m.shape[m.ndim - len(kept) + i] for m in metas if m.ndim >= len(kept)]
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
        fn = _contiguous(local or op) if _resharded(specs, ins) else local
        out_dims = [a for d, a in enumerate(keep) if d not in gone]
        outs = []
        for m in metas:  # new dims (repeat's) lead
            dims = [()] * (m.ndim - len(out_dims)) + out_dims if m.ndim >= len(out_dims) else []
            outs.append(out_layout(x.mesh, dims, partial, m))  # pending only when linear
        out = outs[0] if not isinstance(meta, (tuple, list)) else type(meta)(outs)
        return OpSharding(specs, out, fn)

    return rule


def batched_rule(core: int):
    """A rule for an op on the last ``core`` dims of its first input ``x`` (matrices: 2),
    batched over the leading dims (``torch.linalg``): the core dims are whole, the batch dims
    keep their axes where every output starts with ``x``'s batch dims and no input has more
    dims than ``x`` (then batch dims broadcast alike from the left and from the right). Other
    inputs of ``x``'s rank and batch shape share its batch axes; the rest are replicated."""

    def rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        x = ins[0]
        nb = max(x.ndim - core, 0)
        meta = meta_call(op, args, kwargs)
        metas = meta if isinstance(meta, (tuple, list)) else (meta,)
        batch = tuple(x.shape[:nb])
        ok = all(isinstance(m, torch.Tensor) and tuple(m.shape[:nb]) == batch for m in metas)
        ok = ok and all(o.ndim <= x.ndim for o in ins[1:])
        keep = [a if ok and d < nb else () for d, a in enumerate(x.dim_axes)]
        same = [o.ndim == x.ndim and tuple(o.shape[:nb]) == batch for o in ins]
        keep = _every_block_runs(op, args, kwargs, x, keep, True, same=same)
        specs = [spec(keep) if s else spec([()] * o.ndim) for o, s in zip(ins, same)]
        if not all(isinstance(m, torch.Tensor) for m in metas):
            return OpSharding(specs, None)
        outs = [out_layout(x.mesh, keep[:nb] + [()] * (m.ndim - nb), (), m) for m in metas]
        out = outs[0] if not isinstance(meta, (tuple, list)) else type(meta)(outs)
        return OpSharding(specs, out, _contiguous(op) if _resharded(specs, ins) else None)

    return rule


def _resharded(specs, ins) -> bool:
    return any(s != o.spec for s, o in zip(specs, ins))


def _contiguous(op):
    """``op`` on contiguous local tensors: a block gathered along a later dim is a strided
    view, which some kernels refuse (``take_along_dim``'s flattening ``view``,
    ``native_group_norm``, ``max_unpool``). Used where inputs are resharded (communication
    dominates the copy)."""

    def local(*args, **kwargs):
        args = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
        kwargs = {
            k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
        }
        return op(*args, **kwargs)

    return local


def _every_block_runs(op, args, kwargs, x, keep, align_others, same=None):
    """``keep`` (per-dim axes of ``x``), with dims made whole until ``op`` accepts every rank's
    block: a block the global shape does not have would raise on its rank alone while the
    others wait in a collective. A dim where some rank's block is empty is made whole first
    (``avg_pool1d`` and ``interpolate`` refuse an empty channel block; backward kernels such
    as ``pixel_shuffle``'s return wrong shapes for an empty batch), then every dim (the dense
    call) if the op still refuses a block."""
    lay = x.with_spec(spec(keep))
    ranks = x.mesh.ranks
    empty = {d for d in range(x.ndim) if any(lay.local_shape(r)[d] == 0 for r in ranks)}
    keep = [() if d in empty else a for d, a in enumerate(keep)]
    if _blocks_run(op, args, kwargs, x, keep, align_others, same):
        return keep
    return [()] * x.ndim


def _blocks_run(op, args, kwargs, x, keep, align_others, same=None) -> bool:
    """Whether ``op`` runs (on meta tensors) on the block of every rank of the inputs resharded
    to ``keep``: decided at plan time from the layouts, the same on every rank."""
    if not any(keep):
        return True
    shapes = set()
    for r in x.mesh.ranks:
        local = {}
        for i, o in enumerate(tensor_inputs(args, kwargs)):
            aligned = same[i] if same is not None else align_others and o.ndim == x.ndim
            if o is x or aligned:
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


def reduced(op, x, args, kwargs):
    """The dims a reduction over ``dim`` drops: none with ``keepdim=True`` (or with no
    ``dim`` for ops that then reduce the flattened value to a 0-d tensor: all dims)."""
    bound = bind(op, args, kwargs)
    if bound.get("keepdim"):
        return ()
    d = bound.get("dim")
    if d is None or (isinstance(d, (tuple, list)) and not d):
        return tuple(range(x.ndim))
    return norm_dims(d, x.ndim)


def last_unless_keepdim(op, x, args, kwargs):
    """``pairwise_distance`` drops the last dim unless ``keepdim``."""
    return () if bind(op, args, kwargs)["keepdim"] else (x.ndim - 1,)


def dropped(op, x, args, kwargs):
    """The ``dim`` an op always drops (``trapezoid``, ``cosine_similarity``)."""
    return (norm_dim(bind(op, args, kwargs)["dim"], x.ndim),)


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
        rule = whole_dims_rule(along(), removes=reduced)
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
    register_rule(torch._grouped_mm, grouped_mm_rule)  # torch 2.11+
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


# -- the table of the other ops that run once some dims are whole ----------------------------


def _all(op, x, args, kwargs):
    return set(range(x.ndim))


def dims(*ds):
    """Fixed dims (``fliplr``'s 1; ``hsplit``'s 1, or 0 for a 1-d input: the last of ``ds``
    that ``x`` has)."""
    return lambda op, x, args, kwargs: {max(d for d in ds if d < max(x.ndim, 1))}


def all_but(name="dim"):
    """Every dim but argument ``name`` (``renorm`` scales each slice along ``dim``)."""
    return lambda op, x, args, kwargs: _all(op, x, args, kwargs) - along(name)(op, x, args, kwargs)


def last(k):
    """The last ``k`` dims (``pixel_shuffle``'s (C, H, W))."""
    return lambda op, x, args, kwargs: set(range(max(x.ndim - k, 0), x.ndim))


def channels(op, x, args, kwargs):
    """``prelu``'s channel dim (1; none for an input of one dim, which has one channel)."""
    return {1} if x.ndim >= 2 else set()


def normalized(op, x, args, kwargs):
    """``native_layer_norm``'s ``normalized_shape`` dims (the last ones)."""
    return last(len(bind(op, args, kwargs)["normalized_shape"]))(op, x, args, kwargs)


def padded(op, x, args, kwargs):
    """The dims ``constant_pad_nd``'s ``pad`` pads: the last ``len(pad) // 2``."""
    return last(len(bind(op, args, kwargs)["pad"]) // 2)(op, x, args, kwargs)


def elementwise_in_first(op, x, args, kwargs):
    """``isin``/``bucketize``: elementwise in the first argument (kept as it is; the others,
    the set searched, replicated); every dim when the first argument is a number."""
    return set() if args and args[0] is x else set(range(x.ndim))


def tiled(op, x, args, kwargs):
    reps = tuple(bind(op, args, kwargs)["dims"])
    reps = (1,) * (x.ndim - len(reps)) + reps
    return {d for d in range(x.ndim) if reps[len(reps) - x.ndim + d] != 1}


def _resolved(op):
    """``op`` with a lazily conjugated result (``ifft`` of a real input) made a plain tensor,
    which collectives can send."""
    return lambda *args, **kwargs: op(*args, **kwargs).resolve_conj()


_TENSOR_SPLIT = whole_dims_rule(along(), linear=True)


def tensor_split_rule(op, args, kwargs):
    """``tensor_split`` with int sections or indices; tensor indices would make the output
    count depend on values (no plan can be made from layouts)."""
    if len(tensor_inputs(args, kwargs)) > 1:
        raise NotImplementedError(
            "tensor_split of a ShardedArray with tensor indices_or_sections is not supported: "
            "the number of outputs would depend on the values; pass a list of ints "
            "(indices.tolist())"
        )
    return _TENSOR_SPLIT(op, args, kwargs)


def compare_rule(op, args, kwargs):
    """``torch.equal``/``allclose``: a Python bool, computed on the whole values (every rank
    returns the same)."""
    return OpSharding([spec([()] * o.ndim) for o in tensor_inputs(args, kwargs)], None)


def _resolve(path: str):
    """``"linalg.det"`` -> ``torch.linalg.det`` (``"Tensor.x"``, ``"F.x"`` likewise); None
    where this torch has no such op."""
    home, _, name = path.rpartition(".")
    space = {"": torch, "Tensor": torch.Tensor, "F": F}.get(home)
    if space is None:
        space = getattr(torch, home, None)
    return getattr(space, name, None)


def register_table(table):
    """``{rule: "name name..."}``: each name is a torch path (``"linalg.det"``, ``"F.glu"``,
    ``"Tensor.unfold"``); a plain name registers ``torch.<name>`` and ``Tensor.<name>``."""
    for rule, names in table.items():
        for n in names.split():
            paths = [n] if "." in n else [n, f"Tensor.{n}"]
            for op in filter(None, map(_resolve, paths)):
                register_rule(op, rule)


#: Global ops (the whole value in, a result every rank computes): each input is gathered.
EVERYTHING = (
    "block_diag cartesian_prod kron meshgrid diag diag_embed diagflat diagonal "
    "diagonal_copy diagonal_scatter select_scatter trace take put masked_scatter histc "
    "gradient unfold unfold_copy dist hstack vstack dstack column_stack row_stack "
    "quantile nanquantile _weight_norm linalg.multi_dot linalg.tensorinv linalg.tensorsolve "
    "F.pdist F.bilinear F.unfold F.multilabel_soft_margin_loss "
    "F.cosine_embedding_loss F.triplet_margin_loss F.triplet_margin_with_distance_loss "
    "F.multi_margin_loss F.multilabel_margin_loss F.ctc_loss F.embedding_bag addmv addr "
    "addbmm inner tensordot"
)
#: Fourier transforms over their ``dim`` (``fftn``'s default: every dim).
FFT = (
    "fft ifft rfft irfft hfft ihfft fft2 ifft2 rfft2 irfft2 hfft2 ihfft2 fftn ifftn rfftn "
    "irfftn hfftn ihfftn fftshift ifftshift"
)


_WHOLE = whole_dims_rule(_all)  # every input gathered whole


def drawn_rule(op, args, kwargs):
    """A random op whose draw depends on its input's values (the module docstring): every input
    gathered whole, the op run by every rank on it, after the generators that draw are
    compared over the mesh's axes (all of them hold the one replicated result)."""
    plan = _WHOLE(op, args, kwargs)
    out = plan.out
    group = random.drawing_group(out) if isinstance(out, BaseLayout) else None
    run = plan.local or op
    if group is None:
        return OpSharding(plan.in_specs, out, run)
    what = f"{op.__name__} (its draw)"

    def local(*a, **k):
        generator = k.get("generator")
        if generator is None:
            generator = next((v for v in a if isinstance(v, torch.Generator)), None)
        device = next(v.device for v in (*a, *k.values()) if isinstance(v, torch.Tensor))
        consistency.check_draw(group, device, what, generator)
        return run(*a, **k)

    return OpSharding(plan.in_specs, out, local)


#: The random ops :func:`drawn_rule` runs (``register_table``'s names).
DRAWN = "bernoulli multinomial normal poisson F.rrelu"


def _register_table():
    along_linear = whole_dims_rule(along(), linear=True)
    along_aligned = whole_dims_rule(along(), align_others=True)
    register_table(
        {
            _WHOLE: f"{EVERYTHING} linspace logspace native_group_norm",
            along_linear: "unsafe_split unsafe_chunk split_with_sizes split_with_sizes_copy "
            "take_along_dim",
            whole_dims_rule(dims(1, 0), linear=True): "fliplr hsplit",
            whole_dims_rule(dims(0), linear=True): "flipud vsplit",
            whole_dims_rule(dims(2), linear=True): "dsplit",
            whole_dims_rule(along("dims"), linear=True): "rot90",
            whole_dims_rule(tiled, linear=True): "tile",
            whole_dims_rule(along()): "cummax cummin logcumsumexp glu F.glu F.softmin "
            "F.normalize msort",
            whole_dims_rule(along(), removes=reduced): "prod median nanmedian mode kthvalue "
            "nanmean var_mean std_mean aminmax",
            along_aligned: "diff cumulative_trapezoid index_fill index_copy index_reduce "
            "scatter scatter_reduce slice_scatter cross linalg.cross",
            whole_dims_rule(along(), align_others=True, removes=dropped): "trapz trapezoid "
            "linalg.vecdot F.cosine_similarity",
            whole_dims_rule(last(1), align_others=True, removes=last_unless_keepdim): (
                "F.pairwise_distance"
            ),
            whole_dims_rule(all_but()): "renorm",
            whole_dims_rule(channels): "F.prelu",
            whole_dims_rule(last(3)): "F.pixel_shuffle F.pixel_unshuffle F.channel_shuffle "
            "native_channel_shuffle",
            whole_dims_rule(lambda op, x, a, k: set(range(1, x.ndim))): "F.local_response_norm",
            whole_dims_rule(lambda op, x, a, k: set(range(1, x.ndim)), align_others=True): (
                "F.grid_sample grid_sampler_2d grid_sampler_3d"
            ),
            whole_dims_rule(padded): "constant_pad_nd",
            whole_dims_rule(elementwise_in_first): "isin bucketize",
            whole_dims_rule(last(1), align_others=True): "searchsorted",
            whole_dims_rule(lambda op, x, a, k: set(), linear=True): "Tensor.sum_to_size",
            whole_dims_rule(normalized): "native_layer_norm",
            drawn_rule: DRAWN,
        }
    )
    for k in (1, 2, 3):
        register_rule(getattr(F, f"conv_transpose{k}d"), whole_dims_rule(batched(k + 2)))
        # the indices count positions in each (N, C) plane: those dims stay split
        register_rule(getattr(F, f"max_unpool{k}d"), whole_dims_rule(last(k), align_others=True))
    for n in FFT.split():
        op = getattr(torch.fft, n)
        register_rule(op, whole_dims_rule(along(), local=_resolved(op)))
    register_rule(torch.tensor_split, tensor_split_rule, aliases=(torch.Tensor.tensor_split,))
    for op in (torch.allclose, torch.Tensor.allclose, torch.equal, torch.Tensor.equal):
        register_rule(op, compare_rule)
    spatial_dims = whole_dims_rule(lambda op, x, a, k: set(range(2, x.ndim)))
    for n in ("upsample_nearest", "upsample_bilinear"):
        register_rule(getattr(F, n), spatial_dims, float_valued=True)
    # ord=0.5 (what a rule sees for a float) is not a matrix norm: plan per value
    norms = whole_dims_rule(along(), removes=reduced)
    for op in (torch.linalg.matrix_norm, torch.linalg.norm):
        register_rule(op, norms, float_valued=True)
    register_rule(torch.linalg.cond, batched_rule(2), float_valued=True)
    # its eps (deprecated) warns when not its default: the plan sees the floats' values
    register_rule(F.gumbel_softmax, drawn_rule, float_valued=True)


_register_table()
