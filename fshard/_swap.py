"""Values put into a module for the duration of a ``with`` block: the one mechanism behind
:func:`fshard.nn.functional_call` and :func:`fshard.nn.fsdp_call` (its root and each unit), and
the name lookup of :func:`fshard.nn.load_params` and :func:`fshard.nn.state_dict`.

``torch.func.functional_call`` refuses non-Tensor values (a ShardedArray), so :class:`swap` puts
the values into the module itself, as torch.func does with tensors: each named entry of its
owner's ``_parameters`` (or ``_buffers``) holds the value for the block, so ``getattr`` and
``module.parameters()`` both see it (transformers' ``self.dtype``, ``next(self.parameters())``)::

    with swap(module, {"fc.weight": w}, "functional_call"):
        out = module(x)  # every alias of fc.weight reads w
    # the module's own parameters are back

* **Ties.** Every place that holds the named tensor gets the value (GPT-2's ``lm_head.weight``
  is ``transformer.wte.weight``; one tensor may have any number of owners), as
  ``torch.func.functional_call(tie_weights=True)``. Two names of one tensor given different
  values are an error.
* **Restored** on exit, also when the body raises (the entries keep their places, so
  ``named_parameters()`` and ``state_dict()`` keep their order; dynamo guards it). Swaps nest
  (FSDP units inside the root) if they exit in reverse order of entry.
* **Validated up front**: every entry that does not fit is listed (:class:`LeafErrors`) before
  anything is swapped.
* **Traced.** Under ``torch.func`` transforms the values are whatever tensors the transform
  passes; under ``torch.compile`` dynamo traces the dict writes.
* **Cached.** Where each name's tensor is held (:func:`aliases`, ties included) and where each
  name resolves (:func:`resolve`) are static: an eager swap reads them from a per-module cache
  (:func:`places`, weak in the module) found by a snapshot of the module's structure
  (:func:`structure`: each submodule and the names and identities of the tensors it holds),
  taken at every swap, so any change to the module (a submodule or tensor added, replaced,
  deleted or newly tied) is a different snapshot and is read afresh (the argument:
  :class:`Places`). A swap of the names a swap was given before on one structure (a pipeline
  stage's layer, once per microbatch) is one snapshot, one lookup and one list; compiled calls
  do not cache (dynamo traces the uncached lookups).

Not thread-safe for concurrent swaps on one module.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Mapping

import torch

from ._leaf_errors import LeafErrors
from .array import ShardedArray

__all__ = [
    "swap",
    "targets",
    "aliases",
    "resolve",
    "structure",
    "places",
    "Places",
    "hold_elsewhere",
    "held_here",
    "reading",
]


# -- modules whose values are held elsewhere --------------------------------------------------
# fs.nn.shard_params copies a module's values into a params dict that training replaces; the
# module's own tensors then lag behind. ``module.state_dict()`` is refused from shard_params on,
# and again after any eager swap into the module (a training or eval step on the params), until
# fs.nn.load_params writes the values back. Compiled calls do not mark: state read there would
# be guarded, and the step recompiled once it changed. The hook that reads the dict is
# registered only on modules shard_params saw, so a reused id is harmless.
_STALE: dict[int, bool] = {}
_HOOKED: dict[int, object] = {}
_READING = contextvars.ContextVar("fshard_swap_reading", default=False)


def _refuse_stale_state_dict(module, prefix, keep_vars) -> None:
    if _STALE.get(id(module)) and not _READING.get():
        raise RuntimeError(
            f"{type(module).__name__}.state_dict(): this module's parameters were copied into a "
            "params dict by fs.nn.shard_params; training updates that dict, not the module, so "
            "its own tensors may be stale. Save the trained values with "
            "fs.checkpoint.save(path, fs.nn.state_dict(model, params)) (sharded, no gather), or "
            "write them back first with fs.nn.load_params(model, params), after which "
            "model.state_dict() holds them"
        )


def hold_elsewhere(module: torch.nn.Module) -> None:
    """Mark ``module``'s values as copied into a params dict (:func:`fshard.nn.shard_params`):
    ``module.state_dict()`` raises until :func:`held_here`."""
    _STALE[id(module)] = True
    if id(module) not in _HOOKED:
        _HOOKED[id(module)] = module.register_state_dict_pre_hook(_refuse_stale_state_dict)
        weakref.finalize(module, _forget, id(module))


def _forget(key: int) -> None:
    _STALE.pop(key, None)
    _HOOKED.pop(key, None)


def held_here(module: torch.nn.Module) -> None:
    """``module``'s own tensors hold its values again (:func:`fshard.nn.load_params`)."""
    if id(module) in _STALE:
        _STALE[id(module)] = False


class reading:
    """``with reading():`` ``module.state_dict()`` is allowed (fshard reads keys and aliases
    from it, not values)."""

    def __enter__(self):
        self.token = _READING.set(True)

    def __exit__(self, *exc):
        _READING.reset(self.token)


