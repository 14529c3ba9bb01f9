"""Triton side of ``echo::prefill_indexer_topk_gather`` (custom_ops/prefill_gather.py).

The queries go a block of ``score_rows`` at a time, as in ``prefill_kernels.
prefill_indexer_topk_cuda``. Block i + 1's scores launch is ``_logits_copy_kernel``: its first
``copy_progs`` programs copy the rows block i selected (``_copy_selected``) while the others
compute score tiles (``prefill_kernels._logits_tile``), so on one stream, inside one graph, the
host reads overlap the scoring. The first programs of a launch are the first to be scheduled:
the copy programs start with the scoring, not after it. Block 0 has nothing to copy yet; the last
block's rows are copied after its selection.

``_copy_selected`` takes entries of a ``[rows, topk]`` selection (positions, -1 padded) and, for
each position not yet marked (an atomic exchange on ``mark [L]``, so a row is copied once however
many queries select it), copies ``host_kv[slot]`` to ``rows[position]`` a tile of ``BR`` rows x
``BW`` 32-bit words at a time (UVA reads of pinned memory on CUDA), and adds what it copied to a
counter. All grids from static shapes; no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from custom_ops import prefill_kernels as pk
from custom_ops.backends.deep_gemm_ops import HEADS
from custom_ops.kv_format import PAGE

_PAGE = tl.constexpr(PAGE)


@dataclass(frozen=True)
class GatherConfig:
    """The copy's launch shapes (not yet timed on the GPU; bench_prefill's ``gather`` part
    times them)."""

    copy_progs: int = 16  # programs of a fused scores launch that copy
    block_rows: int = 16  # rows a copy program moves at a time
    block_words: int = 128  # 32-bit words of a row per load (rows are 164 or 288 words)
    num_warps: int = 4  # of the plain copy launch (the fused one takes the scores config's)


@triton.jit
def _copy_selected(
    sel_ptr, n_sel, mark_ptr, bt_ptr, src_ptr, dst_ptr, cnt_ptr, prog, n_progs,
    ROW_W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    n_new = tl.full([], 0, tl.int32)
    for start in range(prog * BR, n_sel, n_progs * BR):
        e = start + tl.arange(0, BR)
        p = tl.load(sel_ptr + e, mask=e < n_sel, other=-1)
        live = p >= 0
        old = tl.atomic_xchg(mark_ptr + tl.where(live, p, 0), 1, mask=live)
        go = live & (old == 0)
        page = tl.load(bt_ptr + p // _PAGE, mask=go, other=0).to(tl.int64)
        src = src_ptr + (page * _PAGE + p % _PAGE)[:, None] * ROW_W
        dst = dst_ptr + p.to(tl.int64)[:, None] * ROW_W
        for w0 in tl.static_range(0, ROW_W, BW):
            ww = w0 + tl.arange(0, BW)
            m = go[:, None] & (ww < ROW_W)[None, :]
            tl.store(dst + ww[None, :], tl.load(src + ww[None, :], mask=m), mask=m)
        n_new += tl.sum(go.to(tl.int32), 0)
    tl.atomic_add(cnt_ptr, n_new.to(tl.int64))


@triton.jit
def _copy_kernel(
    sel_ptr, n_sel, mark_ptr, bt_ptr, src_ptr, dst_ptr, cnt_ptr,
    ROW_W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    _copy_selected(sel_ptr, n_sel, mark_ptr, bt_ptr, src_ptr, dst_ptr, cnt_ptr,
                   tl.program_id(0), tl.num_programs(0), ROW_W, BR, BW)  # fmt: skip


@triton.jit
def _logits_copy_kernel(
    q_ptr, w_ptr, kv_ptr, ks_ptr, bt_ptr, pos_ptr, score_ptr, Q, L, n_heads, n_q_tiles,
    sel_ptr, n_sel, mark_ptr, src_ptr, dst_ptr, cnt_ptr,
    BQ: tl.constexpr, BT: tl.constexpr, STAGES: tl.constexpr,
    COPY_PROGS: tl.constexpr, ROW_W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < COPY_PROGS:
        _copy_selected(sel_ptr, n_sel, mark_ptr, bt_ptr, src_ptr, dst_ptr, cnt_ptr, pid,
                       COPY_PROGS, ROW_W, BR, BW)  # fmt: skip
    else:
        s = pid - COPY_PROGS
        pk._logits_tile(
            s % n_q_tiles, s // n_q_tiles, q_ptr, w_ptr, kv_ptr, ks_ptr, bt_ptr, pos_ptr,
            score_ptr, Q, L, n_heads, BQ, BT, STAGES,
        )  # fmt: skip


class _Copy:
    """The state of one call's copies: ``rows`` and ``mark`` by position, the two counters."""

    def __init__(self, host_kv, block_table, g: GatherConfig):
        L = block_table.shape[1] * PAGE
        dev = block_table.device
        self.g, self.bt = g, block_table[0].contiguous()
        self.row_w = host_kv.shape[1] // 4
        self.src = host_kv.view(torch.int32)
        self.rows = torch.zeros((L, host_kv.shape[1]), dtype=torch.uint8, device=dev)
        self.dst = self.rows.view(torch.int32)
        self.mark = torch.zeros(L, dtype=torch.int32, device=dev)
        self.copied = torch.zeros(2, dtype=torch.int64, device=dev)

    def launch(self, sel: torch.Tensor, which: int) -> None:
        """Copy ``sel``'s unmarked rows in a launch of its own; count them in ``copied[which]``."""
        g = self.g
        n = sel.numel()
        grid = (max(1, min(triton.cdiv(n, g.block_rows), 4 * g.copy_progs)),)
        _copy_kernel[grid](
            sel, n, self.mark, self.bt, self.src, self.dst, self.copied[which:],
            ROW_W=self.row_w, BR=g.block_rows, BW=g.block_words, num_warps=g.num_warps,
        )  # fmt: skip


