"""FSDP (ZeRO-3) by layouts: params and optimizer state sharded over a data-parallel axis.

The JAX way: a param (and so its gradient and optimizer moments) has a layout that also splits
it over ``'dp'`` (:func:`fsdp_plan` adds ``'dp'`` to dim 0 of any base plan, e.g. a Megatron
TP plan, so FSDP composes with TP on a 2-D mesh). Each layer's weights are all-gathered over
``'dp'`` just before use to a *varying* value, so the gradient is the transpose, a
``psum_scatter`` (reduce_scatter): never an all_reduce then a slice::

    per param of a unit          forward                         backward
    sharded over dp (dim 0)      all_gather(to="varying")        psum_scatter (reduce_scatter)
    left whole (0-d, unnested)   pcast over dp (no comm)         psum (all_reduce, bucketed
                                                                 under fs.value_and_grad)

A fused projection split per part over tp (:class:`~fshard.Parts`) on a dim other than 0
(GPT-2's ``c_attn`` weight, MoE experts' packed ``gate_up_proj``) is sharded on dim 0 like any
param: its block gathered along dim 0 is its per-part block under the base plan. One whose
parts are on dim 0 (Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` weights, ``c_attn``'s bias)
has each part split over tp and then dp (``Parts(P(("tp", "dp"), None), 0, (q, k, v))``): the
unit's all_gather gives each part's sub-chunks ``[q_0 | k_0 | v_0 | q_1 | k_1 | v_1]``, put back
in part order ``[q_r | k_r | v_r]`` by a local permutation (``_Session.arranged``; its backward,
the inverse, runs before the reduce_scatter), so the gathered value has the base plan's layout.

In a ``shard_map`` body (FSDP x CP, the global view) a param invariant over the body's manual
axes (``cp``) that meets varying data is pcast over them: that pcast is made on the param's
*block*, before the gather (the unit's varying gather is of its blocks pcast over the manual
axes, one reduce_scatter per unit), so its sum runs after the reduce_scatter, on ``1/dp`` of the
bytes, bucketed by :func:`fshard.value_and_grad`'s gradient sync (sums over other axes commute
with the gather's transpose). FSDP over the body's manual axes too (``axis=("dp_shard",
"cp")``, :func:`fshard.parallel.parallelize`'s FSDP x CP, torchtitan's ``dp_shard_cp``: the
params enter the body as they are, split over cp) gathers each unit over the whole group and
holds the body's pcast over ``cp`` pending until the op rule's over ``dp_shard``: the unit's
varying gather over both, one reduce_scatter that sums over ``cp`` too. A param split over a
prefix of the FSDP axes (an expert over ``("ep", "dp_shard")``: 4 do not split over ep x
dp_shard x cp) has a group of its own (``_Session.axes_of``): the unit packs it with the others
of that group, gathers and reduce-scatters it over ``dp_shard``, and pcasts its block over
``cp`` in its varying gather (the sum on the shard, bucketed, as HSDP's replicas).

:func:`fsdp_gather` gathers one *unit* (e.g. a transformer block: :func:`fsdp_units`) at a
time. Outside ``torch.func`` transforms (plain ``.backward()`` or :func:`fshard.value_and_grad`,
which differentiates at top level) it also does what FSDP2 does for memory and speed:

* the next unit's gather is launched asynchronously when a unit is gathered (prefetch);
* a gathered weight saved for the backward (``F.linear`` saves it) is not kept: a
  ``saved_tensors_hooks`` pack stores a token while its unit is in use, and the backward
  re-gathers the unit when it first needs it (prefetching the unit before it), keeping at most
  two units gathered at once; a model's root unit (``""`` of a module with layers: embedding,
  final norm, head) keeps what the backward reads of it from the forward, as FSDP2 applies no
  ``reshard_after_forward`` to its root (the backward's first use is the forward's last).

Under a ``torch.func`` transform (``fs.remat``'s recompute) a unit's blocks are packed as the
eager path packs them and gathered with one ``fs.lax.all_gather(..., to="varying")``, whose
backward is one reduce_scatter (same values, same collectives, no prefetch or freeing:
torch.func does not support saved-tensor hooks); in the global view (``fsdp_call`` on
ShardedArrays) the invariant gathers reuse that one gather's data (``done=``) and ``_Pcasts``
hands out its per-param results as the varying gathers (in a ``shard_map`` body, FSDP x CP,
of the blocks pcast over the body's manual axes). Both paths gather through ``fshard._comm`` (the asynchronous one with
``_comm.all_gather_start``): the same lowering, wire and consistency checks and comm-log records.

The data-parallel ``axis`` may be a tuple of mesh axes (``("dp", "fsdp")``): params are then
sharded over their product, the first most significant, like any ``P`` entry; any order works
(a reversed tuple's process group lists its ranks in another order: ``_comm`` puts the gathered
blocks back in chunk order).

Example (pure FSDP on a module; the loss is averaged over dp)::

    params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    def loss(ps, x, y):
        out = fs.nn.fsdp_call(model, ps, (x,), mesh=mesh)
        return fs.lax.pmean(F.mse_loss(out, y), "dp", mesh=mesh)
    value, grads = fs.value_and_grad(loss)(params, x_local, y_local)
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from .. import _comm, _compat, _swap, axis_env, lax
from .._leaf_errors import LeafErrors
from ..api import reshard
from ..array import ShardedArray
from ..collectives import AllGather, Bound, Pcast
from ..gradsync import GradSync
from ..mesh import Mesh
from ..module import _tied_specs, cast_inputs, cast_outputs, policy_of
from ..nn_plan import _split_plan
from ..planner import chunk_sizes
from ..precision import MixedPrecisionPolicy
from ..spec import Layout, P, Parts, nests, parts_arranged, parts_chunked, spec_of_dims
from ..tree import tree_leaves

__all__ = ["fsdp_plan", "fsdp_units", "fsdp_gather", "fsdp_call"]


def fsdp_plan(
    module: torch.nn.Module,
    mesh: Mesh,
    axis: str | Sequence[str] = "dp",
    base: Mapping[str, P | Parts] | None = None,
) -> dict[str, P | Parts]:
    """A :func:`fshard.nn.shard_params` plan that shards every param over ``axis`` too.

    Dim 0 of each param's base spec gets ``axis`` as its least significant axis (``None`` ->
    ``'dp'``, ``'tp'`` -> ``('tp', 'dp')``; a tuple of axes is appended as a whole), so
    all-gathering this rank's block over ``axis`` along dim 0 gives exactly its block under the
    base plan. Dim 0 need not split evenly over ``axis`` (FSDP2 shards every param too): the
    blocks are fshard's uneven chunks (``ceil(rows / n)`` rows, the last ranks fewer or none),
    padded to the largest for the unit's one all_gather and reduce_scatter, as FSDP2 pads.
    A param whose base plan already splits dim 0 must split evenly over the base axes and the
    FSDP axes together (else its blocks over ``axis`` would not nest in the base blocks): with
    a tuple of axes it is split over the longest prefix of them that does (4 experts split
    over ``ep`` = 2, FSDP over ``("dp_shard", "cp")`` of 2 x 2: ``P(("ep", "dp_shard"))``, as
    torchtitan shards experts over fewer FSDP ranks than the dense params); :func:`fsdp_call`
    gathers and reduce-scatters it over those axes (its own group, packed with the unit's
    params of that group) and sums its gradient over the others like HSDP's replicas. A fused
    projection split per part (:class:`~fshard.Parts`) on a dim other than 0 (GPT-2's Conv1D
    ``c_attn`` weight ``(in, 3 x out)``, transformers' packed experts ``gate_up_proj``
    ``(E, 2I, H)``) is split on dim 0 as its ``P``'s is, the parts dim keeping its per-part
    split (``Parts(P(None, 'tp'), 1, s)`` -> ``Parts(P('dp', 'tp'), 1, s)``; experts over
    ``ep``: ``Parts(P(('ep', 'dp_shard'), 'tp', None), 1, s)``), as FSDP2 shards it on dim 0
    (``_StridedShard`` keeping the tp parts): gathering dim 0 gives its block under the base.
    A :class:`~fshard.Parts` on dim 0 (Phi-3's fused ``qkv_proj`` and ``gate_up_proj``
    weights, ``c_attn``'s bias) has each part split over its base axes and then the longest
    prefix of the FSDP axes whose (ceil-div) chunks of every part nest in its base chunks
    (``Parts(P('tp', None), 0, s)`` -> ``Parts(P(('tp', 'dp'), None), 0, s)``, as FSDP2's
    ``_StridedShard`` over tp and ``Shard(0)`` over dp): :func:`fsdp_call` gathers it in its
    unit's all_gather and puts each part's sub-chunks back in part order. One that nests over
    none of the axes (parts of 6 rows over tp x dp = 2 x 2: tp chunks of 3, flat chunks of 2),
    or a 0-d one, keeps its base spec: it stays whole over ``axis`` and its gradient is
    all-reduced like DDP's (bucketed under :func:`fshard.value_and_grad`). The base may split
    dim 0 over FSDP axes other than the first (experts over
    ``ep`` with FSDP over ``("dp_shard", "ep")``, :func:`fshard.parallel.parallelize`'s
    FSDP x EP: the dense params split over both, as torchtitan's FSDP mesh holds its ep
    ranks): FSDP adds the longest prefix of the others that nests (``P(("ep",
    "dp_shard"))``), and :func:`fsdp_call` gathers over that prefix alone, the base's axes
    held.

    Args:
        module: the module.
        mesh: the mesh (sizes decide which params split evenly).
        axis: the data-parallel mesh axis, or a tuple of axes (sharded over their product).
        base: another plan to compose with, e.g. ``fs.nn.megatron_plan(...)`` on ``'tp'``.

    Returns:
        ``{param name: P or Parts}`` (exact names) for :func:`fshard.nn.shard_params`.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("dp",))  # 2 ranks
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        >>> fs.nn.fsdp_plan(model, mesh)  # 3 rows over 2 ranks: blocks of 2 and 1
        {'0.weight': P('dp', None), '0.bias': P('dp'), '2.weight': P('dp', None), '2.bias': P('dp')}
        >>> am = fs.Mesh.abstract((2, 2, 2), ("ep", "dp_shard", "cp"))  # a prefix of the axes:
        >>> fs.nn.fsdp_plan(torch.nn.Linear(4, 4), am, ("dp_shard", "cp"), base={"weight": fs.P("ep")})
        {'weight': P(('ep', 'dp_shard'), None), 'bias': P(('dp_shard', 'cp'))}
        >>> am = fs.Mesh.abstract((2, 2), ("dp_shard", "ep"))  # the base holds ep of the axes
        >>> fs.nn.fsdp_plan(torch.nn.Linear(4, 4), am, ("dp_shard", "ep"), base={"weight": fs.P("ep")})
        {'weight': P(('ep', 'dp_shard'), None), 'bias': P(('dp_shard', 'ep'))}
        >>> am = fs.Mesh.abstract((2, 2), ("dp", "tp"))  # [q | k | v] on dim 1, split per part
        >>> fs.nn.fsdp_plan(torch.nn.Linear(4, 6), am, base={"weight": fs.Parts(fs.P(None, "tp"), 1, (2, 2, 2))})
        {'weight': Parts(P('dp', 'tp'), dim=1, sizes=(2, 2, 2)), 'bias': P('dp')}
        >>> qkv = fs.Parts(fs.P("tp", None), 0, (8, 4, 4))  # [q | k | v] on dim 0, per part
        >>> fs.nn.fsdp_plan(torch.nn.Linear(4, 16, bias=False), am, base={"weight": qkv})
        {'weight': Parts(P(('tp', 'dp'), None), dim=0, sizes=(8, 4, 4))}
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fsdp_plan: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fsdp_plan: mesh must be a fshard.Mesh, got {type(mesh).__name__}")
    axes = _axes(axis, mesh, "fsdp_plan")
    named = dict(module.named_parameters())
    # a tied param (a head tied to the embedding) is named once, but the base plan may name
    # it by either name (transformers' plans name the head), as shard_params reads it
    specs = _tied_specs(module, _split_plan(base)[0])
    errors = LeafErrors(f"fsdp_plan: parameters the base plan already shards over {axis!r}")
    for name, spec in specs.items():
        if not set(axes) & set(spec.axes):
            continue
        # dim 0's base split may hold FSDP axes other than the first (experts over ep, FSDP
        # over ("dp_shard", "ep")), none after them: FSDP adds the others after them (its part
        # starts with the first axis: fsdp_call tells it from the base's); else refused
        # (a fused projection's parts on dim 0 hold no such split: FSDP nests its axes after
        # the parts' base axes, _nested_parts; on another dim, its dim 0
        # is the P's: experts over ep with their [gate | up] halves over tp)
        ndim = named[name].dim()
        first = () if _parts_on_dim0(spec, ndim) else _dim0(spec, ndim)
        held = [i for i, a in enumerate(first) if a in axes]
        if (
            axes[0] in spec.axes
            or set(axes) & set(spec.axes) - set(first)
            or any(a not in axes for a in first[held[0] :])
        ):
            errors.add(f"[{name!r}]", f"base spec {spec}")
    errors.raise_if_any(fix=f"FSDP adds {axis!r} itself: leave it out of the base plan")
    out = {}
    for name, p in named.items():
        spec = specs[name]
        if p.dim() == 0:
            out[name] = spec
            continue
        if _parts_on_dim0(spec, p.dim()):
            # each part split over the base axes and then FSDP's (the longest prefix whose
            # chunks nest in the base chunks of every part): gathering over them gives each
            # part's sub-chunks, put back in part order after the gather (_part_rows)
            dims = spec.spec.padded(p.dim())
            first = _nested_parts(dims[0], axes, spec.sizes, mesh)
            split = spec_of_dims([first, *dims[1:]], spec.partial) if first else None
            out[name] = spec if split is None else Parts(split, spec.dim, spec.sizes)
            continue
        # a Parts on another dim: its dim 0 is its P's, split as any P's (the parts dim
        # keeps its per-part split), so gathering dim 0 gives its base block
        inner = spec.spec if isinstance(spec, Parts) else spec
        dims = inner.padded(p.dim())
        rest = tuple(a for a in axes if a not in dims[0])  # those the base leaves
        first = _nested(dims[0], rest, p.shape[0], mesh)
        if first is None:
            out[name] = spec  # uneven under a base split of dim 0: the blocks would not nest
            continue
        split = spec_of_dims([first, *dims[1:]], inner.partial)
        out[name] = Parts(split, spec.dim, spec.sizes) if isinstance(spec, Parts) else split
    return out


