"""KVConnector: what a role plugs into the engine loop. The loop calls the same hooks for every
role; this base class is the colocated server (no connector work at all).

Ownership: a request the connector holds (a prefill's bootstrap or inflight queue, a decode's
prealloc and transfer queues) is not in the scheduler. Pages and slots it holds are in KVMemory
like any other request's and are listed by `held()` for the integrity check.
"""

from __future__ import annotations

import time
from typing import Callable

from tandem.server.request import Finish, Request, Status


class KVConnector:
    role = "colocated"

    def __init__(self) -> None:
        self.scheduler = None  # set by attach()
        self.on_transfer: Callable[[float], None] = lambda seconds: None

    def attach(self, scheduler) -> None:
        self.scheduler = scheduler

    def check_request(self, req: Request) -> None:
        """On the caller's thread, before the request is queued: raise InvalidRequestError for a
        request this role can never serve; may adjust the request (a prefill makes one token)."""

    def add(self, req: Request) -> None:
        """A new request (engine loop)."""
        self.scheduler.add(req)

    def keep_kv(self, req: Request) -> bool:
        """The scheduler ended `req`; True takes its pages over (see Scheduler)."""
        return False

    def poll(self) -> list[Request]:
        """Advance the connector's queues; returns the requests that got output or ended."""
        return []

    def abort(self, rid: str, message: str) -> Request | None:
        """End a request the connector holds; None if it holds no such request."""
        return None

    def has_work(self) -> bool:
        return False

    def drain(self) -> None:
        """The server is shutting down (SIGTERM): take no new work from peers; the requests in
        flight go on."""

    def drained(self) -> bool:
        """Nothing left that the server must finish or tell its peers before it exits."""
        return True

    def idle_wait(self) -> float | None:
        """How long the loop may sleep when the scheduler has nothing to run (None: until woken)."""
        return None

    def held(self) -> list[Request]:
        """Requests holding a slot outside the scheduler."""
        return []

    def stats(self) -> dict[str, int]:
        """EngineSnapshot fields this connector fills (queue lengths, transfer counters)."""
        return {}

    def close(self) -> None:
        pass


def end(req: Request, message: str, code: str | None) -> Request:
    """Finish a request held outside the scheduler (it holds no slot, or its owner frees it)."""
    req.status = Status.FINISHED
    req.finish = Finish("abort", message=message, code=code)
    return req


def deadline(seconds: float) -> float:
    return time.monotonic() + seconds
