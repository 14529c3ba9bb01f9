"""Host slot allocation: which rows of the host KV pool a request owns.

One allocator per model (every layer uses the same host slot for a token). It runs on the CPU in
the scheduler, between steps and outside any graph, so it is plain Python: a free list of 64-token
pages. Host slot of token t of a request = pages[t // 64] * 64 + t % 64 (the block table).

Pages are reference counted so that the n sequences of one prompt (``n > 1``, ``best_of``) can
hold the prompt's full pages read-only: ``alloc`` hands a page out with one reference, ``share``
adds one per extra holder, and ``free`` drops one per holder and returns the page to the free list
only when the last one goes (``runtime.prefill_sharing``).
"""

from __future__ import annotations

from collections.abc import Iterable

from custom_ops.kv_format import PAGE


class HostSlotAllocator:
    """A free list of host pages. ``alloc`` hands out the lowest free page ids first (a min-heap
    would cost a log factor for nothing: pages are freed in bulk, so we keep a stack, sorted
    again at the first alloc after frees)."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"HostSlotAllocator needs a positive number of pages, got {num_pages}")
        self.num_pages = num_pages
        # Stack with the lowest page id on top: alloc pops from the end. Freed pages are appended
        # and the stack re-sorted at the next alloc (once per admission, not per finished request:
        # the sort of a 100K-page stack was most of a finish's host time)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._sorted = True
        self._refs = [0] * num_pages  # holders of each page; 0 = free (catches double frees)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * PAGE

    def refs(self, page: int) -> int:
        """How many holders ``page`` has (0: free)."""
        return self._refs[page]

    def can_alloc(self, n_pages: int) -> bool:
        return 0 <= n_pages <= len(self._free)

    def alloc(self, n_pages: int) -> list[int] | None:
        """``n_pages`` page ids, or None when fewer are free (nothing is taken then)."""
        if n_pages < 0:
            raise ValueError(f"HostSlotAllocator.alloc: n_pages must be >= 0, got {n_pages}")
        if n_pages > len(self._free):
            return None
        if not self._sorted:
            self._free.sort(reverse=True)  # hand out low ids first: deterministic, compact
            self._sorted = True
        pages = self._free[len(self._free) - n_pages :][::-1]
        del self._free[len(self._free) - n_pages :]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder for each of ``pages`` (handed out already); each is freed once per
        holder. Sharing a free page raises ValueError (and shares nothing)."""
        pages = self._checked(pages, "share")
        for p in pages:
            self._refs[p] += 1

    def last_holder(self, pages: Iterable[int]) -> list[int]:
        """The pages of ``pages`` that ``free(pages)`` would return to the free list (one holder
        left), in order: the GPU pools must forget those host slots before they are freed."""
        return [p for p in pages if self._refs[p] == 1]

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one holder of each page; returns the pages that went back to the free list (their
        last holder left). Freeing a page that is not handed out, or one page twice in one call,
        raises ValueError (and frees nothing): a double free would hand one page to two
        requests."""
        pages = self._checked(pages, "free")
        refs = self._refs
        for p in pages:
            refs[p] -= 1
        freed = [p for p in pages if not refs[p]]
        if freed:
            self._free.extend(freed)
            self._sorted = False
        return freed

    def _checked(self, pages: Iterable[int], op: str) -> list[int]:
        # whole-list checks (builtins, not a Python loop: a finishing 100K-token request frees
        # ~1.5K pages between two decode steps); the loop below only names the culprit
        pages = list(pages)
        in_range = not pages or (0 <= min(pages) and max(pages) < self.num_pages)
        if in_range and len(set(pages)) == len(pages) and all(map(self._refs.__getitem__, pages)):
            return pages
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(
                    f"HostSlotAllocator.{op}: page {p} out of range [0, {self.num_pages})"
                )
            if not self._refs[p] or p in seen:
                raise ValueError(
                    f"HostSlotAllocator.{op}: page {p} is not allocated (double free?)"
                )
            seen.add(p)
        raise AssertionError("unreachable: the whole-list checks failed, the loop found nothing")

    @staticmethod
    def slots_of(pages: Iterable[int]) -> list[int]:
        """Every host slot of ``pages`` in token order."""
        return [p * PAGE + i for p in pages for i in range(PAGE)]
