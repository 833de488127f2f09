"""`--compute-priority idle`: `idle_compute_threads` (csrc/thread_policy.cpp), run on the thread
that computes forward passes, moves that thread and the OpenMP workers of its parallel regions to
SCHED_IDLE, and no other thread; a local stack runs its decodes so beside its prefills."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.cpu_ops import cpu_ops_unavailable, idle_compute_threads

NEEDS_KERNELS = pytest.mark.skipif(not all(flag in cpu_flags() for flag in ("avx2", "fma")),
                                   reason="tandem's CPU kernels are built for AVX2 + FMA; this CPU lacks them")


def idle_threads() -> set[int]:
    """This process's threads under SCHED_IDLE."""
    found = set()
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                found.add(tid)
        except ProcessLookupError:  # ended meanwhile
            pass
    return found


@NEEDS_KERNELS
def test_the_callers_compute_threads_and_no_others_go_idle():
    assert cpu_ops_unavailable() is None
    before = idle_threads()
    seen: dict = {}

    def compute():  # a thread of its own: its OpenMP pool, not the test runner's, goes idle
        torch.set_num_threads(2)
        torch.ones(1 << 20).sum()  # a parallel region: the pool exists before the call
        seen["count"] = idle_compute_threads()
        seen["me"] = threading.get_native_id()
        seen["idle"] = idle_threads() - before
        seen["after"] = float(torch.ones(1 << 20).sum())  # still computes, on the same pool

    worker = threading.Thread(target=compute)
    worker.start()
    worker.join()
    assert seen["count"] == 2
    assert seen["me"] in seen["idle"] and len(seen["idle"]) == 2, seen
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's thread only, not the process
    assert seen["after"] == 1 << 20


def flags_given(stack, roles: list[str]) -> list[tuple[str, list[str]]]:
    """What `stack.start_servers(roles)` would launch: (role, extra serve flags) per server."""
    started = []
    stack.start_server = lambda role, *extra: started.append((role, list(extra)))
    stack.start_servers(roles)
    return started


@pytest.mark.parametrize("roles, flags", [
    (["colocated"], [["--num-threads", "2"]]),
    (["colocated", "colocated"], [["--num-threads", "1"]] * 2),
    (["prefill", "decode"], [["--num-threads", "2"], ["--num-threads", "2", "--compute-priority", "idle"]]),
    (["prefill", "prefill", "decode", "decode"],
     [["--num-threads", "1"]] * 2 + [["--num-threads", "1", "--compute-priority", "idle"]] * 2),
    (["decode"], [["--num-threads", "2"]]),
])
def test_a_local_stack_gives_decodes_beside_prefills_the_cores_at_idle_priority(monkeypatch, tmp_path, roles, flags):
    """On two cores: servers of one role split them; decodes beside prefills run idle."""
    from tandem.tools import stack
    from tandem.tools.stack import LocalStack

    monkeypatch.setattr(stack, "usable_cpus", lambda: (2, "two cores"))
    assert flags_given(LocalStack(tmp_path), roles) == list(zip(roles, flags))


def test_engine_flags_given_to_a_local_stack_take_precedence(tmp_path):
    from tandem.tools.stack import LocalStack

    stack = LocalStack(tmp_path, ("--num-threads=1", "--compute-priority", "normal"))
    assert flags_given(stack, ["prefill", "decode"]) == [("prefill", []), ("decode", [])]
