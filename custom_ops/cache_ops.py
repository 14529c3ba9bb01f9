"""The cache ops' registrations (``echo::allocate``, ``echo::free``, ``echo::recall``,
``echo::release``, ``echo::release_layers``, ``echo::offload``) and their input checks. The
semantics, the state they act on and the pure-torch references (every op's default kernel, and
the specification its Triton kernel is tested against) are in cache_ref.py; the CUDA launchers
in cache_kernels.py.
"""

from __future__ import annotations

import torch

# (evict_target, reserve_slots: the eviction batch, re-exported as part of these ops' rule)
from custom_ops.cache_layout import (  # noqa: F401
    META_LEN,
    NBINS,
    STATS_LEN,
    evict_target,
    reserve_slots,
)
from custom_ops.cache_ref import (  # noqa: F401  (also read as cache_ops.*_ref)
    allocate_ref,
    free_ref,
    offload_ref,
    recall_ref,
    release_layers_ref,
    release_ref,
)
from custom_ops.kv_format import INDEX_ROW_BYTES, PAGE


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
            raise ValueError(
                f"{op}: {name} must be a 1-D {dtype} tensor of {n} entries, got "
                f"{t.dtype} {list(t.shape)}"
            )
        if t.device != gpu_to_host.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the pool on {gpu_to_host.device}")
    if indices is not None and indices.shape[0] > n_g:
        raise ValueError(f"{op}: indices ({indices.shape[0]}) cannot exceed the pool ({n_g})")


def _check_count(op: str, n: torch.Tensor, device: torch.device) -> None:
    if n.shape != (1,) or n.dtype != torch.int32 or n.device != device:
        raise ValueError(
            f"{op}: n must be an int32 tensor of shape [1] on {device}, got "
            f"{n.dtype} {list(n.shape)} on {n.device}"
        )


def _check_slots(op: str, name: str, slots: torch.Tensor, device: torch.device) -> None:
    if slots.dtype not in (torch.int32, torch.int64) or slots.device != device:
        raise ValueError(
            f"{op}: {name} must be int32/int64 host slots on {device}, got "
            f"{slots.dtype} on {slots.device}"
        )


# ---- input checks (one per op, shared by its reference and its CUDA kernel) ---------------------
_MAPS = ("gpu_free", "gpu_priority", "gpu_to_host", "host_to_gpu")


def _check_allocate(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n):
    _check_state("allocate", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, indices)
    _check_count("allocate", n, gpu_free.device)
    if want_host.dtype != torch.int32 or want_host.dim() != 1 or want_host.device != n.device:
        raise ValueError("allocate: want_host must be a 1-D int32 tensor on the pool's device")


def _check_free(
    gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, protect, n
):
    _check_state("free", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, indices)
    _check_count("free", n, gpu_free.device)
    _check_slots("free", "protect", protect, gpu_free.device)
    if hist.shape != (NBINS,) or hist.dtype != torch.int32:
        raise ValueError(f"free: hist must be int32 [{NBINS}]")
    if stats.shape != (STATS_LEN,) or stats.dtype != torch.int64:
        raise ValueError(f"free: stats must be int64 [{STATS_LEN}]")


def _check_recall(host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices,
                  miss_host, meta, hist, stats, host_slots):  # fmt: skip
    _check_state("recall", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, indices)
    if host_slots.dtype != torch.int32 or host_slots.dim() != 2:
        raise ValueError(
            f"recall: host_slots must be int32 [B, k], got {host_slots.dtype} "
            f"{list(host_slots.shape)}"
        )
    if host_kv.dtype != torch.uint8 or gpu_kv.dtype != torch.uint8 or host_kv.dim() != 2:
        raise ValueError("recall: host_kv and gpu_kv must be uint8 [rows, row_bytes]")
    if gpu_kv.shape != (gpu_to_host.shape[0], host_kv.shape[1]):
        raise ValueError(f"recall: gpu_kv {list(gpu_kv.shape)} must be [N_G, {host_kv.shape[1]}]")
    if host_kv.shape[0] != host_to_gpu.shape[0]:
        raise ValueError(
            f"recall: host_kv has {host_kv.shape[0]} rows, host_to_gpu {host_to_gpu.shape[0]}"
        )
    if miss_host.shape != indices.shape or miss_host.dtype != torch.int32:
        raise ValueError("recall: miss_host must be int32 shaped like indices")


