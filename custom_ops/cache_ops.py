"""The cache ops: ECHO's graph-friendly GPU-pool manager (``echo::allocate``, ``echo::free``,
``echo::recall``, ``echo::release``) and ``echo::offload`` (new rows to the host pool and the
indexer cache), with their pure-torch references: every op's default kernel (CPU) and the
specification its Triton kernel (the CUDA kernel; launchers in cache_kernels.py) is tested
against. The state layout (``meta``, ``stats``, age buckets) is in cache_layout.py.

Per-layer state (all fixed-shape buffers of ``GpuPool``, docs/cache_ops.md "State"):
- ``gpu_free [N_G] int32``: the free slots as a ring list: ``gpu_free[(HEAD + i) % N_G]`` for
  i < meta[NFREE], each free slot exactly once (HEAD = meta[HEAD]; other entries unspecified).
  Placement pops from HEAD in rank order, evictions and releases push behind the last entry, so
  placing is a gather by rank (no scan of the pool). A slot is free <=> its priority is -1.
- ``gpu_priority [N_G] int32``: the step clock when the slot was last selected or filled; -1 free.
- ``gpu_to_host [N_G] int32`` / ``host_to_gpu [N_H] int32``: the two maps, -1 = none.
- ``indices [CAP] int32``: output of allocate / free (slots taken or evicted), -1 padded.
- ``miss_host [CAP] int32``: recall's scratch list of distinct missed host slots.
- ``meta [16] int32``: the clock, the free count and the kernels' counters (layout below).
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
    META_LEN,
    NBINS,
    NFREE,
    OVERFLOW,
    RECALLED,
    SELECTED,
    STATS_LEN,
    STEPS,
    age_bucket,
    evict_target,
    reserve_slots,  # noqa: F401  (re-exported: part of the eviction rule this module specifies)
)
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE


def _check_state(
    op: str,
    gpu_free: torch.Tensor,
    gpu_priority: torch.Tensor,
    gpu_to_host: torch.Tensor,
    host_to_gpu: torch.Tensor,
    meta: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    n_g = gpu_to_host.shape[0] if gpu_to_host.dim() == 1 else -1
    n_h = host_to_gpu.shape[0] if host_to_gpu.dim() == 1 else -1
    want = {
        "gpu_free": (gpu_free, torch.int32, n_g),
        "gpu_priority": (gpu_priority, torch.int32, n_g),
        "gpu_to_host": (gpu_to_host, torch.int32, n_g),
        "host_to_gpu": (host_to_gpu, torch.int32, n_h),
        "meta": (meta, torch.int32, META_LEN),
    }
    if indices is not None:
        want["indices"] = (indices, torch.int32, indices.shape[0] if indices.dim() else -1)
    for name, (t, dtype, n) in want.items():
        if t.dtype != dtype or t.dim() != 1 or t.shape[0] != n or n <= 0:
            raise ValueError(f"{op}: {name} must be a 1-D {dtype} tensor of {n} entries, got "
                             f"{t.dtype} {list(t.shape)}")
        if t.device != gpu_to_host.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the pool on {gpu_to_host.device}")
    if indices is not None and indices.shape[0] > n_g:
        raise ValueError(f"{op}: indices ({indices.shape[0]}) cannot exceed the pool ({n_g})")


def _check_count(op: str, n: torch.Tensor, device: torch.device) -> None:
    if n.shape != (1,) or n.dtype != torch.int32 or n.device != device:
        raise ValueError(f"{op}: n must be an int32 tensor of shape [1] on {device}, got "
                         f"{n.dtype} {list(n.shape)} on {n.device}")


def _check_slots(op: str, name: str, slots: torch.Tensor, device: torch.device) -> None:
    if slots.dtype not in (torch.int32, torch.int64) or slots.device != device:
        raise ValueError(f"{op}: {name} must be int32/int64 host slots on {device}, got "
                         f"{slots.dtype} on {slots.device}")


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


def _place_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, want: torch.Tensor,
               requested: int):
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
        raise ValueError(f"allocate: n = {n_} must be in [0, min(CAP = {indices.shape[0]}, "
                         f"len(want_host) = {want_host.numel()})]")
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
    stats, host_slots, stage_kv=None, host_stage=None,
) -> torch.Tensor:  # fmt: skip
    """With ``stage_kv`` / ``host_stage`` (echo::recall_staged): a miss h with host_stage[h] >= 0
    is copied from stage_kv[host_stage[h]] (a copy of its host row) instead of the host."""
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
    slots = _place_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, placeable,
                       miss.numel())
    placed = placeable[: slots.numel()]
    gpu_kv[slots] = host_kv[placed].to(gpu_kv.device)
    if host_stage is not None:
        src = host_stage[placed].long()
        staged = src >= 0
        gpu_kv[slots[staged]] = stage_kv[src[staged]]
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


# ---- input checks (one per op, shared by its reference and its CUDA kernel) ---------------------
_MAPS = ("gpu_free", "gpu_priority", "gpu_to_host", "host_to_gpu")


def _check_allocate(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n):
    _check_state("allocate", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, indices)
    _check_count("allocate", n, gpu_free.device)
    if want_host.dtype != torch.int32 or want_host.dim() != 1 or want_host.device != n.device:
        raise ValueError("allocate: want_host must be a 1-D int32 tensor on the pool's device")


def _check_free(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats,
                protect, n):
    _check_state("free", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, indices)
    _check_count("free", n, gpu_free.device)
    _check_slots("free", "protect", protect, gpu_free.device)
    if hist.shape != (NBINS,) or hist.dtype != torch.int32:
        raise ValueError(f"free: hist must be int32 [{NBINS}]")
    if stats.shape != (STATS_LEN,) or stats.dtype != torch.int64:
        raise ValueError(f"free: stats must be int64 [{STATS_LEN}]")


def _check_recall(host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices,
                  miss_host, meta, hist, stats, host_slots):
    _check_state("recall", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, indices)
    if host_slots.dtype != torch.int32 or host_slots.dim() != 2:
        raise ValueError(f"recall: host_slots must be int32 [B, k], got {host_slots.dtype} "
                         f"{list(host_slots.shape)}")
    if host_kv.dtype != torch.uint8 or gpu_kv.dtype != torch.uint8 or host_kv.dim() != 2:
        raise ValueError("recall: host_kv and gpu_kv must be uint8 [rows, row_bytes]")
    if gpu_kv.shape != (gpu_to_host.shape[0], host_kv.shape[1]):
        raise ValueError(f"recall: gpu_kv {list(gpu_kv.shape)} must be [N_G, {host_kv.shape[1]}]")
    if host_kv.shape[0] != host_to_gpu.shape[0]:
        raise ValueError(f"recall: host_kv has {host_kv.shape[0]} rows, host_to_gpu "
                         f"{host_to_gpu.shape[0]}")
    if miss_host.shape != indices.shape or miss_host.dtype != torch.int32:
        raise ValueError("recall: miss_host must be int32 shaped like indices")


def _check_release(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots):
    _check_state("release", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta)
    _check_slots("release", "host_slots", host_slots, gpu_free.device)


def _check_offload(host_kv, index_k, rows, index_rows, slots):
    if rows.shape[0] != slots.shape[0] or index_rows.shape != (rows.shape[0], INDEX_ROW_BYTES):
        raise ValueError(
            "offload: rows [T, row], index_rows [T, 132] and slots [T] must agree on T"
        )
    if rows.shape[1] != host_kv.shape[1]:
        raise ValueError(f"offload: row width {rows.shape[1]} != pool row width {host_kv.shape[1]}")


def _cuda_kernel(check, launcher: str):
    """An op's CUDA kernel: the op's input checks, then the Triton launcher
    ``cache_kernels.<launcher>``; Triton is imported on the first CUDA call, not on import."""

    def run(*args):
        check(*args)
        from custom_ops import cache_kernels

        return getattr(cache_kernels, launcher)(*args)

    return run


# ---- registrations: the reference is every op's default kernel, Triton its CUDA kernel -----------
@torch.library.custom_op("echo::allocate", mutates_args=(*_MAPS, "indices", "meta"))
def allocate(
    gpu_free: torch.Tensor,
    gpu_priority: torch.Tensor,
    gpu_to_host: torch.Tensor,
    host_to_gpu: torch.Tensor,
    indices: torch.Tensor,
    meta: torch.Tensor,
    want_host: torch.Tensor,  # [M] int32: distinct, non-resident host slots to place (first n)
    n: torch.Tensor,  # [1] int32: how many
) -> None:
    """Take n free slots, map them to want_host[:n], stamp them with the clock; the slots go to
    indices[:n] in the order of want_host (-1 padded). Short of free slots: fewer, and OVERFLOW."""
    args = (gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n)
    _check_allocate(*args)
    allocate_ref(*args)


allocate.register_kernel("cuda")(_cuda_kernel(_check_allocate, "allocate_cuda"))


@allocate.register_fake
def _(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n) -> None:
    return None


@torch.library.custom_op("echo::free", mutates_args=(*_MAPS, "indices", "meta", "hist", "stats"))
def free_slots(
    gpu_free: torch.Tensor,
    gpu_priority: torch.Tensor,
    gpu_to_host: torch.Tensor,
    host_to_gpu: torch.Tensor,
    indices: torch.Tensor,
    meta: torch.Tensor,
    hist: torch.Tensor,
    stats: torch.Tensor,
    protect: torch.Tensor,  # host slots selected this step (any shape, -1 = none)
    n: torch.Tensor,  # [1] int32: free slots wanted
) -> None:
    """Stamp the resident slots of ``protect`` with the clock, then, when max(n - free, 0) > 0,
    evict that many of the oldest other slots plus a reserve (``evict_target``; their maps
    cleared; nothing is written back: the host copy is authoritative). The evicted slots go to
    indices (-1 padded)."""
    _check_free(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats,
                protect, n)
    free_ref(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, stats, protect, n)


free_slots.register_kernel("cuda")(_cuda_kernel(_check_free, "free_cuda"))


@free_slots.register_fake
def _(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, protect, n):
    return None


@torch.library.custom_op(
    "echo::recall",
    mutates_args=("gpu_kv", *_MAPS, "indices", "miss_host", "meta", "hist", "stats"),
)
def recall(
    host_kv: torch.Tensor,  # [N_H, row] uint8 (UVA view of pinned memory on CUDA)
    gpu_kv: torch.Tensor,  # [N_G, row] uint8
    gpu_free: torch.Tensor,
    gpu_priority: torch.Tensor,
    gpu_to_host: torch.Tensor,
    host_to_gpu: torch.Tensor,
    indices: torch.Tensor,
    miss_host: torch.Tensor,
    meta: torch.Tensor,
    hist: torch.Tensor,
    stats: torch.Tensor,
    host_slots: torch.Tensor,  # [B, k] int32 selected host slots, -1 padded
) -> torch.Tensor:
    """Guaranteed recall: protect the selected slots, evict max(misses - free, 0) (plus the
    reserve, ``evict_target``, when that is > 0), place the distinct misses, copy their rows
    host -> GPU, advance the clock. Returns gpu_slots [B, k] int32 with entry j = the GPU slot of
    host_slots entry j (-1 stays -1)."""
    _check_recall(host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices,
                  miss_host, meta, hist, stats, host_slots)
    return recall_ref(
        host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, miss_host,
        meta, stats, host_slots,
    )


recall.register_kernel("cuda")(_cuda_kernel(_check_recall, "recall_cuda"))


@recall.register_fake
def _(host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, miss_host, meta,
      hist, stats, host_slots):
    return torch.empty_like(host_slots)


@torch.library.custom_op("echo::release", mutates_args=(*_MAPS, "meta"))
def release(
    gpu_free: torch.Tensor,
    gpu_priority: torch.Tensor,
    gpu_to_host: torch.Tensor,
    host_to_gpu: torch.Tensor,
    meta: torch.Tensor,
    host_slots: torch.Tensor,  # host slots of finished requests (any shape, -1 ignored)
) -> None:
    """Forget host slots: their GPU slots (if any) become free and both maps are cleared. Must
    run before the host pages are handed out again, or a stale GPU copy would be served."""
    args = (gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots)
    _check_release(*args)
    release_ref(*args)


release.register_kernel("cuda")(_cuda_kernel(_check_release, "release_cuda"))


@release.register_fake
def _(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots) -> None:
    return None


@torch.library.custom_op("echo::offload", mutates_args=("host_kv", "index_k"))
def offload(
    host_kv: torch.Tensor,  # [N_H, row] uint8 (UVA view of pinned memory on CUDA)
    index_k: torch.Tensor,  # [N_H // 64, 8448] uint8: the paged indexer key cache
    rows: torch.Tensor,  # [T, row] uint8
    index_rows: torch.Tensor,  # [T, 132] uint8
    slots: torch.Tensor,  # [T] int64 host slots, -1 = padding (nothing written)
) -> None:
    """Write each token's KV row to the host pool and its indexer key (128 e4m3 + fp32 scale)
    to the paged indexer cache, at its host slot."""
    _check_offload(host_kv, index_k, rows, index_rows, slots)
    offload_ref(host_kv, index_k, rows, index_rows, slots)


offload.register_kernel("cuda")(_cuda_kernel(_check_offload, "offload_cuda"))


@offload.register_fake
def _(host_kv, index_k, rows, index_rows, slots) -> None:
    return None
