"""The in-process engine: builds the parts of a server (model, KV pool, scheduler, runner, KV
connector) on its own thread, then runs the step loop there once started.

Threads: callers submit and abort from any thread (intake validates on theirs, then the inbox
carries typed messages to the loop); everything else (scheduler, memory, runner, connector,
output processing) is owned by the engine thread. `call(fn)` runs fn on the engine thread between
scheduler calls, which is how tests and servers inspect engine state safely.

The model is loaded on the engine thread too, so that one thread does all of the process's torch
work: GNU OpenMP (torch's CPU thread pool) keeps a pool of workers per thread that runs parallel
regions, and once two such pools outnumber the cores, every region wakes its workers from sleep
instead of spinning. Measured on 2 cores (`tandem bench serve --concurrency 1 --num-requests 3
--prompt-len 300 300 --output-len 64 64` against one `tandem serve`): 84 ms per output token with
the model loaded on the caller's thread, 61 ms with it loaded here.

With `--tp-size N`, ranks 1..N-1 run in processes of their own (`tandem.server.parallel`): this
engine is rank 0, hands each forward pass to them, and fails (`failure`, every open request ends
with an error) when one of them is lost.

One iteration of the loop: apply the inbox, then `step()`: poll the KV connector (handing it
what the scheduler reports, applying what it asks through the scheduler) -> schedule ->
execute -> update -> publish outputs, the snapshot of statistics and the step's KV events (what
the prefix cache stored and dropped, `tandem.server.kvcache.kv_events`).

Overlap scheduling (the default on CUDA and for a decode; `--no-disable-overlap-schedule` asks
for it on a CPU, `--disable-overlap-schedule` turns it off: `overlap_scheduling`) is a second loop
over the same calls, `step_overlapped()`: the forward passes run on a runner thread, and while
it computes step N the engine thread plans step N+1 and launches it, then, until step N is
done, applies the inbox and polls the connector, and takes step N's output (update, publish).
The runner thread then does all of the process's torch work, the model's
loading included, for the reason above. Every step runs after the one launched before it, so
what the scheduler frees or shares now is only read or written again by later steps. A failed
forward pass fails the engine, as it does with tensor parallelism: the step after it is already
running on its output.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch

from tandem.kernels.cpu_ops import idle_compute_threads
from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.loop.cuda_graphs import capture_decode_graphs
from tandem.server.disagg.connector import advertise_host, create_connector
from tandem.server.disagg.layout import KVLayout
from tandem.server.loop.grammar import GrammarCompiler
from tandem.server.loop.inbox import Abort, Add, Call, Inbox, Message, Stop, Wake
from tandem.server.loop.intake import Intake, RequestStream
from tandem.server.kvcache.kv_events import KvEventPublisher, Subscription
from tandem.server.loop.kv_pool import kv_layout, num_kv_pages
from tandem.server.scheduling.memory import KVMemory
from tandem.server.model import LoadedModel, Shard, load_model, resolve_device
from tandem.server.loop.outputs import CompletedOutput
from tandem.server.loop.output_processor import OutputProcessor
from tandem.server.parallel.group import threads_per_rank
from tandem.server.parallel.workers import RankPool, RankSpec
from tandem.server.scheduling.plan import StepOutput, StepPlan
from tandem.server.scheduling.policy import prefill_tokens_per_pass
from tandem.server.scheduling.request import Bootstrap, Finish
from tandem.server.loop.runner import ModelRunner
from tandem.server.scheduling.sampling_params import SamplingParams
from tandem.server.scheduling.scheduler import Scheduler, SchedulerConfig
from tandem.server.loop.stats import EngineSnapshot, StatsObserver

log = logging.getLogger("tandem.engine")


def overlap_scheduling(config: EngineConfig, device: torch.device, role: str = "colocated") -> bool:
    """`--disable-overlap-schedule`, or where it is unset: overlap on CUDA, and on a CPU for a
    decode server and with `--compute-priority idle`. On a CPU the host work overlap hides is
    about 1% of a step, and it costs a new prompt one more step of waiting (the next step is
    already launched when it arrives; docs/performance.md, "Overlap scheduling on two cores", has
    the measurement), which a decode, with no prompts to prefill, does not pay. It frees the engine
    thread to poll while a step computes: a decode notices arrived KV mid-step
    (`_poll_while_running`), and at idle priority the engine thread goes on while another
    process's work holds the cores."""
    if config.disable_overlap_schedule is not None:
        return not config.disable_overlap_schedule
    return device.type == "cuda" or role == "decode" or config.compute_priority == "idle"


