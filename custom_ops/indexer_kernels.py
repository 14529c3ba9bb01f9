"""Triton kernels of ``echo::indexer_topk`` (the CUDA implementation of ``indexer_topk_ref``).

Two stages, all grids sized from static shapes, live lengths read on the device, no host syncs:

1. ``_scores_kernel`` (grid B x token blocks): for each request, the fp8 q [Hi, 128] against the
   fp8 keys of its past tokens, read page by page through the block table (one ``tl.dot`` per
   ``score_block`` tokens, fp32 accumulate), then ReLU, head weights, the key's scale:
   ``score[b, t] = k_scale[t] * sum_h w[b, h] * relu(q[b, h] . k[t])`` and -inf at t >= seq_len.
   With ``fuse_hist`` it also adds the first radix histogram (top 8 bits of each score's order
   key) to a per-request histogram with integer atomics (counts are exact, whatever the order).
2. Exact top-k by radix select over the order-preserving int32 key of each fp32 score, every
   kernel a grid of B x chunks (a fixed split of each row) reading the scores once:
   ``_hist_kernel``      four passes, one per key byte from the top: the histogram of the byte
                         among the keys whose higher bytes are those of the k-th largest key (known
                         from the earlier passes' histograms); after the fourth, that key (the
                         threshold) and how many of the keys equal to it to take are known;
   ``_count_kernel``     per chunk, the keys above the threshold and equal to it;
   ``_output_kernel``    from every chunk's counts, its output offset and share of the ties (they go
                         to the earlier token); writes the host slots of the selected tokens in
                         ascending position and the -1 padding.
   The work per program does not depend on the scores: many tied or close scores (a whole row of
   equal values) cost what distinct ones do. Everything is integer counting and prefix sums in a
   fixed order: the output is deterministic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE

_NBINS = 256  # 8-bit radix digits: tl.histogram's cost grows with the number of bins
_MIN_KEY = tl.constexpr(-(2**31))  # key of a masked token: below every real score (-inf included)
_MAX_KEY = tl.constexpr(2**31 - 1)  # threshold of an empty request: nothing is above or equal
_PAGE = tl.constexpr(PAGE)
_DIM = tl.constexpr(INDEX_DIM)
_PAGE_BYTES = tl.constexpr(INDEX_PAGE_BYTES)
_SCALE_OFF = tl.constexpr(PAGE * INDEX_DIM // 4)  # page's scales start, in fp32 units (2048)
_PAGE_F32 = tl.constexpr(INDEX_PAGE_BYTES // 4)  # page size in fp32 units (2112)


@dataclass(frozen=True)
class IndexerConfig:
    """Launch shapes. Defaults are the H200 choice; tests use small blocks to cover many chunks."""

    score_block: int = 128  # tokens per tl.dot in the scores kernel (multiple of 16)
    score_tokens: int = 1024  # tokens per program of the scores kernel (multiple of score_block)
    score_warps: int = 4
    score_stages: int = 3
    fuse_hist: bool = False  # first radix histogram inside the scores kernel
    sel_block: int = 2048  # scores per iteration of the selection passes (power of two)
    sel_chunk: int | None = None  # tokens per selection program; None: about 4 programs per SM
    sel_warps: int = 4


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: any value works, this one mirrors the H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def chunks_for(
    B: int, L: int, blk: int, chunk: int | None, device: torch.device
) -> tuple[int, int]:
    """(chunk, n_chunks) of a pass over ``B`` rows of ``L`` scores, ``blk`` per loop iteration,
    from static shapes only: ``chunk`` tokens per program, or about 4 programs per SM."""
    if chunk is not None:
        if chunk % blk:
            raise ValueError(f"chunk {chunk} must be a multiple of the block {blk}")
    else:
        n = max(1, min(triton.cdiv(4 * _sm_count(device), B), triton.cdiv(L, blk)))
        chunk = triton.cdiv(triton.cdiv(L, n), blk) * blk
    return chunk, triton.cdiv(L, chunk)


def _chunking(B: int, L: int, cfg: IndexerConfig, device: torch.device) -> tuple[int, int]:
    """(chunk, n_chunks) of the selection passes."""
    return chunks_for(B, L, cfg.sel_block, cfg.sel_chunk, device)


# ------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _order_key(s):
    """fp32 -> int32 whose signed order is the float order. -0.0 is folded onto +0.0 first: the
    reference's sort sees them equal (a tie, going to the earlier token)."""
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse their magnitude order


