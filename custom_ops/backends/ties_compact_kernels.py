"""The tie fix-up's "v3" kernels: one full read of the scores instead of v2's two.

Same result as v1 / v2 (``ties.threshold_select_ref``). kth as in v2 (its own launch, or found in
the first pass: ``ties_fast_kernels._row_kth``), then:

``_compact_kernel`` (grid B x chunks): per chunk, the live scores above kth and equal to it are
counted, and their positions listed in position order (a tie tagged in bit 30), keeping only
the chunk's first topk ties: entry j = (above so far) + min(ties so far, topk) - 1, stored while
j < LCAP = min(2 topk, chunk). That loses nothing: a chunk never takes more than topk ties, and
an entry whose output index is below topk has a list index below 2 topk (its list index exceeds
its output offset within the chunk by at most the topk ties listed).
``_emit_kernel`` (grid B x chunks): the chunk's output offset and tie quota from every chunk's
counts (``ties_fast_kernels._chunk_share``), then its list instead of its scores (about topk /
chunks entries on scores without many ties): a listed score above kth, or one of the quota's
first ties, goes to ``off + above so far + min(ties so far, quota) - 1`` as a host slot; then
the -1 padding. Graph-safe (static grids and buffers), deterministic (position order only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.backends.ties_config import FixupConfig
from custom_ops.backends.ties_fast_kernels import _CP_MIN, _chunk_share, _pad, _row_kth, chunking
from custom_ops.kv_format import PAGE

_PAGE = tl.constexpr(PAGE)
_TIE = tl.constexpr(1 << 30)  # the tag of a tie in a list entry (positions stay below it)
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
        p = gt | (eq << 16)
        row = tl.sum(p, 1)
        tot = tl.sum(row, 0)
        q = tl.maximum(topk - n_eq, 0)  # ties the list may still take, the first ones
        blk_list = (tot & 0xFFFF) + tl.minimum(tot >> 16, q)
        if SKIP:
            go = blk_list > 0
        else:
            go = blk_list >= 0
        if go:
            cs = tl.cumsum(p, 1) + (tl.cumsum(row, 0) - row)[:, None]
            cg = cs & 0xFFFF
            ce = cs >> 16
            keep = (gt > 0) | ((eq > 0) & (ce <= q))
            j = n_gt + tl.minimum(n_eq, topk) + cg + tl.minimum(ce, q) - 1
            tl.store(row_list + j, t | (eq * _TIE), mask=keep & (j < LCAP))
        n_gt += tot & 0xFFFF
        n_eq += tot >> 16
    tl.store(cnt_ptr + (b * C + c) * 2, n_gt)
    tl.store(cnt_ptr + (b * C + c) * 2 + 1, n_eq)


@triton.jit(do_not_specialize=["bt_stride", "PADCH"])
def _emit_kernel(
    sl_ptr, bt_ptr, cnt_ptr, list_ptr, out_ptr, topk, bt_stride, PADCH, LCAP,
    CP: tl.constexpr, LB: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    seq_len = tl.load(sl_ptr + b)
    k = tl.minimum(topk, seq_len)
    off, take, tot_sel = _chunk_share(cnt_ptr, b, c, C, k, CP)
    my_gt = tl.load(cnt_ptr + (b * C + c) * 2)
    my_eq = tl.load(cnt_ptr + (b * C + c) * 2 + 1)
    n_list = tl.minimum(my_gt + tl.minimum(my_eq, topk), LCAP)
    row_list = list_ptr + (b * C + c) * LCAP
    n_sel = 0
    n_eq_seen = 0
    for j0 in range(0, n_list, LB):
        j = j0 + tl.arange(0, LB)
        valid = j < n_list
        e = tl.load(row_list + j, mask=valid, other=0)
        pos = e & (_TIE - 1)
        gt = (valid & ((e & _TIE) == 0)).to(tl.int32)
        eq = (valid & ((e & _TIE) != 0)).to(tl.int32)
        p = gt | (eq << 16)
        cs = tl.cumsum(p, 0)
        cg = cs & 0xFFFF
        ce = cs >> 16
        q = tl.maximum(take - n_eq_seen, 0)
        sel = (gt > 0) | ((eq > 0) & (ce <= q))
        o = off + n_sel + cg + tl.minimum(ce, q) - 1
        page = tl.load(bt_ptr + b * bt_stride + pos // _PAGE, mask=sel, other=0)
        tl.store(out_ptr + b * topk + o, page * _PAGE + pos % _PAGE, mask=sel & (o < k))
        tot = tl.sum(p, 0)
        n_sel += (tot & 0xFFFF) + tl.minimum(tot >> 16, q)
        n_eq_seen += tot >> 16
    _pad(out_ptr + b * topk, c, PADCH, topk, tot_sel, LB)


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
    if W >= 1 << 30:
        raise ValueError(f"fix-up v3: rows of {W} scores do not fit the list's position bits")
    fold = kth is None
    if fold:
        if raw is None:
            raise ValueError("select: needs kth or the library's positions raw")
        kth = torch.empty((B,), dtype=torch.float32, device=dev)
    chunk, C = chunking(B, W, cfg, dev)
    lcap = min(2 * topk, chunk)
    cnt = torch.empty((B, C, 2), dtype=torch.int32, device=dev)
    lists = torch.empty((B, C, lcap), dtype=torch.int32, device=dev)
    _compact_kernel[(B, C)](
        scores, seq_lens, raw if fold else seq_lens, kth, cnt, lists, W, topk, chunk, lcap,
        ROWS=cfg.block // PAGE, FOLD=fold, KP=triton.next_power_of_2(topk) if fold else 16,
        SKIP=cfg.skip, num_warps=cfg.warps,
    )  # fmt: skip
    out = torch.empty((B, topk), dtype=torch.int32, device=dev)
    _emit_kernel[(B, C)](
        seq_lens, block_table, cnt, lists, out, topk, block_table.stride(0), triton.cdiv(topk, C),
        lcap, CP=max(_CP_MIN, triton.next_power_of_2(C)), LB=_LIST_BLOCK, num_warps=4,
    )  # fmt: skip
    return out, kth
