"""Random draws on ShardedArrays: every rank draws the whole tensor and keeps its block.

``fs.rand`` / ``fs.randn``'s contract, for the draws a model makes in its forward: a dropout's
mask (:mod:`.nn`), a router's jitter (Mixtral, PhiMoE, MiniMax: ``torch.empty_like(h).uniform_(1
- eps, 1 + eps)``), Gumbel noise (``F.gumbel_softmax``: ``empty_like(logits).exponential_()``),
``torch.rand_like`` / ``randn_like`` / ``randint_like``. Each rank draws the whole global tensor
from the generator (the default one of the block's device, or ``generator=``) and keeps its
block, so the values are the dense op's for the same seed on any mesh and layout, at the cost of
drawing (and briefly holding) the whole tensor on every rank.

The ranks that hold one value (those of the axes it is replicated or pending over) must draw
one tensor: their generators' states are compared (:func:`fshard.consistency.check_draw`; with
per-rank seeds each would hold its own draw of the one value, so that raises a
``ConsistencyError``). Over an axis that splits the value each rank keeps a block of its own
draw: with per-rank seeds a valid draw, not dense's. Under ``vmap`` one draw is shared across
the batch (as a plain draw of the unbatched shape), whatever ``randomness=`` says.

Example:
    >>> noise = torch.empty_like(h).uniform_(0.99, 1.01)  # h: a ShardedArray  # doctest: +SKIP
    >>> torch.equal(fs.gather(noise), torch.empty(h.shape).uniform_(0.99, 1.01))  # same seed  # doctest: +SKIP
    True
"""

from __future__ import annotations

import functools

import torch

from .. import consistency
from ..array import ShardedArray
from ..mesh import AxisGroup
from ..spec import Layout, spec_of_dims

__all__ = []

#: The in-place random fills (``x.uniform_(a, b)``...), which fshard runs as a fresh draw that
#: ``x`` is rebound to (:mod:`.inplace`).
FILLS = (
    "uniform_",
    "normal_",
    "exponential_",
    "cauchy_",
    "log_normal_",
    "geometric_",
    "random_",
    "bernoulli_",
)


@functools.lru_cache(maxsize=1024)
def drawing_group(layout: Layout) -> AxisGroup | None:
    """The group of the mesh axes ``layout`` is replicated or pending over (size > 1), whose
    ranks must make one draw; ``None``: every axis splits it, or the mesh is abstract."""
    mesh = layout.mesh
    if mesh.is_abstract:
        return None
    split = {a for d in layout.dim_axes for a in d}
    axes = tuple(a for a in mesh.axis_names if a not in split and mesh.size(a) > 1)
    return mesh.group(axes) if axes else None


def whole(
    layout: Layout,
    shape: tuple,
    dtype: torch.dtype,
    device,
    fill: str,
    args=(),
    generator=None,
    what: str | None = None,
    kwargs=None,
) -> torch.Tensor:
    """``torch.empty(shape, dtype).<fill>(*args, **kwargs, generator=generator)`` drawn on
    ``device`` (the
    generator's, when one is given), after the generators of the ranks that hold one value of
    ``layout`` are compared (a disagreement names ``what``, the op drawing): the caller keeps
    its block."""
    group = drawing_group(layout)
    if group is not None:
        name = what or f"Tensor.{fill}"
        consistency.check_draw(group, torch.device(device), name, generator)
    where = device if generator is None else generator.device
    out = torch.empty(shape, dtype=dtype, device=where)
    kwargs = dict(kwargs or {})
    if generator is not None:
        kwargs["generator"] = generator
    return getattr(out, fill)(*args, **kwargs)


def block_of(layout: Layout, t: torch.Tensor, device) -> torch.Tensor:
    """This rank's block of the whole draw ``t``, on ``device`` (a copy: the whole is let go)."""
    mesh = layout.mesh
    rank = mesh.ranks[0] if mesh.is_abstract else mesh.rank
    block = t[layout.shard_metadata(rank).slices()]
    return block.clone() if block.device == torch.device(device) else block.to(device)


def filled(x: ShardedArray, fill: str, args: tuple, kwargs: dict) -> ShardedArray:
    """``x.<fill>(*args, **kwargs)`` as a fresh value: ``x``'s dims, not pending (the draw is
    the value), every rank's block of one whole draw."""
    kwargs = dict(kwargs)
    generator = kwargs.pop("generator", None)
    tensors = any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
    if tensors or type(x.layout) is not Layout:
        what = "tensor arguments" if tensors else f"a {type(x.layout).__name__}"
        raise TypeError(
            f"ShardedArray: Tensor.{fill} with {what} is not supported (fshard draws the whole "
            "tensor with scalar arguments and keeps each rank's block of a Layout); draw a "
            "full tensor and fs.shard it"
        )
    lay = x.layout
    out = Layout(lay.mesh, spec_of_dims(lay.dim_axes, ()), lay.shape, lay.dtype)
    device = x.local.device
    drawn = whole(out, out.shape, out.dtype, device, fill, args, generator, kwargs=kwargs)
    return ShardedArray._raw(block_of(out, drawn, device).contiguous(), out)
