"""KVMemory: admission, growth, caching and release of request pages, with page ownership checked
after every operation (free + cached + owned by requests == total)."""

from __future__ import annotations

from support.requests import make_request
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Request


def admit(mem: KVMemory, req: Request, num_tokens: int | None = None) -> bool:
    ok = mem.admit(req, mem.match(req), req.num_tokens if num_tokens is None else num_tokens)
    mem.check_integrity()
    return ok


def compute(mem: KVMemory, req: Request, upto: int | None = None) -> None:
    """Pretend a forward pass wrote KV for the request's first `upto` tokens (default: all)."""
    req.num_computed = req.num_tokens if upto is None else upto
    mem.cache_computed(req)
    mem.check_integrity()


def release(mem: KVMemory, req: Request) -> None:
    mem.release(req)
    mem.check_integrity()


def assert_idle(mem: KVMemory) -> None:
    """Nothing held by requests: every page is free or cached and unpinned."""
    mem.check_integrity()
    assert mem.slots.num_free == mem.slots.num_slots
    assert mem.allocator.num_free + mem.cache.num_pages == mem.num_pages
    assert mem.cache.num_evictable == mem.cache.num_pages
    assert mem.available_pages == mem.num_pages


def test_admit_reserves_pages_and_a_slot():
    mem = KVMemory(num_pages=8, page_size=4, num_slots=2)
    req = make_request("a", list(range(10)))
    assert admit(mem, req)
    assert len(req.pages) == 3 and req.slot is not None
    assert req.cached_pages == 0 and req.num_computed == 0
    assert mem.allocator.num_free == 5
    assert mem.used_pages == 3
    release(mem, req)
    assert req.slot is None and req.pages == []
    assert_idle(mem)


def test_grow_is_all_or_nothing():
    mem = KVMemory(num_pages=4, page_size=4, num_slots=1)
    req = make_request("a", list(range(6)))
    assert admit(mem, req)
    assert mem.grow(req, 8) and len(req.pages) == 2, "8 tokens still fit two pages"
    assert mem.grow(req, 9) and len(req.pages) == 3
    mem.check_integrity()
    assert not mem.grow(req, 4 * 4 + 1), "17 tokens need 5 pages of a 4-page pool"
    assert len(req.pages) == 3 and mem.allocator.num_free == 1
    mem.check_integrity()
    release(mem, req)
    assert_idle(mem)


def test_cache_computed_hands_whole_pages_to_the_cache_and_pins_them():
    mem = KVMemory(num_pages=8, page_size=4, num_slots=2)
    req = make_request("a", list(range(10)))
    admit(mem, req)
    pages = list(req.pages)
    compute(mem, req, upto=6)
    assert req.cached_pages == 1 and mem.cache.num_pages == 1
    compute(mem, req)
    assert req.cached_pages == 2, "10 computed tokens are two whole pages"
    assert req.pages == pages, "no duplicates: the request keeps its page ids"
    assert mem.cache.num_pages == 2 and mem.cache.num_evictable == 0, "cached pages stay pinned while running"
    assert mem.slots.holder(req.slot) is req
    release(mem, req)
    assert mem.cache.num_pages == 2 and mem.cache.num_evictable == 2
    assert sorted(mem.cache.held_pages()) == sorted(pages[:2])
    assert_idle(mem)


def test_second_request_reuses_cached_prefix():
    mem = KVMemory(num_pages=8, page_size=4, num_slots=2)
    first = make_request("a", list(range(10)))
    admit(mem, first)
    compute(mem, first)
    cached = first.pages[:2]
    release(mem, first)

    second = make_request("b", list(range(8)) + [50, 51, 52])
    assert mem.match(second).pages == cached
    assert admit(mem, second)
    assert second.pages[:2] == cached and second.cached_pages == 2
    assert second.num_computed == 8, "the cached prefix counts as computed"
    assert len(second.pages) == 3
    assert mem.cache.num_evictable == 0, "the admitted request pins the prefix it uses"
    compute(mem, second)
    release(mem, second)
    assert mem.cache.num_pages == 2, "no new whole page beyond the shared two"
    assert_idle(mem)


def test_match_leaves_one_token_to_compute():
    mem = KVMemory(num_pages=8, page_size=4, num_slots=2)
    first = make_request("a", list(range(8)))
    admit(mem, first)
    compute(mem, first)
    release(mem, first)
    assert mem.cache.num_pages == 2
    again = make_request("b", list(range(8)))
    assert len(mem.match(again).pages) == 1, "a fully cached prompt must still run its last token"
    admit(mem, again)
    assert again.num_computed == 4 and again.pending == 4
    release(mem, again)
    assert_idle(mem)