class Engine:
    """`disagg` picks the role: colocated (the default) or a prefill or decode server, whose KV
    connector listens on (prefill: bootstrap service) or connects from `host`; `port` is the
    server's gRPC port, which names a decode to its prefill peers. `observer` gets the engine's
    statistics. Nothing runs until `start()` (or `with Engine(...)`)."""

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, observer: StatsObserver | None = None,
                 disagg: DisaggConfig | None = None, host: str = "127.0.0.1", port: int | None = None):
        config.validate()
        disagg = disagg or DisaggConfig()
        disagg.validate()
        if config.tp_size > 1 and model is not None:
            raise ValueError(f"--tp-size={config.tp_size}: the engine loads every rank's share itself; pass no model")
        self.config = config
        self.observer = observer or StatsObserver()
        self.inbox = Inbox()
        self.failure: str | None = None  # why the loop failed (a lost tensor-parallel rank), None while it has not
        self.ranks: RankPool | None = None  # tensor-parallel ranks 1..N-1, with --tp-size > 1
        self.overlap = overlap_scheduling(config, model.device if model is not None else resolve_device(config.device),
                                          disagg.role)
        log.info("overlap scheduling %s%s", "on" if self.overlap else "off",
                 " (unset: on CUDA, for a decode, or with --compute-priority idle)" if config.disable_overlap_schedule is None else "")
        # Overlap scheduling: the one thread that runs forward passes (and every other torch call).
        self._runner_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-runner") if self.overlap else None
        self._in_flight: tuple[StepPlan, Future] | None = None  # launched, not yet updated (overlap)
        self._started = False
        self._stopping = False  # the inbox said Stop while a step computed (overlap)
        self._go = threading.Event()  # set by start() or shutdown(): the built engine thread goes on
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(built, model, disagg, host, port),
                                        name="tandem-engine", daemon=True)
        self._thread.start()
        built.result()  # what building raised, raised here

    def _build(self, model: LoadedModel | None, disagg: DisaggConfig, host: str, port: int | None) -> None:
        config = self.config
        threads, why = threads_per_rank(config.num_threads, config.tp_size, torch.get_num_threads())
        torch.set_num_threads(threads)
        log.info("%d torch threads%s (%s)", threads, " per rank" if config.tp_size > 1 else "", why)
        if config.tp_size > 1:
            advertise = advertise_host(disagg, host) if disagg.role != "colocated" else host
            self.ranks = RankPool(RankSpec(config.model, config.dtype, config.prefill_dtype, config.device,
                                           config.attention_backend, config.page_size, config.num_threads,
                                           config.tp_size, 0, config.tp_timeout, disagg.role,
                                           disagg.kv_transfer_protocol, disagg.ib_device, advertise),
                                  resolve_device(config.device))
            model = load_model(config.model, config.dtype, config.device, config.prefill_dtype,
                               Shard(0, config.tp_size), self.ranks.group.all_reduce)
        self.model = model or load_model(config.model, config.dtype, config.device, config.prefill_dtype)
        mc, lc = self.model.config, self.model.module.config  # the whole model; this rank's heads
        self.tokenizer = self.model.tokenizer
        self.context_length = config.context_length or mc.max_position_embeddings
        self.eos_token_ids = self.model.eos_token_ids
        num_pages = num_kv_pages(config, self.model, self.context_length)
        # On CUDA one page more than the pool hands out: where CUDA graphs' padding rows write (cuda_graphs.py).
        scratch = int(self.model.device.type == "cuda")
        self.kv_cache = PagedKVCache(
            mc.num_layers, num_pages + scratch, config.page_size, lc.num_kv_heads, mc.head_dim,
            self.model.compute_dtype, self.model.device
        )
        if self.ranks is not None:
            self.ranks.build(num_pages, self._fail)
        self.kv_events = KvEventPublisher(config.kv_events_replay, config.kv_events_queue)
        self.memory = KVMemory(num_pages, config.page_size, config.max_running_requests, not config.disable_radix_cache,
                               self.kv_events)
        self.runner = ModelRunner(self.model.module, self.kv_cache, config.attention_backend, self.ranks)
        self.runner.graphs = capture_decode_graphs(config, self.model.module, self.kv_cache, disagg.role,
                                                   self.runner.attn, scratch_page=num_pages)
        self.connector = create_connector(disagg, host, port, self.kv_layout(), self.kv_cache, self.memory,
                                          self._wake, self.observer.on_kv_transfer, self.ranks)
        self.scheduler = Scheduler(self._scheduler_config(), self.memory)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids, config.grammar_compile_timeout)
        self.intake = Intake(config, self.tokenizer, mc.vocab_size, self.context_length, self.memory.total_tokens,
                             self.eos_token_ids, self.grammars, self.connector.max_new_tokens)
        self.outputs = OutputProcessor(self.tokenizer, self.observer, self.scheduler.finish, self.intake.release)
        self.snapshot = EngineSnapshot()
        self._publish_snapshot()
        if config.compute_priority == "idle":
            self._idle_compute_threads()

    def _idle_compute_threads(self) -> None:
        """`--compute-priority idle`, on the thread that runs the forward passes, after every
        other thread (gRPC, KV transfer) exists: those keep their policy."""
        if self.model.device.type != "cpu":
            raise ValueError(f"--compute-priority=idle is for CPU servers; this one runs on {self.model.device}")
        try:
            count = idle_compute_threads()
        except RuntimeError as e:
            raise ValueError(f"--compute-priority=idle: {e}") from e
        log.info("compute priority idle: the %d threads that run forward passes yield the cores to other "
                 "processes (SCHED_IDLE)", count)

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        prefill_tokens, why = prefill_tokens_per_pass(c.max_prefill_tokens, self.model.device.type)
        log.info("max prefill tokens %d (%s)", prefill_tokens, why)
        return SchedulerConfig(
            max_running_requests=c.max_running_requests,
            max_prefill_tokens=prefill_tokens,
            chunked_prefill_size=c.chunked_prefill_size,
            enable_mixed_chunk=c.enable_mixed_chunk,
            schedule_policy=c.schedule_policy,
            init_new_token_ratio=c.init_new_token_ratio,
            min_new_token_ratio=c.min_new_token_ratio,
            new_token_ratio_decay_steps=c.new_token_ratio_decay_steps,
            hand_off_finished=self.connector.takes_finished,
        )

    def kv_layout(self) -> KVLayout:
        """What a disaggregated peer must share with this engine to exchange KV pages."""
        return kv_layout(self.model, self.kv_cache)

    @property
    def role(self) -> str:
        return self.connector.role

    @property
    def max_total_tokens(self) -> int:
        return self.memory.total_tokens

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

    def _fail(self, reason: str) -> None:
        """From any thread: the engine cannot go on (a tensor-parallel rank is gone). The loop
        stops and every open request ends with an error naming `reason`."""
        if self.failure is None:
            self.failure = reason
            log.error("engine failing: %s", reason)
        self.inbox.stop()

    def _wake(self) -> None:
        """From any thread: make the loop look at its connector now."""
        try:
            self.inbox.put(Wake())
        except RuntimeError:
            pass

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self, built: Future, model: LoadedModel | None, disagg: DisaggConfig, host: str, port: int | None) -> None:
        """Build, wait for start() (or shutdown()), then loop until stopped."""
        try:
            if self._runner_thread is not None:
                self._runner_thread.submit(self._build, model, disagg, host, port).result()
            else:
                self._build(model, disagg, host, port)
        except BaseException as e:
            self.inbox.close()
            if hasattr(self, "connector"):  # a prefill's bootstrap service may already listen
                self.connector.close()
            if self.ranks is not None:
                self.ranks.close()
            if self._runner_thread is not None:
                self._runner_thread.shutdown()
            built.set_exception(e)
            return
        built.set_result(None)
        self._go.wait()
        step = self.step_overlapped if self.overlap else self.step
        try:
            while self._started and not self._stopping and self._apply_inbox(self._idle_timeout()):
                step()
        except BaseException as e:
            self.failure = self.failure or f"engine loop crashed: {type(e).__name__}: {e}"
            log.exception("engine loop crashed")
            raise
        finally:
            self._close(self.inbox.close())

    def _close(self, left: list[Message]) -> None:
        """The loop is over (`left`: what the closed inbox still held). Requests that ended in the
        scheduler go to the connector first (a prefill starts their KV writes, which closing it
        waits for); every stream still open ends with finish_reason abort."""
        if self._in_flight is not None:  # the device is done with the KV cache before the connector closes
            wait([self._in_flight[1]])
            self._in_flight = None
        finished = self.scheduler.take_handed_off()
        try:
            if finished:
                self.connector.poll(finished, 0)  # what it asks of a stopped loop is moot
            self.connector.close()
        except Exception:  # the streams below must end whatever happened to the loop
            log.exception("closing the KV connector failed")
        finally:
            if self.ranks is not None:
                self.ranks.close()
            if self._runner_thread is not None:
                self._runner_thread.shutdown()
            self.grammars.close()
        for message in left:
            if isinstance(message, Add):
                self.outputs.open(message.stream)
            elif isinstance(message, Call):
                message.future.set_exception(RuntimeError("the engine is shut down"))
        if self.failure:  # the server failed them: an error, not a client's abort
            self.outputs.close_all(f"the server failed: {self.failure}", "internal")
        else:
            self.outputs.close_all("engine stopped")
        self.kv_events.publish()
        self.kv_events.close()

    def _idle_timeout(self) -> float | None:
        """How long the loop may wait for inbox traffic: 0 when the scheduler has work."""
        if self.scheduler.has_work() or self._in_flight is not None:
            return 0.0
        return self.connector.idle_wait()

    def _apply_inbox(self, timeout: float | None) -> bool:
        """Apply inbox messages, waiting up to `timeout` seconds (None: forever) for the first;
        False once asked to stop."""
        message = self.inbox.get(timeout)
        while message is not None:
            if isinstance(message, Stop):
                return False
            self._apply(message)
            message = self.inbox.get(0)
        return True

    def _apply(self, message: Message) -> None:
        if isinstance(message, Add):
            self.outputs.open(message.stream)
            self.connector.add(message.stream.request)
        elif isinstance(message, Abort):
            if self.scheduler.abort(message.rid) is None and (req := self.connector.abort(message.rid, "aborted")):
                self.scheduler.end_elsewhere(req, Finish("abort", message="aborted"))
        elif isinstance(message, Call):
            try:
                message.future.set_result(message.fn())
            except Exception as e:
                message.future.set_exception(e)

    def step(self) -> None:
        """poll -> schedule -> execute -> update -> publish."""
        self._poll_connector()
        plan = self.scheduler.schedule()
        if plan is not None:
            try:
                out = self.runner.execute(plan)
            except Exception as e:
                self._step_failed(plan, e)
            else:
                self._update(plan, out)
        elif self.scheduler.has_work():
            time.sleep(0.001)  # nothing fits right now; let inbox traffic (aborts) through
        self._publish()

    def step_overlapped(self) -> None:
        """poll -> schedule step N+1 and launch it on the runner thread -> update step N (waiting
        for its output) -> publish; step N+1 computes meanwhile."""
        self._poll_connector()
        plan = self.scheduler.schedule()
        launched = None
        if plan is not None:
            launched = plan, self._runner_thread.submit(self.runner.run, self.runner.prepare(plan))
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            ran, future = previous
            self._poll_while_running(future)
            try:
                out = future.result()
            except Exception as e:
                self._step_failed(ran, e)
            else:
                self._update(ran, out)
        elif plan is None and self.scheduler.has_work():
            time.sleep(0.001)
        self._publish()

    def _poll_while_running(self, step: Future) -> None:
        """Until `step` is done, go on as between steps: apply the inbox (a decode registers a new
        request with its prefill now, not a step later) and poll the connector, as often as it
        asks while its requests wait for their KV. What they admit or free is only read or
        written by steps planned after this point."""
        step.add_done_callback(lambda _: self._wake())
        while not step.done() and not self._stopping:
            self._stopping = not self._apply_inbox(self.connector.step_poll_interval())
            self._poll_connector()

    def _update(self, plan: StepPlan, out: StepOutput) -> None:
        for req in self.scheduler.update(plan, out):
            self.outputs.publish(req)

    def _step_failed(self, plan: StepPlan, error: Exception) -> None:
        """Fail the step's requests and keep serving; or, where other work already depends on the
        step (tensor-parallel ranks that may now disagree about the KV cache, the next step under
        overlap scheduling), fail the engine."""
        log.exception("forward pass failed")
        reason = f"forward pass failed: {type(error).__name__}: {error}"
        if self.ranks is not None:
            self._fail(self.ranks.explain(error))
        elif self.overlap:
            self._fail(reason)
        else:
            self.scheduler.fail(plan, reason)

    def _poll_connector(self) -> None:
        """The one exchange with the KV connector per step: it gets what the scheduler reports,
        the scheduler applies what it asks."""
        events = self.connector.poll(self.scheduler.take_handed_off(), self.scheduler.reserved_tokens())
        for req in events.admit:
            self.scheduler.add(req)
        for req, first_token in events.arrived:
            self.scheduler.add_prefilled(req, first_token)
            self.outputs.publish(req)
        for rid, message, code in events.aborts:
            self.scheduler.abort(rid, message, code)
        for req, finish in events.ended:
            self.scheduler.end_elsewhere(req, finish)
            self.outputs.publish(req)

    def _publish(self) -> None:
        """The end of a step: the streams that ended, the step's KV events, then the statistics
        (which count those events)."""
        self.outputs.publish_ended()
        self.kv_events.publish()
        self._publish_snapshot()

    def _kv_event_stats(self) -> dict:
        s = self.kv_events.stats()
        return dict(kv_event_batches=s.batches, kv_events=s.events, kv_event_subscribers=s.subscribers,
                    kv_event_subscribers_dropped=s.subscribers_dropped)

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
            generation_tokens=self.outputs.generated,
            prefix_query_tokens=sched.stats.prefix_query_tokens,
            prefix_hit_tokens=sched.stats.prefix_hit_tokens,
            retractions=sched.stats.retractions,
            requests_finished=self.outputs.finished,
            requests_aborted=self.outputs.aborted,
            forward_steps=sched.stats.forward_steps,
            grammar_compiles=self.grammars.stats.compiled,
            grammar_cache_hits=self.grammars.stats.cache_hits,
            grammar_compile_seconds=self.grammars.stats.seconds,
            **self.connector.stats(),
            **self._kv_event_stats(),
        )
