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
import contextvars
from collections.abc import Iterator

from .mesh import Mesh

__all__ = ["current_mesh", "tracker", "enter", "in_body"]

_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("fshard_mesh", default=None)
# The active body's varying-axes tracker (fshard.shard_map._Tracker) or None.
_TRACKER: contextvars.ContextVar = contextvars.ContextVar("fshard_vma", default=None)


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
    mesh = _MESH.get()
    if mesh is None:
        raise ValueError(
            "fs.lax collectives need a mesh: call them inside fs.shard_map, or pass mesh=..."
        )
    return mesh


def _body_tracker():
    """``_TRACKER.get()``, which dynamo cannot trace: under ``torch.compile`` its value at trace
    time is a constant of the graph. A body's tracker is a TorchFunctionMode, and dynamo guards
    on the mode stack, so a graph traced outside a body is never reused inside one."""
    return _TRACKER.get()


# What torch.compiler.assume_constant_result sets; calling it would import dynamo (seconds)
# when fshard is imported.
_body_tracker._dynamo_marked_constant = True


def tracker(mesh: Mesh | None = None):
    """The enclosing body's varying-axes tracker, or ``None`` outside a body or when ``mesh``
    names another mesh than the body's (then nothing is tracked)."""
    t = _body_tracker()
    if t is None or (mesh is not None and mesh != t.mesh):
        return None
    return t


def in_body() -> bool:
    """Whether a ``shard_map`` body is running in this context."""
    return _TRACKER.get() is not None


@contextlib.contextmanager
def enter(mesh: Mesh, body_tracker) -> Iterator[None]:
    """Run a ``shard_map`` body: ``mesh`` and ``body_tracker`` are current inside the block."""
    mesh_token = _MESH.set(mesh)
    tracker_token = _TRACKER.set(body_tracker)
    try:
        yield
    finally:
        _TRACKER.reset(tracker_token)
        _MESH.reset(mesh_token)
