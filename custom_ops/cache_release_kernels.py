"""Triton kernels of the list ops outside recall and free: release (a finished request's host
slots leave the maps, their GPU slots go back to the ring; release_layers: in every layer's pool at
once, its prefetch threshold state reset too) and offload (new tokens' rows to
the host pool and their keys to the paged indexer cache); launched by cache_kernels.py."""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.cache_constexpr import (
    IDX_PAGE_W,
    IDX_ROW_W,
    M_DONE,
    M_HEAD,
    M_NFREE,
    M_VICT_CTR,
    PAGE_C,
)
from custom_ops.cache_sync import _last_program


@triton.jit
def _release_slots(host_slots, h2g, g2h, prio, ring, meta, total, n_h, n_g, pid, nprog,
                   BLOCK: tl.constexpr):  # fmt: skip
    """Program ``pid`` of ``nprog``: drop its block of host slots from one pool's maps (the
    exchange makes duplicates in the list free once) and push their GPU slots onto the ring of
    free slots behind its last entry: position HEAD + NFREE + j, j from one atomicAdd per block
    on meta[VICT_CTR] plus a prefix sum. The last program (meta[DONE]) adds the count to NFREE
    and resets the counter, so no program reads NFREE after another changed it."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(host_slots + offs, mask=offs < total, other=-1)
    head = tl.load(meta + M_HEAD)
    nfree = tl.load(meta + M_NFREE)
    valid = (h >= 0) & (h < n_h)
    h = tl.where(valid, h, 0).to(tl.int32)
    old = tl.atomic_xchg(h2g + h, tl.full([BLOCK], -1, tl.int32), mask=valid, sem="relaxed")
    rel = valid & (old >= 0)
    minus1 = tl.full([BLOCK], -1, tl.int32)
    tl.store(g2h + old, minus1, mask=rel)
    tl.store(prio + old, minus1, mask=rel)
    ri = rel.to(tl.int32)
    c = tl.sum(ri, axis=0)
    if c > 0:
        j = tl.atomic_add(meta + M_VICT_CTR, c, sem="relaxed") + tl.cumsum(ri, axis=0) - 1
        pos = head + nfree + j
        tl.store(ring + tl.where(pos >= n_g, pos - n_g, pos), old, mask=rel)
    if _last_program(meta, nprog):
        pushed = tl.atomic_xchg(meta + M_VICT_CTR, 0, sem="relaxed")
        tl.store(meta + M_NFREE, nfree + pushed)
        tl.atomic_xchg(meta + M_DONE, 0, sem="relaxed")


@triton.jit
def _release_kernel(
    host_slots, h2g, g2h, prio, ring, meta, total, n_h, n_g, BLOCK: tl.constexpr
):  # fmt: skip
    """echo::release: one pool, a program per block of host slots."""
    _release_slots(host_slots, h2g, g2h, prio, ring, meta, total, n_h, n_g, tl.program_id(0),
                   tl.num_programs(0), BLOCK)  # fmt: skip


@triton.jit
def _ptr(table, col, layer, n_layers, DT: tl.constexpr):
    """Entry (col, layer) of a [cols, n_layers] table of int64 addresses, as a pointer to DT."""
    return tl.load(table + col * n_layers + layer).to(tl.pointer_type(DT))


@triton.jit
def _release_layers_kernel(
    host_slots, table, total, n_h, n_g, n_layers, n_ema,
    FORGET: tl.constexpr, EMA_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """echo::release_layers: program (i, l) is release's program i on layer l's pool, whose
    buffers are the addresses in column l of ``table`` (rows: host_to_gpu, gpu_to_host,
    gpu_priority, gpu_free, meta, then with FORGET the threshold state ``ema``). With FORGET
    it also zeroes the ``ema`` columns (EMA_ROWS x n_ema fp32) of its slots' host pages."""
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    h2g = _ptr(table, 0, layer, n_layers, tl.int32)
    g2h = _ptr(table, 1, layer, n_layers, tl.int32)
    prio = _ptr(table, 2, layer, n_layers, tl.int32)
    ring = _ptr(table, 3, layer, n_layers, tl.int32)
    meta = _ptr(table, 4, layer, n_layers, tl.int32)
    if FORGET:
        ema = _ptr(table, 5, layer, n_layers, tl.float32)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        h = tl.load(host_slots + offs, mask=offs < total, other=-1)
        valid = (h >= 0) & (h < n_h)
        page = tl.where(valid, h, 0) // PAGE_C
        zero = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(EMA_ROWS):
            tl.store(ema + r * n_ema + page, zero, mask=valid)
    _release_slots(host_slots, h2g, g2h, prio, ring, meta, total, n_h, n_g, pid,
                   tl.num_programs(0), BLOCK)  # fmt: skip


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
