"""A module's parameters as sharded values: the single mechanism every strategy runs modules by.

``shard_params(module, mesh, plan)`` turns a module's parameters into a flat dict
``name -> ShardedArray``; ``functional_call(module, params, args)`` runs the module's own
``forward`` with those values put into the module by :mod:`fshard._swap` (the one swap that
:func:`fshard.parallel.fsdp_call` and the pipeline stages use too); ``load_params`` writes
trained values back, ``state_dict`` gives a sharded state dict. The public names are
:mod:`fshard.nn`'s, which also re-exports the plans of :mod:`fshard.parallel`; this module sits
below :mod:`fshard.parallel` so the strategies can run modules through it.

Example:
    >>> import torch, fshard as fs
    >>> from fshard.module import functional_call, shard_params
    >>> mesh = fs.Mesh.create((2,), ("tp",))
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(4, 2)
    >>> out = functional_call(model, shard_params(model, mesh, {}), (torch.ones(1, 4),))
    >>> torch.allclose(fs.gather(out), model(torch.ones(1, 4)))
    True
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import weakref
from collections.abc import Mapping

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from . import _compat, _swap, config, consistency, lax
from ._leaf_errors import LeafErrors
from ._traced import constant
from .api import gather, reshard, shard
from .array import ShardedArray, is_sharded
from .collectives import Bound, Pcast
from .mesh import Mesh
from .nn_plan import LocalRows, Output, _match, _split_plan, match_plan
from .ops.indexing import ValueDependentShape
from .precision import MixedPrecisionPolicy
from .shard_map import shard_map
from .spec import LAYOUT_OF_ID, Layout, P, _layout
from .tree import tree_leaves

__all__ = [
    "MixedPrecisionPolicy",
    "Output",
    "LocalRows",
    "shard_params",
    "functional_call",
    "load_params",
    "state_dict",
    "match_plan",
]


_REPLICATED = P()

# What the last shard_params on a module recorded, by id(module) and dropped when the module
# dies (weakref.finalize). Plain dicts, not WeakKeyDictionaries: a compiled functional_call
# reads them, and dynamo guards a WeakKeyDictionary entry by its position among the keys, so
# any other module dying recompiled the step, or, in the middle of a trace, failed it
# ("IndexError" creating the guard); a plain dict entry is guarded by its key.
# id(module) -> {submodule name: output spec}
_OUTPUTS: dict[int, dict] = {}
# id(module) -> the MixedPrecisionPolicy the last shard_params on it was given
_POLICIES: dict[int, MixedPrecisionPolicy] = {}


def _record(table: dict, module: torch.nn.Module, value) -> None:
    """``table[id(module)] = value`` (``None``: no entry) until ``module`` dies."""
    key = id(module)
    if value is None:
        table.pop(key, None)
        return
    if key not in table:
        weakref.finalize(module, table.pop, key, None)
    table[key] = value


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and _compat.storage_id(a) == _compat.storage_id(b)


def shard_params(
    module: torch.nn.Module,
    mesh: Mesh,
    plan: Mapping[str, P | Output] | None = None,
    *,
    src=None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> dict[str, ShardedArray]:
    """Shard a module's parameters following ``plan``.

    The values are copies: the module's own tensors are never aliased, so a donated optimizer
    step (``fs.optim.step(..., donate=True)``) cannot write into the module. They live on
    ``mesh.device()`` whatever device the module is on (as :func:`fshard.shard`): a CPU module
    sharded onto a CUDA mesh gives CUDA blocks (each rank copies only its blocks; the module
    stays on the CPU, so move inputs and buffers your forward reads with ``mesh.device()``). Write trained
    values back with :func:`load_params`. From here on ``module.state_dict()`` raises until
    :func:`load_params` (and again after each later eager :func:`functional_call` /
    :func:`fsdp_call`): the module's own tensors do not hold what training produces (save
    ``fs.nn.state_dict(module, params)`` instead; torch's and HF's savers call
    ``state_dict()``, so a stale save fails instead of writing the initial weights). Read its
    keys before sharding, or through ``fs.nn.state_dict(module, {})``. Tied parameters (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) appear once, under their first name; the plan may name them by
    any of their names (transformers' plans name the head), which must agree on one spec;
    :func:`functional_call` gives every alias that value.

    Args:
        module: the module. With ``src=None`` every rank must hold the same values (e.g. the
            same seed before construction); each keeps its block, no communication but the
            consistency check's (when on: one small all_reduce for the whole module, its
            parameters' specs, shapes, dtypes and content hashes; a ``ConsistencyError`` names
            each parameter the ranks disagree on).
        mesh: the mesh.
        plan: ``{pattern: P | Output}``: ``P`` entries are parameter layouts, see
            :func:`match_plan` (globs, or ``"re:"`` regexes; first match wins; unmatched params
            are replicated; a pattern matching nothing raises). Specs index the parameter as
            torch stores it (``nn.Linear.weight`` is ``(out_features, in_features)``).
            :class:`Output` entries are module output layouts over module names; they are
            recorded for this module and applied by :func:`functional_call`.
        src: a rank: only that rank's values are used; they are scattered (each rank receives
            its block). Other ranks' modules only provide names, shapes and dtypes (they may
            live on the ``meta`` device): ``src``'s buffers, persistent or not (a rotary
            ``inv_freq``), are broadcast into them, so they run.
        mp_policy: a :class:`MixedPrecisionPolicy` recorded for this module: the default of
            :func:`functional_call` and :func:`fsdp_call` on it (FSDP2's ``fully_shard(...,
            mp_policy=)``). The params themselves keep their dtype (the fp32 master).

    Returns:
        ``{name: ShardedArray}`` in ``named_parameters()`` order (detached copies).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> plan = {"0.weight": fs.P("tp", None), "0.bias": fs.P("tp"), "2.weight": fs.P(None, "tp")}
        >>> params = fs.nn.shard_params(model, mesh, plan)  # the rest replicated
        >>> params["0.weight"].spec, params["0.weight"].local.shape, params["2.bias"].spec
        (P('tp'), torch.Size([4, 4]), P())
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a fshard.Mesh, got {type(mesh).__name__}")
    named = dict(module.named_parameters())
    param_rules, output_rules = _split_plan(plan)
    specs = _tied_specs(module, param_rules)
    outputs = _match((n for n, _ in module.named_modules()), output_rules, "module")
    errors = LeafErrors("shard_params: parameters the plan's specs do not fit", "params")
    for name, p in named.items():  # every layout checked before any parameter is sharded
        try:
            Layout.of(mesh, specs[name], tuple(p.shape), p.dtype)
        except (TypeError, ValueError) as e:
            errors.add(f"[{name!r}]", f"shape {tuple(p.shape)}, spec {specs[name]}: {e}")
    errors.raise_if_any(fix="fix the plan's pattern or spec for these parameters")
    out = {}
    checked = src is None and consistency.enabled()
    if checked:
        # what each fs.shard below would compare (its layout and full value), for every
        # parameter in one exchange instead of one per parameter (a 2-layer GPT on 4 ranks:
        # shard_params took 0.43 s of a 1.0 s composed run, mostly in those exchanges)
        fields = {}
        for n, p in named.items():
            fields[n] = (specs[n], tuple(p.shape), p.dtype)
            fields[f"{n} values"] = p.detach()
        consistency.check_equal(
            fields,
            mesh,
            what="shard_params (every rank must pass the same module and plan: the parameters' "
            "specs, shapes, dtypes and values)",
        )
    with config.consistency(False) if checked else contextlib.nullcontext():  # checked above
        for name, p in named.items():
            spec, t = specs[name], p.detach()
            if src is None:
                x = shard(t, mesh, spec)
            else:
                x = shard(
                    t if mesh.rank == src else None,
                    mesh,
                    spec,
                    src=src,
                    shape=t.shape,
                    dtype=t.dtype,
                )
            if _shares_storage(x.local, t):
                x = ShardedArray._raw(x.local.clone(), x.layout)
            out[name] = x
    if src is not None:
        _broadcast_buffers(module, mesh, src)
    _record(_OUTPUTS, module, outputs)
    _record(_POLICIES, module, mp_policy)
    _swap.hold_elsewhere(module)
    if not _compat.TRACES_ATTRIBUTE_DELETE:
        # functional_call leaves these modules' ``forward`` bound on the instance under an
        # older dynamo (it cannot delete it): bind it now, so the first compiled call sees the
        # state every later one does (no recompile on the second step)
        for name in outputs:
            sub = module.get_submodule(name)
            sub.__dict__.setdefault("forward", sub.forward)
    return out