def resolve(module: torch.nn.Module, name: str, fn: str = "functional_call"):
    """``(owner, attr, slot)`` of the parameter or buffer ``name`` (a dotted name as in
    ``named_parameters()``, any alias of a tied one); ``ValueError`` naming ``fn`` if there is
    none."""
    *path, attr = name.split(".")
    owner = module
    for part in path:
        sub = owner._modules.get(part)
        if sub is None:
            raise ValueError(f"{fn}: {name!r} is not a parameter or buffer of the module")
        owner = sub
    for slot in ("_parameters", "_buffers"):
        tensors = getattr(owner, slot)
        if tensors.get(attr) is not None:
            return owner, attr, slot
    raise ValueError(f"{fn}: {name!r} is not a parameter or buffer of the module")


def aliases(module: torch.nn.Module) -> dict[int, list]:
    """``id(tensor) -> [(owner, attr, slot), ...]``: every place a parameter/buffer is held.
    Read it before a swap when a nested swap needs it (entries the outer one popped are not
    found afterwards)."""
    out: dict[int, list] = {}
    for owner in module.modules():
        for slot in ("_parameters", "_buffers"):
            for attr, t in getattr(owner, slot).items():
                if t is not None:
                    out.setdefault(id(t), []).append((owner, attr, slot))
    return out


# -- the static part, cached per module structure ------------------------------------------------

#: modules a structure snapshot walks at most (a module tree holding itself: no snapshot)
_STRUCTURE_MODULES = 1 << 16


def structure(module: torch.nn.Module) -> tuple | None:
    """Everything :func:`aliases` and :func:`resolve` read of ``module``, as a hashable
    snapshot: for each submodule (breadth first, by every path: a shared one at each) its
    number of children, parameters and buffers and their names; then the identities of the
    submodules in that order (``None`` children included), then those of every tensor (or
    ``None``) they hold, in the same order. The counts and the walk's order make it a
    serialization of the tree: equal snapshots are equal trees of equal names and identities.
    The dicts are read in C (``+=`` of their keys and values, ``map(id, ...)`` at the end), not
    through ``named_modules``' names and a tuple per tensor. ``None`` past
    ``_STRUCTURE_MODULES`` modules (a cycle): no cache then."""
    keys: list = []
    held: list = []  # every tensor (or None) the modules hold, in walk order
    mods = [module]
    for m in mods:  # grows as the walk finds children: breadth first
        if m is None:  # a child slot registered as None
            keys.append(None)
            continue
        subs, ps, bs = m._modules, m._parameters, m._buffers
        keys += (len(subs), len(ps), len(bs))
        if subs:  # (most dicts are empty: a test is cheaper than an empty extend)
            keys += subs
            mods += subs.values()
            if len(mods) > _STRUCTURE_MODULES:
                return None
        if ps:
            keys += ps
            held += ps.values()
        if bs:
            keys += bs
            held += bs.values()
    keys += map(id, mods)
    keys += map(id, held)
    return tuple(keys)


class Places:
    """:func:`aliases` and :func:`resolve` of one structure of a module (:func:`structure`),
    its owners held weakly (the cache is weak in the module, which may be one of them).

    Why a hit is the answer the uncached path would give: those two functions read only the
    module tree (each module's ``_modules``, ``_parameters`` and ``_buffers``: keys, and which
    object each holds), all of which the snapshot records, objects by ``id``. Ids are reused
    only once their object is gone, so equal snapshots can still differ in which objects they
    name. Tensors: within one snapshot every id is of a live object, so the ids group the
    places exactly as :func:`aliases` groups the tensors, and the cache keeps places, never
    tensors. Modules: :meth:`alive` checks that every owner the entry names is still the object
    it was (a weak reference to it is live, and two live objects never share an id); a module
    holding no tensor is only a step on a path, which the snapshot's names and child ids fix.
    ``checked``: what callers found valid on this structure (:func:`fshard.nn.fsdp_call`'s
    units check), read with the entry."""

    __slots__ = ("structure", "held", "owners", "plans", "checked")

    def __init__(self, module: torch.nn.Module, snapshot: tuple):
        self.structure = snapshot
        refs: dict[int, weakref.ref] = {}
        self.held = {
            key: [(refs.setdefault(id(o), weakref.ref(o)), a, s) for o, a, s in places]
            for key, places in aliases(module).items()
        }
        self.owners = tuple(refs.values())
        self.plans: dict[tuple, tuple | None] = {}  # names given -> their places, in order
        self.checked: set = set()

    def alive(self) -> bool:
        """Every owner is still the object the entry was made from."""
        for ref in self.owners:  # noqa: SIM110 (a loop: no generator frame per call)
            if ref() is None:
                return False
        return True

    def aliases(self) -> dict[int, list]:
        """:func:`aliases` of the module, when :meth:`alive`."""
        return {key: [(r(), a, s) for r, a, s in v] for key, v in self.held.items()}

    def fit(self, module: torch.nn.Module, values: Mapping) -> list | None:
        """:func:`targets` for ``values`` where every name resolves, no two of them name one
        tensor and every value is a ShardedArray or tensor (the uncached loop's result, without its
        lookups); ``None`` otherwise (the uncached loop then says what does not fit)."""
        names = tuple(values)
        try:
            plan = self.plans[names]
        except KeyError:
            if len(self.plans) >= 16:  # names that keep changing: keep the latest
                self.plans.clear()
            plan = self.plans[names] = self._plan(module, names)
        if plan is None:
            return None
        for value in values.values():
            if not isinstance(value, _VALUES):
                return None
        return [(name, r(), a, s, values[name]) for name, r, a, s in plan]

    def _plan(self, module: torch.nn.Module, names: tuple) -> tuple | None:
        claimed: set[int] = set()
        out: list = []
        for name in names:
            try:
                owner, attr, slot = resolve(module, name)
            except ValueError:
                return None
            key = id(getattr(owner, slot)[attr])
            places = self.held.get(key)  # None: an enclosing swap's value (the loop says)
            if key in claimed or places is None:
                return None
            claimed.add(key)
            out.extend((name, r, a, s) for r, a, s in places)
        return tuple(out)


