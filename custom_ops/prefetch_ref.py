"""The pure-torch references of the lossless prefetch ops (ECHO's second half,
docs/prefetch.md; registered in prefetch.py): ``echo::indexer_topk_prefetch`` and
``echo::recall_staged``. Each is its op's default kernel (CPU) and the specification its Triton
kernel (prefetch_scores.py / prefetch_kernels.py) is tested against. The statistics layout and
the threshold update are in prefetch_layout.py.

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
is recorded in ``stage_host[slot] = (E + 1) << 32 | h`` (a tag: E is the staging epoch, the last
word of ``stage_ctr``; prefetch_layout) and ``host_stage[h] = slot``. Then the exact top-k, then
the threshold update for live requests (in-graph, ``prefetch_layout.update_ema``): the level is
ECHO's EMA (alpha 0.5) of the exact k-th score, the deviation an EMA of how far the k-th score
moved, and the next threshold is ``level + margin * dev`` (margin 0: ECHO's). The state lives
in ``ema [EMA_ROWS, N_H / 64 + 1]``, a column per request keyed by its first host page
(``ema_keys``). Last, the step's staging ends (``end_staging``): the claim counters back to 0
and the epoch word to E + 1, so exactly this call's tags are live.

``recall_staged`` is ``echo::recall`` with staging as a second source: the same lookup, eviction
and placement (staged rows still count as misses, so the pool evicts exactly what a recall
without prefetch would: prefetch never changes the pool's policy), and the attended set is the
exact top-k whatever was staged; only the bytes of a staged miss come from staging (GPU -> GPU)
instead of over PCIe. A miss h is staged iff ``host_stage[h]`` is a slot whose tag is h's in the
current epoch (``prefetch_layout.staged_source``). Nothing is emptied after it: the next staging
call's tags carry the next epoch, so every entry left from this step (a slot restaged for another
row, a host row rewritten since) fails the tag and is read from the host.

Statistics (``pf_stats`` int64, cumulative, read between steps): candidates, rows staged, staged
rows promoted into the pool (placed misses copied from staging, each host slot once), steps
(staging calls).
"""

from __future__ import annotations

import torch

from custom_ops.cache_ref import recall_ref
from custom_ops.indexer import indexer_topk_ref
from custom_ops.kv_format import PAGE, index_cache_gather
from custom_ops.prefetch_layout import (
    EMA_THR,
    PF_CANDIDATES,
    PF_STAGED,
    PF_STEPS,
    ema_keys,
    stage_tag,
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
    stage_ctr,
    ema,
    pf_stats,
    cap: int,
    ratio: float,
) -> None:
    """The prefetch decision and copies of indexer_topk_prefetch (scan order when a cap binds),
    tagged with the next epoch (the epoch word stage_ctr[-1] + 1)."""
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
    stage_host[st] = stage_tag(stage_ctr[-1] + 1, hs)
    host_stage[hs] = st.to(torch.int32)
    pf_stats[PF_STAGED] += hs.numel()


def end_staging(stage_ctr, pf_stats) -> None:
    """The end of a staging call (after the top-k): the claim counters back to 0, the epoch word
    to the epoch this call tagged its rows with, one more step."""
    stage_ctr[:-1] = 0
    stage_ctr[-1] += 1
    pf_stats[PF_STEPS] += 1


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
        stage_ctr,
        ema,
        pf_stats,
        cap,
        ratio,
    )
    host, kth = indexer_topk_ref(q_fp8, weights, index_cache, block_table, seq_lens, topk)
    update_ema(ema, kth, seq_lens, block_table, margin)
    end_staging(stage_ctr, pf_stats)
    return host, kth


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
    return recall_ref(
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
        stage_host,
        stage_ctr,
        pf_stats,
    )
