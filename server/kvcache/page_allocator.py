"""Page allocator: hands out KV page ids in [0, num_pages) and takes them back."""

from __future__ import annotations


class PageAllocator:
    """A free list of page ids.

    Contract: every page id is either free (in the free list exactly once) or owned by exactly one
    holder (a request or the prefix cache). `alloc` is all-or-nothing; `free` of a page that is
    already free is a bug and raises.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pops low ids first
        self._is_free = bytearray([1]) * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages, or None (and nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:][::-1]  # ascending: runs of consecutive pages move in one KV write
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        """All or nothing: a page that is already free (or listed twice) raises and frees none."""
        for i, p in enumerate(pages):
            if self._is_free[p]:
                for q in pages[:i]:
                    self._is_free[q] = 0
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = 1
        self._free.extend(pages)

    def check_integrity(self) -> None:
        assert len(self._free) == len(set(self._free)), "free list holds a page twice"
        assert sum(self._is_free) == len(self._free), "free flags disagree with the free list"
