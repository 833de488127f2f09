"""Scheduler driven by a fake runner: admission, chunked prefill, mixed batches, retraction, the
new-token ratio, queue order, aborts and stop conditions, in the plain loop and the overlapped
one (each step planned before the one before it is updated). No model, no torch."""

from __future__ import annotations

import pytest

import support.requests
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.plan import FUTURE_TOKEN, Phase, SeqPlan, StepOutput, StepPlan
from tandem.server.scheduling.policy import CPU_PREFILL_TOKENS, GPU_PREFILL_TOKENS, mixed_chunks, prefill_tokens_per_pass
from tandem.server.scheduling.request import Finish, Request, Status
from tandem.server.scheduling.scheduler import Scheduler, SchedulerConfig

EOS = 2
TOKEN = 7  # what the fake runner samples unless told otherwise

DEFAULTS = dict(
    max_running_requests=8,
    max_prefill_tokens=4096,
    chunked_prefill_size=0,
    enable_mixed_chunk=False,
    schedule_policy="fcfs",
    init_new_token_ratio=0.7,
    min_new_token_ratio=0.1,
    new_token_ratio_decay_steps=100,
)


def make_scheduler(num_pages: int = 256, page_size: int = 4, prefix_cache: bool = True, **config) -> Scheduler:
    cfg = SchedulerConfig(**{**DEFAULTS, **config})
    return Scheduler(cfg, KVMemory(num_pages, page_size, cfg.max_running_requests, prefix_cache))


def make_request(rid: str, prompt: list[int], max_new_tokens: int = 4, **params) -> Request:
    """support.requests.make_request with this file's defaults: 4 new tokens at most, EOS stops."""
    return support.requests.make_request(rid, prompt, max_new_tokens, frozenset({EOS}), **params)


def outputs(req: Request) -> list[int]:
    return req.token_ids[req.prompt_len :]