def _parts_on_dim0(spec, ndim: int) -> bool:
    """Whether ``spec`` is a :class:`~fshard.Parts` whose parts dim is dim 0 of an ``ndim``-d
    param (Phi-3's fused ``qkv_proj`` weight, GPT-2's ``c_attn`` bias): FSDP splits each part
    (:func:`_nested_parts`), and gathering its blocks gives every part's sub-chunks, put
    back in part order (``_Session.arranged``)."""
    return isinstance(spec, Parts) and spec.dim % ndim == 0


def _nested_parts(base: tuple[str, ...], axes: tuple[str, ...], sizes, mesh: Mesh):
    """Dim 0's entry for a :class:`~fshard.Parts` on dim 0 whose parts of ``sizes`` are each
    split over ``base``: ``base`` and the longest prefix of the FSDP ``axes`` whose chunks of
    every part nest in its base chunks (:func:`~fshard.spec.nests`: uneven parts too, where
    the ceil-div chunks nest), ``None`` when none does (the param stays whole over them)."""
    outer = math.prod(mesh.size(a) for a in base)
    for n in range(len(axes), 0, -1):
        inner = math.prod(mesh.size(a) for a in axes[:n])
        if all(nests(s, outer, inner) for s in sizes):
            return (*base, *axes[:n])
    return None


def _dim0(spec, ndim: int) -> tuple[str, ...]:
    """Dim 0's axes of a param of ``spec`` (a ``P``, or a ``Parts`` on another dim: its P's)."""
    inner = spec.spec if isinstance(spec, Parts) else spec
    return inner.padded(ndim)[0]


def _nested(base: tuple[str, ...], axes: tuple[str, ...], rows: int, mesh: Mesh):
    """Dim 0's entry for a param of ``rows`` rows split over ``base`` by its base plan: ``base``
    and then the longest prefix of the FSDP ``axes`` whose blocks nest in the base blocks (the
    rows divide evenly over ``base`` and the prefix together; without a base split, all of
    ``axes``: uneven blocks are padded), ``None`` when no prefix nests (not even the first
    axis). E.g. 4 experts split over ``ep`` = 2 with ``axes`` ``("dp_shard", "cp")`` of 2 x 2:
    ``("ep", "dp_shard")`` (4 do not split over 8), as torchtitan shards its experts over
    fewer FSDP ranks than the dense params."""
    if not base:
        return axes
    for n in range(len(axes), 0, -1):
        first = (*base, *axes[:n])
        if rows % math.prod(mesh.size(a) for a in first) == 0:
            return first
    return None


def _fsdp_part(first: tuple[str, ...], axes: tuple[str, ...], where: str) -> tuple[str, ...]:
    """The FSDP axes dim 0's entry ``first`` splits a param over: its longest tail that is a
    prefix of the FSDP ``axes`` less those before it (what :func:`fsdp_plan` writes: the
    base plan's axes, then FSDP's; an expert split over ``ep`` by its base plan, FSDP over
    ``("dp_shard", "ep")``: ``("ep", "dp_shard")``, its FSDP part ``("dp_shard",)``, ep held
    by the base). An FSDP axis before another axis in ``first`` that is not FSDP's (a
    hand-written ``P(("dp", "tp"))`` with ``axis="dp"``) is refused: gathering it would not
    give the param's block."""
    for k in range(len(first), 0, -1):
        head, tail = first[: len(first) - k], first[len(first) - k :]
        if tail == tuple(a for a in axes if a not in head)[:k]:
            break
    else:
        k = 0
    head, tail = first[: len(first) - k], first[len(first) - k :]
    held = [i for i, a in enumerate(head) if a in axes]
    if held and any(a not in axes for a in head[held[0] :]):
        before = tuple(a for a in head if a in axes)
        after = tuple(a for a in head[held[0] :] if a not in axes)
        raise ValueError(
            f"{where} of dim 0 {first} splits dim 0 over the FSDP axes {before} before "
            f"{after}: gathering them would not give its block; put the FSDP axes last in "
            "dim 0 (fs.nn.fsdp_plan does)"
        )
    return tail


def _axes(axis, mesh: Mesh, where: str) -> tuple[str, ...]:
    """``axis`` (a mesh axis name or a non-empty tuple of distinct names) as a tuple."""
    axes = (axis,) if isinstance(axis, str) else axis
    if (
        not isinstance(axes, (tuple, list))
        or not axes
        or any(not isinstance(a, str) for a in axes)
        or len(set(axes)) != len(axes)
    ):
        raise TypeError(
            f"{where}: axis must be a mesh axis name or a tuple of distinct names, got {axis!r}"
        )
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{where}: axis {axis!r} is not a mesh axis; the mesh has {mesh.axis_names}"
        )
    return tuple(axes)


def _replicate_axes(replicate, axes: tuple[str, ...], mesh: Mesh, where: str) -> tuple:
    """HSDP's ``replicate`` axes (``None``: none) as a tuple, disjoint from the shard axes."""
    if replicate is None:
        return ()
    try:
        rep = _axes(replicate, mesh, where)
    except TypeError:
        raise TypeError(
            f"{where}: replicate must be a mesh axis name, a tuple of names or None, got "
            f"{replicate!r}"
        ) from None
    if set(rep) & set(axes):
        raise ValueError(
            f"{where}: replicate={replicate!r} and axis={axes!r} share "
            f"{sorted(set(rep) & set(axes))}; HSDP shards over axis and replicates over the "
            "other data-parallel axes"
        )
    return rep


def fsdp_units(module: torch.nn.Module) -> dict[str, list[str]]:
    """Default FSDP units: each element of every ``nn.ModuleList`` (e.g. ``"blocks.3"``), and
    the root unit ``""`` holding every other param (embeddings, final norm, head). A tied
    param (one tensor under several names) belongs to the deepest unit holding all its names,
    so it is gathered for every use (GPT-2's ``lm_head.weight`` = ``wte.weight``: the root).

    Args:
        module: the module.

    Returns:
        ``{unit name: [param names]}``, the root first, then module order.

    Example:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = torch.nn.Embedding(8, 4)
        ...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        >>> fs.nn.fsdp_units(Net())
        {'': ['emb.weight'], 'blocks.0': ['blocks.0.weight', 'blocks.0.bias'], 'blocks.1': ['blocks.1.weight', 'blocks.1.bias']}
    """
    prefixes = [
        f"{name}.{child}" if name else child
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.ModuleList)
        for child, _ in m.named_children()
    ]
    units: dict[str, list[str]] = {"": []}
    units.update({p: [] for p in prefixes})
    names: dict[int, list[str]] = {}  # every name of each tensor
    for pname, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(pname)
    for pname, p in module.named_parameters():
        inside = (u for u in prefixes if all(n.startswith(u + ".") for n in names[id(p)]))
        units[max(inside, key=len, default="")].append(pname)
    return units


