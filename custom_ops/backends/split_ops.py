"""The two halves of ``echo::indexer_topk`` as ops of their own, so that a library can serve one
half and Triton the other (DeepGEMM scores + Triton top-k, Triton scores + FlashInfer top-k).

``echo::index_scores(q, weights, index_cache, block_table, seq_lens)`` -> scores fp32 [B, P*64]
(-inf past each length) and ``echo::topk_from_scores(scores, block_table, seq_lens, topk)`` ->
(host slots, kth), the semantics of ``indexer_topk_ref``'s two steps; ``scores`` may be wider
than P*64 (DeepGEMM's padded rows), only live positions are read. Default kernels: the
references; CUDA kernels: ``custom_ops.indexer_kernels`` at its default launch configuration.
"""

from __future__ import annotations

import torch

from custom_ops.backends.deep_gemm_ops import scores_ref
from custom_ops.backends.ties import stable_select_ref
from custom_ops.kv_format import PAGE


@torch.library.custom_op("echo::index_scores", mutates_args=())
def index_scores(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Default kernel (CPU): the reference."""
    width = block_table.shape[1] * PAGE
    return scores_ref(q_fp8, weights, index_cache, block_table, seq_lens, width)


@index_scores.register_kernel("cuda")
def _(q_fp8, weights, index_cache, block_table, seq_lens):
    from custom_ops import indexer_kernels as ik

    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    return ik.index_scores(q_fp8, weights, index_cache, bt, seq_lens, ik.IndexerConfig())


@index_scores.register_fake
def _(q_fp8, weights, index_cache, block_table, seq_lens):
    return q_fp8.new_empty((q_fp8.shape[0], block_table.shape[1] * PAGE), dtype=torch.float32)


@torch.library.custom_op("echo::topk_from_scores", mutates_args=())
def topk_from_scores(
    scores: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default kernel (CPU): the stable-sort reference."""
    return stable_select_ref(scores, block_table, seq_lens, topk)


@topk_from_scores.register_kernel("cuda")
def _(scores, block_table, seq_lens, topk):
    from custom_ops import indexer_kernels as ik

    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    return ik.topk_from_scores(scores.contiguous(), bt, seq_lens, topk, ik.IndexerConfig())


@topk_from_scores.register_fake
def _(scores, block_table, seq_lens, topk):
    B = scores.shape[0]
    return (
        scores.new_empty((B, topk), dtype=torch.int32),
        scores.new_empty((B,), dtype=torch.float32),
    )