def _logits_copy(q_fp8, weights, index_cache, block_table, positions, cfg, prev, cp: _Copy):
    """``prefill_kernels.prefill_index_logits`` whose launch also copies ``prev``'s rows."""
    Q, n_heads = q_fp8.shape[:2]
    L = block_table.shape[1] * PAGE
    scores = torch.empty((Q, L), dtype=torch.float32, device=q_fp8.device)
    n_q = triton.cdiv(Q, cfg.block_q)
    g = cp.g
    grid = (g.copy_progs + n_q * triton.cdiv(L, cfg.block_t),)
    _logits_copy_kernel[grid](
        q_fp8.contiguous(), weights.contiguous(), index_cache, index_cache.view(torch.float32),
        cp.bt, positions.contiguous(), scores, Q, L, n_heads, n_q,
        prev, prev.numel(), cp.mark, cp.src, cp.dst, cp.copied,
        BQ=cfg.block_q, BT=cfg.block_t, STAGES=cfg.num_stages, COPY_PROGS=g.copy_progs,
        ROW_W=cp.row_w, BR=g.block_rows, BW=g.block_words, num_warps=cfg.num_warps,
    )  # fmt: skip
    return scores


def prefill_indexer_topk_gather_cuda(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    host_kv: torch.Tensor,
    cfg: pk.PrefillIndexerConfig | None = None,
    gather: GatherConfig | None = None,
    logits_backend: str = "triton",
    fuse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``echo::prefill_indexer_topk_gather`` on the GPU (or on CPU tensors under
    TRITON_INTERPRET=1). ``fuse=False`` copies each block's rows in a launch of its own after its
    selection (the side-by-side of bench_prefill); so does the DeepGEMM scores path."""
    cfg = cfg or pk.PrefillIndexerConfig()
    cp = _Copy(host_kv, block_table, gather or GatherConfig())
    if logits_backend == "deep_gemm" and q_fp8.shape[1] in HEADS:
        sel = pk.prefill_indexer_topk_cuda(
            q_fp8, weights, index_cache, block_table, positions, topk, cfg, logits_backend
        )
        cp.launch(sel, 1)
        return sel, cp.rows, cp.copied
    T = q_fp8.shape[0]
    qb = pk.score_rows(block_table.shape[1] * PAGE, T, cfg.score_elems)
    out = torch.empty((T, topk), dtype=torch.int32, device=q_fp8.device)
    prev = None
    for s in range(0, T, qb):  # static bounds: shapes only
        e = min(T, s + qb)
        args = (q_fp8[s:e], weights[s:e], index_cache, block_table, positions[s:e])
        if prev is not None and fuse:
            scores = _logits_copy(*args, cfg, prev, cp)
        else:
            scores = pk.prefill_index_logits(*args, cfg)
        out[s:e] = pk.prefill_topk_from_scores(scores, positions[s:e], topk, cfg)
        prev = out[s:e]
        if not fuse:
            cp.launch(prev, 1)
    if prev is not None and fuse:
        cp.launch(prev, 1)  # the last block's rows: the guaranteed recall
    return out, cp.rows, cp.copied
