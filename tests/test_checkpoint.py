"""fs.checkpoint: DCP save/load with resharding on load, atomic saves, clear errors on all ranks."""

import os

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard.launch import RankError

# -- the saved values (recomputed in the test process as the oracle) --------------------------


def _values():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),  # uneven over both axes
        "b": torch.arange(18, dtype=torch.float64).reshape(3, 6),  # 3 rows over 4: 1,1,1,0
        "r": torch.randn(4, 3, generator=g),  # replicated
        "p": torch.randn(5, 2, generator=g),  # partial over x
        "i": torch.arange(10, dtype=torch.int32),  # int dtype
        "e": torch.ones(0, 3),  # zero elements
        "t": torch.linspace(0, 1, 4),  # plain tensor
    }


def save_4(path):
    mesh = fs.Mesh.create((2, 2), ("x", "y"))
    v = _values()
    tree = {
        "params": {
            "w": fs.shard(v["w"], mesh, fs.P("x", "y")),
            "b": fs.shard(v["b"], mesh, fs.P(("x", "y"))),
            "r": fs.shard(v["r"], mesh, fs.P()),
            "p": fs.shard(v["p"], mesh, fs.P(None, "y", partial="x")),
            "i": fs.shard(v["i"], mesh, fs.P("y")),
            "e": fs.shard(v["e"], mesh, fs.P("x")),
        },
        "t": v["t"],
        "step": 7,
        "name": "run-a",
    }
    fs.checkpoint.save(path, tree)
    return sorted(os.listdir(path))


def _gathered(out):
    return {
        k: fs.gather(v) if isinstance(v, fs.ShardedArray) else v for k, v in out["params"].items()
    } | {"t": out["t"], "step": out["step"], "name": out["name"]}


def load_2(path):
    mesh = fs.Mesh.create((2,), ("d",))
    like = {
        "params": {
            "w": fs.zeros((7, 5), mesh, fs.P(None, "d")),
            "b": fs.Layout(mesh, fs.P(None, "d"), (3, 6), torch.float64),
            "r": fs.zeros((4, 3), mesh, fs.P("d")),
            "p": fs.Layout(mesh, fs.P(partial="d"), (5, 2)),
            "i": fs.zeros((10,), mesh, fs.P(), dtype=torch.int32),
            "e": fs.zeros((0, 3), mesh, fs.P(None, "d")),
        },
        "t": torch.zeros(4),
        "step": 0,
        "name": "",
    }
    out = fs.checkpoint.load(path, like)
    assert out["params"]["w"].layout == like["params"]["w"].layout
    assert out["params"]["p"].spec == fs.P(partial="d")
    return _gathered(out)


def load_1(path):
    mesh = fs.Mesh.create((1,), ("d",))
    v = _values()
    like = {
        "params": {k: fs.zeros(v[k].shape, mesh, fs.P("d"), dtype=v[k].dtype) for k in v},
        "t": torch.zeros(4),
        "step": 0,
        "name": "",
    }
    del like["params"]["t"]
    return _gathered(fs.checkpoint.load(path, like))


def _check_loaded(out):
    v = _values()
    for k in ("w", "b", "r", "p", "i", "e", "t"):
        assert out[k].dtype == v[k].dtype, k
        assert torch.equal(out[k], v[k]), k  # bit-exact
    assert out["step"] == 7 and out["name"] == "run-a"


def test_save_4_ranks_load_on_2_and_1(world4, world2, world1, tmp_path):
    path = str(tmp_path / "ckpt")
    files = world4.run(save_4, path)[0]
    assert ".metadata" in files
    assert not os.path.exists(tmp_path / ".ckpt.fshard-tmp")
    for out in world2.run(load_2, path) + world1.run(load_1, path):
        _check_loaded(out)


# -- resume training on another world size -----------------------------------------------------
# fs.optim.adamw over a sharded parameter; its state (moments with the param's layout, a step
# count) is checkpointed on a 2x2 mesh and resumed on 2 ranks with another spec.

