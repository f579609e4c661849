"""Sharding ``torch.nn.Module`` parameters and running modules functionally on them.

``shard_params(module, mesh, plan)`` turns a module's parameters into a flat dict
``name -> ShardedArray``; ``functional_call(module, params, args)`` runs the module's own
``forward`` with those values swapped in. Because the params dict is a pytree of
ShardedArrays (whose only pytree child is the local tensor), ``torch.func.grad`` /
``vmap(grad)`` of a loss built on ``functional_call`` return gradients with the params'
layouts, and :mod:`fshard.optim` updates them; ``load_params`` writes trained values back
into the module, ``state_dict`` gives a sharded state dict for :mod:`fshard.checkpoint`::

    plan = fs.nn.megatron_plan(column=["*.fc1"], row=["*.fc2"])
    params = fs.nn.shard_params(model, mesh, plan)
    loss_fn = lambda ps, x, y: F.mse_loss(fs.nn.functional_call(model, ps, (x,)), y)
    grads = torch.func.grad(loss_fn)(params, x, y)
    fs.nn.load_params(model, params)  # model.state_dict() now holds the trained values

From ``shard_params`` on, ``model.state_dict()`` raises until ``load_params`` (the module's own
tensors are not what training produces).

A plan maps globs to ``fs.P`` (a parameter's layout) or to :class:`Output` (a module's
output layout, DTensor's ``output_layouts``: e.g. reduce a row-parallel Linear's pending sum
right after it, so the residual stream stays replicated).

Inside ``forward``, ``F.linear(x, self.weight)`` etc. receive ShardedArrays and dispatch to
fshard's op rules through ``__torch_function__``; a forward written on local tensors with
:mod:`fshard.lax` collectives (reading ``self.weight.local``) works as well.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> _ = torch.manual_seed(0)  # every rank builds the same weights
    >>> model = torch.nn.Linear(4, 2)
    >>> params = fs.nn.shard_params(model, mesh, {"weight": fs.P("tp")})
    >>> out = fs.nn.functional_call(model, params, (torch.ones(1, 4),))
    >>> torch.allclose(fs.gather(out), model(torch.ones(1, 4)))
    True
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Iterable, Mapping

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from . import _compat, _swap
from ._leaf_errors import LeafErrors
from .api import gather, reshard, shard
from .array import ShardedArray, is_sharded
from .fsdp import fsdp_call, fsdp_gather, fsdp_plan, fsdp_units  # noqa: F401 (fs.nn API)
from .mesh import Mesh
from .nn_plan import Output, _match, _matcher, _split_plan, match_plan
from .spec import Layout, P, _layout
from .tree import tree_leaves

__all__ = [
    "Output",
    "shard_params",
    "functional_call",
    "load_params",
    "state_dict",
    "megatron_plan",
    "hf_tp_plan",
    "match_plan",
]


_REPLICATED = P()

# module -> {submodule name: output spec}, recorded by the last shard_params on it
_OUTPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "meta" or b.device.type == "meta":
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def shard_params(
    module: torch.nn.Module, mesh: Mesh, plan: Mapping[str, P | Output] | None = None, *, src=None
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
    ``transformer.wte.weight``) appear once, under their first name; :func:`functional_call`
    gives every alias that value.

    Args:
        module: the module. With ``src=None`` every rank must hold the same values (e.g. the
            same seed before construction); each keeps its block, no communication.
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

    Returns:
        ``{name: ShardedArray}`` in ``named_parameters()`` order (detached copies).

    Example:
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> plan = {"0.weight": fs.P("tp", None), "0.bias": fs.P("tp"), "2.weight": fs.P(None, "tp")}
        >>> params = fs.nn.shard_params(model, mesh, plan)  # the rest replicated
        >>> params["0.weight"].spec, params["0.weight"].local.shape, params["2.bias"].spec
        (P('tp', None), torch.Size([4, 4]), P())
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a fshard.Mesh, got {type(mesh).__name__}")
    named = dict(module.named_parameters())
    param_rules, output_rules = _split_plan(plan)
    specs = match_plan(named, param_rules)
    outputs = _match((n for n, _ in module.named_modules()), output_rules, "module")
    errors = LeafErrors("shard_params: parameters the plan's specs do not fit", "params")
    for name, p in named.items():  # every layout checked before any parameter is sharded
        try:
            Layout(mesh, specs[name], tuple(p.shape), p.dtype)
        except (TypeError, ValueError) as e:
            errors.add(f"[{name!r}]", f"shape {tuple(p.shape)}, spec {specs[name]}: {e}")
    errors.raise_if_any(fix="fix the plan's pattern or spec for these parameters")
    out = {}
    for name, p in named.items():
        spec, t = specs[name], p.detach()
        if src is None:
            x = shard(t, mesh, spec)
        else:
            x = shard(
                t if mesh.rank == src else None, mesh, spec, src=src, shape=t.shape, dtype=t.dtype
            )
        if _shares_storage(x.local, t):
            x = ShardedArray._raw(x.local.clone(), x.layout)
        out[name] = x
    if src is not None:
        _broadcast_buffers(module, mesh, src)
    _OUTPUTS[module] = outputs
    _swap.hold_elsewhere(module)
    if not _compat.TRACES_ATTRIBUTE_DELETE:
        # functional_call leaves these modules' ``forward`` bound on the instance under an
        # older dynamo (it cannot delete it): bind it now, so the first compiled call sees the
        # state every later one does (no recompile on the second step)
        for name in outputs:
            sub = module.get_submodule(name)
            sub.__dict__.setdefault("forward", sub.forward)
    return out


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

    Returns:
        Whatever ``module.forward`` returns.

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
        outputs = _OUTPUTS.get(module, {})
    else:
        if not isinstance(outputs, Mapping):
            raise TypeError(f"outputs must be a mapping glob -> fs.P, got {outputs!r}")
        _, outputs = _split_plan({k: Output(v) for k, v in outputs.items()})
        outputs = _match((n for n, _ in module.named_modules()), outputs, "module")
    if not isinstance(args, tuple):
        args = (args,)
    mesh = _one_rank_mesh(params)
    if mesh is not None:
        return _run_local(module, params, args, kwargs or {}, mesh)
    with _called(module, params, outputs):
        return module(*args, **(kwargs or {}))


@contextlib.contextmanager
def _called(module: torch.nn.Module, values: Mapping, outputs: Mapping[str, P]):
    """``values`` swapped into ``module`` and its :class:`Output` layouts applied, for the
    duration of the block, and again whenever activation checkpointing recomputes a part of
    the forward in the backward (see :func:`_recompute_swapped`)."""
    patched = []
    with _swap.swap(module, values, "functional_call"):
        try:
            for name, spec in outputs.items():
                sub = module.get_submodule(name)
                patched.append((sub, sub.__dict__.get("forward", _NONE), sub.forward))
                sub.__dict__["forward"] = _with_output(sub.forward, name, spec)
            with _recompute_swapped(lambda: _called(module, values, outputs)):
                yield
        finally:
            for sub, forward, bound in reversed(patched):
                if forward is not _NONE:
                    sub.__dict__["forward"] = forward
                elif _compat.TRACES_ATTRIBUTE_DELETE or not torch.compiler.is_dynamo_compiling():
                    del sub.__dict__["forward"]
                else:  # the class's forward, bound, left as the instance's: the same calls
                    sub.__dict__["forward"] = bound


#: torch.utils.checkpoint.checkpoint without its dynamo-disabling wrapper: its keyword defaults
_CHECKPOINT = inspect.unwrap(torch.utils.checkpoint.checkpoint)


@contextlib.contextmanager
def _recompute_swapped(enter):
    """Activation checkpointing (``torch.utils.checkpoint``, transformers'
    ``gradient_checkpointing_enable()``) recomputes a part of the forward in the backward,
    after the call has put the module's own tensors back: it would recompute with those
    (stale, or full where the values are sharded) and give wrong gradients. For the block,
    ``checkpoint``'s default ``context_fn`` is one whose recompute context is ``enter()`` (the
    values swapped in again), so every non-reentrant checkpoint made inside the call recomputes
    with them. A reentrant one (``use_reentrant=True``) has no recompute hook: torch refuses
    it then ("Passing `context_fn` ... only supported when use_reentrant=False"). A
    ``context_fn`` passed explicitly is used as given, and its recompute does not see the
    values (not detected)."""
    if torch.compiler.is_dynamo_compiling():  # dynamo traces checkpoint, recompute included
        yield
        return
    defaults = _CHECKPOINT.__kwdefaults__
    given = defaults["context_fn"]
    defaults["context_fn"] = lambda: (contextlib.nullcontext(), enter())
    try:
        yield
    finally:
        defaults["context_fn"] = given


def _one_rank_mesh(params: Mapping) -> Mesh | None:
    """The params' mesh when it has one rank (every axis of size 1) and every ShardedArray
    value lives on it; ``None`` otherwise, decided at the first ShardedArray on a bigger mesh.
    Not while dynamo traces: a compiled step's plans are constants already."""
    if torch.compiler.is_dynamo_compiling():
        return None
    mesh = None
    for v in params.values():
        if type(v) is ShardedArray:
            m = v.layout.mesh
            if mesh is None:
                if m.size(m.axis_names) != 1:
                    return None
                mesh = m
            elif m is not mesh and m != mesh:
                return None
    return mesh


