"""What happens to a request between an overlapped step's launch and its result, held there on
purpose (support/overlap.py's StepGate), colocated and on each side of a prefill/decode pair.

The window: while the engine thread waits for step N it has planned step N+1 already, and a
decode in both counts the token N samples as computed (`num_computed`) before it is known
(`token_ids`). An abort applied then used to hand the prefix cache a page with a missing last key
(issue 65: "insert needs whole pages: 31 tokens for 2 pages of 16") and crash the loop."""

from __future__ import annotations

import gc
import random

import pytest

from support.checks import assert_engine_clean, assert_matches_reference
from support.overlap import StepGate
from support.pd import assert_clean
from support.serving import free_port
from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.loop.engine import Engine
from tandem.server.scheduling.request import Bootstrap
from tandem.server.scheduling.sampling_params import SamplingParams

PAGE = 16
LONG = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
rng = random.Random(65)
PROMPT = [rng.randrange(1000, 40000) for _ in range(21)]
OTHER = [rng.randrange(1000, 40000) for _ in range(37)]


@pytest.fixture(autouse=True)
def collect_engines_now():
    yield
    gc.collect()  # Mooncake engines go now, not in a later test (test_pd_engine.py says why)


def ahead_of_known(req, at_boundary: bool):
    """The window's state for `req`: a launched step reads the token the step before is still
    sampling; `at_boundary`: that token is the first of a page."""
    ahead = req.num_computed == len(req.token_ids) + 1
    return ahead and (req.num_computed % PAGE == 0) == at_boundary and (req.num_computed, len(req.token_ids))


def abort_parked(engine: Engine, gate: StepGate, req) -> list[int]:
    """Abort `req` while the engine is parked mid-step; returns its known tokens. The check runs
    after the abort (the inbox keeps order) and before the held step ends."""
    engine.abort(req.rid)

    def check():
        assert gate.parked(), "the abort was not applied while the step was in flight"
        assert req.finished and req.finish.reason == "abort"
        # Freed, or (a prefill's) handed to the KV connector, which frees it at its next poll.
        assert req.slot is None or req in engine.scheduler.handed_off
        engine.scheduler.check_integrity(engine.connector.held())
        return list(req.token_ids)

    return engine.call(check)


@pytest.mark.parametrize("at_boundary", [True, False], ids=["page-boundary", "mid-page"])
def test_colocated_abort_while_a_decode_step_is_in_flight(smollm_fp32, hf_reference, at_boundary):
    """The aborted request's known tokens stay cached and correct (a later prompt that extends
    them is served from the cache, as the reference says); the request decoding beside it is
    untouched; nothing leaks."""
    engine = Engine(EngineConfig(max_total_tokens=4096, disable_overlap_schedule=False), model=smollm_fp32)
    gate = StepGate(engine)
    with engine:
        target, other = engine.submit(PROMPT, LONG), engine.submit(OTHER, SHORT)
        seen = gate.step_until(lambda: ahead_of_known(target.request, at_boundary))
        known = abort_parked(engine, gate, target.request)
        assert seen == (len(known) + 1, len(known))
        gate.open()
        aborted = target.result()
        assert aborted.finish_reason == "abort" and aborted.output_ids == known[len(PROMPT):]
        want, gaps = hf_reference.greedy(OTHER, SHORT.max_new_tokens)
        assert_matches_reference(other.result().output_ids, want, gaps, "the request beside it")
        want, gaps = hf_reference.greedy(PROMPT, LONG.max_new_tokens)
        n = len(aborted.output_ids)
        assert_matches_reference(aborted.output_ids, want[:n], gaps[:n], "the aborted request's tokens")
        again = engine.submit(known + [5], SHORT).result()
        assert again.cached_tokens == len(known) // PAGE * PAGE
        assert_matches_reference(again.output_ids, *hf_reference.greedy(known + [5], SHORT.max_new_tokens),
                                 "a prompt over the aborted request's cached pages")
        assert_engine_clean(engine)