@triton.jit
def _key_to_float(key):
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)  # the transform is its own inverse
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _select_bin(h, k):
    """h [256] int32 counts of one radix digit, k >= 1 still to select: the bin holding the k-th
    largest, and the rank (1-based) of the k-th largest inside that bin."""
    idx = tl.arange(0, 256)
    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # elements in bins >= i
    top = tl.max(tl.where(ge >= k, idx, 0), 0)
    above = tl.sum(tl.where(idx > top, h, 0), 0)
    return top, k - above


@triton.jit
def _load_keys(score_ptr, b, L, t, seq_len):
    live = t < seq_len
    s = tl.load(score_ptr + b * L + t, mask=live, other=0.0)
    return tl.where(live, _order_key(s), _MIN_KEY), live


# ------------------------------------------------------------------------------------------------
# stage 1: index scores


@triton.jit
def _scores_kernel(
    q_ptr,  # [B, Hi, 128] uint8 (e4m3 bytes)
    w_ptr,  # [B, Hi] fp32
    kv_ptr,  # [pages, 8448] uint8: the paged indexer cache
    ks_ptr,  # the same memory as fp32 [pages, 2112] (scales)
    bt_ptr,  # [B, P] int32
    sl_ptr,  # [B] int32
    score_ptr,  # [B, L] fp32 out
    hist_ptr,  # [B, 4, 256] int32, pass-1 histogram accumulated into [:, 0] when FUSE_HIST
    n_heads,
    bt_stride,
    L,
    HP: tl.constexpr,  # heads padded to a power of two >= 16 (tl.dot's minimum)
    BT: tl.constexpr,
    TPP: tl.constexpr,
    FUSE_HIST: tl.constexpr,
    STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.program_id(1) * TPP
    seq_len = tl.load(sl_ptr + b)
    hh = tl.arange(0, HP)
    dd = tl.arange(0, _DIM)
    tt = tl.arange(0, BT)
    hm = hh < n_heads
    q = tl.load(q_ptr + (b * n_heads + hh[:, None]) * _DIM + dd[None, :], mask=hm[:, None], other=0)
    q = q.to(tl.float8e4nv, bitcast=True)  # [HP, 128]
    w = tl.load(w_ptr + b * n_heads + hh, mask=hm, other=0.0)  # padded heads weigh 0
    n_live = tl.minimum(tl.maximum(seq_len - start, 0), TPP)
    n_iter = tl.cdiv(n_live, BT)  # blocks holding live tokens; past seq_len nothing is read
    hist = tl.zeros([256], dtype=tl.int32)
    for i in tl.range(0, n_iter, num_stages=STAGES):
        t = start + i * BT + tt
        live = t < seq_len
        page = tl.load(bt_ptr + b * bt_stride + t // _PAGE, mask=live, other=0).to(tl.int64)
        off = t % _PAGE
        # page layout: 64 x 128 e4m3 values, then 64 fp32 scales
        k = tl.load(
            kv_ptr + page[:, None] * _PAGE_BYTES + off[:, None] * _DIM + dd[None, :],
            mask=live[:, None],
            other=0,
        )
        ks = tl.load(ks_ptr + page * _PAGE_F32 + _SCALE_OFF + off, mask=live, other=0.0)
        logits = tl.dot(k.to(tl.float8e4nv, bitcast=True), tl.trans(q))  # [BT, HP] fp32
        # NOTE: ReLU before the head weights (which can be negative), as the reference
        s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * ks
        s = tl.where(live, s, float("-inf"))
        tl.store(score_ptr + b * L + t, s, mask=t < L)
        if FUSE_HIST:
            hist += tl.histogram((_order_key(s) >> 24) + 128, 256, mask=live)
    for i in range(n_iter, TPP // BT):
        t = start + i * BT + tt
        tl.store(score_ptr + b * L + t, tl.full([BT], float("-inf"), tl.float32), mask=t < L)
    if FUSE_HIST:
        bins = tl.arange(0, 256)
        # integer atomics on the few non-empty bins: exact counts whatever the order
        tl.atomic_add(hist_ptr + b * 1024 + bins, hist, mask=hist > 0, sem="relaxed")


# ------------------------------------------------------------------------------------------------
# stage 2: exact top-k


@triton.jit
def _threshold(hist_ptr, b, k):
    """The k-th largest live key of request b (k >= 1) from its four radix histograms, and how
    many of the keys equal to it are selected."""
    bins = tl.arange(0, 256)
    h = hist_ptr + b * 1024 + bins
    top1, k1 = _select_bin(tl.load(h), k)
    top2, k2 = _select_bin(tl.load(h + 256), k1)
    top3, k3 = _select_bin(tl.load(h + 512), k2)
    top4, need = _select_bin(tl.load(h + 768), k3)
    return (((top1 - 128) * 256 + top2) * 256 + top3) * 256 + top4, need


@triton.jit
def _hist_kernel(score_ptr, sl_ptr, hist_ptr, L, topk, CH, PASS: tl.constexpr, BLK: tl.constexpr):
    """Radix pass PASS (1..4): the histogram of key byte PASS (bits 31..24 first) among the live
    keys whose higher bytes equal those of the k-th largest key, known from the earlier passes.
    Accumulated into hist[b, PASS - 1] with integer atomics."""
    b = tl.program_id(0)
    start = tl.program_id(1) * CH
    seq_len = tl.load(sl_ptr + b)
    k = tl.minimum(topk, seq_len)
    bins = tl.arange(0, 256)
    h = hist_ptr + b * 1024 + bins
    prefix = 0  # the higher bytes of the k-th largest key (bits 31..32-8*(PASS-1)), signed
    if PASS >= 2:
        top, k = _select_bin(tl.load(h), k)
        prefix = top - 128
    if PASS >= 3:
        top, k = _select_bin(tl.load(h + 256), k)
        prefix = prefix * 256 + top
    if PASS >= 4:
        top, k = _select_bin(tl.load(h + 512), k)
        prefix = prefix * 256 + top
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), BLK)
    hist = tl.zeros([256], dtype=tl.int32)
    for i in range(n_iter):
        t = start + i * BLK + tl.arange(0, BLK)
        key, live = _load_keys(score_ptr, b, L, t, seq_len)
        if PASS == 1:
            hist += tl.histogram((key >> 24) + 128, 256, mask=live)
        else:
            match = live & ((key >> (40 - 8 * PASS)) == prefix)
            hist += tl.histogram((key >> (32 - 8 * PASS)) & 255, 256, mask=match)
    tl.atomic_add(h + (PASS - 1) * 256, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _count_kernel(score_ptr, sl_ptr, hist_ptr, cnt_ptr, kth_ptr, L, topk, CH, BLK: tl.constexpr):
    """Per chunk, the live keys above the threshold and equal to it; kth of each request."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    start = c * CH
    seq_len = tl.load(sl_ptr + b)
    k = tl.minimum(topk, seq_len)
    tau, _ = _threshold(hist_ptr, b, tl.maximum(k, 1))
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), BLK)
    n_gt = 0
    n_eq = 0
    for i in range(n_iter):
        t = start + i * BLK + tl.arange(0, BLK)
        key, live = _load_keys(score_ptr, b, L, t, seq_len)
        n_gt += tl.sum((live & (key > tau)).to(tl.int32), 0)
        n_eq += tl.sum((live & (key == tau)).to(tl.int32), 0)
    tl.store(cnt_ptr + (b * C + c) * 2, n_gt)
    tl.store(cnt_ptr + (b * C + c) * 2 + 1, n_eq)
    if c == 0:
        tl.store(kth_ptr + b, tl.where(k > 0, _key_to_float(tau), float("-inf")))


@triton.jit
def _output_kernel(
    score_ptr,
    sl_ptr,
    bt_ptr,
    hist_ptr,
    cnt_ptr,
    out_ptr,  # [B, topk] int32 out
    L,
    topk,
    CH,
    bt_stride,
    PADCH,
    CP: tl.constexpr,  # chunks padded to a power of two
    BLK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    start = c * CH
    seq_len = tl.load(sl_ptr + b)
    k = tl.minimum(topk, seq_len)
    tau, need = _threshold(hist_ptr, b, tl.maximum(k, 1))
    # this chunk's output offset and share of the ties (they go to the earlier token), from every
    # chunk's counts in position order
    cc = tl.arange(0, CP)
    cm = cc < C
    n_gt = tl.load(cnt_ptr + (b * C + cc) * 2, mask=cm, other=0)
    n_eq = tl.load(cnt_ptr + (b * C + cc) * 2 + 1, mask=cm, other=0)
    take_all = tl.minimum(tl.maximum(need - (tl.cumsum(n_eq, 0) - n_eq), 0), n_eq)
    sel_all = n_gt + take_all
    off = tl.sum(tl.where(cc < c, sel_all, 0), 0)
    take = tl.where(k > 0, tl.sum(tl.where(cc == c, take_all, 0), 0), 0)
    tau = tl.where(k > 0, tau, _MAX_KEY)  # an empty request selects nothing
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), BLK)
    n_sel = 0
    n_eq = 0
    for i in range(n_iter):
        t = start + i * BLK + tl.arange(0, BLK)
        key, live = _load_keys(score_ptr, b, L, t, seq_len)
        eq = (live & (key == tau)).to(tl.int32)
        rank = n_eq + tl.cumsum(eq, 0) - 1  # among this chunk's ties, in position order
        sel = ((live & (key > tau)) | ((eq > 0) & (rank < take))).to(tl.int32)
        pos = off + n_sel + tl.cumsum(sel, 0) - 1
        page = tl.load(bt_ptr + b * bt_stride + t // _PAGE, mask=sel > 0, other=0)
        tl.store(out_ptr + b * topk + pos, page * _PAGE + t % _PAGE, mask=sel > 0)
        n_sel += tl.sum(sel, 0)
        n_eq += tl.sum(eq, 0)
    # -1 padding of outputs k .. topk, this program's share of them
    lo = c * PADCH
    hi = tl.minimum(lo + PADCH, topk)
    for j0 in range(lo, hi, BLK):
        j = j0 + tl.arange(0, BLK)
        tl.store(out_ptr + b * topk + j, tl.full([BLK], -1, tl.int32), mask=(j >= k) & (j < hi))


# ------------------------------------------------------------------------------------------------
# launchers


def _interpreting(t: torch.Tensor) -> bool:
    return not t.is_cuda  # CPU tensors only reach these launchers under TRITON_INTERPRET=1


def index_scores(
    q_u8: torch.Tensor,  # [B, Hi, 128] uint8
    weights: torch.Tensor,  # [B, Hi] fp32
    index_cache: torch.Tensor,  # [pages, 8448] uint8
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    cfg: IndexerConfig,
    hists: torch.Tensor | None = None,  # [B, 4, 256] int32 zeros: gets the pass-1 histogram
) -> torch.Tensor:
    """Index scores [B, P*64] fp32 (-inf past each request's length)."""
    B, n_heads = q_u8.shape[:2]
    L = block_table.shape[1] * PAGE
    if cfg.score_tokens % cfg.score_block or cfg.score_block % 16:
        raise ValueError("score_tokens must be a multiple of score_block, itself of 16")
    scores = torch.empty((B, L), dtype=torch.float32, device=q_u8.device)
    fuse = hists is not None
    grid = (B, triton.cdiv(L, cfg.score_tokens))
    _scores_kernel[grid](
        q_u8.contiguous(),
        weights.contiguous(),
        index_cache,
        index_cache.view(torch.float32),
        block_table,
        seq_lens,
        scores,
        hists if fuse else scores,  # unused when not fused
        n_heads,
        block_table.stride(0),
        L,
        HP=max(16, triton.next_power_of_2(n_heads)),
        BT=cfg.score_block,
        TPP=cfg.score_tokens,
        FUSE_HIST=fuse,
        STAGES=cfg.score_stages,
        num_warps=cfg.score_warps,
    )
    return scores


def topk_from_scores(
    scores: torch.Tensor,  # [B, L] fp32, L = P*64
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    topk: int,
    cfg: IndexerConfig,
    hists: torch.Tensor | None = None,  # [B, 4, 256] zeros but pass 1 done, or None: run it here
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of each row's first seq_len scores, as ``indexer_topk_ref`` selects them:
    host slots ascending by position (-1 padded) and the lowest selected score."""
    B, L = scores.shape
    dev = scores.device
    chunk, C = _chunking(B, L, cfg, dev)
    blk, warps = cfg.sel_block, cfg.sel_warps
    first = 2  # the radix pass to start from
    if hists is None:
        hists = torch.zeros((B, 4, _NBINS), dtype=torch.int32, device=dev)
        first = 1
    for p in range(first, 5):
        _hist_kernel[(B, C)](
            scores, seq_lens, hists, L, topk, chunk, PASS=p, BLK=blk, num_warps=warps
        )
    cnt = torch.empty((B, C, 2), dtype=torch.int32, device=dev)
    kth = torch.empty((B,), dtype=torch.float32, device=dev)
    _count_kernel[(B, C)](
        scores, seq_lens, hists, cnt, kth, L, topk, chunk, BLK=blk, num_warps=warps
    )
    out = torch.empty((B, topk), dtype=torch.int32, device=dev)
    _output_kernel[(B, C)](
        scores, seq_lens, block_table, hists, cnt, out, L, topk, chunk, block_table.stride(0),
        triton.cdiv(topk, C), CP=triton.next_power_of_2(C), BLK=blk, num_warps=warps,
    )  # fmt: skip
    return out, kth


def indexer_topk_cuda(
    q_u8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    cfg: IndexerConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``echo::indexer_topk`` on the GPU (or on CPU tensors under TRITON_INTERPRET=1):
    (host slots int32 [B, topk], kth fp32 [B]), the semantics of ``indexer_topk_ref``."""
    cfg = cfg or IndexerConfig()
    if q_u8.dtype != torch.uint8 or q_u8.dim() != 3 or q_u8.shape[-1] != INDEX_DIM:
        raise ValueError("indexer_topk_cuda: q must be uint8 [B, Hi, 128] (e4m3 bytes)")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("indexer_topk_cuda: block_table and seq_lens must be int32")
    if not index_cache.is_contiguous() or index_cache.shape[-1] != INDEX_PAGE_BYTES:
        raise ValueError(
            f"indexer_topk_cuda: index cache must be contiguous [pages, {INDEX_PAGE_BYTES}]"
        )
    if not _interpreting(q_u8) and not (index_cache.is_cuda and block_table.is_cuda):
        raise ValueError("indexer_topk_cuda: all tensors must be on the GPU")
    if topk <= 0:
        raise ValueError(f"indexer_topk_cuda: topk must be positive, got {topk}")
    B = q_u8.shape[0]
    hists = None
    if cfg.fuse_hist:
        hists = torch.zeros((B, 4, _NBINS), dtype=torch.int32, device=q_u8.device)
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    scores = index_scores(q_u8, weights, index_cache, block_table, seq_lens, cfg, hists)
    return topk_from_scores(scores, block_table, seq_lens, topk, cfg, hists)
