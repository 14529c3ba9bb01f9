"""CUDA implementations of the prefetch ops (semantics and references in custom_ops/prefetch.py).

- ``indexer_topk_prefetch_cuda``: a fused scores + staging kernel (the variants of
  prefetch_scores.py), the unchanged exact top-k, the in-graph EMA update (``_ema_kernel``: one
  launch where the torch expression of ``update_ema`` took about ten small ones).
- ``recall_staged_cuda``: ``_promote_kernel`` (the selected, staged, missing rows: one claim per
  host slot by an atomic exchange on host_stage, appended with one atomic per block), then the
  pool's own ``echo::free`` and ``echo::allocate`` for them (the normal protect / evict / allocate
  path), ``_commit_kernel`` (copy staging -> pool, empty the staging buffer, statistics), then the
  unchanged ``echo::recall`` for the remaining misses.
Static grids, live counts read on the device, no host syncs: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import indexer_kernels as ik
from custom_ops.prefetch_layout import EMA_ALPHA, PF_PROMOTED, PF_STAGED, PF_STEPS
from custom_ops.prefetch_scores import scores_variant

LIST_BLOCK = 1024
ROWS_PER_ITER = 4  # rows per copy iteration and program (staging -> pool, device memory)
# staged rows per score block at most ("tile"); "post" gives a program rows x TPP / BT in all
PF_ROWS = 8
_S_PROMOTED = tl.constexpr(PF_PROMOTED)
_S_STAGED = tl.constexpr(PF_STAGED)
_S_STEPS = tl.constexpr(PF_STEPS)
_A_NEW = tl.constexpr(EMA_ALPHA)  # update_ema's two weights, as the Python floats it uses
_A_OLD = tl.constexpr(1.0 - EMA_ALPHA)


def _words(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.shape[-1] % 4 or t.data_ptr() % 16 or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, 16-byte aligned, rows a multiple of 4 B")
    return t.view(torch.int32)


def indexer_topk_prefetch_cuda(
    q_fp8,
    weights,
    index_cache,
    block_table,
    seq_lens,
    topk,
    host_kv,
    host_to_gpu,
    stage_kv,
    stage_host,
    host_stage,
    stage_ctr,
    ema,
    pf_stats,
    cap,
    ratio,
    cfg: ik.IndexerConfig | None = None,
    rows_per_block: int = PF_ROWS,
    variant: str | None = None,
):
    """``echo::indexer_topk_prefetch`` on the GPU (or under TRITON_INTERPRET=1); ``variant``
    names the fused scores kernel (prefetch_scores.SCORES_VARIANTS, None: its default)."""
    cfg = cfg or ik.IndexerConfig()
    launch = scores_variant(variant)
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("indexer_topk_prefetch: block_table and seq_lens must be int32")
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    scores = launch(
        q_fp8,
        weights,
        index_cache,
        block_table,
        seq_lens,
        _words(host_kv, "host_kv"),
        host_to_gpu,
        _words(stage_kv, "stage_kv"),
        stage_host,
        host_stage,
        stage_ctr,
        ema,
        pf_stats,
        cap,
        ratio,
        cfg,
        rows_per_block,
    )
    host, kth = ik.topk_from_scores(scores, block_table, seq_lens, topk, cfg)
    ema_update_cuda(ema, kth, seq_lens, block_table)
    return host, kth


@triton.jit
def _ema_kernel(ema_ptr, kth_ptr, sl_ptr, bt_ptr, bt_stride, B, BP: tl.constexpr):
    r = tl.arange(0, BP)
    live = r < B
    live &= tl.load(sl_ptr + r, mask=live, other=0) > 0
    key = tl.load(bt_ptr + r * bt_stride, mask=live, other=0)  # the first host page
    # a key shared by several live rows (an n > 1 group's members): the first row writes it
    same = (key[None, :] == key[:, None]) & live[None, :] & (r[None, :] < r[:, None])
    live &= tl.sum(same.to(tl.int32), 1) == 0
    e = tl.load(ema_ptr + key, mask=live, other=0.0)
    k = tl.load(kth_ptr + r, mask=live, other=0.0)
    tl.store(ema_ptr + key, k * _A_NEW + e * _A_OLD, mask=live)


def ema_update_cuda(ema, kth, seq_lens, block_table) -> None:
    """``prefetch_layout.update_ema`` in one launch, bit for bit (no FMA contraction: the two
    products are rounded as torch rounds them). Of live rows that share a first page (an n > 1
    group) only the first writes it, as in the reference, so no two lanes store to one entry;
    padded rows leave the dump entry as it was, as the reference does."""
    B = seq_lens.shape[0]
    _ema_kernel[(1,)](
        ema, kth, seq_lens, block_table, block_table.stride(0), B,
        BP=max(2, triton.next_power_of_2(B)), num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip


@triton.jit
def _promote_kernel(
    host_slots, h2g, hstage, promote_host, promote_src, promote_n, total, cap, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(host_slots + offs, mask=offs < total, other=-1)
    valid = h >= 0
    g = tl.load(h2g + h, mask=valid, other=0)
    s = tl.load(hstage + h, mask=valid & (g < 0), other=-1)
    cand = valid & (g < 0) & (s >= 0)
    # a host slot listed twice is promoted once: only one exchange sees its staging slot
    old = tl.atomic_xchg(hstage + h, tl.full([BLOCK], -1, tl.int32), mask=cand, sem="relaxed")
    win = (cand & (old >= 0)).to(tl.int32)
    nwin = tl.sum(win, 0)
    base = tl.atomic_add(promote_n, nwin, mask=nwin > 0, sem="relaxed")
    pos = base + tl.cumsum(win, 0) - 1
    m = (win > 0) & (pos < cap)
    tl.store(promote_host + pos, h, mask=m)
    tl.store(promote_src + pos, old, mask=m)


@triton.jit
def _commit_kernel(
    stage,
    gpu_kv,
    promote_src,
    indices,
    promote_n,
    stage_host,
    hstage,
    pf_stats,
    n_stage,
    n_copy,
    ROW_W: tl.constexpr,
    ROW_WP: tl.constexpr,
    RPI: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Programs [0, n_copy): pool[indices[i]] = staging[promote_src[i]] for i < n (slot -1: not
    placed, the recall will fetch it). Programs after: empty the staging buffer, count it."""
    pid = tl.program_id(0)
    if pid < n_copy:
        n = tl.load(promote_n)
        cols = tl.arange(0, ROW_WP)
        cmask = cols < ROW_W
        for start in range(pid * RPI, n, n_copy * RPI):
            r = start + tl.arange(0, RPI)
            rm = r < n
            src = tl.load(promote_src + r, mask=rm, other=0).to(tl.int64)
            dst = tl.load(indices + r, mask=rm, other=-1)
            ok = rm & (dst >= 0)
            m2 = ok[:, None] & cmask[None, :]
            v = tl.load(stage + src[:, None] * ROW_W + cols[None, :], mask=m2)
            tl.store(gpu_kv + dst.to(tl.int64)[:, None] * ROW_W + cols[None, :], v, mask=m2)
            tl.atomic_add(pf_stats + _S_PROMOTED, tl.sum(ok.to(tl.int64), 0), sem="relaxed")
        if pid == 0:
            tl.atomic_add(pf_stats + _S_STEPS, (n * 0 + 1).to(tl.int64), sem="relaxed")
    else:
        offs = (pid - n_copy) * BLOCK + tl.arange(0, BLOCK)
        h = tl.load(stage_host + offs, mask=offs < n_stage, other=-1)
        live = h >= 0
        tl.store(hstage + h, tl.full([BLOCK], -1, tl.int32), mask=live)
        tl.store(stage_host + offs, tl.full([BLOCK], -1, tl.int32), mask=live)
        c = tl.sum(live.to(tl.int64), 0)
        tl.atomic_add(pf_stats + _S_STAGED, c, mask=c > 0, sem="relaxed")


