"""Automatic prefix caching (runtime/prefix_cache.py): the cache's bookkeeping against the
allocator's reference counts, the scheduler's admissions and evictions, and the engine: a prompt
served from cached pages gives the logits of the same prompt prefilled in full, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.host_slots import HostSlotAllocator
from runtime.prefix_cache import PrefixCache
from runtime.request import PAGE, Request, Status
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.scheduler_config import SchedulerConfig
from runtime.tokenizer import Tokenizer
from tests.test_lossless import _record_logits


def _toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


# ---- the cache alone ---------------------------------------------------------------------------
def test_match_acquire_insert_and_lru_eviction():
    alloc = HostSlotAllocator(16)
    cache = PrefixCache(alloc)
    a = _toks(1, 3 * PAGE + 5)
    pages_a = alloc.alloc(4)
    assert cache.register(a, pages_a, 0, 2) == 2  # two full pages, then the third
    assert cache.register(a[2 * PAGE :], pages_a, 2, 3) == 3  # the tokens from page 2 on
    cache.finished(a, 3)
    alloc.free(pages_a)
    cache.released(pages_a)
    assert cache.num_pages == 3 and cache.num_evictable == 3 and alloc.num_free == 13
    # a prompt sharing two pages and then differing
    b = a[: 2 * PAGE] + _toks(2, PAGE + 3)
    assert cache.match(b, 10) == pages_a[:2]
    assert cache.match(b, 1) == pages_a[:1]  # the limit
    assert cache.match(_toks(3, 2 * PAGE), 10) == []  # another first page: nothing
    assert cache.match(a[PAGE:], 10) == []  # page 1's tokens at position 0: another key
    cache.acquire(pages_a[:2])
    assert cache.num_evictable == 1 and alloc.refs(pages_a[0]) == 2
    assert cache.hits == 2 * PAGE
    # eviction takes only what no request holds (page 2), never pages 0-1
    assert cache.evict(5) == [pages_a[2]]
    assert cache.num_pages == 2 and cache.num_evictable == 0
    alloc.free([pages_a[2]])
    assert cache.match(a, 10) == pages_a[:2]


def test_descendants_go_before_their_parents_and_with_them():
    alloc = HostSlotAllocator(8)
    cache = PrefixCache(alloc)
    a = _toks(4, 3 * PAGE)
    pa = alloc.alloc(3)
    cache.register(a, pa, 0, 3)
    cache.finished(a, 3)
    alloc.free(pa)
    cache.released(pa)
    # least recently used is the chain's last page: one eviction takes the leaf only
    assert cache.evict(1) == [pa[2]]
    alloc.free([pa[2]])
    # a page's cached children go with it whatever the order
    gone: list[int] = []
    cache._drop(pa[0], gone)
    assert sorted(gone) == sorted(pa[:2]) and cache.num_pages == 0
    assert cache.match(a, 3) == []


def test_a_duplicate_computation_keeps_the_cached_page_and_stops():
    alloc = HostSlotAllocator(8)
    cache = PrefixCache(alloc)
    a = _toks(5, 2 * PAGE)
    first, second = alloc.alloc(2), alloc.alloc(2)  # two sequences computed the same tokens
    assert cache.register(a, first, 0, 2) == 2
    assert cache.register(a, second, 0, 2) == 0  # page 0's key is cached under another page
    for pages in (first, second):
        alloc.free(pages)
        cache.released(pages)
    assert cache.match(a, 2) == first and cache.num_pages == 2
    assert alloc.num_free == 6  # the second sequence's pages went back


# ---- the scheduler -----------------------------------------------------------------------------
def _sched(pages: int, cache: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_batch=4, max_model_len=pages * PAGE, host_tokens=pages * PAGE,
                          topk=8, prefill_chunk=64, enable_prefix_caching=cache)  # fmt: skip
    return Scheduler(cfg, release=lambda pages: None)


def _req(rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw))


def _finish(s: Scheduler, req: Request, outputs: int = 0) -> None:
    req.output_ids = _toks(99, outputs)
    req.num_computed = req.num_tokens - 1 if outputs else req.prefill_end
    s.remove(req)


def _check_refs(s: Scheduler) -> None:
    """Every page's reference count is its holders: requests and the cache."""
    held = [0] * s.pages.num_pages
    members = [m for g in s.groups.values() for m in g.members]  # hold pages before the fork
    for r in s.running + members:
        for p in r.pages:
            held[p] += 1
    for p in s.prefix._key:
        held[p] += 1
    assert held == [s.pages.refs(p) for p in range(s.pages.num_pages)]
    evictable = [p for p in s.prefix._key if s.pages.refs(p) == 1]
    assert s.prefix.num_evictable == len(evictable) and all(p in s.prefix._lru for p in evictable)


