"""The axis environment: the mesh of the enclosing ``shard_map`` body and its varying-axes tracker.

One owner for "where am I": :func:`fshard.shard_map` enters a body with :func:`enter`, and
:mod:`fshard.lax` reads :func:`current_mesh` (the mesh its axis names refer to) and
:func:`tracker` (the body's varying-axes tracker, or ``None`` outside a body). Nothing else
writes these context variables.

Example:
    >>> from fshard import axis_env
    >>> axis_env.tracker() is None  # not inside a shard_map body
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .mesh import Mesh

__all__ = ["current_mesh", "tracker", "enter", "in_body"]

# (mesh, tracker) of the enclosing bodies, innermost last. A list, not a ContextVar: dynamo traces
# a global list's pushes, pops and reads (a shard_map body compiles), not ContextVar.get/set.
# Bodies run one at a time per process (fshard's ranks are processes).
_STACK: list = []


def current_mesh(mesh: Mesh | None = None) -> Mesh:
    """``mesh`` if given, else the mesh of the enclosing ``shard_map`` body.

    Raises:
        TypeError: ``mesh`` is not a :class:`fshard.Mesh`.
        ValueError: no ``mesh`` given and no enclosing body.
    """
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a fshard.Mesh, got {type(mesh).__name__}")
        return mesh
    mesh = _STACK[-1][0] if _STACK else None
    if mesh is None:
        raise ValueError(
            "fs.lax collectives need a mesh: call them inside fs.shard_map, or pass mesh=..."
        )
    return mesh


def tracker(mesh: Mesh | None = None):
    """The enclosing body's varying-axes tracker, or ``None`` outside a body or when ``mesh``
    names another mesh than the body's (then nothing is tracked)."""
    t = _STACK[-1][1] if _STACK else None
    if t is None or (mesh is not None and mesh != t.mesh):
        return None
    return t


def in_body() -> bool:
    """Whether a ``shard_map`` body is running in this context."""
    return bool(_STACK)


@contextlib.contextmanager
def enter(mesh: Mesh, body_tracker) -> Iterator[None]:
    """Run a ``shard_map`` body: ``mesh`` and ``body_tracker`` are current inside the block."""
    _STACK.append((mesh, body_tracker))
    try:
        yield
    finally:
        _STACK.pop()