class FakeRunner:
    """Writes every planned token into a fake KV pool at (page, offset) and checks that all earlier
    positions of the sequence read back its own history, so a page shared, swapped or reused wrongly
    fails the step. Samples `script[num_output]` when given, else TOKEN. Like the real runner, it
    fills in a FUTURE_TOKEN with what the pass before sampled for that request."""

    def __init__(self, page_size: int, script: dict[str, list[int]] | None = None):
        self.page_size = page_size
        self.script = script or {}
        self.kv: dict[tuple[int, int], int] = {}
        self.sampled: dict[str, int] = {}

    def cell(self, pages: list[int], pos: int) -> tuple[int, int]:
        return pages[pos // self.page_size], pos % self.page_size

    def __call__(self, plan: StepPlan) -> StepOutput:
        sampled, self.sampled = self.sampled, {}
        for seq in plan.seqs:
            for pos in range(seq.start_pos):
                assert self.kv.get(self.cell(seq.pages, pos)) == seq.history[pos], f"{seq.rid}: KV at {pos} is wrong"
            tokens = seq.token_ids[:-1] + [sampled[seq.rid] if seq.token_ids[-1] == FUTURE_TOKEN else seq.token_ids[-1]]
            for pos, token in enumerate(tokens, seq.start_pos):
                self.kv[self.cell(seq.pages, pos)] = token
        out = StepOutput([self.next_token(seq) if seq.sample else None for seq in plan.seqs])
        self.sampled = {seq.rid: token for seq, token in zip(plan.seqs, out.next_tokens) if seq.sample}
        return out

    def next_token(self, seq: SeqPlan) -> int:
        script = self.script.get(seq.rid)
        return script[seq.kv_len - seq.prompt_len] if script else TOKEN


def check_plan(plan: StepPlan, page_size: int) -> None:
    extends, decodes = plan.seqs[: plan.num_extends], plan.seqs[plan.num_extends :]
    assert plan.phase is (Phase.MIXED if extends and decodes else Phase.PREFILL if extends else Phase.DECODE)
    assert len({s.rid for s in plan.seqs}) == len(plan.seqs), "a request runs twice in one pass"
    for seq in decodes:
        assert len(seq.token_ids) == 1 and seq.sample
    for seq in plan.seqs:
        assert seq.token_ids and seq.history[seq.start_pos : seq.kv_len] == seq.token_ids
        assert seq.sample == (seq.kv_len == len(seq.history)), "only the piece reaching the end samples"
        assert len(seq.pages) * page_size >= seq.kv_len, "pages do not cover the pass"


def step(sched: Scheduler, runner: FakeRunner) -> StepPlan:
    plan = sched.schedule()
    assert plan is not None, "work is queued but nothing was scheduled"
    check_plan(plan, sched.page_size)
    sched.update(plan, runner(plan))
    sched.check_integrity()
    return plan


def assert_drained(sched: Scheduler) -> None:
    """Nothing queued or running; every page free or held, unpinned, by the prefix cache."""
    sched.check_integrity()
    mem = sched.memory
    assert not sched.has_work()
    assert mem.slots.num_free == mem.slots.num_slots
    assert mem.allocator.num_free + mem.cache.num_pages == mem.num_pages
    assert mem.cache.num_evictable == mem.cache.num_pages


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list[StepPlan]:
    plans = []
    while sched.has_work():
        assert len(plans) < max_steps, "the scheduler stopped making progress"
        plans.append(step(sched, runner))
    assert_drained(sched)
    return plans


def run_overlapped(sched: Scheduler, runner: FakeRunner, max_steps: int = 500,
                   between=lambda plan: None) -> list[StepPlan]:
    """The overlapped loop: step N+1 is planned (and, in launch order, run) before step N's
    update. `between(plan)` runs after each plan, before the update of the step before it."""
    plans, in_flight = [], None
    while sched.has_work() or in_flight:
        assert len(plans) < max_steps, "the scheduler stopped making progress"
        plan = sched.schedule()
        launched = None
        if plan is not None:
            plans.append(plan)
            launched = plan, runner(plan)
            between(plan)
        if in_flight is not None:
            sched.update(*in_flight)
            sched.check_integrity()
        in_flight = launched
    assert_drained(sched)
    return plans


# -- a request's life ------------------------------------------------------------------------------
def test_one_request_prefills_then_decodes_to_its_limit():
    sched = make_scheduler()
    req = make_request("a", [11, 12, 13, 14, 15], max_new_tokens=4)
    sched.add(req)
    plans = run_to_completion(sched, FakeRunner(4))
    assert [p.phase for p in plans] == [Phase.PREFILL] + [Phase.DECODE] * 3
    assert [p.seqs[0].start_pos for p in plans] == [0, 5, 6, 7]
    assert outputs(req) == [TOKEN] * 4
    assert req.finish.reason == "length" and req.status is Status.FINISHED


# -- admission budgets -----------------------------------------------------------------------------
def test_max_prefill_tokens_limits_prompts_per_step():
    sched = make_scheduler(max_prefill_tokens=16)
    reqs = [make_request(str(i), [100 + i] * 8) for i in range(3)]
    for req in reqs:
        sched.add(req)
    runner = FakeRunner(4)
    first = step(sched, runner)
    assert [s.rid for s in first.seqs] == ["0", "1"], "16 prompt tokens fit two prompts of 8"
    assert [r.rid for r in sched.waiting] == ["2"]
    run_to_completion(sched, runner)
    assert all(len(outputs(r)) == 4 for r in reqs)


def test_one_prompt_may_exceed_max_prefill_tokens():
    sched = make_scheduler(max_prefill_tokens=16)
    long, short = make_request("long", list(range(30))), make_request("short", [1, 2])
    sched.add(long)
    sched.add(short)
    runner = FakeRunner(4)
    first = step(sched, runner)
    assert [(s.rid, len(s.token_ids)) for s in first.seqs] == [("long", 30)]
    assert [r.rid for r in sched.waiting] == ["short"]
    run_to_completion(sched, runner)


def test_mixed_chunks_when_unset_are_on_for_a_cpu_only():
    assert mixed_chunks(None, "cpu")[0] is True
    assert mixed_chunks(None, "cuda") == (False, "unset, on cuda: decode steps replay CUDA graphs")
    assert mixed_chunks(False, "cpu") == (False, "asked for")
    assert mixed_chunks(True, "cuda") == (True, "asked for")


def test_prefill_tokens_per_pass_when_unset_is_a_few_hundred_on_a_cpu():
    """A CPU's products run at their peak from a few hundred rows on: two long prompts go one per
    pass, so the first one's first token does not wait for the second; short ones still share."""
    assert prefill_tokens_per_pass(None, "cpu")[0] == CPU_PREFILL_TOKENS == 256
    assert prefill_tokens_per_pass(None, "cuda")[0] == GPU_PREFILL_TOKENS == 8192
    assert prefill_tokens_per_pass(100_000, "cpu") == (100_000, "asked for")
    sched = make_scheduler(max_prefill_tokens=CPU_PREFILL_TOKENS)
    long = [make_request(f"long{i}", [100 + i] * 200) for i in range(2)]
    short = [make_request(f"short{i}", [200 + i] * 20) for i in range(3)]
    for req in long + short:
        sched.add(req)
    runner = FakeRunner(4)
    assert [s.rid for s in step(sched, runner).seqs] == ["long0"]
    assert [s.rid for s in step(sched, runner).seqs] == ["long1", "short0", "short1"]
    run_to_completion(sched, runner)
    assert all(len(outputs(r)) == 4 for r in long + short)


def test_max_running_requests_caps_running():
    sched = make_scheduler(max_running_requests=2)
    reqs = [make_request(str(i), [50 + i] * 3, max_new_tokens=3) for i in range(5)]
    for req in reqs:
        sched.add(req)
    runner = FakeRunner(4)
    seen_running = []
    while sched.has_work():
        step(sched, runner)
        seen_running.append(sched.num_running)
    assert max(seen_running) == 2
    assert_drained(sched)
    assert all(outputs(r) == [TOKEN] * 3 for r in reqs)


# -- chunked prefill -------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size, chunk, pieces", [(4, 10, [8, 8, 5]), (1, 10, [10, 10, 1]), (4, 8, [8, 8, 5])])
def test_long_prompt_is_split_into_page_aligned_pieces(page_size, chunk, pieces):
    sched = make_scheduler(page_size=page_size, chunked_prefill_size=chunk)
    prompt = list(range(100, 121))
    req = make_request("a", prompt, max_new_tokens=2)
    sched.add(req)
    runner = FakeRunner(page_size)
    starts = 0
    for i, size in enumerate(pieces):
        plan = step(sched, runner)
        (seq,) = plan.seqs
        assert plan.phase is Phase.PREFILL
        assert (seq.start_pos, seq.token_ids) == (starts, prompt[starts : starts + size])
        assert seq.start_pos % page_size == 0
        last = i == len(pieces) - 1
        assert seq.sample == last
        assert (sched.chunked is None) == last
        if not last:
            assert req.num_output == 0
            # the finished pieces are shared through the prefix cache right away
            assert req.cached_pages == (starts + size) // page_size
        starts += size
    assert outputs(req) == [TOKEN]
    decode = step(sched, runner)
    assert decode.phase is Phase.DECODE and decode.seqs[0].start_pos == len(prompt)
    assert_drained(sched)
    assert outputs(req) == [TOKEN] * 2


def test_chunked_request_blocks_other_prompts_until_done():
    sched = make_scheduler(chunked_prefill_size=8)
    long, short = make_request("long", list(range(20)), max_new_tokens=1), make_request("short", [1, 2, 3])
    sched.add(long)
    sched.add(short)
    runner = FakeRunner(4)
    assert [s.rid for s in step(sched, runner).seqs] == ["long"]
    assert [s.rid for s in step(sched, runner).seqs] == ["long"]
    last = step(sched, runner)
    assert [(s.rid, len(s.token_ids)) for s in last.seqs] == [("long", 4), ("short", 3)], (
        "the last piece leaves room in the chunk budget for the next prompt"
    )
    run_to_completion(sched, runner)


# -- mixed batches and prefill priority ------------------------------------------------------------
def test_mixed_step_runs_prompt_piece_with_decodes():
    sched = make_scheduler(chunked_prefill_size=8, enable_mixed_chunk=True)
    a = make_request("a", [1, 2, 3], max_new_tokens=6)
    sched.add(a)
    runner = FakeRunner(4)
    assert step(sched, runner).phase is Phase.PREFILL
    b = make_request("b", list(range(100, 120)), max_new_tokens=2)
    sched.add(b)
    plan = step(sched, runner)
    assert plan.phase is Phase.MIXED
    assert plan.num_extends == 1
    assert [(s.rid, s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs] == [
        ("b", 0, 8, False),
        ("a", 3, 1, True),
    ]
    plan = step(sched, runner)
    assert plan.phase is Phase.MIXED
    assert [(s.rid, s.start_pos) for s in plan.seqs] == [("b", 8), ("a", 4)]
    run_to_completion(sched, runner)
    assert outputs(a) == [TOKEN] * 6 and outputs(b) == [TOKEN] * 2


def test_prefill_has_priority_when_not_mixed():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], max_new_tokens=5)
    sched.add(a)
    runner = FakeRunner(4)
    step(sched, runner)
    b = make_request("b", [4, 5, 6])
    sched.add(b)
    plan = step(sched, runner)
    assert plan.phase is Phase.PREFILL and [s.rid for s in plan.seqs] == ["b"]
    assert a.num_output == 1, "a running request does not decode in a prefill step"
    plan = step(sched, runner)
    assert plan.phase is Phase.DECODE and [s.rid for s in plan.seqs] == ["a", "b"]
    run_to_completion(sched, runner)


