"""Automatic prefix caching over the host pool (``EngineConfig.enable_prefix_caching``): the full
64-token pages of finished sequences, kept for later requests whose prompts start with the same
tokens (vLLM's automatic prefix caching, SGLang's radix cache). A multi-turn chat or an agent
that resends a long history prefills only what is new.

- **Keys.** A cached page is keyed by its 64 tokens and its parent's page id (the cached page
  before it; -1 for the first), so two prompts share page i exactly when their first
  64 (i + 1) tokens are equal. Keys are compared as tuples: no hash collision can match a wrong
  page.
- **What is kept.** When a sequence finishes (not by an error), every page it filled with
  computed tokens (``num_computed // 64`` pages of prompt and output) that is not cached yet.
  The cache takes a reference to each (``HostSlotAllocator.share``), so the page outlives the
  sequence with its KV rows and indexer keys as they were written; its GPU-pool rows stay mapped
  too (the rows did not change).
- **Use.** At admission a request takes the longest run of cached pages its prompt starts with,
  at most ``prefill_end // 64`` of them (its last prompt token is always computed, by the first
  decode step), one more reference each, and prefills from there. Requests that ask for
  ``prompt_logprobs`` (they need every prompt position's logits), that bring their prompt's KV,
  or that share a prefill (``n > 1``) take none.
- **Eviction.** A page only the cache holds (one reference) can be evicted; an admission that
  needs more pages than are free evicts the least recently used ones, through the scheduler's
  release hook (the GPU pools forget their slots first). A page a request holds is never
  evicted. A request that holds page i holds the pages before it in its chain too, and a chain
  is touched from its last page to its first, so a page's descendants are evicted before it; a
  page's cached children go with it all the same, so no key ever names an evicted parent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from runtime.host_slots import HostSlotAllocator
from runtime.request import PAGE

Key = tuple[int, tuple[int, ...]]  # (parent page or -1, the page's 64 tokens)


class PrefixCache:
    def __init__(self, pages: HostSlotAllocator):
        self.pages = pages
        self._page: dict[Key, int] = {}  # key -> cached page
        self._key: dict[int, Key] = {}  # cached page -> its key
        self._children: dict[int, set[int]] = {}  # cached page -> its cached children
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recent first
        self.num_evictable = 0  # cached pages no request holds
        # prompt tokens looked up, and those found cached (admissions that may use the cache)
        self.queries = self.hits = 0

    @property
    def num_pages(self) -> int:
        return len(self._key)

    def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The cached pages ``tokens`` start with, at most ``max_pages`` (nothing is taken)."""
        out: list[int] = []
        parent = -1
        for i in range(max_pages):
            page = self._page.get((parent, tuple(tokens[i * PAGE : (i + 1) * PAGE])))
            if page is None:
                break
            out.append(page)
            parent = page
        return out

    def evictable_of(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` (cached ones) no request holds."""
        return sum(1 for p in pages if self.pages.refs(p) == 1)

    def acquire(self, pages: Sequence[int], prompt_tokens: int) -> None:
        """One more holder for each of ``pages`` (a ``match``), counted as a lookup of
        ``prompt_tokens`` tokens that found ``len(pages)`` pages."""
        self.num_evictable -= self.evictable_of(pages)
        self.pages.share(pages)
        self._touch(pages)
        self.queries += prompt_tokens
        self.hits += len(pages) * PAGE

    def count_miss(self, prompt_tokens: int) -> None:
        self.queries += prompt_tokens

    def insert(self, tokens: Sequence[int], pages: Sequence[int], n_pages: int) -> None:
        """Keep the first ``n_pages`` full pages of a finishing sequence (``tokens`` its prompt
        and output, ``pages`` its block table) that are not cached yet. Call it before the
        sequence drops its references."""
        parent, chain = -1, []
        for i in range(n_pages):
            key = (parent, tuple(tokens[i * PAGE : (i + 1) * PAGE]))
            page = self._page.get(key)
            if page is None:  # new: the cache holds this sequence's page from now on
                page = pages[i]
                if page in self._key:  # cached under another chain: not this one's content
                    break
                self._page[key], self._key[page] = page, key
                self._children.setdefault(parent, set()).add(page)
                self.pages.share([page])
            chain.append(page)
            parent = page
        self._touch(chain)

    def released(self, pages: Sequence[int]) -> None:
        """A sequence dropped its references to ``pages``: the cached ones it was the last
        request to hold become evictable."""
        self.num_evictable += sum(1 for p in pages if p in self._key and self.pages.refs(p) == 1)

    def evict(self, n: int) -> list[int]:
        """Drop at least ``n`` evictable pages, least recently used first (with their cached
        children); returns them, still held by the cache's reference, for the caller to free."""
        out: list[int] = []
        for page in list(self._lru):
            if len(out) >= n:
                break
            if page in self._key and self.pages.refs(page) == 1:
                self._drop(page, out)
        self.num_evictable -= len(out)
        return out

    def _drop(self, page: int, out: list[int]) -> None:
        for child in self._children.pop(page, ()):
            if self.pages.refs(child) != 1:
                raise AssertionError(f"prefix cache: page {child} in use under evicted {page}")
            self._drop(child, out)
        key = self._key.pop(page)
        del self._page[key]
        self._children.get(key[0], set()).discard(page)
        self._lru.pop(page, None)
        out.append(page)

    def _touch(self, chain: Sequence[int]) -> None:
        """Most recent: the chain's first page (so its descendants are evicted before it)."""
        for page in reversed(chain):
            self._lru[page] = None
            self._lru.move_to_end(page)
