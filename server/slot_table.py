"""Request slots: a bounded table of running requests, slot -> the request's page table.

A slot is a small stable integer the runner may use to index per-request device state; the number
of slots is the hard cap on requests that hold KV pages at once.
"""

from __future__ import annotations


class SlotTable:
    """Contract: a slot is free or held by exactly one request; `pages(slot)` is that request's page
    list (shared by reference with the request, so appends are visible)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._pages: list[list[int] | None] = [None] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, pages: list[int]) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._pages[slot] = pages
        return slot

    def release(self, slot: int) -> None:
        if self._pages[slot] is None:
            raise RuntimeError(f"slot {slot} released twice")
        self._pages[slot] = None
        self._free.append(slot)

    def pages(self, slot: int) -> list[int]:
        pages = self._pages[slot]
        if pages is None:
            raise KeyError(f"slot {slot} is free")
        return pages

    def held_pages(self) -> list[int]:
        return [p for pages in self._pages if pages is not None for p in pages]

    def check_integrity(self) -> None:
        used = sum(p is not None for p in self._pages)
        assert used + len(self._free) == self.num_slots, "slots lost or double counted"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
