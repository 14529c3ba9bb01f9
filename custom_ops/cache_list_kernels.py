"""Triton kernels of the cache-manager ops over a list of host slots or tokens (grids sized by
the list): recall's lookup (also free's protect) and recall's row copy + output; launched by
cache_kernels.py, whose docstring gives the coordination (release and offload:
cache_release_kernels.py; the programs' coordination: cache_sync.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.cache_constexpr import (
    CLOCK_MASK,
    M_ALLOC_CTR,
    M_CLOCK,
    M_HEAD,
    M_IDX_HW,
    M_LAST_ALLOC,
    M_LAST_MISS,
    M_NFREE,
    M_NMISS,
    PENDING,
    PF_PROMOTED_C,
    S_RECALLED,
    S_SELECTED,
    S_STEPS,
    STAGE_SHIFT,
)
from custom_ops.cache_sync import _pdl_start


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
    SKIP_CLEAN: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    if PDL:
        _pdl_start()
    _lookup(
        tl.program_id(0), host_slots, h2g, prio, h2g, h2g, miss_host, meta, stats, total, cap, 1,
        MISSES, BLOCK, SKIP_CLEAN, False,
    )  # fmt: skip  (ring, g2h, n_g: unread without PLACE_EARLY)


@triton.jit
def _lookup(
    pid,
    host_slots,
    h2g,
    prio,
    ring,
    g2h,
    miss_host,
    meta,
    stats,
    total,
    cap,
    n_g,
    MISSES: tl.constexpr,
    BLOCK: tl.constexpr,
    SKIP_CLEAN: tl.constexpr,
    PLACE_EARLY: tl.constexpr,
    SELF_ROWS: tl.constexpr = 0,
    STAMP: tl.constexpr = True,
):
    """Program ``pid`` of the lookup: stamp resident selected slots with the clock (protect).
    With MISSES: claim each distinct missing host slot once (atomic exchange -1 -> PENDING:
    exactly one lane sees -1) and append the claimed ones to miss_host (one atomicAdd per block);
    count the selected entries. A block without a miss (all but <= misses of them in a steady
    step) skips the claim: its exchange, the sum of the winners and the append are dependent
    round trips on its path.

    PLACE_EARLY (recall in one launch): a miss of rank r < min(NFREE, CAP) is placed here, at the
    ring's entry HEAD + r, which is where the placement pass would put it whether or not the call
    evicts (ranks below the free count always pop the ring; the ring rule, cache_ref.py), so in a
    step without eviction every miss is placed when the lookup ends and the copy need not wait
    for the pass. A duplicate's exchange that took such a slot (>= 0) writes it back; every
    exchange that saw a slot restores it after, so the slot is the last value written.

    SELF_ROWS > 0 (with PLACE_EARLY; cache_kernels.LOOKUP_COPY_ROWS, or LOOKUP_COPY_ROWS_STAGED):
    the first SELF_ROWS ranks this block placed are this program's to copy (_copy_claimed, once
    its lookup is signalled); their miss_host entries are stored as -1 - h, so the copy programs
    skip them. Returns that rank range [r0, r1) and the HEAD it read.

    STAMP = False (cache_kernels.PROBE_LOOKUP_STAMPS, a timing probe only): the hits are not
    stamped, which breaks the eviction order."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(host_slots + offs, mask=offs < total, other=-1).to(tl.int32)
    valid = h >= 0
    g = tl.load(h2g + h, mask=valid, other=-1)
    clock = tl.load(meta + M_CLOCK)
    k_early = clock * 0
    head = clock * 0
    if PLACE_EARLY:
        k_early = tl.minimum(tl.load(meta + M_NFREE), cap)
        head = tl.load(meta + M_HEAD)
    r0 = clock * 0  # this block's early-placed ranks: [r0, r1)
    r1 = clock * 0
    if STAMP:
        tl.store(prio + g, tl.zeros([BLOCK], tl.int32) + clock, mask=valid & (g >= 0))
    if MISSES:
        miss = valid & (g == -1)
        any_miss = tl.sum(miss.to(tl.int32), axis=0)
        if not SKIP_CLEAN:  # cache_kernels.LOOKUP_SKIP_CLEAN = False: every block claims
            any_miss = any_miss * 0 + 1
        if any_miss > 0:
            old = tl.atomic_xchg(
                h2g + h, tl.full([BLOCK], PENDING, tl.int32), mask=miss, sem="relaxed"
            )
            win = (miss & (old == -1)).to(tl.int32)
            nwin = tl.sum(win, axis=0)
            if nwin > 0:
                base = tl.atomic_add(meta + M_NMISS, nwin, sem="relaxed")
                pos = base + tl.cumsum(win, axis=0) - 1
                listed = h
                if PLACE_EARLY and SELF_ROWS > 0:
                    r0 = base
                    r1 = tl.maximum(tl.minimum(tl.minimum(base + nwin, k_early), base + SELF_ROWS),
                                    base)  # fmt: skip
                    listed = tl.where(pos < r1, -1 - h, h)  # this program copies these rows
                tl.store(miss_host + pos, listed, mask=(win > 0) & (pos < cap))
                if PLACE_EARLY:
                    pm = (win > 0) & (pos < k_early)
                    at = head + pos
                    slot = tl.load(ring + tl.where(at >= n_g, at - n_g, at), mask=pm, other=0)
                    tl.store(h2g + h, slot, mask=pm)
                    tl.store(g2h + slot, h, mask=pm)
                    tl.store(prio + slot, tl.zeros([BLOCK], tl.int32) + clock, mask=pm)
            if PLACE_EARLY:
                tl.store(h2g + h, old, mask=miss & (old >= 0))  # a duplicate took a placed slot
        nvalid = tl.sum(valid.to(tl.int32), axis=0)
        tl.atomic_add(stats + S_SELECTED, nvalid.to(tl.int64), sem="relaxed")
    return r0, r1, head


