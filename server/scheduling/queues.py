"""Where each request the scheduler holds is, and every change of its status: the half of
`Scheduler` that is not planning (the scheduler is its queues plus the planning over them).

    waiting   FIFO (a retracted request goes back first); holds no slot
    chunked   at most one: holds a slot, its prompt only partly computed
    running   hold a slot and have sampled at least once (or sample in the step being planned)
    finished  freed at once, or, with `hand_off`, kept in `handed_off` with what it holds until its
              next owner (a prefill's KV connector, which still has to send its KV) takes it

Requests other owners hold (a KV connector's queues) end through `end_elsewhere`: their status
changes here, their owner frees them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Finish, Request, Status


class RequestQueues:
    def __init__(self, memory: KVMemory, hand_off: bool = False):
        self.memory = memory
        self.hand_off = hand_off
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked: Request | None = None
        self.handed_off: list[Request] = []  # ended, still holding what they held (hand_off)

    def requests(self) -> Iterator[Request]:
        """Every request waiting, chunked or running."""
        yield from self.waiting
        if self.chunked is not None:
            yield self.chunked
        yield from self.running

    def holders(self) -> list[Request]:
        """The running and chunked requests: those that hold a slot and are planned for."""
        return self.running + ([self.chunked] if self.chunked is not None else [])

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def queued_prompt_tokens(self) -> int:
        """Tokens the waiting requests (and a partly prefilled one) still need prefilled."""
        return sum(r.pending for r in self.waiting) + (self.chunked.pending if self.chunked is not None else 0)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.handed_off)

    # -- status changes ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def admit(self, req: Request) -> None:
        """A waiting request got its slot and pages and is planned: running from now on (the caller
        makes it `chunked` instead where only part of its prompt fits)."""
        self.waiting.remove(req)
        req.status = Status.RUNNING

    def retract(self, req: Request) -> None:
        """Back to the front of the waiting queue; its computed prefix stays in the prefix cache."""
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self.memory.release(req)
        req.status = Status.WAITING
        req.num_retractions += 1
        self.waiting.appendleft(req)

    def abort(self, rid: str, message: str = "aborted", code: str | None = None) -> Request | None:
        """End a request wherever it is and free what it holds. Unknown ids return None."""
        for req in self.requests():
            if req.rid == rid:
                self.finish(req, Finish("abort", message=message, code=code))
                return req
        return None

    def finish(self, req: Request, finish: Finish) -> None:
        """End a request (once: a finished one keeps its first finish) and free or hand off what it holds."""
        if req.finished:
            return
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        req.status = Status.FINISHED
        req.finish = finish
        req.sampling = 0  # a sample still in flight is dropped at its update
        if self.hand_off:
            self.handed_off.append(req)
        else:
            self.memory.release(req)

    @staticmethod
    def end_elsewhere(req: Request, finish: Finish) -> None:
        """End a request another owner holds (in a KV connector's queues, never in these): only its
        status and finish change; its owner frees what it holds."""
        req.status = Status.FINISHED
        req.finish = finish

    def take_handed_off(self) -> list[Request]:
        """The requests that ended since the last call, with what they hold (`hand_off`): from now
        on the caller's to free."""
        taken, self.handed_off = self.handed_off, []
        return taken

    def check_integrity(self, held_elsewhere: list[Request] = ()) -> None:
        """`held_elsewhere`: requests holding slots outside the scheduler (a KV connector's)."""
        self.memory.check_integrity()
        holders = self.holders() + list(held_elsewhere) + [r for r in self.handed_off if r.slot is not None]
        assert len(holders) == len({r.rid for r in holders}), "a request is running twice"
        assert all(r.slot is None for r in self.waiting), "a waiting request holds a slot"
        assert self.memory.slots.num_free == self.memory.slots.num_slots - len(holders), "slots leaked"
