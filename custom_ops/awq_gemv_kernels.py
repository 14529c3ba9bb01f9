"""The few-token form of ``echo::w4a16_linear_p`` (custom_ops/awq_pairs.py): a GEMV-shaped
kernel over the pair layout, for decode linears where the tiled kernel
(``awq_pairs_kernels.py``) is latency-bound (as ``fp8_gemv_kernels.py`` for FP8).

Each program owns ``BN`` output columns and ``MP`` tokens and walks every group of K itself: no
split-K, so no partials, counters or last-program sums. A step takes ``CG`` groups: the words
``[CG, BN, 16]`` (64 contiguous bytes per column and group; loaded a step ahead, so two steps
are in flight), the packed (zero point, scale) words ``[CG, BN]``, and the tokens' x. Nibble
slot (s, h) of word p is K row ``32 s + 2 p + h`` of the group (``awq_format``); for each of the
8 slots, ``((w >> (4 s + 16 h)) & 0xF) | 0x4B000000`` read as fp32 is ``2^23 + q`` exactly, so one
subtraction of ``2^23 + z`` gives ``q - z`` exactly, and the products with x accumulate in fp32
on the CUDA cores; each group's sum is then multiplied by its scale (``(q - z) * s`` is the
reference's exact weight; the sums differ from it in order only).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_format import GROUP, check_pairs, check_x16
from custom_ops.awq_kernels import _num_sms, _store

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_GROUP = tl.constexpr(GROUP)


@triton.jit
def _scale_f32(zs):
    """The fp16 scales in bits 16..31 of the ``zs_p`` words, as fp32."""
    return (zs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def w4a16_gemv_kernel(
    x_ptr, qw_ptr, zs_ptr, y_ptr, M, N, G, stride_xm, stride_ym,
    MP: tl.constexpr, BN: tl.constexpr, CG: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``y[m, n]`` for tokens ``pid_m * MP + [0, MP)`` and columns ``pid_n * BN + [0, BN)``
    over all G groups, ``CG`` a step."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * MP + tl.arange(0, MP)
    n_mask = offs_n < N
    m_mask = offs_m < M
    gg = tl.arange(0, CG)
    pp = tl.arange(0, 16)
    col = offs_n[None, :, None].to(tl.int64) * 16 + pp[None, None, :]  # [1, BN, 16]
    n16 = N.to(tl.int64) * 16
    w_mask = n_mask[None, :, None]
    w_next = tl.load(qw_ptr + gg[:, None, None] * n16 + col,
                     mask=(gg < G)[:, None, None] & w_mask, other=0)  # fmt: skip
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    rows = tl.arange(0, MP)
    for c in range(0, tl.cdiv(G, CG)):
        w = w_next
        g1 = (c + 1) * CG + gg  # the next step's words, issued before this step's sums
        w_next = tl.load(qw_ptr + g1[:, None, None] * n16 + col,
                         mask=(g1 < G)[:, None, None] & w_mask, other=0)  # fmt: skip
        g = c * CG + gg
        gm = g < G
        zs = tl.load(zs_ptr + g[:, None] * N + offs_n[None, :], mask=gm[:, None] & n_mask[None, :],
                     other=0)  # fmt: skip
        zf = ((zs & 0xFF).to(tl.float32) + 8388608.0)[:, :, None]  # 2^23 + z, [CG, BN, 1]
        sc = _scale_f32(zs)
        x_grp = g[:, None] * _GROUP + 2 * pp[None, :]  # [CG, 16]: K row 2 p of each group
        x_mask = gm[:, None] & (pp < 16)[None, :]
        for mi in tl.static_range(MP):  # a token at a time: the registers do not grow with MP
            row = tl.minimum(pid_m * MP + mi, M - 1)  # (a row past M is computed, not stored)
            x_row = x_ptr + row * stride_xm + x_grp
            part = tl.zeros([CG, BN, 16], dtype=tl.float32)
            for s in tl.static_range(4):
                for h in tl.static_range(2):
                    q = ((w >> (4 * s + 16 * h)) & 0xF) | 0x4B000000
                    qz = q.to(tl.float32, bitcast=True) - zf  # q - z, exact
                    xk = tl.load(x_row + (32 * s + h), mask=x_mask, other=0.0).to(tl.float32)
                    part += xk[:, None, :] * qz
            d = tl.sum(tl.sum(part, axis=2) * sc, axis=0)  # [BN]
            acc += tl.where(rows[:, None] == mi, d[None, :], 0.0)
    mask = m_mask[:, None] & n_mask[None, :]
    _store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask, INTERPRET)


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def w4a16_gemv_config(m: int, n: int, k: int, num_sms: int, waves: float = 1.0,
                      chunk_bytes: int = 8192, mp: int | None = None) -> dict:  # fmt: skip
    """MP: the tokens' power of two, at most ``mp`` (default 4); BN: the widest power-of-two
    column block (at most 128) that still gives ``waves`` x SMs programs; CG: groups a step so
    that a step's words are about ``chunk_bytes`` (64 bytes a column and group; two steps in
    flight a program)."""
    mp = min(mp or 4, triton.next_power_of_2(max(m, 1)))
    m_blocks = -(-m // mp)
    bn = 128
    while bn > 2 and -(-n // bn) * m_blocks < waves * num_sms:
        bn //= 2
    cg = _pow2_floor(chunk_bytes // (bn * 64))
    cg = min(cg, triton.next_power_of_2(k // GROUP))  # (never past K's groups)
    return {"GEMV": True, "GEMV_MP": mp, "GEMV_BN": bn, "GEMV_CG": cg, "num_warps": 4}


def w4a16_gemv(
    x: torch.Tensor, qweight_p: torch.Tensor, zs_p: torch.Tensor, cfg: dict
) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` (x's dtype) with the GEMV kernel; ``cfg``: ``GEMV_MP`` /
    ``GEMV_BN`` / ``GEMV_CG`` / ``num_warps`` (``w4a16_gemv_config``'s keys; missing ones from
    it, whose ``waves`` and ``chunk_bytes`` are ``GEMV_WAVES`` and ``GEMV_CHUNK``)."""
    check_x16("w4a16_linear_p", x)
    m, k = x.shape
    n = check_pairs("w4a16_linear_p", qweight_p, zs_p, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    auto = w4a16_gemv_config(m, n, k, _num_sms(x.device), cfg.get("GEMV_WAVES", 1.0),
                             cfg.get("GEMV_CHUNK", 8192), cfg.get("GEMV_MP"))  # fmt: skip
    mp = auto["GEMV_MP"]  # (GEMV_MP caps it: no token block wider than the tokens)
    bn, cg = (int(cfg.get(f"GEMV_{key}", auto[f"GEMV_{key}"])) for key in ("BN", "CG"))
    for name, v in (("MP", mp), ("BN", bn), ("CG", cg)):
        if v < 1 or v > 128 or v & (v - 1):
            raise ValueError(f"w4a16_linear_p: bad GEMV config {cfg}: GEMV_{name} must be a "
                             f"power of two in 1..128, got {v}")  # fmt: skip
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    w4a16_gemv_kernel[(triton.cdiv(n, bn), triton.cdiv(m, mp))](
        x, qweight_p, zs_p, y, m, n, k // GROUP, x.stride(0), y.stride(0), MP=mp, BN=bn, CG=cg,
        INTERPRET=_INTERPRET, num_warps=int(cfg.get("num_warps", auto["num_warps"])),
    )  # fmt: skip
    return y
