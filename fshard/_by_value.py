"""Pickling functions and classes of an interactive ``__main__`` by value, for the launcher.

:class:`fshard.launch.World` sends ``fn`` to spawned workers by pickle, which stores a function
as a reference (module and name) that the worker imports. A worker re-imports a script's
``__main__`` from its file, but ``python -c``, a script read from stdin, the REPL and a notebook
have no file: the reference cannot be resolved there (``Can't get attribute 'f' on <module
'__main__' (built-in)>``). For those sessions :func:`dumps` pickles what ``__main__`` defines
*by value*, as ``cloudpickle`` does (not a dependency here):

* a function as its code object (``marshal``, read by the same Python in the worker), the
  globals its code names (recursively: nested functions and comprehensions), its defaults,
  closure cells, ``__dict__`` and names, rebuilt in two phases (skeleton, then state) so a
  function that refers to itself or to another one that refers back pickles once;
* a class as ``type(name, bases, namespace)`` with its methods by value (``nn.Module``
  subclasses defined in a notebook cell work);
* a module by name (re-imported in the worker).

Everything else pickles as usual. A script with a file keeps pickling by reference.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import marshal
import os
import pickle
import sys
import types

__all__ = ["dumps", "interactive_main", "unimportable_main_hidden"]


def interactive_main() -> bool:
    """Whether ``__main__`` has no file a spawned process could import (``python -c``, stdin,
    the REPL, a notebook kernel)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:  # python -m: importable
        return False
    path = getattr(main, "__file__", None)
    return not path or not os.path.isfile(path)


@contextlib.contextmanager
def unimportable_main_hidden():
    """While a process is spawned: hide a ``__main__.__file__`` that names no file
    (``'<stdin>'``), which the child would otherwise try to run as the main script."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or os.path.isfile(path) or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def dumps(obj) -> bytes:
    """``pickle.dumps(obj)``, with the functions and classes of ``__main__`` that a worker
    could not import by reference (:func:`interactive_main`, or not reachable as
    ``__main__.<qualname>``: a notebook cell's namespace) pickled by value.

    Example:
        >>> import pickle
        >>> pickle.loads(dumps((len, [1, 2])))
        (<built-in function len>, [1, 2])
    """
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


def _by_value(obj) -> bool:
    if getattr(obj, "__module__", None) != "__main__":
        return False
    if interactive_main():
        return True
    found = sys.modules.get("__main__")
    for part in getattr(obj, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    return found is not obj


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, types.FunctionType) and _by_value(obj):
            return _reduce_function(obj)
        if isinstance(obj, type) and _by_value(obj):
            return _reduce_class(obj)
        if isinstance(obj, types.ModuleType):
            return importlib.import_module, (obj.__name__,)
        return NotImplemented


class _EmptyCell:
    """Stands for a closure cell with no value yet (pickled by reference)."""


class _Descriptor:
    """A staticmethod, classmethod or property of a class pickled by value: its kind and the
    functions it wraps (pickled by reference)."""

    def __init__(self, kind: type, args: tuple):
        self.kind, self.args = kind, args

    def build(self):
        return self.kind(*self.args)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _reduce_function(fn: types.FunctionType):
    g = fn.__globals__
    used = {n: g[n] for n in sorted(_global_names(fn.__code__)) if n in g}
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            cells.append(_EmptyCell())
    state = (
        used,
        fn.__defaults__,
        fn.__kwdefaults__,
        tuple(cells),
        fn.__qualname__,
        fn.__doc__,
        dict(fn.__dict__),
    )
    args = (marshal.dumps(fn.__code__), fn.__name__, len(cells))
    return _make_function, args, state, None, None, _fill_function


def _make_function(code: bytes, name: str, ncells: int) -> types.FunctionType:
    globals_ = {"__builtins__": builtins, "__name__": "__main__"}
    closure = tuple(types.CellType() for _ in range(ncells)) or None
    return types.FunctionType(marshal.loads(code), globals_, name, None, closure)


def _fill_function(fn: types.FunctionType, state) -> None:
    used, defaults, kwdefaults, cells, qualname, doc, attrs = state
    fn.__globals__.update(used)
    fn.__defaults__, fn.__kwdefaults__ = defaults, kwdefaults
    fn.__qualname__, fn.__doc__ = qualname, doc
    fn.__module__ = "__main__"
    fn.__dict__.update(attrs)
    for cell, value in zip(fn.__closure__ or (), cells):
        if not isinstance(value, _EmptyCell):
            cell.cell_contents = value


# A class body's own entries that ``type()`` makes again (or that cannot be pickled).
_TYPE_MADE = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__"})


def _reduce_class(cls: type):
    namespace = {}
    for k, v in vars(cls).items():
        if k in _TYPE_MADE:
            continue
        if isinstance(v, (staticmethod, classmethod)):
            v = _Descriptor(type(v), (v.__func__,))
        elif isinstance(v, property):
            v = _Descriptor(property, (v.fget, v.fset, v.fdel, v.__doc__))
        namespace[k] = v
    args = (cls.__name__, cls.__qualname__, cls.__bases__, type(cls))
    return _make_class, args, namespace, None, None, _fill_class


def _make_class(name: str, qualname: str, bases: tuple, metaclass: type) -> type:
    cls = metaclass(name, bases, {"__module__": "__main__", "__qualname__": qualname})
    return cls


def _fill_class(cls: type, namespace: dict) -> None:
    for k, v in namespace.items():
        setattr(cls, k, v.build() if isinstance(v, _Descriptor) else v)
