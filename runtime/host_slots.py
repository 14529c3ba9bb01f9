"""Host slot allocation: which rows of the host KV pool a request owns.

One allocator per model (every layer uses the same host slot for a token). It runs on the CPU in
the scheduler, between steps and outside any graph, so it is plain Python over 64-token pages.
Host slot of token t of a request = pages[t // 64] * 64 + t % 64 (the block table).

Pages are reference counted so that the n sequences of one prompt (``n > 1``, ``best_of``) can
hold the prompt's full pages read-only: ``alloc`` hands a page out with one reference, ``share``
adds one per extra holder, and ``free`` drops one per holder and marks the page free only when
the last one goes (``runtime.prefill_sharing``).
"""

from __future__ import annotations

from collections.abc import Iterable

from custom_ops.kv_format import PAGE


class HostSlotAllocator:
    """Host pages, handed out lowest free id first (deterministic, compact). A byte per page says
    whether it is free: ``alloc`` finds the lowest free runs with ``bytearray.find`` (C speed, a
    call per run), ``free`` flips the freed pages' bytes back; nothing is sorted, so a finish and
    an admission cost the same at any pool size (``benchmarks/bench_host_slots.py``)."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"HostSlotAllocator needs a positive number of pages, got {num_pages}")
        self.num_pages = num_pages
        self._is_free = bytearray(b"\x01") * num_pages
        self._num_free = num_pages
        self._low = 0  # no page below this id is free
        self._refs = [0] * num_pages  # holders of each page; 0 = free (catches double frees)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    @property
    def num_free_slots(self) -> int:
        return self._num_free * PAGE

    def refs(self, page: int) -> int:
        """How many holders ``page`` has (0: free)."""
        return self._refs[page]

    def can_alloc(self, n_pages: int) -> bool:
        return 0 <= n_pages <= self._num_free

    def alloc(self, n_pages: int) -> list[int] | None:
        """``n_pages`` page ids, the lowest free ones in ascending order, or None when fewer are
        free (nothing is taken then)."""
        if n_pages < 0:
            raise ValueError(f"HostSlotAllocator.alloc: n_pages must be >= 0, got {n_pages}")
        if n_pages > self._num_free:
            return None
        flags, pages, i = self._is_free, [], self._low
        while len(pages) < n_pages:
            i = flags.find(1, i)  # the lowest free page from i (there is one: counted above)
            run_end = flags.find(0, i)
            end = min(self.num_pages if run_end < 0 else run_end, i + n_pages - len(pages))
            flags[i:end] = bytes(end - i)
            self._refs[i:end] = [1] * (end - i)
            pages.extend(range(i, end))
            i = end
        self._low = i  # every free page below i was just taken
        self._num_free -= n_pages
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
        flags = self._is_free
        for p in freed:
            flags[p] = 1
        if freed:
            self._num_free += len(freed)
            self._low = min(self._low, min(freed))
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
