"""Checkpoints of pytrees of sharded values on ``torch.distributed.checkpoint`` (DCP).

``save(path, tree)`` writes any pytree of :class:`ShardedArray`, plain tensors and Python values
(params, optimizer state, step counter) as a DCP checkpoint directory; ``load(path, like)`` reads
it into the layouts of ``like``, which may use another mesh, world size, spec or an uneven or
explicit layout (DCP reshards on load: every rank reads exactly the saved chunks that overlap
its block).

How values are stored (decisions):

- **Keys** are the pytree paths joined by ``/`` (``{"params": {"w": x}}`` -> ``params/w``; a list
  index is its number; a bare leaf is ``<root>``). ``load`` matches by key, so ``like`` must
  have the same paths; extra keys in the checkpoint are ignored (load a subset, e.g. params
  only).
- **Sharded values** are presented to DCP as a ``ShardedTensor`` built with
  ``_init_from_local_shards_and_global_metadata``: one chunk per *distinct non-empty* block.
  Empty blocks (uneven layouts: 2 rows over 4 ranks) are skipped. A **replicated** block is
  written once, by the first rank in mesh order that holds it (the replica with index 0 on
  every replicated axis). A fully replicated value is written like a plain tensor.
- **Partial** (pending-sum) values are reduced first (one all_reduce over the partial axes)
  and saved as their sum; loading into a partial ``like`` puts the value on the first rank of
  each partial axis and zeros elsewhere, as :func:`fshard.shard` does.
- **Plain tensors** are saved once, from rank 0's copy (DCP deduplicates equal writes; every
  rank must hold the same value). **Other leaves** (ints, floats, strings...) are pickled by
  DCP and read back on every rank. ``None`` is an empty subtree (nothing is saved).
- **Atomic:** data goes to ``.<name>.fshard-tmp`` beside ``path``. When every rank has finished
  (a barrier), rank 0 moves an existing ``path`` aside to ``.<name>.fshard-old``, renames the
  temporary directory to ``path`` and deletes the old one. A save interrupted at any point
  leaves the previous checkpoint intact (if a crash falls between the two renames, the next
  ``save`` or ``load`` moves ``.<name>.fshard-old`` back first).
- **Errors, not hangs:** before reading any data, every rank reads the checkpoint metadata and
  checks every key of ``like`` (present, shape, dtype, tensor vs Python value) and the data
  files (present, long enough). The ranks then exchange their findings (one small
  ``all_gather_object``), so all ranks raise the same :class:`CheckpointError`.

Cost: ``save`` writes each distinct block once (one file per rank); ``load`` reads on each rank
only the byte ranges overlapping its block (a replicated value is read by every rank).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist

from . import consistency
from .array import ShardedArray
from .interop import _distinct_boxes, _quiet, _sharded_tensor
from .spec import Layout, P

__all__ = ["save", "load", "CheckpointError"]

#: Test hook: called with a stage name ("start", "written") on every rank during ``save``.
_test_hook: Callable[[str], None] | None = None

_ROOT_KEY = "<root>"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, or does not match ``like`` (raised on every rank)."""


def _hook(stage: str) -> None:
    if _test_hook is not None:
        _test_hook(stage)


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def _check_path(path, fn: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{fn}: path must be a str or os.PathLike (a directory), got "
            f"{type(path).__name__} {path!r}"
        )
    path = os.path.abspath(os.fspath(path))
    if os.path.basename(path) == "":
        raise ValueError(f"{fn}: path {path!r} has no final component; name the directory")
    return path


