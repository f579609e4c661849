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

import functools
from collections.abc import Callable, Sequence

import optree
import torch
from torch.overrides import TorchFunctionMode

from . import _comm, axis_env, consistency
from ._leaf_errors import LeafErrors, paths
from .api import shard
from .array import ShardedArray, is_sharded
from .collectives import Bound, Pcast, Unvary
from .executor import claimed_local
from .lax import apply
from .mesh import Mesh
from .spec import Layout, P, chunk_bounds

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

    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        self.paused = 0

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

    def collective(self, xs: list, axes: tuple[str, ...], run: Callable, varies: bool) -> list:
        """Run a collective on ``xs`` (pcast first where invariant) and mark its results."""
        vmas = [self.vma(x) for x in xs]
        xs = [self.pcast(x, axes) for x in xs]
        self.paused += 1
        try:
            ys = run(xs)
        finally:
            self.paused -= 1
        axes_set = frozenset(axes)
        for y, v in zip(ys, vmas):
            self.tag(y, (v | axes_set) if varies else (v - axes_set))
        return ys

    # -- the mode -------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.grad and not self.paused:
            return self._grad(func, args, kwargs)
        if self.paused or func in _PASSTHROUGH:
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


def _spec_axes_problem(spec: P, mesh: Mesh) -> str | None:
    unknown = [a for a in spec.axes if a not in mesh.axis_names]
    if unknown:
        return (
            f"spec {spec} names axis {unknown[0]!r}, which is not an axis of the mesh; the mesh "
            f"axes are {mesh.axis_names}"
        )
    return None


# -- the input boundary ---------------------------------------------------------------------


def _input_problem(x, spec: P | None, mesh: Mesh) -> str | None:
    if spec is None or not isinstance(x, ShardedArray):
        return None
    if x.mesh != mesh:
        return f"lives on {x.mesh!r}, not on the shard_map mesh {mesh!r}"
    if x.layout.spec != spec:
        return (
            f"has layout {x.layout.spec} but in_specs gives {spec}; shard_map never reshards "
            f"implicitly: call fs.reshard(x, {spec}) first"
        )
    return None


def _local_input(x, spec: P | None, mesh: Mesh):
    if spec is None:
        return x
    if isinstance(x, ShardedArray):
        return claimed_local(x)
    if isinstance(x, torch.Tensor):
        return shard(x, mesh, spec).local
    return x


def _inputs(args: tuple, in_specs, mesh: Mesh) -> tuple[tuple, list]:
    """Local inputs and, per tensor leaf, (local, varying axes) to mark once the body starts."""
    if isinstance(in_specs, list):
        in_specs = tuple(in_specs)
    if _is_spec(in_specs):
        in_specs = (in_specs,) * len(args)
    specs, subtrees, treedef = _spec_leaves(in_specs, args, "in_specs")
    inputs = list(_subtrees(specs, subtrees, treedef, "args"))
    errors = LeafErrors("shard_map: inputs that do not fit their in_specs")
    for spec, where, leaves, _ in inputs:  # every input checked before any communication
        if spec is not None and (problem := _spec_axes_problem(spec, mesh)):
            errors.add(where, problem)
            continue
        for w, leaf in leaves:
            if problem := _input_problem(leaf, spec, mesh):
                errors.add(w, problem)
    errors.raise_if_any()
    marks: list = []
    seen: dict = {}
    new = []
    for spec, _, leaves, sub_def in inputs:
        locals_ = []
        for _, leaf in leaves:
            local = _local_input(leaf, spec, mesh)
            if spec is not None and isinstance(local, torch.Tensor):
                axes = frozenset(spec.axes)
                if seen.setdefault(id(local), axes) != axes:  # one object, two specs
                    local = local.view_as(local)
                marks.append((local, axes))
            locals_.append(local)
        new.append(optree.tree_unflatten(sub_def, locals_))
    return treedef.unflatten(new), marks


# -- the output boundary --------------------------------------------------------------------


