"""Triton kernels of the cache-manager ops (cache_ops.py has the semantics and the references).

All grids are static (sized by the pool, the list or the SM count); the live counts (how many to
allocate, how many misses) are read from device memory inside the kernels, so a CUDA graph
replays them with new values. No autotuning: these kernels mutate state.

Cross-program coordination, and why it is race-free:
- A kernel never reads a counter that another program of the same launch writes, except through
  the atomic that writes it (ranking: the old value of one atomicAdd per block is the block's
  base rank; the ranks inside a block come from a prefix sum).
- The eviction/placement pass, whose results are totals over its programs, ends with
  ``_last_program``: after a CTA barrier, one release/acquire atomic on meta[DONE]; the program
  that sees DONE == grid - 1 is the last, every other program's writes are visible to it, and it
  alone finalises (free count, stats) and resets the scratch counters with atomic exchanges. So
  no separate reset launch is needed. The copy/output launch needs no totals: its last program
  (one of its own) finalises (clock, stats, NMISS; after a placement pass that evicted nothing,
  also the free count, IDX_HW and the rank counter), which no other program of that launch reads.
- Ops made of several launches (free, recall) hand values from one launch to the next through
  meta; launches on one stream are ordered.
- A launch with nothing to do (no eviction due, nothing to place) sees so in the counts it reads
  at its start, the same in every program: program 0 alone records it, nobody touches meta[DONE].

Byte offsets into the pools are computed in int64 (a 2M-row bf16 layer is 2.3 GB > 2 GiB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import cache_layout as C
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE

# Globals read inside kernels must be constexpr.
M_CLOCK = tl.constexpr(C.CLOCK)
M_NFREE = tl.constexpr(C.NFREE)
M_OVERFLOW = tl.constexpr(C.OVERFLOW)
M_IDX_HW = tl.constexpr(C.IDX_HW)
M_NMISS = tl.constexpr(C.NMISS)
M_ALLOC_CTR = tl.constexpr(C.ALLOC_CTR)
M_VICT_CTR = tl.constexpr(C.VICT_CTR)
M_EQ_CTR = tl.constexpr(C.EQ_CTR)
M_DONE = tl.constexpr(C.DONE)
M_LAST_ALLOC = tl.constexpr(C.LAST_ALLOC)
M_LAST_EVICT = tl.constexpr(C.LAST_EVICT)
M_LAST_MISS = tl.constexpr(C.LAST_MISS)
M_CURSOR = tl.constexpr(C.CURSOR)
S_SELECTED = tl.constexpr(C.SELECTED)
S_RECALLED = tl.constexpr(C.RECALLED)
S_STEPS = tl.constexpr(C.STEPS)
S_EVICTED = tl.constexpr(C.EVICTED)
CLOCK_MASK = tl.constexpr(C.CLOCK_MASK)
AGE_EXACT = tl.constexpr(C.AGE_EXACT)
AGE_SHIFT = tl.constexpr(C.AGE_SHIFT)
NBINS = tl.constexpr(C.NBINS)
PENDING = tl.constexpr(C.PENDING)
PAGE_C = tl.constexpr(PAGE)
IDX_PAGE_W = tl.constexpr(INDEX_PAGE_BYTES // 4)  # int32 words per indexer-cache page (2112)
IDX_ROW_W = tl.constexpr(INDEX_ROW_BYTES // 4)  # 33 words: 32 of fp8 values, 1 fp32 scale

# Launch configuration (chosen by reasoning, not measured: see docs/cache_ops.md; the benchmark
# can try others). Pool scans: 196 programs of 1024 slots at N_G = 200K, ~1.5 per SM, one atomic
# per block; a scan is latency-bound (a few dependent round trips), not bandwidth-bound.
SCAN_BLOCK = 1024  # pool slots per program in pool scans (allocate, free, recall)
SCAN_WARPS = 4
LIST_BLOCK = 1024  # list entries per program (lookup, output, release)
PAD_BLOCK = 1024  # index-buffer entries per padding store
# Next-fit placement (one program, no atomics, no cross-program protocol): allocate always, and
# recall when nothing is evicted and it has at most NF_MAX_MISSES misses. A scan step reads
# NF_BLOCK free bits (4 KB: 16 per thread in allocate's one program of NF_WARPS, 32 in recall's
# program 0, which has the pass's SCAN_WARPS); at the ~1.6% free density the reserve leaves
# (N_G/64 slots) one step finds ~64 free slots, so a 37-miss step is one step. NF_MAX_MISSES = 0
# turns it off for recall (the multi-program pass places everything, as before).
NF_BLOCK = 4096
NF_WARPS = 8
NF_MAX_MISSES = 128
# ... and when the scan it expects (misses x N_G / free slots, for free slots spread evenly) is at
# most NF_MAX_SCAN slots (4 scan steps): a pool nearly out of free slots (the step before a
# refill) takes the multi-program pass instead of a long serial scan.
NF_MAX_SCAN = 4 * NF_BLOCK
# want_host entries next fit reads up front (a power of two; 0 = off). Off by default: it uses
# tl.gather, not yet run on the H200's Triton; the benchmark's sweep times and checks it.
NF_PRELOAD = 0
ALLOCATE_NEXT_FIT = True  # False: allocate runs the multi-program pass (the benchmark times both)
# 16-byte units per copy program and iteration (8 KB, 4 per thread at 4 warps): 264 programs
# then move a 2048-row fp8 recall (84K units) in one wave.
COPY_UNITS = 512
COPY_PROGRAMS_PER_SM = 2
COPY_WARPS = 4
COPY_EARLY = True  # issue the first list read beside the count's (False: after it, as before)
COPY_OWN_FINAL = True  # the copy launch's finalisation in a program of its own (False: program 0)
COPY_CACHE = ""  # cache modifier of the host-row loads ("" = default; ".cg": L2 only, no L1)


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
def _lookup_kernel(
    host_slots,
    h2g,
    prio,
    miss_host,
    meta,
    stats,
    total,
    cap,
    MISSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Stamp resident selected slots with the clock (protect). With MISSES: claim each distinct
    missing host slot once (atomic exchange -1 -> PENDING: exactly one lane sees -1) and append
    the claimed ones to miss_host (one atomicAdd per block); count the selected entries."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(host_slots + offs, mask=offs < total, other=-1).to(tl.int32)
    valid = h >= 0
    g = tl.load(h2g + h, mask=valid, other=-1)
    clock = tl.load(meta + M_CLOCK)
    tl.store(prio + g, tl.zeros([BLOCK], tl.int32) + clock, mask=valid & (g >= 0))
    if MISSES:
        miss = valid & (g == -1)
        old = tl.atomic_xchg(h2g + h, tl.full([BLOCK], PENDING, tl.int32), mask=miss, sem="relaxed")
        win = (miss & (old == -1)).to(tl.int32)
        nwin = tl.sum(win, axis=0)
        if nwin > 0:
            base = tl.atomic_add(meta + M_NMISS, nwin, sem="relaxed")
            pos = base + tl.cumsum(win, axis=0) - 1
            tl.store(miss_host + pos, h, mask=(win > 0) & (pos < cap))
        nvalid = tl.sum(valid.to(tl.int32), axis=0)
        tl.atomic_add(stats + S_SELECTED, nvalid.to(tl.int64), sem="relaxed")


@triton.jit
def _hist_kernel(prio, meta, hist, want_ptr, n_g, cap, BLOCK: tl.constexpr):
    """Histogram of the age buckets of evictable slots, only when free must evict (with the
    reserve most calls need not: every program returns after two loads)."""
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


@triton.jit
def _copy_units(
    host_kv,
    gpu_kv,
    h2g,
    u,
    r,
    h,
    nunits,
    UPR: tl.constexpr,
    UNITS: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Units u (rows r, host slots h = miss_host[r]) host -> GPU, those below nunits."""
    um = u < nunits
    word = (u - r * UPR) * 4
    src = h.to(tl.int64) * (UPR * 4) + word
    g = tl.load(h2g + h, mask=um, other=0)
    dst = g.to(tl.int64) * (UPR * 4) + word
    m2 = um[:, None]
    w4 = tl.arange(0, 4)
    v = tl.load(host_kv + src[:, None] + w4[None, :], mask=m2, cache_modifier=CACHE)
    tl.store(gpu_kv + dst[:, None] + w4[None, :], v, mask=m2)


