"""The op-rule registry and the dispatcher every ShardedArray op goes through.

A *rule* is a function ``rule(op, args, kwargs) -> OpSharding``. It sees the call with every tensor
input replaced by its :class:`~fshard.Layout` (plain tensors as replicated layouts) and every
Python ``float``/``complex`` replaced by :data:`SCALAR` (a run-time value: rules must not depend
on it, which is what lets ``x * lr`` hit the cache for every ``lr``, unlike pytorch#109101). It
returns an :class:`OpSharding`: the spec each tensor input must have, the output layout(s), and
the function to run on local tensors. A rule reads its arguments by name with
:func:`~fshard.ops.binding.bind` (the op's signature, bound once per op).

OpShardings are cached by ``(op, autocast state, input layouts, static args)``, so after the first
call an op costs a dict lookup plus the local torch call. Under ``torch.autocast`` a rule plans on
the dtypes autocast gives the op's inputs and the local program runs on inputs cast the same way
(:mod:`fshard.ops._autocast`). When the input specs differ from the inputs'
layouts, the inputs are resharded by their programs (:func:`fshard.executor.program`, bound once
and held in the compiled plan; differentiable, logged);
then every input that is invariant over a mesh axis on which another input varies (sharded or
partial) goes through ``pcast`` (forward identity, backward psum), so a replicated parameter's
gradient is reduced exactly once. In strict mode (:func:`fshard.config.strict`) a reshard that
would communicate raises instead.

Tensor inputs are numbered in flattening order: positional arguments left to right (lists and
tuples in order), then keyword arguments sorted by name. ``OpSharding.in_specs`` follows that
order, or names the parameters (``{"input": P("x"), "weight": None}``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.utils import _python_dispatch

from .. import _compat, config
from .._traced import constant
from ..array import ShardedArray, expose_operators, install_dispatch
from ..collectives import Bound, Pcast, ZeroOthers
from ..consistency import check_replicated
from ..executor import check_plain_tensor, gather_varying, program
from ..executor import run as run_program
from ..lax import apply, claim, claim_of
from ..spec import LAYOUT_OF_ID, BaseLayout, Layout, P, _layout
from . import _autocast
from . import inplace as _inplace
from .aliases import aliases_of
from .binding import declare_signature, resolve

__all__ = [
    "OpSharding",
    "SCALAR",
    "SHAPE_ONLY",
    "register_rule",
    "dispatch",
    "tensor_inputs",
    "rule_for",
]


class _Scalar:
    """Placeholder for a run-time Python number (float/complex) in the arguments a rule sees."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SCALAR"


#: What a rule sees in place of a Python float/complex argument (its value is a run-time input).
SCALAR = _Scalar()


