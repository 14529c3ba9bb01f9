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
from custom_ops.fp8_linear_format import BLOCK, check_fp8_linear, check_moe_fp8


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


# ---- echo::moe_fp8 ---------------------------------------------------------------------------


def moe_fp8_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    ue8m0: bool,
) -> torch.Tensor:
    """Reference for ``echo::moe_fp8``: DeepSeek's ``Expert`` with FP8 linears, per expert over
    the tokens routed to it: ``gu = fp8_linear(x, w13[e])`` (16-bit), ``h = silu(g) * u`` in fp32
    rounded to x's dtype, ``fp8_linear(h, w2[e])`` (16-bit), weighted sum in fp32."""
    check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    t, d = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros((t, d), dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = fp8_linear_ref(x[tok], w13[e], w13_scale[e], ue8m0)  # [n, 2I]
        h = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
        y = fp8_linear_ref(h, w2[e], w2_scale[e], ue8m0)  # [n, D]
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(-1))
    return out


@torch.library.custom_op("echo::moe_fp8", mutates_args=())
def moe_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    ue8m0: bool,
) -> torch.Tensor:
    """Routed experts with FP8 block-scaled weights: ``x [T, D] -> fp32 [T, D]``; the reference
    by default, Triton on CUDA (grouped by expert on the device, gate and up fused)."""
    return moe_fp8_ref(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0)


@moe_fp8.register_kernel("cuda")
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0):
    return _kernels().moe_fp8_triton(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0)


@moe_fp8.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0):
    return x.new_empty(x.shape, dtype=torch.float32)
