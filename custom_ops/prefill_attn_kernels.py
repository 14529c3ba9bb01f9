"""Triton kernel of ``echo::sparse_mla_prefill`` (the CUDA implementation of
``sparse_mla_prefill_ref``): the T queries of one request's chunk, each over its own selected rows
of the request's context ``rows [L, row]`` (by position), in the absorbed form.

What differs from reusing the decode kernel (custom_ops/attention_kernels.py), and why:
- **One program per (query, block of heads), no split of the selected list**: a 2048-query chunk
  with 128 heads is 4096 programs, enough for the 132 SMs; no partial accumulators and no combine.
  Each gathered row serves a whole block of heads (``[heads, 576] x [576, BLOCK_K]`` on the tensor
  cores), as in decode; the working set is one block of rows and the ``[heads, 512]`` fp32
  accumulator, whatever L is.
- **The head blocks of one query are neighbours in the grid** (head block fastest), so they run
  together and read the query's selected rows from L2 once for all its heads.
- **Trailing unused entries are skipped**: a program first finds its query's last valid entry and
  stops there. A block of only -1 entries leaves the online softmax unchanged (max and sum as they
  were, nothing added), so this is exact; it saves the causal half of the work of the first
  ``index_topk`` positions (whose selection is their prefix, -1 padded).
- **FP8 rows are dequantised once per call** (``dequant_first``): ``_dequant_kernel`` writes the
  context as bf16 rows (``[L, 1152]``, the same values the in-loop dequantisation gives: e4m3 *
  the fp32 scale of each 128 columns, rounded to bf16), and the attention loop then reads plain
  bf16 rows. The decode kernel dequantises every gathered row in registers for every (query, head
  block) that selects it: with 2048 queries selecting from the same context that is the same
  rows dequantised thousands of times. The extra memory is ``L * 1152`` bytes, bounded by the
  context, never by ``T * L``.
The loop is the decode kernel's (``attention_kernels._attend``, one jit function inlined into
both) without splits: outputs equal
``sparse_mla_decode_cuda`` with ``n_split=1`` bit for bit (tests/test_prefill_attn.py).
Few programs (a short chunk): the decode kernel with its splits fills the GPU better, so the
launcher hands such calls to it (a static choice, from shapes only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from custom_ops import attention_kernels as ak
from custom_ops.kv_format import KV_LORA, ROPE, ROW_BYTES, check_fmt

_LOG2E = math.log2(math.e)
_BF16_ROW = ROW_BYTES["bf16"]
_FP8_ROW = tl.constexpr(ROW_BYTES["fp8"])
_LORA = tl.constexpr(KV_LORA)
_OUT_ROW = tl.constexpr(KV_LORA + ROPE)  # bf16 elements of a dequantised row


@dataclass(frozen=True)
class PrefillAttnConfig:
    """Launch shapes. Defaults by reasoning from the decode kernel's H200 sweep
    (benchmarks/results/decode_kernels_h200.json: bf16 rows with 3 stages 227 TFLOP/s, fp8 rows
    195): bf16 rows (dequantised first), 64 heads x 64 rows, 8 warps, 3 stages. The bench
    (``python -m benchmarks.bench_prefill``) times the alternatives side by side; tests use
    small ones."""

    block_h: int = 64  # heads per program (wgmma M; fewer heads are padded up to 16)
    block_k: int = 64  # selected rows per iteration
    num_warps: int = 8
    num_stages: int = 3
    dequant_first: bool = True  # fp8 rows: dequantise the context once, then read bf16 rows
    min_programs: int | None = None  # fewer (query, head block) programs: the decode kernel
    dequant_rows: int = 32  # rows per program of the dequantisation
    scan: int = 1024  # selected entries per step of the search for the last valid one


@triton.jit
def _dequant_kernel(
    u8_ptr, bf_ptr, f32_ptr, out_ptr, hi_ptr, L, BL: tl.constexpr, EMU: tl.constexpr
):
    """fp8 rows [L, 656] -> bf16 rows [L, 576]: the decode kernel's in-loop dequantisation. Rows
    past ``hi`` (the largest selected position, read on the device) are never gathered: left
    unwritten, so a short prompt under a long compiled context limit converts only its prefix."""
    start = tl.program_id(0) * BL
    if start > tl.load(hi_ptr):
        return
    rr = start + tl.arange(0, BL)
    valid = rr < L
    row = tl.where(valid, rr, 0).to(tl.int64)
    dd = tl.arange(0, 128)
    dr = tl.arange(0, 64)
    out = out_ptr + row[:, None] * _OUT_ROW
    for j in tl.static_range(4):
        v = ak._load_nope(u8_ptr, bf_ptr, f32_ptr, row, valid, j, True, _FP8_ROW, EMU)
        tl.store(out + j * 128 + dd[None, :], v, mask=valid[:, None])
    # the rope part is bf16 already (the last 128 bytes of the row): copied
    rope = tl.load(bf_ptr + row[:, None] * (_FP8_ROW // 2) + (_FP8_ROW // 2 - 64) + dr[None, :],
                   mask=valid[:, None], other=0.0)  # fmt: skip
    tl.store(out + _LORA + dr[None, :], rope, mask=valid[:, None])


def dequant_rows(
    rows: torch.Tensor, cfg: PrefillAttnConfig | None = None, hi: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8 rows uint8 ``[L, 656]`` -> bf16 rows uint8 ``[L, 1152]`` (``unpack_kv_rows``'s values,
    in the bf16 row format). ``hi`` (a device int32 scalar): only rows up to it are written (the
    rest of the output is uninitialised); None: all."""
    cfg = cfg or PrefillAttnConfig()
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != ROW_BYTES["fp8"]:
        raise ValueError(f"dequant_rows: rows must be uint8 [L, {ROW_BYTES['fp8']}] (fp8 rows)")
    rows = rows.contiguous()
    L = rows.shape[0]
    out = torch.empty((L, KV_LORA + ROPE), dtype=torch.bfloat16, device=rows.device)
    if hi is None:
        hi = torch.full((), L, dtype=torch.int32, device=rows.device)
    if L:
        _dequant_kernel[(triton.cdiv(L, cfg.dequant_rows),)](
            rows, rows.view(torch.bfloat16), rows.view(torch.float32), out, hi, L,
            BL=cfg.dequant_rows, EMU=not rows.is_cuda,
            num_warps=4,
        )  # fmt: skip
    return out.view(torch.uint8)


