"""Continuous batching with admission by host-pool and GPU-pool capacity.

Policy (vLLM-v0 style, kept simple):
- FCFS admission from the waiting queue while the request fits: a free decode row (the largest
  captured bucket bounds the batch), host pages for its whole lifetime (prompt + max_tokens), and,
  when offloading, room in every layer's GPU pool for one more selection (B x topk <= N_G per layer,
  so the guaranteed recall never has to evict a token selected in the same step). A request that
  does not fit waits; nothing is dropped. One that could never fit is rejected at ``add``.
- A running request with prompt tokens left gets one prefill chunk per step, and the running
  requests that have finished their prefill decode one token in a step between two chunks
  (``decode_during_prefill``), so a long prompt does not stall them; with it off, prefill comes
  first and they wait until no request has prompt tokens left. The first decode step of a request
  processes its last prompt token and samples its first output token.
- A group of n sequences of one prompt (``add_group``; runtime.prefill_sharing) is admitted as a
  whole: n decode rows, the prompt's pages once and each member's own pages. Its hidden head takes
  the prefill chunks in the running list's order; at the first ``schedule`` after its prefill the
  group forks: the members take the head's place in the running list.
- With ``enable_prefix_caching`` a request's prompt starts on the cached pages of an earlier
  sequence where its tokens match (runtime.prefix_cache); an admission that finds too few free
  pages evicts cached pages no request holds, least recently used first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from custom_ops.kv_format import pages_for
from runtime.host_slots import HostSlotAllocator
from runtime.prefill_sharing import PrefillGroup, head_of, share_prompt_logprobs
from runtime.prefix_cache import PrefixCache
from runtime.request import PAGE, Request, Status
from runtime.scheduler_config import SchedulerConfig

# release(pages): called with host pages about to go back to the free list (last holder gone), so
# the GPU pools forget their slots first; copy_rows(src slots, dst slots): the fork's copy of a
# group's last prompt page, in every layer (the engine's, which owns the cache)
PageHook = Callable[[list[int]], None]
CopyHook = Callable[[list[int], list[int]], None]


@dataclass
class ScheduledBatch:
    is_decode: bool
    requests: list[Request]
    chunk_start: int = 0  # prefill only: token range [chunk_start, chunk_end) of requests[0]
    chunk_end: int = 0


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        release: PageHook | None = None,
        copy_rows: CopyHook | None = None,
    ):
        self.cfg = cfg
        self.pages = HostSlotAllocator(cfg.host_tokens // PAGE)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.release = release
        self.copy_rows = copy_rows
        self.groups: dict[int, PrefillGroup] = {}  # id(head) -> its group, until the fork
        self._group_of: dict[int, PrefillGroup] = {}  # id(member) -> its group, until the fork
        self._decode_next = False  # the last step was a prefill chunk (decode_during_prefill)
        self.prefix = PrefixCache(self.pages) if cfg.enable_prefix_caching else None

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def add_group(self, members: list[Request]) -> None:
        """Queue ``members`` (two or more requests of one prompt of at least two tokens, at most
        ``max_running`` of them) to share one prefill; see runtime.prefill_sharing."""
        group = self.check_group(members)
        self.groups[id(group.head)] = group
        for m in members:
            self._group_of[id(m)] = group
        self.waiting.append(group.head)

    def check_group(self, members: list[Request]) -> PrefillGroup:
        """The group ``members`` would make; ValueError if it could never run."""
        if len(members) < 2 or len({tuple(m.prompt_ids) for m in members}) != 1:
            raise ValueError("a prefill group needs two or more requests of the same prompt")
        if len(members) > self.cfg.max_running:
            raise ValueError(
                f"a prefill group of {len(members)} cannot decode at once: at most "
                f"{self.cfg.max_running} rows"
            )
        for m in members:
            self.check(m)
        group = PrefillGroup(head_of(members), list(members))
        if group.head.prefill_end < 1:
            raise ValueError("a one-token prompt has no prefill to share")
        if group.pages_needed() > self.pages.num_pages:
            raise ValueError(
                f"{len(members)} sequences of prompt + max_tokens = "
                f"{members[0].max_total_tokens} tokens can never fit the host KV pool "
                f"({self.pages.num_pages * PAGE} tokens) at once"
            )
        return group

    def check(self, req: Request) -> None:
        """Raise ValueError for a request that can never run."""
        total = req.max_total_tokens
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if total > self.cfg.max_model_len:
            # (the limit is host_tokens where that is the least: a request reserves its pages)
            # (max_model_len is already capped by max_position_embeddings: EngineConfig.model_len)
            whose, why = "the model's ", " (max_model_len, at most max_position_embeddings)"
            if self.cfg.max_model_len == self.cfg.host_tokens:
                whose, why = "the ", " (host_tokens: a request reserves all its pages at admission)"
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = "
                f"{total} exceeds {whose}context limit of {self.cfg.max_model_len} tokens{why}"
            )
        if pages_for(total) > self.pages.num_pages:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens can never fit the host KV pool "
                f"({self.pages.num_pages * PAGE} tokens)"
            )

    def remove(self, req: Request, cache: bool = True) -> list[int]:
        """Take ``req`` out of the queues and drop its hold on its host pages (a page shared with
        other sequences stays theirs); returns the pages it held. A group member leaving before
        the fork leaves its group; the last one to leave takes the head with it. ``cache``:
        its computed full pages may go to the prefix cache (False after a failed step)."""
        group = self._group_of.pop(id(req), None)
        if group is not None:
            group.members.remove(req)
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        try:
            pages = self._free(req, cache)
        finally:  # the head goes with the last member even if a release hook raised
            if group is not None and not group.members:
                self._drop_head(group, cache)
        return pages

    def _free(self, req: Request, cache: bool = True) -> list[int]:
        """Drop ``req``'s hold on its pages (its computed full pages kept by the prefix cache
        first, when ``cache``). If the release hook raises, the pages are freed anyway and the
        GPU pools may still map them: the caller must reset the pools (``Engine.recover``
        does)."""
        if req.pages and self.prefix is not None:
            if cache:
                self.computed(req)
            self.prefix.finished(req.prompt_ids + req.output_ids, req.cache_pages)
        pages, req.pages = req.pages, []
        try:
            self._release_and_free(pages)
        finally:  # freed even if the hook raised: the cached ones it held are evictable now
            if self.prefix is not None:
                self.prefix.released(pages)
        return pages

    def computed(self, req: Request) -> None:
        """``req``'s computed count moved: the prefix cache keeps the pages it filled (call after
        each step of it; cheap when no page filled)."""
        n = min(req.num_computed, req.num_tokens) // PAGE
        if self.prefix is None or n <= req.cache_pages or req.cache_stopped:
            return
        # the new pages' tokens only (a decode step fills a page: no copy of the whole context)
        a, b, k = req.cache_pages * PAGE, n * PAGE, len(req.prompt_ids)
        tokens = req.prompt_ids[a:b] + req.output_ids[max(a - k, 0) : max(b - k, 0)]
        upto = self.prefix.register(tokens, req.pages, req.cache_pages, n)
        req.cache_stopped = upto < n
        req.cache_pages = upto

    def _extend_prefix(self, req: Request) -> None:
        """Before ``req``'s first prefill chunk: take the cached pages registered since its
        admission (those of a prefill that ran meanwhile) in place of its own unwritten ones. Not
        for a group's head: its members share its pages from admission on."""
        if self.prefix is None or req.num_computed != req.cached_tokens or id(req) in self.groups:
            return
        have = req.cached_tokens // PAGE
        new = self._cached_prefix(req)[have:]
        if not new:
            return
        self.prefix.acquire(new)
        own, req.pages[have : have + len(new)] = req.pages[have : have + len(new)], new
        req._block_row = None  # the block table changed, its length did not
        req.num_computed = req.cached_tokens = (have + len(new)) * PAGE
        req.cache_pages = have + len(new)
        self._release_and_free(own)  # last: a hook that raises leaves the request consistent

    def _release_and_free(self, pages: list[int]) -> None:
        if pages:
            last = self.pages.last_holder(pages)
            try:
                if last and self.release is not None:
                    self.release(last)  # before the pages can be handed out again
            finally:  # a release that raises (Engine.recover resets the pools) loses no page
                self.pages.free(pages)

    def _alloc(self, n: int) -> list[int]:
        """``n`` free pages, evicting cached ones no request holds when too few are free
        (``_can_admit`` checked there are enough)."""
        short = n - self.pages.num_free
        if short > 0 and self.prefix is not None:
            self._release_and_free(self.prefix.evict(short))
        pages = self.pages.alloc(n)
        assert pages is not None  # _can_admit
        return pages

    def reset_prefix_cache(self) -> int:
        """Evict every cached page no request holds (vLLM's ``reset_prefix_cache``), through the
        release hook; returns how many. Pages running requests hold stay cached."""
        if self.prefix is None:
            return 0
        pages = self.prefix.evict(self.prefix.num_evictable)
        self._release_and_free(pages)
        return len(pages)

    @property
    def pages_in_use(self) -> int:
        """Host pages requests hold: the cached pages no request holds count as free (an
        admission takes them), as vLLM's kv_cache_usage counts its unreferenced cached blocks."""
        return self.pages.num_pages - self._available()

    def _available(self, skip: Sequence[int] = ()) -> int:
        """Pages an admission can have: the free ones and the cached ones no request holds
        (less those of ``skip``, cached pages it takes as its prefix)."""
        if self.prefix is None:
            return self.pages.num_free
        return self.pages.num_free + self.prefix.num_evictable - self.prefix.evictable_of(skip)

    def _takes_prefix(self, req: Request) -> bool:
        """Whether ``req`` may start on cached pages: not when it needs its whole prompt
        computed (``prompt_logprobs``) or brings its prompt's KV."""
        return (
            self.prefix is not None and req.params.prompt_logprobs is None and req.prompt_kv is None
        )

    def placement(self, prompt_ids: list[int], takes_prefix: bool) -> tuple[int, int, int]:
        """What the data-parallel balancer weighs for a new request of ``prompt_ids``: this
        rank's tokens still to compute, the pages it could give the request now (free ones and
        those only the prefix cache holds, less what the waiting requests will take), and the
        prompt tokens it has cached (``takes_prefix``: the request may use the cache). Waiting
        requests count without their cached prefixes, as admission will take them."""
        left = sum(self._tokens_left(r) for r in self.running)
        reserved = 0
        for r in self.waiting:
            m = len(self._cached_prefix(r))
            group = self.groups.get(id(r))
            left += self._tokens_left(r, m)
            reserved += (group.pages_needed() if group else pages_for(r.max_total_tokens)) - m
        match = []
        if takes_prefix and self.prefix is not None and len(prompt_ids) > 1:
            match = self.prefix.match(prompt_ids, (len(prompt_ids) - 1) // PAGE)
        return left, self._available(match) - reserved, len(match) * PAGE

    def _tokens_left(self, req: Request, cached_pages: int = 0) -> int:
        """Tokens ``req`` still computes, its first ``cached_pages`` pages taken from the prefix
        cache. A group's head (queued, or admitted and prefilling: its members run only after
        the fork) computes the prompt once, and each member decodes its own tokens."""
        done = max(req.num_computed, cached_pages * PAGE)
        group = self.groups.get(id(req))
        if group is None:
            return req.max_total_tokens - done
        decode = sum(m.max_total_tokens - len(m.prompt_ids) for m in group.members)
        return len(req.prompt_ids) - done + decode

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached pages ``req``'s prompt starts with (none when it may take none)."""
        if not self._takes_prefix(req):
            return []
        memo, epoch = req.prefix_match, self.prefix.epoch
        known = memo[1] if memo is not None and memo[0] == epoch else []
        pages = self.prefix.match(req.prompt_ids, req.prefill_end // PAGE, known)
        req.prefix_match = (epoch, pages)
        return pages

    def _drop_head(self, group: PrefillGroup, cache: bool = True) -> None:
        head = group.head
        del self.groups[id(head)]
        if head in self.running:
            self.running.remove(head)
        elif head in self.waiting:
            self.waiting.remove(head)
        self._free(head, cache)
        head.status = Status.FINISHED

    @property
    def num_rows(self) -> int:
        """Decode rows taken: running requests and the members of admitted groups (their heads
        prefill and never decode)."""
        heads = sum(1 for g in self.groups.values() if g.admitted)
        members = sum(len(g.members) for g in self.groups.values() if g.admitted)
        return len(self.running) - heads + members

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission: a queued group is one entry of the queue (its head)
        but counts its members, as ``num_rows`` counts an admitted group's."""
        groups = self.groups
        return sum(len(groups[id(r)].members) if id(r) in groups else 1 for r in self.waiting)

    # ---- one step ------------------------------------------------------------------------------
    def _can_admit(self, req: Request) -> bool:
        """Whether the head of the queue fits now: decode rows (a group needs all of its
        members') and host pages for its whole lifetime (a group's: its prompt once, each
        member's own)."""
        group = self.groups.get(id(req))
        if self.num_rows + (len(group.members) if group else 1) > self.cfg.max_running:
            return False
        cached = self._cached_prefix(req)  # a group's: its head's
        need = group.pages_needed() if group is not None else pages_for(req.max_total_tokens)
        return need - len(cached) <= self._available(cached)

    def _admit(self) -> None:
        while self.waiting and self._can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            group = self.groups.get(id(req))
            cached = self._cached_prefix(req)
            if self._takes_prefix(req):  # a lookup: counted in the hit rate
                self.prefix.queries += len(req.prompt_ids)
                self.prefix.acquire(cached)
            req.num_computed = req.cached_tokens = len(cached) * PAGE
            req.cache_pages = len(cached)
            req.pages = list(cached)  # held from here: freed with it if what follows raises
            if group is not None:
                self._admit_group(group)
            else:
                req.pages += self._alloc(pages_for(req.max_total_tokens) - len(cached))
            req.status = Status.RUNNING
            self.running.append(req)

    def _admit_group(self, group: PrefillGroup) -> None:
        """All of the group's pages (``_can_admit`` checked there are enough): the head's prompt
        pages (those it holds already first: its prefix from the prefix cache), the first ``s``
        of them shared with every member, and each member's own."""
        head, s = group.head, group.shared_pages
        head.pages += self._alloc(pages_for(head.prefill_end) - len(head.pages))
        for m in group.members:
            m.cached_tokens = head.cached_tokens
            own = self._alloc(pages_for(m.max_total_tokens) - s)
            self.pages.share(head.pages[:s])
            m.pages = head.pages[:s] + own
            m.status = Status.RUNNING
        group.admitted = True

    def _fork(self) -> None:
        """Groups whose head has prefilled the prompt: copy its last, partly filled prompt page
        into each member's own page, put the members where the head was in the running list,
        and drop the head (its references to the shared pages, its copy of the last page)."""
        for group in [g for g in self.groups.values() if g.admitted and not g.head.in_prefill]:
            head = group.head
            positions = group.copied_positions()
            if len(positions):
                if self.copy_rows is None:
                    raise RuntimeError("Scheduler: a prefill group forks but has no copy_rows")
                src = [head.slot_of(p) for p in positions]
                dst = [m.slot_of(p) for m in group.members for p in positions]
                self.copy_rows(src * len(group.members), dst)
            share_prompt_logprobs(head, group.members)
            for m in group.members:
                m.num_computed = head.num_computed
                del self._group_of[id(m)]
            i = self.running.index(head)
            self.running[i : i + 1] = group.members
            del self.groups[id(head)]
            self._free(head)
            head.status = Status.FINISHED

    def schedule(self) -> ScheduledBatch | None:
        self._fork()
        self._admit()
        for r in self.running:  # the next prompt to prefill starts on what is cached by now
            if r.in_prefill and r.prompt_kv is None:
                self._extend_prefix(r)
                if r.in_prefill:
                    break
        # a group head admitted with its whole prefill cached has prefilled already: it forks
        # now, never decoding itself (it holds only the prompt's pages)
        self._fork()
        prefilling = [r for r in self.running if r.in_prefill]
        decoding = [r for r in self.running if not r.in_prefill]
        # a received prompt KV is written, not computed (Engine._load_prompt_kv): no turn taken
        load = next((r for r in prefilling if r.prompt_kv is not None), None)
        if load is not None:
            end = min(load.num_computed + self.cfg.prefill_chunk, load.prefill_end)
            return ScheduledBatch(False, [load], load.num_computed, end)
        take_turn = self.cfg.decode_during_prefill and self._decode_next and decoding
        if prefilling and not take_turn:
            self._decode_next = True
            req = prefilling[0]
            end = min(req.num_computed + self.cfg.prefill_chunk, req.prefill_end)
            return ScheduledBatch(False, [req], req.num_computed, end)
        self._decode_next = False
        return ScheduledBatch(True, decoding) if decoding else None

    def repeats(self, reqs: list[Request], leaving: Sequence[Request] = ()) -> bool:
        """Whether ``schedule()`` will return a decode batch of exactly ``reqs``, in that order,
        once ``leaving`` (running requests about to finish) are removed; the engine's
        asynchronous scheduling launches such a batch before it reads the tokens of the step
        before. True when, without them, the running list is ``reqs`` (so none is prefilling), no
        group waits to prefill or fork, and the head of the queue could not fit even with all of
        their rows and pages free (an upper bound: pages shared with others are counted too)."""
        gone = {id(r) for r in leaving}
        rest = [r for r in self.running if id(r) not in gone]
        if len(rest) != len(reqs) or any(a is not b for a, b in zip(rest, reqs)):
            return False
        if any(g.admitted for g in self.groups.values()):
            return False
        if not self.waiting:
            return True
        head = self.waiting[0]
        group = self.groups.get(id(head))
        rows = self.num_rows - len(leaving) + (len(group.members) if group else 1)
        cached = self._cached_prefix(head)  # a group's: its head's
        need = group.pages_needed() if group is not None else pages_for(head.max_total_tokens)
        need -= len(cached)
        freed = sum(len(r.pages) for r in leaving)
        return rows > self.cfg.max_running or need - freed > self._available(cached)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
