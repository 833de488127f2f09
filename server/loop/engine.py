"""The in-process engine: builds the parts of a server (model, KV pool, scheduler, runner, KV
connector) on its own thread, then runs the step loop there once started.

Threads: callers submit and abort from any thread (intake validates on theirs, then the inbox
carries typed messages to the loop); everything else (scheduler, memory, runner, connector,
output processing) is owned by the engine thread. `call(fn)` runs fn on the engine thread between
scheduler calls, which is how tests and servers inspect engine state safely. What runs on the
engine thread (building the parts, the loop, closing) is `EngineThread` (engine_thread.py), this
class's base; here is the rest: construction, start and shutdown, and the API any thread calls.

With `--tp-size N`, ranks 1..N-1 run in processes of their own (`tandem.server.parallel`): this
engine is rank 0, hands each forward pass to them, and fails (`failed`, every open request ends
with an error) when one of them is lost.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable, Sequence

from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.disagg.layout import KVLayout
from tandem.server.kvcache.kv_events import Subscription
from tandem.server.loop.engine_thread import EngineThread
from tandem.server.loop.failure import Failure
from tandem.server.loop.inbox import Abort, Add, Call, Inbox, Wake
from tandem.server.loop.intake import RequestStream
from tandem.server.loop.kv_pool import kv_bytes_per_token, kv_layout
from tandem.server.loop.outputs import CompletedOutput
from tandem.server.loop.stats import StatsObserver
from tandem.server.loop.steps import OverlappedSteps, Steps, overlap_scheduling
from tandem.server.model.load import LoadedModel, resolve_device
from tandem.server.parallel.workers import RankPool
from tandem.server.scheduling.request import Bootstrap
from tandem.server.scheduling.sampling_params import SamplingParams

log = logging.getLogger("tandem.engine")


class Engine(EngineThread):
    """`disagg` picks the role: colocated (the default) or a prefill or decode server, whose KV
    connector listens on (prefill: bootstrap service) or connects from `host`; `port` is the
    server's gRPC port, which names a decode to its prefill peers. `observer` gets the engine's
    statistics. Nothing runs until `start()` (or `with Engine(...)`)."""

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, observer: StatsObserver | None = None,
                 disagg: DisaggConfig | None = None, host: str = "127.0.0.1", port: int | None = None,
                 on_failure: Callable[[str], None] | None = None):
        config.validate()
        disagg = disagg or DisaggConfig()
        disagg.validate()
        if config.tp_size > 1 and model is not None:
            raise ValueError(f"--tp-size={config.tp_size}: the engine loads every rank's share itself; pass no model")
        self.config = config
        self.observer = observer or StatsObserver()
        self.inbox = Inbox()
        self.failed = Failure(on_failure)  # why the engine failed; `on_failure` is told before any request ends
        self.ranks: RankPool | None = None  # tensor-parallel ranks 1..N-1, with --tp-size > 1
        overlap = overlap_scheduling(config, model.device if model is not None else resolve_device(config.device),
                                     disagg.role)
        log.info("overlap scheduling %s%s", "on" if overlap else "off",
                 " (unset: on CUDA, for a decode, or with --compute-priority idle)" if config.disable_overlap_schedule is None else "")
        self.steps = OverlappedSteps(self) if overlap else Steps(self)
        self._started = False
        self._go = threading.Event()  # set by start() or shutdown(): the built engine thread goes on
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(built, model, disagg, host, port),
                                        name="tandem-engine", daemon=True)
        self._thread.start()
        built.result()  # what building raised, raised here

    def kv_layout(self) -> KVLayout:
        """What a disaggregated peer must share with this engine to exchange KV pages."""
        return kv_layout(self.model, self.kv_cache)

    @property
    def overlap(self) -> bool:
        return isinstance(self.steps, OverlappedSteps)

    @property
    def role(self) -> str:
        return self.connector.role

    @property
    def max_total_tokens(self) -> int:
        return self.memory.total_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """This rank's KV cache per token, every layer (a latent cache: the whole latent)."""
        return kv_bytes_per_token(self.model.module.config, self.model.precision.kv)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Run the loop on the engine thread."""
        if self.inbox.closed or self._go.is_set():
            raise RuntimeError("the engine is shut down" if self.inbox.closed else "the engine is already started")
        self._started = True
        self._go.set()
        return self

    @property
    def alive(self) -> bool:
        return not self.inbox.closed

    def shutdown(self) -> None:
        """Stop the loop: every request still open ends with finish_reason abort (also when the
        engine never started)."""
        if not self._thread.is_alive():
            return
        if self._started:
            self.inbox.stop()
        self._go.set()
        self._thread.join()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- public API (any thread) ------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, rid: str | None = None,
               bootstrap: Bootstrap | None = None) -> RequestStream:
        """Validate and enqueue a request. Raises InvalidRequestError (naming the field) for input
        that can never be served; nothing is allocated for a rejected request. `bootstrap`: where
        a disaggregated request's legs meet (required on prefill and decode servers)."""
        request = self.intake.make_request(prompt, params or SamplingParams(), rid)
        request.bootstrap = bootstrap
        self.connector.check_request(request)
        self.intake.register(request.rid)
        stream = RequestStream(request, self.abort)
        try:
            self.inbox.put(Add(stream))
        except RuntimeError:
            self.intake.release(request.rid)
            raise
        return stream

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None) -> list[CompletedOutput]:
        """Submit all prompts at once (they batch together) and wait for every result, in order."""
        streams = [self.submit(p, params) for p in prompts]
        return [s.result() for s in streams]

    def abort(self, rid: str) -> None:
        """Stop a request and free what it holds. Idempotent; unknown ids are ignored."""
        try:
            self.inbox.put(Abort(rid))
        except RuntimeError:
            pass  # stopped: every request already ended

    def call(self, fn: Callable, timeout: float | None = 60):
        """Run `fn()` on the loop thread between steps and return its result (or raise its error)."""
        future: Future = Future()
        self.inbox.put(Call(fn, future))
        return future.result(timeout)

    def check_integrity(self) -> None:
        self.call(lambda: self.scheduler.check_integrity(self.connector.held()))

    def flush_cache(self) -> bool:
        return self.call(self.memory.flush_cache)

    def subscribe_kv_events(self, start: int) -> Subscription:
        """The prefix cache's events from sequence `start` on (0: a snapshot, then live); raises
        CursorError when `start` cannot be resumed from, SubscriberLimitError when full."""
        return self.call(lambda: self.kv_events.subscribe(start, self.memory.cache.snapshot_events))

    def drain(self) -> None:
        """The server is shutting down: the KV connector takes no new work from its peers."""
        self.call(self.connector.drain)

    def drained(self) -> bool:
        """No request left, and nothing the KV connector must finish or tell its peers first."""
        return self.call(lambda: not self.scheduler.has_work() and not len(self.outputs) and self.connector.drained())

    def fail(self, reason: str) -> None:
        """From any thread: the engine cannot go on (a tensor-parallel rank is gone). The loop
        stops and every open request ends with an error naming `reason`."""
        if self.failed.record(reason):
            log.error("engine failing: %s", reason)
        self.inbox.stop()

    def wake(self) -> None:
        """From any thread: make the loop look at its connector now."""
        try:
            self.inbox.put(Wake())
        except RuntimeError:
            pass