def _run_local(module, params: Mapping, args: tuple, kwargs: dict, mesh: Mesh):
    """:func:`functional_call` on a one-rank mesh: every block is the whole value, so the module
    runs on the plain local tensors (no per-op dispatch: a one-GPU step costs what the plain
    step costs), and each tensor in the output comes back as a replicated ShardedArray of the
    mesh. Output entries of the plan reshard nothing here."""

    def unwrap(v):
        return v.local if type(v) is ShardedArray else v

    local = {k: unwrap(v) for k, v in params.items()}
    args, kwargs = pytree.tree_map(unwrap, (args, kwargs), is_leaf=is_sharded)
    with _called(module, local, {}):
        out = module(*args, **kwargs)

    def wrap(t):
        if isinstance(t, torch.Tensor):
            return ShardedArray._raw(t, _layout(mesh, _REPLICATED, tuple(t.shape), t.dtype))
        return t

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


#: weight dim of the out-features and of the in-features, per module kind
_WEIGHT_DIMS = {"linear": (0, 1), "conv1d": (1, 0), "conv": (0, 1)}


def _linear_kind(mod: torch.nn.Module, name: str) -> str:
    """``"linear"`` (weight (out, in)), ``"conv1d"`` (HF GPT-2 Conv1D, weight (in, out)),
    ``"conv"`` (``nn.Conv1d/2d/3d``, weight (out, in, *kernel))."""
    if isinstance(mod, torch.nn.Linear):
        return "linear"
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx"):
        return "conv1d"
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    if isinstance(mod, conv) and mod.groups == 1:
        return "conv"
    what = f"a {type(mod).__name__}"
    if isinstance(mod, conv):
        what += f" with groups={mod.groups} (its channels are split per group)"
    raise TypeError(
        f"megatron_plan: module {name!r} is {what}; column/row splits know nn.Linear, "
        "transformers' Conv1D and nn.Conv1d/2d/3d with groups=1; write its fs.P entries by hand"
    )