def _outputs(out, out_specs, mesh: Mesh, tracker: _Tracker, out_shapes, check: bool, vma: bool):
    if isinstance(out_specs, list):
        out_specs = tuple(out_specs)
    specs, subtrees, treedef = _spec_leaves(out_specs, out, "out_specs")
    flat = []  # (where, local tensor, spec)
    subdefs = []
    errors = LeafErrors("shard_map: outputs that do not fit their out_specs")
    for spec, where, leaves, sub_def in _subtrees(specs, subtrees, treedef, "output"):
        subdefs.append((sub_def, len(leaves)))
        if spec is None:
            errors.add(where, "its out_specs entry is None; give a fshard.P", TypeError)
            continue
        if problem := _spec_axes_problem(spec, mesh):
            errors.add(where, problem)
            continue
        for w, leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, ShardedArray):
                errors.add(
                    w,
                    f"the body returned {type(leaf).__name__}; it must return local "
                    "torch.Tensors (the body works on local blocks)",
                    TypeError,
                )
            elif leaf.dim() < len(spec):
                errors.add(
                    w, f"has {leaf.dim()} dims but its out_spec {spec} has {len(spec)} entries"
                )
            elif vma and (problem := _variance_problem(spec, mesh, tracker.vma(leaf))):
                errors.add(w, problem)
            flat.append((w, leaf, spec))
    errors.raise_if_any()
    if check:
        for w, local, spec in flat:
            _check_replicated(w, local, spec, mesh)
    shapes = _global_shapes(flat, mesh, out_shapes, out, treedef)
    results = []
    for (_w, local, spec), shape in zip(flat, shapes):
        local = _cast_out(local, spec, mesh, tracker.vma(local))
        layout = Layout(mesh, spec, shape, local.dtype)
        results.append(ShardedArray._raw(local, layout))
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


def _check_replicated(where: str, local: torch.Tensor, spec: P, mesh: Mesh) -> None:
    """Raise unless ``local`` is equal on every rank of each axis ``spec`` leaves replicated."""
    t = _plain(local)
    for a in mesh.axis_names:
        if a in spec.axes or mesh.size(a) == 1:
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


def _global_shapes(flat: list, mesh: Mesh, out_shapes, out, treedef) -> list:
    if out_shapes is not None:
        return _given_shapes(flat, mesh, out_shapes, out)
    if not any(any(spec.dims) for _, _, spec in flat):
        return [tuple(local.shape) for _, local, _ in flat]
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
    for (w, local, spec), shape in zip(flat, shapes):
        want = Layout(mesh, spec, shape, local.dtype).local_shape(mesh.rank)
        if tuple(local.shape) != want:
            errors.add(
                w,
                f"has local shape {tuple(local.shape)} but out_shapes gives global shape "
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
    mine = [s for _, local, _ in flat for s in local.shape]
    g = mesh.group(mesh.axis_names)
    rows = _comm.size_exchange(mine, g, mesh.device())
    table = {g.ranks[j]: rows[j] for j in range(g.size)}
    shapes, k = [], 0
    for w, local, spec in flat:
        nd = local.dim()
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


def _signature(args: tuple, in_specs, out_specs) -> dict:
    """What every rank must agree on when calling a shard_map (consistency mode)."""

    def describe(v):
        if isinstance(v, ShardedArray):
            return ("ShardedArray", v.layout.spec, v.layout.shape, v.layout.dtype)
        if isinstance(v, torch.Tensor):
            return ("Tensor", tuple(v.shape), v.dtype)
        return type(v).__name__

    leaves = optree.tree_leaves(args, is_leaf=is_sharded, none_is_leaf=True)
    return {
        "in_specs": repr(in_specs),
        "out_specs": repr(out_specs),
        "inputs": tuple(describe(v) for v in leaves),
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
    """
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

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        if kwargs:
            raise TypeError(
                f"shard_map: pass inputs positionally (in_specs describes the positional "
                f"arguments); got keyword arguments {sorted(kwargs)}"
            )
        if axis_env.in_body():
            raise NotImplementedError("shard_map: nesting shard_map bodies is not supported")
        if consistency.enabled():
            consistency.check_equal(_signature(args, in_specs, out_specs), mesh, what="shard_map")
        local_args, marks = _inputs(args, in_specs, mesh)
        tracker = _Tracker(mesh)
        for local, axes in marks:
            tracker.tag(local, axes)
        with axis_env.enter(mesh, tracker), tracker:
            out = f(*local_args)
        return _outputs(out, out_specs, mesh, tracker, out_shapes, check_replication, check_vma)

    return mapped
