"""Consistency checks: ranks that disagree get one clear error instead of wrong values or a hang.

The most common SPMD bug is ranks that disagree: a different global shape or spec in
``from_local`` (per-rank batch sizes), ``psum`` on one rank and ``pmax`` on another, a
collective skipped on one rank, float32 against int32, per-rank seeds before a replicated
``fs.randn``. Collectives do not notice (Gloo pairs whatever arrives, reinterprets bits, or
aborts the process). Three modes (``fs.config.check_consistency``, the
``fs.config.consistency(mode)`` context manager, or ``FSHARD_CHECK_CONSISTENCY``):

``"default"`` (on unless turned off)
    Every collective folds its description (op, mesh axes, dtype, the shapes every rank must
    share, chunk sizes) and its call site (module, line and function of the first frame outside
    fshard and torch) into a running digest of its process group: a deterministic BLAKE2/
    multiply-xor hash, cached per description and per call site, so a collective costs about a
    microsecond and no communication. The digest is exchanged (one ``all_reduce(MAX)`` of four
    int64 words ``h, -h, seq, -seq``) at a group's first collective, at every
    ``fs.config.consistency_interval``-th, at every call of the entry points that create
    layouts or touch files (checkpoint save/load, ``from_local``, ``shard``, creation
    functions, ``shard_map``), which also compare their own arguments, and at the boundaries a
    training loop crosses every step (:func:`boundary`: ``fs.optim.step``, ``fs.gather(dst=)``)
    at their 1st, 2nd, 4th, ... crossing up to ``fs.config.consistency_boundary_interval`` (64)
    and every 64th after; the other crossings fold into the digest. A disagreement is caught
    at the next exchange, naming the first collective or argument that differed; collectives
    issued in between may have moved mismatched data (a size or dtype mismatch there can still
    abort Gloo or time out first: use ``"every"`` to find it).
    A boundary over a mesh compares the digest of each of its sub-groups (the ``x`` groups of
    an ``("x", "y")`` mesh) among that group's members only, a ``(d, -d)`` pair per
    sub-group in the same all_reduce (a fixed room of 32 pairs, kinds x group size; a second
    small all_reduce where they do not fit): sibling groups of a correct program legitimately
    differ (an uneven split gives their blocks different shapes); across groups only the kinds
    of sub-groups used are compared.
``"every"`` (strict; the test suite's fault tests)
    The digest of each collective is exchanged before it runs: the error is raised before any
    mismatched data moves, including mismatches that would abort Gloo.
``"off"``
    No checks.

A plain tensor that meets ShardedArrays in an op claims to be replicated (the op treats it as
``P()``): :func:`check_replicated` compares its content hash over the mesh the first time per call
site, op and input (default) or at every call (``"every"``), so a per-rank batch passed as a plain
tensor raises instead of giving unreduced gradients.

On a mismatch, and only then, the ranks exchange readable descriptions and every rank raises the
same :class:`ConsistencyError` naming each rank's view and the fields that differ. The exchange is
a fixed-size int64 message, so it cannot itself be corrupted by the disagreement it detects. No
mode turns a rank that never reaches the next collective into an error: the others wait for it
until the process group's timeout. Cost: ``benchmarks/consistency.py``.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("x",))
    >>> with fs.config.consistency("every"):  # raises ConsistencyError if ranks disagree
    ...     y = fs.lax.psum(torch.ones(2), "x", mesh=mesh)
    >>> y
    tensor([2., 2.])
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import config
from ._function import plain
from .mesh import AxisGroup, Mesh
from .spec import PartitionSpec, Parts

__all__ = [
    "ConsistencyError",
    "enabled",
    "boundary",
    "check_collective",
    "check_equal",
    "check_replicated",
    "reset",
    "Static",
    "wait_pending",
]

_MASK = (1 << 62) - 1
_MIX = 0x9E3779B97F4A7C15
_SHOWN = 4  # differing fields shown in an error (the first is where the ranks parted)


class ConsistencyError(RuntimeError):
    """The ranks of a group disagreed about a collective or a value (raised on every rank)."""


class _Running:
    """This rank's running digest of one process group (default mode)."""

    __slots__ = ("axes", "ranks", "kind", "digest", "seq", "exchanged", "history")

    def __init__(self, g: AxisGroup):
        self.axes, self.ranks = g.axes, frozenset(g.ranks)
        # Its kind: the axes and the members' offsets from the lowest, which sibling groups of
        # one mesh share and groups of two meshes over the same axis names need not (the dp
        # groups of a ("dp", "tp") and of a ("tp", "dp") mesh). Kind and lowest rank name one
        # member set: its slot in the sub-group exchange (_slot).
        low = min(self.ranks)
        self.kind = (self.axes, tuple(sorted(r - low for r in self.ranks)))
        self.digest, self.seq, self.exchanged = 0, 0, False
        self.history: list = []  # (seq, description, site) since the last exchange

    def key(self) -> tuple:
        return (self.axes, len(self.ranks), self.seq, self.digest)