_TARGET_SEED, _SHAPE = 3, (7, 5)


def _target():
    return torch.randn(_SHAPE, generator=torch.Generator().manual_seed(_TARGET_SEED))


def _grad(w):
    """Gradient of sum((w - target)^2), elementwise (dense tensor or ShardedArray)."""
    if isinstance(w, fs.ShardedArray):
        block = _target()[w.layout.shard_metadata(w.layout.mesh.rank).slices()]
        return fs.ShardedArray(2 * (w.local - block), w.layout)
    return 2 * (w - _target())


def _train(params, opt_state, steps):
    opt = fs.optim.adamw(0.05, weight_decay=0.01)
    for _ in range(steps):
        updates, opt_state = opt.update({"w": _grad(params["w"])}, opt_state, params)
        params = fs.optim.apply_updates(params, updates)
    return params, opt_state


def train_then_save(path):
    mesh = fs.Mesh.create((2, 2), ("x", "y"))
    params = {"w": fs.shard(torch.linspace(-1, 1, 35).reshape(_SHAPE), mesh, fs.P("y", "x"))}
    opt_state = fs.optim.adamw(0.05, weight_decay=0.01).init(params)
    params, opt_state = _train(params, opt_state, 3)
    fs.checkpoint.save(path, {"params": params, "opt": opt_state, "step": 3})


def resume(path):
    mesh = fs.Mesh.create((2,), ("d",))
    like_params = {"w": fs.zeros(_SHAPE, mesh, fs.P(None, "d"))}
    like = {
        "params": like_params,
        "opt": fs.optim.adamw(0.05, weight_decay=0.01).init(like_params),
        "step": 0,
    }
    state = fs.checkpoint.load(path, like)
    assert state["step"] == 3
    assert state["params"]["w"].layout == like_params["w"].layout
    params, _ = _train(state["params"], state["opt"], 3)
    return fs.gather(params["w"])


def test_resume_training_on_another_world_size(world4, world2, tmp_path):
    path = str(tmp_path / "train")
    world4.run(train_then_save, path)
    got = world2.run(resume, path)
    params = {"w": torch.linspace(-1, 1, 35).reshape(_SHAPE)}
    params, _ = _train(params, fs.optim.adamw(0.05, weight_decay=0.01).init(params), 6)
    for g in got:
        assert torch.equal(g, params["w"])  # uninterrupted dense run, bit-identical


# -- interrupted saves and bad checkpoints ----------------------------------------------------


def save_value(path, value, die_on_rank=None, stage="written"):
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.full((5, 3), float(value)), mesh, fs.P("x"))
    if die_on_rank is not None:

        def hook(s):
            if s == stage and dist.get_rank() == die_on_rank:
                os._exit(17)

        fs.checkpoint._test_hook = hook
    try:
        fs.checkpoint.save(path, {"x": x, "step": value})
    finally:
        fs.checkpoint._test_hook = None


def load_value(path):
    mesh = fs.Mesh.create((2,), ("x",))
    out = fs.checkpoint.load(path, {"x": fs.Layout(mesh, fs.P(None, "x"), (5, 3)), "step": 0})
    return fs.gather(out["x"]), out["step"]


def _assert_value(results, value):
    for full, step in results:
        assert step == value
        assert torch.equal(full, torch.full((5, 3), float(value)))


