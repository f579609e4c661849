"""Sequence parallelism (Megatron-SP, Korthikanti et al. 2022) over the tensor-parallel axis.

Between tensor-parallel regions (norms, dropout, residual adds) the activations stay split on
the sequence dim over ``axis``: each row-parallel layer's pending sum is reduce-scattered onto
the sequence (``fs.nn.Output(P(None, axis))``) instead of all-reduced, and the op rule of the
next column-parallel matmul all-gathers its sequence-split input to a *varying* value, whose
transpose is a reduce_scatter (:func:`fshard.executor.gather_varying`). Per layer that is
Megatron-SP's 4 all_gathers + 4 reduce_scatters (forward and backward) in place of plain TP's
4 all_reduces: the same bytes on the wire, activations between regions 1/tp the size.

The call is :func:`fshard.nn.functional_call`: nothing runs differently, only layouts differ.

Limits (today): a linear layer keeps its weight's split and all-gathers its sequence-split
input at any size (the linear rule moves the activation, never the weight: Megatron's choice).
Sibling projections reading one input (separate q/k/v, gate/up) each gather it (one all_gather
and one reduce_scatter per projection, not per region as Megatron's fused qkv/fc1), and each
column-parallel layer keeps its gathered input for the backward where Megatron re-gathers it;
both need a shared "replicated but varying" value (a plan entry like DTensor's
``PrepareModuleInput`` whose every use is a pcast), not built yet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from ..nn_plan import Output
from ..spec import P
from .tensor import megatron_plan

__all__ = ["megatron_sp_comm", "sequence_parallel_plan"]


def sequence_parallel_plan(
    column: Iterable[str] = (),
    row: Iterable[str] = (),
    vocab: Iterable[str] = (),
    axis: str = "tp",
    bias: bool = True,
    *,
    scatter: Iterable[str] = (),
    seq_dim: int = 1,
    model: torch.nn.Module | None = None,
) -> dict[str, P | Output]:
    """:func:`fshard.nn.megatron_plan` with sequence parallelism.

    Args:
        column, row, vocab, axis, bias, model: as in :func:`fshard.nn.megatron_plan`.
        scatter: globs of modules whose replicated output enters the sequence-parallel region
            (a replicated token embedding: Megatron's ``scatter_to_sequence_parallel_region``:
            a local slice forward, an all_gather backward). A vocab-parallel embedding needs
            none: its pending sum is reduce-scattered.
        seq_dim: the sequence dim of the activations (1: batch-first, as transformers; 0:
            Megatron's ``(seq, batch, hidden)``).

    Returns:
        The plan; row-parallel, vocab-parallel and ``scatter`` outputs are ``Output(P(...))``
        split on ``seq_dim``.

    Example:
        >>> sequence_parallel_plan(column=["*.fc1"], row=["*.fc2"], scatter=["tok"])
        {'*.fc1.weight': P('tp', None), '*.fc1.bias': P('tp'), '*.fc2.weight': P(None, 'tp'), '*.fc2': Output(spec=P(None, 'tp')), 'tok': Output(spec=P(None, 'tp'))}
    """
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 0:
        raise TypeError(f"seq_dim must be a non-negative int, got {seq_dim!r}")
    if isinstance(scatter, str):
        raise TypeError(f"scatter must be a list of globs, not a string ({scatter!r}); wrap it")
    split = P(*([None] * seq_dim), axis)
    plan = megatron_plan(column, row, vocab, axis, bias, row_output=split, model=model)
    plan.update({m: Output(split) for m in scatter})
    return plan


def megatron_sp_comm(
    layers: int,
    act_bytes: int,
    tp: int,
    *,
    columns: int = 2,
    rows: int = 2,
    head: bool = True,
    scatter: bool = True,
    vocab: bool = False,
    sp_param_bytes: Iterable[int] = (),
) -> Counter:
    """Megatron-SP's collectives for one forward + backward, as ``fs.debug.comm_log`` records
    them on one rank: ``Counter({(op, nbytes): count})``, ``nbytes`` the rank's input bytes.

    Each of ``columns`` column-parallel reads per layer all-gathers the sequence-split input
    (forward, ``act_bytes / tp`` in) and reduce-scatters its gradient (backward, ``act_bytes``
    in); each of ``rows`` row-parallel outputs per layer is reduce-scattered (forward) and its
    gradient all-gathered (backward). ``head``: a column-parallel LM head reads the
    sequence-split final norm. ``scatter``: a replicated embedding output enters the region
    (backward all_gather). ``vocab``: a vocab-parallel embedding's pending sum enters it
    (forward reduce_scatter, backward all_gather). ``sp_param_bytes``: the sizes of the parameters applied on
    sequence-split activations (norm weights and biases), whose gradients are all-reduced.

    ``act_bytes`` is one full activation (``batch * seq * hidden * itemsize``). Megatron's
    layers have ``columns = rows = 2`` (fused qkv, fc1): 4 all_gathers + 4 reduce_scatters per
    layer, the bytes of plain TP's 4 all_reduces.

    Example:
        >>> megatron_sp_comm(1, 1024, 2, head=False, scatter=False)
        Counter({('all_gather', 512): 4, ('reduce_scatter', 1024): 4})
    """
    if act_bytes % tp:
        raise ValueError(f"act_bytes ({act_bytes}) must divide over tp={tp}")
    gathers = layers * (columns + rows) + head + scatter + vocab
    scatters = layers * (columns + rows) + head + vocab
    want = Counter(
        {("all_gather", act_bytes // tp): gathers, ("reduce_scatter", act_bytes): scatters}
    )
    want.update(("all_reduce", n) for n in sp_param_bytes)
    return want
