"""CUDA side of ``echo::dg_prefill_logits`` and of the DeepGEMM logits step of
``echo::prefill_indexer_topk`` (custom_ops/backends/deep_gemm_prefill.py says what the library
takes): the gather of a request's keys into DeepGEMM's contiguous layout, the library call, and
the causal clean-up. Triton kernels (graph-safe: static grids, no host reads); they also run on
CPU tensors under TRITON_INTERPRET=1, which the CPU tests use for the gather and the clean-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.backends.deep_gemm_ops import _lib, prefill_logits_width
from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE

_VALS32 = tl.constexpr(PAGE * INDEX_DIM // 4)  # a page's values, in int32 words (2048)
_PAGE32 = tl.constexpr(INDEX_PAGE_BYTES // 4)  # a page, in int32 words (2112)
_PAGE_T = tl.constexpr(PAGE)
CLEAN_BLOCK = 1024  # columns per clean-up program (4 KB of -inf stores)


@triton.jit
def _gather_kernel(cache32_ptr, bt_ptr, kv32_ptr, sf32_ptr):
    """One program per page of the request: its 8 KB of values and 256 B of scales, copied as
    int32 words (the values are bytes, the scales fp32: a bit copy either way)."""
    i = tl.program_id(0)
    page = tl.load(bt_ptr + i).to(tl.int64)
    src = cache32_ptr + page * _PAGE32
    w = tl.arange(0, _VALS32)
    tl.store(kv32_ptr + i.to(tl.int64) * _VALS32 + w, tl.load(src + w))
    s = tl.arange(0, _PAGE_T)
    tl.store(sf32_ptr + i.to(tl.int64) * _PAGE_T + s, tl.load(src + _VALS32 + s))


def gather_index_keys(
    index_cache: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_index_keys_ref`` in one launch: values uint8 ``[P*64, 128]``, scales fp32
    ``[P*64]``, both contiguous (what ``fp8_mqa_logits`` asserts)."""
    if not index_cache.is_contiguous() or index_cache.shape[-1] != INDEX_PAGE_BYTES:
        raise ValueError(
            f"gather_index_keys: index cache must be contiguous [pages, {INDEX_PAGE_BYTES}]"
        )
    P = block_table.shape[1]
    kv = torch.empty((P * PAGE, INDEX_DIM), dtype=torch.uint8, device=index_cache.device)
    sf = torch.empty((P * PAGE,), dtype=torch.float32, device=index_cache.device)
    if P:
        _gather_kernel[(P,)](
            index_cache.view(torch.int32), block_table[0].contiguous(), kv.view(torch.int32),
            sf.view(torch.int32), num_warps=4,
        )  # fmt: skip
    return kv, sf


@triton.jit
def _clean_kernel(score_ptr, pos_ptr, W, BLOCK: tl.constexpr):
    """-inf at every column t > p of row q; a block wholly at or before p is not touched."""
    q = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK
    p = tl.load(pos_ptr + q)
    if t0 + BLOCK - 1 > p:
        t = t0 + tl.arange(0, BLOCK)
        m = (t < W) & (t > p)
        tl.store(score_ptr + q.to(tl.int64) * W + t, tl.full([BLOCK], float("-inf"), tl.float32),
                 mask=m)  # fmt: skip


def causal_clean(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Writes -inf at ``scores[q, t]`` for t > positions[q], in place (contiguous ``[Q, W]``)."""
    Q, W = scores.shape
    if Q and W:
        grid = (Q, triton.cdiv(W, CLEAN_BLOCK))
        _clean_kernel[grid](scores, positions.contiguous(), W, BLOCK=CLEAN_BLOCK, num_warps=4)
    return scores


def num_sms() -> int:
    """The SMs DeepGEMM's persistent kernels launch on (its own setting)."""
    return int(_lib().get_num_sms())


def query_rows(W: int, T: int, budget: int, heads: int, num_sms: int) -> int:
    """Queries per ``fp8_mqa_logits`` call: its persistent grid gives each of ``num_sms`` SMs
    blocks of 128 / heads queries in turn, so a call of ``num_sms`` x 128 / heads rows fills
    whole waves (at 100K a 2^25-element budget allows 335 rows: 168 blocks, 1.3 waves of 132
    SMs, when 264 rows are one). The largest multiple of that within ``budget`` fp32 scores of
    width W; past the point where one wave exceeds the budget (W > ~127K at 64 heads), the
    Triton path's rows (``score_rows``: 16 at least). From static shapes only."""
    unit = max(1, 128 // heads) * num_sms
    rows = budget // max(W, 1) // unit * unit
    if rows == 0:
        rows = max(16, budget // max(W, 1) // 16 * 16)
    return max(1, min(T, rows))


def prefill_scores(
    q_fp8: torch.Tensor,  # [Q, H, 128] uint8 (e4m3 bytes), H in HEADS
    weights: torch.Tensor,  # [Q, H] fp32
    kv: torch.Tensor,  # [L, 128] uint8: the request's keys by position (gather_index_keys)
    sf: torch.Tensor,  # [L] fp32
    positions: torch.Tensor,  # [Q] int64
    width: int,  # prefill_logits_width(L)
    clean: bool,
) -> torch.Tensor:
    """DeepGEMM's scores ``[Q, width]`` fp32 of each query over keys t <= p (compressed logits
    with ks = 0: column t is key t). ``clean``: -inf past each p, else those entries are
    unspecified (a top-k reading t < p + 1 only needs no clean-up)."""
    Q = q_fp8.shape[0]
    L = kv.shape[0]
    if width != prefill_logits_width(L):
        raise ValueError(f"prefill_scores: width {width} must be {prefill_logits_width(L)}")
    if Q == 0:  # the library indexes query seq_len - 1
        return torch.empty((0, width), dtype=torch.float32, device=q_fp8.device)
    q = q_fp8.contiguous().view(torch.float8_e4m3fn)  # [Q, H, 128]
    ks = torch.zeros((Q,), dtype=torch.int32, device=q.device)
    ke = (positions + 1).clamp(min=0, max=L).to(torch.int32)
    out = _lib().fp8_mqa_logits(
        q, (kv.view(torch.float8_e4m3fn), sf), weights.contiguous(), ks, ke, False, width
    )
    if out.shape != (Q, width):
        raise RuntimeError(
            f"deep_gemm.fp8_mqa_logits returned {list(out.shape)}, not [{Q}, {width}]"
        )
    if out.stride() != (width, 1):
        # NOTE: every version read returns this layout; a build that does not gets a copy
        # (correct, slower) rather than a tensor the fake's strides would misdescribe
        out = out.contiguous()
    return causal_clean(out, positions) if clean else out
