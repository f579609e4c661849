"""What a newcomer meets first (issue 29): the names ``dir(fshard)`` shows."""

import torch

import fshard as fs


def test_dir_lists_the_public_api_only():
    names = dir(fs)
    assert names == sorted(fs.__all__)
    assert "shard" in names and "value_and_grad" in names and "lax" in names
    for internal in ("array", "executor", "planner", "_comm", "spec", "api", "autodiff"):
        assert internal not in names, internal
    assert fs.array.ShardedArray is fs.ShardedArray  # still importable by name


def habits_rank_fn():
    mesh = fs.Mesh.create((1,), ("x",))
    x = fs.shard(torch.ones(2), mesh, fs.P("x"))
    errors = {}
    for name in ("full_tensor", "to_local", "placements", "redistribute", "device_mesh"):
        try:
            getattr(x, name)
        except AttributeError as e:
            errors[name] = str(e)
    loss = fs.shard(torch.tensor(2.5), mesh, fs.P())
    return errors, float(loss), loss.item(), int(fs.shard(torch.tensor(3), mesh, fs.P()))


def test_peer_habits_name_the_fshard_spelling(world1):
    """Issue 29 item 7: DTensor's x.full_tensor(), x.to_local(), x.placements,
    x.redistribute(...) gave a bare AttributeError; each now names fshard's spelling. float()
    and item() of a replicated scalar work (issue 29 item 2)."""
    errors, f, i, n = world1.run(habits_rank_fn)[0]
    assert "fs.gather(x)" in errors["full_tensor"]
    assert "x.local" in errors["to_local"]
    assert "x.spec" in errors["placements"]
    assert "fs.reshard" in errors["redistribute"]
    assert "x.mesh" in errors["device_mesh"]
    assert (f, i, n) == (2.5, 2.5, 3)
