"""Triton side of ``echo::prefill_indexer_topk_gather`` (custom_ops/prefill_gather.py).

The queries go a block of ``score_rows`` at a time, as in ``prefill_kernels.
prefill_indexer_topk_cuda``. After block i's selection, ``_mark_kernel`` (one program per
``MARK_BLOCK`` entries, all in parallel) marks each selected position with an atomic exchange
on ``mark [L]`` and appends the positions no earlier block selected to ``listed [L]``, a range
per block (``bounds``). Block i + 1's scores launch is ``_logits_copy_kernel``: its first
``copy_progs`` programs copy block i's range of new rows (``_copy_listed``) while the others
compute score tiles (``prefill_kernels._logits_tile``), so on one stream, inside one graph, the
host reads overlap the scoring. The first programs of a launch are the first to be scheduled:
the copy programs start with the scoring, not after it. Block 0 has nothing to copy yet; the last
block's rows are copied after its selection by ``_copy_kernel``, one program per ``BR`` rows.
A copy moves ``host_kv[slot]`` to ``rows[position]`` a tile of ``BR`` rows x ``BW`` 32-bit words
at a time (UVA reads of pinned memory on CUDA); only distinct new rows are in a range, so the
copy loops carry no per-entry atomics. All grids from static shapes; no host syncs.
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
MARK_BLOCK = 1024  # selection entries a marking program takes


@dataclass(frozen=True)
class GatherConfig:
    """The copy's launch shapes. ``copy_progs``: 32 beat 16 at 32K and 100K contexts in two H200
    runs of bench_prefill_gather, and 64 was no faster (docs/prefetch.md, "Prefill")."""

    copy_progs: int = 32  # programs of a fused scores launch that copy
    block_rows: int = 16  # rows a copy program moves at a time
    block_words: int = 128  # 32-bit words of a row per load (rows are 164 or 288 words)
    num_warps: int = 4  # of the plain copy launch (the fused one takes the scores config's)


@triton.jit
def _mark_kernel(sel_ptr, n_sel, mark_ptr, listed_ptr, tail_ptr, BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(sel_ptr + e, mask=e < n_sel, other=-1)
    live = p >= 0
    old = tl.atomic_xchg(mark_ptr + tl.where(live, p, 0), 1, mask=live)
    new = (live & (old == 0)).to(tl.int32)
    base = tl.atomic_add(tail_ptr, tl.sum(new, 0))  # this program's place in the list
    tl.store(listed_ptr + base + tl.cumsum(new, 0) - 1, p, mask=new > 0)


@triton.jit
def _copy_listed(
    listed_ptr, bounds_ptr, bt_ptr, src_ptr, dst_ptr, prog, n_progs,
    ROW_W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    lo = tl.load(bounds_ptr)
    hi = tl.load(bounds_ptr + 1)
    for start in range(lo + prog * BR, hi, n_progs * BR):
        i = start + tl.arange(0, BR)
        m = i < hi
        p = tl.load(listed_ptr + i, mask=m, other=0)
        page = tl.load(bt_ptr + p // _PAGE, mask=m, other=0).to(tl.int64)
        src = src_ptr + (page * _PAGE + p % _PAGE)[:, None] * ROW_W
        dst = dst_ptr + p.to(tl.int64)[:, None] * ROW_W
        for w0 in tl.static_range(0, ROW_W, BW):
            ww = w0 + tl.arange(0, BW)
            wm = m[:, None] & (ww < ROW_W)[None, :]
            tl.store(dst + ww[None, :], tl.load(src + ww[None, :], mask=wm), mask=wm)


@triton.jit
def _copy_kernel(
    listed_ptr, bounds_ptr, bt_ptr, src_ptr, dst_ptr,
    ROW_W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    _copy_listed(listed_ptr, bounds_ptr, bt_ptr, src_ptr, dst_ptr, tl.program_id(0),
                 tl.num_programs(0), ROW_W, BR, BW)  # fmt: skip


@triton.jit
def _logits_copy_kernel(
    q_ptr, w_ptr, kv_ptr, ks_ptr, bt_ptr, pos_ptr, score_ptr, Q, L, n_heads, n_q_tiles,
    listed_ptr, bounds_ptr, src_ptr, dst_ptr,
    BQ: tl.constexpr, BT: tl.constexpr, STAGES: tl.constexpr,
    COPY_PROGS: tl.constexpr, ROW_W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < COPY_PROGS:
        _copy_listed(listed_ptr, bounds_ptr, bt_ptr, src_ptr, dst_ptr, pid, COPY_PROGS,
                     ROW_W, BR, BW)  # fmt: skip
    else:
        s = pid - COPY_PROGS
        pk._logits_tile(
            s % n_q_tiles, s // n_q_tiles, q_ptr, w_ptr, kv_ptr, ks_ptr, bt_ptr, pos_ptr,
            score_ptr, Q, L, n_heads, BQ, BT, STAGES,
        )  # fmt: skip


class _Copy:
    """One call's copy state: ``rows`` and ``mark`` by position; ``listed``, the new positions of
    each block in turn, block b's between ``bounds[b]`` and ``bounds[b + 1]``; ``tail``, the
    list's length."""

    def __init__(self, host_kv, block_table, n_blocks: int, g: GatherConfig, dev):
        self.L = L = block_table.shape[1] * PAGE
        self.g, self.bt = g, block_table[0].contiguous()
        self.row_w = host_kv.shape[1] // 4
        self.src = host_kv.view(torch.int32)
        self.rows = torch.zeros((L, host_kv.shape[1]), dtype=torch.uint8, device=dev)
        self.dst = self.rows.view(torch.int32)
        self.mark = torch.zeros(L, dtype=torch.int32, device=dev)
        self.listed = torch.empty(L, dtype=torch.int32, device=dev)
        self.tail = torch.zeros(1, dtype=torch.int32, device=dev)
        self.bounds = torch.zeros(n_blocks + 1, dtype=torch.int32, device=dev)

    def mark_new(self, sel: torch.Tensor, b: int) -> None:
        """List block ``b``'s positions that no block before it selected."""
        n = sel.numel()
        grid = (max(1, triton.cdiv(n, MARK_BLOCK)),)
        _mark_kernel[grid](sel, n, self.mark, self.listed, self.tail, BLOCK=MARK_BLOCK)
        self.bounds[b + 1 : b + 2].copy_(self.tail)

    def copy(self, b: int, n_entries: int) -> None:
        """Copy block ``b``'s listed rows (at most ``n_entries``) in a launch of their own."""
        g = self.g
        grid = (max(1, triton.cdiv(min(self.L, n_entries), g.block_rows)),)
        _copy_kernel[grid](
            self.listed, self.bounds[b:], self.bt, self.src, self.dst,
            ROW_W=self.row_w, BR=g.block_rows, BW=g.block_words, num_warps=g.num_warps,
        )  # fmt: skip

    def copied(self, overlapped_blocks: int) -> torch.Tensor:
        """``[rows of the first overlapped_blocks blocks, the rest]`` int64."""
        early = self.bounds[overlapped_blocks]
        return torch.stack([early, self.bounds[-1] - early]).to(torch.int64)


