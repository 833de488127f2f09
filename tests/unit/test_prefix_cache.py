"""RadixCache and ChunkCache: page-granular matching, splitting, pinning and LRU eviction."""

from __future__ import annotations

import pytest

from tandem.server.kvcache.page_allocator import PageAllocator
from tandem.server.kvcache.prefix_cache import ChunkCache, RadixCache


def make_cache(page_size: int, num_pages: int = 32) -> RadixCache:
    return RadixCache(PageAllocator(num_pages), page_size)


def insert(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert `tokens` (whole pages) on freshly allocated pages, freeing any the cache already held,
    as KVMemory does. Returns the pages the cache now holds for `tokens`."""
    pages = cache.allocator.alloc(len(tokens) // cache.page_size)
    already = cache.insert(tokens, pages)
    cache.allocator.free(pages[:already])
    return cache.match(tokens).pages


def assert_all_accounted(cache: RadixCache) -> None:
    cache.check_integrity()
    assert cache.allocator.num_free + cache.num_pages == cache.allocator.num_pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_full_match(page_size):
    cache = make_cache(page_size)
    tokens = list(range(100, 100 + 3 * page_size))
    pages = insert(cache, tokens)
    assert len(pages) == 3
    match = cache.match(tokens)
    assert match.pages == pages
    assert match.node is not None
    assert cache.num_pages == cache.num_evictable == 3
    assert_all_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_only_whole_pages(page_size):
    cache = make_cache(page_size)
    tokens = list(range(3 * page_size))
    pages = insert(cache, tokens)
    # a longer query matches what is cached; a query one token short of two pages matches one page
    assert cache.match(tokens + [999] * page_size).pages == pages
    assert cache.match(tokens[: 2 * page_size - 1]).pages == pages[: (2 * page_size - 1) // page_size]
    assert_all_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_no_match(page_size):
    cache = make_cache(page_size)
    insert(cache, list(range(2 * page_size)))
    miss = cache.match([77] * (2 * page_size))
    assert miss.pages == [] and miss.node is None
    short = cache.match(list(range(page_size - 1)))  # less than a page can never match
    assert short.pages == [] and short.node is None
    assert cache.match([]).pages == []
    assert_all_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_partial_match_splits_edge_at_page_boundary(page_size):
    cache = make_cache(page_size)
    tokens = list(range(4 * page_size))
    pages = insert(cache, tokens)
    assert len(cache.root.children) == 1
    edge = next(iter(cache.root.children.values()))
    assert len(edge.pages) == 4, "one insert makes one edge"

    query = tokens[: 2 * page_size] + [999] * page_size
    match = cache.match(query)
    assert match.pages == pages[:2]
    upper = next(iter(cache.root.children.values()))
    assert upper is match.node
    assert upper.key == tokens[: 2 * page_size] and upper.pages == pages[:2]
    (lower,) = upper.children.values()
    assert lower.key == tokens[2 * page_size :] and lower.pages == pages[2:]
    # the split changed no ownership
    assert cache.num_pages == cache.num_evictable == 4
    assert cache.match(tokens).pages == pages
    assert_all_accounted(cache)


def test_split_inside_a_page_rounds_down():
    cache = make_cache(4)
    tokens = list(range(12))
    pages = insert(cache, tokens)
    # diverges at token 6: the shared whole pages are the first one only
    match = cache.match(tokens[:6] + [999] * 6)
    assert match.pages == pages[:1]
    assert [n.key for n in cache.root.children.values()] == [tokens[:4]]
    assert_all_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_reports_already_cached_pages(page_size):
    cache = make_cache(page_size)
    P = page_size
    first = list(range(3 * P))
    insert(cache, first)
    second = first[: 2 * P] + [500] * (2 * P)
    pages = cache.allocator.alloc(4)
    assert cache.insert(second, pages) == 2
    cache.allocator.free(pages[:2])  # duplicates stay the caller's
    assert cache.num_pages == 5
    assert cache.match(second).pages[2:] == pages[2:], "the cache took the new tail pages"
    assert cache.insert(first, cache.match(first).pages) == 3, "re-inserting a cached prefix adds nothing"
    assert cache.num_pages == 5
    assert_all_accounted(cache)


def test_insert_needs_whole_pages():
    cache = make_cache(4)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3], [0])
    assert cache.num_pages == 0
    assert_all_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_lock_pins_node_and_ancestors(page_size):
    cache = make_cache(page_size)
    P = page_size
    trunk = list(range(2 * P))
    insert(cache, trunk + [1000] * P)
    branch = trunk + [2000] * P
    insert(cache, branch)  # splits: trunk (2 pages) with two one-page leaves
    assert cache.num_pages == 4
    node = cache.match(branch).node
    cache.lock(node)
    assert cache.num_evictable == 1, "only the other leaf stays evictable"
    cache.lock(node)
    assert cache.num_evictable == 1
    assert cache.evict(100) == 1
    assert cache.match(branch).pages != [] and len(cache.match(branch).pages) == 3
    assert cache.match(trunk + [1000] * P).pages == cache.match(trunk).pages
    cache.unlock(node)
    assert cache.num_evictable == 0, "one lock is still held"
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.num_evictable == cache.num_pages == 3
    assert_all_accounted(cache)


def test_lock_survives_a_later_split():
    cache = make_cache(1)
    tokens = [1, 2, 3, 4]
    insert(cache, tokens)
    node = cache.match(tokens).node
    cache.lock(node)
    cache.match([1, 2, 9])  # splits the locked edge
    assert cache.num_evictable == 0
    cache.check_integrity()
    cache.unlock(node)
    assert cache.num_evictable == 4
    assert_all_accounted(cache)


def test_unlock_more_than_lock_raises():
    cache = make_cache(1)
    insert(cache, [1, 2])
    node = cache.match([1, 2]).node
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(RuntimeError, match="unlocked more often than locked"):
        cache.unlock(node)
    cache.lock(None)  # nothing matched: a no-op
    cache.unlock(None)
    assert_all_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_evicts_least_recently_used_leaf_first(page_size):
    cache = make_cache(page_size)
    P = page_size
    old, new = [1] * P + [2] * P, [3] * P + [4] * P
    old_pages = insert(cache, old)
    insert(cache, new)
    cache.match(old)  # touching `old` makes `new` the least recently used
    free_before = cache.allocator.num_free
    assert cache.evict(1) == 2, "eviction frees a whole leaf"
    assert sorted(cache.held_pages()) == sorted(old_pages)
    assert cache.allocator.num_free == free_before + 2
    assert cache.match(new).pages == []
    assert cache.match(old).pages == old_pages
    assert_all_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_parent_evictable_after_its_last_child(page_size):
    cache = make_cache(page_size)
    P = page_size
    trunk = [5] * P
    a, b, other = trunk + [6] * P, trunk + [7] * P, [8] * P
    (trunk_page, a_page), (_, b_page), (other_page,) = insert(cache, a), insert(cache, b), insert(cache, other)
    # access order, oldest first: a, b (and the trunk with it), other
    cache.match(a)
    cache.match(b)
    cache.match(other)
    held = set(cache.held_pages())
    assert held == {trunk_page, a_page, b_page, other_page}
    assert cache.num_evictable == 4

    # the trunk is older than `other` but is no leaf until both its children are gone
    for gone in (a_page, b_page, trunk_page, other_page):
        assert cache.evict(1) == 1
        held.remove(gone)
        assert set(cache.held_pages()) == held, f"expected page {gone} evicted next"
        assert cache.num_pages == cache.num_evictable == len(held)
        cache.check_integrity()
    assert cache.evict(1) == 0
    assert_all_accounted(cache)


def test_evicting_children_cascades_to_parent_in_one_call():
    cache = make_cache(1)
    insert(cache, [1, 2, 3])
    insert(cache, [1, 2, 4])
    assert cache.evict(4) == 4, "both leaves, then the trunk they leave behind"
    assert cache.num_pages == 0
    assert_all_accounted(cache)


def test_evict_skips_locked_leaves_and_reports_shortfall():
    cache = make_cache(2, num_pages=8)
    kept, dropped = [1, 1, 2, 2], [3, 3, 4, 4]
    insert(cache, kept)
    insert(cache, dropped)
    node = cache.match(kept).node
    cache.lock(node)
    assert cache.evict(10) == 2, "only the unpinned leaf can go"
    assert len(cache.match(kept).pages) == 2
    assert cache.num_pages == 2 and cache.num_evictable == 0
    cache.unlock(node)
    assert_all_accounted(cache)


def test_reset_refused_while_locked():
    cache = make_cache(4)
    tokens = list(range(8))
    insert(cache, tokens)
    node = cache.match(tokens).node
    cache.lock(node)
    assert cache.reset() is False
    assert cache.num_pages == 2
    cache.unlock(node)
    assert cache.reset() is True
    assert cache.num_pages == cache.num_evictable == 0
    assert cache.allocator.num_free == cache.allocator.num_pages
    assert cache.match(tokens).pages == []
    assert_all_accounted(cache)


def test_chunk_cache_keeps_nothing():
    allocator = PageAllocator(4)
    cache = ChunkCache(allocator, 2)
    match = cache.match([1, 2, 3, 4])
    assert match.pages == [] and match.node is None
    with pytest.raises(RuntimeError, match="keeps nothing"):
        cache.insert([1, 2], [0])
    cache.lock(None)
    cache.unlock(None)
    assert cache.evict(4) == 0
    assert cache.num_pages == cache.num_evictable == 0
    assert cache.held_pages() == []
    assert cache.reset() is True
    assert allocator.num_free == 4
    cache.check_integrity()