def test_admission_starts_on_the_cached_prefix_and_evicts_when_short():
    s = _sched(8)
    doc = _toks(7, 3 * PAGE)
    a = _req("a", doc + [5, 6, 7])
    s.add(a)
    assert s.schedule().requests == [a] and a.num_computed == 0
    _finish(s, a)
    assert s.prefix.num_pages == 3  # prefill_end = 3 * 64 + 2: three full pages computed
    b = _req("b", doc + [9, 9])
    s.add(b)
    batch = s.schedule()
    assert b.cached_tokens == b.num_computed == 3 * PAGE and b.pages[:3] == a_pages(s, doc)
    assert batch.chunk_start == 3 * PAGE and batch.chunk_end == b.prefill_end
    _check_refs(s)
    _finish(s, b)
    # a prompt that needs every page: the cached ones go (least recently used first)
    c = _req("c", _toks(8, 8 * PAGE - 4), max_tokens=4)
    s.add(c)
    assert s.schedule().requests == [c] and c.cached_tokens == 0
    assert s.prefix.num_pages == 0 and s.pages.num_free == 0
    _check_refs(s)


def test_a_pool_full_of_cached_pages_admits_a_request_needing_all_of_it():
    """Pages only the cache holds never keep a request out: finished requests leave a tree of
    cached pages (a branch under a shared parent) over all but the free ones, and a request of
    the whole pool is admitted at once, every cached page evicted (children with their
    parents), while the balancer sees the whole pool as available."""
    s = _sched(8)
    doc = _toks(40, 3 * PAGE)
    for rid, prompt in (("a", doc + [1]), ("b", doc[: 2 * PAGE] + _toks(41, PAGE) + [2]),
                        ("c", _toks(42, 2 * PAGE) + [3])):  # fmt: skip
        r = _req(rid, prompt)
        s.add(r)
        s.schedule()
        _finish(s, r)
    assert s.prefix.num_pages == 3 + 1 + 2 == s.prefix.num_evictable  # b's page 2: a branch
    assert s.pages_in_use == 0 and s.placement(_toks(43, 10), True)[1] == 8
    x = _req("x", _toks(43, 8 * PAGE - 4), max_tokens=4)
    s.add(x)
    assert s.schedule().requests == [x] and x.status is Status.RUNNING and not s.waiting
    assert len(x.pages) == 8 and s.pages.num_free == 0 and s.prefix.num_pages == 0
    _check_refs(s)


