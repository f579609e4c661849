"""Neural-net rules: softmax, log_softmax, layer_norm, rms_norm, embedding, cross_entropy,
scaled_dot_product_attention, dropout.

None of them gathers a split dim:

- ``softmax``/``log_softmax`` over a split dim: ``pmax`` of the local max and ``psum`` of the
  local sums of exponentials (two small all_reduces of the non-softmax dims);
- ``layer_norm``/``rms_norm`` over split normalized dims: ``psum`` of the moments, the weight
  and bias sharded like those dims;
- ``embedding`` with a vocab-split weight: each rank looks up the ids in its vocab block (others
  masked to zero); the output is partial over the vocab axes (Megatron's masked lookup; the
  ``psum`` happens when a nonlinear op or ``fs.gather`` needs it);
- ``cross_entropy`` with vocab-split logits (Megatron vocab-parallel CE): one ``pmax`` and one
  ``psum`` of ``O(batch)`` floats; the logits are never gathered;
- ``scaled_dot_product_attention``: batch and head dims may be split (q, k, v broadcast as
  in torch; size-1 dims stay whole; with ``enable_gqa`` the heads stay split when every head
  count divides evenly); sequence and feature dims are made whole. ``dropout_p > 0`` runs the
  math path with the mask drawn for the global shape (equal to dense for the same seed);
- ``dropout``: every rank draws the full mask from the default generator (so generators stay
  in step) and keeps its block: the same mask as dense ``F.dropout`` with the same seed. Under
  ``vmap`` the mask is shared across the batch. Where the value is replicated or pending over a
  mesh axis, the ranks of those axes must draw one mask: their generators' states are compared
  (:func:`fshard.consistency.check_draw`; per-rank seeds raise a ``ConsistencyError``), as the
  attention weights' of ``dropout_p > 0``.
- the rest of the family, drawn the same way: channel-wise dropout (``dropout1d/2d/3d``,
  ``torch.feature_dropout``: one draw per (sample, channel), as ATen's feature noise of shape
  ``(N, C, 1, ...)``, an unbatched input's channels first), alpha dropout
  (``alpha_dropout``, ``feature_alpha_dropout``: ATen's ``a * noise`` and ``b`` from the one
  draw; a pending sum is reduced first, the map being affine) and ``torch.dropout``.

Example:
    >>> loss = F.cross_entropy(logits, target)  # logits P(None, "tp"): O(batch) bytes moved  # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..spec import BaseLayout, Layout
from . import random, rows
from ._common import (
    block_bounds,
    group_of,
    group_pcast,
    group_pmax,
    group_psum,
    in_mesh_order,
    meta_call,
    norm_dim,
    opmath,
    out_layout,
    safe_amax,
    spec,
    unreduced,
)
from .binding import bind
from .elementwise import align, own_dims
from .registry import OpSharding, register_rule, tensor_inputs

__all__ = []


def _rank(mesh):
    return mesh.ranks[0] if mesh.is_abstract else mesh.rank


# -- softmax --------------------------------------------------------------------------------


def softmax_rule(op, args, kwargs):
    ins = tensor_inputs(args, kwargs)
    x = ins[0]
    dim_arg = bind(op, args, kwargs)["dim"]
    if dim_arg is None:
        raise TypeError(f"{op.__name__}: pass dim explicitly for a ShardedArray")
    dim = norm_dim(dim_arg, x.ndim)
    meta = meta_call(op, args, kwargs)
    group = group_of(x.mesh, x.dim_axes[dim])
    out = out_layout(x.mesh, x.dim_axes, (), meta)
    log = op.__name__ == "log_softmax"
    dtype = meta.dtype
    if group is None:  # the Tensor kernel F.softmax would call, without its torch-function check
        method = getattr(torch.Tensor, op.__name__)  # a closure: dynamo cannot call methodcaller
        cast = dtype if dtype != x.dtype else None

        def kernel(t):
            return method(t, dim) if cast is None else method(t, dim, cast)

        return OpSharding([unreduced(x)], out, kernel, tensors_only=True)

    def local(t, *a, **k):
        t = t.to(opmath(dtype))  # as the dense kernel: compute in float32, round once
        m = group_pmax(safe_amax(t, (dim,), True), group).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        z = t - m
        e = torch.exp(z)
        s = group_pcast(group_psum(e.sum(dim, keepdim=True), group), group)
        return (z - torch.log(s) if log else e / s).to(dtype)

    return OpSharding([unreduced(x)], out, local)


# -- normalization --------------------------------------------------------------------------


def _norm_rule(rms: bool):
    def rule(op, args, kwargs):
        bound = bind(op, args, kwargs)
        x = bound["input"]
        ns = bound["normalized_shape"]
        ns = (ns,) if isinstance(ns, int) else tuple(ns)
        nd = len(ns)
        norm_axes = [a for d in x.dim_axes[x.ndim - nd :] for a in d]
        specs = {"input": unreduced(x)}
        for n in ("weight", "bias"):
            if isinstance(bound.get(n), Layout):
                specs[n] = spec(x.dim_axes[x.ndim - nd :])
        meta = meta_call(op, args, kwargs)
        out = out_layout(x.mesh, x.dim_axes, (), meta)
        group = group_of(x.mesh, norm_axes)
        if group is None:
            return OpSharding(specs, out)
        dims = tuple(range(-nd, 0))
        count = math.prod(ns)
        dtype = meta.dtype  # the input's, also with weights of another dtype (autocast's mix)

        def local(b):
            t, w, bias, eps = b["input"], b["weight"], b.get("bias"), b["eps"]
            # As the dense kernels: compute in float32 for a reduced-precision input (rms_norm's
            # default eps is float32's then), round once at the end.
            t = t.to(opmath(t.dtype))
            if eps is None:
                eps = torch.finfo(t.dtype).eps if rms else 1e-5
            if rms:
                ms = group_psum((t * t).sum(dims, keepdim=True), group) / count
                y = t * torch.rsqrt(group_pcast(ms, group) + eps)
            else:
                mean = group_psum(t.sum(dims, keepdim=True), group) / count
                d = t - group_pcast(mean, group)
                var = group_psum((d * d).sum(dims, keepdim=True), group) / count
                y = d * torch.rsqrt(group_pcast(var, group) + eps)
            if w is not None:
                y = y * w
            if bias is not None:
                y = y + bias
            return y.to(dtype)

        return OpSharding(specs, out, local, by_name=True)

    return rule


# -- embedding ------------------------------------------------------------------------------


def embedding_rule(op, args, kwargs):
    bound = bind(op, args, kwargs)
    ids, w = bound["input"], bound["weight"]
    if bound["max_norm"] is not None or bound["sparse"]:
        raise NotImplementedError(
            "F.embedding on a ShardedArray supports neither max_norm (it renormalises the "
            "weight in place) nor sparse=True"
        )
    vocab_axes, dim_axes = w.dim_axes[0], w.dim_axes[1]
    if bound["scale_grad_by_freq"] and (vocab_axes or ids.sharded_axes):
        raise NotImplementedError(
            "F.embedding(scale_grad_by_freq=True) with a vocab-split weight or split ids is not "
            f"supported (weight {w.spec}, ids {ids.spec}): the id counts would be per rank, not "
            "global. Replicate the ids and the weight's vocab dim (fs.reshard(ids, fs.P()), "
            "fs.reshard(weight, fs.P(None, ...))) or drop scale_grad_by_freq"
        )
    taken = set(vocab_axes) | set(dim_axes)
    id_dims = [() if set(axes) & taken else axes for axes in ids.dim_axes]
    specs = {"input": spec(id_dims), "weight": spec(w.dim_axes)}
    meta = meta_call(op, args, kwargs)
    out = out_layout(w.mesh, [*id_dims, dim_axes], in_mesh_order(w.mesh, vocab_axes), meta)
    if not vocab_axes:
        return OpSharding(specs, out)
    lo, hi = block_bounds(w, 0, _rank(w.mesh))
    pad = bound["padding_idx"]
    if pad is not None:
        pad = pad % w.shape[0]
        pad = pad - lo if lo <= pad < hi else None

    def local(b):
        i, weight = b["input"], b["weight"]
        inside = (i >= lo) & (i < hi)
        if hi == lo:
            # An empty vocab block: zero rows, computed from both the ids and the weight so that
            # under vmap this rank's result is batched exactly when the other ranks' rows are
            # (the psum of the pending sum then runs with the same shape on every rank).
            return inside.unsqueeze(-1).to(weight.dtype) * weight.sum(0)
        rows = F.embedding(torch.where(inside, i - lo, 0), weight, padding_idx=pad)
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    return OpSharding(specs, out, local, by_name=True)


# -- cross entropy --------------------------------------------------------------------------


def cross_entropy_rule(op, args, kwargs):
    bound = bind(op, args, kwargs)
    x, target = bound["input"], bound["target"]
    if isinstance(bound["weight"], BaseLayout) or bound["size_average"] is not None:
        raise NotImplementedError(
            "F.cross_entropy on a ShardedArray supports no class weight= and no legacy "
            "size_average=/reduce=; gather first or use fs.shard_map"
        )
    if bound["reduce"] is not None:
        raise NotImplementedError("F.cross_entropy: legacy reduce= is not supported")
    if x.ndim < 2 or not isinstance(target, BaseLayout) or target.ndim != x.ndim - 1:
        raise NotImplementedError(
            "F.cross_entropy on a ShardedArray expects (N, C, d1, ...) logits and (N, d1, ...) "
            "class indices (torch's K-dimensional form; (N, C) and (N,) most often); reshape "
            "first (logits.reshape(-1, C), target.reshape(-1))"
        )
    reduction = bound["reduction"]
    mesh = x.mesh
    if x.is_explicit or target.is_explicit:  # row blocks (fshard.ops.rows): taken as they are
        bounds = rows.same_rows([x, target])
        if bounds is None or x.ndim != 2:
            raise rows.explicit_error("F.cross_entropy", [x, target])
        n_axes, c_axes = rows.row_axes(x), ()
        specs = {"input": None, "target": None}
        if reduction == "none":
            out = rows.rows_layout(mesh, bounds, (x.shape[0],), x.dtype, n_axes)
    else:
        # the class dim (1) over c_axes (a vocab-parallel loss); every other dim, the target's,
        # keeps its split: a sum over them is a pending sum over their axes (a sequence split
        # over cp is not gathered, as flattening (rows, seq) would gather it)
        c_axes = x.dim_axes[1]
        row_dims = [x.dim_axes[0], *x.dim_axes[2:]]
        n_axes = tuple(a for axes in row_dims for a in axes)
        specs = {"input": spec(x.dim_axes), "target": spec(row_dims)}
        if reduction == "none":
            out = Layout(mesh, spec(row_dims), tuple(target.shape), x.dtype)
    if reduction != "none":
        out = Layout(mesh, spec([], in_mesh_order(mesh, n_axes)), (), x.dtype)
    c_group, n_group = group_of(mesh, c_axes), group_of(mesh, n_axes)
    lo, hi = (0, x.shape[1]) if c_group is None else block_bounds(x, 1, _rank(mesh))
    n_classes = x.shape[1]

    def local(b):
        logits, t = b["input"], b["target"]
        ignore, smooth = b["ignore_index"], b["label_smoothing"]
        valid = t != ignore
        if c_group is None:
            loss = F.cross_entropy(
                logits, t, ignore_index=ignore, reduction="none", label_smoothing=smooth
            )
        else:
            loss = _vocab_parallel_ce(logits, t, valid, lo, hi, n_classes, smooth, c_group)
        if reduction == "none":
            return loss
        total = loss.sum()
        if reduction == "sum":
            return total
        count = valid.sum().to(total.dtype)
        if n_group is not None:
            count = group_psum(count, n_group)
        return total / count

    return OpSharding(specs, out, local, by_name=True)


def _vocab_parallel_ce(logits, t, valid, lo, hi, n_classes, smooth, group):
    m = group_pmax(safe_amax(logits, (1,), True), group).detach()
    z = logits - m
    sumexp = torch.exp(z).sum(1)
    inside = (t >= lo) & (t < hi)
    if hi > lo:
        idx = torch.where(inside, t - lo, 0).unsqueeze(1)
        picked = z.gather(1, idx).squeeze(1) * inside.to(z.dtype)
    else:  # an empty vocab block: zeros that depend on the targets as on the other ranks, so
        # that under vmap the psum below is batched (or not) the same way on every rank
        picked = z.sum(1) * inside.to(z.dtype)
    parts = [sumexp, picked] + ([z.sum(1)] if smooth else [])
    red = group_psum(torch.stack(parts), group)
    lse = torch.log(red[0])
    loss = lse - red[1]
    if smooth:
        loss = (1 - smooth) * loss + smooth * (lse - red[2] / n_classes)
    return torch.where(valid, loss, torch.zeros_like(loss))


# -- attention ------------------------------------------------------------------------------


def sdpa_rule(op, args, kwargs):
    bound = bind(op, args, kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    gqa = bool(bound["enable_gqa"])
    meta = meta_call(op, args, kwargs)
    batch = tuple(meta.shape[:-2])  # q, k and v's leading dims broadcast to these

    def leading(x):  # x's leading dims; under enable_gqa k/v's head count is shown as q's
        shape = list(x.shape[:-2])
        if gqa and x is not q and shape and shape[-1] > 1:
            shape[-1] = batch[-1]
        return Layout(x.mesh, spec(x.dim_axes[:-2]), tuple(shape), x.dtype)

    lead = [leading(x) for x in (q, k, v)]
    dims = align(lead, batch)
    if gqa and dims and dims[-1]:
        n = q.mesh.size(dims[-1])
        if any(x.shape[-3] % n for x in (q, k, v) if x.ndim >= 3):
            dims[-1] = ()  # uneven head blocks would not pair q heads with their k/v group
    out_dims = [*dims, (), ()]
    specs = {
        n: spec([*own_dims(x, dims, batch), (), ()])
        for n, x in zip(("query", "key", "value"), lead)
    }
    mask = bound["attn_mask"]
    if isinstance(mask, BaseLayout):
        specs["attn_mask"] = spec(own_dims(mask, out_dims, tuple(meta.shape)))
    out = out_layout(q.mesh, out_dims, (), meta)
    block = None if q.mesh.is_abstract else out.shard_metadata(q.mesh.rank).slices()
    shape = (*batch, q.shape[-2], k.shape[-2])  # the attention weights' global shape

    def local(b):
        p = b["dropout_p"]
        if not p:
            return op(**b)
        return _sdpa_dropout(b, p, shape, block, out)

    return OpSharding(specs, out, local, by_name=True)


def _sdpa_dropout(b, p, shape, block, out):
    """Attention with dropout on local blocks: the math path of dense sdpa, with the weights'
    dropout mask drawn for the global shape from the default generator and sliced to this
    rank's block, so it equals dense ``F.scaled_dot_product_attention`` for the same seed."""
    q, k, v = b["query"], b["key"], b["value"]
    if b["enable_gqa"] and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scale = b["scale"]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    mask = b["attn_mask"]
    if b["is_causal"]:
        mask = torch.ones(shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    elif mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, -1)
    noise = random.whole(
        out, shape, weights.dtype, weights.device, "bernoulli_", (1 - p,), what="sdpa dropout_p"
    )
    noise = noise[(*block[:-2], slice(None), slice(None))] if block is not None else noise
    return (weights * noise.div_(1 - p)) @ v