class _ShapeOnly:
    """``OpSharding.in_specs`` entry for a tensor read for its shape only (``x.expand_as(y)``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SHAPE_ONLY"


#: An ``in_specs`` entry: the input is passed as it is and its layout does not make the other
#: inputs varying (its values never reach the output, so no gradient flows through it).
SHAPE_ONLY = _ShapeOnly()


@dataclass(frozen=True, eq=False)
class OpSharding:
    """How one op call runs on shards, decided by its rule once per ``(op, layouts, static args)``.

    Attributes:
        in_specs: one :class:`~fshard.P` (or ``None``: keep as is; :data:`SHAPE_ONLY`: read
            for its shape only) per tensor input, in flattening order (positional, then keyword
            arguments sorted by name); or a mapping ``{parameter name: spec}`` (the op's
            signature names the tensor inputs; names left out are kept as they are).
        out: the output :class:`~fshard.Layout`, a tuple/list of them for ops returning
            several tensors, or ``None`` for an op whose result is returned as is.
        local: called as ``local(*args, **kwargs)`` with the resharded local tensors (and the
            call's actual scalars); default: the op itself.
        tensors_only: ``local`` already holds every non-tensor argument (the rule bound the
            static ones; there are no scalars) and is called with the local tensors alone, in
            flattening order. Saves re-passing keywords such as ``F.softmax``'s ``_stacklevel``
            on every call.
        by_name: ``local`` is called with one dict, every argument by parameter name with the
            op's defaults filled (local tensors and the call's actual scalars).

    Example:
        >>> OpSharding(in_specs=(P("x"),), out=Layout(Mesh.abstract((2,), ("x",)), P("x"), (4,)))  # doctest: +SKIP
    """

    in_specs: Sequence[P | None] | Mapping[str, P | None]
    out: Any
    local: Callable | None = None
    tensors_only: bool = False
    by_name: bool = False


_RULES: dict = {}
_CACHE: dict = {}
#: Ops whose rule sees the values of float arguments (an output shape depends on them, e.g.
#: interpolate's scale_factor): planned per value.
_FLOAT_VALUED: set = set()
#: Calls of one ShardedArray then static arguments, keyed by
#: ``(op, autocast state, layout._id, *args[1:], _KW, *kwargs, *kwargs.values())`` (names then
#: values: no tuple per item; the length fixes where the names end).
_UNARY: dict = {}
#: Bound of _CACHE and _UNARY (keys hold shapes and static arguments, so a program with
#: ever-changing shapes would grow them without end): a full cache is emptied and refilled.
CACHE_MAX = 8192


def _remember(cache: dict, key, value):
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value


_KW = object()  # separates positional from keyword arguments in a _UNARY key


def register_rule(
    op,
    rule=None,
    *,
    aliases: Sequence = (),
    float_valued: bool = False,
    signature: Callable | None = None,
):
    """Register ``rule`` for torch function or Tensor method ``op`` (and ``aliases``).

    A rule is ``rule(op, args, kwargs) -> OpSharding``; in ``args``/``kwargs`` tensors appear
    as their :class:`~fshard.Layout` and Python floats as :data:`SCALAR` (with
    ``float_valued=True``, as their values: for ops whose output shape depends on a float).
    ``fs.ops.bind(op, args, kwargs)`` gives them by parameter name. The result is cached per
    layouts and static arguments, so a rule runs once per distinct call signature. Register
    ``torch.Tensor.<name>`` too for the method form (``x.<name>(...)``); the names torch
    documents as aliases of ``op`` (``torch.greater`` for ``torch.gt``, see
    :mod:`fshard.ops.aliases`) get the rule too unless they have their own. ``signature``: a
    callable with ``op``'s Python signature, for an op whose own cannot be read (see
    :mod:`fshard.ops.binding`). Usable as a decorator.

    Example (a custom op that keeps any layout, as every elementwise op does)::

        def softclip(x, limit):  # a plain torch function with a torch-function override
            if torch.overrides.has_torch_function_unary(x):
                return torch.overrides.handle_torch_function(softclip, (x,), x, limit)
            return limit * torch.tanh(x / limit)

        @fs.ops.register_rule(softclip)
        def _softclip_rule(op, args, kwargs):
            x = args[0]                      # a Layout
            keep = fs.P(*x.dim_axes)         # nonlinear: drop any pending sum first
            return fs.ops.OpSharding(in_specs=(keep,), out=x.with_spec(keep), local=softclip)

        y = softclip(x_sharded, 2.0)         # runs on local shards, no communication
    """
    if rule is None:
        return lambda r: register_rule(
            op, r, aliases=aliases, float_valued=float_valued, signature=signature
        )
    if not callable(rule):
        raise TypeError(f"register_rule: rule must be callable, got {type(rule).__name__}")
    if signature is not None:
        declare_signature(op, signature)
    given = (op, *aliases)
    derived = {a for o in given for a in aliases_of(o)} - set(given)
    for o in (*given, *[a for a in derived if a not in _RULES]):  # torch's documented aliases
        _RULES[o] = rule
        if float_valued:
            _FLOAT_VALUED.add(o)
        expose_operators(o)
    _CACHE.clear()
    _UNARY.clear()
    return rule


def rule_for(op):
    """The rule registered for ``op``, or ``None``."""
    return _RULES.get(op)


def op_name(op) -> str:
    """A readable name for a torch function / Tensor method / property getter."""
    self = getattr(op, "__self__", None)
    if self is not None and type(self).__name__ == "getset_descriptor":
        return f"torch.Tensor.{self.__name__}"
    qual = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)
    mod = getattr(op, "__module__", None) or ""
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    if qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return "torch.Tensor." + qual.split(".", 1)[1]
    if mod.startswith("torch.nn.functional") or mod == "torch._C._nn":
        return f"torch.nn.functional.{qual}"
    if mod.startswith("torch"):
        return f"torch.{qual}"
    return f"{mod}.{qual}" if mod else qual


# -- dispatch -------------------------------------------------------------------------------


def _leaf_key(a):
    t = type(a)
    if t is ShardedArray:
        return a.layout._id
    if t is float or t is complex:
        return SCALAR
    if isinstance(a, torch.Tensor):
        return (torch.Tensor, a.shape, a.dtype)
    if t is slice:
        return (slice, a.start, a.stop, a.step)
    return a


_STATIC = frozenset(
    {int, bool, type(None), str, torch.dtype, torch.device, torch.memory_format, torch.layout}
)


def dispatch(func, args, kwargs):
    """Run torch function/method ``func`` on ShardedArray arguments through its rule.

    Hot path: a flat argument list is keyed without building a pytree; the compiled
    OpSharding is looked up in a dict and run. Keyword arguments are keyed (and numbered) in
    sorted-name order.
    """
    if _dynamo_compiling():
        return _traced_dispatch(func, args, kwargs)
    ac = _autocast_state()  # None unless torch.autocast is on: plans differ under it
    ukey = None
    x = args[0] if args else None
    if type(x) is ShardedArray:
        # One probe per call shape; tuple displays, not star-unpacking, on the common shapes.
        # Unary keys: (op, ac, layout id, *args[1:], _KW, *kwargs, *kwargs.values()).
        n = len(args)
        if kwargs:
            if n == 1:
                ukey = (func, ac, x.layout._id, _KW, *kwargs, *kwargs.values())
            elif type(args[1]) is not ShardedArray:
                ukey = (func, ac, x.layout._id, *args[1:], _KW, *kwargs, *kwargs.values())
        elif n == 1:
            ukey = (func, ac, x.layout._id, _KW)
        elif n == 2:
            y = args[1]
            ty = type(y)
            if ty is ShardedArray or ty is float:  # binary (floats never enter _UNARY)
                compiled = _CACHE.get(
                    (func, None, ac, x.layout._id, y.layout._id if ty is ShardedArray else SCALAR)
                )
                if compiled is not None:
                    return compiled.run(args, None)
            else:  # x.sum(0), torch.softmax(x, -1)
                ukey = (func, ac, x.layout._id, y, _KW)
        elif type(args[1]) is not ShardedArray:
            ukey = (func, ac, x.layout._id, *args[1:], _KW)
        if ukey is not None:
            try:
                run = _UNARY.get(ukey)
            except TypeError:  # an unhashable argument
                run = ukey = None
            if run is not None:
                return run(args, kwargs)
    if kwargs:
        names = tuple(sorted(kwargs))
        leaves, tree = (*args, *[kwargs[n] for n in names]), (len(args), names)
    else:
        leaves, tree = args, None
    key = [func, tree, ac]
    append = key.append
    for a in leaves:
        t = type(a)
        if t is ShardedArray:
            append(a.layout._id)
        elif t is float or t is complex:
            append(SCALAR)
        elif t in _STATIC:
            append(a)
        elif isinstance(a, torch.Tensor):
            append((type(a), a.shape, a.dtype, a.layout))
        else:
            return _dispatch_tree(func, args, kwargs, ac)
    key = tuple(key)
    compiled = _CACHE.get(key)
    if compiled is None:
        if func in _FLOAT_VALUED:
            return _dispatch_tree(func, args, kwargs, ac)
        compiled = _remember(_CACHE, key, _compile(func, leaves, tree))
        if ukey is not None:
            unary = _unary_runner(compiled, args, kwargs)
            if unary is not None and compiled.view_of:  # leaf i is args[i] here
                unary = _inplace.tracking(unary, compiled.view_of, len(args), key=compiled.view_key)
            if unary is not None:
                _remember(_UNARY, ukey, unary)
    return compiled.run(leaves, tree)


install_dispatch(dispatch)
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_autocast_state = _autocast.state


# -- under torch.compile ---------------------------------------------------------------------


def _traced_dispatch(func, args, kwargs):
    """:func:`dispatch` while dynamo traces. The plan is a constant of the graph
    (:func:`fshard._traced.constant`): planned from the call's static description, sharing the
    eager cache; the graph records only the plan's local program (reshards, pcasts, the local
    op). Guards: every layout token, static argument and plain-tensor shape."""
    both = (args, kwargs or {})
    compiled, paths, tree = constant(_plan_described, func, _describe(both), _autocast_state())
    leaves = [_at(both, path) for path in paths]
    if tree is _NESTED:
        return compiled.run_general(leaves, lambda locs: _substitute(both, paths, locs))
    return compiled.run(leaves, tree)


_DESC_SHARDED, _DESC_TENSOR, _DESC_VALUE = "\0sharded", "\0tensor", "\0value"
_DESC_LIST, _DESC_DICT = "\0list", "\0dict"
_NESTED = "\0nested"  # the plan's tree: rebuild (args, kwargs) by substitution


def _describe(a):
    """``a`` as a hashable tree of constants dynamo can convert: a ShardedArray by its layout
    token, a tensor by shape and dtype, any other leaf by value."""
    t = type(a)
    if t is ShardedArray:
        return (_DESC_SHARDED, a.layout._id)
    if isinstance(a, torch.Tensor):
        # operator.index: a size dynamo made symbolic (automatic dynamic shapes, when one code
        # object, e.g. torch.func.grad's wrapper, is compiled again for other shapes) is
        # specialized to a guarded constant (int() would keep it symbolic)
        return (_DESC_TENSOR, tuple(map(operator.index, a.shape)), a.dtype)
    if t is tuple:
        return tuple(_describe(v) for v in a)
    if t is list:
        return (_DESC_LIST, *[_describe(v) for v in a])
    if t is dict:
        return (_DESC_DICT, *[(k, _describe(v)) for k, v in a.items()])
    return (_DESC_VALUE, a)


def _stand_in(d):
    """What :func:`_describe` described: a ShardedArray of the layout (on a meta tensor), a meta
    tensor, or the value itself, in the same containers."""
    kind = d[0] if d else None
    if kind == _DESC_SHARDED:
        lay = LAYOUT_OF_ID[d[1]]
        return ShardedArray._raw(torch.empty(0, dtype=lay.dtype, device="meta"), lay)
    if kind == _DESC_TENSOR:
        return torch.empty(d[1], dtype=d[2], device="meta")
    if kind == _DESC_VALUE:
        return d[1]
    if kind == _DESC_LIST:
        return [_stand_in(v) for v in d[1:]]
    if kind == _DESC_DICT:
        return {k: _stand_in(v) for k, v in d[1:]}
    return tuple(_stand_in(v) for v in d)


def _plan_described(func, desc, ac) -> tuple:
    """``(compiled, paths, tree)`` for a call described by :func:`_describe` under autocast state
    ``ac``: the plan, where each of its leaves sits in ``(args, kwargs)``, and its tree
    (``_NESTED``: substitute)."""
    args, kwargs = _stand_in(desc)
    paths = _leaf_paths((args, kwargs))
    leaves = [_at((args, kwargs), p) for p in paths]
    flat = all(len(p) == 2 for p in paths)
    if flat and func not in _FLOAT_VALUED:
        names = tuple(sorted(kwargs))
        tree = (len(args), names) if names else None
        key = (func, tree, ac, *[_leaf_key(a) for a in leaves])
        compiled = _CACHE.get(key) or _remember(_CACHE, key, _compile(func, leaves, tree))
        return compiled, paths, tree
    spec_leaves, spec = optree.tree_flatten(
        (args, kwargs), is_leaf=_is_tensor_like, none_is_leaf=True
    )
    key = (func, spec, ac, *[a if type(a) is float else _leaf_key(a) for a in spec_leaves])
    compiled = _CACHE.get(key) or _remember(_CACHE, key, _compile(func, spec_leaves, spec))
    return compiled, paths, _NESTED


def _leaf_paths(both) -> list[tuple]:
    """Paths (indices and keys) of the leaves of ``(args, kwargs)``, in optree's flatten order
    (dict keys sorted), the order of a plan's leaves; positional then keyword (sorted) when flat."""
    out = []

    def walk(a, path):
        t = type(a)
        if t is tuple or t is list:
            for i, v in enumerate(a):
                walk(v, (*path, i))
        elif t is dict:
            for k in sorted(a):
                walk(a[k], (*path, k))
        else:
            out.append(path)

    walk(both, ())
    return out


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _substitute(tree, paths, values):
    """``tree`` with the leaf at ``paths[i]`` replaced by ``values[i]``."""
    at = dict(zip(paths, values))

    def walk(a, path):
        if path in at:
            return at[path]
        t = type(a)
        if t is tuple or t is list:
            return t(walk(v, (*path, i)) for i, v in enumerate(a))
        if t is dict:
            return {k: walk(v, (*path, k)) for k, v in a.items()}
        return a

    return walk(tree, ())