def a_pages(s: Scheduler, tokens: list[int]) -> list[int]:
    return s.prefix.match(tokens, len(tokens) // PAGE)


def test_requests_arriving_together_share_the_first_ones_prefill():
    """Admitted in one step, before any page is cached: the second request's prefill starts on
    the pages the first one's prefill registered meanwhile, in place of its own."""
    s = _sched(16)
    doc = _toks(11, 3 * PAGE)
    a, b = _req("a", doc + [1, 2, 3]), _req("b", doc + [4, 5])
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.requests == [a] and b.cached_tokens == 0 and b.status is Status.RUNNING
    own_b = list(b.pages)
    for end in (64, 128, 192):  # a's chunks; each registers its full pages
        a.num_computed = end
        s.computed(a)
    a.num_computed = a.prefill_end
    s.computed(a)
    assert s.schedule().requests == [a]  # a decode step's turn between two prefill chunks
    batch = s.schedule()
    assert batch.requests == [b] and batch.chunk_start == 3 * PAGE
    assert b.pages[:3] == a.pages[:3] and b.pages[3:] == own_b[3:]
    assert all(s.pages.refs(p) == 0 for p in own_b[:3])  # its unwritten pages went back
    assert torch.equal(b.block_row(), torch.tensor(b.pages, dtype=torch.int32))
    _check_refs(s)


def test_a_waiting_requests_match_is_redone_after_an_eviction():
    s = _sched(8)
    doc, other = _toks(12, 3 * PAGE), _toks(13, 3 * PAGE)
    a = _req("a", doc + [1])
    s.add(a)
    s.schedule()
    _finish(s, a)  # the document's 3 pages cached
    w = _req("w", doc + [2])
    assert s._cached_prefix(w) == a_pages(s, doc)  # remembered while w would wait
    s._release_and_free(s.prefix.evict(3))  # an admission evicted them ...
    b = _req("b", other + [3])
    s.add(b)
    s.schedule()
    _finish(s, b)  # ... and the same page ids now hold another document
    assert len(a_pages(s, other)) == 3 and s._cached_prefix(w) == []
    _check_refs(s)


def test_a_group_starts_on_the_cached_prefix_and_its_members_share_it():
    """n sequences of one prompt (a prefill group): the head takes the cached prefix like any
    request, the members hold it with the rest of the shared prompt, and eviction later finds
    no held page under an evicted one."""
    cfg = SchedulerConfig(max_batch=4, max_model_len=16 * PAGE, host_tokens=16 * PAGE, topk=8,
                          prefill_chunk=64, enable_prefix_caching=True)  # fmt: skip
    s = Scheduler(cfg, release=lambda pages: None, copy_rows=lambda src, dst: None)
    system = _toks(1, PAGE)
    a = _req("a", system + _toks(2, 10), max_tokens=2)
    s.add(a)
    s.schedule()
    _finish(s, a)  # the system prompt's page cached
    members = [_req(f"m{i}", system + _toks(3, PAGE + 5), max_tokens=2) for i in range(2)]
    s.add_group(members)
    batch = s.schedule()
    head = batch.requests[0]
    assert head.cached_tokens == PAGE and batch.chunk_start == PAGE
    sys_page = head.pages[0]
    assert a_pages(s, system) == [sys_page]
    assert all(m.cached_tokens == PAGE and m.pages[:2] == head.pages[:2] for m in members)
    _check_refs(s)
    head.num_computed = head.prefill_end
    s.computed(head)
    assert not head.cache_stopped and head.cache_pages == 2
    s.schedule()  # the fork
    _check_refs(s)
    s.remove(members[0])
    _check_refs(s)
    assert s.prefix.num_evictable == 0  # m1 holds the system page and the head's second page
    s.remove(members[1])
    assert s.prefix.num_evictable == 2
    c = _req("c", _toks(5, (s.pages.num_free + 1) * PAGE - 4), max_tokens=4)
    s.add(c)
    s.schedule()  # evicts one page only the cache holds: the leaf, not its parent
    assert c in s.running and a_pages(s, system) == [sys_page]
    _check_refs(s)
    assert all(k[0] == -1 or k[0] in s.prefix._key for k in s.prefix._page)  # parents cached


def test_a_page_computed_twice_stops_the_later_sequence():
    """Two sequences fill a page with the same tokens (say the same greedy answer): the later
    one's page is not cached, and nothing of it is cached under the earlier one's page."""
    s = _sched(16)
    doc = _toks(16, PAGE + 10)
    a, b = _req("a", doc, max_tokens=2 * PAGE), _req("b", doc, max_tokens=2 * PAGE)
    for r in (a, b):
        s.add(r)
    s.schedule()
    s.schedule()
    answer = _toks(17, 2 * PAGE)
    for r in (a, b):  # both computed their prompt page themselves, then the same answer
        r.num_computed = r.prefill_end
        r.output_ids = list(answer[:PAGE])
        r.num_computed = r.num_tokens
        s.computed(r)
    assert not a.cache_stopped and a.cache_pages == 2
    assert b.cache_stopped and b.cache_pages == 0
    _check_refs(s)
    assert all(k[0] == -1 or k[0] in s.prefix._key for k in s.prefix._page)


def test_a_raising_release_hook_loses_no_evictable_page_and_an_error_caches_no_head():
    s = _sched(8)
    doc = _toks(14, 2 * PAGE)
    a = _req("a", doc + [1])
    s.add(a)
    s.schedule()
    a.num_computed = a.prefill_end
    s.computed(a)  # registered while running: the cache and a hold them

    def boom(pages):
        raise RuntimeError("release failed")

    s.release = boom
    with pytest.raises(RuntimeError, match="release failed"):
        s.remove(a)
    _check_refs(s)  # its cached pages are evictable although the hook raised
    s.release = lambda pages: None
    # a group whose last member ends in an error: its head's computed pages are not cached
    members = [_req(f"g{i}", _toks(15, 2 * PAGE + 3), max_tokens=2) for i in range(2)]
    s.add_group(members)
    head = s.schedule().requests[0]
    head.num_computed = 2 * PAGE
    for m in members:
        s.remove(m, cache=False)
    assert s.prefix.num_pages == 2 and s.pages.num_used == 2  # a's pages only
    _check_refs(s)


def test_placement_counts_cached_pages_as_the_request_will_take_them():
    """What a data-parallel rank reports for a request on a document it holds, used by a running
    request, with few pages free: its cached tokens, and pages enough (it needs only the rest)."""
    from runtime.distributed.balance import RankLoad, assign

    s = _sched(16)
    doc = _toks(18, 10 * PAGE)
    a = _req("a", doc + [1, 2], max_tokens=2)
    s.add(a)
    s.schedule()
    a.num_computed = a.prefill_end
    s.computed(a)  # the document's 10 pages cached, a still running
    q = doc + [3, 4]
    left, free, cached = s.placement(q, takes_prefix=True)
    assert cached == 10 * PAGE and free == s.pages.num_free == 16 - 11
    assert s.placement(q, takes_prefix=False)[2] == 0
    other = RankLoad(0, 16, 16)  # an idle rank with every page free
    here = RankLoad(left, free, 16, cached)
    assert assign(pages_for_tokens(len(q) + 4), len(q) + 4, [other, here]) == 1
    # a waiting request on the document counts without its cached prefix
    w = _req("w", doc + [5], max_tokens=64)
    s.waiting.append(w)
    left2, free2, _ = s.placement(q, takes_prefix=True)
    assert left2 - left == w.max_total_tokens - 10 * PAGE
    assert free - free2 == -(-w.max_total_tokens // PAGE) - 10


def pages_for_tokens(n: int) -> int:
    return -(-n // PAGE)


def test_an_admission_whose_eviction_fails_leaks_no_reference():
    """A request that takes a cached prefix and needs an eviction for its own pages, whose
    release hook raises: the prefix it took goes back with it (what Engine.recover does)."""
    s = _sched(8)
    doc, doc2 = _toks(19, 3 * PAGE), _toks(20, 2 * PAGE)
    for rid, d in (("a", doc), ("a2", doc2)):
        r = _req(rid, d + [1])
        s.add(r)
        s.schedule()
        _finish(s, r)  # 3 + 2 pages cached, 3 free
    b = _req("b", doc + _toks(21, 4 * PAGE), max_tokens=4)  # 8 pages: 3 cached, 5 its own

    def boom(pages):
        raise RuntimeError("release failed")

    s.release = boom
    s.add(b)
    with pytest.raises(RuntimeError, match="release failed"):
        s.schedule()  # took the document's 3 pages, then evicted doc2's 2: the hook raised
    s.release = lambda pages: None
    s.remove(b, cache=False)
    _check_refs(s)
    assert s.pages.num_free + s.prefix.num_evictable == 8


def test_a_request_bringing_its_prompt_kv_takes_no_prefix():
    s = _sched(16)
    doc = _toks(22, 2 * PAGE)
    a = _req("a", doc + [1])
    s.add(a)
    s.schedule()
    _finish(s, a)
    k = _req("k", doc + [2])
    k.prompt_kv = object()  # (what the engine writes; the scheduler only looks at it)
    s.add(k)
    s.schedule()
    assert k.cached_tokens == 0 and k.num_computed == 0 and k.pages[0] not in s.prefix._key
    assert s.placement(k.prompt_ids, takes_prefix=True)[2] == 2 * PAGE  # (the balancer asks)


def test_requests_that_take_no_prefix():
    s = _sched(16)
    doc = _toks(9, 2 * PAGE)
    a = _req("a", doc + [1, 2])
    s.add(a)
    s.schedule()
    _finish(s, a)
    for r in (_req("lp", doc + [3], prompt_logprobs=1),):
        s.add(r)
        s.schedule()
        assert r.cached_tokens == 0 and r.num_computed == 0
    # the last prompt token is always computed: a prompt of exactly the cached pages + 1 token
    # takes them all, one of exactly the cached pages takes all but the last
    s2 = _sched(16)
    a = _req("a", doc + doc[:1])
    s2.add(a)
    s2.schedule()
    _finish(s2, a)
    whole = _req("w", doc)
    s2.add(whole)
    s2.schedule()
    assert whole.cached_tokens == PAGE and whole.in_prefill
    plus1 = _req("p", doc + [7])
    s2.add(plus1)
    s2.schedule()
    assert plus1.cached_tokens == 2 * PAGE and not plus1.in_prefill


def test_error_finishes_cache_nothing_and_random_traffic_keeps_the_counts():
    s = _sched(12)
    a = _req("a", _toks(10, 2 * PAGE + 1))
    s.add(a)
    s.schedule()
    a.num_computed = a.prefill_end
    s.remove(a, cache=False)
    assert s.prefix.num_pages == 0 and s.pages.num_free == 12
    rng = random.Random(0)
    docs = [_toks(20 + i, 3 * PAGE) for i in range(3)]
    live: list[Request] = []
    for i in range(200):
        if live and (rng.random() < 0.45 or len(live) >= 3):
            r = live.pop(rng.randrange(len(live)))
            r.num_computed = rng.randrange(r.num_computed, r.prefill_end + 1)
            s.remove(r, cache=rng.random() < 0.9)
        elif live and rng.random() < 0.5:  # a step of a running request: its pages register
            r = live[rng.randrange(len(live))]
            r.num_computed = rng.randrange(r.num_computed, r.prefill_end + 1)
            s.computed(r)
        else:
            doc = docs[rng.randrange(3)][: rng.randrange(1, 3 * PAGE)]
            r = _req(
                f"r{i}", doc + _toks(i, rng.randrange(1, 100)), max_tokens=rng.randrange(1, 64)
            )
            s.add(r)
            s.schedule()
            live.extend(x for x in s.running if x not in live)
            for x in list(s.waiting):  # does not fit now: leaves the queue again
                # the remembered match (continued while it waits) is a fresh one
                assert s._cached_prefix(x) == s.prefix.match(x.prompt_ids, x.prefill_end // PAGE)
                s.remove(x)
        _check_refs(s)
    assert s.prefix.hits > 0 and s.prefix.queries > s.prefix.hits


# ---- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    path = resolve_model("tiny")
    model, _ = load_model(path, device="cpu")
    return model, Tokenizer.from_dir(path)


def _engine(tiny, cache: bool, **kw) -> Engine:
    model, tok = tiny
    opts = dict(max_batch=2, host_tokens=64 * 40, gpu_tokens=4 * model.config.index_topk,
                max_model_len=1024, prefill_chunk=64, enable_prefix_caching=cache)  # fmt: skip
    cfg = EngineConfig(**opts | kw)
    return Engine(model, model.config, tok, cfg)


def _serve(eng: Engine, prompts: list[list[int]], steps: int = 6) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    out = {}
    for i, p in enumerate(prompts):  # one after another: each can reuse the ones before
        eng.add_request(f"q{i}", p, params)
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize(
    ("offload", "buffer"), [(True, True), (True, False), (False, True)],
    ids=["offload", "offload-no-prefill-buffer", "gpu-only"],
)  # fmt: skip
def test_cached_prefix_gives_the_logits_of_a_full_prefill(tiny, offload, buffer):
    """A document and a first question on it, another prompt (it takes the prefill buffer's
    rows), then a second question on the document: with the cache the last prompt prefills only
    what follows the document's full pages (read back from the host), and
    every decode step's logits equal the run without the cache, bit for bit (chunks of 64 =
    pages: the chunks it computes are the uncached run's; the cached pages hold the rows the
    same prefill chunks wrote)."""
    doc = _toks(30, 200)
    q1, q2 = doc + _toks(31, 40), doc + _toks(32, 70)
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache, offload=offload, prefill_buffer=buffer)
        log = _record_logits(eng)
        runs[cache] = (_serve(eng, [q1, _toks(36, 230), q2]), log, eng)
    (t0, log0, e0), (t1, log1, e1) = runs[False], runs[True]
    assert t0 == t1
    prefills = [sum(1 for d, _, _ in log if not d) for log in (log0, log1)]
    assert prefills[0] - prefills[1] == 3  # q2's chunks [0, 192): the document's full pages
    dec0 = [x for d, _, x in log0 if d]
    dec1 = [x for d, _, x in log1 if d]
    assert len(dec0) == len(dec1) == 18
    for a, b in zip(dec0, dec1):
        assert torch.equal(a, b)
    m0, m1 = e0.metrics(), e1.metrics()
    assert m0["prefix_cache_hit_rate"] == 0.0
    assert m1["prefix_cache_hit_rate"] == pytest.approx(192 / (240 + 230 + 270))
    # every page is held by the cache alone now, and all of them can be evicted
    s = e1.scheduler
    assert s.pages.num_used == s.prefix.num_pages == s.prefix.num_evictable == 3 + 3 + 1


def test_a_burst_on_one_document_prefills_it_once(tiny):
    """Three requests on one document arriving together: the later two prefill only their own
    tokens, and every decode step's logits equal the run without the cache (the same batches)."""
    doc = _toks(37, 200)
    prompts = [doc + _toks(38 + i, 30 + 20 * i) for i in range(3)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    runs = {}
    for cache in (False, True):
        # prefill first: the decode batches are then the same three rows in both runs
        eng = _engine(tiny, cache, max_batch=4, decode_during_prefill=False)
        log = _record_logits(eng)
        for i, p in enumerate(prompts):
            eng.add_request(f"b{i}", p, params)
        while eng.has_unfinished():
            eng.step()
        runs[cache] = (log, eng)
    (log0, _), (log1, eng) = runs[False], runs[True]
    prefills = [sum(1 for d, _, _ in log if not d) for log in (log0, log1)]
    assert prefills[0] - prefills[1] == 2 * 3  # the document's 3 full pages, twice
    dec0, dec1 = ([x for d, _, x in log if d] for log in (log0, log1))
    assert len(dec0) == len(dec1) > 0
    assert all(torch.equal(a, b) for a, b in zip(dec0, dec1))
    assert eng.scheduler.prefix.hits == 2 * 3 * PAGE


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_hits_whole_prompt_and_miss_give_the_same_tokens(tiny, async_scheduling):
    """After one request on a document, four arrive together: one whose whole prompt is cached
    (it decodes at once), two partial hits and a miss; tokens equal the run without the cache."""
    doc = _toks(30, 300)
    later = [doc[:193], doc[:250] + _toks(2, 90), _toks(3, 200), doc + _toks(4, 70)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache, max_batch=4, async_scheduling=async_scheduling)
        toks = _serve(eng, [doc + _toks(1, 20)])
        for i, p in enumerate(later):
            eng.add_request(f"l{i}", p, params)
        while eng.has_unfinished():
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        runs[cache] = (toks, eng)
    assert runs[True][0] == runs[False][0]
    # 193 tokens: its 3 pages; 250 + 90: 3 pages; the document + 70: 4 pages
    assert runs[True][1].scheduler.prefix.hits == (3 + 3 + 4) * PAGE


def test_a_group_on_a_cached_document_gives_the_same_tokens(tiny):
    """n = 3 sequences of a prompt on a cached document (one shared prefill, which starts after
    the document's pages): tokens equal the run without the cache."""
    doc = _toks(39, 200)
    params = [SamplingParams(max_tokens=5, temperature=0.8, seed=i) for i in range(3)]
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache, max_batch=4)
        toks = _serve(eng, [doc + _toks(40, 20)])
        eng.add_request_group([f"g{i}" for i in range(3)], doc + _toks(41, 50), params)
        while eng.has_unfinished():
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        runs[cache] = (toks, eng)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].scheduler.prefix.hits == 3 * PAGE  # the group's one lookup


def test_a_group_whose_whole_prefill_is_cached_forks_before_decoding(tiny):
    """n = 2 sequences of a prompt whose prefill (every token but the last: here one full page)
    is all cached at admission: the head forks at once and never decodes itself (it crashed
    the step: the head holds only the prompt's pages); each sequence gives the single
    request's tokens."""
    prompt = _toks(42, PAGE + 1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng = _engine(tiny, True, max_batch=4)
    want = _serve(eng, [prompt], steps=4)["q0"]  # caches the page
    eng.add_request_group(["g0", "g1"], prompt, [params, params])
    toks: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert toks == {"g0": want, "g1": want}
    assert eng.scheduler.prefix.hits == PAGE


def test_a_later_turn_reuses_the_answer_pages(tiny):
    """Turn 2 = turn 1's prompt + its answer + a new message: it starts on the pages turn 1
    filled, answer tokens included (their rows were computed by decode steps, not a prefill, so
    its logits are not compared bit for bit with a full prefill's)."""
    eng = _engine(tiny, True)
    log = _record_logits(eng)
    q1 = _toks(34, 240)
    toks = _serve(eng, [q1], steps=20)  # computes 259 tokens: 4 full pages, 16 answer tokens
    turn2 = q1 + toks["q0"] + _toks(35, 30)
    n_before = len(log)
    _serve(eng, [turn2])
    req_prefills = sum(1 for d, _, _ in log[n_before:] if not d)
    assert req_prefills == 1  # [256, 289): the 4 cached pages skipped
    assert eng.scheduler.prefix.hits == 4 * PAGE


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "gpu-only"])
def test_a_request_needing_the_whole_pool_evicts_every_cached_page(tiny, offload):
    """Finished requests leave the host pool full of pages only the cache holds; a request
    needing every page is admitted at its first step (evicting them all, their GPU-pool slots
    forgotten first) and gives the tokens of an engine that never cached."""
    big = _toks(50, 8 * PAGE - 6)
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache, offload=offload, host_tokens=8 * PAGE, max_model_len=8 * PAGE)
        if cache:  # 4 + 2 + 1 pages cached: 7 of the 8
            _serve(eng, [_toks(51, 4 * PAGE + 1), _toks(52, 2 * PAGE + 1), _toks(53, PAGE + 1)])
            s = eng.scheduler
            assert s.prefix.num_pages == s.prefix.num_evictable == 7 and s.pages_in_use == 0
        eng.add_request("big", big, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        first = eng.step()
        assert eng.scheduler.running and not eng.scheduler.waiting and first == []
        assert eng.scheduler.pages.num_free == 0 and eng.scheduler.pages_in_use == 8
        out = {o.request_id: o.new_token_ids for o in first}
        for k, v in _outputs(eng).items():
            out.setdefault(k, []).extend(t for o in v for t in o.new_token_ids)
        runs[cache] = out["big"]
        if cache:
            assert eng.scheduler.prefix.hits == 0
    assert len(runs[True]) == 6 and runs[True] == runs[False]


def test_offload_equals_gpu_only_with_the_cache_on_both(tiny):
    """The lossless property with prefix caching on in both engines (LLM's default, so the
    demo's two): requests on one document, some arriving after it is cached, hitting it; every
    step (prefill chunk or decode) is the same in both, logits bit for bit."""
    model, _ = tiny
    doc = _toks(66, 230)
    first = [doc + _toks(67, 40), _toks(68, 180)]
    later = [doc + _toks(69 + i, 20 + 30 * i) for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for offload in (True, False):
        eng = _engine(tiny, True, offload=offload, max_batch=3,
                      gpu_tokens=3 * model.config.index_topk)  # fmt: skip
        log = _record_logits(eng)
        toks = _serve(eng, first)
        for i, p in enumerate(later):
            eng.add_request(f"l{i}", p, params)
        toks |= {k: [t for o in v for t in o.new_token_ids] for k, v in _outputs(eng).items()}
        runs[offload] = (toks, log, eng.scheduler.prefix.hits)
    (t_off, log_off, hits), (t_gpu, log_gpu, hits_gpu) = runs[True], runs[False]
    assert hits == hits_gpu == 3 * 3 * PAGE  # each later request on the document's 3 pages
    assert t_off == t_gpu
    assert len(log_off) == len(log_gpu)
    for (d1, ids1, a), (d2, ids2, b) in zip(log_off, log_gpu):
        assert (d1, ids1) == (d2, ids2) and torch.equal(a, b), (d1, ids1)


def test_a_received_prompt_kv_is_cached_once_written_and_a_failed_load_is_not(tiny):
    """A prompt whose KV another engine computed (prefill/decode disaggregation) registers its
    full pages once the rows are written, as a prefill's would be: a later local request on the
    same document starts on them and decodes the logits of a full local prefill (the same
    64-token chunks wrote the rows there). A load that fails partway registers nothing."""
    doc, tail = _toks(70, 4 * PAGE + 20), _toks(71, 30)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sender = _engine(tiny, False)
    sender.add_request("s", doc, SamplingParams(max_tokens=1))
    while sender.requests["s"].in_prefill:
        sender.step()
    kv = sender.prompt_kv("s")
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache)
        log = _record_logits(eng)
        if cache:
            eng.add_request("recv", doc, params, prompt_kv=kv)
            _outputs(eng)
            assert eng.scheduler.prefix.num_pages == 4  # the received rows' 4 full pages
            del log[:]
        eng.add_request("local", doc[: 4 * PAGE] + tail, params)
        _outputs(eng)
        runs[cache] = ([x for d, _, x in log if d], eng.scheduler.prefix)
    (dec0, _), (dec1, prefix) = runs[False], runs[True]
    assert prefix.hits == 4 * PAGE and len(dec0) == len(dec1) == 4
    assert all(torch.equal(a, b) for a, b in zip(dec0, dec1))

    class Failing:  # the connector dies after the first layer
        num_layers, num_tokens, row_bytes = kv.num_layers, kv.num_tokens, kv.row_bytes

        def chunk(self, layer, start, end):
            if layer > 0:
                raise OSError("connection reset")
            return kv.chunk(layer, start, end)

    eng = _engine(tiny, True)
    eng.add_request("bad", doc, params, prompt_kv=Failing())
    with pytest.raises(OSError, match="connection reset"):
        eng.step()
    assert eng.scheduler.prefix.num_pages == 0 and eng.scheduler.pages.num_used == 0


@pytest.mark.parametrize(("failing", "kept"), [("prefill", 1), ("decode", 2)])
def test_recover_keeps_only_pages_whose_rows_were_complete(tiny, failing, kept):
    """A step that fails (here before it writes anything: the second prefill chunk, or the
    first decode step, each of which would fill a page) registers none of its rows: after
    Engine.recover the cache holds the pages earlier steps completed, and a later request on
    the document decodes the logits of an engine that never cached."""
    doc = _toks(80, 3 * PAGE - 1)  # + 1 token: 3 chunks of 64, 64, 63, then the first decode
    later = doc + _toks(81, 40)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache)
        if cache:
            forward = eng.runner.forward

            def fail_once(batch, *a, forward=forward):
                fails = batch.is_decode if failing == "decode" else batch.chunk_start == PAGE
                if fails and batch.requests[0].request_id == "doc":
                    raise RuntimeError("step failed")
                return forward(batch, *a)

            eng.runner.forward = fail_once
            eng.add_request("doc", doc + [1], params)
            with pytest.raises(RuntimeError, match="step failed"):
                while eng.has_unfinished():
                    eng.step()
            eng.recover()
            eng.runner.forward = forward
            assert eng.scheduler.prefix.num_pages == kept  # what the completed steps wrote
        log = _record_logits(eng)
        eng.add_request("later", later, params)
        _outputs(eng)
        runs[cache] = [x for d, _, x in log if d]
    assert eng.scheduler.prefix.hits == kept * PAGE and len(runs[True]) == 4
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


