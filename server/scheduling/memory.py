"""KV memory: request-level operations over the page allocator, the slot table and the prefix cache.

Ownership, per page, at every moment: free in the allocator, owned by the prefix cache, or owned
by exactly one running request. A running request's `pages[:cached_pages]` are the prefix cache's
(pinned through `cache_node`), `pages[cached_pages:]` its own. Integrity:
free + cached + owned by requests == total.
"""

from __future__ import annotations

from tandem.server.kvcache.page_allocator import PageAllocator
from tandem.server.kvcache.prefix_cache import ChunkCache, EventRecorder, PrefixCache, PrefixMatch, RadixCache
from tandem.server.kvcache.slot_table import SlotTable
from tandem.server.scheduling.request import Request


class KVMemory:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, prefix_cache: bool = True,
                 events: EventRecorder | None = None):
        """`events`: where the radix cache reports what it stores and drops (KV events)."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.slots: SlotTable[Request] = SlotTable(num_slots)
        self.cache: PrefixCache = (RadixCache(self.allocator, page_size, events) if prefix_cache
                                   else ChunkCache(self.allocator, page_size))

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def total_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    @property
    def available_pages(self) -> int:
        """Pages that could be handed out now: free, or cached and evictable."""
        return self.allocator.num_free + self.cache.num_evictable

    @property
    def used_pages(self) -> int:
        """Pages pinned by running requests or owned by them (not free, not evictable)."""
        return self.num_pages - self.available_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- admission --------------------------------------------------------------------------------
    def match(self, req: Request) -> PrefixMatch:
        """Longest cached prefix usable by `req`: at least one token must stay to compute, so that
        the forward pass produces logits for the next position."""
        limit = (req.num_tokens - 1) // self.page_size * self.page_size
        return self.cache.match(req.token_ids[:limit])

    def admit(self, req: Request, match: PrefixMatch, num_tokens: int) -> bool:
        """Give `req` a slot, pin its cached prefix and reserve pages for positions [0, num_tokens).
        All or nothing: on False nothing changed."""
        if self.slots.num_free == 0:
            return False
        self.cache.lock(match.node)  # before allocating: eviction must not take the match
        need = self.pages_for(num_tokens) - len(match.pages)
        new = self._alloc(need)
        if new is None:
            self.cache.unlock(match.node)
            return False
        req.pages = list(match.pages) + new
        req.cached_pages = len(match.pages)
        req.cache_node = match.node
        req.num_computed = len(match.pages) * self.page_size
        req.slot = self.slots.acquire(req)
        return True

    def reserve(self, req: Request, num_tokens: int, reuse_prefix: bool = False, keep_pages: int = 0) -> bool:
        """Give `req` a slot and pages for positions [0, num_tokens): a decode server's destination
        for transferred KV. With `reuse_prefix`, the longest cached prefix of its prompt (as `match`
        finds it: at least one page left to arrive) is pinned and shared, `req.cached_pages` long,
        and only the pages after it are fresh; otherwise all are. Refused when it would leave fewer
        than `keep_pages` available (a prefix other requests pin already costs nothing). All or
        nothing."""
        match = self.match(req) if reuse_prefix else self.cache.match([])
        cost = self.pages_for(num_tokens) - len(match.pages) + self.cache.unpinned_pages(match.node)
        if self.available_pages - cost < keep_pages:
            return False
        return self.admit(req, match, num_tokens)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make `req`'s pages cover positions [0, num_tokens). All or nothing."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        new = self._alloc(need)
        if new is None:
            return False
        req.pages.extend(new)
        return True

    def _alloc(self, n: int) -> list[int] | None:
        if n > self.allocator.num_free:
            self.cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    # -- caching and release ----------------------------------------------------------------------
    def cache_computed(self, req: Request) -> None:
        """Hand the whole pages of `req`'s cacheable tokens (`Request.num_cacheable`: computed, or
        being computed, with known ids) to the prefix cache and pin them for it. Safe at any moment,
        a step in flight or not."""
        if isinstance(self.cache, ChunkCache):
            return
        n = req.num_cacheable // self.page_size
        if n <= req.cached_pages:
            return
        keys = req.token_ids[: n * self.page_size]
        already = self.cache.insert(keys, req.pages[:n])
        # req.pages[cached_pages:already] duplicate what the cache held: swap in the cache's pages.
        match = self.cache.match(keys)
        assert len(match.pages) == n, "prefix cache lost pages it just took"
        duplicates = req.pages[req.cached_pages : max(already, req.cached_pages)]
        self.cache.lock(match.node)
        self.cache.unlock(req.cache_node)
        req.pages[:n] = match.pages
        req.cached_pages = n
        req.cache_node = match.node
        self.allocator.free(duplicates)

    def release(self, req: Request) -> None:
        """Give back everything `req` holds; its computed prefix stays cached (unpinned)."""
        if req.slot is None:
            return
        self.cache_computed(req)
        self.cache.unlock(req.cache_node)
        self.allocator.free(req.pages[req.cached_pages :])
        self.slots.release(req.slot)
        req.slot, req.pages, req.cached_pages, req.cache_node, req.num_computed = None, [], 0, None, 0

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while running requests pin part of it."""
        return self.cache.reset()

    # -- accounting -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        self.slots.check_integrity()
        self.cache.check_integrity()
        free = set(self.allocator._free)
        cached = self.cache.held_pages()
        holders = self.slots.holders()
        owned = [p for r in holders for p in r.pages[r.cached_pages :]]
        cached_set, owned_set = set(cached), set(owned)
        assert len(cached_set) == len(cached), "the prefix cache holds a page twice"
        assert len(owned_set) == len(owned), "two requests own the same page"
        assert not (free & cached_set) and not (free & owned_set) and not (cached_set & owned_set), (
            "a page has two owners"
        )
        assert len(free) + len(cached) + len(owned) == self.num_pages, (
            f"pages leaked: free {len(free)} + cached {len(cached)} + owned {len(owned)} != {self.num_pages}"
        )
        for r in holders:
            assert set(r.pages[: r.cached_pages]) <= cached_set, f"request {r.rid} pins pages the cache lost"
            assert self.slots.holder(r.slot) is r, f"slot {r.slot} is not {r.rid}'s"
            check_counts(r, self.page_size)


def check_counts(req: Request, page_size: int) -> None:
    """What a request holding a slot may say of itself at any moment, a step in flight or not
    (Request's rule): its pages cover what is computed, its cached pages only known tokens."""
    known, computed = len(req.token_ids), req.num_computed
    assert computed <= known + 1 and (req.finished or computed <= req.num_tokens), (
        f"request {req.rid}: {computed} tokens computed, {known} known, {req.sampling} being sampled"
    )
    assert req.cached_pages * page_size <= req.num_cacheable, (
        f"request {req.rid} pins {req.cached_pages} cached pages for {req.num_cacheable} cacheable tokens"
    )
    assert len(req.pages) * page_size >= computed, (
        f"request {req.rid}: {computed} tokens computed in {len(req.pages)} pages of {page_size}"
    )
