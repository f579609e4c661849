"""Global switches: strict mode (no implicit reshards) and cross-rank consistency checks.

Example:
    >>> import fshard as fs
    >>> with fs.config.consistency(False):  # no cross-rank checks within the block
    ...     fs.config.consistency_mode()
    'off'
    >>> with fs.config.strict():  # an implicit reshard in an op raises, naming the fix
    ...     fs.config.is_strict()
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import os

__all__ = [
    "strict",
    "is_strict",
    "check_consistency",
    "consistency_interval",
    "consistency_boundary_interval",
    "consistency",
    "consistency_checked",
    "consistency_mode",
]

_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("fshard_strict", default=False)
_CONSISTENCY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fshard_consistency", default=None
)

#: the consistency modes (see :mod:`fshard.consistency`), by what selects them
_MODES = {
    False: "off",
    "0": "off",
    "off": "off",
    "false": "off",
    True: "default",
    "": "default",
    "1": "default",
    "on": "default",
    "true": "default",
    "default": "default",
    "every": "every",
    "strict": "every",
}


def _mode(value, what: str) -> str:
    key = value.strip().lower() if isinstance(value, str) else value
    try:
        return _MODES[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"{what}: got {value!r}; accepted: False / 'off' / '0' (no checks), True / 'default' "
            "/ '1' (a running digest, exchanged at API boundaries and every "
            "consistency_interval collectives), 'every' / 'strict' (an exchange before every "
            "collective)"
        ) from None


#: Consistency mode (see :mod:`fshard.consistency`): ``True`` (the default) keeps a running
#: digest of every collective (its description and call site) per process group and exchanges
#: it at the API boundaries (creation functions, ``from_local``, ``shard``, ``shard_map``,
#: ``gather(dst=)``, ``fs.optim.step``, checkpoints), at a group's first collective and every
#: :data:`consistency_interval`-th; ``"every"`` exchanges before every collective (debugging,
#: fshard's fault tests); ``False`` turns checks off. Set it here, with :func:`consistency` for
#: a block, or with ``FSHARD_CHECK_CONSISTENCY`` (``0``/``off``, ``1``/``default``,
#: ``every``), read at import, so processes spawned by ``fs.launch`` inherit it.
check_consistency: bool | str = os.environ.get("FSHARD_CHECK_CONSISTENCY", "default")
_mode(check_consistency, "FSHARD_CHECK_CONSISTENCY")  # refuse a typo at import

#: In the default mode, every process group exchanges its digest at its ``consistency_interval``-th
#: collective, and every ``consistency_interval``-th after (the same on every rank; env
#: ``FSHARD_CONSISTENCY_INTERVAL``).
consistency_interval: int = int(os.environ.get("FSHARD_CONSISTENCY_INTERVAL", "256"))

#: In the default mode, a boundary crossed every step (``fs.optim.step``, ``fs.gather(dst=)``)
#: exchanges the digests at its 1st, 2nd, 4th, ... crossing up to this, then every this-th
#: (env ``FSHARD_CONSISTENCY_BOUNDARY_INTERVAL``): the exchange costs one small all_reduce's
#: latency, which would be several percent of a short step if paid every step.
consistency_boundary_interval: int = int(
    os.environ.get("FSHARD_CONSISTENCY_BOUNDARY_INTERVAL", "64")
)


class consistency(contextlib.ContextDecorator):  # noqa: N801 (used as a function)
    """Set the consistency mode within the block (``True``/``"default"``, ``"every"``,
    ``False``), overriding ``check_consistency``. Also a decorator. (A class, not a generator
    context manager: the pipeline enters one at each transfer.)

    Example:
        >>> with fs.config.consistency("every"):  # doctest: +SKIP
        ...     y = fs.reshard(x, fs.P())  # ranks exchange a digest before each collective
    """

    def __init__(self, enabled: bool | str = True):
        self._mode = _mode(enabled, "fs.config.consistency(enabled)")
        self._tokens: list = []  # one instance entered again within its block

    def _recreate_cm(self):  # a decorated function's each call: its own (threads, recursion)
        return type(self)(self._mode)

    def __enter__(self) -> None:
        self._tokens.append(_CONSISTENCY.set(self._mode))

    def __exit__(self, *exc) -> None:
        _CONSISTENCY.reset(self._tokens.pop())


def consistency_mode() -> str:
    """The consistency mode in this context: ``"off"``, ``"default"`` or ``"every"``."""
    scoped = _CONSISTENCY.get()
    return scoped if scoped is not None else _mode(check_consistency, "check_consistency")


def consistency_checked() -> bool:
    """Whether consistency checks run in this context (any mode but ``"off"``)."""
    return consistency_mode() != "off"


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
