"""Hugging Face safetensors directories, written and read sharded: ``save(path, params)`` /
``load(path, like)``.

``save`` writes ``{name: ShardedArray | Tensor}`` (e.g. ``fs.nn.shard_params``'s dict, which
uses the module's parameter names) as the directory ``save_pretrained`` writes:
``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes each and
``model.safetensors.index.json`` (its ``weight_map``), plus ``config.json`` when a ``config``
is given; ``transformers``' ``from_pretrained`` loads it unchanged. ``load`` reads such a
directory (or a single ``model.safetensors``) into the layouts of ``like``, any plan's.

Reading needs the ``safetensors`` package (``transformers`` brings it; fshard's ``[hf]`` extra);
writing needs nothing beyond torch.

How (decisions):

- **Writing, each rank its own blocks:** the file plan (which parameter in which file, at which
  byte offset) follows from the names, shapes and dtypes alone, so every rank computes it
  without communication. Each file's owner rank writes its header and sizes it; then every
  rank writes the distinct blocks it owns (a replicated block once, by its first holder, as
  :mod:`fshard.checkpoint`) straight to their place with ``pwrite`` (one write per contiguous
  run: one for a row block, one per row for a column block). No rank holds more than its
  blocks. DCP's ``HuggingFaceStorageWriter`` is not used: with ``save_distributed`` it writes
  per-rank files keyed by parameter name, so a rank holding two blocks of one parameter (an
  :class:`fshard.Parts` layout) keeps only one, and its consolidation writes every byte twice
  and holds whole tensors in memory.
- **Reading, each rank its slices:** DCP's ``HuggingFaceStorageReader`` with DCP's resharding
  planner: each rank asks for the boxes of its block and reads them through ``safe_open(...)
  .get_slice``, a memory map (only the pages of its slices are read). fshard hands it the
  metadata it built from the validated index and headers (the reader's own scan opens every
  ``.safetensors`` file of the directory).
- **Tied weights:** a value given under several names (``fs.nn.state_dict`` lists the head and
  the embedding it is tied to) is written once, under its first name, as ``save_pretrained``
  does; ``fs.nn.shard_params`` already lists a tied parameter once. Loading into such a ``like``
  (one ShardedArray or tensor under several names, one of them in the files) reads it once and
  returns it under every name.
- **Partial values** are reduced first (one all_reduce), as in :func:`fshard.checkpoint.save`.
- **Atomic, one save at a time, nothing overwritten:** the files are written into a temporary
  directory beside ``path`` and renamed into place (:mod:`fshard.checkpoint`'s lock and
  commit): a save that dies leaves the previous directory intact. An existing ``path`` is
  replaced only if it is empty or a Hugging Face checkpoint directory (it holds
  ``model.safetensors.index.json`` or ``model.safetensors``); files saved there by other tools
  (a tokenizer) are not kept: write them after the export.
- **Bad input, before any data is read:** every rank checks the index (present, parseable), every
  file it needs (present, a valid safetensors header, as long as its header says: a file cut
  by an interrupted write is caught) and every parameter of ``like`` (in the index, in the
  file the index names, the same dtype and shape); the errors, each naming the file and the
  parameter, are agreed on by all ranks and raised on every rank as
  :class:`fshard.checkpoint.CheckpointError` before anything is loaded.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.gettempdir(), f"fshard-hf-example-{os.getppid()}")  # one for all ranks
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> params = {"lm.weight": fs.shard(torch.arange(8.0).reshape(4, 2), mesh, fs.P("x"))}
    >>> fs.hf_checkpoint.save(path, params)
    >>> sorted(os.listdir(path))
    ['model-00001-of-00001.safetensors', 'model.safetensors.index.json']
    >>> out = fs.hf_checkpoint.load(path, {"lm.weight": fs.Layout(mesh, fs.P(None, "x"), (4, 2))})
    >>> fs.gather(out["lm.weight"])[:, 1]
    tensor([1., 3., 5., 7.])
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import consistency
from .array import ShardedArray
from .checkpoint import (
    CheckpointError,
    _agree,
    _barrier,
    _Busy,
    _check_path,
    _cleanup,
    _commit,
    _dcp_failure,
    _fsync_dir,
    _hook,
    _is_dist,
    _load_target,
    _lock,
    _prepare,
    _rank,
    _recover,
    _saveable_local,
    _share,
    _single_process_quiet,
    _unlock,
    _wait_pending,
)
from .interop import _distinct_boxes, _quiet, local_pieces, rank_boxes
from .spec import BaseLayout

__all__ = ["save", "load"]

#: The index ``save_pretrained`` writes for a checkpoint of several files.
INDEX = "model.safetensors.index.json"
#: The file ``save_pretrained`` writes for a checkpoint of one file (no index).
SINGLE = "model.safetensors"
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_CODE = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100_000_000  # safetensors' own limit


# -- the file plan -----------------------------------------------------------------------------


def _file_plan(
    entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int
) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Parameters grouped into files in order, each file at most ``max_shard_size`` bytes of
    data (a larger parameter gets a file of its own), as ``save_pretrained`` splits them."""
    files: list[list] = [[]]
    size = 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * dtype.itemsize
        if files[-1] and size + n > max_shard_size:
            files.append([])
            size = 0
        files[-1].append((name, shape, dtype))
        size += n
    return files