# -- retraction and the new-token ratio ------------------------------------------------------------
def retraction_scenario(page_size: int):
    """A 14-token pool: `a` runs alone for two steps, then `b` joins (and `c` waits for a slot);
    both decode until the pool runs out and one must go."""
    sched = make_scheduler(
        num_pages=14 // page_size,
        page_size=page_size,
        max_running_requests=2,
        init_new_token_ratio=0.5,
        min_new_token_ratio=0.0,
        new_token_ratio_decay_steps=2,
    )
    a, b = make_request("a", [1, 2, 3, 4], max_new_tokens=10), make_request("b", [5, 6, 7, 8], max_new_tokens=10)
    c = make_request("c", [9, 9], max_new_tokens=2)
    sched.add(a)
    runner = FakeRunner(page_size)
    step(sched, runner)
    step(sched, runner)
    sched.add(b)
    sched.add(c)
    return sched, runner, (a, b, c)


@pytest.mark.parametrize("page_size", [1, 2])
def test_retraction_sends_fewest_output_request_to_front_of_queue(page_size):
    sched, runner, (a, b, c) = retraction_scenario(page_size)
    while sched.stats.retractions == 0:
        assert sched.has_work()
        step(sched, runner)
    assert a.num_output > b.num_output > 0
    assert b.status is Status.WAITING and b.slot is None and b.num_retractions == 1
    assert [r.rid for r in sched.waiting] == ["b", "c"], "the retracted request goes first"
    assert [r.rid for r in sched.running] == ["a"]
    run_to_completion(sched, runner)
    assert outputs(a) == [TOKEN] * 10 and outputs(b) == [TOKEN] * 10 and outputs(c) == [TOKEN] * 2
    assert a.finish.reason == b.finish.reason == "length"
    assert runner.kv, "the fake runner saw the passes"


