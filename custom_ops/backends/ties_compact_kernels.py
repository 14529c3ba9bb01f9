"""The tie fix-up's "v3" kernels: the scores read about once instead of v2's twice.

Same result as v1 / v2 (``ties.threshold_select_ref``). kth as in v2 (its own launch, or found in
the first pass: ``ties_fast_kernels._row_kth``), then:

``_compact_kernel`` (grid B x chunks): per chunk, the live scores above kth and equal to it are
counted (as v2's count pass), and the positions of those above kth listed in position order
(the first min(topk, chunk): an entry at list index >= topk never reaches the output).
``_emit_kernel`` (grid B x chunks): the chunk's output offset and tie quota from every chunk's
counts (``ties_fast_kernels._chunk_share``). A chunk that takes no ties (on scores with few
ties, all but the one holding the k-th value; with many, all but the first few) copies its
list, ``off + list index``, as host slots; a chunk that takes ties runs v2's output pass over
its scores. Then the -1 padding. Graph-safe (static grids and buffers), deterministic (position
order only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.backends.ties_config import FixupConfig
from custom_ops.backends.ties_fast_kernels import (
    _CP_MIN,
    _block_2d,
    _chunk_share,
    _pad,
    _row_kth,
    chunking,
)
from custom_ops.kv_format import PAGE

_PAGE = tl.constexpr(PAGE)
_LIST_BLOCK = 256  # list entries per loop iteration of the emit pass


@triton.jit
def _compact_kernel(
    score_ptr, sl_ptr, raw_ptr, kth_ptr, cnt_ptr, list_ptr, W, topk, CH, LCAP,
    ROWS: tl.constexpr, FOLD: tl.constexpr, KP: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    start = c * CH
    seq_len = tl.load(sl_ptr + b)
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), ROWS * _PAGE)
    kth = _row_kth(score_ptr, raw_ptr, kth_ptr, b, c, n_iter, W, topk, FOLD, KP)
    row_list = list_ptr + (b * C + c) * LCAP
    r = tl.arange(0, ROWS)
    col = tl.arange(0, _PAGE)
    n_gt = 0
    n_eq = 0
    for i in range(n_iter):
        t = start + i * (ROWS * _PAGE) + r[:, None] * _PAGE + col[None, :]
        live = t < seq_len
        s = tl.load(score_ptr + b * W + t, mask=t < W, other=float("-inf"))  # t < W: vector loads
        gt = (live & (s > kth)).to(tl.int32)
        eq = (live & (s == kth)).to(tl.int32)
        tot = tl.sum(tl.sum(gt | (eq << 16), 1), 0)
        blk_gt = tot & 0xFFFF
        if SKIP:
            go = (blk_gt > 0) & (n_gt < LCAP)
        else:
            go = blk_gt >= 0
        if go:
            row_g = tl.sum(gt, 1)
            j = n_gt + tl.cumsum(gt, 1) + (tl.cumsum(row_g, 0) - row_g)[:, None] - 1
            tl.store(row_list + j, t, mask=(gt > 0) & (j < LCAP))
        n_gt += blk_gt
        n_eq += tot >> 16
    tl.store(cnt_ptr + (b * C + c) * 2, n_gt)
    tl.store(cnt_ptr + (b * C + c) * 2 + 1, n_eq)


@triton.jit(do_not_specialize=["bt_stride", "PADCH"])
def _emit_kernel(
    score_ptr, sl_ptr, bt_ptr, kth_ptr, cnt_ptr, list_ptr, out_ptr, W, topk, CH, bt_stride,
    PADCH, LCAP,
    CP: tl.constexpr, LB: tl.constexpr, ROWS: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    seq_len = tl.load(sl_ptr + b)
    k = tl.minimum(topk, seq_len)
    off, take, tot_sel = _chunk_share(cnt_ptr, b, c, C, k, CP)
    row_out = out_ptr + b * topk
    if take == 0:  # only scores above kth: the list, in order
        n_list = tl.minimum(tl.load(cnt_ptr + (b * C + c) * 2), LCAP)
        row_list = list_ptr + (b * C + c) * LCAP
        for j0 in range(0, n_list, LB):
            j = j0 + tl.arange(0, LB)
            ok = j < n_list
            pos = tl.load(row_list + j, mask=ok, other=0)
            page = tl.load(bt_ptr + b * bt_stride + pos // _PAGE, mask=ok, other=0)
            tl.store(row_out + off + j, page * _PAGE + pos % _PAGE, mask=ok & (off + j < k))
    else:  # the chunk takes ties: v2's output pass over its scores
        kth = tl.load(kth_ptr + b)
        start = c * CH
        n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), ROWS * _PAGE)
        n_sel = 0
        n_eq_seen = 0
        for i in range(n_iter):
            q = tl.maximum(take - n_eq_seen, 0)
            blk_sel, blk_eq = _block_2d(
                score_ptr, bt_ptr, row_out, b, W, bt_stride, seq_len, k, kth,
                start + i * (ROWS * _PAGE), q, off + n_sel, ROWS, True, SKIP,
            )  # fmt: skip
            n_sel += blk_sel
            n_eq_seen += blk_eq
    _pad(row_out, c, PADCH, topk, tot_sel, LB)


def select(
    scores: torch.Tensor,  # [B, W] fp32 contiguous
    block_table: torch.Tensor,  # [B, P] int32, stride(1) == 1
    seq_lens: torch.Tensor,  # [B] int32
    topk: int,
    cfg: FixupConfig,
    kth: torch.Tensor | None = None,  # [B] fp32, or
    raw: torch.Tensor | None = None,  # [B, topk] int32 library positions (-1 = none)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ties_fast_kernels.select`` with the v3 passes (cfg.tile is implied: whole pages)."""
    B, W = scores.shape
    dev = scores.device
    fold = kth is None
    if fold:
        if raw is None:
            raise ValueError("select: needs kth or the library's positions raw")
        kth = torch.empty((B,), dtype=torch.float32, device=dev)
    chunk, C = chunking(B, W, cfg, dev)
    lcap = min(topk, chunk)
    cnt = torch.empty((B, C, 2), dtype=torch.int32, device=dev)
    lists = torch.empty((B, C, lcap), dtype=torch.int32, device=dev)
    rows = cfg.block // PAGE
    _compact_kernel[(B, C)](
        scores, seq_lens, raw if fold else seq_lens, kth, cnt, lists, W, topk, chunk, lcap,
        ROWS=rows, FOLD=fold, KP=triton.next_power_of_2(topk) if fold else 16, SKIP=cfg.skip,
        num_warps=cfg.warps,
    )  # fmt: skip
    out = torch.empty((B, topk), dtype=torch.int32, device=dev)
    _emit_kernel[(B, C)](
        scores, seq_lens, block_table, kth, cnt, lists, out, W, topk, chunk,
        block_table.stride(0), triton.cdiv(topk, C), lcap,
        CP=max(_CP_MIN, triton.next_power_of_2(C)), LB=_LIST_BLOCK, ROWS=rows, SKIP=cfg.skip,
        num_warps=cfg.warps,
    )  # fmt: skip
    return out, kth
