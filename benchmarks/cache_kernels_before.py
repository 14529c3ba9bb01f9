"""FROZEN COPY, for before/after timing only: custom_ops/cache_kernels.py as of commit 58ac81b
(before issue 18), so benchmarks/bench_cache_ops.py can time the old kernels beside the new ones
in the same run. Not used by the engine; do not edit (its semantics: eviction of exactly
max(n - free, 0), no reserve). Its original docstring follows.

Triton kernels of the cache-manager ops (cache_ops.py has the semantics and the references).

All grids are static (sized by the pool, the list or the SM count); the live counts (how many to
allocate, how many misses) are read from device memory inside the kernels, so a CUDA graph
replays them with new values. No autotuning: these kernels mutate state.

Cross-program coordination, and why it is race-free:
- A kernel never reads a counter that another program of the same launch writes, except through
  the atomic that writes it (ranking: the old value of one atomicAdd per block is the block's
  base rank; the ranks inside a block come from a prefix sum).
- Each multi-program kernel ends with ``_last_program``: after a CTA barrier, one release/acquire
  atomic on meta[DONE]; the program that sees DONE == grid - 1 is the last, every other program's
  writes are visible to it, and it alone finalises (free count, clock, stats) and resets the
  scratch counters with atomic exchanges. So no separate reset launch is needed.
- Ops made of several launches (free, recall) hand values from one launch to the next through
  meta; launches on one stream are ordered.

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

SCAN_BLOCK = 1024  # pool slots per program in pool scans (allocate, free): one atomic per block
LIST_BLOCK = 1024  # list entries per program (lookup, output, release)
PAD_BLOCK = 1024  # index-buffer entries per padding store
ROWS_PER_ITER = 4  # rows per copy-loop iteration and program (bytes in flight over PCIe)


# ---- helpers ------------------------------------------------------------------------------------
@triton.jit
def _bucket(age):
    """cache_ops.age_bucket for age >= 1."""
    return tl.where(age < AGE_EXACT, age,
                    tl.minimum(AGE_EXACT + ((age - AGE_EXACT) >> AGE_SHIFT), NBINS - 1))


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


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _lookup_kernel(host_slots, h2g, prio, miss_host, meta, stats, total, cap,
                   MISSES: tl.constexpr, BLOCK: tl.constexpr):
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
    """Histogram of the age buckets of evictable slots, only when free must evict."""
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
def _select_kernel(prio, gpu_free, g2h, h2g, indices, meta, hist, stats, want_ptr, n_g, cap,
                   BLOCK: tl.constexpr, PAD: tl.constexpr):
    """Evict exactly max(want - free, 0) slots: every evictable slot in buckets above the
    threshold bucket T, and the first (by atomic rank) of those in T. Finalise in the last
    program: free count, index high-water mark, stats, reset of hist and counters."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nfree = tl.load(meta + M_NFREE)
    needed = tl.maximum(tl.minimum(tl.load(want_ptr), cap) - nfree, 0)
    _pad(indices, needed, tl.load(meta + M_IDX_HW), pid, nprog, PAD)
    if needed > 0:
        bins = tl.arange(0, NBINS)
        cnt = tl.load(hist + bins)
        suffix = tl.sum(cnt, axis=0) - tl.cumsum(cnt, axis=0) + cnt  # evictable in buckets >= b
        # T = the highest bucket whose suffix still covers `needed`; T = 1 (take all) on overflow.
        t = tl.maximum(tl.max(tl.where((suffix >= needed) & (bins > 0), bins, 0), axis=0), 1)
        take_t = needed - tl.sum(tl.where(bins > t, cnt, 0), axis=0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        p = tl.load(prio + offs, mask=offs < n_g, other=-1)
        age = (tl.load(meta + M_CLOCK) - p) & CLOCK_MASK
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
            pos = tl.atomic_add(meta + M_VICT_CTR, nv, sem="relaxed") + tl.cumsum(vi, axis=0) - 1
            tl.store(indices + pos, offs, mask=victim)
            hh = tl.load(g2h + offs, mask=victim, other=0)
            minus1 = tl.full([BLOCK], -1, tl.int32)
            tl.store(h2g + hh, minus1, mask=victim)
            tl.store(g2h + offs, minus1, mask=victim)
            tl.store(prio + offs, minus1, mask=victim)
            tl.store(gpu_free + offs, tl.full([BLOCK], 1, tl.int8), mask=victim)
    if _last_program(meta):
        nv_total = tl.atomic_xchg(meta + M_VICT_CTR, 0)
        tl.atomic_xchg(meta + M_EQ_CTR, 0)
        tl.atomic_xchg(meta + M_DONE, 0)
        tl.store(hist + tl.arange(0, NBINS), tl.zeros([NBINS], tl.int32))
        _pad(indices, nv_total, needed, 0, 1, PAD)  # only on overflow (fewer victims than needed)
        tl.store(meta + M_NFREE, nfree + nv_total)
        tl.store(meta + M_IDX_HW, nv_total)
        tl.store(meta + M_LAST_EVICT, nv_total)
        tl.atomic_add(stats + S_EVICTED, nv_total.to(tl.int64))
        if nv_total < needed:
            tl.atomic_add(meta + M_OVERFLOW, 1)


@triton.jit
def _alloc_kernel(gpu_free, prio, g2h, h2g, indices, meta, want_host, want_ptr, n_g, cap,
                  WRITE_IDX: tl.constexpr, BLOCK: tl.constexpr, PAD: tl.constexpr):
    """Take n = min(want, cap) free slots: per 1024-slot block, a prefix sum of the free bits and
    one atomicAdd for the block's base rank; rank r < n maps want_host[r] <-> that slot. Blocks
    that start after n slots were claimed skip the scan (early exit)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    want = tl.load(want_ptr)
    n = tl.minimum(want, cap)
    nfree = tl.load(meta + M_NFREE)
    clock = tl.load(meta + M_CLOCK)
    if WRITE_IDX:
        _pad(indices, n, tl.load(meta + M_IDX_HW), pid, nprog, PAD)
    if tl.load(meta + M_ALLOC_CTR, volatile=True) < n:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        f = (tl.load(gpu_free + offs, mask=offs < n_g, other=0) != 0).to(tl.int32)
        cnt = tl.sum(f, axis=0)
        if cnt > 0:
            base = tl.atomic_add(meta + M_ALLOC_CTR, cnt, sem="relaxed")
            if base < n:
                rank = base + tl.cumsum(f, axis=0) - 1
                take = (f > 0) & (rank < n)
                hh = tl.load(want_host + rank, mask=take, other=0)
                tl.store(g2h + offs, hh, mask=take)
                tl.store(h2g + hh, offs, mask=take)
                tl.store(prio + offs, tl.zeros([BLOCK], tl.int32) + clock, mask=take)
                tl.store(gpu_free + offs, tl.zeros([BLOCK], tl.int8), mask=take)
                if WRITE_IDX:
                    tl.store(indices + rank, offs, mask=take)
    if _last_program(meta):
        # Blocks skip only once the counter reached n, so total < n means every free slot was
        # counted: k = min(total, n) is exactly the number placed.
        k = tl.minimum(tl.atomic_xchg(meta + M_ALLOC_CTR, 0), n)
        tl.atomic_xchg(meta + M_DONE, 0)
        tl.store(meta + M_NFREE, nfree - k)
        tl.store(meta + M_LAST_ALLOC, k)
        if WRITE_IDX:
            _pad(indices, k, n, 0, 1, PAD)  # only when short of free slots
            tl.store(meta + M_IDX_HW, k)
        if k < want:
            tl.atomic_add(meta + M_OVERFLOW, 1)


@triton.jit
def _copy_out_kernel(host_kv, gpu_kv, miss_host, h2g, host_slots, out, meta, stats, total,
                     n_copy, ROW_W: tl.constexpr, ROW_WP: tl.constexpr, RPI: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Programs [0, n_copy): copy the placed misses' rows host -> GPU (UVA reads, RPI rows of
    int32 words per iteration). Programs after: gpu_slots[j] = host_to_gpu[host_slots[j]] and
    un-claim misses left PENDING (only on overflow). Last program: clock, stats, reset NMISS."""
    pid = tl.program_id(0)
    if pid < n_copy:
        nalloc = tl.load(meta + M_LAST_ALLOC)
        cols = tl.arange(0, ROW_WP)
        cmask = cols < ROW_W
        for start in range(pid * RPI, nalloc, n_copy * RPI):
            r = start + tl.arange(0, RPI)
            rmask = r < nalloc
            h = tl.load(miss_host + r, mask=rmask, other=0)
            g = tl.load(h2g + h, mask=rmask, other=0)
            m2 = rmask[:, None] & cmask[None, :]
            v = tl.load(host_kv + h.to(tl.int64)[:, None] * ROW_W + cols[None, :], mask=m2)
            tl.store(gpu_kv + g.to(tl.int64)[:, None] * ROW_W + cols[None, :], v, mask=m2)
    else:
        offs = (pid - n_copy) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < total
        h = tl.load(host_slots + offs, mask=inb, other=-1)
        valid = h >= 0
        g = tl.load(h2g + h, mask=valid, other=-1)
        tl.store(h2g + h, tl.full([BLOCK], -1, tl.int32), mask=valid & (g == PENDING))
        tl.store(out + offs, tl.maximum(g, -1), mask=inb)
    if _last_program(meta):
        tl.store(meta + M_LAST_MISS, tl.atomic_xchg(meta + M_NMISS, 0))
        tl.atomic_xchg(meta + M_DONE, 0)
        tl.store(meta + M_CLOCK, (tl.load(meta + M_CLOCK) + 1) & CLOCK_MASK)
        nalloc = tl.load(meta + M_LAST_ALLOC).to(tl.int64)
        tl.atomic_add(stats + S_RECALLED, nalloc)
        tl.atomic_add(stats + S_STEPS, nalloc * 0 + 1)


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
def _offload_kernel(host_kv, index_k, rows, index_rows, slots,
                    ROW_W: tl.constexpr, ROW_WP: tl.constexpr):
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
    # Enough programs that ~2 x SMs x 4 rows are in flight: PCIe latency is ~1-2 us, so the copy
    # needs tens of kilobytes outstanding to run near link speed.
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # TRITON_INTERPRET on CPU: few programs, several loop iterations each


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, block)),)


