"""What the scheduler hands to the runner for one forward pass, and what comes back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.server.scheduling.sampling_params import SamplingParams


# A decode's input token that is still being sampled when the step is planned (overlap
# scheduling): the step before samples it; the runner fills it in before the pass.
FUTURE_TOKEN = -1


class Phase(enum.Enum):
    PREFILL = "prefill"  # only prompt pieces (extends)
    DECODE = "decode"  # only one-token decodes
    MIXED = "mixed"  # prompt pieces followed by decodes, one forward pass


@dataclass
class SeqPlan:
    """One request's share of a forward pass. Filled by the scheduler; read-only for the runner."""

    rid: str
    token_ids: list[int]  # tokens to run now, len >= 1: a prompt piece, or the last sampled token (FUTURE_TOKEN
    # when the step before is still sampling it)
    start_pos: int  # position of token_ids[0]; positions [0, start_pos) already have KV in `pages`
    pages: list[int]  # page table covering positions [0, start_pos + len(token_ids)), in order
    sample: bool  # True when this pass reaches the end of the request's tokens: sample the next one
    params: SamplingParams
    history: list[int]  # the request's tokens (prompt + output; it may grow later), for penalties: the
    # sample sees history[:start_pos] + token_ids
    prompt_len: int  # history[:prompt_len] is the prompt
    seed: int  # seed for this sample; derived from the request seed and its output count
    grammar: object = None  # the request's grammar state (Request.grammar) when its output is constrained

    @property
    def kv_len(self) -> int:
        """Tokens with KV after this pass: the attention length of the last query."""
        return self.start_pos + len(self.token_ids)


@dataclass
class StepPlan:
    """One forward pass. The scheduler counts its tokens as computed (`Request.num_computed`) and its
    samples as pending (`Request.sampling`) from the moment it plans it; `Scheduler.update` settles them."""

    phase: Phase
    seqs: list[SeqPlan]  # prompt pieces first, then decodes (each decode has len(token_ids) == 1)
    num_extends: int  # seqs[:num_extends] are prompt pieces (a piece may be a single token)
    page_size: int


@dataclass
class StepOutput:
    """The runner's answer, aligned with `StepPlan.seqs`. Entries for seqs with sample=False are None."""

    next_tokens: list[int | None]
    logprobs: list[float | None] = field(default_factory=list)  # of the chosen token; empty unless asked
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
