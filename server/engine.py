"""The in-process engine: validates requests, runs the step loop on its own thread, streams
outputs back.

Threads: callers submit and abort from any thread through the inbox; everything else (scheduler,
memory, runner, detokenizers) is owned by the loop thread. `call(fn)` runs fn on the loop thread
between two steps, which is how tests and servers inspect engine state safely.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import random
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.disagg.connector import KVConnector
from tandem.server.disagg.layout import KVLayout
from tandem.server.memory import KVMemory
from tandem.server.model import LoadedModel, load_model
from tandem.server.outputs import CompletedOutput, StreamOutput
from tandem.server.request import Bootstrap, Finish, Request
from tandem.server.runner import ModelRunner
from tandem.server.sampling_params import CapacityError, InvalidRequestError, SamplingParams
from tandem.server.scheduler import Scheduler, SchedulerConfig
from tandem.server.stats import EngineSnapshot, StatsObserver
from tandem.server.stop_strings import StopStringMatcher
from tandem.server.tokenizer import IncrementalDetokenizer

log = logging.getLogger("tandem.engine")

_DONE = object()  # end-of-stream marker in a RequestStream's queue


class RequestStream:
    """A submitted request, seen from the caller: iterate for its StreamOutputs."""

    def __init__(self, engine: "Engine", request: Request):
        self.engine = engine
        self.request = request
        self.rid = request.rid
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def __iter__(self) -> Iterator[StreamOutput]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            yield item

    def abort(self) -> None:
        self.engine.abort(self.rid)

    def result(self) -> CompletedOutput:
        """Wait for the end; the whole output."""
        ids, text, lps, tops, last = [], [], [], [], None
        for out in self:
            ids += out.token_ids
            text.append(out.text)
            lps += out.logprobs
            tops += out.top_logprobs
            last = out
        first = self.request.first_token_time  # stamped by the scheduler when the token was made
        return CompletedOutput(
            rid=self.rid,
            prompt_tokens=last.prompt_tokens,
            output_ids=ids,
            text="".join(text),
            finish_reason=last.finish_reason,
            matched_stop=last.matched_stop,
            error=last.error,
            error_code=last.error_code,
            cached_tokens=last.cached_tokens,
            logprobs=lps,
            top_logprobs=tops,
            time_to_first_token=None if first is None else first - self.request.arrival_time,
            latency=time.monotonic() - self.request.arrival_time,
        )


@dataclass
class _Live:
    """Loop-thread bookkeeping for one request being streamed."""

    stream: RequestStream
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    released: int = 0  # characters of detok.text already sent
    sent_tokens: int = 0  # output tokens already sent
    last_token_time: float = 0.0


class Engine:
    """`disagg` picks the role: colocated (the default) or a prefill or decode server, whose KV
    connector listens on (prefill: bootstrap service) or connects from `host`. `port`: the
    server's own gRPC port, which with the advertised host names a decode to its prefill peers
    (a successor at the same address replaces its predecessor there)."""

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, observer: StatsObserver | None = None,
                 disagg: DisaggConfig | None = None, host: str = "127.0.0.1", port: int | None = None):
        config.validate()
        disagg = disagg or DisaggConfig()
        disagg.validate()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = model or load_model(config.model, config.dtype, config.device)
        mc = self.model.config
        self.tokenizer = self.model.tokenizer
        self.context_length = config.context_length or mc.max_position_embeddings
        self.eos_token_ids = self.model.eos_token_ids
        num_pages = self._num_kv_pages()
        self.kv_cache = PagedKVCache(
            mc.num_layers, num_pages, config.page_size, mc.num_kv_heads, mc.head_dim, self.model.compute_dtype, self.model.device
        )
        self.memory = KVMemory(num_pages, config.page_size, config.max_running_requests, not config.disable_radix_cache)
        self.runner = ModelRunner(self.model.module, self.kv_cache, config.attention_backend)
        self._inbox: queue.Queue = queue.Queue()
        self.connector = self._make_connector(disagg, host, port)
        self.scheduler = Scheduler(self._scheduler_config(), self.memory, keep_kv=self.connector.keep_kv)
        self.connector.attach(self.scheduler)
        self.connector.on_transfer = lambda seconds: self.observer.on_kv_transfer(seconds)
        self._live: dict[str, _Live] = {}
        self._rids_lock = threading.Lock()
        self._rids: set[str] = set()
        self._seeds = random.Random(config.seed)
        self._counter = itertools.count()
        self._stopped = threading.Event()
        self._inbox_lock = threading.Lock()  # orders "stopped" against enqueueing
        self.observer = observer or StatsObserver()
        self._generated = self._finished = self._aborted = 0
        self.snapshot = EngineSnapshot()
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            max_running_requests=c.max_running_requests,
            max_prefill_tokens=c.max_prefill_tokens,
            chunked_prefill_size=c.chunked_prefill_size,
            enable_mixed_chunk=c.enable_mixed_chunk,
            schedule_policy=c.schedule_policy,
            init_new_token_ratio=c.init_new_token_ratio,
            min_new_token_ratio=c.min_new_token_ratio,
            new_token_ratio_decay_steps=c.new_token_ratio_decay_steps,
        )

    def _make_connector(self, disagg: DisaggConfig, host: str, port: int | None) -> KVConnector:
        if disagg.role == "colocated":
            return KVConnector()
        advertise = disagg.advertise_host or (host if host not in ("0.0.0.0", "::", "") else socket.gethostbyname(socket.gethostname()))
        if disagg.role == "prefill":
            from tandem.server.disagg.prefill import PrefillConnector

            return PrefillConnector(disagg, host, advertise, self.kv_layout(), self.kv_cache, self.memory, self._wake)
        from tandem.server.disagg.decode import DecodeConnector

        name = f"{advertise}:{port}" if port else None
        return DecodeConnector(disagg, advertise, self.kv_layout(), self.kv_cache, self.memory, self._wake, name)

    def kv_layout(self) -> KVLayout:
        """What a disaggregated peer must share with this engine to exchange KV pages."""
        mc, kv = self.model.config, self.kv_cache
        shape = f"L{mc.num_layers}-H{mc.num_heads}-KV{mc.num_kv_heads}-D{mc.head_dim}-V{mc.vocab_size}"
        return KVLayout(
            model=f"{mc.architecture}:{self.model.source.name}:{shape}",
            kv_dtype=str(kv.dtype).removeprefix("torch."),
            page_size=kv.page_size,
            num_layers=kv.num_layers,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            page_bytes=kv.page_bytes,
        )

    @property
    def role(self) -> str:
        return self.connector.role

    def _wake(self) -> None:
        """From any thread: make the loop look at its connector now."""
        try:
            self._put(("wake",))
        except RuntimeError:
            pass

    def _num_kv_pages(self) -> int:
        c, mc = self.config, self.model.config
        if c.max_total_tokens is not None:
            return c.max_total_tokens // c.page_size
        per_token = PagedKVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.model.compute_dtype)
        budget = int(free_memory_bytes(self.model.device) * c.kv_memory_fraction)
        # Never more than the context length times the slot count: the rest could never be used.
        cap = self.context_length * c.max_running_requests
        return max(1, min(budget // per_token, cap) // c.page_size)

    # -- public API (any thread) ------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        return self.memory.total_tokens

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, rid: str | None = None,
               bootstrap: Bootstrap | None = None) -> RequestStream:
        """Validate and enqueue a request. Raises InvalidRequestError (naming the field) for input
        that can never be served; nothing is allocated for a rejected request. `bootstrap`: where
        a disaggregated request's legs meet (required on prefill and decode servers)."""
        request = self._make_request(prompt, params or SamplingParams(), rid)
        request.bootstrap = bootstrap
        self.connector.check_request(request)
        limit = self.config.max_running_requests + self.config.max_queued_requests
        with self._rids_lock:
            if request.rid in self._rids:
                raise InvalidRequestError("rid", f"request id {request.rid!r} is already in use")
            if len(self._rids) >= limit:
                raise CapacityError("queue", f"{len(self._rids)} requests in flight, the limit is {limit} (--max-queued-requests)")
            self._rids.add(request.rid)
        stream = RequestStream(self, request)
        try:
            self._put(("add", stream))
        except RuntimeError:
            with self._rids_lock:
                self._rids.discard(request.rid)
            raise
        return stream

    def _put(self, item) -> None:
        """Enqueue for the loop, or raise if it has stopped: nothing is left behind in the inbox."""
        with self._inbox_lock:
            if self._stopped.is_set():
                raise RuntimeError("the engine is shut down")
            self._inbox.put(item)

    @property
    def alive(self) -> bool:
        return not self._stopped.is_set()

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None) -> list[CompletedOutput]:
        """Submit all prompts at once (they batch together) and wait for every result, in order."""
        streams = [self.submit(p, params) for p in prompts]
        return [s.result() for s in streams]

    def abort(self, rid: str) -> None:
        """Stop a request and free what it holds. Idempotent; unknown ids are ignored."""
        try:
            self._put(("abort", rid))
        except RuntimeError:
            pass  # stopped: every request already ended

    def call(self, fn: Callable, timeout: float | None = 60):
        """Run `fn()` on the loop thread between steps and return its result (or raise its error)."""
        future: Future = Future()
        self._put(("call", fn, future))
        return future.result(timeout)

    def check_integrity(self) -> None:
        self.call(lambda: self.scheduler.check_integrity(self.connector.held()))

    def flush_cache(self) -> bool:
        return self.call(self.memory.flush_cache)

    def drain(self) -> None:
        """The server is shutting down: the KV connector takes no new work from its peers."""
        self.call(self.connector.drain)

    def drained(self) -> bool:
        """No request left, and nothing the KV connector must finish or tell its peers first."""
        return self.call(lambda: not self.scheduler.has_work() and not self._live and self.connector.drained())

    def shutdown(self) -> None:
        if not self._stopped.is_set():
            self._inbox.put(("stop",))
        self._thread.join()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- validation -------------------------------------------------------------------------------
    def _make_request(self, prompt, params: SamplingParams, rid: str | None) -> Request:
        vocab = self.model.config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise InvalidRequestError("prompt_token_ids", f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty (0 tokens)")
        params.validate(vocab)
        n, ctx, pool = len(ids), self.context_length, self.memory.total_tokens
        if n >= ctx:
            raise InvalidRequestError(
                "prompt", f"{n} tokens leave no room for output in the context length {ctx} (at most {ctx - 1})"
            )
        if n >= pool:
            raise CapacityError(
                "prompt", f"{n} tokens do not fit the KV pool of {pool} tokens (--max-total-tokens; at most {pool - 1})"
            )
        limit = min(ctx, pool) - n
        max_new = min(params.max_new_tokens or self.config.default_max_new_tokens, limit)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        return Request(
            rid=rid or f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}",
            token_ids=ids,
            prompt_len=n,
            params=params,
            max_new_tokens=max_new,
            eos_ids=self.eos_token_ids,
            sampling_seed=seed,
        )

    # -- the loop (engine thread) -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._drain(self._idle_timeout()):
                self._step()
        except BaseException:
            log.exception("engine loop crashed")
            raise
        finally:
            with self._inbox_lock:
                self._stopped.set()
            self.connector.close()
            # Nothing can be enqueued any more: end every request, including those still queued.
            stopped = StreamOutput("", [], "", 0, 0, 0, True, "abort", error="engine stopped")
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "add":
                    self._live[item[1].rid] = _Live(item[1], IncrementalDetokenizer(self.tokenizer), StopStringMatcher(()))
                elif item[0] == "call":
                    item[2].set_exception(RuntimeError("the engine is shut down"))
            for live in list(self._live.values()):
                self._close(live, dataclasses.replace(stopped, rid=live.stream.rid))

    def _idle_timeout(self) -> float | None:
        """How long the loop may wait for inbox traffic: 0 when the scheduler has work."""
        if self.scheduler.has_work():
            return 0.0
        return self.connector.idle_wait()

    def _step(self) -> None:
        for req in self.connector.poll():
            self._publish(req)  # a decode's first token arrived, or a held request ended
        plan = self.scheduler.schedule()
        if plan is not None:
            try:
                out = self.runner.execute(plan)
            except Exception as e:  # keep serving: fail this step's requests, not the engine
                log.exception("forward pass failed")
                for seq in plan.seqs:
                    self.scheduler.abort(seq.rid, f"forward pass failed: {type(e).__name__}: {e}", "internal")
            else:
                for req in self.scheduler.update(plan, out):
                    self._publish(req)
        elif self.scheduler.has_work():
            time.sleep(0.001)  # nothing fits right now; let inbox traffic (aborts) through
        for live in [lv for lv in self._live.values() if lv.stream.request.finished]:
            self._publish(live.stream.request)  # ended without a token (abort, KV exhaustion)
        self._publish_snapshot()

    def _publish_snapshot(self) -> None:
        """Swap in a fresh EngineSnapshot: any thread may read `self.snapshot` at any time."""
        sched, mem = self.scheduler, self.memory
        self.snapshot = EngineSnapshot(
            running=sched.num_running,
            waiting=sched.num_waiting,
            queued_prompt_tokens=sched.queued_prompt_tokens,
            kv_pages_total=mem.num_pages,
            kv_pages_used=mem.used_pages,
            page_size=mem.page_size,
            prompt_tokens=sched.stats.prompt_tokens,
            generation_tokens=self._generated,
            prefix_query_tokens=sched.stats.prefix_query_tokens,
            prefix_hit_tokens=sched.stats.prefix_hit_tokens,
            retractions=sched.stats.retractions,
            requests_finished=self._finished,
            requests_aborted=self._aborted,
            forward_steps=sched.stats.forward_steps,
            **self.connector.stats(),
        )

    def _drain(self, timeout: float | None) -> bool:
        """Apply inbox commands, waiting up to `timeout` seconds (None: forever) for the first;
        returns False once asked to stop."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = item[0]
            if kind == "stop":
                return False
            if kind == "add":
                stream = item[1]
                self._live[stream.rid] = _Live(stream, IncrementalDetokenizer(self.tokenizer), StopStringMatcher(stream.request.params.stop))
                self.connector.add(stream.request)
            elif kind == "abort":
                if self.scheduler.abort(item[1]) is None:
                    self.connector.abort(item[1], "aborted")
            elif kind == "call":
                fn, future = item[1], item[2]
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _publish(self, req: Request) -> None:
        live = self._live.get(req.rid)
        if live is None:
            return
        new_ids = req.token_ids[req.prompt_len + live.sent_tokens :]
        if new_ids:
            now = time.monotonic()
            if live.sent_tokens == 0:
                queued = (req.admit_time or now) - req.arrival_time
                self.observer.on_first_token(queued, (req.first_token_time or now) - req.arrival_time)
            else:
                self.observer.on_tokens(now - live.last_token_time, len(new_ids))
            live.last_token_time = now
            self._generated += len(new_ids)
        live.sent_tokens += len(new_ids)
        for token in new_ids:
            live.detok.push(token)
        if req.finished:
            live.detok.flush()
        text = live.detok.text
        if live.stops.stops and not req.finished:
            hit = live.stops.find(text, live.released)
            if hit is not None:
                text = text[: hit[0]]
                self.scheduler.finish(req, Finish("stop", matched=hit[1]))
        end = len(text) if req.finished else live.stops.safe_length(text)
        delta, live.released = text[live.released : end], max(live.released, end)
        n_new = len(new_ids)
        finish = req.finish
        out = StreamOutput(
            rid=req.rid,
            token_ids=new_ids,
            text=delta,
            prompt_tokens=req.prompt_len,
            completion_tokens=req.num_output,
            cached_tokens=req.num_cached_prompt,
            finished=req.finished,
            finish_reason=finish.reason if finish else None,
            matched_stop=finish.matched if finish else None,
            error=finish.message if finish and finish.reason == "abort" else None,
            error_code=finish.code if finish else None,
            logprobs=req.output_logprobs[-n_new:] if n_new and req.output_logprobs else [],
            top_logprobs=req.output_top_logprobs[-n_new:] if n_new and req.output_top_logprobs else [],
        )
        if req.finished:
            self._finished += 1
            self._aborted += finish.reason == "abort"
            self.observer.on_finish(time.monotonic() - req.arrival_time)
            self._close(live, out)
        else:
            live.stream._queue.put(out)

    def _close(self, live: _Live, final: StreamOutput) -> None:
        live.stream._queue.put(final)
        live.stream._queue.put(_DONE)
        self._live.pop(live.stream.rid, None)
        with self._rids_lock:
            self._rids.discard(live.stream.rid)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
