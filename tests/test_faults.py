"""Adversarial tests (issue 14): every way ranks, checkpoints and the launcher can go wrong
must give a clear error, never a silent wrong value, code execution or a hang.

Sections (kept apart so they can grow independently):
1. SPMD safety: rank disagreement, shard_map checks, partial cotangents, small errors.
2. Checkpoint security and integrity, launcher hardening, install.
"""

# ==========================================================================================
# 1. SPMD safety: consistency mode, shard_map out_specs / varying axes, partial cotangents
# ==========================================================================================


# (section 1 ends here)


# ==========================================================================================
# 2. Checkpoints (safe loading, checksums, atomic saves) and the launcher
# ==========================================================================================
# Launcher hardening (loopback store, workers die with the driver, recovery after a collective
# timeout, the dead rank blamed, the README's torchrun command) is tested in tests/test_launch.py.
# Imports are local to this section (underscored names) so section 1 can grow independently.

import errno as _errno  # noqa: E402
import hashlib as _hashlib  # noqa: E402
import io as _io  # noqa: E402
import json as _json  # noqa: E402
import os as _os  # noqa: E402
import pickle as _pickle  # noqa: E402
import subprocess as _subprocess  # noqa: E402
import sys as _sys  # noqa: E402
import threading as _threading  # noqa: E402
import time as _time  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

import pytest as _pytest  # noqa: E402
import torch as _torch  # noqa: E402
import torch.distributed as _dist  # noqa: E402

import fshard as _fs  # noqa: E402


def ck_save(path, value, pause_dir=None):
    """Save a (5, 3) tensor full of ``value`` sharded over all ranks, and ``step=value``.
    With ``pause_dir``: after writing, wait (holding the save) until ``pause_dir/go`` exists."""
    mesh = _fs.Mesh.create((_dist.get_world_size(),), ("x",))
    x = _fs.shard(_torch.full((5, 3), float(value)), mesh, _fs.P("x"))
    if pause_dir is not None:

        def hook(stage):
            if stage == "written":
                _Path(pause_dir, f"paused{_dist.get_rank()}").touch()
                while not _os.path.exists(_os.path.join(pause_dir, "go")):
                    _time.sleep(0.02)

        _fs.checkpoint._test_hook = hook
    try:
        _fs.checkpoint.save(path, {"x": x, "step": value})
    except _fs.checkpoint.CheckpointError as e:
        return str(e)
    finally:
        _fs.checkpoint._test_hook = None
    return None


def ck_load(path):
    """(gathered x, step), or the CheckpointError's text."""
    mesh = _fs.Mesh.create((_dist.get_world_size(),), ("x",))
    try:
        out = _fs.checkpoint.load(path, {"x": _fs.Layout(mesh, _fs.P("x"), (5, 3)), "step": 0})
    except _fs.checkpoint.CheckpointError as e:
        return str(e)
    return _fs.gather(out["x"]), out["step"]


def _assert_holds(results, value):
    for r in results:
        assert not isinstance(r, str), r
        full, step = r
        assert step == value and _torch.equal(full, _torch.full((5, 3), float(value)))


def _one_error(results):
    """Every rank raised the same CheckpointError: its text."""
    assert all(isinstance(r, str) for r in results), results
    assert len(set(results)) == 1, results
    return results[0]


def _manifest(path):
    return _json.loads(_Path(path, "fshard.json").read_text())


def _reseal(path, *names):
    """What an attacker who rewrote files does: record their new sizes and checksums."""
    m = _manifest(path)
    for name in names:
        data = _Path(path, name).read_bytes()
        m["files"][name] = {"bytes": len(data), "sha256": _hashlib.sha256(data).hexdigest()}
    _Path(path, "fshard.json").write_text(_json.dumps(m))


# -- 14.4 loading never runs code from disk ---------------------------------------------------


