"""Request intake, on the caller's thread: validation (every rejection names the field and the
limit) and the compiling of constraints, request ids and the bound on requests in flight, and the
caller's side of a request (RequestStream)."""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
import uuid
from typing import Callable, Iterator, Sequence

from tandem.server.config import EngineConfig
from tandem.server.loop.grammar import GrammarCompiler
from tandem.server.loop.outputs import CompletedOutput, StreamOutput
from tandem.server.scheduling.request import Request
from tandem.server.scheduling.sampling_params import CapacityError, InvalidRequestError, SamplingParams

_DONE = object()  # end-of-stream marker in a RequestStream's queue


class RequestStream:
    """A submitted request, seen from the caller: iterate for its StreamOutputs. The engine loop
    writes them (`put`, then `close`)."""

    def __init__(self, request: Request, abort: Callable[[str], None]):
        self.request = request
        self.rid = request.rid
        self._abort = abort
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def __iter__(self) -> Iterator[StreamOutput]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            yield item

    def put(self, output: StreamOutput) -> None:
        self._queue.put(output)

    def close(self, final: StreamOutput) -> None:
        self._queue.put(final)
        self._queue.put(_DONE)

    def abort(self) -> None:
        self._abort(self.rid)

    def result(self) -> CompletedOutput:
        """Wait for the end; the whole output."""
        ids, text, lps, tops, last = [], [], [], [], None
        for out in self:
            ids += out.token_ids
            text.append(out.text)
            lps += out.logprobs
            tops += out.top_logprobs
            last = out
        first = self.request.first_token_time  # stamped by the scheduler when the token was made
        return CompletedOutput(
            rid=self.rid,
            prompt_tokens=last.prompt_tokens,
            output_ids=ids,
            text="".join(text),
            finish_reason=last.finish_reason,
            matched_stop=last.matched_stop,
            error=last.error,
            error_code=last.error_code,
            cached_tokens=last.cached_tokens,
            logprobs=lps,
            top_logprobs=tops,
            time_to_first_token=None if first is None else first - self.request.arrival_time,
            latency=time.monotonic() - self.request.arrival_time,
        )


class Intake:
    """Turns a prompt and its parameters into a Request the engine can always serve, or raises
    InvalidRequestError / CapacityError; tracks the ids of the requests in flight (thread-safe)."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, context_length: int, pool_tokens: int,
                 eos_token_ids: frozenset[int], grammars: GrammarCompiler, max_new_tokens: int | None = None):
        self.config, self.tokenizer, self.vocab_size, self.grammars = config, tokenizer, vocab_size, grammars
        self.context_length, self.pool_tokens, self.eos_token_ids = context_length, pool_tokens, eos_token_ids
        self.max_new_tokens = max_new_tokens  # the role's cap (a prefill makes one token)
        self.limit = config.max_running_requests + config.max_queued_requests
        self._seeds = random.Random(config.seed)
        self._counter = itertools.count()
        self._lock = threading.Lock()  # guards _rids and _seeds
        self._rids: set[str] = set()

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, rid: str | None) -> Request:
        """Validate; nothing is allocated or registered for a rejected request."""
        vocab = self.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise InvalidRequestError("prompt_token_ids", f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty (0 tokens)")
        params.validate(vocab)
        n, ctx, pool = len(ids), self.context_length, self.pool_tokens
        if n >= ctx:
            raise InvalidRequestError(
                "prompt", f"{n} tokens leave no room for output in the context length {ctx} (at most {ctx - 1})"
            )
        if n >= pool:
            raise CapacityError(
                "prompt", f"{n} tokens do not fit the KV pool of {pool} tokens (--max-total-tokens; at most {pool - 1})"
            )
        max_new = min(params.max_new_tokens or self.config.default_max_new_tokens, min(ctx, pool) - n)
        if self.max_new_tokens is not None:
            max_new = min(max_new, self.max_new_tokens)
        # Last: compiling is the one check that may take a while (its result is cached by text).
        grammar = self.grammars.matcher(params.constraint) if params.constraint is not None else None
        with self._lock:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
            number = next(self._counter)
        return Request(
            rid=rid or f"req-{number}-{uuid.uuid4().hex[:8]}",
            token_ids=ids,
            prompt_len=n,
            params=params,
            max_new_tokens=max_new,
            eos_ids=self.eos_token_ids,
            sampling_seed=seed,
            grammar=grammar,
        )

    def register(self, rid: str) -> None:
        """Claim `rid` for a request in flight; refused when it is taken or the engine is full."""
        with self._lock:
            if rid in self._rids:
                raise InvalidRequestError("rid", f"request id {rid!r} is already in use")
            if len(self._rids) >= self.limit:
                raise CapacityError("queue", f"{len(self._rids)} requests in flight, the limit is {self.limit} "
                                             "(--max-queued-requests)")
            self._rids.add(rid)

    def release(self, rid: str) -> None:
        """The request ended (its stream is closed): its id may be used again."""
        with self._lock:
            self._rids.discard(rid)