# -- dropout --------------------------------------------------------------------------------


#: the dropout family: op -> (feature noise, alpha, the rank of an unbatched input, which the op
#: treats as one sample: ``dropout1d``'s ``(C, L)``, ``dropout3d``'s ``(C, D, H, W)``)
_DROPOUTS = {
    F.dropout: (False, False, None),
    torch.dropout: (False, False, None),
    torch.feature_dropout: (True, False, None),
    torch.alpha_dropout: (False, True, None),
    torch.feature_alpha_dropout: (True, True, None),
    F.dropout1d: (True, False, 2),
    F.dropout2d: (True, False, None),
    F.dropout3d: (True, False, 4),
    F.alpha_dropout: (False, True, None),
    F.feature_alpha_dropout: (True, True, None),
}
#: ATen's alpha dropout constant (SELU's scale times its alpha)
_ALPHA = 1.7580993408473766


def dropout_family_rule(op, args, kwargs):
    """Dropout, channel-wise and alpha dropout (see the module docstring): ATen's
    ``_dropout_impl`` on the whole noise, drawn once for the global shape, each rank keeping its
    block of it."""
    feature, alpha, unbatched = _DROPOUTS[op]
    bound = bind(op, args, kwargs)
    x = bound["input"]
    if bound.get("inplace"):
        raise TypeError(f"ShardedArray is immutable: {op.__name__}(inplace=True) is not supported")
    meta = meta_call(op, args, kwargs)  # torch's checks and warnings (p's range, the rank)
    training = bound["training"] if "training" in bound else bound["train"]
    affine = alpha and training  # a pending sum is reduced first: b is added once
    out = out_layout(x.mesh, x.dim_axes, () if affine else x.partial, meta)
    if not training:
        return OpSharding([None], out, lambda t, *a, **k: t)
    shape = tuple(x.shape)
    if not feature or len(shape) < 2:
        noise_shape = shape  # (a feature dropout of fewer dims: torch's error, from meta_call)
    elif len(shape) == unbatched:  # one sample: its channels are dim 0
        noise_shape = (shape[0],) + (1,) * (len(shape) - 1)
    else:
        noise_shape = shape[:2] + (1,) * (len(shape) - 2)
    block = None
    if not x.mesh.is_abstract:
        slices = x.shard_metadata(x.mesh.rank).slices()
        block = tuple(sl if n > 1 else slice(None) for sl, n in zip(slices, noise_shape))
    what = op.__name__

    def local(b):
        t, p = b["input"], b["p"]
        if p == 0 or math.prod(shape) == 0:  # ATen returns the input
            return t
        if p == 1:
            return t * torch.zeros((), dtype=t.dtype, device=t.device)
        noise = random.whole(out, noise_shape, t.dtype, t.device, "bernoulli_", (1 - p,), what=what)
        if not alpha:
            noise.div_(1 - p)
            return t * noise[block]
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        shift = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        return t * noise[block] + shift[block]

    in_specs = [spec(x.dim_axes)] if affine and x.partial else [None]
    return OpSharding(in_specs, out, local, by_name=True)


def _register():
    for name in ("softmax", "log_softmax"):
        register_rule(
            getattr(F, name),
            softmax_rule,
            aliases=(getattr(torch, name), getattr(torch.Tensor, name)),
        )
    register_rule(F.layer_norm, _norm_rule(rms=False))
    register_rule(F.rms_norm, _norm_rule(rms=True))
    register_rule(F.embedding, embedding_rule)
    register_rule(F.cross_entropy, cross_entropy_rule)
    cross_entropy_rule.explicit_layouts = True
    register_rule(F.scaled_dot_product_attention, sdpa_rule)
    for op in _DROPOUTS:
        register_rule(op, dropout_family_rule)


_register()
