"""Global switches: strict mode (no implicit reshards) and cross-rank consistency checks."""

from __future__ import annotations

import contextlib
import contextvars
import os

__all__ = ["strict", "is_strict", "check_consistency", "consistency", "consistency_checked"]

_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("fshard_strict", default=False)
_CONSISTENCY: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "fshard_consistency", default=None
)

#: Consistency mode (see :mod:`fshard.consistency`), off by default. When True, the ranks of a
#: group exchange a small digest (op, axes, layout, shape, dtype, sequence number) before every
#: collective, and ``from_local``/``shard``/creation functions/``shard_map`` check that every
#: rank passed the same layout; any disagreement raises ``fs.consistency.ConsistencyError`` on
#: every rank, before the data collective. Set it here, with :func:`consistency` for a block,
#: or with the environment variable ``FSHARD_CHECK_CONSISTENCY=1`` (read at import, so
#: processes spawned by ``fs.launch`` inherit it; fshard's test suite runs with it on).
check_consistency: bool = os.environ.get("FSHARD_CHECK_CONSISTENCY", "0") not in ("", "0")


@contextlib.contextmanager
def consistency(enabled: bool = True):
    """Turn consistency mode on (or off) within the block, overriding ``check_consistency``.

    Example:
        >>> with fs.config.consistency():  # doctest: +SKIP
        ...     y = fs.reshard(x, fs.P())  # ranks exchange a digest first
    """
    token = _CONSISTENCY.set(bool(enabled))
    try:
        yield
    finally:
        _CONSISTENCY.reset(token)


def consistency_checked() -> bool:
    """Whether consistency mode is on in this context."""
    scoped = _CONSISTENCY.get()
    return check_consistency if scoped is None else scoped


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
