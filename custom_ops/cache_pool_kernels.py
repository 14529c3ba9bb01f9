"""Triton kernels of the cache-manager ops that scan the GPU pool (grids sized by the pool):
free's age histogram and the eviction + placement pass (free, recall, allocate), with its
next-fit placement; launched by cache_kernels.py, whose docstring gives the coordination."""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.cache_constexpr import (
    AGE_EXACT,
    AGE_SHIFT,
    CLOCK_MASK,
    M_ALLOC_CTR,
    M_CLOCK,
    M_CURSOR,
    M_DONE,
    M_EQ_CTR,
    M_IDX_HW,
    M_LAST_ALLOC,
    M_LAST_EVICT,
    M_NFREE,
    M_OVERFLOW,
    M_VICT_CTR,
    NBINS,
    S_EVICTED,
)
from custom_ops.cache_list_kernels import _pdl_start


# ---- helpers ------------------------------------------------------------------------------------
@triton.jit
def _bucket(age):
    """cache_ops.age_bucket for age >= 1."""
    return tl.where(
        age < AGE_EXACT, age, tl.minimum(AGE_EXACT + ((age - AGE_EXACT) >> AGE_SHIFT), NBINS - 1)
    )


@triton.jit
def _last_program(meta):
    """True in the last program of the grid to get here; every program must call it once."""
    tl.debug_barrier()  # all threads' stores of this program are issued before the release
    done = tl.atomic_add(meta + M_DONE, 1, sem="acq_rel")
    return done == tl.num_programs(0) - 1


@triton.jit
def _pad(indices, lo, hi, pid, nprog, BLOCK: tl.constexpr):
    """indices[lo:hi] = -1, spread over the programs."""
    for start in range(lo + pid * BLOCK, hi, nprog * BLOCK):
        o = start + tl.arange(0, BLOCK)
        tl.store(indices + o, tl.full([BLOCK], -1, tl.int32), mask=o < hi)


