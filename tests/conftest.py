"""Shared fixtures: one persistent launch World per size for the whole session."""

import importlib.util
import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Consistency mode (fshard.consistency): the mode users get, "default" (running digests compared
# at boundaries), so the suite runs what users run. Tests of a mode set it themselves
# (fs.config.consistency("every"), the fault tests); FSHARD_CHECK_CONSISTENCY=every in the
# shell runs everything strict. Set before fshard is imported; spawned workers inherit it.
os.environ.setdefault("FSHARD_CHECK_CONSISTENCY", "default")

import torch  # noqa: E402

from fshard.launch import World  # noqa: E402

# The one-process lane runs torch on one intra-op thread, as every rank does (fshard.launch):
# its tensors are tiny, and on a shared machine torch's default (a thread per core) spins in
# each op's barrier for the cores others hold. Measured on the 2-core machine at load 10: one
# refusal of tests/test_zoo.py (hf_zoo.parallelize_refusals, HRM, a dense torch.func step and
# parallelize on 4 simulated ranks) 12.6 s with 2 threads, 0.45 s with 1.
torch.set_num_threads(1)

# Spawned workers inherit the parent's sys.path and import test functions by module name
# (tests.test_launch.fn), so the repo root must be on it even if pytest's rootdir insertion
# changes (e.g. --import-mode=importlib).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


#: The one-process lane, ``pytest -m one_process``: every test that asks for no ``world*``
#: fixture and starts no process (layout math and planning on abstract meshes, op rules and
#: optimizers on plain tensors, argument checks that fail before any collective, the
#: repository's static checks, the doctests of the pure modules). Nothing in it starts a rank:
#: a test of the lane that starts a process fails (``_no_process_in_one_process_lane``), so a
#: test that launches ranks by itself (``fs.launch.run``, torchrun, a script) is listed here.
STARTS_PROCESSES = {
    "tests/ops/test_autocast.py::test_op_rules_match_dense_autocast",
    "tests/test_compat.py::test_suite_slice_on_simulated_oldest_torch",
    "tests/test_consistency_default.py::test_default_agreeing_ranks_pass_across_periodic_exchanges",
    "tests/test_consistency_default.py::test_default_catches_a_disagreement_mid_run_at_the_next_boundary",
    "tests/test_consistency_default.py::test_default_catches_a_late_disagreement_at_the_next_due_step",
    "tests/test_consistency_default.py::test_default_catches_checkpoint_save_to_different_paths",
    "tests/test_consistency_default.py::test_default_catches_every_disagreement_case",
    "tests/test_consistency_default.py::test_default_catches_mismatched_per_rank_batch_sizes",
    "tests/test_consistency_default.py::test_default_catches_per_rank_rows_passed_as_a_plain_tensor",
    "tests/test_consistency_default.py::test_default_catches_shard_src_with_a_shape_other_than_the_source",
    "tests/test_consistency_default.py::test_default_is_on_and_catches_a_skipped_same_shaped_gather",
    "tests/test_consistency_default.py::test_default_names_a_subgroup_disagreement_within_its_group",
    "tests/test_consistency_default.py::test_default_never_flags_random_correct_programs_on_a_2d_mesh",
    "tests/test_consistency_default.py::test_default_passes_a_plain_tensor_that_is_replicated",
    "tests/test_consistency_default.py::test_default_passes_uneven_blocks_on_a_2d_mesh",
    "tests/test_consistency_default.py::test_default_step_boundary_exchanges_at_1_2_4_8_then_every_interval",
    "tests/test_consistency_default.py::test_default_specs_compare_by_value_not_spelling",
    "tests/test_consistency_default.py::test_default_pipeline_plain_inputs_that_differ_raise_before_any_transfer",
    "tests/test_consistency_default.py::test_shard_of_a_meta_tensor_is_a_meta_sharded_array",
    "tests/test_consistency_default.py::test_shard_src_checks_the_shapes_before_the_send",
    "tests/test_consistency_default.py::test_world_runs_after_a_timed_out_run_and_the_message_names_the_cause",
    "tests/test_devices.py::test_mesh_create_initialises_the_group_under_torchrun",
    "tests/test_devices.py::test_readme_quickstart_under_torchrun",
    "tests/test_doc_blocks.py::test_scripts_run",
    "tests/test_dry_run.py::test_dry_run_figures_do_not_depend_on_the_hash_seed_or_earlier_runs",
    "tests/test_launch.py::test_a_sub_group_times_out_at_the_worlds_pg_timeout",
    "tests/test_launch.py::test_ranks_import_what_the_driver_imports_not_the_working_directorys",
    "tests/test_launch.py::test_fork_server_imports_the_modules_preload_names",
    "tests/test_launch.py::test_one_shot_run",
    "tests/test_launch.py::test_readme_multinode_torchrun_command",
    "tests/test_launch.py::test_results_in_rank_order",
    "tests/test_launch.py::test_run_from_an_interactive_session",
    "tests/test_launch.py::test_workers_die_with_the_driver",
    "tests/test_launch.py::test_worlds_fork_from_one_server_per_environment",
    "tests/test_mistakes.py::test_a_gloo_timeout_in_a_rank_names_the_cause",
    "tests/test_mistakes.py::test_collective_on_one_rank_under_fs_launch_run",
    "tests/test_mistakes.py::test_mistake_under_launch",
    "tests/test_mistakes.py::test_mistakes_under_torchrun",
    "tests/test_public_api.py::test_launch_examples_run_here",
    "tests/test_train_gpt.py::test_pipeline_training_matches_dense",
}
_WORLDS = {"world1", "world2", "world4", "world8"}


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
        if in_one_process_lane(item.nodeid, getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.one_process)


def in_one_process_lane(nodeid: str, fixturenames) -> bool:
    """Whether the test ``nodeid`` (asking for ``fixturenames``) runs in the one-process lane."""
    path = nodeid.split("::", 1)[0]
    name = nodeid.split("[", 1)[0]
    if _WORLDS & set(fixturenames):
        return False
    return path not in STARTS_PROCESSES and name not in STARTS_PROCESSES


class ProcessStarted(AssertionError):
    """A test of the one-process lane started a process."""


@pytest.fixture(autouse=True)
def _no_process_in_one_process_lane(request, monkeypatch):
    """A one-process-lane test that starts a process (a rank, a script) fails, naming the fix:
    the lane's promise is checked, not assumed."""
    if request.node.get_closest_marker("one_process") is None:
        yield
        return

    def refuse(*args, **kwargs):
        raise ProcessStarted(
            f"{request.node.nodeid} is in the one-process lane (it asks for no world fixture) "
            "but starts a process; list it in tests/conftest.py STARTS_PROCESSES"
        )

    popen_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(str(argv[0]).split()[0]) if argv else ""
        if program.startswith("python") or program == "torchrun" or argv[:1] == [sys.executable]:
            refuse()  # a rank or a script; a tool (git) is not a process of the library's
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    yield


#: A session World's workers are restarted after a test once one of them runs more threads than
#: this. Each Gloo process group keeps a thread that wakes every 10 ms (gloo's tcp ``Loop``): by
#: the end of a whole-suite run a world4 worker once held 88 groups and, idle, burned 14% of a
#: core. Meshes now share their groups by rank set (``fshard.mesh``), so a worker holds a few
#: (a 4-rank world: 14 threads after every test_composition configuration); groups a test makes
#: itself (``dist.new_group``, torch's own FSDP2 or pipelining) still add 3 threads each. A
#: worker starts with 5 threads (the default group has 3). A restart costs the next test its
#: warm-up (imports, plan caches: ~5 s of a 6 s first composed step on world4).
MAX_WORKER_THREADS = 32


def _thread_count() -> int:
    """This process's threads (Linux; elsewhere 0, so no restart)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _recycle_if_crowded(world: World) -> None:
    """Restart ``world``'s workers if one of them holds too many threads, or if they do not
    answer (a test left them broken: the next run would restart them anyway)."""
    if not world._procs:  # not started, or already stopped
        return
    try:
        counts = world.run(_thread_count, timeout=60)
    except Exception:  # noqa: BLE001 -- any failure: fresh workers for the next test
        counts = [MAX_WORKER_THREADS + 1]
    if max(counts) > MAX_WORKER_THREADS:
        world._kill()
        world.run(_thread_count)  # fresh workers now: no test's timing includes their start


@pytest.fixture(autouse=True)
def _recycle_session_worlds(request):
    yield
    for name in sorted(_WORLDS & set(request.fixturenames)):
        _recycle_if_crowded(request.getfixturevalue(name))


#: What the session Worlds' fork server imports before it forks: transformers' Llama (what the
#: HF tests' ranks run), else each worker of each World (and every restart) imports it itself,
#: about 5 s of CPU each (measured: a World(4) started and importing it, 34-45 s at load 12;
#: with the preload 10 s for the first, 0.6 s after). Only the session Worlds: a test's own
#: World or script imports what it uses.
PRELOAD = (
    ("transformers.models.llama.modeling_llama",)
    if importlib.util.find_spec("transformers") is not None
    else ()
)


def _world(n: int, start_timeout: float = 120):
    world = World(n, timeout=start_timeout, preload=PRELOAD)  # workers start on the first run
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


@pytest.fixture(scope="session")
def world8():
    """8 ranks on the 2 cores, for the few tests of every axis at once: started once (8 processes
    importing torch), not once per test; a longer start-up bound for the oversubscription."""
    yield from _world(8, start_timeout=600)