def _outputs(eng: Engine) -> dict[str, list]:
    """Step until done: each request's outputs (StepOutput) in order."""
    out: dict[str, list] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o)
    return out


def test_prompt_logprobs_requests_compute_the_whole_prompt_on_a_cached_document(tiny):
    """A request (and a group of n = 2) asking for ``prompt_logprobs`` on a cached document
    takes no cached page (vLLM skips the cache for them too): every prompt position's logprobs
    are computed, equal to the engine without the cache, and it reports no cached token."""
    doc = _toks(60, 200)
    prompt = doc + _toks(61, 30)
    lp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache, max_batch=4)
        _serve(eng, [doc + _toks(62, 10)])  # caches the document's pages
        eng.add_request("lp", prompt, lp)
        eng.add_request_group(["g0", "g1"], prompt, [lp, lp])
        runs[cache] = (_outputs(eng), eng)
    (plain, _), (cached, eng) = runs[False], runs[True]
    for rid in ("lp", "g0", "g1"):
        assert cached[rid][0].prompt_logprobs == plain[rid][0].prompt_logprobs
        assert len(cached[rid][0].prompt_logprobs) == len(prompt)
        assert cached[rid][0].cached_tokens == 0
        assert [o.new_token_ids for o in cached[rid]] == [o.new_token_ids for o in plain[rid]]
    assert eng.scheduler.prefix.hits == 0 and eng.scheduler.prefix.num_pages > 0