class _Session:
    """One forward (and its backward) of an FSDP model: see :func:`fsdp_gather`."""

    def __init__(
        self, params, units, axis, mesh, prefetch, policy=None, replicate=None, typed=False,
        root=None,
    ):  # fmt: skip
        self.params, self.units, self.axis, self.mesh = params, units, axis, mesh
        # typed (the global view): get(unit) gives ShardedArrays in the base layouts, whose
        # locals are invariant gathers; _Pcasts turns their pcasts into the varying gather
        self.typed = typed
        self.pcasts = _Pcasts(self) if typed else None
        self.unit_of = {n: u for u, names in units.items() for n in names}
        self.vary: dict[str, torch.Tensor] = {}  # typed, eager: each param's varying gather
        self.whole: dict[str, torch.Tensor] = {}  # typed, in a shard_map body: its gathered data
        # typed, in a body: (name, axes) -> its invariant gather of its block pcast over axes
        # (_on_shard), (name, axes, "vary") -> the varying one
        self.over: dict[tuple, torch.Tensor] = {}
        self.policy = policy or MixedPrecisionPolicy()
        self.axes = _axes(axis, mesh, "fsdp_gather")
        self.replicate = _replicate_axes(replicate, self.axes, mesh, "fsdp_gather")
        # HSDP: the shard's gradient is all-reduced over the replicate axes after the
        # reduce_scatter (FSDP2's order: 1/n of the bytes), bucketed by fs.value_and_grad
        self.rep_group = mesh.group(self.replicate) if self.replicate else None
        self.order = list(units)
        self.prefetch = prefetch
        self.group = mesh.group(axis)
        # each param's FSDP axes (all of them, or a prefix: fsdp_plan's nesting rule) and
        # their group, gathered and reduce-scattered over it (axes_of, group_of)
        self.split: dict[str, tuple[str, ...]] = {}
        self.groups = {self.axes: self.group}
        # a 1-rank group has nothing to gather or free: the lax path (no hooks, no copy)
        # (a Function's forward under a torch.func transform, fs.remat's under torch.func.grad,
        # runs with the transforms peeled off but saved-tensor hooks still refused: not eager)
        self.eager = (
            not torch._C._are_functorch_transforms_active()
            and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and self.group.size > 1
        )
        self.launched: dict[str, dict] = {}  # unit -> {name: _comm.Pending} gathers in flight
        self.active: dict[int, tuple[str, str, torch.Tensor]] = {}  # storage -> (unit, name, full)
        self.seen: list[str] = []  # units in forward order
        self.cache: dict[str, dict] = {}  # backward: unit -> {name: full}
        # a pipeline's stage (eager, in its shard_map body): the step's gradient sync keeps
        # each param's gather for the step (FSDP2's reshard_after_forward=False under PP), so
        # a unit is gathered once per step, not twice per microbatch; kept: those params
        self.held = _active_sync("step") if self.eager and axis_env.in_body() else None
        self.kept: set[str] = set()
        # untyped, in a pipeline's stage: the uses of kept gathers, the step's stand-ins (read
        # as they are, not through a varying all_gather of the kept data each use)
        self.uses: dict[str, torch.Tensor] = {}
        # units whose gathered weights the backward reads as saved, not re-gathered: a model's
        # root unit (embedding, final norm, head; ``root``: whether the call's unit "" is one,
        # None: whether there are other units), as FSDP2 applies no reshard_after_forward to
        # its root (gathered from its forward to the backward, whose first use, the head's,
        # follows the forward's last); a layer called alone (fs.remat's, a pipeline stage's)
        # is gathered again
        root = len(units) > 1 if root is None else root
        self.keep = {""} if root and "" in units else set()

    def keeps_all(self) -> bool:
        """In a pipeline's stage: whether the step's gradient sync keeps every sharded param's
        gather for the step (each a leaf of it or a view of one), so that the saved-tensor
        hooks would save every gathered weight as it is (305 pack and 305 unpack calls a step
        on a stage of ``benchmarks/composed_step.py``'s FSDP x PP, each from C++ into
        Python)."""
        if self.held is None:
            return False
        return all(
            self.held.holds(self.params[n].local)
            for names in self.units.values()
            for n in names
            if self.sharded(n)
        )

    def sharded(self, name: str) -> bool:
        return bool(self.axes_of(name))

    def axes_of(self, n: str) -> tuple[str, ...]:
        """The FSDP axes param ``n``'s dim 0 is split over, in the FSDP axes' order: all of
        them, or some (a prefix, :func:`fsdp_plan`'s nesting rule: 4 experts split over
        ``("ep", "dp_shard")`` of FSDP over ``("dp_shard", "cp")``; a :class:`~fshard.Parts`
        on another dim: its ``P``'s dim 0; on dim 0: each part's, :meth:`part_rows`); ``()``:
        whole over them (a 0-d param, or one its plan leaves whole).
        A param split over some is gathered and reduce-scattered over those (:meth:`group_of`,
        packed with the unit's params of that group) and its block pcast over the others
        (:meth:`rest_of`) in its varying gather: its gradient's sum over them runs on the shard,
        as HSDP's over the replicate axes."""
        axes = self.split.get(n)
        if axes is None:
            spec, ndim = self.params[n].spec, len(self.params[n].shape)
            axes = (
                ()
                if ndim == 0
                else _fsdp_part(_dim0(spec, ndim), self.axes, f"fsdp_call: param {n!r}")
            )
            self.split[n] = axes
        return axes

    def rest_of(self, n: str) -> tuple[str, ...]:
        """The FSDP axes sharded param ``n`` is whole over (``()`` for most: see
        :meth:`axes_of`)."""
        axes, held = self.axes_of(n), self.params[n].spec.axes  # a base split (experts: ep)
        return tuple(a for a in self.axes if a not in axes and a not in held)

    def group_of(self, n: str):
        """Sharded param ``n``'s FSDP group: the ranks it is gathered over."""
        axes = self.axes_of(n)
        group = self.groups.get(axes)
        if group is None:
            group = self.groups[axes] = self.mesh.group(axes)
        return group

    def rows(self, n: str) -> tuple[int, ...] | None:
        """Sharded param ``n``'s rows in each chunk of its FSDP axes (group order), or
        ``None`` when they are equal."""
        parts = self.part_rows(n)
        if parts is not None:
            rows = tuple(sum(r) for r in parts)
            return None if len(set(rows)) == 1 else rows
        return _chunk_rows(self.params[n].layout, self.axes_of(n), self.group_of(n).size)

    def part_rows(self, n: str) -> tuple[tuple[int, ...], ...] | None:
        """A :class:`~fshard.Parts` param on dim 0 split over FSDP axes: the rows of each part
        in each chunk of its FSDP axes (group order); ``None`` for any other param."""
        layout = self.params[n].layout
        if not (self.axes_of(n) and _parts_on_dim0(layout.spec, len(layout.shape))):
            return None
        return _part_rows(layout, self.axes_of(n), self.group_of(n).ranks)

    def arranged(self, n: str, full: torch.Tensor) -> torch.Tensor:
        """Param ``n`` gathered over its FSDP axes (``full``: its blocks in chunk order along
        dim 0) as its base block: for a :class:`~fshard.Parts` on dim 0, whose chunk ``j``
        is ``[q_j | k_j | v_j]`` (each part's sub-chunk ``j`` of this rank's base chunk), the
        parts' sub-chunks put back in part order ``[q_0 q_1 | k_0 k_1 | v_0 v_1]`` (a local
        permutation: its backward the inverse, before the reduce_scatter); ``full`` itself
        for any other param."""
        parts = self.part_rows(n)
        return full if parts is None else parts_arranged(full, parts)

    def chunked(self, n: str, full: torch.Tensor | None) -> torch.Tensor | None:
        """The inverse of :meth:`arranged`: param ``n``'s base block as its blocks over its
        FSDP axes in chunk order (what the gather's data is)."""
        parts = None if full is None else self.part_rows(n)
        return full if parts is None else parts_chunked(full, parts)

    def _gather_op(self, n: str, invariant: bool = False) -> Bound:
        """Param ``n``'s all_gather over its FSDP axes (its uneven blocks' sizes)."""
        g = self.group_of(n)
        return Bound(AllGather(g.axes, 0, self.rows(n), invariant), g)

    def _launch(self, unit: str) -> None:
        """One all_gather per unit (and dtype), as FSDP2's: this rank's blocks of the unit's
        params packed back to back, gathered at once (an uneven param's block padded to its
        largest, so every rank's pack has one size)."""
        if unit in self.launched:
            return
        packs: dict = {}  # (gathered dtype, master dtype, device) -> [names, numel]
        lows = {}
        launched = []
        for n in self.units[unit]:
            if self.sharded(n):
                low = self._low(n).detach()
                group = self.group_of(n)
                if self.held is not None:  # gathered earlier in the step: no communication
                    if not self.typed:  # the use the gradient sync made of it already
                        use = self.held.kept_use(self.params[n].local, group, low.dtype)
                        if use is not None:
                            self.uses[n] = use = self.arranged(n, use)
                            launched.append(([n], None, _comm.Pending(use)))
                            continue
                    full = self.held.held_gather(self.params[n].local, group, low.dtype)
                    if full is not None:
                        launched.append(([n], None, _comm.Pending(full)))
                        continue
                lows[n] = low = _padded(low, self.rows(n))
                key = (group.axes, low.dtype, self.params[n].dtype, low.device)
                pack = packs.setdefault(key, [[], 0])
                pack[0].append(n)
                pack[1] += low.numel()
        for names, numel in packs.values():
            # packed in place, in this rank's block of the gather's output: no copy at launch
            group = self.group_of(names[0])
            out, flat = _comm.gather_buffer(numel, group, lows[names[0]])
            torch.cat([lows[n].reshape(-1) for n in names], out=flat)
            shapes = [tuple(lows[n].shape) for n in names]
            pending = _comm.all_gather_start(flat, group, 0, None, out=out)
            launched.append((names, shapes, pending))
        self.launched[unit] = launched

    def _wait(self, unit: str) -> list:
        """The unit's packs, gathered: ``[(names, shapes, flat)]``, ``flat`` every chunk's
        packed blocks in chunk order."""
        self._launch(unit)
        return [(ns, shapes, pending.wait()) for ns, shapes, pending in self.launched.pop(unit)]

    def _unpack(self, packs: list, flats: list | None = None) -> dict:
        """``{name: gathered param}`` out of ``packs`` (or of ``flats``, the packs' gathered
        buffers as other tensors: the differentiable varying gather): each param's blocks in
        chunk order along dim 0 (an uneven param's padding cut off), a copy with its own
        storage."""
        out = {}
        for (names, shapes, _), buf in zip(packs, flats or [p[2] for p in packs]):
            if shapes is None:  # one param, gathered as it is
                out[names[0]] = buf
                continue
            k = self.group_of(names[0]).size
            pieces = torch.split(buf.view(k, -1), [math.prod(s) for s in shapes], dim=1)
            for n, shape, piece in zip(names, shapes, pieces):
                out[n] = self.arranged(n, _unpadded(piece, k, shape, self.rows(n)))
        if self.held is not None and flats is None:  # kept for the step's other uses
            for n, full in out.items():
                # (a use of the step's stand-in: kept already)
                group = self.group_of(n)
                if n in self.uses or self.held.hold_gather(self.params[n].local, group, full):
                    self.kept.add(n)
        return out

    def _vary(self, packs: list, over: tuple[str, ...] = ()) -> dict:
        """The varying gathers of the packs' params, one differentiable all_gather per pack
        on the data gathered ahead (``done=``): its backward is ONE reduce_scatter of the
        pack's gradients (then, with HSDP, each shard's all_reduce over the replicate axes), in
        the policy's reduce dtype, cast to each param's. Under ``fs.value_and_grad(...,
        sync=False)`` one per param (the unreduced gradient sync takes each param's gather
        over, keeping the whole param's addend). ``over``: of the blocks pcast over those axes
        too (a body's manual axes, :meth:`_body_pack`; the caller checks it may pack)."""
        unreduced = _active_sync("unreduced") is not None
        # in a shard_map body one per param too: a pipeline's stages (this path: untyped, in a
        # body) run under its step-mode gradient sync, which takes each param's gather over and
        # reduce-scatters the params once per step, packed (the typed path in a body packs
        # its varying gathers of the blocks pcast over the body's manual axes: _body_pack)
        body = axis_env.in_body() and not over and not (self.typed and self._manual_fsdp())
        if unreduced or body or any(shapes is None for _, shapes, _ in packs):
            fulls = self._unpack(packs)
            uses = {n: self.uses.pop(n) for n in fulls if n in self.uses}
            return {n: uses[n] if n in uses else self._varying(n, full) for n, full in fulls.items()}  # fmt: skip
        flats = []
        for names, _, flat in packs:
            xs = [self.params[n].local for n in names]
            if not any(x.requires_grad for x in xs):
                flats.append(flat)
                continue
            reduce = self.policy.reduce_in(xs[0].dtype)
            # in a body over some of the FSDP axes (FSDP over dp_shard x cp, in the body over
            # cp) each block tagged as varying over them (_block): the gather's result varies
            # over cp, so the body's tracker does not pcast it (a second sum in the backward)
            xs = [self._block(n) for n in names]
            srcs = [self._replicated(x, reduce, over, n) for n, x in zip(names, xs)]
            if reduce == flat.dtype:
                ins, done = [self.policy.cast_param(t) for t in srcs], flat
            else:
                ins, done = [t.to(reduce) for t in srcs], flat.to(reduce)
            packed = torch.cat([_padded(t, self.rows(n)).reshape(-1) for n, t in zip(names, ins)])
            # an eager gather's op, for the backward: varying, its transpose a reduce_scatter
            group = self.group_of(names[0])
            gathered = Bound(AllGather(group.axes, 0, None), group)
            flats.append(lax.apply(gathered, packed, done=done).to(flat.dtype))
        return self._unpack(packs, flats)

    def gather(self, unit: str) -> dict[str, torch.Tensor]:
        if unit not in self.units:
            raise ValueError(f"fsdp_gather: unknown unit {unit!r}; the units are {self.order}")
        if not self.eager:
            if self.typed:
                return self._typed_unit(unit)
            return self._traced_unit(unit)
        packs = self._wait(unit)
        # The data is gathered per pack (_launch), in a shard_map body too. In the global view
        # in a body whose manual axes the FSDP axes leave out (FSDP over dp_shard x CP) the
        # differentiable varying gathers are of the blocks pcast over the body's manual axes,
        # one per pack (_body_pack: _Pcasts hands them out after the body's tracker has pcast
        # the param over those axes), or made per param where an op rule asks for one;
        # elsewhere (a body over some of the FSDP axes too: parallelize's FSDP over dp_shard x
        # cp, whose blocks enter the body over cp as they are) one per pack, made here.
        lazy = self.typed and axis_env.in_body() and not self._manual_fsdp()
        vary = {} if lazy else self._vary(packs)
        packed, over = self._body_pack(packs) if lazy else ({}, ())
        if packed:  # the data: the packed varying gathers' (one copy of the unit)
            fulls = {n: v.detach() for n, v in packed.items()}
        else:
            fulls = self._unpack(packs) if lazy else {}
        if self.prefetch:
            i = self.order.index(unit)
            if i + 1 < len(self.order):
                self._launch(self.order[i + 1])
        self.active = {k: v for k, v in self.active.items() if v[0] == ""}  # root stays
        self._next_unit()
        self.over.update({(n, over, "vary"): v for n, v in packed.items()})
        self.seen.append(unit)
        out = {}
        for n in self.units[unit]:
            if n in vary:
                y = vary[n]
                self.active[_compat.storage_id(y)] = (unit, n, y)
            if self.typed and lazy:
                y = self._typed(n, fulls.get(n))
                if n in fulls:
                    self.whole[n] = fulls[n]  # what _Pcasts' varying gather reads
                    self.active[_compat.storage_id(y.local)] = (unit, n, y.local)
            elif self.typed:  # the invariant gather on the same data; _Pcasts reads vary[n]
                y = self._typed(n, vary[n].detach() if n in vary else None)
                if n in vary:
                    self.vary[n] = vary[n]
                    self.active[_compat.storage_id(y.local)] = (unit, n, y.local)
            elif n not in vary:
                y = self._pcast(n)
            out[n] = y
        return out

    def _body_pack(self, packs: list) -> tuple[dict, tuple[str, ...]]:
        """In a ``shard_map`` body (the global view, eager): ``({name: varying gather}, axes)``,
        the unit's varying gathers of its blocks pcast over the body's other manual axes
        ``axes`` (FSDP x CP: ``cp``), one differentiable all_gather per pack on the gathered
        data (:meth:`_vary`), so that its backward is one reduce_scatter per pack (then the
        shards' sums over ``axes``, bucketed by the gradient sync), not one per param. The
        body's tracker pcasts a param over the manual axes its use varies over, then the op
        rule over the FSDP axes: ``_Pcasts`` hands out these where the first pcast was over
        exactly ``axes``, and makes a param's own otherwise (a use varying over fewer manual
        axes, or none: then this pack's gradient slot stays zero). ``({}, ())`` where it does
        not pack: no other manual axes, under ``fs.value_and_grad(..., sync=False)``, or the
        step's gradient sync holding gathers."""
        over = self._manual_axes()
        if not over or self.held is not None or any(shapes is None for _, shapes, _ in packs):
            return {}, ()
        return self._vary(packs, over), over

    def _manual_axes(self) -> tuple[str, ...]:
        """The body's manual axes other than the FSDP and replicate axes (mesh order, as the
        tracker's pcasts name them); ``()`` outside a body and under ``fs.value_and_grad(...,
        sync=False)`` (its gradient sync takes over each block's own varying gather)."""
        tracker = axis_env.tracker(self.mesh)
        if tracker is None or _active_sync("unreduced") is not None:
            return ()
        skip = set(self.axes + self.replicate)
        return tuple(a for a in self.mesh.axis_names if a in tracker.manual and a not in skip)

    def _manual_fsdp(self) -> tuple[str, ...]:
        """The FSDP axes the enclosing ``shard_map`` body maps over (manual), in the FSDP
        axes' order; ``()`` outside a body. ``parallelize``'s FSDP x CP (FSDP over
        ``("dp_shard", "cp")``, torchtitan's ``dp_shard_cp``; the model in a body over
        ``cp``): the params split over ``cp`` enter the body as they are (``in_specs`` ``None``),
        each unit is gathered over the whole group, and its varying gather (one per pack, its
        backward one reduce_scatter over ``dp_shard x cp``) is what ``_Pcasts`` hands out once
        the body's tracker (over ``cp``) and the op rule (over ``dp_shard``) have pcast the
        gathered param over both."""
        tracker = axis_env.tracker(self.mesh)
        if tracker is None:
            return ()
        return tuple(a for a in self.axes if a in tracker.manual)

    def base_layout(self, n: str):
        """Param ``n``'s layout with the FSDP axes gathered away (its base plan's). In a
        partial-manual ``shard_map`` body, of a param that entered it as it is (a mesh-wide
        value, split over FSDP axes the body maps over): the body's value of it, on the body's
        mesh of the automatic axes (what ``in_specs`` ``P()`` gives for a param whole over the
        manual axes)."""
        layout = self.params[n].layout
        spec = layout.spec
        inner = spec.spec if isinstance(spec, Parts) else spec  # a Parts' dim 0 is its P's
        dims = list(inner.padded(len(layout.shape)))
        dims[0] = dims[0][: len(dims[0]) - len(self.axes_of(n))]  # the FSDP part is its tail
        kept = spec_of_dims(dims, inner.partial)
        base = layout.with_spec(Parts(kept, spec.dim, spec.sizes) if spec is not inner else kept)
        tracker = axis_env.tracker(self.mesh)
        auto = tracker.auto if tracker is not None else None
        if auto is None or layout.mesh == auto:
            return base
        names = set(auto.axis_names)
        if any(a not in names for a in base.spec.axes):
            raise ValueError(
                f"fsdp_call: param {n!r} entered the shard_map body as it is, and its layout "
                f"{layout.spec} names manual axes {sorted(set(base.spec.axes) - names)} "
                f"besides the FSDP axes {self.axes}: give it in_specs naming them"
            )
        return Layout.of(auto, base.spec, base.shape, base.dtype)

    def _typed(self, n: str, full: torch.Tensor | None) -> ShardedArray:
        """The global view's value of param ``n`` for its unit: sharded over the FSDP axes,
        the invariant gather of its blocks (``full``: gathered already; ``None``: gathered now)
        in the base layout; a param left whole, itself (cast to ``param_dtype``)."""
        x = self.params[n]
        if not self.sharded(n):
            low = self.policy.cast_param(x)
            if low is not x:
                self.pcasts.casts[id(low.local)] = (low.local, x.local, x.dtype)
            return low
        if not x.local.requires_grad and full is not None:
            inv = full
        else:
            inv = self._invariant(n, x.local, full)
        self.pcasts.track(inv, n)
        return ShardedArray._raw(inv, self.base_layout(n).with_dtype(inv.dtype))

    def _invariant(self, n: str, src: torch.Tensor, full: torch.Tensor | None) -> torch.Tensor:
        """The invariant gather of param ``n`` from ``src`` (its block, or the block pcast over
        other axes: :meth:`_on_shard`), in ``param_dtype`` (``full``: the data gathered
        already; ``None``: gathered now); its backward keeps this rank's block of the
        cotangent, in the policy's reduce dtype."""
        invariant = self._gather_op(n, invariant=True)
        reduce = self.policy.reduce_in(src.dtype)
        low = self.policy.cast_param(src)
        full = self.chunked(n, full)
        if reduce == low.dtype:
            return self.arranged(n, lax.apply(invariant, low, done=full))
        done = None if full is None else full.to(reduce)
        y = lax.apply(invariant, src.to(reduce), done=done).to(low.dtype)
        return self.arranged(n, y)

    def on_shard(self, n: str) -> bool:
        """Whether a pcast of param ``n``'s gathered value over other axes (a ``shard_map``
        body's manual axes: FSDP x CP's ``cp``) can be made on its block instead
        (:meth:`_on_shard`): in a body, its gathered data at hand, a gradient wanted,
        and not under ``fs.value_and_grad(..., sync=False)`` (whose gradient sync takes over
        the varying gather of the block itself, not of a pcast of it)."""
        return (
            n in self.whole
            and self.params[n].local.requires_grad
            and _active_sync("unreduced") is None
        )

    def _on_shard(self, n: str, axes: tuple[str, ...], reduce=None) -> torch.Tensor:
        """Param ``n``'s invariant gather over the FSDP axes of its block pcast over ``axes``
        (on the gathered data, no communication): what the gathered value pcast over ``axes``
        is, with the pcast's sum in the backward on the block, after the gather's transpose
        (sums over other axes commute with it): ``1/n`` of the bytes, and a pcast of a leaf,
        which ``fs.value_and_grad``'s gradient sync buckets (FSDP x CP: each gradient's sum
        over cp was an all_reduce of the whole gathered gradient, per param)."""
        key = (n, axes)
        if key not in self.over:
            x = self.params[n].local
            src = self._pcast_block(x, axes, reduce)
            self.over[key] = self._invariant(n, src, self.whole[n])
        return self.over[key]

    def _low(self, n: str) -> torch.Tensor:
        """Param ``n``'s block in the policy's ``param_dtype``: what is gathered."""
        return self.policy.cast_param(self.params[n].local)

    def _replicated(
        self, x: torch.Tensor, reduce: torch.dtype | None, over: tuple[str, ...], n: str
    ) -> torch.Tensor:
        """HSDP: ``x`` (param ``n``'s shard) pcast over the replicate axes (and ``over``, and
        the FSDP axes ``n`` is whole over: :meth:`rest_of`), its gradient all-reduced over
        them in ``reduce`` (``None``: the policy's for ``x``); ``x`` itself without them."""
        rest = tuple(a for a in self.rest_of(n) if a not in over)
        return self._pcast_block(x, (*self.replicate, *over, *rest), reduce)

    def _pcast_block(
        self, x: torch.Tensor, axes: tuple[str, ...], reduce: torch.dtype | None = None
    ) -> torch.Tensor:
        """``x`` (a param's shard) pcast over ``axes``, its gradient summed over them in
        ``reduce`` (``None``: the policy's reduce dtype for ``x``); ``x`` without axes."""
        if not axes:
            return x
        reduce = reduce or self.policy.reduce_in(x.dtype)
        if reduce == x.dtype:
            return lax.pcast(x, axes, mesh=self.mesh)
        group = self.rep_group if axes == self.replicate else self.mesh.group(axes)
        return lax.apply(Bound(Pcast(group.axes, reduce), group), x)

    def _varying(self, n: str, full: torch.Tensor, over: tuple[str, ...] = ()) -> torch.Tensor:
        """The gathered ``full`` as the differentiable varying gather of param ``n`` alone
        (its backward reduce-scatters in the policy's reduce dtype, then casts); ``over``: of
        its block pcast over those axes too (:meth:`_on_shard`)."""
        x = self.params[n].local
        if not x.requires_grad:
            return full
        reduce = self.policy.reduce_in(x.dtype)
        src = self._replicated(x, reduce, over, n)
        op, done = self._gather_op(n), self.chunked(n, full)
        if reduce == full.dtype:
            return self.arranged(n, lax.apply(op, self.policy.cast_param(src), done=done))
        y = lax.apply(op, src.to(reduce), done=done.to(reduce)).to(full.dtype)
        return self.arranged(n, y)

    def _pcast(self, n: str) -> torch.Tensor:
        """Param ``n``, left whole over the axis: a pcast over the axis (and the replicate
        axes) whose backward all-reduces in the policy's reduce dtype, then the cast to
        ``param_dtype``."""
        x = self.params[n].local
        axes = self.replicate + self.rest_of(n)
        if not axes:
            return self.policy.cast_param(x)
        y = lax.pcast(x.to(self.policy.reduce_in(x.dtype)), axes, mesh=self.mesh)
        return self.policy.cast_param(y)

    def _next_unit(self) -> None:
        """Drop the gathered values of the units before the one now gathered (a unit's are used
        until the next is gathered); the root unit's stay for the call."""
        self.vary = {k: v for k, v in self.vary.items() if self.unit_of[k] == ""}
        self.whole = {k: v for k, v in self.whole.items() if self.unit_of[k] == ""}
        self.over = {k: v for k, v in self.over.items() if self.unit_of[k[0]] == ""}

    def _typed_unit(self, unit: str) -> dict[str, ShardedArray]:
        """The global view under a ``torch.func`` transform (``fs.remat``'s recompute): the
        unit's sharded params gathered as the eager path gathers them, one packed varying
        all_gather (:meth:`_traced_packs`; its backward one reduce_scatter) whose data the
        invariant gathers reuse (``done=``, no communication) and whose per-param results
        ``_Pcasts`` hands out where an op rule pcasts a param over the FSDP axes (was an
        invariant and a varying all_gather per param: 18 all_gathers and 9 reduce_scatters
        per decoder layer and recompute on a Llama). In a ``shard_map`` body (FSDP x CP) the
        packed varying gather is of the blocks pcast over the body's other manual axes (as
        :meth:`_body_pack`; without such axes the data gathered without a graph, :meth:`_data`,
        ``_Pcasts`` making each param's varying gather on it where an op rule asks)."""
        if axis_env.in_body() and not self._manual_fsdp():
            over = self._manual_axes()
            packed = self._traced_packs(unit, over) if over else {}
            fulls = {n: v.detach() for n, v in packed.items()} if over else self._data(unit)
            self._next_unit()
            self.whole.update(fulls)
            self.over.update({(n, over, "vary"): v for n, v in packed.items()})
            return {n: self._typed(n, fulls.get(n)) for n in self.units[unit]}
        vary = self._traced_packs(unit)
        self._next_unit()
        out = {}
        for n in self.units[unit]:
            if n in vary:
                self.vary[n] = vary[n]
                out[n] = self._typed(n, vary[n].detach())
            else:
                out[n] = self._typed(n, None)  # left whole: no gather
        return out

    def _data(self, unit: str) -> dict[str, torch.Tensor]:
        """Under a ``torch.func`` transform: the unit's sharded params gathered without a graph
        (``{name: gathered}``), one all_gather per pack (gathered dtype, param dtype) of their
        blocks in the policy's ``param_dtype`` (uneven ones padded), as :meth:`_launch` packs
        them."""
        packs: dict = {}  # (FSDP axes, gathered dtype, param dtype) -> [(name, padded block)]
        for n in self.units[unit]:
            if self.sharded(n):
                low = self._low(n).detach()
                key = (self.axes_of(n), low.dtype, self.params[n].dtype)
                packs.setdefault(key, []).append((n, low))
        out = {}
        for (axes, _, _), items in packs.items():
            k = self.group_of(items[0][0]).size
            blocks = [_padded(b, self.rows(n)) for n, b in items]
            flat = torch.cat([b.reshape(-1) for b in blocks])
            full = lax.all_gather(flat, axes, to="varying", mesh=self.mesh).view(k, -1)
            pieces = torch.split(full, [b.numel() for b in blocks], dim=1)
            for (n, _), b, piece in zip(items, blocks, pieces):
                out[n] = self.arranged(n, _unpadded(piece, k, b.shape, self.rows(n)))
        return out

    def _traced_unit(self, unit: str) -> dict[str, torch.Tensor]:
        """Under a ``torch.func`` transform (``fs.remat``'s recompute): the unit's sharded
        params' varying gathers (:meth:`_traced_packs`); a param left whole, its pcast."""
        out = self._traced_packs(unit)
        return {n: out[n] if n in out else self._pcast(n) for n in self.units[unit]}

    def _traced_packs(self, unit: str, over: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Under a ``torch.func`` transform: the unit's sharded params gathered as FSDP2
        gathers them, one differentiable varying all_gather per (gathered dtype, param dtype)
        pack of their blocks (uneven ones padded), whose backward is one reduce_scatter of the
        pack's gradients (was one all_gather and one reduce_scatter per param: 9 each per
        decoder layer and recompute on a Llama). ``{name: gathered}``, sharded params only;
        ``over``: of the blocks pcast over those axes too (a body's manual axes)."""
        out: dict[str, torch.Tensor] = {}
        packs: dict = {}  # (FSDP axes, gathered dtype, param_dtype) -> [(name, padded block)]
        for n in self.units[unit]:
            if not self.sharded(n):
                continue
            x = self._block(n)
            reduce = self.policy.reduce_in(x.dtype)
            src = self._replicated(x, reduce, over, n)
            low = self.policy.cast_param(src)
            # gathered in the reduce dtype where it differs (as _traced: under a transform an
            # edge carries its forward dtype's gradient), then cast to param_dtype
            t = low if reduce == low.dtype else src.to(reduce)
            key = (self.axes_of(n), t.dtype, low.dtype)
            packs.setdefault(key, []).append((n, _padded(t, self.rows(n))))
        for (axes, _, low_dtype), items in packs.items():
            k = self.group_of(items[0][0]).size
            flat = torch.cat([b.reshape(-1) for _, b in items])
            full = lax.all_gather(flat, axes, to="varying", mesh=self.mesh).view(k, -1)
            pieces = torch.split(full, [b.numel() for _, b in items], dim=1)
            for (n, b), piece in zip(items, pieces):
                y = self.arranged(n, _unpadded(piece, k, b.shape, self.rows(n)))
                out[n] = y if y.dtype == low_dtype else y.to(low_dtype)
        return out

    def _traced(self, n: str) -> torch.Tensor:
        if not self.sharded(n):
            return self._pcast(n)
        x = self._block(n)
        reduce = self.policy.reduce_in(x.dtype)
        src = self._replicated(x, reduce, (), n)
        low = self.policy.cast_param(src)
        rows, axes = self.rows(n), self.axes_of(n)
        if reduce == low.dtype:
            y = lax.all_gather(low, axes, sizes=rows, to="varying", mesh=self.mesh)
            return self.arranged(n, y)
        # Under a transform an edge carries its forward dtype's gradient, so a gather of
        # param_dtype values cannot reduce-scatter in another dtype: gather in the reduce dtype
        # (its bytes; the top-level path gathers param_dtype bytes) and cast after.
        y = lax.all_gather(src.to(reduce), axes, sizes=rows, to="varying", mesh=self.mesh)
        return self.arranged(n, y.to(low.dtype))

    def _block(self, n: str) -> torch.Tensor:
        """Param ``n``'s local block for a traced gather. In a ``shard_map`` body that tracks
        the FSDP axes (the experts' dispatch of ``fs.parallel.moe_experts``, manual over every
        axis, where ``_Pcasts`` makes a param's varying gather during ``fs.remat``'s
        recompute), a view tagged as varying over the axes its layout splits it over: the
        block is closed over, so the body's tracker read it as invariant and pcast it over
        the FSDP axes before the gather, a second sum over them in the backward (the
        gradient reduce-scattered, then all-reduced: twice the true value)."""
        x = self.params[n].local
        tracker = axis_env.tracker(self.mesh)
        if tracker is None or tracker.vma(x):
            return x
        axes = frozenset(self.params[n].spec.axes) & tracker.manual
        manual = set(self.axes_of(n)) & tracker.manual  # FSDP x CP's body over cp: cp alone
        if not manual or not manual <= axes:
            return x
        x = x.view_as(x)
        tracker.tag(x, axes)
        return x

    def end_forward(self) -> None:
        """Drop what only the forward reads: the gathered values and what ``_Pcasts`` tracked.
        The backward's nodes hold this session (their saved tensors' unpack hook), so a value
        with an autograd graph kept here would close a cycle through C++ nodes that Python's
        collector cannot see: the graph, its saved activations and the gathered params then
        stayed alive after the step, every step (issue 36 item 7: +28 MiB a step on the
        composed FSDP x TP Llama). The handler's link back to the session goes too: a cycle
        the collector frees only when it runs, holding the session's gathered units."""
        self.active, self.vary, self.whole, self.uses, self.over = {}, {}, {}, {}, {}
        if self.pcasts is not None:  # and the session <-> handler cycle (gc-only otherwise)
            self.pcasts.tracked, self.pcasts.casts, self.pcasts.session = {}, {}, None

    # -- saved-tensor hooks: a gathered weight is re-gathered in the backward, not kept --------

    def pack(self, t: torch.Tensor):
        # A tensor saved as it is is saved detached (autograd gives the unpacked data its
        # graph edge back): the tensor itself, when a node saves its own output, would hold
        # that node (its grad_fn), a cycle through C++ that Python's collector cannot see. A
        # node the backward never runs (the vocab-parallel cross entropy's max, detached) then
        # kept its inputs, the forward's graph with its activations and this session (the
        # unpack hook) with its last regathered unit alive, every step (issue 36 item 7: the
        # composed FSDP x TP Llama, +5.5 MiB a step, 1.56x torch's peak RSS in 5 steps).
        if not self.active:
            return t.detach()
        hit = self.active.get(_compat.storage_id(t))
        if hit is None or hit[2].dtype != t.dtype or hit[1] in self.kept or hit[0] in self.keep:
            return t.detach()  # a kept gather stays alive for the step anyway: saved as it is
        return (hit[0], hit[1], t.size(), t.stride(), t.storage_offset())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        unit, name, size, stride, offset = packed
        full = self._regather(unit)[name]
        return full.as_strided(size, stride, offset)

    def _regather(self, unit: str) -> dict:
        if unit not in self.cache:
            self.cache = {unit: self._unpack(self._wait(unit))}  # the unit before is freed
            # backward order: the root (its head runs first), then the units in reverse
            order = [""] + [u for u in dict.fromkeys(reversed(self.seen)) if u != ""]
            if self.prefetch and unit in order and order.index(unit) + 1 < len(order):
                self._launch(order[order.index(unit) + 1])
        return self.cache[unit]


def _replay_view(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """View ``x`` of its base, taken of ``y`` (what the base stands for: the same shape and
    values). torch replays a view on a new base only of the base's strides; ``y`` may have
    others (a param's rows in a packed gather, cast to ``param_dtype``: a mixed-precision
    expert weight's row of FSDP x EP), then the view is taken of a copy of ``y`` in the base's
    strides (differentiable: its cotangent goes to ``y``)."""
    out = x._view_func(y)
    if out is None:
        base = x._base
        same = torch.empty_strided(base.shape, base.stride(), dtype=y.dtype, device=y.device)
        out = x._view_func(same.copy_(y))
    if out is None:
        raise RuntimeError(
            f"FSDP: a view of a gathered param ({tuple(x.shape)} of {tuple(x._base.shape)}) "
            "cannot be taken of its varying gather"
        )
    return out


class _Pcasts(lax.Handler):
    """FSDP in the global view: where an op rule pcasts a gathered param over the FSDP axes
    (it met data split over them), the value becomes the *varying* gather of the param's
    blocks instead (same data, no new communication when the gather ran ahead), whose backward
    is a reduce_scatter (then, with HSDP, an all_reduce of the shard over the replicate axes);
    other axes of the pcast stay a pcast. A use that meets no such data keeps the invariant
    gather (backward: this rank's block of the cotangent, no communication), so every use is
    differentiated correctly. A param left whole (cast to ``param_dtype``) is pcast on its
    master in the policy's reduce dtype, as ``fs.nn.functional_call`` does.

    What is tracked: each gathered value, views of it, and the results of communication-free
    collectives applied to those (an op rule's ``zero`` step, R -> P, keeps the value on one
    rank and gives fresh zeros on the others: tracking its result keeps the decision, and so
    the collectives issued, the same on every rank). ``tracked[id(t)] = (ref, name, f)``: ``ref``
    a weak reference to ``t``, ``f`` maps the varying gather of param ``name`` to the value
    ``t`` stands for. Weak, so that a unit's gathered params are freed when its forward no
    longer uses them (FSDP2's reshard after forward): held here, every unit's stayed alive
    until the forward ended, the whole model gathered at the forward's peak (16 GiB a rank on
    the 70B dry run). A use after its unit's value was freed cannot reach it: a later use
    of the param gathers again through ``get``."""

    def __init__(self, session: _Session):
        self.session = session
        self.tracked: dict[int, tuple] = {}
        self.casts: dict[int, tuple] = {}  # id(cast local) -> (it, master local, master dtype)

    def track(self, t: torch.Tensor, name: str, f=None, over: tuple = ()) -> None:
        self.tracked[id(t)] = (weakref.ref(t), name, f, over)

    def _find(self, x: torch.Tensor):
        hit = self.tracked.get(id(x))
        if hit is not None and hit[0]() is x:
            return hit[1:]
        if x._base is not None:
            hit = self.tracked.get(id(x._base))
            if hit is not None and hit[0]() is x._base:
                f = hit[2]
                return hit[1], (lambda y: _replay_view(x, y if f is None else f(y))), hit[3]
        return None

    def process(self, b, x, done, proceed):
        s = self.session
        if type(b.op) is not Pcast:
            out = proceed(b, x, done)
            if b.op.local:  # no communication: the result stays tracked
                found = self._find(x)
                if found is not None:
                    name, f, over = found
                    self.track(out, name, lambda y: lax.apply(b, y if f is None else f(y)), over)
            return out
        cast = self.casts.get(id(x))
        if cast is not None and cast[0] is x:
            op = Pcast(b.op.axes, s.policy.reduce_in(cast[2]))
            return proceed(Bound(op, b.group), cast[1], None).to(x.dtype)
        found = self._find(x)
        if found is None:
            return proceed(b, x, done)
        name, f, over = found
        axes = set(b.op.axes)
        fsdp = set(s.axes_of(name))  # a param split over some of the FSDP axes: those
        # FSDP over axes a shard_map body maps over too (parallelize's FSDP over dp_shard x cp,
        # the model in a body over cp): the body's tracker pcasts the gathered param over cp
        # (the manual FSDP axes) when it meets the sequence's chunks; that pcast is held,
        # tracked as pending (``over``), so the op rule's later pcast over the rest (dp_shard,
        # the batch's rows) gives the varying gather over the whole group: one reduce_scatter
        # over dp_shard x cp, no sum over cp of its own. A use that meets no data split over
        # the rest keeps the pcast (its sum over cp, then the invariant gather's block).
        # A param split over some of the FSDP axes (experts over dp_shard of dp_shard x cp)
        # has its block pcast over the others (``rest``) in its varying gather: a pcast over
        # some of those (the body's tracker's over cp) is held pending the same way.
        rest = set(s.rest_of(name))
        hit = axes & fsdp
        pending = hit and not fsdp <= axes | set(over) and not axes & set(s.replicate)
        tracker = axis_env.tracker(s.mesh) if pending else None
        if (pending and tracker is not None and hit <= tracker.manual) or (axes and axes <= rest):
            out = proceed(b, x, x if done is None else done)
            self.track(out, name, f, (*over, *b.op.axes))
            return out
        if not fsdp <= axes | set(over):
            # A pcast over other axes first: a shard_map body's tracker making the gathered
            # param varying over its manual axes (FSDP x CP: over cp) before the op rule
            # pcasts it over the FSDP axes. Pcast's forward is a view (``view_as``): its result
            # and every view of it have the gathered value as ``_base``, so ``_find`` read a
            # view of it as the gathered param itself, and the varying gather standing for it
            # dropped this pcast's psum from the backward (FSDP x CP with packed gathers: a
            # Llama's gradients were the cp rank's own part, 0.92 off). So the result is made
            # on x's data as ``done`` (a tensor of its own, not a view; under a transform too)
            # and tracked as this pcast of what x stands for: a later pcast over the FSDP axes
            # gives the pcast of the varying
            # gather (its psum in the policy's reduce dtype, as every gradient reduction). A
            # pcast over some of the FSDP (or replicate) axes is not tracked: a later pcast of
            # it stays a pcast (the varying gather would sum over those axes twice).
            # In a body the sum moves onto the block (Session._on_shard): a later pcast
            # over the FSDP axes gives the varying gather of the block pcast over these axes
            # (and the replicate ones), its sum after the reduce_scatter, on 1/n of the bytes,
            # bucketed by the gradient sync (eager). This pcast's own result (a use that never
            # meets data split over the FSDP axes) is the invariant gather of the block pcast over
            # them; with HSDP a pcast of the gathered value instead (a stand-in over these
            # axes alone would be a second bucket, all-reduced with zeros when every use is
            # varying; this pcast's psum runs only for a use that reaches the loss).
            if not axes & set(s.axes_of(name) + s.replicate):
                if s.on_shard(name):
                    moved = (*over, *b.op.axes)
                    if s.replicate:
                        out = proceed(b, x, x if done is None else done)
                    else:
                        inv = s._on_shard(name, moved, b.op.reduce_dtype)
                        out = inv if f is None else f(inv)
                    self.track(out, name, f, moved)
                    return out
                out = proceed(b, x, x if done is None else done)
                reduce = b.op.reduce_dtype or s.policy.reduce_in(s.params[name].dtype)
                op = Bound(Pcast(b.op.axes, reduce), b.group)
                self.track(out, name, lambda y: lax.apply(op, y if f is None else f(y)), over)
                return out
            return proceed(b, x, x if done is None else done)
        if not rest <= axes | set(over):
            # The varying gather of a param split over some of the FSDP axes sums its
            # gradient over the others (its block pcast over them): a use that does not vary
            # over them keeps a pcast of the invariant gather (its gradient summed over the
            # pcast's axes, then this rank's block), on x's data as ``done`` (a tensor of its
            # own: a view would be found as the gathered param)
            return proceed(b, x, x if done is None else done)
        # FSDP's own and those the param is whole over: in the varying gather
        over = tuple(a for a in over if a not in fsdp and a not in rest)
        if over:  # the varying gather of the block pcast over ``over`` (Session._on_shard)
            key = (name, over, "vary")
            if key not in s.over and name not in s.whole:  # its unit's data is gone: a pcast
                return proceed(b, x, done)
            if key not in s.over:
                y = s.over[key] = s._varying(name, s.whole[name], over)
                if s.eager:  # for the saved-tensor hooks (none under a transform)
                    s.active[_compat.storage_id(y)] = (s.unit_of[name], name, y)
            y = s.over[key]
        elif name in s.vary:
            y = s.vary[name]  # the unit's varying gather, made with the invariant one
        elif name in s.whole:  # in a shard_map body: made here, per param, once for all its uses
            y = s.vary[name] = s._varying(name, s.whole[name])
            if s.eager:
                s.active[_compat.storage_id(y)] = (s.unit_of[name], name, y)
        else:
            y = s._traced(name)
        y = y if f is None else f(y)
        others = tuple(a for a in b.op.axes if a not in s.axes + s.replicate)
        if not others:
            return y
        g = s.mesh.group(others)
        return proceed(Bound(Pcast(others, b.op.reduce_dtype), g), y, None)


@contextlib.contextmanager
def fsdp_gather(
    params: Mapping[str, ShardedArray],
    units: Mapping[str, Sequence[str]],
    *,
    mesh: Mesh,
    axis: str | Sequence[str] = "dp",
    prefetch: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    replicate: str | Sequence[str] | None = None,
) -> Iterator[Callable[[str], dict[str, torch.Tensor]]]:
    """Gather FSDP units just before use; yields ``get(unit) -> {param name: local tensor}``.

    ``get`` returns each of the unit's params as this rank's block under the *base* plan
    (dp gathered away), varying over ``axis``. The block must span the forward of the loss
    (the saved-tensor hooks are installed for it); the backward may run after it.

    Args:
        params: ``{name: ShardedArray}`` sharded with :func:`fsdp_plan`.
        units: ``{unit name: [param names]}`` in forward order (:func:`fsdp_units`).
        mesh: the mesh.
        axis: the data-parallel mesh axis, or a tuple of axes (as in :func:`fsdp_plan`).
        prefetch: launch the next unit's gather (and in the backward the previous one's)
            asynchronously.
        mp_policy: a :class:`~fshard.nn.MixedPrecisionPolicy`: blocks are cast to its
            ``param_dtype`` before the all_gather (its bytes), gradients reduce-scattered in
            its ``reduce_dtype`` and returned in the params' own dtype.
        replicate: HSDP (FSDP2's 2-D mesh, torchtitan's ``dp_replicate``): data-parallel
            mesh axes the params are *replicated* over (not sharded): each shard's gradient
            is reduce-scattered over ``axis`` and then all-reduced over ``replicate`` (on the
            shard: ``1/n`` of the bytes; bucketed under :func:`fshard.value_and_grad`). The
            batch is split over both; average the loss over both.

    Yields:
        ``get(unit)``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("dp",))  # 2 ranks
        >>> model = torch.nn.Linear(4, 6)
        >>> params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
        >>> params["weight"].local.shape  # this rank's 3 of 6 rows
        torch.Size([3, 4])
        >>> with fs.nn.fsdp_gather(params, {"": ["weight", "bias"]}, mesh=mesh) as get:
        ...     torch.equal(get("")["weight"], model.weight)
        True
    """
    _check_gather(params, units, mesh, mp_policy)
    session = _Session(
        params, units, axis, mesh, prefetch, mp_policy and mp_policy.check(), replicate
    )
    with _gathering(session) as get:
        yield get


@functools.lru_cache(maxsize=4096)
def _chunk_rows(layout: Layout, axes: tuple[str, ...], k: int) -> tuple[int, ...] | None:
    """The rows of each of the ``k`` chunks a param of ``layout`` has over the FSDP ``axes``
    (its dim 0's least significant axes), ``None`` when they are equal. Uneven chunks are
    fshard's flat ones (:func:`~fshard.planner.chunk_sizes`); gathering them over ``axes``
    gives the param's base block only when no other axis splits dim 0."""
    rows = layout.shape[0]
    others = [a for a in _dim0(layout.spec, len(layout.shape)) if a not in axes]
    if rows % (k * math.prod(layout.mesh.size(a) for a in others)) == 0:
        return None
    if others:
        raise ValueError(
            f"fsdp_gather: a param of shape {tuple(layout.shape)} and spec {layout.spec} splits "
            f"dim 0 over {tuple(others)} and the FSDP axes {axes} unevenly: its blocks over "
            f"{axes} would not nest in its blocks over {tuple(others)}; fs.nn.fsdp_plan "
            "splits such a param over the longest prefix of the FSDP axes that nests, or "
            "leaves it whole over them"
        )
    return chunk_sizes(rows, layout.mesh, axes)


@functools.lru_cache(maxsize=4096)
def _part_rows(layout, axes: tuple[str, ...], ranks: tuple[int, ...]) -> tuple:
    """The rows of each part (:class:`~fshard.Parts` on dim 0) in the block of each of
    ``ranks`` (a param's FSDP group, chunk order); its chunks over the FSDP ``axes`` must
    nest in its base chunks of every part (:func:`fsdp_plan` splits it so), else refused."""
    outer = math.prod(layout.mesh.size(a) for a in layout.axes if a not in axes)
    inner = math.prod(layout.mesh.size(a) for a in axes)
    bad = [s for s in layout.sizes if not nests(s, outer, inner)]
    if bad:
        raise ValueError(
            f"fsdp_gather: a param of shape {tuple(layout.shape)} and spec {layout.spec} splits "
            f"its parts {bad} over the FSDP axes {axes} in chunks that do not nest in its "
            "chunks over the other axes: gathering them would not give its block; "
            "fs.nn.fsdp_plan leaves such a param whole over the FSDP axes"
        )
    return layout.part_rows(ranks)


def _unpadded(piece: torch.Tensor, k: int, shape, rows: tuple[int, ...] | None) -> torch.Tensor:
    """A param gathered out of ``piece``, its ``k`` chunks' (padded) blocks of ``shape`` as the
    rows of a ``(k, -1)`` matrix: the blocks in chunk order along dim 0, each uneven one's
    padding (:func:`_padded`) cut off."""
    if rows is None:
        return piece.reshape(k * shape[0], *shape[1:])
    blocks = piece.reshape(k, *shape)
    return torch.cat([blocks[j, :r] for j, r in enumerate(rows)])


def _padded(t: torch.Tensor, rows: tuple[int, ...] | None) -> torch.Tensor:
    """``t`` (a block of dim 0) with zero rows after it up to the largest of ``rows``
    (differentiable: the padding's gradient is dropped)."""
    return t if rows is None else _comm.pad_dim0(t, max(rows))


def _active_sync(mode: str) -> GradSync | None:
    """The innermost active gradient sync of ``mode`` (``"step"``: a pipeline's;
    ``"unreduced"``: ``fs.value_and_grad(..., sync=False)``'s), or ``None``."""
    for h in reversed(lax.active_handlers()):
        if isinstance(h, GradSync) and h.mode == mode:
            return h
    return None


def _sharded(v) -> bool:
    return isinstance(v, ShardedArray)


def _check_gather(params, units, mesh, mp_policy) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"fsdp_gather: mesh must be a fshard.Mesh, got {type(mesh).__name__}")
    missing = sorted({n for names in units.values() for n in names} - set(params))
    if missing:
        raise ValueError(f"fsdp_gather: units name params not in params: {missing[:5]}")
    errors = LeafErrors("fsdp_gather: params must be ShardedArrays", "params")
    for n, v in params.items():
        if not isinstance(v, ShardedArray):
            errors.add(f"[{n!r}]", f"got {type(v).__name__}", TypeError)
    errors.raise_if_any(fix="shard them with fs.nn.shard_params(module, mesh, fsdp_plan(...))")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fsdp_gather: mp_policy must be a fs.nn.MixedPrecisionPolicy or None, got "
            f"{type(mp_policy).__name__}"
        )