def _kind_of(module, glob: str, arg: str) -> tuple[str, list]:
    mods = [(n, m) for n, m in module.named_modules() if _matcher(glob)(n)]
    if not mods:
        raise ValueError(f"megatron_plan: {arg} glob {glob!r} matches no module of the model")
    kinds = {_linear_kind(m, n) for n, m in mods}
    if len(kinds) > 1:
        raise ValueError(
            f"megatron_plan: {arg} glob {glob!r} matches modules of kinds {sorted(kinds)} "
            "(their weights store the features in different dims); split it into one glob "
            "per kind"
        )
    return kinds.pop(), mods


def _split_dim(kind: str, axis: str, which: int) -> P:
    """The weight spec of ``kind`` split over ``axis`` on its out- (0) or in-features (1)."""
    dim = _WEIGHT_DIMS[kind][which]
    return P(*[axis if d == dim else None for d in range(max(dim + 1, 2))])


def _features(mod, kind: str) -> tuple[int, int]:
    if kind == "conv1d":
        return mod.nf, mod.nx
    if kind == "conv":
        return mod.out_channels, mod.in_channels
    return mod.out_features, mod.in_features


def _fused_parts(model: torch.nn.Module, name: str, out_f: int, in_f: int, column) -> str | None:
    """What column projection ``name`` (of ``out_f`` features) looks like from the model's
    config: a fused ``[q | k | v]`` with fewer kv heads, or a fused ``[gate | up]``; ``None``
    otherwise. Only a projection of the hidden state that is the one column projection of its
    parent module (a Llama ``q_proj`` has the siblings ``k_proj``, ``v_proj``) and not the
    output embedding is taken for fused."""
    cfg = getattr(model, "config", None)
    get = lambda *names: next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), None)  # noqa: E731
    parent = name.rpartition(".")[0]
    if any(n != name and n.rpartition(".")[0] == parent for n in column):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if in_f != get("hidden_size", "n_embd", "d_model") or model.get_submodule(name) is head:
        return None
    heads = get("num_attention_heads", "n_head", "num_heads")
    if heads and isinstance(heads, int):
        head_dim = get("head_dim") or in_f // heads
        for kv in (get("num_key_value_heads", "num_kv_heads"), 1 if get("multi_query") else None):
            if kv and kv != heads and out_f == (heads + 2 * kv) * head_dim:
                return f"[q | k | v] with {heads} query and {kv} key/value heads"
    inter = get("intermediate_size", "ffn_dim", "n_inner")
    if isinstance(inter, int) and out_f == 2 * inter:
        return f"[gate | up] of {inter} features each"
    return None


