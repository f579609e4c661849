"""ShardedArray: one plain local tensor plus a static :class:`Layout`, registered as a pytree.

The only pytree child is the local tensor, so ``torch.func`` transforms, optree utilities and
``torch.compile`` see ordinary tensors; the layout rides along as static aux data.

Under ``torch.func.vmap`` a layout describes the per-example (logical) value and the batch dim
lives only in the local tensor. The unflatten rule below keeps the two consistent at vmap's
boundaries: a local tensor with *more* dims than its layout (what vmap returns, with
``out_dims=0``) gets unsharded leading dims prepended to the layout; a local tensor with *fewer*
dims (what vmap passes in for stacked values) drops the unsharded dim whose removal matches the
local shape. Vmapping over a sharded dim is refused with an error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree

from . import _compat
from .spec import BaseLayout, Layout, P, Parts, PartsLayout, ShardMetadata, _layout

__all__ = ["ShardedArray"]


class ShardedArray:
    """An immutable sharded value: ``local`` (this rank's shard) and ``layout`` (static).

    Build one with :func:`fshard.shard`, :func:`fshard.from_local` or a creation function,
    never by assigning fields. Torch functions and operators dispatch to fshard's op rules.

    Updates are functional, as in JAX: ``x.at[idx].set(v)`` (also ``add``, ``multiply``,
    ``min``, ``max``, ``get``) returns a new value; ``x += y`` rebinds the name ``x`` to
    ``x + y`` (nothing another name holds changes, as ``jax.Array``), except in a
    ``torch.nn.Module``'s method, model code, where it is torch's in-place operator (every holder
    of the object sees the update). The in-place forms models
    use (``x[idx] = v``, ``x.masked_fill_(m, v)``, ``x.index_add_(...)``, ``x.zero_()``...)
    rebind the object ``x`` to the functional result, and are refused with a ``TypeError``
    where that could differ from torch: when ``x`` shares its data with another live value (a
    view, or a value on the other side of a ``torch.func``/pytree boundary). See
    :mod:`fshard.ops.inplace`.

    Example:
        >>> import torch, fshard as fs
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.arange(8.0), mesh, fs.P("x"))
        >>> x.shape, x.local.shape, x.spec
        (torch.Size([8]), torch.Size([4]), P('x'))
    """

    __slots__ = ("local", "layout", "_alias")  # _alias: see fshard.ops.inplace

    def __init__(self, local: torch.Tensor, layout: Layout):
        if not isinstance(layout, BaseLayout):
            raise TypeError(f"layout must be a fshard.Layout, got {type(layout).__name__}")
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"local must be a torch.Tensor, got {type(local).__name__}")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "layout", layout)

    @staticmethod
    def _raw(local, layout: Layout) -> ShardedArray:
        """Construct without checks (hot path and pytree unflatten)."""
        if _dynamo_compiling():  # dynamo cannot trace the slot setters; it traces __init__
            return ShardedArray(local, layout)
        obj = _new(ShardedArray)
        _set_local(obj, local)
        _set_layout(obj, layout)
        return obj

    @staticmethod
    def _derived(local, layout: Layout) -> ShardedArray:
        """:meth:`_raw` with the layout's dtype taken from ``local`` (a layout describes its
        local tensor: autocast or a cast inside a tree map may change the dtype a rule or the
        flattened value predicted). One identity check on the hot path; the retyped layout is a
        cache lookup."""
        dtype = local.dtype
        if dtype is not layout.dtype:
            layout = layout.with_dtype(dtype)
        return ShardedArray._raw(local, layout)

    def __setattr__(self, name, value):
        if name == "requires_grad":  # sew's `h.requires_grad = True`: the local block's flag
            # (an attribute set, which functorch allows where it refuses requires_grad_())
            if self.local.requires_grad != value:
                self.local.requires_grad = value
            return
        raise TypeError(
            f"ShardedArray is immutable: cannot set {name!r}. Build a new value instead "
            "(fs.reshard, fs.from_local, or a functional op such as x + y)"
        )

    def __setitem__(self, key, value):
        """``x[key] = value``: rebinds ``x`` to ``x.at[key].set(value)`` (refused when ``x``
        shares its data with another live value; see :mod:`fshard.ops.inplace`)."""
        _INDEXING.set_item(self, key, value)

    @property
    def at(self):
        """JAX's functional indexed update: ``x.at[idx].set(v)``, ``.add(v)`` (repeated
        indices accumulate), ``.multiply(v)``, ``.min(v)``, ``.max(v)``, ``.get()``.

        ``idx`` is anything ``x[idx]`` accepts: ints, slices, ``None``, ``...``, lists and
        integer tensors. The result is a new value with ``x``'s shape; ``x`` is unchanged.

        Example:
            >>> y = x.at[..., 0].set(0.0)  # doctest: +SKIP
        """
        return _INDEXING.at(self)

    def __reduce__(self):
        return (_rebuild_sharded, (self.local, self.layout))

    # -- static metadata ----------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.layout.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def ndim(self) -> int:
        return self.layout.ndim

    def dim(self) -> int:
        return self.layout.ndim

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return self.layout.dtype.is_floating_point

    def is_complex(self) -> bool:
        return self.layout.dtype.is_complex

    @property
    def spec(self) -> P:
        return self.layout.spec

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def requires_grad(self) -> bool:
        return self.local.requires_grad

    def requires_grad_(self, requires_grad: bool = True) -> ShardedArray:
        """``Tensor.requires_grad_`` of the local block, returning ``self`` (transformers'
        activation checkpointing marks the input embeddings' output this way). A no-op when the
        block already is as asked: inside ``torch.func.grad`` every value computed from the
        params requires grad, where functorch would refuse the call on a plain tensor."""
        if self.local.requires_grad != requires_grad:
            self.local.requires_grad_(requires_grad)
        return self

    # Static facts of the local block, the same on every rank (transformers probes them):
    is_cuda = property(lambda self: self.local.is_cuda)
    is_cpu = property(lambda self: self.local.is_cpu)
    is_meta = property(lambda self: self.local.is_meta)
    is_nested = property(lambda self: self.local.is_nested)
    is_sparse = property(lambda self: self.local.is_sparse)
    is_quantized = property(lambda self: self.local.is_quantized)

    def shards_metadata(self) -> list[ShardMetadata]:
        """Every rank's block of the global value, in rank order."""
        return self.layout.shards_metadata()

    def __repr__(self) -> str:
        local = tuple(self.local.shape) if isinstance(self.local, torch.Tensor) else self.local
        return (
            f"ShardedArray(shape={tuple(self.layout.shape)}, dtype={self.layout.dtype}, "
            f"spec={self.layout.spec}, mesh={self.layout.mesh!r}, local_shape={local})"
        )

    def __len__(self) -> int:
        if not self.layout.shape:
            raise TypeError("len() of a 0-d ShardedArray")
        return self.layout.shape[0]

    def __iter__(self):
        """Iterate over dim 0, as a tensor does, where that moves nothing: the rows of a value
        whose dim 0 is not split (each a view of the local block). Over a split dim 0 it is
        refused with a ``TypeError`` (each row would be gathered from its rank): iterate over
        ``fs.gather(x)``, or over the local rows inside ``fs.shard_map``. (transformers'
        ``ModelOutput`` probes its first field with ``iter()`` and takes the ``TypeError`` as
        "not a sequence": a data-parallel forward then gathers nothing, issue 37 item 9.)"""
        if not self.layout.shape:
            raise TypeError("iteration over a 0-d ShardedArray")
        lay = self.layout
        if not isinstance(lay, Layout) or lay.dim_axes[0]:
            raise TypeError(
                f"iteration over a ShardedArray whose dim 0 is split ({lay.spec} on "
                f"{lay.mesh!r}) would gather every row; iterate over fs.gather(x), or over the "
                "local rows inside fs.shard_map"
            )
        return (self[i] for i in range(lay.shape[0]))

    def __bool__(self) -> bool:
        """The truth value of a one-element value that is the same on every rank (replicated,
        no pending sum), e.g. ``if mask.all():``. A split or pending value is refused: ranks
        hold different parts of it and could take different branches."""
        return bool(self._invariant_local("bool()"))

    def item(self):
        """The Python number of a one-element value the same on every rank (as :meth:`__bool__`)."""
        return self._invariant_local("item()").item()

    def view(self, *shape):
        """``Tensor.view``; a size given as a 0-d integer tensor (LED's ``x.view(n,
        torch.div(x.size(1), w, rounding_mode="trunc"), ...)``) is its number, as torch reads it."""
        return _DISPATCH(torch.Tensor.view, (self, *_int_sizes(shape)), _NO_KWARGS)

    def reshape(self, *shape):
        """``Tensor.reshape``, sizes read as :meth:`view` reads them."""
        return _DISPATCH(torch.Tensor.reshape, (self, *_int_sizes(shape)), _NO_KWARGS)

    def __format__(self, spec: str) -> str:
        """``f"{x}"`` of a 0-d value is its number, as for a tensor (switch_transformers'
        ``self.experts[f"expert_{idx}"]``); it must be the same on every rank (as :meth:`item`)."""
        if self.layout.ndim == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def tolist(self):
        """``Tensor.tolist`` of a value the same on every rank (as :meth:`item`)."""
        return self._invariant_local("tolist()").tolist()

    def __float__(self) -> float:
        """``float(loss)`` of a one-element value the same on every rank (as :meth:`item`)."""
        return float(self._invariant_local("float()"))

    def __int__(self) -> int:
        return int(self._invariant_local("int()"))

    def _invariant_local(self, what: str) -> torch.Tensor:
        lay = self.layout
        if lay.is_explicit or lay.sharded_axes or lay.partial:
            how = f"split as {lay.spec}" if not lay.partial else f"pending over {lay.partial}"
            if lay.is_explicit:
                how = "split in row blocks"
            raise TypeError(
                f"{what} of a ShardedArray {how}: each rank holds a different part of it, so "
                "ranks could take different branches. Reduce it to a replicated value first: "
                "x.all() / x.any() / (x == y).all() (they reduce over the mesh), "
                "fs.reshard(x, fs.P()), or gather it (bool(fs.gather(x)))"
            )
        return self.local

    __hash__ = object.__hash__

    # -- torch function protocol: everything goes to the op rules -----------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _DISPATCH(func, args, kwargs or _NO_KWARGS)

    def __getattr__(self, name: str):
        # Tensor methods (x.sum(0), x.reshape(...)) do not reach __torch_function__ on a
        # non-Tensor class, so forward them as the corresponding Tensor method.
        method = getattr(torch.Tensor, name, None)
        if method is None or name.startswith("__"):
            spelling = _PEER_SPELLINGS.get(name)
            hint = f"; fshard's spelling is {spelling}" if spelling else ""
            raise AttributeError(f"'ShardedArray' object has no attribute {name!r}{hint}")
        if name.endswith("_") and not name.endswith("__"):
            forward = _INDEXING.inplace_method(name)
            if forward is None:
                raise TypeError(
                    f"ShardedArray: in-place Tensor.{name} is not supported (it has no "
                    "functional form fshard could rebind to)"
                )
            setattr(ShardedArray, name, forward)
            return getattr(self, name)
        if not callable(method):  # a property such as x.T or x.mT
            return _DISPATCH(method.__get__, (self,), {})
        if _dynamo_compiling():  # a class attribute set in a trace is not seen by it
            return lambda *args, **kwargs: _DISPATCH(method, (self, *args), kwargs)
        # Install a forwarding method on the class, so later calls skip __getattr__.
        setattr(ShardedArray, name, _forward_method(method))
        return getattr(self, name)


#: DTensor's and ShardedTensor's names for what a ShardedArray spells otherwise.
_PEER_SPELLINGS = {
    "full_tensor": "fs.gather(x) (the full value on every rank; fs.gather(x, dst=0): one rank)",
    "to_local": "x.local (this rank's block, a plain tensor)",
    "_local_tensor": "x.local",
    "placements": "x.spec (a fs.P: the mesh axes of each dim; partial= the pending sums)",
    "redistribute": "fs.reshard(x, fs.P(...)) (fs.plan(x.layout, spec) shows its collectives)",
    "device_mesh": "x.mesh (a fs.Mesh; x.mesh.device_mesh is its DeviceMesh)",
    "local_shards": "x.local (one block per rank), or x.shards_metadata() for every rank's box",
    "sharding_spec": "x.spec",
    "metadata": "x.layout (x.shards_metadata(): every rank's offsets and sizes)",
}


def _int_sizes(sizes: tuple) -> tuple:
    """``sizes`` with each 0-d integer tensor (or ShardedArray, the same on every rank) made
    its number, also inside one tuple or list (``view((a, b))``): a plan keys on sizes, and a
    tensor's value is not in the key."""
    if all(type(s) is int for s in sizes):
        return sizes
    out = []
    for s in sizes:
        if isinstance(s, (tuple, list)):
            s = type(s)(_int_sizes(tuple(s)))
        elif (
            isinstance(s, (torch.Tensor, ShardedArray))
            and s.ndim == 0
            and not (s.dtype.is_floating_point or s.dtype.is_complex)
        ):
            s = int(s)
        out.append(s)
    return tuple(out)


def _forward_method(tensor_method):
    def method(self, *args, **kwargs):
        return _DISPATCH(tensor_method, (self, *args), kwargs)

    method.__name__ = getattr(tensor_method, "__name__", "method")
    return method


def _no_dispatcher(func, args, kwargs):
    raise RuntimeError("fshard.ops is not imported: import fshard (it installs the op rules)")


def install_dispatch(dispatch) -> None:
    """Route every torch function, Tensor method and operator on a ShardedArray to
    ``dispatch(func, args, kwargs)``. :mod:`fshard.ops.registry` installs its dispatcher when it
    is imported (it depends on this module, so this module cannot import it)."""
    global _DISPATCH
    _DISPATCH = dispatch


_DISPATCH = _no_dispatcher


class Indexing(NamedTuple):
    """What :mod:`fshard.ops` gives ShardedArray for the forms that are not torch functions:
    ``x[key] = value`` (``set_item(x, key, value)``), ``x.at`` (``at(x)``), in-place Tensor
    methods (``inplace_method(name)``: the method, or ``None`` where none exists) and augmented
    assignment (``augmented(x, name, y, frame)``: ``x`` updated, or ``NotImplemented`` for
    Python's ``x = x op y``; ``frame`` the statement's). Installed with
    :func:`install_indexing` when the ops are imported, as the dispatcher is."""

    set_item: Callable
    at: Callable
    inplace_method: Callable
    augmented: Callable


def install_indexing(indexing: Indexing) -> None:
    """Route item assignment, ``.at`` and in-place methods to ``indexing`` (see
    :class:`Indexing`; :mod:`fshard.ops` installs it, this module cannot import it)."""
    global _INDEXING
    _INDEXING = indexing


def _no_indexing(*args):
    _no_dispatcher(None, args, {})


def _no_augmented(*args):
    return NotImplemented


_INDEXING = Indexing(_no_indexing, _no_indexing, _no_indexing, _no_augmented)
_NO_KWARGS: dict = {}  # never mutated: dispatch only reads kwargs
_new = object.__new__
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_set_local = ShardedArray.__dict__["local"].__set__  # slot setters: the frozen class's
_set_layout = ShardedArray.__dict__["layout"].__set__  # __setattr__ refuses assignment
_set_alias = ShardedArray.__dict__["_alias"].__set__
#: ``_alias`` of a value whose local tensor another object may hold (it crossed a pytree
#: boundary): in-place forms on it are refused (fshard.ops.inplace).
PYTREE_SHARED = "pytree"


def _mark_shared(x: ShardedArray) -> None:
    _set_alias(x, PYTREE_SHARED)


def _forward_operator(name: str):
    tensor_op = getattr(torch.Tensor, name)

    def op(self, *args):
        return _DISPATCH(tensor_op, (self, *args), _NO_KWARGS)

    if name in ("__eq__", "__ne__") and not _compat.TRACES_CLASS_EQ:

        def op(self, *args):  # noqa: F811 (the older dynamo's twin)
            if isinstance(self, type):  # dynamo's `cls == other` as `cls.__eq__(other)`
                return (self is ShardedArray) == (name == "__eq__")
            return _DISPATCH(tensor_op, (self, *args), _NO_KWARGS)

    op.__name__ = name
    return op


#: Tensor dunders a ShardedArray defines itself (protocol, immutability): never forwarded.
_OWN = frozenset(n for n, v in vars(ShardedArray).items() if n.startswith("__"))


def expose_operators(op) -> None:
    """Forward every Python operator of ``torch.Tensor`` that is ``op`` (e.g. ``__xor__``,
    ``__rfloordiv__``, ``__pos__``) on ShardedArray, so ``x ^ y`` reaches ``op``'s rule. The op
    registry calls this for each registered op: the operator list is derived from the rules."""
    for name in _TENSOR_OPERATORS.get(op, ()):
        setattr(ShardedArray, name, _forward_operator(name))
        if name == "__eq__":  # defining __eq__ would otherwise leave the class unhashable
            ShardedArray.__hash__ = object.__hash__


def _tensor_operators() -> dict:
    """``{Tensor method: (its dunder names)}`` for Tensor's operator dunders."""
    out: dict = {}
    for name in dir(torch.Tensor):
        if not (name.startswith("__") and name.endswith("__")) or name in _OWN:
            continue
        if name.startswith("__i") and name[3:-2] in _INPLACE_NAMES:
            continue  # x += y falls back to x = x + y: the name is rebound, as jax.Array
        value = getattr(torch.Tensor, name, None)
        if callable(value):
            try:
                out.setdefault(value, []).append(name)
            except TypeError:  # unhashable
                continue
    return {k: tuple(v) for k, v in out.items()}


_INPLACE_NAMES = ("add", "sub", "mul", "truediv", "matmul", "pow", "and", "or", "xor", "mod")
_INPLACE_NAMES += ("floordiv", "lshift", "rshift", "div")
_TENSOR_OPERATORS = _tensor_operators()


def _augmented(name: str):
    """``x op= y``: :attr:`Indexing.augmented` decides (see :mod:`fshard.ops.inplace`)."""

    def op(self, other):
        if _dynamo_compiling():  # traced: x = x op y (the graph has no holders to update)
            return NotImplemented
        return _INDEXING.augmented(self, name, other, sys._getframe(1))

    op.__name__ = f"__i{name}__"
    return op


for _name in _INPLACE_NAMES:
    if _name != "div":  # Python 2's: never called
        setattr(ShardedArray, f"__i{_name}__", _augmented(_name))
ShardedArray.__hash__ = object.__hash__


# -- pytree registration ---------------------------------------------------------------------


def _refuse_torch_jacfwd(layout: Layout) -> None:
    """``torch.func.jacfwd`` (and ``hessian``, its jacfwd of jacrev) builds its basis from each
    rank's local block, not the global value: a wrong Jacobian for a split or partial argument.
    Its basis (one extra leading dim) is rebuilt here by its ``wrapper_fn``; refuse it there."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return
        code = frame.f_code
        if code.co_name == "wrapper_fn" and code.co_filename.endswith("eager_transforms.py"):
            if "flat_basis" in frame.f_locals:
                raise NotImplementedError(
                    f"torch.func.jacfwd / torch.func.hessian with respect to a ShardedArray laid "
                    f"out as {layout.spec}: torch.func builds its basis from each rank's local "
                    "block, which is not a basis of the global value (the Jacobian would be "
                    "wrong). Use fs.jacfwd / fs.hessian (same arguments; basis of the global "
                    "value), or torch.func.jacrev"
                )
            return
        frame = frame.f_back


def _flatten(x: ShardedArray):
    if not _dynamo_compiling():
        _mark_shared(x)  # its local now has another holder (fshard.ops.inplace)
    return (x.local,), x.layout


def _unflatten(layout: Layout, children) -> ShardedArray:
    (local,) = children
    if isinstance(local, ShardedArray):
        raise TypeError(
            "a ShardedArray nested inside a ShardedArray: torch.func.jacrev/jacfwd/hessian of a "
            "function returning a ShardedArray, taken w.r.t. a ShardedArray, would build one "
            "block per pair of elements, and no layout describes such a block. Use fs.jacfwd / "
            "fs.hessian (their Jacobian of a ShardedArray output keeps its layout), or take the "
            "jacobian of plain tensors: of t -> fs.gather(f(fs.shard(t, mesh, spec))) w.r.t. "
            "the full tensor t, or of the local blocks inside fs.shard_map"
        )
    if not isinstance(local, torch.Tensor):  # optree/torch utilities put placeholders here
        return ShardedArray._raw(local, layout)
    if local.dim() == layout.ndim + 1 and (layout.varying_axes or layout.partial):
        _refuse_torch_jacfwd(layout)
    if layout.partial and torch.compiler.is_dynamo_compiling():
        # torch.func.grad rebuilds its inputs here. Under dynamo a partial input cannot be told
        # from a partial intermediate (lax._is_grad_leaf), so its gradient would miss the Claim
        # and come back summed over the partial axes: refuse instead of a wrong number.
        raise NotImplementedError(
            f"a ShardedArray with pending sums over {layout.partial} passed through "
            "a pytree while torch.compile traces: differentiating or tree-mapping a partial "
            "value inside compiled code is not supported. Reduce it first "
            "(fs.reshard(x, spec_without_partial)) outside the compiled function, or run this "
            "part eagerly"
        )
    extra = local.dim() - layout.ndim
    if extra:
        layout = _relayout_for_rank_change(layout, local, extra)
    out = ShardedArray._derived(local, layout)
    if not _dynamo_compiling():
        _mark_shared(out)
    return out


def _relayout_for_rank_change(layout: Layout, local: torch.Tensor, extra: int) -> Layout:
    if isinstance(layout, PartsLayout):
        return _relayout_parts(layout, local, extra)
    if extra > 0:
        # vmap outputs (batch dims in front): unsharded leading dims, sizes from the local.
        lead = tuple(local.shape[:extra])
        if layout.is_explicit:  # row blocks (fshard.ops.rows): every box gains the dims whole
            boxes = [((0,) * extra + o, lead + s) for o, s in layout.chunks]
            return Layout.explicit(layout.mesh, boxes, lead + layout.shape, layout.dtype)
        spec = P(*([None] * extra), *layout.dim_axes, partial=layout.partial)
        return _layout(layout.mesh, spec, lead + layout.shape, layout.dtype)
    # vmap inputs: a stacked dim was taken off. A batched local says which one (its bdim, in
    # the coordinates of the value one level out: the layout's); otherwise find the unsharded
    # dim whose removal matches the local shape.
    want = tuple(local.shape)
    if extra == -1 and torch._C._functorch.is_batchedtensor(local):
        d = torch._C._functorch.maybe_get_bdim(local)
        if layout.dim_axes[d]:
            raise ValueError(
                f"cannot map over dim {d} of this ShardedArray: it is split over "
                f"{layout.dim_axes[d]} in {layout}. vmap can only map over an unsharded dim of a "
                "ShardedArray; reshard it so that the mapped dim is not split "
                "(e.g. fs.reshard(x, fs.P(None, ...)))"
            )
        spec = P(*(layout.dim_axes[:d] + layout.dim_axes[d + 1 :]), partial=layout.partial)
        shape = layout.shape[:d] + layout.shape[d + 1 :]
        return _layout(layout.mesh, spec, shape, layout.dtype)
    local_full = layout.local_shape(layout.mesh.rank) if not layout.mesh.is_abstract else None
    for d in range(layout.ndim):
        if layout.dim_axes[d]:
            continue
        shape = layout.shape[:d] + layout.shape[d + 1 :]
        if local_full is not None and local_full[:d] + local_full[d + 1 :] != want:
            continue
        axes = layout.dim_axes[:d] + layout.dim_axes[d + 1 :]
        spec = P(*axes, partial=layout.partial)
        out = _layout(layout.mesh, spec, shape, layout.dtype)
        if extra == -1:
            return out
        return _relayout_for_rank_change(out, local, extra + 1)
    raise ValueError(
        f"cannot map over this ShardedArray: its local shape {want} does not match {layout} with "
        "one unsharded dim removed. vmap can only map over an unsharded dim of a ShardedArray; "
        "reshard it so that the mapped dim is not split (e.g. fs.reshard(x, fs.P(None, ...)))"
    )


def _relayout_parts(layout: PartsLayout, local: torch.Tensor, extra: int) -> PartsLayout:
    """:func:`_relayout_for_rank_change` of a per-part layout: dims come and go as for its base
    (the parts dim is split, so it is never the one taken off) and the parts dim moves with
    them."""
    base, axes = layout.base, layout.base.dim_axes
    if extra > 0:
        lead = tuple(local.shape[:extra])
        spec = P(*([None] * extra), *axes, partial=base.partial)
        parts = Parts(spec, layout.dim + extra, layout.sizes)
        return _layout(layout.mesh, parts, lead + layout.shape, layout.dtype)
    want, full = tuple(local.shape), layout.local_shape(layout.mesh.rank)
    bdim = None
    if extra == -1 and torch._C._functorch.is_batchedtensor(local):
        bdim = torch._C._functorch.maybe_get_bdim(local)
    for d in range(layout.ndim) if bdim is None else (bdim,):
        if not axes[d] and (extra < -1 or full[:d] + full[d + 1 :] == want):
            break
    else:
        raise ValueError(
            f"cannot map over this ShardedArray: its local shape {want} does not match {layout} "
            "with one unsharded dim removed. vmap can only map over an unsharded dim; the "
            f"per-part dim {layout.dim} is split"
        )
    spec = P(*(axes[:d] + axes[d + 1 :]), partial=base.partial)
    shape = layout.shape[:d] + layout.shape[d + 1 :]
    out = _layout(
        layout.mesh, Parts(spec, layout.dim - (d < layout.dim), layout.sizes), shape, layout.dtype
    )
    return out if extra == -1 else _relayout_for_rank_change(out, local, extra + 1)


try:
    from optree.registry import __GLOBAL_NAMESPACE as _OPTREE_NS  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older optree
    _OPTREE_NS = "fshard"

optree.register_pytree_node(ShardedArray, _flatten, _unflatten, namespace=_OPTREE_NS)
torch_pytree.register_pytree_node(
    ShardedArray,
    lambda x: ([_flatten(x)[0][0]], x.layout),
    lambda children, layout: _unflatten(layout, children),
    serialized_type_name="fshard.ShardedArray",
    flatten_with_keys_fn=lambda x: (
        [(torch_pytree.GetAttrKey("local"), _flatten(x)[0][0])],
        x.layout,
    ),
)


def is_sharded(x) -> bool:
    """True for a :class:`ShardedArray` (use as ``is_leaf=`` in tree utilities)."""
    return isinstance(x, ShardedArray)


def _rebuild_sharded(local: torch.Tensor, layout: Layout) -> ShardedArray:
    """Unpickle (module level, so ``torch.load(weights_only=True)`` can allow-list it)."""
    return ShardedArray._raw(local, layout)


_compat.trace_matmul_operator(ShardedArray)  # `x @ w` under torch.compile (torch < 2.14)
_compat.trace_torch_function_in_tuples()  # `torch.cat((a, b))` under torch.compile
