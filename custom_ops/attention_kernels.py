"""Triton kernel of ``echo::sparse_mla_decode`` (the CUDA implementation of
``sparse_mla_decode_ref``): MLA decode attention in the absorbed form over gathered pool rows.

One program per (request, block of heads, split of the selected list). It walks its part of the
selected list in list order, BLOCK_K rows at a time: gathers the rows by slot (bf16 rows, or fp8
rows dequantised here: e4m3 * the fp32 scale of each 128 columns, rope part bf16), computes the
scores of all its heads at once (``[heads, 576] x [576, BLOCK_K]`` on the tensor cores, so each
gathered row serves every head of the block), and keeps an fp32 online softmax with the output
accumulator ``[heads, 512]``. The 512 latent columns are handled as four blocks of 128: a block's
fp8 values share one scale, so the dequantisation is one multiply by a per-row scale.

With several splits (few requests: more programs to fill the GPU), each split writes its
unnormalised accumulator and (max, sum), and ``_combine_kernel`` merges the splits in split
order. Split points depend on K and the configuration only, so the reduction order depends only
on the order of the selected list: the result is the same whatever pool slots hold the rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from custom_ops.kv_format import KV_LORA, ROPE, ROW_BYTES, check_fmt

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class MlaConfig:
    """Launch shapes. Defaults are the H200 choice; tests use small ones."""

    block_h: int = 64  # heads per program (wgmma M; fewer heads are padded up to 16)
    block_k: int = 64  # selected rows per iteration
    num_warps: int = 8
    num_stages: int = 2
    n_split: int | None = None  # splits of the selected list; None: enough programs for the SMs


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _mm(a, b, acc, F32: tl.constexpr):
    # NOTE: Triton's interpreter mishandles bf16 tl.dot, so CPU runs multiply the same bf16
    # values in fp32 (bf16 products are exact in fp32: only the summation order differs).
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _bf16(x, EMU: tl.constexpr):
    """fp32 -> bf16, round to nearest even. NOTE: Triton's interpreter truncates instead, so CPU
    runs (EMU) round the fp32 bits first; the truncation is then exact (NaN/inf never reach it)."""
    if EMU:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _load_nope(
    u8_ptr,
    bf_ptr,
    f32_ptr,
    row,
    valid,
    j: tl.constexpr,
    FP8: tl.constexpr,
    ROW: tl.constexpr,
    EMU: tl.constexpr,
):
    """Columns j*128 .. j*128+127 of the latent of the gathered rows, bf16 [BLOCK_K, 128]."""
    dd = tl.arange(0, 128)
    vm = valid[:, None]
    if FP8:
        v = tl.load(u8_ptr + row[:, None] * ROW + j * 128 + dd[None, :], mask=vm, other=0)
        sc = tl.load(f32_ptr + row * (ROW // 4) + 128 + j, mask=valid, other=0.0)
        # the reference's act_dequant: fp32 value * scale, then bf16
        return _bf16(v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None], EMU)
    else:
        return tl.load(
            bf_ptr + row[:, None] * (ROW // 2) + j * 128 + dd[None, :], mask=vm, other=0.0
        )


@triton.jit
def _attend(
    q_row,  # the query's first head of this block: [BH, 576] bf16 at q_row + h * q_sh
    hm,  # [BH] live heads
    u8_ptr,
    bf_ptr,
    f32_ptr,
    sel_row,  # this query's selected rows: int32, -1 = unused
    k_lo,
    k_hi,  # the entries [k_lo, k_hi) of sel_row
    qk_scale,
    FP8: tl.constexpr,
    ROW: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    F32_DOT: tl.constexpr,
    STAGES: tl.constexpr,
):
    """One (query, head block) over some of its selected rows, in the absorbed form: the online
    softmax state (m [BH], l [BH]) and the four fp32 [BH, 128] quarters of the unnormalised
    output. The one loop of the decode and the prefill kernels (inlined into each)."""
    dd = tl.arange(0, 128)
    dr = tl.arange(0, 64)
    q0 = tl.load(q_row + dd[None, :], mask=hm[:, None], other=0.0)
    q1 = tl.load(q_row + 128 + dd[None, :], mask=hm[:, None], other=0.0)
    q2 = tl.load(q_row + 256 + dd[None, :], mask=hm[:, None], other=0.0)
    q3 = tl.load(q_row + 384 + dd[None, :], mask=hm[:, None], other=0.0)
    qr = tl.load(q_row + 512 + dr[None, :], mask=hm[:, None], other=0.0)
    # finite start: a block of only invalid rows gives p = 0 and alpha = 1, never NaN
    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    a0 = tl.zeros([BH, 128], tl.float32)
    a1 = tl.zeros([BH, 128], tl.float32)
    a2 = tl.zeros([BH, 128], tl.float32)
    a3 = tl.zeros([BH, 128], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        kk = k0 + tl.arange(0, BK)
        slot = tl.load(sel_row + kk, mask=kk < k_hi, other=-1)
        valid = slot >= 0
        row = tl.where(valid, slot, 0).to(tl.int64)
        # invalid rows load as zeros: p = 0 times a garbage row could still give NaN
        k0_ = _load_nope(u8_ptr, bf_ptr, f32_ptr, row, valid, 0, FP8, ROW, F32_DOT)
        k1_ = _load_nope(u8_ptr, bf_ptr, f32_ptr, row, valid, 1, FP8, ROW, F32_DOT)
        k2_ = _load_nope(u8_ptr, bf_ptr, f32_ptr, row, valid, 2, FP8, ROW, F32_DOT)
        k3_ = _load_nope(u8_ptr, bf_ptr, f32_ptr, row, valid, 3, FP8, ROW, F32_DOT)
        rope_at = ROW // 2 - 64  # bf16 units: rope is the last 128 bytes of both formats
        kr = tl.load(
            bf_ptr + row[:, None] * (ROW // 2) + rope_at + dr[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        s = tl.zeros([BH, BK], tl.float32)
        s = _mm(q0, tl.trans(k0_), s, F32_DOT)
        s = _mm(q1, tl.trans(k1_), s, F32_DOT)
        s = _mm(q2, tl.trans(k2_), s, F32_DOT)
        s = _mm(q3, tl.trans(k3_), s, F32_DOT)
        s = _mm(qr, tl.trans(kr), s, F32_DOT)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pb = _bf16(p, F32_DOT)
        a0 = _mm(pb, k0_, a0 * alpha[:, None], F32_DOT)
        a1 = _mm(pb, k1_, a1 * alpha[:, None], F32_DOT)
        a2 = _mm(pb, k2_, a2 * alpha[:, None], F32_DOT)
        a3 = _mm(pb, k3_, a3 * alpha[:, None], F32_DOT)
        m_i = m_new
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _sparse_mla_kernel(
    q_ptr,  # [B, H, 576] bf16
    bf_ptr,  # pool as bf16 [N, ROW/2]
    u8_ptr,  # pool as uint8 [N, ROW]
    f32_ptr,  # pool as fp32 [N, ROW/4] (fp8 rows: the scales)
    slot_ptr,  # [B, K] int32
    out_ptr,  # [B, H, 512] bf16 (one split)
    part_ptr,  # [B, H, n_split, 512] fp32 (several splits)
    ml_ptr,  # [B, H, n_split, 2] fp32
    H,
    K,
    k_split,
    q_sb,
    q_sh,
    s_sb,
    qk_scale,  # softmax_scale * log2(e)
    FP8: tl.constexpr,
    ROW: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr,
    STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    sp = tl.program_id(2)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hh < H
    dd = tl.arange(0, 128)
    k_lo = sp * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    m_i, l_i, a0, a1, a2, a3 = _attend(
        q_ptr + b * q_sb + hh[:, None] * q_sh, hm, u8_ptr, bf_ptr, f32_ptr, slot_ptr + b * s_sb,
        k_lo, k_hi, qk_scale, FP8, ROW, BH, BK, F32_DOT, STAGES,
    )  # fmt: skip
    if SPLIT:
        n_split = tl.num_programs(2)
        base = (b * H + hh) * n_split + sp
        po = part_ptr + base[:, None] * 512 + dd[None, :]
        tl.store(po, a0, mask=hm[:, None])
        tl.store(po + 128, a1, mask=hm[:, None])
        tl.store(po + 256, a2, mask=hm[:, None])
        tl.store(po + 384, a3, mask=hm[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=hm)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=hm)
    else:
        inv = 1.0 / tl.maximum(l_i, 1e-30)  # no valid row: l = 0 and the accumulator is 0
        o = out_ptr + (b * H + hh)[:, None] * 512 + dd[None, :]
        tl.store(o, _bf16(a0 * inv[:, None], F32_DOT), mask=hm[:, None])
        tl.store(o + 128, _bf16(a1 * inv[:, None], F32_DOT), mask=hm[:, None])
        tl.store(o + 256, _bf16(a2 * inv[:, None], F32_DOT), mask=hm[:, None])
        tl.store(o + 384, _bf16(a3 * inv[:, None], F32_DOT), mask=hm[:, None])


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, out_ptr, n_split, NS: tl.constexpr, EMU: tl.constexpr):
    """Merge the splits of one (request, head), in split order."""
    bh = tl.program_id(0)
    ss = tl.arange(0, NS)
    sm = ss < n_split
    dd = tl.arange(0, 512)
    m = tl.load(ml_ptr + (bh * n_split + ss) * 2, mask=sm, other=float("-inf"))
    l = tl.load(ml_ptr + (bh * n_split + ss) * 2 + 1, mask=sm, other=0.0)
    mx = tl.max(m, 0)  # >= -1e30: every real split starts from that finite value
    w = tl.exp2(m - mx)
    denom = tl.maximum(tl.sum(w * l, 0), 1e-30)
    o = tl.load(
        part_ptr + (bh * n_split + ss[:, None]) * 512 + dd[None, :], mask=sm[:, None], other=0.0
    )
    o = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + bh * 512 + dd, _bf16(o, EMU))


def sparse_mla_decode_cuda(
    q: torch.Tensor,  # [B, H, 576] bf16
    pool: torch.Tensor,  # [N, row] uint8
    slots: torch.Tensor,  # [B, K] int32, -1 = unused
    softmax_scale: float,
    fmt: str,
    cfg: MlaConfig | None = None,
) -> torch.Tensor:
    """``echo::sparse_mla_decode`` on the GPU (or on CPU tensors under TRITON_INTERPRET=1):
    bf16 [B, H, 512], the semantics of ``sparse_mla_decode_ref``."""
    cfg = cfg or MlaConfig()
    check_fmt(fmt)
    row = ROW_BYTES[fmt]
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[-1] != KV_LORA + ROPE:
        raise ValueError(f"sparse_mla_decode_cuda: q must be bf16 [B, H, 576], got {q.dtype}")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != row or pool.stride(1) != 1:
        raise ValueError(f"sparse_mla_decode_cuda: pool must be uint8 [N, {row}] with unit stride")
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[0] != q.shape[0]:
        raise ValueError("sparse_mla_decode_cuda: slots must be int32 [B, K]")
    if q.is_cuda and not (pool.is_cuda and slots.is_cuda):
        raise ValueError("sparse_mla_decode_cuda: all tensors must be on the GPU")
    if pool.stride(0) != row:
        pool = pool.contiguous()  # row addressing below assumes packed rows
    if q.stride(2) != 1:
        q = q.contiguous()
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    B, H, _ = q.shape
    K = slots.shape[1]
    bh = min(cfg.block_h, max(16, triton.next_power_of_2(H)))
    bk = cfg.block_k
    n_hb = triton.cdiv(H, bh)
    if cfg.n_split is not None:
        n_split = cfg.n_split
    else:  # static: from shapes and the SM count, never from device values
        n_split = max(1, min(_sm_count(q.device) // max(B * n_hb, 1), K // (4 * bk)))
    k_split = triton.cdiv(triton.cdiv(max(K, 1), n_split), bk) * bk
    n_split = triton.cdiv(max(K, 1), k_split)
    out = torch.empty((B, H, KV_LORA), dtype=torch.bfloat16, device=q.device)
    if B == 0 or H == 0:
        return out
    split = n_split > 1
    if split:
        part = torch.empty((B, H, n_split, KV_LORA), dtype=torch.float32, device=q.device)
        ml = torch.empty((B, H, n_split, 2), dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    _sparse_mla_kernel[(B, n_hb, n_split)](
        q, pool.view(torch.bfloat16), pool, pool.view(torch.float32), slots, out, part, ml,
        H, K, k_split, q.stride(0), q.stride(1), slots.stride(0), softmax_scale * _LOG2E,
        FP8=fmt == "fp8", ROW=row, BH=bh, BK=bk, SPLIT=split, F32_DOT=not q.is_cuda,
        STAGES=cfg.num_stages, num_warps=cfg.num_warps if bh >= 64 else 4,
    )  # fmt: skip
    if split:
        _combine_kernel[(B * H,)](
            part,
            ml,
            out,
            n_split,
            NS=triton.next_power_of_2(n_split),
            EMU=not q.is_cuda,
            num_warps=4,
        )
    return out
