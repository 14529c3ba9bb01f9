"""``echo::sparse_mla_decode``: MLA decode attention in the absorbed (MQA) form over selected rows.

For each request b and head h: scores over the selected rows r_k (576 = c_kv 512 + k_pe 64),
``s_k = (q[b, h] · r_k) * softmax_scale`` in fp32, softmax over the valid (slot >= 0) entries, and
``o[b, h] = Σ_k p_k * r_k[:512]`` (bf16 out). The selected list is walked in its given order, so the
result depends on which rows are selected and in what order, never on where they sit in the pool.
A request with no valid slot (a padded batch row) gets zeros.
"""

from __future__ import annotations

import torch

from custom_ops.kv_format import KV_LORA, ROPE, ROW_BYTES, check_fmt, unpack_kv_rows


def sparse_mla_decode_ref(
    q: torch.Tensor,  # [B, H, 576] bf16
    pool: torch.Tensor,  # [N, row] uint8
    slots: torch.Tensor,  # [B, K] int32, -1 = unused
    softmax_scale: float,
    fmt: str,
) -> torch.Tensor:
    rows = unpack_kv_rows(pool[slots.clamp(min=0).long()], fmt).float()  # [B, K, 576]
    s = torch.einsum("bhc,bkc->bhk", q.float(), rows) * softmax_scale  # [B, H, K]
    valid = (slots >= 0)[:, None, :]
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).clamp(min=-1e30)  # all -inf rows stay finite
    p = torch.exp(s - m)
    p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    o = torch.einsum("bhk,bkc->bhc", p, rows[..., :KV_LORA])
    return o.to(torch.bfloat16)


def _check(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, fmt: str) -> None:
    check_fmt(fmt)
    if q.dim() != 3 or q.shape[-1] != KV_LORA + ROPE or q.dtype != torch.bfloat16:
        raise ValueError(
            f"sparse_mla_decode: q must be bf16 [B, H, 576], got {q.dtype} {list(q.shape)}"
        )
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != ROW_BYTES[fmt]:
        raise ValueError(f"sparse_mla_decode: pool must be uint8 [N, {ROW_BYTES[fmt]}] for {fmt}")
    if slots.dim() != 2 or slots.shape[0] != q.shape[0] or slots.dtype != torch.int32:
        raise ValueError("sparse_mla_decode: slots must be int32 [B, K]")


@torch.library.custom_op("echo::sparse_mla_decode", mutates_args=())
def sparse_mla_decode(
    q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, softmax_scale: float, fmt: str
) -> torch.Tensor:
    """Default kernel (CPU): the reference."""
    _check(q, pool, slots, fmt)
    return sparse_mla_decode_ref(q, pool, slots, softmax_scale, fmt)


@sparse_mla_decode.register_kernel("cuda")
def _(q, pool, slots, softmax_scale, fmt):
    _check(q, pool, slots, fmt)
    from custom_ops import attention_kernels  # Triton: imported on the first CUDA call

    return attention_kernels.sparse_mla_decode_cuda(q, pool, slots, softmax_scale, fmt)


@sparse_mla_decode.register_fake
def _(q, pool, slots, softmax_scale, fmt):
    return q.new_empty((q.shape[0], q.shape[1], KV_LORA))
