"""Grouping the T*k (token, expert) pairs of a MoE call by expert, on the device, with static
sizes and no host syncs (vLLM's ``moe_align_block_size``): the pairs are sorted by expert, each
expert's run is padded to ``block_m`` slots, and the grid has a static
``cdiv(T*k, block_m) + min(E, T*k)`` row blocks; blocks past the last expert exit at once.

Two implementations with the same outputs, bit for bit:
- ``moe_align_torch``: about twenty small torch ops (the reference, and every size on CPU);
- ``moe_align_kernel``: one Triton program (``moe_align`` takes it on CUDA up to
  ``KERNEL_MAX_PAIRS`` pairs, decode's sizes): at one or two tokens the torch form's launches
  cost as much as the routed experts' weight reads (``benchmarks/bench_awq_parts.py``).

``expert_rows`` is the same grouping in the form DeepGEMM's masked grouped GEMM takes (one block
of rows per expert, each pair ranked among its expert's pairs), with the same two forms.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
KERNEL_MAX_PAIRS = 4096  # one program sorts next_power_of_2(T*k) keys in registers
_BLOCKS_PER_ITER = 32  # row blocks whose expert one step of the kernel's last loop finds


def _kernel_takes(topk_ids: torch.Tensor) -> bool:
    """Whether a grouping runs as its one-program kernel: on CUDA, up to KERNEL_MAX_PAIRS."""
    return topk_ids.is_cuda and 0 < topk_ids.numel() <= KERNEL_MAX_PAIRS


def _kernel_pairs(topk_ids: torch.Tensor, name: str) -> torch.Tensor:
    """The flat, contiguous pair ids a one-program kernel sorts in registers."""
    flat = topk_ids.reshape(-1)
    if not 0 < flat.numel() <= KERNEL_MAX_PAIRS:
        raise ValueError(f"{name}: {flat.numel()} pairs, the kernel takes 1..{KERNEL_MAX_PAIRS}")
    return flat.contiguous()


def max_blocks(pairs: int, n_experts: int, block_m: int) -> int:
    return triton.cdiv(pairs, block_m) + min(n_experts, pairs)


def moe_align(
    topk_ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``sorted_ids int32 [max_blocks * block_m]`` (pair index ``t * k + j``, or ``T*k``
    in padding slots) and ``block_expert int32 [max_blocks]`` (the expert of each row block, or
    ``n_experts`` for blocks past the end), ``max_blocks = cdiv(T*k, block_m) + min(E, T*k)``.

    An id equal to ``n_experts`` (the skip id: expert parallelism's pick of another rank's
    expert) gets no slot at all: no row block computes it, so the kernels' work is the pairs of
    this rank's experts only, and its output row is left as the launcher initialised it (zeros).
    """
    if _kernel_takes(topk_ids):
        return moe_align_kernel(topk_ids, n_experts, block_m)
    return moe_align_torch(topk_ids, n_experts, block_m)


