"""Byte layouts of one token's cache rows.

MLA latent row (one per token per layer), stored as ``uint8 [row_bytes]``:
- ``bf16``: 512 c_kv + 64 k_pe, bf16 (1152 B; what the public ECHO code stores).
- ``fp8``: FlashMLA's 656-byte format: 512 e4m3 c_kv, 4 fp32 scales (one per 128), 64 bf16 k_pe.
The model's c_kv has already been through the FP8 round trip (the reference simulates the deployed
precision; docs/model_notes.md), so both formats decode to the same bf16 values: re-quantising an
FP8-representable vector with power-of-two scales is exact.

Indexer key row: 128 e4m3 + 1 fp32 scale (132 B). The paged indexer cache holds, per page of 64
tokens, the 64x128 value bytes and then the 64 fp32 scales (8448 B a page).
"""

from __future__ import annotations

import torch

from custom_ops.fp8 import FP8_DTYPE, act_dequant, act_quant

KV_LORA = 512
ROPE = 64
ROW_BYTES = {"bf16": 2 * (KV_LORA + ROPE), "fp8": KV_LORA + 16 + 2 * ROPE}
INDEX_DIM = 128
INDEX_ROW_BYTES = INDEX_DIM + 4
PAGE = 64
INDEX_PAGE_BYTES = PAGE * INDEX_ROW_BYTES  # 8448


def pages_for(tokens: int) -> int:
    """Whole pages that hold ``tokens`` tokens (host slots are handed out a page at a time)."""
    return -(-tokens // PAGE)


def whole_pages(rows: int) -> int:
    """``rows`` rounded down to whole pages (the rows a pool of ``rows`` can hand out)."""
    return rows // PAGE * PAGE


def check_fmt(fmt: str) -> None:
    if fmt not in ROW_BYTES:
        raise ValueError(f"KV row format must be 'bf16' or 'fp8', got {fmt!r}")


def pack_kv_rows(c_kv: torch.Tensor, k_pe: torch.Tensor, fmt: str) -> torch.Tensor:
    """c_kv [N, 512] and k_pe [N, 64] (bf16) -> rows uint8 [N, ROW_BYTES[fmt]]."""
    check_fmt(fmt)
    c_kv = c_kv.to(torch.bfloat16)
    k_pe = k_pe.to(torch.bfloat16)
    if fmt == "bf16":
        return torch.cat([c_kv, k_pe], dim=-1).contiguous().view(torch.uint8)
    q, s = act_quant(c_kv, 128, "ue8m0")  # [N, 512] e4m3, [N, 4] fp32
    return torch.cat(
        [
            q.view(torch.uint8),
            s.contiguous().view(torch.uint8),
            k_pe.contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


def unpack_kv_rows(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """rows uint8 [..., ROW_BYTES[fmt]] -> bf16 [..., 576] (c_kv then k_pe)."""
    check_fmt(fmt)
    rows = rows.contiguous()
    if fmt == "bf16":
        return rows.view(torch.bfloat16)
    q = rows[..., :KV_LORA].contiguous().view(FP8_DTYPE)
    s = rows[..., KV_LORA : KV_LORA + 16].contiguous().view(torch.float32)
    pe = rows[..., KV_LORA + 16 :].contiguous().view(torch.bfloat16)
    return torch.cat([act_dequant(q, s, 128).to(torch.bfloat16), pe], dim=-1)


def pack_index_k(k_fp8: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """k_fp8 [N, 128] e4m3 and k_scale [N] or [N, 1] fp32 -> uint8 [N, 132] (values, then scale)."""
    # NOTE: the fp32 scale's bytes are cut out of its int32 bit pattern (little-endian) instead of
    # a float->byte dtype view: Inductor rejects such views when a size-1 dim gets stride 0
    # (N == 1).
    bits = k_scale.reshape(-1, 1).float().view(torch.int32)  # [N, 1], same element size: any stride
    shifts = torch.arange(0, 32, 8, device=bits.device, dtype=torch.int32)
    scale_bytes = ((bits >> shifts) & 0xFF).to(torch.uint8)  # [N, 4]
    return torch.cat([k_fp8.view(torch.uint8), scale_bytes], dim=-1)


def index_cache_gather(
    index_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read indexer keys of host ``slots`` (any shape, >= 0) from the paged cache [pages, 8448]:
    returns (k fp32 values [..., 128], scale fp32 [...])."""
    page, off = slots // PAGE, slots % PAGE
    flat = index_cache.view(-1)
    base = page.long() * INDEX_PAGE_BYTES
    vidx = (base + off.long() * INDEX_DIM).unsqueeze(-1) + torch.arange(
        INDEX_DIM, device=slots.device
    )
    sidx = (base + PAGE * INDEX_DIM + off.long() * 4).unsqueeze(-1) + torch.arange(
        4, device=slots.device
    )
    k = flat[vidx].view(FP8_DTYPE).float()
    s = flat[sidx].contiguous().view(torch.float32).squeeze(-1)
    return k, s
