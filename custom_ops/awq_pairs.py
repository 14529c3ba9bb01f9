"""AWQ weights in the pair layout (``awq_format.py``) and the two ops over it:
``echo::w4a16_linear_p`` and ``echo::moe_w4a16_p`` (Triton kernels in ``awq_pairs_kernels.py`` and
``awq_pairs_moe.py``).

The references dequantise to the same fp32 weights as the AutoAWQ ones (``(q - z) * s``, exact),
so they agree with ``w4a16_linear_ref`` / ``moe_w4a16_ref`` bit for bit; the kernels sum in
another order (the MMA's), so they agree within fp32 rounding. Where the launch rules take the
SCALED kernels or the dequantised path (``awq_pairs_kernels.p_config``, ``uses_dequant``,
``awq_pairs_moe.moe_p_config``) W is also rounded to x's dtype (``dequantize_pairs_t(...,
dtype)``): within 1e-2 of the references, as AutoAWQ's and vLLM's kernels compute.
"""

from __future__ import annotations

import torch

from custom_ops.awq import _moe_ref, awq_unpack
from custom_ops.awq_format import (
    GROUP,
    PACK,
    WORDS,
    check_awq,
    check_pair_experts,
    check_pairs,
    check_x16,
)


def _triton():
    from custom_ops import awq_pairs_kernels

    return awq_pairs_kernels


def reserve_counters(device: torch.device) -> None:
    """Load time, on CUDA: the split-K tile counters of the pair kernels, made outside any
    CUDA-graph memory pool (``awq_pairs_kernels.reserve_counters``)."""
    if torch.device(device).type == "cuda":
        _triton().reserve_counters(device)


def _pair_shifts(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[4 (s), 2 (h)]``: the bit where K row ``32 s + 2 p + h`` of a group sits in word p."""
    s = torch.arange(4, device=device, dtype=dtype)[:, None]
    return 4 * s + torch.tensor([0, 16], device=device, dtype=dtype)


def pack_zs(zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Zero points (integers 0..15, any int dtype) and scales (fp16 or bf16) ``[..., N]`` -> the
    pair layout's ``zs_p`` int32: z in bits 0..7, the scale as fp16 in bits 16..31. A bf16 scale
    is stored as fp16 exactly (fp16 has more mantissa bits, and holds every bf16 value in
    [6.1e-05, 65504]); ValueError for one that fp16 cannot represent exactly."""
    if scales.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"pack_zs: scales must be float16 or bfloat16, got {scales.dtype}")
    s16 = scales.to(torch.float16)
    if scales.dtype != torch.float16 and not torch.equal(s16.to(scales.dtype), scales):
        bad = scales[s16.to(scales.dtype) != scales].flatten()[:4].tolist()
        raise ValueError(
            f"pack_zs: bf16 scales that fp16 cannot represent exactly (it holds every bf16 value "
            f"in [6.1e-05, 65504]), e.g. {bad}"
        )
    halves = torch.stack([zeros.to(torch.int16), s16.view(torch.int16)], dim=-1)  # [..., N, 2]
    return halves.contiguous().view(torch.int32).squeeze(-1)  # little-endian: z low, s high


