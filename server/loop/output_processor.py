"""Output processing on the engine loop: per request being streamed, detokenize the new tokens,
hold back text that may still become a stop string (and end the request when one matches), time
the tokens for the observer, and hand the caller its StreamOutputs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from tandem.server.loop.intake import RequestStream
from tandem.server.loop.outputs import StreamOutput
from tandem.server.loop.stats import StatsObserver
from tandem.server.loop.stop_strings import StopStringMatcher
from tandem.server.model.tokenizer import IncrementalDetokenizer
from tandem.server.scheduling.request import Finish, Request


@dataclass
class _Live:
    """One request being streamed."""

    stream: RequestStream
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    released: int = 0  # characters of detok.text already sent
    sent_tokens: int = 0  # output tokens already sent
    last_token_time: float = 0.0


class OutputProcessor:
    """`finish(req, Finish)` ends a request whose text matched a stop string (the scheduler's);
    `closed(rid)` is told when a request's stream has ended."""

    def __init__(self, tokenizer, observer: StatsObserver, finish: Callable[[Request, Finish], None],
                 closed: Callable[[str], None]):
        self.tokenizer, self.observer, self.finish, self.closed = tokenizer, observer, finish, closed
        self._live: dict[str, _Live] = {}
        self.generated = self.finished = self.aborted = 0  # output tokens; requests ended, of them aborted

    def __len__(self) -> int:
        return len(self._live)

    def open(self, stream: RequestStream) -> None:
        self._live[stream.rid] = _Live(stream, IncrementalDetokenizer(self.tokenizer),
                                       StopStringMatcher(stream.request.params.stop))

    def publish(self, req: Request) -> None:
        """Send what is new for `req`: its new tokens and the text that can no longer change, and
        its end once it has finished."""
        live = self._live.get(req.rid)
        if live is None:
            return
        new_ids = req.token_ids[req.prompt_len + live.sent_tokens :]
        if new_ids:
            now = time.monotonic()
            if live.sent_tokens == 0:
                queued = (req.admit_time or now) - req.arrival_time
                self.observer.on_first_token(queued, (req.first_token_time or now) - req.arrival_time)
            else:
                self.observer.on_tokens(now - live.last_token_time, len(new_ids))
            live.last_token_time = now
            self.generated += len(new_ids)
        live.sent_tokens += len(new_ids)
        for token in new_ids:
            live.detok.push(token)
        if req.finished:
            live.detok.flush()
        text = live.detok.text
        if live.stops.stops and not req.finished:
            hit = live.stops.find(text, live.released)
            if hit is not None:
                text = text[: hit[0]]
                self.finish(req, Finish("stop", matched=hit[1]))
        end = len(text) if req.finished else live.stops.safe_length(text)
        delta, live.released = text[live.released : end], max(live.released, end)
        n_new = len(new_ids)
        finish = req.finish
        out = StreamOutput(
            rid=req.rid,
            token_ids=new_ids,
            text=delta,
            prompt_tokens=req.prompt_len,
            completion_tokens=live.sent_tokens,
            cached_tokens=req.num_cached_prompt,
            finished=req.finished,
            finish_reason=finish.reason if finish else None,
            matched_stop=finish.matched if finish else None,
            error=finish.message if finish and finish.reason == "abort" else None,
            error_code=finish.code if finish else None,
            logprobs=req.output_logprobs[-n_new:] if n_new and req.output_logprobs else [],
            top_logprobs=req.output_top_logprobs[-n_new:] if n_new and req.output_top_logprobs else [],
        )
        if req.finished:
            self.finished += 1
            self.aborted += finish.reason == "abort"
            self.observer.on_finish(time.monotonic() - req.arrival_time)
            self._close(live, out)
        else:
            live.stream.put(out)

    def publish_ended(self) -> None:
        """The requests that ended without a new token (aborted, out of KV pages)."""
        for live in [lv for lv in self._live.values() if lv.stream.request.finished]:
            self.publish(live.stream.request)

    def close_all(self, error: str, code: str | None = None) -> None:
        """The engine stopped: end every open stream with finish_reason abort (`code`: the gRPC
        status name when the server failed them, None for a shutdown)."""
        for live in list(self._live.values()):
            self._close(live, StreamOutput(live.stream.rid, [], "", 0, 0, 0, True, "abort", error=error,
                                           error_code=code))

    def _close(self, live: _Live, final: StreamOutput) -> None:
        live.stream.close(final)
        del self._live[live.stream.rid]
        self.closed(live.stream.rid)
