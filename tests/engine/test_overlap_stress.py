"""A seeded, bounded stress test of the overlapped loop: every step is held between its launch and
its result (support/overlap.py's StepGate), and there, at random, a request is aborted, its client
disconnects, a stop string ends it or the scheduler retracts it; the KV pool is small enough that
retraction also happens on its own. After every step: the pages add up (free + cached + owned by
requests == total), every request's counts obey Request's rule, every prefix-cache insert was
whole pages of known tokens. At the end: nothing leaked, and every request nothing ended early
(the retracted ones included) produced HF's greedy tokens."""

from __future__ import annotations

import random
import time

import pytest

from support.checks import assert_engine_clean, assert_matches_reference
from support.overlap import StepGate
from tandem.server.config import EngineConfig
from tandem.server.loop.engine import Engine
from tandem.server.scheduling.request import Finish
from tandem.server.scheduling.sampling_params import SamplingParams

PAGE = 16
NEW_TOKENS = 24
KINDS = ("abort", "disconnect", "stop string", "retract")
DEADLINE = 240  # seconds; a run takes about 10


def workload(rng: random.Random, n: int = 14) -> list[list[int]]:
    """Prompts of 1-60 tokens, most behind one of three shared prefixes (prefix-cache hits)."""
    prefixes = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(17, 40))] for _ in range(3)]
    return [(rng.choice(prefixes + [[]]) + [rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 24))])
            for _ in range(n)]


class Injector:
    """Runs on the engine thread while it is parked mid-step: checks the invariants, then maybe
    injects one event into a random live request."""

    def __init__(self, engine: Engine, streams, rng: random.Random):
        self.engine, self.rng = engine, rng
        self.streams = {s.rid: s for s in streams}
        self.touched: dict[str, str] = {}  # rid -> the kind injected
        self.bad_inserts: list[str] = []
        self.steps = 0
        self.kinds: list[str] = []
        self.edges = 0  # injections into a request on the edge
        cache, insert = engine.memory.cache, engine.memory.cache.insert

        def checked_insert(keys, pages):
            if len(keys) != len(pages) * PAGE:
                self.bad_inserts.append(f"{len(keys)} keys for {len(pages)} pages")
            return insert(keys, pages)

        cache.insert = checked_insert

    def __call__(self) -> bool:
        engine, scheduler = self.engine, self.engine.scheduler
        self.steps += 1
        scheduler.check_integrity()
        if not self.kinds:  # each kind once, in a random order, then again
            self.kinds = self.rng.sample(KINDS, len(KINDS))
        kind = self.kinds[-1]
        live = [r for r in scheduler.requests() if r.rid not in self.touched]
        if kind == "retract":
            live = [r for r in live if r in scheduler.running or r is scheduler.chunked]
        # Half the time, a request on the window's sharpest edge when there is one: a launched
        # step reads the token still being sampled, and that token starts a page.
        edge = [r for r in live if r.num_computed == len(r.token_ids) + 1 and r.num_computed % PAGE == 0]
        if live and self.rng.random() < 0.3:
            req = self.rng.choice(edge if edge and self.rng.random() < 0.5 else live)
            self.edges += req in edge
            self.kinds.pop()
            self.touched[req.rid] = kind
            if kind == "abort":
                engine.abort(req.rid)  # applied right after this call, the step still held
            elif kind == "disconnect":
                self.streams[req.rid].abort()  # what a cancelled gRPC call does
            elif kind == "stop string":
                engine.outputs.finish(req, Finish("stop", matched="injected"))  # the output processor's hook
            else:
                scheduler.retract(req)  # what schedule() does when the pool runs short
            scheduler.check_integrity()
        return True


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_overlapped_loop_under_random_injections(smollm_fp32, hf_reference, seed):
    rng = random.Random(seed)
    prompts = workload(rng)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # A small pool, filled greedily (little output headroom reserved): decodes run it short.
    engine = Engine(EngineConfig(max_total_tokens=12 * PAGE, max_running_requests=8, disable_overlap_schedule=False,
                                 init_new_token_ratio=0.05, min_new_token_ratio=0.05), model=smollm_fp32)
    gate = StepGate(engine)
    try:
        engine.start()
        streams = engine.call(lambda: [engine.submit(p, params) for p in prompts])
        inject = Injector(engine, streams, rng)
        deadline = time.monotonic() + DEADLINE
        while not engine.call(lambda: not engine.scheduler.has_work() and not engine.steps.busy):
            assert time.monotonic() < deadline, f"still running after {DEADLINE}s, {inject.steps} steps"
            if engine.call(lambda: gate.parked() and inject()):
                gate.allow()
            else:
                time.sleep(0.001)  # the engine thread is on its way to the next parked state
        results = {s.rid: s.result() for s in streams}
        assert_engine_clean(engine)
        assert not inject.bad_inserts, inject.bad_inserts
        assert set(inject.touched.values()) == set(KINDS), f"seed {seed} injected only {inject.touched}"
        assert inject.edges > 0, "no injection hit a request on the window's edge"
        assert engine.scheduler.stats.retractions > sum(k == "retract" for k in inject.touched.values()), (
            "the pool never ran short by itself")
        for prompt, stream in zip(prompts, streams):
            result, kind = results[stream.rid], inject.touched.get(stream.rid)
            want, gaps = hf_reference.greedy(prompt, NEW_TOKENS)
            n = len(result.output_ids)
            label = f"seed {seed}, {len(prompt)}-token prompt, {kind or 'untouched'}"
            if kind in (None, "retract"):
                assert result.finish_reason == "length", (label, result)
            else:
                assert result.finish_reason == ("stop" if kind == "stop string" else "abort"), (label, result)
                want, gaps = want[:n], gaps[:n]
            assert_matches_reference(result.output_ids, want, gaps, label)
    finally:
        gate.open()
        engine.shutdown()