def test_a_grammar_request_on_a_cached_document_gives_the_same_tokens(tiny):
    """Structured output masks the sampled tokens only: a JSON-schema request whose prompt
    starts on cached pages samples what it samples without the cache."""
    from runtime.structured_output import json_schema_grammar
    from tests.test_structured_output import SCHEMA

    doc = _toks(70, 200)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                            grammar=json_schema_grammar(SCHEMA))  # fmt: skip
    runs = {}
    for cache in (False, True):
        eng = _engine(tiny, cache)
        _serve(eng, [doc + _toks(71, 10)])
        eng.add_request("js", doc + _toks(72, 30), params)
        runs[cache] = [t for o in _outputs(eng)["js"] for t in o.new_token_ids]
        if cache:
            assert eng.scheduler.prefix.hits == 3 * PAGE
    assert runs[True] == runs[False] and runs[True][-1] == tiny[0].config.eos_token_id


def test_reset_stats_zeroes_the_lookups_and_keeps_the_pages(tiny):
    eng = _engine(tiny, True)
    doc = _toks(63, 200)
    _serve(eng, [doc + [5], doc + [6]])
    m = eng.metrics()
    assert m["prefix_cache_hits"] == 3 * PAGE and m["prefix_cache_queries"] == 2 * 201
    pages = m["prefix_cache_pages"]
    eng.reset_stats()
    m = eng.metrics()
    assert (m["prefix_cache_queries"], m["prefix_cache_hits"]) == (0.0, 0.0)
    assert m["prefix_cache_hit_rate"] == 0.0 and m["prefix_cache_pages"] == pages
    _serve(eng, [doc + [7]])  # the pages stayed: a hit
    assert eng.metrics()["prefix_cache_hit_rate"] == pytest.approx(3 * PAGE / 201)


