"""Plain engine statistics: what the metrics layer exports, with no prometheus in sight.

The engine publishes an EngineSnapshot after every step (a frozen object swapped in whole, so
any thread may read the latest one) and reports per-request timings to a StatsObserver.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    # gauges
    running: int = 0  # requests holding a slot (prefilling or decoding)
    waiting: int = 0
    queued_prompt_tokens: int = 0  # prompt tokens of waiting (and partly prefilled) requests still to compute
    kv_pages_total: int = 0
    kv_pages_used: int = 0  # pinned or owned by requests (not free, not evictable cache)
    page_size: int = 1
    # counters (monotonic since start)
    prompt_tokens: int = 0  # prompt tokens of requests admitted for the first time
    generation_tokens: int = 0  # output tokens produced
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    retractions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    forward_steps: int = 0
    # disaggregation (zero on colocated servers)
    bootstrap_queue: int = 0  # prefill: waiting for the decode to register its pages
    inflight_queue: int = 0  # prefill: KV being sent
    prealloc_queue: int = 0  # decode: handshaking and reserving pages
    transfer_queue: int = 0  # decode: waiting for KV
    kv_transfer_bytes: int = 0  # KV bytes sent (prefill) or received (decode)
    kv_transfer_skipped_bytes: int = 0  # decode: prompt KV not sent, its prefix cache held it
    decode_prefix_query_tokens: int = 0  # decode: prompt tokens of arrived requests looked up at reservation
    decode_prefix_hit_tokens: int = 0  # decode: of those, tokens its prefix cache held (not sent)
    kv_transfer_failures: int = 0
    bootstrap_failures: int = 0
    peer_handshakes: int = 0  # decode: handshakes made with prefill processes; prefill: decode peers registered
    peer_rehandshakes: int = 0  # of those, with a new process at an address that had another (a restart)
    peers_offline: int = 0  # decode: prefill peers marked offline (missed heartbeats, unreachable)
    bootstrap_refused: tuple[tuple[str, int], ...] = ()  # prefill: (reason, calls) refused unauthenticated
    # structured output
    grammar_compiles: int = 0  # constraints compiled (cache misses)
    grammar_cache_hits: int = 0  # constraints found compiled already (by their text)
    grammar_compile_seconds: float = 0.0  # time the compiles took
    # KV events (SubscribeKvEvents)
    kv_event_batches: int = 0  # batches published (one per step that changed the prefix cache)
    kv_events: int = 0  # events in them: stored, removed, all-cleared
    kv_event_subscribers: int = 0  # gauge: subscribers now
    kv_event_subscribers_dropped: int = 0  # subscribers dropped for falling behind

    @property
    def token_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def used_tokens(self) -> int:
        return self.kv_pages_used * self.page_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class StatsObserver:
    """Per-request timings, called on the engine thread. The default does nothing."""

    def on_first_token(self, queue_time: float, ttft: float) -> None:
        """queue_time: arrival to first admission; ttft: arrival to first output token (seconds)."""

    def on_tokens(self, inter_token_latency: float, count: int) -> None:
        """`count` tokens arrived `inter_token_latency` seconds after the previous ones."""

    def on_finish(self, e2e_latency: float) -> None:
        """A request ended (any reason), `e2e_latency` seconds after it arrived."""

    def on_kv_transfer(self, seconds: float) -> None:
        """One request's KV moved: prefill, the write; decode, registration to arrival."""


def engine_snapshot(scheduler, memory, outputs, grammars, kv_events, connector: dict) -> EngineSnapshot:
    """An engine's statistics now, from its scheduler, KV memory, output processor, grammar
    compiler's and KV event publisher's stats, and its KV connector's stats (a dict of fields)."""
    return EngineSnapshot(
        running=scheduler.num_running,
        waiting=scheduler.num_waiting,
        queued_prompt_tokens=scheduler.queued_prompt_tokens,
        kv_pages_total=memory.num_pages,
        kv_pages_used=memory.used_pages,
        page_size=memory.page_size,
        prompt_tokens=scheduler.stats.prompt_tokens,
        generation_tokens=outputs.generated,
        prefix_query_tokens=scheduler.stats.prefix_query_tokens,
        prefix_hit_tokens=scheduler.stats.prefix_hit_tokens,
        retractions=scheduler.stats.retractions,
        requests_finished=outputs.finished,
        requests_aborted=outputs.aborted,
        forward_steps=scheduler.stats.forward_steps,
        grammar_compiles=grammars.compiled,
        grammar_cache_hits=grammars.cache_hits,
        grammar_compile_seconds=grammars.seconds,
        kv_event_batches=kv_events.batches,
        kv_events=kv_events.events,
        kv_event_subscribers=kv_events.subscribers,
        kv_event_subscribers_dropped=kv_events.subscribers_dropped,
        **connector,
    )