@contextlib.contextmanager
def _gathering(session: _Session) -> Iterator[Callable]:
    """``session.gather`` for the block, with its saved-tensor hooks (eager) and, in the global
    view, its pcast handler."""
    try:
        with lax.handling(*((session.pcasts,) if session.typed else ())):
            if not session.eager:
                yield session.gather
                return
            if session.keeps_all():  # no saved tensor is ever a token: no hooks to run
                yield session.gather
            else:
                with torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack):
                    yield session.gather
            for unit in list(session.launched):  # prefetched, never used: finish the collective
                session._wait(unit)
    finally:
        session.end_forward()


def _check_units(module: torch.nn.Module, params: Mapping, units: Mapping):
    """Every unit's names resolve in ``module`` (ties: one value), no tensor is in two units,
    and a unit other than the root holds every name of its tensors (a tied alias outside the
    unit's submodule would read the module's own tensor, not the gathered one). Returns the
    module's :func:`fshard._swap.places` (its :func:`fshard._swap.aliases` where there is no
    cache), read before any swap, for the swaps; raises listing every problem.

    The checks depend on the module's structure, the units and which of their names
    ``params`` gives (the values' types are :func:`_check_gather`'s): a call that repeats all
    three (a pipeline stage's layer, once per layer and microbatch) reuses the first's result,
    kept with the places of that structure (``Places.checked``: a changed module is another
    structure, checked afresh), instead of the checks' walks and name lookups."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping name -> value, got {type(params).__name__}")
    places = _swap.places(module)
    if places is None:
        return _check_units_now(module, params, units, _swap.aliases(module))
    try:
        key = (
            tuple((u, tuple(ns)) for u, ns in units.items()),
            tuple(n in params for ns in units.values() for n in ns),
        )
        if key in places.checked:
            return places
    except TypeError:  # an unhashable unit name
        key = None
    _check_units_now(module, params, units, places)
    if key is not None:
        if len(places.checked) >= 8:  # units or names that keep changing: keep the latest
            places.checked.clear()
        places.checked.add(key)
    return places


def _check_units_now(module: torch.nn.Module, params: Mapping, units: Mapping, held):
    values = {n: params[n] for names in units.values() for n in names if n in params}
    _swap.targets(module, values, "fsdp_call", held)  # names, value types, ties
    names: dict[int, list[str]] = {}  # every name of each tensor
    for attr in ("named_parameters", "named_buffers"):
        for n, t in getattr(module, attr)(remove_duplicate=False):
            names.setdefault(id(t), []).append(n)
    unit_of: dict[int, tuple[str, str]] = {}
    errors = LeafErrors("fsdp_call: units that do not fit the module", "params")
    for unit, members in units.items():
        for n in members:
            if n not in values:
                continue  # not in params: fsdp_gather names it
            owner, attr, slot = _swap.resolve(module, n, "fsdp_call")
            key = id(getattr(owner, slot)[attr])
            if key in unit_of:
                other, other_unit = unit_of[key]
                errors.add(
                    f"[{n!r}]",
                    f"in unit {unit!r}, but it is (tied to) params[{other!r}] of unit "
                    f"{other_unit!r}; put it in one unit",
                )
                continue
            unit_of[key] = (n, unit)
            outside = [a for a in names[key] if unit and not a.startswith(unit + ".")]
            if outside:
                errors.add(
                    f"[{n!r}]",
                    f"in unit {unit!r}, but also held as {outside} outside it; put it in a "
                    "unit holding all its names (the root unit '' holds every name)",
                )
    errors.raise_if_any()
    return held


def fsdp_call(
    module: torch.nn.Module,
    params: Mapping[str, ShardedArray],
    args=(),
    kwargs=None,
    *,
    mesh: Mesh,
    axis: str | Sequence[str] = "dp",
    units: Mapping[str, Sequence[str]] | None = None,
    prefetch: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    replicate: str | Sequence[str] | None = None,
    outputs: Mapping[str, P] | None = None,
):
    """Run ``module(*args)`` on local tensors with each FSDP unit gathered just before its
    forward (a forward pre-hook), the next one prefetched, and released after.

    The gathered values are swapped into the module as by :func:`functional_call` (the root
    unit for the whole call, each other unit during its submodule's forward): every alias of a
    tied param reads the gathered value, and the module's own tensors come back afterwards in
    their order. The units are checked against the module first: a tensor in two units, or
    one with an alias outside its unit's submodule, is an error.

    The module's forward runs on plain local tensors (no op rules), so this is pure data /
    fully-sharded parallelism; for FSDP x TP write the local-view loss with
    :func:`fsdp_gather` and explicit ``fs.lax`` collectives (``examples/train_gpt.py --fsdp``).

    Args:
        module: the module.
        params: ``{name: ShardedArray}`` sharded with :func:`fsdp_plan`.
        args: positional arguments (local tensors).
        kwargs: keyword arguments.
        mesh: the mesh.
        axis: the data-parallel mesh axis, or a tuple of axes (as in :func:`fsdp_plan`). A
            param split over some of them (:func:`fsdp_plan`'s longest prefix that nests) is
            gathered and reduce-scattered over those (one pack per group in a unit) and its
            gradient summed over the others on its shard. A :class:`~fshard.Parts` param
            split on dim 0 (its parts on another dim: GPT-2's ``c_attn`` weight, MoE
            experts' ``gate_up_proj``) is gathered in its unit's all_gather and
            reduce-scattered in its reduce_scatter like the others; one split per part on
            dim 0 over the FSDP axes (Phi-3's ``qkv_proj``, ``c_attn``'s bias) too, its
            parts' sub-chunks put back in part order after the gather (refused under
            ``fs.value_and_grad(..., sync=False)``: its unreduced gradient would be in chunk
            order); one left whole is pcast, its gradient all-reduced.
        units: as in :func:`fsdp_gather`; default :func:`fsdp_units`.
        prefetch: as in :func:`fsdp_gather`.
        mp_policy: a :class:`~fshard.nn.MixedPrecisionPolicy` (``None``: the one
            :func:`~fshard.nn.shard_params` recorded for the module, if any): params gathered
            in ``param_dtype``, gradients reduce-scattered in ``reduce_dtype``, floating
            arguments cast to ``param_dtype`` (``cast_forward_inputs``), floating outputs to
            ``output_dtype``.
        replicate: HSDP's replicate axes, as in :func:`fsdp_gather`.
        outputs: ``{submodule name: P}``: the layouts of those submodules' ShardedArray
            outputs in the global view (a plan's :class:`~fshard.nn.Output` entries, which
            :func:`~fshard.nn.functional_call` applies; e.g. a row-parallel layer's output
            all-reduced where it leaves the layer, not left pending). ``None``: none.

    Returns:
        What ``module.forward`` returns (local, varying over ``axis``).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("dp",))  # 2 ranks
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        >>> params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
        >>> x_local = torch.ones(5, 4)  # this rank's batch
        >>> out = fs.nn.fsdp_call(model, params, (x_local,), mesh=mesh)
        >>> torch.allclose(out, model(x_local))
        True
    """
    units = fsdp_units(module) if units is None else units
    if not isinstance(args, tuple):
        args = (args,)
    policy = policy_of(module, mp_policy)
    if policy is not None:
        args, kwargs = cast_inputs(policy, args, kwargs)
    held = _check_units(module, params, units)
    # one walk of the module: the layers under activation checkpointing, and whether it is a
    # model's root (its unit "" kept from the forward to the backward): a module whose layers
    # are units of their own, here or in a call inside this one (fs.remat's layers)
    recomputing, root = [], False
    for n, m in module.named_modules():
        root = root or isinstance(m, torch.nn.ModuleList)
        if m.training and getattr(m, "gradient_checkpointing", False):
            recomputing.append(n)
    if recomputing:  # the backward would recompute those layers with the module's own tensors
        raise ValueError(
            f"fsdp_call: activation checkpointing is on for {recomputing[:3]} (transformers' "
            "gradient_checkpointing_enable()); its recompute in the backward runs after the "
            "unit's gathered values are gone, on the module's own (stale) tensors. Turn it "
            "off (model.gradient_checkpointing_disable()), or use fs.nn.functional_call (dp / "
            "tp), which swaps the values in again for the recompute"
        )
    handles, inside = [], []  # inside: the units' swaps now entered, innermost last
    typed = any(isinstance(v, ShardedArray) for v in tree_leaves((args, kwargs), is_leaf=_sharded))
    _check_gather(params, units, mesh, policy)
    session = _Session(params, units, axis, mesh, prefetch, policy, replicate, typed, root)
    with _gathering(session) as get:
        try:
            for unit in units:
                if unit == "":
                    continue
                sub = module.get_submodule(unit)

                def pre(m, a, unit=unit):
                    inside.append(_swap.swap(module, get(unit), "fsdp_call", held).__enter__())

                def post(m, a, o):
                    inside.pop().__exit__(None, None, None)

                handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
            for name, spec in (outputs or {}).items():
                hook = functools.partial(_output_layout, spec)
                handles.append(module.get_submodule(name).register_forward_hook(hook))
            with _swap.swap(module, get(""), "fsdp_call", held):
                try:
                    return cast_outputs(policy, module(*args, **(kwargs or {})))
                finally:  # a unit whose forward raised: its swap exits before the root's
                    while inside:
                        inside.pop().__exit__(None, None, None)
        finally:
            for h in handles:
                h.remove()


def _output_layout(spec: P, module, args, out):
    return reshard(out, spec) if isinstance(out, ShardedArray) else out