def test_retracted_chunked_request_resumes_from_its_cached_pieces():
    sched = make_scheduler(
        num_pages=9, page_size=2, max_running_requests=2, chunked_prefill_size=4, enable_mixed_chunk=True,
        init_new_token_ratio=0.0, min_new_token_ratio=0.0,
    )
    a, b = make_request("a", [1, 2, 3], max_new_tokens=12), make_request("b", list(range(100, 114)), max_new_tokens=2)
    runner = FakeRunner(2)
    sched.add(a)
    step(sched, runner)
    sched.add(b)
    assert step(sched, runner).phase is Phase.MIXED  # b's first piece rides with a's decode
    while sched.stats.retractions == 0:
        assert sched.chunked is b, "b is still prefilling when the pool runs out"
        step(sched, runner)
    assert sched.chunked is None and list(sched.waiting) == [b] and b.num_retractions == 1
    assert sched.memory.match(b).pages, "b's finished pieces stay in the prefix cache"
    plans = run_to_completion(sched, runner)
    resumed = next(s for p in plans for s in p.seqs if s.rid == "b")
    assert resumed.start_pos > 0, "b does not recompute what the cache kept"
    assert outputs(a) == [TOKEN] * 12 and outputs(b) == [TOKEN] * 2


def test_lone_request_that_outgrows_the_pool_is_aborted():
    sched = make_scheduler(num_pages=6, page_size=1)
    req = make_request("a", [1, 2, 3, 4], max_new_tokens=10)
    sched.add(req)
    runner = FakeRunner(1)
    for _ in range(3):  # the prompt, then two decodes fill the six pages
        step(sched, runner)
    assert sched.schedule() is None, "nothing left to run once the request is aborted"
    assert req.finish.reason == "abort" and "KV cache exhausted" in req.finish.message
    assert len(outputs(req)) == 3
    assert_drained(sched)


