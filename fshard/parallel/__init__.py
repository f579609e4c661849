"""Parallelism strategies, one module each, each with the same shape: a plan that returns
layouts (``{glob: fs.P | fs.nn.Output}`` for :func:`fshard.nn.shard_params`) and a call that
runs the module (:func:`fshard.nn.functional_call` unless the strategy needs its own).

- :mod:`fshard.parallel.sequence`: Megatron sequence parallelism over the tensor-parallel axis.
- :mod:`fshard.parallel.context`: context parallelism (ring and all-to-all attention over a
  sequence-split axis); its call is :func:`context_parallel_loss`.

Example:
    >>> import fshard as fs
    >>> fs.parallel.__all__[:2]
    ['megatron_sp_comm', 'sequence_parallel_plan']
"""

from .context import (
    context_parallel_loss,
    load_balance,
    load_balance_inverse,
    ring_attention,
    ulysses_attention,
)
from .sequence import megatron_sp_comm, sequence_parallel_plan

__all__ = [
    "megatron_sp_comm",
    "sequence_parallel_plan",
    "context_parallel_loss",
    "load_balance",
    "load_balance_inverse",
    "ring_attention",
    "ulysses_attention",
]
