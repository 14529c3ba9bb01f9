"""Lossless prefetch (ECHO's second half, docs/prefetch.md): ``echo::indexer_topk_prefetch`` and
``echo::recall_staged``, with their pure-torch references (the CPU kernels and the specification
the Triton kernels in prefetch_scores.py / prefetch_kernels.py are tested against).

``indexer_topk_prefetch`` is ``echo::indexer_topk`` (same outputs, bit for bit) that also, while
scoring, copies the rows of candidates into a per-layer **staging buffer**: a candidate is a live
token whose score is strictly above its request's threshold and whose host slot is not
on the GPU (``host_to_gpu[h] == -1``). Two caps, chosen by ``ratio``:
- ``ratio == 0``: per request, at most ``cap`` rows; request b owns staging slots
  ``[b * cap, (b + 1) * cap)`` (ECHO's shipped kernel, cap 64);
- ``ratio > 0``: one global budget of ``min(S, floor(ratio * sum(seq_lens)))`` rows, first come
  (the paper: a counter proportional to the context, as the scoring time is).
Which candidates win when a cap binds is scan order in the reference (request-major, then
position) and atomics order in the kernel: either way only performance depends on it. A staged row
is recorded in ``stage_host[slot] = h`` and ``host_stage[h] = slot``. Then the exact top-k, then
the threshold update for live requests (in-graph, ``prefetch_layout.update_ema``): the level is
ECHO's EMA (alpha 0.5) of the exact k-th score, the deviation an EMA of how far the k-th score
moved, and the next threshold is ``level + margin * dev`` (margin 0: ECHO's). The state lives
in ``ema [EMA_ROWS, N_H / 64 + 1]``, a column per request keyed by its first host page
(``ema_keys``).

``recall_staged`` is ``echo::recall`` with staging as a second source: the same lookup, eviction
and placement (staged rows still count as misses, so the pool evicts exactly what a recall
without prefetch would: prefetch never changes the pool's policy), and the attended set is the
exact top-k whatever was staged; only the bytes of a staged miss come from staging (GPU -> GPU)
instead of over PCIe. Then the staging buffer is emptied (``clear_staging``).

Statistics (``pf_stats`` int64, cumulative, read between steps): candidates, rows staged, staged
rows promoted into the pool (staged and selected and missed), steps.
"""

from __future__ import annotations

import torch

from custom_ops.cache_ref import recall_ref
from custom_ops.indexer import _check as _check_indexer
from custom_ops.indexer import indexer_topk_ref
from custom_ops.kv_format import PAGE, index_cache_gather
from custom_ops.prefetch_layout import (  # noqa: F401  (also read as prefetch.PF_*, EMA_*)
    EMA_ALPHA,
    EMA_DEV,
    EMA_LEVEL,
    EMA_ROWS,
    EMA_THR,
    PF_CANDIDATES,
    PF_LEN,
    PF_PROMOTED,
    PF_STAGED,
    PF_STEPS,
    ema_keys,
    threshold,
    update_ema,
)