@triton.jit
def _next_fit(
    gpu_free,
    prio,
    g2h,
    h2g,
    indices,
    meta,
    want_host,
    n,
    n_g,
    clock,
    WRITE_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
    PRE: tl.constexpr,
):
    """One program: take the first n free slots at or after meta[CURSOR] in pool order (wrapping
    once round the pool), map rank r to want_host[r], move the cursor past the last one taken;
    return how many were taken (< n only when the pool has fewer free slots). The steps of the
    scan are dependent (each needs the count found so far), so it is for small n or dense free
    slots: the cursor makes consecutive calls continue where the last stopped (next fit), so
    the calls of one sweep of the pool read each free bit about once between them."""
    if PRE > 0:
        # want_host[:PRE] read beside the cursor, ranks < PRE then taken from registers
        # (tl.gather): one dependent round trip less per call (count -> free bits -> stores).
        pre_i = tl.arange(0, PRE)
        pre = tl.load(want_host + pre_i, mask=pre_i < n, other=0)
    start = tl.load(meta + M_CURSOR)
    start = tl.where((start >= 0) & (start < n_g), start, 0)
    found = n * 0
    scanned = n * 0
    last = start - 1
    ar = tl.arange(0, BLOCK)
    while (found < n) & (scanned < n_g):
        i = scanned + ar  # linear position from the cursor
        lin = start + i
        offs = tl.where(lin >= n_g, lin - n_g, lin)
        f = tl.load(gpu_free + offs, mask=i < n_g, other=0) != 0
        fi = f.to(tl.int32)
        rank = found + tl.cumsum(fi, axis=0) - 1
        take = f & (rank < n)
        if PRE > 0:
            h_pre = tl.gather(pre, tl.minimum(tl.maximum(rank, 0), PRE - 1), 0)
            h_mem = tl.load(want_host + rank, mask=take & (rank >= PRE), other=0)
            h = tl.where(rank < PRE, h_pre, h_mem)
        else:
            h = tl.load(want_host + rank, mask=take, other=0)
        tl.store(g2h + offs, h, mask=take)
        tl.store(h2g + h, offs, mask=take)  # h was PENDING (recall) or absent (allocate)
        tl.store(prio + offs, tl.zeros([BLOCK], tl.int32) + clock, mask=take)
        tl.store(gpu_free + offs, tl.zeros([BLOCK], tl.int8), mask=take)
        if WRITE_IDX:
            tl.store(indices + rank, offs, mask=take)
        last = tl.maximum(last, tl.max(tl.where(take, lin, -1), axis=0))
        found = tl.minimum(found + tl.sum(fi, axis=0), n)
        scanned += BLOCK
    nxt = last + 1
    tl.store(meta + M_CURSOR, tl.where(nxt >= n_g, nxt - n_g, nxt))
    return found


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _hist_kernel(prio, meta, hist, want_ptr, n_g, cap, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    """Histogram of the age buckets of evictable slots, only when free must evict (with the
    reserve most calls need not: every program returns after two loads)."""
    if PDL:
        _pdl_start()
    pid = tl.program_id(0)
    needed = tl.minimum(tl.load(want_ptr), cap) - tl.load(meta + M_NFREE)
    if needed > 0:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        p = tl.load(prio + offs, mask=offs < n_g, other=-1)
        age = (tl.load(meta + M_CLOCK) - p) & CLOCK_MASK
        b = tl.where((p >= 0) & (age > 0), _bucket(age), 0)  # bucket 0: not evictable
        cnt = tl.histogram(b, NBINS)
        bins = tl.arange(0, NBINS)
        tl.atomic_add(hist + bins, cnt, mask=(cnt > 0) & (bins > 0), sem="relaxed")


@triton.jit
def _evict_place_kernel(
    prio,
    gpu_free,
    g2h,
    h2g,
    indices,
    meta,
    hist,
    stats,
    want_ptr,
    want_host,
    n_g,
    cap,
    reserve,
    nf_max,
    nf_scan,
    EVICT: tl.constexpr,
    PLACE: tl.constexpr,
    WRITE_IDX: tl.constexpr,
    PAD_IDX: tl.constexpr,
    HANDOFF: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    NF_BLOCK: tl.constexpr,
    NF_PRE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One pass over the pool, per BLOCK-slot block, of up to two phases (free and recall's
    eviction and recall's and allocate's placement were separate launches before issue 18).

    EVICT: with needed = max(min(want, cap) - free, 0) > 0, evict target = min(needed + reserve,
    cap) slots (cache_layout.evict_target): every evictable slot in buckets above the threshold
    bucket T (from hist) and the first, by atomic rank, of those in T.
    PLACE: take n = min(want, cap) free slots (the block's own victims included: a block knows its
    victims, so no other block's eviction has to finish first), ranked by a prefix sum of the
    block's free bits plus one atomicAdd for the block's base; rank r < n maps want_host[r].
    The last program finalises (free count, index high-water mark, stats, reset of the scratch).
    Nothing to do (the common case with the reserve): program 0 alone pads ``indices`` and
    records zeros; no atomics, no barrier.
    HANDOFF (recall, whose copy launch follows): placing without evicting, the count placed is
    known up front (min(n, free): every free slot is counted), so program 0 records it and the
    copy launch's last program updates the free count and the index high-water mark and resets the
    rank counter; no barrier and no meta[DONE] atomic here. (NFREE and IDX_HW cannot change in
    this launch: every program reads them.)"""
    if PDL:
        _pdl_start()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n_g
    # Issued before the counts are known, so its round trip overlaps theirs (a scan is a chain of
    # dependent round trips; this removes one). Unused when there is nothing to do (200 KB).
    # Eviction alone (free) needs no free bits: no load, so its steady step reads no pool array.
    f = offs < 0
    if PLACE:
        f = tl.load(gpu_free + offs, mask=inb, other=0) != 0
    want = tl.load(want_ptr)
    n = tl.minimum(want, cap)
    nfree = tl.load(meta + M_NFREE)
    clock = tl.load(meta + M_CLOCK)
    idx_hw = tl.load(meta + M_IDX_HW)
    needed = tl.maximum(n - nfree, 0)
    target = tl.where(needed > 0, tl.minimum(needed + reserve, cap), 0)
    if not EVICT:
        target = target * 0
    n_place = n
    if not PLACE:
        n_place = n * 0
    # nf_scan < 0 (allocate, one program): next fit whenever a slot is free (with none, the pass
    # below finds none in its one block, which is then the right answer).
    short_scan = n_place.to(tl.int64) * n_g <= nf_scan * nfree.to(tl.int64)
    nf_ok = (n_place <= nf_max) & tl.where(nf_scan < 0, nfree > 0, short_scan)
    if (target == 0) & (n_place > 0) & nf_ok:
        # Next fit (the counts decide it alike in every program): program 0 places alone.
        if pid == 0:
            if EVICT:
                _pad(indices, 0, idx_hw, 0, 1, PAD)  # no victims this call
            k = _next_fit(
                gpu_free,
                prio,
                g2h,
                h2g,
                indices,
                meta,
                want_host,
                n_place,
                n_g,
                clock,
                WRITE_IDX,
                NF_BLOCK,
                NF_PRE,
            )
            if WRITE_IDX:
                _pad(indices, k, tl.maximum(n, idx_hw), 0, 1, PAD)
            tl.store(meta + M_LAST_ALLOC, k)
            if EVICT:
                tl.store(meta + M_LAST_EVICT, 0)
            if k < want:
                tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")
            if HANDOFF:
                # As the handoff below: the copy launch finalises the free count and IDX_HW
                # (every program here read them); a non-zero ALLOC_CTR tells it so (k > 0 here:
                # no eviction due means free >= n > 0).
                tl.store(meta + M_ALLOC_CTR, k)
            else:
                # Only with a grid of one program (allocate_cuda): no other program reads these.
                tl.store(meta + M_NFREE, nfree - k)
                if WRITE_IDX:
                    tl.store(meta + M_IDX_HW, k)
    elif (target > 0) | (n_place > 0):
        if EVICT:
            _pad(indices, target, idx_hw, pid, nprog, PAD)
        elif WRITE_IDX:
            _pad(indices, n, idx_hw, pid, nprog, PAD)
        victim = offs < 0  # all False
        if EVICT:
            if target > 0:
                bins = tl.arange(0, NBINS)
                cnt = tl.load(hist + bins)
                suffix = tl.sum(cnt, axis=0) - tl.cumsum(cnt, axis=0) + cnt  # in buckets >= b
                # T = the highest bucket whose suffix covers target; T = 1 (take all) if short.
                t = tl.maximum(
                    tl.max(tl.where((suffix >= target) & (bins > 0), bins, 0), axis=0), 1
                )
                take_t = target - tl.sum(tl.where(bins > t, cnt, 0), axis=0)
                p = tl.load(prio + offs, mask=inb, other=-1)
                age = (clock - p) & CLOCK_MASK
                b = tl.where((p >= 0) & (age > 0), _bucket(age), 0)
                eq = ((b == t) & (b > 0)).to(tl.int32)
                neq = tl.sum(eq, axis=0)
                base_eq = neq * 0
                if neq > 0:
                    base_eq = tl.atomic_add(meta + M_EQ_CTR, neq, sem="relaxed")
                rank = base_eq + tl.cumsum(eq, axis=0) - 1
                victim = (b > t) | ((eq > 0) & (rank < take_t))
                vi = victim.to(tl.int32)
                nv = tl.sum(vi, axis=0)
                if nv > 0:
                    pos = tl.atomic_add(meta + M_VICT_CTR, nv, sem="relaxed") + tl.cumsum(vi, 0) - 1
                    tl.store(indices + pos, offs, mask=victim)
                    old_h = tl.load(g2h + offs, mask=victim, other=0)
                    tl.store(h2g + old_h, tl.full([BLOCK], -1, tl.int32), mask=victim)
                f = f | victim
        take = offs < 0
        new_h = tl.zeros([BLOCK], tl.int32)
        if PLACE:
            if n_place > 0:
                fi = f.to(tl.int32)
                cnt_f = tl.sum(fi, axis=0)
                if cnt_f > 0:
                    base = tl.atomic_add(meta + M_ALLOC_CTR, cnt_f, sem="relaxed")
                    if base < n_place:
                        rank_f = base + tl.cumsum(fi, axis=0) - 1
                        take = f & (rank_f < n_place)
                        new_h = tl.load(want_host + rank_f, mask=take, other=0)
                        tl.store(h2g + new_h, offs, mask=take)  # new_h was PENDING or absent
                        if WRITE_IDX:
                            tl.store(indices + rank_f, offs, mask=take)
        # One store per array: a victim that is placed again ends occupied, one not placed free.
        touched = victim | take
        minus1 = tl.full([BLOCK], -1, tl.int32)
        tl.store(g2h + offs, tl.where(take, new_h, minus1), mask=touched)
        tl.store(prio + offs, tl.where(take, clock, minus1), mask=touched)
        tl.store(gpu_free + offs, tl.where(take, 0, 1).to(tl.int8), mask=touched)
        handoff = target < 0  # False
        if HANDOFF:
            handoff = target == 0
        if handoff:
            if pid == 0:
                # Not IDX_HW: the other programs read it for their share of the padding.
                k0 = tl.minimum(n, nfree)
                tl.store(meta + M_LAST_ALLOC, k0)
                tl.store(meta + M_LAST_EVICT, 0)
                if k0 < want:
                    tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")
        elif _last_program(meta):
            # The acquire above made every program's writes visible; the atomics below need no
            # ordering of their own, so relaxed ones are issued back to back instead of each
            # waiting for the last (a round trip each).
            nfree_out = nfree
            if EVICT:
                nv_total = tl.atomic_xchg(meta + M_VICT_CTR, 0, sem="relaxed")
                tl.atomic_xchg(meta + M_EQ_CTR, 0, sem="relaxed")
                if target > 0:
                    tl.store(hist + tl.arange(0, NBINS), tl.zeros([NBINS], tl.int32))
                _pad(indices, nv_total, target, 0, 1, PAD)  # only when short of evictable slots
                nfree_out = nfree + nv_total
                tl.store(meta + M_IDX_HW, nv_total)
                tl.store(meta + M_LAST_EVICT, nv_total)
                tl.atomic_add(stats + S_EVICTED, nv_total.to(tl.int64), sem="relaxed")
                if nv_total < needed:
                    tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")
            if PLACE:
                # Every block counted all its free slots, so total < n means the pool ran out:
                # k = min(total, n) is exactly the number placed.
                k = tl.minimum(tl.atomic_xchg(meta + M_ALLOC_CTR, 0, sem="relaxed"), n)
                nfree_out = nfree_out - k
                tl.store(meta + M_LAST_ALLOC, k)
                if WRITE_IDX:
                    _pad(indices, k, n, 0, 1, PAD)  # only when short of free slots
                    tl.store(meta + M_IDX_HW, k)
                if k < want:
                    tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")
            tl.store(meta + M_NFREE, nfree_out)
            tl.atomic_xchg(meta + M_DONE, 0, sem="relaxed")
    elif pid == 0:
        # Nothing to evict or place: no pass over the pool, no cross-program counter.
        if PAD_IDX:
            _pad(indices, 0, idx_hw, 0, 1, PAD)
            tl.store(meta + M_IDX_HW, 0)
        if EVICT:
            tl.store(meta + M_LAST_EVICT, 0)
        if PLACE:
            tl.store(meta + M_LAST_ALLOC, 0)
            if want > 0:  # cap = 0 cannot happen (the pool has slots); kept for symmetry
                tl.atomic_add(meta + M_OVERFLOW, 1)
