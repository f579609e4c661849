"""Mixed precision as a policy (FSDP2's ``MixedPrecisionPolicy``): fp32 master params, compute in
``param_dtype``, gradient reductions in ``reduce_dtype``, outputs in ``output_dtype``.

The params the optimizer updates stay in their own dtype (the *master*, usually float32). A call
that runs a module under a policy (:func:`fshard.nn.functional_call`,
:func:`fshard.nn.fsdp_call`) casts each floating param to ``param_dtype`` right before use, with a
differentiable cast, so the gradient arrives in the master's dtype::

    master (fp32, any layout) --cast--> param_dtype --> module forward --> output_dtype
    grad (fp32)  <--cast--  reduction in reduce_dtype  <--  cotangent (param_dtype)

Where each reduction runs and in which dtype:

==============================  ==================================  ============================
param                           forward                             backward
==============================  ==================================  ============================
FSDP-sharded (``fsdp_call``)    cast, then all_gather in            cotangent cast to
                                ``param_dtype`` (half the bytes)    ``reduce_dtype``,
                                                                    reduce_scatter, cast to
                                                                    the master dtype
replicated over the data axis   cast (no comm)                      the data-parallel all_reduce
(dp; ``functional_call``)                                           in ``reduce_dtype``, carried
                                                                    on the ``pcast`` op as data
                                                                    (bucketed by
                                                                    ``fs.value_and_grad`` in
                                                                    that dtype)
==============================  ==================================  ============================

``reduce_dtype=None`` reduces in ``param_dtype`` (FSDP2's default). Under a ``torch.func``
transform a gather of ``param_dtype`` values cannot reduce-scatter in another dtype (an autograd
edge carries its forward dtype's gradient), so there, when ``reduce_dtype`` differs from
``param_dtype``, FSDP gathers in ``reduce_dtype`` and casts after (same values, its bytes);
:func:`fshard.value_and_grad` at top level gathers ``param_dtype`` bytes. The tensor-parallel
collectives inside op rules move activations and run in the dtype of the values they move
(``param_dtype``). The data-parallel reduction of a replicated param honours ``reduce_dtype``
where the param meets the data as it was passed in (the op rule's ``pcast`` of the cast value
itself, which is every ``nn.Linear`` / ``nn.Embedding`` / norm weight): the call's
``fshard.module.ReduceInPolicyDtype`` handler (a ``fs.lax.Handler``) takes that pcast on the
master, with ``Pcast(axes, reduce_dtype)``, so the sum runs in ``reduce_dtype`` and flows into
the master's dtype unrounded; a param an op rule reshards first (a sequence-parallel gather) is
reduced in ``param_dtype``.

Example:
    >>> import torch, fshard as fs
    >>> policy = fs.nn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> policy.cast_param(torch.ones(2)).dtype, policy.reduce_dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MixedPrecisionPolicy"]


def _dtype(name: str, value) -> torch.dtype | None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"{name} must be a floating torch.dtype or None, got {value!r}")
    return value


class MixedPrecisionPolicy(NamedTuple):
    """Dtypes for compute, gradient reduction and outputs (FSDP2's ``MixedPrecisionPolicy``).

    Args:
        param_dtype: the dtype floating params are cast to for the forward (``None``: as
            they are). The cast is differentiable: gradients come back in the params' dtype.
        reduce_dtype: the dtype of the gradient reductions over data-parallel axes
            (``None``: ``param_dtype``).
        output_dtype: floating outputs of the module are cast to it (``None``: as computed).
        cast_forward_inputs: cast floating tensor arguments of the call to ``param_dtype``.

    Example:
        >>> import torch, fshard as fs
        >>> fs.nn.MixedPrecisionPolicy(torch.bfloat16).reduce_in(torch.float32)
        torch.bfloat16
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def check(self) -> MixedPrecisionPolicy:
        """The policy, after checking each field (a ``TypeError`` names the field).

        Example:
            >>> import torch, fshard as fs
            >>> fs.nn.MixedPrecisionPolicy(torch.float16).check().param_dtype
            torch.float16
        """
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}")
        return self

    def reduce_in(self, master: torch.dtype) -> torch.dtype:
        """The dtype gradients of a ``master``-dtype param are reduced in.

        Example:
            >>> import torch, fshard as fs
            >>> fs.nn.MixedPrecisionPolicy().reduce_in(torch.float32)
            torch.float32
        """
        return self.reduce_dtype or self.param_dtype or master

    def cast_param(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in ``param_dtype`` if it is floating (differentiable), else ``t``.

        Example:
            >>> import torch, fshard as fs
            >>> fs.nn.MixedPrecisionPolicy(torch.bfloat16).cast_param(torch.arange(3)).dtype
            torch.int64
        """
        if self.param_dtype is None or not t.is_floating_point() or t.dtype == self.param_dtype:
            return t
        return t.to(self.param_dtype)

    def cast_output(self, t):
        """``t`` in ``output_dtype`` if it is a floating tensor (or ShardedArray), else ``t``.

        Example:
            >>> import torch, fshard as fs
            >>> fs.nn.MixedPrecisionPolicy(output_dtype=torch.float32).cast_output(
            ...     torch.ones(1, dtype=torch.bfloat16)).dtype
            torch.float32
        """
        if self.output_dtype is None or not t.is_floating_point() or t.dtype == self.output_dtype:
            return t
        return t.to(self.output_dtype)
