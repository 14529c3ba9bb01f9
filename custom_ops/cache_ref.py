"""The pure-torch references of the cache ops (registered in cache_ops.py): ECHO's graph-friendly
GPU-pool manager (``echo::allocate``, ``echo::free``, ``echo::recall``, ``echo::release``) and
``echo::offload`` (new rows to the host pool and the indexer cache). Each is its op's default
kernel (CPU) and the specification its Triton kernel (the CUDA kernel; launchers in
cache_kernels.py) is tested against. The state layout (``meta``, ``stats``, age buckets) is in
cache_layout.py.

Per-layer state (all fixed-shape buffers of ``GpuPool``, docs/cache_ops.md "State"):
- ``gpu_free [N_G] int32``: the free slots as a ring list: ``gpu_free[(HEAD + i) % N_G]`` for
  i < meta[NFREE], each free slot exactly once (HEAD = meta[HEAD]; other entries unspecified).
  Placement pops from HEAD in rank order, evictions and releases push behind the last entry, so
  placing is a gather by rank (no scan of the pool). A slot is free <=> its priority is -1.
- ``gpu_priority [N_G] int32``: the step clock when the slot was last selected or filled; -1 free.
- ``gpu_to_host [N_G] int32`` / ``host_to_gpu [N_H] int32``: the two maps, -1 = none.
- ``indices [CAP] int32``: output of allocate / free (slots taken or evicted), -1 padded.
- ``miss_host [CAP] int32``: recall's scratch list of distinct missed host slots.
- ``meta [20] int32``: the clock, the free count and the kernels' counters (cache_layout.py).
- ``hist [256] int32``: free's scratch histogram of slot ages (zero between ops).
- ``stats [4] int64``: running totals the engine reads between steps (no sync inside a step).

Priority is a per-layer step clock: recall stamps every selected slot with the clock and then
advances it, so a slot's *age* (clock - stamp) counts the steps since it was last selected, and
free evicts the oldest first. Ages are bucketed (``age_bucket``): exact for the 127 most recent
steps, then 32-step buckets up to ~4200 steps, then one bucket for everything older; within a
bucket the order is unspecified (the reference takes the lowest slot index, the kernel whatever
its atomics give). The clock wraps at 2^30 and ages are computed modulo 2^30, so int32 never
overflows; a slot untouched for 2^30 steps (~4 months at 100 steps/s) merely looks young once.

An eviction that must free ``needed`` > 0 slots frees ``evict_target(needed)`` = needed + N_G/64
(capped by CAP) of the oldest: the reserve lets the following steps evict nothing.

Slots selected in the current step have age 0 and are never evicted. The scheduler keeps the
real (non-padded) rows of a batch within B * k <= N_G, so recall always finds enough evictable
slots; CAP = min(max_batch * topk, N_G) bounds the misses one call places (padded rows, all -1,
may take the shape past it). Shortfalls a broken caller could still cause (more misses than CAP or
than evictable slots) leave those entries -1 and are counted in ``meta[OVERFLOW]`` instead of
synchronising with the host.

Every size that varies per step (how many to allocate, how many misses) lives in a device tensor.
"""

from __future__ import annotations

import torch

from custom_ops.cache_layout import (
    CLOCK,
    CLOCK_MASK,
    EVICTED,
    HEAD,
    IDX_HW,
    LAST_ALLOC,
    LAST_EVICT,
    LAST_MISS,
    NFREE,
    OVERFLOW,
    RECALLED,
    SELECTED,
    STEPS,
    age_bucket,
    evict_target,
)
from custom_ops.kv_format import INDEX_PAGE_BYTES, PAGE
from custom_ops.prefetch_layout import PF_PROMOTED, staged_source


def _host_in_range(op: str, name: str, h: torch.Tensor, n_h: int) -> None:
    """Reference-only check (it syncs): host slots >= 0 must be < N_H."""
    if h.numel() and int(h.max()) >= n_h:
        raise ValueError(f"{op}: {name} holds host slot {int(h.max())} >= N_H = {n_h}")


# ---- references ---------------------------------------------------------------------------------
def _write_indices(indices: torch.Tensor, meta: torch.Tensor, slots: torch.Tensor) -> None:
    indices.fill_(-1)
    indices[: slots.numel()] = slots.to(torch.int32)
    meta[IDX_HW] = slots.numel()