def _aside(path: str, what: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.fshard-{what}")


def _is_leaf(x) -> bool:
    return isinstance(x, (ShardedArray, Layout))


def _flatten(tree, fn: str) -> tuple[list[str], list[Any], Any]:
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    keys = ["/".join(str(p) for p in path) if path else _ROOT_KEY for path in paths]
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k in seen:
            raise ValueError(
                f"{fn}: two leaves map to the same checkpoint key {k!r} (paths "
                f"{paths[seen[k]]!r} and {paths[i]!r}); rename a dict key so that the paths "
                "joined by '/' are unique"
            )
        seen[k] = i
    return keys, leaves, treedef


# -- ShardedArray <-> ShardedTensor for DCP ----------------------------------------------------


def _fully_replicated(layout: Layout) -> bool:
    boxes = _distinct_boxes(layout)
    return len(boxes) == 1 and boxes[0][2] == tuple(layout.shape)


def _to_saveable(key: str, leaf: Any, me: int) -> Any:
    if isinstance(leaf, Layout):
        raise TypeError(
            f"save: the leaf at key {key!r} is a Layout; save values (ShardedArray, tensors, "
            "Python values). Layouts belong in the `like` tree of load"
        )
    if isinstance(leaf, ShardedArray):
        layout = leaf.layout
        if layout.mesh.is_abstract:
            raise ValueError(f"save: the ShardedArray at key {key!r} has an abstract mesh")
        if layout.partial:
            from .api import _reshard_one

            leaf = _reshard_one(leaf, P(*layout.dim_axes))
            layout = leaf.layout
        local = leaf.local.detach().contiguous()
        if math.prod(layout.shape) == 0 or _fully_replicated(layout):
            return local
        return _sharded_tensor(layout, local, me, prefer_me=False)
    if isinstance(leaf, torch.Tensor):
        return leaf.detach()
    return leaf


def _commit(tmp: str, path: str) -> None:
    old = _aside(path, "old")
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def _recover(path: str) -> None:
    """Rank 0: a crash between the two renames of a commit left the old checkpoint aside."""
    old = _aside(path, "old")
    if not os.path.exists(path) and os.path.isdir(old):
        os.rename(old, path)


def _agree(error: str | None) -> str | None:
    """The first non-None error over all ranks (the same string on every rank), or None."""
    if not _is_dist():
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    for r, e in enumerate(errors):
        if e is not None:
            return e if e.startswith("checkpoint") else f"rank {r}: {e}"
    return None


def save(path: str | os.PathLike, tree: Any) -> None:
    """Save a pytree of sharded values, tensors and Python values as a DCP checkpoint.

    Collective: every rank calls it with a tree of the same structure, keys and layouts.

    Args:
        path: the checkpoint directory (created; an existing checkpoint there is replaced
            atomically once the new one is complete).
        tree: any pytree (dicts, lists, tuples, namedtuples...) whose leaves are
            :class:`ShardedArray`, ``torch.Tensor`` (the same on every rank) or picklable
            Python values.

    Returns:
        None.

    Raises:
        TypeError: ``path`` is not a str/PathLike, or a leaf is a :class:`Layout`.
        ValueError: two leaves map to the same key.
        CheckpointError: writing failed on some rank (raised on every rank).

    Example:
        >>> fs.checkpoint.save("ckpt/step100", {"params": params, "opt": state, "step": 100})  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    path = _check_path(path, "save")
    keys, leaves, _ = _flatten(tree, "save")
    consistency.check_equal({k: v for k, v in zip(keys, leaves) if not isinstance(v, (torch.Tensor, ShardedArray))}, what="checkpoint save: keys and Python values")  # fmt: skip
    me = _rank()
    state = {k: _to_saveable(k, leaf, me) for k, leaf in zip(keys, leaves)}
    tmp = _aside(path, "tmp")
    error = None
    if me == 0:
        try:
            _recover(path)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # a previous save that was interrupted
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            error = f"checkpoint save: cannot prepare {tmp!r}: {e}"
    error = _agree(error)
    if error:
        raise CheckpointError(error)
    _hook("start")
    try:
        with _quiet():
            dcp.save(
                state,
                storage_writer=FileSystemWriter(tmp),
                planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                no_dist=not _is_dist(),
            )
    except Exception as e:  # DCP reports a failure on any rank to every rank
        raise CheckpointError(f"checkpoint save to {path!r} failed: {e}") from e
    _hook("written")
    _barrier()  # every rank's data is on disk before the rename
    error = None
    if me == 0:
        try:
            _commit(tmp, path)
        except OSError as e:
            error = f"checkpoint save: renaming {tmp!r} to {path!r} failed: {e}"
    error = _agree(error)
    if error:
        raise CheckpointError(error)


# -- load --------------------------------------------------------------------------------------


def _expected(leaf: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    if isinstance(leaf, (ShardedArray, Layout)):
        layout = leaf.layout if isinstance(leaf, ShardedArray) else leaf
        return tuple(layout.shape), layout.dtype
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype
    return None


def _validate(path: str, keys: list[str], leaves: list[Any]) -> str | None:
    """Check the checkpoint against ``like`` from its metadata alone; an error text or None."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if not os.path.isdir(path):
        old = _aside(path, "old")
        hint = (
            f" (an interrupted save left the previous checkpoint at {old!r})"
            if os.path.isdir(old)
            else ""
        )
        return f"checkpoint {path!r} does not exist or is not a directory{hint}"
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as e:
        return (
            f"checkpoint {path!r}: cannot read its metadata file ({type(e).__name__}: {e}); the "
            "checkpoint is missing, incomplete or corrupted"
        )
    found = md.state_dict_metadata
    problems = []
    for key, leaf in zip(keys, leaves):
        want = _expected(leaf)
        if key not in found:
            have = sorted(found)
            more = f", ... ({len(have)} keys)" if len(have) > 12 else ""
            problems.append(f"key {key!r} is missing (the checkpoint has keys {have[:12]}{more})")
            continue
        entry = found[key]
        if want is None:
            if not isinstance(entry, BytesStorageMetadata):
                problems.append(
                    f"key {key!r}: expected a Python value ({type(leaf).__name__}), found a "
                    f"tensor of shape {tuple(entry.size)} dtype {entry.properties.dtype}"
                )
            continue
        if isinstance(entry, BytesStorageMetadata):
            problems.append(
                f"key {key!r}: expected a tensor of shape {want[0]} dtype {want[1]}, found a "
                "Python value"
            )
            continue
        got = (tuple(entry.size), entry.properties.dtype)
        if got != want:
            problems.append(
                f"key {key!r}: expected shape {want[0]} dtype {want[1]}, found shape {got[0]} "
                f"dtype {got[1]}"
            )
    wanted = set(keys)
    sizes: dict[str, int | None] = {}
    for index, info in md.storage_data.items():
        if index.fqn not in wanted:
            continue
        rel = info.relative_path
        if rel not in sizes:
            full = os.path.join(path, rel)
            sizes[rel] = os.path.getsize(full) if os.path.isfile(full) else None
        size = sizes[rel]
        if size is None:
            problems.append(f"key {index.fqn!r}: data file {rel!r} is missing")
        elif size < info.offset + info.length:
            problems.append(
                f"key {index.fqn!r}: data file {rel!r} is truncated (the chunk at offsets "
                f"{tuple(index.offset or ())} needs bytes [{info.offset}, "
                f"{info.offset + info.length}) but the file has {size} bytes)"
            )
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        return f"checkpoint {path!r} does not match `like`:\n  {shown}{more}"
    return None


def _load_target(leaf: Any, me: int):
    """``(object handed to DCP or None, finish(obj) -> result leaf)``."""
    if isinstance(leaf, (ShardedArray, Layout)):
        layout = leaf.layout if isinstance(leaf, ShardedArray) else leaf
        if layout.mesh.is_abstract:
            raise ValueError(
                f"load: like has a layout on an abstract mesh ({layout!r}); use Mesh.create"
            )
        final = layout
        if layout.partial:
            layout = layout.with_spec(P(*layout.dim_axes))
        device = layout.mesh.device()
        mine = layout.shard_metadata(me)
        local = torch.empty(mine.shard_sizes, dtype=layout.dtype, device=device)

        def finish(_obj, local=local, layout=layout, final=final):
            out = ShardedArray._raw(local, layout)
            if final is not layout:
                from .api import _reshard_one

                out = _reshard_one(out, final.spec)
            return out

        if math.prod(layout.shape) == 0:
            return None, finish
        if _fully_replicated(layout):
            return local, finish
        st = _sharded_tensor(layout, local if mine.numel else None, me, prefer_me=True)
        return st, finish
    if isinstance(leaf, torch.Tensor):
        t = torch.empty_like(leaf)
        return t, lambda _obj, t=t: t
    return leaf, lambda obj: obj


def load(path: str | os.PathLike, like: Any) -> Any:
    """Load a checkpoint written by :func:`save` into the structure and layouts of ``like``.

    Collective: every rank calls it with a ``like`` of the same structure. The mesh, world
    size and specs may differ from the ones used at save time (uneven and explicit layouts
    included): each rank reads only the saved chunks that overlap its own block.

    Args:
        path: the checkpoint directory.
        like: a pytree with the same keys as the saved one (a subset is fine). Leaves:
            :class:`ShardedArray` or :class:`Layout` (the target layout; values are ignored),
            ``torch.Tensor`` (target shape, dtype, device), or any Python value (replaced by
            the saved value).

    Returns:
        A new pytree of ``like``'s structure holding the saved values; ``like`` is not
        modified.

    Raises:
        CheckpointError: on every rank, before any data is read, when the checkpoint is
            missing, its metadata is unreadable, a key is missing, a shape or dtype differs,
            a tensor is saved where ``like`` has a Python value (or the reverse), or a data file
            is missing or truncated.

    Example:
        >>> state = fs.checkpoint.load("ckpt/step100", {"params": params, "opt": state, "step": 0})  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = _check_path(path, "load")
    keys, leaves, treedef = _flatten(like, "load")
    me = _rank()
    error = None
    if me == 0:
        try:
            _recover(path)
        except OSError as e:
            error = f"checkpoint load: cannot restore {_aside(path, 'old')!r}: {e}"
    error = _agree(error)
    if error is None:
        _barrier()
        try:
            error = _validate(path, keys, leaves)
        except Exception as e:  # never let one rank leave early: report it to all
            error = f"checkpoint {path!r}: validation failed ({type(e).__name__}: {e})"
        error = _agree(error)
    if error:
        raise CheckpointError(error)
    state, finishers = {}, []
    for key, leaf in zip(keys, leaves):
        obj, finish = _load_target(leaf, me)
        if obj is not None:
            state[key] = obj
        finishers.append((key, finish))
    if state:
        try:
            with _quiet():
                dcp.load(state, storage_reader=FileSystemReader(path), no_dist=not _is_dist())
        except Exception as e:  # DCP reports a failure on any rank to every rank
            raise CheckpointError(f"checkpoint {path!r}: reading the data failed: {e}") from e
    out = [finish(state.get(key)) for key, finish in finishers]
    return optree.tree_unflatten(treedef, out)
