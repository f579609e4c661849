"""Starting a torchrun rank's process group: which backend (NCCL or Gloo) and its
initialisation. Below :mod:`fshard.mesh` (``Mesh.create`` initialises the group under torchrun,
as DTensor's ``init_device_mesh``) and :mod:`fshard.launch` (``run`` under torchrun).

Example:
    >>> under_torchrun()  # a plain python process
    False
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported now, while no process group exists: its functions' defaults are ``group.WORLD``
# evaluated at import, and torch imports it lazily (torch._dynamo -> fsdp -> _shard). Imported
# after the default group exists, it would hold that group for the life of the process, so
# destroying the group (fshard.launch.shutdown) could never free it and join Gloo's threads.
import torch.distributed.nn.functional  # noqa: F401

__all__ = ["BACKENDS", "default_backend", "init_torchrun_group", "under_torchrun"]


#: The process-group backends fshard starts.
BACKENDS = ("gloo", "nccl")


def default_backend(
    env: dict | None = None, *, cuda_available: bool | None = None, device_count: int | None = None
) -> tuple[str, str]:
    """The process-group backend :func:`run` starts under ``torchrun``, and why.

    In order: ``FSHARD_BACKEND`` (``gloo`` or ``nccl``) when set; else NCCL when CUDA is
    available and this node has a GPU for each of its ranks (``LOCAL_WORLD_SIZE``, as torchrun
    sets it, else ``WORLD_SIZE``, is at most ``torch.cuda.device_count()``); else Gloo. NCCL
    needs one GPU per rank (two ranks on one GPU fail with ``Duplicate GPU detected``); Gloo
    runs any number of ranks, on CPU tensors (the default mesh under Gloo) or on CUDA tensors
    sharing the GPUs (``fs.Mesh.create(..., device_type="cuda")``, the examples' ``--device
    cuda``), which Gloo moves through host memory.

    Args:
      env: the environment to read (default ``os.environ``).
      cuda_available: overrides ``torch.cuda.is_available()`` (for tests).
      device_count: overrides ``torch.cuda.device_count()`` (for tests).

    Returns:
      ``(backend, reason)``: ``"nccl"`` or ``"gloo"``, and one line saying why.

    Example:
        >>> import fshard as fs
        >>> default_backend({"LOCAL_WORLD_SIZE": "2"}, cuda_available=True, device_count=1)
        ('gloo', '2 ranks on this node, 1 CUDA device: NCCL needs one GPU per rank')
    """
    env = os.environ if env is None else env
    forced = env.get("FSHARD_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(
                f"FSHARD_BACKEND={env['FSHARD_BACKEND']!r}: accepted values are 'gloo' and "
                "'nccl' (or unset, to choose by the GPUs present)"
            )
        return forced, "FSHARD_BACKEND"
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return "gloo", "CUDA is not available"
    if device_count is None:
        device_count = torch.cuda.device_count()
    ranks = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    have = f"{_count(ranks, 'rank')} on this node, {_count(device_count, 'CUDA device')}"
    if ranks > device_count:
        return "gloo", f"{have}: NCCL needs one GPU per rank"
    return "nccl", have


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def under_torchrun() -> bool:
    """Whether this process is a torchrun rank (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set)
    that is not one of :class:`World`'s local workers.

    Example:
        >>> under_torchrun()  # a plain python process
        False
    """
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")) and (
        os.environ.get("FSHARD_LAUNCH_WORKER") != "1"
    )


def init_torchrun_group(backend: str | None, timeout: float | None = None) -> str:
    """Initialise the default process group of a torchrun rank (see :func:`default_backend`)."""
    if backend is None:
        backend, why = default_backend()
        if backend == "gloo" and torch.cuda.is_available() and os.environ.get("RANK") == "0":
            print(
                f"fshard.launch: using Gloo ({why}); meshes default to CPU tensors, "
                "Mesh.create(..., device_type='cuda') puts them on the GPUs (shared)",
                file=sys.stderr,
            )
    elif backend not in BACKENDS:
        raise ValueError(f"run: backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError(
                "run: backend='nccl' needs CUDA, and torch.cuda.is_available() is False; use "
                "backend='gloo' (or leave it None)"
            )
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # The group is not destroyed at exit: under torch 2.11 a rank that destroyed it in an
    # atexit hook made the other node's torchrun agent lose the rendezvous store ("Failed to
    # recv ... The connection to the C10d store has failed") in 2 of 3 two-node runs
    # (tests/test_launch.py::test_readme_multinode_torchrun_command; 0 of 3 without it).
    if timeout is None:  # Mesh.create's: torch's default timeout
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return backend
