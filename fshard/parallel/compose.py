"""Every parallelism at once on a causal LM (a transformers model as it is, a model of your own
described by :class:`ModelParts`): one configuration, one mesh, one pure loss function
(torchtitan's ``ParallelDims`` + ``parallelize``, MaxText's mesh of named axes).

:class:`ParallelDims` holds every degree; :meth:`ParallelDims.mesh` names one mesh axis per
degree, outermost first as torchtitan's: ``("pp", "dp_replicate", "dp_shard", "ep", "cp",
"tp")`` (expert parallelism carves its ranks out of the data: the batch is split over
``dp_replicate x dp_shard x ep``). :func:`parallelize` applies the strategies in one fixed order
and returns the sharded params and ``loss(params, batch)``, which ``fs.value_and_grad``,
``torch.func.grad`` and ``fs.remat`` take like any other function. The order, written once:

1. tensor parallel: the model's shipped plan (:func:`~fshard.parallel.hf_tp_plan`) over ``tp``;
2. expert parallel: the MoE experts split over ``ep`` (:func:`expert_parallel_plan`);
3. FSDP / HSDP: every param also split over ``dp_shard`` (:func:`fsdp_plan` over the plans
   above), replicated over ``dp_replicate``; with ``ep > 1`` or ``cp > 1`` over those too,
   ``("dp_shard", "ep", "cp")`` (:attr:`ParallelDims.fsdp_axes`, torchtitan's ``fsdp`` mesh,
   ``dp_shard_cp`` with its ep ranks inside): params, gradients and optimizer state
   ``1/(dp_shard * ep * cp)`` a rank, each unit's gradient one reduce_scatter over those
   ranks (its sums over ep and cp included, no all_reduce over them); an expert, split over
   ``ep`` by its plan, over ``("ep", "dp_shard", "cp")``, or, whose count does not split over
   those, ``ep`` and the longest prefix of the others that does (``("ep", "dp_shard")``: its
   own group, its shard summed over cp); with ``dp_shard == 1`` nothing is split over ep or
   cp (the params replicated over them);
4. pipeline parallel: the decoder layers (``config.base_model_pp_plan``'s ``layers``) stacked
   as stages over ``pp`` (:func:`stack_stages`: each stage's layers keep the layouts of 1-3);
   the embedding held by the first stage's ranks only and the final norm and head by the
   last's (:func:`on_stage`, keeping the layouts of 1-3 there), as torchtitan's split holds
   them: no memory or optimizer work for them on other stages and no all_reduce over ``pp``
   of their gradients (a param both ends use, an embedding tied to the head, stays replicated
   over ``pp``, its gradient summed over it);
5. the call: :func:`fsdp_call` (each block gathered over the FSDP axes just before use) or
   :func:`fshard.nn.functional_call`, inside :func:`expert_parallel_call` with ``ep``; with
   ``pp`` run per piece of the model (embedding, each decoder layer of a stage, norm + head)
   by :func:`pipeline`, otherwise on the whole model, inside :func:`context_parallel_loss`'s
   ``shard_map`` over ``cp`` (the sequence split, ring or all-to-all attention).

The plans stay data (``{name: P}``, what :func:`fshard.nn.shard_params` takes): nothing mutates
the model. With ``pp > 1`` the params are the model's names outside the decoder layers plus
one entry under the layers' name (``"model.layers"``): ``{name in a layer: (pp * virtual,
layers per stage, ...)}`` (:func:`unstack_stages` gives the layers' names back; a fused
projection's :class:`~fshard.Parts` keeps its parts, its dim moved past those two); the ends'
params have a :class:`~fshard.spec.HeldLayout` (``fs.gather`` gives them whole, as any). With ``pp``
and ``cp`` the sequence is split over ``cp`` in the pipeline's activations (load-balanced
chunks; each layer's attention a ring or all-to-all over ``cp``, the rotary embeddings of the
rank's chunks carried with the activations; a plan's sequence-parallel output layout splits
each cp chunk over ``tp``: ``("cp", "tp")``). Not composed yet: an ``attention_mask`` with
``pp``, models whose layers differ (``config.layer_types``) or whose loss adds the router's
auxiliary loss (``output_router_logits``) with ``pp`` (refused by name).

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

import contextlib
import functools
import inspect
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from .. import config, consistency
from ..api import gather, reshard, shard
from ..array import ShardedArray
from ..mesh import Mesh
from ..module import functional_call, shard_params
from ..nn_plan import Output, match_plan
from ..precision import MixedPrecisionPolicy
from ..remat import POLICIES as REMAT_POLICIES
from ..remat import remat as remat_fn
from ..spec import Layout, P, Parts, PartsLayout, spec_of_dims
from .context import (
    _ACTIVE,
    _attention_of,
    _loss_dtype,
    context_parallel_loss,
    forward_kwargs,
    load_balance,
    target_count,
)
from .context import _ATTENTION as _RING
from .expert import (
    _check_experts,
    _experts_modules,
    _unsupported_experts,
    expert_parallel_call,
    expert_parallel_plan,
)
from .fsdp import fsdp_call, fsdp_plan, fsdp_units
from .pipeline import on_stage, pipeline, pipeline_schedule, stack_stages
from .tensor import hf_tp_plan

__all__ = ["ModelParts", "ParallelDims", "parallelize"]

#: The mesh axes, outermost first (torchtitan's order).
AXES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
_ATTENTION = ("ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """Every parallelism degree of a training job (torchtitan's ``ParallelDims``).

    Args:
        dp_replicate: data-parallel replicas (DDP; with ``dp_shard > 1``: HSDP's replicas).
        dp_shard: FSDP: params, gradients and optimizer state split over these ranks (with
            ``cp > 1`` over these x the cp ranks: :attr:`fsdp_axes`).
        cp: context parallel: the sequence split over these ranks (with ``dp_shard > 1`` FSDP
            splits the params over them too, as torchtitan's ``dp_shard_cp``).
        tp: tensor parallel (the model's shipped plan).
        ep: expert parallel: the MoE experts split over these ranks (which also split the
            batch).
        pp: pipeline stages: the decoder layers split into ``pp * pp_virtual`` stages.
        cp_attention: ``"ring"`` or ``"ulysses"``.
        pp_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb"`` (ZB-H1), as
            :func:`fshard.parallel.pipeline`.
        pp_microbatches: the microbatches of a step (default ``pp * pp_virtual``); the batch
            splits into them, each split over the batch axes.
        pp_virtual: stages per rank (``pp_schedule="interleaved"``).

    Example:
        >>> dims = fs.parallel.ParallelDims(dp_shard=4, tp=2)
        >>> dims.world_size, dims.shape, dims.batch_axes
        (8, (1, 1, 4, 1, 1, 2), ('dp_replicate', 'dp_shard', 'ep'))
        >>> fs.parallel.ParallelDims(pp=2, pp_schedule="zb").microbatches
        2
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp_attention: str = "ring"
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_virtual: int = 1

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp", "pp_virtual"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelDims: {name} must be an int >= 1, got {v!r}")
        if self.cp_attention not in _ATTENTION:
            raise ValueError(
                f"ParallelDims: cp_attention must be one of {_ATTENTION}, got {self.cp_attention!r}"
            )
        m = self.pp_microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(
                f"ParallelDims: pp_microbatches must be an int >= 1 or None, got {m!r}"
            )
        if self.pp == 1 and (m is not None or self.pp_virtual != 1):
            raise ValueError(
                "ParallelDims: pp_microbatches and pp_virtual split the pipeline's stages; they "
                f"need pp > 1, got pp=1, pp_microbatches={m!r}, pp_virtual={self.pp_virtual}"
            )
        try:
            pipeline_schedule(self.pp_schedule, self.pp, self.microbatches, self.pp_virtual)
        except ValueError as e:
            raise ValueError(f"ParallelDims: pp_schedule: {e}") from None

    @property
    def microbatches(self) -> int:
        """The pipeline's microbatches a step (1 without ``pp``)."""
        return self.pp_microbatches or self.pp * self.pp_virtual

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The mesh axes FSDP splits params, gradients and optimizer state over (with
        ``dp_shard > 1``): ``dp_shard`` and, of ``ep`` and ``cp``, those above 1, in mesh order
        (torchtitan's ``fsdp`` mesh, ``dp_shard_cp``, whose dp_shard holds its ep ranks):
        each rank holds ``1/(dp_shard * ep * cp)`` of a dense param, the blocks in that order,
        dp_shard outer; a unit's gradient is one reduce_scatter over those ranks, which sums
        it over ep and cp too. The batch is split over ep as over dp_shard, so a dense
        (non-expert) param is replicated over ep: FSDP over ep too halves its memory (at ep
        2) and needs no sum of its own (sharded over dp_shard alone it took one all_reduce
        over ep per param at its full size, 17 a step on a 2-layer Mixtral at dp_shard 2 x ep
        2; the HSDP-like sum of the reduce-scattered shards over ep logs 2.5 S bytes a rank
        where this logs 1.5 S, for a layer gathered twice of S bytes: docs/DESIGN.md). The
        group is the ranks sharing every other coordinate (pp, dp_replicate, tp). An expert
        (split over ``ep`` by its plan) is split over ``("ep", "dp_shard", "cp")``
        (torchtitan's ``efsdp``), or, where its count does not split over those, over ``ep``
        and the longest prefix of the other FSDP axes that it does (4 experts at ep 2 x
        dp_shard 2 x cp 2: ``("ep", "dp_shard")``, gathered and reduce-scattered over
        dp_shard, its shard's gradient summed over cp; :func:`fsdp_plan`). With ``dp_shard ==
        1`` there is no FSDP: the params stay whole over ep and cp (replicated, their
        gradients summed over them by the gradient sync, bucketed).

        Example:
            >>> fs.parallel.ParallelDims(dp_shard=2, cp=2).fsdp_axes
            ('dp_shard', 'cp')
            >>> fs.parallel.ParallelDims(dp_shard=2, ep=2, cp=2).fsdp_axes
            ('dp_shard', 'ep', 'cp')
            >>> fs.parallel.ParallelDims(dp_shard=2, tp=2).fsdp_axes
            ('dp_shard',)
        """
        if self.dp_shard == 1:
            return ("dp_shard",)
        return ("dp_shard", *(a for a in ("ep", "cp") if getattr(self, a) > 1))

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape, one entry per axis of :data:`AXES`."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.ep, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        """The number of ranks: the product of the degrees."""
        return math.prod(self.shape)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch (dim 0) is split over."""
        return ("dp_replicate", "dp_shard", "ep")

    def mesh(self, device_type: str | None = None) -> Mesh:
        """The mesh of these degrees (an initialised process group of :attr:`world_size`
        ranks: ``fs.launch.run`` or ``torchrun``).

        Example:
            >>> fs.parallel.ParallelDims(tp=2).mesh().axis_names  # 2 ranks
            ('pp', 'dp_replicate', 'dp_shard', 'ep', 'cp', 'tp')
        """
        return Mesh.create(self.shape, AXES, device_type=device_type)

    def abstract_mesh(self) -> Mesh:
        """The same mesh without a process group (layout math, planning, ``fs.plan``).

        Example:
            >>> fs.parallel.ParallelDims(dp_shard=512, tp=2).abstract_mesh().size("dp_shard")
            512
        """
        return Mesh.abstract(self.shape, AXES)


@dataclass(frozen=True)
class ModelParts:
    """A causal LM of your own, for :func:`parallelize`: its plan and where its pieces are.

    The model's forward takes ``(input_ids)`` (and ``position_ids=``, ``attention_mask=``
    where it uses them) and returns the logits ``(batch, seq, vocab)`` (or an output with
    ``.logits``); :func:`parallelize` adds the loss. Its attention calls
    :func:`fshard.parallel.attention` (scaled dot-product attention, the ring or all-to-all
    over ``cp`` under context parallelism); a mixture of experts calls
    :func:`fshard.parallel.moe_experts` on experts the plan splits over ``ep``.

    Args:
        plan: ``{name pattern: P or fs.nn.Output}`` over the mesh axes ``"tp"`` and ``"ep"``
            (:func:`fshard.nn.megatron_plan`, :func:`sequence_parallel_plan`, experts as
            ``P("ep")``), as :func:`fshard.nn.shard_params` takes; FSDP's ``dp_shard`` is added
            by :func:`parallelize`. On an axis of degree 1 an entry splits nothing.
        embed: the embedding module's name: ``embed(input_ids)`` (or ``embed(input_ids,
            position_ids=...)``: position embeddings) gives the hidden states.
        layers: the decoder layers' ``torch.nn.ModuleList`` (alike: ``pp`` stacks them as
            stages), each ``layer(hidden) -> hidden``.
        norm: the final norm's name.
        head: the output projection's name (``head(norm(hidden))`` are the logits).

    Example:
        >>> parts = fs.parallel.ModelParts(
        ...     plan=fs.nn.megatron_plan(column=["blocks.*.fc1"], row=["blocks.*.fc2"], axis="tp"),
        ...     embed="embed", layers="blocks", norm="ln_f", head="head")
        >>> parts.layers
        'blocks'
    """

    plan: Mapping = field(default_factory=dict, hash=False)
    embed: str = "embed"
    layers: str = "layers"
    norm: str = "norm"
    head: str = "head"

    def __post_init__(self):
        if not isinstance(self.plan, Mapping):
            raise TypeError(f"ModelParts: plan must be a mapping, got {type(self.plan).__name__}")
        for piece in ("embed", "layers", "norm", "head"):
            if not isinstance(getattr(self, piece), str):
                raise TypeError(
                    f"ModelParts: {piece} must be a module name (str), got "
                    f"{type(getattr(self, piece)).__name__}"
                )


def parallelize(
    model: torch.nn.Module,
    mesh: Mesh,
    dims: ParallelDims,
    *,
    parts: ModelParts | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    remat: bool | str = False,
) -> tuple[dict, Callable]:
    """Shard a causal LM for ``dims`` on ``mesh`` and return ``(params, loss)``: a
    transformers model as it is, a model of your own described by ``parts``.

    ``loss(params, batch)`` is the model's mean next-token cross entropy (transformers'
    ``model(input_ids, labels=labels).loss``) with every strategy of ``dims`` applied, in the
    order of the module docstring; ``batch`` is ``{"input_ids": (batch, seq) tensor, "labels":
    optional, "attention_mask": optional}``, the full tensors, the same on every rank (each
    rank keeps its block); ``"targets"`` instead of ``"labels"`` gives the token each position
    predicts, already shifted (torchtitan's convention; the loss is then the mean over every
    target not -100). A pure function of ``params``: ``fs.value_and_grad`` gives every
    gradient in its parameter's layout.

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``, ``MixtralForCausalLM``, ...);
            with ``tp > 1`` it must ship a tensor-parallel plan; with ``pp > 1`` its config a
            ``base_model_pp_plan`` (embedding, decoder layers, norm) and its layers alike, and
            its forward, run once on one row of 8 ids (on meta params too), must pass each
            piece's output on to the next as it is (else refused, ``NotImplementedError``:
            also where that run raises or skips a piece).
        mesh: ``dims.mesh()`` (axes :data:`AXES`).
        dims: the degrees.
        parts: a model of your own (:class:`ModelParts`: its tensor / expert-parallel plan
            and the names of its embedding, layers, norm and head); ``None``: a transformers
            model, whose shipped plans and ``base_model_pp_plan`` are read.
        mp_policy: a :class:`~fshard.nn.MixedPrecisionPolicy` for the params, or ``None``.
        remat: activation checkpointing per decoder layer (torchtitan's full AC): ``True``
            runs each decoder layer under :func:`fshard.remat` (only its inputs saved; the
            backward recomputes it, FSDP's gathers, TP's collectives, ring attention and the
            experts' dispatch included), with ``pp`` each layer of a stage, without it each
            layer inside the whole model's call (its ``forward`` swapped for the call's
            duration); or a :func:`fshard.remat` policy name (``"collectives"``: the layer's
            collective outputs saved too; not yet with ``dp_shard > 1``, refused); ``False``:
            none. The layers are ``parts.layers`` or a transformers model's
            ``base_model_pp_plan`` layers.

    Returns:
        ``(params, loss)``; with ``pp > 1`` the decoder layers' params are stacked under the
        layers' name (see the module docstring).

    Example:
        >>> import transformers
        >>> transformers.logging.set_verbosity_error()
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=32,
        ...     intermediate_size=64, vocab_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...     num_key_value_heads=2))
        >>> dims = fs.parallel.ParallelDims(tp=2)  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> params, loss = fs.parallel.parallelize(model, dims.mesh(), dims)
        >>> params["model.layers.0.self_attn.q_proj.weight"].spec  # the model's shipped plan
        P('tp')
        >>> ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        >>> torch.allclose(loss(params, {"input_ids": ids}), model(ids, labels=ids).loss, atol=1e-5)
        True
        >>> dims = fs.parallel.ParallelDims(pp=2)  # 2 ranks: the layers as 2 stages, 1F1B
        >>> params, loss = fs.parallel.parallelize(model, dims.mesh(), dims)
        >>> params["model.layers"]["self_attn.q_proj.weight"].shape  # (stages, layers, ...)
        torch.Size([2, 1, 32, 32])
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
    if not isinstance(remat, (bool, str)) or (
        isinstance(remat, str) and remat not in REMAT_POLICIES
    ):
        raise ValueError(
            f"parallelize: remat must be True, False or a fs.remat policy {REMAT_POLICIES}, "
            f"got {remat!r}"
        )
    if remat not in (True, False, None, "nothing") and dims.dp_shard > 1:
        raise ValueError(
            f"parallelize: remat={remat!r} with dp_shard > 1 is not composed yet: FSDP's "
            "forward gathers a unit's params at once (packed, eager) and its recompute param "
            "by param, so the collective or matmul outputs the policy saves do not line up "
            "with the recompute's; use remat=True (the recompute gathers again, as FSDP2 with "
            "activation checkpointing does)"
        )
    if parts is not None and not isinstance(parts, ModelParts):
        raise TypeError(
            f"parallelize: parts must be a fs.parallel.ModelParts or None, got {type(parts).__name__}"
        )
    if dims.cp > 1 and parts is None:
        _check_cp(model)
    pieces = _pipeline_parts(model, dims, parts) if dims.pp > 1 else None
    if remat is not False and pieces is None:
        layers = _layers_name(model, parts)
    # 1-3: the plan, as data: tp, then ep (a transformers model's shipped plans; a model of
    # your own, its plan over those axes), then FSDP over both
    plan: dict = {}
    if parts is not None:
        plan.update(parts.plan)
    if dims.tp > 1 and parts is None:
        try:
            plan.update(hf_tp_plan(model, "tp"))
        except ValueError as e:  # its advice is hf_tp_plan's options, which parallelize lacks
            raise ValueError(
                f"parallelize: tp > 1 splits {type(model).__name__} by the tensor-parallel plan "
                f"it ships, which fshard cannot take as it is ({e}); parallelize takes no "
                "unsupported= option: use tp = 1 for it, or build the sharded params "
                "yourself (fs.nn.hf_tp_plan(model, unsupported='replicate'), "
                "fs.nn.shard_params) outside parallelize"
            ) from None
    if dims.ep > 1 and parts is None:  # the experts' dim over ep, their I dim as tp gave it
        for name, spec in expert_parallel_plan(model, mesh, "ep").items():
            plan[name] = _on_experts_axis(plan.get(name), spec)
    outputs = _outputs(model, plan)  # the module output layouts (fsdp_plan keeps params only)
    fsdp_axes = dims.fsdp_axes
    if dims.dp_shard > 1:
        plan = fsdp_plan(model, mesh, fsdp_axes, base=plan)
    params = shard_params(model, mesh, plan, mp_policy=mp_policy)
    # 4: the decoder layers as stages over pp, each keeping the layouts of 1-3
    if pieces is not None:
        named = {k: v.detach() for k, v in model.named_parameters()}
        stages = stack_stages(named, mesh, prefix=pieces.layers, plan=plan, virtual=dims.pp_virtual)
        params = {k: v for k, v in params.items() if not k.startswith(pieces.layers + ".")}
        params[pieces.layers] = stages
        # the ends held by their stage's ranks only (the embedding by the first's, the norm and
        # head by the last's), as torch.distributed.pipelining holds them: no memory or
        # optimizer work elsewhere, no all_reduce over pp of their gradients (fs.parallel.
        # on_stage); a param both ends use (an embedding tied to the head) stays replicated
        firsts = set(pieces.names["embed"].values())
        lasts = set(pieces.names["norm"].values()) | set(pieces.names["head"].values())
        for names, index in ((firsts - lasts, 0), (lasts - firsts, dims.pp - 1)):
            for k in names:
                params[k] = on_stage(params[k], mesh, index)
    # 5: the call, innermost first: FSDP's gathers, inside the experts' dispatch. The plan's
    # output layouts apply on every path (a row-parallel output reduced where it leaves its
    # layer, as Megatron does, not left pending into the residual stream, where each later use
    # reduces it again), the batch dim keeping its split (a replicated P() would gather it)
    batch_outputs = {n: _with_batch(spec, dims.batch_axes) for n, spec in outputs.items()}
    call: Callable = functools.partial(functional_call, mp_policy=mp_policy, outputs=batch_outputs)
    if dims.dp_shard > 1:
        replicate = "dp_replicate" if dims.dp_replicate > 1 else None
        call = functools.partial(
            fsdp_call, mesh=mesh, axis=fsdp_axes, replicate=replicate, mp_policy=mp_policy,
            outputs=batch_outputs,
        )  # fmt: skip
    # transformers' experts run by fs.parallel.moe_experts with ep, or with tp splitting them
    # (a model of your own calls moe_experts itself); experts it does not run (GPT-OSS's
    # interleaved, transposed, biased ones: hf_tp_plan leaves them replicated) run their own
    # forward under tp (expert_parallel_plan refuses them with ep)
    runs = [n for n, m in _experts_modules(model) if not _unsupported_experts(m)]
    if parts is None and dims.ep == 1 and dims.tp > 1 and runs:
        for name, m in _experts_modules(model):
            _check_experts(name, m)  # one experts implementation per model: all or none
    if parts is None and (dims.ep > 1 or (dims.tp > 1 and runs)):
        call = functools.partial(_experts, call=call)
    if remat is not False and pieces is None:  # each decoder layer under fs.remat, in one call
        policy = None if remat is True else remat
        call = _RematLayers(
            model, layers, call, policy, batch_outputs, fsdp=dims.dp_shard > 1, mp_policy=mp_policy
        )
    if pieces is not None:  # the pieces of the model, the layers as stages
        policy = None if remat is True else remat  # False: no remat
        return params, _pipeline_loss(model, pieces, mesh, dims, call, mp_policy, outputs, policy)
    batch_axes = dims.batch_axes

    def loss(params: Mapping, batch: Mapping) -> torch.Tensor:
        ids, labels, mask, targets = _batch(batch)
        if dims.cp > 1:  # the sequence split over cp, inside a shard_map over it
            return context_parallel_loss(
                model, params, mesh, ids, labels, mask, attention=dims.cp_attention,
                batch=batch_axes, call=call, targets=targets,
            )  # fmt: skip
        spec = P(batch_axes)
        kwargs = {"use_cache": False}
        if mask is not None:
            kwargs["attention_mask"] = shard(mask, mesh, spec)
        if parts is None and targets is None:  # transformers' own loss
            kwargs["labels"] = shard(ids if labels is None else labels, mesh, spec)
            return gather(call(model, params, (shard(ids, mesh, spec),), kwargs).loss)
        if targets is None:
            targets = _shifted(ids if labels is None else labels)
        kwargs = forward_kwargs(model, kwargs, "parallelize's loss")
        out = call(model, params, (shard(ids, mesh, spec),), kwargs)
        logits = getattr(out, "logits", out)
        ce = F.cross_entropy(
            logits.flatten(0, -2).to(_loss_dtype(logits)), shard(targets, mesh, spec).flatten(),
            ignore_index=-100, reduction="sum",
        )  # fmt: skip
        return gather(ce) / target_count(targets)

    return params, loss


def _check_cp(model: torch.nn.Module) -> None:
    """Refuse a transformers model context parallelism would run silently wrong: its
    attention must go through transformers' attention interface (switched to the ring's) and
    its positions be the ``position_ids`` it is given (the global ones of each chunk)."""
    name = type(model).__name__
    why = None
    if not getattr(model, "_supports_attention_backend", False):
        why = "its attention does not go through transformers' attention interface"
    elif "position_ids" not in inspect.signature(model.forward).parameters:
        why = "its forward takes no position_ids"
    else:
        offset = [
            n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding) and "position" in n and m.padding_idx is not None
        ]  # fmt: skip
        if offset:  # RoBERTa's: positions start after padding_idx, counted from the ids
            why = f"its positions ({offset[0]}) are offset by a padding_idx"
        elif mixers := _sequence_mixers(model):
            why = (
                f"its decoder layers mix positions other than by causal softmax attention "
                f"over the whole prefix ({mixers}), which ring attention does not compute"
            )
    if why:
        raise ValueError(
            f"parallelize: cp > 1 splits the sequence and runs ring attention with each chunk's "
            f"global position_ids; {name} cannot: {why}; use cp = 1 for it"
        )


#: the decoder layer kinds (transformers' ``config.layer_types``) whose only mixing across
#: positions is softmax attention through the attention interface (a sliding window is refused
#: where the attention is called, naming it)
_CP_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _sequence_mixers(model: torch.nn.Module) -> str:
    """What mixes positions in ``model``'s decoder layers besides the attention interface's
    softmax attention (``""``: nothing found): layer kinds other than full / sliding attention
    (``config.layer_types``: linear attention, convolution, state-space, hybrid, indexed or
    compressed attention), convolutions over the sequence (kernel > 1: short convolutions,
    Mamba's), state-space parameters (``A_log``, ``dt_bias``)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = []
    types = getattr(text, "layer_types", None) or getattr(config, "layer_types", None) or ()
    other = sorted({t for t in types if isinstance(t, str)} - _CP_LAYER_TYPES)
    if other:
        found.append(f"config.layer_types {other}")
    # the text decoder's layers (not a vision tower's patch convolution), else the whole model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(layers, torch.nn.ModuleList) and id(layers) in names:
        root, pre = layers, names[id(layers)] + "."
    else:
        root, pre = model, ""
    convs = [
        pre + n for n, m in root.named_modules()
        if isinstance(m, _CONVS) and any(k > 1 for k in m.kernel_size)
    ]  # fmt: skip
    if convs:
        found.append(f"convolutions {convs[:2]}")
    ssm = [
        pre + n for n, _ in root.named_parameters() if n.rsplit(".", 1)[-1] in ("A_log", "dt_bias")
    ]
    if ssm:
        found.append(f"state-space parameters {ssm[:2]}")
    return "; ".join(found)


def _layers_name(model: torch.nn.Module, parts: ModelParts | None) -> str:
    """The name of the decoder layers' ``ModuleList``: ``parts.layers``, or a transformers
    model's (its config's ``base_model_pp_plan``)."""
    if parts is not None:
        name = parts.layers
    else:
        prefix = getattr(model, "base_model_prefix", "")
        pp_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
        if "layers" not in pp_plan or not prefix or not hasattr(model, prefix):
            raise NotImplementedError(
                f"parallelize: remat= checkpoints each decoder layer: {type(model).__name__}'s "
                "config has no base_model_pp_plan naming its layers; for a model of your own "
                "give parts=ModelParts(layers=...)"
            )
        name = f"{prefix}.layers"
    if not isinstance(model.get_submodule(name), torch.nn.ModuleList):
        raise ValueError(f"parallelize: remat=: {name!r} is not a torch.nn.ModuleList")
    return name


class _RematLayers:
    """``call`` (the model's call: ``functional_call`` or ``fsdp_call``, inside
    ``expert_parallel_call``) with each decoder layer run under :func:`fshard.remat`: the
    layer's ``forward`` is, for the call, a checkpointed call of ``call`` on the layer and its
    params, so FSDP's gather of the layer happens inside the checkpoint and again in the
    recompute (FSDP2 with activation checkpointing); the plan's output layouts inside a layer
    apply there too, and context parallelism's attention (entered by
    :func:`context_parallel_loss` around the whole call) is entered again in the recompute,
    which runs in the backward, after the call. A layer's call casts its params by the
    mixed-precision policy but not its arguments or outputs: the policy's ``output_dtype`` and
    input cast belong to the model's call, whose layers pass their activations on in the compute
    dtype (a float32 cast of each layer's output met the final norm's bfloat16 weight: ``mixed
    dtype``), so a checkpointed layer computes what it computes without remat."""

    def __init__(
        self, model, layers: str, call, policy, outputs: Mapping, *, fsdp: bool, mp_policy=None
    ):
        self.model, self.layers, self.call, self.policy = model, layers, call, policy
        self.options = (
            {}
            if mp_policy is None
            else {"mp_policy": mp_policy._replace(output_dtype=None, cast_forward_inputs=False)}
        )
        self.modules = list(model.get_submodule(layers))
        self.pres = [f"{layers}.{i}." for i in range(len(self.modules))]
        self.inner = [
            {n[len(pre) :]: o for n, o in outputs.items() if n.startswith(pre)} for pre in self.pres
        ]
        self.outer = {n: o for n, o in outputs.items() if not n.startswith(f"{layers}.")}
        self.units = None
        if fsdp:  # the outer call gathers everything but the layers (each gathers its own)
            units = fsdp_units(model)
            self.units = {u: ns for u, ns in units.items() if not u.startswith(f"{layers}.")}

    def __call__(self, module, params, args=(), kwargs=None, **options):
        if module is not self.model:
            raise ValueError("parallelize: the composed call runs the model it was built for")
        active = _ACTIVE.get()  # cp's attention: entered again in the recompute
        per = [
            {n[len(pre) :]: v for n, v in params.items() if n.startswith(pre)} for pre in self.pres
        ]
        outer = {n: v for n, v in params.items() if not n.startswith(f"{self.layers}.")}
        forwards = [self._forward(i, per[i], active) for i in range(len(self.modules))]
        options = {**options, "outputs": self.outer}
        if self.units is not None:
            options["units"] = self.units
        for layer, fwd in zip(self.modules, forwards):
            layer.forward = fwd
        try:
            return self.call(module, outer, args, kwargs, **options)
        finally:
            for layer in self.modules:
                layer.__dict__.pop("forward", None)

    def _forward(self, i: int, params: dict, active):
        layer, call, inner, model = self.modules[i], self.call, self.inner[i], self.model
        options = self.options

        def run(ps, args, kwargs):
            patched = layer.__dict__.pop("forward", None)  # the layer's own forward inside
            try:
                with (
                    _attention_of(model, active[2], active[0], active[1])
                    if active
                    else (contextlib.nullcontext())
                ):
                    return call(layer, ps, args, kwargs, outputs=inner, **options)
            finally:
                if patched is not None:
                    layer.forward = patched

        checkpointed = remat_fn(run, self.policy)
        return lambda *args, **kwargs: checkpointed(params, args, kwargs)


def _on_experts_axis(tp_spec, ep_spec: P):
    """A stacked experts param's layout: ``ep_spec``'s split of the experts' dim (0) with
    ``tp_spec``'s (:func:`hf_tp_plan`: a :class:`~fshard.Parts` of the [gate | up] halves, or
    down's I dim) of the others."""
    if tp_spec is None:
        return ep_spec
    (axis,) = ep_spec.dims[0]
    if isinstance(tp_spec, Parts):
        rest = tp_spec.spec.padded(3)[1:]
        return Parts(P(axis, *(d or None for d in rest)), tp_spec.dim, tp_spec.sizes)
    return P(axis, *(d or None for d in tp_spec.padded(3)[1:]))


def _experts(model, params, args, kwargs, *, call, **options):
    inner = functools.partial(call, **options) if options else call
    return expert_parallel_call(model, params, args, kwargs, call=inner)


# -- pipeline parallelism of a transformers causal LM -----------------------------------------


@dataclass(frozen=True)
class _Parts:
    """Where the pieces of a transformers causal LM are: module names, and each piece's
    params as ``{name in the piece: name in params}`` (a tied head reads the embedding's)."""

    embed: str
    layers: str
    norm: str
    head: str
    names: Mapping[str, Mapping[str, str]]


def _pipeline_parts(
    model: torch.nn.Module, dims: ParallelDims, parts: ModelParts | None = None
) -> _Parts:
    config = getattr(model, "config", None)
    module_names = {id(m): k for k, m in model.named_modules()}
    if parts is None:
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        pp_plan = getattr(config, "base_model_pp_plan", None) or {}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        missing = [k for k in ("embed_tokens", "layers", "norm") if not hasattr(base, k)]
        if base is not None and head is not None and set(missing) & set(pp_plan):
            raise NotImplementedError(
                f"parallelize: pp > 1 splits a transformers causal LM into the pieces its "
                f"config's base_model_pp_plan names ({sorted(pp_plan)}); "
                f"{type(model).__name__}'s {type(base).__name__} has no {missing} (the plan "
                "does not match the model); use pp = 1 for it, or give parts=ModelParts(...) "
                "naming its embedding, layers, norm and head"
            )
        if base is None or head is None or not {"embed_tokens", "layers", "norm"} <= set(pp_plan):
            raise NotImplementedError(
                f"parallelize: pp > 1 splits a transformers causal LM into embedding, decoder "
                f"layers and norm (its config's base_model_pp_plan) and head; "
                f"{type(model).__name__} has base_model_pp_plan {sorted(pp_plan)} and head "
                f"{type(head).__name__}; for a model of your own give parts=ModelParts(...)"
            )
        modules = {"embed": base.embed_tokens, "layers": base.layers, "norm": base.norm,
                   "head": head}  # fmt: skip
    else:
        modules = {}
        for piece in ("embed", "layers", "norm", "head"):
            name = getattr(parts, piece)
            try:
                modules[piece] = model.get_submodule(name)
            except AttributeError:
                raise ValueError(
                    f"parallelize: parts.{piece} = {name!r} is not a submodule of "
                    f"{type(model).__name__}"
                ) from None
        if not isinstance(modules["layers"], torch.nn.ModuleList):
            raise ValueError(
                f"parallelize: parts.layers = {parts.layers!r} must name a torch.nn.ModuleList, "
                f"got {type(modules['layers']).__name__}"
            )
    layers = modules["layers"]
    n = len(layers)
    stages = dims.pp * dims.pp_virtual
    if n % stages:
        raise ValueError(
            f"parallelize: the model's {n} decoder layers do not split into pp x pp_virtual = "
            f"{stages} stages"
        )
    kinds = {type(m).__name__ for m in layers} | set(getattr(config, "layer_types", None) or ())
    if len(kinds) != 1 + bool(getattr(config, "layer_types", None)):
        raise NotImplementedError(
            "parallelize: pp stacks the decoder layers, which must be alike; these differ: "
            f"{sorted(kinds)} (their classes and config.layer_types)"
        )
    # the causal LM's own forward changes the head's logits after lm_head, which the last
    # stage (norm, then the head module) would skip: Cohere's logit_scale, Gemma-2's soft cap,
    # Granite's logits_scaling
    scaled = {
        k: getattr(config, k, None)
        for k in ("logit_scale", "final_logit_softcapping", "logits_scaling")
    }
    scaled = {k: v for k, v in scaled.items() if v not in (None, 1, 1.0)}
    if parts is None and scaled:
        raise NotImplementedError(
            f"parallelize: pp > 1 runs the head module (lm_head) on the last stage; "
            f"{type(model).__name__}'s forward also changes its logits ({scaled}), which the "
            "stage would skip; use pp = 1 for it"
        )
    if parts is None:
        _check_pieces(model, modules)
    if getattr(config, "output_router_logits", False):
        raise NotImplementedError(
            "parallelize: pp with output_router_logits=True: the router's auxiliary loss sums "
            "over every layer, across the stages; set config.output_router_logits=False"
        )
    canonical: dict[int, str] = {}
    full: dict[str, str] = {}
    for k, p in model.named_parameters(remove_duplicate=False):
        full[k] = canonical.setdefault(id(p), k)
    out = {}
    for piece in ("embed", "norm", "head"):
        m = modules[piece]
        pre = module_names[id(m)]
        out[piece] = {r: full[f"{pre}.{r}"] for r, _ in m.named_parameters(remove_duplicate=False)}
    return _Parts(
        embed=module_names[id(modules["embed"])],
        layers=module_names[id(layers)],
        norm=module_names[id(modules["norm"])],
        head=module_names[id(modules["head"])],
        names=out,
    )


def _check_pieces(model: torch.nn.Module, modules: Mapping) -> None:
    """Refuse a transformers causal LM whose forward changes a value between the pieces the
    pipeline runs one after another (embedding, each decoder layer, norm, head): the stages
    pass each piece's output on as it is, so a scale or residual the model's own forward adds
    between them (InklingForCausalLM's ``last_hidden_state / logits_mup_width_multiplier``
    before lm_head, Granite's embedding and logits multipliers, Cohere's ``logit_scale``, a
    hidden state expanded before the first layer) would be skipped silently.

    Found by running the model once, as it is, on one short row of ids (no grad, eval mode:
    no dropout, the random state untouched) with hooks on the pieces: each piece's input must
    be the previous piece's output, the same tensor (or a view of it of the same shape: the
    head's ``hidden_states[:, slice(0, None)]``), or that tensor multiplied or divided by
    exactly 1 (:class:`_UnitScales`: Granite's multipliers at 1.0 change nothing), and the
    logits the head's output. Params on ``meta`` (a model built for planning, ``fs.dry_run``)
    are checked so too, the forward run on meta tensors (:class:`_MetaReads`): the check is by
    identity and by operation, not by values, and answers as on CPU.

    No model reaches the pipeline unchecked: one whose forward raises on that row (inputs it
    needs, a sequence length it cannot take, an op with no meta kernel, a number read from a
    meta tensor) or does not call a piece as the stages do (a layer it skips) is refused,
    naming the model and why."""
    layers = list(modules["layers"])
    seen: dict = {}

    def first(a, k):
        return a[0] if a else k.get("hidden_states")

    def out(o):
        return o[0] if isinstance(o, (tuple, list)) else o

    def put(key, value) -> None:  # the first call's (a hook returning a value replaces it)
        seen.setdefault(key, value)

    hooks = [
        modules["embed"].register_forward_hook(lambda m, a, o: seen.update(embed=out(o))),
        modules["norm"].register_forward_pre_hook(
            lambda m, a, k: seen.update(norm_in=first(a, k)), with_kwargs=True
        ),
        modules["norm"].register_forward_hook(lambda m, a, o: seen.update(norm=out(o))),
        modules["head"].register_forward_pre_hook(
            lambda m, a, k: seen.update(head_in=first(a, k)), with_kwargs=True
        ),
        modules["head"].register_forward_hook(lambda m, a, o: seen.update(head=out(o))),
    ]
    for i, layer in enumerate(layers):
        hooks.append(
            layer.register_forward_pre_hook(
                lambda m, a, k, i=i: put(("in", i), first(a, k)) or put(("kw", i), (a[1:], k)),
                with_kwargs=True,
            )
        )
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: put(("out", i), out(o))))
    training = {m: m.training for m in model.modules()}
    unit = _UnitScales()
    weight = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = weight.device if weight is not None else torch.device("cpu")
    meta = device.type == "meta"
    try:
        ids = torch.ones((1, 8), dtype=torch.long, device=device)
        model.eval()
        with torch.no_grad(), unit, _MetaReads() if meta else contextlib.nullcontext():
            logits = getattr(model(ids, use_cache=False), "logits", None)
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:200]
        on = " on its meta params" if meta else ""
        raise NotImplementedError(
            f"parallelize: pp > 1 checks that {type(model).__name__}'s forward passes each "
            f"piece's output (embedding, each decoder layer, norm, head) on as it is, by running "
            f"it once on one row of 8 ids{on}, which raised {type(e).__name__}: {first}; the "
            "stages could skip what it does between them unchecked; use pp = 1 for it"
        ) from e
    finally:
        for h in hooks:
            h.remove()
        for m, mode in training.items():
            m.training = mode

    def same(a, b) -> bool:
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return False
        while a is not b and id(a) in unit.sources:  # x * 1.0, x / 1.0: x itself
            a = unit.sources[id(a)][1]
        return a is b or (a._base is b and a.shape == b.shape)

    n = len(layers)
    steps = [
        ("between the embedding and the first decoder layer", ("in", 0), "embed"),
        *((f"between decoder layers {i} and {i + 1}", ("in", i + 1), ("out", i))
          for i in range(n - 1)),
        ("between the last decoder layer and the norm", "norm_in", ("out", n - 1)),
        ("between the norm and the head", "head_in", "norm"),
        ("after the head, on its logits", None, "head"),
    ]  # fmt: skip
    missing = [k for _, a, b in steps for k in (a, b) if k is not None and k not in seen]
    if missing:
        names = {"embed": "the embedding", "norm_in": "the norm", "norm": "the norm",
                 "head_in": "the head", "head": "the head"}  # fmt: skip
        called = sorted({names.get(k) or f"decoder layer {k[1]}" for k in missing})
        raise NotImplementedError(
            f"parallelize: pp > 1 runs the embedding, each decoder layer, the norm and the head "
            f"one after another; {type(model).__name__}'s forward did not call {called} so "
            "(the stages would run what it does not, or skip what it does instead); use pp = 1 "
            "for it"
        )
    # every layer runs with the keyword arguments the first one was given besides the hidden
    # states (_layer_kwargs): a per-layer input (Gemma 4's per_layer_input) would repeat layer
    # 0's, a positional one would be dropped
    if seen[("kw", 0)][0]:
        raise NotImplementedError(
            f"parallelize: pp > 1 runs every decoder layer with the hidden states and the "
            f"keyword arguments the model gives its first layer; {type(model).__name__} also "
            f"passes {len(seen[('kw', 0)][0])} positional input(s) after the hidden states; "
            "use pp = 1 for it"
        )
    other = next((i for i in range(1, n) if not _alike(seen[("kw", i)], seen[("kw", 0)])), None)
    if other is not None:
        kwargs, first_kwargs = seen[("kw", other)][1], seen[("kw", 0)][1]
        differ = [k for k in kwargs if not _alike(kwargs[k], first_kwargs.get(k))]
        raise NotImplementedError(
            f"parallelize: pp > 1 runs every decoder layer with what the model gives its first "
            f"layer besides the hidden states; {type(model).__name__} gives layer {other} "
            f"other inputs ({differ}); use pp = 1 for it"
        )
    for where, a, b in steps:
        if not same(logits if a is None else seen[a], seen[b]):
            raise NotImplementedError(
                f"parallelize: pp > 1 runs the embedding, each decoder layer, the norm and the "
                f"head one after another, each taking the previous one's output; "
                f"{type(model).__name__}'s forward changes the value {where} (a scale, "
                "residual or extra input the stages would skip); use pp = 1 for it"
            )


class _MetaReads(TorchDispatchMode):
    """Runs :func:`_check_pieces`' probe on a model whose params are on ``meta`` (a model built
    for planning, ``fs.dry_run``): the check is by identity and by operation, not by values, so
    the forward runs on meta tensors, and the few ops that read a value (``.item()``,
    ``bool(t)``, ``nonzero``) get one. A boolean read is true (the
    probe's ids are one unpadded row: transformers' "no packed sequences" test on the position
    ids is the one read the zoo's causal LMs make), ``nonzero`` finds every element non-zero
    (torch's ``meta_nonzero_assume_all_nonzero``: every expert of an MoE layer hit, so each
    path runs); a number read raises (the probe does not run: pp refused). Local to that one
    run: no collective passes through it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is not None and t.is_meta:
            if func is torch.ops.aten._local_scalar_dense.default:
                if t.dtype != torch.bool:  # a number drives what follows: not guessed
                    raise RuntimeError(f"the forward reads a {t.dtype} number of a meta tensor")
                return True
            if func is torch.ops.aten.nonzero.default:
                return torch.empty((t.numel(), t.dim()), dtype=torch.long, device="meta")
            if func is torch.ops.aten._grouped_mm.default and t.dtype != torch.bfloat16:
                # its meta kernel takes bfloat16 only (the CPU one float32 too: transformers'
                # experts at float32); the same shapes in bfloat16, cast back
                out_dtype = args[4] if len(args) > 4 else kwargs.pop("out_dtype", None)
                dtype = out_dtype or t.dtype
                wide = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point()
                        else a for a in args[:4]]  # fmt: skip
                return func(*wide, **kwargs).to(dtype)
        return func(*args, **kwargs)


class _UnitScales(torch.overrides.TorchFunctionMode):
    """Records, while :func:`_check_pieces` runs the model, each tensor made by multiplying or
    dividing another by exactly 1 (a Python number or a one-element tensor): ``sources[id(out)]
    = (out, x)``. A multiplier of 1.0 between two pieces (Granite's and HyperCLOVA X's
    ``embedding_multiplier`` and ``logits_scaling`` at 1.0) makes a new tensor of the same
    values for every input, which a stage may skip; by the operation, not by the values one
    run shows (a clamp or mask that happens not to change the probe's values is still refused).
    Local to that one run: no collective passes through it."""

    _OPS = {
        torch.mul, torch.div, torch.true_divide, torch.Tensor.mul, torch.Tensor.div,
        torch.Tensor.true_divide, torch.Tensor.__mul__, torch.Tensor.__rmul__,
        torch.Tensor.__truediv__,
    }  # fmt: skip

    def __init__(self):
        super().__init__()
        self.sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._OPS and not kwargs and len(args) == 2 and isinstance(out, torch.Tensor):
            x, c = args
            if isinstance(x, torch.Tensor) and x.shape == out.shape and _is_one(c):
                self.sources[id(out)] = (out, x)  # out kept alive: its id is not reused
        return out


def _is_one(c) -> bool:
    """Whether ``c`` is exactly the number 1 (a Python int or float, or a one-element tensor)."""
    if isinstance(c, bool):
        return False
    if isinstance(c, (int, float)):
        return c == 1
    if not isinstance(c, torch.Tensor) or c.numel() != 1 or c.is_meta:
        return False
    return bool(c == 1)


def _alike(a, b) -> bool:
    """Whether two layer inputs are the same: one tensor or equal ones, containers alike."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.is_meta or b.is_meta:  # no values to compare: the same tensor only
            return a is b
        return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_alike(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_alike, a, b))
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


def _outputs(model: torch.nn.Module, plan: Mapping) -> dict[str, P]:
    """The plan's :class:`~fshard.nn.Output` layouts by module name (matched by
    :func:`~fshard.nn.match_plan`'s rules: each rule's index rides as a tag)."""
    rules = [(g, o.spec) for g, o in plan.items() if isinstance(o, Output)]
    if not rules:
        return {}
    names = [n for n, _ in model.named_modules()]
    tags = match_plan(names, {g: P(str(i)) for i, (g, _) in enumerate(rules)})
    return {n: rules[int(t.dims[0][0])][1] for n, t in tags.items() if t.dims}


def _with_batch(spec: P, axes: tuple[str, ...], *, lead: int = 0, seq: tuple[str, ...] = ()) -> P:
    """A plan's output layout ``spec`` (its dims: rows, sequence, ...) for a call on
    activations: ``lead`` whole dims put in front (the pipeline's embedding output has the
    microbatches' dim first), the rows split over the batch ``axes`` where ``spec`` leaves
    them whole, and the sequence split over ``seq`` first, outer to ``spec``'s own split of it
    (the pipeline's activations hold the sequence split over cp: with sequence parallelism
    each rank's cp chunk is split over tp, ``("cp", "tp")``).

    Example:
        >>> _with_batch(P(None, "tp"), ("dp",), lead=1, seq=("cp",))
        P(None, 'dp', ('cp', 'tp'))
    """
    rows, sequence, *rest = spec.padded(2)
    if seq and not set(seq) & set(sequence):
        sequence = (*seq, *sequence)
    dims = [()] * lead + [rows or axes, sequence, *rest]
    while len(dims) > 1 and not dims[-1]:
        dims.pop()
    return spec_of_dims(dims, spec.partial)


class _Captured(Exception):
    pass


def _layer_kwargs(model: torch.nn.Module, parts: _Parts, positions: tuple, device, dtype) -> dict:
    """What the model's own forward passes its decoder layers besides the hidden states for a
    ``seq``-token sequence (the causal mask or ``None``, rotary position embeddings, position
    ids): read from its forward on one dummy sequence, stopped at the first layer, floating
    tensors cast to the compute ``dtype``. The same for every row and microbatch (no padding
    mask), so a stage closes over them."""
    base = model.get_submodule(parts.layers.rsplit(".", 1)[0]) if "." in parts.layers else model
    first = model.get_submodule(parts.layers)[0]
    seen: dict = {}

    def capture(module, args, kwargs):
        seen.update(kwargs)
        raise _Captured

    handle = first.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            pos = torch.tensor([positions], device=device)
            kwargs = forward_kwargs(base, {"position_ids": pos, "use_cache": False}, "parallelize")
            base(torch.zeros_like(pos), **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()

    def cast(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        if isinstance(v, tuple):
            return tuple(map(cast, v))
        return v

    return {k: cast(v) for k, v in seen.items() if k != "hidden_states"}


def _pipeline_loss(
    model, parts: _Parts, mesh: Mesh, dims: ParallelDims, call, mp_policy, outputs, remat=False
):
    """The causal-LM loss with the decoder layers pipelined over ``pp``: the embedding on the
    first stage (the pipeline's ``input_fn``), each stage's layers, the norm, head and loss on
    the last stage (:func:`pipeline`), every piece run by ``call`` with the plan's output
    layouts; each layer under :func:`fshard.remat` with ``remat`` (its policy, or ``None``)
    unless it is ``False``."""
    layer_name = f"{parts.layers}.0"
    axes = dims.batch_axes
    seq_axes = ("cp",) if dims.cp > 1 else ()
    pieces = {}
    for key, name in (("embed", parts.embed), ("layer", layer_name), ("norm", parts.norm),
                      ("head", parts.head)):  # fmt: skip
        # a plan's output layout names the model axes of (rows, sequence, ...); the rows keep
        # their split over the batch axes and the sequence its split over cp; the embedding's
        # output has the microbatches' dim in front
        lead = 1 if key == "embed" else 0
        rel = {
            n[len(name) + 1 :] if n != name else "": _with_batch(
                spec, axes, lead=lead, seq=seq_axes
            )
            for n, spec in outputs.items()
            if n == name or n.startswith(name + ".")
        }
        pieces[key] = (model.get_submodule(name), rel)
    # fsdp_call's default units of each piece, found once (fsdp_call walks the module's
    # params to find them at every call: 16 calls a step on a 2-layer stage, 4 microbatches)
    fsdp = isinstance(call, functools.partial) and call.func is fsdp_call
    units = {k: {"units": fsdp_units(mod)} if fsdp else {} for k, (mod, _) in pieces.items()}
    # A decoder layer whose params only FSDP splits (no tp, ep, cp or HSDP, no output layout
    # inside it, no mixed precision: untested there) runs on this rank's rows as plain
    # tensors: the layer is row-wise, so its local view is exact, and fsdp_call gives its
    # params gathered as plain tensors (the varying gathers, whose backward the pipeline's
    # step-mode gradient sync takes over). In the global view every op of the layer went
    # through an op rule (~400 a step on a stage of benchmarks/composed_step.py's FSDP x PP,
    # each a Python dispatch) for the same numbers.
    local_layers = (
        fsdp
        and mp_policy is None
        and not pieces["layer"][1]
        and dims.tp == dims.cp == dims.ep == dims.dp_replicate == 1
    )
    # the last stage's norm, head and cross entropy too (row-wise; the loss this rank's addend
    # of the sum over the batch axes, as the global view's is), and the first stage's
    # embedding (row-wise: a lookup per token; in the global view ~100 op-rule dispatches a
    # step on a stage-0 rank of benchmarks/composed_step.py's FSDP x PP)
    local_last = local_layers and not pieces["norm"][1] and not pieces["head"][1]
    local_first = local_layers and not pieces["embed"][1]

    def run(key, params, args, kwargs):
        # the plan's output layouts, as the whole model's call applies them: the same
        # collectives as without pp (a pending activation between stages is exact too since
        # the pipeline passes its stages' inputs as intermediates, issue 36)
        module, rel = pieces[key]
        inner = {n: spec for n, spec in rel.items() if n}
        out = call(module, params, args, kwargs, outputs=inner, **units[key])
        return reshard(out, rel[""]) if "" in rel and isinstance(out, ShardedArray) else out

    def layer(params, x, kwargs):
        return run("layer", params, (x,), kwargs)

    if remat is not False:  # the call inside: the recompute gathers (FSDP) again
        layer = remat_fn(layer, remat)

    m, axes = dims.microbatches, dims.batch_axes
    rows = m * math.prod(mesh.size(a) for a in axes)
    dtype = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype else None
    dtype = dtype or next(model.parameters()).dtype
    # the embedding's output: the policy's output dtype, else the (cast) params'
    act_dtype = mp_policy.output_dtype if mp_policy is not None else None
    act_dtype = act_dtype or dtype
    kwargs_of = functools.lru_cache(maxsize=8)(
        lambda positions, device: _layer_kwargs(model, parts, positions, device, dtype)
    )
    cp = dims.cp
    width = _out_width(pieces["embed"][0])

    def piece(params, name):
        return {r: params[k] for r, k in parts.names[name].items()}

    def loss(params: Mapping, batch: Mapping) -> torch.Tensor:
        ids, labels, mask, targets = _batch(batch)
        if mask is not None:
            raise ValueError(
                "parallelize's loss: batch['attention_mask'] with pp > 1 is not composed yet "
                "(the stages close over one causal mask); drop it or use pp=1"
            )
        b, s = ids.shape
        if b % rows:
            raise ValueError(
                f"parallelize's loss: batch['input_ids'] has {b} rows; with pp they split into "
                f"{m} microbatches over the batch axes ({rows // m} ranks): give a multiple of "
                f"{rows}"
            )
        if targets is None:
            targets = _shifted(ids if labels is None else labels)
        count = target_count(targets)  # the loss is the sum over every target / count
        order = tuple(range(s))
        if cp > 1:  # the sequence in load-balanced chunks, split over cp (ring attention)
            if s % (2 * cp):
                raise ValueError(
                    f"parallelize's loss: the sequence ({s}) must split into 2 x cp "
                    f"({2 * cp}) chunks"
                )
            order = tuple(load_balance(torch.arange(s), cp, 0).tolist())
            ids, targets = load_balance(ids, cp, 1), load_balance(targets, cp, 1)
        seq = (axes, "cp") if cp > 1 else (axes,)

        layer_kwargs = kwargs_of(order, ids.device)
        # with cp the rotary embeddings follow the rank's chunks: they ride with the
        # activations through the pipeline (after the hidden dims), not closed over
        rope = layer_kwargs.get("position_embeddings") if cp > 1 else None
        if cp > 1:  # causality: the ring's chunk arithmetic; no padding mask with pp
            drop = ("position_embeddings", "attention_mask", "position_ids")
            layer_kwargs = {k: v for k, v in layer_kwargs.items() if k not in drop}

        def split(t):
            return shard(t.reshape(m, b // m, s, *t.shape[2:]), mesh, P(None, *seq))

        # the batch's values, checked together as one boundary crossed every step (each
        # fs.shard compared its own, one exchange each): exchanged at the 1st, 2nd, 4th, ...
        # step, else folded into the mesh's running digest, which the pipeline's shard_map
        # compares (one exchange) before anything is sent: a per-rank batch still raises,
        # before the step's first collective
        data = {"ids": ids, "targets": targets}
        if "position_ids" in inspect.signature(pieces["embed"][0].forward).parameters:
            # an embedding of your own may add position embeddings
            data["position_ids"] = torch.tensor(order, device=ids.device).expand(b, s)
        if rope is not None:
            data["rope"] = torch.cat(rope, -1).expand(b, s, -1).to(act_dtype)
        consistency.boundary(
            mesh, "parallelize's loss (every rank must pass the same batch)", **data
        )
        with config.consistency(False):
            data = {k: split(v) for k, v in data.items()}

        def stage(p, x):
            kwargs, extra = layer_kwargs, None
            if rope is not None:  # (hidden | cos | sin) on the last dim
                hd = rope[0].shape[-1]
                x, extra = x[..., : -2 * hd], x[..., -2 * hd :]
                kwargs = {**kwargs, "position_embeddings": (extra[..., :hd], extra[..., hd:])}
            typed = local_layers and isinstance(x, ShardedArray) and not x.layout.partial
            h = x.local if typed else x
            for i in range(next(iter(p.values())).shape[0]):
                out = layer({k: _row(v, i) for k, v in p.items()}, h, kwargs)
                h = out[0] if isinstance(out, tuple) else out
            x = ShardedArray._derived(h, x.layout) if typed else h
            return x if extra is None else torch.cat([x, extra], -1)

        def last(hp, y, target):
            if rope is not None:
                y = y[..., : -2 * rope[0].shape[-1]]
            rows = None  # the local view (as the layers'): the axes this rank's rows split over
            if local_last and _sharded(y) and _sharded(target) and not y.layout.partial:
                rows = y.spec.padded(y.ndim)[0]
                y, target = y.local, target.local
            logits = run("head", hp["head"], (run("norm", hp["norm"], (y,), {}),), {})
            # (rows, vocab, seq): torch's K-dimensional form, each dim keeping its split (the
            # sequence over cp; flattening (rows, seq) would gather the logits over cp)
            ce = F.cross_entropy(
                logits.to(_loss_dtype(logits)).movedim(-1, 1),
                target,
                ignore_index=-100,
                reduction="sum",
            )
            ce = ce * (m / count)  # the pipeline means over the m microbatches
            if rows:  # this rank's addend of the sum over its rows' axes, as the op rule's
                ce = ShardedArray._raw(ce, Layout.of(mesh, P(partial=rows), (), ce.dtype))
            return ce

        def first(ep, mbs):  # the first stage's piece: the embedding of every microbatch
            if local_first and all(_sharded(v) and not v.layout.partial for v in mbs.values()):
                # the local view (as the layers'): this rank's rows, its block of the output
                mbs = {k: v.local for k, v in mbs.items()}
            kwargs = {"position_ids": mbs["position_ids"]} if "position_ids" in mbs else {}
            x = run("embed", ep, (mbs["ids"],), kwargs)
            return x if rope is None else torch.cat([x, mbs["rope"]], -1)

        # one microbatch's activation (its layout: the plan's for the embedding's output, else
        # the rows over the batch axes and, with cp, the sequence over cp)
        hidden = width + (0 if rope is None else 2 * rope[0].shape[-1])
        embed_out = pieces["embed"][1].get("", P(None, *seq))
        spec = P(*embed_out.dims[1:], partial=embed_out.partial)
        act = Layout(mesh, spec, (b // m, s, hidden), act_dtype)
        inputs = {k: v for k, v in data.items() if k != "targets"}
        hp = {"norm": piece(params, "norm"), "head": piece(params, "head")}
        with (
            _attention_of(model, mesh, "cp", _RING[dims.cp_attention])
            if cp > 1
            else contextlib.nullcontext()
        ):
            out = pipeline(
                stage, params[parts.layers], inputs, mesh, loss_fn=last, loss_params=hp,
                targets=data["targets"], input_fn=first, input_params=piece(params, "embed"),
                activation=act, schedule=dims.pp_schedule, virtual=dims.pp_virtual,
            )  # fmt: skip
        return gather(out)

    return loss


def _sharded(v) -> bool:
    return isinstance(v, ShardedArray)


def _row(v, i: int):
    """Layer ``i`` of a stage's stacked param ``v``: ``v[i]``; of a ShardedArray whose dim 0
    (the layers) no axis splits, its block's row in the layout of the other dims, as the
    indexing op rule gives it, without the rule's dispatch (one per param and layer each
    microbatch). A fused projection's per-part layout (:class:`~fshard.Parts`, its parts past
    dim 0) keeps its parts in the row."""
    lay = v.layout if type(v) is ShardedArray else None
    if type(lay) is Layout and not lay.spec.padded(1)[0]:
        return ShardedArray._raw(v.local[i], _row_layout(lay))
    if type(lay) is PartsLayout and lay.dim > 0 and not lay.base.spec.padded(1)[0]:
        return ShardedArray._raw(v.local[i], _row_layout(lay))
    return v[i]


@functools.lru_cache(maxsize=256)
def _row_layout(layout: Layout | PartsLayout) -> Layout | PartsLayout:
    parts = isinstance(layout, PartsLayout)
    spec = layout.base.spec if parts else layout.spec
    rest = P(*spec.padded(len(layout.shape))[1:], partial=spec.partial)
    if parts:
        rest = Parts(rest, layout.dim - 1, layout.sizes)
    return Layout.of(layout.mesh, rest, layout.shape[1:], layout.dtype)


def _out_width(embed: torch.nn.Module) -> int:
    """The last dim of ``embed``'s output (the hidden size), from a call on ``meta`` copies of
    its params and one token (no memory, no compute)."""
    named = itertools.chain(embed.named_parameters(), embed.named_buffers())
    meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in named}
    ids = torch.zeros((1, 1), dtype=torch.long, device="meta")
    return int(torch.func.functional_call(embed, meta, (ids,)).shape[-1])


def _batch(batch) -> tuple:
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(
            "parallelize's loss: batch must be a mapping with 'input_ids' (and optionally "
            f"'labels', 'attention_mask'), got {type(batch).__name__}"
        )
    unknown = sorted(set(batch) - {"input_ids", "labels", "targets", "attention_mask"})
    if unknown:
        raise ValueError(
            f"parallelize's loss: batch has unknown keys {unknown}; accepted: 'input_ids', "
            "'labels' or 'targets', 'attention_mask'"
        )
    if "labels" in batch and "targets" in batch:
        raise ValueError(
            "parallelize's loss: batch has 'labels' (transformers': shifted inside) and "
            "'targets' (already shifted); give one"
        )
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise TypeError(
            "parallelize's loss: batch['input_ids'] must be the full (batch, seq) tensor, "
            f"got {type(ids).__name__} {tuple(getattr(ids, 'shape', ()))}"
        )
    for key in ("labels", "targets"):
        t = batch.get(key)
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != ids.shape):
            raise ValueError(
                f"parallelize's loss: batch[{key!r}] must be a tensor shaped as input_ids "
                f"{tuple(ids.shape)}, got {type(t).__name__} {tuple(getattr(t, 'shape', ()))}"
            )
    return ids, batch.get("labels"), batch.get("attention_mask"), batch.get("targets")


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """transformers' labels as targets: each position predicts the next label (the last
    position nothing, -100)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1)
