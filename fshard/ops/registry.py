"""Op rule registry (placeholder until the op-rules work lands: every op raises clearly)."""

from __future__ import annotations

_RULES: dict = {}


def register_rule(op, rule=None):
    """Register ``rule`` for torch function ``op``."""
    if rule is None:
        return lambda r: register_rule(op, r)
    _RULES[op] = rule
    return rule


def dispatch(func, args, kwargs):
    rule = _RULES.get(func)
    if rule is None:
        name = getattr(func, "__name__", repr(func))
        raise TypeError(
            f"fshard has no rule for {name} on ShardedArray; gather/reshard first, use "
            "fs.shard_map on local tensors, or fs.ops.register_rule"
        )
    return rule(func, args, kwargs)
