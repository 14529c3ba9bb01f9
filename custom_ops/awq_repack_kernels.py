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
        w = tl.load(
            qw_ptr + (g * N + offs_n[None, :]).to(tl.int64) * 16 + offs_j[:, None],
            mask=n_mask[None, :],
            other=0,
        )
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)  # [BN]
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        if DOT:
            part = tl.zeros([BM, BN], dtype=tl.float32)
            rs = tl.zeros([BM], dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_rows + g * 128 + 16 * i, mask=m_mask[:, None], other=0.0)
                q = (w >> (4 * i)) & 0xF  # [16, BN] = W^T rows 16 i .. 16 i + 15, minus zero
                if x_ptr.dtype.element_ty == tl.bfloat16:
                    wq = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
                else:
                    wq = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
                part += _dot(xi, wq, INTERPRET)
                rs += tl.sum(xi.to(tl.float32), axis=1)
            if x_ptr.dtype.element_ty == tl.bfloat16:
                zc = z + 128.0
            else:
                zc = z + 1024.0
            acc += (part - rs[:, None] * zc[None, :]) * s[None, :]
        else:
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
