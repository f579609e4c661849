"""The CPU allocator's live bytes as a test oracle, counting the frees of every thread: a Gloo
Work holds its collective's tensors and the group's worker thread may free them after fshard
dropped its references, where torch.profiler, which records only the threads it profiles,
never sees the free (tests/test_dry_run.py's ``_real_rank`` has the measurements)."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch


@contextlib.contextmanager
def allocator_counts_every_thread():
    """c10's ``caffe2_report_cpu_memory_usage`` switched on inside the block: the CPU
    allocator then keeps its running total of live bytes (the ``total_allocated`` of
    torch.profiler's allocator events) for the allocations and frees of every thread, where by
    default it counts only those of threads under the profiler."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    was, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = was


def peak_above_start(prof) -> int:
    """The allocator's highest running total at ``prof``'s allocator events above its total
    before the first of them."""

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    events = (n for n in walk(tree) if n.tag == torch._C._profiler._EventType.Allocation)
    allocs = [n.extra_fields for n in sorted(events, key=lambda n: n.start_time_ns)]
    start = allocs[0].total_allocated - allocs[0].alloc_size
    return max(a.total_allocated for a in allocs) - start