def _check_release(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots):
    _check_state("release", gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta)
    _check_slots("release", "host_slots", host_slots, gpu_free.device)


def _check_release_layers(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, ema,
                          host_slots):  # fmt: skip
    lists = {"gpu_free": gpu_free, "gpu_priority": gpu_priority, "gpu_to_host": gpu_to_host,
             "host_to_gpu": host_to_gpu, "meta": meta, "ema": ema}  # fmt: skip
    n = len(meta)
    for name, lst in lists.items():
        if len(lst) != n or n == 0:
            if name == "ema" and not lst:
                continue
            raise ValueError(f"release_layers: {name} has {len(lst)} layers, meta {n} (> 0)")
    # one layer's state checked whole; the others must match it (the kernel reads their sizes
    # from the first), one comparison per tensor: a call passes every layer's (366 on V3.2)
    _check_release(gpu_free[0], gpu_priority[0], gpu_to_host[0], host_to_gpu[0], meta[0],
                   host_slots)  # fmt: skip
    n_ema = host_to_gpu[0].shape[0] // PAGE + 1
    if ema and (ema[0].dim() != 2 or ema[0].shape[1] != n_ema or ema[0].dtype != torch.float32):
        raise ValueError(
            f"release_layers: ema[0] must be contiguous float32 [rows, {n_ema}], got "
            f"{ema[0].dtype} {list(ema[0].shape)}"
        )
    dev = meta[0].device
    for name, lst in lists.items():
        if not lst:
            continue
        want = (lst[0].shape, lst[0].dtype, dev, True)
        for i, t in enumerate(lst):
            if (t.shape, t.dtype, t.device, t.is_contiguous()) != want:
                raise ValueError(
                    f"release_layers: {name}[{i}] is {t.dtype} {list(t.shape)} on {t.device} "
                    f"(contiguous: {t.is_contiguous()}), layer 0's {lst[0].dtype} "
                    f"{list(lst[0].shape)} on {dev} (contiguous)"
                )


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
    _check_free(
        gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, protect, n
    )
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
                  miss_host, meta, hist, stats, host_slots)  # fmt: skip
    return recall_ref(host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices,
                      miss_host, meta, stats, host_slots)  # fmt: skip


recall.register_kernel("cuda")(_cuda_kernel(_check_recall, "recall_cuda"))


@recall.register_fake
def _(*args):
    return torch.empty_like(args[11])  # host_slots


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


# echo::release_layers takes every layer's pool buffers (6 x 61 tensors on V3.2). custom_op's
# per-tensor Python work on each call (alias checks, version counters) cost 0.67 ms of its
# 1.27 ms on the H100's host (a profile, gpu_session45), so it is defined on the dispatcher
# directly: the same schema and meaning (its lists are mutated), a CPU reference, a CUDA kernel,
# a fake. Its buffers never need autograd's version counters (cache state, no grad).
_LIB = torch.library.Library("echo", "FRAGMENT")
_LIB.define(
    "release_layers(Tensor(a!)[] gpu_free, Tensor(b!)[] gpu_priority, Tensor(c!)[] gpu_to_host, "
    "Tensor(d!)[] host_to_gpu, Tensor(e!)[] meta, Tensor(f!)[] ema, Tensor host_slots) -> ()"
)


def release_layers(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, ema, host_slots):
    """echo::release in every layer's pool at once (one launch on CUDA, not one per layer), and
    each layer's prefetch threshold state ``ema`` (an empty list when prefetch is off) of the
    slots' host pages back to 0. Each list: one entry per layer; ``host_slots``: the finished
    request's (any shape, -1 ignored)."""
    args = (gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, ema, host_slots)
    _check_release_layers(*args)
    release_layers_ref(*args)


_LIB.impl("release_layers", release_layers, "CPU")
_LIB.impl("release_layers", _cuda_kernel(_check_release_layers, "release_layers_cuda"), "CUDA")


@torch.library.register_fake("echo::release_layers", lib=_LIB)
def _(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, ema, host_slots) -> None:
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