def test_new_token_ratio_decays_per_decode_step_to_floor():
    sched = make_scheduler(init_new_token_ratio=0.5, min_new_token_ratio=0.1, new_token_ratio_decay_steps=4)
    sched.add(make_request("a", [1, 2, 3], max_new_tokens=8))
    runner = FakeRunner(4)
    assert sched.ratio.value == 0.5
    step(sched, runner)
    assert sched.ratio.value == 0.5, "a prefill step does not decay the ratio"
    values = []
    for _ in range(6):
        assert step(sched, runner).phase is Phase.DECODE
        values.append(sched.ratio.value)
    assert values == pytest.approx([0.4, 0.3, 0.2, 0.1, 0.1, 0.1])
    run_to_completion(sched, runner)


def test_new_token_ratio_resets_on_retraction():
    sched, runner, _ = retraction_scenario(page_size=1)
    while sched.stats.retractions == 0:
        step(sched, runner)
        if sched.stats.retractions == 0:
            assert sched.ratio.value < 0.5
    assert sched.ratio.value == 0.5, "a retraction puts the ratio back at its initial value"
    run_to_completion(sched, runner)


def test_reserve_for_running_output_holds_back_admission():
    sched = make_scheduler(num_pages=36, page_size=1, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    a = make_request("a", [1, 2, 3, 4], max_new_tokens=30)
    sched.add(a)
    runner = FakeRunner(1)
    step(sched, runner)
    b = make_request("b", [5, 6, 7, 8], max_new_tokens=2)
    sched.add(b)
    plan = step(sched, runner)
    # 32 pages available, 29 reserved for a's output: b's 4 prompt tokens (+2 reserved) do not fit
    assert plan.phase is Phase.DECODE and sched.waiting[0] is b
    plans = run_to_completion(sched, runner)
    assert sched.stats.retractions == 0
    first_b = next(i for i, p in enumerate(plans) if any(s.rid == "b" for s in p.seqs))
    assert [p.seqs[0].rid for p in plans[:first_b]] == ["a"] * 28, "b waited for all of a's decodes"
    assert outputs(b) == [TOKEN] * 2


# -- queue order -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, first", [("fcfs", "x"), ("lpm", "y")])
def test_lpm_admits_longest_cached_prefix_first(policy, first):
    sched = make_scheduler(schedule_policy=policy, max_prefill_tokens=16)
    runner = FakeRunner(4)
    warm = list(range(100, 116))
    sched.add(make_request("warm", warm, max_new_tokens=1))
    run_to_completion(sched, runner)
    assert sched.memory.cache.num_pages == 4

    x = make_request("x", list(range(200, 216)))
    y = make_request("y", warm[:12] + [1, 2, 3, 4])
    sched.add(x)
    sched.add(y)
    plan = step(sched, runner)
    assert [s.rid for s in plan.seqs] == [first]
    if first == "y":
        assert plan.seqs[0].start_pos == 12, "y starts after its cached prefix"
    run_to_completion(sched, runner)
    assert sched.stats.prefix_hit_tokens == 12
    assert y.num_cached_prompt == 12 and x.num_cached_prompt == 0
    assert sched.stats.prompt_tokens == sched.stats.prefix_query_tokens == 16 * 3


def test_prompt_tokens_count_once_per_request_and_arrived_prompts_query_no_cache():
    """A retracted request's readmission counts nothing again; a prompt whose KV arrived (PD
    decode) counts as a prompt but was never looked up in the prefix cache."""
    sched, runner, requests = retraction_scenario(page_size=2)
    run_to_completion(sched, runner)
    assert sched.stats.retractions > 0
    admitted = sum(r.prompt_len for r in requests)
    assert sched.stats.prompt_tokens == sched.stats.prefix_query_tokens == admitted

    arrived = make_request("arrived", list(range(10, 21)), max_new_tokens=1)
    assert sched.memory.reserve(arrived, arrived.prompt_len)
    before = sched.stats.prefix_query_tokens
    sched.add_prefilled(arrived, TOKEN)
    assert sched.stats.prompt_tokens == admitted + 11
    assert sched.stats.prefix_query_tokens == before


def test_an_arrived_prompt_is_shared_while_its_request_runs():
    """A decode's prompt KV is final once it arrived: its whole pages enter the prefix cache then,
    pinned by the request, so the next request with that prefix finds them before the first ends."""
    sched, runner = make_scheduler(num_pages=16, page_size=4), FakeRunner(4)
    arrived = make_request("arrived", list(range(10, 21)), max_new_tokens=8)  # 11 tokens: 2 whole pages
    assert sched.memory.reserve(arrived, arrived.prompt_len)
    for pos, token in enumerate(arrived.token_ids):  # the transfer
        runner.kv[runner.cell(arrived.pages, pos)] = token
    sched.add_prefilled(arrived, TOKEN)
    assert arrived.cached_pages == 2 and sched.memory.cache.num_evictable == 0
    step(sched, runner)
    follower = make_request("follower", list(range(10, 21)) + [5, 6])
    sched.add(follower)
    step(sched, runner)  # the follower's prefill reads the arrived pages (the runner checks their KV)
    assert follower.cached_pages >= 2 and follower.pages[:2] == arrived.pages[:2]
    assert sched.stats.prefix_hit_tokens == 8 and arrived.status is Status.RUNNING
    run_to_completion(sched, runner)


# -- aborts ----------------------------------------------------------------------------------------
def test_abort_from_waiting_running_and_chunked_frees_everything():
    sched = make_scheduler(max_running_requests=2, chunked_prefill_size=8)
    running = make_request("running", [1, 2, 3], max_new_tokens=50)
    chunked = make_request("chunked", list(range(100, 140)), max_new_tokens=50)
    waiting = make_request("waiting", [7, 8, 9])
    runner = FakeRunner(4)
    sched.add(running)
    step(sched, runner)
    sched.add(chunked)
    sched.add(waiting)
    step(sched, runner)
    assert sched.chunked is chunked and list(sched.waiting) == [waiting]

    for req in (waiting, chunked, running):
        assert sched.abort(req.rid, "client went away") is req
        assert req.finished and req.finish.reason == "abort" and req.finish.message == "client went away"
        assert req.slot is None and req.pages == []
        sched.check_integrity()
    assert sched.abort("nobody") is None
    assert_drained(sched)


def test_abort_while_the_pass_runs_skips_its_update():
    sched = make_scheduler()
    req = make_request("a", [1, 2, 3])
    sched.add(req)
    plan = sched.schedule()
    sched.abort("a")
    assert sched.update(plan, FakeRunner(4)(plan)) == []
    assert outputs(req) == [] and req.finish.reason == "abort"
    assert_drained(sched)


# -- stopping --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, reason, matched, expected",
    [
        ({}, "stop", EOS, [5, 6, EOS]),
        ({"ignore_eos": True}, "length", None, [5, 6, EOS, 8, 9, 10]),
        ({"stop_token_ids": (8,), "ignore_eos": True}, "stop", 8, [5, 6, EOS, 8]),
        ({"stop_token_ids": (6,)}, "stop", 6, [5, 6]),
    ],
)
def test_stop_conditions(params, reason, matched, expected):
    sched = make_scheduler()
    req = make_request("a", [1, 3, 4], max_new_tokens=6, **params)
    sched.add(req)
    run_to_completion(sched, FakeRunner(4, script={"a": [5, 6, EOS, 8, 9, 10, 11]}))
    assert outputs(req) == expected
    assert req.finish.reason == reason and req.finish.matched == matched


