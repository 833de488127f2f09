"""KV cache events: what the prefix cache stored and dropped, page by page, for routers that route
on where a prefix is cached (smg's cache-aware policy, through `SubscribeKvEvents`).

The radix cache records events as it changes (on the engine thread); once per scheduler step the
engine publishes what was recorded as one batch with the next sequence number (1, 2, ...). Each
subscriber has a bounded queue: publishing never waits for one, and a subscriber that falls
`queue_batches` behind is dropped and told why. The last `replay_batches` batches are kept, so a
subscriber that reconnects with the sequence number it last applied gets what it missed; one
whose cursor is older than that, or from before a restart, is refused (`CursorError`) and starts
again from 0, which opens with a snapshot of the cache: all-cleared, then every cached page.

Pages are named as SGLang's radix cache names them: the hash of a page chains the previous page's
digest with the page's token ids (SHA-256 over the digest, then each id as 4 little-endian bytes),
read as a signed 64-bit integer; the first page of a sequence starts from no digest. Plain Python
objects here; the gRPC servicer turns them into protobuf.
"""

from __future__ import annotations

import hashlib
import queue
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence, Union


def page_digests(previous: bytes | None, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Digests of the whole pages of `token_ids`, chained from `previous` (None: the first page)."""
    digests = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256()
        if previous is not None:
            h.update(previous)
        h.update(struct.pack(f"<{page_size}I", *token_ids[start : start + page_size]))
        previous = h.digest()
        digests.append(previous)
    return digests


def block_hash(digest: bytes) -> int:
    """A page's digest as the signed 64-bit block hash events carry."""
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass(frozen=True)
class BlocksStored:
    """Consecutive pages newly cached after the page `parent` (None: from the start of a sequence)."""

    parent: int | None
    hashes: list[int]
    token_ids: list[list[int]]  # one page's ids per hash


@dataclass(frozen=True)
class BlocksRemoved:
    hashes: list[int]


@dataclass(frozen=True)
class AllCleared:
    pass


Event = Union[BlocksStored, BlocksRemoved, AllCleared]


@dataclass(frozen=True)
class EventBatch:
    sequence: int
    timestamp: float
    events: list[Event]
    snapshot_pages: int | None = None  # set on a snapshot: every page the cache held


class CursorError(Exception):
    """A subscriber's start sequence number cannot be resumed from: start again from 0."""


class SubscriberLimitError(Exception):
    pass


@dataclass
class PublisherStats:
    batches: int = 0
    events: int = 0
    subscribers: int = 0
    subscribers_dropped: int = 0


class Subscription:
    """One subscriber's view: `next(timeout)` gives the next batch, or None after `timeout` seconds
    without one, after `close()`, or once dropped (then `dropped` says why)."""

    def __init__(self, publisher: "KvEventPublisher", queue_batches: int):
        self._publisher = publisher
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(queue_batches)
        self.dropped: str | None = None
        self.closed = False

    def next(self, timeout: float) -> EventBatch | None:
        if self.closed:
            return None
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._publisher._remove(self)

    def _offer(self, batch: EventBatch) -> bool:
        try:
            self._queue.put_nowait(batch)
            return True
        except queue.Full:
            return False

    def _end(self, reason: str | None) -> None:
        self.dropped, self.closed = reason, True
        try:
            self._queue.put_nowait(None)  # wake a reader blocked in next()
        except queue.Full:
            pass  # a full queue wakes its reader anyway: it has batches to take first


class KvEventPublisher:
    """Recording and publishing run on the engine thread; subscriptions end and stats are read
    from any thread."""

    def __init__(self, replay_batches: int = 4096, queue_batches: int = 1024, max_subscribers: int = 64):
        self.queue_batches = queue_batches
        self.max_subscribers = max_subscribers
        self._pending: list[Event] = []
        self._history: deque[EventBatch] = deque(maxlen=replay_batches)
        self._subscribers: list[Subscription] = []
        self._sequence = 0
        self._lock = threading.Lock()
        self._stats = PublisherStats()
        self._closed = False

    # -- recording (the prefix cache, engine thread) -----------------------------------------------
    def stored(self, parent: int | None, hashes: list[int], token_ids: list[list[int]]) -> None:
        self._pending.append(BlocksStored(parent, hashes, token_ids))

    def removed(self, hashes: list[int]) -> None:
        self._pending.append(BlocksRemoved(hashes))

    def cleared(self) -> None:
        self._pending.append(AllCleared())

    # -- publishing (engine thread) ----------------------------------------------------------------
    def publish(self) -> None:
        """What was recorded since the last call, as the next batch, to every subscriber."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        with self._lock:
            self._sequence += 1
            batch = EventBatch(self._sequence, time.time(), events)
            self._history.append(batch)
            self._stats.batches += 1
            self._stats.events += len(events)
            for sub in list(self._subscribers):
                if not sub._offer(batch):
                    self._drop(sub, f"fell {self.queue_batches} KV event batches behind (at sequence "
                                    f"{batch.sequence}); resubscribe from 0 for a snapshot")

    def subscribe(self, start: int, snapshot: Callable[[], list[Event]]) -> Subscription:
        """A new subscriber from sequence `start` on (engine thread, between steps): 0 for the
        cache as it is now (`snapshot()`: its stored pages, parents first) and what follows; else
        the kept batches numbered `start` and later, then what follows."""
        self.publish()  # what the snapshot shows must not come again as a later batch
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            if len(self._subscribers) >= self.max_subscribers:
                raise SubscriberLimitError(f"{self.max_subscribers} KV event subscribers already (the limit)")
            first: list[EventBatch] = []
            if start == 0:
                if self._sequence:
                    events = [AllCleared(), *snapshot()]
                    pages = sum(len(e.hashes) for e in events if isinstance(e, BlocksStored))
                    first.append(EventBatch(self._sequence, time.time(), events, snapshot_pages=pages))
            else:
                oldest = self._history[0].sequence if self._history else self._sequence + 1
                if start > self._sequence + 1:
                    raise CursorError(f"start_sequence_number {start} is ahead of this server's last batch "
                                      f"{self._sequence} (it restarted?): subscribe from 0 for a snapshot")
                if start < oldest - 1:
                    raise CursorError(f"start_sequence_number {start} is older than the batches kept for replay "
                                      f"({oldest}-{self._sequence}): subscribe from 0 for a snapshot")
                first = [batch for batch in self._history if batch.sequence >= start]
            sub = Subscription(self, self.queue_batches + len(first))
            for batch in first:
                sub._offer(batch)
            self._subscribers.append(sub)
            self._stats.subscribers = len(self._subscribers)
        return sub

    def close(self) -> None:
        """The engine stopped: every subscription ends (cleanly, not dropped)."""
        with self._lock:
            self._closed = True
            for sub in self._subscribers:
                sub._end(None)
            self._subscribers.clear()
            self._stats.subscribers = 0

    # -- any thread --------------------------------------------------------------------------------
    @property
    def sequence(self) -> int:
        return self._sequence

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(**vars(self._stats))

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
                self._stats.subscribers = len(self._subscribers)
            sub.closed = True

    def _drop(self, sub: Subscription, reason: str) -> None:
        self._subscribers.remove(sub)
        self._stats.subscribers = len(self._subscribers)
        self._stats.subscribers_dropped += 1
        sub._end(reason)