@pytest.mark.parametrize("stage", ["start", "written"])
def test_killed_save_keeps_previous_checkpoint(world2, tmp_path, stage):
    path = str(tmp_path / "ck")
    world2.run(save_value, path, 1)
    with pytest.raises(RankError) as info:
        world2.run(save_value, path, 2, 1, stage)
    err = info.value  # the dead rank is blamed, not rank 0 whose collective then failed
    assert (err.rank, err.exit_code) == (1, 17), str(err)
    _assert_value(world2.run(load_value, path), 1)
    world2.run(save_value, path, 3)  # the next save cleans up and replaces the old one
    _assert_value(world2.run(load_value, path), 3)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def load_error(path, like_kind):
    mesh = fs.Mesh.create((2,), ("x",))
    like = {"x": fs.Layout(mesh, fs.P("x"), (5, 3)), "step": 0}
    if like_kind == "shape":
        like["x"] = fs.Layout(mesh, fs.P("x"), (5, 4))
    elif like_kind == "dtype":
        like["x"] = fs.zeros((5, 3), mesh, fs.P(), dtype=torch.float64)
    elif like_kind == "missing":
        like["opt"] = {"mu": torch.zeros(3)}
    elif like_kind == "kind":
        like["step"] = torch.zeros(())
    elif like_kind == "many":
        like = {"x": fs.Layout(mesh, fs.P("x"), (5, 4)), "step": torch.zeros(())}
        like["opt"] = {"mu": torch.zeros(3)}
    try:
        fs.checkpoint.load(path, like)
    except fs.checkpoint.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("shape", "key 'x': expected shape (5, 4) dtype torch.float32, found shape (5, 3)"),
        ("dtype", "key 'x': expected shape (5, 3) dtype torch.float64, found shape (5, 3) dtype"),
        ("missing", "key 'opt/mu' is missing\n`like` has 1 keys the checkpoint lacks; the"),
        ("kind", "key 'step': expected a tensor of shape () dtype torch.float32, found a Python"),
        ("truncated", "is truncated"),
        ("missing_data", "key 'x': data file '__1_0.distcp' is missing"),
        ("absent", "does not exist"),
        ("no_metadata", "cannot read its metadata file"),
    ],
)
def test_bad_checkpoint_same_clear_error_on_all_ranks(world2, tmp_path, kind, needle):
    path = str(tmp_path / "ck")
    world2.run(save_value, path, 4)
    if kind == "truncated":
        data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]
        full = os.path.join(path, data)
        with open(full, "r+b") as f:
            f.truncate(os.path.getsize(full) // 2)
    elif kind == "missing_data":
        os.remove(os.path.join(path, "__1_0.distcp"))
    elif kind == "absent":
        path = str(tmp_path / "nope")
    elif kind == "no_metadata":
        os.remove(os.path.join(path, ".metadata"))
    errors = world2.run(load_error, path, kind)
    assert errors[0] is not None and needle in errors[0], errors[0]
    assert errors[0] == errors[1]


def test_load_error_names_every_leaf(world2, tmp_path):
    """Three leaves of ``like`` do not match the checkpoint: all three are listed by path."""
    path = str(tmp_path / "ck")
    world2.run(save_value, path, 4)
    msg = world2.run(load_error, path, "many")[0]
    for line in (
        "like['x']: key 'x': expected shape (5, 4)",
        "like['step']: key 'step': expected a tensor",
        "like['opt']['mu']: key 'opt/mu' is missing",
    ):
        assert line in msg, (line, msg)
    assert "(3 leaves)" in msg, msg


def load_other_optimizer(path):
    mesh = fs.Mesh.create((2,), ("x",))
    params = {f"layer{i}": fs.zeros((4, 3), mesh, fs.P("x")) for i in range(12)}
    like = {"params": params, "opt": fs.optim.adamw(0.1).init(params)}
    try:
        fs.checkpoint.load(path, like)
    except fs.checkpoint.CheckpointError as e:
        return str(e)


def save_sgd_state(path):
    mesh = fs.Mesh.create((2,), ("x",))
    params = {f"layer{i}": fs.zeros((4, 3), mesh, fs.P("x")) for i in range(12)}
    tx = fs.optim.sgd(0.1, momentum=0.9)
    fs.checkpoint.save(path, {"params": params, "opt": tx.init(params)})


def test_load_with_another_optimizer_shows_the_difference_once(world2, tmp_path):
    """Issue 29 item 7: ``like`` from another optimizer gave a correct but 7,193-character
    error repeating the checkpoint's key list on every line; the difference is now shown
    once."""
    path = str(tmp_path / "ck")
    world2.run(save_sgd_state, path)
    msg = world2.run(load_other_optimizer, path)[0]
    assert msg.count("the checkpoint has") == 1, msg
    assert "'opt/0/0/layer0'" in msg and "... and 15 more" in msg, msg  # sgd's trace
    assert len(msg) < 2000, len(msg)


def test_argument_errors(tmp_path):
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        fs.checkpoint.save(3, {"a": 1})
    with pytest.raises(ValueError, match="same checkpoint key 'a/b'"):
        fs.checkpoint.save(str(tmp_path / "c"), {"a/b": 1, "a": {"b": 2}})


def _smaller_model(path):
    """Issue 40 item 6: a checkpoint of 3 layers loaded into a 2-layer model. strict=False
    (the default) loads the subset; strict=True names what would be left over."""
    import fshard as fs
    from fshard.checkpoint import CheckpointError

    mesh = fs.Mesh.create((2,), ("x",))
    big = {f"layers.{i}.w": fs.shard(torch.full((4,), float(i)), mesh, fs.P("x")) for i in range(3)}
    big["step"] = 7
    fs.checkpoint.save(path, big)
    like = {f"layers.{i}.w": fs.zeros((4,), mesh, fs.P()) for i in range(2)}
    subset = fs.checkpoint.load(path, like)
    like["step"] = 0
    try:
        fs.checkpoint.load(path, like, strict=True)
    except CheckpointError as e:
        error = str(e)
    else:
        error = None
    full = fs.checkpoint.load(
        path, {**like, "layers.2.w": fs.zeros((4,), mesh, fs.P())}, strict=True
    )
    return fs.gather(subset["layers.1.w"]), error, fs.gather(full["layers.2.w"]), full["step"]


def test_load_strict_names_the_keys_left_over(world2, tmp_path):
    out = world2.run(_smaller_model, str(tmp_path / "ck"))
    for sub, error, full, step in out:
        assert torch.equal(sub, torch.full((4,), 1.0))
        assert error is not None and "strict=True" in error and "'layers.2.w'" in error, error
        assert "1 keys `like` lacks (of 4)" in error, error
        assert torch.equal(full, torch.full((4,), 2.0)) and step == 7
    assert out[0][1] == out[1][1]


# -- asynchronous save (issue 39 item 1) --------------------------------------------------------


def async_save_then_train(path):
    """save(blocking=False) returns before the bytes are on disk; the step loop goes on with
    collectives of its own (on the default group) while the background thread writes; what is
    saved is the value at the call, even when the arrays are then changed in place."""
    mesh = fs.Mesh.create((2,), ("x",))
    w = fs.shard(torch.arange(12.0).reshape(6, 2), mesh, fs.P("x"))
    handle = fs.checkpoint.save(path, {"w": w, "step": 1}, blocking=False)
    assert isinstance(handle, fs.checkpoint.SaveHandle)
    for _ in range(5):  # training steps: in-place updates and a collective each
        w.local.add_(1.0)
        w = fs.reshard(fs.reshard(w, fs.P()), fs.P("x"))
    handle.wait()
    assert handle.done()
    like = {"w": fs.Layout(mesh, fs.P(), (6, 2)), "step": 0}
    first = fs.checkpoint.load(path, like)
    second = fs.checkpoint.save(path, {"w": w * 0, "step": 0}, blocking=False)
    third = fs.checkpoint.save(path, {"w": w, "step": 2}, blocking=False)
    assert second.done()  # the third save waited for the second
    loaded = fs.checkpoint.load(path, like)
    assert third.done()  # load waited for the save in flight
    return [(fs.gather(out["w"]), out["step"]) for out in (first, loaded)], sorted(os.listdir(path))


def test_async_save_keeps_the_value_at_the_call_and_training_goes_on(world2, tmp_path):
    path = str(tmp_path / "ck")
    for saves, files in world2.run(async_save_then_train, path):
        for (w, step), want in zip(saves, (1, 2)):
            assert step == want
            bump = 0 if want == 1 else 5  # the first: the value at the call, not after
            assert torch.equal(w, torch.arange(12.0).reshape(6, 2) + bump)
        assert "fshard.json" in files
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def async_save_value(path, value, die_on_rank=None, stage="written"):
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.full((5, 3), float(value)), mesh, fs.P("x"))
    if die_on_rank is not None:

        def hook(s):
            if s == stage and dist.get_rank() == die_on_rank:
                os._exit(17)

        fs.checkpoint._test_hook = hook
    try:
        handle = fs.checkpoint.save(path, {"x": x, "step": value}, blocking=False)
        x = x * 0  # the step loop goes on
        handle.wait()
    finally:
        fs.checkpoint._test_hook = None


