"""FP8 e4m3 block quantisation as the DeepSeek reference's ``act_quant`` (docs/model_notes.md,
indexer step 4): per block of 128, ``amax = max(|x|, 1e-4)``, ``s = amax / 448``, with ``ue8m0``
rounded up to a power of two; ``y = clamp(x / s, ±448)`` cast to e4m3. Scales are fp32."""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def act_quant(
    x: torch.Tensor, block: int = 128, scale_fmt: str | None = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the last dim of ``x`` in blocks: (e4m3 like x, fp32 scales [..., D/block])."""
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"act_quant: last dim {d} is not a multiple of the block {block}")
    xb = x.float().unflatten(-1, (d // block, block))  # [..., nb, block]
    amax = xb.abs().amax(dim=-1).clamp_min(1e-4)  # [..., nb]
    s = amax / FP8_MAX
    if scale_fmt is not None:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    y = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return y.flatten(-2), s


def act_dequant(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of ``act_quant``: fp32 values ``q * s`` (exact for power-of-two scales)."""
    d = q.shape[-1]
    return (q.float().unflatten(-1, (d // block, block)) * s.unsqueeze(-1)).flatten(-2)


def fp8_round_trip(
    x: torch.Tensor, block: int = 128, scale_fmt: str | None = "ue8m0"
) -> torch.Tensor:
    """``x`` through FP8 and back, in ``x.dtype``: the precision the deployed KV cache keeps."""
    q, s = act_quant(x, block, scale_fmt)
    return act_dequant(q, s, block).to(x.dtype)
