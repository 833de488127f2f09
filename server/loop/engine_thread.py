"""What runs on the engine thread: building the server's parts, the loop, closing.

The model is loaded on the engine thread too, so that one thread does all of the process's torch
work: GNU OpenMP (torch's CPU thread pool) keeps a pool of workers per thread that runs parallel
regions, and once two such pools outnumber the cores, every region wakes its workers from sleep
instead of spinning. Measured on 2 cores (`tandem bench serve --concurrency 1 --num-requests 3
--prompt-len 300 300 --output-len 64 64` against one `tandem serve`): 84 ms per output token with
the model loaded on the caller's thread, 61 ms with it loaded here.

One iteration of the loop: apply the inbox, then one step (`steps.py`): poll the KV connector ->
schedule -> execute -> update -> publish outputs, the statistics and the step's KV events; with
overlap scheduling (the default on CUDA and for a decode) the forward passes run one step ahead on
a runner thread, which then does all of the torch work.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

from tandem.kernels.cpu_ops import idle_compute_threads
from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.disagg.roles import advertise_host, create_connector
from tandem.server.kvcache.kv_events import KvEventPublisher
from tandem.server.loop.cuda_graphs import capture_decode_graphs
from tandem.server.loop.failure import Failure, crash_reason
from tandem.server.loop.grammar import GrammarCompiler
from tandem.server.loop.inbox import Abort, Add, Call, Inbox, Message, Stop, handling
from tandem.server.loop.intake import Intake
from tandem.server.loop.kv_pool import num_kv_pages
from tandem.server.loop.output_processor import OutputProcessor
from tandem.server.loop.runner import ModelRunner
from tandem.server.loop.stats import engine_snapshot
from tandem.server.loop.steps import Steps
from tandem.server.model.load import LoadedModel, load_model, resolve_device
from tandem.server.model.shard import Shard
from tandem.server.parallel.group import threads_per_rank
from tandem.server.parallel.workers import RankPool, RankSpec
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Finish
from tandem.server.scheduling.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("tandem.engine")


def idle_compute_priority(device: torch.device) -> None:
    """`--compute-priority idle`, on the thread that runs the forward passes, after every other
    thread (gRPC, KV transfer) exists: those keep their policy."""
    if device.type != "cpu":
        raise ValueError(f"--compute-priority=idle is for CPU servers; this one runs on {device}")
    try:
        count = idle_compute_threads()
    except RuntimeError as e:
        raise ValueError(f"--compute-priority=idle: {e}") from e
    log.info("compute priority idle: the %d threads that run forward passes yield the cores to other "
             "processes (SCHED_IDLE)", count)


class EngineThread:
    """The engine thread's half of `Engine`: `_run` builds the parts, waits for start(), loops
    (inbox, then one step) and closes; nothing here runs on another thread. `Engine.__init__` sets
    what is declared below and starts the thread."""

    config: EngineConfig
    inbox: Inbox
    steps: Steps
    failed: Failure
    ranks: RankPool | None
    _started: bool
    _go: threading.Event

    def _build(self, model: LoadedModel | None, disagg: DisaggConfig, host: str, port: int | None) -> None:
        config = self.config
        threads, why = threads_per_rank(config.num_threads, config.tp_size, torch.get_num_threads())
        torch.set_num_threads(threads)
        log.info("%d torch threads%s (%s)", threads, " per rank" if config.tp_size > 1 else "", why)
        if config.tp_size > 1:
            advertise = advertise_host(disagg, host) if disagg.role != "colocated" else host
            self.ranks = RankPool(RankSpec(config, disagg, advertise_host=advertise), resolve_device(config.device))
            model = load_model(config, Shard(0, config.tp_size), self.ranks.group.all_reduce)
        self.model = model or load_model(config)
        mc, lc = self.model.config, self.model.module.config  # the whole model; this rank's heads
        self.tokenizer = self.model.tokenizer
        self.context_length = config.context_length or mc.max_position_embeddings
        self.eos_token_ids = self.model.eos_token_ids
        num_pages = num_kv_pages(config, self.model, self.context_length)
        # On CUDA one page more than the pool hands out: where CUDA graphs' padding rows write (cuda_graphs.py).
        scratch = int(self.model.device.type == "cuda")
        self.kv_cache = PagedKVCache(
            mc.num_layers, num_pages + scratch, config.page_size, lc.kv_heads, mc.kv_dim,
            self.model.precision.kv, self.model.device, value_dim=mc.kv_value_dim
        )
        log.info("KV cache: %d bytes per token%s", self.kv_bytes_per_token,
                 "" if config.tp_size == 1 else " on each rank (a latent: whole on each)" if mc.latent else
                 " on this rank (its share of the KV heads)")
        if self.ranks is not None:
            self.ranks.build(num_pages, self.fail)
        self.kv_events = KvEventPublisher(config.kv_events_replay, config.kv_events_queue)
        self.memory = KVMemory(num_pages, config.page_size, config.max_running_requests, not config.disable_radix_cache,
                               self.kv_events)
        self.runner = ModelRunner(self.model.module, self.kv_cache, config.attention_backend, self.ranks)
        self.runner.graphs = capture_decode_graphs(config, self.model.module, self.kv_cache, disagg.role,
                                                   self.runner.attn, scratch_page=num_pages)
        self.connector = create_connector(disagg, host, port, self.kv_layout(), self.kv_cache, self.memory,
                                          self.wake, self.observer.on_kv_transfer, self.ranks)
        self.scheduler = Scheduler(SchedulerConfig.of(config, self.model.device.type, self.connector.takes_finished),
                                   self.memory)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids, config.grammar_compile_timeout)
        self.intake = Intake(config, self.tokenizer, mc.vocab_size, self.context_length, self.memory.total_tokens,
                             self.eos_token_ids, self.grammars, self.connector.max_new_tokens)
        self.outputs = OutputProcessor(self.tokenizer, self.observer, self.scheduler.finish, self.intake.release)
        self.publish_snapshot()
        if config.compute_priority == "idle":
            idle_compute_priority(self.model.device)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self, built: Future, model: LoadedModel | None, disagg: DisaggConfig, host: str, port: int | None) -> None:
        """Build, wait for start() (or shutdown()), then loop until stopped."""
        try:
            self.steps.run(self._build, model, disagg, host, port)
        except BaseException as e:
            self.inbox.close()
            if hasattr(self, "connector"):  # a prefill's bootstrap service may already listen
                self.connector.close()
            if self.ranks is not None:
                self.ranks.close()
            self.steps.close()
            built.set_exception(e)
            return
        built.set_result(None)
        self._go.wait()
        try:
            while self._started and not self.steps.stopping and self.apply_inbox(self._idle_timeout()):
                self.steps.step()
        except BaseException as e:
            self.failed.record(reason := crash_reason(e))
            log.exception("%s", reason)
            raise
        finally:
            self._close(self.inbox.close())

    def _close(self, left: list[Message]) -> None:
        """The loop is over (`left`: what the closed inbox still held). Requests that ended in the
        scheduler go to the connector first (a prefill starts their KV writes, which closing it
        waits for); every stream still open ends with finish_reason abort."""
        self.steps.settle()
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
            self.steps.close()
            self.grammars.close()
        for message in left:
            if isinstance(message, Add):
                self.outputs.open(message.stream)
            elif isinstance(message, Call):
                message.future.set_exception(RuntimeError("the engine is shut down"))
        if self.failed.reason:  # the server failed them: an error, not a client's abort
            self.outputs.close_all(f"the server failed: {self.failed.reason}", "internal")
        else:
            self.outputs.close_all("engine stopped")
        self.kv_events.publish()
        self.kv_events.close()

    def _idle_timeout(self) -> float | None:
        """How long the loop may wait for inbox traffic: 0 when the scheduler has work."""
        if self.scheduler.has_work() or self.steps.busy:
            return 0.0
        return self.connector.idle_wait()

    def apply_inbox(self, timeout: float | None) -> bool:
        """Apply inbox messages, waiting up to `timeout` seconds (None: forever) for the first;
        False once asked to stop."""
        message = self.inbox.get(timeout)
        while message is not None:
            if isinstance(message, Stop):
                return False
            try:
                self._apply(message)
            except Exception as e:  # the loop crashes: name the request it was handling
                if (what := handling(message)) is not None:
                    e.add_note(what)
                raise
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

    def publish_snapshot(self) -> None:
        """Swap in a fresh EngineSnapshot: any thread may read `self.snapshot` at any time."""
        self.snapshot = engine_snapshot(self.scheduler, self.memory, self.outputs, self.grammars.stats,
                                        self.kv_events.stats(), self.connector.stats())
