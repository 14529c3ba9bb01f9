"""DeepGEMM's scale-factor layouts on SM90 (custom_ops/backends/deep_gemm_gemm.py): activation
scales MN-major and TMA-aligned, weight scales as the checkpoint stores them."""

from __future__ import annotations

import torch

TMA_ALIGN = 4  # fp32 elements per 16 bytes: DeepGEMM's get_tma_aligned_size for the scales


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def empty_sfa(groups: int, rows: int, kb: int, device) -> torch.Tensor:
    """An fp32 scale buffer ``[groups, rows, kb]`` in DeepGEMM's MN-major TMA-aligned layout."""
    ra = align_up(rows, TMA_ALIGN)
    return torch.empty_strided(
        (groups, rows, kb), (kb * ra, 1, ra), dtype=torch.float32, device=device
    )


def sfa_layout(s: torch.Tensor) -> torch.Tensor:
    """``s [M, KB]`` or ``[G, M, KB]`` (any strides) copied into that layout (same values)."""
    g = s.unsqueeze(0) if s.dim() == 2 else s
    out = empty_sfa(g.shape[0], g.shape[1], g.shape[2], s.device)
    out.copy_(g)
    return out[0] if s.dim() == 2 else out


def weight_sf_layout(w_scale: torch.Tensor) -> torch.Tensor:
    """The load-time conversion of the checkpoint's weight scales for SM90 DeepGEMM: none is
    needed (fp32, ``[ceil(N/128), K/128]``, contiguous); returns ``w_scale`` itself, after checking
    it is in that layout, so the weights keep one copy."""
    if w_scale.dtype != torch.float32 or not w_scale.is_contiguous():
        raise ValueError("deep_gemm: weight scales must be contiguous fp32 [.., N/128, K/128]")
    return w_scale
