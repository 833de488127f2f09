"""Per-request sampling and stopping parameters, and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class InvalidRequestError(ValueError):
    """A request that can never be served. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class CapacityError(InvalidRequestError):
    """The request is well-formed but exceeds what this server can hold: its KV pool, or its
    queue. Servers answer RESOURCE_EXHAUSTED (HTTP 429) rather than INVALID_ARGUMENT."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` (or `top_k == 1`) means greedy. `top_k` of -1 or 0 disables top-k.
    `max_new_tokens=None` lets the engine pick its limit (context length minus prompt).
    """

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the field, the value and the limit."""

        def finite(name: str, value) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequestError(name, f"must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            finite(name, getattr(self, name))
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise InvalidRequestError("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise InvalidRequestError("seed", f"must be an integer >= 0, got {self.seed!r}")
        for token in self.stop_token_ids:
            if not _is_int(token) or not 0 <= token < vocab_size:
                raise InvalidRequestError("stop_token_ids", f"token id {token!r} is outside the vocabulary [0, {vocab_size})")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError("stop", f"stop strings must be non-empty, got {text!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError("top_logprobs", f"must be in [0, 20], got {self.top_logprobs!r}")
