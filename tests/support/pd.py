"""A prefill and a decode engine in one process: both legs of a request, and waiting for both
sides to settle."""

from __future__ import annotations

import random
import threading
import time

from support.checks import assert_engine_clean
from tandem.server.scheduling.request import Bootstrap
from tandem.server.scheduling.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def assert_clean(*engines):
    """Once both sides settle (quarantined pages wait for the prefill's word): nothing held."""
    wait_idle(*engines)
    for engine in engines:
        assert_engine_clean(engine)
        assert engine.call(engine.connector.held) == []
        assert not engine.call(engine.connector.has_work)


def run_pair(p, d, port, prompt, params=GREEDY, room=None, legs=("prefill", "decode")):
    """Submit both legs of one request; returns (prefill result, decode result)."""
    room = random.randrange(1 << 31) if room is None else room
    b = Bootstrap("127.0.0.1", port, room)
    streams = {}
    if "prefill" in legs:
        streams["prefill"] = p.submit(prompt, params, bootstrap=b)
    if "decode" in legs:
        streams["decode"] = d.submit(prompt, params, bootstrap=b)
    return {leg: s.result() for leg, s in streams.items()}


def run_pairs(p, d, port, prompts, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[dict]:
    """`run_pair` for every prompt at once (with its own params, given a list), each from its own
    thread; results in prompt order."""
    results: list = [None] * len(prompts)

    def one(i):
        results[i] = run_pair(p, d, port, prompts[i], params[i] if isinstance(params, list) else params)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def wait_idle(*engines, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not e.call(e.connector.has_work) and not e.call(e.scheduler.has_work) for e in engines):
            return
        time.sleep(0.05)
    raise AssertionError("engines still busy")
