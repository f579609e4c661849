"""Inspecting communication and layouts: ``comm_log`` and ``visualize``.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> x = fs.shard(torch.ones(4), mesh, fs.P("x"))
    >>> with fs.debug.comm_log() as log:
    ...     t = fs.gather(x)
    >>> [r.op for r in log]
    ['all_gather']
"""

from __future__ import annotations

import contextlib
import io

from rich.console import Console
from rich.table import Table

from ._comm import _LOG, CommRecord
from .interop import rank_boxes
from .spec import BaseLayout

__all__ = ["comm_log", "visualize", "CommRecord"]


@contextlib.contextmanager
def comm_log():
    """Record every collective issued in the block on this rank.

    Yields:
        A list that fills with :class:`CommRecord` ``(op, axes, nbytes)`` entries, ``nbytes``
        being this rank's input bytes. Local steps (slices, zeroing) are not recorded.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.arange(8.0).reshape(2, 4), mesh, fs.P("x", None))
        >>> with fs.debug.comm_log() as log:
        ...     y = fs.reshard(x, fs.P(None, "x"))
        >>> [(r.op, r.axes, r.nbytes) for r in log]  # this rank's (1, 4) float32 block
        [('all_to_all', ('x',), 16)]
    """
    log: list[CommRecord] = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def _blocks(layout: BaseLayout):
    """{(dim0 range, dim1 range): [ranks]} for the first two dims (a per-part layout: one cell
    per part a rank holds)."""
    cells: dict = {}
    for r in layout.mesh.ranks:
        for m in rank_boxes(layout, r):
            key = tuple((o, o + s) for o, s in zip(m.shard_offsets[:2], m.shard_sizes[:2]))
            cells.setdefault(key, []).append(r)
    return cells


def visualize(x, *, console: Console | None = None) -> str:
    """Print a table of which rank holds which block (like ``jax.debug.visualize_array_sharding``).

    Rows are blocks of dim 0, columns blocks of dim 1 (1-D values have one row); each cell lists
    the ranks holding that block. Higher dims are summarised in the title. Works on a
    ``ShardedArray`` or a ``Layout`` (abstract meshes too).

    Returns:
        The rendered text.

    Example:
        >>> import io
        >>> from rich.console import Console
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> x = fs.shard(torch.zeros(5, 7), mesh, fs.P("x", None))
        >>> text = fs.debug.visualize(x, console=Console(file=io.StringIO()))  # printed on the console
        >>> "[0:3)" in text and "[3:5)" in text  # rank 0 holds rows 0-2, rank 1 rows 3-4
        True
    """
    layout = x if isinstance(x, BaseLayout) else getattr(x, "layout", None)
    if not isinstance(layout, BaseLayout):
        raise TypeError(f"visualize: expected a ShardedArray or Layout, got {type(x).__name__}")
    cells = _blocks(layout)
    nd = layout.ndim
    rows = sorted({k[0] for k in cells}) if nd >= 1 else [()]
    cols = sorted({k[1] for k in cells}) if nd >= 2 else [()]
    title = f"{tuple(layout.shape)} {layout.dtype} {layout.spec} on {layout.mesh!r}"
    if layout.partial:
        title += f" (pending sum over {layout.partial})"
    table = Table(title=title, show_lines=True)
    table.add_column("dim0 \\ dim1" if nd >= 2 else ("dim0" if nd else "value"))
    for c in cols:
        table.add_column(f"[{c[0]}:{c[1]})" if c else "")
    for r in rows:
        cells_row = []
        for c in cols:
            key = tuple(k for k in (r, c) if k != ())
            ranks = cells.get(key, [])
            cells_row.append("ranks " + ",".join(map(str, ranks)) if ranks else "")
        label = f"[{r[0]}:{r[1]})" if r else "all"
        table.add_row(label, *cells_row)
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False).print(table)
    text = buf.getvalue()
    (console or Console()).print(table)
    return text
