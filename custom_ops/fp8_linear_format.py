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


def check_moe_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
) -> tuple[int, int, int]:
    """ValueError unless these are FP8 stacked experts for x; returns (E, I, D)."""
    from custom_ops.awq_format import check_moe_inputs

    check_moe_inputs(x, topk_ids, topk_weights)
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(
            "moe_fp8: w13 [E, 2I, D] and w2 [E, D, I] must be float8_e4m3fn, got "
            f"{w13.dtype} {list(w13.shape)}, {w2.dtype} {list(w2.shape)}"
        )
    e, two_i, d = w13.shape
    inter = two_i // 2
    if d != x.shape[1] or tuple(w2.shape) != (e, d, inter) or d % BLOCK or inter % BLOCK:
        raise ValueError(
            f"moe_fp8: shapes do not match or are not multiples of {BLOCK}: x {list(x.shape)}, "
            f"w13 {list(w13.shape)}, w2 {list(w2.shape)}"
        )
    for name, s, want in (
        ("w13_scale", w13_scale, (e, two_i // BLOCK, d // BLOCK)),
        ("w2_scale", w2_scale, (e, d // BLOCK, inter // BLOCK)),
    ):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"moe_fp8: {name} must be float32 {list(want)}, got {s.dtype} "
                             f"{list(s.shape)}")  # fmt: skip
    for t in (w13, w13_scale, w2, w2_scale):
        if not t.is_contiguous():
            raise ValueError("moe_fp8: the expert tensors must be contiguous")
    return e, inter, d