def _tied_specs(module: torch.nn.Module, rules: Mapping) -> dict:
    """``{name: spec}`` of every parameter under its first name, the plan matched against every
    name of each parameter: a tied parameter (``lm_head.weight`` is ``embed_tokens.weight``) is
    listed once by ``named_parameters()``, but a plan may name it by either name (transformers'
    plans name the head). Its names must agree on one spec (or be unmatched)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(first.setdefault(id(p), name), []).append(name)
    found = _match((n for names in aliases.values() for n in names), rules, "parameter")
    specs = {}
    for name, names in aliases.items():
        given = {n: found[n] for n in names if n in found}
        if len(set(given.values())) > 1:
            raise ValueError(
                f"shard_params: {names} are one tied parameter, and the plan gives its names "
                f"different specs: {given}. Give them one spec (or drop the entry of all but one)"
            )
        specs[name] = next(iter(given.values()), _REPLICATED)
    return specs


def _broadcast_buffers(module: torch.nn.Module, mesh: Mesh, src: int) -> None:
    """``src``'s buffers, persistent or not (a rotary ``inv_freq`` is computed at construction
    and never saved), written into every rank's module: a module built on ``meta`` elsewhere
    then runs. Each buffer object is sent once (tied buffers stay tied)."""
    seen: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for attr, b in list(owner._buffers.items()):
            if b is None:
                continue
            if id(b) not in seen:
                t = b.detach() if mesh.rank == src else None
                got = shard(t, mesh, _REPLICATED, src=src, shape=b.shape, dtype=b.dtype).local
                if mesh.rank != src:  # on the module's device, or the mesh's for a meta module
                    got = got if b.device.type == "meta" else got.to(b.device)
                seen[id(b)] = b if mesh.rank == src else got
            owner._buffers[attr] = seen[id(b)]


_NONE = object()  # no instance ``forward`` to restore


def _with_output(forward, name: str, spec: P):
    """``forward`` with its ShardedArray output resharded to ``spec``. Applied as a patched
    instance ``forward``, not a forward hook: dynamo traces a patched forward, while registering
    a hook inside a compiled step is a graph break."""

    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        if isinstance(out, ShardedArray):
            return reshard(out, spec)
        if any(isinstance(leaf, ShardedArray) for leaf in tree_leaves(out)):
            raise TypeError(
                f"functional_call: the plan gives module {name!r} the output layout {spec}, "
                f"but it returns a {type(out).__name__}, not a single ShardedArray; drop its "
                "fs.nn.Output entry (or reshard inside the model)"
            )
        return out

    return run


def functional_call(
    module: torch.nn.Module,
    params: Mapping,
    args=(),
    kwargs=None,
    *,
    outputs: Mapping[str, P] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    mutable: bool | list[str] = False,
):
    """Run ``module(*args, **kwargs)`` with the parameters (and buffers) in ``params``.

    ``torch.func.functional_call`` refuses non-Tensor values, so this swaps the values into
    the module itself (``fshard/_swap.py``, shared with :func:`fsdp_call`): each named entry is
    popped from its owner's ``_parameters`` (or ``_buffers``) and set in the owner's
    ``__dict__``; everything is restored afterwards, in its order, also when ``forward``
    raises. Like ``torch.func.functional_call`` (``tie_weights=True``), every alias of a
    parameter gets the value (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``: passing
    the latter swaps both). Names missing from ``params`` keep the module's own tensors. Not
    thread-safe for concurrent calls on one module.

    Args:
        module: the module.
        params: ``{name: ShardedArray | Tensor}`` (names as in ``named_parameters()``).
        args: a tuple of positional arguments (a single non-tuple value is wrapped).
        kwargs: keyword arguments.
        outputs: ``{module glob: P}``, output layouts applied to ShardedArray outputs of the
            matched submodules (see :class:`Output`). ``None``: the :class:`Output` entries of
            the plan the last :func:`shard_params` on this module used; ``{}``: none.
        mp_policy: a :class:`MixedPrecisionPolicy`: the module's floating parameters (not its
            buffers) are cast to ``param_dtype`` for the call (their gradients come back in
            their own dtype, the data-parallel reduction in ``reduce_dtype``: see
            :mod:`fshard.precision`), floating arguments too when ``cast_forward_inputs``,
            floating outputs to ``output_dtype``. ``None``: the policy the last
            :func:`shard_params` on this module recorded, if any.
        mutable: buffers the forward may update in place (a MoE router's load-balancing
            counter ``self.tokens_per_expert.add_(counts)``, BatchNorm's running statistics):
            ``True`` (every buffer not in ``params``) or a list of globs over buffer names
            (flax's ``mutable=[...]``). Each is passed as a fresh replicated ShardedArray holding
            the module's value, so an in-place update rebinds it to the functional result
            (:mod:`fshard.ops.inplace`) computed in the global view: a count over the whole
            batch, as the dense module would count it, whatever the data split. The module's
            own buffers are not written: the call returns the new values, for the next call's
            ``params`` or :func:`load_params`. Without it an in-place update of a buffer by a
            sharded value is refused.

    Returns:
        Whatever ``module.forward`` returns; with ``mutable``, ``(output, {buffer name:
        ShardedArray})``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> params = fs.nn.shard_params(model, mesh, fs.nn.megatron_plan(column=["0"], row=["2"]))
        >>> x = torch.ones(3, 4)
        >>> out = fs.nn.functional_call(model, params, (x,))  # the module's forward, sharded
        >>> torch.allclose(fs.gather(out), model(x))
        True
        >>> g = fs.grad(lambda ps: fs.nn.functional_call(model, ps, (x,)).sum())(params)
        >>> g["0.weight"].spec == params["0.weight"].spec
        True
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping name -> value, got {type(params).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping or None, got {type(kwargs).__name__}")
    if outputs is None:
        outputs = _OUTPUTS.get(id(module), {})
    else:
        if not isinstance(outputs, Mapping):
            raise TypeError(f"outputs must be a mapping glob -> fs.P, got {outputs!r}")
        _, outputs = _split_plan({k: Output(v) for k, v in outputs.items()})
        outputs = _match((n for n, _ in module.named_modules()), outputs, "module")
    if not isinstance(args, tuple):
        args = (args,)
    state = _mutable_buffers(module, params, mutable)
    policy = policy_of(module, mp_policy)
    handlers = ()
    if policy is not None:
        params, cast = _cast_params(policy, module, params)
        args, kwargs = cast_inputs(policy, args, kwargs)
        handlers = (cast,) if cast.sources else ()
    params = {**params, **state}
    mesh = _one_rank_mesh(params)
    if mesh is not None:
        out = _run_local(module, params, args, kwargs or {}, mesh)
    else:
        try:
            handling = lax.handling(*handlers) if handlers else contextlib.nullcontext()
            with handling, _called(module, params, outputs):
                out = module(*args, **(kwargs or {}))
        except ValueDependentShape as e:
            raise _local_rows_hint(module, e) from e
    out = cast_outputs(policy, out)
    return out if mutable is False else (out, state)


def _local_rows_hint(module: torch.nn.Module, error: ValueDependentShape) -> ValueDependentShape:
    """``error`` naming the innermost submodule of ``module`` it was raised in and the plan
    entry that runs that module on each rank's rows (a MoE router's ``torch.where`` over the
    expert mask on a batch split over ``dp``, issue 37 item 7). Not automatic: the global view
    cannot tell that every value the module touches may be split by rows, and re-running a
    module that already issued collectives would desynchronise the ranks."""
    if getattr(error, "hinted", False):  # a nested call named its module already
        return error
    names = {id(m): n for n, m in module.named_modules()}
    tb, inner = error.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and names.get(id(owner)):
            inner = owner
        tb = tb.tb_next
    if inner is None:
        return error
    name = names[id(inner)]
    block = name.rpartition(".")[0] or name  # the module holding it (Mixtral's MoE block)
    glob = ".".join("*" if part.isdigit() else part for part in block.split("."))
    axis = error.axes[0] if len(error.axes) == 1 else error.axes
    hinted = ValueDependentShape(
        f"{error}.\nRaised in {name} ({type(inner).__name__}), called through "
        f"fs.nn.functional_call: where every parameter it uses is replicated, the plan entry "
        f"{{{glob!r}: fs.nn.LocalRows({axis!r})}} (fs.nn.shard_params(model, mesh, plan)) runs "
        f"{block} ({type(module.get_submodule(block)).__name__}) on each rank's rows, with no "
        "change to the model's code",
        error.axes,
    )
    hinted.hinted = True
    return hinted


def _mutable_buffers(module: torch.nn.Module, params: Mapping, mutable) -> dict:
    """``{buffer name: fresh replicated ShardedArray}`` of the buffers ``mutable`` names (see
    :func:`functional_call`) that ``params`` does not give, on the mesh of ``params``."""
    if mutable is False:
        return {}
    if mutable is not True and not (
        isinstance(mutable, (list, tuple)) and all(isinstance(g, str) for g in mutable)
    ):
        raise TypeError(
            f"functional_call: mutable must be a bool or a list of buffer-name globs, got "
            f"{mutable!r}"
        )
    mesh = next((v.layout.mesh for v in params.values() if type(v) is ShardedArray), None)
    if mesh is None:
        raise ValueError(
            "functional_call: mutable needs ShardedArray params (their mesh holds the buffers)"
        )
    names = [n for n, _ in module.named_buffers() if n not in params]
    chosen = names if mutable is True else _match(names, dict.fromkeys(mutable), "buffer")
    buffers = dict(module.named_buffers())
    return {
        name: ShardedArray._raw(
            buffers[name].detach().clone(),
            _layout(mesh, _REPLICATED, tuple(buffers[name].shape), buffers[name].dtype),
        )
        for name in chosen
    }


def policy_of(module, given) -> MixedPrecisionPolicy | None:
    """``given`` checked, or (``None``) the policy :func:`shard_params` recorded for ``module``."""
    if given is None:
        return _POLICIES.get(id(module))
    if not isinstance(given, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a fs.nn.MixedPrecisionPolicy or None, got {type(given).__name__}"
        )
    return given.check()


class ReduceInPolicyDtype(lax.Handler):
    """Mixed precision's say where a collective is applied (:mod:`fshard.precision`): a
    ``pcast`` of a param cast to ``param_dtype`` is taken on its master instead, carrying the
    policy's reduce dtype (``Pcast.reduce_dtype``), then cast: the same forward values, and the
    backward all-reduces in ``reduce_dtype`` (bucketed by ``fs.value_and_grad``'s gradient sync,
    which sees the master) with the sum flowing into the master's dtype unrounded.
    ``sources``: ``{id(cast local): (cast local, master local, reduce dtype)}`` of one call."""

    def __init__(self):
        self.sources: dict[int, tuple] = {}

    def process(self, b, x, done, proceed):
        src = self.sources.get(id(x)) if type(b.op) is Pcast else None
        if src is None or src[0] is not x:
            return proceed(b, x, done)
        _, master, dtype = src
        return proceed(Bound(Pcast(b.op.axes, dtype), b.group), master, None).to(x.dtype)


def _cast_params(policy: MixedPrecisionPolicy, module, params: Mapping):
    """``params``, the module's parameters among them (not its buffers) cast to
    ``policy.param_dtype``, and the call's :class:`ReduceInPolicyDtype` knowing each cast (see
    :mod:`fshard.precision`)."""
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    out = dict(params)
    cast = ReduceInPolicyDtype()
    for name, v in params.items():
        if name not in names or not isinstance(v, (torch.Tensor, ShardedArray)):
            continue
        low = policy.cast_param(v)
        if low is v:
            continue
        cast.sources[id(_local(low))] = (_local(low), _local(v), policy.reduce_in(v.dtype))
        out[name] = low
    return out, cast


def _cast(fn):
    return lambda t: fn(t) if isinstance(t, (torch.Tensor, ShardedArray)) else t


def cast_inputs(policy: MixedPrecisionPolicy, args: tuple, kwargs):
    """``(args, kwargs)`` with floating tensors cast to ``policy.param_dtype`` when
    ``policy.cast_forward_inputs``."""
    if not policy.cast_forward_inputs or policy.param_dtype is None:
        return args, kwargs
    cast = _cast(policy.cast_param)
    return pytree.tree_map(cast, args, is_leaf=is_sharded), pytree.tree_map(
        cast, kwargs, is_leaf=is_sharded
    )


def cast_outputs(policy: MixedPrecisionPolicy | None, out):
    """``out`` with floating tensors cast to ``policy.output_dtype``."""
    if policy is None or policy.output_dtype is None:
        return out
    return pytree.tree_map(_cast(policy.cast_output), out, is_leaf=is_sharded)


def _local(v):
    return v.local if type(v) is ShardedArray else v


@contextlib.contextmanager
def _called(module: torch.nn.Module, values: Mapping, outputs: Mapping[str, P]):
    """``values`` swapped into ``module`` and its :class:`Output` layouts applied, for the
    duration of the block, and again whenever activation checkpointing recomputes a part of
    the forward in the backward (see :func:`_recompute_swapped`)."""
    patched = []
    # a LocalRows module's values are swapped in by its own forward, on local blocks
    inner = {}
    if outputs:
        inner = {n: _under(values, n) for n, s in outputs.items() if isinstance(s, LocalRows)}
    outer = values
    if inner:
        outer = {k: v for k, v in values.items() if not any(k in own for own in inner.values())}
    with _swap.swap(module, outer, "functional_call"):
        try:
            for name, spec in outputs.items():
                sub = module.get_submodule(name)
                patched.append((sub, sub.__dict__.get("forward", _NONE), sub.forward))
                if isinstance(spec, LocalRows):
                    run = _with_local_rows(sub, name, spec.axis, inner[name])
                else:
                    run = _with_output(sub.forward, name, spec)
                sub.__dict__["forward"] = run
            undo = _recompute_swapped(lambda: _called(module, values, outputs))
            try:
                yield
            finally:
                undo()
        finally:
            for sub, forward, bound in reversed(patched):
                if forward is not _NONE:
                    sub.__dict__["forward"] = forward
                elif _compat.TRACES_ATTRIBUTE_DELETE or not torch.compiler.is_dynamo_compiling():
                    del sub.__dict__["forward"]
                else:  # the class's forward, bound, left as the instance's: the same calls
                    sub.__dict__["forward"] = bound


def _under(values: Mapping, name: str) -> dict:
    """``{full name: value}`` of the entries of ``values`` inside submodule ``name``."""
    if not name:
        raise ValueError("functional_call: a LocalRows plan entry must name a submodule")
    return {k: v for k, v in values.items() if k.startswith(name + ".")}


def _with_local_rows(sub: torch.nn.Module, name: str, axis: str, values: Mapping):
    """``sub``'s forward run on this rank's rows (see :class:`LocalRows`): under
    :func:`shard_map` over ``axis``, its parameters (``values``, replicated) swapped in as
    local blocks."""
    forward = sub.forward
    own = {k[len(name) + 1 :]: v for k, v in values.items()}
    for k, v in own.items():
        if type(v) is ShardedArray and (v.layout.rule_flag is not None or any(v.spec.dims)):
            raise ValueError(
                f"functional_call: LocalRows({axis!r}) runs {name!r} on each rank's rows, so its "
                f"parameters must be replicated; {name}.{k} has the layout {v.spec}. Drop it "
                "from the plan, or the LocalRows entry"
            )

    def run(*args, **kwargs):
        leaves, tree = pytree.tree_flatten((args, kwargs), is_leaf=is_sharded)
        at = [i for i, v in enumerate(leaves) if type(v) is ShardedArray]
        if not at:  # nothing sharded comes in: the module runs as it is
            with _swap.swap(sub, own, "functional_call"):
                return forward(*args, **kwargs)

        def body(params, xs):
            # varying over the axis once, here: each parameter's gradient is summed over it once
            # for the whole body, whichever of its parts this rank's rows use (a MoE block
            # indexes only the experts its tokens reach, which differ from rank to rank)
            params = {
                k: lax.pcast(v, axis) if v.is_floating_point() else v for k, v in params.items()
            }
            given = list(leaves)
            for i, x in zip(at, xs):
                given[i] = x
            a, k = pytree.tree_unflatten(given, tree)
            with _swap.swap(sub, params, "functional_call"):
                return forward(*a, **k)

        mesh = leaves[at[0]].layout.mesh
        run_local = shard_map(body, mesh, in_specs=(_REPLICATED, P(axis)), out_specs=P(axis))
        return run_local(own, [leaves[i] for i in at])

    return run


#: torch.utils.checkpoint.checkpoint without its dynamo-disabling wrapper: its keyword defaults
_CHECKPOINT = inspect.unwrap(torch.utils.checkpoint.checkpoint)
_CHECKPOINT_MODULE = torch.utils.checkpoint
#: the signature of the non-reentrant generator ``checkpoint`` calls (:data:`_compat.CHECKPOINT_GENERATOR`)
_GENERATOR_SIGNATURE = inspect.signature(getattr(_CHECKPOINT_MODULE, _compat.CHECKPOINT_GENERATOR))


def _recompute_swapped(enter):
    """Activation checkpointing (``torch.utils.checkpoint``, transformers'
    ``gradient_checkpointing_enable()``) recomputes a part of the forward in the backward,
    after the call has put the module's own tensors back: it would recompute with those
    (stale, or full where the values are sharded) and give wrong gradients. Until the function
    this returns is called, every non-reentrant checkpoint made recomputes inside ``enter()`` (the
    values swapped in again): ``checkpoint``'s default ``context_fn`` becomes one whose
    recompute context is ``enter()``, and a ``context_fn`` the caller passes (selective
    activation checkpointing) gets ``enter()`` around its own recompute context (torch's
    non-reentrant generator, which ``checkpoint`` looks up at each call, is wrapped:
    :data:`fshard._compat.CHECKPOINT_GENERATOR`). A
    reentrant one (``use_reentrant=True``) has no recompute hook: the non-default
    ``context_fn`` makes torch refuse it ("Passing `context_fn` ... only supported when
    use_reentrant=False"). The function returned puts torch's own back (a function, not a
    context manager: one generator frame less per call)."""
    if torch.compiler.is_dynamo_compiling():  # dynamo traces checkpoint, recompute included
        return _nothing

    def ours():
        return contextlib.nullcontext(), enter()

    name = _compat.CHECKPOINT_GENERATOR
    prev = getattr(_CHECKPOINT_MODULE, name)

    def generator(*args, **kwargs):
        bound = _GENERATOR_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments["context_fn"]
        if given is not ours:

            def context_fn():
                forward, recompute = given()
                return forward, _Entered(recompute, enter())

            bound.arguments["context_fn"] = context_fn
        return prev(*bound.args, **bound.kwargs)

    defaults = _CHECKPOINT.__kwdefaults__
    default = defaults["context_fn"]

    def undo():
        defaults["context_fn"] = default
        setattr(_CHECKPOINT_MODULE, name, prev)

    defaults["context_fn"] = ours
    setattr(_CHECKPOINT_MODULE, name, generator)
    return undo


def _nothing() -> None:
    pass


class _Entered:
    """Context managers entered in order when this one is (not before), exited in reverse."""

    def __init__(self, *managers):
        self.managers, self.stack = managers, None

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for m in self.managers:
            self.stack.enter_context(m)
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def _one_rank_mesh(params: Mapping) -> Mesh | None:
    """The params' mesh when it has one rank (every axis of size 1) and every ShardedArray
    value lives on it; ``None`` otherwise, decided at the first ShardedArray on a bigger mesh.
    Also while dynamo traces (the checks are on static metadata, constants of the trace)."""
    mesh = None
    for v in params.values():
        if type(v) is ShardedArray:
            m = v.layout.mesh
            if mesh is None:
                if m.size_total != 1:
                    return None
                mesh = m
            elif m is not mesh and m != mesh:
                return None
    return mesh


def _replicated(mesh_of: str, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
    """The replicated layout of ``shape`` and ``dtype`` on the mesh of the layout whose token
    is ``mesh_of`` (arguments dynamo converts: see :func:`fshard._traced.constant`)."""
    return _layout(LAYOUT_OF_ID[mesh_of].mesh, _REPLICATED, shape, dtype)


def _run_local(module, params: Mapping, args: tuple, kwargs: dict, mesh: Mesh):
    """:func:`functional_call` on a one-rank mesh: every block is the whole value, so the module
    runs on the plain local tensors (no per-op dispatch: a one-GPU step costs what the plain
    step costs, and a compiled one traces the plain module, as ``torch.compile(model)`` does),
    and each tensor in the output comes back as a replicated ShardedArray of the mesh. Output
    entries of the plan reshard nothing here."""

    def unwrap(v):
        return v.local if type(v) is ShardedArray else v

    local = {k: unwrap(v) for k, v in params.items()}
    args, kwargs = pytree.tree_map(unwrap, (args, kwargs), is_leaf=is_sharded)
    with _called(module, local, {}):
        out = module(*args, **kwargs)
    if torch.compiler.is_dynamo_compiling():
        # a layout built while dynamo traces is not interned (its registry write is deferred):
        # the output layouts are constants of the trace, keyed by a param's layout token
        token = next(v.layout._id for v in params.values() if type(v) is ShardedArray)

        def layout(t):
            return constant(_replicated, token, tuple(map(operator.index, t.shape)), t.dtype)

    else:

        def layout(t):
            return _layout(mesh, _REPLICATED, tuple(t.shape), t.dtype)

    def wrap(t):
        return ShardedArray._raw(t, layout(t)) if isinstance(t, torch.Tensor) else t

    return pytree.tree_map(wrap, out, is_leaf=is_sharded)


def load_params(module: torch.nn.Module, params: Mapping, *, dst: int | None = None) -> None:
    """Write ``params`` (e.g. trained, sharded) back into the module's own tensors, in place.

    Every alias of a parameter is updated (they are one tensor). Sharded values are gathered,
    so every rank of their mesh must call this with the same ``params``; all names and shapes
    are checked before any communication.

    Args:
        module: the module :func:`shard_params` read.
        params: ``{name: ShardedArray | Tensor}`` (names as in ``named_parameters()``;
            buffers too).
        dst: ``None``: every rank's module is written. A rank: values are gathered to that rank
            only and only its module is written (the others may live on ``meta``).

    Returns:
        None; afterwards ``module.state_dict()`` holds the values.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = torch.nn.Linear(4, 2)
        >>> params = fs.nn.shard_params(model, mesh, {"weight": fs.P("tp")})
        >>> params = {k: v * 0 for k, v in params.items()}  # trained
        >>> fs.nn.load_params(model, params)  # gathered into the module's own tensors
        >>> float(model.weight.abs().sum())
        0.0
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping name -> value, got {type(params).__name__}")
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int)):
        raise TypeError(f"load_params: dst must be a rank (int) or None, got {dst!r}")
    targets = {}
    errors = LeafErrors("load_params: values whose shape does not fit the module", "params")
    for name, owner, attr, slot, value in _swap.targets(module, params, "load_params"):
        t = getattr(owner, slot)[attr]
        if tuple(value.shape) != tuple(t.shape):
            errors.add(
                f"[{name!r}]",
                f"shape {tuple(value.shape)}; the module's {type(owner).__name__}.{attr} has "
                f"shape {tuple(t.shape)}",
            )
        targets[id(t)] = (t, value)
    errors.raise_if_any()
    written = dst is None  # with dst: whether this rank is dst (its gathers return the values)
    for t, value in targets.values():
        full = value
        if isinstance(value, ShardedArray):
            full = gather(value, dst)
            if full is None:
                continue
            written = True
        elif dst is not None:
            raise TypeError("load_params: dst needs ShardedArray values (a tensor is local)")
        with torch.no_grad():
            t.copy_(full.detach())
    if written:
        _swap.held_here(module)


def state_dict(module: torch.nn.Module, params: Mapping) -> dict:
    """``module.state_dict()`` with the values of ``params`` in place of the module's own.

    A sharded state dict for :func:`fshard.checkpoint.save` (no communication): the same keys
    as ``module.state_dict()`` (tied aliases and persistent buffers included), each holding the
    ShardedArray from ``params`` where there is one, else the module's tensor (detached).

    Args:
        module: the module.
        params: ``{name: ShardedArray | Tensor}`` (e.g. from :func:`shard_params`).

    Returns:
        ``{state_dict key: ShardedArray | Tensor}``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = torch.nn.Linear(4, 2)
        >>> params = fs.nn.shard_params(model, mesh, {"weight": fs.P("tp")})
        >>> sd = fs.nn.state_dict(model, params)  # for fs.checkpoint.save
        >>> sorted(sd), sd["weight"].spec
        (['bias', 'weight'], P('tp'))
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping name -> value, got {type(params).__name__}")
    by_tensor = {
        id(getattr(o, s)[a]): v for _, o, a, s, v in _swap.targets(module, params, "state_dict")
    }
    out = {}
    with _swap.reading():
        module_state = module.state_dict(keep_vars=True)
    for key, t in module_state.items():
        out[key] = by_tensor.get(id(t), t.detach() if isinstance(t, torch.Tensor) else t)
    return out
