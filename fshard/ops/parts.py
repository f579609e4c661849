"""Op rules for per-part layouts (:class:`~fshard.spec.PartsLayout`): a fused projection's
``[q | k | v]`` or ``[gate | up]`` with each part split on its own.

Two kinds of op take such a value as it is:

* **Aligned ops** treat the parts dim element by element: pointwise ops, casts, ``F.linear`` /
  ``matmul`` / ``addmm`` (the parts on the weight's out-features, or on a contracted dim both
  operands split alike), reshapes that keep the parts dim and the dims after it, permutations
  (``.T``, ``transpose``, ``permute``: the parts dim moves, still per part). If every
  operand that spans the parts dim holds the *same* parts, the local blocks line up element by
  element, exactly as the blocks of one contiguous split would; so the op's own rule decides
  with each per-part layout replaced by its ``base`` (the same :class:`P`, one part), and the
  result is laid out per part wherever the parts dim lands. An operand that spans the dim
  without parts (a bias) is resharded to the same parts (``slice_parts``, local).
* **Cuts at part boundaries** (``split``, ``chunk``, ``narrow``, ``x[..., a:b]``): each piece
  is some whole parts, so it is this rank's chunks of them, cut locally: one part gives a
  plain ``P`` split, several a :class:`~fshard.spec.Parts` of those.
* **Selections of the other dims** (``x[i]``, ``x[..., j]``, ``x[None]``: ints, ``None`` and
  ``...``, the parts dim a full slice; a pipeline's stacked param's layer ``w[i]``): aligned,
  the parts dim kept whole where it lands.

Anything else (a cut inside a part, an op that reads positions along the dim) is refused here,
and the dispatcher gathers the parts dim first (one all_gather, ``gather_parts`` in the plan).

Example:
    >>> qkv = F.linear(x, w_qkv)  # w_qkv Parts(P("tp", None), 0, (q, k, v)): local  # doctest: +SKIP
    >>> q, k, v = qkv.split((q, k, v), -1)  # each P(..., "tp"): local, no communication  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import optree
import torch

from ..collectives import norm_dim
from ..spec import BaseLayout, Parts, PartsLayout, _layout
from .binding import bind
from .registry import (
    SHAPE_ONLY,
    ExplicitRefused,
    OpSharding,
    _tensor_names,
    is_layout,
    tensor_inputs,
)

__all__ = [
    "aligned",
    "cuts",
    "pointwise_groups",
    "linear_groups",
    "reshape_groups",
    "split_ranges",
    "narrow_range",
    "getitem_range",
    "getitem_groups",
]

#: ``(("in", i) | ("out", k), dim)``: dim ``dim`` of tensor input ``i`` or of output ``k``
Member = tuple[tuple[str, int], int]


def _refuse(op, ins, why: str) -> ExplicitRefused:
    shown = ", ".join(f"{tuple(v.shape)} {v.spec}" for v in ins)
    name = getattr(op, "__name__", str(op))
    return ExplicitRefused(
        f"{name}: {why} (inputs: {shown}); the per-part dim is gathered first (gather_parts)"
    )


def _has_parts(ins) -> bool:
    return any(type(x) is PartsLayout for x in ins)


def aligned(rule: Callable, groups: Callable, local_of: Callable | None = None) -> Callable:
    """``rule`` taking per-part inputs of an aligned op. ``groups(op, args, kwargs, ins, outs)``
    lists the op's dim correspondences: each group a list of :data:`Member` that the op lines up
    element by element (an output dim and the input dims it comes from, or two contracted
    dims). ``local_of(out)``: the local function for the per-part output ``out``, for a rule
    whose own local function bakes in its output's local shape (a reshape: per part, the local
    sizes of an uneven split differ from the base's)."""

    @functools.wraps(rule)
    def parts_rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        if not _has_parts(ins):
            return rule(op, args, kwargs)
        base = lambda v: v.base if type(v) is PartsLayout else v  # noqa: E731
        targs, tkwargs = optree.tree_map(base, (args, kwargs), is_leaf=is_layout, none_is_leaf=True)
        sharding = rule(op, targs, tkwargs)
        if isinstance(sharding.in_specs, Mapping):  # by parameter name -> by position
            names = _tensor_names(op, args, kwargs)
            sharding = dataclasses.replace(
                sharding, in_specs=[sharding.in_specs.get(n) for n in names]
            )
        sharding = _per_part(op, sharding, ins, groups(op, args, kwargs, ins, sharding.out))
        if local_of is not None and not sharding.out.mesh.is_abstract:
            sharding = dataclasses.replace(sharding, local=local_of(sharding.out))
        return sharding

    parts_rule.parts_layouts = True
    return parts_rule


