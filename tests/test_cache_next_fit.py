"""The placement paths of the cache kernels (issue 18): next fit by one program (allocate, and
recall's steady step) and the multi-program pass, and both copy variants, each against the
reference on fresh random states (TRITON_INTERPRET=1 on CPU), plus next fit's cursor rules."""

from __future__ import annotations

import copy

import pytest
import torch
from test_cache_ops import assert_same_up_to_ties, make_pool, resident, selection, state

from custom_ops import cache_kernels as K
from custom_ops import cache_layout as L
from custom_ops import cache_ops as C
from custom_ops.cache.invariants import check_pool


def _free_only(pool, slots: list[int]) -> None:
    """Release exactly the GPU slots ``slots`` (the pool is full before)."""
    hs = pool.gpu_to_host[torch.tensor(slots, device=pool.gpu_to_host.device)]
    C.release_ref(*state(pool), pool.meta, hs)


def _allocate(pool, want, n: int) -> None:
    cnt = torch.tensor([n], dtype=torch.int32, device=want.device)
    K.allocate_cuda(*state(pool), pool.indices, pool.meta, want, cnt)


def test_next_fit_starts_at_the_cursor_wraps_and_moves_it(device, monkeypatch):
    monkeypatch.setattr(K, "ALLOCATE_NEXT_FIT", True)
    pool, _, _ = make_pool(300, 4096, 16, 8, device=device)  # full pool, CAP = 128
    _free_only(pool, [5, 6, 200, 290, 295])
    want = torch.nonzero(pool.host_to_gpu < 0).flatten()[:8].int()
    pool.meta[L.CURSOR] = 250
    _allocate(pool, want, 4)  # 290, 295, then round the end of the pool: 5, 6
    check_pool(pool)
    assert pool.indices[:5].tolist() == [290, 295, 5, 6, -1]
    assert pool.gpu_to_host[[290, 295, 5, 6]].tolist() == want[:4].tolist()
    assert int(pool.meta[L.CURSOR]) == 7 and int(pool.meta[L.NFREE]) == 1
    assert int(pool.meta[L.IDX_HW]) == 4
    _allocate(pool, want[4:], 1)  # continues from 7: slot 200
    check_pool(pool)
    assert pool.indices[:2].tolist() == [200, -1] and int(pool.meta[L.CURSOR]) == 201
    # A cursor outside the pool (any value is valid state) scans from slot 0.
    _free_only(pool, [3, 250])
    pool.meta[L.CURSOR] = -7
    _allocate(pool, want[5:], 1)
    assert pool.indices[0].item() == 3 and int(pool.meta[L.CURSOR]) == 4
    pool.meta[L.CURSOR] = 10**6
    _allocate(pool, want[6:], 1)
    assert pool.indices[0].item() == 250 and int(pool.meta[L.CURSOR]) == 251
    check_pool(pool)


def test_next_fit_scans_the_whole_pool_in_several_steps(device, monkeypatch):
    """Free slots spread over more than one scan step (NF_BLOCK shrunk to 64), and fewer than
    asked for: all of them are taken, in pool order from the cursor, and OVERFLOW counts it."""
    monkeypatch.setattr(K, "ALLOCATE_NEXT_FIT", True)
    monkeypatch.setattr(K, "NF_BLOCK", 64)
    pool, _, _ = make_pool(1000, 4096, 16, 8, device=device)
    free = [17, 130, 260, 999, 640]
    _free_only(pool, free)
    pool.meta[L.CURSOR] = 200
    want = torch.nonzero(pool.host_to_gpu < 0).flatten()[:8].int()
    _allocate(pool, want, 8)
    check_pool(pool, allow_overflow=True)
    assert pool.indices[:6].tolist() == [260, 640, 999, 17, 130, -1]
    assert int(pool.meta[L.LAST_ALLOC]) == 5 and int(pool.meta[L.OVERFLOW]) == 1
    assert int(pool.meta[L.NFREE]) == 0 and int(pool.meta[L.CURSOR]) == 131


def test_allocate_on_a_full_pool_places_nothing_and_counts_an_overflow(device, monkeypatch):
    monkeypatch.setattr(K, "ALLOCATE_NEXT_FIT", True)
    pool, _, _ = make_pool(2500, 8192, 16, 8, device=device)  # full, 3 scan blocks
    pool.indices[:5] = torch.arange(5, dtype=torch.int32)  # as a previous call left them
    pool.meta[L.IDX_HW] = 5
    want = torch.nonzero(pool.host_to_gpu < 0).flatten()[:4].int()
    _allocate(pool, want, 4)
    check_pool(pool, allow_overflow=True)
    assert int(pool.meta[L.LAST_ALLOC]) == 0 and int(pool.meta[L.OVERFLOW]) == 1
    assert bool((pool.indices == -1).all()) and int(pool.meta[L.IDX_HW]) == 0