class _Payload:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _data_file(path):
    return sorted(n for n in _os.listdir(path) if n.endswith(".distcp"))[0]


def _plant(path, where, marker):
    """Put a live payload in ``where``; returns the bytes a naive loader would unpickle."""
    from torch.distributed.checkpoint.metadata import Metadata

    md_path = _Path(path, ".metadata")
    if where == "metadata":  # a real Metadata with the payload nested inside
        md = _pickle.loads(md_path.read_bytes())
        md.storage_meta.modules = [_Payload(marker)]
        md_path.write_bytes(_pickle.dumps(md))
        _reseal(path, ".metadata")
        return md_path.read_bytes()
    if where == "data":  # a tensor chunk replaced by a torch.save of the payload
        name = _data_file(path)
        buf = _io.BytesIO()
        _torch.save(_Payload(marker), buf)
        _Path(path, name).write_bytes(buf.getvalue())
        md = _pickle.loads(md_path.read_bytes())
        assert isinstance(md, Metadata)
        for info in md.storage_data.values():
            if info.relative_path == name:
                info.offset, info.length = 0, len(buf.getvalue())
        md_path.write_bytes(_pickle.dumps(md))
        _reseal(path, name, ".metadata")
        return buf.getvalue()
    if where == "pickled_value":  # 'step' stored as a DCP pickled value (plain DCP does that)
        import torch.distributed.checkpoint as dcp

        for name in _os.listdir(path):
            _os.remove(_os.path.join(path, name))
        with _fs.interop._quiet():
            dcp.save(
                {"x": _torch.zeros(5, 3), "step": _Payload(marker)},
                storage_writer=dcp.FileSystemWriter(path),
                no_dist=True,
            )
        m = {"format": "fshard.checkpoint", "version": 1, "values": {}, "files": {}}
        _Path(path, "fshard.json").write_text(_json.dumps(m))
        _reseal(path, ".metadata", *[n for n in _os.listdir(path) if n.endswith(".distcp")])
        return None
    # fshard.json: a value that is not an allowed type (a dtype tag naming a function)
    m = _manifest(path)
    m["values"]["step"] = {"dtype": "load"}
    _Path(path, "fshard.json").write_text(_json.dumps(m))
    return None


@_pytest.mark.parametrize("where", ["metadata", "data", "pickled_value", "manifest"])
def test_checkpoint_load_runs_no_code_from_disk(world2, tmp_path, where):
    path, marker = str(tmp_path / "ck"), tmp_path / "pwned"
    assert world2.run(ck_save, path, 4) == [None, None]
    payload = _plant(path, where, marker)
    if payload is not None:  # the payload is live: a naive loader runs it
        if where == "metadata":
            _pickle.loads(payload)
        else:
            _torch.load(_io.BytesIO(payload), weights_only=False)
        assert marker.exists()
        marker.unlink()
    error = _one_error(world2.run(ck_load, path))
    assert not marker.exists(), "fs.checkpoint.load executed code from the checkpoint"
    needle = {
        "metadata": "refusing to load the global builtins.exec",
        "data": "Weights only load failed",
        "pickled_value": "key 'step': expected a Python value (int), found a pickled Python",
        "manifest": "key 'step': the saved Python value is refused",
    }[where]
    assert needle in error, error


def weights_only_roundtrip():
    mesh = _fs.Mesh.create((2,), ("x",))
    x = _fs.shard(_torch.arange(12.0).reshape(4, 3), mesh, _fs.P("x"))
    explicit = _fs.Layout.explicit(mesh, [((0, 0), (1, 3)), ((1, 0), (3, 3))], (4, 3))
    tree = {"x": x, "layout": x.layout, "explicit": explicit, "spec": _fs.P(("x",), partial=())}
    buf = _io.BytesIO()
    _torch.save(tree, buf)
    buf.seek(0)
    back = _torch.load(buf, weights_only=True)
    assert back["x"].layout == x.layout and back["x"].layout.mesh is mesh  # the live mesh
    assert _torch.equal(back["x"].local, x.local)
    assert back["layout"] == x.layout and back["explicit"] == explicit
    assert back["spec"] == tree["spec"]
    return _torch.equal(_fs.gather(back["x"]), _torch.arange(12.0).reshape(4, 3))