@triton.jit
def _prefill_attn_kernel(
    q_ptr,  # [T, H, 576] bf16
    bf_ptr,  # rows as bf16 [L, ROW/2]
    u8_ptr,  # rows as uint8 [L, ROW]
    f32_ptr,  # rows as fp32 [L, ROW/4] (fp8 rows: the scales)
    sel_ptr,  # [T, K] int32 positions, -1 = unused
    out_ptr,  # [T, H, 512] bf16
    H,
    K,
    n_hb,
    q_sb,
    q_sh,
    s_sb,
    qk_scale,  # softmax_scale * log2(e)
    FP8: tl.constexpr,
    ROW: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    SCAN: tl.constexpr,
    F32_DOT: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // n_hb  # head block fastest: a query's head blocks run side by side
    hh = (pid % n_hb) * BH + tl.arange(0, BH)
    hm = hh < H
    sel_row = sel_ptr + b.to(tl.int64) * s_sb
    # the last valid entry + 1: every block after it is all -1 (leaves the softmax state as it is)
    last = tl.zeros([SCAN], tl.int32)
    for s0 in range(0, K, SCAN):
        ss = s0 + tl.arange(0, SCAN)
        e = tl.load(sel_row + ss, mask=ss < K, other=-1)
        last = tl.maximum(last, tl.where(e >= 0, ss + 1, 0))
    k_hi = tl.max(last, 0)
    m_i, l_i, a0, a1, a2, a3 = ak._attend(
        q_ptr + b.to(tl.int64) * q_sb + hh[:, None] * q_sh, hm, u8_ptr, bf_ptr, f32_ptr, sel_row,
        0, k_hi, qk_scale, FP8, ROW, BH, BK, F32_DOT, STAGES,
    )  # fmt: skip
    dd = tl.arange(0, 128)
    inv = 1.0 / tl.maximum(l_i, 1e-30)  # no valid row: l = 0 and the accumulator is 0
    o = out_ptr + (b.to(tl.int64) * H + hh)[:, None] * 512 + dd[None, :]
    tl.store(o, ak._bf16(a0 * inv[:, None], F32_DOT), mask=hm[:, None])
    tl.store(o + 128, ak._bf16(a1 * inv[:, None], F32_DOT), mask=hm[:, None])
    tl.store(o + 256, ak._bf16(a2 * inv[:, None], F32_DOT), mask=hm[:, None])
    tl.store(o + 384, ak._bf16(a3 * inv[:, None], F32_DOT), mask=hm[:, None])


def sparse_mla_prefill_attn(
    q: torch.Tensor,  # [T, H, 576] bf16
    rows: torch.Tensor,  # [L, row] uint8: the request's rows by position
    sel: torch.Tensor,  # [T, K] int32 positions, -1 = unused
    softmax_scale: float,
    fmt: str,
    cfg: PrefillAttnConfig | None = None,
) -> torch.Tensor:
    """``echo::sparse_mla_prefill`` on the GPU (or on CPU tensors under TRITON_INTERPRET=1):
    bf16 ``[T, H, 512]``, the semantics of ``sparse_mla_prefill_ref``."""
    cfg = cfg or PrefillAttnConfig()
    check_fmt(fmt)
    row = ROW_BYTES[fmt]
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[-1] != KV_LORA + ROPE:
        raise ValueError(f"sparse_mla_prefill_attn: q must be bf16 [T, H, 576], got {q.dtype}")
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != row:
        raise ValueError(f"sparse_mla_prefill_attn: rows must be uint8 [L, {row}] for {fmt}")
    if sel.dtype != torch.int32 or sel.dim() != 2 or sel.shape[0] != q.shape[0]:
        raise ValueError("sparse_mla_prefill_attn: sel must be int32 [T, K]")
    if q.is_cuda and not (rows.is_cuda and sel.is_cuda):
        raise ValueError("sparse_mla_prefill_attn: all tensors must be on the GPU")
    if cfg.block_h % 16 or cfg.block_k % 16:
        raise ValueError("PrefillAttnConfig: block_h and block_k must be multiples of 16")
    T, H, _ = q.shape
    K = sel.shape[1]
    bh = min(cfg.block_h, max(16, triton.next_power_of_2(H)))
    n_hb = triton.cdiv(H, bh)
    min_programs = cfg.min_programs if cfg.min_programs is not None else ak._sm_count(q.device)
    if T * n_hb < min_programs:  # static: a short chunk fills the GPU better with splits
        return ak.sparse_mla_decode_cuda(q, rows, sel, softmax_scale, fmt)
    out = torch.empty((T, H, KV_LORA), dtype=torch.bfloat16, device=q.device)
    if T == 0 or H == 0:
        return out
    rows = rows.contiguous()  # row addressing below assumes packed rows
    if fmt == "fp8" and cfg.dequant_first:
        # only the prefix any query selects (a device max: no host sync)
        hi = sel.amax().to(torch.int32) if sel.numel() else None
        rows, fmt, row = dequant_rows(rows, cfg, hi), "bf16", _BF16_ROW
    if q.stride(2) != 1:
        q = q.contiguous()
    sel = sel if sel.stride(1) == 1 else sel.contiguous()
    _prefill_attn_kernel[(T * n_hb,)](
        q, rows.view(torch.bfloat16), rows, rows.view(torch.float32), sel, out,
        H, K, n_hb, q.stride(0), q.stride(1), sel.stride(0), softmax_scale * _LOG2E,
        FP8=fmt == "fp8", ROW=row, BH=bh, BK=cfg.block_k,
        SCAN=min(cfg.scan, triton.next_power_of_2(max(K, 1))), F32_DOT=not q.is_cuda,
        STAGES=cfg.num_stages, num_warps=cfg.num_warps if bh >= 64 else 4,
    )  # fmt: skip
    return out
