"""Tensor parallelism on the CPU (gloo): three ranks, one KV head each (SmolLM2-135M has 9 query
and 3 KV heads), are exact against HF transformers under chunked prefill, prefix hits and
retraction, and leave nothing behind. (PD between TP sizes, and a rank killed under load:
tests/e2e/test_tensor_parallel_pd.py and test_tensor_parallel_server.py.)"""

from __future__ import annotations

import pytest

from support.checks import assert_engine_clean, run_and_compare
from support.serving import process_gone
from tandem.server.config import EngineConfig
from tandem.server.loop.engine import Engine


def tp_engine(**overrides) -> Engine:
    return Engine(EngineConfig(tp_size=3, dtype="float32", **overrides)).start()


def rank_pids(engine) -> list[int]:
    return [p.pid for p in engine.ranks._procs]


def test_three_ranks_match_the_reference(greedy_workload):
    engine = tp_engine(page_size=16, chunked_prefill_size=256, max_total_tokens=16384)
    try:
        assert engine.model.module.config.num_kv_heads == 1 and engine.kv_cache.num_kv_heads == 1
        run_and_compare(engine, greedy_workload, "tp3")
        again = run_and_compare(engine, greedy_workload, "tp3 (second pass, from the prefix cache)")
        assert all(r.cached_tokens > 0 for r, (p, _, _) in zip(again, greedy_workload) if len(p) > 32)
        assert_engine_clean(engine)
        pids = rank_pids(engine)
    finally:
        engine.shutdown()
    assert len(pids) == 2 and all(process_gone(pid) for pid in pids), "a rank outlived its engine"


def test_three_ranks_stay_exact_through_retraction(greedy_workload):
    # Prefills apart from decodes, as in test_exactness.py's retraction test: the schedule this pool
    # was sized for.
    engine = tp_engine(page_size=1, chunked_prefill_size=256, max_total_tokens=1800, init_new_token_ratio=0.0,
                       min_new_token_ratio=0.0, enable_mixed_chunk=False)
    try:
        run_and_compare(engine, greedy_workload, "tp3 small pool")
        assert engine.call(lambda: engine.scheduler.stats.retractions) > 0, "the pool was not small enough to retract"
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_tp_refuses_what_it_cannot_split_or_serve(smollm_fp32):
    with pytest.raises(ValueError, match="--tp-size=2 is invalid for .*: it must divide the model's 9 query heads"):
        Engine(EngineConfig(tp_size=2, max_total_tokens=1024))
    with pytest.raises(ValueError, match="pass no model"):
        Engine(EngineConfig(tp_size=3, max_total_tokens=1024), model=smollm_fp32)
    with pytest.raises(ValueError, match="--tp-size=0 is invalid: must be >= 1"):
        EngineConfig(tp_size=0).validate()
