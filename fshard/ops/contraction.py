"""The contraction engine of the matmul-family rules (:mod:`fshard.ops.linalg`) and of the
convolution rule (:mod:`fshard.ops.whole`): mesh axes assigned to index letters.

Example:
    >>> import fshard as fs
    >>> mesh = fs.Mesh.abstract((2,), ("tp",))
    >>> x, w = fs.Layout(mesh, fs.P(), (4, 8)), fs.Layout(mesh, fs.P("tp", None), (6, 8))
    >>> (sx, sw), out_dims, partial = contract([x, w], [["n", "c"], ["o", "c"]], ["n", "o"], 1)
    >>> sw, out_dims, partial  # the weight keeps its split: a column-parallel linear
    (P('tp', None), [(), ('tp',)], ())
"""

from __future__ import annotations

import math

from ..spec import Layout
from ._common import in_mesh_order, reshard_cost, spec

__all__ = ["contract"]


def contract(operands: list[Layout], letters, out_letters, first: int | None = None):
    """Assign mesh axes to index letters.

    Returns ``(in_specs, out_dims, out_partial)`` for ``operands`` with per-dim ``letters``
    (``None`` for a broadcast dim) and output ``out_letters``. With a partial operand there are
    two candidates: keep its pending sum (the other operands give up its axes, e.g. gather a
    weight split over them) or reduce it first (every operand keeps its axes). The one that
    moves fewer bytes wins, counting the all_reduce a pending output needs later; ties keep
    the pending sum.

    Where two operands split different letters over one mesh axis, one keeps its split and the
    other is gathered: ``operands[first]`` keeps it when given (a linear layer's weight: the
    activation moves, as in Megatron), else the larger one.
    """
    # by position: equal layouts are one interned object, so identity cannot tell operands apart
    kept = next((i for i, x in enumerate(operands) if x.partial), None)
    best = _assign(operands, letters, out_letters, kept, first)
    if kept is None:
        return best
    reduced = _assign(operands, letters, out_letters, None, first)
    if _cost(operands, letters, out_letters, reduced) < _cost(operands, letters, out_letters, best):
        return reduced
    return best


def _assign(operands, letters, out_letters, kept, first=None):
    """Axes per letter, keeping the pending sum of ``operands[kept]`` (``None``: reduce all);
    ``operands[first]`` (else the largest) picks its axes first."""
    reserved = set(operands[kept].partial) if kept is not None else set()
    # A letter repeated within one operand (einsum "ii->i": a diagonal) pairs two dims of the
    # same tensor: it stays unsplit, since one mesh axis cannot split two dims of a tensor.
    repeated = {c for ls in letters for c in ls if c is not None and ls.count(c) > 1}
    assign: dict[str, tuple[str, ...]] = {c: () for c in repeated}
    used = set(reserved)
    order = sorted(range(len(operands)), key=lambda i: (i != first, -operands[i].nbytes))
    for i in order:
        x = operands[i]
        for d, letter in enumerate(letters[i]):
            if letter is None or letter in assign:
                continue
            # the dim's major axes up to the first one taken: the rest are gathered (a dim
            # split over ("cp", "tp") whose tp another operand takes stays split over cp)
            axes = x.dim_axes[d]
            free = next((j for j, a in enumerate(axes) if a in used), len(axes))
            if free:
                assign[letter] = axes[:free]
                used |= set(axes[:free])
    specs = []
    for i, ls in enumerate(letters):
        dims = [assign.get(letter, ()) if letter is not None else () for letter in ls]
        specs.append(spec(dims, operands[i].partial if i == kept else ()))
    out_dims = [assign.get(letter, ()) for letter in out_letters]
    summed = [a for letter, axes in assign.items() if letter not in out_letters for a in axes]
    mesh = operands[0].mesh
    partial = in_mesh_order(mesh, (*reserved, *summed))
    return specs, out_dims, partial


def _cost(operands, letters, out_letters, candidate) -> float:
    """Bytes received: the operands' reshards, plus the all_reduce of a pending output."""
    specs, out_dims, partial = candidate
    cost = sum(reshard_cost(x, s) for x, s in zip(operands, specs))
    if partial:
        mesh = operands[0].mesh
        sizes = {c: x.shape[d] for x, ls in zip(operands, letters) for d, c in enumerate(ls) if c}
        n = mesh.size(partial)
        out = math.prod(sizes.get(c, 1) for c in out_letters)
        split = math.prod(mesh.size(a) for a in out_dims if a)
        cost += 2 * (n - 1) / n * out / split * operands[0].dtype.itemsize
    return cost
