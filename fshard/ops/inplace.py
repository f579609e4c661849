"""In-place forms on ShardedArray: what they mean, and when they are refused.

A ShardedArray never changes its local tensor. The in-place forms a model uses
(``x[idx] = v``, ``x.masked_fill_(m, v)``, ``x.index_add_(0, i, s)``, ``x.zero_()``,
``F.relu(x, inplace=True)``, ``torch.sigmoid_(x)``...) compute
the functional result (``x.at[idx].set(v)``, ``x.masked_fill(m, v)``...) and *rebind* the
object ``x`` to it: every name bound to that same object sees the new value, as with a torch
tensor. Augmented assignment (``x += y``) rebinds the *name* instead, as ``jax.Array`` does:
``x = x + y``, nothing another name holds changes; in a ``torch.nn.Module``'s method (model
code, written for torch tensors) it is torch's in-place operator instead: the object becomes
``x + y``, which every holder sees (:func:`augmented`).

Rebinding is exact as long as no other value shares ``x``'s data. In torch a view
(``x[:, :2]``, ``x.view(...)``, ``x.T``, ``x.detach()``...) sees an in-place update of its base and
the base sees an update of the view; here they are separate values. So an in-place form is
refused (``TypeError`` pointing at the functional form and ``x.at``) when ``x`` may share its
data with another live value:

- ``x`` has a live view, or is a view of a live value (the dispatcher links an op's output to
  the inputs it aliases, decided once per layout by running the op on meta tensors, with a
  shared token; a view that is no longer referenced does not count);
- ``x`` went through a pytree boundary (``torch.func`` transforms, ``tree_map``): the object
  on the other side holds the same local tensor (an input of a function under ``grad`` is the
  caller's value, which an in-place update would have to change);
- ``x`` is a view of a plain tensor, or the call runs under ``torch.compile``.

Values an op creates (``x.new_zeros(...)``, ``x.clone()``, ``x * 2``, a comparison...) are fresh:
in-place forms on them work, under ``torch.func.grad`` and ``vmap`` too.

One kind of view is written through: a basic-slicing view ``v = x[idx]`` (ints, slices,
``None``, ``...``) of a value ``x`` that nothing else shares. An in-place form on ``v``
(``x[..., :6].copy_(w)``, ``x[0].zero_()``, ``x[:, 1:][0] = 1``) rebinds ``v`` and then ``x`` to
``x.at[idx].set(v)``, as JAX's functional update; through a chain of such views
(``x[0][..., :6]``) each base up to the first. It is refused when any other value shares the
data (another live view of ``x``, a pytree boundary): torch would update that one too.

Example:
    >>> shifted = ids.new_zeros(ids.shape)          # doctest: +SKIP
    >>> shifted[..., 1:] = ids[..., :-1]             # fresh value: rebound in place  # doctest: +SKIP
    >>> shifted.masked_fill_(shifted == -100, 0)     # doctest: +SKIP
"""

from __future__ import annotations

import gc
import sys

import torch

from ..array import PYTREE_SHARED, ShardedArray
from ..executor import reshard_one
from ..spec import BaseLayout
from . import random

__all__ = ["rebind", "inplace_method", "inplace_keyword", "link_views", "InplaceCall", "augmented"]

_set_alias = ShardedArray.__dict__["_alias"].__set__
_set_local = ShardedArray.__dict__["local"].__set__
_set_layout = ShardedArray.__dict__["layout"].__set__
_dynamo_compiling = torch.compiler.is_dynamo_compiling