#: module -> its Places, the latest first
_PLACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_VALUES = (torch.Tensor, ShardedArray)


def places(module: torch.nn.Module) -> Places | None:
    """The cached :class:`Places` of ``module``'s structure now (made on a miss); ``None`` where
    there is no cache: while dynamo traces (it traces the uncached lookups), for a module tree
    holding itself or a module without weak references. Read it before a swap when a nested
    swap needs it, as :func:`aliases`."""
    if torch.compiler.is_compiling():
        return None
    snapshot = structure(module)
    if snapshot is None:
        return None
    try:
        cached = _PLACES.get(module)
        if cached is None:
            cached = _PLACES[module] = []
    except TypeError:  # no weak references to this module
        return None
    for entry in cached:  # latest first; an equal tuple compares faster than it hashes
        if entry.structure == snapshot:
            if entry.alive():
                return entry
            cached.remove(entry)
            break
    entry = Places(module, snapshot)
    del cached[7:]  # a module whose structure keeps changing: the latest 8
    cached.insert(0, entry)
    return entry


def targets(
    module: torch.nn.Module, values: Mapping, fn: str, held: dict | Places | None = None
) -> list:
    """``[(name, owner, attr, slot, value)]`` for every alias of every entry ``name`` of
    ``values``; the error (naming ``fn``) lists every entry that does not fit. ``held``: the
    :func:`aliases` of ``module`` or its :func:`places`, when the caller has them (read before
    any enclosing swap); ``None``: read now, uncached."""
    if isinstance(held, Places):
        fast = held.fit(module, values)
        if fast is not None:
            return fast
        held = held.aliases()
    held = aliases(module) if held is None else held
    claimed: dict[int, tuple[str, object]] = {}
    out = []
    errors = LeafErrors(f"{fn}: params entries that do not fit the module", "params")
    for name, value in values.items():
        if not isinstance(value, _VALUES):
            errors.add(
                f"[{name!r}]",
                f"got {type(value).__name__}; values must be ShardedArrays or tensors",
                TypeError,
            )
            continue
        try:
            owner, attr, slot = resolve(module, name, fn)
        except ValueError:
            errors.add(f"[{name!r}]", "not a parameter or buffer of the module")
            continue
        key = id(getattr(owner, slot)[attr])
        if key in claimed:
            other, other_value = claimed[key]
            if other_value is not value:
                errors.add(
                    f"[{name!r}]",
                    f"tied to params[{other!r}] (one parameter) but given a different value; "
                    "pass only one of them",
                )
            continue
        claimed[key] = (name, value)
        out.extend((name, o, a, s, value) for o, a, s in held[key])
    errors.raise_if_any()
    return out


class swap:
    """``with swap(module, values, fn):`` the module reads ``values`` (``{name: ShardedArray |
    Tensor}``, names as in ``named_parameters()`` / ``named_buffers()``) in place of its own
    tensors, every alias of each included; names left out keep the module's own. ``fn`` names
    the caller in errors, raised by the constructor before anything is swapped. ``held``: the
    module's :func:`places` (or :func:`aliases`), read before any enclosing swap; ``None``:
    :func:`places` now.

    A swap is entered once. ``__enter__`` / ``__exit__`` may be called from hooks (FSDP units:
    a forward pre-hook and a forward hook) as long as nested swaps exit in reverse order.
    """

    def __init__(self, module: torch.nn.Module, values: Mapping, fn: str, held=None):
        self.targets = targets(module, values, fn, places(module) if held is None else held)
        eager = not torch.compiler.is_compiling()
        if eager and fn in ("functional_call", "fsdp_call") and id(module) in _STALE:
            _STALE[id(module)] = True
        self.saved: list = []

    def __enter__(self) -> swap:
        saved = self.saved
        try:
            for _, owner, attr, slot, value in self.targets:
                entries = getattr(owner, slot)
                saved.append((entries, attr, entries[attr]))
                entries[attr] = value
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for entries, attr, original in reversed(self.saved):
            entries[attr] = original
        self.saved = []
