"""AWQ 4-bit (W4A16) ops: ``echo::w4a16_linear`` and ``echo::moe_w4a16`` (+ ``echo::moe_bf16``).

Each op has a pure-torch reference (its default kernel), a Triton kernel (its CUDA kernel,
``awq_kernels.py``, imported on first use) and a fake implementation; the format and its checks
are in ``awq_format.py``. Format, AutoAWQ "gemm" (docs/model_notes.md), for a linear with in=K,
out=N:
``qweight int32 [K, N/8]``, ``qzeros int32 [K/128, N/8]``, ``scales fp16|bf16 [K/128, N]``;
nibble i of a word holds column ``8c + ORDER[i]``; ``W^T[k, n] = (q[k, n] - z[k // 128, n]) *
s[k // 128, n]`` and ``y = x @ W^T``.

Numerics (kernel and reference alike): ``(q - z) * s`` is exact in fp32, products accumulate in
fp32, the output is rounded once to x's dtype. In the MoE, ``silu(gate) * up`` is computed in fp32
and rounded to x's dtype as the down projection's input; the weighted sum over the k experts is
fp32 and returned in fp32 (as ``model.moe.Experts``: the caller adds the shared experts in fp32).
``moe_bf16`` also rounds the gate/up and down outputs to x's dtype, as the bf16 model's 16-bit
linears do (so the model computes the same numbers through it as through its dense form).
"""

from __future__ import annotations

import torch

from custom_ops.awq_format import (
    AWQ_REVERSE_ORDER,
    GROUP,
    PACK,
    check_awq,
    check_moe_inputs,
)


def _triton():
    """The Triton kernels, imported on the first CUDA call (not when the ops register)."""
    from custom_ops import awq_kernels

    return awq_kernels


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., N/8] -> int32 [..., N] of 4-bit values in column order (undoes AWQ_ORDER)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"awq_unpack: packed words must be int32, got {packed.dtype}")
    shifts = 4 * torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int32, device=packed.device)
    # NOTE: words with the top nibble >= 8 are negative; >> is arithmetic, & 0xF keeps the nibble.
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def awq_dequantize_t(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """fp32 ``W^T [..., K, N]`` (the checkpoint's [in, out] orientation); leading dims (experts)
    are kept."""
    q = awq_unpack(qweight)  # [..., K, N]
    z = awq_unpack(qzeros)  # [..., K/128, N]
    if (
        z.shape[-2] * GROUP != q.shape[-2]
        or tuple(scales.shape) != tuple(z.shape)
        or z.shape[:-2] != q.shape[:-2]
        or z.shape[-1] != q.shape[-1]
    ):
        raise ValueError(
            f"awq_dequantize: inconsistent shapes qweight {list(qweight.shape)}, "
            f"qzeros {list(qzeros.shape)}, scales {list(scales.shape)} (group {GROUP})"
        )
    zr = z.repeat_interleave(GROUP, dim=-2)  # [..., K, N]
    sr = scales.float().repeat_interleave(GROUP, dim=-2)
    return (q - zr).float() * sr


# ---- w4a16_linear ----------------------------------------------------------------------------


def w4a16_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Reference: ``(x.float() @ W^T).to(x.dtype)`` with fp32 ``W^T`` from ``awq_dequantize_t``."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            "w4a16_linear: x must be a 2-D float16 or bfloat16 tensor, "
            f"got {x.dtype} {list(x.shape)}"
        )
    n = qweight.shape[-1] * PACK
    check_awq("w4a16_linear", qweight, qzeros, scales, x.shape[-1], n)
    return (x.float() @ awq_dequantize_t(qweight, qzeros, scales)).to(x.dtype)


