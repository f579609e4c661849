"""Data-parallel input from a loader: which rows each rank reads, and those rows as one value.

With a data loader each rank reads its own rows; the global batch is never on any rank. Two
functions cover the recipe:

* :func:`sampler` is torch's ``DistributedSampler`` over the mesh's data-parallel axes: ranks
  that differ only in other axes (tensor parallel) read the same rows, as torchtitan and
  MaxText do;
* :func:`batch` turns this rank's rows into the global batch split over those axes, after one
  small exchange of every rank's block shape: the global shape is checked across ranks, never
  inferred per rank (a rank with a different row count, feature size or rank count is an
  error on every rank, naming each rank's shape).

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("dp",))
    >>> fs.data.batch(torch.ones(3, 2), mesh, "dp").shape  # 3 rows here, 3 on the other rank
    torch.Size([6, 2])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import DistributedSampler

from . import _comm
from .api import from_local
from .mesh import Mesh
from .spec import Layout, P

__all__ = ["sampler", "batch"]

_MAX_DIMS = 8  # the block shapes exchanged by batch() are padded to this many dims
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def _axes(mesh: Mesh, axes, fn: str) -> tuple[str, ...]:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{fn}: mesh must be a fshard.Mesh, got {type(mesh).__name__}")
    names = (axes,) if isinstance(axes, str) else axes
    if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{fn}: axes must be a mesh axis name or a tuple of names, got {axes!r}")
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown or not names:
        raise ValueError(
            f"{fn}: axes={axes!r} must name axes of the mesh {mesh.axis_names}; unknown: {unknown}"
        )
    return tuple(a for a in mesh.axis_names if a in names)


def sampler(
    dataset,
    mesh: Mesh,
    axes: str | Sequence[str] = "dp",
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> DistributedSampler:
    """``torch.utils.data.DistributedSampler`` over the data-parallel ``axes`` of ``mesh``.

    The replicas are the positions along ``axes`` (``mesh.size(axes)`` of them); a rank's
    position is ``mesh.axis_index(axes)``, so ranks that differ only in other axes read the same
    rows. Every replica gets the same number of rows (padded by repetition unless
    ``drop_last``), so :func:`batch` of equal loader batches always fits. Call
    ``set_epoch(epoch)`` on it each epoch when shuffling, as with torch's.

    Args:
        dataset: a map-style dataset (``len`` and indexing).
        mesh: the mesh.
        axes: the data-parallel axis name or names (several: their positions linearised, first
            most significant, as ``P(("dp", "fsdp"))`` splits a dim).
        shuffle: as ``DistributedSampler``'s.
        seed: as ``DistributedSampler``'s.
        drop_last: as ``DistributedSampler``'s.

    Returns:
        The sampler, for ``DataLoader(dataset, batch_size=rows_per_rank, sampler=...)``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("dp",))
        >>> s = fs.data.sampler(range(10), mesh, "dp", shuffle=False)
        >>> list(s) == list(range(mesh.rank, 10, 2))  # this rank's rows
        True
    """
    names = _axes(mesh, axes, "sampler")
    return DistributedSampler(
        dataset,
        num_replicas=mesh.size(names),
        rank=mesh.axis_index(names),
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )


def batch(local: torch.Tensor, mesh: Mesh, axes: str | Sequence[str] = "dp", *, dim: int = 0):
    """This rank's rows of a batch as the global batch, split over ``axes`` along ``dim``.

    One all_gather of every rank's block shape (a few int64, logged as ``size_exchange``)
    checks, on every rank alike, that the blocks form one value: the same dtype and the same
    sizes outside ``dim`` everywhere, the same rows on ranks at one position along ``axes``
    (they hold copies), and per-position row counts that follow fshard's block convention
    (ceil-div: e.g. 3 | 2 for 5 rows; :func:`sampler` gives equal counts). Then the value is
    ``fs.from_local(local, mesh, P(axes at dim), shape=global)``: no data moves.

    Args:
        local: this rank's rows (a tensor).
        mesh: the mesh.
        axes: the data-parallel axis name(s).
        dim: the batch dim of ``local``.

    Returns:
        A :class:`~fshard.ShardedArray` of global shape ``local.shape`` with ``dim`` the sum of
        the positions' row counts.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("dp",))
        >>> x = fs.data.batch(torch.ones(4, 16), mesh, "dp")  # this rank's 4 rows
        >>> x.shape, x.spec
        (torch.Size([8, 16]), P('dp'))
    """
    names = _axes(mesh, axes, "batch")
    if not isinstance(local, torch.Tensor) or type(local).__name__ == "ShardedArray":
        raise TypeError(f"batch: local must be a torch.Tensor, got {type(local).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -local.dim() <= dim < local.dim():
        raise ValueError(f"batch: dim={dim!r} is not a dim of a {local.dim()}-d tensor")
    if local.dim() > _MAX_DIMS:
        raise ValueError(f"batch: local has {local.dim()} dims; at most {_MAX_DIMS} are supported")
    dim %= local.dim()
    code = _DTYPES.index(local.dtype) if local.dtype in _DTYPES else len(_DTYPES)
    mine = [code, local.dim(), *local.shape, *[-1] * (_MAX_DIMS - local.dim())]
    if mesh.size(mesh.axis_names) == 1:
        shapes = [mine]
    else:
        shapes = _comm.size_exchange(mine, mesh.group(mesh.axis_names), mesh.device())
    ranks = mesh.ranks
    if any(s[:2] != mine[:2] for s in shapes) or any(
        s[2 + d] != mine[2 + d] for s in shapes for d in range(local.dim()) if d != dim
    ):
        listed = ", ".join(f"rank {r}: {_describe(s)}" for r, s in zip(ranks, shapes))
        raise ValueError(
            f"batch: the ranks' blocks differ outside the batch dim {dim} ({listed}); every "
            "rank must read rows of one dtype and one shape (only the row count may differ)"
        )
    rows: dict[int, int] = {}
    for r, s in zip(ranks, shapes):
        pos = mesh.axis_index(names, rank=r)
        if rows.setdefault(pos, s[2 + dim]) != s[2 + dim]:
            raise ValueError(
                f"batch: ranks at data-parallel position {pos} of {names} read {rows[pos]} and "
                f"{s[2 + dim]} rows; ranks that differ only in other axes must read the same "
                "rows (use fs.data.sampler, which gives them the same indices)"
            )
    counts = [rows[p] for p in range(mesh.size(names))]
    shape = list(local.shape)
    shape[dim] = sum(counts)
    entries = [None] * local.dim()
    entries[dim] = names[0] if len(names) == 1 else names
    spec = P(*entries)
    layout = Layout(mesh, spec, tuple(shape), local.dtype)
    want = [layout.local_shape(r)[dim] for r in ranks]
    have = [shapes[i][2 + dim] for i in range(len(ranks))]
    if want != have:
        raise ValueError(
            f"batch: rows per rank {have} (global {shape[dim]}) do not follow fshard's block "
            f"convention for {spec}, which gives {want}; read equal batches on every rank "
            "(fs.data.sampler, DataLoader(drop_last=True)) or pad the short ones"
        )
    return from_local(local, mesh, spec, shape=tuple(shape))


def _describe(s: list[int]) -> str:
    dtype = _DTYPES[s[0]] if s[0] < len(_DTYPES) else "another dtype"
    return f"{dtype} {tuple(s[2 : 2 + s[1]])}"
