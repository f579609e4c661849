"""Per-op rules: global-view torch ops on ShardedArray."""

from .registry import dispatch, register_rule

__all__ = ["dispatch", "register_rule"]