def _unique_in_order(x: torch.Tensor) -> torch.Tensor:
    """The distinct values of x in the order of their first appearance."""
    if not x.numel():
        return x
    uniq, inv = torch.unique(x, return_inverse=True)
    first = torch.full_like(uniq, x.numel()).scatter_reduce_(
        0, inv, torch.arange(x.numel(), device=x.device), "amin"
    )
    return uniq[first.argsort()]


def _push_ref(gpu_free, meta, slots: torch.Tensor) -> None:
    """Append ``slots`` (in their order) to the ring of free slots, behind its last entry."""
    n_g = gpu_free.numel()
    pos = (int(meta[HEAD]) + int(meta[NFREE]) + torch.arange(slots.numel())) % n_g
    gpu_free[pos.to(gpu_free.device)] = slots.to(torch.int32)
    meta[NFREE] += slots.numel()


def _evict_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, stats, needed: int):
    """Evict evict_target(needed) evictable slots (at least ``needed``, else OVERFLOW), oldest
    bucket first, lowest slot index first within one. The victims, in slot order (a one-block
    kernel pass ranks them so), go to ``indices`` and victim v is pushed at ring position
    HEAD + NFREE + v: a recall's placement right after pops the old free slots first, then the
    victims in their order, as the kernel's fused pass does."""
    clock = int(meta[CLOCK])
    p = gpu_priority.long()
    age = (clock - p) & CLOCK_MASK
    evictable = (p >= 0) & (age > 0)
    k = min(evict_target(needed, p.numel(), indices.shape[0]), int(evictable.sum()))
    victims = torch.empty(0, dtype=torch.long, device=p.device)
    if k > 0:
        bucket = torch.where(evictable, age_bucket(age), -1)
        victims = torch.sort(bucket, descending=True, stable=True).indices[:k].sort().values
        host_to_gpu[gpu_to_host[victims].long()] = -1
        gpu_to_host[victims] = -1
        gpu_priority[victims] = -1
    _push_ref(gpu_free, meta, victims)
    _write_indices(indices, meta, victims)
    meta[LAST_EVICT] = k
    stats[EVICTED] += k
    if k < needed:
        meta[OVERFLOW] += 1


def _place_ref(
    gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, want: torch.Tensor, requested: int
):
    """Map the distinct, non-resident host slots ``want`` (int64) onto the free slots popped from
    the ring's head in rank order (rank r takes gpu_free[(HEAD + r) % N_G]); fewer than
    ``requested`` placed counts as an overflow."""
    n_g = gpu_free.numel()
    k = min(want.numel(), int(meta[NFREE]))
    pos = (int(meta[HEAD]) + torch.arange(k)) % n_g
    slots = gpu_free[pos.to(gpu_free.device)].long()
    gpu_to_host[slots] = want[:k].to(torch.int32)
    host_to_gpu[want[:k]] = slots.to(torch.int32)
    gpu_priority[slots] = meta[CLOCK]
    meta[HEAD] = (int(meta[HEAD]) + k) % n_g
    meta[NFREE] -= k
    meta[LAST_ALLOC] = k
    if k < requested:
        meta[OVERFLOW] += 1
    return slots


def _protect_ref(gpu_priority, host_to_gpu, meta, protect: torch.Tensor, op: str) -> None:
    h = protect.reshape(-1).long()
    h = h[h >= 0]
    _host_in_range(op, "protect", h, host_to_gpu.shape[0])
    g = host_to_gpu[h].long()
    gpu_priority[g[g >= 0]] = meta[CLOCK]


def allocate_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n):
    n_ = int(n[0])
    if not 0 <= n_ <= min(indices.shape[0], want_host.numel()):
        raise ValueError(
            f"allocate: n = {n_} must be in [0, min(CAP = {indices.shape[0]}, "
            f"len(want_host) = {want_host.numel()})]"
        )
    w = want_host.reshape(-1)[:n_].long()
    if n_ and int(w.min()) < 0:
        raise ValueError("allocate: want_host[:n] must be host slots >= 0")
    _host_in_range("allocate", "want_host", w, host_to_gpu.shape[0])
    if torch.unique(w).numel() != n_:
        raise ValueError("allocate: want_host[:n] holds a host slot twice")
    if n_ and bool((host_to_gpu[w] >= 0).any()):
        raise ValueError("allocate: a host slot in want_host[:n] is already on the GPU")
    slots = _place_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, w, n_)
    _write_indices(indices, meta, slots)


def free_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, stats, protect, n):
    n_ = int(n[0])
    if not 0 <= n_ <= indices.shape[0]:
        raise ValueError(f"free: n = {n_} must be in [0, CAP = {indices.shape[0]}]")
    _protect_ref(gpu_priority, host_to_gpu, meta, protect, "free")
    needed = max(n_ - int(meta[NFREE]), 0)
    _evict_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, stats, needed)