def test_update_returns_requests_that_got_a_token():
    sched = make_scheduler(chunked_prefill_size=8)
    long, short = make_request("long", list(range(10)), max_new_tokens=1), make_request("short", [1])
    sched.add(short)
    sched.add(long)
    runner = FakeRunner(4)
    plan = sched.schedule()
    assert [(s.rid, len(s.token_ids)) for s in plan.seqs] == [("short", 1), ("long", 4)]
    touched = sched.update(plan, runner(plan))
    assert touched == [short], "a prompt piece that does not sample gives nothing to publish"
    run_to_completion(sched, runner)


# -- whole runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("mixed", [True, False])
def test_many_requests_on_a_tight_pool_drain_cleanly(prefix_cache, mixed):
    sched = make_scheduler(
        num_pages=12, page_size=2, prefix_cache=prefix_cache, max_running_requests=4,
        chunked_prefill_size=6, enable_mixed_chunk=mixed, init_new_token_ratio=0.3, min_new_token_ratio=0.0,
    )
    system = [40, 41, 42, 43, 44, 45]
    reqs = [make_request(f"r{i}", system + [i] * (i % 4 + 1), max_new_tokens=3 + i % 5) for i in range(10)]
    runner = FakeRunner(2)
    for req in reqs:
        sched.add(req)
    run_to_completion(sched, runner)
    assert sched.stats.retractions > 0, "the pool is meant to be tight enough to force retractions"
    assert all(outputs(r) == [TOKEN] * r.max_new_tokens for r in reqs)
    assert (sched.stats.prefix_hit_tokens > 0) == prefix_cache