def test_reset_prefix_cache_evicts_what_no_request_holds(tiny):
    """``Scheduler.reset_prefix_cache``: the pages no request holds are evicted (their GPU-pool
    rows released), a running request's are not; an idle engine's pools are then empty."""
    eng = _engine(tiny, True)
    s = eng.scheduler
    doc = _toks(64, 200)
    _serve(eng, [doc + [5], _toks(65, 150)])
    assert s.prefix.num_pages == 5 and s.pages.num_used == 5
    eng.add_request("r", doc + [6], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()  # admitted on the document's 3 cached pages
    assert s.reset_prefix_cache() == 2  # the other prompt's: the document's are held
    assert s.prefix.num_pages == 3
    _outputs(eng)
    n = s.prefix.num_pages
    assert s.reset_prefix_cache() == n >= 3 and s.prefix.num_pages == s.prefix.num_evictable == 0
    assert s.pages.num_free == s.pages.num_pages
    assert eng.cache.stats()["gpu_pool_usage"] == 0.0


def test_llm_caches_prefixes_unless_told_not_to():
    """LLM (and so serve and generate) turns prefix caching on by default, as vLLM does;
    ``enable_prefix_caching=False`` (--no-enable-prefix-caching) turns it off; EngineConfig's
    own default stays off (an engine built directly holds nothing once its requests end)."""
    from echo_compile.llm import LLM

    opts = dict(device="cpu", compile=False, max_batch=2, host_tokens=64 * 16,
                gpu_tokens=2 * 32, max_model_len=512, progress=False)  # fmt: skip
    assert LLM("tiny", **opts).engine.scheduler.prefix is not None
    assert LLM("tiny", enable_prefix_caching=False, **opts).engine.scheduler.prefix is None
    assert not EngineConfig().enable_prefix_caching


def test_engine_config_prefix_caching():
    assert (
        EngineConfig(enable_prefix_caching=True)
        .scheduler_config(load_model(resolve_model("tiny"), device="cpu")[0].config)
        .enable_prefix_caching
    )
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        EngineConfig(enable_prefix_caching=1)
    assert EngineConfig(enable_prefix_caching=True, dp=2, tp=2).enable_prefix_caching


def test_status_after_the_scheduler_lets_go():
    s = _sched(4)
    r = _req("a", _toks(40, 70))
    s.add(r)
    s.schedule()
    s.remove(r)
    assert r.status is Status.FINISHED and r.pages == []


def test_server_reports_cached_tokens_and_metrics():
    """Through the OpenAI server and the official client: a second prompt on the same document
    reports its cached prompt tokens in ``usage.prompt_tokens_details``; /metrics has the hit
    rate."""
    import httpx
    import openai
    from server_utils import running_server

    from echo_compile.llm import LLM
    from runtime.async_engine import AsyncEngine
    from runtime.server import build_app

    llm = LLM("tiny", device="cpu", compile=False, max_batch=2, host_tokens=64 * 32,
              gpu_tokens=2 * 32, max_model_len=512, progress=False,
              enable_prefix_caching=True)  # fmt: skip
    aengine = AsyncEngine(llm.engine)
    try:
        with running_server(build_app(aengine, "tiny")) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x")
            doc = _toks(50, 150)
            usage = [
                client.completions.create(
                    model="tiny", prompt=doc + _toks(51 + i, 20), max_tokens=3, temperature=0
                ).usage
                for i in range(2)
            ]
            assert [u.prompt_tokens_details.cached_tokens for u in usage] == [0, 2 * PAGE]
            assert usage[1].prompt_tokens == 170
            # n = 2 on the document (one shared prefill): its cached tokens counted once, as
            # its prompt tokens are; prompt_logprobs computes the whole prompt: none cached
            lp = {"extra_body": {"prompt_logprobs": 1}}
            for extra, cached in (({"n": 2}, 2 * PAGE), (lp, 0)):
                u = client.completions.create(
                    model="tiny", prompt=doc + _toks(53, 20), max_tokens=2, temperature=0, **extra
                ).usage
                assert (u.prompt_tokens, u.prompt_tokens_details.cached_tokens) == (170, cached)
            text = httpx.get(base + "/metrics").text
            rate = next(ln for ln in text.splitlines() if ln.startswith("echo_prefix_cache_hit"))
            # (the prompt_logprobs request looked nothing up)
            assert float(rate.split()[-1]) == pytest.approx(2 * 128 / 510)
            # idle: the cached pages no request holds are free to an admission, so the pool
            # reads empty (it read 1 - free / pages: nearly full with a warm cache)
            assert llm.engine.scheduler.prefix.num_evictable > 0
            usage_line = next(ln for ln in text.splitlines() if ln.startswith("echo_host_pool"))
            assert float(usage_line.split()[-1]) == 0.0
    finally:
        aengine.shutdown()


@pytest.mark.cuda
def test_compiled_engine_with_prefix_cache_cuda():
    """On the GPU, compiled (CUDA graphs, compiled prefill): decode logits with the prefix cache
    equal the run without it, bit for bit, offloading, with no recompile after warm-up."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests.test_compile import make_engine

    path = resolve_model("tiny")
    model, _ = load_model(path, device="cuda")
    tiny_cuda = (model, Tokenizer.from_dir(path))
    torch._dynamo.reset()
    counters.clear()
    doc = _toks(30, 200)
    prompts = [doc + _toks(31, 40), _toks(36, 230), doc + _toks(32, 70)]
    dec = {}
    for cache in (False, True):
        eng = make_engine(tiny_cuda, True, compiled=True, strict=True, compile_prefill=True,
                          enable_prefix_caching=cache)  # fmt: skip
        eng.runner.warmup(calls=3, progress=False)
        log = _record_logits(eng)
        with torch.compiler.set_stance("fail_on_recompile"):
            _serve(eng, prompts)
        dec[cache] = [x for d, _, x in log if d]
        if cache:
            assert eng.metrics()["prefix_cache_hit_rate"] > 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(dec[True]) == len(dec[False]) == 18
    for a, b in zip(dec[False], dec[True]):
        assert torch.equal(a, b)
