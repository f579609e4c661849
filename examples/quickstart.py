"""Quickstart: shard a tensor on 2 local ranks, reshard it, and look at layouts and traffic.

python examples/quickstart.py          # self-launches 2 local Gloo ranks
torchrun --nproc-per-node 2 examples/quickstart.py
"""

import torch
import torch.distributed as dist

import fshard as fs


def main():
    mesh = fs.Mesh.create((dist.get_world_size(),), ("x",))
    t = torch.arange(35.0).reshape(5, 7)  # uneven on purpose: 5 rows over 2 ranks
    x = fs.shard(t, mesh, fs.P("x", None))
    rank = dist.get_rank()
    lines = []
    for spec in [fs.P(None, "x"), fs.P(), fs.P(partial="x")]:
        planned = fs.plan(x.layout, spec)
        with fs.debug.comm_log() as log:
            y = fs.reshard(x, spec)
        assert torch.equal(fs.gather(y), t)
        lines.append(
            f"{x.spec} -> {spec}: planned {[(s.op, s.nbytes) for s in planned]}, "
            f"issued {[(r.op, r.nbytes) for r in log]}"
        )
    y = fs.reshard(x, fs.P(None, "x"))  # collectives run on every rank, never under `if rank`
    if rank == 0:
        fs.debug.visualize(x)
        fs.debug.visualize(y)
        print("\n".join(lines))
    # gradients keep the parameter's layout
    w = fs.shard(torch.randn(7, 3, generator=torch.Generator().manual_seed(0)), mesh, fs.P("x"))
    g = torch.func.grad(lambda w: (fs.gather(w) ** 2).sum())(w)
    assert g.layout == w.layout and torch.allclose(fs.gather(g), 2 * fs.gather(w))
    return rank, tuple(x.local.shape)


if __name__ == "__main__":
    from fshard.launch import run

    print("local shapes per rank:", run(main, 2))
