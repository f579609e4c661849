"""Local multi-process launcher: run a function on N ranks joined by one Gloo process group.

Local ranks are always Gloo; their tensors live on the CPU unless a mesh says otherwise
(``fs.Mesh.create(..., device_type="cuda")``: CUDA tensors over Gloo, ranks sharing the GPUs).
Under ``torchrun``, :func:`run` picks NCCL or Gloo by :func:`default_backend`.

:class:`World` keeps N spawned worker processes (one ``torch.distributed`` Gloo group) alive
across many calls, so tests and notebooks pay the start-up cost once and module-level state
(e.g. mesh caches) persists between calls. :func:`run` is the one-shot form, and under
``torchrun`` it runs the function in place instead.

Example:
    >>> import torch.distributed as dist
    >>> from fshard.launch import World
    >>> with World(2) as world:  # two ranks, kept up across calls
    ...     world.run(dist.get_rank), world.run(dist.get_world_size)
    ([0, 1], [2, 2])
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import multiprocessing as mp
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.reduction
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from . import _by_value, consistency
from ._torchrun import BACKENDS, default_backend, init_torchrun_group, under_torchrun
from .mesh import PeerFailed, abandoned, release_groups

__all__ = ["RankError", "World", "default_backend", "is_worker", "run", "shutdown"]

_WORKER_ENV = "FSHARD_LAUNCH_WORKER"
_GRACE_S = 5.0  # after one rank raises, how long the others get to finish
_PROBE_S = 5.0  # after a failed run, how long the health-check barrier may take
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
#: Set only in the environment a fork server starts with: the pid of the driver it must die
#: with (read when the server imports this module, :func:`_server_dies_with_driver`).
_SERVER_PARENT_ENV = "_FSHARD_FORKSERVER_PARENT"
#: Set only in the environment a fork server starts with: the driver's own ``PYTHONPATH`` and
#: ``PYTHONSAFEPATH`` (JSON), put back when the server imports this module (:func:`_driver_path`)
_SERVER_ENV_BEFORE = "_FSHARD_FORKSERVER_ENV_BEFORE"
#: Variables that may differ between the driver and the fork server serving it: pytest names
#: the current test in one; the workers see its value at the server's start.
_ENV_IGNORED = frozenset({"PYTEST_CURRENT_TEST"})


def is_worker() -> bool:
    """Whether this process is a :class:`World` worker.

    Returns:
      ``True`` inside a worker started by :class:`World` or :func:`run`, else ``False``.

    Example:
        >>> import fshard as fs
        >>> fs.launch.is_worker()  # in the launching process; True inside fs.launch.run's ranks
        False
    """
    return os.environ.get(_WORKER_ENV) == "1"


class RankError(RuntimeError):
    """A rank raised an exception, or its process died, inside :meth:`World.run`.

    When a rank died, it is the one reported (with its exit code), not the ranks that then
    failed in a collective with it; otherwise the lowest rank that raised an error of its own
    (not a collective failure) is reported. The message lists the other ranks' errors.

    Attributes:
      rank: The failing rank (see above).
      exc_type: Class name of the remote exception (``"WorkerDied"`` if the process died).
      remote_traceback: The remote traceback as text (empty if the process died).
      exception: The original exception object if it could be unpickled, else ``None``.
      exit_code: The process exit code if the worker died (negative: killed by that signal),
        else ``None``.

    Example:
        >>> import math, fshard as fs
        >>> try:
        ...     fs.launch.run(math.sqrt, 1, (-1.0,))
        ... except fs.launch.RankError as e:
        ...     print(e.rank, e.exc_type)
        0 ValueError
    """

    def __init__(
        self,
        message: str,
        rank: int = -1,
        exc_type: str = "",
        remote_traceback: str = "",
        exception: BaseException | None = None,
        exit_code: int | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exception = exception
        self.exit_code = exit_code


@contextlib.contextmanager
def _environ(**values: str):
    """``values`` in this process's environment while a process is started (it inherits the
    environment), as it was before afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


_SEED_LOCK = threading.Lock()
_SEED: list[str] = []


