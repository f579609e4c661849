"""Consistency mode: ranks that disagree get one clear error, before any data moves.

The most common SPMD bug is ranks that disagree: a different global shape or spec in
``from_local``, ``psum`` on one rank and ``pmax`` on another, a collective skipped on one rank,
float32 against int32, per-rank seeds before a replicated ``fs.randn``. Collectives do not notice
(Gloo pairs whatever arrives, reinterprets bits, or aborts the process). With consistency mode on
(``fs.config.check_consistency = True``, the ``fs.config.consistency()`` context manager, or the
environment variable ``FSHARD_CHECK_CONSISTENCY=1``, which spawned workers inherit), the ranks
of a group exchange one fixed-size digest before each data collective:

    what is hashed                                         where
    op, mesh axes, dtype, the shapes every rank must       before every collective in
    share (global chunk sizes, dims), the number of        fshard._comm (psum, all_gather, ...)
    collectives this rank has issued on the group
    mesh, spec, global shape, dtype                        from_local, shard, creation functions
    + the generator state (rand/randn), fill value,        shard_map (in/out specs and
      a value fingerprint (shard of a full tensor)         input layouts, once per call)
    any Python value                                       :func:`check_equal` (e.g. checkpoints)

The digest is a 62-bit BLAKE2 hash plus the sequence number: four int64 words in one
``all_reduce(MAX)`` (of ``h, -h, seq, -seq``: every rank learns whether all agree). On a
mismatch, and only then, the ranks exchange readable descriptions and every rank raises the same
:class:`ConsistencyError` naming each rank's view and the fields that differ. The exchange is a
fixed-size int64 message, so it cannot itself be corrupted by the disagreement it detects.

Cost: one small all_reduce per collective (see ``benchmarks/consistency.py``). It is on in
fshard's test suite and opt-in otherwise. It cannot turn a rank that never reaches the next
collective into an error: the others wait for it until the process group's timeout.

Example:
    >>> import fshard as fs
    >>> with fs.config.consistency():  # doctest: +SKIP
    ...     y = fs.lax.psum(x, "x", mesh=mesh)  # raises ConsistencyError if ranks disagree
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import config
from .mesh import AxisGroup, Mesh

__all__ = ["ConsistencyError", "enabled", "check_collective", "check_equal", "reset"]

_MASK = (1 << 62) - 1
_SEQ: dict = {}  # process group -> checked exchanges issued on it by this rank


class ConsistencyError(RuntimeError):
    """The ranks of a group disagreed about a collective or a value (raised on every rank)."""


def enabled() -> bool:
    """Whether consistency mode is on in this context (see :mod:`fshard.config`). Graph
    tracing (``torch.compile``, ``make_fx``) runs no checks: they would be traced, not run."""
    return (
        not torch.compiler.is_compiling()  # first: dynamo cannot trace the ContextVar read
        and config.consistency_checked()
        and get_proxy_mode() is None
    )


def reset() -> None:
    """Forget the per-group sequence numbers (e.g. after a run aborted by a timeout)."""
    _SEQ.clear()


def _canonical(obj):
    """A deterministic, repr-able stand-in for ``obj`` (tensors by dtype, shape and bytes)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), _content_hash(obj))
    if isinstance(obj, Mapping):
        return ("dict", tuple((repr(k), _canonical(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_canonical(v) for v in obj))
    if isinstance(obj, torch.Generator):
        return ("generator", _canonical(obj.get_state()))
    return obj


def _content_hash(t: torch.Tensor) -> str:
    """A hash of the bytes of ``t`` (the physical tensor under any torch.func wrappers)."""
    with torch._C._DisableFuncTorch():
        while torch._C._functorch.is_functorch_wrapped_tensor(t):
            t = torch._C._functorch.get_unwrapped(t)
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() and t.element_size() else t
        return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


def _show(v) -> str:
    if isinstance(v, torch.Tensor):
        _, dtype, shape, data = _canonical(v)
        return f"tensor({dtype}, shape {shape}, content hash {data})"
    if isinstance(v, torch.Generator):
        return f"generator(state hash {_canonical(v)[1][3]})"
    return repr(v)


def _hash(fields: tuple) -> int:
    text = repr(_canonical(fields)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK


def _world_group() -> AxisGroup:
    n, me = dist.get_world_size(), dist.get_rank()
    ranks = tuple(range(n))
    return AxisGroup(("<world>",), dist.group.WORLD, n, me, ranks, ranks)


def _device(group: AxisGroup) -> torch.device:
    if dist.get_backend(group.pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(g: AxisGroup, what: str, fields: dict, device: torch.device | None = None) -> None:
    """Raise :class:`ConsistencyError` on every rank of ``g`` unless all hold equal ``fields``."""
    seq = _SEQ.get(g.pg, 0)
    _SEQ[g.pg] = seq + 1
    h = _hash(tuple(fields.items()))
    words = torch.tensor([h, -h, seq, -seq], dtype=torch.int64, device=device or _device(g))
    dist.all_reduce(words, dist.ReduceOp.MAX, group=g.pg)
    top = words.tolist()
    if top[0] == -top[1] and top[2] == -top[3]:
        return
    mine = {**{k: _show(v) for k, v in fields.items()}, "sequence number": seq}
    views: list = [None] * g.size
    dist.all_gather_object(views, (dist.get_rank(), mine), group=g.pg)
    raise ConsistencyError(_message(what, g, views))


def _message(what: str, g: AxisGroup, views: list) -> str:
    views = sorted(views)
    keys = list(dict.fromkeys(k for _, v in views for k in v))
    differ = [k for k in keys if len({v.get(k, "<missing>") for _, v in views}) > 1]
    lines = [
        f"fshard consistency check failed before {what}: the {len(views)} ranks of the group "
        f"(global ranks {[r for r, _ in views]}) disagree on {', '.join(differ)}."
    ]
    for k in differ:
        per = "; ".join(f"rank {r}: {v.get(k, '<missing>')}" for r, v in views)
        lines.append(f"  {k}: {per}")
    lines.append(
        "Every rank must issue the same collectives, in the same order, on values with the same "
        "layout, global shape and dtype (and replicated inputs must be equal). Look for a branch "
        "on the rank, a per-rank seed or shape, or a collective one rank skips. (Raised on every "
        "rank by fs.config.check_consistency; no data collective ran.)"
    )
    return "\n".join(lines)


def check_collective(op: str, g: AxisGroup, t: torch.Tensor, **fields) -> None:
    """Before data collective ``op`` on ``g``: check every rank issues the same one.

    ``fields`` are what must agree across the group besides ``op``, the axes and ``t``'s dtype
    (e.g. the shape every rank passes, the global chunk sizes). No-op unless :func:`enabled`.
    """
    if g.size == 1 or not enabled():
        return
    described = {"collective": op, "mesh axes": g.axes, "dtype": t.dtype, **fields}
    _agree(g, f"a collective over mesh axes {g.axes}", described, t.device)


def check_equal(obj, group: Mesh | AxisGroup | None = None, *, what: str) -> None:
    """Raise :class:`ConsistencyError` on every rank unless ``obj`` is equal on all of them.

    Runs only when consistency mode is on (:func:`enabled`); costs one small all_reduce.

    Args:
        obj: any value made of Python scalars, strings, tuples, lists, dicts, tensors (compared
            by dtype, shape and bytes), dtypes, specs, layouts.
        group: a :class:`~fshard.Mesh` (all its ranks), an :class:`~fshard.mesh.AxisGroup`, or
            ``None`` for the whole default process group.
        what: names the value in the error, e.g. ``"checkpoint Python values"``.

    Example:
        >>> consistency.check_equal({"step": step}, mesh, what="train state")  # doctest: +SKIP
    """
    if not enabled() or not dist.is_initialized():
        return
    if isinstance(group, Mesh):
        group = group.group(group.axis_names)
    elif group is None:
        group = _world_group()
    elif not isinstance(group, AxisGroup):
        raise TypeError(
            f"check_equal: group must be a fshard.Mesh, an AxisGroup or None, got "
            f"{type(group).__name__}"
        )
    if group.size == 1:
        return
    fields = obj if isinstance(obj, dict) else {"value": obj}
    _agree(group, what, dict(fields))


def rng_state(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The state ``torch.rand*`` will draw from: ``generator``'s, else the device default's."""
    if generator is not None:
        return generator.get_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()
