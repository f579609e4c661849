"""Every parallelism at once on a transformers causal LM: one configuration, one mesh, one pure
loss function (torchtitan's ``ParallelDims`` + ``parallelize``, MaxText's mesh of named axes).

:class:`ParallelDims` holds every degree; :meth:`ParallelDims.mesh` names one mesh axis per
degree, outermost first as torchtitan's: ``("dp_replicate", "dp_shard", "ep", "cp", "tp")``
(expert parallelism carves its ranks out of the data: the batch is split over
``dp_replicate x dp_shard x ep``). :func:`parallelize` applies the strategies in one fixed order
and returns the sharded params and ``loss(params, batch)``, which ``fs.value_and_grad``,
``torch.func.grad`` and ``fs.remat`` take like any other function. The order, written once:

1. tensor parallel: the model's shipped plan (:func:`~fshard.parallel.hf_tp_plan`) over ``tp``;
2. expert parallel: the MoE experts split over ``ep`` (:func:`expert_parallel_plan`);
3. FSDP / HSDP: every param also split over ``dp_shard`` (:func:`fsdp_plan` over the plans
   above), replicated over ``dp_replicate``;
4. the call: :func:`fsdp_call` (each block gathered over ``dp_shard`` just before use) or
   :func:`fshard.nn.functional_call`, inside :func:`expert_parallel_call` with ``ep``, inside
   :func:`context_parallel_loss`'s ``shard_map`` over ``cp`` (the sequence split, ring or
   all-to-all attention).

The plans stay data (``{name: P}``, what :func:`fshard.nn.shard_params` takes): nothing mutates
the model. Pipeline parallelism of a transformers model is not composed here yet (the demo's
GPT composes it: ``examples/train_gpt.py --pp``); ``pp > 1`` raises.

Example:
    >>> import transformers
    >>> transformers.logging.set_verbosity_error()
    >>> _ = torch.manual_seed(0)
    >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, vocab_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> dims = fs.parallel.ParallelDims(dp_shard=2)  # 2 ranks: fs.launch.run(fn, 2)
    >>> params, loss = fs.parallel.parallelize(model, dims.mesh(), dims)
    >>> ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    >>> value, grads = fs.value_and_grad(loss)(params, {"input_ids": ids})
    >>> torch.allclose(value, model(ids, labels=ids).loss, atol=1e-5)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..api import gather, shard
from ..mesh import Mesh
from ..module import functional_call, shard_params
from ..precision import MixedPrecisionPolicy
from ..spec import P
from .context import context_parallel_loss
from .expert import expert_parallel_call, expert_parallel_plan
from .fsdp import fsdp_call, fsdp_plan
from .tensor import hf_tp_plan

__all__ = ["ParallelDims", "parallelize"]

#: The mesh axes, outermost first (torchtitan's order; pp would come first).
AXES = ("dp_replicate", "dp_shard", "ep", "cp", "tp")
_ATTENTION = ("ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """Every parallelism degree of a training job (torchtitan's ``ParallelDims``).

    Args:
        dp_replicate: data-parallel replicas (DDP; with ``dp_shard > 1``: HSDP's replicas).
        dp_shard: FSDP: params, gradients and optimizer state split over these ranks.
        cp: context parallel: the sequence split over these ranks.
        tp: tensor parallel (the model's shipped plan).
        ep: expert parallel: the MoE experts split over these ranks (which also split the
            batch).
        pp: pipeline stages (not composed for transformers models yet: must be 1).
        cp_attention: ``"ring"`` or ``"ulysses"``.

    Example:
        >>> dims = fs.parallel.ParallelDims(dp_shard=4, tp=2)
        >>> dims.world_size, dims.shape, dims.batch_axes
        (8, (1, 4, 1, 1, 2), ('dp_replicate', 'dp_shard', 'ep'))
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp_attention: str = "ring"

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelDims: {name} must be an int >= 1, got {v!r}")
        if self.cp_attention not in _ATTENTION:
            raise ValueError(
                f"ParallelDims: cp_attention must be one of {_ATTENTION}, got {self.cp_attention!r}"
            )
        if self.pp != 1:
            raise NotImplementedError(
                "ParallelDims: pp > 1 is not composed for transformers models yet (the demo's "
                "GPT composes it: examples/train_gpt.py --pp); use pp=1"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape, one entry per axis of :data:`AXES`."""
        return (self.dp_replicate, self.dp_shard, self.ep, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        """The number of ranks: the product of the degrees."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch (dim 0) is split over."""
        return ("dp_replicate", "dp_shard", "ep")

    def mesh(self, device_type: str | None = None) -> Mesh:
        """The mesh of these degrees (an initialised process group of :attr:`world_size`
        ranks: ``fs.launch.run`` or ``torchrun``).

        Example:
            >>> fs.parallel.ParallelDims(tp=2).mesh().axis_names  # 2 ranks
            ('dp_replicate', 'dp_shard', 'ep', 'cp', 'tp')
        """
        return Mesh.create(self.shape, AXES, device_type=device_type)

    def abstract_mesh(self) -> Mesh:
        """The same mesh without a process group (layout math, planning, ``fs.plan``).

        Example:
            >>> fs.parallel.ParallelDims(dp_shard=512, tp=2).abstract_mesh().size("dp_shard")
            512
        """
        return Mesh.abstract(self.shape, AXES)


def parallelize(
    model: torch.nn.Module,
    mesh: Mesh,
    dims: ParallelDims,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> tuple[dict, Callable]:
    """Shard a transformers causal LM for ``dims`` on ``mesh`` and return ``(params, loss)``.

    ``loss(params, batch)`` is the model's mean next-token cross entropy (transformers'
    ``model(input_ids, labels=labels).loss``) with every strategy of ``dims`` applied, in the
    order of the module docstring; ``batch`` is ``{"input_ids": (batch, seq) tensor, "labels":
    optional, "attention_mask": optional}``, the full tensors, the same on every rank (each
    rank keeps its block). A pure function of ``params``: ``fs.value_and_grad`` gives every
    gradient in its parameter's layout.

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``, ``MixtralForCausalLM``, ...);
            with ``tp > 1`` it must ship a tensor-parallel plan.
        mesh: ``dims.mesh()`` (axes :data:`AXES`).
        dims: the degrees.
        mp_policy: a :class:`~fshard.nn.MixedPrecisionPolicy` for the params, or ``None``.

    Returns:
        ``(params, loss)``.

    Example:
        >>> import transformers
        >>> transformers.logging.set_verbosity_error()
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=32,
        ...     intermediate_size=64, vocab_size=64, num_hidden_layers=1, num_attention_heads=4,
        ...     num_key_value_heads=2))
        >>> dims = fs.parallel.ParallelDims(tp=2)  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> params, loss = fs.parallel.parallelize(model, dims.mesh(), dims)
        >>> params["model.layers.0.self_attn.q_proj.weight"].spec  # the model's shipped plan
        P('tp', None)
        >>> ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        >>> torch.allclose(loss(params, {"input_ids": ids}), model(ids, labels=ids).loss, atol=1e-5)
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"parallelize: dims must be a ParallelDims, got {type(dims).__name__}")
    if not isinstance(mesh, Mesh) or mesh.axis_names != AXES or mesh.shape != dims.shape:
        raise ValueError(
            f"parallelize: mesh must be dims.mesh() (axes {AXES}, shape {dims.shape}), got {mesh!r}"
        )
    # 1-3: the plan, as data: tp, then ep, then FSDP over both
    plan: dict = {}
    if dims.tp > 1:
        plan.update(hf_tp_plan(model, "tp"))
    if dims.ep > 1:
        plan.update(expert_parallel_plan(model, mesh, "ep"))
    if dims.dp_shard > 1:
        plan = fsdp_plan(model, mesh, "dp_shard", base=plan)
    params = shard_params(model, mesh, plan, mp_policy=mp_policy)
    # 4: the call, innermost first: FSDP's gathers, inside the experts' dispatch
    call: Callable = functional_call
    if dims.dp_shard > 1:
        replicate = "dp_replicate" if dims.dp_replicate > 1 else None
        call = functools.partial(
            fsdp_call, mesh=mesh, axis="dp_shard", replicate=replicate, mp_policy=mp_policy
        )
    if dims.ep > 1:
        call = functools.partial(_experts, call=call)
    batch_axes = dims.batch_axes

    def loss(params: Mapping, batch: Mapping) -> torch.Tensor:
        ids, labels, mask = _batch(batch)
        if dims.cp > 1:  # the sequence split over cp, inside a shard_map over it
            return context_parallel_loss(
                model, params, mesh, ids, labels, mask, attention=dims.cp_attention,
                batch=batch_axes, call=call,
            )  # fmt: skip
        spec = P(batch_axes)
        kwargs = {"labels": shard(ids if labels is None else labels, mesh, spec)}
        kwargs["use_cache"] = False
        if mask is not None:
            kwargs["attention_mask"] = shard(mask, mesh, spec)
        return gather(call(model, params, (shard(ids, mesh, spec),), kwargs).loss)

    return params, loss


def _experts(model, params, args, kwargs, *, call):
    return expert_parallel_call(model, params, args, kwargs, call=call)


def _batch(batch) -> tuple:
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(
            "parallelize's loss: batch must be a mapping with 'input_ids' (and optionally "
            f"'labels', 'attention_mask'), got {type(batch).__name__}"
        )
    unknown = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
    if unknown:
        raise ValueError(
            f"parallelize's loss: batch has unknown keys {unknown}; accepted: 'input_ids', "
            "'labels', 'attention_mask'"
        )
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise TypeError(
            "parallelize's loss: batch['input_ids'] must be the full (batch, seq) tensor, "
            f"got {type(ids).__name__} {tuple(getattr(ids, 'shape', ()))}"
        )
    return ids, batch.get("labels"), batch.get("attention_mask")
