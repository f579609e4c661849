"""Run by tests/test_launch.py under the README's multi-node torchrun command (two loopback
"nodes", one process each): shards a tensor over both nodes and gathers it back."""

import torch
import torch.distributed as dist

import fshard as fs
from fshard.launch import run


def shard_and_gather():
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.arange(6.0).reshape(2, 3), mesh, fs.P("x"))
    return dist.get_rank(), x.local.tolist(), fs.gather(x).tolist()


if __name__ == "__main__":
    print("RESULT", run(shard_and_gather, 2), flush=True)
