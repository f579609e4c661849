"""Torch's own alias table, read once from its docstrings: ``torch.greater`` is ``torch.gt``.

Torch documents every alias in its docstring (``torch.greater``: "Alias for
:func:`torch.gt`."; the method form: ``Tensor.greater``: "See :func:`torch.greater`.", taken
only where the names match: ``Tensor.norm`` points at ``torch.linalg.norm``, a different op).
:func:`aliases_of` groups
the torch functions and Tensor methods those sentences connect, so a rule registered for one
name serves all of them (:func:`fshard.ops.register_rule` uses it): no hand-written list to
fall behind torch.

Example:
    >>> import torch
    >>> torch.greater in aliases_of(torch.gt) and torch.Tensor.greater in aliases_of(torch.gt)
    True
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

__all__ = ["aliases_of"]

_NAMESPACES = {
    "torch": torch,
    "torch.special": torch.special,
    "torch.linalg": torch.linalg,
    "torch.nn.functional": F,
}
_ALIAS = re.compile(r"Alias (?:for|of) :(?:func|meth):`~?([\w.]+)`")
_SEE = re.compile(r"^\s*See :func:`(torch\.[\w.]+)`\.?\s*$", re.MULTILINE)


def _resolve(target: str, home: str):
    """The object ``target`` names in a docstring of namespace ``home`` (``"abs"`` in a Tensor
    method's docstring is ``torch.Tensor.abs``), or ``None``."""
    if home == "torch.Tensor" and "." not in target:
        obj = getattr(torch.Tensor, target, None)
    elif target.startswith(("Tensor.", "torch.Tensor.")):
        obj = getattr(torch.Tensor, target.rpartition(".")[2], None)
    else:
        head, _, name = target.rpartition(".")
        obj = getattr(_NAMESPACES.get(head), name, None) if head else None
    return obj if callable(obj) else None


def _edges():
    spaces = [*_NAMESPACES.items(), ("torch.Tensor", torch.Tensor)]
    for home, ns in spaces:
        # a module's own dict, not dir()/getattr: torch's module __getattr__ imports lazily
        names = dir(ns) if home == "torch.Tensor" else list(vars(ns))
        for name in names:
            if name.startswith("_"):
                continue
            obj = getattr(ns, name, None) if home == "torch.Tensor" else vars(ns)[name]
            doc = getattr(obj, "__doc__", None)
            if not callable(obj) or not isinstance(doc, str):
                continue
            found = _ALIAS.findall(doc)
            if home == "torch.Tensor":  # the method form of torch.<same name> only
                found += [t for t in _SEE.findall(doc) if t == f"torch.{name}"]
            for target in found:
                other = _resolve(target, home)
                if other is not None and other is not obj:
                    yield obj, other


@functools.cache
def _groups() -> dict:
    """``{op: frozenset of ops torch documents as the same op}``."""
    parent: dict = {}

    def find(a):
        while parent.setdefault(a, a) is not a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in _edges():
        try:
            ra, rb = find(a), find(b)
        except TypeError:  # unhashable
            continue
        if ra is not rb:
            parent[ra] = rb
    members: dict = {}
    for a in parent:
        members.setdefault(find(a), set()).add(a)
    return {a: frozenset(members[find(a)]) for a in parent}


def aliases_of(op) -> frozenset:
    """Every torch function or Tensor method torch documents as the same op as ``op`` (``op``
    excluded; empty when it has none)."""
    try:
        group = _groups().get(op)
    except TypeError:
        return frozenset()
    return group - {op} if group else frozenset()
