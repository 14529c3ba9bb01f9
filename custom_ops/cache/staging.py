"""``Staging``: one layer's prefetch state (docs/prefetch.md): the staging buffer the fused indexer
copies candidates into, its two maps, the per-request threshold state (EMAs of the exact k-th
score and of its distance from that EMA, prefetch_layout) and the prefetch statistics. Every
tensor is a module buffer allocated once, so CUDA graphs replay over it. Memory per layer: S x
row bytes of staging (S = max_batch x prefetch_cap; 64 x 64 bf16 rows: 4.7 MB), 8 x S bytes of
epoch tags (stage_host), 4 x N_H bytes for host_stage (the ``pool_size + slot`` encoding ECHO
puts in host_to_gpu would change the recall's meaning of that map, so the map is separate) and
12 x N_H / 64 bytes of threshold state.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import custom_ops  # noqa: F401  (registers the echo:: ops this module calls)
from custom_ops.cache.config import CacheConfig
from custom_ops.kv_format import PAGE
from custom_ops.prefetch_layout import EMA_ROWS, PF_LEN

# the per-layer metrics KVCache.stats() lists (step stats, /metrics, bench JSON)
PREFETCH_STATS = ("prefetched_per_step", "prefetch_precision", "prefetch_coverage")


def staging_buffers(cfg: CacheConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    """One layer's staging buffers, name: (shape, dtype, initial value), the one home of their
    sizes: ``Staging`` allocates them, the memory plan (runtime/distributed/plan.py) counts
    them."""
    n_stage = cfg.max_batch * cfg.prefetch_cap
    # threshold, level, deviation (prefetch_layout.EMA_*) keyed by a request's first host page
    # (+ a dump column for padded rows)
    n_ema = cfg.host_tokens // PAGE + 1
    return {
        "stage_kv": ((n_stage, cfg.row_bytes), torch.uint8, 0),
        # tags epoch << 32 | host slot (prefetch_layout), -1 never staged
        "stage_host": ((n_stage,), torch.int64, -1),
        "host_stage": ((cfg.host_tokens,), torch.int32, -1),
        # claim counters per request, the global one, then the staging epoch (the last word)
        "stage_ctr": ((cfg.max_batch + 2,), torch.int32, 0),
        "ema": ((EMA_ROWS, n_ema), torch.float32, 0),
        "totals": ((PF_LEN,), torch.int64, 0),
    }


def staging_bytes(cfg: CacheConfig) -> int:
    """Device bytes of one layer's ``Staging`` of ``cfg`` (prefetch on)."""
    return sum(
        math.prod(shape) * dtype.itemsize for shape, dtype, _ in staging_buffers(cfg).values()
    )


class Staging(nn.Module):
    def __init__(self, cfg: CacheConfig, device: torch.device):
        super().__init__()
        self.cap = cfg.prefetch_cap
        self.ratio = cfg.prefetch_ratio if cfg.prefetch == "global" else 0.0
        self.margin = cfg.prefetch_margin
        for name, (shape, dtype, value) in staging_buffers(cfg).items():
            t = torch.full(shape, value, dtype=dtype, device=device)
            self.register_buffer(name, t, persistent=False)

    def select(self, index_k, host_kv, pool, q_fp8, weights, block_table, seq_lens, topk):
        return torch.ops.echo.indexer_topk_prefetch(
            q_fp8,
            weights,
            index_k,
            block_table,
            seq_lens,
            topk,
            host_kv,
            pool.host_to_gpu,
            self.stage_kv,
            self.stage_host,
            self.host_stage,
            self.stage_ctr,
            self.ema,
            self.totals,
            self.cap,
            self.ratio,
            self.margin,
        )

    def recall(self, pool, host_kv: torch.Tensor, host_slots: torch.Tensor) -> torch.Tensor:
        return torch.ops.echo.recall_staged(
            host_kv,
            pool.gpu_kv,
            pool.gpu_free,
            pool.gpu_priority,
            pool.gpu_to_host,
            pool.host_to_gpu,
            pool.indices,
            pool.miss_host,
            pool.meta,
            pool.hist,
            pool.totals,
            host_slots,
            self.stage_kv,
            self.stage_host,
            self.host_stage,
            self.stage_ctr,
            self.totals,
        )

    def stats(self, pool_stats: dict[str, float]) -> dict[str, float]:
        """Prefetch metrics of the layer, from its running totals (one host sync): prefetched
        rows per step, precision = promoted / staged (staged rows the exact top-k then selected),
        coverage = promoted / misses. The pool's own figures (hit rate, recalled rows) already
        count a staged miss as a miss: the recall places it like any other, only its bytes come
        from staging."""
        cand, staged, promoted, steps = self.totals.tolist()
        misses = pool_stats["recalled"]
        return {
            "prefetch_candidates": float(cand),
            "prefetched": float(staged),
            "prefetched_per_step": staged / steps if steps else 0.0,
            "prefetch_precision": promoted / staged if staged else 0.0,
            "prefetch_coverage": promoted / misses if misses else 0.0,
            "host_copied": misses - promoted,
        }

    @torch.no_grad()
    def reset(self) -> None:
        """Empty the staging state (the tags too: the epoch starts again at 0); the running
        ``totals`` stay, as the pool's do (``GpuPool.reset``): the prefetch shares are of every
        step since start."""
        self.stage_host.fill_(-1)
        self.host_stage.fill_(-1)
        self.stage_ctr.zero_()
        self.ema.zero_()
