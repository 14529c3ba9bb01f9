"""The AutoAWQ "gemm" 4-bit format (docs/model_notes.md): its constants and the shape checks every
AWQ op runs before its reference or its Triton kernel. ``qweight int32 [K, N/8]``, ``qzeros int32
[K/128, N/8]``, ``scales fp16|bf16 [K/128, N]``; nibble i of a word holds column ``8c + ORDER[i]``.
"""

from __future__ import annotations

import torch

GROUP = 128  # input features per scale / zero group
PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column offset AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column offset ch sits in nibble REVERSE[ch]


def check_awq(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               k: int, n: int, lead: tuple[int, ...] = ()) -> None:
    """ValueError unless qweight/qzeros/scales have the AWQ shapes and dtypes for in=k, out=n."""
    if k % GROUP or n % PACK:
        raise ValueError(f"{name}: in={k} must be a multiple of {GROUP} and out={n} of {PACK}")
    want = {
        "qweight": (qweight, (*lead, k, n // PACK)),
        "qzeros": (qzeros, (*lead, k // GROUP, n // PACK)),
        "scales": (scales, (*lead, k // GROUP, n)),
    }
    for what, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: {what} must have shape {list(shape)}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(
            f"{name}: qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}"
        )
    if scales.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: scales must be float16 or bfloat16, got {scales.dtype}")


def check_moe_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"moe: x must be a 2-D float16 or bfloat16 tensor [T, D], got {x.dtype} {list(x.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe: topk_ids must be [T={x.shape[0]}, k], got {list(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"moe: topk_weights must match topk_ids {list(topk_ids.shape)}, "
            f"got {list(topk_weights.shape)}"
        )
