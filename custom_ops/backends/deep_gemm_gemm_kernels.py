"""Triton kernel feeding DeepGEMM's FP8 GEMMs (custom_ops/backends/deep_gemm_gemm.py): per row and
block of 128, DeepSeek's ``act_quant`` (the same ``_quant_tile`` as ``echo::fp8_linear``'s
prologue: exact ue8m0 scales), writing the e4m3 values row-major and the fp32 scales straight into
DeepGEMM's MN-major TMA-aligned layout (so DeepGEMM runs no transpose kernel of its own).

Rows are indirect: source row ``src_rows[i]`` goes to destination row ``dst_rows[i]`` (the MoE
scatters each (token, slot) pair into its expert's block); ``GATED``: the source row holds
``[gate | up]`` (bf16 GEMM output) and the quantised value is ``silu(g) * u`` in fp32 rounded to
the source's 16-bit dtype first (the reference's ``h``). Grid: (cdiv(rows, BR), K / 128).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_kernels import _round16
from custom_ops.backends.deep_gemm_layout import empty_sfa
from custom_ops.fp8 import FP8_DTYPE
from custom_ops.fp8_linear_format import BLOCK
from custom_ops.fp8_quant_kernels import _quant_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BR = 8  # rows per program: 8 x 128 values, one K block; decode has few rows, many K blocks


@triton.jit
def dg_quant_kernel(
    src_ptr, src_rows_ptr, dst_rows_ptr, q_ptr, sf_ptr,
    n_rows, K, stride_src, rows_per_group, stride_sf_g, stride_sf_kb,
    IDENT: tl.constexpr, GATED: tl.constexpr, UE8M0: tl.constexpr, INTERPRET: tl.constexpr,
    BR: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    i = pid_r * BR + tl.arange(0, BR)
    mask = i < n_rows
    if IDENT:
        srow = i.to(tl.int64)
        drow = i.to(tl.int64)
    else:
        srow = tl.load(src_rows_ptr + i, mask=mask, other=0).to(tl.int64)
        drow = tl.load(dst_rows_ptr + i, mask=mask, other=0).to(tl.int64)
    offs = kb * 128 + tl.arange(0, 128)
    src = src_ptr + srow[:, None] * stride_src + offs[None, :]
    if GATED:
        g = tl.load(src, mask=mask[:, None], other=0.0).to(tl.float32)
        u = tl.load(src + K, mask=mask[:, None], other=0.0).to(tl.float32)
        x = _round16(g / (1.0 + tl.exp(-g)) * u, src_ptr.dtype.element_ty, INTERPRET)
    else:
        x = tl.load(src, mask=mask[:, None], other=0.0).to(tl.float32)
    q, s = _quant_tile(x, UE8M0, INTERPRET)  # [BR, 128] e4m3, [BR] fp32
    tl.store(q_ptr + drow[:, None] * K + offs[None, :], q, mask=mask[:, None])
    grp = drow // rows_per_group
    pos = drow - grp * rows_per_group
    tl.store(sf_ptr + grp * stride_sf_g + kb * stride_sf_kb + pos, s, mask=mask)


def quant_rows(
    src: torch.Tensor, src_rows: torch.Tensor | None, dst_rows: torch.Tensor | None,
    dst8: torch.Tensor, sf: torch.Tensor, rows_per_group: int, ue8m0: bool, gated: bool,
) -> None:  # fmt: skip
    """Quantise ``src`` rows into ``dst8 [R, K]`` e4m3 and ``sf [G, rows_per_group, K/128]``
    (DeepGEMM layout); ``src_rows is None``: rows 0..R-1 onto themselves. K = dst8's width
    (``src`` is ``[., 2K]`` when ``gated``)."""
    k = dst8.shape[1]
    if src.stride(1) != 1 or not dst8.is_contiguous() or k % BLOCK:
        raise ValueError("quant_rows: src rows must be unit-stride, dst8 contiguous, K % 128 == 0")
    if src.shape[1] != (2 * k if gated else k):
        raise ValueError(f"quant_rows: src width {src.shape[1]} does not match K={k}")
    ident = src_rows is None
    n = dst8.shape[0] if ident else src_rows.numel()
    if n == 0:
        return
    rows_s = src_rows if not ident else dst8  # any pointer: unused under IDENT
    rows_d = dst_rows if not ident else dst8
    dg_quant_kernel[(triton.cdiv(n, BR), k // BLOCK)](
        src, rows_s, rows_d, dst8, sf, n, k, src.stride(0), rows_per_group,
        sf.stride(0), sf.stride(2), IDENT=ident, GATED=gated, UE8M0=ue8m0,
        INTERPRET=_INTERPRET, BR=BR, num_warps=4,
    )  # fmt: skip


def act_quant_dg(x: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 ``[M, K/128]`` MN-major TMA-aligned): the input
    pair of ``deep_gemm.fp8_gemm_nt``."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    x8 = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    sf = empty_sfa(1, m, k // BLOCK, x.device)
    quant_rows(x, None, None, x8, sf, m, ue8m0, gated=False)
    return x8, sf[0]
