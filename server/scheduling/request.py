"""A request's state inside the engine: what is stored is what is true; the rest is derived."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from tandem.server.scheduling.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, no slot, no private pages
    RUNNING = "running"  # holds a slot and pages; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"  # ended; may still hold its slot and pages for their next owner (a KV
    # connector sending them, or keeping them while a peer may still write them), which frees them


@dataclass(frozen=True)
class Finish:
    """Why a request ended. `reason` is one of stop | length | abort."""

    reason: str
    matched: int | str | None = None  # the stop token id or stop string that matched
    message: str = ""
    # For failures the server caused (a peer that never came, a dead peer): the gRPC status name
    # the request ends with, e.g. "deadline_exceeded". None for normal ends and client aborts.
    code: str | None = None


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's two legs meet: the prefill's bootstrap service and the room
    (the router picks it; both legs carry the same one)."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


class GrammarState(Protocol):
    """A constrained request's place in its grammar (`tandem.server.loop.grammar.Matcher`)."""

    def accept(self, token: int) -> bool:
        """Advance by `token`; False when the grammar does not allow it."""


@dataclass
class Request:
    rid: str
    token_ids: list[int]  # prompt followed by every output token; grows by one per sampled token
    prompt_len: int
    params: SamplingParams
    max_new_tokens: int  # resolved limit (params.max_new_tokens or the engine's default)
    eos_ids: frozenset[int]
    sampling_seed: int  # the request's seed, or one drawn for it on arrival
    arrival_time: float = field(default_factory=time.monotonic)
    bootstrap: Bootstrap | None = None  # set on prefill and decode servers
    # Structured output: where the output stands in its grammar. The runner advances it with each
    # token it samples; the scheduler only with a first token that arrived from a prefill server.
    grammar: GrammarState | None = None

    status: Status = Status.WAITING
    finish: Finish | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    # Memory, owned by KVMemory. pages[:cached_pages] belong to the prefix cache and are pinned by
    # `cache_node`; pages[cached_pages:] belong to this request alone.
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    cached_pages: int = 0
    cache_node: object = None
    # While steps are launched and not yet updated (overlap scheduling) the counts run ahead of what
    # is known, by one rule: `num_computed` counts the positions launched steps write, `sampling` the
    # tokens they sample, and `token_ids` holds only tokens already sampled. A decode planned while
    # the step before still samples its input token reads FUTURE_TOKEN at position len(token_ids),
    # so num_computed may pass len(token_ids) by one (never by more: one step is in flight at a
    # time). Whatever is keyed by token ids (the prefix cache) takes only `num_cacheable`
    # positions, on every path that may run in that window: aborts, disconnects, peer loss,
    # retraction, stop strings and grammar ends, drain (all free through KVMemory.release).
    num_computed: int = 0  # leading tokens whose KV is in `pages`, or being written by a launched step
    # Tokens launched forward passes sample for this request, not yet known (0, or 1 or 2 under
    # overlap scheduling): they count in `num_tokens` (and `num_output`) and join `token_ids` at
    # their steps' updates.
    sampling: int = 0
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache on first admission
    num_retractions: int = 0
    admit_time: float | None = None  # first admission (monotonic), stamped by the scheduler
    first_token_time: float | None = None  # first output token (monotonic), stamped by the scheduler

    @property
    def num_tokens(self) -> int:
        """Tokens of the request, those being sampled included."""
        return len(self.token_ids) + self.sampling

    @property
    def num_cacheable(self) -> int:
        """Leading positions whose KV is written (or being written by a launched step, which every
        later reader runs after) and whose token ids are known: what may be shared by those ids."""
        return min(self.num_computed, len(self.token_ids))

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens whose KV is not yet computed; the next forward passes must run them."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Running with only the last sampled token left to compute."""
        return self.status is Status.RUNNING and self.num_output > 0 and self.pending == 1

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - self.num_output

    def stop_reason(self, token: int) -> Finish | None:
        """Whether `token`, just appended, ends the request: EOS, a stop token, or max_new_tokens
        (counting the tokens known, not those in flight). A constrained request's grammar allows an
        EOS only once it is complete, and nothing after, so EOS ends it even with ignore_eos."""
        if token in self.eos_ids and (not self.params.ignore_eos or self.grammar is not None):
            return Finish("stop", matched=token)
        if token in self.params.stop_token_ids:
            return Finish("stop", matched=token)
        if len(self.token_ids) - self.prompt_len >= self.max_new_tokens:
            return Finish("length")
        return None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
