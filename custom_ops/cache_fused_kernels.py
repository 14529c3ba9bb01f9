"""free and recall in ONE launch each (cache_kernels.FUSED): the phases that were separate
launches (lookup, histogram, eviction + placement, row copy + output) are ranges of program ids
of one grid, in that order, and a program waits for the phases it depends on through a counter
in meta (_signal / _wait: release / acquire atomics) instead of a launch boundary.

Why this cannot deadlock: a program only ever waits for programs with LOWER ids. The GPU hands
out thread blocks in increasing id order, so the lowest unfinished program has been scheduled
and waits for nobody unfinished: it finishes, and by induction so does everyone (no program
needs the others resident with it: at B x k = 131072 the recall's grid is 512 + 2 x 196 + 264 +
512 + 1 programs of 4 warps). The CPU
interpreter runs the programs one after another in id order, so every wait there is already
satisfied. A phase that has nothing to do (no eviction due: most steps, thanks to the reserve)
signals and returns without touching the pool.

The phases' bodies are the kernels of cache_list_kernels.py / cache_pool_kernels.py, whose
race-freedom arguments (cache_kernels.py) carry over: what was ordered by a launch boundary is
ordered by a _wait that follows the producers' _signal. One order is relaxed instead: the
recall's output programs read the map before the lookup ends (RECALL_OUT_EARLY), and wait only
for the entries they read no slot in (cache_list_kernels._out_early says why a slot read early is
final)."""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.cache_constexpr import (
    M_COPIED,
    M_FREE0,
    M_HISTED,
    M_LAST_ALLOC,
    M_LOOKED,
    M_NFREE,
    M_NMISS,
    M_PLACED,
)
from custom_ops.cache_list_kernels import (
    _copy_claimed,
    _copy_out,
    _lookup,
    _out_early,
    _out_late,
    _recall_final,
)
from custom_ops.cache_pool_kernels import _evict_place, _hist
from custom_ops.cache_sync import _signal, _wait


@triton.jit
def _free_kernel(
    protect,
    h2g,
    prio,
    ring,
    g2h,
    indices,
    meta,
    hist,
    stats,
    want_ptr,
    total,
    n_g,
    cap,
    reserve,
    n_look,
    n_scan,
    LIST_BLOCK: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    SLEEP_NS: tl.constexpr = 0,
):
    """echo::free: programs [0, n_look) stamp the protected slots, the next n_scan build the age
    histogram, the last n_scan evict. Whether an eviction is due is known before the stamps
    (needed = min(n, CAP) - NFREE; the stamps do not change the free count), so in a step that
    needs none no program waits or signals: the op costs one lookup pass."""
    pid = tl.program_id(0)
    needed = tl.minimum(tl.load(want_ptr), cap) - tl.load(meta + M_NFREE)
    if pid < n_look:
        _lookup(pid, protect, h2g, prio, ring, g2h, indices, meta, stats, total, cap, n_g, False,
                LIST_BLOCK, True, False)  # fmt: skip
        if needed > 0:
            _signal(meta + M_LOOKED)
    elif pid < n_look + n_scan:
        if needed > 0:
            _wait(meta + M_LOOKED, n_look, SLEEP_NS)
            _hist(pid - n_look, prio, meta, hist, want_ptr, n_g, cap, SCAN_BLOCK)
            _signal(meta + M_HISTED)
    else:
        if needed > 0:
            _wait(meta + M_HISTED, n_scan, SLEEP_NS)
        # its last program resets LOOKED and HISTED: every program has passed its wait by then
        _evict_place(
            pid - n_look - n_scan, n_scan, prio, ring, g2h, h2g, indices, meta, hist, stats,
            want_ptr, indices, n_g, cap, reserve, False, SCAN_BLOCK, PAD, True, False,
        )  # fmt: skip