def unpack_zs(zs_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``zs_p`` int32 -> (the zero points int32, the scales fp16), undoing ``pack_zs``."""
    return zs_p & 0xFF, (zs_p >> 16).to(torch.int16).view(torch.float16)


def pair_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ ``(qweight [K, N/8], qzeros [K/128, N/8], scales [K/128, N])`` -> the pair layout
    ``(qweight_p int32 [K/128, N, 16], zs_p int32 [K/128, N])``."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    check_awq("pair_awq", qweight, qzeros, scales, k, n)
    g = k // GROUP
    q = awq_unpack(qweight).to(torch.int64)  # [K, N], k = 128 g + 32 s + 2 p + h
    q = q.view(g, 4, WORDS, 2, n).permute(0, 4, 2, 1, 3)  # [G, N, 16 (p), 4 (s), 2 (h)]
    shifts = _pair_shifts(q.device, torch.int64)  # [4 (s), 2 (h)]
    word = (q << shifts).sum((-1, -2))  # [G, N, 16] in [0, 2^32)
    qweight_p = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()
    return qweight_p, pack_zs(awq_unpack(qzeros), scales)


def pair_awq_experts(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked AutoAWQ experts ``[E, K, N/8]``, ``[E, K/128, N/8]``, ``[E, K/128, N]`` -> the
    stacked pair layout ``[E, K/128, N, 16]``, ``[E, K/128, N]``."""
    if qweight.dim() != 3:
        raise ValueError(
            f"pair_awq_experts: qweight must be [E, K, N/8], got {list(qweight.shape)}"
        )
    parts = [pair_awq(qweight[e], qzeros[e], scales[e]) for e in range(qweight.shape[0])]
    return tuple(torch.stack(list(t)) for t in zip(*parts, strict=True))  # type: ignore[return-value]


def unpack_pairs(qweight_p: torch.Tensor) -> torch.Tensor:
    """int32 ``[G, N, 16]`` -> the 4-bit values ``q [K, N]`` (int32), undoing ``pair_awq``."""
    g, n, _ = qweight_p.shape
    shifts = _pair_shifts(qweight_p.device, torch.int32)
    # NOTE: >> is arithmetic on negative words; & 0xF keeps the nibble.
    q = (qweight_p[..., None, None] >> shifts) & 0xF  # [G, N, 16 (p), 4 (s), 2 (h)]
    return q.permute(0, 3, 2, 4, 1).reshape(g * GROUP, n)


def dequantize_pairs_t(
    qweight_p: torch.Tensor, zs_p: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """fp32 ``W^T [K, N]`` of a pair-layout weight (exact: small integers times a 16-bit scale).
    With ``dtype`` (bf16 / fp16): the scale in that dtype and the product rounded to it once, the
    weights the scaled kernels compute with (``awq_pairs_kernels``: SCALED, ``dequant_p``)."""
    q = unpack_pairs(qweight_p)
    z, s = unpack_zs(zs_p)
    s = s if dtype is None else s.to(dtype)
    w = (q - z.repeat_interleave(GROUP, dim=0)).float() * s.float().repeat_interleave(GROUP, dim=0)
    return w if dtype is None else w.to(dtype).float()


# ---- echo::w4a16_linear_p --------------------------------------------------------------------


def w4a16_linear_p_ref(
    x: torch.Tensor, qweight_p: torch.Tensor, zs_p: torch.Tensor
) -> torch.Tensor:
    """Reference: ``(x.float() @ W^T).to(x.dtype)``."""
    check_x16("w4a16_linear_p", x)
    check_pairs("w4a16_linear_p", qweight_p, zs_p, x.shape[1])
    return (x.float() @ dequantize_pairs_t(qweight_p, zs_p)).to(x.dtype)


@torch.library.custom_op("echo::w4a16_linear_p", mutates_args=())
def w4a16_linear_p(x: torch.Tensor, qweight_p: torch.Tensor, zs_p: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` with a pair-layout W4 weight; the reference by default,
    Triton on CUDA."""
    return w4a16_linear_p_ref(x, qweight_p, zs_p)


@w4a16_linear_p.register_kernel("cuda")
def _(x, qweight_p, zs_p):
    return _triton().w4a16_linear_p_triton(x, qweight_p, zs_p)


@w4a16_linear_p.register_fake
def _(x, qweight_p, zs_p):
    return x.new_empty((x.shape[0], qweight_p.shape[1]))


# ---- echo::moe_w4a16_p -----------------------------------------------------------------------


def dequantize_pairs_experts_t(
    qw: torch.Tensor, zs: torch.Tensor, k: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """fp32 ``W^T [E, K, N]`` of stacked pair-layout experts (K checked when given; ``dtype``:
    rounded as ``dequantize_pairs_t``)."""
    check_pair_experts("moe_w4a16_p", qw, zs, k if k is not None else qw.shape[1] * GROUP)
    return torch.stack([dequantize_pairs_t(qw[e], zs[e], dtype) for e in range(qw.shape[0])])


def moe_w4a16_p_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight_p: torch.Tensor,
    w13_zs_p: torch.Tensor,
    w2_qweight_p: torch.Tensor,
    w2_zs_p: torch.Tensor,
) -> torch.Tensor:
    """Reference for ``echo::moe_w4a16_p``: the numerics of ``moe_w4a16_ref``."""
    w13_t = dequantize_pairs_experts_t(w13_qweight_p, w13_zs_p, x.shape[1])  # [E, D, 2I]
    inter = w13_t.shape[2] // 2
    w2_t = dequantize_pairs_experts_t(w2_qweight_p, w2_zs_p, inter)  # [E, I, D]
    if w2_t.shape[2] != x.shape[1]:
        raise ValueError(f"moe_w4a16_p: x has D={x.shape[1]}, w2 gives {w2_t.shape[2]}")
    return _moe_ref(x, topk_ids, topk_weights, w13_t, w2_t)


@torch.library.custom_op("echo::moe_w4a16_p", mutates_args=())
def moe_w4a16_p(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight_p: torch.Tensor,
    w13_zs_p: torch.Tensor,
    w2_qweight_p: torch.Tensor,
    w2_zs_p: torch.Tensor,
) -> torch.Tensor:
    """Routed experts over pair-layout W4 weights: ``x [T, D] -> fp32 [T, D]``, as
    ``echo::moe_w4a16``; the reference by default, Triton on CUDA (gate and up fused)."""
    w = (w13_qweight_p, w13_zs_p, w2_qweight_p, w2_zs_p)
    return moe_w4a16_p_ref(x, topk_ids, topk_weights, *w)


@moe_w4a16_p.register_kernel("cuda")
def _(x, topk_ids, topk_weights, w13_qweight_p, w13_zs_p, w2_qweight_p, w2_zs_p):
    from custom_ops.awq_pairs_moe import moe_w4a16_p_triton

    w = (w13_qweight_p, w13_zs_p, w2_qweight_p, w2_zs_p)
    return moe_w4a16_p_triton(x, topk_ids, topk_weights, *w)


@moe_w4a16_p.register_fake
def _(x, topk_ids, topk_weights, w13_qweight_p, w13_zs_p, w2_qweight_p, w2_zs_p):
    return x.new_empty(x.shape, dtype=torch.float32)
