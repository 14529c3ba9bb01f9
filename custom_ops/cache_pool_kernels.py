"""Triton kernels of the cache-manager ops that work on the GPU pool's state: free's age
histogram, the eviction + placement pass (free, recall) and allocate's one-program placement;
launched by cache_kernels.py, whose docstring gives the coordination.

The free slots are a ring list (``gpu_free``, int32: ``gpu_free[(HEAD + i) % N_G]`` for
i < NFREE, cache_ref.py): placement pops rank r from position HEAD + r, an eviction pushes
victim v at HEAD + NFREE + v. Pops and pushes of one launch never touch the same positions
(free + freed <= N_G), and both depend only on HEAD, NFREE (read at the start) and the rank, so
no program reads what another writes in that launch."""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.cache_constexpr import (
    AGE_EXACT,
    AGE_SHIFT,
    CLOCK_MASK,
    M_ALLOC_CTR,
    M_CLOCK,
    M_DONE,
    M_EQ_CTR,
    M_HEAD,
    M_HISTED,
    M_IDX_HW,
    M_LAST_ALLOC,
    M_LAST_EVICT,
    M_LOOKED,
    M_NFREE,
    M_OVERFLOW,
    M_VICT_CTR,
    NBINS,
    S_EVICTED,
)
from custom_ops.cache_sync import _last_program, _pdl_start


# ---- helpers ------------------------------------------------------------------------------------
@triton.jit
def _bucket(age):
    """cache_ops.age_bucket for age >= 1."""
    return tl.where(
        age < AGE_EXACT, age, tl.minimum(AGE_EXACT + ((age - AGE_EXACT) >> AGE_SHIFT), NBINS - 1)
    )


@triton.jit
def _wrap(pos, n_g):
    """pos mod N_G for pos in [0, 2 N_G): ring positions past the end wrap once."""
    return tl.where(pos >= n_g, pos - n_g, pos)


@triton.jit
def _pad(indices, lo, hi, pid, nprog, BLOCK: tl.constexpr):
    """indices[lo:hi] = -1, spread over the programs."""
    for start in range(lo + pid * BLOCK, hi, nprog * BLOCK):
        o = start + tl.arange(0, BLOCK)
        tl.store(indices + o, tl.full([BLOCK], -1, tl.int32), mask=o < hi)


