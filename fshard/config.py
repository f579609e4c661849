"""Global switches: strict mode (no implicit reshards) and cross-rank consistency checks."""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["strict", "is_strict", "check_consistency"]

_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("fshard_strict", default=False)

#: When True, ``from_local`` and ``shard_map`` exchange a small digest of (spec, shape, dtype)
#: across ranks and raise on disagreement, instead of letting a later collective misbehave.
check_consistency: bool = False


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Within the block, any implicit reshard in an op rule that would communicate raises.

    The error names the op, the input layouts and the ``fs.reshard`` call that fixes it (JAX
    explicit-sharding behaviour). Reshards that need no communication (slicing a replicated
    operand to match a sharded one, zeroing addends to make a value partial) stay implicit.

    Example:
        >>> with fs.config.strict():  # doctest: +SKIP
        ...     y = x @ w   # raises if x and w need a reshard first
    """
    token = _STRICT.set(bool(enabled))
    try:
        yield
    finally:
        _STRICT.reset(token)


def is_strict() -> bool:
    """Whether strict mode is on in this context."""
    return _STRICT.get()