def test_torch_save_of_sharded_values_loads_with_weights_only(world2):
    assert world2.run(weights_only_roundtrip) == [True, True]


# -- 14.5 integrity: checksums, concurrent saves, disk full, bad leaves, bad paths ------------


@_pytest.mark.parametrize("where", ["data", "metadata"])
def test_flipped_byte_fails_its_checksum(world2, tmp_path, where):
    path = str(tmp_path / "ck")
    world2.run(ck_save, path, 4)
    name = _data_file(path) if where == "data" else ".metadata"
    raw = bytearray(_Path(path, name).read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, size unchanged
    _Path(path, name).write_bytes(bytes(raw))
    error = _one_error(world2.run(ck_load, path))
    assert f"{name!r} fails its checksum" in error or f"'{name}' fails its checksum" in error


def test_concurrent_saves_one_winner_never_a_mix(world2, world1, tmp_path):
    path = str(tmp_path / "ck")
    world2.run(ck_save, path, 1)
    results = {}
    first = _threading.Thread(
        target=lambda: results.update(a=world2.run(ck_save, path, 5, str(tmp_path)))
    )
    first.start()
    try:
        deadline = _time.monotonic() + 60
        while not all((tmp_path / f"paused{r}").exists() for r in (0, 1)):
            assert _time.monotonic() < deadline and first.is_alive()
            _time.sleep(0.02)
        # the first save has written its data and holds the path: the second is refused
        loser = world1.run(ck_save, path, 6)[0]
        assert loser is not None and "another save to" in loser and "in progress" in loser
    finally:
        (tmp_path / "go").touch()
        first.join(120)
    assert results["a"] == [None, None]
    _assert_holds(world2.run(ck_load, path), 5)
    assert sorted(n for n in _os.listdir(tmp_path) if "ck" in n) == ["ck"]  # no leftovers


def save_with_disk_full(path, rank):
    """``rank``'s writes fail as on a full disk (ENOSPC), as DCP's writer would see them."""
    import torch.distributed.checkpoint.filesystem as fsys

    real = fsys._write_item

    def full(*args, **kwargs):
        if _dist.get_rank() == rank:
            raise OSError(_errno.ENOSPC, _os.strerror(_errno.ENOSPC))
        return real(*args, **kwargs)

    fsys._write_item = full
    try:
        return ck_save(path, 9)
    finally:
        fsys._write_item = real


def test_disk_full_is_a_checkpoint_error_on_every_rank(world2, tmp_path):
    path = str(tmp_path / "ck")
    world2.run(ck_save, path, 1)
    error = _one_error(world2.run(save_with_disk_full, path, 1))
    assert "failed: rank 1: OSError: [Errno 28] No space left on device" in error, error
    _assert_holds(world2.run(ck_load, path), 1)  # the previous checkpoint is intact
    assert sorted(n for n in _os.listdir(tmp_path) if "ck" in n) == ["ck"]


def save_to_tiny_tmpfs(path):
    """A (1024, 256) float32 tensor (1 MiB) into a 256 KiB file system."""
    mesh = _fs.Mesh.create((2,), ("x",))
    x = _fs.shard(_torch.ones(1024, 256), mesh, _fs.P("x"))
    try:
        _fs.checkpoint.save(path, {"x": x})
    except _fs.checkpoint.CheckpointError as e:
        return str(e)
    return None


def test_real_full_disk_on_a_tiny_tmpfs(world2, tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if _sys.platform != "linux" or _os.geteuid() != 0:
        _pytest.skip("mounting a tmpfs needs root on Linux (the ENOSPC test above still runs)")
    mounted = _subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)])
    if mounted.returncode != 0:
        _pytest.skip("cannot mount a tmpfs here (the ENOSPC test above still runs)")
    try:
        error = _one_error(world2.run(save_to_tiny_tmpfs, str(mnt / "ck")))
        # torch.save's writer turns ENOSPC into "unexpected pos"; fshard names the cause
        assert "the disk is likely full" in error, error
        assert _os.listdir(mnt) == []  # the failed save left nothing behind
    finally:
        _subprocess.run(["umount", str(mnt)], check=True)


