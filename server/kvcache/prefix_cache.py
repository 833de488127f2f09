"""Prefix caches: the radix tree over token ids, and the plain chunk cache used when it is disabled.

Both work in whole pages: a cached prefix always covers a multiple of `page_size` tokens, and the
cache owns the pages it holds. Requests pin what they use with `lock`; only unpinned pages can be
evicted, least recently used leaves first. The radix cache names each page by a hash chained over
the tokens up to it (`tandem.server.kvcache.kv_events`) and reports what it stores, evicts and clears to
an event recorder, from which routers learn where each prefix is cached.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, Sequence

from tandem.server.kvcache.kv_events import BlocksStored, block_hash, page_digests
from tandem.server.kvcache.page_allocator import PageAllocator


@dataclass
class PrefixMatch:
    pages: list[int]  # cached pages holding the first len(pages) * page_size tokens
    node: object  # handle to pass to lock/unlock; None when nothing matched


class PrefixCache(ABC):
    """Contract:
    - `match` returns the longest cached page-aligned prefix of `token_ids`; it takes no reference.
    - `lock(node)` pins the node and all its ancestors; `unlock` undoes exactly one `lock`.
      `unpinned_pages(node)` is what a `lock(node)` now would take out of `num_evictable`.
    - `insert(token_ids, pages)` takes ownership of `pages` for the page-aligned `token_ids`
      (len(token_ids) == len(pages) * page_size). It returns how many leading pages were already
      cached: the caller's pages in that range are duplicates, stay the caller's, and must be freed
      by the caller (except the ones identical to cached pages, which the caller got from `match`).
    - `evict(n)` frees up to `n` unpinned pages to the allocator and returns how many it freed.
    - `num_pages` is every page the cache owns, `num_evictable` those not pinned.
    """

    page_size: int

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> PrefixMatch: ...

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: list[int]) -> int: ...

    @abstractmethod
    def lock(self, node: object) -> None: ...

    @abstractmethod
    def unlock(self, node: object) -> None: ...

    @abstractmethod
    def unpinned_pages(self, node: object) -> int: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int: ...

    @abstractmethod
    def held_pages(self) -> list[int]: ...

    @abstractmethod
    def snapshot_events(self) -> list[BlocksStored]:
        """Every cached page as KV events (stored), each node after its parent."""

    @abstractmethod
    def reset(self) -> bool:
        """Drop every cached page if none is pinned; return whether it did."""

    @property
    @abstractmethod
    def num_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_evictable(self) -> int: ...

    @abstractmethod
    def check_integrity(self) -> None: ...


class EventRecorder(Protocol):
    """Where the radix cache reports its changes (`KvEventPublisher`)."""

    def stored(self, parent: int | None, hashes: list[int], token_ids: list[list[int]]) -> None: ...

    def removed(self, hashes: list[int]) -> None: ...

    def cleared(self) -> None: ...


class ChunkCache(PrefixCache):
    """No sharing: nothing is ever cached, `insert` reports no duplicates and keeps nothing.

    With it, a request owns all of its pages from admission to release."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch([], None)

    def insert(self, token_ids: Sequence[int], pages: list[int]) -> int:
        raise RuntimeError("ChunkCache keeps nothing; callers must not insert")

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def unpinned_pages(self, node: object) -> int:
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    def held_pages(self) -> list[int]:
        return []

    def snapshot_events(self) -> list[BlocksStored]:
        return []

    def reset(self) -> bool:
        return True

    @property
    def num_pages(self) -> int:
        return 0

    @property
    def num_evictable(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass


class _Node:
    __slots__ = ("key", "pages", "digests", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], digests: list[bytes], parent: "_Node | None"):
        self.key = key  # token ids on the edge from parent; len == len(pages) * page_size
        self.pages = pages
        self.digests = digests  # per page, chained over every token from the root to the page's end
        self.children: dict[tuple[int, ...], _Node] = {}  # first page of the child's key -> child
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class RadixCache(PrefixCache):
    """Radix tree over token ids, page-granular, with reference counts and LRU eviction."""

    def __init__(self, allocator: PageAllocator, page_size: int, events: EventRecorder | None = None):
        self.allocator = allocator
        self.page_size = page_size
        self.events = events
        self._clock = itertools.count(1)
        self.reset_tree()

    def reset_tree(self) -> None:
        self.root = _Node([], [], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._num_pages = 0
        self._num_evictable = 0

    # -- lookups ----------------------------------------------------------------------------------
    def _first_page(self, token_ids: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(token_ids[start : start + self.page_size])

    def _shared_pages(self, key: list[int], token_ids: Sequence[int], start: int) -> int:
        """How many whole pages of `key` equal token_ids[start:]."""
        P = self.page_size
        n = min(len(key), len(token_ids) - start) // P
        for i in range(n):
            if key[i * P : (i + 1) * P] != list(token_ids[start + i * P : start + (i + 1) * P]):
                return i
        return n

    def _walk(self, token_ids: Sequence[int]) -> tuple[_Node, list[int], int]:
        """Descend as far as whole pages match, splitting an edge that matches only in part.

        Returns the deepest node fully matched, the pages along the path, and the matched length."""
        node, pages, pos = self.root, [], 0
        now = next(self._clock)
        node.last_access = now
        while len(token_ids) - pos >= self.page_size:
            child = node.children.get(self._first_page(token_ids, pos))
            if child is None:
                break
            shared = self._shared_pages(child.key, token_ids, pos)
            if shared < len(child.pages):
                child = self._split(child, shared)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return node, pages, pos

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        node, pages, _ = self._walk(token_ids)
        return PrefixMatch(pages, node if node is not self.root else None)

    def _split(self, child: _Node, num_pages: int) -> _Node:
        """Cut child's edge after `num_pages` pages; returns the new upper node."""
        P = self.page_size
        upper = _Node(child.key[: num_pages * P], child.pages[:num_pages], child.digests[:num_pages], child.parent)
        upper.lock_ref = child.lock_ref  # every lock on child pins its ancestors too
        upper.last_access = child.last_access
        child.parent.children[tuple(upper.key[:P])] = upper
        child.key = child.key[num_pages * P :]
        child.pages = child.pages[num_pages:]
        child.digests = child.digests[num_pages:]
        child.parent = upper
        upper.children[tuple(child.key[:P])] = child
        return upper

    # -- insertion --------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: list[int]) -> int:
        P = self.page_size
        if len(token_ids) != len(pages) * P:
            raise ValueError(f"insert needs whole pages: {len(token_ids)} tokens for {len(pages)} pages of {P}")
        node, _, pos = self._walk(token_ids)
        if pos < len(token_ids):
            key = list(token_ids[pos:])
            new = _Node(key, pages[pos // P :], page_digests(self._last_digest(node), key, P), node)
            new.last_access = node.last_access
            node.children[tuple(new.key[:P])] = new
            self._num_pages += len(new.pages)
            self._num_evictable += len(new.pages)
            if self.events is not None:
                self.events.stored(*self._stored(new))
        return pos // P

    # -- events -----------------------------------------------------------------------------------
    @staticmethod
    def _last_digest(node: _Node) -> bytes | None:
        return node.digests[-1] if node.digests else None

    def _stored(self, node: _Node) -> tuple[int | None, list[int], list[list[int]]]:
        """(parent page's hash, the node's page hashes, the node's pages' token ids)."""
        P = self.page_size
        parent = self._last_digest(node.parent)
        return (None if parent is None else block_hash(parent), [block_hash(d) for d in node.digests],
                [node.key[i : i + P] for i in range(0, len(node.key), P)])

    def snapshot_events(self) -> list[BlocksStored]:
        events, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            events.append(BlocksStored(*self._stored(node)))
            stack.extend(node.children.values())
        return events

    # -- reference counts -------------------------------------------------------------------------
    def lock(self, node: object) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unpinned_pages(self, node: object) -> int:
        pages = 0
        while node is not None and node is not self.root:
            pages += len(node.pages) if node.lock_ref == 0 else 0
            node = node.parent
        return pages

    def unlock(self, node: object) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("prefix cache node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.pages)
            node = node.parent

    # -- eviction ---------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.pages)
            if self.events is not None:
                self.events.removed([block_hash(d) for d in leaf.digests])
            freed += len(leaf.pages)
            self._num_pages -= len(leaf.pages)
            self._num_evictable -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[tuple(leaf.key[: self.page_size])]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> bool:
        if self._num_evictable != self._num_pages:
            return False
        self.allocator.free(self.held_pages())
        self.reset_tree()
        if self.events is not None:
            self.events.cleared()
        return True

    # -- accounting -------------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def held_pages(self) -> list[int]:
        return [p for node in self._nodes() for p in node.pages]

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    def check_integrity(self) -> None:
        total = evictable = 0
        for node in self._nodes():
            assert node.pages and len(node.key) == len(node.pages) * self.page_size, "edge is not whole pages"
            assert node.digests == page_digests(self._last_digest(node.parent), node.key, self.page_size), "page hashes broken"
            assert node.parent.children[tuple(node.key[: self.page_size])] is node, "child keyed wrongly"
            # every lock on a descendant is also counted on each of its ancestors
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, "lock counts broken"
            total += len(node.pages)
            evictable += len(node.pages) if node.lock_ref == 0 else 0
        assert total == self._num_pages, f"page count drifted: {total} != {self._num_pages}"
        assert evictable == self._num_evictable, f"evictable count drifted: {evictable} != {self._num_evictable}"
