import os
import time

import pytest
import torch
import torch.distributed as dist

import fshard.launch as launch
from fshard.launch import RankError, World, is_worker, run

# Functions run on the workers: module level, so they pickle by reference.

_STATE = {}


def rank_info(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), torch.full((2,), dist.get_rank())


def worker_env():
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ[k] for k in keys}
    return env, is_worker(), torch.get_num_threads(), __name__


def set_state(value):
    _STATE["value"] = value
    return os.getpid()


def get_state():
    return _STATE.get("value"), os.getpid()


def fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    return "fine"


def collective_on_rank0_only():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return dist.get_rank()


def fail_on_rank1_while_rank0_waits():
    if dist.get_rank() == 1:
        raise KeyError("lost")
    dist.all_reduce(torch.ones(1))


def exit_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def nested_launch():
    return run(get_state, 2)


def pids():
    return os.getpid()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_results_in_rank_order(request, n):
    world = request.getfixturevalue(f"world{n}")
    out = world.run(rank_info, 10)
    total = float(sum(10 + r for r in range(n)))
    assert [o[:3] for o in out] == [(r, n, total) for r in range(n)]
    for r, o in enumerate(out):
        assert torch.equal(o[3], torch.full((2,), r))


def test_worker_environment(world2):
    out = world2.run(worker_env)
    for rank, (env, worker, threads, module) in enumerate(out):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert worker and threads == 1
        assert module == "tests.test_launch"  # this very module, imported by the worker
    assert not is_worker()


def test_state_persists_across_runs(world2):
    first = world2.run(set_state, "kept")
    assert world2.run(get_state) == [("kept", pid) for pid in first]


def test_exception_on_one_rank(world2):
    before = world2.run(pids)
    with pytest.raises(RankError) as info:
        world2.run(fail_on_rank1)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert isinstance(err.exception, ValueError)
    assert "rank 1 raised ValueError: bad input on rank 1" in str(err)
    assert "Remote traceback (rank 1)" in str(err) and "fail_on_rank1" in err.remote_traceback
    assert world2.run(pids) == before  # no restart needed: every rank answered


@pytest.mark.timeout(60)
def test_partial_collective_does_not_hang(world2):
    start = time.monotonic()
    with pytest.raises((TimeoutError, RankError)) as info:
        world2.run(collective_on_rank0_only, timeout=5)
    assert time.monotonic() - start < 20
    if isinstance(info.value, TimeoutError):  # (a RankError if Gloo's own timeout fired first)
        assert "ranks [0] did not finish within 5 s (ranks [1] did)" in str(info.value)
    assert world2.run(rank_info, 0)[1][:3] == (1, 2, 1.0)  # restarted and working


@pytest.mark.timeout(60)
def test_failure_while_other_rank_is_stuck(world2, monkeypatch):
    monkeypatch.setattr(launch, "_GRACE_S", 1.0)
    with pytest.raises(RankError) as info:
        world2.run(fail_on_rank1_while_rank0_waits, timeout=30)
    assert info.value.rank == 1 and info.value.exc_type == "KeyError"
    assert "ranks [0] had not finished" in str(info.value)
    assert world2.run(rank_info, 0)[0][:3] == (0, 2, 1.0)


@pytest.mark.timeout(60)
def test_worker_process_dies(world2):
    with pytest.raises(RankError, match="rank 1 died with exit code 3") as info:
        world2.run(exit_on_rank1)
    assert info.value.rank == 1 and info.value.exit_code == 3
    assert world2.run(rank_info, 0)[1][:3] == (1, 2, 1.0)


def test_one_shot_run():
    out = run(rank_info, 2, (1,))
    assert [o[:3] for o in out] == [(0, 2, 3.0), (1, 2, 3.0)]


def test_nested_launch_is_refused(world1):
    with pytest.raises(RankError, match="nested launches are not supported"):
        world1.run(nested_launch)


def test_unpicklable_fn_is_refused(world1):
    with pytest.raises(TypeError, match="module level"):
        world1.run(lambda: 0)


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True, None])
def test_invalid_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        World(bad)
    with pytest.raises(ValueError, match="world_size"):
        run(rank_info, bad)


def test_closed_world_refuses_to_run():
    world = World(1)
    with world:
        pass
    world.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        world.run(pids)