def _unary_runner(c: _Compiled, args, kwargs):
    """``run(args, kwargs)`` for a trivial OpSharding of one ShardedArray followed by static
    arguments only (they are part of the unary cache key, so they are passed through as given)."""
    if not _runs_as_is(c):
        return None
    if any(type(v) not in _STATIC for v in (*args[1:], *kwargs.values())):
        return None
    fn, out, raw = c.fn, c.out, ShardedArray._derived
    if c.tensors_only or len(args) == 1 and not kwargs:
        return lambda a, kw: raw(fn(a[0].local), out)
    if len(args) == 2 and not kwargs:
        return lambda a, kw: raw(fn(a[0].local, a[1]), out)
    if len(args) > 1:
        return lambda a, kw: raw(fn(a[0].local, *a[1:], **kw), out)
    return lambda a, kw: raw(fn(a[0].local, **kw), out)


def _dispatch_tree(func, args, kwargs, ac):
    leaves, tree = optree.tree_flatten((args, kwargs), is_leaf=_is_tensor_like, none_is_leaf=True)
    if func in _FLOAT_VALUED:  # planned per float value (never under the SCALAR key)
        key = (func, tree, ac, *[a if type(a) is float else _leaf_key(a) for a in leaves])
    else:
        key = (func, tree, ac, *[_leaf_key(a) for a in leaves])
    try:
        compiled = _CACHE.get(key)
    except TypeError:  # an unhashable static argument: compile without caching
        compiled, key = None, None
    if compiled is None:
        compiled = _compile(func, leaves, tree)
        if key is not None:
            _remember(_CACHE, key, compiled)
    return compiled.run(leaves, tree)


