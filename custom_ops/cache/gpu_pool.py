"""``GpuPool``: one layer's GPU cache of host KV rows and its cache-manager state.

Every tensor is a module buffer allocated once and only mutated in place, so torch.compile treats
them as static inputs and CUDA graphs replay over them (docs/graph_notes.md). The ops are the
``echo::`` custom ops of cache_ops.py. Running statistics live in a device buffer (``totals``) and
are read between steps with ``stats()``; nothing in ``recall`` synchronises with the host.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import custom_ops  # noqa: F401  (registers the echo:: cache ops this module calls)
from custom_ops import cache_layout as C
from custom_ops.cache.config import CacheConfig


def pool_buffers(cfg: CacheConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype, int | None]]:
    """One layer's pool buffers, name: (shape, dtype, initial value; None: 0, 1, 2, ...), the one
    home of their sizes: ``GpuPool`` allocates them, the memory plan (runtime/distributed/plan.py)
    counts them."""
    n_g, n_h = cfg.gpu_tokens, cfg.host_tokens
    cap = min(cfg.max_batch * cfg.topk, n_g)  # CAP: selected entries per recall
    i32 = torch.int32
    return {
        "gpu_kv": ((n_g, cfg.row_bytes), torch.uint8, 0),
        "gpu_free": ((n_g,), i32, None),  # the ring of free slots: all, from HEAD = 0
        "gpu_priority": ((n_g,), i32, -1),
        "gpu_to_host": ((n_g,), i32, -1),
        "host_to_gpu": ((n_h,), i32, -1),
        "indices": ((cap,), i32, -1),
        "miss_host": ((cap,), i32, 0),
        "meta": ((C.META_LEN,), i32, 0),
        "hist": ((C.NBINS,), i32, 0),
        "totals": ((C.STATS_LEN,), torch.int64, 0),  # the ops' argument "stats"
    }


class GpuPool(nn.Module):
    """Per-layer GPU pool. ``recall(host_kv, host_slots [B, k] int32) -> gpu_slots [B, k] int32``
    keeps the order of ``host_slots`` (entry j holds host slot j's row; -1 stays -1).

    ``debug=True`` (or ECHO_CACHE_DEBUG=1 at construction) checks every invariant after each
    eager call (it synchronises; never inside a compiled step)."""

    def __init__(self, cfg: CacheConfig, device: str | torch.device, debug: bool | None = None):
        super().__init__()
        device = torch.device(device)
        n_g, n_h = cfg.gpu_tokens, cfg.host_tokens
        if n_g <= 0 or n_h <= 0:
            raise ValueError(f"GpuPool: gpu_tokens ({n_g}), host_tokens ({n_h}) must be positive")
        if n_h >= 2**31 or n_g >= 2**31:
            raise ValueError("GpuPool: pools are indexed with int32 slot ids (< 2^31 rows)")
        self.capacity = min(cfg.max_batch * cfg.topk, n_g)  # CAP: selected entries per recall
        self.debug = debug if debug is not None else os.environ.get("ECHO_CACHE_DEBUG") == "1"

        for name, (shape, dtype, value) in pool_buffers(cfg).items():
            if value is None:
                t = torch.arange(shape[0], dtype=dtype, device=device)
            else:
                t = torch.full(shape, value, dtype=dtype, device=device)
            self.register_buffer(name, t, persistent=False)
        self.meta[C.NFREE] = n_g

    # ---- the ops (static buffers in, so CUDA-graph safe) ----------------------------------------
    def recall(self, host_kv: torch.Tensor, host_slots: torch.Tensor) -> torch.Tensor:
        out = torch.ops.echo.recall(
            host_kv, self.gpu_kv, self.gpu_free, self.gpu_priority, self.gpu_to_host,
            self.host_to_gpu, self.indices, self.miss_host, self.meta, self.hist, self.totals,
            host_slots,
        )
        if self.debug and not torch.compiler.is_compiling():
            from custom_ops.cache.invariants import check_pool

            check_pool(self, selected=host_slots, gpu_slots=out, host_kv=host_kv)
        return out

    def allocate(self, want_host: torch.Tensor, n: torch.Tensor) -> None:
        """Place want_host[:n] (distinct, not resident) into free slots; slots in ``indices``."""
        torch.ops.echo.allocate(
            self.gpu_free, self.gpu_priority, self.gpu_to_host, self.host_to_gpu, self.indices,
            self.meta, want_host, n,
        )
        self._debug_check()

    def free(self, protect: torch.Tensor, n: torch.Tensor) -> None:
        """Protect ``protect``'s slots, then evict max(n - free, 0) into ``indices``."""
        torch.ops.echo.free(
            self.gpu_free, self.gpu_priority, self.gpu_to_host, self.host_to_gpu, self.indices,
            self.meta, self.hist, self.totals, protect, n,
        )
        self._debug_check()

    def release(self, host_slots: torch.Tensor) -> None:
        """Forget ``host_slots`` (a finished request's): call before their pages are reused."""
        torch.ops.echo.release(
            self.gpu_free, self.gpu_priority, self.gpu_to_host, self.host_to_gpu, self.meta,
            host_slots,
        )
        self._debug_check()

    def _debug_check(self) -> None:
        if self.debug and not torch.compiler.is_compiling():
            from custom_ops.cache.invariants import check_pool

            check_pool(self)

    # ---- between steps (these synchronise) ------------------------------------------------------
    def stats(self) -> dict[str, float]:
        s = self.totals.tolist()
        m = self.meta.tolist()
        n_g = self.gpu_to_host.shape[0]
        selected, recalled, steps, evicted = (s[i] for i in (C.SELECTED, C.RECALLED, C.STEPS,
                                                              C.EVICTED))
        return {
            "selected": float(selected),
            "recalled": float(recalled),
            "steps": float(steps),
            "evicted": float(evicted),
            "hit_rate": 1.0 - recalled / selected if selected else 1.0,
            "recalled_rows_per_step": recalled / steps if steps else 0.0,
            "gpu_pool_usage": 1.0 - m[C.NFREE] / n_g,
            "overflow": float(m[C.OVERFLOW]),
        }

    @torch.no_grad()
    def reset(self) -> None:
        """Empty the pool (in place: the buffers keep their addresses). The running ``totals``
        stay: they count every lookup since start (or ``KVCache.reset_stats``), and /metrics
        exports them as counters, which a reset here (after a failed step) would restart."""
        self.gpu_free.copy_(torch.arange(self.gpu_free.numel(), dtype=torch.int32))
        self.gpu_priority.fill_(-1)
        self.gpu_to_host.fill_(-1)
        self.host_to_gpu.fill_(-1)
        self.indices.fill_(-1)
        self.meta.zero_()
        self.meta[C.NFREE] = self.gpu_to_host.shape[0]
        self.hist.zero_()