@pytest.mark.parametrize("next_fit,pre", [(True, 0), (True, 16), (False, 0)])
def test_allocate_paths_match_reference(next_fit, pre, device, monkeypatch):
    monkeypatch.setattr(K, "ALLOCATE_NEXT_FIT", next_fit)
    monkeypatch.setattr(K, "NF_PRELOAD", pre)  # 16 < n: ranks from registers and from memory
    monkeypatch.setattr(K, "NF_BLOCK", 256)  # several scan steps at this size
    for seed, (occ, n) in enumerate([(2000, 37), (2900, 100), (2990, 40)]):
        pool, _, gen = make_pool(3000, 8192, 64, 4, device=device, seed=seed, occupied=occ)
        pool.meta[L.CURSOR] = int(torch.randint(0, 3000, (1,), generator=gen))
        non = torch.nonzero(pool.host_to_gpu < 0).flatten()
        want = non[torch.randperm(non.numel(), generator=gen)[:n].to(device)].int()
        ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
        cnt = torch.tensor([n], dtype=torch.int32, device=device)
        C.allocate_ref(*state(ref), ref.indices, ref.meta, want, cnt)
        _allocate(ker, want, n)
        check_pool(ker, allow_overflow=True)
        assert resident(ref) == resident(ker)
        assert ref.meta.tolist()[:4] == ker.meta.tolist()[:4]
        k = int(ker.meta[L.LAST_ALLOC])
        assert k == min(n, 3000 - occ)
        assert torch.equal(ker.indices[:k], ker.host_to_gpu[want[:k].long()])
        assert bool((ker.indices[k:] == -1).all())


# (occupied, hits, misses, dups): steady steps (no eviction) below and above NF_MAX_MISSES = 24,
# one with few free slots (its expected scan, 20 x 3000 / 40 slots, is above NF_MAX_SCAN = 1024:
# the multi-program pass), and steps that must evict (the multi-program pass in any setting).
RECALL_CASES = [
    (2000, 200, 20, 5),
    (2000, 100, 90, 10),
    (2960, 100, 20, 0),
    (2990, 100, 60, 0),
    (3000, 300, 9, 2),
]


@pytest.mark.parametrize("nf_max,early,pre", [(24, True, 0), (24, True, 8), (0, False, 0)])
def test_recall_paths_match_reference(nf_max, early, pre, device, monkeypatch):
    monkeypatch.setattr(K, "NF_MAX_MISSES", nf_max)
    monkeypatch.setattr(K, "NF_PRELOAD", pre)
    monkeypatch.setattr(K, "COPY_EARLY", early)
    monkeypatch.setattr(K, "COPY_OWN_FINAL", early)  # the copy launch's finaliser, new or old
    monkeypatch.setattr(K, "LOOKUP_SKIP_CLEAN", early)  # blocks without a miss skip the claim
    monkeypatch.setattr(K, "LIST_BLOCK", 32)  # 8 lookup blocks: some have no miss
    monkeypatch.setattr(K, "NF_BLOCK", 256)
    monkeypatch.setattr(K, "NF_MAX_SCAN", 1024)
    for seed, (occ, hits, misses, dups) in enumerate(RECALL_CASES):
        pool, host_kv, gen = make_pool(3000, 8192, 64, 4, device=device, seed=seed, occupied=occ)
        for _ in range(2):  # a second step on the state the first left
            hs = selection(pool, gen, 4, 64, hits, misses, dups)
            ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
            o_ref = C.recall_ref(host_kv, ref.gpu_kv, *state(ref), ref.indices, ref.miss_host,
                                 ref.meta, ref.totals, hs)  # fmt: skip
            o_ker = K.recall_cuda(host_kv, ker.gpu_kv, *state(ker), ker.indices, ker.miss_host,
                                  ker.meta, ker.hist, ker.totals, hs)  # fmt: skip
            check_pool(ker, selected=hs, gpu_slots=o_ker, host_kv=host_kv)
            # Which path placed: next fit moves the cursor, the multi-program pass does not.
            n_miss, free = int(ker.meta[L.LAST_MISS]), int(pool.meta[L.NFREE])
            nf = 0 < n_miss <= min(nf_max, free) and n_miss * 3000 <= 1024 * free
            assert (int(ker.meta[L.CURSOR]) != int(pool.meta[L.CURSOR])) == nf
            assert torch.equal(o_ker >= 0, o_ref >= 0)
            assert torch.equal(ker.gpu_kv[o_ker[hs >= 0].long()], host_kv[hs[hs >= 0].long()])
            assert_same_up_to_ties(pool, ref, ker)
            pool = ker
