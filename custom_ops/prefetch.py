"""The lossless prefetch ops' registrations (``echo::indexer_topk_prefetch``,
``echo::recall_staged``; ECHO's second half, docs/prefetch.md) and their input checks. The
semantics and the pure-torch references (every op's default kernel, and the specification its
Triton kernel is tested against) are in prefetch_ref.py; the statistics layout and the threshold
update in prefetch_layout.py; the CUDA launchers in prefetch_kernels.py.
"""

from __future__ import annotations

import torch

from custom_ops.indexer import _check as _check_indexer
from custom_ops.prefetch_layout import EMA_ROWS, PF_LEN
from custom_ops.prefetch_ref import indexer_topk_prefetch_ref, recall_staged_ref


# ---- input checks -------------------------------------------------------------------------------
def _check_staging(
    op,
    host_kv,
    host_to_gpu,
    stage_kv,
    stage_host,
    host_stage,
    stage_ctr,
    pf_stats,
    B: int | None = None,
    ema=None,
    cap: int = 1,
    ratio: float = 0.0,
    margin: float = 0.0,
):
    n_h = host_to_gpu.shape[0]
    if host_kv.dim() != 2 or host_kv.shape[0] != n_h or host_kv.dtype != torch.uint8:
        raise ValueError(
            f"{op}: host_kv must be uint8 [N_H = {n_h}, row], got "
            f"{host_kv.dtype} {list(host_kv.shape)}"
        )
    if stage_kv.dim() != 2 or stage_kv.shape[1] != host_kv.shape[1] or stage_kv.shape[0] < 1:
        raise ValueError(f"{op}: stage_kv must be uint8 [S, {host_kv.shape[1]}]")
    S = stage_kv.shape[0]
    for name, t, dt, n in (
        ("stage_host", stage_host, torch.int64, S),
        ("host_stage", host_stage, torch.int32, n_h),
        ("pf_stats", pf_stats, torch.int64, PF_LEN),
    ):
        if t.dtype != dt or t.shape != (n,):
            raise ValueError(f"{op}: {name} must be {dt} [{n}], got {t.dtype} {list(t.shape)}")
    if stage_ctr.dtype != torch.int32 or stage_ctr.dim() != 1 or stage_ctr.shape[0] < 2:
        raise ValueError(
            f"{op}: stage_ctr must be a 1-D int32 tensor of claim counters and the staging epoch "
            f"(its last word), got {stage_ctr.dtype} {list(stage_ctr.shape)}"
        )
    if B is not None:
        if (
            stage_ctr.shape[0] < B + 2
            or ema.dtype != torch.float32
            or ema.shape != (EMA_ROWS, n_h // 64 + 1)
            or not ema.is_contiguous()
        ):
            raise ValueError(
                f"{op}: stage_ctr must hold >= B + 2 = {B + 2} words and ema a contiguous "
                f"fp32 [{EMA_ROWS}, N_H / 64 + 1 = {n_h // 64 + 1}] (a batch of {B}), got "
                f"stage_ctr {list(stage_ctr.shape)}, ema {ema.dtype} {list(ema.shape)}"
            )
        if not margin >= 0 or margin == float("inf"):
            raise ValueError(f"{op}: margin must be a finite number >= 0, got {margin!r}")
        if ratio < 0 or (ratio == 0 and (cap <= 0 or B * cap > S)):
            raise ValueError(
                f"{op}: need ratio > 0 (global budget) or 0 < cap with B * cap <= "
                f"S (got cap={cap}, ratio={ratio}, B={B}, S={S})"
            )


def _check_prefetch(
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
):
    _check_indexer(q_fp8, weights, index_cache, block_table, seq_lens, topk)
    _check_staging(
        "indexer_topk_prefetch",
        host_kv,
        host_to_gpu,
        stage_kv,
        stage_host,
        host_stage,
        stage_ctr,
        pf_stats,
        q_fp8.shape[0],
        ema,
        cap,
        ratio,
        margin,
    )


def _check_recall_staged(
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
    from custom_ops.cache_ops import _check_recall

    _check_recall(
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
    _check_staging(
        "recall_staged", host_kv, host_to_gpu, stage_kv, stage_host, host_stage, stage_ctr, pf_stats
    )


# ---- registrations ------------------------------------------------------------------------------
_STAGING = ("stage_kv", "stage_host", "host_stage", "stage_ctr")


@torch.library.custom_op("echo::indexer_topk_prefetch", mutates_args=(*_STAGING, "ema", "pf_stats"))
def indexer_topk_prefetch(
    q_fp8: torch.Tensor,  # [B, Hi, 128] uint8 (e4m3 bytes)
    weights: torch.Tensor,  # [B, Hi] fp32
    index_cache: torch.Tensor,  # [pages, 8448] uint8
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    topk: int,
    host_kv: torch.Tensor,  # [N_H, row] uint8 (UVA view of pinned memory on CUDA)
    host_to_gpu: torch.Tensor,  # [N_H] int32: the layer's pool map (read only)
    stage_kv: torch.Tensor,  # [S, row] uint8: staging rows
    stage_host: torch.Tensor,  # [S] int64: tag epoch << 32 | h of each slot, -1 never staged
    host_stage: torch.Tensor,  # [N_H] int32: staging slot of each host slot, -1 none
    stage_ctr: torch.Tensor,  # [>= B + 2] int32: claims per request, the global one, ..., epoch
    ema: torch.Tensor,  # [EMA_ROWS, N_H / 64 + 1] fp32: threshold, level, dev (prefetch_layout)
    pf_stats: torch.Tensor,  # [PF_LEN] int64
    cap: int,  # rows per request (ratio == 0)
    ratio: float,  # > 0: global budget of ratio * sum(seq_lens) rows
    margin: float,  # next thresholds: level + margin * dev (update_ema)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``echo::indexer_topk`` plus staging of candidates above the threshold (module docstring)."""
    args = (
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
    )
    _check_prefetch(*args)
    return indexer_topk_prefetch_ref(*args)


@indexer_topk_prefetch.register_kernel("cuda")
def _(*args):
    _check_prefetch(*args)
    from custom_ops import prefetch_kernels  # Triton: imported on the first CUDA call

    return prefetch_kernels.indexer_topk_prefetch_cuda(*args)


@indexer_topk_prefetch.register_fake
def _(q_fp8, weights, *rest):
    B, topk = q_fp8.shape[0], rest[3]
    return (
        q_fp8.new_empty((B, topk), dtype=torch.int32),
        q_fp8.new_empty((B,), dtype=torch.float32),
    )


@torch.library.custom_op(
    "echo::recall_staged",
    mutates_args=(
        "gpu_kv",
        "gpu_free",
        "gpu_priority",
        "gpu_to_host",
        "host_to_gpu",
        "indices",
        "miss_host",
        "meta",
        "hist",
        "stats",
        "pf_stats",  # (the staging state is read, not written: stale entries fail their tags)
    ),
)
def recall_staged(
    host_kv: torch.Tensor,
    gpu_kv: torch.Tensor,
    gpu_free: torch.Tensor,
    gpu_priority: torch.Tensor,
    gpu_to_host: torch.Tensor,
    host_to_gpu: torch.Tensor,
    indices: torch.Tensor,
    miss_host: torch.Tensor,
    meta: torch.Tensor,
    hist: torch.Tensor,
    stats: torch.Tensor,
    host_slots: torch.Tensor,  # [B, k] int32 selected host slots, -1 padded
    stage_kv: torch.Tensor,
    stage_host: torch.Tensor,
    host_stage: torch.Tensor,
    stage_ctr: torch.Tensor,
    pf_stats: torch.Tensor,
) -> torch.Tensor:
    """``echo::recall`` (same output and pool semantics) whose misses staged in the current
    epoch are copied GPU -> GPU from staging (prefetch_ref's module docstring)."""
    args = (
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
    )
    _check_recall_staged(*args)
    return recall_staged_ref(*args)


@recall_staged.register_kernel("cuda")
def _(*args):
    _check_recall_staged(*args)
    from custom_ops import prefetch_kernels

    return prefetch_kernels.recall_staged_cuda(*args)


@recall_staged.register_fake
def _(*args):
    return torch.empty_like(args[11])
