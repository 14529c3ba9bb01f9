"""Triton W4A16 GEMM over the repacked "k-major" layout (custom_ops/awq_format.py):
``qweight_r int32 [G, N, 16]``, ``zeros_r uint8 [G, N]``, ``scales_r [G, N]``; nibble i of word j
of (g, n) is ``q[128 g + 16 i + j, n]``.

Why this layout (the AutoAWQ one made the former kernel reach ~12% of HBM, issue 17):
- a program's weight tile for one group is one contiguous ``BN * 64``-byte block: every thread
  loads 16 contiguous bytes, and no interleave / gather is needed to line up nibbles with K;
- nibble i of the ``[16, BN]`` word tile *is* the operand ``W^T[16 i : 16 i + 16, BN]`` of a
  ``tl.dot`` against ``x[:, 16 i : 16 i + 16]``: dequantisation is a shift, a mask and an OR on
  registers (the 16-bit magic number ``c + q``, exact), the zero point and scale are applied to
  the fp32 partial product per group (``acc += (x @ (c + q) - rowsum(x) * (c + z)) * s``);
- split-K over groups for small M (decode GEMMs have few output tiles): partial sums in fp32,
  reduced by one launch in a fixed order (deterministic, unlike atomics: the lossless tests
  compare runs bit for bit).
``DOT=False`` is a CUDA-core variant (broadcast FMAs, one cross-lane reduction at the end) for
M of a few rows, where an MMA pads M to 16; the benchmark times both.

NOTE (as in awq_kernels.py): under the Triton interpreter (CPU CI) both dot operands are
converted to fp32 and bf16 stores are rounded by hand (``INTERPRET=True``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_format import GROUP, WORDS, check_repacked
from custom_ops.awq_kernels import _dot, _num_sms, _store, splitk_sum_kernel

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _group_dot(acc, x_rows, row_mask, w_ptrs, z_ptrs, s_ptrs, n_mask, INTERPRET: tl.constexpr):
    """``acc [BM, BN] += x[:, group] @ W^T[group, :]`` for one group of 128 K values.

    ``x_rows [BM, 16]``: pointers to x[row, group start + j]; ``w_ptrs [16, BN]``: the group's
    words of each column (contiguous along j); ``z_ptrs``/``s_ptrs [BN]``: its zeros and scales.
    ``(x @ (c + q) - rowsum(x) * (c + z)) * s`` with the 16-bit magic number c (128 for bf16 x,
    1024 for fp16): ``c + q`` is an OR on the nibble, exact, and a tl.dot operand as it is."""
    w = tl.load(w_ptrs, mask=n_mask[None, :], other=0)  # [16, BN] int32
    z = tl.load(z_ptrs, mask=n_mask, other=0).to(tl.float32)  # [BN]
    s = tl.load(s_ptrs, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
    part = tl.zeros_like(acc)
    rs = tl.sum(part, axis=1)  # zeros [BM]
    for i in tl.static_range(8):
        xi = tl.load(x_rows + 16 * i, mask=row_mask[:, None], other=0.0)  # [BM, 16]
        q = (w >> (4 * i)) & 0xF  # [16, BN]: W^T rows 16 i .. 16 i + 15 of the group, + z
        if x_rows.dtype.element_ty == tl.bfloat16:
            wq = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
        else:
            wq = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
        part += _dot(xi, wq, INTERPRET)
        rs += tl.sum(xi.to(tl.float32), axis=1)
    if x_rows.dtype.element_ty == tl.bfloat16:
        zc = z + 128.0
    else:
        zc = z + 1024.0
    return acc + (part - rs[:, None] * zc[None, :]) * s[None, :]


@triton.jit
def w4a16_r_kernel(
    x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr,
    M, N, G, stride_xm, stride_os, stride_om, SPLIT_K,
    BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over this split's groups of x[m, k] * W^T[k, n] (fp32 when
    SPLIT_K > 1, else in out's dtype). Grid: (cdiv(N, BN), cdiv(M, BM), SPLIT_K)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_j = tl.arange(0, 16)
    n_mask = offs_n < N
    m_mask = offs_m < M
    per_split = tl.cdiv(G, SPLIT_K)
    g0 = pid_k * per_split
    g1 = tl.minimum(g0 + per_split, G)
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_j[None, :]  # [BM, 16]
    if DOT:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BM, 16, BN], dtype=tl.float32)
    for g in range(g0, g1):
        # [16 (j), BN] words: column n's 16 words are contiguous, the tile is one block
        w_ptrs = qw_ptr + (g * N + offs_n[None, :]).to(tl.int64) * 16 + offs_j[:, None]
        if DOT:
            acc = _group_dot(
                acc, x_rows + g * 128, m_mask, w_ptrs, z_ptr + g * N + offs_n,
                s_ptr + g * N + offs_n, n_mask, INTERPRET,
            )  # fmt: skip
        else:
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0)
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_rows + g * 128 + 16 * i, mask=m_mask[:, None], other=0.0)
                q = (w >> (4 * i)) & 0xF
                # 2^23 + q as fp32 bits, minus 2^23 + z: (q - z) exactly, two ALU operations
                wf = (q | 0x4B000000).to(tl.float32, bitcast=True) - (z[None, :] + 8388608.0)
                acc3 += xi.to(tl.float32)[:, :, None] * (wf * s[None, :])[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, axis=1)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    _store(out, acc, m_mask[:, None] & n_mask[None, :], INTERPRET)


def r_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int | bool]:
    """Launch configuration of ``w4a16_r_kernel`` for [m, k] x [k, n], chosen by reasoning (not
    yet timed; ``benchmarks/bench_awq.py`` tries alternatives): BM the smallest MMA tile that
    covers m (16 up to 64, then 64); BN 64 (a 4 KB contiguous weight block per group; 128 from
    m > 64, where the x tile is reused across more columns); split-K over the K/128 groups
    until about two programs per SM are in flight (an H200 needs ~4 KB loads in flight per SM
    of several warps to approach HBM bandwidth), at most 16 splits."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 128 if m > 64 else 64
    groups = k // GROUP
    tiles = -(-m // bm) * -(-n // bn)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= groups and split < 16:
        split *= 2
    return {"BM": bm, "BN": bn, "SPLIT_K": split, "DOT": True, "num_warps": 4, "num_stages": 3}


def w4a16_linear_r_triton(
    x: torch.Tensor, qweight_r: torch.Tensor, zeros_r: torch.Tensor, scales_r: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ W^T -> [M, N]`` (x's dtype) with a repacked W4 weight; fp32 accumulation."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"w4a16_linear_r: x must be 2-D float16 or bfloat16, got {x.dtype} {list(x.shape)}"
        )
    m, k = x.shape
    n = check_repacked("w4a16_linear_r", qweight_r, zeros_r, scales_r, k)
    if qweight_r.shape[-1] != WORDS:
        raise ValueError("w4a16_linear_r: qweight_r's last dim must be 16")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or r_config(m, n, k, _num_sms(x.device))
    bm, bn, split = cfg["BM"], cfg["BN"], cfg["SPLIT_K"]
    dot = cfg.get("DOT", True)
    if bn % 16 or (dot and bm < 16) or split < 1:
        raise ValueError(
            f"w4a16_linear_r: bad config {cfg}: need BN % 16 == 0, BM >= 16 with DOT, SPLIT_K >= 1"
        )
    if split == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    w4a16_r_kernel[grid](
        x, qweight_r, zeros_r, scales_r, out, m, n, k // GROUP, x.stride(0), out.stride(0),
        out.stride(1), split, BM=bm, BN=bn, DOT=dot, INTERPRET=_INTERPRET,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    if split == 1:
        return out[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](
        out, y, m * n, split, BLOCK=1024, INTERPRET=_INTERPRET, num_warps=4
    )
    return y


# ---- fused MoE over repacked experts ---------------------------------------------------------


@triton.jit
def moe_r_kernel(
    a_ptr, w_ptr, z_ptr, s_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    num_pairs, N, G, E, stride_am, stride_om,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One row block (pairs of one expert, ``awq_kernels.moe_align``) x BN output columns, over
    repacked expert weights ``w [E, G, NW, 16]``, ``z``/``s [E, G, NW]`` (NW = 2N when GATED:
    gate columns then up columns, fused in one pass over x). Row r of the block is pair
    ``p = sorted_ids[r]``: it reads A row ``p // A_ROW_DIV`` and writes out row ``p``; GATED:
    out = silu(gate) * up (fp32, stored in out's dtype); MUL_WEIGHT: out = acc * topk_w[p].
    Grid: (max_blocks, cdiv(N, BN)); blocks past the last expert exit at once."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BM + tl.arange(0, BM))  # [BM] pair indices
    row_mask = ids < num_pairs
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, 16)
    n_mask = offs_n < N
    NW = 2 * N if GATED else N
    x_rows = a_ptr + (ids // A_ROW_DIV)[:, None].to(tl.int64) * stride_am + offs_j[None, :]
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * G * NW * 16
    zs_base = e64 * G * NW
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for g in range(0, G):
        col = g * NW + offs_n  # [BN] (group, column) index of the gate / plain columns
        acc = _group_dot(
            acc, x_rows + g * 128, row_mask,
            w_base + col[None, :].to(tl.int64) * 16 + offs_j[:, None],
            z_ptr + zs_base + col, s_ptr + zs_base + col, n_mask, INTERPRET,
        )  # fmt: skip
        if GATED:
            acc_up = _group_dot(
                acc_up, x_rows + g * 128, row_mask,
                w_base + (col + N)[None, :].to(tl.int64) * 16 + offs_j[:, None],
                z_ptr + zs_base + col + N, s_ptr + zs_base + col + N, n_mask, INTERPRET,
            )  # fmt: skip
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, fp32
    if MUL_WEIGHT:
        tw = tl.load(topk_w_ptr + ids, mask=row_mask, other=0.0)
        acc = acc * tw[:, None]
    out = out_ptr + ids[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    _store(out, acc, row_mask[:, None] & n_mask[None, :], INTERPRET)


def moe_r_config(num_pairs: int, n_experts: int) -> dict[str, int]:
    """Launch configuration of ``moe_r_kernel`` (both GEMMs), by reasoning (not yet timed): at
    decode sizes most experts get one or a few pairs, so BM = 16 (the smallest MMA tile) up to 16
    pairs per expert on average, else 64; BN = 64 gives each program one contiguous 4 KB weight
    block per group (8 KB with gate and up) and enough programs (touched experts x N / 64)."""
    bm = 64 if num_pairs > 16 * n_experts else 16
    return {"BM": bm, "BN": 64, "num_warps": 4, "num_stages": 3}


def moe_w4a16_r_triton(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13_qweight_r: torch.Tensor, w13_zeros_r: torch.Tensor, w13_scales_r: torch.Tensor,
    w2_qweight_r: torch.Tensor, w2_zeros_r: torch.Tensor, w2_scales_r: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """Fused W4A16 MoE over repacked experts: fp32 ``[T, D] = sum_j w[t, j] *
    down_e(silu(gate_e(x_t)) * up_e(x_t))``; ``w13_* [E, D/128, 2I(, 16)]``, ``w2_* [E, I/128,
    D(, 16)]``."""
    from custom_ops.awq_format import check_moe_inputs
    from custom_ops.awq_kernels import moe_align

    check_moe_inputs(x, topk_ids, topk_weights)
    check_repacked_experts(
        "moe_w4a16_r (w13)", w13_qweight_r, w13_zeros_r, w13_scales_r, x.shape[1]
    )
    e, _, two_i, _ = w13_qweight_r.shape
    inter = two_i // 2
    check_repacked_experts("moe_w4a16_r (w2)", w2_qweight_r, w2_zeros_r, w2_scales_r, inter)
    t, d = x.shape
    if w2_qweight_r.shape[0] != e or w2_qweight_r.shape[2] != d or two_i % 2:
        raise ValueError(
            f"moe_w4a16_r: w2 {list(w2_qweight_r.shape)} does not match w13 "
            f"{list(w13_qweight_r.shape)} and D={d}"
        )
    cfg = config or moe_r_config(t * topk_ids.shape[1], e)
    if cfg["BN"] % 16 or cfg["BM"] < 16:
        raise ValueError(f"moe_w4a16_r: bad config {cfg}: need BN % 16 == 0, BM >= 16")
    if x.stride(1) != 1:
        x = x.contiguous()
    topk = topk_ids.shape[1]
    p = t * topk
    sorted_ids, block_expert = moe_align(topk_ids, e, cfg["BM"])
    n_blocks = block_expert.numel()
    tw = topk_weights.reshape(-1).float().contiguous()  # [P]
    common = dict(
        BM=cfg["BM"], BN=cfg["BN"], INTERPRET=_INTERPRET,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    h = torch.empty((p, inter), device=x.device, dtype=x.dtype)  # silu(gate) * up per pair
    moe_r_kernel[(n_blocks, triton.cdiv(inter, cfg["BN"]))](
        x, w13_qweight_r, w13_zeros_r, w13_scales_r, h, sorted_ids, block_expert, tw,
        p, inter, d // GROUP, e, x.stride(0), h.stride(0),
        A_ROW_DIV=topk, GATED=True, MUL_WEIGHT=False, **common,
    )  # fmt: skip
    # NOTE: zeros, not empty: a skipped pair's (id == E) row is never written
    y = torch.zeros((p, d), device=x.device, dtype=torch.float32)  # weighted expert outputs
    moe_r_kernel[(n_blocks, triton.cdiv(d, cfg["BN"]))](
        h, w2_qweight_r, w2_zeros_r, w2_scales_r, y, sorted_ids, block_expert, tw,
        p, d, inter // GROUP, e, h.stride(0), y.stride(0),
        A_ROW_DIV=1, GATED=False, MUL_WEIGHT=True, **common,
    )  # fmt: skip
    return y.view(t, topk, d).sum(1)  # [T, D] fp32


def check_repacked_experts(name: str, qw: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                           k: int) -> None:  # fmt: skip
    """ValueError unless ``qw [E, k/128, N, 16]``, ``z``/``s [E, k/128, N]`` are repacked
    experts."""
    if qw.dim() != 4 or z.dim() != 3 or s.dim() != 3:
        raise ValueError(
            f"{name}: need qweight_r [E, K/128, N, 16] and zeros_r/scales_r [E, K/128, N], got "
            f"{list(qw.shape)}, {list(z.shape)}, {list(s.shape)}"
        )
    if not (qw.shape[0] == z.shape[0] == s.shape[0]):
        raise ValueError(
            f"{name}: the expert counts differ: {qw.shape[0]}, {z.shape[0]}, {s.shape[0]}"
        )
    check_repacked(name, qw[0], z[0], s[0], k)
    if not (qw.is_contiguous() and z.is_contiguous() and s.is_contiguous()):
        raise ValueError(f"{name}: the stacked expert tensors must be contiguous")
