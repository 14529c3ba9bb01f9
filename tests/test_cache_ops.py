"""The cache-manager ops: opcheck, reference semantics, Triton kernels against the references
(TRITON_INTERPRET=1 on CPU, real kernels when CUDA is present) on fresh random states, the
invariant checker, the host slot allocator and the host pool."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from custom_ops import cache_kernels as K
from custom_ops import cache_layout as L
from custom_ops import cache_ops as C
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool
from custom_ops.cache.host_pool import allocate_host_rows
from custom_ops.cache.invariants import CacheInvariantError, check_pool, fill_random
from custom_ops.cache.kv_cache import KVCache
from custom_ops.cache_ref import offload_ref
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE
from runtime.host_slots import HostSlotAllocator


@pytest.fixture(
    params=[(True, K.LOOKUP_COPY_ROWS, True), (True, 2, True), (True, 0, True),
            (True, K.LOOKUP_COPY_ROWS, False), (False, 0, True)],  # fmt: skip
    ids=["one-launch", "one-launch-lookup-copies-2", "one-launch-copy-programs-only",
         "one-launch-output-after-lookup", "launches"],  # fmt: skip
)
def device(request, device, monkeypatch):
    """Every kernel test runs free and recall in one launch (K.FUSED, the default) with each
    lookup program copying up to K.LOOKUP_COPY_ROWS (the default), 2 or none of the rows it
    places (the copy programs copy the rest), with the output programs waiting for the lookup
    (K.RECALL_OUT_EARLY off), and as a launch per phase. (The interpreter runs the programs in id
    order, so the early output reads final slots here and its late path only sees PENDING past
    the capacity; the reads that race the lookup are exercised by tests/test_cache_cuda.py.)"""
    monkeypatch.setattr(K, "FUSED", request.param[0])
    monkeypatch.setattr(K, "LOOKUP_COPY_ROWS", request.param[1])
    monkeypatch.setattr(K, "RECALL_OUT_EARLY", request.param[2])
    return device


def make_pool(n_g, n_h, topk, max_batch, fmt="fp8", device="cpu", seed=0, occupied=None):
    cfg = CacheConfig(1, n_h, n_g, topk, fmt=fmt, max_batch=max_batch)
    gen = torch.Generator().manual_seed(seed)
    pool = GpuPool(cfg, device)
    host_kv = torch.randint(0, 256, (n_h, cfg.row_bytes), dtype=torch.uint8, generator=gen)
    host_kv = host_kv.to(device)
    occ = n_g if occupied is None else occupied
    fill_random(pool, occ, gen, host_kv=host_kv)
    return pool, host_kv, gen


def selection(pool, gen, b, k, hits, misses, dups=0, pad=True):
    """[b, k] int32: `hits` resident and `misses` non-resident distinct host slots, `dups` of them
    repeated, shuffled, -1 padded."""
    h2g = pool.host_to_gpu.cpu()
    res = torch.nonzero(h2g >= 0).flatten()
    non = torch.nonzero(h2g < 0).flatten()
    hits, misses = min(hits, res.numel()), min(misses, non.numel())
    s = torch.cat([res[torch.randperm(res.numel(), generator=gen)[:hits]],
                   non[torch.randperm(non.numel(), generator=gen)[:misses]]])
    if dups and s.numel():
        s = torch.cat([s, s[torch.randint(0, s.numel(), (dups,), generator=gen)]])
    s = s[torch.randperm(s.numel(), generator=gen)][: b * k]
    out = torch.full((b * k,), -1, dtype=torch.int32)
    pos = torch.randperm(b * k, generator=gen)[: s.numel()] if pad else torch.arange(s.numel())
    out[pos] = s.int()
    return out.view(b, k).to(pool.gpu_kv.device)


def state(p):
    return (p.gpu_free, p.gpu_priority, p.gpu_to_host, p.host_to_gpu)


def resident(p) -> dict[int, int]:
    """host slot -> stamp: the placement-independent view of a pool."""
    h2g = p.host_to_gpu.long().cpu()
    h = torch.nonzero(h2g >= 0).flatten()
    return dict(zip(h.tolist(), p.gpu_priority.long().cpu()[h2g[h]].tolist(), strict=True))


def stamps(p) -> torch.Tensor:
    """[N_H] int64: the stamp of each resident host slot, -1 where not on the GPU."""
    h2g = p.host_to_gpu.long().cpu()
    out = torch.full_like(h2g, -1)
    on = h2g >= 0
    out[on] = p.gpu_priority.long().cpu()[h2g[on]]
    return out


def ring(p) -> list[int]:
    """The live entries of the ring of free slots, from HEAD (the others are unspecified)."""
    n_g, head, nfree = p.gpu_free.numel(), int(p.meta[L.HEAD]), int(p.meta[L.NFREE])
    return p.gpu_free.cpu()[(head + torch.arange(nfree)) % n_g].tolist()


def assert_exact(ref, ker):
    """Ref and kernel agree on everything: where the kernel is deterministic (one program of
    the pool pass, one lookup block, no duplicated miss; allocate always) placement included."""
    for name in ("gpu_priority", "gpu_to_host", "host_to_gpu", "indices", "meta", "totals",
                 "gpu_kv"):  # fmt: skip
        assert torch.equal(getattr(ref, name), getattr(ker, name)), name
    assert ring(ref) == ring(ker)


def set_ring(p, free: list[int], head: int) -> None:
    """Free exactly the GPU slots ``free`` of a full pool, listed in this order from ``head``."""
    n_g = p.gpu_free.numel()
    f = torch.tensor(free, dtype=torch.long, device=p.gpu_free.device)
    p.host_to_gpu[p.gpu_to_host[f].long()] = -1
    p.gpu_to_host[f] = -1
    p.gpu_priority[f] = -1
    p.gpu_free[(head + torch.arange(len(free), device=f.device)) % n_g] = f.int()
    p.meta[L.HEAD], p.meta[L.NFREE] = head, len(free)
    check_pool(p)


def assert_same_up_to_ties(before, ref, ker):
    """Ref and kernel may evict different slots of the threshold age bucket (and place rows in
    different free slots); everything else must agree. Vectorised: runs at full H200 sizes."""
    sb, sr, sk = stamps(before), stamps(ref), stamps(ker)
    inb, inr, ink = sb >= 0, sr >= 0, sk >= 0
    bucket = L.age_bucket((int(before.meta[L.CLOCK]) - sb) & L.CLOCK_MASK)
    ev_r, ev_k = inb & ~inr, inb & ~ink
    assert torch.equal(bucket[ev_r].sort().values, bucket[ev_k].sort().values)
    assert torch.equal(inr & ~inb, ink & ~inb)  # the same host slots placed
    both = inr & ink
    assert torch.equal(sr[both], sk[both])
    keep = [L.CLOCK, L.NFREE, L.OVERFLOW, L.IDX_HW, L.LAST_EVICT, L.HEAD]
    assert ref.meta[keep].tolist() == ker.meta[keep].tolist()
    assert ref.totals.tolist() == ker.totals.tolist()
    b_h2g = before.host_to_gpu.long().cpu()
    for p, ev in ((ref, ev_r), (ker, ev_k)):  # indices = the evicted slots
        got = p.indices[: int(p.meta[L.IDX_HW])].long().cpu().sort().values
        assert torch.equal(got, b_h2g[ev].sort().values)


class CacheStep(torch.nn.Module):
    """What a decode step does with the cache, per layer: write the new tokens, recall the
    selection, read the selected rows (the attention's input)."""

    def __init__(self, cache: KVCache):
        super().__init__()
        self.cache = cache

    def forward(self, rows, irows, new_slots, host_slots):
        outs = []
        for layer in self.cache.layers:
            layer.store(rows, irows, new_slots)
            pool, slots = layer.fetch(host_slots)
            outs.append(pool[slots.clamp(min=0).long()] * (slots >= 0)[..., None])
        return torch.stack(outs)


def step_inputs(gen, written, pos, b=8, k=64, row=656):
    rows = torch.randint(0, 256, (b, row), dtype=torch.uint8, generator=gen)
    irows = torch.randint(0, 256, (b, INDEX_ROW_BYTES), dtype=torch.uint8, generator=gen)
    hs = written[: pos + b][torch.randint(0, pos + b, (b, k), generator=gen)].int()
    hs[torch.rand(b, k, generator=gen) < 0.1] = -1
    return rows, irows, written[pos : pos + b], hs


# ---- opcheck ------------------------------------------------------------------------------------
def test_opcheck_every_op():
    pool, host_kv, gen = make_pool(300, 1024, 16, 4, occupied=280)
    hs = selection(pool, gen, 4, 16, hits=30, misses=20, dups=3)
    n = torch.tensor([25], dtype=torch.int32)
    want = torch.nonzero(pool.host_to_gpu < 0).flatten()[:40].int()
    base = (*state(pool), pool.indices, pool.meta)
    torch.library.opcheck(torch.ops.echo.allocate.default, (*base, want, torch.tensor([15])
                                                             .int()))
    torch.library.opcheck(torch.ops.echo.free.default, (*base, pool.hist, pool.totals, hs, n))
    torch.library.opcheck(torch.ops.echo.recall.default, (
        host_kv, pool.gpu_kv, *state(pool), pool.indices, pool.miss_host, pool.meta, pool.hist,
        pool.totals, hs))
    torch.library.opcheck(torch.ops.echo.release.default, (*state(pool), pool.meta, hs))
    index_k = torch.zeros(1024 // PAGE, INDEX_PAGE_BYTES, dtype=torch.uint8)
    rows = torch.randint(0, 256, (5, host_kv.shape[1]), dtype=torch.uint8, generator=gen)
    irows = torch.randint(0, 256, (5, INDEX_ROW_BYTES), dtype=torch.uint8, generator=gen)
    slots = torch.tensor([3, -1, 700, 64, 1023])
    torch.library.opcheck(torch.ops.echo.offload.default, (host_kv, index_k, rows, irows, slots))


# ---- reference semantics ------------------------------------------------------------------------
def test_recall_reference_semantics():
    pool, host_kv, gen = make_pool(512, 4096, 32, 8)  # full pool
    hs = selection(pool, gen, 8, 32, hits=150, misses=60, dups=20)
    before = copy.deepcopy(pool)
    out = pool.recall(host_kv, hs)
    check_pool(pool, selected=hs, gpu_slots=out, host_kv=host_kv)
    valid = hs >= 0
    assert torch.equal(out >= 0, valid)  # order kept, -1 stays -1
    assert torch.equal(pool.gpu_kv[out[valid].long()], host_kv[hs[valid].long()])
    n_miss = torch.unique(hs[valid & (before.host_to_gpu[hs.clamp(min=0).long()] < 0)]).numel()
    assert int(pool.meta[L.LAST_MISS]) == n_miss == int(pool.totals[L.RECALLED])  # dups once
    needed = max(n_miss - int(before.meta[L.NFREE]), 0)
    assert needed > 0 and int(pool.meta[L.LAST_EVICT]) == C.evict_target(needed, 512, 256)
    assert int(pool.totals[L.SELECTED]) == int(valid.sum())
    # Evicted slots come from the oldest buckets: none older survives unselected.
    rb, ra = resident(before), resident(pool)
    clock = int(before.meta[L.CLOCK])
    age = {h: (clock - s) & L.CLOCK_MASK for h, s in rb.items()}
    ev = rb.keys() - ra.keys()
    kept = {h for h in rb.keys() & ra.keys() if ra[h] == rb[h]}  # untouched survivors
    bucket = lambda h: int(L.age_bucket(torch.tensor(age[h])))  # noqa: E731
    assert ev and min(map(bucket, ev)) >= max(map(bucket, kept))
    assert not ev & set(hs[valid].tolist())


def test_free_exact_count_protection_and_overflow():
    pool, _, gen = make_pool(400, 2048, 50, 8, occupied=390)
    hs = selection(pool, gen, 8, 50, hits=390, misses=0)  # protect every resident slot but 0
    pool.free(hs, torch.tensor([30], dtype=torch.int32))
    # 10 free already, every resident slot protected: nothing can be evicted -> overflow.
    assert int(pool.meta[L.LAST_EVICT]) == 0 and int(pool.meta[L.OVERFLOW]) == 1
    pool, _, gen = make_pool(400, 2048, 50, 8, occupied=390)
    hs = selection(pool, gen, 2, 50, hits=60, misses=0)
    prot = set(hs[hs >= 0].tolist())
    before = resident(pool)
    pool.free(hs, torch.tensor([37], dtype=torch.int32))
    check_pool(pool)
    gone = before.keys() - resident(pool).keys()
    # max(37 - 10, 0) = 27 needed, plus the reserve (400 >> 6 = 6): the next 6 oldest
    assert len(gone) == 27 + C.reserve_slots(400) == 33 and not gone & prot
    pool.free(hs, torch.tensor([37], dtype=torch.int32))
    assert int(pool.meta[L.LAST_EVICT]) == 0 and int(pool.indices[0]) == -1  # 37 free already


@pytest.mark.parametrize("impl", ["ref", "kernel"])
def test_eviction_takes_a_reserve_and_later_steps_skip_it(impl, device):
    """A needed eviction frees needed + N_G/64 of the oldest slots; the next step's misses then
    fit the reserve and nothing is evicted; the one after evicts again (needed + reserve)."""
    pool, host_kv, gen = make_pool(256, 4096, 32, 4, device=device)  # full, reserve 4, CAP 128
    assert C.reserve_slots(256) == 4 and C.evict_target(0, 256, 128) == 0
    for step, (misses, evicted, free_after) in enumerate([(3, 7, 4), (3, 0, 1), (3, 6, 4)]):
        hs = selection(pool, gen, 4, 32, hits=40, misses=misses)
        before = copy.deepcopy(pool)
        args = (host_kv, pool.gpu_kv, *state(pool), pool.indices, pool.miss_host, pool.meta)
        out = (C.recall_ref(*args, pool.totals, hs) if impl == "ref"
               else K.recall_cuda(*args, pool.hist, pool.totals, hs))
        check_pool(pool, selected=hs, gpu_slots=out, host_kv=host_kv)
        assert int(pool.meta[L.LAST_EVICT]) == evicted, step
        assert int(pool.meta[L.NFREE]) == free_after and int(pool.meta[L.OVERFLOW]) == 0
        rb, ra = resident(before), resident(pool)
        clock = int(before.meta[L.CLOCK])
        age = {h: (clock - s) & L.CLOCK_MASK for h, s in rb.items()}
        bucket = {h: int(L.age_bucket(torch.tensor(a))) for h, a in age.items()}
        ev = rb.keys() - ra.keys()
        kept = {h for h in rb.keys() & ra.keys() if ra[h] == rb[h]}
        if ev:  # oldest first: no untouched survivor is older than a victim
            assert min(bucket[h] for h in ev) >= max(bucket[h] for h in kept)


def test_recall_without_eviction_pads_a_long_index_list(device):
    """A recall that evicts nothing must clear every entry the last call listed, even when that
    list spans several programs' shares of the padding (1024 entries each): the programs read the
    high-water mark while the pass runs, so nothing may change it before the copy launch."""
    pool, host_kv, gen = make_pool(3000, 8192, 128, 16, device=device, occupied=2000)
    pool.indices[:2048] = torch.arange(2048, dtype=torch.int32, device=device)
    pool.meta[L.IDX_HW] = 2048  # as after an eviction of 2048 slots
    check_pool(pool)
    hs = selection(pool, gen, 16, 128, hits=500, misses=300)
    ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
    args = lambda p: (host_kv, p.gpu_kv, *state(p), p.indices, p.miss_host, p.meta)  # noqa: E731
    C.recall_ref(*args(ref), ref.totals, hs)
    out = K.recall_cuda(*args(ker), ker.hist, ker.totals, hs)
    check_pool(ker, selected=hs, gpu_slots=out, host_kv=host_kv)
    assert int(ker.meta[L.LAST_EVICT]) == 0 and int(ker.meta[L.IDX_HW]) == 0
    assert bool((ker.indices == -1).all())
    assert_same_up_to_ties(pool, ref, ker)


def test_allocate_reference_and_bad_input():
    pool, _, _ = make_pool(100, 1024, 10, 4, occupied=90)
    want = torch.nonzero(pool.host_to_gpu < 0).flatten()[:20].int()
    pool.allocate(want, torch.tensor([12], dtype=torch.int32))  # only 10 free
    check_pool(pool, allow_overflow=True)
    assert int(pool.meta[L.LAST_ALLOC]) == 10 and int(pool.meta[L.OVERFLOW]) == 1
    assert torch.equal(pool.indices[:10], pool.host_to_gpu[want[:10].long()])
    assert bool((pool.indices[10:] == -1).all())
    with pytest.raises(ValueError, match="already on the GPU"):
        pool.allocate(want, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="twice"):
        pool.allocate(torch.tensor([5, 5], dtype=torch.int32), torch.tensor([2]).int())
    with pytest.raises(ValueError, match="int32 tensor of shape"):
        pool.allocate(want, torch.tensor([1]))
    with pytest.raises(ValueError, match="N_H"):
        pool.recall(torch.zeros(1024, 656, dtype=torch.uint8), torch.full((1, 4), 5000).int())


def test_release_frees_gpu_slots_and_tolerates_duplicates():
    pool, host_kv, gen = make_pool(256, 1024, 32, 4, occupied=200)
    res = torch.nonzero(pool.host_to_gpu >= 0).flatten()[:50]
    lst = torch.cat([res, res[:5], torch.tensor([-1, 3, 900])])
    on_gpu = {h for h in lst.tolist() if h >= 0 and int(pool.host_to_gpu[h]) >= 0}
    pool.release(lst)
    check_pool(pool, host_kv=host_kv)
    assert int(pool.meta[L.NFREE]) == 56 + len(on_gpu)
    assert bool((pool.host_to_gpu[lst[lst >= 0]] == -1).all())


def test_clock_wraps_without_breaking_eviction_order():
    pool, host_kv, gen = make_pool(128, 1024, 16, 4)
    pool.meta[L.CLOCK] = L.CLOCK_MASK - 2
    for _ in range(6):
        hs = selection(pool, gen, 4, 16, hits=30, misses=10)
        out = pool.recall(host_kv, hs)
        check_pool(pool, selected=hs, gpu_slots=out, host_kv=host_kv)
    assert int(pool.meta[L.CLOCK]) == 3


# ---- kernels vs references ----------------------------------------------------------------------
CASES = [  # n_g, n_h, topk, max_batch, occupied, hits, misses, dups, fmt
    (37, 128, 8, 4, 37, 10, 9, 2, "fp8"),
    (1024, 4096, 64, 16, 1024, 600, 37, 5, "fp8"),
    (1500, 4096, 64, 16, 700, 300, 500, 40, "bf16"),
    (3000, 8192, 128, 16, 3000, 1000, 1000, 100, "fp8"),
    (2049, 4096, 128, 8, 2049, 0, 1024, 0, "bf16"),
    (700, 2048, 32, 16, 0, 0, 300, 30, "fp8"),
]


@pytest.mark.parametrize("case", CASES)
def test_recall_kernel_matches_reference(case, device):
    n_g, n_h, topk, mb, occ, hits, misses, dups, fmt = case
    for seed in range(2):  # fresh random states
        pool, host_kv, gen = make_pool(n_g, n_h, topk, mb, fmt, device, seed, occ)
        for _ in range(2):  # and a second step on the state the first one left
            hs = selection(pool, gen, mb, topk, hits, misses, dups)
            ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
            o_ref = C.recall_ref(host_kv, ref.gpu_kv, *state(ref), ref.indices, ref.miss_host,
                                 ref.meta, ref.totals, hs)
            o_ker = K.recall_cuda(host_kv, ker.gpu_kv, *state(ker), ker.indices, ker.miss_host,
                                  ker.meta, ker.hist, ker.totals, hs)
            check_pool(ker, selected=hs, gpu_slots=o_ker, host_kv=host_kv)
            check_pool(ref, selected=hs, gpu_slots=o_ref, host_kv=host_kv)
            assert torch.equal(ker.gpu_kv[o_ker[hs >= 0].long()], ref.gpu_kv[o_ref[hs >= 0].long()])
            assert_same_up_to_ties(pool, ref, ker)
            pool = ker


@pytest.mark.parametrize("rows", [0, 1, 3, 64])
@pytest.mark.parametrize("occ", [300, 1000], ids=["free-slots", "eviction"])
@pytest.mark.parametrize("dups", [0, 6])
def test_lookup_programs_copy_their_first_rows_and_the_copy_programs_the_rest(
    rows, occ, dups, monkeypatch
):
    """K.LOOKUP_COPY_ROWS: in the one-launch recall each lookup program copies up to ``rows`` of
    the misses it placed from the ring, the copy programs the others (and the victims' rows
    when 1000 of 1024 slots are taken). 16 lookup blocks of 16 entries: the first all misses,
    the others two each. Every row lands: rows, maps and output as the reference's; and the
    split is the one intended: the interpreter runs the programs in id order, so block b's
    misses take the ranks after block b - 1's, and a rank is the lookup's to copy (marked
    -1 - h in miss_host) when the ring serves it (rank < free slots) and it is among its
    block's first ``rows``."""
    monkeypatch.setattr(K, "FUSED", True)
    monkeypatch.setattr(K, "LIST_BLOCK", 16)
    monkeypatch.setattr(K, "LOOKUP_COPY_ROWS", rows)
    for seed in range(2):
        pool, host_kv, gen = make_pool(1024, 4096, 64, 4, "fp8", "cpu", seed, occ)
        h2g = pool.host_to_gpu
        res = torch.nonzero(h2g >= 0).flatten()
        non = torch.nonzero(h2g < 0).flatten()
        non = non[torch.randperm(non.numel(), generator=gen)]
        hs = res[torch.randperm(res.numel(), generator=gen)[:256]].clone()
        hs[:16] = non[:16]  # block 0: all misses
        hs[16::16], hs[17::16] = non[16:31], non[31:46]  # two in each other block
        if dups:  # a miss of block 0 again in other blocks
            hs[40:40 + 16 * dups:16] = non[:dups]
        hs = hs.int().view(4, 64)
        ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
        o_ref = C.recall_ref(host_kv, ref.gpu_kv, *state(ref), ref.indices, ref.miss_host,
                             ref.meta, ref.totals, hs)  # fmt: skip
        o_ker = K.recall_cuda(host_kv, ker.gpu_kv, *state(ker), ker.indices, ker.miss_host,
                              ker.meta, ker.hist, ker.totals, hs)  # fmt: skip
        check_pool(ker, selected=hs, gpu_slots=o_ker, host_kv=host_kv)
        assert torch.equal(ker.gpu_kv[o_ker.flatten().long()], host_kv[hs.flatten().long()])
        assert torch.equal(ref.gpu_kv[o_ref.flatten().long()], host_kv[hs.flatten().long()])
        assert int(ker.meta[L.LAST_MISS]) == int(ref.meta[L.LAST_MISS]) == 46
        assert_same_up_to_ties(pool, ref, ker)
        free = 1024 - occ
        firsts = [0, *range(16, 46, 2)]  # each block's first rank
        sizes = [16] + [2] * 15
        want = sum(max(0, min(n, rows, free - r)) for r, n in zip(firsts, sizes, strict=True))
        assert int((ker.miss_host[:46] < 0).sum()) == want


@pytest.mark.parametrize("case", CASES)
def test_free_and_allocate_kernels_match_reference(case, device):
    n_g, n_h, topk, mb, occ, hits, _, _, fmt = case
    cap = min(mb * topk, n_g)
    for seed in range(2):
        pool, _, gen = make_pool(n_g, n_h, topk, mb, fmt, device, seed, occ)
        prot = selection(pool, gen, mb, topk, hits, 0)
        n = torch.tensor([int(torch.randint(0, cap + 1, (1,), generator=gen))],
                         dtype=torch.int32, device=device)
        ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
        C.free_ref(*state(ref), ref.indices, ref.meta, ref.totals, prot, n)
        K.free_cuda(*state(ker), ker.indices, ker.meta, ker.hist, ker.totals, prot, n)
        check_pool(ker, allow_overflow=True)
        assert_same_up_to_ties(pool, ref, ker)
        if n_g <= K.SCAN_BLOCK:  # one program ranks the victims in slot order: exactly
            assert_exact(ref, ker)
        # allocate on the state free left: exact agreement up to placement
        pool = ker
        non = torch.nonzero(pool.host_to_gpu < 0).flatten()
        want = non[torch.randperm(non.numel(), generator=gen)[:cap].to(device)].int()
        n = torch.tensor([min(int(n), want.numel())], dtype=torch.int32, device=device)
        ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
        C.allocate_ref(*state(ref), ref.indices, ref.meta, want, n)
        K.allocate_cuda(*state(ker), ker.indices, ker.meta, want, n)
        check_pool(ker, allow_overflow=True)
        assert_exact(ref, ker)  # allocate is one program: the ring's head, in rank order
        k = int(ker.meta[L.LAST_ALLOC])
        assert torch.equal(ker.indices[:k], ker.host_to_gpu[want[:k].long()])
        assert bool((ker.indices[k:] == -1).all())


def test_recall_padded_bucket_and_capacity_overflow(device):
    """A bucket padded past CAP (extra rows all -1) is fine; more real misses than CAP (a broken
    scheduler) leave the rest -1 and count an overflow, in the reference and the kernel alike."""
    pool, host_kv, gen = make_pool(300, 4096, 16, 4, device=device)  # CAP = 64
    hs = torch.full((8, 16), -1, dtype=torch.int32, device=device)  # 128 entries > CAP
    hs[:4] = selection(pool, gen, 4, 16, hits=40, misses=24)
    for impl in ("ref", "kernel"):
        p = copy.deepcopy(pool)
        args = (host_kv, p.gpu_kv, *state(p), p.indices, p.miss_host, p.meta)
        out = (C.recall_ref(*args, p.totals, hs) if impl == "ref"
               else K.recall_cuda(*args, p.hist, p.totals, hs))
        check_pool(p, selected=hs, gpu_slots=out, host_kv=host_kv)
    non = torch.nonzero(pool.host_to_gpu < 0).flatten()[:100].int()
    hs = torch.cat([non, torch.full((28,), -1, dtype=torch.int32, device=device)]).view(8, 16)
    for impl in ("ref", "kernel"):
        p = copy.deepcopy(pool)
        args = (host_kv, p.gpu_kv, *state(p), p.indices, p.miss_host, p.meta)
        out = (C.recall_ref(*args, p.totals, hs) if impl == "ref"
               else K.recall_cuda(*args, p.hist, p.totals, hs))
        check_pool(p, host_kv=host_kv, allow_overflow=True)
        assert int(p.meta[L.OVERFLOW]) == 1 and int(p.meta[L.LAST_ALLOC]) == 64, impl
        assert int((out >= 0).sum()) == 64 and int(p.totals[L.RECALLED]) == 64
        placed = out >= 0
        assert torch.equal(p.gpu_kv[out[placed].long()], host_kv[hs[placed].long()])


def test_allocate_kernel_when_short_of_free_slots(device):
    pool, _, gen = make_pool(1500, 4096, 64, 16, device=device, occupied=1480)
    free = ring(pool)
    want = torch.nonzero(pool.host_to_gpu < 0).flatten()[:64].int()
    n = torch.tensor([50], dtype=torch.int32, device=device)
    K.allocate_cuda(*state(pool), pool.indices, pool.meta, want, n)
    check_pool(pool, allow_overflow=True)
    assert int(pool.meta[L.LAST_ALLOC]) == 20 and int(pool.meta[L.OVERFLOW]) == 1
    assert int(pool.meta[L.NFREE]) == 0 and pool.indices[:21].tolist() == free + [-1]
    # on a full pool: nothing placed, another overflow, HEAD unmoved
    head = int(pool.meta[L.HEAD])
    K.allocate_cuda(*state(pool), pool.indices, pool.meta, want[20:], n)
    check_pool(pool, allow_overflow=True)
    assert int(pool.meta[L.LAST_ALLOC]) == 0 and int(pool.meta[L.OVERFLOW]) == 2
    assert int(pool.meta[L.HEAD]) == head and bool((pool.indices == -1).all())


def test_allocate_kernel_past_the_want_list(device):
    """n > len(want_host) (bad input the reference rejects; the kernel cannot check it without a
    sync): the kernel places the listed slots only, once each, and counts an OVERFLOW."""
    pool, _, gen = make_pool(1500, 4096, 64, 16, device=device, occupied=100)
    want = torch.nonzero(pool.host_to_gpu < 0).flatten()[:10].int()
    n = torch.tensor([30], dtype=torch.int32, device=device)
    K.allocate_cuda(*state(pool), pool.indices, pool.meta, want, n)
    check_pool(pool, allow_overflow=True)
    assert int(pool.meta[L.LAST_ALLOC]) == 10 and int(pool.meta[L.OVERFLOW]) == 1
    assert bool((pool.host_to_gpu[want.long()] >= 0).all())


# ---- the ring of free slots: pop from HEAD in rank order, push behind the last entry ----------
def _run(impl: str, op: str, p, *args):
    """One op on pool p by the reference or by the kernel (the launchers)."""
    if op == "recall":
        host_kv, hs = args
        a = (host_kv, p.gpu_kv, *state(p), p.indices, p.miss_host, p.meta)
        if impl == "ref":
            return C.recall_ref(*a, p.totals, hs)
        return K.recall_cuda(*a, p.hist, p.totals, hs)
    if op == "allocate":
        want, n = args
        cnt = torch.tensor([n], dtype=torch.int32, device=want.device)
        fn = C.allocate_ref if impl == "ref" else K.allocate_cuda
        return fn(*state(p), p.indices, p.meta, want, cnt)
    fn = C.release_ref if impl == "ref" else K.release_cuda
    return fn(*state(p), p.meta, args[0])


def _misses(p, hs_list: list[int], k: int) -> torch.Tensor:
    """[1, k] int32: host slots ``hs_list`` then -1 padding."""
    out = torch.full((1, k), -1, dtype=torch.int32)
    out[0, : len(hs_list)] = torch.tensor(hs_list, dtype=torch.int32)
    return out.to(p.gpu_kv.device)


@pytest.mark.parametrize("impl", ["ref", "kernel"])
def test_ring_pops_from_head_in_rank_order_and_wraps(impl, device, monkeypatch):
    """allocate and a steady recall take the ring's entries from HEAD in rank order (want order,
    the misses' order of first appearance), round the end of the ring; HEAD and NFREE follow."""
    monkeypatch.setattr(K, "ALLOC_BLOCK", 4)  # allocate's program loops over several chunks
    pool, host_kv, _ = make_pool(64, 512, 16, 4, device=device)  # full
    free = [9, 40, 3, 63, 0, 17, 22, 51, 30, 5]
    set_ring(pool, free, head=60)  # positions 60..63, then 0..5
    non = torch.nonzero(pool.host_to_gpu < 0).flatten()
    want = non[:6].int()
    _run(impl, "allocate", pool, want, 6)
    check_pool(pool)
    assert pool.indices[:7].tolist() == free[:6] + [-1]
    assert pool.gpu_to_host[free[:6]].tolist() == want.tolist()
    assert int(pool.meta[L.HEAD]) == 2 and ring(pool) == free[6:]
    miss = non[[10, 8, 12]].tolist()
    out = _run(impl, "recall", pool, host_kv, _misses(pool, miss, 16))
    check_pool(pool)  # (allocate maps slots without rows: no row check)
    assert torch.equal(pool.gpu_kv[free[6:9]], host_kv[miss])
    assert out[0, :3].tolist() == free[6:9] and int(pool.meta[L.LAST_EVICT]) == 0
    assert int(pool.meta[L.HEAD]) == 5 and ring(pool) == free[9:]


@pytest.mark.parametrize("impl", ["ref", "kernel"])
@pytest.mark.parametrize("nfree", [0, 2])
def test_refill_serves_misses_from_victims_and_rings_the_surplus(impl, nfree, device):
    """A recall with M = 5 misses and F free slots (< M) evicts needed + reserve = 5 - F + 4 of
    the oldest: misses r < F pop the ring, miss F + v takes victim v (victims in slot order),
    and exactly the surplus victims are left in the ring, at [HEAD + M, HEAD + F + E)."""
    pool, host_kv, _ = make_pool(256, 4096, 16, 4, device=device)  # full, reserve 4
    free = [77, 201][:nfree]
    if free:
        set_ring(pool, free, head=255)
    head = int(pool.meta[L.HEAD])
    clock = int(pool.meta[L.CLOCK])
    victims = [10, 40, 41, 100, 150, 200, 230, 231, 240][: 9 - nfree]  # E = 5 - F + 4
    occ = pool.gpu_priority >= 0
    pool.gpu_priority[occ] = (clock - 1) & L.CLOCK_MASK  # age 1: the youngest evictable
    pool.gpu_priority[torch.tensor(victims, device=device)] = (clock - 300) & L.CLOCK_MASK
    miss = torch.nonzero(pool.host_to_gpu < 0).flatten()[[7, 3, 11, 5, 9]].tolist()
    out = _run(impl, "recall", pool, host_kv, _misses(pool, miss, 16))
    check_pool(pool, host_kv=host_kv)
    e = len(victims)
    served = free + victims[: 5 - nfree]
    assert out[0, :5].tolist() == served and out[0, 5:].eq(-1).all()
    assert int(pool.meta[L.LAST_EVICT]) == e and pool.indices[:e].tolist() == victims
    assert ring(pool) == victims[5 - nfree :]
    assert int(pool.meta[L.HEAD]) == (head + 5) % 256 and int(pool.meta[L.NFREE]) == 4


@pytest.mark.parametrize("impl", ["ref", "kernel"])
def test_release_pushes_behind_the_ring_in_list_order(impl, device):
    pool, host_kv, _ = make_pool(64, 512, 16, 4, device=device)
    set_ring(pool, [6, 60], head=62)
    slots = [33, 2, 61, 12]
    lst = pool.gpu_to_host[slots].tolist()
    lst = torch.tensor([lst[0], -1, lst[1], 500, lst[2], lst[3]], device=device)  # 500: not on
    _run(impl, "release", pool, lst)
    check_pool(pool, host_kv=host_kv)
    assert ring(pool) == [6, 60] + slots and int(pool.meta[L.HEAD]) == 62
    # an empty pool (every slot free) and a list naming no resident slot: nothing changes
    before = ring(pool)
    _run(impl, "release", pool, torch.tensor([500, -1], device=device))
    assert ring(pool) == before


def test_fresh_pool_places_from_slot_zero(device):
    """GpuPool's initial ring is arange(N_G) from HEAD 0: the first misses take slots 0, 1, ...;
    a pool emptied again (release of everything) has every slot in its ring once."""
    cfg = CacheConfig(1, 512, 64, 16, max_batch=4)
    pool = GpuPool(cfg, device)
    host_kv = torch.randint(0, 256, (512, cfg.row_bytes), dtype=torch.uint8).to(device)
    check_pool(pool)
    assert ring(pool) == list(range(64))
    out = _run("kernel", "recall", pool, host_kv, _misses(pool, [9, 4, 300], 16))
    check_pool(pool, host_kv=host_kv)
    assert out[0, :3].tolist() == [0, 1, 2] and int(pool.meta[L.HEAD]) == 3
    _run("kernel", "release", pool, torch.arange(512, device=device))
    check_pool(pool)
    assert sorted(ring(pool)) == list(range(64)) and int(pool.meta[L.NFREE]) == 64


@pytest.mark.parametrize("occ,misses", [(200, 20), (250, 60), (256, 40)])
def test_ring_pass_exact_in_one_program_and_over_several(occ, misses, device, monkeypatch):
    """The kernel against the reference from random ring states: exactly (placement included)
    with the pool pass in one program; with 8 programs of 32 (ranks and victims across
    programs) exactly when nothing is evicted, else up to ties."""
    for block in (1024, 32):
        monkeypatch.setattr(K, "SCAN_BLOCK", block)
        pool, host_kv, gen = make_pool(256, 4096, 64, 4, device=device, seed=block, occupied=occ)
        for _ in range(2):
            hs = selection(pool, gen, 4, 64, hits=100, misses=misses)
            ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
            _run("ref", "recall", ref, host_kv, hs)
            _run("kernel", "recall", ker, host_kv, hs)
            check_pool(ker, selected=hs, host_kv=host_kv)
            if block == 1024 or int(ker.meta[L.LAST_EVICT]) == 0:
                assert_exact(ref, ker)
            else:
                assert_same_up_to_ties(pool, ref, ker)
            pool = ker


@pytest.mark.parametrize("n_g,occ,m", [(64, 60, 70), (2500, 2500, 3000), (1100, 100, 1)])
def test_release_kernel_matches_reference(n_g, occ, m, device):
    pool, _, gen = make_pool(n_g, 8192, 32, 4, device=device, occupied=occ)
    lst = torch.randint(-1, 8192, (m,), generator=gen).to(device)
    ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
    C.release_ref(*state(ref), ref.meta, lst)
    K.release_cuda(*state(ker), ker.meta, lst)
    check_pool(ker)
    assert resident(ref) == resident(ker) and torch.equal(ref.meta, ker.meta)
    # the pushes: behind the old ring, as a set (their order comes from the blocks' atomics
    # and, for a slot listed twice, from which lane's exchange won)
    old = ring(pool)
    assert ring(ker)[: len(old)] == old == ring(ref)[: len(old)]
    assert sorted(ring(ker)) == sorted(ring(ref))


@pytest.mark.parametrize("fmt,t,n_h", [("fp8", 1, 128), ("bf16", 64, 4096), ("fp8", 300, 8192)])
def test_offload_kernel_matches_reference(fmt, t, n_h, device):
    gen = torch.Generator().manual_seed(t)
    row = 656 if fmt == "fp8" else 1152
    host = torch.randint(0, 256, (n_h, row), dtype=torch.uint8, generator=gen).to(device)
    index_k = torch.randint(0, 256, (n_h // PAGE, INDEX_PAGE_BYTES), dtype=torch.uint8,
                            generator=gen).to(device)
    rows = torch.randint(0, 256, (t, row), dtype=torch.uint8, generator=gen).to(device)
    irows = torch.randint(0, 256, (t, INDEX_ROW_BYTES), dtype=torch.uint8, generator=gen).to(device)
    slots = torch.randperm(n_h, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.2] = -1
    slots = slots.to(device)
    h_ref, i_ref = host.clone(), index_k.clone()
    offload_ref(h_ref, i_ref, rows, irows, slots)
    K.offload_cuda(host, index_k, rows, irows, slots)
    assert torch.equal(host, h_ref) and torch.equal(index_k, i_ref)


# ---- the invariant checker catches what it claims to ------------------------------------------
CORRUPTIONS = ["map", "ring_twice", "ring_occupied", "head", "prio", "nfree", "pending",
               "scratch", "row"]  # fmt: skip


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_invariant_checker_catches_corruption(corrupt):
    pool, host_kv, gen = make_pool(64, 512, 16, 4, occupied=40)
    check_pool(pool, host_kv=host_kv)
    g = int(torch.nonzero(pool.gpu_priority >= 0)[0])
    h = int(pool.gpu_to_host[g])
    head = int(pool.meta[L.HEAD])
    if corrupt == "map":
        pool.host_to_gpu[h] = (g + 1) % 64
    elif corrupt == "ring_twice":  # a free slot listed twice (one listed no more)
        pool.gpu_free[(head + 1) % 64] = pool.gpu_free[head]
    elif corrupt == "ring_occupied":  # an occupied slot in the ring instead of a free one
        pool.gpu_free[head] = g
    elif corrupt == "head":
        pool.meta[L.HEAD] = 64
    elif corrupt == "prio":
        pool.gpu_priority[g] = -1
    elif corrupt == "nfree":
        pool.meta[L.NFREE] += 1
    elif corrupt == "pending":
        pool.host_to_gpu[int(torch.nonzero(pool.host_to_gpu < 0)[0])] = L.PENDING
    elif corrupt == "scratch":
        pool.meta[L.ALLOC_CTR] = 3
    else:
        pool.gpu_kv[g, 7] ^= 1
    with pytest.raises(CacheInvariantError):
        check_pool(pool, host_kv=host_kv)


# ---- host slots, host pool, KVCache ------------------------------------------------------------
def test_host_slot_allocator():
    a = HostSlotAllocator(10)
    p1 = a.alloc(4)
    assert p1 == [0, 1, 2, 3] and a.num_free == 6 and a.num_used == 4
    assert a.alloc(7) is None and a.num_free == 6  # nothing taken on failure
    p2 = a.alloc(6)
    assert sorted(p1 + p2) == list(range(10)) and a.alloc(1) is None
    a.free(p1)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([p1[0]])
    with pytest.raises(ValueError, match="out of range"):
        a.free([10])
    assert a.alloc(2) == [0, 1] and a.num_free == 2
    assert HostSlotAllocator.slots_of([2])[:3] == [128, 129, 130]


def test_host_slot_allocator_against_a_set():
    """Random alloc / share / free sequences: alloc always hands out the lowest free ids (the
    stack is re-sorted lazily after frees), the counts agree with a plain set model, and a
    duplicate in one free call raises and frees nothing."""
    rng = random.Random(5)
    for trial in range(20):
        n = rng.randrange(1, 200)
        a, free, refs, held = HostSlotAllocator(n), set(range(n)), {}, []
        for _ in range(300):
            op = rng.random()
            if op < 0.45:
                k = rng.randrange(0, 12)
                got = a.alloc(k)
                want = sorted(free)[:k] if k <= len(free) else None
                assert got == want
                if got is not None:
                    free -= set(got)
                    refs.update(dict.fromkeys(got, 1))
                    held.append(got)
            elif op < 0.55 and held:
                pages = rng.choice(held)
                a.share(pages)
                for p in pages:
                    refs[p] += 1
                held.append(list(pages))
            elif held:
                pages = held.pop(rng.randrange(len(held)))
                if pages and rng.random() < 0.1:
                    with pytest.raises(ValueError, match="double free"):
                        a.free(pages + pages[:1])
                back = a.free(pages)
                for p in pages:
                    refs[p] -= 1
                assert back == [p for p in pages if refs[p] == 0]
                free |= set(back)
            assert a.num_free == len(free), trial


def test_host_pool_cpu_and_size_error():
    rows = allocate_host_rows(3, 128, 656, torch.device("cpu"), pinned=True)
    assert len(rows) == 3 and rows[0].shape == (128, 656) and rows[0].dtype == torch.uint8
    assert rows[0].data_ptr() != rows[1].data_ptr()  # separate bases, not views of one
    with pytest.raises(ValueError, match=r"\d+ bytes") as e:
        allocate_host_rows(61, 2**40, 656, torch.device("cpu"), pinned=True)
    assert "GiB" in str(e.value) and "--host-tokens" in str(e.value)  # the flag that sizes it


def test_kvcache_fetch_release_stats_cpu():
    cfg = CacheConfig(num_layers=2, host_tokens=1024, gpu_tokens=128, topk=32, max_batch=4)
    cache = KVCache(cfg)
    gen = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        layer.host_kv.copy_(torch.randint(0, 256, layer.host_kv.shape, dtype=torch.uint8,
                                          generator=gen))
    hs = torch.randint(0, 1024, (4, 32), generator=gen).int()
    hs[0, 5:] = -1
    for layer in cache.layers:
        pool, slots = layer.fetch(hs)
        v = hs >= 0
        assert torch.equal(pool[slots[v].long()], layer.host_kv[hs[v].long()])
        check_pool(layer.pool, selected=hs, gpu_slots=slots, host_kv=layer.host_kv)
    st = cache.stats()
    assert len(st["hit_rate"]) == 2 and st["hit_rate"][0] < 0.2 and st["gpu_pool_usage"] > 0
    cache.release(hs.long())
    for layer in cache.layers:
        check_pool(layer.pool)
        assert int(layer.pool.meta[L.NFREE]) == 128


@pytest.mark.parametrize("prefetch", ["off", "request"])
def test_kvcache_warm_kernels_changes_nothing(prefetch):
    """warm_kernels runs release and store on nothing: every buffer (maps, free ring, host rows,
    indexer cache, staging state) is bit for bit what it was, with a pool half full."""
    cfg = CacheConfig(2, 1024, 128, 32, fmt="fp8", max_batch=4, prefetch=prefetch)
    cache = KVCache(cfg)
    gen = torch.Generator().manual_seed(2)
    for layer in cache.layers:
        layer.host_kv.copy_(torch.randint(0, 256, layer.host_kv.shape, dtype=torch.uint8,
                                          generator=gen))
        layer.index_k.copy_(torch.randint(0, 256, layer.index_k.shape, dtype=torch.uint8,
                                          generator=gen))
        layer.fetch(torch.randint(0, 1024, (4, 16), generator=gen).int())
    if prefetch != "off":
        for layer in cache.layers:
            layer.staging.ema.uniform_(generator=gen)
    before = {name: b.clone() for name, b in cache.named_buffers()}
    cache.warm_kernels()
    after = dict(cache.named_buffers())
    assert before.keys() == after.keys() and len(before) > 8
    for name, b in before.items():
        assert torch.equal(b, after[name]), name


# ---- torch.compile on CPU: one graph, in-place, CUDA-graph ready -------------------------------
def test_compiled_step_cpu_inductor_matches_eager_without_clones():
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import ReinplaceCounters, counters

    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    cfg = CacheConfig(2, 4096, 1024, 64, fmt="fp8", max_batch=8)
    gen = torch.Generator().manual_seed(3)
    written = torch.randperm(4096, generator=gen)
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        step = torch.compile(CacheStep(KVCache(cfg)), fullgraph=True)
        eager = CacheStep(KVCache(cfg))
        for i in range(4):
            args = step_inputs(gen, written, 8 * i)
            assert torch.equal(step(*args), eager(*args))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert ReinplaceCounters.get_total_missed() == 0  # no buffer cloned by Inductor
    for layer in step._orig_mod.cache.layers:
        check_pool(layer.pool, host_kv=layer.host_kv)


def test_compiled_step_is_cudagraph_ready():
    """docs/graph_notes.md's lint: the AOT graph has no cudagraph-incompatible node (sync, dynamic
    shape) and every input it mutates is a static buffer (so reduce-overhead will not skip)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.utils import get_static_address_type
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    found = {}

    def lint(gm, example_inputs):
        def fw(g, _):
            found["bad"] = get_first_incompatible_cudagraph_node(g)
            ph = [n for n in g.graph.nodes if n.op == "placeholder"]
            copies = [n for n in g.graph.nodes if n.target is torch.ops.aten.copy_.default]
            mutated = [n.args[0] for n in copies if n.args[0].op == "placeholder"]
            found["mutated"] = len(mutated)
            found["plain"] = [m.name for m in mutated
                              if get_static_address_type(example_inputs[ph.index(m)]) is None]
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw,
                                     keep_inference_input_mutations=True)

    torch._dynamo.reset()
    cfg = CacheConfig(2, 4096, 1024, 64, fmt="fp8", max_batch=8)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        torch.compile(CacheStep(KVCache(cfg)), backend=lint, fullgraph=True)(
            *step_inputs(gen, torch.randperm(4096, generator=gen), 0))
    assert found["bad"] is None
    # 2 layers x (offload: host_kv, index_k; recall: gpu_kv, 4 maps, indices, miss_host, meta,
    # hist, stats), all module buffers
    assert found["mutated"] == 2 * 12 and found["plain"] == []