#: transformers' styles that declare a plain contiguous column split head-aligned
_HF_ALIGNED = ("colwise",)


def _shipped_style(model: torch.nn.Module, name: str) -> str | None:
    """The style the model's own tensor-parallel plan gives module ``name`` (None: none)."""
    for pattern, style in _hf_entries(model).items():
        if _matcher(pattern)(name):
            return style
    return None


def _check_fused(name: str, mod, kind: str, axis: str, model, column) -> None:
    """Refuse or warn about a column split of a fused projection that is not head-aligned.

    A contiguous split of the out-features gives each rank whole heads only when the features
    are head-major (GPT-NeoX's ``[h0: q k v | h1: q k v | ...]``): the model's own plan says so
    (style ``colwise``), and that split is taken without a warning. Parts of different sizes
    (``[q | k | v]`` with fewer kv heads, ``[gate | up]``) need a per-part split, which a
    contiguous ``fs.P`` block cannot express: values stay correct, but every step gathers
    and re-splits the parts (Phi-3 on 2 ranks: 6 all_gathers per layer and step), so it warns
    with that cost."""
    out_f, in_f = _features(mod, kind)
    if _shipped_style(model, name) in _HF_ALIGNED:
        return
    parts = _fused_parts(model, name, out_f, in_f, column)
    if out_f != 3 * in_f and parts is None:
        return
    msg = f"megatron_plan: column split of {name!r} (and the modules its glob matches) over {axis!r}: its {out_f} out-features "
    if kind == "conv1d" and out_f == 3 * in_f:  # HF GPT-2 family: [q | k | v], split(n_embd)
        raise ValueError(
            f"{msg}look like a fused [q | k | v] projection stored [q | k | v] (transformers' "
            "Conv1D, GPT-2's c_attn); a contiguous split is not head-aligned (rank 0 would get "
            "all of q and part of k, so the attention would reshuffle heads across ranks every "
            "step). Leave it out of column= (replicated; the row-parallel c_proj after the "
            "attention then slices its input for free), or permute its out-features head-major "
            "and split by hand"
        )
    if parts is not None:
        warnings.warn(
            f"{msg}are a fused {parts}; a contiguous split gives rank 0 other parts than rank "
            "1, so every step all-gathers and re-splits them (values stay correct). Leave it "
            "out of column= (replicated: the row-parallel layer after it slices its input for "
            "free), or use separate projections",
            stacklevel=4,
        )
        return
    warnings.warn(
        f"{msg}= 3 x {in_f} look like a fused q|k|v projection and the model's plan does not "
        "say how they are ordered: a contiguous split is head-aligned if they are head-major "
        "([h0: q k v | h1: q k v | ...], GPT-NeoX, Falcon); if they are [q | k | v] "
        "concatenated, leave it out of column= (values stay correct, but heads move across "
        "ranks every step)",
        stacklevel=4,
    )