def _is_tensor_like(x) -> bool:
    return isinstance(x, (ShardedArray, torch.Tensor))


def tensor_inputs(args, kwargs) -> list[Layout]:
    """The tensor inputs a rule sees (Layouts), in the order ``OpSharding.in_specs`` follows.

    Example:
        >>> tensor_inputs((lay_x, 2, [lay_y]), {})  # doctest: +SKIP
        [lay_x, lay_y]
    """
    leaves = optree.tree_leaves((args, kwargs), is_leaf=is_layout, none_is_leaf=True)
    return [a for a in leaves if isinstance(a, BaseLayout)]


def is_layout(x) -> bool:
    """True for a :class:`Layout` (``is_leaf=`` of the static views rules see)."""
    return isinstance(x, BaseLayout)


def _static_view(leaves, mesh, floats=False):
    """Leaves as a rule sees them: Layouts for tensors, SCALAR for floats (unless ``floats``)."""
    out = []
    for a in leaves:
        t = type(a)
        if t is ShardedArray:
            out.append(a.layout)
        elif isinstance(a, torch.Tensor):
            out.append(_layout(mesh, P(), tuple(a.shape), a.dtype))
        elif (t is float or t is complex) and not floats:
            out.append(SCALAR)
        else:
            out.append(a)
    return out


