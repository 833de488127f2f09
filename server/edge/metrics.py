"""Prometheus metrics. This module owns every prometheus_client object of the server.

Names: `tandem_` prefix, unit suffix, `_total` on counters; labels `role` and `model`, and on a
counter by kind (`LABELLED_COUNTERS`) one label more, every known value exported from the start.
Gauges and counters are read from the engine's latest EngineSnapshot at scrape time; histograms
are fed by the engine's StatsObserver callbacks.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.server.disagg.bootstrap import REFUSALS
from tandem.server.loop.stats import EngineSnapshot, StatsObserver

# From 1 ms (a GPU decode step) to two minutes (a long CPU request under load).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
)

LABELS = ("role", "model")

# name -> (help, snapshot field). The disaggregation queues and transfer counters read 0 on a
# colocated server; bootstrap and inflight are prefill queues, prealloc and transfer decode ones.
GAUGES = {
    "tandem_num_requests_running": ("Requests holding a slot (prefilling or decoding)", "running"),
    "tandem_num_requests_waiting": ("Requests in the waiting queue", "waiting"),
    "tandem_queued_prompt_tokens": ("Prompt tokens of waiting requests not yet prefilled", "queued_prompt_tokens"),
    "tandem_kv_pages_total": ("Pages in the KV pool", "kv_pages_total"),
    "tandem_kv_pages_used": ("KV pages used by requests (not free, not evictable cache)", "kv_pages_used"),
    "tandem_kv_page_size_tokens": ("Tokens per KV page", "page_size"),
    "tandem_bootstrap_queue_requests": ("Prefill requests waiting for their decode peer", "bootstrap_queue"),
    "tandem_prealloc_queue_requests": ("Decode requests handshaking and reserving KV pages", "prealloc_queue"),
    "tandem_transfer_queue_requests": ("Decode requests waiting for their KV to arrive", "transfer_queue"),
    "tandem_inflight_queue_requests": ("Prefill requests whose KV is being sent", "inflight_queue"),
    "tandem_kv_event_subscribers": ("Subscribers to the prefix cache's KV events (routers)", "kv_event_subscribers"),
}
COUNTERS = {
    "tandem_kv_event_batches": ("KV event batches published (one per step that changed the prefix cache)", "kv_event_batches"),
    "tandem_kv_events": ("KV events published: pages stored, pages removed, cache cleared", "kv_events"),
    "tandem_kv_event_subscribers_dropped": ("KV event subscribers dropped for falling behind", "kv_event_subscribers_dropped"),
    "tandem_prompt_tokens": ("Prompt tokens of admitted requests", "prompt_tokens"),
    "tandem_generation_tokens": ("Output tokens generated", "generation_tokens"),
    "tandem_prefix_cache_query_tokens": ("Prompt tokens looked up in the prefix cache", "prefix_query_tokens"),
    "tandem_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache", "prefix_hit_tokens"),
    "tandem_retractions": ("Running requests sent back to the waiting queue for lack of KV pages", "retractions"),
    "tandem_requests_finished": ("Requests that ended, for any reason", "requests_finished"),
    "tandem_requests_aborted": ("Requests that ended aborted", "requests_aborted"),
    "tandem_kv_transfer_bytes": ("KV cache bytes sent (prefill) or received (decode) through Mooncake", "kv_transfer_bytes"),
    "tandem_kv_transfer_skipped_bytes": ("KV cache bytes a decode did not need sent: its prefix cache held them",
                                         "kv_transfer_skipped_bytes"),
    "tandem_decode_prefix_query_tokens": ("Prompt tokens a decode looked up in its prefix cache before its KV arrived",
                                          "decode_prefix_query_tokens"),
    "tandem_decode_prefix_hit_tokens": ("Prompt tokens a decode found in its prefix cache (their KV was not sent)",
                                        "decode_prefix_hit_tokens"),
    "tandem_grammar_compiles": ("Constraints (JSON schemas, regexes, grammars) compiled: cache misses", "grammar_compiles"),
    "tandem_grammar_cache_hits": ("Constraints found compiled already (cached by their text)", "grammar_cache_hits"),
    "tandem_grammar_compile_seconds": ("Seconds spent compiling constraints", "grammar_compile_seconds"),
    "tandem_kv_transfer_failures": ("Requests whose KV transfer failed (peer died, timed out, wrong room)", "kv_transfer_failures"),
    "tandem_bootstrap_failures": ("Requests whose two legs never paired (no peer in time, handshake refused)", "bootstrap_failures"),
    "tandem_peer_handshakes": ("Bootstrap handshakes: made with prefill processes (decode), decode peers registered (prefill)",
                               "peer_handshakes"),
    "tandem_peer_rehandshakes": ("Handshakes with a new process at an address that had another (the peer restarted)",
                                 "peer_rehandshakes"),
    "tandem_peers_offline": ("Prefill peers marked offline: missed heartbeats, or unreachable while requests waited (decode)",
                             "peers_offline"),
}


# name -> (help, snapshot field: (value, count) pairs, the extra label, its known values)
LABELLED_COUNTERS = {
    "tandem_bootstrap_refused": ("Bootstrap calls a prefill refused unauthenticated (no bootstrap token, a wrong one)",
                                 "bootstrap_refused", "reason", REFUSALS),
}


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot], labels: list[str]):
        self.snapshot, self.labels = snapshot, labels

    def collect(self):
        snap = self.snapshot()
        for name, (text, field) in GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=LABELS)
            family.add_metric(self.labels, getattr(snap, field))
            yield family
        for name, (text, field) in COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=LABELS)
            family.add_metric(self.labels, getattr(snap, field))
            yield family
        for name, (text, field, label, known) in LABELLED_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=(*LABELS, label))
            counts = {value: 0 for value in known} | dict(getattr(snap, field))
            for value, count in counts.items():
                family.add_metric([*self.labels, value], count)
            yield family


class Metrics(StatsObserver):
    """The server's registry. Pass it to the Engine as its observer, then `bind(engine)`."""

    def __init__(self, role: str, model: str):
        self.registry = CollectorRegistry()
        self.labels = [role, model]
        self._snapshot: Callable[[], EngineSnapshot] = EngineSnapshot

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, LABELS, buckets=LATENCY_BUCKETS, registry=self.registry).labels(*self.labels)

        self.ttft = histogram("tandem_time_to_first_token_seconds", "Arrival to first output token")
        self.itl = histogram("tandem_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = histogram("tandem_e2e_request_latency_seconds", "Arrival to the end of the request")
        self.queue = histogram("tandem_queue_time_seconds", "Arrival to first admission into a forward pass")
        self.kv_transfer = histogram(
            "tandem_kv_transfer_latency_seconds", "One request's KV transfer: the write (prefill), registration to arrival (decode)"
        )
        self.crashes = Counter(
            "tandem_engine_crashes", "Times the engine stopped on a failure (a crashed loop, a failed overlapped "
            "pass, a lost tensor-parallel rank), earlier containers of the pod included where TANDEM_CRASH_LOG is set",
            LABELS, registry=self.registry).labels(*self.labels)
        self.registry.register(_SnapshotCollector(lambda: self._snapshot(), self.labels))

    def bind(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    # StatsObserver
    def on_first_token(self, queue_time: float, ttft: float) -> None:
        self.queue.observe(queue_time)
        self.ttft.observe(ttft)

    def on_tokens(self, inter_token_latency: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(inter_token_latency / count)

    def on_finish(self, e2e_latency: float) -> None:
        self.e2e.observe(e2e_latency)

    def on_kv_transfer(self, seconds: float) -> None:
        self.kv_transfer.observe(seconds)

    def serve(self, host: str, port: int):
        """Start `/metrics` on its own port (a daemon thread); returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)


def exported_metric_names() -> set[str]:
    """Every metric family name this module exports (dashboards and tests check against it)."""
    names = set(GAUGES) | {f"{n}_total" for n in (*COUNTERS, *LABELLED_COUNTERS, "tandem_engine_crashes")}
    for h in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "queue_time", "kv_transfer_latency"):
        names |= {f"tandem_{h}_seconds_{s}" for s in ("bucket", "sum", "count")}
    return names
