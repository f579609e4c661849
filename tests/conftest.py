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