def _unflatten(tree, leaves):
    """``(args, kwargs)`` from leaves: ``tree`` is None (positional only), ``(n, names)`` (flat
    keywords) or an optree treespec."""
    if tree is None:
        return tuple(leaves), {}
    if type(tree) is tuple:
        n, names = tree
        return tuple(leaves[:n]), dict(zip(names, leaves[n:]))
    if callable(tree):  # under torch.compile: see _traced_dispatch
        return tree(leaves)
    return optree.tree_unflatten(tree, leaves)


class ExplicitRefused(TypeError):
    """Raised by a rule marked ``explicit_layouts`` for explicit inputs it cannot take as they
    are; the dispatcher then makes them whole (see :func:`_compile`)."""


def _compile(func, leaves, tree) -> _Compiled:
    name = op_name(func)
    sharded = [a for a in leaves if type(a) is ShardedArray]
    mesh = sharded[0].layout.mesh
    for a in sharded[1:]:
        if a.layout.mesh != mesh:
            raise ValueError(
                f"{name}: inputs live on different meshes ({mesh!r} and {a.layout.mesh!r}); "
                "move them to one mesh first"
            )
    # An explicit layout (row blocks of an uneven batch, fshard.ops.rows) or a per-part one
    # (fshard.ops.parts) reaching a rule that does not take it (one marked explicit_layouts /
    # parts_layouts does) is made whole: the rule sees made_whole() and the compiled op gathers
    # the blocks first (gather_blocks / gather_parts, in the comm log).
    whole = set()
    for i, a in enumerate(leaves):
        if type(a) is ShardedArray:
            flag = a.layout.rule_flag
            if flag is not None and not getattr(_RULES.get(func), flag, False):
                whole.add(i)
        elif isinstance(a, torch.Tensor):
            check_plain_tensor(a, f"{name}: input {i}")
    fname = getattr(func, "__name__", "")
    method = _inplace.inplace_method(fname) if fname.endswith("_") else None
    if method is not None and type(leaves[0]) is ShardedArray:  # torch.relu_(x), F.elu_(x)
        return _inplace.InplaceCall(lambda a, k: method(*a, **k), lambda lv: _unflatten(tree, lv))
    if fname.endswith("_") and not fname.endswith("__"):
        raise TypeError(
            f"ShardedArray is immutable: in-place {name} is not supported; use the functional "
            f"form {fname[:-1]!r}"
        )
    # Planned outside every torch.func level: under grad a factory call returns a wrapped
    # tensor, so the meta stand-ins of the rules and of the alias probe would depend on the
    # level active when the op is first seen, and the plan is cached for the process.
    with _outside_transforms():
        return _plan(func, name, leaves, tree, mesh, whole)


