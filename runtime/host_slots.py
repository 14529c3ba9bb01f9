"""Host slot allocation: which rows of the host KV pool a request owns.

One allocator per model (every layer uses the same host slot for a token). It runs on the CPU in
the scheduler, between steps and outside any graph, so it is plain Python: a free list of 64-token
pages. Host slot of token t of a request = pages[t // 64] * 64 + t % 64 (the block table).
"""

from __future__ import annotations

from collections.abc import Iterable

from custom_ops.kv_format import PAGE


class HostSlotAllocator:
    """A free list of host pages. ``alloc`` hands out the lowest free page ids first (a min-heap
    would cost a log factor for nothing: pages are freed in bulk, so we keep a sorted stack)."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"HostSlotAllocator needs a positive number of pages, got {num_pages}")
        self.num_pages = num_pages
        # Stack with the lowest page id on top: alloc pops from the end.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used = bytearray(num_pages)  # 1 = handed out; catches double frees

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * PAGE

    def can_alloc(self, n_pages: int) -> bool:
        return 0 <= n_pages <= len(self._free)

    def alloc(self, n_pages: int) -> list[int] | None:
        """``n_pages`` page ids, or None when fewer are free (nothing is taken then)."""
        if n_pages < 0:
            raise ValueError(f"HostSlotAllocator.alloc: n_pages must be >= 0, got {n_pages}")
        if n_pages > len(self._free):
            return None
        pages = self._free[len(self._free) - n_pages :][::-1]
        del self._free[len(self._free) - n_pages :]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Give pages back. Freeing a page that is not handed out raises ValueError (and frees
        nothing), since a double free would hand one page to two requests."""
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(
                    f"HostSlotAllocator.free: page {p} out of range [0, {self.num_pages})"
                )
            if not self._used[p] or p in seen:
                raise ValueError(
                    f"HostSlotAllocator.free: page {p} is not allocated (double free?)"
                )
            seen.add(p)
        for p in pages:
            self._used[p] = 0
        self._free.extend(pages)
        self._free.sort(reverse=True)  # keep handing out low ids first: deterministic, compact

    @staticmethod
    def slots_of(pages: Iterable[int]) -> list[int]:
        """Every host slot of ``pages`` in token order."""
        return [p * PAGE + i for p in pages for i in range(PAGE)]
