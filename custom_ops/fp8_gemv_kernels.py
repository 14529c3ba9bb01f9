"""The small-M Triton kernel of ``echo::fp8_linear`` (custom_ops/fp8_linear.py): FP8 block-scaled
weights times a few tokens on the CUDA cores, no MMA.

At decode a linear sees a few rows of x; an MMA pads them to 16 (``fp8_linear_kernels``) or to
64 (DeepGEMM) and moves the weight tile through shared memory. Here x is quantised first, in a
launch of its own (``act_quant_dg``, DeepSeek's ``act_quant``: e4m3 values and one fp32 scale per
row and block of 128), then each program owns ``BN`` weight rows (``128 % BN == 0``: one
weight-scale row) and a range of K blocks (split-K). Per K block a thread loads 16 contiguous
e4m3 weights of its row (the next block's 16 are requested before this block's arithmetic: a
register prefetch) and, for each of the ``MP`` tokens (M rounded up to a power of two), the 16
matching e4m3 activations; both loads have the shape ``[1, BN, 128]`` (the activations
broadcast over the rows), so Triton gives them one layout and the products need no layout
conversion. The products are summed in fp32 within the thread, then over the 8 threads of the
row (3 shuffles): one fp32 dot per token and K block, times both scales, summed over the blocks
in fp32, rounded once to 16 bits: the reference's numbers (``fp8_linear_ref``) with the fp32
sums in another order. About ``1.5 + 2.5 MP`` instructions per weight: the CUDA cores keep up
with HBM while MP is small, the benchmark says up to which M.

Split-K partials go to an fp32 ``[SPLIT_K, M, N]`` buffer summed in order by
``splitk_sum_kernel`` (one more launch); ``SPLIT_K = 1`` stores the 16-bit output directly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_kernels import _num_sms, _store, splitk_sum_kernel
from custom_ops.backends.deep_gemm_gemm_kernels import act_quant_dg
from custom_ops.fp8_linear_format import BLOCK, check_fp8_linear

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
GEMV_MAX_M = 8  # the largest M this kernel takes (MP <= 8 keeps the products in registers)


@triton.jit
def fp8_gemv_kernel(
    x8_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K, stride_xm, stride_xs_m, stride_xs_kb, stride_os, stride_om, SPLIT_K,
    MP: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] over this split's K blocks, from e4m3 ``x8 [M, K]`` and its scales
    ``xs`` (strides given). Grid: (cdiv(N, BN), SPLIT_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, 128)
    KB = K // 128
    per_split = tl.cdiv(KB, SPLIT_K)
    kb0 = pid_k * per_split
    kb1 = tl.minimum(kb0 + per_split, KB)
    nb = (pid_n * BN) // 128  # the tile's weight-scale row (128 % BN == 0)
    # w [1, BN, 128] and each token's x8 row broadcast to the same shape: both loads get one
    # layout (16 contiguous bytes a thread), so the products need no layout conversion
    w_rows = w_ptr + offs_n[None, :, None].to(tl.int64) * K + offs_k[None, None, :]
    w_mask = (offs_n < N)[None, :, None]
    k3 = offs_k[None, None, :]  # (a tensor compare: the masks of the blocks past the split's)
    x_rows = x8_ptr + offs_n[None, :, None] * 0 + offs_k[None, None, :]
    tok = tl.arange(0, MP)[:, None]
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    w_next = tl.load(w_rows + kb0 * 128, mask=w_mask & (k3 < (kb1 - kb0) * 128), other=0.0)
    for kb in range(kb0, kb1):
        w = w_next.to(tl.float32)
        # the next block's weights are requested before this block's arithmetic
        w_next = tl.load(w_rows + (kb + 1) * 128, mask=w_mask & (k3 < (kb1 - kb - 1) * 128),
                         other=0.0)  # fmt: skip
        sw = tl.load(ws_ptr + nb * KB + kb)
        for t in tl.static_range(MP):
            r = tl.minimum(t, M - 1)  # rows past M repeat the last one and are not stored
            x = tl.load(x_rows + r * stride_xm + kb * 128)
            part = tl.sum(x.to(tl.float32) * w, axis=2)  # [1, BN]: fp32 dot of one K block
            sx = tl.load(xs_ptr + r * stride_xs_m + kb * stride_xs_kb)
            acc += tl.where(tok == t, (part * sx) * sw, 0.0)
    out = out_ptr + pid_k * stride_os + tok * stride_om + offs_n[None, :]
    _store(out, acc, (tok < M) & (offs_n < N)[None, :], INTERPRET)


def fp8_gemv_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int]:
    """By reasoning (``benchmarks/bench_fp8.py`` times others beside it): BN = 16 rows, one a
    thread at 4 warps (32-64 registers: 16 programs an SM); split-K until 16 programs an SM are
    there to fill, keeping two K blocks a split at least (a 16-byte load in flight and one
    prefetched per thread: ~32 KB an SM)."""
    bn = 16
    tiles = -(-n // bn)
    split = 1
    while tiles * split < 16 * num_sms and split * 4 <= k // BLOCK:
        split *= 2
    return {"BN": bn, "SPLIT_K": split, "num_warps": 4}


def fp8_gemv_triton(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool,
    config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] -> [M, N]`` (M <= ``GEMV_MAX_M``) with FP8 block-scaled weights."""
    check_fp8_linear(x, w8, w_scale)
    m, k = x.shape
    n = w8.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"fp8_gemv: M must be 1..{GEMV_MAX_M}, got {m}")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or fp8_gemv_config(m, n, k, _num_sms(x.device))
    bn, split = cfg["BN"], cfg["SPLIT_K"]
    if BLOCK % bn or bn < 1 or split < 1:
        raise ValueError(f"fp8_gemv: bad config {cfg}: need 128 % BN == 0, SPLIT_K >= 1")
    out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    x8, xs = act_quant_dg(x, ue8m0)  # e4m3 [M, K], fp32 scales [M, K/128] (strided)
    if split == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=out_dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    fp8_gemv_kernel[(triton.cdiv(n, bn), split)](
        x8, xs, w8, w_scale, out, m, n, k, x8.stride(0), xs.stride(0), xs.stride(1),
        out.stride(0), out.stride(1), split, MP=triton.next_power_of_2(m), BN=bn,
        INTERPRET=_INTERPRET, num_warps=cfg.get("num_warps", 4), num_stages=1,
    )  # fmt: skip
    if split == 1:
        return out[0]
    y = torch.empty((m, n), device=x.device, dtype=out_dtype)
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](
        out, y, m * n, split, BLOCK=1024, INTERPRET=_INTERPRET, num_warps=4
    )
    return y