def test_concurrent_identical_prompts_free_duplicate_pages():
    mem = KVMemory(num_pages=8, page_size=4, num_slots=2)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    admit(mem, a)
    admit(mem, b)  # nothing cached yet: b computes the same two pages on its own
    assert mem.allocator.num_free == 2
    compute(mem, a)
    b_own = list(b.pages)
    compute(mem, b)
    assert b.pages[:2] == a.pages[:2], "b now reads the cache's copy"
    assert b.pages[2] == b_own[2]
    assert mem.allocator.num_free == 4, "b's two duplicate pages went back to the free list"
    assert all(p in mem.allocator._free for p in b_own[:2])
    assert mem.slots.holder(b.slot) is b
    release(mem, a)
    assert mem.cache.num_evictable == 0, "b still pins the shared prefix"
    release(mem, b)
    assert mem.cache.num_pages == 2
    assert_idle(mem)


def test_admit_evicts_unpinned_cache_but_not_its_own_match():
    mem = KVMemory(num_pages=5, page_size=2, num_slots=2)
    for rid, prompt in (("shared", [1, 1, 2, 2, 3]), ("old", [9, 9, 9, 9, 9])):
        req = make_request(rid, prompt)
        admit(mem, req)
        compute(mem, req)
        release(mem, req)
    assert mem.cache.num_pages == 4 and mem.allocator.num_free == 1

    req = make_request("new", [1, 1, 2, 2, 7, 7, 7])
    assert admit(mem, req), "the two pages of `old` are evictable"
    assert req.cached_pages == 2 and len(req.pages) == 4
    assert mem.match(make_request("probe", [9, 9, 9, 9, 9])).pages == []
    release(mem, req)
    assert_idle(mem)


def test_admit_refused_when_only_its_own_match_could_be_evicted():
    mem = KVMemory(num_pages=4, page_size=2, num_slots=2)
    first = make_request("a", [1, 1, 2, 2, 3])
    admit(mem, first)
    compute(mem, first)
    release(mem, first)
    assert mem.cache.num_pages == 2 and mem.allocator.num_free == 2

    req = make_request("b", [1, 1, 2, 2, 4, 4, 4, 4, 4])  # 2 cached pages + 3 of its own > 4
    cached = mem.cache.held_pages()
    assert not admit(mem, req)
    assert mem.cache.held_pages() == cached, "admission evicted the prefix it was about to use"
    assert req.slot is None
    assert_idle(mem)


def test_refused_admission_changes_nothing():
    mem = KVMemory(num_pages=4, page_size=2, num_slots=1)
    holder = make_request("holder", [1, 1, 2, 2, 3])
    admit(mem, holder)
    compute(mem, holder)
    too_big = make_request("big", [1, 1, 2, 2] + [5] * 6)
    assert not admit(mem, too_big), "no slot left"
    release(mem, holder)

    free, evictable = mem.allocator.num_free, mem.cache.num_evictable
    assert not admit(mem, too_big), "needs 5 pages of a 4-page pool"
    assert too_big.slot is None and too_big.pages == []
    assert (mem.allocator.num_free, mem.cache.num_evictable) == (free, evictable)
    assert_idle(mem)


def test_flush_cache_refused_while_pinned():
    mem = KVMemory(num_pages=4, page_size=2, num_slots=1)
    req = make_request("a", [1, 2, 3, 4, 5])
    admit(mem, req)
    compute(mem, req)
    assert not mem.flush_cache()
    assert mem.cache.num_pages == 2
    release(mem, req)
    assert mem.flush_cache()
    assert mem.cache.num_pages == 0 and mem.allocator.num_free == 4
    assert_idle(mem)


def test_chunk_cache_owns_nothing_and_frees_everything():
    mem = KVMemory(num_pages=8, page_size=4, num_slots=2, prefix_cache=False)
    a = make_request("a", list(range(10)))
    admit(mem, a)
    compute(mem, a)
    assert a.cached_pages == 0 and mem.cache.num_pages == 0
    assert mem.grow(a, 13) and len(a.pages) == 4
    mem.check_integrity()
    b = make_request("b", list(range(10)))
    assert mem.match(b).pages == []
    admit(mem, b)
    assert not set(a.pages) & set(b.pages)
    assert mem.allocator.num_free == 1
    release(mem, a)
    release(mem, b)
    assert mem.allocator.num_free == 8
    assert_idle(mem)


