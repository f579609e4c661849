"""``shard_map``: run a function on local blocks, with explicit ``fs.lax`` collectives.

The body sees plain local tensors (``ShardedArray.local``, or blocks of full tensors) and
returns local tensors; ``out_specs`` says how those blocks form global :class:`ShardedArray`
outputs. Everything is built from differentiable, vmappable pieces, so ``grad``, ``vjp``,
``jvp``, ``jacrev``, ``jacfwd``, ``hessian`` and ``vmap`` work on a function that calls
``shard_map``, with the gradient contract of DESIGN §4.

Varying-axes tracking (JAX's ``check_vma``, at run time). Per mesh axis a local value is
*invariant* (the same on every rank of the axis) or *varying*. While the body runs, a
``torch.overrides.TorchFunctionMode`` records each tensor's varying axes (an attribute on the
tensor object, stamped with the active body so stale marks are ignored):

- inputs vary over the axes their in_spec shards or marks partial;
- the result of a torch op varies over the union of its tensor operands' axes; when an operand
  is invariant over an axis another operand varies over, the invariant one is first passed
  through :func:`fshard.lax.pcast` over the missing axes (forward: no-op; backward: psum), so a
  replicated parameter's gradient is reduced exactly once (data parallel) and never when it only
  feeds invariant computation (``lambda w: w * 2`` with ``out_specs=P()``);
- collectives set their result's axes (``psum`` removes, ``all_gather`` adds, ...);
- tensors created in the body or closed over are invariant (constants, as in JAX);
  ``fs.lax.axis_index`` is a tensor varying over its axis.
  ``torch.func`` transforms applied *inside* the body: their wrappers of tracked tensors inherit
  the tracked axes; a gradient from an inner ``grad``/``vjp`` (``torch.autograd.grad`` in the
  body) varies over the axes of its primal (JAX: a cotangent has its primal's type); a ``vmap``
  result varies as the physical tensor it views (``out_dims`` moves a dim by a view).

Partial-manual bodies (``axis_names=``, JAX's partial-manual mode) and nesting. The body's
values are global-view ShardedArrays on the mesh of the auto axes (a fused projection's
:class:`~fshard.Parts` layout too, when its parts split over auto axes only; over a manual axis
it is refused by name); an op on them is one op rule
per manual block, so :meth:`_Tracker.sharded_op` (reached through the ShardedArray dispatcher,
swapped in while such a body runs) tracks it as a whole: the result varies over the union of
its operands' manual axes, an invariant operand is ``pcast`` first, and the rule's own
collectives (over auto axes) run untracked. A ``shard_map`` inside a body maps over axes the
outer one left automatic; its tracker tracks the outer's manual axes too (the outer's is paused
meanwhile), and its results carry their outer axes back to the outer tracker.

At the output boundary, an output declared sharded over an axis but tracked invariant is
``pcast`` (its blocks are copies, so its gradient sums them). Two mismatches are errors by
default (``check_vma=True``, JAX's static checks: a ``ValueError`` naming the fix, no
communication): an output declared replicated over an axis but tracked varying, and an output
declared partial over an axis but tracked invariant (its ``n`` equal copies would be added up;
JAX refuses an unreduced out_spec for an invariant value too). With ``check_vma=False`` the
out_spec is trusted: a partial-declared invariant output is ``pcast``, and a replicated-declared
varying one gets a cast whose forward is the identity and whose backward
scales the cotangent by ``1/n`` (e.g. the default ``all_gather(to="varying")`` returned as
``P()``: the cotangent of an invariant output arrives identical on every rank and the varying
computation behind it would otherwise add the ``n`` copies up).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Sequence

import optree
import torch
from torch.overrides import TorchFunctionMode

from . import _comm, _compat, axis_env, consistency, lax
from . import array as _array
from ._leaf_errors import LeafErrors, paths
from .api import shard
from .array import ShardedArray, install_dispatch, is_sharded
from .collectives import Bound, Pcast, Unvary
from .executor import claimed_local
from .lax import apply
from .mesh import Mesh, _member_ranks
from .spec import Layout, P, Parts, PartsLayout, chunk_bounds, nests, spec_of_dims

__all__ = ["shard_map"]

_EMPTY: frozenset = frozenset()
_ATTR = "_fshard_vma"
# Calls that must never get a pcast operand: autograd entry points take tensors that have to
# stay the very objects of the graph.
_PASSTHROUGH = {
    torch.autograd.grad,
    torch.autograd.backward,
    torch.Tensor.backward,
    torch.Tensor.register_hook,
    torch.Tensor.requires_grad_,
    torch.Tensor.detach,
    torch.Tensor.detach_,
}
_FUNCTORCH = torch._C._functorch
_compiling = torch.compiler.is_compiling


class _Tracker(TorchFunctionMode):
    """Records the varying mesh axes of every tensor produced in a shard_map body."""

    def __init__(self, mesh: Mesh, manual: frozenset | None = None, auto: Mesh | None = None):
        super().__init__()
        self.mesh = mesh  # the root mesh: its groups run the pcasts
        # The axes tracked: the body's manual axes and those of every enclosing body.
        self.manual = frozenset(mesh.axis_names) if manual is None else manual
        self.auto = auto  # the mesh of the body's global-view values (partial-manual), or None
        self._paused = 0
        self._popped = False  # off torch's mode stack while paused (see ``paused``)

    @property
    def paused(self) -> int:
        """How many pauses are open: while any is, every op passes through untracked. A pause
        opened where the tracker is the innermost torch-function mode (a pipeline's schedule,
        an inner body's run) also takes the mode off torch's stack until the last pause
        closes: a paused mode's only work is passing each call on, and every torch call and
        tensor attribute read in the pause went through it (~3,700 Python calls a step on a
        stage of ``benchmarks/composed_step.py``'s FSDP x PP). Not under ``torch.compile``
        (the stack is dynamo's to trace)."""
        return self._paused

    @paused.setter
    def paused(self, n: int) -> None:
        was, self._paused = self._paused, n
        if was == 0 and n > 0 and not _compiling():
            top = torch._C._len_torch_function_stack() - 1
            if top >= 0 and torch._C._get_function_stack_at(top) is self:
                torch._C._pop_torch_function_stack()
                self._popped = True
        elif was > 0 and n == 0 and self._popped:
            self._popped = False
            torch._C._push_on_torch_function_stack(self)

    # -- marks --------------------------------------------------------------------------
    def vma(self, t: torch.Tensor) -> frozenset:
        mark = getattr(t, _ATTR, None)
        if mark is not None and mark[0] is self:
            return mark[1]
        # A functorch wrapper made inside the body (grad/vmap in the body) of a tracked tensor
        # (under dynamo the transforms are its own higher-order ops: no wrapper is seen).
        while not _compiling() and _FUNCTORCH.is_functorch_wrapped_tensor(t):
            t = _FUNCTORCH.get_unwrapped(t)
            mark = getattr(t, _ATTR, None)
            if mark is not None and mark[0] is self:
                return mark[1]
        # A view made where the mode cannot see it (vmap moving its result's batch dim to
        # out_dims) varies as what it views; views of closed-over constants stay invariant.
        base = t._base
        mark = getattr(base, _ATTR, None) if base is not None else None
        if mark is not None and mark[0] is self:
            return mark[1]
        return _EMPTY

    def tag(self, t, axes: frozenset) -> None:
        if isinstance(t, torch.Tensor):
            _mark(t, (self, axes))
        elif isinstance(t, (tuple, list)):
            for item in t:
                if isinstance(item, torch.Tensor):
                    _mark(item, (self, axes))

    def pcast(self, t: torch.Tensor, axes: Sequence[str]) -> torch.Tensor:
        """``t`` made varying over ``axes``; axes it already varies over are skipped."""
        have = self.vma(t)
        missing = tuple(a for a in self.mesh.axis_names if a in axes and a not in have)
        if not missing:
            return t
        self.paused += 1
        try:
            g = self.mesh.group(missing)
            out = apply(Bound(Pcast(g.axes), g), t)
        finally:
            self.paused -= 1
        self.tag(out, have | frozenset(missing))
        return out

    def dispatch(self) -> contextlib.AbstractContextManager:
        """While the body's code runs (its call, and ``fs.remat``'s recompute of a part of it
        in the backward): a partial-manual body's global-view ops go through
        :meth:`sharded_op`, which pcasts their invariant operands; others need nothing."""
        return _TrackedDispatch() if self.auto is not None else contextlib.nullcontext()

    def collective(self, xs: list, axes: tuple[str, ...], run: Callable, varies: bool) -> list:
        """Run a collective on ``xs`` (pcast first where invariant) and mark its results.

        Only the tracked axes (:attr:`manual`) are typed: over an auto axis of a
        partial-manual body (local code given the root mesh, e.g. ``fs.nn.fsdp_call``'s gather
        of a param's block over ``dp`` in a pipeline stage, recomputed by ``fs.remat``) the
        collective runs as outside a body. The tracker never sees what varies over an axis it
        does not track, so it read every such operand as invariant: its pcast put a second sum
        over the axis into the backward (the gathered param's gradient reduce-scattered, then
        summed again)."""
        tracked = tuple(a for a in axes if a in self.manual)
        vmas = [self.vma(x) for x in xs]
        xs = [self.pcast(x, tracked) for x in xs]
        self.paused += 1
        try:
            ys = run(xs)
        finally:
            self.paused -= 1
        axes_set = frozenset(axes)
        for y, v in zip(ys, vmas):
            self.tag(y, (v | frozenset(tracked)) if varies else (v - axes_set))
        return ys

    # -- the mode -------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.grad and not self.paused:
            return self._grad(func, args, kwargs)
        if self.paused or func in _PASSTHROUGH or ShardedArray in types:
            # A ShardedArray operand (partial-manual body): its op rule is tracked as a whole
            # by _sharded_op, which ShardedArray.__torch_function__ reaches.
            return func(*args, **kwargs)
        found = []  # vma of every tensor operand
        for a in args:
            if isinstance(a, torch.Tensor):
                found.append(self.vma(a))
            elif isinstance(a, (tuple, list, slice)):
                found.extend(self.vma(t) for t in _index_tensors(a))
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                found.append(self.vma(a))
        union = _EMPTY.union(*found) if found else _EMPTY
        if union and any(v != union for v in found):
            args, kwargs = self._align(func, args, kwargs, union)
        out = func(*args, **kwargs)
        if union:
            self.tag(args[0] if _in_place(func, kwargs) else out, union)
        return out

    def sharded_op(self, dispatch, func, args, kwargs):
        """An op on global-view values of a partial-manual body: the op rule maps each manual
        block independently (its collectives run over the auto axes), so its results vary over
        the union of its operands' manual axes, and an operand invariant over one of them is
        ``pcast`` first (its gradient is then summed over that axis exactly once)."""
        found = [self.vma(_block(t)) for t in _operands(args, kwargs)]
        union = _EMPTY.union(*found) if found else _EMPTY
        if union and any(v != union for v in found):
            axes = tuple(union)

            def fix(t):
                if isinstance(t, ShardedArray) and t.dtype.is_floating_point:
                    local = self.pcast(t.local, axes)
                    return t if local is t.local else ShardedArray._raw(local, t.layout)
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    return self.pcast(t, axes)
                return t

            def fix_arg(a):
                if isinstance(a, (tuple, list)) and not isinstance(a, torch.Size):
                    return type(a)(fix(t) for t in a)
                return fix(a)

            args = tuple(fix_arg(a) for a in args)
            kwargs = {k: fix_arg(v) for k, v in kwargs.items()}
        self.paused += 1
        try:
            out = dispatch(func, args, kwargs)
        finally:
            self.paused -= 1
        if union:
            for t in optree.tree_leaves(out, is_leaf=is_sharded):
                if isinstance(t, (torch.Tensor, ShardedArray)):
                    self.tag(_block(t), union)
        return out

    def _grad(self, func, args, kwargs):
        """``torch.autograd.grad`` in the body (what an inner ``torch.func.grad``/``vjp`` calls):
        a cotangent varies over the axes its primal varies over (JAX: same vma type)."""
        inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
        grads = func(*args, **kwargs)
        primals = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        for g, p in zip(grads, primals):
            if isinstance(g, torch.Tensor) and isinstance(p, torch.Tensor):
                self.tag(g, self.vma(p))
        return grads

    def _align(self, func, args, kwargs, union):
        """pcast every floating operand that is invariant over an axis in ``union``."""
        skip_first = _in_place(func, kwargs)

        def fix(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and self.vma(t) != union:
                return self.pcast(t, tuple(union))
            return t

        new_args = []
        for i, a in enumerate(args):
            if i == 0 and skip_first:
                new_args.append(a)
            elif isinstance(a, torch.Tensor):
                new_args.append(fix(a))
            elif isinstance(a, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in a):
                new_args.append(type(a)(fix(t) for t in a))
            else:
                new_args.append(a)
        new_kwargs = {k: fix(v) if k != "out" else v for k, v in kwargs.items()}
        return tuple(new_args), new_kwargs


def _operands(args, kwargs):
    """The tensors and ShardedArrays among an op's arguments (and in its list arguments)."""
    for a in (*args, *kwargs.values()):
        items = a if isinstance(a, (tuple, list)) else (a,)
        for t in items:
            if isinstance(t, (torch.Tensor, ShardedArray)):
                yield t


def _block(t):
    """The tensor whose marks track a value: a ShardedArray's local block, or the tensor."""
    return t.local if isinstance(t, ShardedArray) else t


def _index_tensors(a):
    """The tensors in a tuple/list argument or an index: slice bounds included, so a slice of
    an invariant value at a varying position (``v[2 * i : 2 * i + 2]``, ``i`` from
    :func:`fshard.lax.axis_index`) varies, as JAX's ``dynamic_slice`` does, and its gradient
    is summed over the axis (the invariant operand is ``pcast`` first)."""
    items = (a.start, a.stop, a.step) if isinstance(a, slice) else a
    for t in items:
        if isinstance(t, torch.Tensor):
            yield t
        elif isinstance(t, slice):
            yield from (b for b in (t.start, t.stop, t.step) if isinstance(b, torch.Tensor))


def _mark(t: torch.Tensor, mark: tuple) -> None:
    setattr(t, _ATTR, mark)
    # A transform applied inside the body (vmap) hands back its physical result when no dim
    # moves; marking the physical tensor keeps that result tracked.
    while not _compiling() and _FUNCTORCH.is_functorch_wrapped_tensor(t):
        t = _FUNCTORCH.get_unwrapped(t)
        setattr(t, _ATTR, mark)


def _in_place(func, kwargs) -> bool:
    return "out" in kwargs or _in_place_name(func)


def _in_place_name(func) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and name[-2] != "_")


# Run by dynamo at trace time (what torch.compiler.assume_constant_result sets): it cannot read
# a torch function's __name__ in a trace.
_in_place_name._dynamo_marked_constant = True


# -- the body: which axes are manual ---------------------------------------------------------


class _Body:
    """One shard_map call's axes. ``mesh``: the mesh its specs and results live on (the
    enclosing body's auto mesh when nested); ``manual``: its manual axes; ``auto``: the mesh of
    the other axes through this rank (partial-manual: the body's values are global-view
    ShardedArrays on it), or ``None``; ``outer``: the enclosing body's tracker, or ``None``."""

    __slots__ = ("mesh", "root", "manual", "auto", "outer")

    def __init__(self, mesh: Mesh, root: Mesh, manual: frozenset, outer: _Tracker | None):
        self.mesh, self.root, self.manual, self.outer = mesh, root, manual, outer
        rest = tuple(a for a in mesh.axis_names if a not in manual)
        self.auto = _auto_mesh(mesh, rest) if rest else None

    def tracker(self) -> _Tracker:
        tracked = self.manual | (self.outer.manual if self.outer is not None else _EMPTY)
        return _Tracker(self.root, tracked, self.auto)

    def outer_vma(self, leaf) -> frozenset:
        """What the enclosing body tracks on ``leaf`` (its axes stay tracked in this body)."""
        if self.outer is None or not isinstance(leaf, (torch.Tensor, ShardedArray)):
            return _EMPTY
        return self.outer.vma(_block(leaf))

    def spec_problem(self, spec: P, what: str) -> str | None:
        for a in spec.axes:
            if self.outer is not None and a in self.outer.manual:
                return (
                    f"spec {spec} names axis {a!r}, which the enclosing shard_map already made "
                    f"manual; an inner shard_map maps over the axes left automatic "
                    f"{self.mesh.axis_names}"
                )
            if a not in self.mesh.axis_names:
                return (
                    f"spec {spec} names axis {a!r}, which is not an axis of the mesh; the mesh "
                    f"axes are {self.mesh.axis_names}"
                )
            if a not in self.manual:
                return (
                    f"spec {spec} names axis {a!r}, which is not manual in this shard_map "
                    f"(axis_names={set(sorted(self.manual))}): {what} may name only the manual "
                    f"axes; the other axes keep the inputs' layouts inside the body (add {a!r} "
                    "to axis_names to map over it)"
                )
        return None


_AUTO: dict = {}


def _auto_mesh(mesh: Mesh, names: tuple[str, ...]) -> Mesh:
    """The mesh of axes ``names`` through this rank (the ranks sharing its other coordinates),
    using ``mesh``'s process groups. Built once per mesh object and axes."""
    key = (id(mesh), names)
    hit = _AUTO.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    ranks = _member_ranks(mesh, names, mesh.rank)
    shape = tuple(mesh.size(a) for a in names)
    if mesh._simulated is not None:  # a dry run's rank: its sub-mesh is simulated alike
        sub = Mesh(shape, names, ranks, mesh.device_type, None, mesh._simulated)
    else:
        sub = Mesh(shape, names, ranks, mesh.device_type, mesh.device_mesh[names])
    for k in range(len(names) + 1):
        for axes in itertools.permutations(names, k):
            sub._groups[axes] = mesh.group(axes)
    _AUTO[key] = (mesh, sub)
    return sub


class _TrackedDispatch:
    """While partial-manual bodies run, ShardedArray ops go through the innermost body's
    tracker (:meth:`_Tracker.sharded_op`); the dispatcher is restored when the last one ends,
    so ops outside bodies pay nothing."""

    base = None
    depth = 0

    def __enter__(self):
        if _TrackedDispatch.depth == 0:
            _TrackedDispatch.base = base = _array._DISPATCH

            def dispatch(func, args, kwargs):
                t = axis_env.tracker()
                if t is None or t.paused or t.auto is None:
                    return base(func, args, kwargs)
                return t.sharded_op(base, func, args, kwargs)

            install_dispatch(dispatch)
        _TrackedDispatch.depth += 1

    def __exit__(self, *exc):
        _TrackedDispatch.depth -= 1
        if _TrackedDispatch.depth == 0:
            install_dispatch(_TrackedDispatch.base)


# -- specs and pytrees ----------------------------------------------------------------------


def _is_spec(s) -> bool:
    return isinstance(s, P) or s is None


def _spec_leaves(specs, tree, what: str) -> tuple[list, list, object]:
    """Match the prefix ``specs`` against ``tree``: (spec per subtree, subtrees, treedef)."""
    spec_list, treedef = optree.tree_flatten(specs, is_leaf=_is_spec, none_is_leaf=True)
    errors = LeafErrors(f"shard_map: {what} must hold fshard.P entries (or None)", what)
    for key, s in zip(paths(treedef), spec_list):
        if not _is_spec(s):
            errors.add(key, f"got {type(s).__name__} {s!r}", TypeError)
    errors.raise_if_any()
    try:
        subtrees = treedef.flatten_up_to(tree)
    except ValueError as e:
        raise ValueError(
            f"shard_map: {what} {specs!r} is not a prefix of the structure it describes "
            f"({optree.tree_structure(tree, is_leaf=is_sharded)}); give one P per input / "
            f"output, or one P for a whole subtree ({e})"
        ) from None
    return spec_list, subtrees, treedef


def _subtrees(specs: list, subtrees: list, treedef, prefix: str):
    """Per spec: ``(spec, its path, [(path, leaf)] of its subtree, the subtree's treedef)``;
    paths are JAX key paths after ``prefix`` (``args[0]['w']``)."""
    for spec, sub, key in zip(specs, subtrees, paths(treedef)):
        leaves, sub_def = optree.tree_flatten(sub, is_leaf=is_sharded)
        where = prefix + key
        yield spec, where, [(where + k, v) for k, v in zip(paths(sub_def), leaves)], sub_def


# -- the input boundary ---------------------------------------------------------------------


def _input_problem(x, spec: P | None, body: _Body) -> str | None:
    if spec is None or not isinstance(x, ShardedArray):
        return None
    mesh = body.mesh
    if x.mesh != mesh:
        return f"lives on {x.mesh!r}, not on the shard_map mesh {mesh!r}"
    if body.auto is None:
        if x.layout.spec != spec:
            return (
                f"has layout {x.layout.spec} but in_specs gives {spec}; shard_map never "
                f"reshards implicitly: call fs.reshard(x, {spec}) first"
            )
        return None
    # Partial-manual: the in_spec says how the manual axes split x; the auto axes may split it
    # too (after the manual ones in a dim), and stay split inside the body.
    have = x.layout.spec
    if isinstance(x.layout, PartsLayout):  # a fused projection's parts, split per part
        if set(x.layout.axes) & body.manual:
            return (
                f"has layout {have}, whose parts are split over the manual axes "
                f"{tuple(sorted(set(x.layout.axes) & body.manual))}; a body takes a per-part "
                "split over its auto axes only: call fs.reshard(x, ...) first"
            )
        have = x.layout.base.spec
    dims = have.padded(max(len(have), len(spec)))
    manual_first = all(
        d[: len([a for a in d if a in body.manual])] == tuple(a for a in d if a in body.manual)
        for d in dims
    )
    if _restrict(have, body.manual) != spec or not manual_first:
        return (
            f"has layout {have}, whose manual axes {tuple(sorted(body.manual))} do not split it "
            f"as in_specs gives ({spec}, each manual axis before any auto axis in a dim); "
            f"call fs.reshard(x, ...) first"
        )
    if bad := _mixed_dim_problem(have, tuple(x.shape), body.manual, body.mesh):
        return bad
    return None


def _restrict(spec: P, axes: frozenset) -> P:
    """``spec`` with only the mesh axes in ``axes`` (the others replicated)."""
    dims = [tuple(a for a in d if a in axes) or None for d in spec.dims]
    return P(*dims, partial=tuple(a for a in spec.partial if a in axes))


def _merged(manual: P, auto: P, ndim: int) -> P:
    """The global spec of a partial-manual output: per dim the manual axes, then the auto ones."""
    dims = [m + a for m, a in zip(manual.padded(ndim), auto.padded(ndim))]
    while dims and not dims[-1]:
        dims.pop()
    return spec_of_dims(dims, manual.partial + auto.partial)


def _mixed_dim_problem(spec: P, shape: tuple, manual: frozenset, mesh: Mesh) -> str | None:
    """A dim split over manual axes M and auto axes A is the concatenation of its M blocks each
    split over A only if fshard's chunks of the dim over M x A nest in its chunks over M
    (always for sizes divisible by the product; not for every uneven size)."""
    for d, axes in enumerate(spec.padded(len(shape))):
        m = tuple(a for a in axes if a in manual)
        if not m or len(m) == len(axes):
            continue
        km, ka, n = mesh.size(m), mesh.size(axes[len(m) :]), shape[d]
        if not nests(n, km, ka):
            return (
                f"splits dim {d} (size {n}) over {axes}: fshard's chunks of it over "
                f"all {km * ka} ranks are not the chunks over the auto axes "
                f"{axes[len(m) :]} of its blocks over the manual axes {m}; use a size "
                f"divisible by {km * ka}, or split that dim over the manual axes only"
            )
    return None


def _local_input(x, spec: P | None, body: _Body):
    if spec is None:
        return x
    if isinstance(x, ShardedArray):
        local = claimed_local(x)
        if body.auto is None:
            return local
        block = Layout(body.mesh, spec, x.shape, x.dtype).local_shape(body.mesh.rank)
        lay = x.layout
        auto_axes = frozenset(body.auto.axis_names)
        if isinstance(lay, PartsLayout):  # the parts over auto axes only (_input_problem)
            auto = Parts(_restrict(lay.base.spec, auto_axes), lay.dim, lay.sizes)
            return ShardedArray._raw(local, Layout.of(body.auto, auto, block, x.dtype))
        auto = _restrict(lay.spec, auto_axes)
        return ShardedArray._raw(local, Layout(body.auto, auto, block, x.dtype))
    if isinstance(x, torch.Tensor):
        local = shard(x, body.mesh, spec).local
        if body.auto is None:
            return local
        return ShardedArray._raw(local, Layout(body.auto, P(), tuple(local.shape), local.dtype))
    return x


def _inputs(args: tuple, in_specs, body: _Body) -> tuple[tuple, list]:
    """Body inputs and, per tensor leaf, (its block, varying axes) to mark once the body starts."""
    if isinstance(in_specs, list):
        in_specs = tuple(in_specs)
    if _is_spec(in_specs):
        in_specs = (in_specs,) * len(args)
    specs, subtrees, treedef = _spec_leaves(in_specs, args, "in_specs")
    inputs = list(_subtrees(specs, subtrees, treedef, "args"))
    errors = LeafErrors("shard_map: inputs that do not fit their in_specs")
    for spec, where, leaves, _ in inputs:  # every input checked before any communication
        if spec is not None and (problem := body.spec_problem(spec, "in_specs")):
            errors.add(where, problem)
            continue
        for w, leaf in leaves:
            if problem := _input_problem(leaf, spec, body):
                errors.add(w, problem)
    errors.raise_if_any()
    marks: list = []
    seen: dict = {}
    new = []
    nested = body.outer is not None
    for spec, _, leaves, sub_def in inputs:
        locals_ = []
        spec_axes = frozenset(spec.axes) if spec is not None else _EMPTY  # once per subtree
        for _, leaf in leaves:
            value = _local_input(leaf, spec, body)
            if spec is not None and isinstance(value, (torch.Tensor, ShardedArray)):
                local = _block(value)
                axes = spec_axes | body.outer_vma(leaf) if nested else spec_axes
                # a view where the mark would overwrite another's: one object under two
                # specs, or (nested) the enclosing body's block, whose mark the enclosing
                # tracker reads after this body (overwritten, it read the block as invariant
                # and pcast it: its other uses' gradients summed over the outer axes)
                if seen.setdefault(id(local), axes) != axes or nested:
                    local = local.view_as(local)
                    if isinstance(value, ShardedArray):
                        value = ShardedArray._raw(local, value.layout)
                    else:
                        value = local
                marks.append((local, axes))
            locals_.append(value)
        new.append(optree.tree_unflatten(sub_def, locals_))
    return treedef.unflatten(new), marks


# -- the output boundary --------------------------------------------------------------------


def _outputs(out, out_specs, body: _Body, tracker: _Tracker, out_shapes, check: bool, vma: bool):
    mesh = body.mesh
    if isinstance(out_specs, list):
        out_specs = tuple(out_specs)
    specs, subtrees, treedef = _spec_leaves(out_specs, out, "out_specs")
    flat = []  # (where, local tensor, spec, block shape, the block's layout over the auto axes)
    subdefs = []
    errors = LeafErrors("shard_map: outputs that do not fit their out_specs")
    for spec, where, leaves, sub_def in _subtrees(specs, subtrees, treedef, "output"):
        subdefs.append((sub_def, len(leaves)))
        if spec is None:
            errors.add(where, "its out_specs entry is None; give a fshard.P", TypeError)
            continue
        if problem := body.spec_problem(spec, "out_specs"):
            errors.add(where, problem)
            continue
        for w, leaf in leaves:
            if body.auto is not None and isinstance(leaf, ShardedArray):
                if leaf.mesh != body.auto:
                    errors.add(
                        w,
                        f"is a ShardedArray on {leaf.mesh!r}; a partial-manual body returns "
                        f"values on its auto axes' mesh {body.auto!r} (what its inputs are on)",
                    )
                    continue
                local, inner, shape = leaf.local, leaf.layout.spec, tuple(leaf.shape)
            elif not isinstance(leaf, torch.Tensor) or isinstance(leaf, ShardedArray):
                errors.add(
                    w,
                    f"the body returned {type(leaf).__name__}; it must return local "
                    "torch.Tensors (the body works on local blocks)"
                    + ("" if body.auto is None else " or ShardedArrays on its auto axes"),
                    TypeError,
                )
                continue
            else:
                local, inner, shape = leaf, None, tuple(leaf.shape)  # replicated over auto
            if len(shape) < len(spec):
                errors.add(
                    w, f"has {len(shape)} dims but its out_spec {spec} has {len(spec)} entries"
                )
            elif vma and (problem := _variance_problem(spec, mesh, tracker.vma(local))):
                errors.add(w, problem)
            flat.append((w, local, spec, shape, inner))
    errors.raise_if_any()
    if check:
        for w, local, spec, _, _ in flat:
            _check_replicated(w, local, spec, mesh, body.manual)
    shapes = _global_shapes(flat, mesh, out_shapes, out)
    results = []
    for (w, local, spec, _, inner), shape in zip(flat, shapes):
        have = tracker.vma(local)
        local = _cast_out(local, spec, mesh, have)
        if body.outer is not None:  # the enclosing body tracks its own manual axes on it
            body.outer.tag(local, have & body.outer.manual)
        full = spec if inner is None else _merged(spec, inner, len(shape))
        if inner is not None and (problem := _mixed_dim_problem(full, shape, body.manual, mesh)):
            raise ValueError(f"shard_map: {w} {problem}")
        results.append(ShardedArray._raw(local, Layout(mesh, full, shape, local.dtype)))
    new, i = [], 0
    for sub_def, n in subdefs:
        new.append(optree.tree_unflatten(sub_def, results[i : i + n]))
        i += n
    return treedef.unflatten(new)


def _variance_problem(spec: P, mesh: Mesh, vma: frozenset) -> str | None:
    """JAX's static out_specs check (``check_vma``): an output declared replicated over an axis
    must be invariant over it, and one declared partial (addends, JAX's *unreduced*) over an
    axis must vary over it: the same value on every rank taken as addends would be counted
    ``n`` times. Uses the tracked varying axes only: no communication."""
    summed = [a for a in mesh.axis_names if a in spec.partial and a not in vma]
    if summed:
        axes = summed[0] if len(summed) == 1 else tuple(summed)
        rest = P(*spec.dims, partial=tuple(a for a in spec.partial if a not in summed))
        return (
            f"declared partial over mesh axis {axes!r} by its out_spec {spec} (its blocks are "
            f"addends of a pending sum), but it is invariant over {axes!r} (the same on every "
            f"rank of it, e.g. already reduced by fs.lax.psum): taken as addends it would be "
            f"counted once per rank of {axes!r} ({mesh.size(axes)} times). "
            f"Declare it replicated over {axes!r} (out_specs={rest!r}), or return the unreduced "
            f"addends (drop the fs.lax.psum over {axes!r}) with P(partial={axes!r})."
        )
    bad = [a for a in mesh.axis_names if a in vma and a not in spec.axes]
    if bad:
        axes = bad[0] if len(bad) == 1 else tuple(bad)
        return (
            f"declared replicated over mesh axis {axes!r} by its out_spec "
            f"{spec}, but it varies over {axes!r} (it was computed from values sharded or "
            f"partial over {axes!r} and not reduced). Reduce it in the body (fs.lax.psum / "
            f"pmean / pmax, or fs.lax.all_gather(..., to='invariant')), or name the axis in its "
            f"out_spec (P({axes!r}) to concatenate the blocks, P(partial={axes!r}) for "
            "addends). If the blocks are equal by construction, pass check_vma=False to trust "
            "the out_spec (check_replication=True then verifies the values)."
        )


def _cast_out(local: torch.Tensor, spec: P, mesh: Mesh, vma: frozenset) -> torch.Tensor:
    declared = frozenset(spec.axes)
    add = tuple(a for a in mesh.axis_names if a in declared and a not in vma)
    drop = tuple(a for a in mesh.axis_names if a in vma and a not in declared)
    if add:
        g = mesh.group(add)
        local = apply(Bound(Pcast(g.axes), g), local)
    if drop:
        g = mesh.group(drop)
        local = apply(Bound(Unvary(g.axes), g), local)
    return local


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The physical tensor under any functorch wrappers (for checks that only read values)."""
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        t = _FUNCTORCH.get_unwrapped(t)
    return t.detach()


def _check_replicated(where: str, local, spec: P, mesh: Mesh, manual: frozenset) -> None:
    """Raise unless ``local`` is equal on every rank of each manual axis ``spec`` leaves
    replicated."""
    t = _plain(local)
    for a in mesh.axis_names:
        if a not in manual or a in spec.axes or mesh.size(a) == 1:
            continue
        g = mesh.group(a)
        with torch.no_grad():
            hi = _comm.all_reduce(t, g, "max")
            lo = _comm.all_reduce(t, g, "min")
            same = torch.tensor([float(torch.equal(hi, lo))])
            agreed = _comm.all_reduce(same, g, "min")  # every rank raises, or none
        if agreed.item() != 1.0:
            worst = (hi.float() - lo.float()).abs().max().item() if hi.numel() else 0.0
            raise ValueError(
                f"shard_map(check_replication=True): {where} is declared replicated over mesh "
                f"axis {a!r} by out_spec {spec}, but its values differ across that axis (max "
                f"abs difference {worst:g}). Return it with a spec that names {a!r} (sharded or "
                f"partial), or reduce it first (fs.lax.psum / pmean / all_gather)"
            )


def _global_shapes(flat: list, mesh: Mesh, out_shapes, out) -> list:
    """Per output (``(where, local, spec, block shape, auto spec)``): its global shape. The
    block is the body's value: a local block, or a global-view value over the auto axes."""
    if out_shapes is not None:
        return _given_shapes(flat, mesh, out_shapes, out)
    if not any(any(f[2].dims) for f in flat):
        return [f[3] for f in flat]
    return _exchanged_shapes(flat, mesh)


def _is_shape(v) -> bool:
    return isinstance(v, (tuple, list, torch.Size)) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in v
    )


def _given_shapes(flat: list, mesh: Mesh, out_shapes, out) -> list:
    if _is_shape(out_shapes) and len(flat) == 1 and isinstance(out, torch.Tensor):
        given = [tuple(out_shapes)]
    else:
        given = optree.tree_leaves(out_shapes, is_leaf=_is_shape, none_is_leaf=True)
        if len(given) != len(flat) or not all(_is_shape(s) for s in given):
            raise ValueError(
                f"shard_map: out_shapes must give one global shape (a tuple of ints) per output "
                f"tensor, in the output's structure; the body returned {len(flat)} tensors, "
                f"out_shapes has {len(given)} entries: {out_shapes!r}"
            )
    shapes = [tuple(shape) for shape in given]
    errors = LeafErrors("shard_map: outputs that do not fit out_shapes")
    for (w, local, spec, block, _), shape in zip(flat, shapes):
        want = Layout(mesh, spec, shape, local.dtype).local_shape(mesh.rank)
        if block != want:
            errors.add(
                w,
                f"has local shape {block} but out_shapes gives global shape "
                f"{shape} with spec {spec}, whose block on rank {mesh.rank} is {want}",
            )
    errors.raise_if_any()
    return shapes


def _exchanged_shapes(flat: list, mesh: Mesh) -> list:
    """Global shapes from every rank's local shapes: ONE small all_gather of int64 sizes.

    Local sizes alone cannot say whether a block of 3 belongs to a dim of 5 or 6 split in two,
    so the ranks exchange their local shapes (all outputs in one message); the global size of a
    split dim is the sum of its chunk sizes, checked against fshard's chunking convention.
    """
    mine = [s for f in flat for s in f[3]]
    g = mesh.group(mesh.axis_names)
    rows = _comm.size_exchange(mine, g, mesh.device())
    table = {g.ranks[j]: rows[j] for j in range(g.size)}
    shapes, k = [], 0
    for w, _, spec, block, _ in flat:
        nd = len(block)
        dims = spec.padded(nd)
        shape = []
        for d in range(nd):
            sizes = {r: table[r][k + d] for r in mesh.ranks}
            shape.append(_dim_size(w, d, dims[d], sizes, mesh))
        shapes.append(tuple(shape))
        k += nd
    return shapes


def _dim_size(where: str, d: int, axes: tuple, sizes: dict, mesh: Mesh) -> int:
    if not axes:
        distinct = sorted(set(sizes.values()))
        if len(distinct) > 1:
            raise ValueError(
                f"shard_map: {where} dim {d} is not split by its out_spec but its local size "
                f"differs across ranks ({[sizes[r] for r in mesh.ranks]} in rank order); split "
                "it in the out_spec or make the sizes agree"
            )
        return distinct[0]
    k = mesh.size(axes)
    chunk: dict = {}
    for r, s in sizes.items():
        j = mesh.axis_index(axes, r)
        if chunk.setdefault(j, s) != s:
            raise ValueError(
                f"shard_map: {where} dim {d} is split over {axes}, but ranks holding the same "
                f"chunk {j} have different sizes ({chunk[j]} and {s})"
            )
    per = [chunk[j] for j in range(k)]
    n = sum(per)
    expected = [b - a for a, b in (chunk_bounds(n, k, j) for j in range(k))]
    if per != expected:
        raise ValueError(
            f"shard_map: {where} dim {d} is split over {axes} with chunk sizes {per} (total "
            f"{n}), but fshard's layout of a dim of size {n} over {k} chunks is {expected} "
            "(ceil-div chunks, the last ones smaller or empty). Return blocks with those sizes "
            "or pass out_shapes="
        )
    return n


def call_signature(args: tuple, in_specs, out_specs) -> dict:
    """What every rank must agree on when calling a shard_map (consistency mode): what
    :func:`shard_map`'s call compares, and what a caller of :func:`shard_map_checked_by_caller`
    compares in a check of its own."""

    def describe(v):
        if isinstance(v, ShardedArray):
            return ("ShardedArray", v.layout.spec, v.layout.shape, v.layout.dtype)
        if isinstance(v, torch.Tensor):
            return ("Tensor", tuple(v.shape), v.dtype)
        return type(v).__name__

    leaves = optree.tree_leaves(args, is_leaf=is_sharded, none_is_leaf=True)
    # static metadata: hashed once per distinct signature (a step's is the last step's); specs
    # by value (consistency._canonical, and P's equality for the cache): P('x') and
    # P('x', None) are one spec
    return {
        "in_specs": consistency.Static(in_specs),
        "out_specs": consistency.Static(out_specs),
        "inputs": consistency.Static(tuple(describe(v) for v in leaves)),
    }


# -- the public function --------------------------------------------------------------------


def shard_map(
    f: Callable,
    mesh: Mesh,
    in_specs,
    out_specs,
    check_replication: bool = False,
    out_shapes=None,
    check_vma: bool = True,
    axis_names=None,
) -> Callable:
    """Map ``f`` over local blocks: ``f`` sees this rank's local tensors and uses ``fs.lax``.

    Args:
        f: the body. It receives local ``torch.Tensor`` blocks (in the structure of the
            arguments) and returns local tensors (any pytree). ``fs.lax`` collectives inside it
            use ``mesh``; ``fs.lax.axis_index`` gives this rank's position.
        mesh: a real :class:`fshard.Mesh` (``Mesh.create``).
        in_specs: a pytree prefix of the positional arguments: one :class:`P` per argument or
            per subtree (a single ``P`` applies to every argument). A :class:`ShardedArray`
            argument must already have that layout (else ``ValueError``: use ``fs.reshard``);
            a plain full tensor is split with ``fs.shard`` (no communication); ``None`` passes
            that subtree through untouched (e.g. Python numbers).
        out_specs: a pytree prefix of the body's output: how the local blocks form each global
            output. ``P(partial="x")`` means the local values are addends over ``x``.
        check_replication: verify that every output is equal over each mesh axis its out_spec
            leaves replicated (two all_reduces per output and axis) and raise a ``ValueError``
            naming the output and the axis otherwise.
        out_shapes: the global shapes of the outputs (a shape per output tensor, in the
            output's structure). Without it, outputs whose out_spec splits a dim cost one small
            all_gather of the local shapes per call (all outputs in one message), because
            uneven blocks make the global size undecidable from one rank's block; outputs with
            no split dim need no exchange.
        check_vma: JAX's check: an output whose out_spec leaves an axis replicated must be
            invariant over it (reduced, or never mixed with values sharded over it), else
            ``ValueError`` naming the output, the axis and the fix. Free: it reads the tracked
            varying axes. ``False`` trusts the out_spec (the output is taken as equal over the
            axis; its cotangent is counted once). Likewise an output declared partial over an
            axis (``P(partial="x")``: addends) must vary over it; an invariant one (e.g. the
            result of ``fs.lax.psum(t, "x")``) would be summed ``n`` times: ``ValueError``
            naming the out_spec to use instead.

        axis_names: the mesh axes the body is manual over (JAX's ``axis_names``, a set);
            default every axis. ``in_specs`` / ``out_specs`` may name only these (``ValueError``
            naming the spec and the axis otherwise). With fewer than all the axes
            (*partial-manual*), the body's values are global-view :class:`ShardedArray` s on the
            mesh of the other (auto) axes through this rank: an input keeps its layout over
            the auto axes (its in_spec says how the manual axes split it; a dim split over
            both must name the manual axes first), op rules issue their collectives over the
            auto axes as usual, ``fs.lax`` collectives over the manual axes apply to each
            block, and an output's layout is its out_spec's manual axes followed by the auto
            axes of the body's value (a plain tensor returned is replicated over them).
            Inside a body, ``shard_map`` (with the same ``mesh``) maps over the axes the outer
            one left automatic (default: all of them), its body seeing their blocks; naming an
            axis already manual is a ``ValueError``.

    Returns:
        A function of the same positional arguments returning :class:`ShardedArray` outputs
        with the ``out_specs`` layouts and exact global shapes.

    Gradients (DESIGN §4, as JAX with ``check_vma=True``): fshard tracks which mesh axes each
    local value varies over and inserts ``fs.lax.pcast`` where a replicated value meets a
    varying one, so a replicated input's gradient is summed exactly once (data parallel) and
    not at all when it only feeds replicated computation (``lambda w: w * 2`` with
    ``out_specs=P()``). **Pitfall (as in JAX):** ``torch.func.grad`` taken *inside* the body
    with respect to a replicated input already returns the reduced gradient (the pcast's
    backward summed it); do not ``fs.lax.psum`` it again, that counts it ``n`` times. Taking
    ``grad`` around the ``shard_map`` gives ShardedArray gradients with the inputs' layouts.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("dp",))
        >>> x = fs.shard(torch.ones(4, 3), mesh, P("dp"))  # a batch split over dp
        >>> w = fs.shard(torch.ones(3), mesh, P())  # replicated
        >>> def body(x, w):  # x: this rank's rows, w: the whole w
        ...     return fs.lax.psum((x @ w).pow(2).sum(), "dp")
        >>> loss = fs.shard_map(body, mesh, (P("dp"), P()), P())
        >>> float(fs.gather(loss(x, w)))
        36.0
        >>> g = torch.func.grad(lambda w: fs.gather(loss(x, w)))(w)  # summed over dp once
        >>> fs.gather(g)
        tensor([24., 24., 24.])

    Manual over ``pp`` only (a pipeline stage hands its block to the next; inside, ``h`` is a
    ShardedArray over ``tp``):

        >>> mesh2 = fs.Mesh.create((2, 1), ("pp", "tp"))
        >>> h = fs.shard(torch.arange(4.0).reshape(4, 1), mesh2, P("pp", "tp"))
        >>> def stage(h):
        ...     return fs.lax.ppermute(h * 10, "pp", [(0, 1), (1, 0)])
        >>> out = fs.shard_map(stage, mesh2, P("pp"), P("pp"), axis_names={"pp"})(h)
        >>> out.spec, fs.gather(out).flatten()
        (P('pp', 'tp'), tensor([20., 30.,  0., 10.]))
    """
    return _shard_map(
        f, mesh, in_specs, out_specs, check_replication, out_shapes, check_vma, axis_names, True
    )


def shard_map_checked_by_caller(
    f: Callable, mesh: Mesh, in_specs, out_specs, axis_names=None
) -> Callable:
    """:func:`shard_map` whose calls leave out the consistency check of their arguments (one
    exchange over the mesh a call): for a caller that compares :func:`call_signature` of them
    in a check it makes anyway (``fs.parallel.pipeline``: its plain inputs' values and the
    call's signature in one exchange a step, where there were two). Not public: a caller that
    checks nothing would let ranks that disagree reach the body's collectives.

    Example::

        mapped = shard_map_checked_by_caller(body, mesh, specs, P())
        consistency.check_equal({"call": call_signature(args, specs, P())}, mesh, what="f")
        out = mapped(*args)
    """
    return _shard_map(f, mesh, in_specs, out_specs, False, None, True, axis_names, False)


def _shard_map(
    f, mesh, in_specs, out_specs, check_replication, out_shapes, check_vma, axis_names, check_args
) -> Callable:
    if not callable(f):
        raise TypeError(f"shard_map: f must be callable, got {type(f).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_map: mesh must be a fshard.Mesh, got {type(mesh).__name__}")
    if mesh.is_abstract:
        raise ValueError(f"shard_map: mesh {mesh!r} is abstract; use Mesh.create")
    if not isinstance(check_replication, bool):
        raise TypeError(f"shard_map: check_replication must be a bool, got {check_replication!r}")
    if not isinstance(check_vma, bool):
        raise TypeError(f"shard_map: check_vma must be a bool, got {check_vma!r}")

    names = _check_axis_names(axis_names, mesh)

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        if kwargs:
            raise TypeError(
                f"shard_map: pass inputs positionally (in_specs describes the positional "
                f"arguments); got keyword arguments {sorted(kwargs)}"
            )
        if not _compat.TRACES_TUPLE_HASH and torch.compiler.is_dynamo_compiling():
            raise NotImplementedError(
                "shard_map under torch.compile needs torch >= 2.13 (this torch's dynamo cannot "
                "hash the layouts a body's outputs get); without fullgraph=True dynamo runs the "
                "shard_map eagerly"
            )
        body = _body(mesh, names)
        if check_args and consistency.enabled():
            sig = call_signature(args, in_specs, out_specs)
            consistency.check_equal(sig, body.mesh, what="shard_map")
        local_args, marks = _inputs(args, in_specs, body)
        tracker = body.tracker()
        for local, axes in marks:
            tracker.tag(local, axes)
        with contextlib.ExitStack() as stack:
            if body.outer is not None:  # the inner body's tracker tracks the outer's axes too
                body.outer.paused += 1
                stack.callback(_resume, body.outer)
            if body.auto is not None:  # (a full-manual body enters nothing: under
                # torch.compile Dynamo does not trace entering a nullcontext through ExitStack)
                stack.enter_context(tracker.dispatch())
                stack.enter_context(lax.handling(_MANUAL_AXES))
            stack.enter_context(axis_env.enter(body.root, tracker))
            stack.enter_context(tracker)
            out = f(*local_args)
        return _outputs(out, out_specs, body, tracker, out_shapes, check_replication, check_vma)

    return mapped


class _ManualAxes(lax.Handler):
    """In a partial-manual body, a collective its tracker does not run (an op rule's or
    ``fs.reshard``'s, over auto axes) leaves the manual axes its input varies over."""

    recompute = True

    def process(self, b, x, done, proceed):
        out = proceed(b, x, done)
        t = axis_env.tracker()
        if t is not None and not t.paused and t.auto is not None:
            t.tag(out, t.vma(x))
        return out


_MANUAL_AXES = _ManualAxes()


def _resume(t: _Tracker) -> None:
    t.paused -= 1


def _check_axis_names(axis_names, mesh: Mesh) -> frozenset | None:
    if axis_names is None:
        return None
    if isinstance(axis_names, str) or not isinstance(axis_names, (set, frozenset, tuple, list)):
        raise TypeError(
            f"shard_map: axis_names must be a set of mesh axis names (e.g. {{'pp'}}), got "
            f"{type(axis_names).__name__} {axis_names!r}"
        )
    names = frozenset(axis_names)
    unknown = sorted(a for a in names if a not in mesh.axis_names)
    if unknown or not names:
        raise ValueError(
            f"shard_map: axis_names={set(sorted(names))} must be a non-empty subset of the mesh "
            f"axes {mesh.axis_names}" + (f"; {unknown[0]!r} is not one" if unknown else "")
        )
    return names


def _body(mesh: Mesh, names: frozenset | None) -> _Body:
    """The axes of a call: at top level over ``mesh``; inside a body over the axes it left
    automatic (JAX: the manual axes accumulate; ``axis_names`` defaults to all the rest)."""
    outer = axis_env.tracker() if axis_env.in_body() else None
    if outer is None:
        return _Body(mesh, mesh, names if names is not None else frozenset(mesh.axis_names), None)
    if outer.auto is None:
        raise ValueError(
            "shard_map inside a shard_map body over every axis of its mesh: no axis is left "
            "to map over. Give the outer shard_map axis_names={...} (the axes it maps over) "
            "so the inner one can map over the others"
        )
    if mesh != outer.mesh and mesh != outer.auto:
        raise ValueError(
            f"shard_map: mesh {mesh!r} is not the enclosing shard_map's mesh {outer.mesh!r}; "
            "an inner shard_map maps over the same mesh (or the body's auto mesh)"
        )
    inner = outer.auto
    if names is None:
        names = frozenset(inner.axis_names)
    elif taken := sorted(names & outer.manual):
        raise ValueError(
            f"shard_map: axis_names={set(sorted(names))} names {taken[0]!r}, which the "
            f"enclosing shard_map already made manual; the axes left are {inner.axis_names}"
        )
    return _Body(inner, outer.mesh, names, outer)