@triton.jit
def _copy_out_kernel(
    host_kv,
    gpu_kv,
    miss_host,
    h2g,
    host_slots,
    out,
    meta,
    stats,
    total,
    n_copy,
    cap,
    UPR: tl.constexpr,
    UNITS: tl.constexpr,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    CACHE: tl.constexpr,
    OWN_FINAL: tl.constexpr,
):
    """Programs [0, n_copy): copy the placed misses' rows host -> GPU over UVA as a flat stream of
    16-byte units (UPR per row; unit u is word 4 (u % UPR) of row u // UPR): each thread moves
    whole 16-byte vectors, a warp reads 512 contiguous bytes, and no lane idles on a row padded
    to a power of two (fp8's 656-byte row padded to 1024 wasted 36% of the lanes). Programs
    after: gpu_slots[j] = host_to_gpu[host_slots[j]] and un-claim misses left PENDING (only on
    overflow). The last program (no other work) advances the clock, adds the stats, resets NMISS
    and finalises a handed-over placement."""
    pid = tl.program_id(0)
    if pid < n_copy:
        # The first iteration's list read (miss_host, CAP entries) does not wait for the count:
        # it is issued beside the load of meta[LAST_ALLOC], so the host read starts one round
        # trip earlier (the chain was count -> miss_host -> host row; the host read needs only
        # the host slot, the GPU slot load runs beside it).
        # (u0, r0, h0: the else branch's h is another shape; Triton merges same-named variables.)
        u0 = pid * UNITS + tl.arange(0, UNITS)
        r0 = u0 // UPR
        if EARLY:
            h0 = tl.load(miss_host + r0, mask=r0 < cap, other=0)
            nunits = tl.load(meta + M_LAST_ALLOC) * UPR
        else:
            nunits = tl.load(meta + M_LAST_ALLOC) * UPR
            h0 = tl.load(miss_host + r0, mask=u0 < nunits, other=0)
        _copy_units(host_kv, gpu_kv, h2g, u0, r0, h0, nunits, UPR, UNITS, CACHE)
        for start in range((pid + n_copy) * UNITS, nunits, n_copy * UNITS):
            u = start + tl.arange(0, UNITS)
            r = u // UPR
            h = tl.load(miss_host + r, mask=u < nunits, other=0)
            _copy_units(host_kv, gpu_kv, h2g, u, r, h, nunits, UPR, UNITS, CACHE)
    else:
        offs = (pid - n_copy) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < total
        h = tl.load(host_slots + offs, mask=inb, other=-1)
        valid = h >= 0
        g = tl.load(h2g + h, mask=valid, other=-1)
        tl.store(h2g + h, tl.full([BLOCK], -1, tl.int32), mask=valid & (g == PENDING))
        tl.store(out + offs, tl.maximum(g, -1), mask=inb)
    fin = pid == 0
    if OWN_FINAL:
        fin = pid == tl.num_programs(0) - 1
    if fin:
        # A program of its own (the launcher adds it; its list share above is empty), so the
        # finalisation is off the copy's path. No program of this launch reads what is finalised
        # here (NMISS, CLOCK, the free count, the totals; the copy reads LAST_ALLOC, the output
        # host_to_gpu): no barrier, no meta[DONE] atomic for the ~400 programs. The loads go
        # out together (one round trip), the stores and relaxed atomics need no wait.
        nmiss = tl.load(meta + M_NMISS)
        handed = tl.load(meta + M_ALLOC_CTR)
        nfree = tl.load(meta + M_NFREE)
        nalloc = tl.load(meta + M_LAST_ALLOC)
        clock = tl.load(meta + M_CLOCK)
        tl.store(meta + M_LAST_MISS, nmiss)
        tl.store(meta + M_NMISS, 0)
        if handed > 0:  # the placement pass handed its finalisation over
            tl.store(meta + M_NFREE, nfree - nalloc)
            tl.store(meta + M_ALLOC_CTR, 0)
            tl.store(meta + M_IDX_HW, 0)  # no victims; the pass padded indices[:IDX_HW]
        tl.store(meta + M_CLOCK, (clock + 1) & CLOCK_MASK)
        tl.atomic_add(stats + S_RECALLED, nalloc.to(tl.int64), sem="relaxed")
        tl.atomic_add(stats + S_STEPS, nalloc.to(tl.int64) * 0 + 1, sem="relaxed")