def _drawn_hash_seed() -> str:
    """The hash seed of this driver's workers when ``PYTHONHASHSEED`` is unset: drawn once per
    process, so every World can be forked from one server (a process's hash seed is fixed when
    its interpreter starts)."""
    with _SEED_LOCK:
        if not _SEED:
            _SEED.append(str(random.SystemRandom().randrange(1, 2**32)))
        return _SEED[0]


# -- the fork server ---------------------------------------------------------------------------
# multiprocessing's forkserver machinery with a server of fshard's own: its global server's
# preload list and environment are the program's, and one started under another environment
# must not serve a World (modules read the environment when imported: fshard.config, torch).

_SERVER_LOCK = threading.Lock()
#: ``[(key, server, pid)]``: the servers in use, the most recently used last, and the keys they
#: serve. Up to three: a program that starts Worlds under a few environments in turn (a test
#: suite that unsets a variable for some tests) forks from each without restarting it.
_SERVERS: list[tuple[tuple, mp.forkserver.ForkServer, int]] = []
_MAX_SERVERS = 3
#: Servers replaced by one for another environment: they exit once their workers are gone.
_RETIRED: list[int] = []


def _retire(server: mp.forkserver.ForkServer, pid: int, running: bool) -> None:
    """Ask ``server`` to exit (closing its "alive" pipe; it exits once its workers have)."""
    with contextlib.suppress(OSError, TypeError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = server._forkserver_pid = None
    if running:
        _RETIRED.append(pid)


def _fork_server(
    seed: str, pdeathsig: bool, preload: tuple = ()
) -> tuple[mp.forkserver.ForkServer, int]:
    """A running fork server (and its pid) started with this process's environment and
    ``PYTHONHASHSEED=seed``, having imported torch, fshard and ``preload``; started if there is
    none."""
    env = frozenset(
        (k, v) for k, v in os.environ.items() if k not in _ENV_IGNORED and k != "PYTHONHASHSEED"
    )
    key = (seed, pdeathsig, preload, env, tuple(sys.path), os.getcwd(), mp.spawn.get_executable())
    with _SERVER_LOCK:
        for pid in list(_RETIRED):  # reap the retired servers that exited
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    _RETIRED.remove(pid)
        for entry in list(_SERVERS):
            old_key, server, pid = entry
            running = True
            with contextlib.suppress(ChildProcessError):
                running = os.waitpid(pid, os.WNOHANG)[0] == 0
            if running and old_key == key:
                _SERVERS.remove(entry)
                _SERVERS.append(entry)  # the most recently used
                return server, pid
            if not running or old_key == key:
                _SERVERS.remove(entry)
                _retire(server, pid, running)
        while len(_SERVERS) >= _MAX_SERVERS:
            _, server, pid = _SERVERS.pop(0)  # the least recently used
            _retire(server, pid, True)
        server = mp.forkserver.ForkServer()
        server.set_forkserver_preload([__name__, *preload])  # torch and fshard, imported once
        parent = {_SERVER_PARENT_ENV: str(os.getpid())} if pdeathsig else {}
        with _environ(PYTHONHASHSEED=seed, **parent, **_driver_path()):
            server.ensure_running()
        pid = server._forkserver_pid
        _SERVERS.append((key, server, pid))
        return server, pid


class _ServedPopen(mp.popen_forkserver.Popen):
    """``multiprocessing``'s forkserver ``Popen``, forked by ``server`` (not the global one)."""

    def __init__(self, process_obj: Any, server: mp.forkserver.ForkServer):
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        # popen_forkserver.Popen._launch, with self._server for the module's global server
        prep_data = mp.spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp.context.set_spawning_popen(self)
        try:
            mp.reduction.dump(prep_data, buf)
            mp.reduction.dump(process_obj, buf)
        finally:
            mp.context.set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this process
        self.finalizer = mp.util.Finalize(self, mp.util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = mp.forkserver.read_signed(self.sentinel)


class _ServedProcess(mp.context.ForkServerProcess):
    """A process forked by ``server`` (a :class:`~multiprocessing.forkserver.ForkServer`)."""

    def __init__(self, server: mp.forkserver.ForkServer, **kwargs: Any):
        super().__init__(**kwargs)
        self._server = server

    def _Popen(self, process_obj: Any) -> _ServedPopen:  # noqa: N802 -- multiprocessing's name
        return _ServedPopen(process_obj, self._server)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()  # sent to the child, which has no use for the server
        del state["_server"]
        return state


def _driver_path() -> dict[str, str]:
    """The environment a fork server starts with so that it imports what the driver imports:
    the driver's ``sys.path`` as its ``PYTHONPATH`` (an empty entry: the working directory),
    and ``PYTHONSAFEPATH`` so that ``python -c`` puts no working directory before it. CPython
    3.11's ``multiprocessing.forkserver.main`` is handed the driver's ``sys_path`` but imports
    the preload modules (fshard itself) without applying it: a World started in a checkout
    ran that checkout's fshard in its ranks, not the one the driver imported. The driver's
    own values come back in the server (:func:`_server_env_restored`), so the workers see the
    driver's environment. (An entry holding ``os.pathsep`` cannot travel so and is left out.)"""
    path = [p or os.getcwd() for p in sys.path if os.pathsep not in p]
    before = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return {
        "PYTHONPATH": os.pathsep.join(path),
        "PYTHONSAFEPATH": "1",
        _SERVER_ENV_BEFORE: json.dumps(before),
    }


def _server_env_restored() -> None:
    """In a fork server: the driver's own ``PYTHONPATH`` and ``PYTHONSAFEPATH`` back in the
    environment (:func:`_driver_path` replaced them for the server's start), so the workers
    and what they start inherit the driver's. Anywhere else, nothing."""
    before = os.environ.pop(_SERVER_ENV_BEFORE, None)
    if before is None:
        return
    for k, v in json.loads(before).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _server_dies_with_driver() -> None:
    """In a fork server a World started from its main thread (its environment names the
    driver, its parent): the kernel kills it when the driver dies (``PR_SET_PDEATHSIG``), and
    the workers it forked with it. Anywhere else, nothing."""
    driver = os.environ.pop(_SERVER_PARENT_ENV, None)  # the workers must not inherit it
    if driver is None or not sys.platform.startswith("linux") or os.getppid() != int(driver):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(driver):  # the driver died before prctl took effect
        os._exit(1)


_server_dies_with_driver()
_server_env_restored()


class World:
    """A persistent pool of ``world_size`` worker processes forming one Gloo process group.

    Workers are spawned lazily on the first :meth:`run`, and again on the next :meth:`run`
    after a failure that left the process group unusable (a hang, a dead worker, a rank stuck
    in a collective, a collective that raised, e.g. Gloo's timeout). Each worker runs with
    ``torch.set_num_threads(1)`` and has ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT`` and ``FSHARD_LAUNCH_WORKER=1`` in its environment, and
    every worker the same ``PYTHONHASHSEED`` (the driver's, else one drawn per driver
    process): the ranks of an SPMD program must take the same path, and a ``set`` of strings
    iterates in hash order (transformers' lara_mini builds its attention masks in ``set``
    order; with a hash seed per process the ranks issued their collectives in different
    orders, which the consistency check refused). Under ``torchrun``, export
    ``PYTHONHASHSEED`` yourself.

    Start-up: workers are forked from a fork server of fshard's own (``multiprocessing``'s
    forkserver mechanism, not its global server, whose settings stay the program's), a fresh
    interpreter that imported ``torch`` and fshard once and does nothing else (no tensor
    work, no CUDA): a World starts in a fraction of the time of spawning N interpreters that
    each import torch. ``preload`` names more modules for the server to import first, e.g.
    ``transformers.models.llama.modeling_llama``: each worker then starts with them instead of
    importing them itself (about 5 s per worker for that one here); a module that does not
    import is left to the workers, as multiprocessing's preload does. Worlds with other
    ``preload`` lists fork from other servers.
    The server is started with the driver's environment, ``sys.path`` and working directory,
    and serves only Worlds started under the same ones (a World started after ``os.environ``
    changed, e.g. ``FSHARD_CHECK_CONSISTENCY``, gets a new server, so what modules read from
    the environment at import is what the driver has when the World starts; only
    ``PYTEST_CURRENT_TEST`` may differ). Like spawned workers, forked ones share no state with
    the driver but what ``fn`` and its arguments carry.

    Isolation: the rendezvous store and Gloo listen on the loopback interface only. Workers
    exit when the driver process dies, however it dies (a watchdog thread in each worker sees
    the pipe from the driver close; on Linux the kernel also sends SIGKILL via
    ``PR_SET_PDEATHSIG`` when the World was started from the main thread: to the fork server
    when the driver dies, and to the workers when the server dies).

    Args:
      world_size: Number of ranks (an int >= 1).
      timeout: Default per-call limit in seconds for :meth:`run`; also bounds worker start-up.
      pg_timeout: Timeout in seconds of the Gloo process group (how long a collective waits
        for the other ranks before raising), and of the groups fshard's meshes make over
        its sub-sets of ranks (a mesh axis's).
      preload: module names the workers start with, imported once by the fork server (see
        Start-up).

    Example:
        >>> import torch.distributed as dist, fshard as fs
        >>> with fs.launch.World(2) as world:  # the ranks stay up between calls
        ...     world.run(dist.get_world_size), world.run(dist.get_rank)
        ([2, 2], [0, 1])
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 300.0,
        pg_timeout: float = 60.0,
        preload: Sequence[str] = (),
    ):
        _check_world_size(world_size)
        if isinstance(preload, str) or not all(isinstance(m, str) for m in preload):
            raise TypeError(
                f"World: preload must be a sequence of module names, got {preload!r} (e.g. "
                "preload=('transformers.models.llama.modeling_llama',))"
            )
        self.preload = tuple(preload)
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self._store: dist.TCPStore | None = None
        self._generation = 0
        self._hash_seed: str | None = None
        self._closed = False
        self._gave_up = False  # a rank's reply said it gave a process group up
        # Mutated in place (never rebound) so the finalizer always sees the live workers.
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._lifelines: list[Connection] = []
        # Runs on close(), on garbage collection and at interpreter exit: no orphans.
        self._finalizer = weakref.finalize(
            self, _terminate, self._procs, self._conns, self._lifelines
        )

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list:
        """Runs ``fn(*args)`` on every rank and returns the results in rank order.

        ``fn``, ``args`` and the results travel by pickle, so ``fn`` must be importable
        (defined at module level of a module or script). In an interactive session
        (``python -c``, a script on stdin, the REPL, a notebook: ``__main__`` has no file the
        workers could import) the functions and classes ``__main__`` defines travel by value
        instead: their code and the globals it uses (:mod:`fshard._by_value`).

        Args:
          fn: The function to run on each rank.
          *args: Positional arguments, the same for every rank.
          timeout: Seconds to wait for all ranks; defaults to the World's ``timeout``.

        Returns:
          A list with ``fn``'s return value from each rank, rank 0 first.

        Raises:
          RankError: A rank raised or its process died (the lowest such rank is reported).
          TimeoutError: Not every rank finished within ``timeout``; all workers are killed.

        Example::

          world.run(dist.get_rank)  # [0, 1]
        """
        if self._closed:
            raise RuntimeError("World.run: this World is closed; create a new one")
        if is_worker():
            raise RuntimeError(
                "fshard.launch: cannot launch workers from inside a World worker "
                "(nested launches are not supported); call fn directly instead"
            )
        timeout = self.timeout if timeout is None else timeout
        try:
            payload = _by_value.dumps((fn, args))
        except Exception as e:
            raise TypeError(
                f"World.run: could not pickle fn={fn!r} and its args ({e}); fn must be "
                "importable (defined at module level, not a lambda or a local function), or "
                "defined in an interactive session (python -c, stdin, a notebook), where "
                "__main__'s functions and classes travel by value"
            ) from e
        try:
            if len(self._procs) != self.world_size or not all(p.is_alive() for p in self._procs):
                self._start()
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a dead worker: _collect reports it
                    conn.send_bytes(payload)
            outcomes, pending = self._collect(timeout)
        except BaseException:  # e.g. KeyboardInterrupt: the workers' state is unknown
            self._kill()
            raise
        return self._results(outcomes, pending, timeout)

    def close(self) -> None:
        """Terminates the workers (then kills any that linger) and joins them; idempotent."""
        self._closed = True
        self._finalizer()
        self._store = None

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _healthy(self, failed: list[int]) -> bool:
        """After ranks raised: whether the process group still works (one bounded barrier)."""
        if not failed or not self._procs:
            return True
        payload = pickle.dumps((_probe, ()))
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(payload)
        outcomes, pending = self._collect(_PROBE_S + 1.0)
        return not pending and all(o[0] == "ok" for o in outcomes.values())

    def _kill(self) -> None:
        _terminate(self._procs, self._conns, self._lifelines)
        self._gave_up = False

    def _start(self) -> None:
        self._kill()
        if self._hash_seed is None:  # every rank iterates sets alike
            self._hash_seed = os.environ.get("PYTHONHASHSEED") or _drawn_hash_seed()
        if self._store is None:
            # TCPStore(host, ...) as master listens on every interface; handing it a socket
            # bound to loopback keeps the store local. Port 0: the OS picks a free port.
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            port = listener.getsockname()[1]
            self._store = dist.TCPStore(
                "127.0.0.1",
                port,
                self.world_size,
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),  # the store owns (and closes) it
            )
        self._generation += 1
        # PR_SET_PDEATHSIG fires when the *thread* that started the child exits: only safe to
        # ask for from the main thread (the watchdog pipe covers every case anyway).
        pdeathsig = threading.current_thread() is threading.main_thread()
        server, server_pid = _fork_server(self._hash_seed, pdeathsig, self.preload)
        for rank in range(self.world_size):
            parent_conn, child_conn = mp.Pipe()
            # Never written to: the worker sees EOF on it exactly when this process is gone.
            lifeline_r, lifeline_w = mp.Pipe(duplex=False)
            proc = _ServedProcess(
                server,
                target=_worker,
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    self._generation,
                    self.pg_timeout,
                    child_conn,
                    lifeline_r,
                    server_pid if pdeathsig else None,
                ),
                name=f"fshard-rank{rank}",
            )
            # (the seed again: should the server have died since, it restarts with it)
            with _by_value.unimportable_main_hidden(), _environ(PYTHONHASHSEED=self._hash_seed):
                proc.start()
            child_conn.close()  # else the parent would never see EOF when the child dies
            lifeline_r.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._lifelines.append(lifeline_w)
        # Each worker replies once its process group is up; a failure there raises here
        # (run() then kills the workers).
        self._results(*self._collect(self.timeout), self.timeout)

    def _collect(self, timeout: float) -> tuple[dict[int, tuple], set[int]]:
        """Waits for one reply per rank; returns {rank: reply} and the ranks that gave none.

        Stops ``_GRACE_S`` after the first error reply, and at once when a rank dies (the
        group is lost: the others can only fail or hang).
        """
        outcomes: dict[int, tuple] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        failed_at = None
        while pending:
            end = deadline if failed_at is None else min(deadline, failed_at + _GRACE_S)
            now = time.monotonic()
            if now >= end:
                break
            waitables = [self._conns[r] for r in pending]
            waitables += [self._procs[r].sentinel for r in pending]
            wait(waitables, timeout=end - now)
            for rank in sorted(pending):
                reply = self._poll(rank)
                if reply is not None:
                    pending.discard(rank)
                    outcomes[rank] = reply
                    if reply[0] != "ok" and failed_at is None:
                        failed_at = time.monotonic()
            if any(o[0] == "died" for o in outcomes.values()):
                break
        return outcomes, pending

    def _poll(self, rank: int) -> tuple | None:
        """The reply of ``rank`` if it has one, ``("died", exit_code)`` if it died, else None."""
        proc, conn = self._procs[rank], self._conns[rank]
        alive = proc.is_alive()  # checked before reading, so a reply sent just before exit wins
        try:
            if conn.poll():
                message, gave_up = pickle.loads(conn.recv_bytes())
                self._gave_up |= gave_up
                return message
        except (EOFError, OSError):
            alive = False
        if alive:
            return None
        proc.join(1.0)
        return ("died", proc.exitcode)

    def _results(self, outcomes: dict[int, tuple], pending: set[int], timeout: float) -> list:
        failed = [r for r, o in outcomes.items() if o[0] != "ok"]
        died = any(outcomes[r][0] == "died" for r in failed)
        if pending or died or self._gave_up or not self._healthy(failed):
            # A rank is stuck (likely in a collective), the group lost a member, a rank gave a
            # group up (fshard._comm.abandon: a pipeline stage failed), or a failed collective
            # left it out of step (e.g. Gloo's timeout closes the pair): the process group is
            # unusable, so restart the world on the next run.
            self._kill()
        if failed:
            # Blame the cause, not its echoes: a dead rank, then a rank's own error, then a
            # collective that failed because of them.
            failed.sort(key=lambda r: (outcomes[r][0] != "died", bool(outcomes[r][-1]), r))
            note = "".join(f"\n\n(rank {r} then {_summary(outcomes[r])})" for r in failed[1:])
            if pending:
                note += (
                    f"\n\n(ranks {sorted(pending)} had not finished after the failure and "
                    "were killed; the world restarts on the next run)"
                )
            raise _rank_error(failed[0], outcomes[failed[0]], note)
        if pending:
            finished = sorted(outcomes)
            raise TimeoutError(
                f"World.run: ranks {sorted(pending)} did not finish within {timeout:g} s "
                f"(ranks {finished} did). {_CAUSE} All workers were killed; the world "
                "restarts on the next run."
            )
        return [outcomes[r][1] for r in range(self.world_size)]


#: What a collective that timed out (or hung) usually means: every timeout says it.
_CAUSE = (
    "The usual cause is ranks that disagree: a collective not issued on every rank (a branch "
    "on the rank, e.g. `if mesh.rank == 0: print(fs.gather(g))`, an early return or exception "
    "on one rank), or per-rank shapes (batch sizes) that make ranks issue different "
    "collectives. Rerun with FSHARD_CHECK_CONSISTENCY=every to have the first collective the "
    "ranks disagree on named."
)


def _collective_error(exc: BaseException) -> BaseException:
    """A torchrun rank's failed collective (Gloo's ``Timed out waiting 300000ms for recv``),
    with its usual cause; other errors as they are."""
    if not isinstance(exc, Exception) or isinstance(exc, PeerFailed) or not _collective_failed(exc):
        return exc  # (a PeerFailed names its cause: a peer's error, not ranks that disagree)
    kind = TimeoutError if "timed out" in str(exc).lower() else RuntimeError
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return kind(f"rank {dist.get_rank()}: a collective failed ({first[:300]}). {_CAUSE}")


def run(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout: float = 300.0,
    backend: str | None = None,
) -> list:
    """Runs ``fn(*args)`` on ``world_size`` ranks and returns the results in rank order.

    Locally this starts a :class:`World` (Gloo ranks), runs ``fn`` once and closes the World.
    Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set) it runs ``fn`` in
    this process instead, initialising the default process group if needed (with ``timeout``
    as its timeout: a collective that waits longer, e.g. one issued on one rank only, raises a
    ``TimeoutError`` naming that usual cause instead of hanging), and gathers every rank's
    result. A group ``run`` initialised is closed by :func:`shutdown` before it returns (a
    Gloo group left to interpreter teardown can abort the process after its output);
    initialise it yourself (``dist.init_process_group``) to keep using it after. The backend
    there is ``backend``, else
    :func:`default_backend`: NCCL when this node has a GPU per rank, else Gloo (said on
    stderr by rank 0 when GPUs are present). Meshes follow the backend: ``Mesh.create``
    defaults to CUDA blocks under NCCL and CPU blocks under Gloo.

    Args:
      fn: The function to run on each rank; defined at module level of a module or script,
        or anywhere in an interactive session (notebook, ``python -c``; sent by value).
      world_size: Number of ranks (an int >= 1); under ``torchrun`` it must equal
        ``WORLD_SIZE``.
      args: Positional arguments for ``fn``, the same for every rank.
      timeout: Seconds to wait for all ranks (locally); under ``torchrun``, the timeout of
        the process group ``run`` initialises (a collective that waits longer raises).
      backend: ``"gloo"``, ``"nccl"`` or ``None`` (choose; see above). The local launch
        runs Gloo only.

    Returns:
      A list with ``fn``'s return value from each rank, rank 0 first.

    Example:
        >>> import torch.distributed as dist, fshard as fs
        >>> fs.launch.run(dist.get_rank, world_size=2)  # in a script: under if __name__ == "__main__"
        [0, 1]
    """
    _check_world_size(world_size)
    if backend not in (None, *BACKENDS):
        raise ValueError(f"run: backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if is_worker():
        raise RuntimeError(
            "fshard.launch.run: called inside a World worker; nested launches are not "
            "supported (call fn directly: this process is already one rank of a world)"
        )
    if under_torchrun():
        env_size = int(os.environ["WORLD_SIZE"])
        if world_size != env_size:
            raise ValueError(
                f"run: world_size={world_size} does not match WORLD_SIZE={env_size} set by "
                "torchrun; pass the same number of processes"
            )
        owned = not dist.is_initialized()
        if owned:
            init_torchrun_group(backend, timeout)
        gathered: list[Any] = [None] * world_size
        try:
            result = fn(*args)
            dist.all_gather_object(gathered, result)
        except Exception as e:
            wrapped = _collective_error(e)
            if wrapped is e:
                raise
            raise wrapped from e
        if owned:
            # Not from an atexit hook: on torch 2.11 that raced torchrun's agents.
            shutdown()
        return gathered
    if backend == "nccl":
        raise ValueError(
            "run: the local launcher starts Gloo ranks; run under torchrun for NCCL "
            "(torchrun --nproc-per-node N script.py), or pass backend='gloo' / None"
        )
    with World(world_size, timeout=timeout) as world:
        return world.run(fn, *args)


def shutdown() -> None:
    """Closes this torchrun rank's world: a barrier, ``dist.destroy_process_group()``, and the
    release of every process group fshard's meshes hold (:func:`fshard.mesh.release_groups`),
    so each group is freed, and its Gloo threads joined, before this returns.

    Call it at the end of a script that initialised the process group itself (or let
    :func:`run` do it for the group it made). ``dist.destroy_process_group()`` alone leaves
    the groups alive in fshard's meshes until interpreter teardown, where a Gloo worker still
    releasing a finished collective's tensors aborts the process after its output
    ("terminate called without an active exception": 3 of 36 two-node runs on a loaded
    machine). Meshes made before are unusable after it; a new world makes new ones.

    Raises:
      RuntimeError: no default process group is initialised (nothing to close), or called in
        a :class:`World`'s worker (the World owns its group and keeps it between runs).

    Example (one rank here; under torchrun the same last line ends the script)::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> mesh = fs.Mesh.create((1,), ("dp",))
        >>> fs.launch.shutdown()
        >>> dist.is_initialized()
        False
    """
    if is_worker():
        raise RuntimeError(
            "fshard.launch.shutdown: called inside a World worker, whose World owns the process "
            "group and keeps it between runs; World.close() ends it"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "fshard.launch.shutdown: no default process group is initialised; it closes the "
            "world dist.init_process_group (or Mesh.create under torchrun) started"
        )
    dist.barrier()
    dist.destroy_process_group()
    release_groups()
    consistency.reset()  # its running digests are keyed by the groups


def _check_world_size(world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be an int >= 1 (the number of ranks); got {world_size!r} "
            f"of type {type(world_size).__name__}"
        )


def _died_how(code: int | None) -> str:
    how = f"exit code {code}"
    if code is not None and code < 0:
        how += f" (killed by {signal.Signals(-code).name})"
    return how


def _summary(reply: tuple) -> str:
    """One line for a rank's failure that is not the one reported."""
    if reply[0] == "died":
        return f"died with {_died_how(reply[1])}"
    text = reply[2].splitlines()[0] if reply[2] else ""
    return f"raised {reply[1]}: {text[:300]}"