@pytest.mark.parametrize("stage", ["start", "written"])
def test_process_dying_during_async_save_keeps_previous_checkpoint(world2, tmp_path, stage):
    path = str(tmp_path / "ck")
    world2.run(async_save_value, path, 1)
    _assert_value(world2.run(load_value, path), 1)
    with pytest.raises(RankError) as info:
        world2.run(async_save_value, path, 2, 1, stage)
    assert (info.value.rank, info.value.exit_code) == (1, 17), str(info.value)
    _assert_value(world2.run(load_value, path), 1)
    world2.run(async_save_value, path, 3)
    _assert_value(world2.run(load_value, path), 3)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def async_failure_reported(path):
    """A failed asynchronous save is reported by wait(), or else by the next save / load."""
    mesh = fs.Mesh.create((2,), ("x",))
    x = fs.shard(torch.ones(4), mesh, fs.P("x"))
    messages = []
    for how in ("wait", "next"):
        fs.checkpoint._test_hook = lambda s: (
            s == "written" and (_ for _ in ()).throw(OSError(28, "No space left on device"))
        )
        try:
            handle = fs.checkpoint.save(path, {"x": x}, blocking=False)
            try:
                if how == "wait":
                    handle.wait()
                else:
                    fs.checkpoint.load(path, {"x": x})
            except fs.checkpoint.CheckpointError as e:
                messages.append(str(e))
        finally:
            fs.checkpoint._test_hook = None
    return messages


