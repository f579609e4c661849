"""The reshard executor: binds the planner's steps (:func:`fshard.plan`) to process groups and
runs them on local tensors.

:func:`program` is the one cache of a reshard decision: per ``(layout, spec)`` the planned
steps, their ops bound to the mesh's groups (:class:`~fshard.collectives.Bound`, bound here
once) and the output layout. :func:`run` is the one loop that applies a program's ops, each
through :func:`fshard.lax.apply` (the one autograd Function). :func:`reshard_one` moves one
:class:`~fshard.ShardedArray` to a target spec; op rules hold their inputs' programs in their
compiled plans (``fshard.ops.registry``). Every module that reshards (the public
:mod:`fshard.api`, the op registry, shard_map, checkpoint) goes through here, so none of them
imports another's API.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from ._traced import constant
from .array import ShardedArray
from .collectives import AllGather, Bound
from .lax import apply, claim, claim_of
from .planner import Step, steps
from .spec import LAYOUT_OF_ID, Layout, P, Parts

__all__ = [
    "Program",
    "check_plain_tensor",
    "claimed_local",
    "gather_varying",
    "program",
    "reshard_one",
    "run",
]


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


class Program(NamedTuple):
    """A reshard decision: the planned ``steps``, their ``ops`` bound to the mesh's process
    groups (``None`` on an abstract mesh, which has none), the ``out`` layout, and ``claim``:
    the source's bound ``Claim`` if it is partial (see :func:`claimed_local`)."""

    steps: tuple[Step, ...]
    ops: tuple[Bound, ...] | None
    out: Layout
    claim: Bound | None = None


@functools.lru_cache(maxsize=4096)
def program(layout: Layout, spec: P) -> Program:
    """``layout`` -> ``spec``, planned and bound once.

    Example:
        >>> program(x.layout, fs.P()).ops  # doctest: +SKIP
        (Bound(op=AllGather(axes=('x',), dim=0, sizes=(4, 4), invariant=True), group=...),)
    """
    planned = steps(layout, layout.with_spec(spec))
    mesh = layout.mesh
    if mesh.is_abstract:
        return Program(planned, None, layout.with_spec(spec))
    ops = tuple(Bound(s.op, mesh.group(s.axes)) for s in planned)
    held = claim_of(mesh.group(layout.partial)) if layout.partial else None
    return Program(planned, ops, layout.with_spec(spec), held)


def gather_varying(prog: Program, pcast_axes: tuple[str, ...]) -> tuple[Program, tuple[str, ...]]:
    """Fuse a program ending in an invariant all_gather over ``A`` with the ``pcast`` over
    ``pcast_axes`` (a superset of ``A``) an op rule applies after it: ``pcast(A) o
    all_gather_invariant(A)`` is ``all_gather_varying(A)`` (JAX's default all_gather), whose
    transpose is one reduce_scatter instead of an all_reduce then a slice. This is
    Megatron-SP's ``g`` (all_gather forward, reduce_scatter backward) before a column-parallel
    matmul whose input is split on the sequence dim. Returns the program and the axes still
    to pcast; unchanged when the program does not end so.

    Example:
        >>> prog, rest = gather_varying(program(x.layout, fs.P()), ("tp",))  # doctest: +SKIP
        >>> prog.ops[-1].op.invariant, rest  # doctest: +SKIP
        (False, ())
    """
    last = prog.steps[-1].op if prog.steps else None
    if not (isinstance(last, AllGather) and last.invariant and set(last.axes) <= set(pcast_axes)):
        return prog, pcast_axes
    op = dataclasses.replace(last, invariant=False)
    steps = (*prog.steps[:-1], dataclasses.replace(prog.steps[-1], op=op))
    ops = prog.ops and (*prog.ops[:-1], prog.ops[-1]._replace(op=op))
    rest = tuple(a for a in pcast_axes if a not in last.axes)
    return prog._replace(steps=steps, ops=ops), rest


def _program_of(layout_id: str, entries: tuple, partial: tuple, parts=None) -> Program:
    """:func:`program` from constants (see :func:`fshard._traced.constant`); ``parts``:
    ``(dim, sizes)`` of a :class:`~fshard.spec.Parts` target."""
    spec = P(*entries, partial=partial)
    return program(LAYOUT_OF_ID[layout_id], spec if parts is None else Parts(spec, *parts))


def run(local: torch.Tensor, prog: Program) -> torch.Tensor:
    """Apply ``prog``'s ops to ``local`` in order (differentiable)."""
    if prog.ops is None:
        raise ValueError(
            f"{prog.out.mesh!r} is abstract: it has no process groups. Use Mesh.create"
        )
    for b in prog.ops:
        local = apply(b, local)
    return local


_dynamo_compiling = torch.compiler.is_dynamo_compiling


def claimed_local(x: ShardedArray) -> torch.Tensor:
    """``x.local`` ready to be consumed: a partial leaf being differentiated goes through
    :class:`fshard.collectives.Claim`, so its gradient holds addends of the dense gradient (DESIGN §4:
    the cotangent of a partial value is invariant; a partial *parameter's* gradient keeps the
    parameter's layout, with the full gradient on the first rank of the partial axes and zeros
    on the others)."""
    layout = x.layout
    if not layout.partial:
        return x.local
    return claim(x.local, claim_of(layout.mesh.group(layout.partial)))


def reshard_one(x: ShardedArray, spec: P | Parts) -> ShardedArray:
    """``x`` moved to layout ``spec`` (differentiable; no checks: ``spec`` is a valid P or
    Parts)."""
    if x.layout.spec == spec:
        return x
    if _dynamo_compiling():  # planned at trace time, not traced
        if isinstance(spec, Parts):
            inner, parts = spec.spec, (spec.dim, spec.sizes)
            prog = constant(_program_of, x.layout._id, inner._entries, inner.partial, parts)
        else:
            prog = constant(_program_of, x.layout._id, spec._entries, spec.partial)
    else:
        prog = program(x.layout, spec)
    return ShardedArray._raw(run(claim(x.local, prog.claim), prog), prog.out)
