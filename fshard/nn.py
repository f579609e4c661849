"""Sharding ``torch.nn.Module`` parameters and running modules functionally on them.

``shard_params(module, mesh, plan)`` turns a module's parameters into a flat dict
``name -> ShardedArray``; ``functional_call(module, params, args)`` runs the module's own
``forward`` with those values swapped in. Because the params dict is a pytree of
ShardedArrays (whose only pytree child is the local tensor), ``torch.func.grad`` /
``vmap(grad)`` of a loss built on ``functional_call`` return gradients with the params'
layouts, and :mod:`fshard.optim` updates them; ``load_params`` writes trained values back
into the module, ``state_dict`` gives a sharded state dict for :mod:`fshard.checkpoint`::

    plan = fs.nn.megatron_plan(column=["*.fc1"], row=["*.fc2"])
    params = fs.nn.shard_params(model, mesh, plan)
    loss_fn = lambda ps, x, y: F.mse_loss(fs.nn.functional_call(model, ps, (x,)), y)
    grads = torch.func.grad(loss_fn)(params, x, y)
    fs.nn.load_params(model, params)  # model.state_dict() now holds the trained values

From ``shard_params`` on, ``model.state_dict()`` raises until ``load_params`` (the module's own
tensors are not what training produces).

A plan maps globs to ``fs.P`` (a parameter's layout) or to :class:`Output` (a module's
output layout, DTensor's ``output_layouts``: e.g. reduce a row-parallel Linear's pending sum
right after it, so the residual stream stays replicated).

Inside ``forward``, ``F.linear(x, self.weight)`` etc. receive ShardedArrays and dispatch to
fshard's op rules through ``__torch_function__``; a forward written on local tensors with
:mod:`fshard.lax` collectives (reading ``self.weight.local``) works as well.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> _ = torch.manual_seed(0)  # every rank builds the same weights
    >>> model = torch.nn.Linear(4, 2)
    >>> params = fs.nn.shard_params(model, mesh, {"weight": fs.P("tp")})
    >>> out = fs.nn.functional_call(model, params, (torch.ones(1, 4),))
    >>> torch.allclose(fs.gather(out), model(torch.ones(1, 4)))
    True
"""

from .module import (
    LocalRows,
    MixedPrecisionPolicy,
    Output,
    functional_call,
    load_params,
    match_plan,
    shard_params,
    state_dict,
)
from .parallel.fsdp import fsdp_call, fsdp_gather, fsdp_plan, fsdp_units
from .parallel.tensor import hf_tp_plan, megatron_plan

__all__ = [
    "MixedPrecisionPolicy",
    "Output",
    "LocalRows",
    "shard_params",
    "functional_call",
    "load_params",
    "state_dict",
    "megatron_plan",
    "hf_tp_plan",
    "match_plan",
    "fsdp_plan",
    "fsdp_units",
    "fsdp_gather",
    "fsdp_call",
]