def allocate_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n):
    n_g = gpu_to_host.shape[0]
    _alloc_kernel[_grid(n_g, SCAN_BLOCK)](
        gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n, n_g,
        indices.shape[0], WRITE_IDX=True, BLOCK=SCAN_BLOCK, PAD=PAD_BLOCK, num_warps=4,
    )


def _evict(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, want):
    n_g, cap = gpu_to_host.shape[0], indices.shape[0]
    grid = _grid(n_g, SCAN_BLOCK)
    _hist_kernel[grid](gpu_priority, meta, hist, want, n_g, cap, BLOCK=SCAN_BLOCK, num_warps=4)
    _select_kernel[grid](
        gpu_priority, gpu_free, gpu_to_host, host_to_gpu, indices, meta, hist, stats, want, n_g,
        cap, BLOCK=SCAN_BLOCK, PAD=PAD_BLOCK, num_warps=4,
    )


def free_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats,
              protect, n):
    p = protect.reshape(-1)
    _lookup_kernel[_grid(p.numel(), LIST_BLOCK)](
        p, host_to_gpu, gpu_priority, indices, meta, stats, p.numel(), indices.shape[0],
        MISSES=False, BLOCK=LIST_BLOCK, num_warps=4,
    )
    _evict(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, n)


def recall_cuda(host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices,
                miss_host, meta, hist, stats, host_slots) -> torch.Tensor:
    hs = host_slots.reshape(-1)
    total, cap, n_g = hs.numel(), indices.shape[0], gpu_to_host.shape[0]
    out = torch.empty_like(host_slots)
    n_miss = meta[C.NMISS : C.NMISS + 1]  # the live miss count, as a pointer
    _lookup_kernel[_grid(total, LIST_BLOCK)](
        hs, host_to_gpu, gpu_priority, miss_host, meta, stats, total, cap, MISSES=True,
        BLOCK=LIST_BLOCK, num_warps=4,
    )
    _evict(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, n_miss)
    _alloc_kernel[_grid(n_g, SCAN_BLOCK)](
        gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, miss_host, n_miss, n_g,
        cap, WRITE_IDX=False, BLOCK=SCAN_BLOCK, PAD=PAD_BLOCK, num_warps=4,
    )
    row_w = host_kv.shape[1] // 4
    n_copy = _num_copy_programs(hs.device)
    _copy_out_kernel[(n_copy + triton.cdiv(total, LIST_BLOCK),)](
        _words(host_kv, "host_kv", True), _words(gpu_kv, "gpu_kv", True), miss_host, host_to_gpu,
        hs, out.view(-1), meta, stats, total, n_copy, ROW_W=row_w,
        ROW_WP=triton.next_power_of_2(row_w), RPI=ROWS_PER_ITER, BLOCK=LIST_BLOCK, num_warps=4,
    )
    return out


def release_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots) -> None:
    hs = host_slots.reshape(-1)
    _release_kernel[_grid(hs.numel(), LIST_BLOCK)](
        hs, host_to_gpu, gpu_to_host, gpu_priority, gpu_free, meta, hs.numel(),
        host_to_gpu.shape[0], BLOCK=LIST_BLOCK, num_warps=4,
    )


def offload_cuda(host_kv, index_k, rows, index_rows, slots) -> None:
    """echo::offload's CUDA path (kv_cache.py): rows [T, row] -> host_kv, index rows [T, 132] ->
    the paged indexer cache, for slots >= 0."""
    t = slots.shape[0]
    if t == 0:
        return
    row_w = host_kv.shape[1] // 4
    _offload_kernel[(t,)](
        _words(host_kv, "host_kv", True), index_k.view(torch.int32), _words(rows, "rows", False),
        _words(index_rows, "index_rows", False),
        slots.contiguous(), ROW_W=row_w, ROW_WP=triton.next_power_of_2(row_w), num_warps=2,
    )
