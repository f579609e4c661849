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
  rank must hold the same value). ``None`` is an empty subtree (nothing is saved).
- **Python values** (every other leaf) are written by rank 0 as JSON into ``fshard.json``, never
  pickled. Allowed leaves: ``bool``, ``int``, ``float`` (nan and inf too), ``str``,
  ``torch.Size``, ``torch.dtype`` (exact types; lists, tuples and dicts are pytree nodes, so
  their leaves are stored one by one, and ``None`` is an empty subtree). Anything else is
  refused at save time with the key named (e.g. a numpy float: convert it with ``float()``).

Safety: ``load`` never executes code from the checkpoint directory.

- ``fshard.json`` is JSON; a value decodes only to the allowed types above.
- DCP's ``.metadata`` is a pickle, and DCP's own reader (``FileSystemReader.read_metadata``)
  calls ``pickle.load`` on it. ``load`` reads it instead with a restricted unpickler that
  resolves only DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts and paths (any
  other global, e.g. ``os.system`` in a ``__reduce__``, raises :class:`CheckpointError`), and
  hands the validated object to DCP through a ``FileSystemReader`` whose ``read_metadata``
  returns it. (The alternative, a JSON copy of the metadata written at save time, would have
  to rebuild DCP's private metadata classes field by field for ``dcp.load``; the allow-list
  keeps DCP's own format and fails closed if a torch release adds a class.)
- Tensor chunks in the data files are read by DCP with ``torch.load(weights_only=True)``.
- ``torch.save(x)`` of a :class:`ShardedArray`, :class:`Layout`, :class:`Mesh` or :class:`P`
  loads back with ``torch.load(weights_only=True)``: their rebuild functions are registered
  with ``torch.serialization.add_safe_globals`` when fshard is imported.

Integrity and atomicity:

- **Checksums:** ``fshard.json`` records the size and SHA-256 of ``.metadata`` and of every data
  file (hashed at save time, each file by one rank), and the SHA-256 of its own canonical JSON
  (so an edited Python value is caught too; manifests of format version 1, written before that
  existed, load without it). ``load`` verifies ``.metadata`` on every
  rank and each data file it is about to read on one rank, before DCP reads any data; a
  mismatch names the file.
- **Atomic:** data goes to a fresh ``.<name>.fshard-tmp-<id>`` beside ``path``. When every rank
  has finished (a barrier) and the checksums are written, rank 0 moves an existing ``path``
  aside to ``.<name>.fshard-old``, renames the temporary directory to ``path`` and deletes the
  old one. A save interrupted at any point leaves the previous checkpoint intact (if a crash
  falls between the two renames, the next ``save`` or ``load`` moves ``.<name>.fshard-old``
  back first).
- **One save at a time:** rank 0 holds an exclusive ``flock`` on ``.<name>.fshard-lock`` for
  the whole save (the kernel drops it if the process dies). A second save to the same path
  while one is running fails at once with :class:`CheckpointError`; the running one wins.
  Leftover temporary directories of crashed saves are removed under the lock. On a file
  system without ``flock`` saves proceed unlocked: each still writes its own directory and
  the rename is atomic, so the result is one complete checkpoint (the last to commit), never
  a mix.
- ``save`` refuses a ``path`` that exists and is not a checkpoint directory (a plain file, or a
  non-empty directory without ``fshard.json`` or ``.metadata``) before touching anything.

Asynchronous saves (``save(path, tree, blocking=False)``, issue 39): the caller blocks while
every rank copies its blocks to host memory with DCP's ``DefaultStager`` (kept for the process,
so a loop updating its params in place refills the same copies) and rank 0 takes the lock; a
background thread then runs the same write, checksums and commit as a blocking save, with its
collectives on a Gloo process group of its own (made once, by ``dist.new_group``): collectives
from two threads on one group could pair up wrongly with the step's. ``dcp.async_save`` itself
is not called: its future covers DCP's write only, and fshard's commit must follow on the same
thread. Only one asynchronous save per process is in flight: the next ``save`` or ``load``
waits for it and raises its failure if no :meth:`SaveHandle.wait` did.

Errors, not hangs: every failure is agreed on by all ranks (one small ``all_gather_object``)
and raised on every rank as :class:`CheckpointError` naming the rank and the cause, including
DCP's ``CheckpointException`` (a ``BaseException``: e.g. a full disk on one rank). Before
reading any data, every rank checks each key of ``like`` (present, shape, dtype, tensor vs
Python value) and the data files (listed, present, the recorded size, the checksum).

Cost: ``save`` writes each distinct block once (one file per rank) and hashes what it wrote
(from the page cache); ``load`` hashes every data file holding a requested key once (spread
over the ranks), then reads on each rank only the byte ranges overlapping its block (a
replicated value is read by every rank).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.gettempdir(), f"fshard-example-{os.getppid()}")  # one for all ranks
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> fs.checkpoint.save(path, {"w": fs.shard(torch.arange(6.0), mesh, fs.P("x")), "step": 100})
    >>> like = {"w": fs.zeros((6,), mesh, fs.P()), "step": 0}  # another layout: replicated
    >>> state = fs.checkpoint.load(path, like)
    >>> state["w"].spec, fs.gather(state["w"]), state["step"]
    (P(), tensor([0., 1., 2., 3., 4., 5.]), 100)
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import math
import os
import pickle
import shutil
import socket
import sys
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist

from . import _compat, consistency
from ._leaf_errors import LeafErrors, paths
from .array import ShardedArray, _rebuild_sharded
from .executor import reshard_one
from .interop import _quiet, _sharded_tensor, local_pieces, rank_boxes
from .mesh import _restore as _rebuild_mesh
from .spec import (
    BaseLayout,
    ExplicitLayout,
    HeldLayout,
    Layout,
    P,
    PartitionSpec,
    Parts,
    _make_spec,
)

__all__ = ["save", "load", "CheckpointError", "SaveHandle"]

#: Test hook: called with a stage name ("start", "written") on every rank during ``save``.
_test_hook: Callable[[str], None] | None = None

_ROOT_KEY = "<root>"
_MANIFEST = "fshard.json"
_FORMAT = "fshard.checkpoint"
_VERSION = 2  # 2: the manifest carries a checksum of itself (1: fshard before 2026-11-26)
_UNSEALED_VERSIONS = (1,)  # read without a self-checksum: written before it existed
_HASH_BLOCK = 1 << 22

# torch.save / torch.load(weights_only=True) of fshard's values (see "Safety" above).
torch.serialization.add_safe_globals(
    [_rebuild_sharded, Layout, ExplicitLayout, HeldLayout, PartitionSpec, _make_spec, _rebuild_mesh]
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, unsafe, or does not match ``like``, or a save failed
    (raised on every rank, with the same message).

    Example:
        >>> import fshard as fs
        >>> try:
        ...     fs.checkpoint.load("/nonexistent/ckpt", {"step": 0})
        ... except fs.checkpoint.CheckpointError as e:
        ...     print(type(e).__name__)
        CheckpointError
    """


def _hook(stage: str) -> None:
    if _test_hook is not None:
        _test_hook(stage)


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _world() -> int:
    return dist.get_world_size() if _is_dist() else 1


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _barrier(group=None) -> None:
    if _is_dist():
        dist.barrier(group=group)


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
    return isinstance(x, (ShardedArray, BaseLayout))


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


def _unreduced(spec: PartitionSpec | Parts) -> PartitionSpec | Parts:
    """``spec`` without its pending sums (a :class:`Parts` keeps its parts)."""
    if isinstance(spec, Parts):
        return Parts(P(*spec.spec.dims), spec.dim, spec.sizes)
    return P(*spec.dims)


def _fully_replicated(layout: Layout) -> bool:
    """Whether every rank holds the whole value (then each saves its plain tensor, DCP writes
    one). Not where some ranks hold empty blocks (a ``Layout.held`` value: its one block is on
    one stage's ranks; saved plain, DCP took the coordinator's empty block for the value)."""
    whole = tuple(layout.shape)
    return all(
        len(boxes) == 1 and tuple(boxes[0].shard_sizes) == whole
        for boxes in (rank_boxes(layout, r) for r in layout.mesh.ranks)
    )


def _saveable_local(key: str, leaf: Any) -> tuple[Layout | None, torch.Tensor]:
    """``(layout or None for a plain tensor, the tensor this rank saves)``; a partial value is
    reduced first (a collective)."""
    if isinstance(leaf, BaseLayout):
        raise TypeError(
            f"save: the leaf at key {key!r} is a Layout; save values (ShardedArray, tensors, "
            "Python values). Layouts belong in the `like` tree of load"
        )
    if isinstance(leaf, ShardedArray):
        layout = leaf.layout
        if layout.mesh.is_abstract:
            raise ValueError(f"save: the ShardedArray at key {key!r} has an abstract mesh")
        if layout.partial:
            leaf = reshard_one(leaf, layout.with_spec(_unreduced(layout.spec)).spec)
            layout = leaf.layout
        return layout, leaf.local.detach().contiguous()
    return None, leaf.detach()


def _to_dcp(layout: Layout | None, local: torch.Tensor, me: int) -> Any:
    """What DCP is handed for one tensor leaf: a ShardedTensor over the distinct blocks, or
    the plain tensor (replicated, empty, or not sharded)."""
    if layout is None or math.prod(layout.shape) == 0 or _fully_replicated(layout):
        return local
    return _sharded_tensor(layout, local_pieces(layout, local), me, prefer_me=False)


# -- Python values: JSON with an allow-list -----------------------------------------------------

_ALLOWED = "bool, int, float, str, torch.Size, torch.dtype (lists, tuples, dicts: of those)"


def _encode(value: Any) -> Any:
    """A Python leaf as JSON: scalars as themselves, the rest as a one-key tag."""
    kind = type(value)
    if kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is torch.Size:
        return {"size": list(value)}
    if kind is torch.dtype:
        return {"dtype": str(value).removeprefix("torch.")}
    raise TypeError(f"a {kind.__module__}.{kind.__qualname__} ({value!r:.80})")


def _decode(obj: Any) -> Any:
    """Inverse of :func:`_encode`; only ever builds the allowed types."""
    if type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is dict and len(obj) == 1:
        ((tag, body),) = obj.items()
        if tag == "size" and type(body) is list and all(type(n) is int for n in body):
            return torch.Size(body)
        if tag == "dtype" and isinstance(getattr(torch, str(body), None), torch.dtype):
            return getattr(torch, body)
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
    raise ValueError(f"not an allowed value: {str(obj)[:80]}")


# -- DCP's .metadata without pickle.load -------------------------------------------------------

_DCP_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    *(
        (_DCP_MD, n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP ``.metadata`` pickle needs (see "Safety" above)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to load the global {module}.{name}: not one of DCP's metadata types"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id in DCP metadata")


def _read_metadata(data: bytes):
    import io

    from torch.distributed.checkpoint.metadata import Metadata

    md = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"the pickle holds a {type(md).__name__}, not a Metadata")
    return md


def _reader(path: str, md):
    """DCP's FileSystemReader, reading ``md`` (already validated) instead of unpickling."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _Reader(path)


# -- files: checksums, the lock, the commit ----------------------------------------------------


def _digest(full: str) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(full, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return os.path.getsize(full), h.hexdigest()


def _share(value: Any, group=None) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not _is_dist():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gather(value: Any, group=None) -> list[Any]:
    if not _is_dist():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def _agree(error: str | None, group=None) -> str | None:
    """The first non-None error over all ranks (the same string on every rank), or None."""
    for r, e in enumerate(_gather(error, group)):
        if e is not None:
            return e if e.startswith("checkpoint") else f"rank {r}: {e}"
    return None


def _dcp_failure(e: BaseException) -> str:
    """What failed, per rank, in DCP's CheckpointException (or any exception)."""
    failures = getattr(e, "failures", None)
    if not failures:
        return f"{type(e).__name__}: {e}"
    return "; ".join(
        f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(failures.items())
    )


def _disk_hint(directory: str) -> str:
    """Name a full disk (torch.save's writer reports ENOSPC as "unexpected pos")."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if free < max(1 << 20, total // 1000):
        return (
            f" (the file system holding {directory!r} has {free} of {total} bytes free: the "
            "disk is likely full)"
        )
    return ""


class _Busy(Exception):
    pass


def _lock(path: str) -> int | None:
    """Rank 0: an exclusive flock on ``.<name>.fshard-lock`` (its fd; None where the file
    system has no flock). Raises _Busy naming the holder when another save holds it."""
    lock = _aside(path, "lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise _Busy(f"{holder} holds {lock!r}") from None
        except OSError:
            os.close(fd)
            return None
        try:  # the holder may have unlinked it between our open and our flock: retry
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"save pid {os.getpid()} on host {socket.gethostname()}".encode())
            return fd
        os.close(fd)


def _unlock(path: str, fd: int | None) -> None:
    if fd is not None:
        os.unlink(_aside(path, "lock"))
        os.close(fd)


def _prepare(path: str, markers: tuple[str, ...] = (_MANIFEST, ".metadata")) -> str:
    """Rank 0, under the lock: refuse a non-checkpoint ``path`` (a non-empty directory holding
    none of ``markers``), restore an interrupted commit, drop crashed saves' temporary
    directories; returns a fresh temporary directory."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint save: {path!r} exists and is not a directory; refusing to replace it "
            "(remove it or choose another path)"
        )
    if os.path.isdir(path):
        names = os.listdir(path)
        if names and not set(markers) & set(names):
            raise CheckpointError(
                f"checkpoint save: {path!r} is a non-empty directory that is not a checkpoint "
                f"(no {' or '.join(markers)}; it holds e.g. {sorted(names)[:5]}); refusing "
                "to replace it (remove it or choose another path)"
            )
    _recover(path)
    head, name = os.path.split(path)
    stale = f".{name}.fshard-tmp-"
    for entry in os.listdir(head):
        if entry.startswith(stale):
            shutil.rmtree(os.path.join(head, entry))
    return _aside(path, f"tmp-{uuid.uuid4().hex[:12]}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: str, path: str) -> None:
    old = _aside(path, "old")
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if os.path.exists(old):
        shutil.rmtree(old)


def _recover(path: str) -> None:
    """Rank 0: a crash between the two renames of a commit left the old checkpoint aside."""
    old = _aside(path, "old")
    if not os.path.exists(path) and os.path.isdir(old):
        os.rename(old, path)


# -- save --------------------------------------------------------------------------------------


class SaveHandle:
    """A running asynchronous save: what :func:`save` returns with ``blocking=False``.

    The values were copied to host memory before :func:`save` returned; a background thread
    writes them, checksums the files and commits the checkpoint (atomically, as a blocking
    save does). The next :func:`save` or :func:`load` on this process waits for it first.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.gettempdir(), f"fshard-example-{os.getppid()}")  # one for all ranks
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.shard(torch.arange(6.0), mesh, fs.P("x"))
        >>> handle = fs.checkpoint.save(path, {"w": w, "step": 1}, blocking=False)
        >>> w = w * 2  # training goes on while the bytes are written
        >>> handle.wait()  # (or the next save / load waits)
        >>> handle.done()
        True
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._finished = threading.Event()
        self._error: str | None = None
        self._reported = False

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return self._finished.is_set()

    def wait(self) -> None:
        """Block until the save is committed.

        Raises:
            CheckpointError: the save failed (on every rank, the same message); the previous
                checkpoint at ``path`` is untouched.
        """
        self._finished.wait()
        if self._error is not None:
            self._reported = True
            raise CheckpointError(self._error)

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "writing"
        return f"SaveHandle({self.path!r}, {state})"


#: The asynchronous save this process started last (the next save or load waits for it).
_pending: SaveHandle | None = None
#: A process group of its own for asynchronous saves, so that their collectives (in the
#: background thread) never interleave with the step's on the default group.
_save_group: Any = None
#: The default group of this process's first checkpoint call (see _background_group).
_first_world: Any = None


@atexit.register
def _wait_at_exit() -> None:
    """A process leaving with an asynchronous save in flight finishes it first, and says so on
    stderr if it failed unobserved (e.g. the process group was destroyed under it)."""
    try:
        _wait_pending()
    except CheckpointError as e:
        print(f"fshard.checkpoint at exit: {e}", file=sys.stderr)


def _wait_pending() -> None:
    """Wait for this process's asynchronous save; raise its failure if no ``wait()`` did (a
    failed save is never silent)."""
    global _pending
    if _pending is not None:
        handle, _pending = _pending, None
        handle._finished.wait()
        if handle._error is not None and not handle._reported:
            handle._reported = True
            raise CheckpointError(
                f"the previous asynchronous save failed (reported here, at the next save or "
                f"load; SaveHandle.wait() reports it at once): {handle._error}"
            )


def _note_world() -> None:
    """Remember the first default group a checkpoint call saw (to tell a re-initialisation)."""
    global _first_world
    if _is_dist() and _first_world is None:
        _first_world = dist.group.WORLD


def _background_group() -> tuple[bool, Any]:
    """``(usable, the asynchronous saves' process group)``. Not usable once torch.distributed
    was destroyed and initialised again after this process's first checkpoint call
    (``fs.launch.run`` under torchrun, per call): torch then restarts its group names, so a new
    group reads the destroyed ones' rendezvous keys from the store torchrun keeps
    (``new_group`` then fails or hangs, measured with torch alone on 2.13); the save then
    blocks instead."""
    global _save_group
    if not _is_dist():
        return True, None
    _note_world()
    if dist.group.WORLD is not _first_world:
        return False, None
    if _save_group is None:
        _save_group = dist.new_group(backend="gloo")
    return True, _save_group


#: DCP's stager, kept for the process: it maps each source storage (weakly) to its host copy
#: and refills that copy on the next save, so a loop that updates its params in place
#: (``donate=True``) pays no fresh allocation (page faults) per save; a copy is dropped with
#: its source.
_stager: Any = None


def _stage(locals_: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``locals_`` in host memory, by DCP's stager (what ``dcp.async_save`` does).
    Only called once the previous asynchronous save is done (its copies are free to reuse)."""
    global _stager
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if _stager is None or not _compat.STAGER_REUSABLE:
        _stager = DefaultStager(  # a synchronous copy to plain host memory (CPU-only here)
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
    return _stager.stage(locals_)


def save(path: str | os.PathLike, tree: Any, *, blocking: bool = True) -> SaveHandle | None:
    """Save a pytree of sharded values, tensors and Python values as a DCP checkpoint.

    Collective: every rank calls it with a tree of the same structure, keys and layouts.

    Args:
        path: the checkpoint directory (created; an existing checkpoint there is replaced
            atomically once the new one is complete).
        tree: any pytree (dicts, lists, tuples, namedtuples...) whose leaves are
            :class:`ShardedArray`, ``torch.Tensor`` (the same on every rank) or Python values
            of the allowed types (see the module docstring; rank 0's are written).
        blocking: ``False``: copy this rank's blocks to host memory (DCP's ``DefaultStager``)
            and return a :class:`SaveHandle` at once; a background thread writes, checksums
            and commits while training goes on (torch's ``dcp.async_save``, plus fshard's
            commit). A process that dies meanwhile leaves the previous checkpoint complete.
            Any save first waits for this process's previous asynchronous one. The host copy
            stays with its source tensor (DCP's stager caches it) and is refilled by the next
            asynchronous save: one copy of this rank's saved state in host memory. Wait for
            the last one (:meth:`SaveHandle.wait`) while the process group still exists (before
            the function given to ``fs.launch.run`` returns: ``run`` then destroys the group,
            which fails a save still in flight; the previous checkpoint stays, and the failure
            is printed at exit). The background write runs on a process group of its own, made
            at the first asynchronous save; after torch.distributed is destroyed and initialised
            again in the process (a second ``fs.launch.run`` under torchrun) torch cannot make
            one reliably, so such a save blocks (with a ``RuntimeWarning``) and returns a
            finished handle.

    Returns:
        None, or with ``blocking=False`` a :class:`SaveHandle`.

    Raises:
        TypeError: ``path`` is not a str/PathLike, or a leaf is a :class:`Layout`.
        ValueError: two leaves map to the same key.
        CheckpointError: on every rank: a Python value of a type that is not allowed,
            ``path`` is a file or a directory that is not a checkpoint, another save to
            ``path`` is running, or writing failed on some rank (e.g. the disk is full;
            with ``blocking=False`` raised by :meth:`SaveHandle.wait`).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.gettempdir(), f"fshard-example-{os.getppid()}")  # one for all ranks
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.shard(torch.arange(6.0), mesh, fs.P("x"))
        >>> fs.checkpoint.save(path, {"w": w, "step": 100})
        >>> state = fs.checkpoint.load(path, {"w": w, "step": 0})
        >>> fs.gather(state["w"]), state["step"]
        (tensor([0., 1., 2., 3., 4., 5.]), 100)
    """
    global _pending
    path = _check_path(path, "save")
    if not isinstance(blocking, bool):
        raise TypeError(f"save: blocking must be a bool, got {type(blocking).__name__}")
    keys, leaves, _ = _flatten(tree, "save")
    _wait_pending()
    _note_world()
    me = _rank()
    values, error = {}, None
    for key, leaf in zip(keys, leaves):
        if not isinstance(leaf, (ShardedArray, BaseLayout, torch.Tensor)):
            try:
                values[key] = _encode(leaf)
            except TypeError as e:
                error = f"checkpoint save: the value at key {key!r} is {e}; allowed: {_ALLOWED}"
                break
    error = _agree(error)
    if error:
        raise CheckpointError(error)
    consistency.check_equal({"checkpoint path": path, **{k: v for k, v in zip(keys, leaves) if not isinstance(v, (torch.Tensor, ShardedArray))}}, what="checkpoint save: path, keys and Python values")  # fmt: skip
    tensors = {k: _saveable_local(k, leaf) for k, leaf in zip(keys, leaves) if k not in values}
    group, asked_async = None, not blocking
    if not blocking:
        usable, group = _background_group()
        if not usable:
            warnings.warn(
                "fs.checkpoint.save(blocking=False): torch.distributed was initialised again in "
                "this process, where torch cannot make a new process group reliably (its group "
                "names restart and meet the old group's keys in torchrun's store); this save "
                "blocks. Call fs.launch.run once per process for asynchronous saves",
                RuntimeWarning,
                stacklevel=2,
            )
            blocking, group = True, None
    lock, tmp = None, None
    try:
        if me == 0:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                lock = _lock(path)
                tmp = _prepare(path)
            except _Busy as e:
                error = (
                    f"checkpoint save: another save to {path!r} is in progress ({e}); this one "
                    "was refused and changed nothing"
                )
            except CheckpointError as e:
                error = str(e)
            except OSError as e:
                error = f"checkpoint save: cannot prepare the save to {path!r}: {e}"
        error, tmp = _share((_agree(error), tmp))
        if error:
            raise CheckpointError(error)
        if not blocking:
            staged = _stage({k: t for k, (_, t) in tensors.items()})
            tensors = {k: (layout, staged[k]) for k, (layout, _) in tensors.items()}
        state = {k: _to_dcp(layout, t, me) for k, (layout, t) in tensors.items()}
    except BaseException:
        _cleanup(path, me, tmp, lock)
        raise
    if blocking:
        try:
            _write(path, tmp, state, values, None, background=False)
        finally:
            _cleanup(path, me, tmp, lock)
        if not asked_async:
            return None
        done = SaveHandle(path)  # the asynchronous save that fell back to blocking: done
        done._finished.set()
        return done
    handle = SaveHandle(path)

    def run() -> None:
        try:
            _write(path, tmp, state, values, group, background=True)
        except CheckpointError as e:
            handle._error = str(e)
        except BaseException as e:  # keep the thread's failure for wait(), never lose it
            handle._error = f"checkpoint save to {path!r} failed: {type(e).__name__}: {e}"
        finally:
            try:
                _cleanup(path, me, tmp, lock)
            finally:
                handle._finished.set()

    _pending = handle
    threading.Thread(target=run, name=f"fshard-save {path}", daemon=True).start()
    return handle


def _cleanup(path: str, me: int, tmp: str | None, lock: int | None) -> None:
    if me == 0:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing behind
        _unlock(path, lock)


def _write(path: str, tmp: str, state: dict, values: dict, group, *, background: bool) -> None:
    """Write ``state`` with DCP into ``tmp``, checksum the files, seal the manifest, commit
    ``tmp`` to ``path`` (collectives on ``group``; the default one when None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    me, world = _rank(), _world()
    _hook("start")
    try:
        with contextlib.ExitStack() as quiet:
            if (
                not background
            ):  # warnings filters are process-wide: set them on the main thread only
                quiet.enter_context(_quiet())
                quiet.enter_context(_single_process_quiet())
            dcp.save(
                state,
                storage_writer=FileSystemWriter(tmp),
                planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                process_group=group,
                no_dist=not _is_dist(),
            )
    except (Exception, CheckpointException) as e:  # DCP reports any rank's failure to all
        cause = _share(f"{_dcp_failure(e)}{_disk_hint(tmp)}", group)  # the same on all ranks
        raise CheckpointError(f"checkpoint save to {path!r} failed: {cause}") from None
    _hook("written")
    _barrier(group)  # every rank's data is on disk
    digests, error = {}, None
    try:
        for name in sorted(os.listdir(tmp))[me::world]:
            digests[name] = _digest(os.path.join(tmp, name))
    except OSError as e:
        error = f"checkpoint save: hashing the files in {tmp!r} failed: {e}"
    gathered = _gather((error, digests), group)
    error = _agree(error, group)
    if me == 0 and error is None:
        files = {n: {"bytes": b, "sha256": h} for _, d in gathered for n, (b, h) in d.items()}
        manifest = {"format": _FORMAT, "version": _VERSION, "values": values, "files": files}
        manifest = _seal(manifest)
        try:
            with open(os.path.join(tmp, _MANIFEST), "w") as f:
                json.dump(manifest, f, allow_nan=False, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _commit(tmp, path)
        except OSError as e:
            error = f"checkpoint save: committing {tmp!r} to {path!r} failed: {e}"
    error = _agree(error, group)
    if error:
        raise CheckpointError(error)


# -- load --------------------------------------------------------------------------------------


def _expected(leaf: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    if isinstance(leaf, (ShardedArray, BaseLayout)):
        layout = leaf.layout if isinstance(leaf, ShardedArray) else leaf
        return tuple(layout.shape), layout.dtype
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype
    return None


def _manifest_digest(manifest: dict) -> str:
    """SHA-256 of ``manifest``'s canonical JSON, its own ``"sha256"`` entry left out."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    text = json.dumps(body, allow_nan=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _seal(manifest: dict) -> dict:
    """``manifest`` with the checksum of its own content (so an edited Python value, which no
    data-file checksum covers, is caught at load)."""
    return {**manifest, "sha256": _manifest_digest(manifest)}


def _read_manifest(path: str) -> dict:
    full = os.path.join(path, _MANIFEST)
    if not os.path.isfile(full):
        raise CheckpointError(
            f"checkpoint {path!r} has no {_MANIFEST}: it was not written by fshard.checkpoint."
            "save (or by an older fshard), so its checksums and Python values cannot be checked"
        )
    try:
        with open(full, "rb") as f:
            manifest = json.loads(f.read())
        version = manifest.get("version")
        if manifest.get("format") != _FORMAT or version not in (_VERSION, *_UNSEALED_VERSIONS):
            raise ValueError(f"format {manifest.get('format')!r} {version!r}")
        if version not in _UNSEALED_VERSIONS and manifest.get("sha256") != _manifest_digest(
            manifest
        ):
            raise ValueError(
                "its content does not match the checksum it was saved with: it was modified "
                "after the save"
            )
        if not isinstance(manifest["values"], dict) or not isinstance(manifest["files"], dict):
            raise ValueError("values and files must be objects")
    except (ValueError, KeyError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {path!r}: its {_MANIFEST} is corrupted or of another version "
            f"({type(e).__name__}: {e})"
        ) from None
    return manifest


def _check_file(path: str, name: str, files: dict, verify: bool) -> str | None:
    """A problem with data file ``name`` (absent, unlisted, wrong size, bad checksum) or None."""
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        return f"data file {name!r} is missing"
    entry = files.get(name)
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
        return f"data file {name!r} has no checksum in {_MANIFEST}"
    size = os.path.getsize(full)
    if size != entry.get("bytes"):
        cut = "truncated" if size < entry["bytes"] else "modified"
        return f"data file {name!r} is {cut} (it has {size} bytes, {entry['bytes']} at save)"
    if verify and _digest(full)[1] != entry.get("sha256"):
        return (
            f"data file {name!r} fails its checksum (SHA-256 differs from the one recorded at "
            "save): it is corrupted"
        )
    return None


def _validate(
    path: str, keys: list[str], leaves: list[Any], wheres: list[str], me: int, world: int
):
    """Check the checkpoint against ``like`` (leaves at key paths ``wheres``) before reading
    data; (error text listing every mismatching leaf, or None; DCP metadata; decoded values)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if not os.path.isdir(path):
        old = _aside(path, "old")
        hint = (
            f" (an interrupted save left the previous checkpoint at {old!r})"
            if os.path.isdir(old)
            else ""
        )
        return f"checkpoint {path!r} does not exist or is not a directory{hint}", None, None
    manifest = _read_manifest(path)
    files = manifest["files"]
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            data = f.read()
    except OSError as e:
        return f"checkpoint {path!r}: cannot read its metadata file ({e})", None, None
    entry = files.get(".metadata")
    if not isinstance(entry, dict) or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        return (
            f"checkpoint {path!r}: its metadata file '.metadata' fails its checksum (SHA-256 "
            f"differs from the one recorded in {_MANIFEST}): it is corrupted",
            None,
            None,
        )
    try:
        md = _read_metadata(data)
    except Exception as e:
        return (
            f"checkpoint {path!r}: cannot read its metadata file ({type(e).__name__}: {e}); "
            "the checkpoint is corrupted or unsafe",
            None,
            None,
        )
    found, saved_values = md.state_dict_metadata, manifest["values"]
    errors, values = LeafErrors(f"checkpoint {path!r} does not match `like`", "like"), {}
    where = dict(zip(keys, wheres))

    def problem(key: str, text: str) -> None:
        errors.add(where[key], f"key {key!r}{text}")

    missing: list[str] = []

    for key, leaf in zip(keys, leaves):
        want = _expected(leaf)
        if key not in found and key not in saved_values:
            problem(key, " is missing")
            missing.append(key)
            continue
        if want is None:
            if key not in saved_values:
                entry = found[key]
                what = (
                    "a pickled Python value (not written by fshard)"
                    if isinstance(entry, BytesStorageMetadata)
                    else f"a tensor of shape {tuple(entry.size)} dtype {entry.properties.dtype}"
                )
                problem(key, f": expected a Python value ({type(leaf).__name__}), found {what}")
                continue
            try:
                values[key] = _decode(saved_values[key])
            except (ValueError, TypeError) as e:
                problem(key, f": the saved Python value is refused ({e})")
            continue
        entry = found.get(key)
        if entry is None or isinstance(entry, BytesStorageMetadata):
            problem(
                key, f": expected a tensor of shape {want[0]} dtype {want[1]}, found a Python value"
            )
            continue
        got = (tuple(entry.size), entry.properties.dtype)
        if got != want:
            problem(
                key,
                f": expected shape {want[0]} dtype {want[1]}, found shape {got[0]} dtype {got[1]}",
            )
    wanted = set(keys)
    needed: dict[str, str] = {}  # data file -> a key it holds
    for index, info in md.storage_data.items():
        if index.fqn in wanted:
            needed.setdefault(info.relative_path, index.fqn)
            full = os.path.join(path, info.relative_path)
            if os.path.isfile(full) and os.path.getsize(full) < info.offset + info.length:
                problem(
                    index.fqn,
                    f": data file {info.relative_path!r} is truncated (the "
                    f"chunk at offsets {tuple(index.offset or ())} needs bytes [{info.offset}, "
                    f"{info.offset + info.length}) but the file has {os.path.getsize(full)} "
                    "bytes)",
                )
    for i, name in enumerate(sorted(needed)):
        bad = _check_file(path, name, files, verify=i % world == me)
        if bad is not None:
            problem(needed[name], f": {bad}")
    if errors:
        return errors.message(_structure_diff(missing, keys, [*found, *saved_values])), None, None
    return None, md, values


def _left_over(path: str, keys: list[str], md, values: dict) -> str | None:
    """``strict``: the saved keys ``like`` lacks, named (None when there are none)."""
    saved = set(md.state_dict_metadata) | set(_read_manifest(path)["values"])
    extra = sorted(saved - set(keys))
    if not extra:
        return None
    shown = ", ".join(repr(k) for k in extra[:12]) + (", ..." if len(extra) > 12 else "")
    return (
        f"checkpoint {path!r}: load(strict=True): the checkpoint has {len(extra)} keys `like` "
        f"lacks (of {len(saved)}): {shown}; they would be left unloaded. Build `like` with the "
        "structure that was saved (the same model and optimizer), or pass strict=False to "
        "load a subset"
    )


def _structure_diff(missing: list[str], keys: list[str], saved: list[str]) -> str:
    """The structural difference, once: the keys the checkpoint has that ``like`` lacks (where
    ``like`` has keys the checkpoint lacks, e.g. another optimizer's state)."""
    if not missing:
        return ""
    extra = sorted(set(saved) - set(keys))
    shown = ", ".join(repr(k) for k in extra[:12]) + (", ..." if len(extra) > 12 else "")
    return (
        f"`like` has {len(missing)} keys the checkpoint lacks; the checkpoint has "
        f"{len(extra)} keys `like` lacks{': ' + shown if extra else ''} (of {len(set(saved))} "
        "keys). Build `like` with the structure that was saved (e.g. the same optimizer)"
    )


def _load_target(leaf: Any, me: int):
    """``(object handed to DCP or None, finish(obj) -> result leaf)``."""
    if isinstance(leaf, (ShardedArray, BaseLayout)):
        layout = leaf.layout if isinstance(leaf, ShardedArray) else leaf
        if layout.mesh.is_abstract:
            raise ValueError(
                f"load: like has a layout on an abstract mesh ({layout!r}); use Mesh.create"
            )
        final = layout
        if layout.partial:
            layout = layout.with_spec(_unreduced(layout.spec))
        device = layout.mesh.device()
        boxes = rank_boxes(layout, me)  # one, or one per part (read apart, joined after)
        pieces = [torch.empty(m.shard_sizes, dtype=layout.dtype, device=device) for m in boxes]

        def finish(_obj, pieces=pieces, layout=layout, final=final):
            local = pieces[0] if len(pieces) == 1 else torch.cat(pieces, layout.dim)
            out = ShardedArray._raw(local, layout)
            if final is not layout:
                out = reshard_one(out, final.spec)
            return out

        if math.prod(layout.shape) == 0:
            return None, finish
        if _fully_replicated(layout):
            return pieces[0], finish
        held = pieces if any(m.numel for m in boxes) else None
        st = _sharded_tensor(layout, held, me, prefer_me=True)
        return st, finish
    if isinstance(leaf, torch.Tensor):
        t = torch.empty_like(leaf)
        return t, lambda _obj, t=t: t
    raise AssertionError("Python values come from fshard.json")


def load(path: str | os.PathLike, like: Any, *, strict: bool = False) -> Any:
    """Load a checkpoint written by :func:`save` into the structure and layouts of ``like``.

    Collective: every rank calls it with a ``like`` of the same structure. The mesh, world
    size and specs may differ from the ones used at save time (uneven and explicit layouts
    included): each rank reads only the saved chunks that overlap its own block.

    Args:
        path: the checkpoint directory.
        like: a pytree with the same keys as the saved one (a subset is fine unless
            ``strict``). Leaves: :class:`ShardedArray` or :class:`Layout` (the target layout;
            values are ignored), ``torch.Tensor`` (target shape, dtype, device), or any Python
            value (replaced by the saved value).
        strict: also refuse a checkpoint with keys ``like`` lacks (as
            ``torch.nn.Module.load_state_dict(strict=True)``): the error names them, e.g. the
            layers a smaller model would silently leave unloaded.

    Returns:
        A new pytree of ``like``'s structure holding the saved values; ``like`` is not
        modified.

    Raises:
        CheckpointError: on every rank, before any data is read, when the checkpoint is
            missing, not written by :func:`save`, its metadata is unreadable or refers to a
            type outside DCP's metadata classes, a key is missing, a shape or dtype differs,
            a tensor is saved where ``like`` has a Python value (or the reverse), ``strict``
            and the checkpoint has keys ``like`` lacks, a saved
            Python value is not of an allowed type, or a data file is missing, truncated or
            fails its checksum; and when DCP fails to read the data on some rank.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.gettempdir(), f"fshard-example-{os.getppid()}")  # one for all ranks
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> fs.checkpoint.save(path, {"w": fs.shard(torch.arange(6.0), mesh, fs.P("x")), "step": 100})
        >>> like = {"w": fs.zeros((6,), mesh, fs.P()), "step": 0}  # another layout: replicated
        >>> state = fs.checkpoint.load(path, like)
        >>> state["w"].spec, fs.gather(state["w"]), state["step"]
        (P(), tensor([0., 1., 2., 3., 4., 5.]), 100)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = _check_path(path, "load")
    if not isinstance(strict, bool):
        raise TypeError(f"load: strict must be a bool, got {type(strict).__name__}")
    keys, leaves, treedef = _flatten(like, "load")
    _wait_pending()
    _note_world()
    consistency.check_equal({"checkpoint path": path}, what="checkpoint load")
    me = _rank()
    error = None
    if me == 0:
        try:
            lock = _lock(path)  # a save that is renaming right now restores it itself
        except (_Busy, OSError):
            pass
        else:
            try:
                _recover(path)
            except OSError as e:
                error = f"checkpoint load: cannot restore {_aside(path, 'old')!r}: {e}"
            finally:
                _unlock(path, lock)
    error = _agree(error)
    md = values = None
    if error is None:
        _barrier()
        try:
            error, md, values = _validate(path, keys, leaves, paths(treedef), me, _world())
            if error is None and strict:
                error = _left_over(path, keys, md, values)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # never let one rank leave early: report it to all
            error = f"checkpoint {path!r}: validation failed ({type(e).__name__}: {e})"
        error = _agree(error)
    if error:
        raise CheckpointError(error)
    state, finishers = {}, []
    for key, leaf in zip(keys, leaves):
        if key in values:
            finishers.append((key, lambda _obj, v=values[key]: v))
            continue
        obj, finish = _load_target(leaf, me)
        if obj is not None:
            state[key] = obj
        finishers.append((key, finish))
    if state:
        try:
            with _quiet(), _single_process_quiet():
                dcp.load(state, storage_reader=_reader(path, md), no_dist=not _is_dist())
        except (Exception, CheckpointException) as e:  # DCP reports any rank's failure to all
            raise CheckpointError(
                f"checkpoint {path!r}: reading the data failed: {_dcp_failure(e)}"
            ) from None
    out = [finish(state.get(key)) for key, finish in finishers]
    return optree.tree_unflatten(treedef, out)