def _per_part(op, sharding: OpSharding, ins, groups) -> OpSharding:
    specs = list(sharding.in_specs)
    single = isinstance(sharding.out, BaseLayout)
    outs = [sharding.out] if single else list(sharding.out or ())
    for i, x in enumerate(ins):
        if type(x) is not PartsLayout:
            continue
        group = next((g for g in groups if (("in", i), x.dim) in g), None)
        if group is None:
            raise _refuse(op, ins, "the op reads positions along the per-part dim")
        total = x.shape[x.dim]
        for (kind, j), d in group:
            if kind == "in":
                y, s = ins[j], specs[j]
                if s is SHAPE_ONLY or y.shape[d] != total:
                    continue  # read for its shape, or broadcast along the dim
                if type(y) is PartsLayout and (y.dim, y.sizes, y.axes) != (d, x.sizes, x.axes):
                    raise _refuse(op, ins, "two operands hold different parts")
                lay = (y.base if type(y) is PartsLayout else y) if s is None else y.with_spec(s)
                lay = lay.base if type(lay) is PartsLayout else lay
                if lay.dim_axes[d] != x.axes:
                    raise _refuse(op, ins, "the op would split the per-part dim otherwise")
                want = Parts(lay.spec, d, x.sizes)
                specs[j] = None if y.spec == want else want
            else:
                o = outs[j]
                if type(o) is PartsLayout or o.shape[d] != total:
                    continue  # already per part, or the dim reduced to size 1 (keepdim)
                if o.dim_axes[d] != x.axes:
                    raise _refuse(op, ins, "the output would not keep the per-part split")
                outs[j] = o.with_spec(Parts(o.spec, d, x.sizes))
    out = outs[0] if single else type(sharding.out)(outs) if sharding.out is not None else None
    return OpSharding(specs, out, sharding.local, sharding.tensors_only, sharding.by_name)


def pointwise_groups(op, args, kwargs, ins, outs) -> list[list[Member]]:
    """Broadcasting: every output dim with the input dims aligned to it from the right."""
    outs = [outs] if isinstance(outs, BaseLayout) else list(outs or ())
    nd = max([o.ndim for o in outs] + [x.ndim for x in ins])
    groups = []
    for o in range(nd):
        g = [(("out", k), o - nd + y.ndim) for k, y in enumerate(outs) if o - nd + y.ndim >= 0]
        g += [(("in", i), o - nd + x.ndim) for i, x in enumerate(ins) if o - nd + x.ndim >= 0]
        groups.append(g)
    return groups


