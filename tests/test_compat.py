"""The torch and Python versions fshard supports (issue 27): names, the simulated oldest torch, and
the version-dependent behaviours `fshard/_compat.py` decides at import.

The oldest supported torch is checked two ways on the pinned one: statically (every ``torch.…``
name fshard writes, outside ``fshard/_compat.py``, exists in the surface recorded from the oldest
torch, ``tests/data/torch_api_oldest.txt``) and by running collectives, FSDP and a compiled gather
with the names the oldest torch lacks removed from ``torch.distributed`` in every process.
The whole suite on another torch: ``tools/test_torch.sh VERSION`` (docs/measurements.md, "Compatibility").
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import _compat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import torch_api  # noqa: E402

SURFACE = ROOT / "tests" / "data" / "torch_api_oldest.txt"


def test_every_torch_name_exists_in_the_oldest_torch():
    """A name newer than the oldest supported torch (as ``dist.all_gather_single`` was, used in
    three modules) fails here, on the newest torch, naming where it is used."""
    header = SURFACE.read_text().splitlines()[0]
    recorded = tuple(int(p) for p in re.search(r"torch (\d+)\.(\d+)", header).groups())
    assert recorded == _compat.OLDEST_TORCH, header
    missing = torch_api.missing(torch_api.used_names(), torch_api.load(SURFACE))
    assert not missing, (
        "torch names the oldest supported torch lacks; route them through fshard/_compat.py: "
        + "; ".join(f"{k} ({', '.join(sorted(v))})" for k, v in sorted(missing.items()))
    )


def test_the_checker_finds_a_newer_name(tmp_path):
    """The static check is not vacuous: a module calling ``dist.all_gather_single`` directly, or
    a name read from the lazily imported functional collectives, is reported."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import torch.distributed as dist\n"
        "from . import _compat\n"
        "def f(o, x):\n"
        "    dist.all_gather_single(o, x)\n"
        "    return _compat.funcol().reduce_scatter_single(x, 'sum', 0, None)\n"
    )
    used = torch_api.used_names(pkg)
    missing = torch_api.missing(used, torch_api.load(SURFACE))
    assert set(missing) == {
        "torch.distributed.all_gather_single",
        "torch.distributed._functional_collectives.reduce_scatter_single",
    }


def test_declared_range_is_the_tested_one():
    """pyproject's torch range starts at the oldest torch the suite passed on."""
    text = (ROOT / "pyproject.toml").read_text()
    low = re.search(r'"torch>=(\d+)\.(\d+)', text)
    assert low and tuple(map(int, low.groups())) == _compat.OLDEST_TORCH
    py = re.search(r'requires-python = ">=3\.(\d+)"', text)
    assert py and int(py.group(1)) >= 11, "declare only the Pythons the suite ran on"


_SIMULATE = """
import torch.distributed as dist
for name in {names!r}:
    if hasattr(dist, name):
        delattr(dist, name)
"""


