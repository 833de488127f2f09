"""Prefill and decode engines in one process, KV moved by Mooncake over TCP on 127.0.0.1: outputs
equal the colocated engine's, and every failure path ends both legs and frees everything."""

from __future__ import annotations

import gc
import json
import random
import threading
import time

import pytest
import torch

from support.checks import assert_matches_reference, cached_prefixes
from support.pd import GREEDY, assert_clean, run_pair, run_pairs, wait_idle
from support.serving import free_port
from support.structured import REGEXES, SCHEMAS, assert_full_match, assert_valid_json, chat_prompt
from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.scheduling.request import Bootstrap
from tandem.server.scheduling.sampling_params import Constraint, InvalidRequestError, SamplingParams

@pytest.fixture(autouse=True)
def collect_engines_now():
    """Engines a test shut down are destroyed as it ends, not in some later test's garbage
    collection: a Mooncake engine's destructor holds the GIL for ~0.75 s, and several in a row
    stall that later test's bootstrap calls (same process) past their 5 s timeout."""
    yield
    gc.collect()


def make_pd(smollm_fp32, prefill=None, decode=None, decode_engine=None, **engine):
    """(prefill engine, decode engine, bootstrap port). `prefill`, `decode`: DisaggConfig fields of
    each; `engine`: EngineConfig fields of both, `decode_engine` the decode's own."""
    from tandem.server.loop.engine import Engine

    engine.setdefault("max_total_tokens", 8192)
    port = free_port()
    p = Engine(EngineConfig(**engine), model=smollm_fp32, disagg=DisaggConfig(role="prefill", bootstrap_port=port, **(prefill or {}))).start()
    d = Engine(EngineConfig(**{**engine, **(decode_engine or {})}), model=smollm_fp32,
               disagg=DisaggConfig(role="decode", **(decode or {}))).start()
    return p, d, port


@pytest.fixture(scope="module")
def pd(smollm_fp32):
    p, d, port = make_pd(smollm_fp32, prefill={"bootstrap_timeout": 3.0}, decode={"bootstrap_timeout": 3.0})
    yield p, d, port
    for e in (p, d):
        e.shutdown()


def test_pd_outputs_equal_the_reference(pd, hf_reference):
    assert_pd_matches_the_reference(*pd, hf_reference)


def test_pd_outputs_equal_the_reference_with_the_other_loops(smollm_fp32, hf_reference):
    """The fixture's pair runs a CPU's defaults: the prefill's plain loop, the decode overlapped.
    Here each side runs the other loop."""
    p, d, port = make_pd(smollm_fp32, disable_overlap_schedule=False, decode_engine={"disable_overlap_schedule": True})
    try:
        assert p.overlap and not d.overlap
        assert_pd_matches_the_reference(p, d, port, hf_reference)
    finally:
        for e in (p, d):
            e.shutdown()


def assert_pd_matches_the_reference(p, d, port, hf_reference):
    rng = random.Random(5)
    shared = [rng.randrange(1000, 40000) for _ in range(300)]
    prompts = [shared + [rng.randrange(1000, 40000) for _ in range(n)] for n in (5, 40, 77)]
    prompts += [[rng.randrange(1000, 40000) for _ in range(n)] for n in (1, 16, 17, 1100)]
    # The first alone: the others find the shared prefix in the prefill's cache.
    results = [run_pair(p, d, port, prompts[0])] + run_pairs(p, d, port, prompts[1:])
    for prompt, legs in zip(prompts, results):
        want, gaps = hf_reference.greedy(prompt, GREEDY.max_new_tokens)
        assert legs["prefill"].finish_reason in ("length", "stop") and len(legs["prefill"].output_ids) == 1
        assert legs["prefill"].output_ids[0] == legs["decode"].output_ids[0]
        assert_matches_reference(legs["decode"].output_ids, want, gaps, f"{len(prompt)}-token prompt")
    # The shared prefix was served from the prefill's prefix cache, and still arrived whole.
    assert p.snapshot.prefix_hit_tokens >= 2 * 288
    assert results[1]["decode"].cached_tokens == results[1]["prefill"].cached_tokens >= 288
    assert p.snapshot.kv_transfer_bytes == d.snapshot.kv_transfer_bytes > 0
    assert_clean(p, d)


