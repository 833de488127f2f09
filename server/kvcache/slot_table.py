"""Request slots: a bounded table of the requests that hold KV pages, slot -> request.

A slot is a small stable integer that indexes per-request state (the KV connectors' arrival
records); the number of slots is the hard cap on requests that hold KV pages at once.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class SlotTable(Generic[T]):
    """Contract: a slot is free or held by exactly one holder."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._holders: list[T | None] = [None] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, holder: T) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._holders[slot] = holder
        return slot

    def release(self, slot: int) -> None:
        if self._holders[slot] is None:
            raise RuntimeError(f"slot {slot} released twice")
        self._holders[slot] = None
        self._free.append(slot)

    def holder(self, slot: int) -> T:
        holder = self._holders[slot]
        if holder is None:
            raise KeyError(f"slot {slot} is free")
        return holder

    def holders(self) -> list[T]:
        return [h for h in self._holders if h is not None]

    def check_integrity(self) -> None:
        used = sum(h is not None for h in self._holders)
        assert used + len(self._free) == self.num_slots, "slots lost or double counted"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
