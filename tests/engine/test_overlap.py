"""Overlap scheduling on the real model: when it is on, and what a failed forward pass does in
each loop. (Exactness under overlap is in test_exactness.py; the scheduler's side of it in
unit/test_scheduler.py.)"""

from __future__ import annotations

import torch

from support.checks import assert_engine_clean
from tandem.server.config import EngineConfig
from tandem.server.loop.engine import Engine, overlap_scheduling
from tandem.server.scheduling.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(1000, 1040))  # 40 tokens: two whole pages of 16 to cache


def failing_on(engine: Engine, calls: set[int]):
    """Make the runner's passes numbered `calls` (from 1) raise; returns the list of call numbers seen."""
    seen, run = [], engine.runner.run

    def flaky(step):
        seen.append(len(seen) + 1)
        if seen[-1] in calls:
            raise RuntimeError("injected: the device fell over")
        return run(step)

    engine.runner.run = flaky
    return seen


def test_overlap_scheduling_when_unset_is_on_for_cuda_decodes_and_idle_cpu_servers():
    assert overlap_scheduling(EngineConfig(), torch.device("cuda"))
    assert not overlap_scheduling(EngineConfig(), torch.device("cpu"))
    assert not overlap_scheduling(EngineConfig(), torch.device("cpu"), "prefill")
    assert overlap_scheduling(EngineConfig(), torch.device("cpu"), "decode")
    assert not overlap_scheduling(EngineConfig(disable_overlap_schedule=True), torch.device("cpu"), "decode")
    assert overlap_scheduling(EngineConfig(compute_priority="idle"), torch.device("cpu"))
    assert overlap_scheduling(EngineConfig(disable_overlap_schedule=False), torch.device("cpu"))
    assert not overlap_scheduling(EngineConfig(disable_overlap_schedule=True), torch.device("cuda"))


def test_a_failed_pass_fails_the_overlapped_engine(smollm_fp32):
    engine = Engine(EngineConfig(max_total_tokens=4096, disable_overlap_schedule=False), model=smollm_fp32)
    assert engine.overlap
    with engine:
        failing_on(engine, {3})
        results = [s.result() for s in [engine.submit(PROMPT, GREEDY), engine.submit(PROMPT[::-1], GREEDY)]]
        engine._thread.join(30)
        assert not engine._thread.is_alive(), "the loop went on after the failed pass"
    assert engine.failed.reason and "forward pass failed: RuntimeError: injected" in engine.failed.reason
    for r in results:
        assert r.finish_reason == "abort" and r.error_code == "internal" and "injected" in r.error, r


def test_a_failed_pass_fails_only_its_requests_in_the_plain_loop(make_engine):
    """Its requests end with an internal error, nothing leaks, and none of the KV it was to write
    reaches the prefix cache: the same prompt right after is computed afresh and comes out right."""
    engine = make_engine(max_total_tokens=4096, disable_overlap_schedule=True)
    want = engine.submit(PROMPT, GREEDY).result().output_ids
    engine.flush_cache()
    seen = failing_on(engine, {1})
    failed = engine.submit(PROMPT, GREEDY).result()
    assert failed.finish_reason == "abort" and failed.error_code == "internal" and "injected" in failed.error
    assert_engine_clean(engine)
    assert engine.call(lambda: engine.memory.cache.num_pages) == 0, "the failed prefill's pages were cached"
    again = engine.submit(PROMPT, GREEDY).result()
    assert again.output_ids == want and again.cached_tokens == 0
    assert len(seen) > 1 and engine.failed.reason is None