_SEQ: dict = {}  # process group -> exchanges issued on it by this rank ("every" mode)
_RUNNING: dict = {}  # process group -> _Running
_CROSSED: dict = {}  # (process group, boundary) -> times this rank crossed it (default mode)
_CLAIMED: set = set()  # (call site, mesh, op, input) whose plain tensor was checked (default)
_SETTLED: set = set()  # process groups whose digests a settle() compared and cleared
_PENDING: list = []  # deferred checks' verdicts, their exchanges in flight (check_equal(defer=))


def enabled() -> bool:
    """Whether consistency checks run in this context (see :mod:`fshard.config`). Graph
    tracing (``torch.compile``, ``make_fx``) runs no checks: they would be traced, not run."""
    return (
        not torch.compiler.is_compiling()  # first: dynamo cannot trace the ContextVar read
        and config.consistency_checked()
        and get_proxy_mode() is None
    )


def _active_mode() -> str:
    """The mode in this context, once the verdicts of deferred checks in flight are taken:
    every entry point asks it first (:func:`check_collective` before each data collective),
    so a deferred check is decided before any collective or check that follows it."""
    if _PENDING:
        wait_pending()
    if torch.compiler.is_compiling() or get_proxy_mode() is not None:
        return "off"
    return config.consistency_mode()


def wait_pending() -> None:
    """Take the verdicts of the checks deferred by ``check_equal(..., defer=True)``: wait for
    their exchanges and raise :class:`ConsistencyError` (on every rank of their groups) where
    the ranks disagreed. Runs by itself before the next collective or check; a caller that
    deferred a check calls it where it may leave without one (its ``finally``), so no rank
    returns, or raises an error of its own, with a verdict its peers take.

    Example:
        >>> consistency.wait_pending()  # doctest: +SKIP
    """
    while _PENDING:
        _PENDING.pop(0)()


def reset() -> None:
    """Forget the sequence numbers and running digests (``fs.launch`` does this before every
    run, so a run that failed on some ranks leaves nothing behind)."""
    _PENDING.clear()
    _SEQ.clear()
    _RUNNING.clear()
    _CROSSED.clear()
    _CLAIMED.clear()
    _SETTLED.clear()


#: types ``_canonical`` returns as they are, found by one set lookup (the isinstance checks,
#: ``Mapping``'s an ABC's, cost more than the rest of a shard_map signature's hash)
_ATOMS = frozenset({str, int, float, bool, type(None), torch.dtype})


