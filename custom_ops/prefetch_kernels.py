"""CUDA implementations of the prefetch ops (semantics and references in
custom_ops/prefetch_ref.py).

- ``indexer_topk_prefetch_cuda``: a fused scores + staging kernel (the variants of
  prefetch_scores.py), the unchanged exact top-k, the in-graph EMA update (``_ema_kernel``: one
  launch where the torch expression of ``update_ema`` took about ten small ones; it also
  writes the next step's thresholds, level + margin x dev, and ends the step's staging: the
  claim counters back to 0, the epoch word advanced to the epoch the staged rows are tagged with,
  one more step counted).
- ``recall_staged_cuda``: ``echo::recall``'s launches with staging as the copy's second source
  (a miss staged in the current epoch is read GPU -> GPU and counted as promoted). Nothing runs
  after it: the next staging call's tags carry the next epoch, so this step's entries need no
  clearing.
Static grids, live counts read on the device, no host syncs: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import indexer_kernels as ik
from custom_ops.prefetch_layout import EMA_ALPHA, EMA_DEV, EMA_LEVEL, EMA_THR, PF_STEPS
from custom_ops.prefetch_scores import scores_variant

# staged rows per score block at most ("tile"); "post" and "early" give a program rows x TPP / BT
# in all
PF_ROWS = 8
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
    ema_update_cuda(ema, kth, seq_lens, block_table, margin, stage_ctr, pf_stats)
    return host, kth


@triton.jit
def _ema_kernel(ema_ptr, kth_ptr, sl_ptr, bt_ptr, bt_stride, B, n_ema, margin, ctr_ptr, n_ctr,
                pfs_ptr, BP: tl.constexpr, END_STAGING: tl.constexpr,
                CTR_BLOCK: tl.constexpr = 128):  # fmt: skip
    if END_STAGING:  # prefetch_ref.end_staging: after the scoring, which claimed and tagged
        for start in range(0, n_ctr - 1, CTR_BLOCK):
            c = start + tl.arange(0, CTR_BLOCK)
            tl.store(ctr_ptr + c, tl.zeros([CTR_BLOCK], tl.int32), mask=c < n_ctr - 1)
        tl.store(ctr_ptr + n_ctr - 1, tl.load(ctr_ptr + n_ctr - 1) + 1)
        tl.atomic_add(pfs_ptr + _S_STEPS, 1, sem="relaxed")
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


def ema_update_cuda(ema, kth, seq_lens, block_table, margin: float, stage_ctr=None,
                    pf_stats=None) -> None:  # fmt: skip
    """``prefetch_layout.update_ema`` in one launch, bit for bit (no FMA contraction: every
    product is rounded as torch rounds it). Of live rows that share a first page (an n > 1
    group) only the first writes it, as in the reference, so no two lanes store to one entry;
    padded rows leave the dump column as it was, as the reference does. With ``stage_ctr`` and
    ``pf_stats`` the same launch ends the step's staging (``prefetch_ref.end_staging``): it runs
    after the scoring kernel, so no claim or tag of this step can follow it."""
    B = seq_lens.shape[0]
    end = stage_ctr is not None
    _ema_kernel[(1,)](
        ema, kth, seq_lens, block_table, block_table.stride(0), B, ema.shape[1], float(margin),
        stage_ctr if end else seq_lens, stage_ctr.shape[0] if end else 0,
        pf_stats if end else ema, BP=max(2, triton.next_power_of_2(B)), END_STAGING=end,
        num_warps=1, enable_fp_fusion=False,
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
    """echo::recall (one launch, or four with cache_kernels.FUSED off), the copy reading the
    misses staged in the current epoch from staging and counting them (PF_PROMOTED)."""
    from custom_ops import cache_kernels

    return cache_kernels.recall_cuda(
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
        stage_host=stage_host,
        stage_ctr=stage_ctr,
        pf_stats=pf_stats,
    )
