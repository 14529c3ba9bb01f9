"""CUDA implementations of the prefetch ops (semantics and references in
custom_ops/prefetch_ref.py).

- ``indexer_topk_prefetch_cuda``: a fused scores + staging kernel (the variants of
  prefetch_scores.py), the unchanged exact top-k, the in-graph EMA update (``_ema_kernel``: one
  launch where the torch expression of ``update_ema`` took about ten small ones; it also
  writes the next step's thresholds, level + margin x dev).
- ``recall_staged_cuda``: ``echo::recall``'s launches with staging as the copy's second source
  (a staged miss is read GPU -> GPU), then ``_clear_kernel`` (statistics, empty the staging
  buffer, reset the claim counters).
Static grids, live counts read on the device, no host syncs: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import indexer_kernels as ik
from custom_ops.prefetch_layout import (
    EMA_ALPHA,
    EMA_DEV,
    EMA_LEVEL,
    EMA_THR,
    PF_PROMOTED,
    PF_STAGED,
    PF_STEPS,
)
from custom_ops.prefetch_scores import scores_variant

LIST_BLOCK = 1024
# staged rows per score block at most ("tile"); "post" gives a program rows x TPP / BT in all
PF_ROWS = 8
_S_PROMOTED = tl.constexpr(PF_PROMOTED)
_S_STAGED = tl.constexpr(PF_STAGED)
_S_STEPS = tl.constexpr(PF_STEPS)
_A_NEW = tl.constexpr(EMA_ALPHA)  # update_ema's two weights, as the Python floats it uses
_A_OLD = tl.constexpr(1.0 - EMA_ALPHA)
_THR = tl.constexpr(EMA_THR)  # the rows of the threshold state
_LEVEL = tl.constexpr(EMA_LEVEL)
_DEV = tl.constexpr(EMA_DEV)


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
    margin,
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
        ema[EMA_THR],  # the thresholds, one per first host page
        pf_stats,
        cap,
        ratio,
        cfg,
        rows_per_block,
    )
    host, kth = ik.topk_from_scores(scores, block_table, seq_lens, topk, cfg)
    ema_update_cuda(ema, kth, seq_lens, block_table, margin)
    return host, kth


@triton.jit
def _ema_kernel(ema_ptr, kth_ptr, sl_ptr, bt_ptr, bt_stride, B, n_ema, margin, BP: tl.constexpr):
    r = tl.arange(0, BP)
    live = r < B
    live &= tl.load(sl_ptr + r, mask=live, other=0) > 0
    key = tl.load(bt_ptr + r * bt_stride, mask=live, other=0)  # the first host page
    # a key shared by several live rows (an n > 1 group's members): the first row writes it
    same = (key[None, :] == key[:, None]) & live[None, :] & (r[None, :] < r[:, None])
    live &= tl.sum(same.to(tl.int32), 1) == 0
    level = tl.load(ema_ptr + _LEVEL * n_ema + key, mask=live, other=0.0)
    dev = tl.load(ema_ptr + _DEV * n_ema + key, mask=live, other=0.0)
    k = tl.load(kth_ptr + r, mask=live, other=0.0)
    fresh = (level == 0) & (dev == 0)  # the request's first update: level <- kth, dev <- 0
    new_dev = tl.where(fresh, 0.0, tl.abs(k - level) * _A_NEW + dev * _A_OLD)
    new_level = tl.where(fresh, k, k * _A_NEW + level * _A_OLD)
    thr = tl.where(margin > 0, new_level + new_dev * margin, new_level)  # not 0 * inf
    tl.store(ema_ptr + _THR * n_ema + key, thr, mask=live)
    tl.store(ema_ptr + _LEVEL * n_ema + key, new_level, mask=live)
    tl.store(ema_ptr + _DEV * n_ema + key, new_dev, mask=live)


def ema_update_cuda(ema, kth, seq_lens, block_table, margin: float) -> None:
    """``prefetch_layout.update_ema`` in one launch, bit for bit (no FMA contraction: every
    product is rounded as torch rounds it). Of live rows that share a first page (an n > 1
    group) only the first writes it, as in the reference, so no two lanes store to one entry;
    padded rows leave the dump column as it was, as the reference does."""
    B = seq_lens.shape[0]
    _ema_kernel[(1,)](
        ema, kth, seq_lens, block_table, block_table.stride(0), B, ema.shape[1], float(margin),
        BP=max(2, triton.next_power_of_2(B)), num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip


@triton.jit
def _clear_kernel(stage_host, hstage, h2g, stage_ctr, pf_stats, n_stage, n_ctr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """After the recall: count the staged rows and the promoted ones (staged rows now on the
    GPU), empty the staging buffer; program 0 also resets the claim counters and counts the
    step. A host slot staged twice (two requests sharing a page) is counted once: only one
    exchange on host_stage sees its entry."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(stage_host + offs, mask=offs < n_stage, other=-1)
    live = h >= 0
    old = tl.atomic_xchg(hstage + h, tl.full([BLOCK], -1, tl.int32), mask=live, sem="relaxed")
    first = live & (old >= 0)
    g = tl.load(h2g + h, mask=first, other=-1)
    tl.store(stage_host + offs, tl.full([BLOCK], -1, tl.int32), mask=live)
    staged = tl.sum(live.to(tl.int64), 0)
    promoted = tl.sum((first & (g >= 0)).to(tl.int64), 0)
    tl.atomic_add(pf_stats + _S_STAGED, staged, mask=staged > 0, sem="relaxed")
    tl.atomic_add(pf_stats + _S_PROMOTED, promoted, mask=promoted > 0, sem="relaxed")
    if pid == 0:
        for start in range(0, n_ctr, BLOCK):
            c = start + tl.arange(0, BLOCK)
            tl.store(stage_ctr + c, tl.zeros([BLOCK], tl.int32), mask=c < n_ctr)
        tl.atomic_add(pf_stats + _S_STEPS, staged * 0 + 1, sem="relaxed")


def clear(stage_host, host_stage, host_to_gpu, stage_ctr, pf_stats) -> None:
    """The launch that empties the staging buffer after the recall (``_clear_kernel``)."""
    n_stage = stage_host.shape[0]
    _clear_kernel[(max(1, triton.cdiv(n_stage, LIST_BLOCK)),)](
        stage_host, host_stage, host_to_gpu, stage_ctr, pf_stats, n_stage, stage_ctr.shape[0],
        BLOCK=LIST_BLOCK, num_warps=4,
    )  # fmt: skip


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
    pf_stats,
):
    """echo::recall (one launch, or four with cache_kernels.FUSED off), the copy reading staged
    misses from staging, then ``clear``."""
    from custom_ops import cache_kernels

    out = cache_kernels.recall_cuda(
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
        stage_kv=stage_kv,
        host_stage=host_stage,
    )
    clear(stage_host, host_stage, host_to_gpu, stage_ctr, pf_stats)
    return out
