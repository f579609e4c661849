"""What a newcomer meets first (issue 29): the names ``dir(fshard)`` shows."""

import pytest
import torch

import fshard as fs


def test_dir_lists_the_public_api_only():
    names = dir(fs)
    assert names == sorted(fs.__all__)
    assert "shard" in names and "value_and_grad" in names and "lax" in names
    for internal in ("array", "executor", "planner", "_comm", "spec", "api", "autodiff"):
        assert internal not in names, internal
    assert fs.array.ShardedArray is fs.ShardedArray  # still importable by name


def test_peer_habits_name_the_fshard_spelling():
    """Issue 29 item 7: DTensor's x.full_tensor(), x.to_local(), x.placements,
    x.redistribute(...) gave a bare AttributeError; each now names fshard's spelling (no rank
    needed: a value on one simulated rank of an abstract mesh)."""
    mesh = fs.Mesh.abstract((2,), ("x",)).simulate(0, backend="gloo")
    x = fs.shard(torch.ones(4, device="meta"), mesh, fs.P("x"))
    want = {
        "full_tensor": "fs.gather(x)",
        "to_local": "x.local",
        "placements": "x.spec",
        "redistribute": "fs.reshard",
        "device_mesh": "x.mesh",
    }
    for name, spelling in want.items():
        with pytest.raises(AttributeError) as info:
            getattr(x, name)
        assert spelling in str(info.value), (name, str(info.value))


def scalars_rank_fn():
    mesh = fs.Mesh.create((1,), ("x",))
    loss = fs.shard(torch.tensor(2.5), mesh, fs.P())
    return float(loss), loss.item(), int(fs.shard(torch.tensor(3), mesh, fs.P()))


def test_replicated_scalars_convert_to_python_numbers(world1):
    """float() and item() of a replicated scalar work (issue 29 item 2)."""
    assert world1.run(scalars_rank_fn)[0] == (2.5, 2.5, 3)
