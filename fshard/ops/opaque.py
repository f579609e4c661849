"""Torch code that runs on a ShardedArray without reaching fshard's dispatcher.

``torch.autograd.Function.apply`` does no ``__torch_function__`` dispatch: a ShardedArray
argument would reach ``forward`` as a constant (no tensor torch's autograd sees), the result
would have no graph, and every gradient behind the Function would be missing (filled with
zeros by the transform that asked for it). This module makes such calls give the dense result:

- ``SomeFunction.apply(x, ...)`` with ShardedArray arguments (old- and new-style Functions,
  under ``fs.value_and_grad``, ``torch.func.grad``/``vmap`` or eager ``backward``): each
  ShardedArray argument is gathered (``fs.gather``, differentiable), the Function runs under
  torch's own autograd on the full tensors, as in dense code, and each tensor output becomes a
  replicated ShardedArray (``P()``) on the arguments' mesh. The Function's code is opaque to
  fshard, so running it on the whole value is the only form known to be exact; it costs an
  all_gather per split argument and the whole computation on every rank. A Function that is
  elementwise or otherwise local is faster as a rule (``fs.ops.register_rule``) or called on
  the local blocks inside ``fs.shard_map``.
- ``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)`` (the reentrant variant is a
  Function): rerouted to ``use_reentrant=False``, which is built on saved-tensor hooks and runs
  ``fn`` on the ShardedArrays themselves (same values and gradients, activations recomputed).
- torch 2.11's non-reentrant checkpoint saves its inputs through a no-op Function
  (:data:`fshard._compat.CHECKPOINT_INPUT_SAVER`): ShardedArray inputs pass it untouched, so the
  recompute sees the values the forward saw (gathered, they would come back as full tensors).
- A module with full backward hooks (``register_full_backward_hook``,
  ``register_full_backward_pre_hook``) called on ShardedArrays: torch's ``BackwardHook`` looks
  for ``torch.Tensor`` arguments only, so the hook would never run and a gradient it changes
  would silently stay unchanged. Refused, naming the module.

Other ways in are refused by the dispatcher itself, naming the op and the fix: a
``torch.library`` custom op (``torch.ops.ns.op`` dispatches ``__torch_function__``: "no
sharding rule for torch.ns::op"), ``Tensor.register_hook``, ``Tensor.backward`` /
``torch.autograd.grad`` / ``backward`` on a ShardedArray (``fs.value_and_grad`` or
``torch.func.grad`` differentiate global-view code), ``torch.cond``, forward-mode
``make_dual``. A ``torch.jit.script`` function refuses the non-Tensor argument itself.

Installed when :mod:`fshard.ops` is imported (``Function.apply`` and ``BackwardHook`` are
patched once; a call without ShardedArray arguments runs torch's code after one type scan).

Example:
    >>> class Double(torch.autograd.Function):  # doctest: +SKIP
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x * 2
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return g * 2
    >>> w = fs.shard(torch.arange(4.0), mesh, fs.P("x"))  # doctest: +SKIP
    >>> fs.gather(fs.grad(lambda w: fs.gather(Double.apply(w).sum()))(w))  # doctest: +SKIP
    tensor([2., 2., 2., 2.])
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _checkpoint
import torch.utils.hooks as _hooks

from .. import _compat
from ..array import ShardedArray
from ..executor import reshard_one
from ..spec import P, _layout

__all__ = ["function_apply"]

_APPLY = torch.autograd.Function.__dict__["apply"]  # torch's classmethod
_REPLICATED = P()


def _has_sharded(args, kwargs) -> bool:
    for a in args:
        if type(a) is ShardedArray:
            return True
    if kwargs:
        for a in kwargs.values():
            if type(a) is ShardedArray:
                return True
    return False


def function_apply(cls, *args, **kwargs):
    """``torch.autograd.Function.apply`` that gives the dense result on ShardedArray arguments
    (see the module docstring); any other call is torch's ``apply``, unchanged."""
    if not _has_sharded(args, kwargs):
        return _APPLY.__get__(None, cls)(*args, **kwargs)
    if cls is _compat.CHECKPOINT_INPUT_SAVER:  # a non-reentrant checkpoint keeps its inputs
        return _APPLY.__get__(None, cls)(*args, **kwargs)
    if cls is _checkpoint.CheckpointFunction:  # checkpoint(fn, *args, use_reentrant=True)
        function, preserve_rng_state, *inputs = args
        return _checkpoint.checkpoint(
            function, *inputs, use_reentrant=False, preserve_rng_state=preserve_rng_state
        )
    sharded = [a for a in (*args, *kwargs.values()) if type(a) is ShardedArray]
    mesh = sharded[0].layout.mesh
    for a in sharded[1:]:
        if a.layout.mesh != mesh:
            raise ValueError(
                f"{cls.__name__}.apply: ShardedArray arguments live on different meshes "
                f"({mesh!r} and {a.layout.mesh!r}); move them to one mesh first"
            )

    def whole(a):
        return reshard_one(a, _REPLICATED).local if type(a) is ShardedArray else a

    out = _APPLY.__get__(None, cls)(
        *[whole(a) for a in args], **{k: whole(v) for k, v in kwargs.items()}
    )

    def wrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        return ShardedArray._raw(t, _layout(mesh, _REPLICATED, tuple(t.shape), t.dtype))

    if isinstance(out, (tuple, list)):
        return type(out)(wrap(t) for t in out)
    return wrap(out)


_APPLY_ON_TENSORS = _hooks.BackwardHook._apply_on_tensors


def _backward_hook_apply_on_tensors(self, fn, args):
    if torch.is_grad_enabled() and any(type(a) is ShardedArray and a.requires_grad for a in args):
        module = type(self.module).__name__
        raise TypeError(
            f"{module} has full backward hooks (register_full_backward_hook / "
            "register_full_backward_pre_hook) and is called on ShardedArrays: torch's "
            "BackwardHook sees torch.Tensor arguments only, so the hooks would never run (a "
            "gradient they change would silently stay unchanged). Remove the hooks and change "
            "the gradients fs.value_and_grad / torch.func.grad return instead, or call the "
            "module on local blocks inside fs.shard_map"
        )
    return _APPLY_ON_TENSORS(self, fn, args)


def install() -> None:
    """Patch ``torch.autograd.Function.apply`` and ``BackwardHook`` (idempotent)."""
    torch.autograd.Function.apply = classmethod(function_apply)
    _hooks.BackwardHook._apply_on_tensors = _backward_hook_apply_on_tensors


install()