def _header(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict]:
    """The safetensors header of one file (length prefix and JSON, padded to 8 bytes) and
    ``{name: byte offset of its data in the file}``."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * dtype.itemsize
        meta[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {name: len(head) + meta[name]["data_offsets"][0] for name, _, _ in entries}


def _runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]):
    """``(element offset in the row-major whole, element offset in the block, length)`` of each
    contiguous run of a block at ``offsets`` of ``sizes`` in a tensor of ``shape``."""
    nd = len(shape)
    j = nd  # dims j.. of the block span the whole tensor after its first partial dim
    while j > 0 and sizes[j - 1] == shape[j - 1]:
        j -= 1
    j = max(j - 1, 0)
    stride = [math.prod(shape[d + 1 :]) for d in range(nd)]
    length = math.prod(sizes[j:]) if nd else 1
    outer = sizes[:j]
    for k in range(math.prod(outer)):
        idx, rest = [], k
        for s in reversed(outer):
            idx.append(rest % s)
            rest //= s
        idx.reverse()
        start = sum((offsets[d] + idx[d]) * stride[d] for d in range(j))
        if nd:
            start += offsets[j] * stride[j]
        yield start, k * length, length


def _write_block(fd: int, at: int, shape, offsets, sizes, piece: torch.Tensor) -> None:
    data = memoryview(piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    item = piece.element_size()
    for whole, mine, n in _runs(tuple(shape), tuple(offsets), tuple(sizes)):
        chunk = data[mine * item : (mine + n) * item]
        written = 0
        while written < len(chunk):
            written += os.pwrite(fd, chunk[written:], at + whole * item + written)


# -- save --------------------------------------------------------------------------------------


def save(
    path: str | os.PathLike,
    params: Mapping[str, Any],
    *,
    max_shard_size: int = 5 * 10**9,
    config: Any = None,
) -> None:
    """Write sharded parameters as a Hugging Face safetensors directory, each rank its blocks.

    Collective: every rank calls it with the same names, shapes, dtypes and layouts. No rank
    gathers a parameter: each writes the distinct blocks it holds into the files.

    Args:
        path: the directory (created; an existing Hugging Face checkpoint directory there is
            replaced atomically once the new one is complete; any other non-empty directory
            is refused).
        params: ``{name: ShardedArray | Tensor}`` under the model's parameter names (e.g.
            ``fs.nn.shard_params``'s dict, or ``fs.nn.state_dict``'s: a value given under
            several names, a tied weight, is written once under its first name).
        max_shard_size: at most this many bytes of tensor data per file (a larger parameter
            gets a file of its own); ``save_pretrained``'s default, 5 GB.
        config: written as ``config.json`` by rank 0 when given: an object with
            ``to_json_file(path)`` (a ``transformers`` ``PretrainedConfig``) or a dict.

    Returns:
        None.

    Raises:
        TypeError: ``params`` is not a mapping of names to tensors / ShardedArrays, a dtype
            safetensors cannot hold, or ``max_shard_size`` not a positive int.
        CheckpointError: on every rank: ``path`` is not a directory it may replace, another
            save to it is running, or writing failed on some rank.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.gettempdir(), f"fshard-hf-example-{os.getppid()}")  # one for all ranks
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> w = fs.shard(torch.ones(4, 2), mesh, fs.P("x"))
        >>> fs.hf_checkpoint.save(path, {"a.weight": w, "b.weight": w * 2}, max_shard_size=32)
        >>> json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
        {'a.weight': 'model-00001-of-00002.safetensors', 'b.weight': 'model-00002-of-00002.safetensors'}
    """
    path = _check_path(path, "hf_checkpoint.save")
    if not isinstance(params, Mapping):
        raise TypeError(
            f"hf_checkpoint.save: params must be a mapping name -> ShardedArray | Tensor, got "
            f"{type(params).__name__}"
        )
    if (
        isinstance(max_shard_size, bool)
        or not isinstance(max_shard_size, int)
        or max_shard_size < 1
    ):
        raise TypeError(
            f"hf_checkpoint.save: max_shard_size must be a positive int, got {max_shard_size!r}"
        )
    seen: dict[int, str] = {}
    named: dict[str, Any] = {}
    for name, value in params.items():
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"hf_checkpoint.save: parameter names must be non-empty str, got {name!r}"
            )
        if not isinstance(value, (ShardedArray, torch.Tensor)):
            raise TypeError(
                f"hf_checkpoint.save: params[{name!r}] is a {type(value).__name__}; expected a "
                "ShardedArray or a torch.Tensor"
            )
        if value.dtype not in _DTYPES:
            raise TypeError(
                f"hf_checkpoint.save: params[{name!r}] has dtype {value.dtype}, which safetensors "
                f"cannot hold; accepted: {', '.join(str(d) for d in _DTYPES)}"
            )
        if id(value) in seen:  # a tied weight: written once, under its first name
            continue
        seen[id(value)] = name
        named[name] = value
    _wait_pending()
    consistency.check_equal(
        {"checkpoint path": path, "names": list(named), "max_shard_size": max_shard_size},
        what="hf_checkpoint.save: path, names",
    )
    me, world = _rank(), (dist.get_world_size() if _is_dist() else 1)
    tensors = {name: _saveable_local(name, value) for name, value in named.items()}
    files = _file_plan([(n, tuple(v.shape), v.dtype) for n, v in named.items()], max_shard_size)
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    lock, tmp, error = None, None, None
    try:
        if me == 0:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                lock = _lock(path)
                tmp = _prepare(path, (INDEX, SINGLE))
                os.makedirs(tmp)
            except _Busy as e:
                error = (
                    f"hf_checkpoint.save: another save to {path!r} is in progress ({e}); this "
                    "one was refused and changed nothing"
                )
            except CheckpointError as e:
                error = str(e).replace("checkpoint save:", "hf_checkpoint.save:", 1)
            except OSError as e:
                error = f"hf_checkpoint.save: cannot prepare the save to {path!r}: {e}"
        error, tmp = _share((_agree(error), tmp))
        if error:
            raise CheckpointError(error)
        error = None
        where: dict[str, tuple[str, int]] = {}
        try:
            for i, (entries, fname) in enumerate(zip(files, names)):
                head, starts = _header(entries)
                for n in starts:
                    where[n] = (fname, starts[n])
                if i % world == me:
                    end = len(head) + sum(math.prod(s) * d.itemsize for _, s, d in entries)
                    with open(os.path.join(tmp, fname), "wb") as f:
                        f.write(head)
                        f.truncate(end)
        except OSError as e:
            error = f"hf_checkpoint.save: creating the files in {tmp!r} failed: {e}"
        error = _agree(error)
        if error is None:
            _hook("start")
            try:
                _write_blocks(tmp, where, tensors, me)
            except OSError as e:
                error = f"hf_checkpoint.save: writing this rank's blocks to {tmp!r} failed: {e}"
        _hook("written")
        error = _agree(error)
        if me == 0 and error is None:
            try:
                total = sum(math.prod(v.shape) * v.dtype.itemsize for v in named.values())
                index = {
                    "metadata": {"total_size": total},
                    "weight_map": {n: where[n][0] for n in named},
                }
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump(index, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
                if config is not None:
                    _write_config(config, os.path.join(tmp, "config.json"))
                _fsync_dir(tmp)
                _commit(tmp, path)
            except (OSError, TypeError, ValueError) as e:
                error = f"hf_checkpoint.save: committing {tmp!r} to {path!r} failed: {e}"
        error = _agree(error)
        if error:
            raise CheckpointError(error)
    finally:
        _cleanup(path, me, tmp, lock)


def _write_blocks(tmp: str, where: dict, tensors: dict, me: int) -> None:
    """This rank's distinct blocks into their files (then fsync'd)."""
    fds: dict[str, int] = {}
    try:
        for name, (layout, local) in tensors.items():
            fname, at = where[name]
            if layout is None:  # a plain tensor: rank 0's copy
                blocks = [((0,) * local.dim(), tuple(local.shape), local)] if me == 0 else []
            else:
                pieces = local_pieces(layout, local)
                mine = {
                    (m.shard_offsets, m.shard_sizes): p
                    for m, p in zip(rank_boxes(layout, me), pieces)
                }
                blocks = [
                    (off, size, mine[(off, size)])
                    for owner, off, size in _distinct_boxes(layout)
                    if owner == me
                ]
            for offsets, sizes, piece in blocks:
                if fname not in fds:
                    fds[fname] = os.open(os.path.join(tmp, fname), os.O_WRONLY)
                _write_block(
                    fds[fname],
                    at,
                    tuple(local.shape if layout is None else layout.shape),
                    offsets,
                    sizes,
                    piece,
                )
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _write_config(config: Any, full: str) -> None:
    if isinstance(config, Mapping):
        with open(full, "w") as f:
            json.dump(dict(config), f, indent=2, sort_keys=True)
    elif callable(getattr(config, "to_json_file", None)):
        config.to_json_file(full)
    else:
        raise TypeError(
            f"config must be a dict or have to_json_file (a transformers PretrainedConfig), got "
            f"{type(config).__name__}"
        )


# -- load --------------------------------------------------------------------------------------


def _read_header(full: str) -> tuple[dict, int]:
    """A safetensors file's header and the byte offset of its data; ValueError when it is not
    one."""
    with open(full, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError("it is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER:
            raise ValueError(f"its header length {n} is not plausible (not a safetensors file)")
        text = f.read(n)
    if len(text) < n:
        raise ValueError("it ends inside its header")
    header = json.loads(text)
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header, 8 + n


def _validate(path: str, like: dict) -> tuple[list[str], dict, dict]:
    """Problems (each naming the file and the parameter), ``{name: (file, shape, dtype)}`` and
    ``{tied name: the name it is read under}``."""
    problems: list[str] = []
    if not os.path.isdir(path):
        return [f"hf_checkpoint.load: {path!r} does not exist or is not a directory"], {}, {}
    index_file = os.path.join(path, INDEX)
    if os.path.isfile(index_file):
        try:
            with open(index_file, "rb") as f:
                weight_map = json.loads(f.read())["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise ValueError("weight_map must map names to file names")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            return (
                [f"hf_checkpoint.load: {INDEX} in {path!r} is corrupted ({type(e).__name__}: {e})"],
                {},
                {},
            )
        index_name = INDEX
    elif os.path.isfile(os.path.join(path, SINGLE)):
        try:
            header, _ = _read_header(os.path.join(path, SINGLE))
        except (OSError, ValueError) as e:
            return [f"hf_checkpoint.load: file {SINGLE!r} in {path!r}: {e}"], {}, {}
        weight_map = {k: SINGLE for k in header if k != "__metadata__"}
        index_name = SINGLE
    else:
        return (
            [
                f"hf_checkpoint.load: {path!r} holds neither {INDEX} nor {SINGLE}: not a Hugging "
                "Face safetensors checkpoint"
            ],
            {},
            {},
        )
    headers: dict[str, tuple[dict, int] | str] = {}
    found: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    names_of: dict[int, list[str]] = {}  # one value under several names: a tied weight
    for name, leaf in like.items():
        if isinstance(leaf, (ShardedArray, torch.Tensor)):
            names_of.setdefault(id(leaf), []).append(name)
    tied = {
        name: next(n for n in names if n in weight_map)
        for names in names_of.values()
        if any(n in weight_map for n in names)
        for name in names
        if name not in weight_map
    }
    for name, leaf in like.items():
        fname = weight_map.get(name)
        if name in tied:
            continue
        if fname is None:
            problems.append(f"parameter {name!r} is missing from {index_name}")
            continue
        if os.path.basename(fname) != fname or fname in ("", ".", ".."):
            problems.append(
                f"parameter {name!r}: {index_name} names the file {fname!r}, not a file of the directory"
            )
            continue
        if fname not in headers:
            full = os.path.join(path, fname)
            if not os.path.isfile(full):
                headers[fname] = "is missing"
            else:
                try:
                    header, start = _read_header(full)
                    end = max(
                        (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                        default=0,
                    )
                    size = os.path.getsize(full)
                    headers[fname] = (
                        (header, start)
                        if size >= start + end
                        else f"is truncated ({size} bytes, its header needs {start + end}: an interrupted write?)"
                    )
                except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
                    headers[fname] = f"is not a valid safetensors file ({type(e).__name__}: {e})"
        got = headers[fname]
        if isinstance(got, str):
            problems.append(f"parameter {name!r}: file {fname!r} {got}")
            continue
        entry = got[0].get(name)
        if not isinstance(entry, dict):
            problems.append(
                f"parameter {name!r}: {index_name} names file {fname!r}, which does not hold it"
            )
            continue
        shape, dtype = tuple(entry.get("shape", ())), _FROM_CODE.get(entry.get("dtype"))
        want = _want(leaf)
        if (shape, dtype) != want:
            problems.append(
                f"parameter {name!r} in file {fname!r}: shape {shape} dtype "
                f"{dtype or entry.get('dtype')}, but the plan expects shape {want[0]} dtype {want[1]}"
            )
            continue
        found[name] = (fname, shape, dtype)
    return problems, found, tied


def _want(leaf: Any) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(leaf, (ShardedArray, BaseLayout)):
        layout = leaf.layout if isinstance(leaf, ShardedArray) else leaf
        return tuple(layout.shape), layout.dtype
    return tuple(leaf.shape), leaf.dtype


def _reader(path: str, found: dict):
    """DCP's HuggingFaceStorageReader over the validated files, metadata built from the
    headers ``found`` (one chunk per parameter, the whole tensor)."""
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    tensors, storage = {}, {}
    for name, (fname, shape, dtype) in found.items():
        zeros = torch.Size([0] * len(shape))
        tensors[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(shape))],
        )
        storage[MetadataIndex(fqn=name, offset=zeros)] = _HFStorageInfo(
            relative_path=os.path.join(path, fname), shape=torch.Size(shape), dtype=dtype
        )

    class _Reader(HuggingFaceStorageReader):
        def read_metadata(self) -> Metadata:
            return Metadata(
                state_dict_metadata=tensors,
                storage_data=storage,
                storage_meta=StorageMeta(load_id=self.load_id),
            )

    return _Reader(path)


def load(path: str | os.PathLike, like: Mapping[str, Any], *, strict: bool = False) -> dict:
    """Read a Hugging Face safetensors directory into the layouts of ``like``, each rank only
    its slices.

    Collective: every rank calls it with the same names and layouts. Reads ``save_pretrained``'s
    directories (several files and ``model.safetensors.index.json``, or one
    ``model.safetensors``) and :func:`save`'s. Nothing is loaded until every parameter is
    checked on every rank.

    Args:
        path: the directory.
        like: ``{name: ShardedArray | Layout | Tensor}``: the target layouts (e.g. of
            ``fs.nn.shard_params`` on a ``meta`` model, or ``fs.Layout`` s); values are ignored.
        strict: also refuse a checkpoint holding parameters ``like`` lacks.

    Returns:
        ``{name: ShardedArray | Tensor}`` in ``like``'s layouts.

    Raises:
        TypeError: ``like`` is not a mapping of names to ShardedArray / Layout / Tensor.
        CheckpointError: on every rank, before any data is read, naming the file and the
            parameter: the index or a file is missing or corrupted, a file is truncated, a
            parameter is missing from the index or its file, its dtype or shape differs from
            ``like``'s (or ``strict`` and the checkpoint has more); or reading failed.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.gettempdir(), f"fshard-hf-example-{os.getppid()}")  # one for all ranks
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> fs.hf_checkpoint.save(path, {"head.weight": fs.shard(torch.eye(4), mesh, fs.P())})
        >>> like = {"head.weight": fs.Layout(mesh, fs.P("tp"), (4, 4))}  # a transformers model's
        >>> out = fs.hf_checkpoint.load(path, like)  # names, any plan's layouts
        >>> out["head.weight"].spec, out["head.weight"].local.shape
        (P('tp'), torch.Size([2, 4]))
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = _check_path(path, "hf_checkpoint.load")
    if not isinstance(like, Mapping):
        raise TypeError(
            f"hf_checkpoint.load: like must be a mapping name -> layout, got {type(like).__name__}"
        )
    if not isinstance(strict, bool):
        raise TypeError(f"hf_checkpoint.load: strict must be a bool, got {type(strict).__name__}")
    for name, leaf in like.items():
        if not isinstance(leaf, (ShardedArray, BaseLayout, torch.Tensor)):
            raise TypeError(
                f"hf_checkpoint.load: like[{name!r}] is a {type(leaf).__name__}; expected a "
                "ShardedArray, a Layout or a torch.Tensor"
            )
    if importlib.util.find_spec("safetensors") is None:
        raise ImportError(
            "hf_checkpoint.load reads through DCP's HuggingFaceStorageReader, which needs the "
            "safetensors package: pip install safetensors (or fshard's [hf] extra)"
        )
    like = dict(like)
    _wait_pending()
    consistency.check_equal(
        {"checkpoint path": path, "names": list(like)}, what="hf_checkpoint.load"
    )
    me, error = _rank(), None
    if me == 0:
        try:
            lock = _lock(path)
        except (_Busy, OSError):
            pass
        else:
            try:
                _recover(path)
            finally:
                _unlock(path, lock)
    _barrier()
    try:
        problems, found, tied = _validate(path, like)
        if strict and not problems:
            problems += _left_over(path, like)
    except Exception as e:  # never let one rank leave early: report it to all
        problems, found, tied = [f"validation failed ({type(e).__name__}: {e})"], {}, {}
    if problems:
        shown = "\n".join(problems[:20]) + (
            f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        error = (
            f"checkpoint {path!r}: cannot load it into `like` ({len(problems)} problems):\n{shown}"
        )
    error = _agree(error)
    if error:
        raise CheckpointError(error)
    state, finishers = {}, []
    for name, leaf in like.items():
        if name in tied:
            continue
        if isinstance(leaf, torch.Tensor):
            leaf = leaf.detach()
        obj, finish = _load_target(leaf, me)
        if obj is not None:
            state[name] = obj
        finishers.append((name, finish))
    if state:
        try:
            with _quiet(), _single_process_quiet():
                dcp.load(state, storage_reader=_reader(path, found), no_dist=not _is_dist())
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {path!r}: reading the data failed: {_dcp_failure(e)}"
            ) from None
    out = {name: finish(state.get(name)) for name, finish in finishers}
    return {name: out[tied.get(name, name)] for name in like}


def _left_over(path: str, like: dict) -> list[str]:
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, "rb") as f:
            names = set(json.loads(f.read())["weight_map"])
    else:
        names = {k for k in _read_header(os.path.join(path, SINGLE))[0] if k != "__metadata__"}
    extra = sorted(names - set(like))
    if not extra:
        return []
    return [
        f"load(strict=True): the checkpoint has {len(extra)} parameters `like` lacks: "
        + ", ".join(repr(n) for n in extra[:12])
        + (", ..." if len(extra) > 12 else "")
    ]