def _rank_error(rank: int, reply: tuple, note: str = "") -> RankError:
    if reply[0] == "died":
        code = reply[1]
        cause = "os._exit, a segfault, the OOM killer, or an error while the worker started"
        if code == -signal.SIGABRT:  # Gloo aborts the process on a mismatched collective
            cause = (
                "most often Gloo aborting on a collective whose size or dtype differs between "
                "ranks (per-rank shapes or batch sizes, a collective one rank skipped): rerun "
                "with FSHARD_CHECK_CONSISTENCY=every to have it named before it runs; else "
                "an abort in a C++ library"
            )
        return RankError(
            f"rank {rank} died with {_died_how(code)} before replying ({cause}: see its "
            f"stderr){note}",
            rank=rank,
            exc_type="WorkerDied",
            exit_code=code,
        )
    _, exc_type, text, tb, exc_bytes, collective = reply
    try:
        exception = pickle.loads(exc_bytes) if exc_bytes is not None else None
    except Exception:
        exception = None
    if (collective or "timed out" in text.lower()) and not text.startswith("fshard"):
        # Gloo's own words (a timeout, a closed connection): add what they usually mean
        text = f"{text}\n\nA collective failed on rank {rank}. {_CAUSE}"
    return RankError(
        f"rank {rank} raised {exc_type}: {text}\n\nRemote traceback (rank {rank}):\n{tb}{note}",
        rank=rank,
        exc_type=exc_type,
        remote_traceback=tb,
        exception=exception,
    )