# -- disaggregation hooks ---------------------------------------------------------------------------
def test_hand_off_gives_every_finished_request_with_its_pages_to_the_next_owner():
    sched = make_scheduler(hand_off_finished=True)
    runner = FakeRunner(sched.page_size)
    sched.add(make_request("a", list(range(10, 20)), max_new_tokens=1))
    plan = sched.schedule()
    sched.update(plan, runner(plan))
    assert sched.has_work(), "a request to hand off is work: the loop must not sleep on it"
    sched.check_integrity()  # the scheduler still accounts for it until it is taken
    (req,) = sched.take_handed_off()
    assert req.finished and req.slot is not None and len(req.pages) == 3  # still held: being "sent"
    assert sched.take_handed_off() == [] and not sched.has_work()
    sched.check_integrity(held_elsewhere=[req])
    with pytest.raises(AssertionError, match="slots leaked"):
        sched.check_integrity()
    sched.memory.release(req)
    assert_drained(sched)
    sched.add(make_request("b", list(range(30, 40))))
    sched.add(make_request("c", list(range(50, 60))))
    sched.schedule()  # b and c hold pages now
    sched.abort("b")
    sched.abort("c")
    taken = sched.take_handed_off()
    assert [(r.rid, r.finish.reason) for r in taken] == [("b", "abort"), ("c", "abort")]  # aborts go too
    for r in taken:
        sched.memory.release(r)
    assert_drained(sched)


def test_end_elsewhere_changes_status_and_finish_only():
    sched = make_scheduler()
    req = make_request("held", list(range(10, 21)))
    assert sched.memory.reserve(req, req.prompt_len)  # a KV connector's, not the scheduler's
    sched.end_elsewhere(req, Finish("abort", message="peer gone", code="unavailable"))
    assert req.finished and req.finish.code == "unavailable"
    assert req.slot is not None, "its owner frees it"
    sched.memory.release(req)
    assert_drained(sched)


@pytest.mark.parametrize("first_token,finished", [(TOKEN, False), (EOS, True)])
def test_add_prefilled_joins_running_without_a_prompt_pass(first_token, finished):
    sched = make_scheduler()
    runner = FakeRunner(sched.page_size)
    prompt = list(range(10, 21))
    req = make_request("a", prompt, max_new_tokens=3)
    assert sched.memory.reserve(req, req.prompt_len)
    for pos, token in enumerate(prompt):  # what the transfer wrote
        runner.kv[runner.cell(req.pages, pos)] = token
    sched.add_prefilled(req, first_token)
    assert outputs(req) == [first_token] and req.finished is finished
    plans = run_to_completion(sched, runner)
    assert all(p.phase is Phase.DECODE for p in plans)  # the prompt never ran here
    assert outputs(req) == ([EOS] if finished else [TOKEN] * 3)


