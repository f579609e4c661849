"""Mesh: an N-D grid of ranks with axis names, over ``torch.distributed.DeviceMesh``.

A mesh is row-major: the rank at position ``i`` of ``mesh.ranks`` sits at
``numpy.unravel_index(i, shape)``. ``Mesh.abstract`` needs no process group and serves layout
math and planning; ``Mesh.create`` builds (and caches) the DeviceMesh and one process group per
subset of axes, so that collectives over a tuple of axes (``("dp", "tp")``) have a group. A
process group is made once per set of ranks and shared by every mesh and axis over those ranks
(the DeviceMesh is built ``DeviceMesh.from_group`` from them): a program or a test session that
makes many meshes holds one group per rank set, not one per mesh axis.
Meshes compare and hash by shape, names, ranks, device type (``"cpu"`` or ``"cuda"``, where
the local blocks live) and abstractness: a CPU and a CUDA mesh over the same ranks are different
meshes (as a JAX ``Mesh`` over other devices, or a DTensor ``DeviceMesh`` of another device
type), and so are an abstract mesh and the real mesh of the same shape (as JAX's
``AbstractMesh`` and ``Mesh``). So no cache keyed by layouts hands one mesh's layouts or programs
to the other: a plan made on an abstract mesh prints and costs what the real mesh would run,
but only the real mesh's own plans run.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _torchrun
from .spec import chunk_index

__all__ = ["Mesh", "AxisGroup", "SimulatedGroup"]


@dataclass(frozen=True)
class SimulatedGroup:
    """The process group of a simulated mesh (:meth:`Mesh.simulate`): no processes behind it.

    ``fshard._comm`` meets it where it would call torch.distributed and runs the collective on
    shapes only (``meta`` tensors of the result's shape), after the same wire checks and
    comm-log records as a real group's, so what a dry run records is what the real run records.
    ``backend`` names the backend whose lowering (``_comm.LOWERINGS``) the simulated wire follows:
    the lowering decides which temporaries a collective allocates, so the memory of a dry run
    follows it too.
    """

    backend: str = "nccl"


@dataclass(frozen=True, eq=False)
class AxisGroup:
    """A process group over a tuple of mesh axes, seen from this rank.

    ``ranks[j]`` is the global rank holding chunk ``j`` (mixed radix over the axes, first axis
    most significant); ``group_rank[j]`` is that rank's rank inside ``pg`` (torch sorts group
    ranks, so a reversed axis tuple has a non-identity order). ``index`` is this rank's chunk.
    """

    axes: tuple[str, ...]
    pg: object
    size: int
    index: int
    ranks: tuple[int, ...]
    group_rank: tuple[int, ...]
    # Derived fields, not properties: torch.compile reads a group as a guarded constant (dynamo's
    # frozen-dataclass variable serves fields only), and nothing about it is resolved in a trace.
    identity_order: bool = field(init=False)
    backend: str | None = field(init=False)  # dist.get_backend(pg); None without a pg
    simulated: bool = field(init=False)  # pg is a SimulatedGroup: shapes only on the wire

    def __post_init__(self):
        object.__setattr__(self, "identity_order", self.group_rank == tuple(range(self.size)))
        simulated = isinstance(self.pg, SimulatedGroup)
        object.__setattr__(self, "simulated", simulated)
        if simulated:
            backend = self.pg.backend
        else:
            backend = None if self.pg is None else dist.get_backend(self.pg)
        object.__setattr__(self, "backend", backend)


def _check_mesh_args(shape, names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(names, str):
        names = (names,)
    if not isinstance(shape, (tuple, list)) or not shape:
        raise ValueError(f"Mesh: shape must be a non-empty tuple of positive ints, got {shape!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"Mesh: shape must be a non-empty tuple of positive ints, got {shape!r}")
    if not isinstance(names, (tuple, list)) or any(not isinstance(n, str) for n in names):
        raise TypeError(f"Mesh: names must be a tuple of str, got {names!r}")
    if len(names) != len(shape):
        raise ValueError(
            f"Mesh: shape {tuple(shape)} has {len(shape)} axes but names {tuple(names)} has "
            f"{len(names)}; give one name per axis"
        )
    if any(not n for n in names):
        raise ValueError(f"Mesh: axis names must be non-empty strings, got {tuple(names)!r}")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(
            f"Mesh: axis name {dup!r} appears twice in {tuple(names)}; names must be unique"
        )
    return tuple(shape), tuple(names)


class Mesh:
    """An N-D grid of ranks with named axes.

    Example:
        >>> m = Mesh.abstract((2, 2), ("dp", "tp"))
        >>> m.coords(3), m.size("tp"), m.size(("dp", "tp"))
        ((1, 1), 2, 4)
    """

    __slots__ = (
        "shape",
        "axis_names",
        "ranks",
        "device_type",
        "device_mesh",
        "_coords",
        "_kind",
        "_hash",
        "_groups",
        "_simulated",
        "__weakref__",
    )

    def __init__(
        self,
        shape,
        axis_names,
        ranks=None,
        device_type: str = "cpu",
        device_mesh=None,
        simulated: tuple[int, SimulatedGroup] | None = None,
    ):
        shape, axis_names = _check_mesh_args(shape, axis_names)
        n = math.prod(shape)
        ranks = tuple(range(n)) if ranks is None else tuple(int(r) for r in ranks)
        if len(ranks) != n:
            raise ValueError(f"Mesh: {len(ranks)} ranks given for a mesh of shape {shape}")
        set_ = object.__setattr__
        set_(self, "shape", shape)
        set_(self, "axis_names", axis_names)
        set_(self, "ranks", ranks)
        set_(self, "device_type", device_type)
        set_(self, "device_mesh", device_mesh)
        coords = {}
        for pos, r in enumerate(ranks):
            coords[r] = _unravel(pos, shape)
        set_(self, "_coords", coords)
        set_(self, "_simulated", simulated)  # (this rank, its SimulatedGroup) or None
        if simulated is not None and simulated[0] not in coords:
            raise ValueError(f"Mesh.simulate: rank {simulated[0]} is not in the mesh (0..{n - 1})")
        set_(self, "_kind", self._kind_of())
        set_(self, "_hash", hash((shape, axis_names, ranks, device_type, self._kind)))
        if device_mesh is not None:
            _REAL[id(self)] = self
        set_(self, "_groups", {})  # axes tuple -> AxisGroup, filled once by Mesh.create

    def __setattr__(self, name, value):
        raise AttributeError("Mesh is immutable")

    # -- construction -------------------------------------------------------------------
    @staticmethod
    def abstract(shape: Sequence[int], names: Sequence[str], device_type: str = "cpu") -> Mesh:
        """A mesh with no process group, for layout math and planning.

        ``device_type`` (``"cpu"`` or ``"cuda"``) only matters for equality. An abstract mesh
        never equals a real mesh (of :meth:`create`), so its layouts and plans never stand in
        for the real mesh's.

        Example:
            >>> Mesh.abstract((2, 4), ("x", "y")).size("y")
            4
        """
        _check_device_type(device_type, "Mesh.abstract")
        return Mesh(shape, names, device_type=device_type)

    @staticmethod
    def create(shape: Sequence[int], names: Sequence[str], device_type: str | None = None) -> Mesh:
        """A mesh over the initialised default process group (cached per shape and names).

        Under ``torchrun`` with no process group yet, this initialises the default one, as
        DTensor's ``init_device_mesh`` does (NCCL when every local rank has its own GPU, else
        Gloo: :func:`fshard._torchrun.default_backend`). It is not destroyed at exit: call
        :func:`fshard.launch.shutdown` at the end of the script (a Gloo group left to interpreter
        teardown aborts a rank after its output in some runs, with "terminate called without an
        active exception", in plain torch too; ``dist.destroy_process_group()`` alone cannot free
        the groups fshard's meshes hold), or run the script's body with
        :func:`fshard.launch.run`, which does.

        Args:
            shape: ranks along each axis; their product must equal the world size.
            names: one unique name per axis.
            device_type: where the local blocks live, ``"cpu"`` or ``"cuda"``; default
                ``"cuda"`` when the default process group uses NCCL, else ``"cpu"``. A CUDA mesh
                over Gloo is allowed (Gloo moves CUDA tensors through host memory): that is how
                more ranks than GPUs share the GPUs. ``mesh.device()`` is this rank's device, and
                ``fs.shard`` / ``fs.from_local`` / the creation functions put blocks there.

        A CUDA mesh uses the current CUDA device of each process. When the process has not
        initialised CUDA yet (no ``torch.cuda.set_device`` call, no CUDA tensor), this sets it to
        ``LOCAL_RANK % torch.cuda.device_count()`` (``RANK`` without ``LOCAL_RANK``) before the
        DeviceMesh is built: one GPU per rank under NCCL, ranks sharing the GPUs round robin
        over Gloo (DeviceMesh itself would pick ``cuda:LOCAL_RANK``, which does not exist when
        there are more ranks than GPUs).

        Example:
            >>> mesh = Mesh.create((2, 2), ("dp", "tp"))  # doctest: +SKIP
        """
        shape, names = _check_mesh_args(shape, names)
        # under torchrun, as DTensor's init_device_mesh: NCCL on GPUs, else Gloo
        if dist.is_available() and not dist.is_initialized() and _torchrun.under_torchrun():
            _torchrun.init_torchrun_group(None)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Mesh.create needs an initialised torch.distributed process group; run under "
                "fshard.launch.run or torchrun (where Mesh.create initialises it), or use "
                "Mesh.abstract for layout math"
            )
        world = dist.get_world_size()
        if math.prod(shape) != world:
            raise ValueError(
                f"Mesh.create: shape {shape} has {math.prod(shape)} ranks but the world size is "
                f"{world}; the product of the shape must equal the world size"
            )
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        _check_device_type(device_type, "Mesh.create")
        if device_type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    "Mesh.create: device_type='cuda' but CUDA is not available here (torch "
                    f"{torch.__version__}, torch.cuda.is_available() is False); use "
                    "device_type='cpu' (Gloo), or run on a CUDA build with a GPU"
                )
            _select_cuda_device()
        elif dist.get_backend() == "nccl":
            raise ValueError(
                "Mesh.create: device_type='cpu' but the process group uses NCCL, which moves "
                "only CUDA tensors; use device_type='cuda' (the default under NCCL), or start "
                "the process group with Gloo (fs.launch.run(..., backend='gloo'))"
            )
        return _create(shape, names, device_type, id(dist.group.WORLD))

    def simulate(self, rank: int, backend: str = "nccl") -> Mesh:
        """This abstract mesh seen from ``rank``: a mesh with a "this rank" and simulated groups.

        What a dry run (:func:`fshard.dry_run`) runs a step on. ``mesh.rank`` is ``rank``,
        ``mesh.group(axes)`` an :class:`AxisGroup` over a :class:`SimulatedGroup`, and
        ``mesh.device()`` is ``meta``: values created on it hold no data, and every collective
        runs on shapes only (``fshard._comm``), recorded in ``fs.debug.comm_log()`` as the real
        mesh records it. Nothing global changes: no process group, no torch.distributed
        initialisation, and a real world in the process is never touched. A simulated mesh
        equals only the simulation of the same abstract mesh from the same rank and backend, so
        no cached program of one serves another (their groups differ).

        Args:
            rank: the rank to be, ``0 <= rank < mesh.size_total``.
            backend: whose lowering (``fshard._comm.LOWERINGS``) the simulated wire follows,
                ``"nccl"`` (default) or ``"gloo"``; it decides the collectives' temporaries.

        Example:
            >>> m = Mesh.abstract((4, 2), ("dp", "tp")).simulate(5)
            >>> m.rank, m.group("tp").index, m.device()
            (5, 1, device(type='meta'))
        """
        if not self.is_abstract:
            raise ValueError(f"Mesh.simulate: {self!r} is not abstract; use Mesh.abstract(...)")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"Mesh.simulate: rank must be an int, got {rank!r}")
        if not isinstance(backend, str):
            raise TypeError(f"Mesh.simulate: backend must be a str, got {backend!r}")
        return _simulated(self.shape, self.axis_names, self.ranks, self.device_type, rank, backend)

    @property
    def simulated_rank(self) -> int | None:
        """The rank a simulated mesh (:meth:`simulate`) stands for; ``None`` on other meshes."""
        return None if self._simulated is None else self._simulated[0]

    def _kind_of(self) -> tuple:
        """What, besides shape, names, ranks and device type, makes two meshes equal."""
        if self._simulated is not None:
            return ("simulated", *self._simulated)
        # A real mesh is its world's: after release_groups() and a new world, Mesh.create's mesh
        # of the same shape is another mesh, so nothing cached for the old one serves it.
        return ("abstract",) if self.device_mesh is None else ("real", _WORLDS[0])

    def abstract_mesh(self) -> Mesh:
        """The abstract mesh of the same shape, names, ranks and device type.

        Example:
            >>> Mesh.abstract((2,), ("x",)).simulate(1).abstract_mesh()
            Mesh(x=2, abstract)
        """
        return Mesh(self.shape, self.axis_names, self.ranks, self.device_type)

    def __reduce__(self):
        args = (self.shape, self.axis_names, self.ranks, self.device_type)
        if self._simulated is not None:
            return (_simulated, args + self._simulated[:1] + (self._simulated[1].backend,))
        return (_restore, args + (True,) if self.is_abstract else args)

    # -- queries ------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, Mesh)
            and self.shape == other.shape
            and self.axis_names == other.axis_names
            and self.ranks == other.ranks
            and self.device_type == other.device_type
            and self._kind == other._kind
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        kind = "" if self.device_type == "cpu" else f", {self.device_type}"
        if self._simulated is not None:
            kind += f", simulated rank {self._simulated[0]}"
        elif self.device_mesh is None:
            kind += ", abstract"
        return f"Mesh({axes}{kind})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size_total(self) -> int:
        return len(self.ranks)

    @property
    def is_abstract(self) -> bool:
        """No process group and no "this rank" (``Mesh.abstract``); a simulated mesh is not."""
        return self.device_mesh is None and self._simulated is None

    def axis_index_of(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ValueError(
                f"{name!r} is not an axis of the mesh; the mesh axes are {self.axis_names}"
            ) from None

    def axes_tuple(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        """Normalise ``"x"`` or ``("x", "y")`` into a checked tuple of axis names."""
        if isinstance(axes, str):
            axes = (axes,)
        axes = tuple(axes)
        for a in axes:
            if not isinstance(a, str):
                raise TypeError(f"axis must be a mesh axis name or a tuple of names, got {a!r}")
            self.axis_index_of(a)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis {axes} names a mesh axis twice")
        return axes

    def size(self, axes: str | Sequence[str]) -> int:
        """Number of ranks along ``axes`` (a name or a tuple of names)."""
        return math.prod(self.shape[self.axis_index_of(a)] for a in self.axes_tuple(axes))

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of a global rank."""
        try:
            return self._coords[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not in the mesh (ranks {self.ranks})") from None

    def rank_at(self, coords: Sequence[int]) -> int:
        """Global rank at mesh coordinates ``coords``."""
        pos = 0
        for c, s in zip(coords, self.shape):
            pos = pos * s + c
        return self.ranks[pos]

    @property
    def rank(self) -> int:
        """This process's global rank (real meshes), the simulated rank (simulated meshes)."""
        if self._simulated is not None:
            return self._simulated[0]
        if self.device_mesh is None:
            raise ValueError(
                f"{self!r} is abstract: it has no 'this rank'. Pass a rank explicitly, or use "
                "Mesh.create inside a process group"
            )
        return dist.get_rank()

    def device(self) -> torch.device:
        """The device local shards live on for this rank (``meta`` on a simulated mesh)."""
        if self._simulated is not None:
            return torch.device("meta")
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def placement(self, rank: int) -> str:
        if self.device_type == "cuda":
            local = rank % max(torch.cuda.device_count(), 1)
            return f"rank:{rank}/cuda:{local}"
        return f"rank:{rank}/cpu"

    def axis_index(self, axes: str | Sequence[str], rank: int | None = None) -> int:
        """Mixed-radix position of ``rank`` along ``axes`` (first axis most significant)."""
        coords = self.coords(self.rank if rank is None else rank)
        return chunk_index(self, self.axes_tuple(axes), coords)[0]

    def group(self, axes: str | Sequence[str]) -> AxisGroup:
        """This rank's process group over ``axes``.

        Every ordered tuple of distinct axes has its group built once, by ``Mesh.create``: a
        plain dict read, which ``torch.compile`` turns into a guarded constant (no traced call).
        """
        axes = self.axes_tuple(axes)
        if self._simulated is not None:
            g = self._groups.get(axes)
            if g is None:
                rank, pg = self._simulated
                g = self._groups[axes] = _axis_group(self, axes, rank, pg)
            return g
        if self.device_mesh is None:
            raise ValueError(f"{self!r} is abstract: it has no process groups. Use Mesh.create")
        return self._groups[axes]


def _check_device_type(device_type, where: str) -> None:
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device_type must be 'cpu' or 'cuda', got {device_type!r}")


def _select_cuda_device() -> None:
    """Before a CUDA DeviceMesh: give a process that has not picked a GPU the GPU
    ``LOCAL_RANK % device_count`` (see :meth:`Mesh.create`)."""
    if torch.cuda.is_initialized():
        return  # the process chose (torch.cuda.set_device) or used a GPU already: keep it
    import os

    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", dist.get_rank())))
    torch.cuda.set_device(local % torch.cuda.device_count())


def _unravel(pos: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(pos % s)
        pos //= s
    return tuple(reversed(out))


def _member_ranks(mesh: Mesh, axes: tuple[str, ...], rank: int) -> tuple[int, ...]:
    """Global ranks sharing ``rank``'s coordinates off ``axes``, in chunk order over ``axes``."""
    base = list(mesh.coords(rank))
    idx = [mesh.axis_index_of(a) for a in axes]
    out = []
    for combo in itertools.product(*(range(mesh.shape[i]) for i in idx)):
        c = list(base)
        for i, v in zip(idx, combo):
            c[i] = v
        out.append(mesh.rank_at(c))
    return tuple(out)


_GROUPS: dict = {}
_LIVE: dict = {}
# Every real mesh alive, by identity (equal meshes of one world are distinct objects).
_REAL: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_WORLDS = [0]  # worlds released so far: part of a real mesh's equality
_SHARED: dict = {}  # (world, member ranks) -> the process group over them
#: the names of the process groups this process gave up (``fshard._comm.abandon``: a pipeline
#: stage failed and closed its connections to the group's ranks); unusable since
_ABANDONED: set = set()


class PeerFailed(dist.DistError):
    """A rank's collectives over a process group failed because a peer gave the group up after
    an error of its own (``fshard._comm.abandon``: a pipeline stage raised); the message names
    that peer's error."""


def abandoned() -> bool:
    """Whether this process gave up a process group (:func:`fshard._comm.abandon`, after a
    pipeline stage failed): the group is unusable, and a :class:`fshard.launch.World` worker
    exits after its reply so that the world restarts.

    Example:
        >>> abandoned()
        False
    """
    return bool(_ABANDONED)


def mark_abandoned(group_name: str) -> None:
    """Record that this process gave up the process group ``group_name``
    (:func:`fshard._comm.abandon`): :func:`abandoned` is true from then on.

    Example:
        >>> mark_abandoned("3")  # doctest: +SKIP
    """
    _ABANDONED.add(group_name)


# Unbounded on purpose: one entry per distinct mesh (shape, names, device type, world) and per
# (mesh, axes) group, each owning process groups that must live as long as the world.
@functools.cache
def _create(shape, names, device_type, _world_key) -> Mesh:
    # Every group is created here, collectively (each rank creates every group, in the same
    # order), once per member set and world (_shared_group): the one-axis groups of the
    # DeviceMesh too, which init_device_mesh would make anew for each mesh (each Gloo group
    # holds 3 threads that wake every 10 ms: a test session's meshes of 6 axes in 4 ranks
    # added 18 threads per rank per mesh, 6 of them size-1 groups, all over the same ranks).
    grid = torch.arange(math.prod(shape), dtype=torch.int).view(shape)
    ranks = tuple(int(r) for r in grid.flatten().tolist())
    abstract = Mesh(shape, names, ranks, device_type)
    me = dist.get_rank()
    dim_groups = [
        _shared_group(_world_key, [_member_ranks(abstract, (a,), r) for r in ranks], me)
        for a in names
    ]
    dm = DeviceMesh.from_group(dim_groups, device_type, grid, mesh_dim_names=names)
    mesh = Mesh(shape, names, ranks, device_type, dm)
    _LIVE[(shape, names, ranks, device_type)] = mesh
    # One group per subset of >= 2 axes (subsets that differ only by size-1 axes, and meshes of
    # other shapes, share it: a 6-axis mesh made ~60 groups, most of them the same ranks).
    for k in range(2, len(names) + 1):
        for subset in itertools.combinations(names, k):
            sets = [_member_ranks(mesh, subset, r) for r in ranks]
            _GROUPS[(mesh, subset)] = _shared_group(_world_key, sets, me)
    for k in range(len(names) + 1):
        for axes in itertools.permutations(names, k):
            mesh._groups[axes] = _axis_group(mesh, axes)
    return mesh


class _ReleasedGroup:
    """What a released mesh's groups hold instead of their process group
    (:func:`release_groups`): any use raises, naming why."""

    def __getattr__(self, name):
        raise RuntimeError(
            "this mesh's process groups were released (fs.launch.shutdown, or fs.launch.run "
            "closing the group it made): create a new mesh with Mesh.create in the new world"
        )

    def __repr__(self) -> str:
        return "<released process group: its world was shut down; use a new Mesh.create>"


def release_groups() -> None:
    """Drops every reference fshard's meshes hold to this process's process groups.

    fshard builds each group once and keeps it for the life of the world (:func:`_create`),
    so ``dist.destroy_process_group()`` alone frees nothing: the groups, and Gloo's worker
    threads, lived on into interpreter teardown, where a worker still releasing a finished
    collective's tensors needs the GIL the finalising interpreter no longer gives, and the
    process aborted after its output ("terminate called without an active exception").
    Called after the destroy, this lets the last reference go here: each group's destructor
    joins its threads while the interpreter is whole. Every real mesh made so far is unusable
    afterwards (its groups raise when used) and unequal to the meshes of a later world.

    Example:
        >>> dist.destroy_process_group(); release_groups()  # doctest: +SKIP
    """
    released = _ReleasedGroup()
    for mesh in list(_REAL.values()):
        # The meshes live on in cached layouts and programs: what they hold of the world goes.
        object.__setattr__(mesh, "device_mesh", released)
        for g in mesh._groups.values():
            object.__setattr__(g, "pg", released)
    _REAL.clear()
    _WORLDS[0] += 1
    _LIVE.clear()
    _SHARED.clear()
    _GROUPS.clear()
    _create.cache_clear()


def _default_timeout():
    """The default group's timeout, for its sub-groups: torch gives a ``dist.new_group`` its
    backend's default (30 minutes on Gloo, 10 on NCCL) whatever ``init_process_group`` was
    given, so a collective over a mesh axis waited 30 minutes where a ``fs.launch.World``'s
    ``pg_timeout`` (or torchrun's ``timeout``) said 60 s. ``None`` (torch's default) where the
    group does not say."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(device).options._timeout
    except Exception:
        return None


def _shared_group(world_key, member_sets: list, me: int):
    """This rank's process group among ``member_sets`` (each a group's ranks), every one
    created once per world (``dist.new_group`` is collective: every rank calls it for every set,
    members or not, in the same order) and shared by every mesh and axis over the same ranks;
    the whole world's is the default group."""
    mine = None
    for members in dict.fromkeys(tuple(sorted(m)) for m in member_sets):
        if len(members) == dist.get_world_size():
            pg = dist.group.WORLD
        else:
            pg = _SHARED.get((world_key, members))
            if pg is None:
                pg = dist.new_group(list(members), timeout=_default_timeout())
                _SHARED[(world_key, members)] = pg
        if me in members:
            mine = pg
    return mine


def _restore(shape, names, ranks, device_type, abstract: bool = False) -> Mesh:
    """Unpickle: an abstract mesh stays abstract; a real one is the live mesh when this process
    has one of that shape and device type, else an abstract one."""
    live = None if abstract else _LIVE.get((shape, names, ranks, device_type))
    return live or Mesh(shape, names, ranks, device_type)


@functools.lru_cache(maxsize=4096)
def _simulated(shape, names, ranks, device_type, rank: int, backend: str) -> Mesh:
    """One simulated mesh per (abstract mesh, rank, backend): the same object each time, so its
    groups and the programs bound to them are built once."""
    return Mesh(shape, names, ranks, device_type, None, (rank, SimulatedGroup(backend)))


def _axis_group(mesh: Mesh, axes: tuple[str, ...], me: int | None = None, pg=None) -> AxisGroup:
    """This rank's group over ``axes``; ``me`` and ``pg`` given: a simulated rank's."""
    simulated = me is not None
    me = dist.get_rank() if me is None else me
    ranks = _member_ranks(mesh, axes, me)
    if simulated or not axes:
        pg = pg if axes else None
    elif len(axes) == 1:
        pg = mesh.device_mesh.get_group(axes[0])
    else:
        key = tuple(a for a in mesh.axis_names if a in axes)
        pg = _GROUPS[(mesh, key)]
    position = {r: k for k, r in enumerate(sorted(ranks))}
    group_rank = tuple(position[r] for r in ranks)
    return AxisGroup(
        axes=axes,
        pg=pg,
        size=len(ranks),
        index=ranks.index(me),
        ranks=ranks,
        group_rank=group_rank,
    )
