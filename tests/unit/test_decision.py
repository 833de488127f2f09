"""The autoscaler's decision function and signal arithmetic, without Kubernetes."""

import random

import pytest
from prometheus_client import generate_latest

from tandem.operator.decision import Decision, Policy, Sample, decide
from tandem.operator.signals import PodSignals, PoolTracker, decode_load, prefill_load, prefill_rate
from tandem.operator.spec import DecodeAutoscaling, PrefillAutoscaling
from tandem.server.edge.metrics import Metrics
from tandem.server.loop.stats import EngineSnapshot

INTERVAL = 15.0
PREFILL = Policy(min_replicas=1, max_replicas=8, scale_down_window=300)
DECODE = Policy(min_replicas=1, max_replicas=8, scale_down_window=600)


class Pool:
    """A pool driven through `decide` every interval, pods taking `startup` seconds to be ready."""

    def __init__(self, policy: Policy, replicas: int, startup: float = 0.0):
        self.policy, self.replicas, self.startup = policy, replicas, startup
        self.history: list[Sample] = []
        self.ready_at: list[float] = [0.0] * replicas
        self.changes: list[tuple[float, int, int, str]] = []

    def step(self, now: float, load: float, stale: str | None = None) -> Decision:
        self.history.append(Sample(now, load, self.replicas))
        starting = sum(1 for t in self.ready_at[: self.replicas] if t > now)
        decision = decide(self.history, now, self.replicas, starting, self.policy, stale)
        if decision.replicas != self.replicas:
            self.changes.append((now, self.replicas, decision.replicas, decision.reason))
            if decision.replicas > self.replicas:
                self.ready_at += [now + self.startup] * (decision.replicas - self.replicas)
            self.ready_at = self.ready_at[: decision.replicas]
            self.replicas = decision.replicas
        return decision

    def run(self, start: float, seconds: float, load, stale=None) -> float:
        now = start
        while now < start + seconds:
            now += INTERVAL
            self.step(now, load(now) if callable(load) else load, stale)
        return now


def test_queue_burst_scales_up_within_one_interval():
    pool = Pool(PREFILL, replicas=2)
    now = pool.run(0, 600, 1.8)  # steady: 2 servers at 90% of target
    assert pool.changes == []
    decision = pool.step(now + INTERVAL, 19 / 4)  # 19 waiting requests, 4 per server
    assert decision.replicas == 4 and decision.panicking  # at most doubling in one step
    assert decision.reason.startswith("scale up 2→4: panic")
    decision = pool.step(now + 2 * INTERVAL, 19 / 4)
    assert decision.replicas == 5  # still panicking: the rest of the way, pods starting or not


def test_noisy_steady_load_does_not_flap():
    """30 minutes of samples scattered ±25% around 2.5 servers' worth of load: at most one change."""
    rng = random.Random(7)
    for policy in (PREFILL, DECODE):
        pool = Pool(policy, replicas=2, startup=60)
        pool.run(0, 1800, lambda t: 2.5 * rng.uniform(0.75, 1.25))
        assert len(pool.changes) <= 1, pool.changes
        assert pool.replicas == 3


def test_two_to_one_only_when_one_server_takes_the_load():
    heavy = Pool(PREFILL, replicas=2)
    heavy.run(0, 1200, 0.9)  # one server would run at 90% of its target
    assert heavy.replicas == 2 and heavy.changes == []
    assert "above 80% of their target" in decide(heavy.history, 1200, 2, 0, PREFILL).reason

    light = Pool(PREFILL, replicas=2)
    light.run(0, 1200, 0.7)
    assert light.replicas == 1
    (when, before, after, reason), = light.changes
    assert (before, after) == (2, 1) and when >= PREFILL.scale_down_window
    assert reason.startswith("scale down 2→1")