def test_release_of_everything_returns_the_pool():
    mem = KVMemory(num_pages=16, page_size=2, num_slots=4)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [1, 2, 8, 8, 8], [9, 9, 9]]
    reqs = [make_request(str(i), p) for i, p in enumerate(prompts)]
    for req in reqs:
        assert admit(mem, req)
        compute(mem, req)
    for req in reqs:  # decode a few tokens each
        for token in (30, 31, 32):
            req.token_ids.append(token)
            assert mem.grow(req, req.num_tokens)
            compute(mem, req)
    for req in reqs:
        release(mem, req)
    assert mem.cache.num_pages > 0
    assert_idle(mem)
    assert mem.flush_cache()
    assert mem.allocator.num_free == 16


def test_reserve_for_transferred_kv_shares_the_cached_prefix_only_when_asked():
    """A decode's reservation: with reuse, the cached prefix is pinned and only the rest is fresh
    (the last page always arrives); when the KV never comes, releasing it leaves that prefix cached
    and frees only the fresh pages; once it came and the request ended, the rest joins the cache."""
    mem = KVMemory(num_pages=8, page_size=4, num_slots=3)
    first = make_request("a", list(range(12)))
    admit(mem, first)
    compute(mem, first)
    cached = list(first.pages[:2])
    release(mem, first)
    assert mem.cache.num_pages == 3

    whole = make_request("whole", list(range(12)))
    assert mem.reserve(whole, whole.prompt_len)
    assert whole.cached_pages == 0 and not set(whole.pages) & set(mem.cache.held_pages())

    lost = make_request("lost", list(range(12)))
    assert mem.reserve(lost, lost.prompt_len, reuse_prefix=True)
    assert lost.pages[:2] == cached and lost.cached_pages == 2 and len(lost.pages) == 3
    assert lost.pages[2] not in mem.cache.held_pages(), "the last page is the request's own: it arrives"
    mem.check_integrity()
    own, free_before = lost.pages[2], mem.allocator.num_free
    release(mem, lost)  # its KV never came: num_computed still counts the cached prefix only
    assert set(cached) <= set(mem.cache.held_pages()) and mem.cache.num_pages == 3, "the cached prefix stays"
    assert mem.allocator.num_free == free_before + 1 and own in mem.allocator._free, "only its own page is freed"

    follow_up = make_request("b", list(range(8)) + [60, 61, 62, 63, 64])
    assert mem.reserve(follow_up, follow_up.prompt_len, reuse_prefix=True)
    assert follow_up.pages[:2] == cached and len(follow_up.pages) == 4
    follow_up.num_computed = follow_up.prompt_len  # its KV arrived (the scheduler's add_prefilled)
    release(mem, whole)
    release(mem, follow_up)
    later = mem.match(make_request("c", list(range(8)) + [60, 61, 62, 63, 64, 99])).pages
    assert later[:2] == cached and len(later) == 3, "the transferred page joined the cache behind the prefix"
    assert_idle(mem)


def test_reserve_counts_what_it_takes_from_the_available_pages():
    """A reservation's cost: its fresh pages, plus the cached prefix it pins unless something else
    pins it already. It is refused when it would leave fewer than `keep_pages` available."""
    mem = KVMemory(num_pages=10, page_size=4, num_slots=4)
    first = make_request("a", list(range(12)))
    admit(mem, first)
    compute(mem, first)  # 3 cached pages, pinned by `first` while it runs
    assert mem.available_pages == 7
    twin = make_request("b", list(range(8)) + [70, 71, 72, 73, 74])  # shares 2 pages, needs 2 more
    assert mem.cache.unpinned_pages(mem.match(twin).node) == 0
    assert not mem.reserve(twin, twin.prompt_len, reuse_prefix=True, keep_pages=6), "2 fresh pages leave 5"
    assert twin.slot is None
    assert mem.reserve(twin, twin.prompt_len, reuse_prefix=True, keep_pages=5)
    assert mem.available_pages == 5 and twin.cached_pages == 2
    mem.check_integrity()
    release(mem, twin)
    release(mem, first)  # nothing pins the prefix now: pinning it costs its pages too
    assert mem.available_pages == 10
    again = make_request("c", list(range(8)) + [70, 71, 72, 73, 74])
    assert mem.cache.unpinned_pages(mem.match(again).node) == 2
    assert not mem.reserve(again, again.prompt_len, reuse_prefix=True, keep_pages=7), "2 fresh + 2 pinned leave 6"
    assert mem.reserve(again, again.prompt_len, reuse_prefix=True, keep_pages=6)
    assert mem.available_pages == 6
    release(mem, again)
    assert_idle(mem)
