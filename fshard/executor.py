"""The reshard executor: runs the planner's steps (:func:`fshard.plan`) on local tensors.

:func:`reshard_one` moves one :class:`~fshard.ShardedArray` to a target spec: the steps are
planned and turned into differentiable ops once per ``(layout, spec)`` (:func:`_program`), then
applied to the local tensor. Every module that reshards (the public :mod:`fshard.api`, the op
registry, shard_map, checkpoint) goes through here, so none of them imports another's API.
"""

from __future__ import annotations

import functools

import torch

from . import _comm
from ._function import call
from ._traced import constant
from .array import ShardedArray
from .lax import (
    AllGather,
    AllToAll,
    LocalSlice,
    Ppermute,
    Psum,
    PsumScatter,
    ZeroOthers,
    apply,
    claim_partial_leaf,
)
from .planner import Step, chunk_sizes, plan
from .spec import LAYOUT_OF_ID, Layout, P

__all__ = ["check_plain_tensor", "claimed_local", "reshard_one"]


def check_plain_tensor(t: torch.Tensor, where: str) -> None:
    """Refuse tensors fshard cannot shard as dense local blocks: DTensors and non-strided
    (sparse, mkldnn) tensors. Plain tensors (and torch.func wrappers of them) pass."""
    if type(t) is not torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            raise TypeError(
                f"{where}: got a DTensor; fshard works on plain tensors. Convert it with "
                "fs.interop.from_dtensor(d) (keeps its sharding), or pass d.full_tensor() / "
                "d.to_local()"
            )
    if t.layout is not torch.strided:
        raise TypeError(
            f"{where}: got a {t.layout} tensor; fshard shards dense (torch.strided) tensors "
            "only. Pass t.to_dense()"
        )


def _compile_step(step: Step):
    """The op that runs one planned step on a local tensor (differentiable)."""
    src, dst, mesh = step.src, step.dst, step.src.mesh
    if step.op == "gather_blocks":
        return _GatherBlocks(src)
    g = mesh.group(step.axes)
    if step.op == "zero":
        return ZeroOthers(g)
    if step.op == "ppermute":
        me = mesh.rank
        return Ppermute(g, step.perm, src.local_shape(me), dst.local_shape(me))
    if step.op == "all_reduce":
        return Psum(g)
    if step.op == "all_to_all":
        j, i = step.dim, step.concat_dim
        split = chunk_sizes(src.shape[j], mesh, step.axes)
        concat = chunk_sizes(src.shape[i], mesh, step.axes)
        return AllToAll(g, j, i, split, concat)
    sizes = chunk_sizes(src.shape[step.dim], mesh, step.axes)
    if step.op == "all_gather":
        return AllGather(g, step.dim, sizes, invariant=True)
    if step.op == "reduce_scatter":
        return PsumScatter(g, step.dim, sizes)
    if step.op == "slice":
        return LocalSlice(g, step.dim, sizes)
    raise AssertionError(step.op)


class _GatherBlocksFn(torch.autograd.Function):
    """Explicit layout -> full tensor on every rank: all_gather of padded flat blocks over the
    whole mesh, assembled by offsets. Cost per rank: receives (N-1) x the largest block
    (replicas included). Backward keeps this rank's box of the (invariant) cotangent, with no
    communication, as for ``gather``. Not vmappable."""

    @staticmethod
    def forward(local, layout):
        mesh = layout.mesh
        g = mesh.group(mesh.axis_names)
        metas = [layout.shard_metadata(r) for r in g.ranks]
        sizes = [m.numel for m in metas]
        flat = local.detach().contiguous().reshape(-1)
        if max(sizes) == 0:
            flat, sizes = flat.new_zeros(1), [1] * len(sizes)
        flat = _comm.all_gather(flat, g, 0, sizes)
        out = local.new_empty(layout.shape)
        start = 0
        for m, n in zip(metas, sizes):
            if m.numel:
                out[m.slices()] = flat[start : start + m.numel].view(m.shard_sizes)
            start += n
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        return grad[layout.shard_metadata(layout.mesh.rank).slices()].clone(), None


class _GatherBlocks:
    """The ``gather_blocks`` step (source: a ``Layout.explicit``)."""

    def __init__(self, layout):
        self.layout = layout

    def __call__(self, x):
        return call(_GatherBlocksFn, x, self.layout)


@functools.lru_cache(maxsize=4096)
def _program(layout: Layout, spec: P):
    """Planned once per (layout, target): the ops to run and the output layout."""
    return tuple(_compile_step(s) for s in plan(layout, spec)), layout.with_spec(spec)


def _program_of(layout_id: str, entries: tuple, partial: tuple):
    """:func:`_program` from constants (see :func:`fshard._traced.constant`)."""
    return _program(LAYOUT_OF_ID[layout_id], P(*entries, partial=partial))


_dynamo_compiling = torch.compiler.is_dynamo_compiling


def claimed_local(x: ShardedArray) -> torch.Tensor:
    """``x.local`` ready to be consumed: a partial leaf being differentiated goes through
    :class:`fshard.lax.Claim`, so its gradient holds addends of the dense gradient (DESIGN §4:
    the cotangent of a partial value is invariant; a partial *parameter's* gradient keeps the
    parameter's layout, with the full gradient on the first rank of the partial axes and zeros
    on the others)."""
    layout = x.layout
    if not layout.partial:
        return x.local
    return claim_partial_leaf(x.local, layout.mesh.group(layout.partial))


def reshard_one(x: ShardedArray, spec: P) -> ShardedArray:
    """``x`` moved to layout ``spec`` (differentiable; no checks: ``spec`` is a valid P)."""
    if x.layout.spec == spec:
        return x
    if _dynamo_compiling():  # planned at trace time, not traced
        ops, out = constant(_program_of, x.layout._id, spec._entries, spec.partial)
    else:
        ops, out = _program(x.layout, spec)
    local = claimed_local(x)
    for op in ops:
        local = op(local) if isinstance(op, _GatherBlocks) else apply(op, local)
    return ShardedArray._raw(local, out)
