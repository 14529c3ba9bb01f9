"""Automatic prefix caching over the host pool (``EngineConfig.enable_prefix_caching``): the full
64-token pages sequences compute, kept for later requests whose prompts start with the same
tokens (vLLM's automatic prefix caching, SGLang's radix cache). A multi-turn chat or an agent
that resends a long history prefills only what is new.

- **Keys.** A cached page is keyed by its 64 tokens and its parent's page id (the cached page
  before it; -1 for the first), so two prompts share page i exactly when their first
  64 (i + 1) tokens are equal. Keys are compared as tuples: no hash collision can match a wrong
  page.
- **What is kept.** Every page a sequence fills with computed tokens (prompt and output), as
  soon as the step that fills it is done (``register``): a sequence never writes a position below
  its computed count again, so a full page is final. The cache takes a reference to each page
  (``HostSlotAllocator.share``), so it outlives the sequence with its KV rows and indexer keys as
  they were written; its GPU-pool rows stay mapped too (the rows did not change). A sequence that
  ends in an error registers nothing more.
- **Use.** At admission a request takes the longest run of cached pages its prompt starts with,
  at most ``prefill_end // 64`` of them (its last prompt token is always computed, by the first
  decode step), one more reference each; when its prefill is about to start it looks again, so
  requests that arrive together on one document find the pages the first one's prefill has
  registered meanwhile (prefill runs one request at a time). n sequences of one prompt
  (``n > 1``) take it through their shared prefill's head, at admission only (the members hold
  the head's pages from then on). Requests that ask for ``prompt_logprobs`` (they need every
  prompt position's logits) or that bring their prompt's KV take none.
- **Eviction.** A page only the cache holds (one reference) can be evicted; an admission that
  needs more pages than are free evicts the least recently used ones, through the scheduler's
  release hook (the GPU pools forget their slots first). A page a request holds is never
  evicted. A sequence registers a page only under a parent it holds (when a page's key is cached
  already under another sequence's page, it stops registering), so a request that holds page i
  holds the pages before it in its chain; and a chain is touched from its last page to its
  first, so a page's descendants are evicted before it. A page's cached children go with it all
  the same, so no key ever names an evicted parent.
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
        self.epoch = 0  # evictions so far: a match made since is still valid (registers only add)
        # prompt tokens looked up, and those found cached (admissions that may use the cache)
        self.queries = self.hits = 0

    def reset_stats(self) -> None:
        """Zero the lookup counters (``Engine.reset_stats``); the cached pages stay."""
        self.queries = self.hits = 0

    @property
    def num_pages(self) -> int:
        return len(self._key)

    def match(self, tokens: Sequence[int], max_pages: int, known: Sequence[int] = ()) -> list[int]:
        """The cached pages ``tokens`` start with, at most ``max_pages`` (nothing is taken).
        ``known``: an earlier match of these tokens made in this ``epoch`` (it still holds:
        only evictions remove pages), continued from its end."""
        out = list(known[:max_pages])
        parent = out[-1] if out else -1
        for i in range(len(out), max_pages):
            page = self._page.get((parent, tuple(tokens[i * PAGE : (i + 1) * PAGE])))
            if page is None:
                break
            out.append(page)
            parent = page
        return out

    def evictable_of(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` (cached ones) no request holds."""
        return sum(1 for p in pages if self.pages.refs(p) == 1)

    def acquire(self, pages: Sequence[int]) -> None:
        """One more holder for each of ``pages`` (cached ones, a ``match``); counted as hits."""
        self.num_evictable -= self.evictable_of(pages)
        self.pages.share(pages)
        self._touch(pages)
        self.hits += len(pages) * PAGE

    def register(self, tokens: Sequence[int], pages: Sequence[int], start: int, end: int) -> int:
        """Keep pages ``[start, end)`` of a sequence (``tokens`` its tokens from page ``start``
        on, ``pages`` its block table), whose pages before ``start`` the cache holds already;
        returns the page it registered up to: ``end``, or where a page's key turned out cached
        under another page (then the sequence stops for good: its later pages would hang under
        a parent it does not hold)."""
        parent = -1 if start == 0 else pages[start - 1]  # its own: registered, or matched
        if parent != -1 and parent not in self._key:
            raise AssertionError(f"prefix cache: page {parent} was never registered")
        for i in range(start, end):
            key = (parent, tuple(tokens[(i - start) * PAGE : (i - start + 1) * PAGE]))
            page = self._page.get(key)
            if page is None and pages[i] not in self._key:
                page = pages[i]  # new: the cache holds this sequence's page from now on
                self._page[key], self._key[page] = page, key
                self._children.setdefault(parent, set()).add(page)
                self.pages.share([page])
            elif page != pages[i]:
                return i
            parent = page
        return end

    def finished(self, tokens: Sequence[int], n_pages: int) -> None:
        """A sequence whose first ``n_pages`` the cache holds lets them go: most recent use,
        from its last page to its first."""
        self._touch(self.match(tokens, n_pages))

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
        self.epoch += bool(out)
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
