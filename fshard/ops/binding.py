"""Binding an op call's arguments to parameter names, once per op.

A rule reads its arguments by name (``bind(op, args, kwargs)["eps"]``) instead of copying the
op's signature into a tuple of names and positions. The signature comes from, in order: the
one given at registration (``register_rule(op, rule, signature=fn)``: any callable whose
Python signature is the op's), the op's own Python signature (``torch.nn.functional`` is
mostly Python), or its ATen schemas (``torch._C._jit_get_schemas_for_operator``; ``self`` is
called ``input``, as torch's Python functions call it, for Tensor methods too), or, for an
operator method with neither (``Tensor.__matmul__``, ``__add__``, ``__radd__``), Python's
operator protocol: ``(input, other)``, ``(input)`` for a unary one. Every op's
:class:`Signature` is built once and cached; binding runs when a call is planned, and for a
``OpSharding(by_name=True)`` once per call as one dict update.

Example:
    >>> import torch.nn.functional as F
    >>> b = bind(F.layer_norm, ("x", (4,)), {"eps": 1e-6})
    >>> b["input"], b["normalized_shape"], b["weight"], b["eps"]
    ('x', (4,), None, 1e-06)
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Signature", "bind", "declare_signature", "signature_of"]


@dataclass(frozen=True)
class Signature:
    """One overload of an op: its parameter names and defaults.

    Attributes:
        names: every parameter, in order (``positional`` first, then keyword-only ones).
        positional: the parameters a positional argument may fill, in order.
        defaults: ``{name: default}`` for the parameters that have one.
        packs: the int-list parameter right after ``input`` that also takes its ints as
            separate arguments (``x.flip(0, 1)``, as torch's Python binding allows), or None.
    """

    names: tuple[str, ...]
    positional: tuple[str, ...]
    defaults: Mapping[str, Any]
    packs: str | None = None

    def accepts(self, args, kwargs) -> bool:
        """Whether a call with these many positional arguments and these keywords fits."""
        args, kwargs = self._packed(args), self._numpy_names(kwargs)
        if len(args) > len(self.positional):
            return False
        if any(k not in self.names for k in kwargs):
            return False
        given = set(self.positional[: len(args)])
        if given & set(kwargs):
            return False
        return all(n in given or n in kwargs or n in self.defaults for n in self.names)

    def bind(self, args, kwargs) -> dict:
        """``{name: value}`` for every parameter, defaults filled (no checks: see accepts)."""
        bound = dict(self.defaults)
        bound.update(zip(self.positional, self._packed(args)))
        bound.update(self._numpy_names(kwargs))
        return bound

    def _numpy_names(self, kwargs):
        """``kwargs`` with the NumPy spellings torch's argument parser accepts (``axis`` for
        ``dim``, ``keepdims`` for ``keepdim``, ``x``/``a``/``x1`` for ``input``, ``x2`` for
        ``other``) renamed, where this signature has the torch name and not the NumPy one."""
        if not kwargs or not any(k in _NUMPY_NAMES for k in kwargs):
            return kwargs
        out = {}
        for k, v in kwargs.items():
            name = _NUMPY_NAMES.get(k)
            out[name if name and k not in self.names and name in self.names else k] = v
        return out

    def _packed(self, args):
        if self.packs is not None and len(args) > 2:
            return (args[0], tuple(args[1:]))
        return args

    @staticmethod
    def of_callable(fn: Callable) -> Signature:
        params = list(inspect.signature(fn).parameters.values())
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return Signature(
            names=tuple(p.name for p in params),
            positional=tuple(p.name for p in params if p.kind in kinds),
            defaults={p.name: p.default for p in params if p.default is not p.empty},
        )

    @staticmethod
    def of_schema(schema) -> Signature:
        args = schema.arguments

        def name(a):
            return "input" if a.name == "self" else a.name

        positional = [a for a in args if not a.kwarg_only]
        packs = len(positional) == 2 and str(positional[1].type) == "List[int]"
        return Signature(
            names=tuple(name(a) for a in args),
            positional=tuple(name(a) for a in positional),
            defaults={name(a): a.default_value for a in args if a.has_default_value()},
            packs=positional[1].name if packs else None,
        )


#: NumPy argument names torch's Python argument parser takes for its own
#: (``torch/csrc/utils/python_arg_parser.cpp``, ``numpy_compatibility_arg_names``)
_NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim", "x": "input", "a": "input", "x1": "input"}
_NUMPY_NAMES["x2"] = "other"

#: Signatures declared at registration (``register_rule(..., signature=)``), by op.
_DECLARED: dict = {}
_CACHE: dict = {}


def declare_signature(op, fn: Callable) -> None:
    """Bind ``op``'s arguments with ``fn``'s Python signature (for builtins whose own
    signature cannot be read and whose schema is ambiguous)."""
    _DECLARED[op] = fn
    _CACHE.pop(op, None)


def signature_of(op) -> tuple[Signature, ...]:
    """``op``'s overloads (cached; empty when no signature can be found)."""
    found = _CACHE.get(op)
    if found is None:
        found = _CACHE[op] = _find(op)
    return found


def _find(op) -> tuple[Signature, ...]:
    declared = _DECLARED.get(op)
    if declared is not None:
        return (Signature.of_callable(declared),)
    try:
        return (Signature.of_callable(op),)
    except (TypeError, ValueError):  # a builtin: read its ATen schemas
        pass
    name = getattr(op, "__name__", "")
    schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}") if name else []
    found = tuple(Signature.of_schema(s) for s in schemas if _functional(s))
    return found or _operator_protocol(name)


def _operator_protocol(name: str) -> tuple[Signature, ...]:
    """A Python operator method with neither a signature nor a schema (``Tensor.__matmul__``,
    ``__add__``, ``__radd__``, ``__iadd__``, ``__eq__``...): bound as Python calls it,
    ``x.__op__(other)`` (``x.__neg__()`` for a unary one), its arity that of
    ``operator.__op__`` (``__rop__`` / ``__iop__`` have ``__op__``'s)."""
    if not (name.startswith("__") and name.endswith("__")):
        return ()
    stem = name[2:-2]
    for candidate in (stem, stem[1:] if stem[:1] in "ri" else None):
        fn = vars(operator).get(f"__{candidate}__") if candidate else None
        if fn is not None:
            n = len(inspect.signature(fn).parameters)
            names = ("input", "other")[:n]
            return (Signature(names=names, positional=names, defaults={}),)
    return ()


def _functional(schema) -> bool:
    return not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


def resolve(op, args, kwargs) -> Signature:
    """The first overload of ``op`` that accepts this call's argument counts and keywords."""
    for sig in signature_of(op):
        if sig.accepts(args, kwargs):
            return sig
    name = getattr(op, "__qualname__", op)
    raise TypeError(
        f"cannot bind the arguments of {name} (positional {len(args)}, keywords {sorted(kwargs)}) "
        "to its signature; declare one with fs.ops.register_rule(op, rule, signature=fn)"
    )


def bind(op, args, kwargs) -> dict:
    """The call's arguments by parameter name, with ``op``'s defaults filled in.

    Example:
        >>> sorted(bind(torch.topk, ("x", 3), {}).items())  # an ATen schema
        [('dim', -1), ('input', 'x'), ('k', 3), ('largest', True), ('sorted', True)]
        >>> sorted(bind(torch.Tensor.sum, ("x", 0), {}).items())  # the overload that fits
        [('dim', 0), ('dtype', None), ('input', 'x'), ('keepdim', False)]
    """
    return resolve(op, args, kwargs).bind(args, kwargs)
