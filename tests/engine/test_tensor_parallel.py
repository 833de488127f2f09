"""Tensor parallelism on the CPU (gloo): three ranks, one KV head each (SmolLM2-135M has 9 query
and 3 KV heads), are exact against HF transformers under chunked prefill, prefix hits and
retraction, colocated and between prefill and decode servers of different TP sizes (each head's
KV moved by the rank holding it, over Mooncake); and a rank that dies fails the engine promptly,
with errors for every open request, and takes the other ranks with it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from support.checks import assert_engine_clean, assert_matches_reference
from support.prompts import prompts
from support.serving import free_port, wait_for
from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.engine import Engine
from tandem.server.request import Bootstrap
from tandem.server.sampling_params import SamplingParams

NEW_TOKENS = 24
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(smollm_fp32, hf_reference):
    ids = prompts(smollm_fp32.tokenizer)
    assert len(ids) >= 10 and min(map(len, ids)) == 4 and max(map(len, ids)) >= 1200
    return [(p, *hf_reference.greedy(p, NEW_TOKENS)) for p in ids]


def tp_engine(**overrides) -> Engine:
    return Engine(EngineConfig(tp_size=3, dtype="float32", **overrides)).start()


def run_and_compare(engine, workload, label: str):
    results = [s.result() for s in [engine.submit(p, GREEDY) for p, _, _ in workload]]
    for i, (r, (p, want, gaps)) in enumerate(zip(results, workload)):
        assert r.finish_reason == "length", f"{label} prompt {i}: {r.finish_reason} {r.error}"
        assert_matches_reference(r.output_ids, want, gaps, f"{label} prompt {i} ({len(p)} tokens)")
    return results


def rank_pids(engine) -> list[int]:
    return [p.pid for p in engine.ranks._procs]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_three_ranks_match_the_reference(workload):
    engine = tp_engine(page_size=16, chunked_prefill_size=256, max_total_tokens=16384)
    try:
        assert engine.model.module.config.num_kv_heads == 1 and engine.kv_cache.num_kv_heads == 1
        run_and_compare(engine, workload, "tp3")
        again = run_and_compare(engine, workload, "tp3 (second pass, from the prefix cache)")
        assert all(r.cached_tokens > 0 for r, (p, _, _) in zip(again, workload) if len(p) > 32)
        assert_engine_clean(engine)
        pids = rank_pids(engine)
    finally:
        engine.shutdown()
    assert len(pids) == 2 and all(gone(pid) for pid in pids), "a rank outlived its engine"


def test_three_ranks_stay_exact_through_retraction(workload):
    engine = tp_engine(page_size=1, chunked_prefill_size=256, max_total_tokens=1800, init_new_token_ratio=0.0,
                       min_new_token_ratio=0.0)
    try:
        run_and_compare(engine, workload, "tp3 small pool")
        assert engine.call(lambda: engine.scheduler.stats.retractions) > 0, "the pool was not small enough to retract"
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(3, 1), (1, 3)])
def test_pd_between_different_tp_sizes_is_exact(smollm_fp32, workload, prefill_tp, decode_tp):
    config = dict(dtype="float32", page_size=16, chunked_prefill_size=256, max_total_tokens=8192)
    port = free_port()

    def engine(tp: int, role: str, **disagg) -> Engine:
        return Engine(EngineConfig(tp_size=tp, **config), model=None if tp > 1 else smollm_fp32,
                      disagg=DisaggConfig(role=role, **disagg)).start()

    p = engine(prefill_tp, "prefill", bootstrap_port=port)
    d = engine(decode_tp, "decode")
    work = sorted(workload, key=lambda w: len(w[0]))[::2]  # every other length, 4 tokens to the longest
    work.append(max(workload, key=lambda w: len(w[0])))
    try:
        legs = []
        for room, (prompt, _, _) in enumerate(work):
            b = Bootstrap("127.0.0.1", port, room)
            legs.append((p.submit(prompt, GREEDY, bootstrap=b), d.submit(prompt, GREEDY, bootstrap=b)))
        for (prefill_leg, decode_leg), (prompt, want, gaps) in zip(legs, work):
            out = decode_leg.result()
            assert out.finish_reason == "length", (out.finish_reason, out.error)
            assert prefill_leg.result().finish_reason == "length"
            assert_matches_reference(out.output_ids, want, gaps, f"tp {prefill_tp} -> {decode_tp}, {len(prompt)} tokens")
        assert p.snapshot.kv_transfer_bytes == d.snapshot.kv_transfer_bytes > 0
        for e in (p, d):
            wait_for(lambda e=e: not e.call(e.connector.has_work) and not e.call(e.scheduler.has_work), "idle", 30)
            assert_engine_clean(e)
            assert e.call(e.connector.held) == []
    finally:
        p.shutdown()
        d.shutdown()


def test_a_killed_rank_fails_the_engine_and_its_requests(smollm_fp32):
    engine = tp_engine(page_size=16, max_total_tokens=8192)
    try:
        pids = rank_pids(engine)
        long_prompt = max(prompts(smollm_fp32.tokenizer), key=len)
        streams = [engine.submit(long_prompt, SamplingParams(max_new_tokens=2000, ignore_eos=True)) for _ in range(3)]
        next(iter(streams[0]))  # running: the ranks are inside forward passes
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        results = [s.result() for s in streams]
        took = time.monotonic() - start
        for r in results:
            assert r.finish_reason == "abort" and r.error_code == "internal", (r.finish_reason, r.error_code)
            assert "tensor-parallel rank 1 exited with code -9" in r.error, r.error
        assert took < 30, f"the requests took {took:.1f}s to fail"
        assert engine.failure and not engine.alive
        with pytest.raises(RuntimeError, match="shut down"):
            engine.submit("too late", GREEDY)
        deadline = time.monotonic() + 20
        while not gone(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pids[1]), "rank 2 outlived the failed engine"
    finally:
        engine.shutdown()


def test_tp_refuses_what_it_cannot_split_or_serve(smollm_fp32):
    with pytest.raises(ValueError, match="--tp-size=2 is invalid for .*: it must divide the model's 9 query heads"):
        Engine(EngineConfig(tp_size=2, max_total_tokens=1024))
    with pytest.raises(ValueError, match="pass no model"):
        Engine(EngineConfig(tp_size=3, max_total_tokens=1024), model=smollm_fp32)
    with pytest.raises(ValueError, match="--tp-size=0 is invalid: must be >= 1"):
        EngineConfig(tp_size=0).validate()