def recall_ref(
    host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, miss_host, meta,
    stats, host_slots, stage_kv=None, host_stage=None, stage_host=None, stage_ctr=None,
    pf_stats=None,
) -> torch.Tensor:  # fmt: skip
    """With the staging state (echo::recall_staged): a placed miss h that is staged in the
    current epoch (``prefetch_layout.staged_source``: host_stage[h] a slot whose stage_host tag
    is h's with the epoch word stage_ctr[-1]) is copied from stage_kv[host_stage[h]] (a copy of
    its host row) instead of the host, and counted in pf_stats[PF_PROMOTED]."""
    hs = host_slots.long()
    valid = hs >= 0
    _host_in_range("recall", "host_slots", hs[valid], host_to_gpu.shape[0])
    clock = int(meta[CLOCK])
    hc = hs.clamp(min=0)
    g = torch.where(valid, host_to_gpu[hc].long(), -1)
    hit = g >= 0
    gpu_priority[g[hit]] = clock  # protect: age 0 is never evicted in this step
    # Duplicates within the batch are recalled once; the misses in the order of their first
    # appearance (the kernel's miss list, with one lookup block and no duplicate misses).
    miss = _unique_in_order(hs[valid & ~hit])
    stats[SELECTED] += int(valid.sum())
    # At most CAP misses are placed (the kernel's miss list); more only if the caller broke the
    # capacity rule: the rest stay -1 in the output and count as an overflow.
    placeable = miss[: indices.shape[0]]
    needed = max(placeable.numel() - int(meta[NFREE]), 0)
    _evict_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, stats, needed)
    slots = _place_ref(
        gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, placeable, miss.numel()
    )
    placed = placeable[: slots.numel()]
    gpu_kv[slots] = host_kv[placed].to(gpu_kv.device)
    if host_stage is not None:
        staged, src = staged_source(placed.long(), host_stage, stage_host, stage_ctr[-1])
        gpu_kv[slots[staged]] = stage_kv[src[staged]]
        pf_stats[PF_PROMOTED] += int(staged.sum())  # a host slot is placed once
    miss_host[: placeable.numel()] = placeable.to(torch.int32)
    out = torch.where(valid, host_to_gpu[hc], -1).to(torch.int32)
    stats[RECALLED] += slots.numel()
    stats[STEPS] += 1
    meta[LAST_MISS] = miss.numel()
    meta[CLOCK] = (clock + 1) & CLOCK_MASK
    return out


def release_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots) -> None:
    h = host_slots.reshape(-1).long()
    h = h[h >= 0]
    _host_in_range("release", "host_slots", h, host_to_gpu.shape[0])
    g = host_to_gpu[h].long()
    g = g[g >= 0]
    # The GPU slots in the order of their first appearance in the list (a host slot listed twice
    # is freed once): the order they are pushed onto the ring in.
    g = _unique_in_order(g)
    host_to_gpu[h] = -1
    gpu_to_host[g] = -1
    gpu_priority[g] = -1
    _push_ref(gpu_free, meta, g)


def release_layers_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, ema,
                       host_slots) -> None:  # fmt: skip
    """release in every layer's pool (the lists: one entry per layer), and, given each layer's
    prefetch threshold state ``ema`` [EMA_ROWS, N_H / 64 + 1] (an empty list: prefetch is
    off), its columns of the slots' host pages back to 0, ECHO's start: the next request keyed
    by one of them does not inherit a stranger's threshold."""
    for state in zip(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, strict=True):
        release_ref(*state, host_slots)
    h = host_slots.reshape(-1).long()
    pages = h[h >= 0] // PAGE
    for e in ema:
        e.index_fill_(1, pages, 0.0)


def offload_ref(host_kv, index_k, rows, index_rows, slots) -> None:
    keep = slots >= 0
    s = slots[keep].long()
    host_kv[s] = rows[keep]
    page, off = s // PAGE, s % PAGE
    flat = index_k.view(-1)
    base = page * INDEX_PAGE_BYTES
    vidx = (base + off * 128)[:, None] + torch.arange(128, device=slots.device)
    sidx = (base + PAGE * 128 + off * 4)[:, None] + torch.arange(4, device=slots.device)
    flat[vidx] = index_rows[keep][:, :128]
    flat[sidx] = index_rows[keep][:, 128:]
