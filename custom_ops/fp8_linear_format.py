"""The FP8 block-scaled linear's format (custom_ops/fp8_linear.py) and the input checks its
reference and its Triton kernel share: ``w8 float8_e4m3fn [N, K]``, ``w_scale fp32
[ceil(N/128), K/128]``, K a multiple of 128."""

from __future__ import annotations

import torch

from custom_ops.fp8 import FP8_DTYPE

BLOCK = 128  # weight blocks are BLOCK x BLOCK; activations are quantised per BLOCK along K


def check_fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_linear: x must be a 2-D float tensor [M, K], got {x.dtype} "
                         f"{list(x.shape)}")  # fmt: skip
    if w8.dim() != 2 or w8.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear: w8 must be a 2-D float8_e4m3fn [N, K], got {w8.dtype} "
                         f"{list(w8.shape)}")  # fmt: skip
    n, k = w8.shape
    if x.shape[1] != k or k % BLOCK:
        raise ValueError(
            f"fp8_linear: x has K={x.shape[1]}, w8 has K={k}; K must match and be a multiple of "
            f"{BLOCK}"
        )
    want = (-(-n // BLOCK), k // BLOCK)
    if tuple(w_scale.shape) != want or w_scale.dtype != torch.float32:
        raise ValueError(
            f"fp8_linear: w_scale must be float32 {list(want)}, got {w_scale.dtype} "
            f"{list(w_scale.shape)}"
        )
    if not (w8.is_contiguous() and w_scale.is_contiguous()):
        raise ValueError("fp8_linear: w8 and w_scale must be contiguous")