def save_unpicklable(path):
    mesh = _fs.Mesh.create((2,), ("x",))
    tree = {"x": _fs.zeros((4,), mesh, _fs.P("x")), "opt": {"schedule": lambda step: 0.1}}
    try:
        _fs.checkpoint.save(path, tree)
    except _fs.checkpoint.CheckpointError as e:
        return str(e)
    return None


def test_unpicklable_leaf_is_a_checkpoint_error_on_every_rank(world2, tmp_path):
    error = _one_error(world2.run(save_unpicklable, str(tmp_path / "ck")))
    assert "the value at key 'opt/schedule' is a builtins.function" in error, error
    assert not _os.path.exists(tmp_path / "ck")


@_pytest.mark.parametrize("kind", ["file", "directory"])
def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path, kind):
    path = tmp_path / "target"
    if kind == "file":
        path.write_text("precious")
    else:
        path.mkdir()
        (path / "notes.txt").write_text("precious")
    before = sorted(_os.listdir(tmp_path))
    with _pytest.raises(_fs.checkpoint.CheckpointError, match="refusing to replace it"):
        _fs.checkpoint.save(str(path), {"t": _torch.zeros(2), "step": 1})
    assert sorted(_os.listdir(tmp_path)) == before
    content = path if kind == "file" else path / "notes.txt"
    assert content.read_text() == "precious"


def test_python_values_round_trip_exactly(tmp_path):
    values = {
        "step": 3,
        "flag": True,
        "none_is_a_value": [None, 1.5, float("inf"), float("nan"), "s", -(2**70)],
        "tup": (1, (2.0, "x")),
        "dct": {1: "one", (2, 3): [_torch.Size([2, 3])]},
        "dtype": _torch.bfloat16,
    }
    path = str(tmp_path / "new" / "dirs" / "ck")  # parents are created
    _fs.checkpoint.save(path, {"v": values})
    back = _fs.checkpoint.load(path, {"v": values})["v"]
    nan = back["none_is_a_value"][3]
    assert nan != nan
    back["none_is_a_value"][3] = values["none_is_a_value"][3] = 0.0
    assert back == values
    assert type(back["tup"][1]) is tuple and type(back["dct"][(2, 3)][0]) is _torch.Size
    with _pytest.raises(_fs.checkpoint.CheckpointError, match="numpy.float64"):
        import numpy as np

        _fs.checkpoint.save(str(tmp_path / "ck2"), {"loss": np.float64(0.5)})


# -- 14.7 fresh install: the test extra declares every package the tests import ---------------


def test_test_extra_declares_what_the_tests_import():
    import ast
    import importlib.metadata as md

    tomllib = _pytest.importorskip("tomllib")
    root = _Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = {
        r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        for r in [*project["dependencies"], *project["optional-dependencies"]["test"]]
    }
    dists = md.packages_distributions()
    local = {"tests", "fshard"} | {f.stem for f in root.glob("*/*.py")}  # e.g. examples/
    missing = set()
    for f in (root / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in _sys.stdlib_module_names or top in local:
                    continue
                if not {d.lower() for d in dists.get(top, [top])} & declared:
                    missing.add(f"{top} (imported by tests/{f.name})")
    assert not missing, f"pyproject's test extra lacks {sorted(missing)}"


# (section 2 ends here)