def linear_groups(op, args, kwargs, ins, outs) -> list[list[Member]]:
    """``F.linear(x, w, b)``, ``addmm(b, x, w)``, ``matmul``/``mm``/``@`` with a 2-D right
    operand: the out-features (the weight's and the bias's with the output's last dim), the
    contracted dim, and the left operand's leading dims with the output's."""
    if not isinstance(outs, BaseLayout):
        return []
    bound = bind(op, args, kwargs)
    names = {"linear": ("input", "weight", "bias", True), "addmm": ("mat1", "mat2", "input", False)}
    name = getattr(op, "__name__", "")
    x_name, w_name, b_name, transposed = names.get(name, (None, None, None, False))
    if x_name is None:  # matmul / mm / __matmul__: the two tensor inputs (__rmatmul__: swapped)
        x, w, b = (1, 0, None) if op is torch.Tensor.__rmatmul__ else (0, 1, None)
        if len(ins) != 2 or ins[w].ndim != 2 or ins[x].ndim < 2:
            return []
    else:
        index = {id(v): i for i, v in enumerate(ins)}
        x, w = index.get(id(bound.get(x_name))), index.get(id(bound.get(w_name)))
        b = index.get(id(bound.get(b_name))) if isinstance(bound.get(b_name), BaseLayout) else None
        if x is None or w is None or x == w:
            return []
    out_f, in_f = (0, 1) if transposed else (1, 0)
    nd, nx = outs.ndim, ins[x].ndim
    groups = [[(("in", x), nx - 1), (("in", w), in_f)]]  # the contracted dim
    for o in range(nd):  # the output's dims: x's leading ones, then the weight's out-features
        g = [(("out", 0), o), (("in", w), out_f) if o == nd - 1 else (("in", x), o)]
        if b is not None and o - nd + ins[b].ndim >= 0:  # the bias broadcasts from the right
            g.append((("in", b), o - nd + ins[b].ndim))
        groups.append(g)
    return groups


def reshape_groups(op, args, kwargs, ins, outs) -> list[list[Member]]:
    """A reshape keeps the dims of the longest common trailing run of its input and output
    shapes (a dim there has every dim after it unchanged, so its elements keep their order)."""
    if not isinstance(outs, BaseLayout) or not ins:
        return []
    x, groups = ins[0], []
    for k in range(1, min(x.ndim, outs.ndim) + 1):
        if x.shape[x.ndim - k :] != outs.shape[outs.ndim - k :]:
            break
        groups.append([(("in", 0), x.ndim - k), (("out", 0), outs.ndim - k)])
    return groups


def getitem_groups(op, args, kwargs, ins, outs) -> list[list[Member]]:
    """``x[i, ..., :]``: basic indexing by ints, full slices, ``...`` and ``None``, which keeps
    every element of the dims it does not index (a stacked param's layer ``w[i]``): each
    input dim a full slice keeps, with the output dim it lands on."""
    if not isinstance(outs, BaseLayout) or len(ins) != 1:
        return []
    key = args[1] if len(args) > 1 else None
    key = key if isinstance(key, tuple) else (key,)

    def basic(k) -> bool:
        return k is Ellipsis or k is None or type(k) is int or (type(k) is slice and k == _ALL)

    if sum(k is Ellipsis for k in key) > 1 or not all(basic(k) for k in key):
        return []
    x = ins[0]
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > x.ndim:
        return []
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = key[:at] + (_ALL,) * (x.ndim - used) + key[at + 1 :]
    else:
        key = key + (_ALL,) * (x.ndim - used)
    groups, d, o = [], 0, 0
    for k in key:
        if k is None:
            o += 1
        elif type(k) is int:
            d += 1
        else:
            groups.append([(("in", 0), d), (("out", 0), o)])
            d, o = d + 1, o + 1
    return groups


_ALL = slice(None)


def cuts(rule: Callable, ranges: Callable) -> Callable:
    """``rule`` taking a per-part input cut along its parts dim at part boundaries.
    ``ranges(op, args, kwargs, x)`` gives ``(dim, [(start, stop), ...], single)``: the dim cut,
    the global range of each output along it, and whether the op returns one tensor; ``None``
    when the call is not such a cut (then a ``rule`` that takes per-part inputs itself, an
    :func:`aligned` one, decides)."""

    @functools.wraps(rule)
    def parts_rule(op, args, kwargs):
        ins = tensor_inputs(args, kwargs)
        if not _has_parts(ins):
            return rule(op, args, kwargs)
        x = ins[0]
        cut = ranges(op, args, kwargs, x) if type(x) is PartsLayout and len(ins) == 1 else None
        if cut is None and getattr(rule, "parts_layouts", False):
            return rule(op, args, kwargs)
        if cut is None or cut[0] != x.dim:
            raise _refuse(op, ins, "only cuts along the per-part dim at part boundaries are local")
        _, spans, single = cut
        bounds = [0]
        for n in x.sizes:
            bounds.append(bounds[-1] + n)
        picks = []
        for a, b in spans:
            if a not in bounds or b not in bounds or b < a:
                raise _refuse(op, ins, f"[{a}, {b}) is not a range of whole parts {x.sizes}")
            picks.append((bounds.index(a), bounds.index(b)))
        local = [n for _, n in x.part_chunks(x.mesh.rank)] if not x.mesh.is_abstract else None
        outs = [_piece(x, p, q) for p, q in picks]
        fn = functools.partial(_cut_local, dim=x.dim, local=local, picks=tuple(picks), one=single)
        return OpSharding([None], outs[0] if single else tuple(outs), fn, tensors_only=True)

    parts_rule.parts_layouts = True
    return parts_rule


