"""Plan a run on any number of ranks from one process: the user's own training step, run on an
abstract mesh with ``meta`` tensors, once per class of ranks (JAX's ``jit(...).lower(...)``
``memory_analysis()`` / ``cost_analysis()`` against an ``AbstractMesh``).

:func:`dry_run` binds the abstract mesh to one representative rank of each class
(:meth:`fshard.Mesh.simulate`: a mesh with a "this rank" whose groups are
:class:`~fshard.mesh.SimulatedGroup` s), calls the user's ``init(mesh)`` and ``step(*args)``
there, and reports what that rank holds, saves, sends and computes. Every value created on a
simulated mesh is a ``meta`` tensor, so a 70B model on 1,024 ranks costs no memory and little
time. Collectives run through the one path every collective takes (op rule -> ``fs.lax.apply``
and its handlers -> ``collectives.RUN`` -> ``fshard._comm``): ``_comm`` checks and records
them exactly as on a real group and makes the received buffers with the right shapes where it
would call torch.distributed, so the collectives of the report are ``fs.debug.comm_log``'s
records, and the lowering's temporaries are in its memory (``backend=``: whose lowering). No
process group is created, torch.distributed is never initialised or used, and a real world in
the process is not touched.

**Rank classes** (:func:`rank_classes`). Ranks whose arguments have the same local shapes
(every array ``init`` returns, params, optimizer state and batch alike), that get equal blocks of
every dim size of those arguments wherever the step splits it (a full batch sharded inside the
loss) and that have the same coordinate on the pipeline axes (``distinct_axes``, default the
mesh axes named ``"pp"``: stages run different code) run the same program on the same shapes,
so they allocate, send and compute the same: one rank per class is run (the lowest), and the
class lists its members. Uneven splits (a vocabulary of 128,256 split over 1,024 ranks: 1,017
blocks of 126 rows, one of 114, six empty) give several classes.
The step must be SPMD inside a class (no branch on ``mesh.rank`` beyond what the local shapes
and ``distinct_axes`` show); ``ranks=`` runs exactly the ranks given instead.
``tests/test_dry_run.py`` runs every rank of small meshes and checks each one's report equals
its class representative's.

**What is counted.** Memory is the bytes of live tensor storages, tracked by a
``TorchDispatchMode`` with weak-reference finalizers on the storages (each storage once, however
many views share it), checked against torch.profiler's CPU allocator events on real Gloo
ranks (``tests/test_dry_run.py``). A storage the cyclic garbage collector frees (one a
reference cycle kept alive) stays counted until the step ends: when the collector runs depends
on the process's history, not on the step, so the figures are the same in every run. Not torch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``): it attributes memory through module hooks and the
module's own ``nn.Parameter`` s, while a functional step swaps sharded values into the module
(``fs.nn.functional_call``); it was not tried here. ``torch.func`` refuses
``saved_tensors_hooks``, so the activations are taken at the backward's start. So:

- ``args``: each argument's bytes after ``init`` (its leaves' distinct storages);
  ``grads``: the first argument's floating-point bytes (gradients have their params' layouts
  and dtypes, DESIGN §4), the bytes ``fs.value_and_grad`` returns;
- ``activations``: live bytes when the step's first backward op runs (the autograd engine's
  current node is set) minus the live bytes when the step started: what the forward saved for
  the backward (and any forward value still referenced there);
- ``peak``: the most bytes live at once during the step, arguments included; ``end``: live
  bytes when the step returned (the new state, the arguments while still referenced);
- ``flops``: per dtype of each op's first tensor input, from ``torch.utils.flop_counter``'s
  formulas (``flop_registry``, what ``FlopCounterMode`` counts; matmuls, convolutions,
  attention); ``bytes_accessed``: the bytes each non-view op reads and writes (the roofline's
  memory term);
- ``collectives``: the step's ``comm_log`` records; consistency checks
  (``fs.config.check_consistency``) are not among them (they are not data collectives and
  ``comm_log`` does not record them either), and a simulated group never runs one.

Tensors created outside ``init`` and ``step`` (module buffers captured by the loss) are counted
when the step first makes a view of them. The model must be built on ``torch.device("meta")``
inside ``init`` (its full-size meta params cost nothing and are not counted; the sharded
params ``init`` returns are). A step that reads a tensor's value (``.item()``, ``bool(t)``) cannot
run on meta data: a boolean read is answered ``True`` (transformers' checks that the position
ids are not packed and the mask has no padding, the path of an unpacked, unpadded training
batch) and counted in ``value_reads``; any other read raises ``ValueError``.

**Estimate** (``hardware=``, :class:`Hardware`): a roofline per class, compute time =
``max(flops / peak flops per dtype, bytes_accessed / mem_bw) + kernels * kernel_latency``,
communication time = for each collective its axes' latency plus the bytes it receives per rank
(DESIGN §5's cost model: all_reduce 2(n-1)/n L, all_gather (n-1) L, reduce_scatter and
all_to_all (n-1)/n L, ppermute L) over the bandwidth of its slowest axis. The latency terms
matter for small steps (many small kernels and collectives); on large accelerator steps the
FLOP and byte terms dominate. Reported both ways: ``serial`` (no overlap: compute + communication, an upper bound) and
``overlapped`` (perfect overlap: the larger of the two, a lower bound).

Example:
    >>> import transformers
    >>> transformers.logging.set_verbosity_error()
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, vocab_size=128,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> dims = fs.parallel.ParallelDims(dp_shard=64, tp=2)
    >>> def init(mesh):
    ...     with torch.device("meta"):
    ...         model = transformers.LlamaForCausalLM(cfg)
    ...     params, loss = fs.parallel.parallelize(model, mesh, dims)
    ...     opt = fs.optim.adamw(1e-3)
    ...     batch = {"input_ids": torch.zeros(128, 32, dtype=torch.long, device="meta")}
    ...     return params, opt.init(params), batch, loss, opt
    >>> def step(params, opt_state, batch, loss, opt):
    ...     value, grads = fs.value_and_grad(loss)(params, batch)
    ...     updates, opt_state = opt.update(grads, opt_state, params)
    ...     return fs.optim.apply_updates(params, updates), opt_state, value
    >>> report = fs.dry_run(step, init, dims.abstract_mesh())
    >>> sorted(r for c in report.classes for r in c.ranks) == list(range(128))
    True
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import optree
import torch
from rich.console import Console
from rich.table import Table
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from .array import ShardedArray
from .debug import CommRecord, comm_log
from .mesh import Mesh
from .spec import chunk_bounds, chunk_index

__all__ = ["dry_run", "DryRunReport", "RankClassReport", "Hardware", "OutOfMemoryError"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class Hardware:
    """One device of the target machine, for :func:`dry_run`'s estimate and memory check.

    Args:
        memory: bytes of device memory per rank (``None``: no memory check).
        flops: peak FLOP/s per dtype, e.g. ``{torch.bfloat16: 989e12, torch.float32: 67e12}``
            (the estimate refuses a step computing in a dtype not listed).
        mem_bw: device memory bandwidth, bytes/s.
        axis_bw: bandwidth per mesh axis, bytes/s received per rank (within a node: NVLink;
            across nodes: the network); a collective over several axes goes at its slowest.
        kernel_latency: seconds each kernel (each non-view op the step runs) costs beyond its
            roofline: launch and dispatch (about 5e-6 for eager CUDA kernels; 0, the default, for
            a captured graph; tens of microseconds for fshard's eager dispatch on a CPU).
        axis_latency: seconds each collective over a mesh axis costs beyond its bytes (the
            alpha of the alpha-beta model: a few microseconds within a node); a collective over
            several axes pays the largest.

    Example:
        >>> h100 = fs.Hardware(memory=80 * 2**30, flops={torch.bfloat16: 989e12},
        ...     mem_bw=3.35e12, axis_bw={"tp": 450e9, "dp_shard": 50e9})
        >>> h100.memory // 2**30
        80
    """

    memory: int | None = None
    flops: Mapping[torch.dtype, float] = field(default_factory=dict)
    mem_bw: float | None = None
    axis_bw: Mapping[str, float] = field(default_factory=dict)
    kernel_latency: float = 0.0
    axis_latency: Mapping[str, float] = field(default_factory=dict)

    def __hash__(self):
        return hash((self.memory, tuple(self.flops.items()), self.mem_bw, self.kernel_latency))


class OutOfMemoryError(ValueError):
    """A rank class of :func:`dry_run` needs more memory than ``Hardware.memory``; the full
    report is ``err.report``.

    Example:
        >>> m = fs.Mesh.abstract((2,), ("x",))
        >>> try:
        ...     fs.dry_run(lambda x: x * 2, lambda m: fs.shard(torch.empty(4, device="meta"), m, fs.P("x")), m, hardware=fs.Hardware(memory=10))
        ... except OutOfMemoryError as e:
        ...     print(e.report.classes[0].peak)
        16
    """

    def __init__(self, message: str, report: DryRunReport):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class Estimate:
    """A rank class's step time on :class:`Hardware` (seconds): ``compute`` (the roofline of
    its ops plus ``launch``, the kernels' latency), ``comm`` per mesh axes (bytes over bandwidth
    plus each collective's latency), ``serial`` (no overlap) and ``overlapped`` (perfect)."""

    compute: float
    comm: Mapping[tuple[str, ...], float]
    serial: float
    overlapped: float
    launch: float = 0.0


@dataclass
class RankClassReport:
    """What one class of ranks holds, sends and computes in one step (all bytes per rank).

    Attributes:
        ranks: the members (global ranks); ``ranks[0]`` is the one that was run.
        args: bytes of each argument ``init`` returned, by the step's parameter names.
        grads: bytes of the gradients (the first argument's floating-point bytes).
        activations: bytes saved by the forward for the backward.
        peak: the most bytes live during the step; ``end``: live when it returned.
        collectives: the step's ``comm_log`` records, in order.
        flops: FLOPs per dtype; ``bytes_accessed``: bytes read and written by the ops;
            ``kernels``: how many non-view ops ran (each a kernel launch on a device).
        value_reads: boolean reads of meta values answered ``True`` (see the module docstring).
        estimate: the :class:`Estimate` when ``hardware=`` was given.

    Example:
        >>> m = fs.Mesh.abstract((2,), ("x",))
        >>> c = fs.dry_run(lambda x: x * 2, lambda m: fs.shard(torch.empty(4, device="meta"), m, fs.P("x")), m).classes[0]
        >>> c.args, c.peak  # the argument's block of 2 floats, and the product's
        ({'x': 8}, 16)
    """

    ranks: tuple[int, ...]
    args: dict[str, int]
    grads: int
    activations: int
    peak: int
    end: int
    collectives: list[CommRecord]
    flops: dict[torch.dtype, int]
    bytes_accessed: int
    value_reads: int = 0
    kernels: int = 0
    estimate: Estimate | None = None

    @property
    def rank(self) -> int:
        """The representative (the rank that was run)."""
        return self.ranks[0]

    def comm_summary(self) -> dict[tuple[tuple[str, ...], str], tuple[int, int]]:
        """``{(axes, op): (count, bytes)}`` of the step's collectives (input bytes, as
        ``comm_log``).

        Example:
            >>> report.classes[0].comm_summary()  # doctest: +SKIP
            {(('dp_shard',), 'all_gather'): (20, 1310720), ...}
        """
        out: dict = {}
        for r in self.collectives:
            n, b = out.get((r.axes, r.op), (0, 0))
            out[(r.axes, r.op)] = (n + 1, b + r.nbytes)
        return out

    def measures(self) -> tuple:
        """Everything but the members: equal for two ranks of one class."""
        return (
            tuple(self.args.items()),
            self.grads,
            self.activations,
            self.peak,
            self.end,
            tuple(self.collectives),
            tuple(sorted((str(k), v) for k, v in self.flops.items())),
            self.bytes_accessed,
            self.kernels,
        )


@dataclass
class DryRunReport:
    """:func:`dry_run`'s result: one :class:`RankClassReport` per class of ranks.

    ``print(report)`` (or ``report.table()``, a ``rich`` table) shows memory, communication,
    FLOPs and the estimate per class.

    Example:
        >>> m = fs.Mesh.abstract((2,), ("x",))
        >>> r = fs.dry_run(fs.gather, lambda m: fs.shard(torch.empty(4, device="meta"), m, fs.P("x")), m)
        >>> [(c.ranks, [x.op for x in c.collectives]) for c in r.classes]
        [((0, 1), ['all_gather'])]
    """

    mesh: Mesh
    classes: list[RankClassReport]
    hardware: Hardware | None = None

    def for_rank(self, rank: int) -> RankClassReport:
        """The class report of global ``rank``.

        Example:
            >>> report.for_rank(17).peak  # doctest: +SKIP
        """
        for c in self.classes:
            if rank in c.ranks:
                return c
        raise ValueError(f"rank {rank} is in no class of this report (ranks were chosen)")

    def table(self) -> Table:
        """The report as a ``rich`` table, one column per rank class."""
        t = Table(title=f"dry run on {self.mesh!r}", show_lines=False)
        t.add_column("per rank")
        for c in self.classes:
            t.add_column(_members(c.ranks), justify="right")
        rows: list[tuple[str, list[str]]] = []
        names = list(dict.fromkeys(k for c in self.classes for k in c.args))
        for k in names:
            rows.append((f"{k} (argument)", [_gib(c.args.get(k, 0)) for c in self.classes]))
        rows.append(("gradients", [_gib(c.grads) for c in self.classes]))
        rows.append(("activations saved for backward", [_gib(c.activations) for c in self.classes]))
        rows.append(("step peak", [_gib(c.peak) for c in self.classes]))
        if self.hardware is not None and self.hardware.memory is not None:
            mem = self.hardware.memory
            rows.append(("device memory free at peak", [_gib(mem - c.peak) for c in self.classes]))
        keys = list(dict.fromkeys(k for c in self.classes for k in c.comm_summary()))
        for axes, op in keys:
            cells = []
            for c in self.classes:
                n, b = c.comm_summary().get((axes, op), (0, 0))
                cells.append(f"{n} x, {_gib(b)}" if n else "-")
            rows.append((f"{op} over {','.join(axes)}", cells))
        dtypes = list(dict.fromkeys(d for c in self.classes for d in c.flops))
        for d in dtypes:
            cells = [f"{c.flops.get(d, 0) / 1e12:.2f}" for c in self.classes]
            rows.append((f"TFLOP ({str(d).removeprefix('torch.')})", cells))
        if any(c.estimate is not None for c in self.classes):
            est = [c.estimate for c in self.classes]
            rows.append(("est. compute (s)", [_s(e and e.compute) for e in est]))
            if any(e and e.launch for e in est):
                rows.append(("  of which kernel latency (s)", [_s(e and e.launch) for e in est]))
            for axes in dict.fromkeys(a for e in est if e for a in e.comm):
                rows.append((f"est. comm over {','.join(axes)} (s)", [_s(e and e.comm.get(axes)) for e in est]))  # fmt: skip
            rows.append(("est. step, no overlap (s)", [_s(e and e.serial) for e in est]))
            rows.append(("est. step, full overlap (s)", [_s(e and e.overlapped) for e in est]))
        for name, cells in rows:
            t.add_row(name, *cells)
        return t

    def __str__(self) -> str:
        buf = io.StringIO()
        Console(file=buf, width=200, force_terminal=False).print(self.table())
        return buf.getvalue()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**26 else f"{n / 2**20:.2f} MiB"


def _s(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _members(ranks: Sequence[int]) -> str:
    """``ranks 0-1016 (1017)`` for a run of consecutive ranks, else the first few."""
    rs = sorted(ranks)
    if rs == list(range(rs[0], rs[-1] + 1)):
        head = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs[0]}-{rs[-1]}"
    else:
        head = "ranks " + ",".join(map(str, rs[:4])) + (",..." if len(rs) > 4 else "")
    return f"{head} ({len(rs)})"


# -- the tracker ---------------------------------------------------------------------------------


class _Tracker(TorchDispatchMode):
    """Live storage bytes (each storage once, freed by a weak-reference finalizer), the peak,
    the live bytes at the first backward op, FLOPs per dtype and bytes accessed."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.in_gc = False  # the cyclic collector is running (gc.callbacks)
        self.seen = WeakIdKeyDictionary()
        self.at_backward: int | None = None
        self.flops: Counter = Counter()
        self.bytes_accessed = 0
        self.kernels = 0
        self.value_reads = 0

    def _free(self, n: int) -> None:
        if not self.in_gc:  # a free by the collector stays counted: see _gc
            self.live -= n

    def _gc(self, phase: str, info) -> None:
        """A ``gc.callbacks`` entry. A storage freed by the cyclic collector (held by a
        reference cycle, or by something a cycle held) is freed whenever the collector
        happens to run: after a number of allocations that depends on the process's history
        (earlier dry runs, ``PYTHONHASHSEED``'s dict and set orders), so counting the free
        there made the peak vary from run to run (issue 38). It stays counted until the
        step ends, as if the collector had not run: the same figure every run, an upper
        bound of the real run's (whose collector may run later still)."""
        self.in_gc = phase == "start"

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self.seen:
            return
        n = st.nbytes()
        self.seen[st] = n
        self.live += n
        weakref.finalize(st, self._free, n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.at_backward is None and torch._C._current_autograd_node() is not None:
            self.at_backward = self.live
        if func is _aten._local_scalar_dense.default and args[0].device.type == "meta":
            return self._read(args[0])
        flat = optree.tree_leaves((args, kwargs))
        if any(_cpu_scalar(t) for t in flat) and any(_on_meta(t) for t in flat):
            # a 0-d CPU tensor meets device tensors as a scalar (as on CUDA); meta's out= copy
            # check refuses it, so it is moved to meta (4 bytes, not counted)
            args, kwargs = optree.tree_map(_to_meta_if_scalar, (args, kwargs), none_is_leaf=True)
        out = func(*args, **kwargs)
        outs = [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            self.add(t)
        if self.live > self.peak:
            self.peak = self.live
        packet = func._overloadpacket
        if packet in flop_registry:
            first = next(
                a for a in optree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
            )
            self.flops[first.dtype] += int(flop_registry[packet](*args, **kwargs, out_val=out))
        if not _is_view(func) and packet not in _UNTOUCHED:
            ins = [a for a in optree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            self.bytes_accessed += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
            self.kernels += 1
        return out

    def _read(self, t: torch.Tensor):
        if t.dtype == torch.bool and t.numel() == 1:
            self.value_reads += 1
            return True
        raise ValueError(
            f"dry_run: the step reads the value of a {t.dtype} tensor of shape {tuple(t.shape)} "
            "(.item(), int(t), a Python branch on it); on meta tensors there is none. Only "
            "boolean reads are answered (True). Make the value static (a Python number), or "
            "keep that computation out of the step"
        )


class _FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on meta tensors as the fused (flash) kernel a device
    runs for a training batch, instead of meta's choice, the math path, which materialises the
    ``seq x seq`` scores (8 GiB per layer for 64 heads at 8192 tokens in bf16). Flash saves the
    output and the log-sum-exp only; its FLOPs are the same formula. On sharded values the
    op's rule calls attention on the local blocks: the mode is re-entered around it (a mode is
    off while it handles a call), so the local call is the one priced as flash."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
            if all(type(t) is torch.Tensor and t.device.type == "meta" for t in (q, k, v)):
                return _flash(q, k, v, *args[3:], **{n: x for n, x in kwargs.items() if n not in ("query", "key", "value")})  # fmt: skip
            if any(isinstance(t, ShardedArray) for t in (q, k, v)):
                with self:
                    return ShardedArray.__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)


def _flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


#: allocations that read and write nothing (not memory traffic)
_UNTOUCHED = frozenset({_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty})


def _cpu_scalar(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "cpu"


def _on_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _to_meta_if_scalar(t):
    return t.to("meta") if _cpu_scalar(t) else t


def _is_view(func) -> bool:
    return bool(func._schema.returns) and func._schema.returns[0].alias_info is not None and not func._schema.returns[0].alias_info.is_write  # fmt: skip


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _locals(tree) -> list[torch.Tensor]:
    leaves = optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ShardedArray))
    out = []
    for x in leaves:
        if isinstance(x, ShardedArray):
            out.append(x.local)
        elif isinstance(x, torch.Tensor):
            out.append(x)
    return out


def _fresh(args: tuple) -> tuple:
    """``args`` with each meta array that views a larger storage (a block sliced from the full
    meta param of a model built on meta) on a storage of its own: on the devices every block is
    materialised in its own memory (``fs.nn.shard_params`` of a meta model, a checkpoint load),
    and a meta storage's size is the bytes the tracker counts."""

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" or t.untyped_storage().nbytes() <= _nbytes(t):
            return t
        return torch.empty_like(t, memory_format=torch.contiguous_format).requires_grad_(
            t.requires_grad
        )

    def leaf(x):
        if isinstance(x, ShardedArray):
            local = own(x.local)
            return x if local is x.local else ShardedArray._raw(local, x.layout)
        return own(x) if isinstance(x, torch.Tensor) else x

    return tuple(optree.tree_map(leaf, a, is_leaf=lambda x: isinstance(x, ShardedArray), none_is_leaf=True) for a in args)  # fmt: skip


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault(st._cdata, st.nbytes())
    return sum(seen.values())


# -- rank classes ----------------------------------------------------------------------------------


def rank_classes(args, mesh: Mesh, distinct_axes: Sequence[str]) -> list[tuple[int, ...]]:
    """The classes of ranks of ``mesh`` that run the same step on the same shapes, in order of
    their lowest rank. Two ranks are in one class when

    1. every ShardedArray in ``args`` has the same local shape on both;
    2. for every dim size ``n > 1`` of the plain tensors in ``args`` (a full batch that the
       step shards, as ``parallelize``'s loss does) and every split the step may cut it by (each
       mesh axis alone, and each axis tuple the arguments' layouts split a dim over) whose
       ranks ``k`` do not divide ``n``, both hold chunks of the same size: whatever the step
       splits that way (the batch inside a loss, a hidden dim), they get equal blocks. A dim
       size the step makes that no plain argument has, or a split over axes that no layout of
       the arguments uses, is not seen (``ranks=`` runs chosen ranks);
    3. they have the same coordinates on ``distinct_axes`` (pipeline stages).

    Example:
        >>> m = fs.Mesh.abstract((3,), ("x",))
        >>> x = fs.shard(torch.empty(5, device="meta"), m.simulate(0), fs.P("x"))
        >>> rank_classes([x], m, ())  # blocks of 2, 2, 1
        [(0, 1), (2,)]
    """
    leaves = optree.tree_leaves(args, is_leaf=lambda x: isinstance(x, ShardedArray))
    layouts = list(dict.fromkeys(x.layout for x in leaves if isinstance(x, ShardedArray)))
    # the dims of plain tensors (a full batch the step shards); a ShardedArray's are rule 1's
    sizes = {n for x in leaves if isinstance(x, torch.Tensor) for n in x.shape}
    combos = {(a,) for a in mesh.axis_names if mesh.size(a) > 1}
    for lay in layouts:
        for axes in getattr(lay, "dim_axes", ()):
            combos.add(tuple(a for a in axes if mesh.size(a) > 1))
    splits = []  # (n, axes) that give some ranks other block sizes
    for combo in sorted(c for c in combos if c):
        count = mesh.size(combo)
        splits += [(n, combo) for n in sorted(sizes) if n > 1 and n % count]
    idx = [mesh.axis_index_of(a) for a in distinct_axes]
    classes: dict = {}
    for r in mesh.ranks:
        coords = mesh.coords(r)
        blocks = []
        for n, combo in splits:
            j, count = chunk_index(mesh, combo, coords)
            lo, hi = chunk_bounds(n, count, j)
            blocks.append(hi - lo)
        key = (
            tuple(coords[i] for i in idx),
            tuple(lay.local_shape(r) for lay in layouts),
            tuple(blocks),
        )
        classes.setdefault(key, []).append(r)
    return sorted((tuple(v) for v in classes.values()), key=lambda c: c[0])


def uneven_splits(args, names: Sequence[str] = ()) -> list[str]:
    """One line per array dim of ``args`` split over axes whose size does not divide it.

    Example:
        >>> m = fs.Mesh.abstract((4,), ("x",)).simulate(0)
        >>> uneven_splits({"w": fs.shard(torch.empty(6, 2, device="meta"), m, fs.P("x"))})
        ["['w']: dim 0 of size 6 split over ('x',) (4 ranks): blocks of 3 x 2, 1 x 0"]
    """
    out = []
    paths, leaves, _ = optree.tree_flatten_with_path(
        args, is_leaf=lambda x: isinstance(x, ShardedArray)
    )
    for path, x in zip(paths, leaves):
        lay = getattr(x, "layout", None)
        dim_axes = getattr(lay, "dim_axes", None)
        if dim_axes is None:
            continue
        for d, axes in enumerate(dim_axes):
            if not axes:
                continue
            k = lay.mesh.size(axes)
            n = lay.shape[d]
            if n % k:
                c = -(-n // k)
                blocks = Counter(max(0, min(c, n - j * c)) for j in range(k))
                sizes = [f"{count} x {b}" for b, count in sorted(blocks.items(), reverse=True)]
                where = list(path) if not names else [names[path[0]], *path[1:]]
                out.append(
                    f"{where}: dim {d} of size {n} split over {tuple(axes)} ({k} ranks): blocks "
                    f"of {', '.join(sizes)}"
                )
    return out


# -- the dry run -----------------------------------------------------------------------------------


def dry_run(
    step: Callable,
    init: Callable[[Mesh], Sequence],
    mesh: Mesh,
    *,
    ranks: Sequence[int] | None = None,
    hardware: Hardware | None = None,
    backend: str = "nccl",
    distinct_axes: Sequence[str] | None = None,
    uneven: str = "allow",
    attention: str = "flash",
) -> DryRunReport:
    """Run ``step(*init(mesh))`` on an abstract ``mesh`` of any size, once per class of ranks,
    with meta tensors: per class, the bytes of params, gradients and optimizer state, the
    activations saved for the backward, the step's peak, every collective with its bytes, the
    FLOPs, and with ``hardware`` a step-time estimate and a memory check.

    How, and what each figure means: the module docstring of ``fshard.dryrun``.

    Args:
        step: the user's training step, called as ``step(*init(m))`` (forward, backward, the
            optimizer update); its return value is dropped.
        init: ``init(m)`` builds the step's arguments on the mesh ``m`` it is given (a simulated
            rank of ``mesh``: create the model under ``torch.device("meta")``, shard and
            initialise as the real script does); returns a tuple (or one value).
        mesh: an abstract mesh (``Mesh.abstract``, ``ParallelDims.abstract_mesh()``).
        ranks: run exactly these ranks (each its own class) instead of one per class.
        hardware: a :class:`Hardware`: with ``flops``, estimate the step time; with
            ``memory``, raise :class:`OutOfMemoryError` naming the classes whose peak does not
            fit.
        backend: whose collective lowering the simulated wire follows (``"nccl"``, ``"gloo"``).
        distinct_axes: axes whose coordinate separates classes (default: those named ``"pp"``).
        uneven: ``"allow"`` (fshard splits unevenly: extra classes) or ``"error"``: a
            ``ValueError`` before any step runs, naming each array dim its axes do not divide.
        attention: ``"flash"`` (default): ``F.scaled_dot_product_attention`` is priced as the
            fused kernel that CUDA and CPU pick for an unmasked (causal) training batch, which
            saves no ``seq x seq`` scores; ``"math"``: as meta tensors run it (the scores
            materialised, what a masked batch on some backends runs).

    Returns:
        A :class:`DryRunReport` (``print(report)`` shows the table).

    Raises:
        TypeError / ValueError: bad arguments; ``mesh`` not abstract; an uneven split with
            ``uneven="error"``; a step that failed on a class (the class's ranks named and the
            cause chained); a step reading a non-boolean value.
        OutOfMemoryError: with ``hardware.memory``, a class whose peak exceeds it.

    Example:
        >>> mesh = fs.Mesh.abstract((1024,), ("dp",))
        >>> def init(m):  # a replicated weight, a batch of 4096 rows split over 1,024 ranks
        ...     w = fs.shard(torch.empty(64, 64, device="meta"), m, fs.P())
        ...     return w, fs.shard(torch.empty(4096, 64, device="meta"), m, fs.P("dp"))
        >>> def step(w, x):
        ...     return fs.value_and_grad(lambda w: torch.tanh(x @ w).sum())(w)
        >>> (c,) = fs.dry_run(step, init, mesh).classes
        >>> len(c.ranks), c.args, c.flops  # forward and backward matmuls of 4 x 64 x 64
        (1024, {'w': 16384, 'x': 1024}, {torch.float32: 65536})
    """
    if not callable(step):
        raise TypeError(f"dry_run: step must be callable, got {type(step).__name__}")
    if not callable(init):
        raise TypeError(f"dry_run: init must be callable (init(mesh) -> args), got {type(init).__name__}")  # fmt: skip
    if not isinstance(mesh, Mesh) or not mesh.is_abstract:
        raise ValueError(
            f"dry_run: mesh must be an abstract fshard.Mesh (Mesh.abstract(shape, names) or "
            f"ParallelDims.abstract_mesh()), got {mesh!r}"
        )
    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(f"dry_run: hardware must be a fshard.Hardware, got {type(hardware).__name__}")  # fmt: skip
    if attention not in ("flash", "math"):
        raise ValueError(f"dry_run: attention must be 'flash' or 'math', got {attention!r}")
    if uneven not in ("allow", "error"):
        raise ValueError(f"dry_run: uneven must be 'allow' or 'error', got {uneven!r}")
    if distinct_axes is None:
        distinct_axes = tuple(a for a in mesh.axis_names if a == "pp")
    distinct_axes = mesh.axes_tuple(distinct_axes)
    if ranks is not None:
        ranks = [_check_rank(r, mesh) for r in ranks]
        if not ranks:
            raise ValueError("dry_run: ranks is empty; give at least one rank, or None for all")
    names = _arg_names(step)
    first = ranks[0] if ranks is not None else mesh.ranks[0]
    args0 = None
    if ranks is None or uneven == "error":
        args0 = _as_args(init(mesh.simulate(first, backend)))
        if uneven == "error":
            bad = uneven_splits(args0, _labels(names, len(args0)))
            if bad:
                raise ValueError(
                    f"dry_run: uneven='error' and {len(bad)} array dims are not divided evenly by "
                    "the mesh axes splitting them:\n  " + "\n  ".join(bad)
                )
        classes = rank_classes(args0, mesh, distinct_axes) if ranks is None else None
    if ranks is not None:
        classes = [(r,) for r in ranks]
    reports = []
    for c in classes:  # the first class's representative is `first`: its arguments are built
        built = args0 if c[0] == first and ranks is None else None
        args0 = None
        reports.append(_run_class(step, init, mesh, c, names, backend, attention, built))
    report = DryRunReport(mesh, reports, hardware)
    if hardware is not None:
        if hardware.flops:  # the estimate needs the peaks; a memory-only Hardware checks memory
            for c in reports:
                c.estimate = estimate(c, mesh, hardware)
        _check_memory(report)
    return report


def _check_rank(r, mesh: Mesh) -> int:
    if isinstance(r, bool) or not isinstance(r, int) or r not in mesh.ranks:
        raise ValueError(f"dry_run: ranks must be ranks of {mesh!r} (0..{mesh.size_total - 1}), got {r!r}")  # fmt: skip
    return r


def _arg_names(step) -> list[str] | None:
    try:
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return [p.name for p in params]


def _labels(names, n: int) -> list[str]:
    if names is None or len(names) < n:
        return [f"argument {i}" for i in range(n)]
    return names[:n]


def _as_args(args) -> tuple:
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)


def _run_class(
    step, init, mesh: Mesh, members, names, backend: str, attention: str, built=None
) -> RankClassReport:
    """Run ``members[0]``'s step (on ``built``, its arguments, when given)."""
    rank = members[0]
    sim = mesh.simulate(rank, backend)
    tracker = _Tracker()
    attention_mode = _FusedAttention if attention == "flash" else contextlib.nullcontext
    args = _fresh(built if built is not None else _as_args(init(sim)))
    labels = _labels(names, len(args))
    per_arg = {labels[i]: _storage_bytes(_locals(a)) for i, a in enumerate(args) if _locals(a)}
    params = _locals(args[0]) if args else []
    grads = sum(_nbytes(t) for t in params if t.dtype.is_floating_point or t.dtype.is_complex)
    for t in (t for a in args for t in _locals(a)):
        tracker.add(t)
    start = tracker.live
    tracker.peak = start
    gc.callbacks.append(tracker._gc)
    try:
        with comm_log() as log, attention_mode(), tracker:
            out = step(*args)
            end = tracker.live
            del out
    except Exception as e:
        raise ValueError(
            f"dry_run: the step failed on rank {rank} (class {_members(members)}) of {mesh!r}: "
            f"{type(e).__name__}: {e}"
        ) from e
    finally:
        gc.callbacks.remove(tracker._gc)
        tracker.in_gc = False
    activations = 0 if tracker.at_backward is None else tracker.at_backward - start
    return RankClassReport(
        ranks=tuple(members),
        args=per_arg,
        grads=grads,
        activations=activations,
        peak=tracker.peak,
        end=end,
        collectives=list(log),
        flops=dict(tracker.flops),
        bytes_accessed=tracker.bytes_accessed,
        value_reads=tracker.value_reads,
        kernels=tracker.kernels,
    )


# -- the estimate and the memory check -------------------------------------------------------------

#: bytes received per rank per input byte, axis of n ranks (DESIGN §5)
_TRAFFIC = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "ppermute": lambda n: 1.0,
    "scatter": lambda n: 1.0 / n,
    "gather": lambda n: 1.0,
    "size_exchange": lambda n: n - 1,
}


def estimate(c: RankClassReport, mesh: Mesh, hardware: Hardware) -> Estimate:
    """The roofline estimate of class ``c`` on ``hardware`` (see the module docstring).

    Example:
        >>> estimate(report.classes[0], mesh, fs.Hardware(flops={torch.float32: 1e12}))  # doctest: +SKIP
    """
    compute = 0.0
    for dtype, n in c.flops.items():
        peak = hardware.flops.get(dtype)
        if peak is None:
            raise ValueError(
                f"dry_run: the step computes {n:.3g} FLOPs in {dtype}, but hardware.flops gives "
                f"none for it (given: {sorted(map(str, hardware.flops))}); add its peak FLOP/s"
            )
        compute += n / peak
    if hardware.mem_bw:
        compute = max(compute, c.bytes_accessed / hardware.mem_bw)
    launch = c.kernels * hardware.kernel_latency
    compute += launch
    comm: dict = {}
    for r in c.collectives:
        bw = [hardware.axis_bw.get(a) for a in r.axes]
        if any(b is None for b in bw):
            missing = [a for a, b in zip(r.axes, bw) if b is None]
            raise ValueError(
                f"dry_run: the step runs {r.op} over mesh axes {r.axes}, but hardware.axis_bw "
                f"gives no bandwidth for {missing} (given: {sorted(hardware.axis_bw)})"
            )
        n = mesh.size(r.axes)
        alpha = max(hardware.axis_latency.get(a, 0.0) for a in r.axes)
        comm[r.axes] = comm.get(r.axes, 0.0) + alpha + _TRAFFIC[r.op](n) * r.nbytes / min(bw)
    total = sum(comm.values())
    return Estimate(compute, comm, compute + total, max(compute, total), launch)


def _check_memory(report: DryRunReport) -> None:
    mem = report.hardware.memory
    if mem is None:
        return
    over = [c for c in report.classes if c.peak > mem]
    if not over:
        return
    lines = []
    for c in over:
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in c.args.items())
        lines.append(
            f"{_members(c.ranks)}: step peak {_gib(c.peak)} exceeds {_gib(mem)} by "
            f"{_gib(c.peak - mem)} (arguments: {parts}; gradients {_gib(c.grads)}; activations "
            f"saved for backward {_gib(c.activations)})"
        )
    raise OutOfMemoryError(
        f"dry_run: {len(over)} rank class(es) of {report.mesh!r} need more than the "
        f"{_gib(mem)} of device memory:\n  " + "\n  ".join(lines),
        report,
    )