class Gate:
    """Wraps an engine's `runner.run`: while closed, the forward passes it is handed wait."""

    def __init__(self, engine, monkeypatch):
        self.open, self.waiting = threading.Event(), threading.Event()
        self.open.set()
        run = engine.runner.run

        def gated(step):
            if not self.open.is_set():
                self.waiting.set()
                assert self.open.wait(60)
            return run(step)

        monkeypatch.setattr(engine.runner, "run", gated)


def next_output(stream, timeout: float):
    """The stream's next output, or None if none came within `timeout` seconds."""
    got = []
    reader = threading.Thread(target=lambda: got.append(next(iter(stream))), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else None


def test_a_decode_registers_and_streams_while_a_step_computes(smollm_fp32, monkeypatch):
    """The decode (overlapped, a CPU decode's default) goes on while a step computes: a new
    request registers with its prefill, and its first token streams once its KV lands, both while
    that step is still held."""
    p, d, port = make_pd(smollm_fp32)
    prefill_gate, decode_gate = Gate(p, monkeypatch), Gate(d, monkeypatch)
    try:
        assert d.overlap and not p.overlap
        long = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
        a = Bootstrap("127.0.0.1", port, random.randrange(1 << 31))
        a_legs = p.submit(list(range(100, 140)), long, bootstrap=a), d.submit(list(range(100, 140)), long, bootstrap=a)
        assert next_output(a_legs[1], 60).token_ids  # the decode is running steps
        decode_gate.open.clear()
        assert decode_gate.waiting.wait(60)  # a decode step is held
        prefill_gate.open.clear()
        b = Bootstrap("127.0.0.1", port, random.randrange(1 << 31))
        b_legs = p.submit(list(range(300, 400)), GREEDY, bootstrap=b), d.submit(list(range(300, 400)), GREEDY, bootstrap=b)
        assert prefill_gate.waiting.wait(60)  # the decode registered b: its prefill runs (held)
        prefill_gate.open.set()
        first = next_output(b_legs[1], 60)
        assert first is not None and first.token_ids and not decode_gate.open.is_set()
        decode_gate.open.set()
        assert b_legs[0].result().output_ids == first.token_ids
        assert len(first.token_ids + b_legs[1].result().output_ids) == GREEDY.max_new_tokens
        assert a_legs[1].result().finish_reason == "length"
        assert_clean(p, d)
    finally:
        prefill_gate.open.set()
        decode_gate.open.set()
        for e in (p, d):
            e.shutdown()


# -- decode-side prefix reuse ----------------------------------------------------------------------
@pytest.fixture
def registrations(monkeypatch):
    """Every room a decode registers: (prompt_len, destination pages, skip_pages)."""
    from tandem.server.disagg.bootstrap import BootstrapClient

    seen, register = [], BootstrapClient.register

    def spy(self, me, room, request_id, prompt_len, digest, pages, record_slot, skip_pages=0):
        seen.append((prompt_len, list(pages), skip_pages))
        return register(self, me, room, request_id, prompt_len, digest, pages, record_slot, skip_pages)

    monkeypatch.setattr(BootstrapClient, "register", spy)
    return seen


def _cached_pages(engine) -> tuple[set[int], dict[int, torch.Tensor]]:
    """The decode's cached pages now, and a copy of each one's KV in every layer."""

    def read():
        pages = set(engine.memory.cache.held_pages())
        return pages, {page: engine.kv_cache.buffer[:, :, page].clone() for page in pages}

    return engine.call(read)


def cached_prefixes_of(engine) -> set[tuple[int, ...]]:
    return engine.call(lambda: cached_prefixes(engine.memory.cache))


@pytest.mark.parametrize("case", ["reuse", "disabled", "old-prefill"])
def test_decode_gets_only_the_pages_its_prefix_cache_lacks(smollm_fp32, hf_reference, registrations, monkeypatch, case):
    """A shared system prompt, then two users and one user's follow-up turn: with reuse, the decode
    registers destinations only past the prefix its own cache holds (a page it caches is never a
    destination, and its KV is the same before and after), the prefill sends only those pages,
    the counters say what was skipped, and every output equals the reference. The last page always
    moves. With `--disable-decode-prefix-reuse`, or with a prefill that does not list the feature
    (an older version during a rollout), every page moves."""
    if case == "old-prefill":
        monkeypatch.setattr("tandem.server.disagg.bootstrap.FEATURES", [])
    reuse = case == "reuse"
    p, d, port = make_pd(smollm_fp32, decode={"disable_decode_prefix_reuse": case == "disabled", "bootstrap_timeout": 3.0})
    try:
        rng, page = random.Random(11), d.config.page_size
        system = [rng.randrange(1000, 40000) for _ in range(200)]  # 12 whole pages and 8 tokens
        first = system + [rng.randrange(1000, 40000) for _ in range(30)]
        turn1 = run_pair(p, d, port, first)["decode"]
        wait_idle(p, d)  # its pages are in the decode's cache now
        follow_up = first + turn1.output_ids + [rng.randrange(1000, 40000) for _ in range(20)]
        second = system + [rng.randrange(1000, 40000) for _ in range(40)]
        cached, kv_before = _cached_pages(d)
        computed = len(first) + len(turn1.output_ids) - 1  # the last output token has no KV yet
        assert len(cached) == computed // page

        results = [legs["decode"] for legs in run_pairs(p, d, port, [second, follow_up])]
        for prompt, out in zip((first, second, follow_up), (turn1, *results)):
            want, gaps = hf_reference.greedy(prompt, GREEDY.max_new_tokens)
            assert_matches_reference(out.output_ids, want, gaps, f"{len(prompt)}-token prompt")

        need = {n: -(-n // page) for n in (len(first), len(second), len(follow_up))}
        skips = {len(first): 0, len(second): 200 // page,
                 len(follow_up): min(computed // page, (len(follow_up) - 1) // page)} if reuse else {}
        assert sorted((n, skip) for n, _, skip in registrations) == sorted((n, skips.get(n, 0)) for n in need)
        for n, pages, skip in registrations:
            assert len(pages) == need[n] - skip
            if n != len(first):
                assert not set(pages) & cached, "a cached page was registered as a transfer destination"
        kv_after = d.call(lambda: {page: d.kv_cache.buffer[:, :, page].clone() for page in cached})
        assert all(torch.equal(kv_before[page], kv_after[page]) for page in cached), "the cached prefix was written"

        page_bytes = d.connector.kv_bytes_per_page
        skipped = sum(skip for _, _, skip in registrations)
        assert p.snapshot.kv_transfer_bytes == d.snapshot.kv_transfer_bytes == (sum(need.values()) - skipped) * page_bytes
        assert d.snapshot.kv_transfer_skipped_bytes == skipped * page_bytes
        assert d.snapshot.decode_prefix_hit_tokens == skipped * page
        assert d.snapshot.decode_prefix_query_tokens == (sum(need) if reuse else 0)
        assert_clean(p, d)

        # A decode leg whose prefill never comes: it times out and frees its own pages, never the
        # cached prefix it pinned.
        held = cached_prefixes_of(d)
        lost = run_pair(p, d, port, system + [7] * 40, legs=("decode",))["decode"]
        assert lost.finish_reason == "abort" and "no prefill request arrived" in lost.error
        assert_clean(p, d)
        assert held <= cached_prefixes_of(d)
    finally:
        for e in (p, d):
            e.shutdown()


def test_decode_reuse_stays_exact_through_retraction_on_the_decode(smollm_fp32, hf_reference):
    """A decode pool too small for every request's output: running requests are retracted and
    recomputed on the decode from its own cache; with the shared prefix reused, outputs stay equal
    to the reference and both sides end clean."""
    p, d, port = make_pd(smollm_fp32, decode_engine={"max_total_tokens": 640, "init_new_token_ratio": 0.0,
                                                     "min_new_token_ratio": 0.0})
    try:
        rng = random.Random(12)
        system = [rng.randrange(1000, 40000) for _ in range(200)]
        params = SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)
        prompts = [system + [rng.randrange(1000, 40000) for _ in range(20 + 7 * i)] for i in range(6)]
        run_pair(p, d, port, prompts[0], params)  # the system prompt is in the decode's cache from here on
        wait_idle(p, d)
        for prompt, legs in zip(prompts, run_pairs(p, d, port, prompts, params)):
            want, gaps = hf_reference.greedy(prompt, params.max_new_tokens)
            assert_matches_reference(legs["decode"].output_ids, want, gaps, f"{len(prompt)}-token prompt")
        assert d.call(lambda: d.scheduler.stats.retractions) > 0, "the decode pool was not small enough to retract"
        assert d.snapshot.decode_prefix_hit_tokens >= len(prompts) * 192
        assert_clean(p, d)
    finally:
        for e in (p, d):
            e.shutdown()


def test_decode_leg_with_no_prefill_times_out_and_frees(pd):
    p, d, port = pd
    start = time.monotonic()
    out = run_pair(p, d, port, list(range(100, 180)), legs=("decode",))["decode"]
    assert out.finish_reason == "abort" and "no prefill request arrived" in out.error
    assert time.monotonic() - start < 15
    assert_clean(p, d)


def test_prefill_leg_with_no_decode_times_out_and_frees(pd):
    p, d, port = pd
    before = p.snapshot.bootstrap_failures
    out = run_pair(p, d, port, list(range(100, 180)), legs=("prefill",))["prefill"]
    assert out.finish_reason == "abort" and "no decode server registered" in out.error
    assert p.snapshot.bootstrap_failures == before + 1
    assert_clean(p, d)


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_abort_on_either_leg_ends_both(pd, first):
    """The leg that came first is aborted while it waits for its peer: the peer leg, arriving
    afterwards, is refused at once instead of waiting out its timeout."""
    p, d, port = pd
    b = Bootstrap("127.0.0.1", port, random.randrange(1 << 31))
    prompt = list(range(200, 700))
    engines = {"prefill": p, "decode": d}
    early = engines[first].submit(prompt, GREEDY, bootstrap=b)
    time.sleep(0.3)  # registered (decode) or waiting in the bootstrap queue (prefill)
    early.abort()
    assert early.result().finish_reason == "abort"
    wait_idle(p, d)  # an aborted decode leg tells the prefill side before it frees its pages
    start = time.monotonic()
    late = engines["decode" if first == "prefill" else "prefill"].submit(prompt, GREEDY, bootstrap=b).result()
    assert late.finish_reason == "abort" and "aborted" in late.error
    assert time.monotonic() - start < 2.0  # not the 3 s bootstrap timeout
    assert_clean(p, d)


def test_abort_while_decoding_frees_both_sides(pd):
    p, d, port = pd
    params = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)
    b = Bootstrap("127.0.0.1", port, random.randrange(1 << 31))
    ps, ds = p.submit(list(range(300, 800)), params, bootstrap=b), d.submit(list(range(300, 800)), params, bootstrap=b)
    assert ps.result().finish_reason == "length"  # the prefill leg ends after its forward pass
    first = next(iter(ds))  # the first token arrived with the KV
    assert first.token_ids
    ds.abort()
    rest = ds.result()
    assert rest.finish_reason == "abort" and rest.error_code is None  # a client abort, not a failure
    assert_clean(p, d)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_constrained_requests_through_a_pair(pd, temperature):
    """The prefill samples the first token under the grammar; the decode resumes from it."""
    p, d, port = pd
    cases = [(what, Constraint("json_schema", json.dumps(schema)), schema) for what, schema in SCHEMAS[:6]]
    cases += [(what, Constraint("regex", pattern), pattern) for what, pattern in REGEXES[:4]]
    prompts = [p.tokenizer.encode(chat_prompt(p.tokenizer, what)) for what, _, _ in cases]
    params = [SamplingParams(max_new_tokens=120, temperature=temperature, seed=i, constraint=constraint)
              for i, (_, constraint, _) in enumerate(cases)]
    for (what, constraint, spec), legs in zip(cases, run_pairs(p, d, port, prompts, params)):
        out = legs["decode"]
        assert out.finish_reason == "stop" and legs["prefill"].output_ids == out.output_ids[:1], what
        if constraint.kind == "regex":
            assert_full_match(out.text, spec, what)
        else:
            assert_valid_json(out.text, spec, what)
    assert_clean(p, d)


def test_a_first_token_that_breaks_the_decodes_constraint_fails_the_request(pd):
    """Legs that disagree on the constraint: the decode cannot resume its grammar from the prefill's
    token, so the request fails there, and both sides free what it held."""
    p, d, port = pd
    b = Bootstrap("127.0.0.1", port, random.randrange(1 << 31))
    prompt = list(range(400, 460))
    ps = p.submit(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, constraint=Constraint("regex", "yes")),
                  bootstrap=b)
    ds = d.submit(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, constraint=Constraint("regex", "no")),
                  bootstrap=b)
    first = ps.result().text
    assert first and "yes".startswith(first)
    out = ds.result()
    assert out.finish_reason == "abort" and out.error_code == "internal" and "breaks the request's constraint" in out.error
    assert_clean(p, d)


def test_wrong_room_is_refused_on_both_legs(pd):
    p, d, port = pd
    room = random.randrange(1 << 31)
    b = Bootstrap("127.0.0.1", port, room)
    ps = p.submit(list(range(100, 150)), GREEDY, bootstrap=b)
    ds = d.submit(list(range(300, 350)), GREEDY, bootstrap=b)  # another prompt, same room
    for out in (ps.result(), ds.result()):
        assert out.finish_reason == "abort" and "wrong bootstrap_room" in out.error
    assert_clean(p, d)


def test_requests_without_bootstrap_are_invalid(pd):
    p, d, _ = pd
    for engine in (p, d):
        with pytest.raises(InvalidRequestError, match="disaggregated_params"):
            engine.submit([1, 2, 3], GREEDY)
    assert_clean(p, d)


def test_layout_mismatch_is_refused_at_the_handshake(smollm_fp32):
    from tandem.server.loop.engine import Engine

    port = free_port()
    p = Engine(EngineConfig(max_total_tokens=4096, page_size=32), model=smollm_fp32,
               disagg=DisaggConfig(role="prefill", bootstrap_port=port)).start()
    d = Engine(EngineConfig(max_total_tokens=4096), model=smollm_fp32, disagg=DisaggConfig(role="decode")).start()
    try:
        start = time.monotonic()
        outs = run_pair(p, d, port, list(range(100, 180)))
        assert outs["decode"].error_code == "failed_precondition"
        assert "page_size: 16 on decode, 32 on prefill" in outs["decode"].error
        assert outs["prefill"].finish_reason == "abort"  # told by the decode, not by its own timeout
        assert time.monotonic() - start < 10
        assert_clean(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def _prefill(smollm_fp32, port):
    from tandem.server.loop.engine import Engine

    return Engine(EngineConfig(max_total_tokens=4096), model=smollm_fp32,
                  disagg=DisaggConfig(role="prefill", bootstrap_port=port)).start()


def _decode(smollm_fp32, heartbeat):
    from tandem.server.loop.engine import Engine

    return Engine(EngineConfig(max_total_tokens=4096), model=smollm_fp32,
                  disagg=DisaggConfig(role="decode", peer_heartbeat_interval=heartbeat)).start()


def test_a_quietly_replaced_prefill_is_met_again(smollm_fp32):
    """The prefill behind a bootstrap address is replaced while the decode hears nothing (no
    goodbye, no heartbeat in time): its next registration is refused as unknown, it handshakes
    with the new instance and registers again, and the request succeeds."""
    port = free_port()
    d, p = _decode(smollm_fp32, heartbeat=3600), _prefill(smollm_fp32, port)
    try:
        first = run_pair(p, d, port, list(range(100, 140)))["decode"]
        p.shutdown()  # no drain: nobody is told
        p = _prefill(smollm_fp32, port)
        second = run_pair(p, d, port, list(range(100, 140)))["decode"]
        assert second.finish_reason == "length" and second.output_ids == first.output_ids
        assert (d.snapshot.peer_handshakes, d.snapshot.peer_rehandshakes, d.snapshot.bootstrap_failures) == (2, 1, 0)
        assert_clean(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_heartbeats_mark_a_vanished_prefill_offline(smollm_fp32):
    """An idle decode checks its prefill: two heartbeats unanswered and the peer is offline; the
    next request meets the process that took the address over."""
    port = free_port()
    d, p = _decode(smollm_fp32, heartbeat=0.2), _prefill(smollm_fp32, port)
    try:
        run_pair(p, d, port, list(range(100, 140)))
        p.shutdown()
        deadline = time.monotonic() + 10
        while d.snapshot.peers_offline == 0:
            assert time.monotonic() < deadline, "the decode never noticed its prefill was gone"
            time.sleep(0.05)
        p = _prefill(smollm_fp32, port)
        out = run_pair(p, d, port, list(range(100, 140)))["decode"]
        assert out.finish_reason == "length" and out.error is None
        assert (d.snapshot.peers_offline, d.snapshot.peer_rehandshakes, d.snapshot.bootstrap_failures) == (1, 1, 0)
        assert_clean(p, d)
    finally:
        p.shutdown()
        d.shutdown()
