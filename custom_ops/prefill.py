"""Sparse prefill ops: the indexer's exact top-k for every query of a prefill chunk, and MLA
attention in the absorbed form over each query's own selection (docs/model_notes.md, prefill).

``echo::prefill_indexer_topk``: for query q at absolute position p = positions[q] of the request
whose pages are ``block_table[0]``, the decode indexer's score over its causal prefix t <= p,

    score[q, t] = k_scale[t] * sum_h weights[q, h] * ReLU(sum_d q[q, h, d] * k[t, d])

(the formula and operation order of ``custom_ops.indexer.indexer_topk_ref``), then the top
``min(topk, p + 1)`` tokens by score, ties to the earlier token: exactly what ``echo::indexer_topk``
selects for a request of p + 1 tokens. The output lists token POSITIONS (not host slots) in
ascending order, -1 padded: prefill attends over the request's own rows, indexed by position. The
work is done a block of queries at a time, so ``[T, L]`` fp32 scores never exist for a whole chunk
(``score_rows`` bounds the block). Two separable steps: ``prefill_index_logits_ref`` (scores) and
``prefill_topk_from_scores_ref`` (selection), so a library backend can replace either: with
``logits_backend="deep_gemm"`` the CUDA kernel computes the scores with DeepGEMM's
``fp8_mqa_logits`` (custom_ops/backends/deep_gemm_prefill.py; 32 or 64 index heads, else Triton).

``echo::sparse_mla_prefill``: ``echo::sparse_mla_decode``'s semantics with the T queries of a chunk
as its rows, each over its own selected rows of ``rows [L, row]`` (the request's context, by
position): same form, same numerics (on the GPU the prefill kernel of
custom_ops/prefill_attn_kernels.py: the decode kernel's loop, one program per query and head block).
"""

from __future__ import annotations

import torch

from custom_ops.attention import sparse_mla_decode_ref
from custom_ops.fp8 import FP8_DTYPE
from custom_ops.kv_format import KV_LORA, PAGE, ROPE, ROW_BYTES, check_fmt, index_cache_gather

# fp32 scores of one query block are at most this many elements (CUDA: 128 MB)
SCORE_ELEMS = 1 << 25
# the reference's attention gathers [block, topk, 576] fp32 rows: bound its block
ATTN_REF_ELEMS = 1 << 24


