"""Sharding plans for ``torch.nn`` modules: ``{pattern: fs.P | Output}`` matched against
parameter and module names (:func:`match_plan`).

Shared by :mod:`fshard.module` (``shard_params``, ``functional_call``; :mod:`fshard.nn`
re-exports :class:`Output` and :func:`match_plan`) and the strategies of :mod:`fshard.parallel`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .spec import P, Parts

__all__ = ["Output", "LocalRows", "match_plan"]


class Output(NamedTuple):
    """Plan value: reshard the output of every module the key matches to ``spec``.

    The key is a glob (or ``"re:"`` regex) over module names (``named_modules()``), e.g.
    ``{"*.o_proj": fs.nn.Output(fs.P())}``: ``o_proj``'s pending sum is all-reduced right
    after it (DTensor ``RowwiseParallel(output_layouts=Replicate())``);
    ``fs.nn.Output(fs.P(None, "tp"))`` reduce-scatters it over the sequence dim instead.
    Applied by :func:`functional_call` to a module output that is a ShardedArray; plain
    tensor outputs (a dense call, a local-view forward) are left alone.

    Example:
        >>> Output(P())
        Output(spec=P())
    """

    spec: P


class LocalRows(NamedTuple):
    """Plan value: run every module the key matches on this rank's rows of the batch.

    The key is a glob over module names, e.g. ``{"*.mlp": fs.nn.LocalRows("dp")}`` for the
    MoE blocks of a transformers model in data parallelism: a router's ``torch.where`` over
    the expert mask has a value-dependent shape, which the global view refuses on a batch split
    over ``dp``; on its own rows each rank routes its tokens itself (as :func:`fsdp_call` runs a
    whole module). The module's parameters must be replicated and its ShardedArray inputs
    split over ``axis`` on their first dim; its outputs are split the same way. It runs under
    :func:`fshard.shard_map` (in_specs ``P()`` for the parameters, ``P(axis)`` for the
    inputs, out_specs ``P(axis)``), so the parameters' gradients are summed over ``axis``.

    Example:
        >>> LocalRows("dp")
        LocalRows(axis='dp')
    """

    axis: str = "dp"


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


def _match(names: Iterable[str], rules: Mapping, what: str) -> dict:
    """``{name: value}`` of the first rule matching each name (names no rule matches are
    left out); a rule that matches nothing raises."""
    compiled = [(pattern, _matcher(pattern), value) for pattern, value in rules.items()]
    used, out, names = set(), {}, list(names)
    for name in names:
        for pattern, match, value in compiled:
            if match(name):
                out[name] = value
                used.add(pattern)
                break
    unused = [p for p, _, _ in compiled if p not in used]
    if unused:
        raise ValueError(
            f"plan pattern(s) {unused} match no {what} (or only ones an earlier pattern "
            f"took); {what} names are e.g. {names[:6]}. Globs use fnmatch against "
            "the full dotted name; prefix a regex with 're:'"
        )
    return out


def _split_plan(plan) -> tuple[dict[str, P], dict[str, P]]:
    if plan is None:
        return {}, {}
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping pattern -> fs.P, got {type(plan).__name__}")
    params, outputs = {}, {}
    for pattern, value in plan.items():
        if isinstance(value, Output) and isinstance(value.spec, P):
            outputs[pattern] = value.spec
        elif isinstance(value, LocalRows) and isinstance(value.axis, str) and value.axis:
            outputs[pattern] = value
        elif isinstance(value, (P, Parts)):
            params[pattern] = value
        else:
            raise TypeError(
                f"plan[{pattern!r}] must be a fs.P or fs.Parts (a parameter's layout) or a "
                f"fs.nn.Output(fs.P(...)) (a module's output layout) or a fs.nn.LocalRows(axis) "
                f"(a module run on this rank's rows), got "
                f"{type(value).__name__} {value!r}"
            )
    return params, outputs


def match_plan(names: Iterable[str], plan: Mapping[str, P]) -> dict[str, P]:
    """Resolve ``plan`` against parameter ``names``: ``{name: spec}`` for every name.

    Patterns are fnmatch globs matched against the full dotted name (``"*.fc1.weight"``,
    ``"blocks.*.attn.qkv.*"``; ``*`` also matches dots), or regexes prefixed with ``"re:"``
    (``"re:blocks\\.[0-3]\\.mlp\\.fc1\\.weight"``, matched with ``fullmatch``). Patterns are
    tried in the plan's order and the **first match wins**. Unmatched names are replicated
    (``P()``). A pattern that matches no name is an error (a typo would otherwise silently
    replicate a layer). :class:`Output` entries (module output layouts) are skipped here.

    Args:
        names: parameter names (``module.named_parameters()`` order).
        plan: ``{pattern: P}``.

    Returns:
        ``{name: spec}`` in ``names`` order.

    Example:
        >>> match_plan(["fc.weight", "fc.bias"], {"*.weight": P("tp")})
        {'fc.weight': P('tp'), 'fc.bias': P()}
    """
    rules, _ = _split_plan(plan)
    names = list(names)
    found = _match(names, rules, "parameter")
    return {name: found.get(name, P()) for name in names}