def moe_align_torch(
    topk_ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align`` in torch ops (the reference)."""
    flat = topk_ids.reshape(-1).long()  # [P]
    p = flat.numel()
    n_blocks = max_blocks(p, n_experts, block_m)
    dev = flat.device
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )[:n_experts]  # [E] (bin E, the skipped pairs, dropped)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_start = torch.cumsum(padded, 0) - padded  # [E] first slot of each expert's run
    cnt_start = torch.cumsum(counts, 0) - counts  # [E] first position of the expert in sort order
    order = torch.argsort(flat, stable=True)  # [P] pairs sorted by expert, skipped ones last
    e_sorted = flat[order]
    kept = e_sorted < n_experts
    e_c = e_sorted.clamp(max=n_experts - 1)
    pos = torch.arange(p, device=dev)
    dest = pad_start[e_c] + pos - cnt_start[e_c]
    n_slots = n_blocks * block_m
    dest = torch.where(kept, dest, n_slots + pos)  # skipped pairs: a scratch tail, cut off below
    sorted_ids = torch.full((n_slots + p,), p, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:n_slots]
    block_end = torch.cumsum(padded, 0) // block_m  # [E] one past each expert's last block
    block_ids = torch.arange(n_blocks, device=dev)
    block_expert = torch.searchsorted(block_end, block_ids, right=True).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, off_ptr, P, E, n_slots, n_blocks,
    BM: tl.constexpr, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, SLOT_BLOCK: tl.constexpr,
    B_BLOCK: tl.constexpr,
):  # fmt: skip
    """One program. Keys ``expert * P_BLOCK + pair`` sorted ascending give the stable order by
    expert (skipped pairs and the padding lanes, expert ``E``, last); pair r of expert e's run
    goes to slot ``pad_start[e] + r``; row block b's expert is the number of experts whose run
    ends at or before b (``searchsorted(block_end, b, right=True)``)."""
    offs = tl.arange(0, P_BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=E).to(tl.int32)  # padding lanes: E
    ex = tl.arange(0, E_BLOCK)
    counts = tl.histogram(ids, E_BLOCK)  # bins >= E (skipped, padding) dropped below
    counts = tl.where(ex < E, counts, 0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    cnt_end = tl.cumsum(counts, 0)
    # slot of sorted position i of expert e: (pad_start[e] - cnt_start[e]) + i
    tl.store(off_ptr + ex, (pad_end - padded) - (cnt_end - counts))
    for s0 in range(0, n_slots, SLOT_BLOCK):  # padding slots hold P
        so = s0 + tl.arange(0, SLOT_BLOCK)
        tl.store(sorted_ptr + so, tl.full([SLOT_BLOCK], 0, tl.int32) + P, mask=so < n_slots)
    tl.debug_barrier()  # the offsets and the padding are stored before they are read / overwritten
    keys = tl.sort(ids.to(tl.int64) * P_BLOCK + offs)
    e_sorted = (keys // P_BLOCK).to(tl.int32)
    order = (keys % P_BLOCK).to(tl.int32)
    kept = e_sorted < E
    off = tl.load(off_ptr + e_sorted, mask=kept, other=0)
    tl.store(sorted_ptr + off + offs, order, mask=kept)
    block_end = tl.where(ex < E, pad_end // BM, 1 << 30)  # [E_BLOCK]; lanes >= E never count
    for b0 in range(0, n_blocks, B_BLOCK):
        b = b0 + tl.arange(0, B_BLOCK)
        expert = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, expert, mask=b < n_blocks)


def moe_align_kernel(
    topk_ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align`` in one Triton launch (up to ``KERNEL_MAX_PAIRS`` pairs)."""
    flat = _kernel_pairs(topk_ids, "moe_align_kernel")
    p = flat.numel()
    n_blocks = max_blocks(p, n_experts, block_m)
    n_slots = n_blocks * block_m
    dev = flat.device
    sorted_ids = torch.empty(n_slots, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    e_block = triton.next_power_of_2(n_experts + 1)
    off = torch.empty(e_block, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        flat, sorted_ids, block_expert, off, p, n_experts, n_slots, n_blocks, BM=block_m,
        P_BLOCK=triton.next_power_of_2(p), E_BLOCK=e_block, SLOT_BLOCK=1024,
        B_BLOCK=_BLOCKS_PER_ITER, num_warps=4,
    )  # fmt: skip
    return sorted_ids, block_expert


# ---- the grouping as rows of per-expert blocks (DeepGEMM's masked grouped GEMM) ---------------


def expert_rows(
    topk_ids: torch.Tensor, n_experts: int, rows_per_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, no host sync: for each (token, slot) pair (flattened ``[T * k]``) its row
    ``e * rows_per_group + rank`` int64 in the grouped blocks (rank: its place among the pairs of
    expert e, in pair order), and ``masked_m [E]`` int32 (pairs per expert). A pair with the skip
    id ``E`` (expert parallelism: another rank's expert) gets the dump row ``E * rows_per_group``,
    one past the experts' blocks, and is in no count."""
    if _kernel_takes(topk_ids):
        return expert_rows_kernel(topk_ids, n_experts, rows_per_group)
    return expert_rows_torch(topk_ids, n_experts, rows_per_group)


def expert_rows_torch(
    topk_ids: torch.Tensor, n_experts: int, rows_per_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_rows`` in torch ops (the reference)."""
    flat = topk_ids.reshape(-1).long()
    p = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(p, device=flat.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    kept = flat < n_experts
    rows = torch.where(kept, flat * rows_per_group + rank, n_experts * rows_per_group)
    return rows, counts[:n_experts].to(torch.int32)


@triton.jit
def _rows_kernel(
    ids_ptr, rows_ptr, counts_ptr, start_ptr, P, E, MG,
    P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
):  # fmt: skip
    """One program. Keys ``expert * P_BLOCK + pair`` sorted ascending give the stable order by
    expert (skipped pairs and the padding lanes, expert ``E``, last); sorted position i of
    expert e is its rank ``i - start[e]``."""
    offs = tl.arange(0, P_BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=E).to(tl.int32)  # padding lanes: E
    ex = tl.arange(0, E_BLOCK)
    counts = tl.histogram(ids, E_BLOCK)
    tl.store(counts_ptr + ex, counts, mask=ex < E)
    tl.store(start_ptr + ex, tl.cumsum(counts, 0) - counts)
    tl.debug_barrier()  # the starts are stored before they are gathered
    keys = tl.sort(ids.to(tl.int64) * P_BLOCK + offs)
    e_sorted = (keys // P_BLOCK).to(tl.int32)
    order = (keys % P_BLOCK).to(tl.int32)
    rank = offs - tl.load(start_ptr + e_sorted)
    # a skipped pair (expert E) takes the dump row E * MG, the first after the experts' blocks
    row = e_sorted.to(tl.int64) * MG + tl.where(e_sorted < E, rank, 0)
    tl.store(rows_ptr + order, row, mask=order < P)  # the padding lanes sort last: order >= P


def expert_rows_kernel(
    topk_ids: torch.Tensor, n_experts: int, rows_per_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_rows`` in one Triton launch (up to ``KERNEL_MAX_PAIRS`` pairs)."""
    flat = _kernel_pairs(topk_ids, "expert_rows_kernel")
    p = flat.numel()
    dev = flat.device
    rows = torch.empty(p, dtype=torch.int64, device=dev)
    counts = torch.empty(n_experts, dtype=torch.int32, device=dev)
    e_block = triton.next_power_of_2(n_experts + 1)
    start = torch.empty(e_block, dtype=torch.int32, device=dev)
    _rows_kernel[(1,)](
        flat, rows, counts, start, p, n_experts, rows_per_group,
        P_BLOCK=triton.next_power_of_2(p), E_BLOCK=e_block, num_warps=4,
    )  # fmt: skip
    return rows, counts