def _piece(x: PartsLayout, p: int, q: int):
    """The layout of parts ``p..q-1`` of ``x``: a P split for one part, else Parts."""
    shape = list(x.shape)
    shape[x.dim] = sum(x.sizes[p:q])
    spec = x.base.spec if q - p <= 1 else Parts(x.base.spec, x.dim, x.sizes[p:q])
    return _layout(x.mesh, spec, tuple(shape), x.dtype)


def _cut_local(t: torch.Tensor, *, dim, local, picks, one):
    """This rank's pieces: its chunks of parts ``p..q-1`` for each ``(p, q)`` of ``picks``
    (``local``: the sizes of its chunk of each part). Under vmap ``t`` is per example, so
    ``dim`` is the layout's dim."""
    if local is None:
        raise ValueError("a per-part cut runs on a real mesh")
    starts = [sum(local[:i]) for i in range(len(local) + 1)]
    pieces = [t.narrow(dim, starts[p], starts[q] - starts[p]) for p, q in picks]
    return pieces[0] if one else tuple(pieces)


def _consecutive(sizes) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


def split_ranges(op, args, kwargs, x):
    """``split`` / ``chunk`` (torch's and the methods): consecutive ranges of ``dim``."""
    bound = bind(op, args, kwargs)
    dim = norm_dim(bound["dim"], x.ndim)
    n = x.shape[dim]
    if "chunks" in bound:
        c = -(-n // bound["chunks"]) if n else 0
        sizes = [min(c, n - a) for a in range(0, n, c)] if c else [0]
    else:
        s = bound.get("split_size_or_sections", bound.get("split_size"))
        if isinstance(s, int) and not isinstance(s, bool):
            sizes = [min(s, n - a) for a in range(0, n, s)] if s > 0 else [n]
        elif isinstance(s, (list, tuple)) and all(type(v) is int for v in s):
            sizes = list(s)
        else:
            return None
    return dim, _consecutive(sizes), False


def narrow_range(op, args, kwargs, x):
    bound = bind(op, args, kwargs)
    start, length = bound["start"], bound["length"]
    if type(start) is not int or type(length) is not int:
        return None
    dim = norm_dim(bound["dim"], x.ndim)
    start = start % x.shape[dim] if start < 0 else start
    return dim, [(start, start + length)], True


def getitem_range(op, args, kwargs, x):
    """``x[..., a:b]`` (every other index a full slice or ``...``)."""
    key = args[1] if len(args) > 1 else None
    key = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in key) > 1 or not all(
        k is Ellipsis or type(k) is slice for k in key
    ):
        return None
    if Ellipsis in key:
        at = key.index(Ellipsis)
        fill = (slice(None),) * (x.ndim - len(key) + 1)
        key = key[:at] + fill + key[at + 1 :]
    key = key + (slice(None),) * (x.ndim - len(key))
    if len(key) != x.ndim:
        return None
    cut = None
    for d, k in enumerate(key):
        if k == slice(None):
            continue
        if cut is not None or k.step not in (None, 1):
            return None
        start, stop, _ = k.indices(x.shape[d])
        cut = (d, [(start, max(start, stop))], True)
    return cut if cut is not None else (x.dim, [(0, x.shape[x.dim])], True)
