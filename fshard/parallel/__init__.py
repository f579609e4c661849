"""Parallelism strategies, one module each, each with the same shape: a plan that returns
layouts (``{glob: fs.P | fs.nn.Output}`` for :func:`fshard.nn.shard_params`) and a call that
runs the module (:func:`fshard.nn.functional_call` unless the strategy needs its own).

- :mod:`fshard.parallel.sequence`: Megatron sequence parallelism over the tensor-parallel axis.
- :mod:`fshard.parallel.pipeline`: pipeline parallelism over a ``pp`` axis (GPipe, 1F1B,
  interleaved 1F1B, ZB-H1): :func:`stack_stages` lays a module's blocks out as stages over
  ``pp`` (the layouts), :func:`pipeline_schedule` plans the schedule (the tick table),
  :func:`pipeline` is the call (its own executor: stages run in schedule order).

Example:
    >>> import fshard as fs
    >>> fs.parallel.__all__
    ['megatron_sp_comm', 'sequence_parallel_plan', 'Action', 'PipelineSchedule', 'pipeline', 'pipeline_schedule', 'stack_stages', 'stage_order', 'unstack_stages']
"""

from .pipeline import (
    Action,
    PipelineSchedule,
    pipeline,
    pipeline_schedule,
    stack_stages,
    stage_order,
    unstack_stages,
)
from .sequence import megatron_sp_comm, sequence_parallel_plan

__all__ = [
    "megatron_sp_comm",
    "sequence_parallel_plan",
    "Action",
    "PipelineSchedule",
    "pipeline",
    "pipeline_schedule",
    "stack_stages",
    "stage_order",
    "unstack_stages",
]
