"""KVConnector: what a role plugs into the engine loop. The loop calls the same hooks for every
role; this base class is the colocated server (new requests go straight to the scheduler).

The contract runs one way each step: the loop hands `poll()` what the scheduler reports (the
requests that ended there, when the role takes them over, and the KV the running requests keep
for their output), and applies the ConnectorEvents it returns through the scheduler. A connector
never calls the scheduler, and never sets a request's status or finish: it says which requests
to admit, which arrived with their KV, which to abort, and which of its own ended, and why.

Ownership: a request the connector holds (a prefill's bootstrap or inflight queue, a decode's
prealloc and transfer queues, a decode's quarantine) is not in the scheduler. Pages and slots it
holds are in KVMemory like any other request's and are listed by `held()` for the integrity check.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.disagg.layout import KVBuffer, Writes
from tandem.server.scheduling.request import Finish, Request


class OtherRanks(Protocol):
    """Tensor-parallel ranks 1..N-1 of this server, as a connector on rank 0 sees them
    (`tandem.server.parallel.workers.RankPool`)."""

    parts: list[KVBuffer]  # their KV buffers, registered with their own Mooncake engines

    def write(self, rank: int, writes: list[Writes]) -> Future:
        """Have rank `rank` make `writes` from its buffer; the future ends when it has."""

    def relayout(self, pages: list[int]) -> None:
        """Have every rank turn `pages`, arrived head-major, token-major (before its next forward pass)."""


def own_part(transfer, kv_cache: PagedKVCache) -> KVBuffer:
    """Rank 0's KV buffer, registered with its Mooncake engine: the first of the server's parts."""
    return KVBuffer(transfer.register(kv_cache.buffer), kv_cache.num_pages, 0, kv_cache.num_kv_heads, transfer.session)


@dataclass
class ConnectorEvents:
    """What one poll asks of the loop, which applies it through the scheduler."""

    admit: list[Request] = field(default_factory=list)  # into the scheduler's waiting queue
    arrived: list[tuple[Request, int]] = field(default_factory=list)  # KV in place: run with this first token
    aborts: list[tuple[str, str, str | None]] = field(default_factory=list)  # (rid, message, code): end these
    ended: list[tuple[Request, Finish]] = field(default_factory=list)  # held here, ended (pages freed or quarantined)

    def end(self, req: Request, message: str, code: str | None) -> None:
        self.ended.append((req, Finish("abort", message=message, code=code)))


class KVConnector:
    role = "colocated"
    # The scheduler hands every request that ends there, with what it holds, to poll() (a
    # prefill still has to send its KV); otherwise it frees them itself.
    takes_finished = False
    # The most tokens a request generates on this role (a prefill makes the first one only).
    max_new_tokens: int | None = None

    def __init__(self, on_transfer: Callable[[float], None] = lambda seconds: None) -> None:
        self.on_transfer = on_transfer  # seconds one request's KV took to move
        self._new: list[Request] = []

    def check_request(self, req: Request) -> None:
        """On the caller's thread, before the request is queued: raise InvalidRequestError for a
        request this role can never serve."""

    def add(self, req: Request) -> None:
        """A new request (engine loop); the connector owns it until a poll admits it."""
        self._new.append(req)

    def poll(self, finished: list[Request], reserved_tokens: int) -> ConnectorEvents:
        """Advance the connector's queues. `finished`: requests that ended in the scheduler since
        the last poll, now this connector's (only with `takes_finished`); `reserved_tokens`: KV
        the running requests keep for their output, which admission must leave them."""
        events, self._new = ConnectorEvents(admit=self._new), []
        return events

    def abort(self, rid: str, message: str) -> Request | None:
        """Take a request the connector holds out of its queues (its pages freed, or quarantined
        while a peer may still write them); the loop ends it. None if it holds no such request."""
        req = next((r for r in self._new if r.rid == rid), None)
        if req is not None:
            self._new.remove(req)
        return req

    def has_work(self) -> bool:
        return bool(self._new)

    def drain(self) -> None:
        """The server is shutting down (SIGTERM): take no new work from peers; the requests in
        flight go on."""

    def drained(self) -> bool:
        """Nothing left that the server must finish or tell its peers before it exits."""
        return True

    def idle_wait(self) -> float | None:
        """How long the loop may sleep when the scheduler has nothing to run (None: until woken)."""
        return 0.0 if self._new else None

    def step_poll_interval(self) -> float | None:
        """How often the overlapped loop polls this connector while a step computes (None: when
        an inbox message comes): for work outside the engine that would otherwise wait a step."""
        return None

    def held(self) -> list[Request]:
        """Requests holding a slot outside the scheduler."""
        return []

    def stats(self) -> dict[str, int]:
        """EngineSnapshot fields this connector fills (queue lengths, transfer counters)."""
        return {}

    def close(self) -> None:
        pass


def deadline(seconds: float) -> float:
    return time.monotonic() + seconds
