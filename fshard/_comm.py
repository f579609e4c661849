"""Raw collectives on plain (never batched) local tensors over an :class:`AxisGroup`.

One implementation per primitive; every call that communicates is recorded in the active
``fs.debug.comm_log()`` as ``(op, axes, nbytes)`` with ``nbytes`` this rank's input bytes.
Chunks are in *chunk order* (mixed radix over the axes); torch's group ranks are sorted global
ranks, so a reversed axis tuple is reordered here. Uneven chunks are padded to the largest chunk
for the wire and trimmed after (Gloo wants equal sizes), which costs at most one chunk of
padding per peer.

How each collective goes on the wire depends on the backend: :data:`LOWERINGS` is the table
(the measurements behind the Gloo choices are in docs/INTERNALS.md, "Lowering"). While a graph is
being traced (``torch.compile``, ``make_fx``, export) every collective is issued through
``torch.distributed._functional_collectives`` instead, whose ops return tensors and record their
waits in the graph, so a traced step replays exactly; ``comm_log`` records eager calls only.

A simulated group (``g.simulated``: a :class:`~fshard.mesh.SimulatedGroup`, from
``Mesh.simulate``, what ``fs.dry_run`` runs on) has no processes behind it: each primitive
checks, records and lowers exactly as for a real group, and where torch.distributed would be
called it makes the received buffer with the right shape instead (``meta`` tensors: no data),
so a dry run's comm log is the real run's and its temporaries are the lowering's.

This is the only module that puts data on the wire (``tests/test_comm.py`` scans the package):
besides the primitives of ``fshard.lax``, FSDP's prefetching gather (:func:`all_gather_start`,
whose :class:`Pending` result does the chunk-order fix-up at ``wait``), shard_map's
:func:`size_exchange` and ``fs.shard(src=)``'s :func:`agree_meta` live here, so the
lowering, the wire and consistency checks and the comm log each have one place.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _compat
from . import mesh as _mesh
from .consistency import check_collective as _consistent
from .mesh import AxisGroup


@dataclass(frozen=True)
class CommRecord:
    """One collective as issued: ``op``, mesh ``axes``, ``nbytes`` of this rank's input.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> with fs.debug.comm_log() as log:
        ...     total = fs.lax.psum(torch.ones(3), "x", mesh=mesh)
        >>> log[0]
        CommRecord(op='all_reduce', axes=('x',), nbytes=12)
    """

    op: str
    axes: tuple[str, ...]
    nbytes: int


_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("fshard_comm_log", default=None)


# -- what each backend accepts on the wire (checked before every call) ------------------------
#
# Kept apart from the collectives below: one table and one function, called first thing by each
# collective that communicates, so every refusal happens locally, before any rank enters the
# call (a refusal on one rank, or an abort inside the backend, would leave the others waiting).
#
# Sources (torch 2.11-2.13): NCCL's dtype map is ``c10d::ncclDataType`` in
# torch/csrc/distributed/c10d/NCCLUtils.hpp (bool travels as uint8; float8 as NCCL's float8
# types or uint8) and its reductions refuse float8 ("Float8 dtypes are not currently supported
# for NCCL reductions", ProcessGroupNCCL::allreduce / _reduce_scatter_base) unless NCCL has
# float8 types (2.24+, ``fshard._compat.nccl_reduces_float8``; seen on torch 2.11 + NCCL 2.28). Gloo's is
# ``GENERATE_ALL_TYPES`` in ProcessGroupGlooDetail.hpp; Gloo's send/recv move raw bytes (any
# dtype) from a host pointer, so a CUDA tensor aborts the process (``gloo::IoException ...
# writev ... Bad address``): fshard stages point-to-point traffic through host memory instead.
# Complex tensors travel as their real view (torch.view_as_real) in torch's Python wrappers of
# all_reduce, all_gather, all_to_all, broadcast, scatter and send/recv, but not of gather (every
# backend) nor reduce_scatter (NCCL); max/min have no meaning for complex values.

_COMMON_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
_FLOAT8 = frozenset(
    getattr(torch, n)
    for n in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
#: float8 types NCCL 2.24+ reduces natively (the fnuz ones travel as uint8: never reduced)
_FLOAT8_NATIVE = frozenset(
    getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn") if hasattr(torch, n)
)
#: dtypes each backend's collectives accept (complex dtypes: see :data:`_COMPLEX_REFUSED`).
WIRE_DTYPES: dict[str, frozenset] = {
    "nccl": _COMMON_DTYPES | _FLOAT8,
    "gloo": _COMMON_DTYPES,
}
#: ops whose torch wrapper does not view complex tensors as real, per backend
_COMPLEX_REFUSED = {"nccl": frozenset({"gather", "reduce_scatter"}), "gloo": frozenset({"gather"})}
#: ops that move bytes without looking at the dtype, per backend (Gloo's send/recv)
_ANY_DTYPE = {"gloo": frozenset({"ppermute"})}
#: the devices each backend's collectives take tensors on
WIRE_DEVICE_TYPES = {"nccl": ("cuda",), "gloo": ("cpu", "cuda")}
#: ops that reduce (their float8 and complex limits differ from data movement)
_REDUCING = frozenset({"all_reduce", "reduce_scatter"})


def _names(dtypes) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def check_wire(
    tensor: torch.Tensor,
    backend: str | None,
    device: torch.device | None = None,
    *,
    op: str = "collective",
    reduce: str | None = None,
    name: str = "the local tensor",
) -> None:
    """Refuse, before the call, a tensor that ``backend`` cannot send in collective ``op``.

    A pure function of its arguments (no process group needed), called by every collective of
    this module first thing when it communicates.

    Args:
        tensor: what would go on the wire (its dtype and device are read, never its data, so a
            ``meta`` or fake tensor works).
        backend: ``dist.get_backend(group)``: ``"nccl"`` and ``"gloo"`` are checked; any other
            backend (or ``None``) passes.
        device: the device the backend needs for this rank. NCCL: this rank's own GPU
            (``torch.device("cuda", torch.cuda.current_device())``, which is ``mesh.device()``
            of a CUDA mesh); ``None`` checks only the device type. Unused for Gloo, which takes
            CPU and CUDA tensors (CUDA tensors go through host memory).
        op: the collective (``all_gather``, ``all_reduce``, ``reduce_scatter``, ``all_to_all``,
            ``ppermute``, ``scatter``, ``gather``, ``broadcast``), for its dtype rules and the
            message.
        reduce: the reduction of ``all_reduce`` (``"sum"``, ``"max"``, ``"min"``).
        name: how the message names ``tensor``.

    Raises:
        TypeError: a dtype the backend cannot send (NCCL and Gloo: no int16, uint16/32/64;
            Gloo: no float8; complex tensors in gather, and in reduce_scatter on NCCL), float8
            in an NCCL reduction, complex values reduced by max/min.
        ValueError: a tensor on a device the backend cannot read: NCCL needs this rank's GPU
            (not the CPU, not another GPU); Gloo needs the CPU or a GPU (not ``meta``).

    Example::

        check_wire(torch.ones(2), "gloo", op="all_gather")  # passes
        check_wire(torch.ones(2, dtype=torch.int16), "nccl", op="all_gather")  # TypeError
        check_wire(torch.ones(2), "nccl", torch.device("cuda", 0))  # ValueError: on cpu
    """
    if backend not in WIRE_DTYPES:
        return
    dtype, dev = tensor.dtype, tensor.device
    if (
        not dtype.is_complex
        and dtype in WIRE_DTYPES[backend]
        and dev.type in WIRE_DEVICE_TYPES[backend]
        and not (backend == "nccl" and (device is not None or dtype in _FLOAT8))
    ):
        return  # the common case, before the messages' words are built (every collective)
    kind = backend.upper() if backend == "nccl" else backend.capitalize()
    where = f"{op} over {kind}"
    if dtype.is_complex:
        if op in _COMPLEX_REFUSED[backend]:
            raise TypeError(
                f"{where}: {name} has dtype {dtype}; torch's {op} over {kind} has no complex "
                "type. Move the real and imaginary parts (torch.view_as_real(x), then "
                "torch.view_as_complex on the result), or a real dtype"
            )
        if op in _REDUCING and reduce in ("max", "min"):
            raise TypeError(
                f"{where}: {name} has dtype {dtype}; complex values have no order, so reduce "
                f"'{reduce}' is undefined for them. Accepted: reduce='sum', or a real dtype"
            )
    elif dtype not in WIRE_DTYPES[backend] and op not in _ANY_DTYPE.get(backend, ()):
        fix = "x.to(torch.bfloat16)" if dtype.is_floating_point else "x.to(torch.int64)"
        raise TypeError(
            f"{where}: {name} has dtype {dtype}, which {kind} cannot send. Accepted: "
            f"{_names(WIRE_DTYPES[backend])}, and complex dtypes as their real view. Convert "
            f"it first ({fix}) and back after"
        )
    if (
        backend == "nccl"
        and op in _REDUCING
        and dtype in _FLOAT8
        and not (dtype in _FLOAT8_NATIVE and _compat.nccl_reduces_float8())
    ):
        raise TypeError(
            f"{where}: {name} has dtype {dtype}; NCCL cannot reduce float8 values (it only "
            "moves them). Upcast before reducing (x.to(torch.bfloat16)) and cast back after"
        )
    accepted = WIRE_DEVICE_TYPES[backend]
    if dev.type not in accepted:
        if backend == "nccl":
            mine = device if device is not None else "this rank's GPU"
            raise ValueError(
                f"{where}: {name} is on {dev}, but NCCL moves only tensors on this rank's GPU "
                f"({mine}). Build the mesh on CUDA (fs.Mesh.create(..., device_type='cuda'), "
                "the default under NCCL) and create tensors on mesh.device(): fs.shard, "
                "fs.from_local and fs.nn.shard_params move CPU tensors there; or start the "
                "process group with Gloo for CPU tensors"
            )
        raise ValueError(
            f"{where}: {name} is on {dev}; Gloo moves tensors on the CPU or a CUDA GPU. Move "
            "it to mesh.device() first"
        )
    if backend == "nccl" and device is not None and dev != device:
        raise ValueError(
            f"{where}: {name} is on {dev}, but this rank's GPU is {device} "
            "(torch.cuda.current_device()); NCCL needs each rank's tensors on its own GPU. "
            "Move it with x.to(mesh.device()), or call torch.cuda.set_device(local_rank) "
            "before creating the mesh and the tensors"
        )


def _wire(t: torch.Tensor, g: AxisGroup, op: str, reduce: str | None = None) -> None:
    """:func:`check_wire` for a collective over ``g`` (eager calls; a compiled graph is traced
    from eager-checked code)."""
    backend = g.backend
    if backend not in WIRE_DTYPES or torch.compiler.is_compiling() or g.simulated:
        return  # a simulated group's tensors are meta: no device to check
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    check_wire(t, backend, device, op=op, reduce=reduce)


def record(op: str, axes: tuple[str, ...], nbytes: int) -> None:
    if torch.compiler.is_compiling():
        return  # a trace runs once; what it records would not be what the graph sends
    log = _LOG.get()
    if log is not None:
        log.append(CommRecord(op, axes, int(nbytes)))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _even_sizes(total: int, n: int) -> tuple[int, ...]:
    if total % n:
        raise ValueError(
            f"size {total} does not split evenly over {n} ranks; pass sizes= for uneven chunks"
        )
    return (total // n,) * n


def pad_dim0(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` with zero rows after it up to ``size`` rows on dim 0 (an uneven block padded to
    the largest for the wire; differentiable)."""
    if t.shape[0] == size:
        return t.contiguous()
    out = t.new_zeros((size, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


#: Blocks at least this large are all-gathered as one broadcast per rank on Gloo.
BROADCAST_GATHER_BYTES = int(os.environ.get("FSHARD_BROADCAST_GATHER_BYTES", 1 << 20))


@dataclass(frozen=True)
class Lowering:
    """How one backend runs the collectives that have more than one lowering.

    Attributes:
        gather_broadcast_bytes: all_gather blocks of at least this many bytes go as one
            broadcast per rank; ``None``: always the backend's own all_gather.
        reduce_scatter_via_all_to_all: reduce_scatter as an all_to_all plus a local sum,
            instead of the backend's own reduce_scatter.
    """

    gather_broadcast_bytes: int | None = None
    reduce_scatter_via_all_to_all: bool = False


NATIVE = Lowering()

#: Lowering per ``dist.get_backend(group)``; a backend not listed gets :data:`NATIVE`. Gloo's
#: all_gather and reduce_scatter are slower than the collectives replacing them here (numbers
#: in docs/INTERNALS.md, "Lowering"); NCCL's own are the fast ones.
LOWERINGS: dict[str, Lowering] = {
    "gloo": Lowering(
        gather_broadcast_bytes=BROADCAST_GATHER_BYTES, reduce_scatter_via_all_to_all=True
    ),
    "nccl": NATIVE,
}

_LOWERING_OF_PG: dict = {}  # process group -> a Lowering overriding its backend's (tests)


def lowering(g: AxisGroup) -> Lowering:
    """The :data:`LOWERINGS` entry for ``g``'s backend. Reads only: a trace that wrote a cache
    here (inside a Function's forward under torch.func.grad) fails in dynamo."""
    low = _LOWERING_OF_PG.get(g.pg)
    return low if low is not None else LOWERINGS.get(str(g.backend), NATIVE)


def tracing() -> bool:
    """Whether a graph is being traced (dynamo, make_fx, export): collectives then go through
    functional collectives, which the graph records with their waits. (The test of
    ``torch.distributed._functional_collectives._are_we_tracing``, without importing that
    module, which imports dynamo: seconds at fshard import.)"""
    if torch.compiler.is_compiling():
        return True
    c = torch._C
    return (
        c._get_dispatch_mode(c._TorchDispatchModeKey.FAKE) is not None
        or c._get_dispatch_mode(c._TorchDispatchModeKey.PROXY) is not None
        or c._dispatch_tls_is_dispatch_key_included(c.DispatchKey.PythonDispatcher)
    )


class Pending:
    """A collective launched asynchronously: :meth:`wait` waits for its ``works`` and returns
    the result (``finish(out)``, e.g. the blocks put in chunk order). Waiting twice returns the
    same tensor.

    ``sends``: the works of what this rank sent (a ppermute's ``isend`` s, on a backend that
    gives one work per message), waited by :meth:`wait` but not by :meth:`result`, which waits
    only for what arrives: a pipeline takes what it received when it needs it and leaves its
    sends in flight (as ``torch.distributed.pipelining``'s schedules do), waiting for them by
    the end of its step. ``held``: the tensors being sent, referenced here until their sends
    complete."""

    __slots__ = ("_out", "_works", "_finish", "_sends", "_held")

    def __init__(self, out: torch.Tensor, works=(), finish=None, sends=(), held=()):
        self._out, self._works, self._finish = out, works, finish
        self._sends, self._held = sends, held

    @property
    def buffer(self) -> torch.Tensor:
        """The tensor the result lands in, to be read only after :meth:`result` (a ppermute's
        received buffer: :meth:`result` returns it)."""
        return self._out

    def landing_in(self, out: torch.Tensor) -> Pending:
        """This launch, its result ``out`` (a tensor on :attr:`buffer`'s data: the Function that
        records the op, applied at launch), ``self`` spent."""
        finish = self._finish
        if finish is not None:
            finish = functools.partial(_then, finish, self._out, out)
        done = Pending(out, self._works, finish, self._sends, self._held)
        self._works = self._sends = self._held = ()
        self._finish = None
        return done

    def result(self) -> torch.Tensor:
        """The result, once what this rank receives has arrived (its sends may be in flight)."""
        for w in self._works:
            w.wait()
        self._works = ()
        if self._finish is not None:
            self._out, self._finish = self._finish(self._out), None
        return self._out

    def wait(self) -> torch.Tensor:
        """The result, once everything this rank sent and receives has gone through."""
        out = self.result()
        for w in self._sends:
            w.wait()
        self._sends = self._held = ()
        return out

    def sent(self) -> bool:
        """Whether every send has completed (does not block)."""
        if all(w.is_completed() for w in self._sends):
            self._sends = self._held = ()
        return not self._sends


#: the tag of :func:`abandon`'s receives, which no message matches (fshard sends with tag 0)
_ABANDON_TAG = 0x7F5A


def _note_key(g: AxisGroup) -> str:
    return f"fshard/abandoned/{g.pg.group_name}"


def peer_failure(g: AxisGroup) -> str | None:
    """What the first rank of ``g`` to give it up (:func:`abandon`) posted, or ``None``. Reads
    the c10d store: only on a failure path."""
    try:
        store, key = dist.distributed_c10d._get_default_store(), _note_key(g)
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # no store (a group made without one): nothing posted
        return None


def abandon(g: AxisGroup, note: str) -> None:
    """Give ``g`` up after an error on this rank, so that no peer waits for the group's timeout
    (a pipeline whose stage raised: the other stages wait on it for activations and
    cotangents). ``note`` (the error, named) goes to the c10d store under the group's name
    unless a peer posted first (:func:`peer_failure`), then this rank's connections to its
    peers in ``g`` are closed: on Gloo by a receive that times out at once (a timed-out wait
    closes every pair of the group's Gloo context, ``gloo/transport/tcp/unbound_buffer.cc``:
    "Application timeout caused pair closure"; the other receives then raise at once, caught
    here; ``ProcessGroup.abort`` and ``shutdown`` leave the pairs open until the process
    exits, torch 2.13; other groups are untouched), so a peer blocked on this rank in a
    collective over ``g`` raises within milliseconds ("Connection closed by peer"), reads the
    note, and gives the group up in turn (the stages beyond it learn so). On other backends
    only the note is posted. The group is unusable afterwards: :func:`fshard.mesh.abandoned`
    says so, and a :class:`fshard.launch.World` restarts."""
    if g.simulated or g.size == 1 or tracing():
        return
    _mesh.mark_abandoned(g.pg.group_name)
    if peer_failure(g) is None:
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_default_store().set(_note_key(g), note)
    if g.backend != "gloo":
        return
    me = g.ranks[g.index]
    for peer in g.ranks:
        if peer == me:
            continue
        with contextlib.suppress(RuntimeError):  # the timeout; a pair closed already
            work = dist.irecv(torch.empty(0), peer, group=g.pg, tag=_ABANDON_TAG)
            work.wait(datetime.timedelta(milliseconds=1))


def _then(finish, buffer: torch.Tensor, out: torch.Tensor, _) -> torch.Tensor:
    finish(buffer)  # into the buffer itself: ``out`` may carry autograd history
    return out


def all_gather(
    t: torch.Tensor, g: AxisGroup, dim: int, sizes: Sequence[int] | None
) -> torch.Tensor:
    """Concatenate every chunk's ``t`` along ``dim`` in chunk order (``sizes``: chunk sizes)."""
    if g.size == 1:
        return t
    out, _, sizes = _all_gather_launch(t, g, dim, sizes, async_op=False)
    return _chunk_order(out, g, sizes, dim)


def all_gather_start(
    t: torch.Tensor,
    g: AxisGroup,
    dim: int,
    sizes: Sequence[int] | None,
    out: torch.Tensor | None = None,
) -> Pending:
    """:func:`all_gather` launched asynchronously (FSDP's prefetch): ``.wait()`` returns what
    :func:`all_gather` returns. The wire check, the consistency check and the comm-log record
    happen at launch (on every rank in the same order), the chunk-order fix-up at ``wait``.
    Several launched back to back queue on the group's worker.

    ``out``: the buffer of :func:`gather_buffer` whose own block ``t`` is (a flat pack written
    in place, ``dim`` 0, even sizes, the broadcast lowering): gathered into, with no copy of
    ``t`` (FSDP's packed unit); ``None``: a buffer of its own.
    """
    if g.size == 1:
        return Pending(t)
    out, works, sizes = _all_gather_launch(t, g, dim, sizes, async_op=True, out=out)
    return Pending(out, works, functools.partial(_chunk_order, g=g, sizes=sizes, dim=dim))


def gather_buffer(numel: int, g: AxisGroup, like: torch.Tensor) -> tuple:
    """``(out, block)`` to pack a flat block of ``numel`` elements (``like``'s dtype and device)
    for an all_gather over ``g``, then ``all_gather_start(block, g, 0, None, out=out)``. Where
    the gather goes as one broadcast per rank (:class:`Lowering`, ``gather_broadcast_bytes``)
    ``out`` is its output and ``block`` this rank's block in it: the block is sent where it
    lies, with no copy into the output. Elsewhere ``out`` is ``None`` and ``block`` a tensor of
    its own (the native all_gather's input, as :func:`all_gather` sends it)."""
    big = lowering(g).gather_broadcast_bytes
    if g.size == 1 or big is None or numel * like.element_size() < big:
        return None, like.new_empty((numel,))
    out = like.new_empty((g.size * numel,))
    j = g.group_rank[g.index]
    return out, out[j * numel : (j + 1) * numel]


def _all_gather_launch(
    t, g: AxisGroup, dim: int, sizes, async_op: bool, out: torch.Tensor | None = None
) -> tuple:
    """Check, record and put :func:`all_gather` on the wire: ``(out, works, sizes)``, ``out``
    the blocks in group-rank order (padded to the largest), complete once ``works`` are
    waited on."""
    x = t.movedim(dim, 0) if dim else t
    sizes = tuple(sizes) if sizes is not None else (x.shape[0],) * g.size
    _wire(t, g, "all_gather")
    _consistent("all_gather", g, t, dim=dim, chunk_sizes=sizes, other_dims=tuple(x.shape[1:]))
    record("all_gather", g.axes, nbytes(t))
    out, works = _gather_wire(pad_dim0(x, max(sizes)), g, async_op, out)
    return out, works, sizes


def _chunk_order(out: torch.Tensor, g: AxisGroup, sizes: tuple, dim: int) -> torch.Tensor:
    """Blocks gathered in group-rank order (padded to the largest), trimmed and concatenated
    in chunk order along ``dim``."""
    m = max(sizes)
    if g.identity_order and all(s == m for s in sizes):
        return out.movedim(0, dim)  # already in chunk order, no padding: no copy
    blocks = out.view(g.size, m, *out.shape[1:])
    parts = [blocks[g.group_rank[j], : sizes[j]] for j in range(g.size)]
    return torch.cat(parts, 0).movedim(0, dim)


def size_exchange(values: Sequence[int], g: AxisGroup, device: torch.device) -> list[list[int]]:
    """Every chunk's ``values`` (ints, the same count on every rank), in chunk order: one small
    all_gather of int64, logged as ``size_exchange`` (shard_map's output shapes)."""
    values = list(values)
    if g.size == 1:
        return [values]
    if g.simulated:
        raise NotImplementedError(
            f"a dry run cannot exchange sizes known only at run time over {g.axes} (MoE token "
            "counts, ragged_all_to_all without recv_sizes=, shard_map outputs without "
            "out_shapes=, fs.data's per-rank blocks): a simulated rank does not know the "
            "others'. Give the sizes statically (recv_sizes=, out_shapes=)"
        )
    send = torch.tensor(values, dtype=torch.int64, device=device)
    _wire(send, g, "all_gather")
    _consistent("size_exchange", g, send, count=len(values))
    record("size_exchange", g.axes, nbytes(send))
    out, _ = _gather_wire(send, g, async_op=False)
    rows = out.view(g.size, len(values)).tolist()
    return [rows[g.group_rank[j]] for j in range(g.size)]


#: Every dtype, by a number the same on every rank (the same torch): ``agree_meta``'s code.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}
_MAX_DIMS = 64  # torch's limit on a tensor's dims
_UNKNOWN = -(1 << 63)  # a word of a rank that passed no shape (below every pair's words)


def agree_meta(meta: tuple | None, g: AxisGroup, src: int) -> tuple:
    """``(shape, dtype)`` of ``fs.shard(..., src=)``: ``src``'s (``meta`` elsewhere: what the
    rank passed, or ``None``), checked before any data moves. One ``all_reduce(MAX)`` of a
    fixed 132 int64 words on every rank, whatever each passed (a broadcast only where a rank
    lacks the shape would pair with another rank's next collective: a Gloo timeout): each
    rank that knows a shape writes ``(v, -v)`` per field (ndim, dtype, dims), the others a
    word below all of them; a field whose maximum is not ``(v, -v)`` differs between ranks,
    and every rank raises the same ``ValueError`` naming each rank's shape and dtype. Metadata,
    not in the comm log.
    """
    if g.size == 1:
        return meta
    if tracing() or g.simulated:
        if meta is None:
            _untraceable("fs.shard(..., src=) without shape and dtype on every rank")
        return meta
    words = torch.full((2 * (2 + _MAX_DIMS),), _UNKNOWN, dtype=torch.int64)
    if meta is not None:
        shape, dtype = meta
        fields = [len(shape), _DTYPE_CODES[dtype], *shape]
        fields += [0] * (2 + _MAX_DIMS - len(fields))
        for i, v in enumerate(fields):
            words[2 * i], words[2 * i + 1] = v, -v
    if dist.get_backend(g.pg) == "nccl":
        words = words.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(words, dist.ReduceOp.MAX, group=g.pg)
    top = words.tolist()
    if all(top[2 * i] == -top[2 * i + 1] for i in range(len(top) // 2)):
        return tuple(top[4 : 4 + 2 * top[0] : 2]), _DTYPES[top[2]]
    views: list = [None] * g.size
    mine = "nothing" if meta is None else f"shape {tuple(meta[0])}, {meta[1]}"
    dist.all_gather_object(views, mine, group=g.pg)
    per = "; ".join(
        f"rank {r}{' (src)' if j == src else ''}: {v}"
        for j, (r, v) in enumerate(zip(g.ranks, views))
    )
    raise ValueError(
        f"shard(src={g.ranks[src]}): the ranks passed different shapes or dtypes ({per}); rank "
        f"{g.ranks[src]}'s tensor is what is scattered: pass None (or its shape= and dtype=) on "
        "the other ranks"
    )


def _gather_wire(
    x: torch.Tensor, g: AxisGroup, async_op: bool = False, out: torch.Tensor | None = None
) -> tuple:
    """Every rank's ``x`` (equal shapes) stacked along dim 0 in group-rank order: ``(out,
    works)``, ``out`` complete once every work in ``works`` is waited on (none when traced or
    not ``async_op``). ``out`` given (:func:`gather_buffer`, the broadcast lowering): ``x`` is
    its own block, broadcast where it lies."""
    big = lowering(g).gather_broadcast_bytes
    big = big is not None and nbytes(x) >= big
    if g.simulated:
        if out is None or not big:
            out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
        if big or str(g.backend) != "gloo":
            return out, ()
        # ProcessGroupGloo's allgather gathers into a flat tensor of its own and copies it
        # out: a second buffer of the output's size while the op runs (until the wait, when
        # launched asynchronously), which the CPU allocator counts
        scratch = _Scratch(out.new_empty(out.shape))
        return out, (scratch,) if async_op else ()
    if tracing():
        if not big:
            return _compat.funcol_all_gather(x.detach(), g.pg), ()
        # the functional broadcast takes the source's rank inside the group
        k = range(g.size)
        return torch.cat([_compat.funcol().broadcast(x.detach(), i, g.pg) for i in k]), ()
    if out is None or not big:  # (the native all_gather into a buffer of its own)
        out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
    if big:
        blocks = out.view(g.size, *x.shape)
        own = blocks[g.group_rank[g.index]]
        if own.data_ptr() != x.data_ptr():  # (packed in place: gather_buffer)
            own.copy_(x)
        works = [
            dist.broadcast(blocks[k], src=src, group=g.pg, async_op=async_op)
            for k, src in enumerate(_group_rank_order(g))
        ]
        return out, works if async_op else ()
    work = _compat.all_gather_into(out, x, group=g.pg, async_op=async_op)
    return out, (work,) if async_op else ()


class _Scratch:
    """A simulated collective's backend-internal buffer, freed at the wait."""

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor):
        self.buf = buf

    def wait(self) -> None:
        self.buf = None


def _group_rank_order(g: AxisGroup) -> list[int]:
    """The global ranks in group-rank order."""
    return [g.ranks[g.group_rank.index(k)] for k in range(g.size)]


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(
    t: torch.Tensor, g: AxisGroup, op: str = "sum", *, inplace: bool = False
) -> torch.Tensor:
    """Elementwise reduction (``sum``, ``max`` or ``min``) over the group; a new tensor, or
    ``t`` itself reduced in place with ``inplace`` (``t`` must then be a contiguous temporary
    the caller owns, e.g. a gradient bucket)."""
    out, work = all_reduce_start(t, g, op, inplace=inplace)
    if work is not None:
        work.wait()
    return out


def all_reduce_start(
    t: torch.Tensor, g: AxisGroup, op: str = "sum", *, inplace: bool = False
) -> tuple[torch.Tensor, dist.Work | None]:
    """:func:`all_reduce` launched asynchronously: ``(out, work)``; ``out`` holds the result
    once ``work.wait()`` returns (``work`` is ``None`` when nothing was sent). Several launched
    back to back queue on the group's worker, so copying the next bucket overlaps the wire."""
    if g.size == 1:
        return t, None
    _wire(t, g, "all_reduce", op)
    _consistent("all_reduce", g, t, reduce=op, shape=tuple(t.shape))
    record("all_reduce", g.axes, nbytes(t))
    if tracing():
        return _compat.funcol().all_reduce(t.detach(), op, g.pg), None
    out = t if inplace else t.clone(memory_format=torch.contiguous_format)
    if g.simulated:
        return out, None
    return out, dist.all_reduce(out, _REDUCE_OPS[op], group=g.pg, async_op=True)


def _exchange(pieces: list[torch.Tensor], g: AxisGroup) -> torch.Tensor:
    """Send ``pieces[j]`` (equal shapes) to chunk ``j``; row ``j`` of the result is what chunk
    ``j`` sent us."""
    send = torch.stack([pieces[j] for j in _chunk_of_group_rank(g)])
    return _exchange_stacked(send, g)


#: Wire buffers kept between calls, per (numel, dtype, device), as DDP keeps its buckets: on
#: CPU a fresh multi-MiB buffer is fresh pages every step (the faults cost more than the copy:
#: glibc gives a large block freed at the top of the heap back to the OS, and the next step's
#: first touch of each page is a fault and a page clear). A buffer is reused only once nothing
#: else references its storage (the results handed out from it, which are views, are gone), so
#: a returned value is never overwritten.
_POOL: dict[tuple, list[torch.Tensor]] = {}
_POOL_DEPTH = 2


def pooled(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of ``numel`` elements from the pool (its contents undefined): one that no
    one else references, else a new one (kept, up to two per size, for the next call).

    Example:
        >>> pooled(4, torch.float32, torch.device("cpu")).shape
        torch.Size([4])
    """
    free = _POOL.setdefault((numel, dtype, device), [])
    for buf in free:
        # 2: the pool's tensor and the temporary storage object of this call
        if torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2:
            return buf.view(numel)  # a new tensor: it holds the storage while in use
    buf = torch.empty(numel, dtype=dtype, device=device)
    if len(free) < _POOL_DEPTH:
        free.append(buf)
    return buf.view(numel)


def _exchange_stacked(send: torch.Tensor, g: AxisGroup, pool: bool = False) -> torch.Tensor:
    """``send`` is ``[n, ...]`` in group-rank order; returns ``[n, ...]`` in chunk order
    (``pool``: received into a :func:`pooled` buffer)."""
    if g.simulated:
        recv = torch.empty_like(send)
    elif tracing():
        recv = _compat.funcol().all_to_all_single(send.detach(), None, None, g.pg)
    else:
        recv = (
            pooled(send.numel(), send.dtype, send.device).view(send.shape)
            if pool
            else torch.empty_like(send)
        )
        dist.all_to_all_single(recv, send, group=g.pg)
    return recv if g.identity_order else recv[list(g.group_rank)]


def _chunk_of_group_rank(g: AxisGroup) -> list[int]:
    inv = [0] * g.size
    for j, k in enumerate(g.group_rank):
        inv[k] = j
    return inv


def _pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    if tuple(t.shape) == tuple(shape):
        return t
    out = t.new_zeros(tuple(shape))
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def reduce_scatter(
    t: torch.Tensor, g: AxisGroup, dim: int, sizes: Sequence[int] | None, pool: bool = False
) -> torch.Tensor:
    """Sum over the group, keeping chunk ``g.index`` of ``dim``. ``pool``: the all_to_all
    lowering receives into a :func:`pooled` buffer, of which the result is a view (a caller
    that reduce-scatters the same bytes every step: no fresh pages each time)."""
    if g.size == 1:
        return t
    _wire(t, g, "reduce_scatter", "sum")
    _consistent("reduce_scatter", g, t, dim=dim, shape=tuple(t.shape), chunk_sizes=sizes)
    record("reduce_scatter", g.axes, nbytes(t))
    x = t.movedim(dim, 0)
    sizes = tuple(sizes) if sizes is not None else _even_sizes(x.shape[0], g.size)
    m = max(sizes)
    if g.identity_order and all(s == m for s in sizes):
        send = x.contiguous().view(g.size, m, *x.shape[1:])  # no copy
    else:
        pieces = [pad_dim0(p, m) for p in torch.split(x, list(sizes), 0)]
        send = torch.stack([pieces[j] for j in _chunk_of_group_rank(g)])
    if lowering(g).reduce_scatter_via_all_to_all:
        # A left fold, not .sum(0): torch's sum starts from +0.0, so -0.0 addends gave +0.0;
        # in place in the received buffer (ours) unless traced (a collective's output there)
        recv = _exchange_stacked(send, g, pool).unbind(0)
        add = torch.add if tracing() else torch.Tensor.add_
        mine = functools.reduce(add, recv)
    elif tracing() and not g.simulated:
        mine = _compat.funcol_reduce_scatter(send.flatten(0, 1).detach(), g.pg)
    else:
        mine = send.new_empty(send.shape[1:])
        if not g.simulated:
            _compat.reduce_scatter_into(mine, send.flatten(0, 1), group=g.pg)
    return mine[: sizes[g.index]].movedim(0, dim)


def all_to_all(
    t: torch.Tensor,
    g: AxisGroup,
    split_dim: int,
    concat_dim: int,
    split_sizes: Sequence[int] | None,
    concat_sizes: Sequence[int] | None,
) -> torch.Tensor:
    """Split ``split_dim`` into chunks sent to each rank; concat what arrives along ``concat_dim``.

    ``split_sizes[j]``: size of the piece sent to chunk ``j``; ``concat_sizes[j]``: size along
    ``concat_dim`` of the piece received from chunk ``j``. ``None`` means even. With
    ``split_dim == concat_dim`` and sizes given the exchange is *ragged* (each rank its own
    sizes: MoE token dispatch): only the pieces' bytes move, no padding.
    """
    if g.size == 1:
        return t
    if split_dim == concat_dim and split_sizes is not None and concat_sizes is not None:
        return _ragged_all_to_all(t, g, split_dim, split_sizes, concat_sizes)
    _wire(t, g, "all_to_all")
    _consistent(
        "all_to_all",
        g,
        t,
        split_dim=split_dim,
        concat_dim=concat_dim,
        split_sizes=split_sizes,
        concat_sizes=concat_sizes,
        shape=tuple(-1 if d == concat_dim else s for d, s in enumerate(t.shape)),
    )
    record("all_to_all", g.axes, nbytes(t))
    n = g.size
    split_sizes = (
        tuple(split_sizes) if split_sizes is not None else _even_sizes(t.shape[split_dim], n)
    )
    concat_sizes = tuple(concat_sizes) if concat_sizes is not None else (t.shape[concat_dim],) * n
    shape = list(t.shape)
    shape[split_dim] = max(split_sizes)
    shape[concat_dim] = max(concat_sizes) if split_dim != concat_dim else shape[split_dim]
    pieces = [_pad_to(p, shape) for p in torch.split(t, list(split_sizes), split_dim)]
    got = _exchange(pieces, g)
    mine = split_sizes[g.index]
    parts = []
    for j, p in enumerate(got):
        idx = [slice(None)] * t.dim()
        idx[split_dim] = slice(0, mine)
        if split_dim != concat_dim:
            idx[concat_dim] = slice(0, concat_sizes[j])
        parts.append(p[tuple(idx)])
    return torch.cat(parts, concat_dim)


def _ragged_all_to_all(t, g: AxisGroup, dim: int, send: Sequence[int], recv: Sequence[int]):
    """Pieces of ``dim`` of sizes ``send[j]`` to chunk ``j``; what chunk ``j`` sends (``recv[j]``
    along ``dim``) concatenated in chunk order. The sizes differ per rank, so the consistency
    check compares only what must agree (the other dims, the dtype)."""
    if len(send) != g.size or len(recv) != g.size or sum(send) != t.shape[dim]:
        raise ValueError(
            f"ragged all_to_all over {g.axes}: send sizes {list(send)} must be {g.size} sizes "
            f"summing to dim {dim}'s {t.shape[dim]}, recv sizes {list(recv)} {g.size} sizes"
        )
    _wire(t, g, "all_to_all")
    other = tuple(d for i, d in enumerate(t.shape) if i != dim)
    _consistent("ragged_all_to_all", g, t, dim=dim, other_dims=other)
    record("all_to_all", g.axes, nbytes(t))
    x = t.movedim(dim, 0)
    order = _chunk_of_group_rank(g)  # group rank k holds chunk order[k]
    if not g.identity_order:
        pieces = torch.split(x, list(send), 0)
        x = torch.cat([pieces[order[k]] for k in range(g.size)], 0)
    send_k = [send[order[k]] for k in range(g.size)]
    recv_k = [recv[order[k]] for k in range(g.size)]
    if tracing() and not g.simulated:
        out = _compat.funcol().all_to_all_single(x.contiguous().detach(), recv_k, send_k, g.pg)
    else:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        if not g.simulated:
            dist.all_to_all_single(out, x.contiguous(), recv_k, send_k, group=g.pg)
    if not g.identity_order:
        pieces = torch.split(out, recv_k, 0)
        out = torch.cat([pieces[g.group_rank[j]] for j in range(g.size)], 0)
    return out.movedim(0, dim)


def ppermute(
    t: torch.Tensor,
    g: AxisGroup,
    perm: Sequence[tuple[int, int]],
    out_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """Send to and receive from chunk indices per ``perm`` (pairs ``(src, dst)``); others get 0."""
    return ppermute_start(t, g, perm, out_shape).wait()


def ppermute_start(
    t: torch.Tensor,
    g: AxisGroup,
    perm: Sequence[tuple[int, int]],
    out_shape: Sequence[int] | None = None,
    ahead: Pending | None = None,
    tag: int = 0,
) -> Pending:
    """:func:`ppermute` launched asynchronously (ring attention's next block, a pipeline's
    transfers): ``.wait()`` returns what :func:`ppermute` returns; ``.result()`` returns it once
    the receive has landed, the sends left in flight (:class:`Pending`). The received buffer
    is allocated here and is what both return (:attr:`Pending.buffer`, to be read only after
    one of them). Checks and the comm-log record happen at launch.

    ``ahead``: this rank's receives of this very ppermute, posted earlier by
    :func:`receive_ahead` (a pipeline posts each tick's receives as the tick begins): only the
    sends are issued here; the checks, the consistency fold and the record are this call's, as
    without it. ``tag``: the messages' wire tag (:data:`AHEAD_TAG` where receives are posted
    ahead)."""
    out_shape = tuple(t.shape) if out_shape is None else tuple(out_shape)
    if g.simulated:
        return _ppermute_simulated(t, g, perm, out_shape)
    if tracing():
        return Pending(_ppermute_traced(t, g, perm, out_shape))
    if g.size > 1:
        _wire(t, g, "ppermute")
    me = g.index
    # a buffer a message fills needs no zeros (ring attention: two per block round)
    receives = any(dst == me and src != me for src, dst in perm)
    if ahead is not None and (not receives or tuple(ahead.buffer.shape) != out_shape):
        raise ValueError(
            f"ppermute over {g.axes}: ahead= is a receive of shape "
            f"{tuple(ahead.buffer.shape)}, this rank receives "
            f"{'a block of shape ' + str(out_shape) if receives else 'nothing'} in perm "
            f"{tuple(perm)}; pass what receive_ahead posted for this ppermute"
        )
    if ahead is not None:
        out = ahead.buffer
    else:
        out = t.new_empty(out_shape) if receives else t.new_zeros(out_shape)
    # Gloo's send/recv read host pointers: a CUDA tensor goes through host memory (a copy each
    # way), as Gloo's own collectives do for CUDA tensors; what lands is copied into ``out``.
    host = g.backend == "gloo" and t.device.type != "cpu"
    wire = t.cpu() if host else t
    land = wire.new_empty(out_shape) if host and receives and ahead is None else out
    ops = []  # (send, tensor, global peer), in perm order
    for src, dst in perm:
        if src == me and dst == me:
            out.copy_(t)
        elif src == me:
            ops.append((True, wire.contiguous(), g.ranks[dst]))
        elif dst == me and ahead is None:
            ops.append((False, land, g.ranks[src]))
    if g.size > 1:
        _consistent("ppermute", g, t, perm=tuple(perm), ndim=t.dim())
        record("ppermute", g.axes, nbytes(t) if any(s == me for s, _ in perm) else 0)
    works = _point_to_point(ops, g, tag) if ops else []
    sent, held = (), ()
    if len(works) == len(ops):  # one work per message (Gloo): the sends apart
        sent = tuple(w for w, op in zip(works, ops) if op[0])
        held = tuple(op[1] for op in ops if op[0])
        works = [w for w, op in zip(works, ops) if not op[0]]
    if ahead is not None:
        works = [*ahead._works, *works]
        ahead._works = ()
    finish = functools.partial(_landed, land) if land is not out else None
    return Pending(out, tuple(works), finish, sent, held)


#: The wire tag of the ppermutes whose receives are posted ahead (:func:`receive_ahead`; a
#: pipeline's transfers): a message of any other ppermute over the same group (tag 0), issued
#: while they are posted, cannot land in them.
AHEAD_TAG = 0x7F5B


def receive_ahead(
    like: torch.Tensor,
    g: AxisGroup,
    perm: Sequence[tuple[int, int]],
    out_shape: Sequence[int],
    tag: int = AHEAD_TAG,
) -> Pending | None:
    """This rank's receive of a later ppermute over ``g`` (``perm``, a block of ``out_shape``
    and ``like``'s dtype), posted now: the ppermute, issued later by every rank as usual, takes
    it as ``ahead=`` and sends only. What arrives lands while this rank computes, as it could
    not were the receive posted only once the rank reaches the ppermute. ``None`` (post
    nothing; the ppermute receives as usual) where this rank receives nothing or from itself,
    on a simulated or traced group, and on any backend but Gloo on CPU tensors: NCCL runs a
    communicator's point-to-point ops in order on one stream, so a receive posted ahead would
    hold back this rank's own sends behind it (the pipeline's peers would wait on each other),
    and Gloo's CUDA tensors go through a host copy the ppermute makes.

    Receives posted ahead over one group match the peer's sends of ``tag`` in the order they are
    posted: post them in the order the ppermutes will be issued, which send with ``tag``
    (``Ppermute(..., tag=AHEAD_TAG)``), and no other sends of that tag in between.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> g, perm = mesh.group("x"), ((0, 1),)
        >>> x = torch.full((2,), float(mesh.rank + 1))
        >>> ahead = _comm.receive_ahead(x, g, perm, (2,))  # rank 1: posted; rank 0: None
        >>> pending = _comm.ppermute_start(x, g, perm, ahead=ahead, tag=_comm.AHEAD_TAG)
        >>> got = pending.result()  # rank 1: tensor([1., 1.])
    """
    me = g.index
    sources = [src for src, dst in perm if dst == me and src != me]
    if (
        not sources
        or g.size == 1
        or g.simulated
        or tracing()
        or g.backend != "gloo"
        or like.device.type != "cpu"
    ):
        return None
    _wire(like, g, "ppermute")
    out = like.new_empty(tuple(out_shape))
    return Pending(
        out, tuple(dist.irecv(out, g.ranks[src], group=g.pg, tag=tag) for src in sources)
    )


def _landed(land: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(land)


def _point_to_point(ops: list, g: AxisGroup, tag: int = 0) -> list:
    """Launch ``ops``, ``(send, tensor, global peer)`` each, over ``g``: their works. Gloo
    cannot coalesce, and ``batch_isend_irecv`` on such a backend is this loop of ``isend`` and
    ``irecv`` in order (torch 2.11-2.13, ``distributed_c10d.batch_isend_irecv``), after a
    ``P2POp`` per message and a check of the list: on Gloo they are issued directly (a
    pipeline step's ppermutes, 8-20 a step). Other backends (NCCL) get ``batch_isend_irecv``,
    which groups the messages so that ranks sending to each other do not deadlock."""
    if g.backend == "gloo":
        return [
            dist.isend(t, peer, group=g.pg, tag=tag)
            if send
            else dist.irecv(t, peer, group=g.pg, tag=tag)
            for send, t, peer in ops
        ]
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend if send else dist.irecv, t, peer, group=g.pg, tag=tag)
            for send, t, peer in ops
        ]
    )


def _ppermute_simulated(t, g: AxisGroup, perm, out_shape: tuple) -> Pending:
    """:func:`ppermute_start` on a simulated group: the same checks and record, the received
    buffer made (zeros where nothing arrives, as on the wire)."""
    me = g.index
    if g.size > 1:
        _consistent("ppermute", g, t, perm=tuple(perm), ndim=t.dim())
        record("ppermute", g.axes, nbytes(t) if any(s == me for s, _ in perm) else 0)
    if any(s == me and d == me for s, d in perm):
        return Pending(t.clone())
    return Pending(t.new_zeros(out_shape))


def _ppermute_traced(t, g: AxisGroup, perm, out_shape: tuple) -> torch.Tensor:
    """:func:`ppermute` as one functional all_to_all with empty splits for the ranks this one
    does not exchange with (functional collectives have no traceable send/recv here)."""
    me, n_in, n_out = g.index, t.numel(), _prod(out_shape)
    send, recv = [0] * g.size, [0] * g.size
    for src, dst in perm:
        if src == me:
            send[g.group_rank[dst]] = n_in
        if dst == me:
            recv[g.group_rank[src]] = n_out
    got = _compat.funcol().all_to_all_single(t.reshape(-1).detach(), recv, send, g.pg)
    if not any(recv):
        return t.new_zeros(out_shape)
    return got.view(out_shape)


def _untraceable(name: str) -> None:
    if tracing():
        raise NotImplementedError(
            f"{name} cannot run inside torch.compile / make_fx / export (it has no functional "
            "collective); move it out of the compiled function"
        )


def scatter_from(
    full: torch.Tensor | None,
    g: AxisGroup,
    src: int,
    blocks: Sequence[tuple[slice, ...]],
    like: torch.Tensor,
) -> torch.Tensor:
    """Chunk ``src`` holds ``full``; chunk ``j`` receives ``full[blocks[j]]`` (``blocks`` static).

    ``like`` gives dtype and device on ranks without ``full``. Only the blocks travel, padded
    to the largest block so that Gloo's equal-size scatter accepts them.
    """
    if g.size == 1:
        return full[blocks[0]].clone()
    _untraceable("scatter (fs.shard of a full tensor from one rank)")
    _wire(full if g.index == src else like, g, "scatter")
    numel = max(max(_static_numel(b) for b in blocks), 1)
    _consistent("scatter", g, like, src=src, blocks=_boxes(blocks))
    recv = like.new_empty(numel)
    if g.index == src:
        record("scatter", g.axes, nbytes(full))
        parts = [_pad_flat(full[b], numel) for b in blocks]
        send = [parts[j] for j in _chunk_of_group_rank(g)]
    else:
        record("scatter", g.axes, 0)
        send = None
    if not g.simulated:
        dist.scatter(recv, send, src=g.ranks[src], group=g.pg)
    mine = tuple(s.stop - s.start for s in blocks[g.index])
    return recv[: _prod(mine)].view(mine)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _static_numel(block: tuple[slice, ...]) -> int:
    return _prod(s.stop - s.start for s in block)


def _boxes(blocks: Sequence[tuple[slice, ...]]) -> tuple:
    return tuple(tuple((s.start, s.stop) for s in b) for b in blocks)


def _pad_flat(t: torch.Tensor, numel: int) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() == numel:
        return flat.contiguous()
    out = flat.new_zeros(numel)
    out[: flat.numel()] = flat
    return out


def gather_to(
    t: torch.Tensor, g: AxisGroup, dst: int, blocks: Sequence[tuple[slice, ...]], shape
) -> torch.Tensor | None:
    """Chunk ``dst`` receives every chunk's ``t`` placed at ``blocks[j]`` of a ``shape`` tensor."""
    if g.size == 1:
        out = t.new_empty(tuple(shape))
        out[blocks[0]] = t
        return out
    _untraceable("gather to one rank")
    _wire(t, g, "gather")
    _consistent("gather", g, t, dst=dst, blocks=_boxes(blocks), shape=tuple(shape))
    record("gather", g.axes, nbytes(t))
    numel = max(max(_static_numel(b) for b in blocks), 1)
    send = _pad_flat(t, numel)
    if g.index == dst:
        recv = [torch.empty_like(send) for _ in range(g.size)]
        if not g.simulated:
            dist.gather(send, recv, dst=g.ranks[dst], group=g.pg)
        out = t.new_empty(tuple(shape))
        for j in range(g.size):
            part = recv[g.group_rank[j]]
            b = blocks[j]
            sub = tuple(s.stop - s.start for s in b)
            out[b] = part[: _prod(sub)].view(sub)
        return out
    if not g.simulated:
        dist.gather(send, None, dst=g.ranks[dst], group=g.pg)
    return None
