"""YaRN rotary position embedding of DeepSeek-V3.2 (docs/model_notes.md, rope layouts) and the
indexer's Hadamard rotation (docs/model_notes.md, indexer step 3).

The reference precomputes ``freqs_cis`` for every position up to ``max_seq_len``; here only the 32
inverse frequencies are held (a non-persistent buffer) and cos/sin are computed from the step's
``positions`` tensor, ``angle = positions.float()[:, None] * freqs[None]`` exactly as the
reference's ``torch.outer(t, freqs)``. Nothing depends on a Python int that changes per step, so a
compiled decode step replays for any position.

Two layouts of the 64 rope dims (docs/model_notes.md, rope layouts):
- interleaved (MLA): pairs ``(x[2j], x[2j+1])`` = (re, im), GPT-J style;
- non-interleaved (indexer): pairs ``(x[j], x[j+32])``, NeoX / rotate-half style.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import ModelConfig


def yarn_correction_range(config: ModelConfig) -> tuple[int, int]:
    """The dims ``[low, high]`` over which YaRN ramps from unscaled to divided by ``factor``
    (reference ``find_correction_range``: floor / ceil, clamped to ``[0, rope_dim - 1]``)."""
    rs = config.rope_scaling
    if rs is None:
        raise ValueError("yarn_correction_range: the config has no rope_scaling block")
    dim, base, orig = (
        config.qk_rope_head_dim,
        config.rope_theta,
        rs.original_max_position_embeddings,
    )

    def correction_dim(num_rotations: float) -> float:
        # the dim whose wavelength makes ``num_rotations`` turns over the original context
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(correction_dim(rs.beta_fast))
    high = math.ceil(correction_dim(rs.beta_slow))
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 ``[qk_rope_head_dim // 2]``: the rope frequencies with the YaRN correction, computed
    with the reference's fp32 operations in its order (so the angles agree bit for bit)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    rs = config.rope_scaling
    # YaRN applies iff the served context exceeds the original one (always for V3.2).
    if rs is not None and config.max_position_embeddings > rs.original_max_position_embeddings:
        low, high = yarn_correction_range(config)
        hi = high + 0.001 if low == high else high  # the reference's guard against a zero span
        ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (hi - low)
        smooth = 1 - torch.clamp(ramp, 0, 1)  # 1: keep the frequency, 0: divide by factor
        freqs = freqs / rs.factor * (1 - smooth) + freqs * smooth
    return freqs


class YarnRotary(nn.Module):
    """Holds the inverse frequencies; ``forward(positions) -> (cos, sin)`` fp32 ``[T, 32]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", yarn_inv_freq(config), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the buffer in place (after ``to_empty()`` from the meta device)."""
        with torch.no_grad():
            self.inv_freq.copy_(yarn_inv_freq(self.config, device=self.inv_freq.device))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = positions.float()[:, None] * self.inv_freq[None, :]  # [T, 32]
        # cos/sin of unit magnitude: YaRN's mscale enters the softmax scale only (model_notes.md)
        return torch.cos(angle), torch.sin(angle)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate ``x [T, ..., 64]`` by the angles of its token (``cos``/``sin`` ``[T, 32]``), in fp32,
    returning ``x.dtype`` (the reference multiplies complex64 numbers, the same real arithmetic)."""
    if x.shape[-1] != 2 * cos.shape[-1] or x.shape[0] != cos.shape[0]:
        raise ValueError(
            f"apply_rope: x {list(x.shape)} does not match cos/sin {list(cos.shape)} "
            "(need [T, ..., 2 * half] against [T, half])"
        )
    bshape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(bshape), sin.view(bshape)  # [T, 1.., 32]
    xf = x.float()
    if interleaved:
        re, im = xf[..., 0::2], xf[..., 1::2]  # [T, .., 32] each: pairs (2j, 2j+1)
        out = torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2)
    else:
        half = cos.shape[-1]
        re, im = xf[..., :half], xf[..., half:]  # pairs (j, j + 32)
        out = torch.cat((re * c - im * s, re * s + im * c), dim=-1)
    return out.to(x.dtype)


def hadamard_matrix(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The Sylvester-ordered ``n x n`` ±1 Walsh-Hadamard matrix (fp32): ``H[i, j] =
    (-1)^popcount(i & j)``, the order ``fast_hadamard_transform`` uses. Symmetric."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    idx = torch.arange(n, device=device)
    bits = idx[:, None] & idx[None, :]  # [n, n]
    parity = torch.zeros_like(bits)
    for b in range(n.bit_length()):
        parity ^= (bits >> b) & 1
    return (1 - 2 * parity).float()


def rotate_activation(x: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` times the orthonormal Hadamard transform (scale ``n^-0.5``), in fp32 and cast
    back to ``x.dtype``, as ``fast_hadamard_transform.hadamard_transform`` does on bf16 input."""
    n = hadamard.shape[0]
    return ((x.float() @ hadamard) * n**-0.5).to(x.dtype)
