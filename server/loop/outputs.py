"""What the engine gives back: one StreamOutput per step per request, or a whole CompletedOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StreamOutput:
    rid: str
    token_ids: list[int]  # tokens new in this chunk (one per step; none in a bare finish)
    text: str  # text new in this chunk (held back while it might still become a stop string)
    prompt_tokens: int
    completion_tokens: int  # cumulative
    cached_tokens: int  # prompt tokens served from the prefix cache
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    matched_stop: int | str | None = None
    error: str | None = None  # why an aborted request ended
    error_code: str | None = None  # gRPC status name for failures the server caused (None: client abort)
    logprobs: list[float] = field(default_factory=list)  # of the new tokens, when asked
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class CompletedOutput:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str | None
    matched_stop: int | str | None = None
    error: str | None = None
    error_code: str | None = None
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    time_to_first_token: float | None = None  # seconds from submission
    latency: float | None = None  # seconds from submission to the final chunk