def _plan(func, name, leaves, tree, mesh, whole) -> _Compiled:
    rule = _RULES.get(func)
    view = _static_view(leaves, mesh, floats=func in _FLOAT_VALUED)
    # Under torch.autocast the rule sees the dtypes autocast gives the op's inputs.
    casts = _autocast.input_casts(func, view, _filled(tree), mesh.device_type)
    if casts:
        view = [v.with_dtype(casts[i]) if i in casts else v for i, v in enumerate(view)]
    seen = [v.made_whole() if i in whole else v for i, v in enumerate(view)]
    args, kwargs = _unflatten(tree, seen)
    if kwargs.get("inplace") is True and kwargs.get("out") is None:  # F.relu(x, inplace=True)
        return _inplace.InplaceCall(
            _inplace.inplace_keyword(func, name), lambda lv: _unflatten(tree, lv)
        )
    if kwargs.get("out") is not None or kwargs.get("inplace") is True:
        raise TypeError(
            f"ShardedArray is immutable: {name} with out=/inplace=True is not supported; "
            "use the functional form and keep the returned value"
        )
    if rule is None:
        raise NotImplementedError(unsupported_message(name, view))
    try:
        sharding = rule(func, args, kwargs)
    except ExplicitRefused:  # the rule takes the layout kind, but not this combination
        whole = {
            i for i, v in enumerate(view) if isinstance(v, BaseLayout) and v.rule_flag is not None
        }
        args, kwargs = _unflatten(
            tree, [v.made_whole() if i in whole else v for i, v in enumerate(view)]
        )
        sharding = rule(func, args, kwargs)
    if not isinstance(sharding, OpSharding):
        raise TypeError(
            f"the rule for {name} returned {type(sharding).__name__}, not a fs.ops.OpSharding"
        )
    specs = sharding.in_specs
    if isinstance(specs, Mapping):
        specs = [specs.get(n) for n in _tensor_names(func, args, kwargs)]
    if whole:
        tensor_idx = [i for i, v in enumerate(view) if isinstance(v, BaseLayout)]
        specs = [
            view[i].made_whole().spec if s is None and i in whole else s
            for i, s in zip(tensor_idx, specs)
        ]
    fn = sharding.local or func
    if sharding.by_name:
        fn = _by_name(sharding.local, resolve(func, args, kwargs))
    if casts:  # run as autocast runs an op it casts: on the cast inputs, autocast off
        fn = _autocast.disabled(fn, mesh.device_type)
    compiled = _Compiled.build(name, specs, sharding, fn, leaves, view, mesh, tree, casts or {})
    # An output that aliases an input (a view) is linked to it at run time (fshard.ops.inplace)
    compiled.view_of = _inplace.aliased_inputs(func, view, _filled(tree))
    if compiled.view_of:
        compiled.view_key = _inplace.slice_key(func, compiled.view_of, args)
        compiled.run = _inplace.tracking(compiled.run, compiled.view_of, key=compiled.view_key)
    return compiled


@contextlib.contextmanager
def _outside_transforms():
    """Where an op is planned: outside every torch.func level, and outside every dispatch mode
    (planning evaluates the op on meta tensors of the global shapes once per plan, not per call:
    a mode measuring the program, a user's ``FlopCounterMode`` or ``fs.dry_run``'s memory and
    FLOP count, must not see it)."""
    with torch._C._DisableFuncTorch(), _python_dispatch._disable_current_modes():
        yield


def _filled(tree):
    """``leaves -> (args, kwargs)`` with run-time placeholders (:data:`SCALAR`) given a value,
    for evaluating the op itself (as :func:`fshard.ops._common.meta_call` does)."""
    return lambda leaves: _unflatten(tree, [0.5 if v is SCALAR else v for v in leaves])


def _tensor_names(op, args, kwargs) -> list[str]:
    """The parameter name of each tensor input, in flattening order (a list argument's name
    once per tensor in it)."""
    positional = resolve(op, args, kwargs).positional
    named = [*zip(positional, args), *sorted(kwargs.items())]
    return [n for n, v in named for _ in tensor_inputs((v,), {})]


def _by_name(local, sig):
    bind = sig.bind
    return lambda *args, **kwargs: local(bind(args, kwargs))


def unsupported_message(name: str, view) -> str:
    layouts = ", ".join(f"{tuple(v.shape)} {v.spec}" for v in view if isinstance(v, BaseLayout))
    return (
        f"fshard has no sharding rule for {name} (inputs: {layouts}). Ways out: "
        "gather to a full tensor with fs.gather(x) (or fs.reshard to the layout you need) and "
        "call the op on plain tensors; run it on local shards inside fs.shard_map(f, mesh, "
        "in_specs, out_specs) with fs.lax collectives; or teach fshard the op with "
        "fs.ops.register_rule(op, rule) (see help(fs.ops.register_rule))"
    )


