"""Triton side of the sparse prefill ops (custom_ops/prefill.py): the CUDA implementations of
``prefill_indexer_topk_ref`` and ``sparse_mla_prefill_ref``.

Indexer: the chunk's queries go a block of ``score_rows`` at a time (bounded ``[rows, L]`` fp32
scores), each block in two separable steps:
1. ``_logits_kernel`` (grid query tiles x token tiles): a program holds BLOCK_T fp8 keys of the
   request (read page by page through its block table, loaded ONCE for BLOCK_Q queries) and, head
   by head, ``[BLOCK_Q, 128] x [128, BLOCK_T]`` fp8 dots on the tensor cores with fp32
   accumulation, then ReLU, the head weight, the key's scale; -inf past each query's position. A
   tile wholly past the block's last position only writes -inf (the causal upper triangle costs no
   reads and no math): a compiled prefill's block table spans max_model_len, so this is what
   keeps a short prompt cheap under a long context limit.
2. The decode indexer's exact radix select (``indexer_kernels.topk_from_scores``) with each
   query's causal length ``p + 1`` as its seq_len and an identity block table (page i -> i, the
   same row for every query: stride 0), so it returns token positions: same selection rule, same
   ties, same -1 padding, deterministic.
With ``logits_backend="deep_gemm"`` (32 or 64 index heads) step 1 is DeepGEMM's
``fp8_mqa_logits`` over the request's keys gathered once per call
(custom_ops/backends/deep_gemm_prefill_kernels.py), rows ``prefill_logits_width(L)`` wide.
Attention: custom_ops/prefill_attn_kernels.py (one program per query and head block, the decode
kernel's loop without splits, FP8 rows dequantised once per call, trailing unused entries
skipped); ``sparse_mla_prefill_decode_kernel`` keeps the earlier path (the decode kernel, the
T queries as its batch rows) for the bench's side-by-side.
All grids from static shapes, live lengths read on the device: no host syncs, graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from custom_ops import attention_kernels as ak
from custom_ops import indexer_kernels as ik
from custom_ops import prefill_attn_kernels as pa
from custom_ops.backends.deep_gemm_ops import HEADS, prefill_logits_width
from custom_ops.backends.deep_gemm_prefill_kernels import (
    gather_index_keys,
    num_sms,
    prefill_scores,
    query_rows,
)
from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE

_PAGE = tl.constexpr(PAGE)
_DIM = tl.constexpr(INDEX_DIM)
_PAGE_BYTES = tl.constexpr(INDEX_PAGE_BYTES)
_SCALE_OFF = tl.constexpr(PAGE * INDEX_DIM // 4)  # a page's scales start, in fp32 units
_PAGE_F32 = tl.constexpr(INDEX_PAGE_BYTES // 4)


def score_rows(L: int, T: int, budget: int) -> int:
    """Queries per block so that a block's ``[rows, L]`` fp32 scores stay within ``budget``
    elements (a multiple of 16, at least 16, at most T). From static shapes only. (The same rule
    as custom_ops.prefill.score_rows: the op module imports this one lazily, not the reverse.)"""
    rows = max(16, budget // max(L, 1) // 16 * 16)
    return max(1, min(T, rows))


@dataclass(frozen=True)
class PrefillIndexerConfig:
    """Launch shapes. Defaults: the fastest of the four logits configs timed side by side on the
    H200 (``python -m benchmarks.bench_prefill``, 32K context, 2048-query chunk: 0.77 ms, 689
    TFLOP/s, against 1.09 ms for 128 x 128 / 8 warps / 2 stages; identical scores); tests use
    small ones."""

    block_q: int = 64  # queries per program (tl.dot M; multiple of 16)
    block_t: int = 128  # tokens per program (tl.dot N; multiple of 16, divides or is 64k)
    num_warps: int = 4
    num_stages: int = 3  # pipelining of the per-head q loads
    score_elems: int = 1 << 25  # fp32 scores of one query block (128 MB; bounds its rows)
    select: ik.IndexerConfig = ik.IndexerConfig()  # the radix select's launch shapes
    # one select program per query even when a block has fewer than 4 per SM (long contexts):
    # five passes instead of six, fewer programs (bench_prefill times both at a 100K shape)
    select_one_per_row: bool = False


@triton.jit
def _logits_kernel(
    q_ptr,  # [Q, Hi, 128] uint8 (e4m3 bytes)
    w_ptr,  # [Q, Hi] fp32
    kv_ptr,  # [pages, 8448] uint8: the paged indexer cache
    ks_ptr,  # the same memory as fp32 (scales)
    bt_ptr,  # [P] int32: the request's pages
    pos_ptr,  # [Q] int64
    score_ptr,  # [Q, L] fp32 out
    Q,
    L,
    n_heads,
    BQ: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
):
    _logits_tile(
        tl.program_id(0), tl.program_id(1), q_ptr, w_ptr, kv_ptr, ks_ptr, bt_ptr, pos_ptr,
        score_ptr, Q, L, n_heads, BQ, BT, STAGES,
    )  # fmt: skip


@triton.jit
def _logits_tile(
    q_tile, t_tile, q_ptr, w_ptr, kv_ptr, ks_ptr, bt_ptr, pos_ptr, score_ptr, Q, L, n_heads,
    BQ: tl.constexpr, BT: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """One ``[BQ, BT]`` tile of scores (``_logits_kernel``'s arguments; also called by the fused
    gather kernel of custom_ops/prefill_gather_kernels.py)."""
    qq = q_tile * BQ + tl.arange(0, BQ)
    tt = t_tile * BT + tl.arange(0, BT)
    qm = qq < Q
    tm = tt < L
    pos = tl.load(pos_ptr + qq, mask=qm, other=-1)  # padded query rows see nothing
    p_max = tl.max(pos, 0)
    out = score_ptr + qq[:, None].to(tl.int64) * L + tt[None, :]
    om = qm[:, None] & tm[None, :]
    if t_tile * BT <= p_max:
        dd = tl.arange(0, _DIM)
        live = tm & (tt <= p_max)
        page = tl.load(bt_ptr + tt // _PAGE, mask=live, other=0).to(tl.int64)
        off = tt % _PAGE
        k = tl.load(
            kv_ptr + page[:, None] * _PAGE_BYTES + off[:, None] * _DIM + dd[None, :],
            mask=live[:, None],
            other=0,
        ).to(tl.float8e4nv, bitcast=True)  # [BT, 128]
        ks = tl.load(ks_ptr + page * _PAGE_F32 + _SCALE_OFF + off, mask=live, other=0.0)
        kt = tl.trans(k)  # [128, BT]
        acc = tl.zeros([BQ, BT], tl.float32)
        q_row = q_ptr + qq[:, None].to(tl.int64) * (n_heads * _DIM) + dd[None, :]
        for h in tl.range(0, n_heads, num_stages=STAGES):
            qh = tl.load(q_row + h * _DIM, mask=qm[:, None], other=0)
            wh = tl.load(w_ptr + qq * n_heads + h, mask=qm, other=0.0)  # [BQ]
            logits = tl.dot(qh.to(tl.float8e4nv, bitcast=True), kt)  # [BQ, BT] fp32
            acc += tl.maximum(logits, 0.0) * wh[:, None]
        s = acc * ks[None, :]
        s = tl.where(tt[None, :] <= pos[:, None], s, float("-inf"))
        tl.store(out, s, mask=om)
    else:
        tl.store(out, tl.full([BQ, BT], float("-inf"), tl.float32), mask=om)


def prefill_index_logits(
    q_fp8: torch.Tensor,  # [Q, Hi, 128] uint8 (e4m3 bytes)
    weights: torch.Tensor,  # [Q, Hi] fp32
    index_cache: torch.Tensor,  # [pages, 8448] uint8
    block_table: torch.Tensor,  # [1, P] int32
    positions: torch.Tensor,  # [Q] int64
    cfg: PrefillIndexerConfig | None = None,
) -> torch.Tensor:
    """Scores ``[Q, P*64]`` fp32, ``prefill_index_logits_ref``'s semantics (fp32 rounding aside)."""
    cfg = cfg or PrefillIndexerConfig()
    if cfg.block_q % 16 or cfg.block_t % 16:
        raise ValueError("PrefillIndexerConfig: block_q and block_t must be multiples of 16")
    Q, n_heads = q_fp8.shape[:2]
    L = block_table.shape[1] * PAGE
    scores = torch.empty((Q, L), dtype=torch.float32, device=q_fp8.device)
    if Q == 0:
        return scores
    grid = (triton.cdiv(Q, cfg.block_q), triton.cdiv(L, cfg.block_t))
    _logits_kernel[grid](
        q_fp8.contiguous(), weights.contiguous(), index_cache, index_cache.view(torch.float32),
        block_table[0].contiguous(), positions.contiguous(), scores, Q, L, n_heads,
        BQ=cfg.block_q, BT=cfg.block_t, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    return scores


def prefill_topk_from_scores(
    scores: torch.Tensor,  # [Q, L] fp32
    positions: torch.Tensor,  # [Q] int64
    topk: int,
    cfg: PrefillIndexerConfig | None = None,
) -> torch.Tensor:
    """``prefill_topk_from_scores_ref`` by the decode indexer's radix select: positions int32
    ``[Q, topk]``, ascending, -1 padded."""
    cfg = cfg or PrefillIndexerConfig()
    Q, L = scores.shape
    # identity pages, one row shared by every query (stride 0): the "host slot" is the position
    ident = torch.arange(L // PAGE, dtype=torch.int32, device=scores.device)[None].expand(Q, -1)
    seq_lens = (positions + 1).clamp(min=0, max=L).to(torch.int32)
    sc = cfg.select
    if cfg.select_one_per_row and sc.sel_chunk is None:
        sc = replace(sc, sel_chunk=triton.cdiv(max(L, 1), sc.sel_block) * sc.sel_block)
    chunk, C = ik._chunking(Q, L, sc, scores.device)
    if C > 1:
        sel, _kth = ik.topk_from_scores(scores, ident, seq_lens, topk, sc)
        return sel
    return _select_one_chunk(scores, ident, seq_lens, topk, sc, chunk)


def _select_one_chunk(scores, ident, seq_lens, topk, sc: ik.IndexerConfig, chunk: int):
    """``ik.topk_from_scores`` when one program covers each row (a prefill block has hundreds
    of rows, so this is the usual case): the four radix passes and the output pass, without the
    count pass. That pass gives each chunk its output offset and its share of the ties; with one
    chunk the offset is 0 and the share is all ``need`` ties still to take, which is what the
    output pass computes from counts saying ``topk`` are equal (``need <= topk``: taken whole).
    Same selection, one pass over the scores fewer (and no kth, which prefill drops)."""
    Q, L = scores.shape
    dev = scores.device
    blk, warps = sc.sel_block, sc.sel_warps
    hists = torch.zeros((Q, 4, ik._NBINS), dtype=torch.int32, device=dev)
    for p in range(1, 5):
        ik._hist_kernel[(Q, 1)](
            scores, seq_lens, hists, L, topk, chunk, PASS=p, BLK=blk, num_warps=warps
        )
    # counts (above, equal) of the one chunk: only "equal >= need" matters with one chunk (no
    # later chunk's offset to give); a fill, not a host tensor: graph-safe
    cnt = torch.full((Q, 2), topk, dtype=torch.int32, device=dev)
    out = torch.empty((Q, topk), dtype=torch.int32, device=dev)
    ik._output_kernel[(Q, 1)](
        scores, seq_lens, ident, hists, cnt, out, L, topk, chunk, ident.stride(0), topk,
        CP=1, BLK=blk, num_warps=warps,
    )  # fmt: skip
    return out


def check_cuda_inputs(where, q_fp8, index_cache, block_table, positions, logits_backend) -> None:
    """What the CUDA indexer needs beyond the op's own checks (custom_ops/prefill.py)."""
    if logits_backend not in ("triton", "deep_gemm"):  # the two the CUDA kernels dispatch to
        raise ValueError(
            f"{where}: logits_backend must be 'triton' or 'deep_gemm', got {logits_backend!r}"
        )
    if not index_cache.is_contiguous() or index_cache.shape[-1] != INDEX_PAGE_BYTES:
        raise ValueError(f"{where}: index cache must be contiguous [pages, {INDEX_PAGE_BYTES}]")
    if q_fp8.is_cuda and not (index_cache.is_cuda and block_table.is_cuda and positions.is_cuda):
        raise ValueError(f"{where}: all tensors must be on the GPU")


def prefill_indexer_topk_cuda(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    cfg: PrefillIndexerConfig | None = None,
    logits_backend: str = "triton",
) -> torch.Tensor:
    """``echo::prefill_indexer_topk`` on the GPU (or on CPU tensors under TRITON_INTERPRET=1).
    ``logits_backend="deep_gemm"``: step (a) by DeepGEMM where it takes the head count (a static
    shape), else Triton."""
    cfg = cfg or PrefillIndexerConfig()
    check_cuda_inputs("prefill_indexer_topk_cuda", q_fp8, index_cache, block_table, positions,
                      logits_backend)  # fmt: skip
    if logits_backend == "deep_gemm" and q_fp8.shape[1] in HEADS:
        return _indexer_topk_deep_gemm(
            q_fp8, weights, index_cache, block_table, positions, topk, cfg
        )
    T = q_fp8.shape[0]
    L = block_table.shape[1] * PAGE
    qb = score_rows(L, T, cfg.score_elems)
    out = torch.empty((T, topk), dtype=torch.int32, device=q_fp8.device)
    for s in range(0, T, qb):  # static bounds: shapes only
        e = min(T, s + qb)
        scores = prefill_index_logits(
            q_fp8[s:e], weights[s:e], index_cache, block_table, positions[s:e], cfg
        )
        out[s:e] = prefill_topk_from_scores(scores, positions[s:e], topk, cfg)
    return out


def _indexer_topk_deep_gemm(q_fp8, weights, index_cache, block_table, positions, topk, cfg):
    """Step (a) by DeepGEMM over the request's keys gathered once per call, in query blocks
    that fill whole waves of its persistent grid (``query_rows``), step (b) as on the Triton
    path. The scores past each p are left unwritten (no clean-up pass): the radix select
    reads t < p + 1 only."""
    T = q_fp8.shape[0]
    W = prefill_logits_width(block_table.shape[1] * PAGE)
    kv, sf = gather_index_keys(index_cache, block_table)
    qb = query_rows(W, T, cfg.score_elems, q_fp8.shape[1], num_sms())
    out = torch.empty((T, topk), dtype=torch.int32, device=q_fp8.device)
    for s in range(0, T, qb):  # static bounds: shapes only
        e = min(T, s + qb)
        scores = prefill_scores(q_fp8[s:e], weights[s:e], kv, sf, positions[s:e], W, False)
        out[s:e] = prefill_topk_from_scores(scores, positions[s:e], topk, cfg)
    return out


def sparse_mla_prefill_cuda(
    q: torch.Tensor,  # [T, H, 576] bf16
    rows: torch.Tensor,  # [L, row] uint8
    sel: torch.Tensor,  # [T, K] int32 positions, -1 = unused
    softmax_scale: float,
    fmt: str,
    cfg: pa.PrefillAttnConfig | None = None,
) -> torch.Tensor:
    """``echo::sparse_mla_prefill`` on the GPU: the prefill attention kernel."""
    return pa.sparse_mla_prefill_attn(q, rows, sel, softmax_scale, fmt, cfg)


def sparse_mla_prefill_decode_kernel(
    q: torch.Tensor,
    rows: torch.Tensor,
    sel: torch.Tensor,
    softmax_scale: float,
    fmt: str,
    cfg: ak.MlaConfig | None = None,
) -> torch.Tensor:
    """The earlier CUDA path: the decode kernel, the T queries as its batch rows (the bench
    times it next to the prefill kernel)."""
    return ak.sparse_mla_decode_cuda(q, rows, sel, softmax_scale, fmt, cfg)
