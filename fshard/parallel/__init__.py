"""Parallelism strategies, one module each, each with the same shape: a plan that returns
layouts (``{glob: fs.P | fs.nn.Output}`` for :func:`fshard.nn.shard_params`) and a call that
runs the module (:func:`fshard.nn.functional_call` unless the strategy needs its own).

- :mod:`fshard.parallel.sequence`: Megatron sequence parallelism over the tensor-parallel axis.

Example:
    >>> import fshard as fs
    >>> fs.parallel.__all__
    ['megatron_sp_comm', 'sequence_parallel_plan']
"""

from .sequence import megatron_sp_comm, sequence_parallel_plan

__all__ = ["megatron_sp_comm", "sequence_parallel_plan"]
