"""Indexing rules: ``x[key]`` with any key torch accepts, ``x.at[key]`` updates, and ops whose
output shape depends on the values (``nonzero``, boolean masks, ``one_hot`` without
``num_classes``).

- ``x[key]``: ints, slices, ``None`` and ``...`` are local on the dims they keep whole (a full
  slice keeps a dim's axes); a dim they cut is gathered first. List and integer-tensor indices
  (``x[..., [-2], :]``, ``mask[batch_idx, kv_idx]``) make the dims they index whole; the index
  tensors are replicated and their broadcast dims are unsplit (where torch puts them: in
  place of adjacent indices, else first).
- ``x.at[key].set(v)`` / ``add`` / ``multiply`` / ``min`` / ``max`` (:func:`index_update`): the
  dims ``x[key]`` cuts are whole, ``v`` takes the layout of ``x[key]``; a pending sum survives
  ``set``/``add`` when ``v`` is pending over the same axes.
- ``x.at[mask].set(v)`` / ``x[mask] = v`` with a boolean ``mask`` over leading dims and ``v``
  the same for every selected position (a number or a row) is ``torch.where``: elementwise, any
  layout. With one row of ``v`` per selected position it runs on replicated values only.
- ``t[key] = v`` on a plain tensor ``t`` with a ShardedArray ``v`` writes ``v`` made replicated
  into ``t`` (a plain tensor is a replicated value).
- Data-dependent shapes (``nonzero``, ``argwhere``, ``x[bool_mask]``, ``one_hot`` with
  ``num_classes=-1``) run on a value that is the same on every rank (replicated; a pending sum
  is reduced first) and give a replicated result; on a split value each rank's result would
  have another shape: ``ValueError`` naming the fix.

Example:
    >>> y = x[..., [-2], :]               # x (B, T, V) P("dp"): local, no communication  # doctest: +SKIP
    >>> z = x.at[:, 0].set(0.0)           # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..array import ShardedArray
from ..spec import BaseLayout, Layout, P, _layout
from . import parts
from ._common import meta_call, out_layout, spec
from .binding import bind
from .elementwise import own_dims
from .registry import OpSharding, register_rule, rule_for, tensor_inputs

__all__ = ["index_update", "At", "UPDATE_MODES", "ValueDependentShape"]

UPDATE_MODES = ("set", "add", "multiply", "min", "max")
_SCATTER = {"multiply": "prod", "min": "amin", "max": "amax"}


# -- the dense function ---------------------------------------------------------------------


def _tensors_in(key) -> list:
    items = key if type(key) is tuple else (key,)
    return [it for it in items if isinstance(it, (torch.Tensor, ShardedArray))]


def index_update(x, key, values, mode: str = "set"):
    """``x`` with ``x[key]`` updated by ``values`` (JAX's ``x.at[key].<mode>(values)``).

    ``mode``: ``"set"``, ``"add"`` (repeated indices accumulate), ``"multiply"``, ``"min"``,
    ``"max"``. Works on plain tensors and ShardedArrays, under ``grad`` and ``vmap``.

    Example:
        >>> import torch
        >>> index_update(torch.zeros(2, 3), (slice(None), [0, 0]), 1.0, "add")
        tensor([[2., 0., 0.],
                [2., 0., 0.]])
    """
    if mode not in UPDATE_MODES:
        raise ValueError(f"index_update: mode must be one of {UPDATE_MODES}, got {mode!r}")
    masked = _masked_update(x, key, values, mode)
    if masked is not None:
        return masked
    relevant = (x, values, *_tensors_in(key))
    if has_torch_function(relevant):
        return handle_torch_function(index_update, relevant, x, key, values, mode)
    pos = torch.arange(x.numel(), device=x.device).view(x.shape)[key]
    if not isinstance(values, torch.Tensor):
        values = torch.tensor(values, dtype=x.dtype, device=x.device)
    values = values.to(x.dtype)
    extra = values.ndim - pos.ndim
    if extra > 0:  # torch accepts leading size-1 dims on the values
        values = values.reshape(values.shape[extra:])
    values = values.expand(pos.shape).reshape(-1)
    flat, idx = x.reshape(-1), pos.reshape(-1)
    if mode in ("set", "add"):
        out = flat.index_put((idx,), values, accumulate=mode == "add")
    else:
        out = flat.scatter_reduce(0, idx, values, _SCATTER[mode], include_self=True)
    return out.view(x.shape)


_COMBINE = {
    "set": lambda x, v: v,
    "add": torch.add,
    "multiply": torch.mul,
    "min": torch.minimum,
    "max": torch.maximum,
}


def _masked_update(x, key, values, mode):
    """``x.at[mask].<mode>(v)`` as ``torch.where``, or ``None``: ``mask`` a boolean tensor over
    the leading dims of ``x`` and ``v`` the same for every selected position (a number, or a
    value broadcasting to ``x.shape[mask.ndim:]``). Then the update is elementwise, with no
    value-dependent shape (gemma3's ``ids[image_mask] = 0``), so it runs on any layout of
    ``x`` and ``mask``. Values with one row per selected position (a count only the mask's
    contents give) are not: ``None``."""
    mask = key[0] if type(key) is tuple and len(key) == 1 else key
    if not isinstance(mask, (torch.Tensor, ShardedArray)) or mask.dtype != torch.bool:
        return None
    k = mask.ndim
    if k > x.ndim or tuple(mask.shape) != tuple(x.shape[:k]):
        return None  # torch's own error
    rest = x.ndim - k
    if isinstance(values, (torch.Tensor, ShardedArray)):
        lead = values.ndim - rest
        if lead > 0 and (lead > 1 or values.shape[0] != 1):
            return None  # one row per selected position (or torch's shape error)
        if lead == 1:
            values = values[0]
        values = values.to(x.dtype)
    elif not isinstance(values, (bool, int, float)):
        return None
    cond = mask.reshape(*mask.shape, *(1,) * rest)
    out = torch.where(cond, _COMBINE[mode](x, values), x)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class At:
    """``x.at``: ``x.at[key]`` gives an :class:`_AtIndex` with the update methods."""

    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x

    def __getitem__(self, key):
        return _AtIndex(self.x, key)


class _AtIndex:
    __slots__ = ("x", "key")

    def __init__(self, x, key):
        self.x, self.key = x, key

    def get(self):
        """``x[key]``."""
        return self.x[self.key]

    def set(self, values):
        """``x`` with ``x[key]`` replaced by ``values``."""
        return index_update(self.x, self.key, values, "set")

    def add(self, values):
        """``x`` with ``values`` added at ``key`` (repeated indices accumulate)."""
        return index_update(self.x, self.key, values, "add")

    def multiply(self, values):
        """``x`` with ``x[key]`` multiplied by ``values``."""
        return index_update(self.x, self.key, values, "multiply")

    def min(self, values):
        """``x`` with ``x[key]`` replaced by ``minimum(x[key], values)``."""
        return index_update(self.x, self.key, values, "min")

    def max(self, values):
        """``x`` with ``x[key]`` replaced by ``maximum(x[key], values)``."""
        return index_update(self.x, self.key, values, "max")


# -- planning a key -------------------------------------------------------------------------


def _is_advanced(it) -> bool:
    return isinstance(it, (Layout, list)) or (type(it) is tuple)


def _expand(x: Layout, key) -> list:
    items = list(key) if type(key) is tuple else [key]
    for it in items:
        if isinstance(it, bool) or (isinstance(it, BaseLayout) and it.dtype == torch.bool):
            raise _DataDependent()
        if isinstance(it, (list, tuple)) and torch.tensor(it).dtype == torch.bool:
            raise _DataDependent()  # a list of bools is a mask too
        if not (it is None or it is Ellipsis or isinstance(it, (int, slice)) or _is_advanced(it)):
            raise TypeError(
                f"ShardedArray indexing: unsupported index {it!r}; use ints, slices, None, ..., "
                "lists or integer tensors"
            )
    n_real = sum(1 for it in items if it is not None and it is not Ellipsis)
    out = []
    for it in items:
        if it is Ellipsis:
            out.extend([slice(None)] * (x.ndim - n_real))
        else:
            out.append(it)
    real = sum(1 for it in out if it is not None)
    return out + [slice(None)] * (x.ndim - real)


def _scalar_index(it) -> bool:
    """A 0-d integer tensor (``for e in expert_hit: x[e[0]]``): torch indexes with its value."""
    return isinstance(it, BaseLayout) and it.ndim == 0 and not it.dtype.is_floating_point


class ValueDependentShape(ValueError):
    """An op whose output shape depends on the values met a split value (each rank's result
    would have another shape); ``axes``: the mesh axes it is split over.
    :func:`fshard.nn.functional_call` adds the module it was raised in and the plan entry
    that runs that module on each rank's rows (``fs.nn.LocalRows``)."""

    def __init__(self, message: str, axes: tuple = ()):
        super().__init__(message)
        self.axes = axes


class _DataDependent(Exception):
    """A boolean index: the output shape depends on the values."""


def _plan(x: Layout, key):
    """``(cut, out_dims, meta)`` of ``x[key]``: the dims of ``x`` the key does not keep whole,
    the output's per-dim axes, and its meta tensor."""
    items = _expand(x, key)
    cut, basic, d = set(), [], 0  # basic: output dims other than the advanced block
    adv = False
    for it in items:
        if it is None:
            basic.append(("new", None))
            continue
        if isinstance(it, slice):
            if it.indices(x.shape[d]) != (0, x.shape[d], 1):
                cut.add(d)
            basic.append(("dim", d))
        else:
            cut.add(d)
            adv = adv or not (isinstance(it, int) or _scalar_index(it))
        d += 1
    # a 0-d integer tensor indexes as an int (torch reads its value: not on meta tensors)
    as_int = lambda it: 0 if _scalar_index(it) else it  # noqa: E731
    meta_key = tuple(map(as_int, key)) if type(key) is tuple else as_int(key)
    meta = meta_call(torch.Tensor.__getitem__, (x, meta_key), {})
    dims = [() if kind == "new" or d in cut else x.dim_axes[d] for kind, d in basic]
    if adv:
        b = meta.ndim - len(basic)
        dims[_advanced_position(x, items, basic, b) : 0] = [()] * b
    return cut, dims, meta


def _index_shape(it) -> tuple[int, ...]:
    if isinstance(it, BaseLayout):
        return tuple(it.shape)
    if isinstance(it, (list, tuple)):
        return tuple(torch.tensor(it).shape)
    return tuple(it.shape) if isinstance(it, torch.Tensor) else ()


def _advanced_position(x: Layout, items, basic, b) -> int:
    """Where torch puts the broadcast dims of the advanced indices among the basic output dims:
    probed on meta tensors whose dims have sizes no index broadcast can produce."""
    dims = [n for it in items for n in _index_shape(it)]
    base = max(dims, default=0) + 2  # small enough that the probe's numel fits in an int64
    sizes = [base + d for d in range(x.ndim)]
    probe = torch.empty_strided(sizes, [0] * len(sizes), device="meta")

    def stand_in(it):
        if isinstance(it, slice):
            return slice(None)
        if isinstance(it, BaseLayout):
            return torch.empty(it.shape, dtype=torch.long, device="meta")
        if isinstance(it, (list, tuple)):
            return torch.empty(torch.tensor(it).shape, dtype=torch.long, device="meta")
        return 0 if isinstance(it, int) else it

    shape = list(probe[tuple(stand_in(it) for it in items)].shape)
    want = [1 if kind == "new" else sizes[d] for kind, d in basic]
    for p in range(len(want) + 1):
        if shape[:p] == want[:p] and shape[p + b :] == want[p:]:
            return p
    raise AssertionError((shape, want))


# -- rules ----------------------------------------------------------------------------------


def getitem_rule(op, args, kwargs):
    x, key = args[0], args[1]
    if not isinstance(x, BaseLayout):
        raise NotImplementedError("indexing a plain tensor with a ShardedArray is not supported")
    try:
        cut, dims, meta = _plan(x, key)
    except _DataDependent:
        return _invariant_rule(op, args, kwargs, "boolean-mask indexing x[mask]")
    unsplit = [() if d in cut else a for d, a in enumerate(x.dim_axes)]
    specs = [spec(unsplit, x.partial)] + [P()] * (len(tensor_inputs(args, kwargs)) - 1)
    return OpSharding(specs, out_layout(x.mesh, dims, x.partial, meta))


def index_update_rule(op, args, kwargs):
    x, key, values, mode = (list(args) + [kwargs.get("mode", "set")])[:4]
    if mode not in UPDATE_MODES:
        raise ValueError(f"index_update: mode must be one of {UPDATE_MODES}, got {mode!r}")
    try:
        cut, dims, meta = _plan(x, key)
    except _DataDependent:  # values with one row per selected position (a count the mask's
        # contents give): exact on values that are the same on every rank
        return _invariant_rule(
            op, args, kwargs, "x[mask] = v with one row of v per selected position"
        )
    v = values if isinstance(values, BaseLayout) else None
    linear = mode in ("set", "add") and v is not None and v.partial == x.partial
    partial = x.partial if linear else ()
    x_dims = [() if d in cut else a for d, a in enumerate(x.dim_axes)]
    specs = [spec(x_dims, partial)]
    specs += [P()] * len(tensor_inputs((key,), {}))
    if v is not None:
        shape = tuple(meta.shape)
        v_dims = own_dims(v, dims, shape) if v.ndim <= len(shape) else [()] * v.ndim
        specs.append(spec(v_dims, partial))
    out = _layout(x.mesh, spec(x_dims, partial), x.shape, x.dtype)
    return OpSharding(specs, out)


def _invariant_rule(op, args, kwargs, what: str):
    """Ops whose output shape depends on the values: run where every tensor input is the same
    on every rank, give a replicated result (its shape read from the local result)."""
    ins = tensor_inputs(args, kwargs)
    split = [x for x in ins if x.sharded_axes]
    if split:
        x = split[0]
        raise ValueDependentShape(
            f"{what} on a ShardedArray split as {x.spec}: its output shape depends on the "
            "values, so each rank's result would have a different shape. Make the input "
            f"replicated first (fs.reshard(x, fs.P()), or fs.gather(x) for a plain tensor), "
            "or run it on local blocks in fs.shard_map",
            tuple(x.sharded_axes),
        )
    mesh = ins[0].mesh

    def local(*a, **k):
        return _replicated(op(*a, **k), mesh)

    return OpSharding([P()] * len(ins), None, local)


def _replicated(out, mesh):
    if isinstance(out, (tuple, list)):
        return type(out)(_replicated(o, mesh) for o in out)
    return ShardedArray._raw(out, _layout(mesh, P(), tuple(out.shape), out.dtype))


def setitem_rule(op, args, kwargs):
    """``t[key] = v`` on a plain tensor ``t`` with a ShardedArray ``v`` or index (pegasus_x's
    ``pe[:, :half] = torch.sin(positions * div_term)``, the positions typed like the sharded
    embeddings). A plain tensor is a replicated value (DESIGN §4), so ``v`` and the indices are
    made replicated and written into ``t`` in place, as the dense code writes; ``t`` stays a
    plain tensor. (``x[key] = v`` on a ShardedArray ``x`` never reaches this rule: it rebinds
    ``x``, ``fshard/ops/inplace.py``.)"""
    return OpSharding([P()] * len(tensor_inputs(args, kwargs)), None, _setitem)


def _setitem(t, key, v):
    t[key] = v


def nonzero_rule(op, args, kwargs):
    return _invariant_rule(op, args, kwargs, op.__name__)


def one_hot_rule(op, args, kwargs):
    """``F.one_hot``: with ``num_classes`` given, elementwise with a new whole trailing dim;
    with ``num_classes=-1`` the size depends on the values (replicated inputs only)."""
    bound = bind(op, args, kwargs)
    x, n = bound["input"], bound["num_classes"]
    if n is None or n < 0:
        return _invariant_rule(op, args, kwargs, "F.one_hot without num_classes")
    meta = meta_call(op, args, kwargs)
    dims = [*x.dim_axes, ()]
    return OpSharding([spec(x.dim_axes)], out_layout(x.mesh, dims, (), meta))


def _where_rule(elementwise):
    """``torch.where(cond)`` is ``nonzero(cond, as_tuple=True)`` (MoE expert loops); the
    three-argument form is elementwise."""

    def rule(op, args, kwargs):
        if len(args) + len(kwargs) == 1:
            return nonzero_rule(op, args, kwargs)
        return elementwise(op, args, kwargs)

    return rule


def _register():
    register_rule(torch.where, _where_rule(rule_for(torch.where)))
    getitem = parts.cuts(parts.aligned(getitem_rule, parts.getitem_groups), parts.getitem_range)
    register_rule(torch.Tensor.__getitem__, getitem)
    register_rule(index_update, index_update_rule)
    register_rule(torch.Tensor.__setitem__, setitem_rule)
    register_rule(torch.nonzero, nonzero_rule, aliases=(torch.Tensor.nonzero,))
    register_rule(torch.argwhere, nonzero_rule, aliases=(torch.Tensor.argwhere,))
    register_rule(torch.masked_select, nonzero_rule, aliases=(torch.Tensor.masked_select,))
    register_rule(F.one_hot, one_hot_rule)


_register()
