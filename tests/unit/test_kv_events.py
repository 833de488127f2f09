"""KV events: the radix cache announces every page it stores, evicts and clears, named by hashes
chained as SGLang's; the publisher batches them, replays from a cursor, snapshots for a new
subscriber and drops (never waits for) one that falls behind."""

from __future__ import annotations

import hashlib
import random
import struct
import threading

import pytest

from support.checks import cached_prefixes
from tandem.server.kvcache.kv_events import (
    AllCleared, BlocksRemoved, BlocksStored, CursorError, KvEventPublisher, SubscriberLimitError, block_hash, page_digests,
)
from tandem.server.kvcache.page_allocator import PageAllocator
from tandem.server.kvcache.prefix_cache import RadixCache

P = 4


class RouterIndex:
    """What a router rebuilds from the events: page hash -> (parent hash, the page's tokens), and
    from those, the token prefix each live page ends."""

    def __init__(self):
        self.pages: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, event) -> None:
        if isinstance(event, BlocksStored):
            parent = event.parent
            assert parent is None or parent in self.pages, "stored after a page the router does not know"
            for h, ids in zip(event.hashes, event.token_ids):
                assert h not in self.pages, "a live page announced twice"
                assert len(ids) == P
                self.pages[h] = (parent, tuple(ids))
                parent = h
        elif isinstance(event, BlocksRemoved):
            for h in event.hashes:
                assert h in self.pages, "removed a page never announced"
                del self.pages[h]
        else:
            assert isinstance(event, AllCleared)
            self.pages.clear()

    def prefixes(self) -> set[tuple[int, ...]]:
        def prefix(h):
            parent, ids = self.pages[h]
            return (prefix(parent) if parent is not None else ()) + ids
        return {prefix(h) for h in self.pages}


def insert(cache: RadixCache, tokens: list[int]) -> None:
    pages = cache.allocator.alloc(len(tokens) // P)
    already = cache.insert(tokens, pages)
    cache.allocator.free(pages[:already])


def test_page_hashes_chain_sha256_of_little_endian_ids_like_sglang():
    ids = list(range(1000, 1000 + 3 * P)) + [7]  # the partial page is not hashed
    digests = page_digests(None, ids, P)
    assert len(digests) == 3
    previous = b""
    for i, d in enumerate(digests):
        expected = hashlib.sha256(previous + b"".join(struct.pack("<I", t) for t in ids[i * P : (i + 1) * P])).digest()
        assert d == expected
        previous = d
    # SGLang's int64: the first 16 hex digits, signed
    assert block_hash(digests[0]) == struct.unpack(">q", bytes.fromhex(digests[0].hex()[:16]))[0]
    # chained: the same page after another prefix has another hash
    assert page_digests(digests[0], ids[:P], P)[0] != digests[0]
    assert page_digests(None, ids[P : 2 * P], P)[0] != digests[1]


def test_events_replayed_by_a_router_match_the_cache_through_splits_evictions_and_a_flush():
    publisher = KvEventPublisher()
    cache = RadixCache(PageAllocator(40), P, publisher)
    sub = publisher.subscribe(0, cache.snapshot_events)
    router = RouterIndex()
    batches = events = 0
    rng = random.Random(0)
    system_prompts = [[rng.randrange(50000) for _ in range(3 * P)] for _ in range(3)]
    for step in range(60):
        prompt = rng.choice(system_prompts)[: rng.choice([P, 2 * P, 3 * P])]
        insert(cache, prompt + [rng.randrange(50000) for _ in range(rng.choice([0, P, 2 * P]))])
        if cache.allocator.num_free < 8:
            assert cache.evict(rng.randrange(1, 6)) > 0
        if step == 40:
            assert cache.reset()
        publisher.publish()
        while (batch := sub.next(0)) is not None:
            batches += 1
            assert batch.sequence == batches
            for event in batch.events:
                router.apply(event)
                events += 1
        assert router.prefixes() == cached_prefixes(cache)
        cache.check_integrity()
    stats = publisher.stats()
    assert stats.batches == batches > 30 and stats.events == events and stats.subscribers == 1
    assert cached_prefixes(cache)  # the test ended with something cached to compare


def test_batches_are_numbered_from_one_and_a_cursor_resumes_where_it_left_off():
    publisher = KvEventPublisher(replay_batches=5)
    for i in range(8):
        publisher.removed([i])
        publisher.publish()
    publisher.publish()  # nothing recorded: no batch
    assert publisher.sequence == 8
    sub = publisher.subscribe(6, list)
    assert [sub.next(0).sequence for _ in range(3)] == [6, 7, 8] and sub.next(0) is None
    assert publisher.subscribe(3, list).next(0).sequence == 4  # the oldest kept follows 3: no gap
    assert publisher.subscribe(9, list).next(0) is None  # up to date: the next batch is 9
    with pytest.raises(CursorError, match="older than the batches kept"):
        publisher.subscribe(2, list)
    with pytest.raises(CursorError, match="ahead of this server's last batch 8"):
        publisher.subscribe(10, list)  # a cursor from before a restart


def test_a_new_subscriber_starts_with_a_snapshot_numbered_as_the_last_batch():
    publisher = KvEventPublisher()
    cache = RadixCache(PageAllocator(16), P, publisher)
    assert publisher.subscribe(0, cache.snapshot_events).next(0) is None  # nothing ever cached: nothing to say
    insert(cache, list(range(2 * P)))
    insert(cache, list(range(P)) + [9] * P)  # splits the first node
    # recorded, not yet published: the snapshot covers them and they never come again
    sub = publisher.subscribe(0, cache.snapshot_events)
    snapshot = sub.next(0)
    assert snapshot.sequence == publisher.sequence == 1 and snapshot.snapshot_pages == 3
    assert isinstance(snapshot.events[0], AllCleared)
    router = RouterIndex()
    for event in snapshot.events:
        router.apply(event)
    assert router.prefixes() == cached_prefixes(cache)
    publisher.publish()
    assert sub.next(0) is None


def test_a_stalled_subscriber_is_dropped_and_never_blocks_publishing():
    publisher = KvEventPublisher(queue_batches=3)
    stalled, reader = publisher.subscribe(0, list), publisher.subscribe(0, list)
    done = threading.Event()

    def publish_many():
        for i in range(50):
            publisher.removed([i])
            publisher.publish()
            reader.next(0)
        done.set()

    threading.Thread(target=publish_many, daemon=True).start()
    assert done.wait(10), "publishing waited for a subscriber"
    assert stalled.closed and "fell 3 KV event batches behind" in stalled.dropped
    assert stalled.next(0) is None
    assert reader.dropped is None and not reader.closed
    stats = publisher.stats()
    assert stats.subscribers == 1 and stats.subscribers_dropped == 1


def test_subscribers_are_bounded_and_leave_cleanly():
    publisher = KvEventPublisher(max_subscribers=2)
    a, b = publisher.subscribe(0, list), publisher.subscribe(0, list)
    with pytest.raises(SubscriberLimitError, match="2 KV event subscribers"):
        publisher.subscribe(0, list)
    a.close()
    assert publisher.stats().subscribers == 1 and publisher.stats().subscribers_dropped == 0
    publisher.close()
    assert b.closed and b.dropped is None and b.next(0) is None
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.subscribe(0, list)
