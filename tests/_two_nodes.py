"""Run by tests/test_launch.py under the README's multi-node torchrun command (two loopback
"nodes", one process each): shards a tensor over both nodes and gathers it back, then says which
Gloo threads are left once ``run`` returned (none: it closed the group it made, and freed it)."""

import os
from pathlib import Path

import torch
import torch.distributed as dist

import fshard as fs
from fshard.launch import run


def shard_and_gather():
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.arange(6.0).reshape(2, 3), mesh, fs.P("x"))
    return dist.get_rank(), x.local.tolist(), fs.gather(x).tolist()


def gloo_threads() -> list[str]:
    """This process's threads that Gloo started (``pt_gloo_runloop``, ``gloo_tcp_loop``)."""
    names = (
        Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")
    )
    return sorted(n for n in names if "gloo" in n)


if __name__ == "__main__":
    print("RESULT", run(shard_and_gather, 2), flush=True)
    print("GLOO THREADS", gloo_threads(), flush=True)