@triton.jit
def _release_kernel(host_slots, h2g, g2h, prio, gpu_free, meta, total, n_h, BLOCK: tl.constexpr):
    """Drop host slots from the maps; the exchange makes duplicates in the list free once."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(host_slots + offs, mask=offs < total, other=-1)
    valid = (h >= 0) & (h < n_h)
    h = tl.where(valid, h, 0).to(tl.int32)
    old = tl.atomic_xchg(h2g + h, tl.full([BLOCK], -1, tl.int32), mask=valid, sem="relaxed")
    rel = valid & (old >= 0)
    minus1 = tl.full([BLOCK], -1, tl.int32)
    tl.store(g2h + old, minus1, mask=rel)
    tl.store(prio + old, minus1, mask=rel)
    tl.store(gpu_free + old, tl.full([BLOCK], 1, tl.int8), mask=rel)
    c = tl.sum(rel.to(tl.int32), axis=0)
    if c > 0:
        tl.atomic_add(meta + M_NFREE, c, sem="relaxed")


@triton.jit
def _offload_kernel(
    host_kv, index_k, rows, index_rows, slots, ROW_W: tl.constexpr, ROW_WP: tl.constexpr
):
    """Token t: its KV row -> host_kv[slot] (UVA writes) and its indexer key (32 words of fp8
    values, 1 word of fp32 scale) -> the paged indexer cache. Slot -1: nothing."""
    t = tl.program_id(0)
    s = tl.load(slots + t).to(tl.int64)
    if s >= 0:
        cols = tl.arange(0, ROW_WP)
        cmask = cols < ROW_W
        v = tl.load(rows + t.to(tl.int64) * ROW_W + cols, mask=cmask)
        tl.store(host_kv + s * ROW_W + cols, v, mask=cmask)
        page = s // PAGE_C
        off = s % PAGE_C
        c32 = tl.arange(0, 32)
        kv = tl.load(index_rows + t.to(tl.int64) * IDX_ROW_W + c32)
        tl.store(index_k + page * IDX_PAGE_W + off * 32 + c32, kv)
        sc = tl.load(index_rows + t.to(tl.int64) * IDX_ROW_W + 32)
        tl.store(index_k + page * IDX_PAGE_W + PAGE_C * 32 + off, sc)


# ---- launchers ----------------------------------------------------------------------------------
def _words(t: torch.Tensor, name: str, state: bool) -> torch.Tensor:
    """uint8 [N, bytes] -> int32 [N, bytes / 4] view, so each thread moves 16-byte words. A state
    tensor (written in place) must already be aligned; an input is copied when it is not."""
    if t.shape[-1] % 4 or t.data_ptr() % 16 or not t.is_contiguous():
        if state:
            raise ValueError(f"{name} must be contiguous, 16-byte aligned, rows a multiple of 4 B")
        t = t.contiguous().clone()
    return t.view(torch.int32)


def _num_copy_programs(device: torch.device) -> int:
    # Enough programs that COPY_PROGRAMS_PER_SM x SMs x COPY_UNITS x 16 B are in flight (1 MB at
    # the defaults): PCIe latency is ~1-2 us, so at ~55 GB/s the copy needs >= ~110 KB
    # outstanding to run near link speed, and a 2048-row fp8 recall (1.3 MB) is then one wave.
    if device.type == "cuda":
        return COPY_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # TRITON_INTERPRET on CPU: few programs, several loop iterations each


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, block)),)


def _evict_place(
    gpu_free,
    gpu_priority,
    gpu_to_host,
    host_to_gpu,
    indices,
    meta,
    hist,
    stats,
    want,
    want_host,
    evict: bool,
    place: bool,
    write_idx: bool,
    handoff: bool = False,
    nf_max: int = 0,
    nf_scan: int = 0,
    one_program: bool = False,
) -> None:
    n_g, cap = gpu_to_host.shape[0], indices.shape[0]
    grid = (1,) if one_program else _grid(n_g, SCAN_BLOCK)
    _evict_place_kernel[grid](
        gpu_priority,
        gpu_free,
        gpu_to_host,
        host_to_gpu,
        indices,
        meta,
        hist,
        stats,
        want,
        want_host,
        n_g,
        cap,
        C.reserve_slots(n_g),
        nf_max,
        nf_scan if nf_max else 0,
        EVICT=evict,
        PLACE=place,
        WRITE_IDX=write_idx,
        PAD_IDX=evict or write_idx,
        HANDOFF=handoff,
        BLOCK=SCAN_BLOCK,
        PAD=PAD_BLOCK,
        NF_BLOCK=NF_BLOCK,
        NF_PRE=NF_PRELOAD,
        num_warps=NF_WARPS if one_program else SCAN_WARPS,
    )


def _hist(gpu_priority, meta, hist, want, n_g: int, cap: int) -> None:
    _hist_kernel[_grid(n_g, SCAN_BLOCK)](
        gpu_priority, meta, hist, want, n_g, cap, BLOCK=SCAN_BLOCK, num_warps=SCAN_WARPS
    )


def allocate_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n):
    """1 launch: with ALLOCATE_NEXT_FIT one program placing by next fit (no atomics, no
    cross-program protocol), else the multi-program placement pass."""
    nf = ALLOCATE_NEXT_FIT
    _evict_place(
        gpu_free,
        gpu_priority,
        gpu_to_host,
        host_to_gpu,
        indices,
        meta,
        meta,
        meta,
        n,
        want_host,
        evict=False,
        place=True,
        write_idx=True,
        nf_max=indices.shape[0] if nf else 0,
        nf_scan=-1,  # one program: next fit whatever the scan
        one_program=nf,
    )


def free_cuda(
    gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, protect, n
):
    """3 launches: protect, histogram, eviction; the last two return at once when the free slots
    (the reserve) already cover n."""
    p = protect.reshape(-1)
    _lookup_kernel[_grid(p.numel(), LIST_BLOCK)](
        p,
        host_to_gpu,
        gpu_priority,
        indices,
        meta,
        stats,
        p.numel(),
        indices.shape[0],
        MISSES=False,
        BLOCK=LIST_BLOCK,
        num_warps=4,
    )
    _hist(gpu_priority, meta, hist, n, gpu_to_host.shape[0], indices.shape[0])
    _evict_place(
        gpu_free,
        gpu_priority,
        gpu_to_host,
        host_to_gpu,
        indices,
        meta,
        hist,
        stats,
        n,
        indices,
        evict=True,
        place=False,
        write_idx=False,
    )


def recall_cuda(
    host_kv,
    gpu_kv,
    gpu_free,
    gpu_priority,
    gpu_to_host,
    host_to_gpu,
    indices,
    miss_host,
    meta,
    hist,
    stats,
    host_slots,
) -> torch.Tensor:
    """4 launches: lookup (protect hits, claim misses), histogram (returns at once unless an
    eviction is due), eviction + placement in one pass, row copy + output."""
    hs = host_slots.reshape(-1)
    total, cap, n_g = hs.numel(), indices.shape[0], gpu_to_host.shape[0]
    out = torch.empty_like(host_slots)
    n_miss = meta[C.NMISS : C.NMISS + 1]  # the live miss count, as a pointer
    _lookup_kernel[_grid(total, LIST_BLOCK)](
        hs,
        host_to_gpu,
        gpu_priority,
        miss_host,
        meta,
        stats,
        total,
        cap,
        MISSES=True,
        BLOCK=LIST_BLOCK,
        num_warps=4,
    )
    _hist(gpu_priority, meta, hist, n_miss, n_g, cap)
    _evict_place(
        gpu_free,
        gpu_priority,
        gpu_to_host,
        host_to_gpu,
        indices,
        meta,
        hist,
        stats,
        n_miss,
        miss_host,
        evict=True,
        place=True,
        write_idx=False,
        handoff=True,  # the copy launch right after finalises the placement
        nf_max=NF_MAX_MISSES,
        nf_scan=NF_MAX_SCAN,
    )
    copy_rows(host_kv, gpu_kv, miss_host, host_to_gpu, meta, stats, hs, out.view(-1))
    return out


def copy_rows(
    host_kv,
    gpu_kv,
    miss_host,
    host_to_gpu,
    meta,
    stats,
    hs,
    out,
    units: int | None = None,
    programs_per_sm: int | None = None,
    warps: int | None = None,
    early: bool | None = None,
    cache: str | None = None,
) -> None:
    """Recall's last launch: rows of miss_host[:meta[LAST_ALLOC]] -> their GPU slots, and
    out = host_to_gpu[hs]. The keyword arguments override the module's copy configuration (the
    benchmark tries a few)."""
    if host_kv.shape[1] % 16:
        raise ValueError(f"recall: row width {host_kv.shape[1]} B must be a multiple of 16")
    n_copy = _num_copy_programs(hs.device)
    if programs_per_sm is not None and hs.device.type == "cuda":
        n_copy = programs_per_sm * torch.cuda.get_device_properties(hs.device).multi_processor_count
    total = hs.numel()
    _copy_out_kernel[(n_copy + triton.cdiv(total, LIST_BLOCK) + int(COPY_OWN_FINAL),)](
        _words(host_kv, "host_kv", True),
        _words(gpu_kv, "gpu_kv", True),
        miss_host,
        host_to_gpu,
        hs,
        out,
        meta,
        stats,
        total,
        n_copy,
        miss_host.shape[0],
        UPR=host_kv.shape[1] // 16,
        UNITS=units or COPY_UNITS,
        BLOCK=LIST_BLOCK,
        EARLY=COPY_EARLY if early is None else early,
        CACHE=COPY_CACHE if cache is None else cache,
        OWN_FINAL=COPY_OWN_FINAL,  # the grid has the finalising program of its own
        num_warps=warps or COPY_WARPS,
    )


def release_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots) -> None:
    hs = host_slots.reshape(-1)
    _release_kernel[_grid(hs.numel(), LIST_BLOCK)](
        hs,
        host_to_gpu,
        gpu_to_host,
        gpu_priority,
        gpu_free,
        meta,
        hs.numel(),
        host_to_gpu.shape[0],
        BLOCK=LIST_BLOCK,
        num_warps=4,
    )


def offload_cuda(host_kv, index_k, rows, index_rows, slots) -> None:
    """echo::offload's CUDA path (kv_cache.py): rows [T, row] -> host_kv, index rows [T, 132] ->
    the paged indexer cache, for slots >= 0."""
    t = slots.shape[0]
    if t == 0:
        return
    row_w = host_kv.shape[1] // 4
    _offload_kernel[(t,)](
        _words(host_kv, "host_kv", True),
        index_k.view(torch.int32),
        _words(rows, "rows", False),
        _words(index_rows, "index_rows", False),
        slots.contiguous(),
        ROW_W=row_w,
        ROW_WP=triton.next_power_of_2(row_w),
        num_warps=2,
    )