class _Shared:
    """The alias state of a value whose data another holder may share (no tracking)."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


_PYTREE = (
    "it crossed a pytree boundary (a torch.func transform, tree_map, ...), so the value on "
    "the other side holds the same data"
)
_PLAIN = _Shared("it is a view of a plain torch.Tensor")


class _Views:
    """The token a base and its views share (in their ``_alias`` slot). No list of members:
    the number of values holding the token is its reference count, so linking a view costs
    two slot writes, and a view nobody references any more no longer counts."""

    __slots__ = ()


class _SliceOf:
    """The ``_alias`` of a basic-slicing view ``base[key]``: the shared token (one reference
    per view, as a plain view's slot) and where to write an in-place update through to."""

    __slots__ = ("token", "base", "key")

    def __init__(self, token: _Views, base: ShardedArray, key):
        self.token, self.base, self.key = token, base, key


def _token(state):
    """The view token of an ``_alias`` state (a slice view's record holds it)."""
    return state.token if type(state) is _SliceOf else state


def _holders(token) -> int:
    """How many objects hold ``token`` (CPython reference count, less this call's own two)."""
    return sys.getrefcount(token) - 2


def _holders_after_gc(token) -> int:
    """:func:`_holders` once garbage cycles are collected: a view that is gone may still be
    referenced from a cycle (an exception caught earlier, its traceback and the frames that
    held the view: pytest.raises on Python 3.12 keeps one) until the collector runs. Only on
    the refusal path, so the common case pays nothing."""
    gc.collect()
    return _holders(token)


def _alias(x: ShardedArray):
    return getattr(x, "_alias", None)  # unset: never linked, a fresh value


def link_views(base, out) -> None:
    """Record that ``out`` (a ShardedArray, or a tuple/list of them) aliases ``base``."""
    if type(base) is not ShardedArray:
        group = _PLAIN
    else:
        group = _token(getattr(base, "_alias", None))
        if group is None:
            group = _Views()
            _set_alias(base, group)
    if type(out) is ShardedArray:
        if out is not base:
            _set_alias(out, group)
        return
    for o in out if isinstance(out, (tuple, list)) else ():
        if type(o) is ShardedArray and o is not base:
            _set_alias(o, group)


def link_slice(base, out, key) -> None:
    """Record that ``out`` is the basic-slicing view ``base[key]`` (see :class:`_SliceOf`)."""
    link_views(base, out)
    state = getattr(out, "_alias", None) if type(out) is ShardedArray else None
    if type(state) is _Views and out is not base:
        _set_alias(out, _SliceOf(state, base, key))


def is_basic_index(key) -> bool:
    """``key`` selects a view by basic indexing only (ints, slices of ints, ``None``, ``...``)."""
    items = key if type(key) is tuple else (key,)
    for it in items:
        t = type(it)
        if t is slice:
            if not all(b is None or type(b) is int for b in (it.start, it.stop, it.step)):
                return False
        elif not (t is int or it is None or it is Ellipsis):
            return False
    return True


#: :func:`slice_key` of an op that is not ``x[key]`` with a basic key.
NOT_A_SLICE = object()


def slice_key(func, view_of: tuple[int, ...], args):
    """``key`` when the planned call is ``x[key]`` with a basic ``key`` returning a view of
    ``x`` (``args``: the rule's view; a basic key is static, part of the plan's cache key),
    else :data:`NOT_A_SLICE`."""
    getitem = func is torch.Tensor.__getitem__ and view_of == (0,) and len(args) == 2
    return args[1] if getitem and is_basic_index(args[1]) else NOT_A_SLICE


def tracking(run, view_of: tuple[int, ...], n_leaves: int | None = None, key=NOT_A_SLICE):
    """``run`` (a compiled op's runner, called ``run(leaves, tree)``) that links its output to
    the inputs it aliases (``view_of``: leaf indices). ``n_leaves``: only the first ``n_leaves``
    leaves are passed (a unary runner gets the positional arguments): a view of a keyword
    argument then links nothing, so the caller must not use such a runner (``None`` returned).
    ``key``: the call is ``x[key]`` with a basic key (:func:`slice_key`), and the output is
    linked as that view, which an in-place form writes through (:func:`rebind`)."""
    if n_leaves is not None and any(i >= n_leaves for i in view_of):
        return None
    if key is not NOT_A_SLICE:

        def linked_slice(leaves, tree):
            out = run(leaves, tree)
            if not _dynamo_compiling():
                link_slice(leaves[0], out, key)
            return out

        return linked_slice
    if len(view_of) == 1:
        (i,) = view_of

        def linked_one(leaves, tree):
            out = run(leaves, tree)
            if not _dynamo_compiling():
                link_views(leaves[i], out)
            return out

        return linked_one

    def linked(leaves, tree):
        out = run(leaves, tree)
        if not _dynamo_compiling():
            for i in view_of:
                link_views(leaves[i], out)
        return out

    return linked


def aliased_inputs(func, leaves, unflatten) -> tuple[int, ...]:
    """The leaf indices of the tensor inputs ``func``'s output aliases (views, or the input
    itself), found by running ``func`` on meta tensors. ``leaves``: the rule's view (Layouts
    for tensors); ``unflatten(leaves) -> (args, kwargs)`` with run-time placeholders filled."""
    metas = {}
    filled = []
    for i, v in enumerate(leaves):
        if isinstance(v, BaseLayout):
            metas[i] = torch.empty(v.shape, dtype=v.dtype, device="meta")
            filled.append(metas[i])
        else:
            filled.append(v)
    if not metas:
        return ()
    try:
        args, kwargs = unflatten(filled)
        with torch._C._DisableFuncTorch():
            out = func(*args, **kwargs)
    except Exception:  # data-dependent or meta-less ops: they do not return views
        return ()
    outs = out if isinstance(out, (tuple, list)) else (out,)
    found = []
    for i, m in metas.items():
        for o in outs:
            if isinstance(o, torch.Tensor) and (o is m or torch._C._is_alias_of(o, m)):
                found.append(i)
                break
    return tuple(found)


def _slice_chain(x: ShardedArray, token) -> list[ShardedArray] | None:
    """``[x, its base, ..., the first base]`` when ``x`` is a chain of basic-slicing views
    whose first base holds ``token`` itself; ``None`` otherwise."""
    chain = [x]
    state = _alias(x)
    while type(state) is _SliceOf and state.token is token:
        chain.append(state.base)
        state = _alias(state.base)
    return chain if len(chain) > 1 and state is token else None


def _refusal(x: ShardedArray, what: str, functional: str) -> str | None:
    if _dynamo_compiling():
        why = "it runs under torch.compile, where fshard cannot track which values share data"
    else:
        token = _token(_alias(x))
        if token is None:
            return None
        if token is PYTREE_SHARED:
            why = _PYTREE
        elif type(token) is _Shared:
            why = token.why
        elif _holders(token) <= 2 or _holders_after_gc(token) <= 2:
            return None  # x's slot and the local name `token`: nobody else
        elif (chain := _slice_chain(x, token)) is not None and (
            _holders(token) <= len(chain) + 1 or _holders_after_gc(token) <= len(chain) + 1
        ):
            return None  # only the views being written through hold it (and `token`)
        else:
            why = (
                "it shares its data with another live value (a view such as x[:, :2], "
                "x.view(...), x.T or x.detach(), or the value it is a view of), which torch "
                "would update too"
            )
    return (
        f"ShardedArray in-place {what} refused: {why}. A ShardedArray never changes its "
        f"shards; an in-place form rebinds the object, which is only exact when nothing else "
        f"shares its data. Use the functional form and keep the result ({functional}), or "
        "make a value you own first (x = x.clone(); then the in-place form)"
    )


def rebind(x: ShardedArray, compute, what: str, functional: str) -> ShardedArray:
    """Rebind ``x`` to ``compute()`` (the functional result) as an in-place op on it would.

    Refused (``TypeError``, before any communication) when ``x`` may share its data. The
    result keeps ``x``'s layout, shape and dtype (resharded/cast back if the op's rule chose
    another layout; a dtype torch would refuse to cast in place raises ``RuntimeError``).
    """
    problem = _refusal(x, what, functional)
    if problem:
        raise TypeError(problem)
    new = compute()
    if not isinstance(new, ShardedArray):
        raise TypeError(f"ShardedArray in-place {what}: the functional form gave {type(new)}")
    if tuple(new.shape) != tuple(x.shape):
        raise RuntimeError(
            f"ShardedArray in-place {what}: the result has shape {tuple(new.shape)}, but an "
            f"in-place op cannot change the shape {tuple(x.shape)} of its operand; use the "
            f"functional form ({functional})"
        )
    if new.dtype != x.dtype:
        if not torch.can_cast(new.dtype, x.dtype):
            raise RuntimeError(
                f"ShardedArray in-place {what}: result type {new.dtype} can't be cast to the "
                f"desired output type {x.dtype}"
            )
        new = new.to(x.dtype)
    _assign(x, new)
    return x


def augmented(x: ShardedArray, name: str, other, frame):
    """``x op= y`` (``name``: ``"add"``, ``"mul"``...) in the statement of ``frame``.

    In model code, written for torch tensors (a ``torch.nn.Module``'s method, or a function it
    calls: a frame up the stack has a module as ``self``, as transformers' helpers such as
    ``apply_rotary_pos_emb`` are called from ``forward``), it means what torch's in-place
    operator means: the object ``x`` becomes
    ``x op y`` in ``x``'s dtype, so every holder of it sees the update (transformers' MiniMax
    jitters its MoE input with ``hidden_states *= ...`` while its decoder layer keeps that input
    as the residual, which torch jitters too), without moving ``x``'s blocks back to its layout
    (a layout is how a value is held, not what it is). Elsewhere, and where the in-place form
    would be refused (``x`` shares its data with a live view, or crossed a pytree boundary),
    ``NotImplemented``: Python's ``x = x op y``, the name rebound, as ``jax.Array`` does."""
    if not _in_model_code(frame) or _refusal(x, "", ""):
        return NotImplemented
    new = getattr(x, f"__{name}__")(other)
    if not isinstance(new, ShardedArray) or tuple(new.shape) != tuple(x.shape):
        return new  # a broadcast that grows x: the name rebound to the result
    if new.dtype != x.dtype:
        if not torch.can_cast(new.dtype, x.dtype):
            return new
        new = new.to(x.dtype)
    if type(_alias(x)) is _SliceOf:  # written through into its base, at x's layout
        _assign(x, new)
    else:
        _set_local(x, new.local)
        _set_layout(x, new.layout)
    return x


def _in_model_code(frame) -> bool:
    """Whether ``frame`` or a frame that called it runs a ``torch.nn.Module``'s method (its
    first argument, ``self``, a module)."""
    while frame is not None:
        code = frame.f_code
        if (
            code.co_argcount
            and code.co_varnames[0] == "self"
            and isinstance(frame.f_locals.get("self"), torch.nn.Module)
        ):
            return True
        frame = frame.f_back
    return False


def _assign(x: ShardedArray, new: ShardedArray) -> None:
    """Rebind ``x`` to ``new`` (resharded to ``x``'s layout); a slice view ``base[key]`` is
    written through: ``base`` rebound to ``base.at[key].set(new)``, and so on up its chain."""
    if new.layout != x.layout:
        new = reshard_one(new, x.spec)
    state = _alias(x)
    if type(state) is _SliceOf:
        _assign(state.base, state.base.at[state.key].set(new))
    _set_local(x, new.local)
    _set_layout(x, new.layout)


#: In-place methods whose functional form is not ``name[:-1]``.
_FUNCTIONAL = {
    "zero_": lambda x: torch.zeros_like(x),
    "fill_": lambda x, value: (
        torch.full_like(x, value)
        if not isinstance(value, (torch.Tensor, ShardedArray))
        else torch.zeros_like(x) + value
    ),
    "copy_": lambda x, src, non_blocking=False: src.to(x.dtype).expand_as(x),
    "index_put_": lambda x, indices, values, accumulate=False: torch.Tensor.index_put(
        x, indices, values, accumulate
    ),
    # a random fill is a fresh draw (every rank draws the whole tensor, keeps its block)
    **{
        name: lambda x, *args, name=name, **kwargs: random.filled(x, name, args, kwargs)
        for name in random.FILLS
        if name != "bernoulli_"
    },
    "bernoulli_": lambda x, p=0.5, *, generator=None: _bernoulli(x, p, generator),
}


def _bernoulli(x: ShardedArray, p, generator):
    """``x.bernoulli_(p)``: a float ``p`` is a fill; a tensor ``p`` (broadcast to ``x``, in its
    own dtype, which picks torch's draw) is ``torch.bernoulli`` of it, whose draws read its
    values (:func:`fshard.ops.whole.drawn_rule`: gathered whole, every rank drawing the dense
    draw), in ``x``'s dtype: dense ``x.bernoulli_(p)``'s values for the same seed."""
    if not isinstance(p, (torch.Tensor, ShardedArray)):
        kwargs = {} if generator is None else {"generator": generator}
        return random.filled(x, "bernoulli_", (p,), kwargs)
    probs = torch.zeros_like(x, dtype=p.dtype) + p
    return torch.bernoulli(probs, generator=generator).to(x.dtype)


def inplace_method(name: str):
    """The in-place Tensor method ``name`` (``"masked_fill_"``) on a ShardedArray, or
    ``None`` when torch has no functional form for it."""
    special = _FUNCTIONAL.get(name)
    if special is None:
        base = name[:-1]
        if not callable(getattr(torch.Tensor, base, None)):
            return None

        def special(x, *args, **kwargs):
            return getattr(x, base)(*args, **kwargs)  # the functional method, forwarded

    hint = (
        f"y = x.{name[:-1]}(...)" if name not in _FUNCTIONAL else f"the functional form of {name}"
    )

    def method(self, *args, **kwargs):
        return rebind(self, lambda: special(self, *args, **kwargs), f"Tensor.{name}", hint)

    method.__name__ = name
    return method


def inplace_keyword(op, name: str):
    """``op(x, ..., inplace=True)`` (``F.relu``, ``F.dropout``, ``nn.ReLU(inplace=True)``): the
    call with ``inplace=False``, ``x`` rebound to its result (refused where ``x`` shares its
    data) and returned, as torch returns its input. Called as ``call(args, kwargs)``."""

    def call(args, kwargs):
        x = args[0] if args else kwargs["input"]
        functional = {**kwargs, "inplace": False}
        return rebind(
            x,
            lambda: op(*args, **functional),
            f"{name}(..., inplace=True)",
            f"y = {name}(x, ...) with inplace=False",
        )

    return call


class InplaceCall:
    """What the dispatcher caches for an in-place call reaching it as a torch function
    (``torch.relu_(x)``, ``F.elu_(x)``, ``F.relu(x, inplace=True)``):
    ``call(args, kwargs)`` with the call's arguments. ``unflatten(leaves) -> (args, kwargs)``."""

    __slots__ = ("run", "run_general", "view_of", "trivial", "comm", "out")

    def __init__(self, call, unflatten):
        def run(leaves, tree):
            return call(*unflatten(leaves))

        self.run = self.run_general = run
        self.view_of, self.trivial, self.comm, self.out = (), False, (), None
