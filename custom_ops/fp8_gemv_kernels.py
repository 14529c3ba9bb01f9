"""The few-token form of ``echo::fp8_linear`` (custom_ops/fp8_linear.py): a GEMV-shaped kernel
for the small decode linears, where the tiled kernel (``fp8_linear_kernels.py``) is
latency-bound.

At decode a weight of 4-15 MB (V3.2's 7168 x 576, 7168 x 2048, 2048 x 7168) is a few µs of HBM
reads, but the tiled kernel needs split-K to spread its few output tiles over the SMs, and then
a chain of partial stores, a counter atomic and the last program's re-reads before the result.
Here each program owns ``BN`` whole weight rows (``BN`` output columns) and ``MP`` tokens, and
walks all of K itself, so nothing is split or summed across programs: the grid is
``cdiv(N, BN) x cdiv(M, MP)`` programs, about one per SM at decode. Each iteration takes ``CB``
K blocks of 128: the weight chunk ``[BN, CB * 128]`` e4m3 (loaded one iteration ahead, so two
chunks are in flight), the tokens' x chunk quantised per 128 as DeepSeek's ``act_quant`` does
(``_quant_tile``: the same e4m3 values and scales as the reference), the per-block fp32 dots
on the CUDA cores (products of e4m3 values are exact in fp32), scaled by both scales and summed
in fp32. No tensor cores: at ``MP`` <= 4 tokens the FMAs are few next to the bytes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_kernels import _num_sms, _store
from custom_ops.fp8_linear_format import BLOCK
from custom_ops.fp8_quant_kernels import _quant_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    MP: tl.constexpr, BN: tl.constexpr, CB: tl.constexpr, UE8M0: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """``y[m, n]`` for tokens ``pid_m * MP + [0, MP)`` and weight rows ``pid_n * BN + [0, BN)``
    (``128 % BN == 0``: one weight-scale row), over every K block, ``CB`` a step."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * MP + tl.arange(0, MP)
    n_mask = offs_n < N
    m_mask = offs_m < M
    kk = tl.arange(0, CB * 128)
    cbs = tl.arange(0, CB)
    KB = K // 128
    ws_row = ws_ptr + (pid_n * BN) // 128 * KB
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    rows = tl.arange(0, MP)
    w_next = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
    for c in range(0, tl.cdiv(KB, CB)):
        w = w_next
        k1 = (c + 1) * CB * 128 + kk  # the next chunk's loads, issued before this one's sums
        w_next = tl.load(w_rows + k1[None, :], mask=n_mask[:, None] & (k1 < K)[None, :], other=0.0)
        wf = tl.reshape(w.to(tl.float32), [BN, CB, 128])
        k0 = c * CB * 128 + kk
        kb = c * CB + cbs
        sw = tl.load(ws_row + kb, mask=kb < KB, other=0.0)  # past K: zero dots, zero scales
        for mi in tl.static_range(MP):  # a token at a time: the registers do not grow with MP
            row = tl.minimum(pid_m * MP + mi, M - 1)  # (a row past M is computed, not stored)
            x = tl.load(x_ptr + row * stride_xm + k0, mask=k0 < K, other=0.0)
            x8, s = _quant_tile(tl.reshape(x.to(tl.float32), [CB, 128]), UE8M0, INTERPRET)
            d = tl.sum(x8.to(tl.float32)[None, :, :] * wf, axis=2)  # [BN, CB]: a dot per K block
            part = tl.sum((d * s[None, :]) * sw[None, :], axis=1)  # [BN]
            acc += tl.where(rows[:, None] == mi, part[None, :], 0.0)
    mask = m_mask[:, None] & n_mask[None, :]
    _store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask, INTERPRET)


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def fp8_gemv_config(m: int, n: int, k: int, num_sms: int, waves: float = 1.0,
                    chunk_bytes: int = 8192, mp: int | None = None) -> dict:  # fmt: skip
    """MP: the tokens' power of two, at most ``mp`` (default 4); BN: the widest power-of-two row
    block (at most 128) that still gives ``waves`` x SMs programs; CB: K blocks a step so that a
    step's weight chunk is about ``chunk_bytes`` (two chunks in flight a program; as many fp32
    products a step, 64 a thread at 8192 on 4 warps)."""
    mp = min(mp or 4, triton.next_power_of_2(max(m, 1)))
    m_blocks = -(-m // mp)
    bn = BLOCK
    while bn > 2 and -(-n // bn) * m_blocks < waves * num_sms:
        bn //= 2
    cb = _pow2_floor(chunk_bytes // (bn * BLOCK))
    cb = min(cb, triton.next_power_of_2(k // BLOCK))  # (never past K's blocks)
    return {"GEMV": True, "GEMV_MP": mp, "GEMV_BN": bn, "GEMV_CB": cb, "num_warps": 4}


def fp8_gemv(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool, cfg: dict
) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` (x contiguous along K, checked by the caller) with the GEMV
    kernel; ``cfg``: ``GEMV_MP`` / ``GEMV_BN`` / ``GEMV_CB`` / ``num_warps`` (``fp8_gemv_config``'s
    keys; missing ones from it, whose ``waves`` and ``chunk_bytes`` are ``GEMV_WAVES`` and
    ``GEMV_CHUNK``)."""
    m, k = x.shape
    n = w8.shape[0]
    auto = fp8_gemv_config(m, n, k, _num_sms(x.device), cfg.get("GEMV_WAVES", 1.0),
                           cfg.get("GEMV_CHUNK", 8192), cfg.get("GEMV_MP"))  # fmt: skip
    mp = auto["GEMV_MP"]  # (GEMV_MP caps it: no token block wider than the tokens)
    bn, cb = (int(cfg.get(f"GEMV_{key}", auto[f"GEMV_{key}"])) for key in ("BN", "CB"))
    for name, v, top in (("MP", mp, 64), ("BN", bn, BLOCK), ("CB", cb, 64)):
        if v < 1 or v > top or v & (v - 1):
            raise ValueError(f"fp8_linear: bad GEMV config {cfg}: GEMV_{name} must be a power "
                             f"of two in 1..{top}, got {v}")  # fmt: skip
    out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    y = torch.empty((m, n), device=x.device, dtype=out_dtype)
    fp8_gemv_kernel[(triton.cdiv(n, bn), triton.cdiv(m, mp))](
        x, w8, w_scale, y, m, n, k, x.stride(0), y.stride(0), MP=mp, BN=bn, CB=cb, UE8M0=ue8m0,
        INTERPRET=_INTERPRET, num_warps=int(cfg.get("num_warps", auto["num_warps"])),
    )  # fmt: skip
    return y
