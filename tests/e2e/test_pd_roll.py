"""Rolling restarts of a PD stack, as a StatefulSet rollout does them: a server is stopped
(SIGTERM, or SIGKILL) and a new process starts at the same gRPC, metrics and bootstrap ports,
with the `smg` router left as it is. Real processes, Mooncake over TCP, the real router.

The scenarios run in order on one stack (two prefill and two decode servers): the first three
through a router over the first prefill and the first decode, the last through a router over
all four. Each ends with every server holding no request, queue entry or KV page."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import signal
import socket
import threading
import time

import pytest

from support.serving import PDStack, Router, Server, assert_all_freed, metric_value, wait_for

# Heartbeats every second (the default is 5 s) keep the scenarios short; the rules are the same.
ENGINE = ("--max-total-tokens", "16384", "--bootstrap-timeout", "20", "--peer-timeout", "2", "--peer-heartbeat-interval", "1",
          "--drain-grace-seconds", "30")
ROUTER_ARGS = ("--prefill-policy", "round_robin", "--decode-policy", "round_robin")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = PDStack(tmp_path_factory.mktemp("pd-roll"), ENGINE, ROUTER_ARGS)
    yield stack
    stack.close()


def generate(router: Router, prompt: list[int], max_new_tokens: int = 8, timeout: float = 120) -> tuple[int, str]:
    body = {"model": "smollm2", "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    return router.post("/generate", body, timeout=timeout)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def first_success_after(router: Router, rng: random.Random, timeout: float = 10) -> float:
    """Seconds until a request through `router` succeeds; then five more in a row must succeed."""
    start = time.monotonic()
    while True:
        status, body = generate(router, prompt(rng, 24))
        if status == 200:
            break
        assert time.monotonic() - start < timeout, f"no request succeeded within {timeout}s; last: {status} {body[:300]}"
        time.sleep(0.2)
    waited = time.monotonic() - start
    for _ in range(5):
        status, body = generate(router, prompt(rng, 24))
        assert status == 200, body
    return waited


def in_flight(router: Router, prompts: list[list[int]], max_new_tokens: int) -> tuple[threading.Thread, list]:
    """Send every prompt at once from background threads; (joiner thread, [(status, body)])."""
    results: list = []

    def one(p):
        results.append(generate(router, p, max_new_tokens))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    joiner = threading.Thread(target=lambda: [t.join() for t in threads])
    joiner.start()
    return joiner, results


def counter(server: Server, name: str) -> float:
    return metric_value(server.metrics_text(), name)


def test_prefill_sigterm_roll_while_idle(stack):
    """Roll the prefill at a quiet moment: the decode hears it leave, re-handshakes with its
    successor, and the next request succeeds."""
    rng = random.Random(1)
    prefill, decode = stack.prefills[0], stack.decodes[0]
    assert generate(stack.one_by_one, prompt(rng, 24))[0] == 200  # the decode holds a registration
    old = stack.bootstrap(prefill, "/v1/layout")["instance"]
    rehandshakes = counter(decode, "tandem_peer_rehandshakes_total")
    assert prefill.restart(signal.SIGTERM) == 0
    new = stack.bootstrap(prefill, "/v1/layout")["instance"]
    assert new != old
    waited = first_success_after(stack.one_by_one, rng, timeout=5)
    assert counter(decode, "tandem_peer_rehandshakes_total") == rehandshakes + 1
    log = decode.log_path.read_text()
    assert f"prefill 127.0.0.1:{prefill.bootstrap_port} (instance {old}) is leaving" in log
    assert f"re-handshake with prefill 127.0.0.1:{prefill.bootstrap_port} (instance {new}): it replaced instance {old}" in log
    assert counter(decode, "tandem_bootstrap_failures_total") == 0, f"a request failed ({waited:.1f}s to the first success)"
    assert_all_freed([prefill, decode])


def test_prefill_sigkill_with_requests_in_flight(stack):
    """Kill the prefill while it computes: its requests fail (no hang), the decode frees their
    pages once the successor's new instance proves the old process gone, later requests succeed."""
    rng = random.Random(2)
    prefill, decode = stack.prefills[0], stack.decodes[0]
    start = time.monotonic()
    joiner, results = in_flight(stack.one_by_one, [prompt(rng, 900 + 40 * i) for i in range(6)], max_new_tokens=16)
    wait_for(lambda: counter(prefill, "tandem_num_requests_running") + counter(prefill, "tandem_num_requests_waiting") > 0,
             "the prefill getting work")
    prefill.restart(signal.SIGKILL, wait=False)
    joiner.join(90)
    assert not joiner.is_alive(), "a client hung"
    assert len(results) == 6 and any(status != 200 for status, _ in results), results
    assert all(status in (200, 500, 502, 503, 504) for status, _ in results), results  # answered, not hung
    prefill.wait_healthy()
    first_success_after(stack.one_by_one, rng)
    assert_all_freed([prefill, decode])
    assert time.monotonic() - start < 120


def test_decode_sigkill_with_requests_in_flight(stack):
    """Kill the decode while it generates, start its successor at the same address: service
    resumes, and the prefill holds nothing of the old decode (its registration was replaced)."""
    rng = random.Random(3)
    prefill, decode = stack.prefills[0], stack.decodes[0]
    name = f"127.0.0.1:{decode.port}"
    old = [p["instance"] for p in stack.bootstrap(prefill, "/v1/peers")["peers"] if p["decode"] == name]
    assert len(old) == 1
    replaced = counter(prefill, "tandem_peer_rehandshakes_total")
    joiner, results = in_flight(stack.one_by_one, [prompt(rng, 40 + i) for i in range(4)], max_new_tokens=400)
    wait_for(lambda: counter(decode, "tandem_num_requests_running") > 0, "the decode generating")
    decode.restart(signal.SIGKILL)
    joiner.join(90)
    assert not joiner.is_alive(), "a client hung"
    assert any(status != 200 for status, _ in results), results
    first_success_after(stack.one_by_one, rng)
    now = [p["instance"] for p in stack.bootstrap(prefill, "/v1/peers")["peers"] if p["decode"] == name]
    assert len(now) == 1 and now != old
    assert counter(prefill, "tandem_peer_rehandshakes_total") == replaced + 1
    assert f"decode peer {name} (instance {now[0]}) replaces instance {old[0]}" in prefill.log_path.read_text()
    assert_all_freed([prefill, decode])


