"""The tie fix-up's "v2" kernels (``ties_config``: why they are cut this way).

Same result as ``ties_kernels``' v1 (``ties.threshold_select_ref``): every live score above kth,
then the earliest live scores equal to it until min(topk, seq_len), as host slots in ascending
position, -1 padded. Two launches (three without ``fold_kth``: ``ties_kernels._kth_kernel``
first), grids from static shapes, live lengths read on the device, no host syncs, and an output
order that depends only on positions (deterministic).

``_count_kernel`` (grid B x chunks): per chunk, the live scores above kth and equal to it.
``_output_kernel`` (grid B x chunks): its output offset and tie quota from every chunk's counts,
then per block of scores one scan of ``gt | eq << 16``: the low half counts the scores above kth
so far, the high half the ties; the ties this block takes are the first ``q`` of them, so a
selected score lands at ``off + cum_gt + min(cum_eq, q) - 1``. 16 bits hold a block of <= 16384
without carrying into the high half (which stays below 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.backends.ties_config import FixupConfig
from custom_ops.indexer_kernels import _sm_count
from custom_ops.kv_format import PAGE

_PAGE = tl.constexpr(PAGE)
_CP_MIN = 64  # chunk counts read per program, padded: one compile for every C <= 64


@triton.jit
def _row_kth(
    score_ptr, raw_ptr, kth_ptr, b, c, n_iter, W, topk, FOLD: tl.constexpr, KP: tl.constexpr
):
    """Row b's kth: read (``FOLD`` off), or found here as the lowest score at the library's k
    positions (mostly L2 hits: the library just read them); then a program with nothing to
    scan skips the gathers, and chunk 0 stores kth for the next pass and the caller."""
    if FOLD:
        n_raw = tl.where((n_iter > 0) | (c == 0), topk, 0)
        j = tl.arange(0, KP)
        raw = tl.load(raw_ptr + b * topk + j, mask=j < n_raw, other=-1)
        ok = raw >= 0
        v = tl.load(score_ptr + b * W + raw, mask=ok, other=float("inf"))
        m = tl.min(tl.where(ok, v, float("inf")), 0)
        kth = tl.where(tl.sum(ok.to(tl.int32), 0) > 0, m, float("-inf"))
        tl.store(kth_ptr + b, kth, mask=c == 0)
    else:
        kth = tl.load(kth_ptr + b)
    return kth


@triton.jit
def _count_kernel(
    score_ptr, sl_ptr, raw_ptr, kth_ptr, cnt_ptr, W, topk, CH,
    BLK: tl.constexpr, FOLD: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    start = c * CH
    seq_len = tl.load(sl_ptr + b)
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), BLK)
    kth = _row_kth(score_ptr, raw_ptr, kth_ptr, b, c, n_iter, W, topk, FOLD, KP)
    n_gt = 0
    n_eq = 0
    for i in range(n_iter):
        t = start + i * BLK + tl.arange(0, BLK)
        live = t < seq_len
        s = tl.load(score_ptr + b * W + t, mask=t < W, other=float("-inf"))  # t < W: vector loads
        p = tl.sum((live & (s > kth)).to(tl.int32) | ((live & (s == kth)).to(tl.int32) << 16), 0)
        n_gt += p & 0xFFFF
        n_eq += p >> 16
    tl.store(cnt_ptr + (b * C + c) * 2, n_gt)
    tl.store(cnt_ptr + (b * C + c) * 2 + 1, n_eq)


@triton.jit
def _block_1d(
    score_ptr, bt_ptr, row_out, b, W, bt_stride, seq_len, k, kth, t0, q, base,
    BLK: tl.constexpr, PACKED: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    """The BLK scores from t0: their selected host slots stored from output index ``base`` (q:
    the ties this block may take, its first ones); returns (selected, ties seen)."""
    t = t0 + tl.arange(0, BLK)
    live = t < seq_len
    s = tl.load(score_ptr + b * W + t, mask=t < W, other=float("-inf"))  # t < W: vector loads
    page = tl.load(bt_ptr + b * bt_stride + t // _PAGE, mask=live, other=0)  # with the scores
    gt = (live & (s > kth)).to(tl.int32)
    eq = (live & (s == kth)).to(tl.int32)
    p = gt | (eq << 16)
    tot = tl.sum(p, 0)
    blk_sel = (tot & 0xFFFF) + tl.minimum(tot >> 16, q)
    if SKIP:
        go = blk_sel > 0
    else:
        go = blk_sel >= 0
    if go:
        if PACKED:
            cs = tl.cumsum(p, 0)
            cg = cs & 0xFFFF
            ce = cs >> 16
        else:
            cg = tl.cumsum(gt, 0)
            ce = tl.cumsum(eq, 0)
        sel = (gt > 0) | ((eq > 0) & (ce <= q))
        pos = base + cg + tl.minimum(ce, q) - 1
        tl.store(row_out + pos, page * _PAGE + t % _PAGE, mask=sel & (pos < k))
    return blk_sel, tot >> 16


@triton.jit
def _block_2d(
    score_ptr, bt_ptr, row_out, b, W, bt_stride, seq_len, k, kth, t0, q, base,
    ROWS: tl.constexpr, PACKED: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    """``_block_1d`` on the block as a [ROWS, 64] tile, one page per row (t0 is a multiple of
    64): one block-table load per page instead of one per score, and the scan as a scan along
    the rows plus a scan of the row totals."""
    r = tl.arange(0, ROWS)
    col = tl.arange(0, _PAGE)
    t = t0 + r[:, None] * _PAGE + col[None, :]
    live = t < seq_len
    s = tl.load(score_ptr + b * W + t, mask=t < W, other=float("-inf"))  # t < W: vector loads
    pg_live = t0 + r * _PAGE < seq_len
    page = tl.load(bt_ptr + b * bt_stride + t0 // _PAGE + r, mask=pg_live, other=0)
    gt = (live & (s > kth)).to(tl.int32)
    eq = (live & (s == kth)).to(tl.int32)
    p = gt | (eq << 16)
    row = tl.sum(p, 1)
    tot = tl.sum(row, 0)
    blk_sel = (tot & 0xFFFF) + tl.minimum(tot >> 16, q)
    if SKIP:
        go = blk_sel > 0
    else:
        go = blk_sel >= 0
    if go:
        if PACKED:
            cs = tl.cumsum(p, 1) + (tl.cumsum(row, 0) - row)[:, None]
            cg = cs & 0xFFFF
            ce = cs >> 16
        else:
            row_g = tl.sum(gt, 1)
            row_e = tl.sum(eq, 1)
            cg = tl.cumsum(gt, 1) + (tl.cumsum(row_g, 0) - row_g)[:, None]
            ce = tl.cumsum(eq, 1) + (tl.cumsum(row_e, 0) - row_e)[:, None]
        sel = (gt > 0) | ((eq > 0) & (ce <= q))
        pos = base + cg + tl.minimum(ce, q) - 1
        slot = page[:, None] * _PAGE + col[None, :]
        tl.store(row_out + pos, slot, mask=sel & (pos < k))
    return blk_sel, tot >> 16


@triton.jit(do_not_specialize=["bt_stride", "PADCH"])
def _output_kernel(
    score_ptr,
    sl_ptr,
    bt_ptr,
    kth_ptr,
    cnt_ptr,
    out_ptr,  # [B, topk] int32
    W,
    topk,
    CH,
    bt_stride,
    PADCH,
    CP: tl.constexpr,  # chunks padded to a power of two
    BLK: tl.constexpr,
    PACKED: tl.constexpr,
    SKIP: tl.constexpr,
    REVERSE: tl.constexpr,
    TILE: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    if REVERSE:  # the count pass read these last: start here, while they are in L2
        b = tl.num_programs(0) - 1 - b
        c = C - 1 - c
    start = c * CH
    seq_len = tl.load(sl_ptr + b)
    k = tl.minimum(topk, seq_len)
    kth = tl.load(kth_ptr + b)
    off, take, tot_sel = _chunk_share(cnt_ptr, b, c, C, k, CP)
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), BLK)
    n_sel = 0
    n_eq_seen = 0
    for i in range(n_iter):
        t0 = start + i * BLK
        q = tl.maximum(take - n_eq_seen, 0)  # ties this block may still take, the first ones
        row_out = out_ptr + b * topk
        base = off + n_sel
        if TILE:
            blk_sel, blk_eq = _block_2d(
                score_ptr, bt_ptr, row_out, b, W, bt_stride, seq_len, k, kth, t0, q, base,
                BLK // _PAGE, PACKED, SKIP,
            )  # fmt: skip
        else:
            blk_sel, blk_eq = _block_1d(
                score_ptr, bt_ptr, row_out, b, W, bt_stride, seq_len, k, kth, t0, q, base,
                BLK, PACKED, SKIP,
            )  # fmt: skip
        n_sel += blk_sel
        n_eq_seen += blk_eq
    _pad(out_ptr + b * topk, c, PADCH, topk, tot_sel, BLK)


@triton.jit
def _chunk_share(cnt_ptr, b, c, C, k, CP: tl.constexpr):
    """From every chunk's (above kth, equal) counts of row b: chunk c's output offset, the ties
    it takes (the earliest ties of the row are taken first), and what the row selects in all."""
    cc = tl.arange(0, CP)
    cm = cc < C
    n_gt = tl.load(cnt_ptr + (b * C + cc) * 2, mask=cm, other=0)
    n_eq = tl.load(cnt_ptr + (b * C + cc) * 2 + 1, mask=cm, other=0)
    need = k - tl.sum(n_gt, 0)  # ties to take, the earliest first
    take_all = tl.minimum(tl.maximum(need - (tl.cumsum(n_eq, 0) - n_eq), 0), n_eq)
    off = tl.sum(tl.where(cc < c, n_gt + take_all, 0), 0)
    take = tl.sum(tl.where(cc == c, take_all, 0), 0)
    tot_sel = tl.minimum(tl.sum(tl.where(cm, n_gt + take_all, 0), 0), k)
    return off, take, tot_sel


@triton.jit
def _pad(row_out, c, PADCH, topk, tot_sel, BLK: tl.constexpr):
    """-1 past what the row selects (k when kth is the true k-th value; fewer when it is not, a
    NaN among a library's scores, and those entries must not stay unwritten): chunk c writes
    its PADCH share of the row."""
    lo = c * PADCH
    hi = tl.minimum(lo + PADCH, topk)
    for j0 in range(lo, hi, BLK):
        j = j0 + tl.arange(0, BLK)
        tl.store(row_out + j, tl.full([BLK], -1, tl.int32), mask=(j >= tot_sel) & (j < hi))


def chunking(B: int, W: int, cfg: FixupConfig, device: torch.device) -> tuple[int, int]:
    """(chunk, n_chunks) from static shapes: cfg.chunk, or about cfg.progs_per_sm programs per SM
    (a short row gets fewer, never a program without a block)."""
    if cfg.chunk is not None:
        chunk = cfg.chunk
    else:
        n = max(
            1, min(triton.cdiv(cfg.progs_per_sm * _sm_count(device), B), triton.cdiv(W, cfg.block))
        )
        chunk = triton.cdiv(triton.cdiv(W, n), cfg.block) * cfg.block
    return chunk, triton.cdiv(W, chunk)


def folds_kth(B: int, W: int, cfg: FixupConfig, device: torch.device) -> bool:
    """Whether the count pass finds kth itself (``cfg.fold_kth``; None: at most one program per
    SM, so at most SMs x topk gathers)."""
    if cfg.fold_kth is not None:
        return cfg.fold_kth
    return B * chunking(B, W, cfg, device)[1] <= _sm_count(device)


def select(
    scores: torch.Tensor,  # [B, W] fp32 contiguous
    block_table: torch.Tensor,  # [B, P] int32, stride(1) == 1
    seq_lens: torch.Tensor,  # [B] int32
    topk: int,
    cfg: FixupConfig,
    kth: torch.Tensor | None = None,  # [B] fp32, or
    raw: torch.Tensor | None = None,  # [B, topk] int32 library positions (-1 = none)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(host slots int32 [B, topk], kth fp32 [B]), from ``kth``, or with ``kth`` None from
    ``raw``: kth found in the count pass (callers: ``ties_kernels.fixup``, which checks)."""
    B, W = scores.shape
    dev = scores.device
    fold = kth is None
    if fold:
        if raw is None:
            raise ValueError("select: needs kth or the library's positions raw")
        kth = torch.empty((B,), dtype=torch.float32, device=dev)
    chunk, C = chunking(B, W, cfg, dev)
    cnt = torch.empty((B, C, 2), dtype=torch.int32, device=dev)
    _count_kernel[(B, C)](
        scores, seq_lens, raw if fold else seq_lens, kth, cnt, W, topk, chunk,
        BLK=cfg.block, FOLD=fold, KP=triton.next_power_of_2(topk) if fold else 16,
        num_warps=cfg.warps,
    )  # fmt: skip
    out = torch.empty((B, topk), dtype=torch.int32, device=dev)
    _output_kernel[(B, C)](
        scores, seq_lens, block_table, kth, cnt, out, W, topk, chunk, block_table.stride(0),
        triton.cdiv(topk, C), CP=max(_CP_MIN, triton.next_power_of_2(C)), BLK=cfg.block,
        PACKED=cfg.packed, SKIP=cfg.skip, REVERSE=cfg.reverse, TILE=cfg.tile, num_warps=cfg.warps,
    )  # fmt: skip
    return out, kth
