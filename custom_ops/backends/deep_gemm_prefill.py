"""DeepGEMM's prefill indexer logits (``deep_gemm.fp8_mqa_logits``) as an ``echo::`` op, the
library backend of step (a) of ``echo::prefill_indexer_topk`` (custom_ops/prefill.py).

``echo::dg_prefill_logits(q_fp8 [Q, Hi, 128] uint8, weights [Q, Hi] fp32, index_cache,
block_table [1, P] int32, positions [Q] int64)`` -> scores fp32 ``[Q, W]``,
``W = prefill_logits_width(P * 64)`` (P * 64 rounded up to 256): ``prefill_index_logits_ref``'s
scores in the first P * 64 columns, -inf at every t > p (the columns past P * 64 included).

What the library takes (read in the 0.1.5.post1 wheel's host asserts and its SM90 kernel):
- q ``[Q, H, 128]`` e4m3 contiguous, H = 32 or 64 on SM90 (``HEADS``; the tiny model's 4 heads
  run Triton); weights fp32 ``[Q, H]`` with unit inner stride;
- keys contiguous ``[L, 128]`` e4m3 and scales contiguous ``[L]`` fp32. Our paged cache puts each
  page's 64 scales after its 64 x 128 values, so it cannot be read in place: one gather of the
  request's L = P * 64 keys per call (``gather_index_keys``, 132 bytes a token: at 100K, 13 MB,
  against the ~3 TFLOP of a 2048-query chunk's logits);
- ``ks``/``ke`` int32 ``[Q]``: query q scores keys [ks, ke); causal: ks = 0, ke = p + 1.
- The output: with ``max_seqlen_k = 0`` the library returns a ``[Q, L]`` view of rows whose
  stride differs between its versions (L + 256 rounded up to 4, 8 or 256 floats); with
  ``max_seqlen_k = W`` ("compressed" logits: column t - ks, here t since ks = 0) the row stride
  is W in every version we read (W a multiple of 256), so the result is one contiguous
  ``[Q, W]`` tensor, no copy. That mode writes only [ks, ke) of each row (its ``clean_logits``
  is refused there): the rest is unwritten memory, so the op writes -inf past each p itself
  (``causal_clean``); ``echo::prefill_indexer_topk`` skips that pass, its radix select reads
  t < p + 1 only.

Default kernel (CPU): the reference. The library is imported on the first CUDA call. Static
shapes only, no host sync: the compiled prefill captures it per chunk bucket.
"""

from __future__ import annotations

import torch

from custom_ops.backends.deep_gemm_ops import HEADS, prefill_logits_width
from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE
from custom_ops.prefill import prefill_index_logits_ref


def gather_index_keys_ref(
    index_cache: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's keys by position: values uint8 ``[P*64, 128]`` (e4m3 bytes) and scales fp32
    ``[P*64]``, page ``block_table[0, i]`` giving positions 64 i .. 64 i + 63."""
    pages = index_cache[block_table[0].long()]  # [P, 8448]
    vals = pages[:, : PAGE * INDEX_DIM].reshape(-1, INDEX_DIM)
    scales = pages[:, PAGE * INDEX_DIM :].contiguous().view(torch.float32).reshape(-1)
    return vals, scales


def _check(q_fp8, weights, index_cache, block_table, positions) -> None:
    if q_fp8.dtype != torch.uint8 or q_fp8.dim() != 3 or q_fp8.shape[-1] != INDEX_DIM:
        raise ValueError(f"dg_prefill_logits: q must be uint8 [Q, H, {INDEX_DIM}] (e4m3 bytes)")
    Q, H = q_fp8.shape[:2]
    if weights.shape != (Q, H) or weights.dtype != torch.float32:
        raise ValueError(f"dg_prefill_logits: weights must be fp32 [{Q}, {H}]")
    if block_table.dim() != 2 or block_table.shape[0] != 1 or block_table.dtype != torch.int32:
        raise ValueError("dg_prefill_logits: block_table must be int32 [1, P] (one request)")
    if positions.shape != (Q,) or positions.dtype != torch.int64:
        raise ValueError(f"dg_prefill_logits: positions must be int64 [{Q}]")
    if (
        index_cache.dtype != torch.uint8
        or index_cache.dim() != 2
        or index_cache.shape[1] != INDEX_PAGE_BYTES
    ):
        raise ValueError(
            f"dg_prefill_logits: index cache must be uint8 [pages, {INDEX_PAGE_BYTES}]"
        )


def dg_prefill_logits_ref(q_fp8, weights, index_cache, block_table, positions) -> torch.Tensor:
    """``prefill_index_logits_ref`` padded with -inf to the op's width."""
    score = prefill_index_logits_ref(q_fp8, weights, index_cache, block_table, positions)
    W = prefill_logits_width(score.shape[1])
    out = score.new_full((score.shape[0], W), float("-inf"))
    out[:, : score.shape[1]] = score
    return out


@torch.library.custom_op("echo::dg_prefill_logits", mutates_args=())
def dg_prefill_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Default kernel (CPU): the reference."""
    _check(q_fp8, weights, index_cache, block_table, positions)
    return dg_prefill_logits_ref(q_fp8, weights, index_cache, block_table, positions)


@dg_prefill_logits.register_kernel("cuda")
def _(q_fp8, weights, index_cache, block_table, positions):
    _check(q_fp8, weights, index_cache, block_table, positions)
    if q_fp8.shape[1] not in HEADS:
        raise ValueError(f"dg_prefill_logits: DeepGEMM's SM90 kernel needs {HEADS} index heads")
    from custom_ops.backends import deep_gemm_prefill_kernels as dpk

    kv, sf = dpk.gather_index_keys(index_cache, block_table)
    W = prefill_logits_width(block_table.shape[1] * PAGE)
    return dpk.prefill_scores(q_fp8, weights, kv, sf, positions, W, clean=True)


@dg_prefill_logits.register_fake
def _(q_fp8, weights, index_cache, block_table, positions):
    W = prefill_logits_width(block_table.shape[1] * PAGE)
    return q_fp8.new_empty((q_fp8.shape[0], W), dtype=torch.float32)
