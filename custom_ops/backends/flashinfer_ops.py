"""FlashInfer's radix top-k as an ``echo::`` op, with the tie fix-up that makes it select our set.

``echo::fi_topk(scores, block_table, seq_lens, topk, row_states)`` -> (host slots int32 [B, topk]
ascending by position, -1 pad; kth fp32 [B]): the semantics of ``ties.stable_select_ref``, which
is also its default (CPU) kernel. On CUDA: FlashInfer's ``radix_topk_page_table_transform`` over
each row's live prefix (its ``lengths``; so scores past seq_len may be anything) gives the k
selected positions; their lowest score is the k-th value, the same for every correct top-k
whatever its ties; the fix-up (``ties_kernels``) then selects every live score above it and the
earliest equal ones, in position order. FlashInfer's own tie-break is not relied on.

``row_states`` is FlashInfer's multi-CTA scratch (``ROW_STATES_BYTES`` zeros, reset by the kernel
itself): a static buffer of the cache, passed in so that it is allocated once outside any CUDA
graph pool (FlashInfer's own cached buffer would be allocated inside the first warm-up).
"""

from __future__ import annotations

import functools

import torch

from custom_ops.backends.ties import stable_select_ref
from custom_ops.backends.ties_config import DEFAULT_FIXUP, fixup_config

ROW_STATES_BYTES = 1 << 20  # what flashinfer.top_k allocates for it (1 MB)
# FlashInfer options, exposed for the benchmark: deterministic order is not needed (the fix-up
# orders by position). ``dsa_graph_safe`` (off): the library's "graph-safe" mode always takes its
# FilteredTopK path with scalar loads (vector size 1), for callers whose scores width changes
# between a graph's capture and its replays (SGLang's). Without it the library picks its path from
# the rows, k, the scores' width and row stride and the pointer's alignment (topk.cu,
# ``ShouldUseFilteredTopK``, ``ComputeFilteredTopKVecSize``): here all of them are static in each
# captured graph (one scores tensor per compiled bucket), so the choice made at capture holds in
# every replay, and the loads are 16-byte vectors (the benchmark times both modes). ``ties``:
# "fixup" (default: exact by construction, one or two more reads of the scores) or "library" (trust
# FlashInfer's tie_break=1, smaller index first, and only sort its k positions; the benchmark
# records whether that gave the exact set on tie-heavy scores before anyone switches to it).
# ``fixup``: the fix-up's kernel variant by name (ties_config.FIXUP_VARIANTS; every one selects
# the same set, benchmarks/bench_topk_fixup.py times them)
OPTIONS = {
    "deterministic": False,
    "dsa_graph_safe": False,
    "ties": "fixup",
    "fixup": DEFAULT_FIXUP,
}


@functools.lru_cache(maxsize=1)
def _topk_module():
    from flashinfer.topk import get_topk_module  # the optional [kernels] extra

    return get_topk_module()


def _check(scores, block_table, seq_lens, topk, row_states) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"fi_topk: scores must be fp32 [B, W], got {scores.dtype}")
    B = scores.shape[0]
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("fi_topk: block_table and seq_lens must be int32")
    if block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("fi_topk: block_table must be [B, P] and seq_lens [B]")
    if topk <= 0:
        raise ValueError(f"fi_topk: topk must be positive, got {topk}")
    if row_states.dtype != torch.uint8 or row_states.numel() < ROW_STATES_BYTES:
        raise ValueError(f"fi_topk: row_states must be >= {ROW_STATES_BYTES} uint8 zeros")


@torch.library.custom_op("echo::fi_topk", mutates_args=("row_states",))
def fi_topk(
    scores: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    row_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default kernel (CPU): the stable-sort reference."""
    _check(scores, block_table, seq_lens, topk, row_states)
    return stable_select_ref(scores, block_table, seq_lens, topk)


def library_positions(
    scores: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, topk: int,
    row_states: torch.Tensor, tie_break: int = 0,
) -> torch.Tensor:  # fmt: skip
    """FlashInfer's k selected positions of each row, int32 [B, topk], -1 past the live length
    (its page-table output is computed too and dropped: the fix-up writes the host slots)."""
    B = scores.shape[0]
    slots = torch.empty((B, topk), dtype=torch.int32, device=scores.device)
    raw = torch.empty_like(slots)
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    _topk_module().radix_topk_page_table_transform(
        scores, slots, bt, None, seq_lens, row_states, topk, OPTIONS["deterministic"],
        tie_break, 64, OPTIONS["dsa_graph_safe"], None, None, raw,
    )  # fmt: skip
    return raw


@fi_topk.register_kernel("cuda")
def _(scores, block_table, seq_lens, topk, row_states):
    _check(scores, block_table, seq_lens, topk, row_states)
    from custom_ops.backends import ties_kernels

    scores = scores.contiguous()
    if OPTIONS["ties"] == "library":
        raw = library_positions(scores, block_table, seq_lens, topk, row_states, tie_break=1)
        return ties_kernels.sort_positions(scores, block_table, raw)
    cfg = fixup_config(OPTIONS["fixup"])
    raw = library_positions(scores, block_table, seq_lens, topk, row_states)
    return ties_kernels.fixup(scores, block_table, seq_lens, raw, topk, cfg)


@fi_topk.register_fake
def _(scores, block_table, seq_lens, topk, row_states):
    B = scores.shape[0]
    return (
        scores.new_empty((B, topk), dtype=torch.int32),
        scores.new_empty((B,), dtype=torch.float32),
    )
