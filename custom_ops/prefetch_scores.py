"""Variants of the fused indexer-scores + prefetch kernel (semantics: custom_ops/prefetch_ref.py).

The fused kernel must cost what the unfused ``_scores_kernel`` costs when nothing qualifies (on
the H200 the first version, ``"tile"``, made the whole indexer 36% slower with nothing staged:
benchmarks/results/prefetch_h200.json). Variants, chosen by name (``SCORES_VARIANTS``):

- ``"tile"``: ``_scores_prefetch_kernel``. Inside the scoring loop, every score
  tile compares with the threshold and *reduces* the comparison across the CTA (a shared-memory
  round trip and barriers, every tile, in a loop that runs at two CTAs per SM), then, for tiles
  with candidates, the map lookups, the claim atomics and the host copy. The copies overlap the
  program's own next tiles.
- ``"post"``: the scoring loop is ``_scores_kernel``'s, plus one element-wise
  comparison with the threshold kept as a bit per score tile (a register per token lane: bit i
  of lane j is token i BT + j; no reduction, no branch). After it, one reduction: a program none
  of whose scores beats the threshold is done (the whole "nothing staged" cost). The others
  unpack the bits into one vector of TPP tokens (registers: the scores are not read back), look
  the map up once, claim once, and copy their kept rows ``rows_per_block`` at a time; the copies
  overlap the scoring of the other programs on the SM. A program stages at most
  rows_per_block x TPP / BT rows, as in ``"tile"``.
- ``"early"`` (default): ``"post"`` with the map looked up in the scoring loop: each tile's
  tokens above the threshold gather their ``host_to_gpu`` entries right after the tile is
  scored, and the next tile's iteration folds them into the bits (so the bits say "candidate",
  above the threshold and not on the GPU, and the load's latency hides under a tile of
  scoring). The tail then runs only in programs with candidates, starts at the claim, and reads
  the epoch word beside its first load instead of after the claim. 3.2-5.7 µs faster than
  ``"post"`` per indexer + recall on an H100 (docs/prefetch.md, gpu_session37).

Each records a staged row as ``stage_host[slot] = (E + 1) << 32 | h`` (E: the staging epoch word,
read once by a program that stages; prefetch_layout) and ``host_stage[h] = slot``, and counts the
rows it keeps in pf_stats[PF_STAGED].

All give the same scores (bit for bit: the same scoring code) and the same candidate set; which
candidates are staged may differ (atomics order when a cap binds; and "post" and "early" budget
per program, so a block with more than rows_per_block candidates can stage more), which only
changes performance: the attended set is the exact top-k either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.indexer_kernels import IndexerConfig
from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE
from custom_ops.prefetch_layout import EPOCH_SHIFT, PF_STAGED

_PAGE = tl.constexpr(PAGE)  # the constants of indexer_kernels' scoring loop
_DIM = tl.constexpr(INDEX_DIM)
_PAGE_BYTES = tl.constexpr(INDEX_PAGE_BYTES)
_SCALE_OFF = tl.constexpr(PAGE * INDEX_DIM // 4)
_PAGE_F32 = tl.constexpr(INDEX_PAGE_BYTES // 4)
_S_STAGED = tl.constexpr(PF_STAGED)
_SHIFT = tl.constexpr(EPOCH_SHIFT)
DEFAULT_VARIANT = "early"


@triton.jit
def _scores_prefetch_post_kernel(
    q_ptr, w_ptr, kv_ptr, ks_ptr, bt_ptr, sl_ptr, score_ptr, ema_ptr, h2g_ptr, hstage_ptr,
    shost_ptr, ctr_ptr, epoch_ptr, pfs_ptr, src_ptr, dst_ptr, n_heads, bt_stride, L, B, cap,
    n_stage, ratio, HP: tl.constexpr, BT: tl.constexpr, TPP: tl.constexpr, STAGES: tl.constexpr,
    GLOBAL: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, ROW_W: tl.constexpr,
    ROW_WP: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Arguments as ``_scores_prefetch_kernel``; the staging after the scoring
    loop, for programs with a score above the threshold only (module docstring). EARLY: the
    ``"early"`` variant (the map looked up in the loop, the bits mark candidates)."""
    b = tl.program_id(0)
    start = tl.program_id(1) * TPP
    seq_len = tl.load(sl_ptr + b)
    hh = tl.arange(0, HP)
    dd = tl.arange(0, _DIM)
    tt = tl.arange(0, BT)
    hm = hh < n_heads
    q = tl.load(q_ptr + (b * n_heads + hh[:, None]) * _DIM + dd[None, :], mask=hm[:, None],
                other=0)  # fmt: skip
    q = q.to(tl.float8e4nv, bitcast=True)  # [HP, 128]
    w = tl.load(w_ptr + b * n_heads + hh, mask=hm, other=0.0)
    n_live = tl.minimum(tl.maximum(seq_len - start, 0), TPP)
    n_iter = tl.cdiv(n_live, BT)
    thr = tl.load(ema_ptr + tl.load(bt_ptr + b * bt_stride))  # padded rows: nothing is live
    # bit i: token start + i BT + lane beats the threshold (EARLY: and is not on the GPU)
    over_bits = tl.zeros([BT], tl.int32)
    over_prev = tl.zeros([BT], tl.int32)  # EARLY: the last tile's tokens above the threshold,
    g_prev = tl.zeros([BT], tl.int32)  # and their map entries, still in flight
    # ---- the scoring loop of _scores_kernel, unchanged but for the comparison
    for i in tl.range(0, n_iter, num_stages=STAGES):
        t = start + i * BT + tt
        live = t < seq_len
        page = tl.load(bt_ptr + b * bt_stride + t // _PAGE, mask=live, other=0).to(tl.int64)
        off = t % _PAGE
        k = tl.load(
            kv_ptr + page[:, None] * _PAGE_BYTES + off[:, None] * _DIM + dd[None, :],
            mask=live[:, None],
            other=0,
        )
        ks = tl.load(ks_ptr + page * _PAGE_F32 + _SCALE_OFF + off, mask=live, other=0.0)
        logits = tl.dot(k.to(tl.float8e4nv, bitcast=True), tl.trans(q))  # [BT, HP] fp32
        s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * ks
        s = tl.where(live, s, float("-inf"))
        tl.store(score_ptr + b * L + t, s, mask=t < L)
        over = s > thr  # dead tokens are -inf; NaN: no
        if EARLY:  # the last tile's lookups, issued a tile of scoring ago; then this tile's
            cand = (over_prev != 0) & (g_prev < 0)
            over_bits = over_bits | (cand.to(tl.int32) << tl.maximum(i - 1, 0))
            g_prev = tl.load(h2g_ptr + page * _PAGE + off, mask=over, other=0)
            over_prev = over.to(tl.int32)
        else:
            over_bits = over_bits | (over.to(tl.int32) << i)
    if EARLY:
        cand = (over_prev != 0) & (g_prev < 0)
        over_bits = over_bits | (cand.to(tl.int32) << tl.maximum(n_iter - 1, 0))
    for i in range(n_iter, TPP // BT):
        t = start + i * BT + tt
        tl.store(score_ptr + b * L + t, tl.full([BT], float("-inf"), tl.float32), mask=t < L)
    # ---- staging, only where some live score beats the threshold
    if tl.max((over_bits != 0).to(tl.int32), 0) > 0:
        _stage_program(b, start, seq_len, over_bits, bt_ptr + b * bt_stride, sl_ptr, h2g_ptr,
                       hstage_ptr, shost_ptr, ctr_ptr, epoch_ptr, pfs_ptr, src_ptr, dst_ptr, B,
                       cap, n_stage, ratio, TPP, BT, GLOBAL, BP, ROWS, TPP // BT * ROWS, ROW_W,
                       ROW_WP, EARLY)  # fmt: skip


@triton.jit
def claim_space(b, sl_ptr, ctr_ptr, B, cap, n_stage, ratio, GLOBAL: tl.constexpr,
                BP: tl.constexpr):  # fmt: skip
    """Where request ``b`` claims staging slots: (limit, its claim counter, its first slot).
    GLOBAL: one budget for all, floor(sum(seq_lens) x ratio) rows at most S, claimed through
    ctr[B] from slot 0 (prefetch_ref.stage_limit); else ``cap`` rows of request b's own range,
    claimed through ctr[b]."""
    if GLOBAL:
        bb = tl.arange(0, BP)
        ctx = tl.sum(tl.load(sl_ptr + bb, mask=bb < B, other=0).to(tl.float32), 0)
        limit = tl.minimum(tl.floor(ctx * ratio).to(tl.int32), n_stage)
        ctr = ctr_ptr + B
        slot0 = b * 0
    else:
        limit = cap + b * 0
        ctr = ctr_ptr + b
        slot0 = b * cap
    return limit, ctr, slot0


@triton.jit
def _stage_program(
    b, start, seq_len, over_bits, bt_row, sl_ptr, h2g_ptr, hstage_ptr, shost_ptr, ctr_ptr,
    epoch_ptr, pfs_ptr, src_ptr, dst_ptr, B, cap, n_stage, ratio, TPP: tl.constexpr,
    BT: tl.constexpr,
    GLOBAL: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, MAXROWS: tl.constexpr,
    ROW_W: tl.constexpr, ROW_WP: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Stage the candidates of one program's TPP tokens, whole-program vectors (one gather of the
    map, one claim atomic, so one chain of memory latencies instead of one per tile): at most
    MAXROWS rows (rows_per_block per score tile), copied host -> staging ROWS rows at a time.
    ``over_bits`` [BT]: bit i of lane j set where token start + i BT + j beat the threshold
    (EARLY: and is a candidate, the map already looked up)."""
    if EARLY:  # beside the page loads, off the claim's chain
        epoch = tl.load(epoch_ptr)
    limit, ctr, slot0 = claim_space(b, sl_ptr, ctr_ptr, B, cap, n_stage, ratio, GLOBAL, BP)
    t = start + tl.arange(0, TPP)
    live = t < seq_len
    # the pages are loaded beside the map's chain, not in it (16 distinct entries per program)
    page = tl.load(bt_row + t // _PAGE, mask=live, other=0)
    # the bits, unpacked: [i, j] -> token i BT + j (no read of the scores just stored; re-reading
    # them after a barrier made the fused indexer 0.06-2.2 us slower, benchmarks/results/
    # gpu_session27/call6_prefetch_post_vs_reload_h100.json)
    tiles = tl.arange(0, TPP // BT)
    over = live & (tl.reshape((over_bits[None, :] >> tiles[:, None]) & 1, [TPP]) != 0)
    h = page * _PAGE + t % _PAGE
    if EARLY:
        cand = over
    else:
        g = tl.load(h2g_ptr + h, mask=over, other=0)
        cand = over & (g < 0)
    ci = cand.to(tl.int32)
    nc = tl.sum(ci, 0)
    if nc > 0:
        claim = tl.minimum(nc, MAXROWS)  # claim only what this program copies: no holes
        base = tl.atomic_add(ctr, claim, sem="relaxed")
        n_keep = tl.minimum(tl.maximum(limit - base, 0), claim)
        lr = tl.cumsum(ci, 0) - 1  # rank among this program's candidates
        keep = cand & (lr < n_keep)
        slot = slot0 + base + lr
        # the tag: the next epoch (this call's; the epoch word is advanced after the top-k)
        if not EARLY:  # "post": read here, on the chain after the claim
            epoch = tl.load(epoch_ptr)
        tag = ((epoch + 1).to(tl.int64) << _SHIFT) | h.to(tl.int64)
        tl.store(shost_ptr + slot, tag, mask=keep)
        tl.store(hstage_ptr + h, slot, mask=keep)
        # the kept host slots are now compacted in stage_host[slot0 + base :][: n_keep] (tags:
        # the host slot is the low 32 bits)
        tl.debug_barrier()
        rr = tl.arange(0, ROWS)
        cols = tl.arange(0, ROW_WP)
        cmask = cols < ROW_W
        first = slot0 + base
        for j in range(0, n_keep, ROWS):
            r = j + rr
            rm = r < n_keep
            hj = tl.load(shost_ptr + first + r, mask=rm, other=0).to(tl.int32).to(tl.int64)
            sj = (first + r).to(tl.int64)
            m2 = rm[:, None] & cmask[None, :]
            v = tl.load(src_ptr + hj[:, None] * ROW_W + cols[None, :], mask=m2)
            tl.store(dst_ptr + sj[:, None] * ROW_W + cols[None, :], v, mask=m2)
        tl.atomic_add(pfs_ptr, nc.to(tl.int64), sem="relaxed")
        tl.atomic_add(pfs_ptr + _S_STAGED, n_keep.to(tl.int64), mask=n_keep > 0, sem="relaxed")


def index_scores_prefetch_post(*args, **kwargs) -> torch.Tensor:
    """``index_scores_prefetch`` (same arguments and result) with the
    ``"post"`` kernel."""
    return launch_scores_prefetch(_scores_prefetch_post_kernel, *args, EARLY=False, **kwargs)


def index_scores_prefetch_early(*args, **kwargs) -> torch.Tensor:
    """``index_scores_prefetch`` (same arguments and result) with the ``"early"`` kernel."""
    return launch_scores_prefetch(_scores_prefetch_post_kernel, *args, EARLY=True, **kwargs)


@triton.jit
def _scores_prefetch_kernel(
    q_ptr,
    w_ptr,
    kv_ptr,
    ks_ptr,
    bt_ptr,
    sl_ptr,
    score_ptr,
    ema_ptr,  # [N_H / 64 + 1] fp32: thresholds (ema[EMA_THR]), keyed by first host page
    h2g_ptr,  # [N_H] int32: the layer's host -> GPU map (read)
    hstage_ptr,  # [N_H] int32 out: staging slot of each staged host slot
    shost_ptr,  # [S] int64 out: tag (epoch << 32 | host slot) of each staging slot
    ctr_ptr,  # [>= B + 2] int32 zeros: claims per request, then the global claim counter
    epoch_ptr,  # [1] int32: the staging epoch E (stage_ctr's last word); tags carry E + 1
    pfs_ptr,  # [4] int64: prefetch statistics (candidates, staged)
    src_ptr,  # host_kv as int32 words [N_H, ROW_W] (UVA on CUDA)
    dst_ptr,  # stage_kv as int32 words [S, ROW_W]
    n_heads,
    bt_stride,
    L,
    B,
    cap,  # rows per request (not GLOBAL)
    n_stage,  # S
    ratio,  # GLOBAL: budget rows per context token
    HP: tl.constexpr,
    BT: tl.constexpr,
    TPP: tl.constexpr,
    STAGES: tl.constexpr,
    GLOBAL: tl.constexpr,
    BP: tl.constexpr,  # B padded to a power of two (the global budget's sum)
    ROWS: tl.constexpr,  # rows copied per score block, at most (a static unroll, no inner loop)
    ROW_W: tl.constexpr,
    ROW_WP: tl.constexpr,
):
    """``_scores_kernel`` plus ECHO's fused prefetch: each score block's candidates (score >
    threshold, not on the GPU) claim staging slots (one atomic per block) and up to ROWS of them
    are copied host -> staging right there, so the PCIe reads of one block overlap the scoring of
    the next (and of the other programs on the SM). Candidates past ROWS in one block, or past a
    cap, are simply not staged: the guaranteed recall fetches them later."""
    b = tl.program_id(0)
    start = tl.program_id(1) * TPP
    seq_len = tl.load(sl_ptr + b)
    hh = tl.arange(0, HP)
    dd = tl.arange(0, _DIM)
    tt = tl.arange(0, BT)
    hm = hh < n_heads
    q = tl.load(q_ptr + (b * n_heads + hh[:, None]) * _DIM + dd[None, :], mask=hm[:, None], other=0)
    q = q.to(tl.float8e4nv, bitcast=True)  # [HP, 128]
    w = tl.load(w_ptr + b * n_heads + hh, mask=hm, other=0.0)
    thr = tl.load(ema_ptr + tl.load(bt_ptr + b * bt_stride))  # padded rows: any, nothing is live
    limit, ctr, slot0 = claim_space(b, sl_ptr, ctr_ptr, B, cap, n_stage, ratio, GLOBAL, BP)
    rr = tl.arange(0, ROWS)
    cols = tl.arange(0, ROW_WP)
    cmask = cols < ROW_W
    n_live = tl.minimum(tl.maximum(seq_len - start, 0), TPP)
    n_iter = tl.cdiv(n_live, BT)
    n_cand = 0
    n_staged = 0
    for i in tl.range(0, n_iter, num_stages=STAGES):
        t = start + i * BT + tt
        live = t < seq_len
        page = tl.load(bt_ptr + b * bt_stride + t // _PAGE, mask=live, other=0).to(tl.int64)
        off = t % _PAGE
        k = tl.load(
            kv_ptr + page[:, None] * _PAGE_BYTES + off[:, None] * _DIM + dd[None, :],
            mask=live[:, None],
            other=0,
        )
        ks = tl.load(ks_ptr + page * _PAGE_F32 + _SCALE_OFF + off, mask=live, other=0.0)
        logits = tl.dot(k.to(tl.float8e4nv, bitcast=True), tl.trans(q))  # [BT, HP] fp32
        s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * ks
        s = tl.where(live, s, float("-inf"))
        tl.store(score_ptr + b * L + t, s, mask=t < L)
        # ---- prefetch: only blocks with tokens above the threshold touch the map, and only
        # blocks with candidates the counters and the host (scalar branches: a block with
        # nothing to stage issues none of the copy's instructions)
        over = live & (s > thr)
        if tl.sum(over.to(tl.int32), 0) > 0:
            h = (page * _PAGE + off).to(tl.int32)
            g = tl.load(h2g_ptr + h, mask=over, other=0)
            cand = over & (g < 0)
            ci = cand.to(tl.int32)
            nc = tl.sum(ci, 0)
            if nc > 0:
                n_cand += nc
                claim = tl.minimum(nc, ROWS)  # claim only what this block can copy: no holes
                base = tl.atomic_add(ctr, claim, sem="relaxed")
                lr = tl.cumsum(ci, 0) - 1  # rank among this block's candidates
                n_keep = tl.minimum(tl.maximum(limit - base, 0), claim)
                keep = cand & (lr < n_keep)
                slot = slot0 + base + lr
                n_staged += n_keep
                tag = ((tl.load(epoch_ptr) + 1).to(tl.int64) << _SHIFT) | h.to(tl.int64)
                tl.store(shost_ptr + slot, tag, mask=keep)
                tl.store(hstage_ptr + h, slot, mask=keep)
                # the kept candidates' rows, compacted by rank: copy row j = candidate lr == j
                pick = keep[:, None] & (lr[:, None] == rr[None, :])  # [BT, ROWS]
                hj = tl.sum(tl.where(pick, h[:, None], 0), axis=0).to(tl.int64)  # [ROWS]
                sj = tl.sum(tl.where(pick, slot[:, None], 0), axis=0).to(tl.int64)
                m2 = (rr < n_keep)[:, None] & cmask[None, :]
                v = tl.load(src_ptr + hj[:, None] * ROW_W + cols[None, :], mask=m2)
                tl.store(dst_ptr + sj[:, None] * ROW_W + cols[None, :], v, mask=m2)
    for i in range(n_iter, TPP // BT):
        t = start + i * BT + tt
        tl.store(score_ptr + b * L + t, tl.full([BT], float("-inf"), tl.float32), mask=t < L)
    tl.atomic_add(pfs_ptr, n_cand.to(tl.int64), mask=n_cand > 0, sem="relaxed")
    tl.atomic_add(pfs_ptr + _S_STAGED, n_staged.to(tl.int64), mask=n_staged > 0, sem="relaxed")


def index_scores_prefetch(*args, **kwargs) -> torch.Tensor:
    """Index scores [B, P*64] fp32 as ``index_scores``, staging candidates on the way
    (``_scores_prefetch_kernel``; semantics in custom_ops/prefetch_ref.py; arguments as
    ``launch_scores_prefetch`` after its kernel)."""
    return launch_scores_prefetch(_scores_prefetch_kernel, *args, **kwargs)


def launch_scores_prefetch(
    kernel,  # a fused scores + prefetch kernel (this one's or prefetch_scores' "post")
    q_u8: torch.Tensor,  # [B, Hi, 128] uint8
    weights: torch.Tensor,  # [B, Hi] fp32
    index_cache: torch.Tensor,  # [pages, 8448] uint8
    block_table: torch.Tensor,  # [B, P] int32 (unit stride along pages)
    seq_lens: torch.Tensor,  # [B] int32
    host_words: torch.Tensor,  # host_kv as int32 [N_H, row / 4]
    host_to_gpu: torch.Tensor,  # [N_H] int32
    stage_words: torch.Tensor,  # stage_kv as int32 [S, row / 4]
    stage_host: torch.Tensor,  # [S] int64 tags
    host_stage: torch.Tensor,  # [N_H] int32
    stage_ctr: torch.Tensor,  # [>= B + 2] int32: zero claim counters, the epoch last
    ema: torch.Tensor,  # [N_H / 64 + 1] fp32: the thresholds, ema[EMA_THR] (prefetch_layout)
    pf_stats: torch.Tensor,  # [4] int64
    cap: int,
    ratio: float,
    cfg: IndexerConfig,
    rows_per_block: int = 8,
    **consts,  # the kernel's own constexprs (the post kernel's EARLY)
) -> torch.Tensor:
    """The launch every fused scores + prefetch kernel shares (same arguments, same grid)."""
    B, n_heads = q_u8.shape[:2]
    L = block_table.shape[1] * PAGE
    if cfg.score_tokens % cfg.score_block or cfg.score_block % 16:
        raise ValueError("score_tokens must be a multiple of score_block, itself of 16")
    if kernel is _scores_prefetch_post_kernel and cfg.score_tokens // cfg.score_block > 32:
        raise ValueError(  # its bits of the tiles above the threshold are one int32 a lane
            f"the post prefetch kernel takes at most 32 score blocks a program: score_tokens / "
            f"score_block = {cfg.score_tokens // cfg.score_block}"
        )
    if rows_per_block <= 0 or rows_per_block & (rows_per_block - 1):
        raise ValueError(f"rows_per_block must be a power of two, got {rows_per_block}")
    scores = torch.empty((B, L), dtype=torch.float32, device=q_u8.device)
    row_w = host_words.shape[1]
    grid = (B, triton.cdiv(L, cfg.score_tokens))
    kernel[grid](
        q_u8.contiguous(), weights.contiguous(), index_cache, index_cache.view(torch.float32),
        block_table, seq_lens, scores, ema, host_to_gpu, host_stage, stage_host, stage_ctr,
        stage_ctr[-1:], pf_stats, host_words, stage_words, n_heads, block_table.stride(0), L, B,
        cap, stage_words.shape[0], float(ratio), HP=max(16, triton.next_power_of_2(n_heads)),
        BT=cfg.score_block, TPP=cfg.score_tokens, STAGES=cfg.score_stages, GLOBAL=ratio > 0,
        BP=max(2, triton.next_power_of_2(B)), ROWS=rows_per_block, ROW_W=row_w,
        ROW_WP=triton.next_power_of_2(row_w), num_warps=cfg.score_warps, **consts,
    )  # fmt: skip
    return scores


SCORES_VARIANTS = {
    "tile": index_scores_prefetch,
    "post": index_scores_prefetch_post,
    "early": index_scores_prefetch_early,
}


def scores_variant(name: str | None):
    """The launcher of a variant by name (None: the default)."""
    name = DEFAULT_VARIANT if name is None else name
    if name not in SCORES_VARIANTS:
        raise ValueError(
            f"unknown prefetch scores variant {name!r}: one of {list(SCORES_VARIANTS)}"
        )
    return SCORES_VARIANTS[name]
