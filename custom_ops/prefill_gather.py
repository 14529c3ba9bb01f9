"""A prefill without a device prefill buffer: the indexer's selection, and the selected rows
copied from the host pool, in one op (ECHO's inter-query prefetch; docs/prefetch.md, "Prefill").

``echo::prefill_indexer_topk_gather(q_fp8, weights, index_cache, block_table, positions, topk,
host_kv, logits_backend)`` returns

- ``sel [T, topk]`` int32: exactly ``echo::prefill_indexer_topk``'s selection (token positions,
  ascending, -1 padded);
- ``rows [L, row]`` uint8, ``L = P * 64``: ``rows[p] = host_kv[slot(p)]`` for every position p
  that some query selects (``slot(p) = block_table[0, p // 64] * 64 + p % 64``), zero elsewhere,
  which is what ``echo::sparse_mla_prefill`` reads: the same bytes as the device prefill buffer
  at every position it reads, so the attention, and so the logits, are unchanged;
- ``copied [2]`` int64: the rows copied while a later query block was being scored, and the rows
  copied after the last block's selection. Their sum is the number of distinct selected positions;
  the split is the implementation's (the reference copies everything after: ``[0, n]``).

Only the union of the chunk's selections crosses PCIe, never the whole context. On CUDA
(custom_ops/prefill_gather_kernels.py) the queries go a block at a time, as in
``echo::prefill_indexer_topk``, and the rows block i selects are copied by extra programs of
block i + 1's scores launch, so the copies run under the scoring (the exact selection of the
previous block, not a prediction: nothing is copied that is not read). The last block's new rows
are copied after its selection: the guaranteed recall.
"""

from __future__ import annotations

import torch

from custom_ops.kv_format import PAGE
from custom_ops.prefill import _check_indexer, prefill_indexer_topk_ref


def selected_positions(sel: torch.Tensor, L: int) -> torch.Tensor:
    """``[L]`` bool: the positions some query of ``sel`` (-1 padded) selects."""
    mark = torch.zeros(L + 1, dtype=torch.bool, device=sel.device)
    mark[torch.where(sel >= 0, sel.long(), L).flatten()] = True
    return mark[:L]


def gather_selected_ref(
    host_kv: torch.Tensor, block_table: torch.Tensor, sel: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [L, row]`` (the host rows at the selected positions, zero elsewhere) and
    ``copied [2] = [0, n_selected]``."""
    L = block_table.shape[1] * PAGE
    mark = selected_positions(sel, L)
    pos = torch.arange(L, device=sel.device)
    slots = block_table[0, pos // PAGE].long() * PAGE + pos % PAGE
    rows = torch.zeros(L, host_kv.shape[1], dtype=host_kv.dtype, device=sel.device)
    rows[mark] = host_kv[slots[mark]].to(sel.device)
    copied = torch.stack([torch.zeros((), dtype=torch.int64, device=sel.device), mark.sum()])
    return rows, copied


def _check_host(host_kv: torch.Tensor, block_table: torch.Tensor) -> None:
    if (
        host_kv.dim() != 2
        or host_kv.dtype != torch.uint8
        or host_kv.shape[1] % 16
        or not host_kv.is_contiguous()
    ):
        raise ValueError(
            "prefill_indexer_topk_gather: host_kv must be contiguous uint8 [N_H, row] with row a "
            f"multiple of 16 bytes, got {host_kv.dtype} {list(host_kv.shape)}"
        )
    if host_kv.shape[0] % PAGE:
        raise ValueError(
            f"prefill_indexer_topk_gather: host_kv holds {host_kv.shape[0]} rows, not whole "
            f"pages of {PAGE}"
        )


@torch.library.custom_op("echo::prefill_indexer_topk_gather", mutates_args=())
def prefill_indexer_topk_gather(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    host_kv: torch.Tensor,
    logits_backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Default kernel (CPU): the references."""
    _check_indexer(q_fp8, weights, index_cache, block_table, positions, topk, logits_backend)
    _check_host(host_kv, block_table)
    sel = prefill_indexer_topk_ref(q_fp8, weights, index_cache, block_table, positions, topk)
    return (sel, *gather_selected_ref(host_kv, block_table, sel))


@prefill_indexer_topk_gather.register_kernel("cuda")
def _(q_fp8, weights, index_cache, block_table, positions, topk, host_kv, logits_backend="triton"):
    _check_indexer(q_fp8, weights, index_cache, block_table, positions, topk, logits_backend)
    _check_host(host_kv, block_table)
    from custom_ops import prefill_gather_kernels  # Triton: imported on the first CUDA call

    return prefill_gather_kernels.prefill_indexer_topk_gather_cuda(
        q_fp8, weights, index_cache, block_table, positions, topk, host_kv,
        logits_backend=logits_backend,
    )  # fmt: skip


@prefill_indexer_topk_gather.register_fake
def _(q_fp8, weights, index_cache, block_table, positions, topk, host_kv, logits_backend="triton"):
    L = block_table.shape[1] * PAGE
    return (
        q_fp8.new_empty((q_fp8.shape[0], topk), dtype=torch.int32),
        host_kv.new_empty((L, host_kv.shape[1]), device=q_fp8.device),
        q_fp8.new_empty((2,), dtype=torch.int64),
    )