def score_rows(L: int, T: int, budget: int = SCORE_ELEMS) -> int:
    """Queries per block so that a block's ``[rows, L]`` fp32 scores stay within ``budget``
    elements (a multiple of 16, at least 16, at most T). From static shapes only."""
    rows = max(16, budget // max(L, 1) // 16 * 16)
    return max(1, min(T, rows))


def prefill_index_logits_ref(
    q_fp8: torch.Tensor,  # [Q, Hi, 128] uint8 (e4m3 bytes)
    weights: torch.Tensor,  # [Q, Hi] fp32
    index_cache: torch.Tensor,  # [pages, 8448] uint8
    block_table: torch.Tensor,  # [1, P] int32
    positions: torch.Tensor,  # [Q] int64
) -> torch.Tensor:
    """Index scores ``[Q, P*64]`` fp32 of each query over the request's tokens, -inf at t > p."""
    L = block_table.shape[1] * PAGE
    t = torch.arange(L, device=q_fp8.device)
    slots = block_table[0, t // PAGE].long() * PAGE + t % PAGE  # [L] host slots
    k, k_scale = index_cache_gather(index_cache, slots)  # [L, 128], [L]
    logits = torch.einsum("qhd,td->qht", q_fp8.view(FP8_DTYPE).float(), k)  # [Q, Hi, L]
    score = (logits.relu() * weights.float()[:, :, None]).sum(dim=1) * k_scale  # [Q, L]
    causal = t[None, :] <= positions[:, None]
    return torch.where(causal, score, torch.full_like(score, float("-inf")))


def prefill_topk_from_scores_ref(
    score: torch.Tensor,  # [Q, L] fp32, -inf past each query's position
    positions: torch.Tensor,  # [Q] int64
    topk: int,
) -> torch.Tensor:
    """Token positions int32 ``[Q, topk]``: the top ``min(topk, p + 1)`` of each row (ties to the
    earlier token), ascending, -1 padded (``indexer_topk_ref``'s selection, by position)."""
    Q, L = score.shape
    K = min(topk, L)
    order = torch.sort(-score, dim=1, stable=True).indices[:, :K]  # [Q, K] best first
    n_sel = (positions.long() + 1).clamp(max=K)  # [Q]
    chosen = torch.arange(K, device=score.device)[None, :] < n_sel[:, None]
    pos = torch.sort(torch.where(chosen, order, L), dim=1).values  # ascending, pad = L
    out = torch.where(pos < L, pos, -1).to(torch.int32)
    if K < topk:
        out = torch.cat([out, out.new_full((Q, topk - K), -1)], dim=1)
    return out


def prefill_indexer_topk_ref(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    T, H = q_fp8.shape[:2]
    # the reference holds [block, H, L] fp32 logits: bound that (a quarter of the kernel's budget)
    qb = score_rows(block_table.shape[1] * PAGE * max(H, 1), T, SCORE_ELEMS // 4)
    outs = []
    for s in range(0, T, qb):  # static bounds: shapes only
        e = min(T, s + qb)
        score = prefill_index_logits_ref(
            q_fp8[s:e], weights[s:e], index_cache, block_table, positions[s:e]
        )
        outs.append(prefill_topk_from_scores_ref(score, positions[s:e], topk))
    if not outs:
        return q_fp8.new_empty((0, topk), dtype=torch.int32)
    return torch.cat(outs)


# who computes step (a), the scores, on CUDA (custom_ops/backends/select.py ``prefill_plan``
# decides from static shapes): our Triton kernel or DeepGEMM's ``fp8_mqa_logits``; the CPU kernel
# is the reference for either
LOGITS_BACKENDS = ("triton", "deep_gemm")


def _check_indexer(
    q_fp8, weights, index_cache, block_table, positions, topk, logits_backend="triton"
) -> None:
    if logits_backend not in LOGITS_BACKENDS:
        raise ValueError(
            f"prefill_indexer_topk: logits_backend must be one of {', '.join(LOGITS_BACKENDS)}, "
            f"got {logits_backend!r}"
        )
    if q_fp8.dim() != 3 or q_fp8.shape[-1] != 128 or q_fp8.dtype != torch.uint8:
        raise ValueError(
            "prefill_indexer_topk: q must be the e4m3 bytes as uint8 [T, H, 128], got "
            f"{q_fp8.dtype} {list(q_fp8.shape)}"
        )
    T, H = q_fp8.shape[:2]
    if weights.shape != (T, H) or weights.dtype != torch.float32:
        raise ValueError(
            f"prefill_indexer_topk: weights must be fp32 [{T}, {H}], got "
            f"{weights.dtype} {list(weights.shape)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != 1 or block_table.dtype != torch.int32:
        raise ValueError(
            "prefill_indexer_topk: block_table must be int32 [1, P] (one request), got "
            f"{block_table.dtype} {list(block_table.shape)}"
        )
    if positions.shape != (T,) or positions.dtype != torch.int64:
        raise ValueError(f"prefill_indexer_topk: positions must be int64 [{T}]")
    if (
        index_cache.dtype != torch.uint8
        or index_cache.dim() != 2
        or index_cache.shape[1] != PAGE * 132
    ):
        raise ValueError(f"prefill_indexer_topk: index cache must be uint8 [pages, {PAGE * 132}]")
    if topk <= 0:
        raise ValueError(f"prefill_indexer_topk: topk must be positive, got {topk}")


@torch.library.custom_op("echo::prefill_indexer_topk", mutates_args=())
def prefill_indexer_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    logits_backend: str = "triton",
) -> torch.Tensor:
    """Default kernel (CPU): the reference (whatever ``logits_backend`` says)."""
    _check_indexer(q_fp8, weights, index_cache, block_table, positions, topk, logits_backend)
    return prefill_indexer_topk_ref(q_fp8, weights, index_cache, block_table, positions, topk)


@prefill_indexer_topk.register_kernel("cuda")
def _(q_fp8, weights, index_cache, block_table, positions, topk, logits_backend="triton"):
    _check_indexer(q_fp8, weights, index_cache, block_table, positions, topk, logits_backend)
    from custom_ops import prefill_kernels  # Triton: imported on the first CUDA call

    return prefill_kernels.prefill_indexer_topk_cuda(
        q_fp8, weights, index_cache, block_table, positions, topk, logits_backend=logits_backend
    )


@prefill_indexer_topk.register_fake
def _(q_fp8, weights, index_cache, block_table, positions, topk, logits_backend="triton"):
    return q_fp8.new_empty((q_fp8.shape[0], topk), dtype=torch.int32)


def sparse_mla_prefill_ref(
    q: torch.Tensor,  # [T, H, 576] bf16
    rows: torch.Tensor,  # [L, row] uint8: the request's rows by position
    sel: torch.Tensor,  # [T, K] int32 positions, -1 = unused
    softmax_scale: float,
    fmt: str,
) -> torch.Tensor:
    """``sparse_mla_decode_ref`` with the queries as its batch rows, a block of them at a time."""
    T, K = sel.shape
    qb = max(1, min(T, ATTN_REF_ELEMS // max(K * (KV_LORA + ROPE), 1)))
    outs = [
        sparse_mla_decode_ref(q[s : s + qb], rows, sel[s : s + qb], softmax_scale, fmt)
        for s in range(0, T, qb)
    ]
    return torch.cat(outs) if outs else q.new_empty((0, q.shape[1], KV_LORA))


def _check_attn(q, rows, sel, fmt) -> None:
    check_fmt(fmt)
    if q.dim() != 3 or q.shape[-1] != KV_LORA + ROPE or q.dtype != torch.bfloat16:
        raise ValueError(
            f"sparse_mla_prefill: q must be bf16 [T, H, 576], got {q.dtype} {list(q.shape)}"
        )
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != ROW_BYTES[fmt]:
        raise ValueError(f"sparse_mla_prefill: rows must be uint8 [L, {ROW_BYTES[fmt]}] for {fmt}")
    if sel.dim() != 2 or sel.shape[0] != q.shape[0] or sel.dtype != torch.int32:
        raise ValueError(f"sparse_mla_prefill: sel must be int32 [T={q.shape[0]}, K]")


@torch.library.custom_op("echo::sparse_mla_prefill", mutates_args=())
def sparse_mla_prefill(
    q: torch.Tensor, rows: torch.Tensor, sel: torch.Tensor, softmax_scale: float, fmt: str
) -> torch.Tensor:
    """Default kernel (CPU): the reference."""
    _check_attn(q, rows, sel, fmt)
    return sparse_mla_prefill_ref(q, rows, sel, softmax_scale, fmt)


@sparse_mla_prefill.register_kernel("cuda")
def _(q, rows, sel, softmax_scale, fmt):
    _check_attn(q, rows, sel, fmt)
    from custom_ops import prefill_kernels  # Triton: imported on the first CUDA call

    return prefill_kernels.sparse_mla_prefill_cuda(q, rows, sel, softmax_scale, fmt)


@sparse_mla_prefill.register_fake
def _(q, rows, sel, softmax_scale, fmt):
    return q.new_empty((q.shape[0], q.shape[1], KV_LORA))
