"""Every byte on the wire goes through ``fshard/_comm.py`` (issue 28).

A static scan (the AST walker of ``tools/torch_api.py``) fails on any torch.distributed collective,
functional collective, raw process-group method or ``fshard._compat`` wire binding named outside
``_comm.py`` and the set-up / bookkeeping modules of :data:`ALLOWED`; ``_comm``'s asynchronous
all_gather (FSDP's prefetch) and shape exchange (shard_map) against the synchronous gather and
dense tensors on a mesh whose process group lists its ranks in another order; the one bucketing
policy (``fs.lax.buckets``) of ``psum`` of a pytree and ``fs.value_and_grad``.
"""

import ast
import contextlib
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import _comm, lax
from fshard.collectives import AllGather, Bound, Ppermute, Psum, start
from fshard.mesh import AxisGroup

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import torch_api  # noqa: E402

#: Modules besides ``_comm.py`` allowed to call these torch.distributed collectives, and why: none
#: moves a tensor of the user's computation (``_compat.py`` binds names, it never calls them).
ALLOWED = {
    # the worker pool: a barrier probing that every rank is alive, results gathered as objects
    "fshard/launch.py": {"barrier", "all_gather_object"},
    # consistency mode's own protocol, run by _comm before each data collective: one all_reduce
    # of a 4-word digest, descriptions exchanged as objects on a mismatch
    "fshard/consistency.py": {"all_reduce", "all_gather_object"},
    # checkpoint planning: barriers around the files, metadata broadcast / gathered as objects
    "fshard/checkpoint.py": {"barrier", "broadcast_object_list", "all_gather_object"},
}
COMM = "fshard/_comm.py"

#: torch.distributed functions that communicate (and the P2POp of batch_isend_irecv)
_COLLECTIVE = re.compile(
    r"^(all_|reduce|broadcast|scatter|gather|send|recv|isend|irecv|batch_isend|barrier|"
    r"monitored_barrier|P2POp)"
)
#: ProcessGroup methods (``pg.allreduce([t])``): names no tensor method has
_PG_METHODS = {
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "_allgather_base",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "recv_anysource",
}
#: fshard/_compat.py's bindings of version-dependent collectives
_COMPAT_WIRE = {
    "all_gather_into",
    "reduce_scatter_into",
    "funcol",
    "funcol_all_gather",
    "funcol_reduce_scatter",
}


def _torch_collective(dotted: str) -> str | None:
    """The collective a dotted torch name is, or None."""
    if dotted.startswith(torch_api.FUNCOL):
        return dotted
    prefix = "torch.distributed."
    if not dotted.startswith(prefix):
        return None
    name = dotted[len(prefix) :]
    return name if "." not in name and _COLLECTIVE.match(name) else None


