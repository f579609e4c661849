"""Parallelism strategies, one module each, each with the same shape: a plan that returns
layouts (``{glob: fs.P | fs.nn.Output}`` for :func:`fshard.nn.shard_params`) and a call that
runs the module (:func:`fshard.nn.functional_call` unless the strategy needs its own; every
call puts values into the module through the one swap of :mod:`fshard._swap`).

| strategy | plan | call |
|---|---|---|
| tensor (:mod:`fshard.parallel.tensor`) | ``megatron_plan``, ``hf_tp_plan`` | ``fs.nn.functional_call`` |
| sequence (:mod:`fshard.parallel.sequence`) | ``sequence_parallel_plan`` | ``fs.nn.functional_call`` |
| FSDP / ZeRO-3 (:mod:`fshard.parallel.fsdp`) | ``fsdp_plan`` (over any base plan) | ``fsdp_call`` |
| expert (:mod:`fshard.parallel.expert`) | ``expert_parallel_plan`` | ``expert_parallel_call`` (``moe_experts`` for your own MoE layer) |
| context (:mod:`fshard.parallel.context`) | ``load_balance`` (the sequence's chunks per rank) | ``context_parallel_loss`` (an HF causal LM or your own); ``attention`` (sdpa, the ring under cp), ``ring_attention`` / ``ulysses_attention`` for your own attention |
| all at once (:mod:`fshard.parallel.compose`) | ``ParallelDims`` (every degree), ``ModelParts`` (a model of your own) | ``parallelize`` (a causal LM: params and one loss) |
| pipeline (:mod:`fshard.parallel.pipeline`) | ``stack_stages`` (a module's blocks as stages over ``pp``), ``on_stage`` (a one-stage param held by its stage's ranks), ``pipeline_schedule`` (the tick table) | ``pipeline`` (its own executor: GPipe, 1F1B, interleaved, ZB-H1) |

The plans and ``fsdp_call`` are also :mod:`fshard.nn`'s names (``fs.nn.megatron_plan`` is
``fs.parallel.megatron_plan``).

Example:
    >>> import fshard as fs
    >>> fs.parallel.megatron_plan is fs.nn.megatron_plan
    True
"""

from .compose import ModelParts, ParallelDims, parallelize
from .context import (
    attention,
    context_parallel_loss,
    load_balance,
    load_balance_inverse,
    ring_attention,
    ulysses_attention,
)
from .expert import expert_parallel_call, expert_parallel_plan, moe_experts
from .fsdp import fsdp_call, fsdp_gather, fsdp_plan, fsdp_units
from .pipeline import (
    Action,
    PipelineSchedule,
    on_stage,
    pipeline,
    pipeline_schedule,
    stack_stages,
    stage_order,
    unstack_stages,
)
from .sequence import megatron_sp_comm, sequence_parallel_plan
from .tensor import hf_tp_plan, megatron_plan

__all__ = [
    "ModelParts",
    "ParallelDims",
    "parallelize",
    "megatron_plan",
    "hf_tp_plan",
    "sequence_parallel_plan",
    "megatron_sp_comm",
    "fsdp_plan",
    "fsdp_units",
    "fsdp_gather",
    "fsdp_call",
    "expert_parallel_plan",
    "expert_parallel_call",
    "moe_experts",
    "pipeline",
    "pipeline_schedule",
    "PipelineSchedule",
    "Action",
    "stack_stages",
    "unstack_stages",
    "on_stage",
    "stage_order",
    "attention",
    "context_parallel_loss",
    "ring_attention",
    "ulysses_attention",
    "load_balance",
    "load_balance_inverse",
]
