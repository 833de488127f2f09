"""The scheduler: which tokens of which requests run in the next forward pass.

One step is `plan = scheduler.schedule()`, `out = runner.execute(plan)`,
`finished = scheduler.update(plan, out)`. Requests move waiting -> running (maybe through one
chunked-prefill step after another) -> finished; retraction sends a running request back to the
front of the waiting queue with its computed prefix left in the prefix cache.

A planned step counts at once: its tokens as computed, its samples as pending
(`Request.sampling`). So the next step can be planned before this one's update (overlap
scheduling): a decode whose input token is still being sampled runs FUTURE_TOKEN, and a request
that ends at an update may already be in the step after, whose sample for it is dropped. Every
step runs after the one planned before it (one runner thread, one device stream), so pages freed
now are written again only by later steps; that is why a finished request's pages need no
deferred free.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from tandem.server.config import EngineConfig
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.plan import FUTURE_TOKEN, Phase, SeqPlan, StepOutput, StepPlan
from tandem.server.scheduling.policy import (
    NewTokenRatio, PrefillBudget, mixed_chunks, order_waiting, prefill_tokens_per_pass, retraction_victim,
)
from tandem.server.scheduling.queues import RequestQueues
from tandem.server.scheduling.request import Finish, Request, Status

log = logging.getLogger("tandem.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int  # 0: no chunking
    enable_mixed_chunk: bool
    schedule_policy: str
    init_new_token_ratio: float
    min_new_token_ratio: float
    new_token_ratio_decay_steps: int
    # Every request that ends here goes to `handed_off` with what it holds, for its next owner (a
    # prefill's KV connector, which still has to send its KV) to take and free; otherwise the
    # scheduler frees it.
    hand_off_finished: bool = False

    @classmethod
    def of(cls, config: EngineConfig, device_type: str, hand_off_finished: bool) -> SchedulerConfig:
        """The scheduler's settings from the engine's, the prompt tokens per pass chosen for the device."""
        prefill_tokens, why = prefill_tokens_per_pass(config.max_prefill_tokens, device_type)
        mixed, mixed_why = mixed_chunks(config.enable_mixed_chunk, device_type)
        log.info("max prefill tokens %d (%s); mixed chunks %s (%s)", prefill_tokens, why, "on" if mixed else "off",
                 mixed_why)
        return cls(max_running_requests=config.max_running_requests, max_prefill_tokens=prefill_tokens,
                   chunked_prefill_size=config.chunked_prefill_size, enable_mixed_chunk=mixed,
                   schedule_policy=config.schedule_policy, init_new_token_ratio=config.init_new_token_ratio,
                   min_new_token_ratio=config.min_new_token_ratio,
                   new_token_ratio_decay_steps=config.new_token_ratio_decay_steps, hand_off_finished=hand_off_finished)


@dataclass
class SchedulerStats:
    """Plain counters and gauges for the metrics layer; the scheduler never touches prometheus."""

    retractions: int = 0
    prompt_tokens: int = 0  # prompt tokens of requests admitted for the first time (computed or arrived)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache on first admission
    prefix_hit_tokens: int = 0  # of those, tokens served from the cache
    forward_steps: int = 0


class Scheduler(RequestQueues):
    """Its queues (`RequestQueues`: waiting, chunked, running, and every change of a request's
    status, including those of requests other owners hold), the planning of each step over them,
    and the update of them with each step's output."""

    def __init__(self, config: SchedulerConfig, memory: KVMemory):
        super().__init__(memory, hand_off=config.hand_off_finished)
        self.config = config
        self.page_size = memory.page_size
        self.launched: deque[tuple[StepPlan, list[Request]]] = deque()  # planned, not yet updated; oldest first
        self.ratio = NewTokenRatio(
            config.init_new_token_ratio, config.min_new_token_ratio, config.new_token_ratio_decay_steps
        )
        self.stats = SchedulerStats()

    # -- intake -----------------------------------------------------------------------------------
    def add_prefilled(self, req: Request, first_token: int) -> None:
        """Join a request whose prompt KV is already in its pages (a decode server's transfer
        arrived) straight into the running batch, with its first output token."""
        assert req.slot is not None and len(req.pages) * self.page_size >= req.prompt_len
        now = time.monotonic()
        req.status = Status.RUNNING
        req.num_computed = req.prompt_len
        self.memory.cache_computed(req)  # the prompt's KV is final: later requests may share it from now on
        req.token_ids.append(first_token)
        req.admit_time = req.first_token_time = now
        self.stats.prompt_tokens += req.prompt_len
        self.running.append(req)
        if req.grammar is not None and not req.grammar.accept(first_token):
            self.finish(req, Finish("abort", message=f"the prefill's first token {first_token} breaks the request's "
                                                    "constraint", code="internal"))
            return
        finish = req.stop_reason(first_token)
        if finish is not None:
            self.finish(req, finish)

    # -- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        mixed = self.config.enable_mixed_chunk and bool(self.running)
        if mixed:
            decodes = self._schedule_decodes()
            prefills = self._schedule_prefills()
        else:
            prefills = self._schedule_prefills()
            decodes = [] if prefills else self._schedule_decodes()
        if not prefills and not decodes:
            return None
        phase = Phase.MIXED if prefills and decodes else Phase.PREFILL if prefills else Phase.DECODE
        self.stats.forward_steps += 1
        plan = StepPlan(phase, [seq for seq, _ in prefills + decodes], len(prefills), self.page_size)
        reqs = [req for _, req in prefills + decodes]
        for seq, req in zip(plan.seqs, reqs):
            req.num_computed += len(seq.token_ids)
            req.sampling += seq.sample
        self.launched.append((plan, reqs))
        return plan

    def _schedule_prefills(self) -> list[tuple[SeqPlan, Request]]:
        if not self.waiting and self.chunked is None:
            return []
        cfg = self.config
        reserved = self.reserved_tokens()
        budget = PrefillBudget(
            rem_total=self.memory.available_pages * self.page_size - reserved,
            rem_input=cfg.max_prefill_tokens,
            rem_chunk=cfg.chunked_prefill_size or None,
            page_size=self.page_size,
        )
        plans: list[tuple[SeqPlan, Request]] = []
        if self.chunked is not None:
            req = self.chunked
            take = budget.take(req.pending, self._reserve(req, plans), first=True)
            if take == 0 or not self.memory.grow(req, req.num_computed + take):
                return []  # the chunk waits; decodes (or a retraction) make room
            plans.append((self._seq(req, take), req))
            if take < req.pending:
                return plans  # still chunked: nothing else joins
            self.chunked = None
            self.running.append(req)  # its first token is sampled this step

        slots_left = cfg.max_running_requests - self.num_running
        for req, match in order_waiting(self.waiting, cfg.schedule_policy, self.memory):
            if slots_left <= 0:
                break
            if req.sampling:  # retracted while a step samples its next token: back once it is known
                continue
            cached = len(match.pages) * self.page_size
            extend = req.num_tokens - cached
            take = budget.take(extend, self._reserve(req, plans), first=not plans)
            if take == 0 or not self.memory.admit(req, match, cached + take):
                break
            self.admit(req)
            slots_left -= 1
            if req.num_retractions == 0:
                req.admit_time = time.monotonic()
                self.stats.prompt_tokens += req.prompt_len
                self.stats.prefix_query_tokens += req.prompt_len
                self.stats.prefix_hit_tokens += cached
                req.num_cached_prompt = cached
            plans.append((self._seq(req, take), req))
            if take < extend:
                self.chunked = req
                break
            self.running.append(req)
        return plans

    def reserved_tokens(self) -> int:
        """KV tokens set aside for the running requests' future output (the new-token ratio)."""
        return sum(self.ratio.reserve(r) for r in self.running)

    def _reserve(self, req: Request, planned: list[SeqPlan]) -> int:
        """Output headroom to set aside for `req`. The first request into an idle engine gets none:
        reserving could only stall it forever, and retraction covers any overflow."""
        return self.ratio.reserve(req) if self.running or planned else 0

    def _schedule_decodes(self) -> list[tuple[SeqPlan, Request]]:
        # A request whose pending sample is its last (max_new_tokens) ends at that step's update.
        decoding = [r for r in self.running if r.is_decoding and r.remaining_new_tokens > 0]
        if not decoding:
            return []
        retracted = False
        while True:
            need = sum(1 for r in decoding if r.num_computed // self.page_size >= len(r.pages))
            if need <= self.memory.available_pages:
                break
            victim = self._pick_victim()
            if victim is None:
                break
            retracted = True
            if victim in decoding:
                decoding.remove(victim)
        plans = []
        for req in decoding:
            if not self.memory.grow(req, req.num_computed + 1):
                # A lone request that outgrew the whole pool: nothing left to retract.
                self.finish(req, Finish("abort", message="KV cache exhausted: the request no longer fits the pool",
                                        code="resource_exhausted"))
                continue
            plans.append((self._seq(req, 1), req))
        if not retracted:  # a retraction just reset the ratio; decaying it now would undo that
            self.ratio.step()
        return plans

    def _pick_victim(self) -> Request | None:
        """Retract the request `retraction_victim` picks among the running ones, if any."""
        victim = retraction_victim(self.holders())
        if victim is not None:
            self.retract(victim)
        return victim

    def retract(self, req: Request) -> None:
        """Send a running request back to wait, and reserve more output headroom from now on."""
        super().retract(req)
        self.stats.retractions += 1
        self.ratio.reset()

    def _seq(self, req: Request, take: int) -> SeqPlan:
        start = req.num_computed
        token_ids = req.token_ids[start : start + take]
        if len(token_ids) < take:  # the last token is the one a launched step samples
            token_ids.append(FUTURE_TOKEN)
        return SeqPlan(
            rid=req.rid,
            token_ids=token_ids,
            start_pos=start,
            pages=req.pages,
            sample=start + take == req.num_tokens,
            params=req.params,
            history=req.token_ids,
            prompt_len=req.prompt_len,
            seed=(req.sampling_seed * 1_000_003 + req.num_output) % (1 << 63),
            grammar=req.grammar,
        )

    # -- update -----------------------------------------------------------------------------------
    def update(self, plan: StepPlan, out: StepOutput) -> list[Request]:
        """Apply a finished forward pass (the oldest one planned and not yet updated). Returns the
        requests that got a new token (some of them now finished), in plan order."""
        reqs = self._settle(plan)
        touched = []
        for i, (seq, req) in enumerate(zip(plan.seqs, reqs)):
            if not seq.sample:
                if req.status is Status.RUNNING:
                    self.memory.cache_computed(req)  # share the finished chunk with later requests
                continue
            if req.finished:  # aborted, or stopped by the step before, while this one ran
                continue
            token = out.next_tokens[i]
            req.sampling -= 1
            req.token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.params.logprobs and out.logprobs:  # the batch may carry Nones for others
                req.output_logprobs.append(out.logprobs[i])
            if req.params.top_logprobs and out.top_logprobs:
                req.output_top_logprobs.append(out.top_logprobs[i])
            finish = req.stop_reason(token)
            if finish is not None:
                self.finish(req, finish)
            touched.append(req)
        return touched

    def fail(self, plan: StepPlan, message: str) -> None:
        """A forward pass failed (the oldest one not yet updated): its requests end with an error;
        the tokens it was to compute are not counted, so none of its KV reaches the prefix cache."""
        for seq, req in zip(plan.seqs, self._settle(plan)):
            if not req.finished:
                req.num_computed = min(req.num_computed, seq.start_pos)
                self.finish(req, Finish("abort", message=message, code="internal"))

    def _settle(self, plan: StepPlan) -> list[Request]:
        launched, reqs = self.launched.popleft()
        assert launched is plan, "steps are updated in the order they were planned"
        return reqs