def wire_calls(package: Path) -> dict[str, set[str]]:
    """``{file: {collective name, ...}}`` for every collective a module of ``package`` names
    (torch.distributed / functional collectives through any import alias, ProcessGroup methods,
    ``_compat``'s wire bindings), ``_compat.py`` itself excepted."""
    found: dict[str, set[str]] = {}
    for dotted, where in torch_api.used_names(package).items():
        name = _torch_collective(dotted)
        if name is not None:
            for w in where:
                found.setdefault(w.rsplit(":", 1)[0], set()).add(name)
    for path in sorted(package.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        where = str(path.relative_to(package.parent))
        tree = ast.parse(path.read_text())
        compat = {"_compat"}  # local names bound to fshard._compat
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                for a in node.names:
                    if a.name == "_compat":
                        compat.add(a.asname or a.name)
                    elif mod.endswith("_compat") and a.name in _COMPAT_WIRE:
                        found.setdefault(where, set()).add(f"_compat.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.endswith("._compat") and a.asname:
                        compat.add(a.asname)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in compat:
                if node.attr in _COMPAT_WIRE:
                    found.setdefault(where, set()).add(f"_compat.{node.attr}")
            elif node.attr in _PG_METHODS:
                found.setdefault(where, set()).add(f"ProcessGroup.{node.attr}")
    return found


def _outside(found: dict[str, set[str]], package_name: str = "fshard") -> dict[str, set[str]]:
    comm = COMM.replace("fshard/", f"{package_name}/")
    out = {}
    for where, names in found.items():
        if where == comm:
            continue
        allowed = ALLOWED.get(where.replace(f"{package_name}/", "fshard/", 1), set())
        extra = names - allowed
        if extra:
            out[where] = extra
    return out


def test_only_comm_puts_data_on_the_wire():
    """No module but ``_comm.py`` (and the set-up modules of ALLOWED, for what they list) names a
    collective. FSDP's asynchronous gather, shard_map's shape exchange and ``fs.shard(src=)``'s
    metadata broadcast did (fsdp.py, shard_map.py, api.py) before they became ``_comm``
    functions."""
    found = wire_calls(ROOT / "fshard")
    bad = _outside(found)
    assert not bad, (
        "collectives outside fshard/_comm.py (add a _comm function: it applies the lowering, the "
        "wire and consistency checks and records the comm log): "
        + "; ".join(f"{w}: {sorted(n)}" for w, n in sorted(bad.items()))
    )
    assert {"all_reduce", "broadcast", "all_to_all_single"} <= found[COMM]  # the scan sees _comm


def test_the_scan_finds_every_form(tmp_path):
    """The scan is not vacuous: each way of reaching the wire is reported, plain tensor ops and
    non-communicating torch.distributed names are not, and ALLOWED is per name."""
    pkg = tmp_path / "fshard"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch import distributed as d2\n"
        "from torch.distributed import all_gather_into_tensor as agit\n"
        "from torch.distributed import _functional_collectives as fc\n"
        "from . import _compat\n"
        "from . import _compat as cc\n"
        "from ._compat import reduce_scatter_into\n"
        "def f(o, x, pg):\n"
        "    dist.all_reduce(x)\n"
        "    torch.distributed.broadcast(x, 0)\n"
        "    d2.isend(x, 1)\n"
        "    agit(o, x)\n"
        "    fc.all_reduce(x, 'sum', pg)\n"
        "    _compat.all_gather_into(o, x, group=pg)\n"
        "    _compat.funcol().all_to_all_single(x, None, None, pg)\n"
        "    cc.funcol_all_gather(x, pg)\n"
        "    pg.allreduce([x])\n"
        "    dist.P2POp(dist.irecv, x, 0)\n"
        "    # not collectives:\n"
        "    dist.get_rank(), dist.get_world_size(), dist.ReduceOp.SUM, dist.new_group([0])\n"
        "    torch.gather(x, 0, o), x.scatter_(0, o, x), torch.broadcast_tensors(x, o)\n"
    )
    (pkg / "consistency.py").write_text(
        "import torch.distributed as dist\n"
        "def f(x):\n"
        "    dist.all_reduce(x)\n"  # allowed here
        "    dist.broadcast(x, 0)\n"  # not
    )
    (pkg / "_comm.py").write_text(
        "import torch.distributed as dist\ndist.all_to_all_single(1, 2)\n"
    )
    bad = _outside(wire_calls(pkg))
    funcol = torch_api.FUNCOL
    assert bad == {
        "fshard/m.py": {
            "all_reduce",
            "broadcast",
            "isend",
            "irecv",
            "P2POp",
            "all_gather_into_tensor",
            funcol,  # imported as a module
            f"{funcol}.all_reduce",
            f"{funcol}.all_to_all_single",
            "_compat.all_gather_into",
            "_compat.funcol",
            "_compat.funcol_all_gather",
            "_compat.reduce_scatter_into",
            "ProcessGroup.allreduce",
        },
        "fshard/consistency.py": {"broadcast"},
    }, bad


# -- _comm.all_gather_start / size_exchange on a group in non-identity order -------------------


def _gen(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def gather_start_rank_fn():
    """On a (2, 2) mesh over axes ("b", "a") (the process group lists the ranks 0, 1, 2, 3 while
    the chunks are ranks 0, 2, 1, 3): several gathers launched back to back, waited in reverse,
    equal the synchronous gather and the dense concatenation in chunk order, with the same comm
    log, under the Gloo lowering (broadcasts for every block here) and the native all_gather;
    even and uneven chunks; a block packed in place in the output (``gather_buffer``). The shape exchange returns the rows in chunk order."""
    mesh = fs.Mesh.create((2, 2), ("a", "b"))
    g = mesh.group(("b", "a"))
    assert not g.identity_order and g.ranks == (0, 2, 1, 3)
    j = g.index
    uneven = (3, 1, 0, 2)
    X = [_gen(10 + k, 2, 5) for k in range(4)]
    U = [_gen(20 + k, 4, uneven[k]) for k in range(4)]
    logs = {}
    try:
        for name, low in (
            ("broadcast", _comm.Lowering(gather_broadcast_bytes=0)),
            ("native", _comm.NATIVE),
        ):
            _comm._LOWERING_OF_PG[g.pg] = low
            with fs.debug.comm_log() as log:
                pending = [
                    _comm.all_gather_start(X[j], g, 0, None),
                    _comm.all_gather_start(U[j], g, 1, uneven),
                    _comm.all_gather_start(X[j], g, 1, None),
                ]
                got = [p.wait() for p in reversed(pending)][::-1]
                assert pending[0].wait() is got[0]  # waiting twice: the same tensor
                want = [
                    _comm.all_gather(X[j], g, 0, None),
                    _comm.all_gather(U[j], g, 1, uneven),
                    _comm.all_gather(X[j], g, 1, None),
                ]
            dense = [torch.cat(X, 0), torch.cat(U, 1), torch.cat(X, 1)]
            for a, b, c in zip(got, want, dense):
                assert torch.equal(a, b) and torch.equal(a, c)
            records = [(r.op, r.axes, r.nbytes) for r in log]
            assert records[:3] == records[3:]
            logs[name] = records
            # packed in place in this rank's block of the output (FSDP's units): the same
            # gather, the block sent where it lies
            with fs.debug.comm_log() as log:
                out, block = _comm.gather_buffer(X[j].numel(), g, X[j])
                torch.cat([X[j][0], X[j][1]], out=block)
                got = _comm.all_gather_start(block, g, 0, None, out=out).wait()
            assert torch.equal(got, torch.cat([x.reshape(-1) for x in X]))
            assert [(r.op, r.nbytes) for r in log] == [("all_gather", 80)]
    finally:
        _comm._LOWERING_OF_PG.pop(g.pg, None)
    assert logs["broadcast"] == logs["native"]
    me = dist.get_rank()
    with fs.debug.comm_log() as log:
        rows = _comm.size_exchange([me, 10 * me, 7], g, mesh.device())
    assert rows == [[r, 10 * r, 7] for r in g.ranks]
    assert [(r.op, r.nbytes) for r in log] == [("size_exchange", 24)]
    return logs["native"][:3]


def test_all_gather_start_in_chunk_order(world4):
    axes = ("b", "a")
    want = [("all_gather", axes, 80), ("all_gather", axes, None), ("all_gather", axes, 80)]
    uneven = (3, 1, 0, 2)
    for rank, got in enumerate(world4.run(gather_start_rank_fn)):
        j = (0, 2, 1, 3).index(rank)
        want[1] = ("all_gather", axes, 4 * uneven[j] * 8)
        assert got == want, (rank, got)


# -- one bucketing policy -------------------------------------------------------------------


def test_buckets_one_policy_two_orders():
    """fs.lax.buckets: per (group, dtype) runs of at most PSUM_BUCKET_BYTES, tensors of at least
    PSUM_INPLACE_MIN_BYTES alone where allowed; "in_place_first" (psum of a pytree) and "filled"
    (value_and_grad's backward) order the same buckets."""
    x = AxisGroup(("x",), None, 2, 0, (0, 1), (0, 1))
    y = AxisGroup(("y",), None, 2, 0, (0, 1), (0, 1))
    f64 = torch.float64
    # bytes:     40   40        80         24   16   40        8    160 (>= 100: in place)
    tensors = [
        torch.empty(10),
        torch.empty(10),
        torch.empty(10, dtype=f64),
        torch.empty(6),
        torch.empty(4),
        torch.empty(10),
        torch.empty(2),
        torch.empty(40),
    ]
    groups = [x, x, x, x, y, x, y, x]
    old = lax.PSUM_BUCKET_BYTES, lax.PSUM_INPLACE_MIN_BYTES
    lax.PSUM_BUCKET_BYTES, lax.PSUM_INPLACE_MIN_BYTES = 100, 100
    try:

        def cut(**kw):
            return [(b.idx, b.own) for b in lax.buckets(tensors, groups, **kw)]

        # x f32: [0, 1] (80 B; +24 > 100), [3, 5] (64 B); x f64: [2]; y f32: [4, 6]; 7 alone
        assert cut(in_place=True, order="filled") == [
            ([0, 1], False),
            ([2], False),
            ([3, 5], False),
            ([4, 6], False),
            ([7], True),
        ]
        assert cut(in_place={7}, order="in_place_first") == [
            ([7], True),
            ([0, 1], False),  # x f32 (first kind seen), its runs in order
            ([3, 5], False),
            ([2], False),  # x f64
            ([4, 6], False),  # y f32
        ]
        # not allowed in place (psum without donate): 7 packed, alone (it exceeds the cap)
        assert cut(order="in_place_first") == [
            ([0, 1], False),
            ([3, 5], False),
            ([7], False),
            ([2], False),
            ([4, 6], False),
        ]
    finally:
        lax.PSUM_BUCKET_BYTES, lax.PSUM_INPLACE_MIN_BYTES = old


# -- ppermute on Gloo: isend / irecv issued directly ----------------------------------------


@contextlib.contextmanager
def _counting(calls: dict):
    """The ``torch.distributed`` functions named in ``calls`` counted into it while inside."""
    real = {name: getattr(dist, name) for name in calls}

    def counted(name):
        def call(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)

        return call

    for name in calls:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, f in real.items():
            setattr(dist, name, f)


def ppermute_gloo_rank_fn():
    """On Gloo a ppermute issues one ``dist.isend`` / ``dist.irecv`` per message and no
    ``batch_isend_irecv`` (which on Gloo is that loop after a P2POp per message): a ring, one
    pair and a rank sending to itself, on a group in non-identity order, against the dense
    expectation, with the comm log of every rank's record as before."""
    mesh = fs.Mesh.create((2, 2), ("a", "b"))
    g = mesh.group(("b", "a"))
    assert not g.identity_order and g.backend == "gloo"
    j = g.index
    X = [_gen(30 + k, 2, 3) for k in range(4)]
    perms = [((0, 1), (1, 2), (2, 3), (3, 0)), ((0, 2),), ((1, 1),)]
    calls = {"isend": 0, "irecv": 0, "batch_isend_irecv": 0}
    with _counting(calls), fs.debug.comm_log() as log:
        got = [_comm.ppermute(X[j], g, perm) for perm in perms]
    for perm, out in zip(perms, got):
        src = [s for s, d in perm if d == j]
        assert torch.equal(out, X[src[0]] if src else torch.zeros(2, 3, dtype=torch.float64))
    sends = sum(s == j and d != j for p in perms for s, d in p)
    recvs = sum(d == j and s != j for p in perms for s, d in p)
    assert calls == {"isend": sends, "irecv": recvs, "batch_isend_irecv": 0}, calls
    nbytes = 2 * 3 * 8
    want = [("ppermute", ("b", "a"), nbytes if any(s == j for s, _ in p) else 0) for p in perms]
    assert [(r.op, r.axes, r.nbytes) for r in log] == want
    return calls


def test_ppermute_on_gloo_sends_directly(world4):
    got = world4.run(ppermute_gloo_rank_fn)
    # chunks 0, 2, 1, 3 are ranks 0, 1, 2, 3: chunk 0 sends twice, chunk 2 receives twice
    assert got[0] == {"isend": 2, "irecv": 1, "batch_isend_irecv": 0}
    assert got[1] == {"isend": 1, "irecv": 2, "batch_isend_irecv": 0}


def receive_ahead_rank_fn():
    """Receives posted ahead (``_comm.receive_ahead``, a pipeline's at each tick's start) land
    exactly what the later ppermutes of the same tag send, in the order posted, while a tag-0
    ppermute over the same group in between keeps its own message; each ppermute given its
    receive sends only (one ``irecv`` per receive in all), with the checks and comm-log
    records of a ppermute without one. A mismatched receive and ``ahead=`` where the op is not
    launched raise before any message."""
    mesh = fs.Mesh.create((2, 2), ("a", "b"))
    g = mesh.group(("b", "a"))
    j = g.index
    X = [[_gen(50 + 4 * k + i, 2, 3) for i in range(4)] for k in range(3)]
    perms = [((0, 1), (1, 2), (2, 3), (3, 0)), ((2, 0),), ((0, 3), (3, 0))]
    calls = {"isend": 0, "irecv": 0}
    with _counting(calls):
        posted = [_comm.receive_ahead(X[0][j], g, perm, (2, 3)) for perm in perms]
        with fs.debug.comm_log() as log:
            between = _comm.ppermute(X[1][j], g, perms[0])  # tag 0: not into the posted ones
            pending = [
                _comm.ppermute_start(X[k][j], g, perm, ahead=posted[k], tag=_comm.AHEAD_TAG)
                for k, perm in enumerate(perms)
            ]
            got = [p.wait() for p in pending]
    receives = [any(d == j and s != j for s, d in p) for p in perms]
    assert [p is not None for p in posted] == receives
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    src = [s for s, d in perms[0] if d == j][0]
    assert torch.equal(between, X[1][src])
    for k, (perm, out) in enumerate(zip(perms, got)):
        src = [s for s, d in perm if d == j]
        assert torch.equal(out, X[k][src[0]] if src else zeros), k
        if posted[k] is not None:
            assert out is posted[k].buffer  # landed in the buffer posted ahead
    sends = 1 + sum(s == j and d != j for p in perms for s, d in p)
    assert calls == {"isend": sends, "irecv": 1 + sum(receives)}, calls
    nbytes = 2 * 3 * 8
    want = [("ppermute", ("b", "a"), nbytes if any(s == j for s, _ in p) else 0)
            for p in (perms[0], *perms)]  # fmt: skip
    assert [(r.op, r.axes, r.nbytes) for r in log] == want
    # refused before any message: a receive of another shape, a receive where none arrives
    with pytest.raises(ValueError, match=r"ahead= is a receive of shape \(2, 3\).*\(4,\)"):
        _comm.ppermute_start(torch.ones(4, dtype=torch.float64), g, perms[0], ahead=posted[0])
    with pytest.raises(ValueError, match="receives nothing"):
        _comm.ppermute_start(X[0][j], g, ((j, j),), ahead=posted[0])
    b = Bound(Ppermute(g.axes, perms[0]), g)
    with torch.autograd.forward_ad.dual_level(), pytest.raises(ValueError, match="ahead="):
        fs.lax.apply_start(b, X[0][j], ahead=posted[0])  # under jvp: not launched ahead
    with pytest.raises(ValueError, match="ahead= is for ops in START"):
        start(Bound(AllGather(g.axes, 0), g), X[0][j], ahead=posted[0])
    with pytest.raises(ValueError, match="psum has none"):
        start(Bound(Psum(g.axes), g), X[0][j], ahead=posted[0])
    assert calls == {"isend": sends, "irecv": 1 + sum(receives)}
    return sum(receives)


def test_receives_posted_ahead_land_what_the_ppermutes_send(world4):
    # chunks 0, 2, 1, 3 are ranks 0, 1, 2, 3; chunk 0 receives in perms 0, 1 and 2, chunk 1
    # in perm 0 only
    assert world4.run(receive_ahead_rank_fn) == [3, 1, 1, 2]


def test_receive_ahead_posts_nothing_where_it_cannot():
    """One process: a simulated group posts nothing (its ppermute makes the received buffer
    itself, nothing on the wire)."""
    sim = fs.Mesh.abstract((4,), ("x",)).simulate(1).group(("x",))
    assert _comm.receive_ahead(torch.ones(2), sim, ((0, 1), (1, 0)), (2,)) is None
