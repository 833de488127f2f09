"""What one server reports, and what a pool's servers add up to. Pure: no I/O (the autoscaler
and `tandem bench autoscale` both keep a PoolTracker per pool).

A server's `/metrics` (server/edge/metrics.py) is read into a PodSignals; a pool's load in replica
units comes from its servers' signals and the pool's per-replica targets:

    prefill  (waiting + bootstrap queue) / waitingPerReplica, or with queueSecondsPerReplica:
             queued prompt tokens / (queueSecondsPerReplica x prefill tokens/s of one server);
             at least the busy fraction once a server's capacity is measured:
             prefill tokens/s of the pool / tokens/s of one saturated server
    decode   max(KV usage / kvUsagePerReplica, (waiting + prealloc queue) / waitingPerReplica)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from tandem.operator.decision import Sample

# PodSignals field -> the sample name in the server's exposition (and in Prometheus).
METRICS = {
    "running": "tandem_num_requests_running",
    "waiting": "tandem_num_requests_waiting",
    "queued_prompt_tokens": "tandem_queued_prompt_tokens",
    "bootstrap_queue": "tandem_bootstrap_queue_requests",
    "prealloc_queue": "tandem_prealloc_queue_requests",
    "transfer_queue": "tandem_transfer_queue_requests",
    "inflight_queue": "tandem_inflight_queue_requests",
    "kv_pages_used": "tandem_kv_pages_used",
    "kv_pages_total": "tandem_kv_pages_total",
    "prompt_tokens": "tandem_prompt_tokens_total",
    "prefix_hit_tokens": "tandem_prefix_cache_hit_tokens_total",
}

RATE_SMOOTHING = 0.3  # weight of a new prefill tokens/s measurement


@dataclass(frozen=True)
class PodSignals:
    """One reading of one server."""

    pod: str
    time: float
    running: float = 0
    waiting: float = 0
    queued_prompt_tokens: float = 0
    bootstrap_queue: float = 0
    prealloc_queue: float = 0
    transfer_queue: float = 0
    inflight_queue: float = 0
    kv_pages_used: float = 0
    kv_pages_total: float = 0
    prompt_tokens: float = 0  # counter
    prefix_hit_tokens: float = 0  # counter

    @classmethod
    def from_text(cls, pod: str, time: float, text: str) -> PodSignals:
        """From Prometheus text exposition; ValueError when it is not a tandem server's."""
        by_name: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                by_name[sample.name] = by_name.get(sample.name, 0.0) + sample.value
        missing = [m for m in METRICS.values() if m not in by_name]
        if missing:
            raise ValueError(f"not a tandem server's metrics: {', '.join(missing)} missing")
        return cls(pod, time, **{field: by_name[metric] for field, metric in METRICS.items()})

    @property
    def in_flight(self) -> float:
        """Requests the server still has to finish (0 once it is drained)."""
        return (self.running + self.waiting + self.bootstrap_queue + self.prealloc_queue + self.transfer_queue
                + self.inflight_queue)

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def computed_prompt_tokens(self) -> float:
        """Prompt tokens actually prefilled (the prefix cache's hits excluded), a counter."""
        return self.prompt_tokens - self.prefix_hit_tokens


def prefill_rate(before: PodSignals, after: PodSignals) -> float | None:
    """Prefill tokens/s of one server between two readings, when it was busy the whole time
    (work queued at both): only then is the rate its capacity, not its arrival rate."""
    dt = after.time - before.time
    busy = before.waiting > 0 and after.waiting > 0
    done = after.computed_prompt_tokens - before.computed_prompt_tokens
    return done / dt if busy and dt > 0 and done > 0 else None


@dataclass(frozen=True)
class PoolLoad:
    load: float  # replica units
    detail: str  # the deciding signal, for people
    values: dict[str, float]  # every signal, summed over the servers


