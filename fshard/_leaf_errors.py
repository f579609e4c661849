"""Errors that name every failing leaf of a pytree, each by its JAX-style key path.

A pytree-level function validates all its leaves first (locally, before any collective), adds
one line per failing leaf to a :class:`LeafErrors`, and raises once: the user fixes every leaf
in one round instead of one per run.

Example::

    errors = LeafErrors("fs.reshard: every leaf must be a ShardedArray")
    for key, v in zip(paths(treespec), leaves):
        if not isinstance(v, ShardedArray):
            errors.add(key, f"got {type(v).__name__}", TypeError)
    errors.raise_if_any(fix="shard plain tensors with fs.shard first")
"""

from __future__ import annotations

import functools

import optree
import torch

MAX_LISTED = 10


@functools.lru_cache(maxsize=1024)
def paths(treespec: optree.PyTreeSpec) -> tuple[str, ...]:
    """JAX's ``keystr`` of every leaf of ``treespec``, in flattening order: ``['layers'][0]['w']``,
    ``.mu`` for a namedtuple field, ``''`` for a bare leaf. Cached per structure (a tree spec
    is hashable; building the paths took ~20 us a tree, and a pipeline step's entry checks
    seven trees whose structure is the last step's)."""
    return tuple(accessor.codify("") for accessor in treespec.accessors())


class LeafErrors:
    """Collects ``(key path, problem)`` lines and raises them as one error.

    Args:
      where: The rule every listed leaf breaks, e.g. ``"fs.reshard: every leaf must be a
        ShardedArray"``; the message starts with it.
      what: The name of the tree whose paths these are, e.g. ``"x"``: a path then reads
        ``x['w']`` (and the root ``x``).
    """

    def __init__(self, where: str, what: str = ""):
        self.where, self.what = where, what
        self.lines: list[tuple[str, str]] = []
        self.kinds: set[type] = set()

    def add(self, key: str, problem: str, kind: type[Exception] = ValueError) -> None:
        """One failing leaf: ``problem`` says what was given and what is accepted."""
        self.lines.append((self.what + key or "<root>", problem))
        self.kinds.add(kind)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def message(self, fix: str = "") -> str:
        n = len(self.lines)
        head = f"{self.where} ({n} {'leaf' if n == 1 else 'leaves'}):"
        body = [f"  {key}: {problem}" for key, problem in self.lines[:MAX_LISTED]]
        if n > MAX_LISTED:
            body.append(f"  ... and {n - MAX_LISTED} more")
        return "\n".join([head, *body] + ([fix] if fix else []))

    def raise_if_any(self, fix: str = "") -> None:
        """Raises TypeError when every problem is a type problem, else ValueError; ``fix`` is
        the remedy common to all the listed leaves (each line may carry its own)."""
        if self.lines:
            kind = TypeError if self.kinds == {TypeError} else ValueError
            if _compiling():  # dynamo can build no message from the traced lines
                raise kind(self.where + _UNDER_COMPILE)
            raise kind(self.message(fix))


_compiling = torch.compiler.is_compiling
_UNDER_COMPILE = (
    " (under torch.compile; call the function once without torch.compile to see which leaves "
    "and why)"
)
