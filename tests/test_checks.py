"""The suite's own checks can fail (issue 37 item 5): a NaN error is not dropped, a test
dependency that does not import fails a CI run instead of skipping its tests, a test of the
one-process lane that starts a rank fails, a session World whose workers hold many process
groups gets fresh workers (issue 38 item 4)."""

import math
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from tests._opcheck import nan_max
from tests.conftest import (
    MAX_WORKER_THREADS,
    REQUIRED_IN_CI,
    STARTS_PROCESSES,
    ProcessStarted,
    _recycle_if_crowded,
    _thread_count,
    check_required,
    in_one_process_lane,
)


def test_nan_max_keeps_a_nan_anywhere():
    assert max([0.1, math.nan, 0.2]) == 0.2  # what Python's max() does: the NaN is dropped
    for values in ([0.1, math.nan, 0.2], [math.nan, 0.1], [0.1, 0.2, math.nan]):
        assert math.isnan(nan_max(values)), values
    assert nan_max([0.1, 0.3, 0.2]) == 0.3
    assert nan_max([]) == 0.0


def test_a_required_package_that_does_not_import_fails_the_run():
    with pytest.raises(pytest.UsageError, match="fshard_no_such_package does not import"):
        check_required(["fshard_no_such_package"])
    assert "transformers" in REQUIRED_IN_CI
    check_required(REQUIRED_IN_CI)  # installed here (pyproject's test extra pins it)


def test_the_one_process_lane_refuses_a_process(request):
    assert request.node.get_closest_marker("one_process") is not None  # this test is in it
    with pytest.raises(ProcessStarted, match="STARTS_PROCESSES"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    subprocess.run(["git", "--version"], check=True, capture_output=True)  # a tool is no rank


def test_the_lane_is_chosen_by_fixtures_and_the_list():
    assert in_one_process_lane("tests/test_spec.py::test_x[a]", ("tmp_path",))
    assert not in_one_process_lane("tests/test_spec.py::test_x", ("world2", "tmp_path"))
    listed = next(iter(STARTS_PROCESSES))
    assert not in_one_process_lane(listed + "[param]", ())


def _new_groups(n: int) -> tuple[int, int]:
    """``n`` Gloo groups over ranks 0 and 1 made with ``dist.new_group`` (meshes share their
    groups by rank set; a program's own groups do not); this process's pid and threads."""
    for _ in range(n):
        dist.new_group([0, 1])
    return os.getpid(), _thread_count()


def test_a_crowded_session_world_gets_fresh_workers(world4):
    """Each Gloo group keeps a thread waking every 10 ms: a session World's workers that
    collected many are restarted after the test (tests/conftest.py), one with few is kept."""
    before = world4.run(_new_groups, 0)
    _recycle_if_crowded(world4)
    assert world4.run(_new_groups, 0) == before  # few threads: the same workers
    crowded = world4.run(_new_groups, 12)
    crowded = [c for rank, c in enumerate(crowded) if rank < 2]  # the groups' members
    assert all(t > MAX_WORKER_THREADS for _, t in crowded), crowded  # 12 groups x 3 threads
    _recycle_if_crowded(world4)
    fresh = world4.run(_new_groups, 0)
    assert all(t <= MAX_WORKER_THREADS for _, t in fresh), fresh
    assert not {pid for pid, _ in fresh} & {pid for pid, _ in crowded}, (crowded, fresh)