def test_async_save_failure_is_never_silent(world2, tmp_path):
    for messages in world2.run(async_failure_reported, str(tmp_path / "ck")):
        assert len(messages) == 2, messages
        assert "No space left on device" in messages[0], messages
        assert messages[1].startswith("the previous asynchronous save failed"), messages
    assert not os.path.exists(tmp_path / "ck")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_reads_the_metadata_fshard_checked(tmp_path):
    """fs.checkpoint.load unpickles a checkpoint's ``.metadata`` itself, resolving only DCP's
    metadata types ("Safety"), and hands DCP the result through its ``FileSystemReader``
    subclass's ``read_metadata``. On the running torch, DCP's load must take the metadata from
    that method only: with the file replaced by bytes that are no pickle, the load still reads
    the values (DCP unpickling the file itself would fail here, and would load any global a
    crafted file names)."""
    import torch.distributed.checkpoint as dcp

    from fshard.checkpoint import _read_metadata, _reader

    path = str(tmp_path / "c")
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=path, no_dist=True)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        md = _read_metadata(f.read())
    with open(meta, "wb") as f:
        f.write(b"not a pickle")
    reader = _reader(path, md)
    calls = []
    checked = reader.read_metadata

    def spy(*args, **kwargs):
        calls.append(1)
        return checked(*args, **kwargs)

    reader.read_metadata = spy
    state = {"w": torch.zeros(2, 3)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert calls and torch.equal(state["w"], torch.arange(6.0).reshape(2, 3))