# -- overlap scheduling ------------------------------------------------------------------------------
def overlap_workload(page_size: int = 2):
    """Ten requests sharing a system prompt, some chunked, some stopping on EOS or a stop token
    before their limit, on a pool tight enough to retract."""
    system = [40, 41, 42, 43, 44, 45]
    reqs = [make_request(f"r{i}", system + [i] * (i % 4 + 1), max_new_tokens=3 + i % 5,
                         **({"stop_token_ids": (9,)} if i % 3 == 0 else {})) for i in range(10)]
    script = {f"r{i}": [7, 8, 9, EOS, 7, 7, 7, 7] if i % 2 else [7] * 8 for i in range(10)}
    return reqs, script


@pytest.mark.parametrize("mixed", [True, False])
def test_overlapped_loop_gives_the_plain_loops_tokens_and_frees_everything(mixed):
    config = dict(num_pages=12, page_size=2, max_running_requests=4, chunked_prefill_size=6, enable_mixed_chunk=mixed,
                  init_new_token_ratio=0.3, min_new_token_ratio=0.0)
    results = []
    for drive in (run_to_completion, run_overlapped):
        sched = make_scheduler(**config)
        reqs, script = overlap_workload()
        for req in reqs:
            sched.add(req)
        drive(sched, FakeRunner(2, script))
        results.append([(outputs(r), r.finish) for r in reqs])
        assert sched.stats.retractions > 0, "the pool is meant to be tight enough to force retractions"
    assert results[0] == results[1]


def test_next_decode_runs_the_token_still_being_sampled():
    sched = make_scheduler()
    req = make_request("a", [11, 12, 13], max_new_tokens=3)
    sched.add(req)
    plans = run_overlapped(sched, FakeRunner(4, {"a": [5, 6, 7]}))
    assert [p.seqs[0].token_ids for p in plans] == [[11, 12, 13], [FUTURE_TOKEN], [FUTURE_TOKEN]]
    assert outputs(req) == [5, 6, 7] and req.finish.reason == "length"


def test_a_request_stopped_at_an_update_is_dropped_from_the_step_after():
    """Its EOS is known only once the next step already runs it: that step's token is not kept,
    and no step after it plans the request."""
    sched = make_scheduler()
    a, b = make_request("a", [11, 12, 13], max_new_tokens=8), make_request("b", [21, 22, 23], max_new_tokens=8)
    sched.add(a)
    sched.add(b)
    plans = run_overlapped(sched, FakeRunner(4, {"a": [5, EOS, 6, 6, 6, 6, 6, 6], "b": [7] * 8}))
    in_plans = [sum(s.rid == "a" for s in p.seqs) for p in plans]
    assert in_plans == [1, 1, 1] + [0] * 5, "a runs once more after the step that sampled its EOS"
    assert outputs(a) == [5, EOS] and a.finish.reason == "stop"
    assert outputs(b) == [7] * 8


def test_a_request_at_its_limit_is_not_planned_while_its_last_token_is_sampled():
    sched = make_scheduler()
    req = make_request("a", [11, 12, 13], max_new_tokens=2)
    sched.add(req)
    plans = run_overlapped(sched, FakeRunner(4))
    assert len(plans) == 2 and outputs(req) == [TOKEN, TOKEN]


def test_abort_while_two_steps_are_in_flight_frees_everything():
    sched = make_scheduler()
    req = make_request("a", [11, 12, 13], max_new_tokens=8)
    sched.add(req)

    def abort_at_third(plan):
        if sched.stats.forward_steps == 3:
            sched.abort("a")

    plans = run_overlapped(sched, FakeRunner(4), between=abort_at_third)
    assert len(plans) == 3 and outputs(req) == [TOKEN] and req.finish.reason == "abort"


def test_a_request_retracted_with_a_token_in_flight_waits_for_it():
    """Retraction can take a request whose next token a running step samples: it keeps that
    token and is not admitted again before the token is known."""
    sched, runner, (a, b, c) = retraction_scenario(2)
    seen = []

    def watch(plan):
        for req in sched.waiting:
            seen.append((req.rid, req.sampling))
            assert not (req.sampling and any(s.rid == req.rid for s in plan.seqs)), "admitted before its token was known"

    run_overlapped(sched, runner, between=watch)
    assert ("b", 1) in seen, "b was meant to be retracted with a token in flight"
    assert outputs(a) == [TOKEN] * 10 and outputs(b) == [TOKEN] * 10 and outputs(c) == [TOKEN] * 2
