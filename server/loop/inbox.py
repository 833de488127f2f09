"""The engine loop's inbox: what other threads ask of the loop, as typed messages.

Closed once the loop stops: from then on `put` raises, so nothing is left behind unanswered; the
messages still queued at that moment are handed back by `close` for the loop to end."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Union

from tandem.server.loop.intake import RequestStream


@dataclass(frozen=True)
class Add:
    """A validated request: stream its outputs."""

    stream: RequestStream


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Call:
    """Run `fn` on the loop thread, between scheduler calls; its result or error goes to `future`."""

    fn: Callable
    future: Future


@dataclass(frozen=True)
class Wake:
    """Look at the KV connector now (a peer answered, a transfer ended)."""


@dataclass(frozen=True)
class Stop:
    pass


Message = Union[Add, Abort, Call, Wake, Stop]


def handling(message: Message) -> str | None:
    """What applying `message` is doing, naming its request (for a crash's log and errors)."""
    if isinstance(message, Abort):
        return f"while aborting request {message.rid}"
    if isinstance(message, Add):
        return f"while adding request {message.stream.rid}"
    return None


class Inbox:
    def __init__(self):
        self._queue: queue.Queue[Message] = queue.Queue()
        self._lock = threading.Lock()  # orders `close` against `put`
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, message: Message) -> None:
        """Enqueue for the loop; raises RuntimeError once the loop has stopped."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            self._queue.put(message)

    def stop(self) -> None:
        """Ask the loop to stop (a no-op once it has)."""
        try:
            self.put(Stop())
        except RuntimeError:
            pass

    def get(self, timeout: float | None) -> Message | None:
        """The next message, waiting up to `timeout` seconds (None: forever, 0: not at all)."""
        try:
            return self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> list[Message]:
        """Refuse new messages; the ones still queued."""
        with self._lock:
            self._closed = True
        left = []
        while (message := self.get(0)) is not None:
            left.append(message)
        return left
