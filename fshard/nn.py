"""Sharding ``torch.nn.Module`` parameters and running modules functionally on them.

``shard_params(module, mesh, plan)`` turns a module's parameters into a flat dict
``name -> ShardedArray``; ``functional_call(module, params, args)`` runs the module's own
``forward`` with those values swapped in. Because the params dict is a pytree of
ShardedArrays (whose only pytree child is the local tensor), ``torch.func.grad`` /
``vmap(grad)`` of a loss built on ``functional_call`` return gradients with the params'
layouts, and :mod:`fshard.optim` updates them::

    params = fs.nn.shard_params(model, mesh, fs.nn.megatron_plan(column=["*.fc1"], row=["*.fc2"]))
    loss_fn = lambda ps, x, y: F.mse_loss(fs.nn.functional_call(model, ps, (x,)), y)
    grads = torch.func.grad(loss_fn)(params, x, y)

Inside ``forward``, ``F.linear(x, self.weight)`` etc. receive ShardedArrays and dispatch to
fshard's op rules through ``__torch_function__``; a forward written on local tensors with
:mod:`fshard.lax` collectives (reading ``self.weight.local``) works as well.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping

import torch

from .api import shard
from .array import ShardedArray
from .mesh import Mesh
from .spec import P

__all__ = ["shard_params", "functional_call", "megatron_plan", "match_plan"]


def _matcher(pattern: str):
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"plan keys must be non-empty strings, got {pattern!r}")
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"plan pattern {pattern!r} is not a valid regex: {e}") from e
        return lambda name: rx.fullmatch(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def match_plan(names: Iterable[str], plan: Mapping[str, P]) -> dict[str, P]:
    """Resolve ``plan`` against parameter ``names``: ``{name: spec}`` for every name.

    Patterns are fnmatch globs matched against the full dotted name (``"*.fc1.weight"``,
    ``"blocks.*.attn.qkv.*"``; ``*`` also matches dots), or regexes prefixed with ``"re:"``
    (``"re:blocks\\.[0-3]\\.mlp\\.fc1\\.weight"``, matched with ``fullmatch``). Patterns are
    tried in the plan's order and the **first match wins**. Unmatched names are replicated
    (``P()``). A pattern that matches no name is an error (a typo would otherwise silently
    replicate a layer).

    Args:
        names: parameter names (``module.named_parameters()`` order).
        plan: ``{pattern: P}``.

    Returns:
        ``{name: spec}`` in ``names`` order.

    Example:
        >>> match_plan(["fc.weight", "fc.bias"], {"*.weight": P("tp")})
        {'fc.weight': P('tp'), 'fc.bias': P()}
    """
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping pattern -> fs.P, got {type(plan).__name__}")
    rules = []
    for pattern, spec in plan.items():
        if not isinstance(spec, P):
            raise TypeError(f"plan[{pattern!r}] must be a fs.P, got {type(spec).__name__} {spec!r}")
        rules.append((pattern, _matcher(pattern), spec))
    used = set()
    out = {}
    for name in names:
        out[name] = P()
        for pattern, match, spec in rules:
            if match(name):
                out[name] = spec
                used.add(pattern)
                break
    unused = [p for p, _, _ in rules if p not in used]
    if unused:
        raise ValueError(
            f"plan pattern(s) {unused} match no parameter (or only ones an earlier pattern "
            f"took); parameter names are e.g. {list(out)[:6]}. Globs use fnmatch against "
            "the full dotted name; prefix a regex with 're:'"
        )
    return out


def shard_params(
    module: torch.nn.Module, mesh: Mesh, plan: Mapping[str, P] | None = None, *, src=None
) -> dict[str, ShardedArray]:
    """Shard a module's parameters following ``plan``.

    Args:
        module: the module. With ``src=None`` every rank must hold the same values (e.g. the
            same seed before construction); each keeps its block, no communication.
        mesh: the mesh.
        plan: ``{pattern: P}``, see :func:`match_plan` (globs, or ``"re:"`` regexes; first
            match wins; unmatched params are replicated; a pattern matching nothing raises).
            Specs index the parameter as torch stores it (``nn.Linear.weight`` is
            ``(out_features, in_features)``).
        src: a rank: only that rank's values are used; they are scattered (each rank receives
            its block). Other ranks' modules only provide names, shapes and dtypes (they may
            live on the ``meta`` device).

    Returns:
        ``{name: ShardedArray}`` in ``named_parameters()`` order (detached values).

    Example:
        >>> plan = {"*.fc1.weight": fs.P("tp", None), "*.fc2.weight": fs.P(None, "tp")}  # doctest: +SKIP
        >>> params = fs.nn.shard_params(model, mesh, plan)  # doctest: +SKIP
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a fshard.Mesh, got {type(mesh).__name__}")
    named = dict(module.named_parameters())
    specs = match_plan(named, plan or {})
    out = {}
    for name, p in named.items():
        spec = specs[name]
        if len(spec) > p.dim():
            raise ValueError(
                f"plan gives {name} (shape {tuple(p.shape)}) the spec {spec}, which has more "
                "entries than the parameter has dims"
            )
        if src is None:
            out[name] = shard(p.detach(), mesh, spec)
        else:
            t = p.detach() if mesh.rank == src else None
            out[name] = shard(t, mesh, spec, src=src, shape=tuple(p.shape), dtype=p.dtype)
    return out