@dataclass(frozen=True, eq=False)
class _Input:
    index: int  # leaf index
    layout: Layout  # source layout (plain tensors: replicated)
    program: Any  # the reshard (fshard.executor.Program), None when no reshard
    claim: Bound | None  # a partial source's Claim (DESIGN §4), None when not partial
    pcast: Bound | None  # Pcast over the axes other inputs vary on, or None
    plain: bool
    cast: torch.dtype | None = None  # the dtype autocast gives this input, None: as is
    # the pcast before the program: a program of zero steps only (replicated -> partial: the
    # group's other ranks hold zeros, not a view of the input), so that the pcast reads the
    # input itself on every rank (the gradient sync's stand-in for a param, or a view of one:
    # once a step, where the pcast of the zeros summed each microbatch's gradient)
    pcast_first: bool = False


class _Compiled:
    """An :class:`OpSharding` bound to concrete leaf positions: what ``dispatch`` runs on a
    cache hit."""

    __slots__ = (
        "name",
        "inputs",
        "fn",
        "out",
        "comm",
        "tensor_idx",
        "nleaves",
        "trivial",
        "tensors_only",
        "run",
        "view_of",
        "view_key",
    )

    @staticmethod
    def build(name, specs, sharding: OpSharding, fn, leaves, view, mesh, tree, casts) -> _Compiled:
        """``view``: the leaves as the rule saw them (tensor inputs retyped by ``casts``, the
        ``{leaf index: dtype}`` autocast gives them: applied to the local tensors after any
        reshard and pcast, so communication and a partial value's sum keep the source dtype)."""
        tensor_idx = [i for i, v in enumerate(view) if isinstance(v, BaseLayout)]
        specs = tuple(specs)
        if len(specs) != len(tensor_idx):
            raise ValueError(
                f"the rule for {name} gave {len(specs)} in_specs for {len(tensor_idx)} tensor "
                "inputs; give one P (or None) per tensor input"
            )
        # each input's layout with its own dtype (autocast's cast comes after any reshard)
        own = {
            i: view[i].with_dtype(leaves[i].dtype) if i in casts else view[i] for i in tensor_idx
        }
        targets = []
        comm = []
        for pos, (i, spec) in enumerate(zip(tensor_idx, specs)):
            src = view[i]
            if spec is SHAPE_ONLY:
                targets.append((src.with_spec(P()), None))
                continue
            if spec is None or spec == src.spec:
                targets.append((src, None))
                continue
            tgt = src.with_spec(spec)
            prog = program(own[i], spec)  # the decision reshard_one caches too
            if not prog.steps:  # differs on size-1 mesh axes only: the same local block
                targets.append((tgt, None))
                continue
            if any(s.collective for s in prog.steps):
                comm.append((pos, src, spec, prog.steps))
            targets.append((tgt, prog))
        union = frozenset().union(*[t.varying_axes for t, _ in targets]) if targets else frozenset()
        inputs = []
        for i, (tgt, prog), given in zip(tensor_idx, targets, specs):
            missing = [
                a
                for a in mesh.axis_names
                if a in union and a not in tgt.varying_axes and mesh.size(a) > 1
            ]
            if given is SHAPE_ONLY:
                missing = []
            if prog is not None and missing:  # all_gather + pcast: one varying all_gather
                prog, missing = gather_varying(prog, tuple(missing))
            pcast = None
            if missing and not mesh.is_abstract:
                g = mesh.group(tuple(missing))
                pcast = Bound(Pcast(g.axes), g)
            plain = type(leaves[i]) is not ShardedArray
            src = own[i]
            claim_op = None
            if src.partial and not mesh.is_abstract:
                claim_op = claim_of(mesh.group(src.partial))
            first = (
                pcast is not None
                and prog is not None
                and all(type(step.op) is ZeroOthers for step in prog.steps)
            )
            inputs.append(_Input(i, src, prog, claim_op, pcast, plain, casts.get(i), first))
        self = _Compiled()
        self.name = name
        self.inputs = tuple(inputs)
        self.fn = _compat.attribute_callable(fn)
        self.out = sharding.out
        self.comm = tuple(comm)
        self.tensor_idx = tuple(tensor_idx)
        self.nleaves = len(view)
        self.trivial = all(
            x.program is None
            and x.pcast is None
            and not x.plain
            and not x.layout.partial
            and x.cast is None
            for x in inputs
        )
        self.tensors_only = sharding.tensors_only
        self.view_of = ()  # set by _compile
        self.view_key = _inplace.NOT_A_SLICE  # x[key] with a basic key: key (set by _compile)
        flat = tree is None or type(tree) is tuple
        self.run = (flat and _fast_runner(self, tree)) or self.run_general
        return self

    def run_general(self, leaves, tree):
        if self.comm and _strict():
            raise strict_error(self.name, self.inputs, self.comm)
        if self.trivial:
            locs = [a.local if type(a) is ShardedArray else a for a in leaves]
        else:
            locs = list(leaves)
            for inp in self.inputs:
                a = leaves[inp.index]
                if inp.plain:  # a plain tensor next to ShardedArrays claims to be replicated
                    check_replicated(a, inp.layout.mesh, self.name, inp.index)
                loc = a if inp.plain else a.local
                if inp.claim is not None:  # a partial leaf's gradient holds addends (DESIGN §4)
                    loc = claim(loc, inp.claim)
                if inp.pcast_first and loc.requires_grad:
                    loc = apply(inp.pcast, loc)
                if inp.program is not None:
                    loc = run_program(loc, inp.program)
                if inp.pcast is not None and not inp.pcast_first and loc.requires_grad:
                    loc = apply(inp.pcast, loc)
                if inp.cast is not None:
                    loc = loc.to(inp.cast)
                locs[inp.index] = loc
        if self.tensors_only:
            result = self.fn(*[locs[i] for i in self.tensor_idx])
        elif tree is None:
            result = self.fn(*locs)
        else:
            args, kwargs = _unflatten(tree, locs)
            result = self.fn(*args, **kwargs)
        return _wrap(result, self.out)