@torch.library.custom_op("echo::w4a16_linear", mutates_args=())
def w4a16_linear(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` (x bf16/fp16) with AWQ weights; the reference by default,
    Triton on CUDA."""
    return w4a16_linear_ref(x, qweight, qzeros, scales)


@w4a16_linear.register_kernel("cuda")
def _(x, qweight, qzeros, scales):
    return _triton().w4a16_linear_triton(x, qweight, qzeros, scales)


@w4a16_linear.register_fake
def _(x, qweight, qzeros, scales):
    return x.new_empty((x.shape[0], qweight.shape[-1] * PACK))


# ---- moe_w4a16 / moe_bf16 --------------------------------------------------------------------


def _moe_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_t: torch.Tensor,
    w2_t: torch.Tensor,
) -> torch.Tensor:
    """Per-expert loop over the tokens routed to it. ``w13_t [E, D, 2I]``, ``w2_t [E, I, D]`` fp32
    (input-major, as AWQ stores them)."""
    check_moe_inputs(x, topk_ids, topk_weights)
    t, d = x.shape
    inter = w13_t.shape[-1] // 2
    out = torch.zeros((t, d), dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(w13_t.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xf[tok] @ w13_t[e]  # [n, 2I] gate | up, fp32 as the kernel's epilogue sees them
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = h.to(x.dtype).float() @ w2_t[e]  # [n, D]
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
    return out


def moe_w4a16_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_qzeros: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_qzeros: torch.Tensor,
    w2_scales: torch.Tensor,
) -> torch.Tensor:
    """Reference for ``echo::moe_w4a16`` (fp32 dequantised weights, plain torch)."""
    w13_t = awq_dequantize_t(w13_qweight, w13_qzeros, w13_scales)  # [E, D, 2I]
    w2_t = awq_dequantize_t(w2_qweight, w2_qzeros, w2_scales)  # [E, I, D]
    if w13_t.shape[1] != x.shape[1] or w2_t.shape[2] != x.shape[1]:
        raise ValueError(
            f"moe_w4a16: x has D={x.shape[1]}, weights give {w13_t.shape[1]} / {w2_t.shape[2]}"
        )
    return _moe_ref(x, topk_ids, topk_weights, w13_t, w2_t)


@torch.library.custom_op("echo::moe_w4a16", mutates_args=())
def moe_w4a16(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_qzeros: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_qzeros: torch.Tensor,
    w2_scales: torch.Tensor,
) -> torch.Tensor:
    """Routed AWQ experts: ``x [T, D] -> fp32 [T, D] = sum_j w[t, j] * down(silu(gate(x)) * up(x))``
    with ``e = topk_ids[t, j]`` (int32/int64) and ``w = topk_weights`` (any float dtype); the
    reference by default, Triton on CUDA."""
    w = (w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros, w2_scales)
    return moe_w4a16_ref(x, topk_ids, topk_weights, *w)


@moe_w4a16.register_kernel("cuda")
def _(x, topk_ids, topk_weights, w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros,
      w2_scales):  # fmt: skip
    w = (w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros, w2_scales)
    return _triton().moe_w4a16_triton(x, topk_ids, topk_weights, *w)


@moe_w4a16.register_fake
def _(
    x, topk_ids, topk_weights, w13_qweight, w13_qzeros, w13_scales, w2_qweight, w2_qzeros, w2_scales
):
    return x.new_empty(x.shape, dtype=torch.float32)


def moe_bf16_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w2_weight: torch.Tensor,
) -> torch.Tensor:
    """Reference for ``echo::moe_bf16``: ``w13_weight [E, 2I, D]``, ``w2_weight [E, D, I]`` in x's
    dtype. Numerics of the DeepSeek reference's ``Expert`` (and ``model.moe.MLP``): the gate/up
    projection and the down projection are 16-bit linears (rounded to x's dtype), ``silu(g) * u``
    in fp32 rounded to x's dtype, the weighted sum over the k experts in fp32."""
    check_moe_inputs(x, topk_ids, topk_weights)
    t, d = x.shape
    inter = w13_weight.shape[1] // 2
    if w13_weight.shape[2] != d or w2_weight.shape[1] != d:
        raise ValueError(
            f"moe_bf16: x has D={d}, weights give {w13_weight.shape[2]} / {w2_weight.shape[1]}"
        )
    out = torch.zeros((t, d), dtype=torch.float32, device=x.device)
    for e in range(w13_weight.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = torch.nn.functional.linear(x[tok], w13_weight[e].to(x.dtype))  # [n, 2I] 16-bit
        h = torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()
        y = torch.nn.functional.linear(h.to(x.dtype), w2_weight[e].to(x.dtype))  # [n, D]
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(-1))
    return out


@torch.library.custom_op("echo::moe_bf16", mutates_args=())
def moe_bf16(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w2_weight: torch.Tensor,
) -> torch.Tensor:
    """The fused MoE with 16-bit stacked weights (the grouped kernels of ``moe_w4a16``, with the
    projections rounded to x's dtype as ``moe_bf16_ref`` says); the reference by default, Triton
    on CUDA. ``model.moe.Experts`` calls it."""
    return moe_bf16_ref(x, topk_ids, topk_weights, w13_weight, w2_weight)


@moe_bf16.register_kernel("cuda")
def _(x, topk_ids, topk_weights, w13_weight, w2_weight):
    return _triton().moe_bf16_triton(x, topk_ids, topk_weights, w13_weight, w2_weight)


@moe_bf16.register_fake
def _(x, topk_ids, topk_weights, w13_weight, w2_weight):
    return x.new_empty(x.shape, dtype=torch.float32)