def test_scale_down_waits_for_the_whole_window_and_goes_one_at_a_time():
    pool = Pool(DECODE, replicas=6)
    pool.run(0, 3000, 0.5)
    downs = [when for when, before, after, _ in pool.changes]
    assert [(b, a) for _, b, a, _ in pool.changes] == [(6, 5), (5, 4), (4, 3), (3, 2), (2, 1)]
    assert downs[0] >= DECODE.scale_down_window
    # A busy minute inside the window blocks the next step down until it has left the window.
    pool = Pool(DECODE, replicas=3)
    now = pool.run(0, 540, 1.2)  # the history does not cover the 600 s window yet
    now = pool.run(now, 60, 2.9)
    now = pool.run(now, 540, 1.2)
    assert pool.replicas == 3 and pool.changes == []
    pool.run(now, 240, 1.2)  # until the busy minute (540-600 s) has left the window
    assert [(b, a) for _, b, a, _ in pool.changes] == [(3, 2)] and pool.changes[0][0] > 600 + 600


def test_pending_guard_holds_scale_up_until_new_pods_are_ready_unless_panicking():
    history = [Sample(t, 3.0, 2) for t in range(15, 136, 15)]
    held = decide(history, 135, current=2, starting=1, policy=PREFILL)
    assert held.replicas == 2 and "waiting for 1 starting server" in held.reason
    assert decide(history, 135, current=2, starting=0, policy=PREFILL).replicas == 3
    burst = history + [Sample(150, 6.0, 2)]
    assert decide(burst, 150, current=2, starting=1, policy=PREFILL).replicas == 4  # panic ignores it


def test_panic_blocks_scale_down_for_a_stable_window():
    pool = Pool(PREFILL, replicas=2)
    now = pool.run(0, 600, 0.5)
    assert pool.replicas == 1
    now = pool.run(now, 15, 4.0)  # spike: panic, 1→2
    assert pool.replicas == 2
    decision = pool.step(now + INTERVAL, 0.1)  # the spike ends at once
    assert decision.panicking and decision.replicas == 2


def test_stale_metrics_freeze_scale_down_but_not_scale_up():
    pool = Pool(PREFILL, replicas=3)
    pool.run(0, 1200, 0.5, stale="pod p-2 not scraped for 45 s")
    assert pool.replicas == 3
    assert "scale-down frozen, pod p-2 not scraped" in decide(pool.history, 1200, 3, 0, PREFILL, "pod p-2 not scraped for 45 s").reason
    pool.run(1200, 150, 5.0, stale="pod p-2 not scraped for 45 s")
    assert pool.replicas == 5


def test_bounds():
    bounded = Policy(min_replicas=2, max_replicas=3)
    pool = Pool(bounded, replicas=2)
    pool.run(0, 300, 40.0)
    assert pool.replicas == 3
    pool.run(300, 2000, 0.0)
    assert pool.replicas == 2
    assert decide([], 0, current=1, starting=0, policy=bounded).replicas == 2  # raised minReplicas
    assert decide([], 0, current=5, starting=0, policy=bounded).replicas == 4  # lowered maxReplicas: one at a time
    assert decide([], 0, current=2, starting=0, policy=bounded).reason == "holding 2: no metrics yet"


def server(pod: str, t: float, **snapshot) -> PodSignals:
    """A real server registry's /metrics text, read back."""
    metrics = Metrics("prefill", "smollm2")
    metrics.bind(lambda: EngineSnapshot(kv_pages_total=100, **snapshot))
    return PodSignals.from_text(pod, t, generate_latest(metrics.registry).decode())


def test_signals_parse_a_real_server_exposition():
    s = server("p-0", 1.0, running=3, waiting=5, queued_prompt_tokens=900, bootstrap_queue=2, kv_pages_used=40,
               prompt_tokens=1000, prefix_hit_tokens=200)
    assert (s.running, s.waiting, s.bootstrap_queue, s.queued_prompt_tokens) == (3, 5, 2, 900)
    assert s.kv_usage == 0.4 and s.computed_prompt_tokens == 800 and s.in_flight == 10
    with pytest.raises(ValueError, match="tandem_num_requests_waiting"):
        PodSignals.from_text("x", 0, "# TYPE other gauge\nother 1\n")