@triton.jit
def _pop(ring, prio, g2h, h2g, indices, r, h, k, head, n_g, clock, WRITE_IDX: tl.constexpr):
    """Ranks r < k take the ring's entries at HEAD + r and map host slot h (want_host[r]) there,
    stamped with the clock; with WRITE_IDX the slot goes to indices[r]."""
    m = r < k
    s = tl.load(ring + _wrap(head + r, n_g), mask=m, other=0)
    tl.store(g2h + s, h, mask=m)
    tl.store(h2g + h, s, mask=m)  # h was PENDING (recall) or absent (allocate)
    tl.store(prio + s, tl.zeros_like(r) + clock, mask=m)
    if WRITE_IDX:
        tl.store(indices + r, s, mask=m)


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _evict_hist_kernel(prio, meta, hist, want_ptr, n_g, cap, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    if PDL:
        _pdl_start()
    _hist(tl.program_id(0), prio, meta, hist, want_ptr, n_g, cap, BLOCK)


@triton.jit
def _hist(pid, prio, meta, hist, want_ptr, n_g, cap, BLOCK: tl.constexpr):
    """Program ``pid``: the histogram of the age buckets of evictable slots, only when free must
    evict (with the reserve most calls need not: every program returns after two loads)."""
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
def _allocate_kernel(
    ring,
    prio,
    g2h,
    h2g,
    indices,
    meta,
    want_host,
    want_ptr,
    n_g,
    cap,
    want_len,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """allocate in ONE program: ranks r < k = min(n, NFREE) take the ring's entries at HEAD + r
    (chunks of BLOCK ranks: one or two for 37 or 2048 slots), then the same program moves HEAD,
    NFREE and IDX_HW: no other program, so no rank atomic, no DONE protocol, no race. The first
    chunk of want_host is read beside the counts (one dependent round trip: counts -> ring ->
    stores)."""
    if PDL:
        _pdl_start()
    ar = tl.arange(0, BLOCK)
    h0 = tl.load(want_host + ar, mask=ar < want_len, other=0)
    want = tl.load(want_ptr)
    nfree = tl.load(meta + M_NFREE)
    head = tl.load(meta + M_HEAD)
    clock = tl.load(meta + M_CLOCK)
    idx_hw = tl.load(meta + M_IDX_HW)
    # n past len(want_host) is bad input the reference rejects; here (no sync) an OVERFLOW
    k = tl.minimum(tl.minimum(tl.minimum(want, cap), want_len), nfree)
    _pop(ring, prio, g2h, h2g, indices, ar, h0, k, head, n_g, clock, True)
    for start in range(BLOCK, k, BLOCK):
        r = start + ar
        h = tl.load(want_host + r, mask=r < k, other=0)
        _pop(ring, prio, g2h, h2g, indices, r, h, k, head, n_g, clock, True)
    _pad(indices, k, idx_hw, 0, 1, PAD)
    tl.store(meta + M_HEAD, _wrap(head + k, n_g))
    tl.store(meta + M_NFREE, nfree - k)
    tl.store(meta + M_IDX_HW, k)
    tl.store(meta + M_LAST_ALLOC, k)
    if k < want:
        tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")


@triton.jit
def _evict_place_kernel(
    prio,
    ring,
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
    PLACE: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        _pdl_start()
    _evict_place(
        tl.program_id(0), tl.num_programs(0), prio, ring, g2h, h2g, indices, meta, hist, stats,
        want_ptr, want_host, n_g, cap, reserve, PLACE, BLOCK, PAD, False, False,
    )  # fmt: skip


@triton.jit
def _evict_place(
    pid,
    nprog,
    prio,
    ring,
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
    PLACE: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    RESET_PHASES: tl.constexpr,
    POPPED: tl.constexpr,
):
    """Program ``pid`` of ``nprog``: free's eviction and (PLACE) recall's eviction + placement,
    one pass. Program p owns the pool slots [p BLOCK, (p + 1) BLOCK) for the eviction and the
    ranks of the same range for the placement. With F = NFREE, M = min(want, cap) misses and
    needed = max(M - F, 0):

    Eviction (needed > 0): target = min(needed + reserve, cap) slots
    (cache_layout.evict_target): every evictable slot in buckets above the threshold bucket T
    (from hist) and the first, by atomic rank, of those in T. Victim v (its rank, also its
    position in ``indices``) serves miss F + v directly when F + v < M (PLACE), else it is
    pushed at ring position HEAD + F + v.
    Placement (PLACE): misses r < min(M, F) pop the ring's entries at HEAD + r.
    So the ring after the launch is the positions [HEAD + M, HEAD + F + E) (E victims), and no
    program reads what another writes. The last program (meta[DONE]) finalises (HEAD, free
    count, IDX_HW, stats, the scratch resets).
    No eviction due and PLACE (recall's steady step): the count placed is known up front
    (min(M, F)), so program 0 records it and hands HEAD + 1 to the copy launch in
    meta[ALLOC_CTR], whose last program moves HEAD, the free count and IDX_HW (which every
    program here reads): no barrier, no meta[DONE] atomic. Nothing to do: program 0 pads
    ``indices`` and records zeros; no atomics. RESET_PHASES (free in one launch,
    cache_fused_kernels.py): the last program also resets the phase counters. POPPED (recall in
    one launch): the lookup placed the ranks below the free count already (PLACE_EARLY)."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n_g
    new_h = tl.zeros([BLOCK], tl.int32)
    if PLACE:
        # The block's ranks of the miss list (CAP entries: in bounds whatever the count), read
        # beside the counts: the steady step's chain is counts -> ring -> stores.
        new_h = tl.load(want_host + offs, mask=offs < cap, other=0)
    want = tl.load(want_ptr)
    n = tl.minimum(want, cap)
    nfree = tl.load(meta + M_NFREE)
    head = tl.load(meta + M_HEAD)
    clock = tl.load(meta + M_CLOCK)
    idx_hw = tl.load(meta + M_IDX_HW)
    needed = tl.maximum(n - nfree, 0)
    target = tl.where(needed > 0, tl.minimum(needed + reserve, cap), 0)
    n_place = n
    if not PLACE:
        n_place = n * 0
    if (target > 0) | (n_place > 0):
        _pad(indices, target, idx_hw, pid, nprog, PAD)
        if PLACE and not POPPED:
            k_pop = tl.minimum(n_place, nfree)
            if pid * BLOCK < k_pop:
                _pop(ring, prio, g2h, h2g, indices, offs, new_h, k_pop, head, n_g, clock, False)
        if target > 0:
            bins = tl.arange(0, NBINS)
            cnt = tl.load(hist + bins)
            suffix = tl.sum(cnt, axis=0) - tl.cumsum(cnt, axis=0) + cnt  # in buckets >= b
            # T = the highest bucket whose suffix covers target; T = 1 (take all) if short.
            t = tl.maximum(tl.max(tl.where((suffix >= target) & (bins > 0), bins, 0), axis=0), 1)
            take_t = target - tl.sum(tl.where(bins > t, cnt, 0), axis=0)
            # A slot popped above reads as free (-1) or stamped now (age 0): not evictable.
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
                v = tl.atomic_add(meta + M_VICT_CTR, nv, sem="relaxed") + tl.cumsum(vi, 0) - 1
                tl.store(indices + v, offs, mask=victim)
                old_h = tl.load(g2h + offs, mask=victim, other=0)
                tl.store(h2g + old_h, tl.full([BLOCK], -1, tl.int32), mask=victim)
                serve = victim & (nfree + v < n_place)  # victim v takes miss F + v
                h = tl.load(want_host + nfree + v, mask=serve, other=0)
                tl.store(h2g + h, offs, mask=serve)  # h was PENDING
                tl.store(ring + _wrap(head + nfree + v, n_g), offs, mask=victim & ~serve)
                minus1 = tl.full([BLOCK], -1, tl.int32)
                tl.store(g2h + offs, tl.where(serve, h, minus1), mask=victim)
                tl.store(prio + offs, tl.where(serve, clock, minus1), mask=victim)
        handoff = target < 0  # False
        if PLACE:
            handoff = target == 0
        if handoff:
            if pid == 0:
                # Not HEAD, NFREE, IDX_HW: the other programs read them (the copy launch's
                # last program moves them; ALLOC_CTR > 0 tells it so).
                tl.store(meta + M_LAST_ALLOC, n_place)
                tl.store(meta + M_LAST_EVICT, 0)
                tl.store(meta + M_ALLOC_CTR, _wrap(head + n_place, n_g) + 1)
                if n_place < want:
                    tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")
        elif _last_program(meta, nprog):
            # The acquire above made every program's writes visible; the atomics below need no
            # ordering of their own, so relaxed ones are issued back to back instead of each
            # waiting for the last (a round trip each).
            nv_total = tl.atomic_xchg(meta + M_VICT_CTR, 0, sem="relaxed")
            tl.atomic_xchg(meta + M_EQ_CTR, 0, sem="relaxed")
            tl.store(hist + tl.arange(0, NBINS), tl.zeros([NBINS], tl.int32))
            _pad(indices, nv_total, target, 0, 1, PAD)  # only when short of evictable slots
            tl.store(meta + M_IDX_HW, nv_total)
            tl.store(meta + M_LAST_EVICT, nv_total)
            tl.atomic_add(stats + S_EVICTED, nv_total.to(tl.int64), sem="relaxed")
            if nv_total < needed:
                tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")
            k = tl.minimum(n_place, nfree + nv_total)  # placed: from the ring, then victims
            tl.store(meta + M_NFREE, nfree + nv_total - k)
            if PLACE:
                tl.store(meta + M_HEAD, _wrap(head + k, n_g))
                tl.store(meta + M_LAST_ALLOC, k)
                if k < want:
                    tl.atomic_add(meta + M_OVERFLOW, 1, sem="relaxed")
            if RESET_PHASES:
                tl.atomic_xchg(meta + M_LOOKED, 0, sem="relaxed")
                tl.atomic_xchg(meta + M_HISTED, 0, sem="relaxed")
            tl.atomic_xchg(meta + M_DONE, 0, sem="relaxed")
    elif pid == 0:
        # Nothing to evict or place: no pass over the pool, no cross-program counter.
        _pad(indices, 0, idx_hw, 0, 1, PAD)
        tl.store(meta + M_IDX_HW, 0)
        tl.store(meta + M_LAST_EVICT, 0)
        if PLACE:
            tl.store(meta + M_LAST_ALLOC, 0)
            if want > 0:  # cap = 0 cannot happen (the pool has slots); kept for symmetry
                tl.atomic_add(meta + M_OVERFLOW, 1)
