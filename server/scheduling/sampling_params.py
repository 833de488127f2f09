"""Per-request sampling and stopping parameters, and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tandem.common.options import opt

CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf_grammar", "structural_tag")


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
class Constraint:
    """Structured output: the grammar every output must match (`tandem.server.loop.grammar`), as text.
    `kind` names the field it came in (the gRPC oneof's names)."""

    kind: Literal["regex", "json_schema", "ebnf_grammar", "structural_tag"]
    text: str


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    The command line's sampling flags are generated from these fields (`tandem.common.options`).
    """

    max_new_tokens: int | None = opt(128, "tokens to generate at most (a request that leaves it unset: up to the context length)")
    temperature: float = opt(1.0, "softmax temperature; 0 is greedy")
    top_p: float = opt(1.0, "nucleus sampling: keep the most likely tokens up to this probability mass")
    top_k: int = opt(-1, "keep the k most likely tokens; -1 or 0 keeps all, 1 is greedy")
    min_p: float = opt(0.0, "drop tokens less likely than min_p times the most likely one")
    repetition_penalty: float = opt(1.0, "divide the positive logits (multiply the negative ones) of tokens seen in prompt or output by this")
    frequency_penalty: float = opt(0.0, "subtract this times each token's count in the output from its logit")
    presence_penalty: float = opt(0.0, "subtract this from the logit of each token the output has")
    seed: int | None = opt(None, "seed of this request's draws (none: the server picks one)")
    stop: tuple[str, ...] = opt((), "stop when the output text contains this string")
    stop_token_ids: tuple[int, ...] = opt((), "stop after this token id")
    ignore_eos: bool = opt(False, "keep generating past the model's end-of-sequence tokens")
    logprobs: bool = opt(False, "return each output token's logprob")
    top_logprobs: int = opt(0, "with --logprobs, also return this many most likely alternatives per token")
    # Set by the API layers; the command line has --json-schema FILE / --regex / --ebnf-grammar FILE.
    constraint: Constraint | None = opt(None, "structured output: the grammar the output must match", cli=False)

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
        c = self.constraint
        if c is not None:
            if c.kind not in CONSTRAINT_KINDS:
                raise InvalidRequestError("constraint", f"kind {c.kind!r} is none of {', '.join(CONSTRAINT_KINDS)}")
            if not isinstance(c.text, str) or not c.text.strip():
                raise InvalidRequestError(c.kind, "must not be empty")
