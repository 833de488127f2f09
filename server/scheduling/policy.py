"""Admission policy: the order of the waiting queue, the per-step prefill budget and the adaptive
share of future output reserved for requests already running."""

from __future__ import annotations

from collections import deque
from typing import Iterator
from dataclasses import dataclass

from tandem.server.kvcache.prefix_cache import PrefixMatch
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Request

# A running request's future output is reserved up to this many tokens (times the ratio): beyond
# that the guess is worthless and retraction handles the rare overflow.
RESERVE_CLIP_TOKENS = 4096
# Longest-prefix-match sorting costs a tree walk per waiting request; past this length, use fcfs.
LPM_MAX_QUEUE = 128
# Prompt tokens per prefill pass where --max-prefill-tokens is unset. A GPU's products keep gaining
# from more rows into the thousands. A CPU's are compute-bound from a few hundred rows on (float32
# on AVX2, measured: ~110 GFLOP/s at 64 rows, ~135 at 256, ~160 from 300): past that a bigger batch
# makes no pass faster and only makes its first prompt wait for the prompts batched with it.
GPU_PREFILL_TOKENS = 8192
CPU_PREFILL_TOKENS = 256


def prefill_tokens_per_pass(asked: int | None, device_type: str) -> tuple[int, str]:
    """`--max-prefill-tokens`, or its default for the device, and why."""
    if asked is not None:
        return asked, "asked for"
    if device_type == "cpu":
        return CPU_PREFILL_TOKENS, ("unset, on a CPU: its products are compute-bound from a few hundred rows on, "
                                    "so more prompts in a pass would only delay the first one's first token")
    return GPU_PREFILL_TOKENS, f"unset, on {device_type}"


def mixed_chunks(asked: bool | None, device_type: str) -> tuple[bool, str]:
    """`--enable-mixed-chunk`, or its default for the device, and why. On a CPU a prompt piece's
    pass is bound by its projections' arithmetic, so the running decodes' rows ride along at little
    cost instead of waiting a pass and then taking one of their own: `tandem bench peers` on a
    2-core Zen 5 measured 1.06x, 1.15x and 1.07x the tokens/s at concurrency 8 on three workloads
    (1.01-1.04x in an earlier five-repeat run); TTFT p50 0.005-0.015 s later (a prompt's pass carries
    the decodes' rows too). On CUDA, off: a mixed pass replays no CUDA graph."""
    if asked is not None:
        return asked, "asked for"
    if device_type == "cpu":
        return True, "unset, on a CPU: decodes ride along with prompt pieces, whose passes are compute-bound"
    return False, f"unset, on {device_type}: decode steps replay CUDA graphs"


class NewTokenRatio:
    """Share of each running request's remaining output that admission keeps free for it.

    Starts conservative, decays linearly each decode step to a floor as the batch proves it fits,
    and jumps back to the start when a retraction shows the guess was too low."""

    def __init__(self, init: float, floor: float, decay_steps: int):
        self.init, self.floor = init, floor
        self.decay = (init - floor) / max(decay_steps, 1)
        self.value = init

    def step(self) -> None:
        self.value = max(self.floor, self.value - self.decay)

    def reset(self) -> None:
        self.value = self.init

    def reserve(self, req: Request) -> int:
        return int(min(req.remaining_new_tokens, RESERVE_CLIP_TOKENS) * self.value)


def order_waiting(waiting: deque[Request], policy: str, memory: KVMemory) -> Iterator[tuple[Request, PrefixMatch]]:
    """The waiting queue in admission order, each with its current prefix-cache match.

    Each match is taken when its request's turn comes: admitting an earlier request may evict
    cached pages, so a match computed before that could point at freed pages. Iterates over a
    snapshot: the caller may remove admitted requests."""
    order = list(waiting)
    if policy == "lpm" and len(order) <= LPM_MAX_QUEUE:
        matched = {id(req): len(memory.match(req).pages) for req in order}
        order.sort(key=lambda req: -matched[id(req)])  # stable: ties stay first-come
    for req in order:
        yield req, memory.match(req)


@dataclass
class PrefillBudget:
    """Token budgets for one step's prompt pieces (SGLang's PrefillAdder, reduced to arithmetic).

    rem_total: KV tokens that may still be committed (available pages minus running reserves).
    rem_input: prompt tokens that may still enter this forward pass (max_prefill_tokens).
    rem_chunk: prompt tokens per pass before the last admitted prompt is cut (None: never cut).
    """

    rem_total: int
    rem_input: int
    rem_chunk: int | None
    page_size: int

    def take(self, extend: int, reserve: int, first: bool) -> int:
        """How many of a request's `extend` pending tokens to run now: all of them, a page-aligned
        piece (the request becomes the chunked one), or 0 (stop admitting this step).

        `reserve` is the output headroom to keep for the request once its prompt is done;
        `first` is whether nothing has been admitted yet this step (one prompt always may exceed
        max_prefill_tokens so that long prompts make progress)."""
        if self.rem_input <= 0:
            return 0
        piece = extend
        if self.rem_chunk is not None and extend > self.rem_chunk:
            piece = self.rem_chunk // self.page_size * self.page_size
            if piece <= 0:
                return 0
        if piece > self.rem_input and not first:
            return 0
        need = piece + (reserve if piece == extend else 0)
        if need > self.rem_total:
            return 0
        self.rem_total -= need
        self.rem_input -= piece
        if self.rem_chunk is not None:
            self.rem_chunk -= piece
        return piece


def retraction_victim(candidates: list[Request]) -> Request | None:
    """Which running request gives its pages back when decodes need more than are free: the one
    with the fewest generated tokens (ties: the longest prompt, the most pages), never the last."""
    if len(candidates) <= 1:
        return None
    return min(candidates, key=lambda r: (r.num_output, -r.prompt_len))