def _n_copy(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # TRITON_INTERPRET on CPU


def recall_staged_cuda(
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
    stage_kv,
    stage_host,
    host_stage,
    stage_ctr,
    promote_host,
    promote_n,
    pf_stats,
):
    hs = host_slots.reshape(-1)
    total, cap = hs.numel(), indices.shape[0]
    # the staging slots of the promoted rows reuse the pool's miss list as scratch: recall
    # rewrites it from scratch afterwards
    promote_src = miss_host
    promote_n.zero_()
    _promote_kernel[(max(1, triton.cdiv(total, LIST_BLOCK)),)](
        hs,
        host_to_gpu,
        host_stage,
        promote_host,
        promote_src,
        promote_n,
        total,
        cap,
        BLOCK=LIST_BLOCK,
        num_warps=4,
    )
    torch.clamp_(promote_n, max=cap)
    maps = (gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta)
    torch.ops.echo.free(*maps, hist, stats, host_slots, promote_n)
    torch.ops.echo.allocate(*maps, promote_host, promote_n)
    row_w = host_kv.shape[1] // 4
    n_copy, n_stage = _n_copy(hs.device), stage_host.shape[0]
    _commit_kernel[(n_copy + triton.cdiv(n_stage, LIST_BLOCK),)](
        _words(stage_kv, "stage_kv"),
        _words(gpu_kv, "gpu_kv"),
        promote_src,
        indices,
        promote_n,
        stage_host,
        host_stage,
        pf_stats,
        n_stage,
        n_copy,
        ROW_W=row_w,
        ROW_WP=triton.next_power_of_2(row_w),
        RPI=ROWS_PER_ITER,
        BLOCK=LIST_BLOCK,
        num_warps=4,
    )
    stage_ctr.zero_()
    return torch.ops.echo.recall(
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
    )
