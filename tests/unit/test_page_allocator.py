"""PageAllocator and SlotTable: the free lists under KV memory."""

from __future__ import annotations

import pytest

from tandem.server.kvcache.page_allocator import PageAllocator
from tandem.server.kvcache.slot_table import SlotTable


def test_alloc_hands_out_distinct_pages_until_empty():
    alloc = PageAllocator(4)
    first, second = alloc.alloc(3), alloc.alloc(1)
    assert sorted(first + second) == [0, 1, 2, 3]
    assert alloc.num_free == 0
    assert alloc.alloc(1) is None
    alloc.check_integrity()


def test_alloc_is_all_or_nothing():
    alloc = PageAllocator(4)
    held = alloc.alloc(2)
    assert alloc.alloc(3) is None
    assert alloc.num_free == 2, "a refused alloc took pages"
    assert sorted(alloc.alloc(2) + held) == [0, 1, 2, 3]
    alloc.check_integrity()


def test_alloc_zero_and_negative():
    alloc = PageAllocator(3)
    assert alloc.alloc(0) == []
    with pytest.raises(ValueError, match="-1"):
        alloc.alloc(-1)
    assert alloc.num_free == 3
    alloc.check_integrity()


def test_freed_pages_are_reused():
    alloc = PageAllocator(2)
    pages = alloc.alloc(2)
    alloc.free(pages)
    assert alloc.num_free == 2
    assert sorted(alloc.alloc(2)) == sorted(pages)
    alloc.check_integrity()


def test_double_free_raises_and_changes_nothing():
    alloc = PageAllocator(4)
    a, b = alloc.alloc(1), alloc.alloc(1)
    alloc.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(a)
    # b is still held: a failed free must not half-apply and lose it
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(b + a)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(b + b)
    assert alloc.num_free == 3
    alloc.check_integrity()
    alloc.free(b)
    assert alloc.num_free == 4
    alloc.check_integrity()


def test_zero_pages_rejected():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


def test_slot_acquire_release():
    slots = SlotTable(2)
    a, b = slots.acquire("a"), slots.acquire("b")
    assert {a, b} == {0, 1}
    assert slots.acquire("c") is None, "a third request got a slot from a table of two"
    assert slots.num_free == 0
    assert slots.holder(a) == "a" and sorted(slots.holders()) == ["a", "b"]
    slots.release(a)
    assert slots.num_free == 1
    with pytest.raises(KeyError):
        slots.holder(a)
    assert slots.holders() == ["b"]
    assert slots.acquire("d") == a
    slots.check_integrity()


def test_slot_double_release_raises():
    slots = SlotTable(2)
    slot = slots.acquire("a")
    slots.release(slot)
    with pytest.raises(RuntimeError, match="released twice"):
        slots.release(slot)
    assert slots.num_free == 2
    slots.check_integrity()