def _resolve(module: torch.nn.Module, name: str):
    *path, attr = name.split(".")
    owner = module
    for part in path:
        sub = owner._modules.get(part)
        if sub is None:
            raise ValueError(
                f"functional_call: {name!r} is not a parameter or buffer of the module"
            )
        owner = sub
    if attr in owner._parameters:
        return owner, attr, "_parameters"
    if attr in owner._buffers:
        return owner, attr, "_buffers"
    raise ValueError(f"functional_call: {name!r} is not a parameter or buffer of the module")


def functional_call(module: torch.nn.Module, params: Mapping, args=(), kwargs=None):
    """Run ``module(*args, **kwargs)`` with the parameters (and buffers) in ``params``.

    ``torch.func.functional_call`` refuses non-Tensor values, so this swaps the values into
    the module itself: each named entry is popped from its owner's ``_parameters`` (or
    ``_buffers``) and set in the owner's ``__dict__``; everything is restored afterwards, also
    when ``forward`` raises. Names missing from ``params`` keep the module's own tensors. Not
    thread-safe for concurrent calls on one module.

    Args:
        module: the module.
        params: ``{name: ShardedArray | Tensor}`` (names as in ``named_parameters()``).
        args: a tuple of positional arguments (a single non-tuple value is wrapped).
        kwargs: keyword arguments.

    Returns:
        Whatever ``module.forward`` returns.

    Example:
        >>> out = fs.nn.functional_call(model, params, (x,))  # doctest: +SKIP
        >>> grads = torch.func.grad(lambda ps: loss(fs.nn.functional_call(model, ps, (x,))))(params)  # doctest: +SKIP
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping name -> value, got {type(params).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping or None, got {type(kwargs).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    targets = []
    for name, value in params.items():
        if not isinstance(value, (torch.Tensor, ShardedArray)):
            raise TypeError(
                f"params[{name!r}] is a {type(value).__name__}; values must be ShardedArrays "
                "or tensors"
            )
        targets.append((*_resolve(module, name), value))
    saved = []
    try:
        for owner, attr, slot, value in targets:
            original = getattr(owner, slot).pop(attr)
            saved.append((owner, attr, slot, original))
            owner.__dict__[attr] = value
        return module(*args, **(kwargs or {}))
    finally:
        for owner, attr, slot, original in reversed(saved):
            owner.__dict__.pop(attr, None)
            getattr(owner, slot)[attr] = original


def megatron_plan(
    column: Iterable[str] = (),
    row: Iterable[str] = (),
    vocab: Iterable[str] = (),
    axis: str = "tp",
    bias: bool = True,
) -> dict[str, P]:
    """A Megatron tensor-parallel plan for ``nn.Linear`` / ``nn.Embedding`` modules.

    Args:
        column: module-name globs of column-parallel Linears (qkv, fc1): the weight
            ``(out, in)`` is split on out-features ``P(axis, None)``, the bias ``P(axis)``;
            their outputs are sharded on the last dim.
        row: globs of row-parallel Linears (attention out-proj, fc2): the weight is split on
            in-features ``P(None, axis)``; the bias stays replicated (added once after the
            reduction).
        vocab: globs of vocab-parallel Embeddings: the weight ``(vocab, dim)`` is ``P(axis)``.
        axis: the tensor-parallel mesh axis.
        bias: whether the column-parallel Linears have a bias (its pattern must match).

    Returns:
        A plan for :func:`shard_params`; everything else (LayerNorm, position embeddings) is
        replicated.

    Example:
        >>> megatron_plan(column=["*.fc1"], row=["*.fc2"])
        {'*.fc1.weight': P('tp', None), '*.fc1.bias': P('tp'), '*.fc2.weight': P(None, 'tp')}
    """
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"axis must be a mesh axis name, got {axis!r}")
    for arg, value in (("column", column), ("row", row), ("vocab", vocab)):
        if isinstance(value, str):
            raise TypeError(f"{arg} must be a list of globs, not a string ({value!r}); wrap it")
    plan: dict[str, P] = {}
    for m in column:
        plan[f"{m}.weight"] = P(axis, None)
        if bias:
            plan[f"{m}.bias"] = P(axis)
    for m in row:
        plan[f"{m}.weight"] = P(None, axis)
    for m in vocab:
        plan[f"{m}.weight"] = P(axis, None)
    return plan


from .fsdp import fsdp_call, fsdp_gather, fsdp_plan, fsdp_units  # noqa: E402, F401