def pair(smollm_fp32, **overlap):
    """A prefill and a decode engine, each with a gate; `overlap`: EngineConfig fields of both."""
    port = free_port()
    p = Engine(EngineConfig(max_total_tokens=4096, **overlap), model=smollm_fp32,
               disagg=DisaggConfig(role="prefill", bootstrap_port=port, bootstrap_timeout=5.0))
    d = Engine(EngineConfig(max_total_tokens=4096, **overlap), model=smollm_fp32,
               disagg=DisaggConfig(role="decode", bootstrap_timeout=5.0))
    return p, d, port


@pytest.mark.parametrize("at_boundary", [True, False], ids=["page-boundary", "mid-page"])
def test_decode_side_abort_while_a_decode_step_is_in_flight(smollm_fp32, hf_reference, at_boundary):
    p, d, port = pair(smollm_fp32, disable_overlap_schedule=False)
    gate = StepGate(d)
    try:
        p.start(), d.start()
        legs = []
        for prompt, params in ((PROMPT, LONG), (OTHER, SHORT)):
            b = Bootstrap("127.0.0.1", port, rng.randrange(1 << 31))
            legs.append((p.submit(prompt, params, bootstrap=b), d.submit(prompt, params, bootstrap=b)))
        (_, target), (_, other) = legs
        gate.step_until(lambda: ahead_of_known(target.request, at_boundary))
        known = abort_parked(d, gate, target.request)
        gate.open()
        assert legs[0][0].result().finish_reason == "length"
        assert target.result().finish_reason == "abort"
        assert legs[1][0].result().finish_reason == "length"
        want, gaps = hf_reference.greedy(OTHER, SHORT.max_new_tokens)
        assert_matches_reference(other.result().output_ids, want, gaps, "the decode beside it")
        # The decode's cache holds the aborted request's known pages, and they are right.
        prompt = known + [5]
        b = Bootstrap("127.0.0.1", port, rng.randrange(1 << 31))
        streams = p.submit(prompt, SHORT, bootstrap=b), d.submit(prompt, SHORT, bootstrap=b)
        again = streams[1].result()
        assert streams[0].result().finish_reason == "length"
        assert again.cached_tokens >= len(known) // PAGE * PAGE
        assert_matches_reference(again.output_ids, *hf_reference.greedy(prompt, SHORT.max_new_tokens), "over the cache")
        assert_clean(p, d)
    finally:
        gate.open()
        for e in (p, d):
            e.shutdown()


@pytest.mark.parametrize("prompt_len", [32, 37], ids=["page-boundary", "mid-page"])
def test_prefill_side_abort_while_its_prefill_step_is_in_flight(smollm_fp32, hf_reference, prompt_len):
    """The prefill leg aborted while its forward pass computes: the decode leg ends with an error
    naming the abort, both sides free everything, and the pair serves the same prompt right after."""
    p, d, port = pair(smollm_fp32, disable_overlap_schedule=False)
    gate = StepGate(p)
    try:
        p.start(), d.start()
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
        b = Bootstrap("127.0.0.1", port, rng.randrange(1 << 31))
        decode = d.submit(prompt, SHORT, bootstrap=b)
        prefill = p.submit(prompt, SHORT, bootstrap=b)
        req = prefill.request
        gate.step_until(lambda: req.num_computed == prompt_len and req in engine_running(p))
        abort_parked(p, gate, req)
        gate.open()
        assert prefill.result().finish_reason == "abort"
        ended = decode.result()
        assert ended.finish_reason == "abort" and "ended before its KV was sent" in ended.error, ended
        b = Bootstrap("127.0.0.1", port, rng.randrange(1 << 31))
        streams = p.submit(prompt, SHORT, bootstrap=b), d.submit(prompt, SHORT, bootstrap=b)
        assert_matches_reference(streams[1].result().output_ids, *hf_reference.greedy(prompt, SHORT.max_new_tokens),
                                 "after the abort")
        assert streams[0].result().finish_reason == "length"
        assert_clean(p, d)
    finally:
        gate.open()
        for e in (p, d):
            e.shutdown()


def engine_running(engine: Engine) -> list:
    return engine.scheduler.running + ([engine.scheduler.chunked] if engine.scheduler.chunked else [])
