"""Inspecting communication and layouts: ``comm_log`` and ``visualize``."""

from __future__ import annotations

import contextlib
import io

from rich.console import Console
from rich.table import Table

from ._comm import _LOG, CommRecord
from .spec import BaseLayout

__all__ = ["comm_log", "visualize", "CommRecord"]


@contextlib.contextmanager
def comm_log():
    """Record every collective issued in the block on this rank.

    Yields:
        A list that fills with :class:`CommRecord` ``(op, axes, nbytes)`` entries, ``nbytes``
        being this rank's input bytes. Local steps (slices, zeroing) are not recorded.

    Example:
        >>> with fs.debug.comm_log() as log:  # doctest: +SKIP
        ...     y = fs.reshard(x, fs.P(None, "x"))
        >>> [r.op for r in log]  # doctest: +SKIP
        ['all_to_all']
    """
    log: list[CommRecord] = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def _blocks(layout: BaseLayout):
    """{(dim0 range, dim1 range): [ranks]} for the first two dims."""
    cells: dict = {}
    for r in layout.mesh.ranks:
        m = layout.shard_metadata(r)
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
        >>> fs.debug.visualize(x)  # doctest: +SKIP
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