@triton.jit
def _copy_units(
    host_kv,
    gpu_kv,
    h2g,
    stage_kv,
    hstage,
    shost,
    ehi,
    n_stage,
    u,
    r,
    h,
    nunits,
    UPR: tl.constexpr,
    UNITS: tl.constexpr,
    CACHE: tl.constexpr,
    STAGED: tl.constexpr,
):
    """Units u (rows r, host slots h = miss_host[r]) host -> GPU slot host_to_gpu[h], those below
    nunits whose h is not marked (< 0: a lookup program copies that row, _lookup's SELF_ROWS).
    Returns _move_units' count of rows read from staging."""
    um = (u < nunits) & (h >= 0)
    g = tl.load(h2g + h, mask=um, other=0)
    return _move_units(host_kv, gpu_kv, stage_kv, hstage, shost, ehi, n_stage, u, r, h, g, um,
                       UPR, CACHE, STAGED)  # fmt: skip


@triton.jit
def _move_units(
    host_kv, gpu_kv, stage_kv, hstage, shost, ehi, n_stage, u, r, h, g, um, UPR: tl.constexpr,
    CACHE: tl.constexpr, STAGED: tl.constexpr,
):  # fmt: skip
    """Units u (16-byte word 4 (u - r * UPR) of row r: host slot h -> GPU slot g) where um.
    STAGED (echo::recall_staged): a row staged in the current epoch is read from stage_kv
    (device memory, a copy of the host row) instead of over PCIe: s = hstage[h] in [0, n_stage)
    and its tag shost[s] == ehi | h (ehi: the epoch << 32, prefetch_layout.staged_source). The
    tag and the staged row depend on s alone, so both loads are issued together; a stale entry
    (its tag another step's or another row's) reads the host. Returns the rows read from staging
    among these units (each counted at its first word; 0 without STAGED)."""
    word = (u - r * UPR) * 4
    src = h.to(tl.int64) * (UPR * 4) + word
    dst = g.to(tl.int64) * (UPR * 4) + word
    m2 = um[:, None]
    w4 = tl.arange(0, 4)
    n_staged = 0
    if STAGED:
        s = tl.load(hstage + h, mask=um, other=-1)
        sv = um & (s >= 0) & (s < n_stage)
        s64 = s.to(tl.int64)
        tag = tl.load(shost + s64, mask=sv, other=-1)
        ssrc = s64 * (UPR * 4) + word
        vs = tl.load(stage_kv + ssrc[:, None] + w4[None, :], mask=sv[:, None])
        live = sv & (tag == (ehi | h.to(tl.int64)))
        staged = live[:, None]
        vh = tl.load(host_kv + src[:, None] + w4[None, :], mask=m2 & ~staged, cache_modifier=CACHE)
        v = tl.where(staged, vs, vh)
        n_staged = tl.sum((live & (word == 0)).to(tl.int32), 0)
    else:
        v = tl.load(host_kv + src[:, None] + w4[None, :], mask=m2, cache_modifier=CACHE)
    tl.store(gpu_kv + dst[:, None] + w4[None, :], v, mask=m2)
    return n_staged


