"""Scheduler-level requests for the unit tests of memory and scheduling: no engine, no tokenizer."""

from __future__ import annotations

from tandem.server.scheduling.request import Request
from tandem.server.scheduling.sampling_params import SamplingParams


def make_request(rid: str, prompt: list[int], max_new_tokens: int = 8, eos_ids: frozenset[int] = frozenset(),
                 **params) -> Request:
    """A waiting Request for `prompt` (copied), sampling seed 0: at most `max_new_tokens`, stopping
    at `eos_ids`, further SamplingParams fields in `params`."""
    return Request(
        rid=rid,
        token_ids=list(prompt),
        prompt_len=len(prompt),
        params=SamplingParams(max_new_tokens=max_new_tokens, **params),
        max_new_tokens=max_new_tokens,
        eos_ids=eos_ids,
        sampling_seed=0,
    )