@pytest.mark.timeout(600)
def test_suite_slice_on_simulated_oldest_torch(tmp_path):
    """Collectives over 2 ranks, FSDP, shard_map's shape exchange and a compiled gather run with
    ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (new in torch 2.13) removed
    in every process, parent and spawned ranks (a ``sitecustomize`` on ``PYTHONPATH``)."""
    newer = ["all_gather_single", "reduce_scatter_single"]
    (tmp_path / "sitecustomize.py").write_text(_SIMULATE.format(names=newer))
    path = [str(tmp_path), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    # test_simulation_took_effect (run there, and first) checks the simulation is in force
    tests = [
        "tests/test_compat.py::test_simulation_took_effect",
        "tests/test_lax.py::test_primitives_1d",
        "tests/test_lax.py::test_uneven_blocks",
        "tests/test_fsdp.py::test_fsdp_training_matches_dense",
        "tests/test_shard_map.py",
        "tests/test_compile.py::test_make_fx_replays_exactly",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        env=dict(env, FSHARD_EXPECT_OLDEST_API="1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1]


def test_simulation_took_effect():
    """Run by the test above: fshard chose the older names."""
    if not os.environ.get("FSHARD_EXPECT_OLDEST_API"):
        assert (_compat.all_gather_into is dist.all_gather_into_tensor) != hasattr(
            dist, "all_gather_single"
        )
        return
    assert not hasattr(dist, "all_gather_single")
    assert _compat.all_gather_into is dist.all_gather_into_tensor
    assert _compat.reduce_scatter_into is dist.reduce_scatter_tensor


def _slice_compiled():
    mesh = fs.Mesh.create((2,), ("x",))
    full = torch.arange(30.0).reshape(5, 6)
    x = fs.shard(full, mesh, fs.P("x", None))
    f = torch.compile(lambda a: a[..., 1:4:2] * 2, fullgraph=True, backend="aot_eager")
    y = f(x)
    return fs.gather(y), y.spec, fs.gather(f(x[1:]))


def test_compiled_slice_of_sharded_value(world2):
    """``a[..., :2]`` of a ShardedArray under ``torch.compile(fullgraph=True)``: the plan cache
    keyed on slices, which hash only from Python 3.12 (`unhashable type: 'slice'` on 3.11)."""
    full = torch.arange(30.0).reshape(5, 6)
    for y, spec, y1 in world2.run(_slice_compiled):
        assert torch.equal(y, full[..., 1:4:2] * 2)
        assert spec == fs.P("x", None)
        assert torch.equal(y1, full[1:][..., 1:4:2] * 2)


def test_freeze_key_makes_slices_hashable():
    k = _compat.freeze_key((slice(1, None), (Ellipsis, [slice(None)])))
    assert hash(k) == hash(_compat.freeze_key((slice(1, None), (Ellipsis, [slice(None)]))))
    assert k != _compat.freeze_key((slice(1, 2), (Ellipsis, [slice(None)])))


class _AddExporting(torch.nn.Module):
    def forward(self, a):
        return a + int(_compat.is_exporting())


def test_is_exporting_only_under_export():
    """``torch.compiler.is_exporting()`` is True inside a plain ``torch.compile`` on torch 2.11
    (dynamo folds it); fshard's reads export's own flag."""
    compiled = torch.compile(_AddExporting(), fullgraph=True, backend="eager")
    assert compiled(torch.zeros(1)).item() == 0
    ep = torch.export.export(_AddExporting(), (torch.zeros(1),), strict=False)
    assert ep.module()(torch.zeros(1)).item() == 1
    assert not _compat.is_exporting()


def test_no_version_probing_outside_compat():
    """Version differences live in fshard/_compat.py: no other module compares versions or
    probes torch's distributed, compiler or C APIs with ``hasattr``."""
    offenders = []
    for path in (ROOT / "fshard").rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(
                r"torch\.__version__\s*[<>=!]|TorchVersion|sys\.version_info|hasattr\(\s*(dist|torch\.(distributed|compiler|_C))\b",
                line,
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("context_fn", ["default", "given"])
def test_checkpoint_calls_the_generator_fshard_wraps(context_fn):
    """``fs.nn.functional_call`` makes an activation checkpoint recompute with the values swapped
    in by wrapping the generator ``torch.utils.checkpoint.checkpoint`` looks up at each call
    (``_compat.CHECKPOINT_GENERATOR``). torch 2.14 calls another name than 2.13; wrapping the old
    one missed every caller-given ``context_fn`` (selective activation checkpointing recomputed
    with the module's own tensors). On the running torch, ``checkpoint`` must call the wrapped
    name, with either ``context_fn``."""
    module = torch.utils.checkpoint
    name = _compat.CHECKPOINT_GENERATOR
    wrapped = getattr(module, name)
    calls = []

    def spy(*args, **kwargs):
        calls.append(name)
        return wrapped(*args, **kwargs)

    kwargs = (
        {} if context_fn == "default" else {"context_fn": torch.utils.checkpoint.noop_context_fn}
    )
    x = torch.ones(3, requires_grad=True)
    setattr(module, name, spy)
    try:
        y = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False, **kwargs)
    finally:
        setattr(module, name, wrapped)
    assert calls == [name]
    y.sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))