class Static:
    """A value a check compares that holds no tensor (atoms, tuples, specs, dtypes: what a call
    signature is made of), hashable: hashed once per distinct value (cached), not walked at
    every check, as a shard_map call's signature is the same every step. Shown as the value.

    Example:
        >>> sig = Static(("ShardedArray", "P('x')", (4, 2)))  # doctest: +SKIP
        >>> consistency.check_equal({"call": sig}, mesh, what="f")  # doctest: +SKIP
    """

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _canonical(obj):
    """A deterministic, repr-able stand-in for ``obj`` (tensors by dtype, shape and bytes; a
    :class:`~fshard.P` and a :class:`~fshard.Parts` by their value, as they compare:
    ``P('x')`` and ``P('x', None)`` are one spec, which ranks may spell either way)."""
    kind = type(obj)
    if kind in _ATOMS:
        return obj
    if kind is dict:  # before Mapping's isinstance, an ABC's (a check's fields)
        return ("dict", tuple((repr(k), _canonical(v)) for k, v in obj.items()))
    if kind is tuple or kind is list:
        return (kind.__name__, tuple(_canonical(v) for v in obj))
    if kind is PartitionSpec:
        return ("P", obj.dims, tuple(sorted(obj.partial)))
    if kind is Parts:
        return ("Parts", _canonical(obj.spec), obj.dim, obj.sizes)
    if kind is Static:
        try:
            return ("static", _cached_hash(obj.value))
        except TypeError:  # an unhashable part (a list): walked, as any value
            return ("static", _hash(obj.value))
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
        t = plain(t)
        if t.is_meta:  # no data: its dtype and shape (hashed with it) are all there is
            return "meta"
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


@functools.lru_cache(maxsize=4096)
def _cached_hash(fields: tuple) -> int:
    return _hash(fields)


def _fold(digest: int, h: int) -> int:
    """The running digest after ``h`` (order-sensitive, deterministic on every rank)."""
    return ((digest ^ h) * _MIX + 1) & _MASK


_SKIP_PREFIXES = ("fshard.", "torch.", "contextlib", "functools")
# module name -> whether its frames are library frames. Keyed by the name (a str: its hash is
# cached), not the code object, whose hash is recomputed at every lookup (its constants,
# names and line table): the walk passes 20-27 frames a collective in a pipeline's step
_SKIP: dict = {}