def test_prefill_load_by_requests_or_by_queued_tokens():
    pods = [server("p-0", 10, waiting=12, bootstrap_queue=3, queued_prompt_tokens=6000),
            server("p-1", 10, waiting=4, queued_prompt_tokens=2000)]
    by_requests = prefill_load(pods, PrefillAutoscaling(), tokens_per_second=None)
    assert by_requests.load == pytest.approx(19 / 4)
    assert by_requests.detail == "waiting 19 over target 8"
    by_tokens = prefill_load(pods, PrefillAutoscaling(queue_seconds_per_replica=2.0), tokens_per_second=1000)
    assert by_tokens.load == pytest.approx(8000 / 2000)
    # Not measured yet: the request count decides.
    assert prefill_load(pods, PrefillAutoscaling(queue_seconds_per_replica=2.0), None).load == by_requests.load


def test_prefill_rate_is_measured_only_while_busy():
    before = server("p-0", 10, waiting=3, prompt_tokens=1000, prefix_hit_tokens=100)
    after = server("p-0", 20, waiting=1, prompt_tokens=6000, prefix_hit_tokens=100)
    assert prefill_rate(before, after) == 500
    idle = server("p-0", 20, waiting=0, prompt_tokens=6000)
    assert prefill_rate(before, idle) is None


def test_decode_load_is_the_larger_of_kv_usage_and_queue():
    kv_bound = decode_load([server("d-0", 1, kv_pages_used=90), server("d-1", 1, kv_pages_used=70)], DecodeAutoscaling())
    assert kv_bound.load == pytest.approx(1.6 / 0.8) and kv_bound.detail.startswith("KV usage 1.60")
    queue_bound = decode_load([server("d-0", 1, kv_pages_used=10, waiting=5, prealloc_queue=3)], DecodeAutoscaling())
    assert queue_bound.load == pytest.approx(8 / 2) and queue_bound.detail.startswith("waiting 8")


def test_pools_move_independently():
    """A prefill-heavy burst (long prompts queue on prefill; decode KV stays low) grows prefill only."""
    prefill, decode = Pool(PREFILL, replicas=2), Pool(DECODE, replicas=2)
    now = 0.0
    for step in range(40):
        now += INTERVAL
        burst = 10 <= step < 20
        p_pods = [server(f"p-{i}", now, waiting=15 if burst else 1) for i in range(prefill.replicas)]
        d_pods = [server(f"d-{i}", now, kv_pages_used=60) for i in range(decode.replicas)]
        prefill.step(now, prefill_load(p_pods, PrefillAutoscaling(), None).load)
        decode.step(now, decode_load(d_pods, DecodeAutoscaling()).load)
    assert prefill.replicas > 2 and prefill.changes
    assert decode.changes == [] and decode.replicas == 2


def test_a_busy_prefill_pool_without_a_queue_still_reads_as_loaded():
    """Once a saturated server's throughput is known, the pool's prefill rate counts as load:
    two servers prefilling 1.5 servers' worth with no queue may not shrink to one."""
    tracker = PoolTracker()
    tracker.remember(0, ["p-0"], {"p-0": server("p-0", 0, waiting=4, prompt_tokens=0)})
    tracker.remember(10, ["p-0"], {"p-0": server("p-0", 10, waiting=4, prompt_tokens=100_000)})  # saturated
    assert tracker.tokens_per_second == 10_000
    pods = ["p-0", "p-1"]
    tracker.remember(20, pods, {"p-0": server("p-0", 20, prompt_tokens=175_000), "p-1": server("p-1", 20)})
    tracker.remember(30, pods, {"p-0": server("p-0", 30, prompt_tokens=250_000),
                                "p-1": server("p-1", 30, prompt_tokens=75_000)})
    load = tracker.load("prefill", list(tracker.last.values()), PrefillAutoscaling())
    assert load.load == pytest.approx(1.5) and load.values["waiting"] == 0
    assert load.detail == "prefilling 15000 tokens/s, 10000 per busy server"
