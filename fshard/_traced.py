"""Values computed once while ``torch.compile`` traces, read by the graph as guarded constants.

Planning (an op rule's plan for some layouts, a reshard program) is plain Python over static
metadata; dynamo should not trace it, only read its result. ``torch.compiler.assume_constant_result``
alone does not serve: dynamo wraps its result under a source it cannot guard, so calling a closure
of the result (a rule's local function) or handing an object of it to an ``autograd.Function``
fails. :func:`constant` has dynamo run ``fn(*args)`` eagerly (once per arguments) and store the
result as an attribute of a class, which dynamo then reads like any global: live, and guarded.

Arguments must be constants dynamo can convert at trace time: strings, ints, ``None``, dtypes,
torch functions and tuples of them (a layout is passed as its ``Layout._id`` token, a string
dynamo guards by value). Python ints read from inputs can turn dynamic after a recompile; pass
strings or tuples of literals.
"""

from __future__ import annotations

from collections.abc import Callable

from ._compat import freeze_key


class _Values:
    """Attribute ``key``: the value of the call :func:`_key` numbered ``key``. A class, not a
    dict: dynamo snapshots a dict the first time a trace reads it, and keys added later in the
    same trace would be missing; an attribute is looked up when read."""


_KEYS: dict = {}  # (fn, args) -> attribute name in _Values


def _key(fn: Callable, args: tuple) -> str:
    k = (fn, freeze_key(args))  # slices in args hash only from Python 3.12
    name = _KEYS.get(k)
    if name is None:
        name = f"v{len(_KEYS)}"
        setattr(_Values, name, fn(*args))
        _KEYS[k] = name
    return name


# Called by dynamo at trace time, its result a constant of the graph (what
# torch.compiler.assume_constant_result sets; calling that would import dynamo at fshard import).
_key._dynamo_marked_constant = True


def constant(fn: Callable, *args):
    """``fn(*args)`` (hashable constant ``args``), computed once per arguments; under dynamo a
    guarded constant of the graph being traced.

    Example:
        >>> constant(divmod, 7, 2)
        (3, 1)
    """
    return getattr(_Values, _key(fn, args))
