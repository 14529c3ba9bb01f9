"""FP8 block-quantised weights, the official DeepSeek-V3.2 checkpoint format (docs/model_notes.md).

A linear ``X`` with weight ``[out, in]`` is stored as ``X.weight`` (float8_e4m3fn, ``[out, in]``)
and ``X.weight_scale_inv`` (fp32, ``[ceil(out/128), ceil(in/128)]``), one scale per 128x128 block:
``W[i, j] = W8[i, j] * scale_inv[i // 128, j // 128]``. A ragged last block (e.g. the 576 rows of
``kv_a_proj_with_mqa``) is zero-padded to 128 when its scale is computed, i.e. its scale comes from
the real elements only.
"""

from __future__ import annotations

import math

import torch

from custom_ops.fp8 import FP8_DTYPE, FP8_MAX

BLOCK = 128


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` ([out, in])."""
    if len(shape) != 2:
        raise ValueError(f"FP8 block weights must be 2-d [out, in], got shape {tuple(shape)}")
    return math.ceil(shape[0] / block), math.ceil(shape[1] / block)


def _expand(s: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """Per-block scales [ob, ib] -> per-element [out, in] (ragged last blocks cropped)."""
    return s.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def weight_quant_fp8(
    w: torch.Tensor, block: int = BLOCK, scale_fmt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (``w8`` e4m3 ``[out, in]``, ``scale_inv`` fp32 ``scale_shape(w.shape)``).

    ``scale_inv = amax(|block|) / 448`` (with ``scale_fmt="ue8m0"`` rounded up to a power of two),
    ``w8 = e4m3(w / scale_inv)`` rounded to nearest. An all-zero block gets scale 1.
    """
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise ValueError(f"weight_quant_fp8: expected a bf16/fp16/fp32 weight, got {w.dtype}")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"weight_quant_fp8: scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    ob, ib = scale_shape(w.shape, block)
    out, inp = w.shape
    wp = torch.zeros(ob * block, ib * block, dtype=torch.float32, device=w.device)
    wp[:out, :inp] = w.float()  # NOTE: zero padding cannot raise a block's amax
    amax = wp.view(ob, block, ib, block).abs().amax(dim=(1, 3))  # [ob, ib]
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    w8 = (w.float() / _expand(s, (out, inp), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w8, s


def is_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``scale`` is a positive finite power of two, i.e. representable as UE8M0 (an
    8-bit exponent, no mantissa), what ``scale_fmt="ue8m0"`` declares for every scale."""
    mantissa, _ = torch.frexp(scale.float())  # scale = mantissa * 2^e, mantissa in [0.5, 1)
    return (mantissa == 0.5) & torch.isfinite(scale)


def weight_dequant_fp8(
    w8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``weight_quant_fp8``: ``w8 * scale_inv`` per block, in ``dtype`` (fp32 math)."""
    if w8.dtype != FP8_DTYPE:
        raise ValueError(f"weight_dequant_fp8: expected a float8_e4m3fn weight, got {w8.dtype}")
    want = scale_shape(w8.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_dequant_fp8: weight {tuple(w8.shape)} needs scale_inv of shape {want}, "
            f"got {tuple(scale_inv.shape)}"
        )
    s = _expand(scale_inv.float().to(w8.device), tuple(w8.shape), block)
    return (w8.float() * s).to(dtype)