@triton.jit
def _stage_epoch(epoch_ptr, STAGED: tl.constexpr):
    """The current staging epoch << 32 (prefetch_layout), read once per copy program; 0 (unread)
    without STAGED."""
    ehi = 0
    if STAGED:
        ehi = tl.load(epoch_ptr).to(tl.int64) << STAGE_SHIFT
    return ehi


@triton.jit
def _count_promoted(pfs, n, STAGED: tl.constexpr):
    """One atomic per copy program: its rows read from staging into pf_stats[PF_PROMOTED]."""
    if STAGED:
        tl.atomic_add(pfs + PF_PROMOTED_C, n.to(tl.int64), mask=n > 0, sem="relaxed")


@triton.jit
def _copy_claimed(
    host_kv, gpu_kv, stage_kv, hstage, shost, epoch_ptr, pfs, n_stage, miss_host, ring, head,
    n_g, r0, r1, UPR: tl.constexpr, UNITS: tl.constexpr, CACHE: tl.constexpr,
    STAGED: tl.constexpr,
):  # fmt: skip
    """The rows of miss ranks [r0, r1), which this lookup program claimed, placed at the ring's
    entries HEAD + r and marked in miss_host as -1 - h (_lookup's SELF_ROWS), host -> GPU in
    UNITS 16-byte units at a time (cache_kernels.LOOKUP_COPY_ROWS). The GPU slot is read from the
    ring, not from host_to_gpu: a duplicate's exchange in another lookup program may hold that
    entry at PENDING for a moment. No program writes those ring entries or miss ranks in this
    launch (pushes land at or after HEAD + max(misses, free), cache_fused_kernels.py). STAGED:
    the rows read from staging are counted (_move_units, _count_promoted)."""
    ehi = _stage_epoch(epoch_ptr, STAGED)
    n_staged = 0
    for start in range(r0 * UPR, r1 * UPR, UNITS):
        u = start + tl.arange(0, UNITS)
        um = u < r1 * UPR
        r = u // UPR
        h = -1 - tl.load(miss_host + r, mask=um, other=-1)
        at = head + r
        g = tl.load(ring + tl.where(at >= n_g, at - n_g, at), mask=um, other=0)
        n_staged += _move_units(host_kv, gpu_kv, stage_kv, hstage, shost, ehi, n_stage, u, r, h,
                                g, um, UPR, CACHE, STAGED)  # fmt: skip
    _count_promoted(pfs, n_staged, STAGED)


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
    stage_kv,
    hstage,
    shost,
    epoch_ptr,
    pfs,
    total,
    n_copy,
    cap,
    n_stage,
    UPR: tl.constexpr,
    UNITS: tl.constexpr,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    CACHE: tl.constexpr,
    OWN_FINAL: tl.constexpr,
    STAGED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Programs [0, n_copy): copy the placed misses' rows host -> GPU over UVA as a flat stream of
    16-byte units (UPR per row; unit u is word 4 (u % UPR) of row u // UPR): each thread moves
    whole 16-byte vectors, a warp reads 512 contiguous bytes, and no lane idles on a row padded
    to a power of two (fp8's 656-byte row padded to 1024 wasted 36% of the lanes). Programs
    after: gpu_slots[j] = host_to_gpu[host_slots[j]] and un-claim misses left PENDING (only on
    overflow). The last program (no other work) advances the clock, adds the stats, resets NMISS
    and finalises a handed-over placement."""
    if PDL:
        _pdl_start()
    pid = tl.program_id(0)
    _copy_out(
        pid, host_kv, gpu_kv, miss_host, h2g, host_slots, out, meta + M_LAST_ALLOC, cap,
        stage_kv, hstage, shost, epoch_ptr, pfs, n_stage, total, n_copy, cap, UPR, UNITS, BLOCK,
        EARLY, CACHE, STAGED,
    )  # fmt: skip
    fin = pid == 0
    if OWN_FINAL:
        fin = pid == tl.num_programs(0) - 1
    if fin:
        _recall_final(meta, stats)


@triton.jit
def _copy_out(
    pid,
    host_kv,
    gpu_kv,
    miss_host,
    h2g,
    host_slots,
    out,
    rows_ptr,
    rows_max,
    stage_kv,
    hstage,
    shost,
    epoch_ptr,
    pfs,
    n_stage,
    total,
    n_copy,
    cap,
    UPR: tl.constexpr,
    UNITS: tl.constexpr,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    CACHE: tl.constexpr,
    STAGED: tl.constexpr,
):
    """Program ``pid`` of the copy/output launch: programs [0, n_copy) copy the rows of
    miss_host[:min(*rows_ptr, rows_max)] (but those a lookup program copies), the next
    cdiv(total, BLOCK) write the output
    (_copy_out_kernel). STAGED: the staging arguments of _move_units; a copy program reads the
    epoch once and adds its rows read from staging to pf_stats once (_count_promoted)."""
    if pid < n_copy:
        ehi = _stage_epoch(epoch_ptr, STAGED)
        # The first iteration's list read (miss_host, CAP entries) does not wait for the count:
        # it is issued beside the load of meta[LAST_ALLOC], so the host read starts one round
        # trip earlier (the chain was count -> miss_host -> host row; the host read needs only
        # the host slot, the GPU slot load runs beside it).
        # (u0, r0, h0: the else branch's h is another shape; Triton merges same-named variables.)
        u0 = pid * UNITS + tl.arange(0, UNITS)
        r0 = u0 // UPR
        if EARLY:
            h0 = tl.load(miss_host + r0, mask=r0 < cap, other=0)
            nunits = tl.minimum(tl.load(rows_ptr), rows_max) * UPR
        else:
            nunits = tl.minimum(tl.load(rows_ptr), rows_max) * UPR
            h0 = tl.load(miss_host + r0, mask=u0 < nunits, other=0)
        n_staged = _copy_units(host_kv, gpu_kv, h2g, stage_kv, hstage, shost, ehi, n_stage, u0,
                               r0, h0, nunits, UPR, UNITS, CACHE, STAGED)  # fmt: skip
        for start in range((pid + n_copy) * UNITS, nunits, n_copy * UNITS):
            u = start + tl.arange(0, UNITS)
            r = u // UPR
            h = tl.load(miss_host + r, mask=u < nunits, other=0)
            n_staged += _copy_units(host_kv, gpu_kv, h2g, stage_kv, hstage, shost, ehi, n_stage,
                                    u, r, h, nunits, UPR, UNITS, CACHE, STAGED)  # fmt: skip
        _count_promoted(pfs, n_staged, STAGED)
    else:
        offs = (pid - n_copy) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < total
        h = tl.load(host_slots + offs, mask=inb, other=-1)
        valid = h >= 0
        g = tl.load(h2g + h, mask=valid, other=-1)
        tl.store(h2g + h, tl.full([BLOCK], -1, tl.int32), mask=valid & (g == PENDING))
        tl.store(out + offs, tl.maximum(g, -1), mask=inb)


@triton.jit
def _out_early(q, h2g, host_slots, out, total, BLOCK: tl.constexpr):
    """Output block ``q`` of the one-launch recall, before the lookup ends (cache_kernels.
    RECALL_OUT_EARLY): out = host_to_gpu[hs] for the entries whose slot is already known. A slot
    read here is final: a hit's entry does not change in the launch (the lookup protects it
    before any eviction can start) and a miss's entry becomes a slot only where it is placed,
    which is its value for the rest of the launch (a duplicate's exchange writes the slot back).
    Returns the mask of the entries still to write: misses (-1 or PENDING when read), for
    _out_late once the placement is known."""
    offs = q * BLOCK + tl.arange(0, BLOCK)
    inb = offs < total
    h = tl.load(host_slots + offs, mask=inb, other=-1)
    valid = h >= 0
    g = tl.load(h2g + h, mask=valid, other=-1)
    late = valid & (g < 0)
    tl.store(out + offs, g, mask=inb & ~late)  # (-1 for padding)
    return offs, h, late


@triton.jit
def _out_late(h2g, out, offs, h, late):
    """The entries _out_early left, after the placement: a slot, or PENDING (past the call's
    capacity: the entry goes back to -1, as in _copy_out)."""
    # (.cg: past this SM's L1, which may hold the lines _out_early read before the wait)
    g = tl.load(h2g + h, mask=late, other=-1, cache_modifier=".cg")
    tl.store(h2g + h, tl.full(g.shape, -1, tl.int32), mask=late & (g == PENDING))
    tl.store(out + offs, tl.maximum(g, -1), mask=late)


@triton.jit
def _recall_final(meta, stats):
    """The recall's finalisation: advance the clock, add the stats, reset NMISS and finalise a
    placement the pass handed over. In a program of its own (the launcher adds it; its list share
    is empty), so it is off the copy's path. No other program of the copy launch reads what is
    finalised here (NMISS, CLOCK, the free count, the totals; the copy reads LAST_ALLOC, the
    output host_to_gpu): no barrier, no meta[DONE] atomic for the ~400 programs. The loads go out
    together (one round trip), the stores and relaxed atomics need no wait."""
    nmiss = tl.load(meta + M_NMISS)
    handed = tl.load(meta + M_ALLOC_CTR)
    nfree = tl.load(meta + M_NFREE)
    nalloc = tl.load(meta + M_LAST_ALLOC)
    clock = tl.load(meta + M_CLOCK)
    tl.store(meta + M_LAST_MISS, nmiss)
    tl.store(meta + M_NMISS, 0)
    if handed > 0:  # the placement pass handed its finalisation over
        tl.store(meta + M_NFREE, nfree - nalloc)
        tl.store(meta + M_HEAD, handed - 1)  # the ring's head after the pass's pops
        tl.store(meta + M_ALLOC_CTR, 0)
        tl.store(meta + M_IDX_HW, 0)  # no victims; the pass padded indices[:IDX_HW]
    tl.store(meta + M_CLOCK, (clock + 1) & CLOCK_MASK)
    tl.atomic_add(stats + S_RECALLED, nalloc.to(tl.int64), sem="relaxed")
    tl.atomic_add(stats + S_STEPS, nalloc.to(tl.int64) * 0 + 1, sem="relaxed")