@triton.jit
def _recall_kernel(
    host_kv,
    gpu_kv,
    host_slots,
    h2g,
    prio,
    ring,
    g2h,
    indices,
    miss_host,
    meta,
    hist,
    stats,
    out,
    stage_kv,
    hstage,
    shost,
    epoch_ptr,
    pfs,
    total,
    n_g,
    cap,
    reserve,
    n_look,
    n_scan,
    n_copy,
    n_out,
    n_stage,
    UPR: tl.constexpr,
    UNITS: tl.constexpr,
    LIST_BLOCK: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    SKIP_CLEAN: tl.constexpr,
    EARLY: tl.constexpr,
    CACHE: tl.constexpr,
    STAGED: tl.constexpr,
    SLEEP_NS: tl.constexpr = 0,
    SELF_ROWS: tl.constexpr = 0,
    LOOK_UNITS: tl.constexpr = 512,
    OUT_EARLY: tl.constexpr = False,
    STAMP: tl.constexpr = True,
):
    """echo::recall: lookup [n_look) -> histogram [n_scan) -> eviction + placement [n_scan) ->
    row copy [n_copy) and output [n_out) -> one finalising program. The lookup places the misses
    the ring serves (PLACE_EARLY: ranks below the free count); how many misses there are is
    known only after it, so the other phases wait for it (LOOKED; the output only where its
    block read a miss, OUT_EARLY below). Then, when no eviction is due (most steps), every miss
    is placed: the copy starts at once, beside the pass (which only records the counts). When
    one is due, the pass waits for the histogram (HISTED) and copy and output (the latter where
    it read a miss) for the pass (PLACED), which serves the remaining misses from victims. The last
    program waits for everyone (HISTED, PLACED, COPIED: every other program has then passed all
    its waits), finalises as the copy launch's last program did, and resets the counters.

    SELF_ROWS > 0 (cache_kernels.LOOKUP_COPY_ROWS; LOOKUP_COPY_ROWS_STAGED for
    echo::recall_staged): a lookup program signals LOOKED, then copies
    the rows of up to SELF_ROWS of the misses it placed early itself, so those host reads start
    as soon as its own lookup ends, beside the other programs' lookups; the copy programs skip
    them (marked in miss_host) and copy the rest. Nothing waits for the lookup programs' copies
    inside the launch: no program reads those rows, and the launch ends after them.

    OUT_EARLY (cache_kernels.RECALL_OUT_EARLY): the output programs do not wait for the lookup;
    each writes the entries whose slot it can already read (_out_early: every hit) and waits, as
    the copy does, only if its block holds a miss (a few blocks in a steady step), then writes
    those (_out_late).

    STAGED (echo::recall_staged): every copy reads the misses staged in the current epoch from
    stage_kv (the tag rule of cache_list_kernels._move_units) and counts them in pf_stats.

    STAMP = False: a timing probe only (cache_kernels.PROBE_LOOKUP_STAMPS)."""
    pid = tl.program_id(0)
    n_miss = meta + M_NMISS  # the live miss count, as a pointer
    scan0 = n_look + n_scan  # the pass's first program
    copy0 = scan0 + n_scan  # the copy's first program
    if pid < n_look:
        if pid == 0:  # the free count before any program of this launch can change it
            tl.store(meta + M_FREE0, tl.load(meta + M_NFREE))
        r0, r1, head = _lookup(
            pid, host_slots, h2g, prio, ring, g2h, miss_host, meta, stats, total, cap, n_g, True,
            LIST_BLOCK, SKIP_CLEAN, True, SELF_ROWS, STAMP,
        )  # fmt: skip
        _signal(meta + M_LOOKED)
        if SELF_ROWS > 0:
            _copy_claimed(host_kv, gpu_kv, stage_kv, hstage, shost, epoch_ptr, pfs, n_stage,
                          miss_host, ring, head, n_g, r0, r1, UPR, LOOK_UNITS, CACHE,
                          STAGED)  # fmt: skip
    elif pid < scan0:
        _wait(meta + M_LOOKED, n_look, SLEEP_NS)
        _hist(pid - n_look, prio, meta, hist, n_miss, n_g, cap, SCAN_BLOCK)
        _signal(meta + M_HISTED)
    elif pid < copy0:
        _wait(meta + M_LOOKED, n_look, SLEEP_NS)
        if tl.minimum(tl.load(n_miss), cap) > tl.load(meta + M_FREE0):  # an eviction is due
            _wait(meta + M_HISTED, n_scan, SLEEP_NS)
        _evict_place(
            pid - scan0, n_scan, prio, ring, g2h, h2g, indices, meta, hist, stats, n_miss,
            miss_host, n_g, cap, reserve, True, SCAN_BLOCK, PAD, False, True,
        )  # fmt: skip
        _signal(meta + M_PLACED)
    elif OUT_EARLY and pid >= copy0 + n_copy and pid < copy0 + n_copy + n_out:
        offs, h, late = _out_early(pid - copy0 - n_copy, h2g, host_slots, out, total, LIST_BLOCK)
        if tl.sum(late.to(tl.int32), 0) > 0:
            _wait(meta + M_LOOKED, n_look, SLEEP_NS)
            if tl.minimum(tl.load(n_miss), cap) > tl.load(meta + M_FREE0):
                _wait(meta + M_PLACED, n_scan, SLEEP_NS)
            _out_late(h2g, out, offs, h, late)
        _signal(meta + M_COPIED)
    elif pid < copy0 + n_copy + n_out:
        _wait(meta + M_LOOKED, n_look, SLEEP_NS)
        free0 = tl.load(meta + M_FREE0)
        rows_ptr = n_miss  # no eviction: the misses, all placed by the lookup
        rows_max = tl.minimum(cap, free0)
        if tl.minimum(tl.load(n_miss), cap) > free0:  # the pass serves the rest from victims
            _wait(meta + M_PLACED, n_scan, SLEEP_NS)
            rows_ptr = meta + M_LAST_ALLOC
            rows_max = cap
        _copy_out(
            pid - copy0, host_kv, gpu_kv, miss_host, h2g, host_slots, out, rows_ptr, rows_max,
            stage_kv, hstage, shost, epoch_ptr, pfs, n_stage, total, n_copy, cap, UPR, UNITS,
            LIST_BLOCK, EARLY, CACHE, STAGED,
        )  # fmt: skip
        _signal(meta + M_COPIED)
    else:
        _wait(meta + M_HISTED, n_scan, SLEEP_NS)
        _wait(meta + M_PLACED, n_scan, SLEEP_NS)
        _wait(meta + M_COPIED, n_copy + n_out, SLEEP_NS)
        _recall_final(meta, stats)
        tl.atomic_xchg(meta + M_LOOKED, 0, sem="relaxed")
        tl.atomic_xchg(meta + M_HISTED, 0, sem="relaxed")
        tl.atomic_xchg(meta + M_PLACED, 0, sem="relaxed")
        tl.atomic_xchg(meta + M_COPIED, 0, sem="relaxed")
        tl.atomic_xchg(meta + M_FREE0, 0, sem="relaxed")