def _strict() -> bool:
    return config._STRICT.get()


# Under torch.compile the setting at trace time (dynamo cannot read a ContextVar).
_strict._dynamo_marked_constant = True


def _runs_as_is(c: _Compiled) -> bool:
    """No reshard, no pcast, no communication, one output layout: swap in locals, call, wrap."""
    return c.trivial and not c.comm and isinstance(c.out, BaseLayout)


def _fast_runner(c: _Compiled, tree):
    """A closure for the common cache hit: no reshard, no pcast, one output layout, positional
    arguments or flat keywords. It does only what the call needs (swap in local tensors, call,
    wrap); anything else runs :meth:`_Compiled.run_general`."""
    if not _runs_as_is(c):
        return None
    fn, out, raw, tidx = c.fn, c.out, ShardedArray._derived, c.tensor_idx
    if tidx == (0,) and (c.tensors_only or c.nleaves == 1 and tree is None):
        return lambda leaves, tree: raw(fn(leaves[0].local), out)
    if c.tensors_only:
        return lambda leaves, tree: raw(fn(*[leaves[i].local for i in tidx]), out)
    if c.nleaves == 2 and tree is None:
        if tidx == (0, 1):
            return lambda leaves, tree: raw(fn(leaves[0].local, leaves[1].local), out)
        if tidx == (0,):
            return lambda leaves, tree: raw(fn(leaves[0].local, leaves[1]), out)
        if tidx == (1,):
            return lambda leaves, tree: raw(fn(leaves[0], leaves[1].local), out)

    def run(leaves, tree):
        locs = list(leaves)
        for i in tidx:
            locs[i] = locs[i].local
        if tree is None:
            return raw(fn(*locs), out)
        n, names = tree
        return raw(fn(*locs[:n], **dict(zip(names, locs[n:]))), out)

    return run


def _wrap(result, out):
    if out is None:
        return result
    if isinstance(out, BaseLayout):
        return ShardedArray._derived(result, out)
    wrapped = [_wrap(r, o) for r, o in zip(result, out)]
    if isinstance(result, tuple) and hasattr(type(result), "n_fields"):
        return type(result)(wrapped)  # torch.return_types.* (.values, .indices), as torch
    return type(out)(wrapped)


def strict_error(name, inputs, comm) -> RuntimeError:
    lines = []
    for pos, src, spec, steps in comm:
        ops = ", ".join(f"{s.op.name} over {s.axes}" for s in steps if s.collective)
        lines.append(
            f"input {pos} {tuple(src.shape)} has {src.spec} but the rule needs {spec} ({ops}); "
            f"fix: x{pos} = fs.reshard(x{pos}, fs.{spec!r})"
        )
    layouts = ", ".join(str(i.layout.spec) for i in inputs)
    return RuntimeError(
        f"fshard strict mode: {name} on inputs with layouts ({layouts}) needs an implicit "
        "reshard that communicates: " + "; ".join(lines) + ". Reshard explicitly before the "
        "call, or leave fs.config.strict()"
    )


def register_copies() -> None:
    """Give ``torch.<view>_copy`` (``permute_copy``, ``view_copy``, ``unbind_copy``...: a view
    op's out-of-place form, the same values) the rule of ``<view>``, once every rule family
    is registered."""
    for name in dir(torch):
        if not name.endswith("_copy") or name.startswith("_"):
            continue
        for home in (torch, torch.Tensor):
            rule = rule_for(getattr(home, name[: -len("_copy")], None))
            if rule is not None and rule_for(getattr(torch, name)) is None:
                register_rule(getattr(torch, name), rule)
                break
