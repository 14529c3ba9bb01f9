"""``echo::indexer_topk``: the lightning indexer's scores over every past token of each decode
request, and the exact top-k of them (docs/model_notes.md, indexer steps 6-7).

score[b, t] = k_scale[t] * Σ_h weights[b, h] * ReLU(Σ_d q[b, h, d] * k[t, d])   (fp32, fp8 inputs)

over tokens t < seq_lens[b] of request b, read from the paged indexer cache through the block
table. The top min(topk, seq_len) tokens are chosen by score, ties going to the earlier token; the
output lists their host slots in ascending token position (-1 padded), so the attention that reads
them reduces in an order that does not depend on where the rows live. ``kth`` is the lowest selected
score (the k-th when seq_len >= topk; -inf for an empty request): the prefetch threshold's input.
"""

from __future__ import annotations

import torch

from custom_ops.kv_format import PAGE, index_cache_gather


def indexer_topk_ref(
    q_fp8: torch.Tensor,  # [B, Hi, 128] uint8: the e4m3 bytes (opcheck cannot compare fp8 tensors)
    weights: torch.Tensor,  # [B, Hi] fp32 (head weights with every scale folded in)
    index_cache: torch.Tensor,  # [pages, 8448] uint8
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, P = block_table.shape
    L = P * PAGE
    dev = q_fp8.device
    t = torch.arange(L, device=dev)
    slots = block_table[:, t // PAGE].long() * PAGE + (t % PAGE)  # [B, L]
    k, k_scale = index_cache_gather(index_cache, slots)  # [B, L, 128], [B, L]
    logits = torch.einsum("bhd,btd->bht", q_fp8.view(torch.float8_e4m3fn).float(), k)  # [B, Hi, L]
    score = (logits.relu() * weights.float()[:, :, None]).sum(dim=1) * k_scale  # [B, L]
    valid = t[None, :] < seq_lens[:, None].long()
    score = torch.where(valid, score, torch.full_like(score, float("-inf")))
    K = min(topk, L)
    order = torch.sort(-score, dim=1, stable=True).indices[:, :K]  # best first, ties: earlier t
    n_sel = seq_lens.long().clamp(max=K)  # [B]
    chosen = torch.arange(K, device=dev)[None, :] < n_sel[:, None]
    kth = score.gather(1, order).gather(1, (n_sel - 1).clamp(min=0)[:, None]).squeeze(1)
    kth = torch.where(n_sel > 0, kth, torch.full_like(kth, float("-inf")))
    pos = torch.sort(torch.where(chosen, order, L), dim=1).values  # ascending position, pad = L
    host = torch.where(pos < L, slots.gather(1, pos.clamp(max=L - 1)), -1).to(torch.int32)
    if K < topk:
        host = torch.cat([host, host.new_full((B, topk - K), -1)], dim=1)
    return host, kth


def _check(q_fp8, weights, index_cache, block_table, seq_lens, topk) -> None:
    if q_fp8.dim() != 3 or q_fp8.shape[-1] != 128 or q_fp8.dtype != torch.uint8:
        raise ValueError(
            "indexer_topk: q must be the e4m3 bytes as uint8 [B, H, 128], got "
            f"{q_fp8.dtype} {list(q_fp8.shape)}"
        )
    B, H = q_fp8.shape[:2]
    if weights.shape != (B, H) or weights.dtype != torch.float32:
        raise ValueError(
            f"indexer_topk: weights must be fp32 [{B}, {H}], got "
            f"{weights.dtype} {list(weights.shape)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("indexer_topk: block_table must be [B, P] and seq_lens [B]")
    if (
        index_cache.dtype != torch.uint8
        or index_cache.dim() != 2
        or index_cache.shape[1] != PAGE * 132
    ):
        raise ValueError(f"indexer_topk: index cache must be uint8 [pages, {PAGE * 132}]")
    if topk <= 0:
        raise ValueError(f"indexer_topk: topk must be positive, got {topk}")


@torch.library.custom_op("echo::indexer_topk", mutates_args=())
def indexer_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default kernel (CPU): the reference."""
    _check(q_fp8, weights, index_cache, block_table, seq_lens, topk)
    return indexer_topk_ref(q_fp8, weights, index_cache, block_table, seq_lens, topk)


@indexer_topk.register_kernel("cuda")
def _(q_fp8, weights, index_cache, block_table, seq_lens, topk):
    _check(q_fp8, weights, index_cache, block_table, seq_lens, topk)
    from custom_ops import indexer_kernels  # Triton: imported on the first CUDA call

    return indexer_kernels.indexer_topk_cuda(
        q_fp8, weights, index_cache, block_table, seq_lens, topk
    )


@indexer_topk.register_fake
def _(q_fp8, weights, index_cache, block_table, seq_lens, topk):
    B = q_fp8.shape[0]
    return (
        q_fp8.new_empty((B, topk), dtype=torch.int32),
        q_fp8.new_empty((B,), dtype=torch.float32),
    )
