"""Quickstart: shard a tensor on 2 local ranks, reshard it, and look at layouts and traffic.

python examples/quickstart.py                   # self-launches 2 local Gloo ranks (CPU tensors)
python examples/quickstart.py --device cuda     # the same ranks with their blocks on the GPU(s)
torchrun --nproc-per-node 2 examples/quickstart.py

``--device`` says where the local blocks live: ``cuda`` or ``cpu``; by default ``cuda`` when the
process group is NCCL (torchrun on a machine with a GPU per rank) and ``cpu`` otherwise (Gloo).
Under torchrun the mesh spans every rank (``--nproc-per-node 1`` on one GPU runs NCCL).
"""

import os

import torch
import torch.distributed as dist
from _device import device_args

import fshard as fs


def main(device=None):
    mesh = fs.Mesh.create((dist.get_world_size(),), ("x",), device_type=device)
    t = torch.arange(35.0, device=mesh.device()).reshape(5, 7)  # uneven: 5 rows over 2 ranks
    x = fs.shard(t, mesh, fs.P("x", None))
    rank = dist.get_rank()
    lines = []
    for spec in [fs.P(None, "x"), fs.P(), fs.P(partial="x")]:
        planned = fs.plan(x.layout, spec)
        with fs.debug.comm_log() as log:
            y = fs.reshard(x, spec)
        assert torch.equal(fs.gather(y), t)
        lines.append(
            f"{x.spec} -> {spec}: planned {[(s.op.name, s.nbytes) for s in planned]}, "
            f"issued {[(r.op, r.nbytes) for r in log]}"
        )
    y = fs.reshard(x, fs.P(None, "x"))  # collectives run on every rank, never under `if rank`
    if rank == 0:
        fs.debug.visualize(x)
        fs.debug.visualize(y)
        print("\n".join(lines))
    # gradients keep the parameter's layout; fs.shard puts the CPU tensor on the mesh's device
    w = fs.shard(torch.randn(7, 3, generator=torch.Generator().manual_seed(0)), mesh, fs.P("x"))
    g = torch.func.grad(lambda w: (fs.gather(w) ** 2).sum())(w)
    assert g.layout == w.layout and torch.allclose(fs.gather(g), 2 * fs.gather(w))
    return rank, tuple(x.local.shape), str(x.local.device)


def parse_args(argv=None) -> dict:
    return device_args(__doc__, argv)


if __name__ == "__main__":
    from fshard.launch import run

    args = parse_args()
    under_torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    ranks = int(os.environ["WORLD_SIZE"]) if under_torchrun else 2
    shapes = run(main, ranks, (args["device"],))
    if not under_torchrun or int(os.environ["RANK"]) == 0:  # run() closed its group
        print("local shapes per rank:", shapes)