def prefill_load(pods: list[PodSignals], scaling, tokens_per_second: float | None,
                 throughput: float | None = None) -> PoolLoad:
    """scaling: the spec's PrefillAutoscaling; tokens_per_second: one busy server's measured
    prefill throughput (None until measured: the request count decides meanwhile); throughput:
    the pool's prefill tokens/s since the last reading.

    A queue only forms once a server is saturated, so the queue alone reads 0 on a pool that is
    90% busy, and would let it shrink below what it needs. Once the capacity is measured, the
    load is at least the busy fraction: throughput / one server's capacity."""
    queued = sum(p.waiting + p.bootstrap_queue for p in pods)
    tokens = sum(p.queued_prompt_tokens for p in pods)
    values = {"waiting": sum(p.waiting for p in pods), "bootstrapQueue": sum(p.bootstrap_queue for p in pods),
              "running": sum(p.running for p in pods), "queuedPromptTokens": tokens}
    busy = PoolLoad(0.0, "", values)
    if tokens_per_second:
        values["prefillTokensPerSecond"] = round(tokens_per_second, 1)
        if throughput is not None:
            values["throughputTokensPerSecond"] = round(throughput, 1)
            busy = PoolLoad(throughput / tokens_per_second, f"prefilling {throughput:.0f} tokens/s, "
                            f"{tokens_per_second:.0f} per busy server", values)
    per = scaling.waiting_per_replica
    if scaling.queue_seconds_per_replica and tokens_per_second:
        capacity = scaling.queue_seconds_per_replica * tokens_per_second
        queue = PoolLoad(tokens / capacity, f"queued prompt tokens {tokens:g} over {capacity * len(pods):.0f} "
                         f"({scaling.queue_seconds_per_replica:g} s at {tokens_per_second:.0f} tokens/s per server)", values)
    else:
        queue = PoolLoad(queued / per, f"waiting {queued:g} over target {per * max(len(pods), 1):g}", values)
    return busy if busy.load > queue.load else queue


def decode_load(pods: list[PodSignals], scaling) -> PoolLoad:
    """scaling: the spec's DecodeAutoscaling."""
    usage = sum(p.kv_usage for p in pods)
    queued = sum(p.waiting + p.prealloc_queue for p in pods)
    values = {"kvUsage": round(usage, 4), "waiting": sum(p.waiting for p in pods),
              "preallocQueue": sum(p.prealloc_queue for p in pods), "running": sum(p.running for p in pods)}
    by_kv, by_queue = usage / scaling.kv_usage_per_replica, queued / scaling.waiting_per_replica
    n = max(len(pods), 1)
    if by_kv >= by_queue:
        return PoolLoad(by_kv, f"KV usage {usage:.2f} over target {scaling.kv_usage_per_replica * n:.2f}", values)
    return PoolLoad(by_queue, f"waiting {queued:g} over target {scaling.waiting_per_replica * n:g}", values)


@dataclass
class PoolTracker:
    """What the autoscaler remembers about one pool between ticks."""

    history: deque[Sample] = field(default_factory=deque)
    last: dict[str, PodSignals] = field(default_factory=dict)  # latest reading per server
    read_at: dict[str, float] = field(default_factory=dict)  # last successful read (or first seen ready)
    tokens_per_second: float | None = None  # one busy prefill server's measured throughput
    throughput: dict[str, float] = field(default_factory=dict)  # prefill tokens/s per server, last interval

    def remember(self, now: float, ready: list[str], reads: dict[str, PodSignals | None]) -> None:
        for pod in ready:
            self.read_at.setdefault(pod, now)
        for pod, signals in reads.items():
            if signals is None:
                continue
            previous = self.last.get(pod)
            if previous and signals.time > previous.time:
                done = signals.computed_prompt_tokens - previous.computed_prompt_tokens
                self.throughput[pod] = max(done, 0.0) / (signals.time - previous.time)
            rate = prefill_rate(previous, signals) if previous else None
            if rate:
                old = self.tokens_per_second
                self.tokens_per_second = rate if old is None else (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * rate
            self.last[pod], self.read_at[pod] = signals, now
        for pod in set(self.read_at) - set(ready) - set(reads):
            for memory in (self.read_at, self.last, self.throughput):
                memory.pop(pod, None)

    def load(self, pool: str, pods: list[PodSignals], scaling) -> PoolLoad:
        """The pool's load from these servers' readings (the ones just remembered)."""
        if pool == "prefill":
            rates = [self.throughput[p.pod] for p in pods if p.pod in self.throughput]
            return prefill_load(pods, scaling, self.tokens_per_second, sum(rates) if rates else None)
        return decode_load(pods, scaling)

    def add(self, sample: Sample, keep: float) -> list[Sample]:
        self.history.append(sample)
        while self.history and self.history[0].time < sample.time - keep:
            self.history.popleft()
        return list(self.history)