def megatron_plan(
    column: Iterable[str] = (),
    row: Iterable[str] = (),
    vocab: Iterable[str] = (),
    axis: str = "tp",
    bias: bool = True,
    *,
    row_output: P | None = _REPLICATED,
    model: torch.nn.Module | None = None,
    sequence_parallel: bool = False,
) -> dict[str, P | Output]:
    """A Megatron tensor-parallel plan for ``nn.Linear`` / ``Conv1D`` / ``nn.Conv1d/2d/3d`` /
    ``nn.Embedding``.

    Args:
        column: module-name globs of column-parallel layers (q/k/v, fc1): the weight is split
            on out-features (``nn.Linear`` ``(out, in)``: ``P(axis, None)``; transformers'
            ``Conv1D`` ``(in, out)``: ``P(None, axis)``; ``nn.Conv2d`` ``(out, in, kh, kw)``:
            its out-channels, ``P(axis, None)``), the bias ``P(axis)``; their outputs are
            sharded on the feature dim (the last; a convolution's channel dim 1).
        row: globs of row-parallel layers (attention out-proj, fc2, a ViT's patch-embedding
            ``Conv2d``): the weight is split on in-features (a convolution's in-channels, so a
            replicated input is sliced for free); the bias stays replicated (added once, by
            the first rank's addend of the pending sum; its gradient needs no collective).
        vocab: globs of vocab-parallel Embeddings: the weight ``(vocab, dim)`` is ``P(axis)``.
        axis: the tensor-parallel mesh axis.
        bias: whether the column-parallel layers have a bias (its pattern must match).
            Ignored when ``model`` is given (read from the modules).
        row_output: the layout each row-parallel layer's (and vocab-parallel Embedding's)
            output, a pending sum, is resharded to right after it (an :class:`Output` entry):
            ``P()`` (default, DTensor's ``RowwiseParallel``) all-reduces the pending sum once,
            so the residual stream and every norm after it stay replicated; ``P(None, axis)``
            reduce-scatters over the sequence dim; ``None`` leaves the sum pending for the op
            rules.
        model: the model. When given, each glob must match modules of the model, the weight
            dim is chosen by module type (``Conv1D`` stores its weight transposed), biases are
            detected, and fused projections in ``column`` are checked: a head-major fused
            q|k|v (GPT-NeoX; the model's own plan gives it the style ``colwise``) is split
            contiguously without a warning; GPT-2's ``Conv1D`` ``[q | k | v]`` is refused (never
            head-aligned); fused parts of different sizes read from the config (``[q | k | v]``
            with fewer kv heads, multi-query, ``[gate | up]``: Phi-3, Falcon) warn with their
            cost, since a contiguous ``fs.P`` block cannot give each rank a slice of every part
            (leave them out of ``column=``: replicated, and the row-parallel layer after them
            slices its input for free); an ``nn.Linear`` with out = 3 x in whose order the
            model does not declare warns that it must be head-major.
        sequence_parallel: Megatron-SP (batch-first activations): ``row_output`` becomes
            ``P(None, axis)``, so norms, dropout and residual adds run on sequence-split
            activations; each column-parallel layer's input is all-gathered (reduce-scattered
            in the backward). See :func:`fshard.parallel.sequence_parallel_plan`.

    Returns:
        A plan for :func:`shard_params`; everything else (norms, position embeddings) is
        replicated.

    Example:
        >>> megatron_plan(column=["*.fc1"], row=["*.fc2"])
        {'*.fc1.weight': P('tp', None), '*.fc1.bias': P('tp'), '*.fc2.weight': P(None, 'tp'), '*.fc2': Output(spec=P())}
    """
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"axis must be a mesh axis name, got {axis!r}")
    for arg, value in (("column", column), ("row", row), ("vocab", vocab)):
        if isinstance(value, str):
            raise TypeError(f"{arg} must be a list of globs, not a string ({value!r}); wrap it")
    if sequence_parallel:
        if row_output is not _REPLICATED and row_output != P(None, axis):
            raise ValueError(
                f"sequence_parallel=True sets row_output=P(None, {axis!r}); got row_output="
                f"{row_output!r} too. Pass one of them"
            )
        row_output = P(None, axis)
    if row_output is not None and not isinstance(row_output, P):
        raise TypeError(f"row_output must be a fs.P or None, got {row_output!r}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    plan: dict[str, P | Output] = {}
    column = list(column)
    if model is not None:
        found = {m: _kind_of(model, m, "column") for m in column}
        names = {n for _, mods in found.values() for n, _ in mods}
    for m in column:
        kind, has_bias = "linear", bias
        if model is not None:
            kind, mods = found[m]
            has_bias = any(getattr(mod, "bias", None) is not None for _, mod in mods)
            _check_fused(*mods[0], kind, axis, model, names)  # one check (and warning) per glob
        plan[f"{m}.weight"] = _split_dim(kind, axis, 0)
        if has_bias:
            plan[f"{m}.bias"] = P(axis)
    for m in row:
        kind = _kind_of(model, m, "row")[0] if model is not None else "linear"
        plan[f"{m}.weight"] = _split_dim(kind, axis, 1)
    for m in vocab:
        plan[f"{m}.weight"] = P(axis, None)
    if row_output is not None:  # a row-parallel layer's and a vocab-parallel lookup's output
        for m in (*row, *vocab):  # is a pending sum
            plan[m] = Output(row_output)
    return plan


#: transformers' tensor-parallel styles (``config.base_model_tp_plan``, ``model._tp_plan``) and
#: the megatron_plan role each maps to. An output transformers gathers (``colwise_gather_output``,
#: ``colwise_rep``) stays split here: in fshard's global view the next op reads a split value as
#: it reads a full one (same values), and the gather is left to the op that needs it.
_HF_STYLES = {
    "colwise": "column",
    "colwise_gather_output": "column",
    "colwise_rep": "column",
    "rowwise": "row",
    "rowwise_rep": "row",
    "rowwise_split_input": "row",
    "embedding_rowwise": "vocab",
    "replicate": None,
}


def _hf_entries(model: torch.nn.Module) -> dict[str, str]:
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    out = dict(getattr(model, "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_base = prefix and isinstance(getattr(model, prefix, None), torch.nn.Module)
    for k, v in base.items():
        out[f"{prefix}.{k}" if has_base else k] = v
    return out


def hf_tp_plan(
    model: torch.nn.Module,
    axis: str = "tp",
    *,
    unsupported: str = "error",
    row_output: P | None = _REPLICATED,
) -> dict[str, P | Output]:
    """The tensor-parallel plan a ``transformers`` model ships, as a fshard plan.

    Reads ``model.tp_plan`` (``config.base_model_tp_plan`` under the base model's prefix, plus
    the head's ``_tp_plan``) and maps each style to :func:`megatron_plan`'s roles:
    ``colwise`` (and ``colwise_gather_output``, ``colwise_rep``: the output stays split, see
    below) to ``column``, ``rowwise`` (``rowwise_rep``, ``rowwise_split_input``) to ``row``,
    ``embedding_rowwise`` to ``vocab``, ``replicate`` to nothing. An output transformers
    gathers stays split over ``axis`` here: fshard's global view reads it as it reads the full
    value (the same numbers), and only an op that needs it whole gathers it. Styles with no
    fshard equivalent yet (``packed_colwise`` fused projections, MoE experts, ``sequence_parallel``
    ...) raise a ``ValueError`` listing them, or, with ``unsupported="replicate"``, leave those
    modules replicated (correct, less sharded).

    Args:
        model: a ``transformers`` model (``PreTrainedModel``).
        axis: the tensor-parallel mesh axis.
        unsupported: ``"error"`` (default) or ``"replicate"``.
        row_output: as in :func:`megatron_plan`.

    Returns:
        A plan for :func:`shard_params` (checked against the model by :func:`megatron_plan`).

    Example:
        >>> import transformers
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> plan = fs.nn.hf_tp_plan(model)  # the plan Llama ships, as fshard specs
        >>> params = fs.nn.shard_params(model, mesh, plan)
        >>> params["model.layers.0.self_attn.q_proj.weight"].spec
        P('tp', None)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"hf_tp_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if unsupported not in ("error", "replicate"):
        raise ValueError(
            f"hf_tp_plan: unsupported must be 'error' or 'replicate', got {unsupported!r}"
        )
    entries = _hf_entries(model)
    if not entries:
        raise ValueError(
            f"hf_tp_plan: {type(model).__name__} ships no tensor-parallel plan (neither "
            "config.base_model_tp_plan nor _tp_plan); write one with fs.nn.megatron_plan"
        )
    roles: dict[str, list[str]] = {"column": [], "row": [], "vocab": []}
    skipped = []
    names = [n for n, _ in model.named_modules()]
    for pattern, style in entries.items():
        if style not in _HF_STYLES:
            skipped.append(f"{pattern!r}: {style!r}")
        elif _HF_STYLES[style] is not None:
            match = _matcher(pattern)
            if not any(match(n) for n in names):  # a fused parameter (MoE experts), no module
                skipped.append(f"{pattern!r}: {style!r} (a parameter, not a module)")
            else:
                roles[_HF_STYLES[style]].append(pattern)
    if skipped and unsupported == "error":
        raise ValueError(
            f"hf_tp_plan: {type(model).__name__}'s plan has styles with no fshard equivalent "
            f"yet: {', '.join(skipped)}. Pass unsupported='replicate' to keep those modules "
            "replicated (values are the same; they are not sharded), or write the plan with "
            "fs.nn.megatron_plan"
        )
    return megatron_plan(**roles, axis=axis, row_output=row_output, model=model)