def _logits_copy(q_fp8, weights, index_cache, block_table, positions, cfg, cp: _Copy, b: int):
    """``prefill_kernels.prefill_index_logits`` whose launch also copies block ``b``'s rows."""
    Q, n_heads = q_fp8.shape[:2]
    L = block_table.shape[1] * PAGE
    scores = torch.empty((Q, L), dtype=torch.float32, device=q_fp8.device)
    n_q = triton.cdiv(Q, cfg.block_q)
    g = cp.g
    grid = (g.copy_progs + n_q * triton.cdiv(L, cfg.block_t),)
    _logits_copy_kernel[grid](
        q_fp8.contiguous(), weights.contiguous(), index_cache, index_cache.view(torch.float32),
        cp.bt, positions.contiguous(), scores, Q, L, n_heads, n_q,
        cp.listed, cp.bounds[b:], cp.src, cp.dst,
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
    where = "prefill_indexer_topk_gather_cuda"
    pk.check_cuda_inputs(where, q_fp8, index_cache, block_table, positions, logits_backend)
    if host_kv.device.type != q_fp8.device.type:
        raise ValueError(f"{where}: host_kv must be a {q_fp8.device.type} tensor (UVA on CUDA)")
    g = gather or GatherConfig()
    T, dev = q_fp8.shape[0], q_fp8.device
    if logits_backend == "deep_gemm" and q_fp8.shape[1] in HEADS:
        sel = pk.prefill_indexer_topk_cuda(
            q_fp8, weights, index_cache, block_table, positions, topk, cfg, logits_backend
        )
        cp = _Copy(host_kv, block_table, 1, g, dev)
        cp.mark_new(sel, 0)
        cp.copy(0, sel.numel())
        return sel, cp.rows, cp.copied(0)
    qb = pk.score_rows(block_table.shape[1] * PAGE, T, cfg.score_elems)
    blocks = [(s, min(T, s + qb)) for s in range(0, T, qb)]  # static bounds: shapes only
    cp = _Copy(host_kv, block_table, len(blocks), g, dev)
    out = torch.empty((T, topk), dtype=torch.int32, device=dev)
    for b, (s, e) in enumerate(blocks):
        args = (q_fp8[s:e], weights[s:e], index_cache, block_table, positions[s:e])
        if b and fuse:  # block b - 1's new rows, copied by this launch
            scores = _logits_copy(*args, cfg, cp, b - 1)
        else:
            scores = pk.prefill_index_logits(*args, cfg)
        out[s:e] = pk.prefill_topk_from_scores(scores, positions[s:e], topk, cfg)
        cp.mark_new(out[s:e], b)
        if not fuse:
            cp.copy(b, (e - s) * topk)
    if blocks and fuse:  # the last block's new rows: the guaranteed recall
        s, e = blocks[-1]
        cp.copy(len(blocks) - 1, (e - s) * topk)
    return out, cp.rows, cp.copied(len(blocks) - 1 if fuse and blocks else 0)