def _error_reply(exc: BaseException) -> tuple:
    """``("error", type name, text, traceback, pickled exc or None, collective failed)``."""
    try:
        exc_bytes = pickle.dumps(exc)
    except Exception:
        exc_bytes = None
    text = traceback.format_exc()
    return ("error", type(exc).__name__, str(exc), text, exc_bytes, _collective_failed(exc))


def _probe() -> None:
    dist.barrier(async_op=True).wait(timeout=timedelta(seconds=_PROBE_S))


def _collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a torch.distributed collective (Gloo raises plain
    RuntimeErrors: a timeout, a closed pair), i.e. is likely an echo of another rank's failure.
    Only orders the blame: whether the group survived is checked by :func:`_probe`."""
    if isinstance(exc, dist.DistError):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any(
        f.filename.endswith(os.path.join("distributed", "distributed_c10d.py")) for f in frames
    )


def _terminate(procs: list, *conns: list[Connection]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    for group in conns:
        for c in group:
            c.close()
        group.clear()
    procs.clear()


def _die_with_parent(lifeline: Connection, parent_pid: int | None) -> None:
    """Exit this worker as soon as the driver process is gone, even while ``fn`` runs."""
    if parent_pid is not None and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the driver died before prctl took effect
            os._exit(1)

    def watch() -> None:
        try:
            lifeline.recv_bytes()  # the driver never writes: this returns only by EOF
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="fshard-lifeline", daemon=True).start()


def _fresh_run() -> None:
    """Each run starts with no consistency history: a run that failed on some ranks (or timed
    out) may have left the ranks with different sequence numbers and digests."""
    consistency.reset()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    generation: int,
    pg_timeout: float,
    conn: Connection,
    lifeline: Connection,
    parent_pid: int | None,
) -> None:
    _die_with_parent(lifeline, parent_pid)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ[_WORKER_ENV] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # no hostname resolution needed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(1)  # N ranks share the machine's cores

    def reply(message: tuple) -> bool:
        # with whether this rank gave a process group up (a failed pipeline stage closed its
        # connections): the group is unusable, and the driver restarts the world
        try:
            data = pickle.dumps((message, abandoned()))
        except Exception as e:  # an unpicklable result
            data = pickle.dumps((_error_reply(e), abandoned()))
        try:
            conn.send_bytes(data)
        except OSError:
            return False  # the parent is gone
        return True

    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=pg_timeout)
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"gen{generation}", store),  # fresh keys per restart
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
    except BaseException as e:
        reply(_error_reply(e))
        return
    if not reply(("ok", None)):
        return
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent closed the pipe
        try:
            fn, args = pickle.loads(payload)
            _fresh_run()
            message = ("ok", fn(*args))
        except BaseException as e:
            message = _error_reply(e)
        if not reply(message):
            return
