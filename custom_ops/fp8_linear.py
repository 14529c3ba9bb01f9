"""``echo::fp8_linear``: a linear with FP8 block-scaled weights computed in FP8, as the DeepSeek
reference's ``linear`` does with ``gemm_impl="fp8"`` (docs/model_notes.md, FP8 checkpoints).

Weights: ``w8 float8_e4m3fn [N, K]`` and ``w_scale fp32 [ceil(N/128), K/128]`` (the checkpoint's
``weight_scale_inv``): ``W[n, k] = w8[n, k] * w_scale[n // 128, k // 128]``. Activations are
quantised per row and block of 128 along K (DeepSeek's ``act_quant``): ``amax = max(|x|, 1e-4)``,
``s = amax / 448`` (``ue8m0``: rounded up to a power of two, computed on the bits as DeepSeek's
kernel does: exact), ``x8 = e4m3(clamp(x / s, ±448))``. Then
``y[m, n] = sum_kb (x8[m, kb] . w8[n, kb]) * s[m, kb] * w_scale[n // 128, kb]``: one fp32 dot per
K block of 128, scaled and summed in fp32 (DeepSeek's ``fp8_gemm``), rounded once to bf16.

The reference below is that formula in plain torch (the CPU kernel); the Triton kernel
(``fp8_linear_kernels.py``, CUDA) quantises the activations in its prologue, per tile.
"""

from __future__ import annotations

import torch

from custom_ops.fp8 import FP8_DTYPE, FP8_MAX
from custom_ops.fp8_linear_format import BLOCK, check_fp8_linear


def _kernels():
    from custom_ops import fp8_linear_kernels

    return fp8_linear_kernels


def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """The least power of two >= s (s > 0 finite), exactly: frexp gives s = m * 2^e, m in
    [0.5, 1); s is a power of two iff m == 0.5 (DeepSeek's kernel tests the mantissa bits)."""
    m, e = torch.frexp(s)
    return torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))


def act_quant_exact(
    x: torch.Tensor, ue8m0: bool, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``x8`` e4m3 ``[M, K]``, fp32 scales ``[M, K/block]``), as above."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    amax = xb.abs().amax(dim=-1).clamp_min(1e-4)  # [M, KB]
    s = amax / FP8_MAX
    if ue8m0:
        s = round_up_pow2(s)
    x8 = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x8.view(m, k), s


def fp8_linear_ref(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool
) -> torch.Tensor:
    """Reference: per K block an fp32 dot of the e4m3 values, scaled by both scales, fp32 sum."""
    check_fp8_linear(x, w8, w_scale)
    m, k = x.shape
    n = w8.shape[0]
    kb = k // BLOCK
    x8, xs = act_quant_exact(x, ue8m0)
    xf = x8.float().view(m, kb, BLOCK).transpose(0, 1)  # [KB, M, 128]
    wf = w8.float().view(n, kb, BLOCK).permute(1, 2, 0)  # [KB, 128, N]
    part = torch.bmm(xf, wf)  # [KB, M, N] fp32 per-block dots
    ws = w_scale.repeat_interleave(BLOCK, dim=0)[:n].t()  # [KB, N]
    y = (part * xs.t().unsqueeze(-1) * ws.unsqueeze(1)).sum(0)  # [M, N] fp32
    return y.to(torch.bfloat16 if x.dtype == torch.float32 else x.dtype)


@torch.library.custom_op("echo::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool
) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` (x's 16-bit dtype; bf16 for fp32 x) with FP8 block-scaled weights;
    the reference by default, Triton on CUDA."""
    return fp8_linear_ref(x, w8, w_scale, ue8m0)


@fp8_linear.register_kernel("cuda")
def _(x, w8, w_scale, ue8m0):
    return _kernels().fp8_linear_triton(x, w8, w_scale, ue8m0)


@fp8_linear.register_fake
def _(x, w8, w_scale, ue8m0):
    dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    return x.new_empty((x.shape[0], w8.shape[0]), dtype=dtype)