def index_scores_ref(q_fp8, weights, index_cache, block_table, seq_lens):
    """(score [B, L] fp32, -inf past seq_len; host slot [B, L] int64) as indexer_topk_ref."""
    B, P = block_table.shape
    L = P * PAGE
    t = torch.arange(L, device=q_fp8.device)
    slots = block_table[:, t // PAGE].long() * PAGE + (t % PAGE)  # [B, L]
    k, k_scale = index_cache_gather(index_cache, slots)  # [B, L, 128], [B, L]
    logits = torch.einsum("bhd,btd->bht", q_fp8.view(torch.float8_e4m3fn).float(), k)
    score = (logits.relu() * weights.float()[:, :, None]).sum(dim=1) * k_scale  # [B, L]
    valid = t[None, :] < seq_lens[:, None].long()
    return torch.where(valid, score, torch.full_like(score, float("-inf"))), slots


def stage_limit(seq_lens: torch.Tensor, n_stage: int, ratio: float) -> torch.Tensor:
    """The global budget (ratio > 0): min(S, floor(ratio * sum(seq_lens))), a device scalar."""
    total = seq_lens.long().sum().double() * ratio
    return torch.clamp(torch.floor(total), max=n_stage).long()


def stage_ref(
    score,
    slots,
    seq_lens,
    host_kv,
    host_to_gpu,
    stage_kv,
    stage_host,
    host_stage,
    ema,
    pf_stats,
    cap: int,
    ratio: float,
) -> None:
    """The prefetch decision and copies of indexer_topk_prefetch (scan order when a cap binds)."""
    B, L = score.shape
    S = stage_kv.shape[0]
    thr = ema[EMA_THR, ema_keys(slots[:, :1] // PAGE, seq_lens, ema.shape[1])][:, None]
    g = host_to_gpu[slots.clamp(max=host_to_gpu.shape[0] - 1)]
    cand = torch.isfinite(score) & (score > thr) & (g < 0)  # -inf past seq_len is never > thr
    pf_stats[PF_CANDIDATES] += int(cand.sum())
    if ratio > 0:
        limit = int(stage_limit(seq_lens, S, ratio))
        hs = slots[cand][:limit]  # request-major, then position
        st = torch.arange(hs.numel(), device=score.device)
    else:
        rank = torch.cumsum(cand.long(), dim=1) - 1
        keep = cand & (rank < cap)
        hs = slots[keep]
        st = (torch.arange(B, device=score.device)[:, None] * cap + rank)[keep]
    stage_kv[st] = host_kv[hs].to(stage_kv.device)
    stage_host[st] = hs.to(torch.int32)
    host_stage[hs] = st.to(torch.int32)


def indexer_topk_prefetch_ref(
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
    score, slots = index_scores_ref(q_fp8, weights, index_cache, block_table, seq_lens)
    stage_ref(
        score,
        slots,
        seq_lens,
        host_kv,
        host_to_gpu,
        stage_kv,
        stage_host,
        host_stage,
        ema,
        pf_stats,
        cap,
        ratio,
    )
    host, kth = indexer_topk_ref(q_fp8, weights, index_cache, block_table, seq_lens, topk)
    update_ema(ema, kth, seq_lens, block_table, margin)
    return host, kth


def clear_staging(stage_host, host_stage, host_to_gpu, stage_ctr, pf_stats) -> None:
    """After the recall: count the staged rows and the promoted ones (staged rows now on the GPU:
    a staged row was not on the GPU when staged, so it is there now only because the recall
    selected and placed it, from staging), then empty the staging buffer."""
    live = stage_host >= 0
    h = stage_host[live].long()
    pf_stats[PF_STAGED] += int(live.sum())
    pf_stats[PF_PROMOTED] += int((host_to_gpu[torch.unique(h)] >= 0).sum())
    pf_stats[PF_STEPS] += 1
    host_stage[h] = -1
    stage_host.fill_(-1)
    stage_ctr.zero_()


def recall_staged_ref(
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
    out = recall_ref(
        host_kv,
        gpu_kv,
        gpu_free,
        gpu_priority,
        gpu_to_host,
        host_to_gpu,
        indices,
        miss_host,
        meta,
        stats,
        host_slots,
        stage_kv,
        host_stage,
    )
    clear_staging(stage_host, host_stage, host_to_gpu, stage_ctr, pf_stats)
    return out


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
        ("stage_host", stage_host, torch.int32, S),
        ("host_stage", host_stage, torch.int32, n_h),
        ("pf_stats", pf_stats, torch.int64, PF_LEN),
    ):
        if t.dtype != dt or t.shape != (n,):
            raise ValueError(f"{op}: {name} must be {dt} [{n}], got {t.dtype} {list(t.shape)}")
    if stage_ctr.dtype != torch.int32 or stage_ctr.dim() != 1:
        raise ValueError(f"{op}: stage_ctr must be a 1-D int32 tensor")
    if B is not None:
        if (
            stage_ctr.shape[0] < B + 1
            or ema.dtype != torch.float32
            or ema.shape != (EMA_ROWS, n_h // 64 + 1)
            or not ema.is_contiguous()
        ):
            raise ValueError(
                f"{op}: stage_ctr must hold >= B + 1 = {B + 1} counters and ema a contiguous "
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
    stage_host: torch.Tensor,  # [S] int32: host slot staged in each slot, -1 empty
    host_stage: torch.Tensor,  # [N_H] int32: staging slot of each host slot, -1 none
    stage_ctr: torch.Tensor,  # [>= B + 1] int32 zeros: per-request claims, then the global one
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
        *_STAGING[1:],  # stage_kv is read, not written
        "pf_stats",
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
    """``echo::recall`` (same output and pool semantics) whose staged misses are copied
    GPU -> GPU from staging; empties the staging buffer (module docstring)."""
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