class Load:
    """Requests through `router` from `concurrency` threads until stopped: short prompts, a few
    tokens each, every outcome kept."""

    def __init__(self, router: Router, concurrency: int, seed: int):
        self.router, self.rng = router, random.Random(seed)
        self.outcomes: list[tuple[float, int, str]] = []  # (time, status, body)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]

    def _run(self):
        while not self._stop.is_set():
            status, body = generate(self.router, prompt(self.rng, self.rng.randrange(16, 200)), max_new_tokens=8, timeout=60)
            self.outcomes.append((time.monotonic(), status, body))

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        assert not any(t.is_alive() for t in self._threads), "a client hung"

    @property
    def failures(self) -> list[tuple[float, int, str]]:
        return [o for o in self.outcomes if o[1] != 200]


def test_rolling_restart_of_both_pools_under_load(stack, capsys):
    """A server of each pool in turn (a prefill, then a decode) gets SIGTERM and a successor once the
    one before is serving, as in a StatefulSet's rolling update, while four clients keep sending
    through the router over both pools: the other server of the pool carries the load meanwhile.
    (One server per pool: rolling the second of each goes through the same transitions again, and
    each restart under this load takes a minute of the suite on two cores.)"""
    load = Load(stack.two_by_two, concurrency=4, seed=4).start()
    try:
        wait_for(lambda: sum(o[1] == 200 for o in load.outcomes) >= 8, "the load getting going")
        start, t0 = len(load.outcomes), time.monotonic()
        windows = []  # (server, seconds from t0 when its restart began, when its successor was serving)
        for name, server in (("prefill1", stack.prefills[1]), ("decode1", stack.decodes[1])):
            began = time.monotonic() - t0
            assert server.restart(signal.SIGTERM) == 0
            windows.append((name, round(began, 1), round(time.monotonic() - t0, 1)))
        wait_for(lambda: len(load.outcomes) >= start + 60, "60 requests over the roll", timeout=120)
    finally:
        load.stop()
    during = load.outcomes[start:]
    with capsys.disabled():
        print(f"\nrolling restart of a prefill and a decode of 2 + 2 under load: {len(during)} requests, "
              f"{sum(o[1] != 200 for o in during)} failed; restarts (began, serving): {windows}")
    failures = load.failures
    assert not failures, (f"{len(failures)} failed, from {failures[0][0] - t0:.1f}s to {failures[-1][0] - t0:.1f}s; "
                          f"restarts (began, serving): {windows}; first: {failures[0][1]} {failures[0][2][:300]}")
    assert_all_freed(stack.servers)


def chat(router: Router, question: str, cancel_after: float | None) -> str:
    """One streamed chat completion through `router`: "ok" when it streamed to [DONE] with no error,
    "cancelled" when this client hung up after `cancel_after` seconds (closing its socket, as a
    browser tab does), else what went wrong."""
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "stream": True,
            "max_tokens": 48, "temperature": 0}
    timer = None
    if cancel_after is not None:
        timer = threading.Timer(cancel_after, lambda: conn.sock and conn.sock.shutdown(socket.SHUT_RDWR))
        timer.start()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return "cancelled" if cancel_after is not None else f"{type(e).__name__}: {e}"
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()
    if response.status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text:
        return "ok"
    if cancel_after is not None and response.status == 200:
        return "cancelled"  # hung up mid-stream: what was read ends short
    return f"HTTP {response.status}: {text[:300]}"


def test_client_cancels_after_a_prefill_restart(stack, capsys):
    """Issue 65's run: the prefill SIGKILLed and restarted at its address, then 120 streamed chat
    requests at concurrency 12, every third cancelled by its client 0.5-2 s after it started.
    Every request nobody cancelled succeeds, neither server's engine fails, and both hold nothing
    after."""
    rng = random.Random(65)
    prefill, decode = stack.prefills[0], stack.decodes[0]
    prefill.restart(signal.SIGKILL)
    first_success_after(stack.one_by_one, rng)
    topics = ["KV caches", "the sea", "prime numbers", "bread", "Kubernetes", "owls", "rain", "chess"]
    plans = [(f"Tell me about {rng.choice(topics)} in {rng.randrange(2, 9)} sentences.",
              rng.uniform(0.5, 2.0) if i % 3 == 0 else None) for i in range(120)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(lambda plan: chat(stack.one_by_one, *plan), plans, timeout=600))
    kept = [o for o, (_, cancel) in zip(outcomes, plans) if cancel is None]
    with capsys.disabled():
        print(f"\n120 chats after a prefill SIGKILL, every third cancelled: {kept.count('ok')}/{len(kept)} kept ones "
              f"succeeded, {outcomes.count('cancelled')} cancelled")
    assert kept.count("ok") == len(kept) == 80, [o for o in kept if o != "ok"][:3]
    for server in (prefill, decode):
        assert server.proc.poll() is None, f"{server.role} exited"
        assert counter(server, "tandem_engine_crashes_total") == 0
        assert "engine loop crashed" not in server.log_path.read_text()
    assert_all_freed([prefill, decode])