def _site() -> tuple:
    """``(module, line, function)`` of the first frame outside fshard and torch: where the
    user's code issued the call (the same on every rank running the same program)."""
    f = sys._getframe(2)
    skips = _SKIP
    while f is not None:
        name = f.f_globals.get("__name__", "")
        skip = skips.get(name)
        if skip is None:
            skip = name == "fshard" or name == "torch" or name.startswith(_SKIP_PREFIXES)
            if len(skips) < 65536:
                skips[name] = skip
        if not skip:
            return (f.f_globals.get("__name__", "?"), f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return ("?", 0, "?")


def _where(site: tuple) -> str:
    return f"{site[0]}:{site[1]} in {site[2]}"


def _world_group() -> AxisGroup:
    n, me = dist.get_world_size(), dist.get_rank()
    ranks = tuple(range(n))
    return AxisGroup(("<world>",), dist.group.WORLD, n, me, ranks, ranks)


def _device(group: AxisGroup) -> torch.device:
    if dist.get_backend(group.pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(
    g: AxisGroup, h: int, seq: int, device: torch.device | None, extra: list = ()
) -> tuple:
    """One ``all_reduce(MAX)`` of ``h, -h, seq, -seq`` and ``extra`` (more int64 words, as many
    on every rank of ``g``), launched: ``(words, work)``, for :func:`_exchanged`."""
    words = torch.tensor([h, -h, seq, -seq, *extra], dtype=torch.int64, device=device or _device(g))
    return words, dist.all_reduce(words, dist.ReduceOp.MAX, group=g.pg, async_op=True)


def _exchanged(words: torch.Tensor, work) -> tuple[bool, list]:
    """:func:`_exchange`'s result: ``(whether every rank of g holds both h and seq, the reduced
    extra words)``."""
    work.wait()
    top = words.tolist()
    return top[0] == -top[1] and top[2] == -top[3], top[4:]


def _raise(what: str, g: AxisGroup, mine: dict, note: str = "") -> None:
    views: list = [None] * g.size
    dist.all_gather_object(views, (dist.get_rank(), {"check": what, **mine}), group=g.pg)
    raise ConsistencyError(_message(views, note))


def _agree(g: AxisGroup, what: str, fields: dict, device: torch.device | None = None) -> None:
    """Raise :class:`ConsistencyError` on every rank of ``g`` unless all hold equal ``fields``."""
    seq = _SEQ.get(g.pg, 0)
    _SEQ[g.pg] = seq + 1
    if _exchanged(*_exchange(g, _hash(tuple(fields.items())), seq, device))[0]:
        return
    mine = {**{k: _show(v) for k, v in fields.items()}, "sequence number": seq}
    _raise(what, g, mine, "no data collective ran")


def _message(views: list, note: str) -> str:
    views = sorted(views)
    whats = {v["check"] for _, v in views}
    what = whats.pop() if len(whats) == 1 else "different checks on different ranks"
    keys = list(dict.fromkeys(k for _, v in views for k in v))
    differ = [k for k in keys if len({v.get(k, "<missing>") for _, v in views}) > 1]
    lines = [
        f"fshard consistency check failed at {what}: the {len(views)} ranks of the group "
        f"(global ranks {[r for r, _ in views]}) disagree on {', '.join(differ[:_SHOWN])}."
    ]
    for k in differ[:_SHOWN]:
        per = "; ".join(f"rank {r}: {v.get(k, '<missing>')}" for r, v in views)
        lines.append(f"  {k}: {per}")
    if len(differ) > _SHOWN:
        lines.append(f"  (and {len(differ) - _SHOWN} more after these)")
    lines.append(
        "Every rank must issue the same collectives, in the same order, from the same lines, on "
        "values with the same layout, global shape and dtype (and replicated inputs must be "
        "equal). Look for a branch on the rank, a per-rank seed, shape or batch size, or a "
        f"collective one rank skips. (Raised on every rank by fs.config.check_consistency; {note}.)"
    )
    return "\n".join(lines)


# -- the default mode: running digests -------------------------------------------------------


def _running(g: AxisGroup) -> _Running:
    r = _RUNNING.get(g.pg)
    if r is None:
        r = _RUNNING[g.pg] = _Running(g)
        # a group settle() compared already is not new: its next collective is not its first
        # (each step of a pipeline's stage re-exchanged there, once a step, after the settle)
        r.exchanged = g.pg in _SETTLED
    return r


def _describe(entry: tuple) -> str:
    seq, (op, axes, dtype, fields), site = entry
    args = "".join(f", {k}={v!r}" for k, v in fields)
    return f"#{seq} {op} over {axes} ({dtype}{args}) at {_where(site)}"


def _history_views(states: list) -> dict:
    """Readable history of each group since its last exchange (sent only on a mismatch), and
    its running digest: ranks whose histories since then look alike still differ there (the
    difference is older than the last exchange that saw it)."""
    out = {}
    for r in sorted(states, key=_Running.key):
        for entry in r.history:
            out[f"collective #{entry[0]} over {r.axes}"] = _describe(entry)
        out[f"collectives issued over {r.axes}"] = str(r.seq)
        out[f"running digest over {r.axes}"] = f"{r.digest:016x}"
    return out


def _collective_default(op: str, g: AxisGroup, t: torch.Tensor, fields: dict) -> None:
    desc = (op, g.axes, t.dtype, tuple(fields.items()))
    try:
        h = _cached_hash(desc)
    except TypeError:  # an unhashable field (a list of sizes)
        desc = (op, g.axes, t.dtype, tuple((k, _canonical(v)) for k, v in fields.items()))
        h = _cached_hash(desc)
    _fold_event(g, desc, h, "collective", t.device)


def _fold_event(g: AxisGroup, desc: tuple, h: int, kind: str, device=None) -> None:
    """Fold the event ``desc`` (``(name, axes, dtype, fields)``, hashed to ``h``) and its call
    site into ``g``'s running digest; exchange at the group's first event and every
    ``consistency_interval``-th."""
    site = _site()
    r = _running(g)
    r.digest = _fold(_fold(r.digest, h), _cached_hash(site))
    r.seq += 1
    r.history.append((r.seq, desc, site))
    if not r.exchanged or r.seq % max(1, int(config.consistency_interval)) == 0:
        what = f"{desc[0]} over mesh axes {g.axes} ({kind} #{r.seq} on the group)"
        _check_running(g, what, [r], 0, {}, device)


def _check_running(
    g: AxisGroup, what: str, states: list, h: int, fields: dict, device=None, defer=False
) -> None:
    """Exchange ``h`` (the boundary's own arguments) with the running digests of ``states``
    over ``g``; on success they are settled (history cleared).

    Ranks compare what they must agree on: the digests of the groups spanning all of ``g``
    (with the set of sub-group kinds every rank used) and, when there are sub-groups (the
    ``x`` groups of an ``("x", "y")`` mesh), each sub-group's digest among its own members
    only, in one exchange (a second where the sub-groups do not fit its room): two
    sub-groups of a correct SPMD program legitimately differ (an uneven split gives their
    blocks different shapes). With ``defer`` the exchange is launched and its verdict taken
    before this process's next collective or check (:func:`wait_pending`)."""
    states = sorted(states, key=_Running.key)
    whole = frozenset(g.ranks)
    subs = [r for r in states if r.ranks != whole]
    kinds = sorted({r.kind for r in subs})
    total = _fold(h, _cached_hash(tuple(kinds)))
    for r in states:
        if r.ranks == whole:
            total = _fold(total, _cached_hash(r.key()))
    seq = _SEQ.get(g.pg, 0)
    _SEQ[g.pg] = seq + 1
    # The sub-groups' words ride in the same all_reduce where there is room for them (a size
    # fixed by the group's size alone, so every rank sends as many words whatever it used):
    # the kinds are in ``total``, so when it agrees every rank laid its words out alike. Was a
    # second all_reduce at every check with sub-groups (a pipeline's step: its pp groups',
    # every step, at its shard_map's check)
    room = _MERGED_PAIRS // g.size
    merged = len(kinds) <= room
    extra, slots = [_ABSENT] * (2 * room * g.size), {}
    if merged:
        extra, slots = _subgroup_words(g, kinds, subs, extra)
    launched = _exchange(g, total, seq, device, extra)

    def verdict() -> None:
        same, top = _exchanged(*launched)
        if not same:
            mine = {k: _show(v) for k, v in fields.items()}
            mine.update(_history_views([r for r in states if r.ranks == whole]))
            mine["sub-group kinds used"] = str(kinds)
            mine["checks on the group"] = str(seq)
            _raise(what, g, mine, "the first line that differs is where the ranks parted")
        if subs:
            if merged:
                _subgroup_verdict(g, what, top, kinds, slots, fields)
            else:
                _check_subgroups(g, what, subs, kinds, fields, device)
        for r in states:
            r.exchanged, r.history = True, []

    if defer:
        _PENDING.append(verdict)
    else:
        verdict()


_ABSENT = -(1 << 63)  # a slot this rank is not a member of (below every digest word)
#: the sub-group word pairs a check's one all_reduce carries at most (kinds x group size)
_MERGED_PAIRS = 32


def _slot(g: AxisGroup, kinds: list, r: _Running) -> int:
    """The word pair of sub-group ``r`` in the exchange over ``g``: by its kind and its
    lowest rank's position in ``g`` (the same on every member, distinct for its siblings)."""
    return kinds.index(r.kind) * g.size + g.ranks.index(min(r.ranks))


def _subgroup_words(g: AxisGroup, kinds: list, subs: list, words: list) -> tuple[list, dict]:
    """``words`` (``_ABSENT`` throughout) with a ``(d, -d)`` pair per sub-group this rank is a
    member of, ``d`` its digest, at its slot; and ``{slot: its sub-groups}``."""
    mine: dict = {}
    for r in subs:
        i = _slot(g, kinds, r)
        mine.setdefault(i, []).append(r)
    for i, rs in mine.items():
        d = 0
        for r in rs:
            d = _fold(d, _cached_hash(r.key()))
        words[2 * i], words[2 * i + 1] = d, -d
    return words, mine


def _check_subgroups(g: AxisGroup, what: str, subs: list, kinds: list, fields: dict, device):
    """One ``all_reduce(MAX)`` over ``g`` of a ``(d, -d)`` pair per sub-group: every member
    writes its digest ``d`` in its group's pair, the others a word below every digest; a pair
    whose maximum is not ``(d, -d)`` is a sub-group whose members disagree."""
    words, mine = _subgroup_words(g, kinds, subs, [_ABSENT] * (2 * len(kinds) * g.size))
    words = torch.tensor(words, dtype=torch.int64, device=device or _device(g))
    dist.all_reduce(words, dist.ReduceOp.MAX, group=g.pg)
    _subgroup_verdict(g, what, words.tolist(), kinds, mine, fields)


def _subgroup_verdict(g: AxisGroup, what: str, top: list, kinds: list, mine: dict, fields: dict):
    """Raise :class:`ConsistencyError` on every rank of ``g`` if a pair of the reduced
    sub-group words ``top`` shows members that disagree (naming the first such sub-group)."""
    pairs = range(len(top) // 2)
    bad = [i for i in pairs if top[2 * i] != _ABSENT and top[2 * i] != -top[2 * i + 1]]
    if not bad:
        return
    first = bad[0]
    view = {k: _show(v) for k, v in fields.items()}
    view.update(_history_views(mine.get(first, [])))
    view["sub-group"] = str(first) if first in mine else "-"
    views: list = [None] * g.size
    dist.all_gather_object(views, (dist.get_rank(), {"check": what, **view}), group=g.pg)
    members = [
        (rank, {k: v for k, v in view.items() if k != "sub-group"})
        for rank, view in views
        if view.get("sub-group") == str(first)
    ]
    axes = kinds[first // g.size][0]
    raise ConsistencyError(
        _message(
            members,
            f"compared within the group over mesh axes {axes} (its sibling groups may "
            "legitimately differ); the first line that differs is where the ranks parted",
        )
    )


def _as_group(group) -> AxisGroup:
    if isinstance(group, Mesh):
        return group.group(group.axis_names)
    if group is None:
        return _world_group()
    if not isinstance(group, AxisGroup):
        raise TypeError(
            f"consistency: group must be a fshard.Mesh, an AxisGroup or None, got "
            f"{type(group).__name__}"
        )
    return group


def _within(g: AxisGroup) -> list:
    """The running digests of the groups inside ``g``'s ranks (the same groups, by axes, on
    every rank of ``g`` when they run the same program)."""
    ranks = frozenset(g.ranks)
    return [r for r in _RUNNING.values() if r.ranks <= ranks]


def _boundary(
    g: AxisGroup, what: str, fields: dict, site: tuple, running: bool = True, defer=False
) -> None:
    h = _hash((tuple(fields.items()), site))
    states = _within(g) if running else []
    _check_running(g, what, states, h, {**fields, "called at": _where(site)}, defer=defer)


def _due(n: int) -> bool:
    """Whether the ``n``-th crossing (from 1) of a recurring boundary exchanges: crossings 1, 2,
    4, 8, ... up to ``consistency_boundary_interval``, then every ``interval``-th."""
    k = max(1, int(config.consistency_boundary_interval))
    return n % k == 0 if n > k else n & (n - 1) == 0


def _recurring(g: AxisGroup, what: str, fields: dict, site: tuple) -> None:
    """A boundary crossed every step: exchange when :func:`_due`, else fold the crossing (its
    name, fields and call site) into the group's running digest, compared at the next exchange."""
    key = (g.pg, what)
    n = _CROSSED[key] = _CROSSED.get(key, 0) + 1
    if _due(n):
        _boundary(g, what, fields, site)
        return
    desc = (what, g.axes, None, tuple((k, _canonical(v)) for k, v in fields.items()))
    r = _running(g)
    r.digest = _fold(_fold(r.digest, _cached_hash(desc)), _cached_hash(site))
    r.seq += 1
    r.history.append((r.seq, desc, site))


# -- entry points ------------------------------------------------------------------------------


def check_collective(op: str, g: AxisGroup, t: torch.Tensor, **fields) -> None:
    """Before data collective ``op`` on ``g``: fold it into the group's digest (default mode)
    or check now that every rank issues the same one (``"every"``).

    ``fields`` are what must agree across the group besides ``op``, the axes and ``t``'s dtype
    (e.g. the shape every rank passes, the global chunk sizes). No-op when checks are off, on
    one rank and on a simulated group (``Mesh.simulate``: one rank alone, nobody to agree with).
    """
    if g.size == 1 or g.simulated:
        return
    mode = _active_mode()
    if mode == "default":
        _collective_default(op, g, t, fields)
    elif mode == "every":
        site = _site()
        described = {"collective": op, "mesh axes": g.axes, "dtype": t.dtype, **fields}
        described["called at"] = _where(site)
        _agree(g, f"a collective over mesh axes {g.axes}", described, t.device)


def check_draw(
    g: AxisGroup, device: torch.device, what: str, generator: torch.Generator | None = None
) -> None:
    """Before a random draw every rank of ``g`` must make alike: an op rule that draws a whole
    tensor on every rank and keeps its block (``dropout``'s mask on a value replicated over
    ``g``'s axes) gives one value only where the ranks' default generators of ``device`` are in
    one state. With per-rank seeds (``torch.manual_seed(seed + rank)``, as data-parallel scripts
    set them) each rank would apply its own mask to the one value it holds: ranks that silently
    disagree on a replicated value (``generator``: that one's state, else the device default's).
    Default mode: the generator's state is folded into ``g``'s
    running digest (no communication; compared at the group's next exchange, its first use
    included, naming this draw); ``"every"``: compared now. No-op when checks are off, on one
    rank and on a simulated group.

    Example:
        >>> consistency.check_draw(mesh.group("tp"), torch.device("cpu"), "dropout")  # doctest: +SKIP
    """
    if g.size == 1 or g.simulated:
        return
    mode = _active_mode()
    if mode == "off":
        return
    state = _content_hash(rng_state(generator, device))
    if mode == "every":
        _agree(g, f"{what}: the generator state every rank draws from", {"rng": state})
        return
    desc = (what, g.axes, None, (("generator state", state),))
    _fold_event(g, desc, _hash(desc), "event")  # a state: hashed, not cached


def boundary(group: Mesh | AxisGroup | None, what: str, **fields) -> None:
    """A boundary a training loop crosses every step (``fs.optim.step``, ``fs.gather(dst=)``): in
    the default mode, at its 1st, 2nd, 4th, ... crossing up to
    ``fs.config.consistency_boundary_interval`` and every ``interval``-th after, the ranks of
    ``group`` exchange their running digests (every collective and crossing since the last
    check, with call sites) and ``fields``; a disagreement raises :class:`ConsistencyError` on
    every rank, naming the first collective that differed. Other crossings fold into the
    digest and cost no communication. In ``"every"`` mode each collective was checked already
    and only ``fields`` are compared, at every crossing. No-op when checks are off.

    Example:
        >>> consistency.boundary(mesh, "fs.optim.step")  # doctest: +SKIP
    """
    mode = _active_mode()
    if mode == "off" or not dist.is_initialized():
        return
    g = _as_group(group)
    if g.size == 1 or g.simulated:
        return
    if mode == "every":
        if fields:
            _agree(g, what, dict(fields))
        return
    _recurring(g, what, fields, _site())


def settle(group: Mesh | AxisGroup, what: str) -> None:
    """Compare now, over ``group``, the running digests of the groups inside its ranks, and
    clear them (default mode; one small all_reduce). For programs that are the same only within
    sub-groups of a mesh (MPMD: a pipeline's stages issue their own tensor-parallel collectives):
    each sub-group settles its history where it ends, so a later boundary over the whole mesh
    compares only what every rank ran since. A settled group's next collective is not its first
    (no exchange there: it folds into the group's fresh digest, compared at the next settle or
    boundary). No-op in the other modes (``"every"`` checked each collective already) and on
    one rank.

    Example:
        >>> consistency.settle(mesh, "fs.parallel.pipeline")  # doctest: +SKIP
    """
    if _active_mode() != "default" or not dist.is_initialized():
        return
    g = _as_group(group)
    if g.size > 1 and not g.simulated:
        _boundary(g, what, {}, _site())
        settled = {id(r) for r in _within(g)}  # agreed: forgotten, so later checks over
        for pg in [pg for pg, r in _RUNNING.items() if id(r) in settled]:  # bigger groups
            del _RUNNING[pg]  # compare only what every rank ran since
            _SETTLED.add(pg)  # ... and its next collective folds in (compared at the next
            # settle or boundary; its first one ever was exchanged)


def check_equal(
    obj, group: Mesh | AxisGroup | None = None, *, what: str, defer: bool = False
) -> None:
    """Raise :class:`ConsistencyError` on every rank unless ``obj`` is equal on all of them.

    Runs whenever checks are on (:func:`enabled`); costs one small all_reduce. In the default
    mode it is also a :func:`boundary` (the running digests are compared with ``obj``).
    With ``defer`` (default mode; ``"every"`` checks at once) the all_reduce is launched and
    its verdict taken before this process's next collective or check, or at
    :func:`wait_pending`, which the caller runs where it may leave without either: the work in
    between (no collective) overlaps the exchange.

    Args:
        obj: any value made of Python scalars, strings, tuples, lists, dicts, tensors (compared
            by dtype, shape and bytes), dtypes, specs, layouts.
        group: a :class:`~fshard.Mesh` (all its ranks), an :class:`~fshard.mesh.AxisGroup`, or
            ``None`` for the whole default process group.
        what: names the value in the error, e.g. ``"checkpoint Python values"``.

    Example:
        >>> consistency.check_equal({"step": step}, mesh, what="train state")  # doctest: +SKIP
    """
    mode = _active_mode()
    if mode == "off" or not dist.is_initialized():
        return
    # the whole default group holds every mesh's ranks: its check compares obj only (ranks of
    # different meshes, e.g. pipeline stages, legitimately differ in their collectives)
    running = group is not None
    group = _as_group(group)
    if group.size == 1 or group.simulated:
        return
    fields = dict(obj) if isinstance(obj, dict) else {"value": obj}
    if mode == "every":
        _agree(group, what, fields)
    else:
        _boundary(group, what, fields, _site(), running, defer)


def check_replicated(t: torch.Tensor, mesh: Mesh, op: str, index: int) -> None:
    """Check the claim a plain tensor makes when it meets ShardedArrays in an op: that it is
    replicated (every rank of ``mesh`` holds the same values). A per-rank batch passed as a
    plain tensor next to replicated params would otherwise give per-rank gradients labelled
    replicated, never reduced (the "replicated" params drift apart). Compared by content hash
    (one small all_reduce) the first time per call site, op and input in the default mode, at
    every call in ``"every"``; never when checks are off, under tracing, on one rank.

    Example:
        >>> consistency.check_replicated(x, mesh, "linear", 0)  # doctest: +SKIP
    """
    mode = _active_mode()
    if mode == "off" or mesh.is_abstract or mesh.size_total == 1 or not dist.is_initialized():
        return
    if mesh.simulated_rank is not None:
        return
    site = _site()
    if mode == "default":
        key = (site, mesh, op, index)
        if key in _CLAIMED:
            return
        if len(_CLAIMED) < 65536:
            _CLAIMED.add(key)
    what = (
        f"{op} at {_where(site)}: input {index} is a plain tensor, which fshard treats as "
        f"replicated over the mesh (every rank must hold the same values); a per-rank value "
        f"(this rank's rows of a batch) must be a ShardedArray: fs.from_local(x, mesh, "
        f"fs.P('dp')) or fs.shard(full, mesh, fs.P('dp'))"
    )
    check_equal({"plain tensor": t}, mesh, what=what)


def rng_state(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The state ``torch.rand*`` will draw from: ``generator``'s, else the device default's."""
    if generator is not None:
        return generator.get_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()
