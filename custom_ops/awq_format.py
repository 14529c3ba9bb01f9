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


def check_awq(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    k: int,
    n: int,
    lead: tuple[int, ...] = (),
) -> None:
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


# ---- the pair layout the wgmma W4A16 kernels read (custom_ops/awq_pairs_kernels.py) -----------
# Made once at load time from the AutoAWQ tensors (custom_ops/awq_pairs.py), for in=K, out=N,
# G = K/128 groups:
#   qweight_p int32 [G, N, 16]: word p of (group g, column n) holds, at bits 4 s .. 4 s + 3 and
#                               16 + 4 s .. 16 + 4 s + 3 (s = 0..3), q[128 g + 32 s + 2 p, n] and
#                               q[128 g + 32 s + 2 p + 1, n]: the two halves of one shifted and
#                               masked word are two K-adjacent weights, the register pair of an
#                               MMA operand; a column's group is 64 contiguous bytes;
#   zs_p      int32 [G, N]      the zero point z[g, n] (0..15) in bits 0..7 and the scale s[g, n]
#                               as fp16 in bits 16..31: one word, so the kernels' software
#                               pipeline copies it like the weights (a uint8 and a 16-bit load
#                               were not pipelined; H200, docs/quantization.md). bf16 scales are
#                               stored as fp16, exactly (``pack_zs`` refuses any fp16 cannot
#                               represent).
# W^T[k, n] = (q[k, n] - z[k // 128, n]) * s[k // 128, n], as in the AutoAWQ format.
WORDS = GROUP // PACK  # 16 int32 words per (group, column)


def check_x16(name: str, x: torch.Tensor) -> None:
    """ValueError unless x is a 2-D float16 or bfloat16 activation [M, K]."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"{name}: x must be a 2-D float16 or bfloat16 tensor, got {x.dtype} {list(x.shape)}"
        )


def check_pairs(name: str, qweight_p: torch.Tensor, zs_p: torch.Tensor, k: int) -> int:
    """ValueError unless the two tensors are a pair-layout W4 weight with in=k; returns N."""
    if qweight_p.dim() != 3 or qweight_p.shape[-1] != WORDS:
        raise ValueError(
            f"{name}: qweight_p must be [K/{GROUP}, N, {WORDS}] int32, got {list(qweight_p.shape)}"
        )
    g, n = qweight_p.shape[:2]
    if g * GROUP != k:
        raise ValueError(f"{name}: x has K={k} but qweight_p holds {g} groups of {GROUP}")
    if tuple(zs_p.shape) != (g, n):
        raise ValueError(f"{name}: zs_p must have shape {[g, n]}, got {list(zs_p.shape)}")
    for what, t in (("qweight_p", qweight_p), ("zs_p", zs_p)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: {what} must be torch.int32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous")
    return n


def check_pair_experts(name: str, qw: torch.Tensor, zs: torch.Tensor, k: int) -> None:
    """ValueError unless ``qw [E, k/128, N, 16]``, ``zs [E, k/128, N]`` are stacked experts in the
    pair layout."""
    if qw.dim() != 4 or zs.dim() != 3:
        raise ValueError(
            f"{name}: need qweight_p [E, K/128, N, 16] and zs_p [E, K/128, N], got "
            f"{list(qw.shape)}, {list(zs.shape)}"
        )
    if qw.shape[0] != zs.shape[0]:
        raise ValueError(f"{name}: the expert counts differ: {qw.shape[0]}, {zs.shape[0]}")
    check_pairs(name, qw[0], zs[0], k)
    if not (qw.is_contiguous() and zs.is_contiguous()):
        raise ValueError(f"{name}: the stacked expert tensors must be contiguous")
