"""References of ``echo::fp8_linear`` and ``echo::moe_fp8`` (custom_ops/fp8_linear.py describes
the format and the numbers): plain torch, the CPU kernels and the oracles of every FP8 GEMM kernel
(Triton and DeepGEMM alike), in a module of their own so the kernels' modules can import them."""

from __future__ import annotations

import torch

from custom_ops.fp8 import FP8_DTYPE, FP8_MAX
from custom_ops.fp8_linear_format import BLOCK, check_fp8_linear, check_moe_fp8


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
