"""Shared fixtures: one persistent launch World per size for the whole session."""

import os
import sys
from pathlib import Path

import pytest

# Consistency mode (fshard.consistency) on for the whole suite: ranks that disagree raise
# instead of returning wrong values. Set before fshard is imported; spawned workers inherit it.
os.environ.setdefault("FSHARD_CHECK_CONSISTENCY", "every")

from fshard.launch import World  # noqa: E402

# Spawned workers inherit the parent's sys.path and import test functions by module name
# (tests.test_launch.fn), so the repo root must be on it even if pytest's rootdir insertion
# changes (e.g. --import-mode=importlib).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


#: The one-process lane, ``pytest -m one_process``: every test of these modules that asks for
#: no ``world*`` fixture (layout math and planning on abstract meshes, argument checks that
#: fail before any collective, the repository's static checks), and the doctests of the pure
#: modules. Nothing in it starts a rank.
ONE_PROCESS = {
    "tests/test_spec.py",
    "tests/test_collectives.py",  # lands with issue 28 item 1 (the ops as data, on abstract meshes)
    "tests/test_errors.py",
    "tests/test_checks.py",
    "tests/test_interop.py",
    "tests/test_imports.py",
    "tests/test_docs.py",
    "tests/test_hf_checkpoint.py",  # the pwrite runs of a block (the rest start ranks)
    "tests/ops/test_rule_selection.py",
    "fshard/spec.py",
    "fshard/planner.py",
}
_WORLDS = {"world1", "world2", "world4"}


#: Packages the suite tests against, whose absence makes tests skip locally
#: (``pytest.importorskip``) but must fail a CI run: a release that no longer imports would
#: otherwise turn ~85 tests into skips while CI stays green. CI sets ``CI`` (``.ci/run`` does).
REQUIRED_IN_CI = ("transformers",)


def pytest_configure(config):
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        check_required(REQUIRED_IN_CI)


def check_required(names) -> None:
    """Import each of ``names``; raise ``pytest.UsageError`` naming the first that fails."""
    for name in names:
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 -- any failure to import: name it
            raise pytest.UsageError(
                f"CI run: {name} does not import ({type(e).__name__}: {e}); the tests that "
                f"use it would be skipped. Install the pinned version: pip install -e '.[test]'"
            ) from e


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path in ONE_PROCESS and not _WORLDS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.one_process)


def _world(n: int):
    world = World(n, timeout=120)  # workers start on the first run
    yield world
    world.close()


@pytest.fixture(scope="session")
def world1():
    yield from _world(1)


@pytest.fixture(scope="session")
def world2():
    yield from _world(2)


@pytest.fixture(scope="session")
def world4():
    yield from _world(4)
