"""Triton kernels of the tie fix-up (``ties.threshold_select_ref``, ``ties.kth_from_indices_ref``).

``fixup`` / ``threshold_select`` run the variant a ``FixupConfig`` names (``ties_config``; the
default ``v3`` lives in ``ties_compact_kernels``, ``v2`` in ``ties_fast_kernels``). This file
holds the kth kernel they use, and the first kernels, variant ``v1``, kept so the benchmark times
them side by side:
three launches, grids from static shapes, live lengths read on the device, no host syncs:
``_kth_kernel``     (grid B) the lowest score at the library's k selected positions;
``_count_kernel``   (grid B x chunks) per chunk, the live scores above kth and equal to it;
``_output_kernel``  (grid B x chunks) from every chunk's counts, its output offset and its share of
                    the ties (the earliest ones), then the host slots in ascending position and the
                    -1 padding.
Two reads of the scores (about 6 us each at B = 64 x 100K on an H200, by bandwidth); the order of
the output depends only on positions, so it is deterministic.
``_sort_map_kernel`` (grid B) serves the optional "library ties" mode instead: the library's k
positions sorted ascending as host slots, and kth (``ties.sort_positions_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.backends import ties_compact_kernels, ties_fast_kernels
from custom_ops.backends.ties_config import DEFAULT_FIXUP, FixupConfig, fixup_config
from custom_ops.indexer_kernels import chunks_for
from custom_ops.kv_format import PAGE

_PAGE = tl.constexpr(PAGE)


@triton.jit
def _kth_kernel(score_ptr, raw_ptr, kth_ptr, W, topk, KP: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, KP)
    raw = tl.load(raw_ptr + b * topk + j, mask=j < topk, other=-1)
    ok = raw >= 0
    v = tl.load(score_ptr + b * W + raw, mask=ok, other=float("inf"))
    m = tl.min(tl.where(ok, v, float("inf")), 0)
    n = tl.sum(ok.to(tl.int32), 0)
    tl.store(kth_ptr + b, tl.where(n > 0, m, float("-inf")))


@triton.jit
def _count_kernel(score_ptr, sl_ptr, kth_ptr, cnt_ptr, W, CH, BLK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    start = c * CH
    seq_len = tl.load(sl_ptr + b)
    kth = tl.load(kth_ptr + b)
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), BLK)
    n_gt = 0
    n_eq = 0
    for i in range(n_iter):
        t = start + i * BLK + tl.arange(0, BLK)
        live = t < seq_len
        s = tl.load(score_ptr + b * W + t, mask=live, other=float("-inf"))
        n_gt += tl.sum((live & (s > kth)).to(tl.int32), 0)
        n_eq += tl.sum((live & (s == kth)).to(tl.int32), 0)
    tl.store(cnt_ptr + (b * C + c) * 2, n_gt)
    tl.store(cnt_ptr + (b * C + c) * 2 + 1, n_eq)


@triton.jit
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
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    start = c * CH
    seq_len = tl.load(sl_ptr + b)
    k = tl.minimum(topk, seq_len)
    kth = tl.load(kth_ptr + b)
    cc = tl.arange(0, CP)
    cm = cc < C
    n_gt = tl.load(cnt_ptr + (b * C + cc) * 2, mask=cm, other=0)
    n_eq = tl.load(cnt_ptr + (b * C + cc) * 2 + 1, mask=cm, other=0)
    need = k - tl.sum(n_gt, 0)  # ties to take, the earliest first
    take_all = tl.minimum(tl.maximum(need - (tl.cumsum(n_eq, 0) - n_eq), 0), n_eq)
    off = tl.sum(tl.where(cc < c, n_gt + take_all, 0), 0)
    take = tl.sum(tl.where(cc == c, take_all, 0), 0)
    n_iter = tl.cdiv(tl.minimum(tl.maximum(seq_len - start, 0), CH), BLK)
    n_sel = 0
    n_eq_seen = 0
    for i in range(n_iter):
        t = start + i * BLK + tl.arange(0, BLK)
        live = t < seq_len
        s = tl.load(score_ptr + b * W + t, mask=live, other=float("-inf"))
        eq = (live & (s == kth)).to(tl.int32)
        rank = n_eq_seen + tl.cumsum(eq, 0) - 1  # among this chunk's ties, in position order
        sel = ((live & (s > kth)) | ((eq > 0) & (rank < take))).to(tl.int32)
        pos = off + n_sel + tl.cumsum(sel, 0) - 1
        page = tl.load(bt_ptr + b * bt_stride + t // _PAGE, mask=sel > 0, other=0)
        tl.store(out_ptr + b * topk + pos, page * _PAGE + t % _PAGE, mask=(sel > 0) & (pos < k))
        n_sel += tl.sum(sel, 0)
        n_eq_seen += tl.sum(eq, 0)
    # -1 from what the chunks select in all: k when kth is the true k-th value; fewer when it is
    # not (a NaN among a library's scores), and the entries past them must not stay unwritten
    tot = tl.minimum(tl.sum(tl.where(cm, n_gt + take_all, 0), 0), k)
    lo = c * PADCH
    hi = tl.minimum(lo + PADCH, topk)
    for j0 in range(lo, hi, BLK):
        j = j0 + tl.arange(0, BLK)
        tl.store(out_ptr + b * topk + j, tl.full([BLK], -1, tl.int32), mask=(j >= tot) & (j < hi))


@triton.jit
def _sort_map_kernel(
    score_ptr, raw_ptr, bt_ptr, out_ptr, kth_ptr, W, topk, bt_stride, KP: tl.constexpr
):
    """One row: the library's positions sorted ascending (-1 last), as host slots, and kth."""
    b = tl.program_id(0)
    j = tl.arange(0, KP)
    raw = tl.load(raw_ptr + b * topk + j, mask=j < topk, other=-1)
    ok = raw >= 0
    v = tl.load(score_ptr + b * W + raw, mask=ok, other=float("inf"))
    n = tl.sum(ok.to(tl.int32), 0)
    m = tl.min(tl.where(ok, v, float("inf")), 0)
    tl.store(kth_ptr + b, tl.where(n > 0, m, float("-inf")))
    pos = tl.sort(tl.where(ok, raw, 2147483647))
    live = pos != 2147483647
    page = tl.load(bt_ptr + b * bt_stride + pos // _PAGE, mask=live, other=0)
    slot = tl.where(live, page * _PAGE + pos % _PAGE, -1)
    tl.store(out_ptr + b * topk + j, slot, mask=j < topk)


def sort_positions(
    scores: torch.Tensor, block_table: torch.Tensor, raw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ties.sort_positions_ref`` on the GPU (or CPU tensors under TRITON_INTERPRET=1)."""
    B, topk = raw.shape
    if not (scores.is_contiguous() and raw.is_contiguous() and raw.dtype == torch.int32):
        raise ValueError("sort_positions: scores and raw int32 indices must be contiguous")
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    out = torch.empty((B, topk), dtype=torch.int32, device=scores.device)
    kth = torch.empty((B,), dtype=torch.float32, device=scores.device)
    KP = triton.next_power_of_2(topk)
    _sort_map_kernel[(B,)](
        scores, raw, bt, out, kth, scores.shape[1], topk, bt.stride(0), KP=KP,
        num_warps=8 if KP >= 2048 else 4,
    )  # fmt: skip
    return out, kth


def kth_from_indices(scores: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``ties.kth_from_indices_ref`` on the GPU (or CPU tensors under TRITON_INTERPRET=1)."""
    B, topk = raw.shape
    if not (scores.is_contiguous() and raw.is_contiguous() and raw.dtype == torch.int32):
        raise ValueError("kth_from_indices: scores and raw int32 indices must be contiguous")
    kth = torch.empty((B,), dtype=torch.float32, device=scores.device)
    _kth_kernel[(B,)](scores, raw, kth, scores.shape[1], topk, KP=triton.next_power_of_2(topk))
    return kth


def threshold_select(
    scores: torch.Tensor,  # [B, W] fp32 contiguous
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    kth: torch.Tensor,  # [B] fp32
    topk: int,
    cfg: FixupConfig | None = None,
) -> torch.Tensor:
    """``ties.threshold_select_ref`` on the GPU: host slots int32 [B, topk]."""
    cfg = _checked(scores, block_table, seq_lens, topk, cfg)
    _check_kth(kth, scores.shape[0])
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    if cfg.variant != "v1":
        return _select_of(cfg)(scores, block_table, seq_lens, topk, cfg, kth=kth)[0]
    B, W = scores.shape
    chunk, C = chunks_for(B, W, cfg.block, cfg.chunk, scores.device)
    cnt = torch.empty((B, C, 2), dtype=torch.int32, device=scores.device)
    _count_kernel[(B, C)](scores, seq_lens, kth, cnt, W, chunk, BLK=cfg.block, num_warps=cfg.warps)
    out = torch.empty((B, topk), dtype=torch.int32, device=scores.device)
    _output_kernel[(B, C)](
        scores, seq_lens, block_table, kth, cnt, out, W, topk, chunk, block_table.stride(0),
        triton.cdiv(topk, C), CP=triton.next_power_of_2(C), BLK=cfg.block, num_warps=cfg.warps,
    )  # fmt: skip
    return out


def _checked(scores, block_table, seq_lens, topk, cfg: FixupConfig | None) -> FixupConfig:
    cfg = cfg or fixup_config(DEFAULT_FIXUP)
    cfg.check()
    if scores.dtype != torch.float32 or not scores.is_contiguous() or scores.dim() != 2:
        raise ValueError("threshold_select: scores must be contiguous fp32 [B, W]")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("threshold_select: block_table and seq_lens must be int32")
    if topk <= 0:
        raise ValueError(f"threshold_select: topk must be positive, got {topk}")
    return cfg


def _check_kth(kth: torch.Tensor, B: int) -> None:
    if kth.dtype != torch.float32 or kth.shape != (B,) or not kth.is_contiguous():
        raise ValueError(f"threshold_select: kth must be contiguous fp32 [{B}], got "
                         f"{kth.dtype} {tuple(kth.shape)}")  # fmt: skip


def fixup(
    scores: torch.Tensor,  # [B, W] fp32 contiguous
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    raw: torch.Tensor,  # [B, topk] int32: a library's selected positions, -1 = none
    topk: int,
    cfg: FixupConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole fix-up from a library's positions: (host slots int32 [B, topk], kth fp32 [B]),
    ``ties.threshold_select_ref`` of ``ties.kth_from_indices_ref``."""
    cfg = _checked(scores, block_table, seq_lens, topk, cfg)
    if raw.dtype != torch.int32 or not raw.is_contiguous() or raw.shape != (scores.shape[0], topk):
        raise ValueError("fixup: raw must be contiguous int32 [B, topk]")
    if cfg.variant != "v1" and ties_fast_kernels.folds_kth(
        scores.shape[0], scores.shape[1], cfg, scores.device
    ):
        bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        return _select_of(cfg)(scores, bt, seq_lens, topk, cfg, raw=raw)
    kth = kth_from_indices(scores, raw)
    return threshold_select(scores, block_table, seq_lens, kth, topk, cfg), kth


def _select_of(cfg: FixupConfig):
    return ties_compact_kernels.select if cfg.variant == "v3" else ties_fast_kernels.select
