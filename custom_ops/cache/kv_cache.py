"""The KV cache the model talks to: per layer, the host KV pool rows, the paged indexer key cache
and (when offloading) the GPU pool that caches recently selected rows.

The model calls four methods per layer and never knows whether offloading is on:
``store`` (echo::offload), ``select`` (echo::indexer_topk), ``fetch`` (echo::recall, or the
device-resident pool itself when offloading is off) and ``prefill_select`` (a prefill chunk's
selections and the request's rows they read: from the device prefill buffer, or, without one,
the selected rows alone from the host pool by echo::prefill_indexer_topk_gather). Every tensor
here is a module buffer allocated once, so torch.compile treats it as static and CUDA graphs
replay over it; each layer has buffers of its own (views of one shared base would
make Inductor clone the whole base, docs/graph_notes.md).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

import custom_ops  # noqa: F401  (registers every echo:: op this module calls)
from custom_ops import cache_layout as C
from custom_ops.backends import select as backends
from custom_ops.backends.deep_gemm_ops import dg_paged_mqa_schedule, schedule_rows
from custom_ops.backends.flashinfer_ops import ROW_STATES_BYTES
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool
from custom_ops.cache.host_pool import allocate_host_rows
from custom_ops.cache.staging import PREFETCH_STATS, Staging
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE


class LayerKV(nn.Module):
    """One layer's cache state (see the module docstring)."""

    def __init__(
        self,
        cfg: CacheConfig,
        layer_id: int,
        host_kv: torch.Tensor,
        device: torch.device,
        shared: dict[str, torch.Tensor | None] | None = None,
        plans: tuple[backends.Plan, ...] | None = None,
    ):
        super().__init__()
        self.fmt = cfg.fmt
        self.topk = cfg.topk
        self.layer_id = layer_id
        self.offloading = cfg.offload
        self.register_buffer("host_kv", host_kv, persistent=False)
        self.register_buffer(
            "index_k",
            torch.zeros(
                cfg.host_tokens // PAGE, INDEX_PAGE_BYTES, dtype=torch.uint8, device=device
            ),
            persistent=False,
        )
        self.pool: nn.Module | None = None
        self.staging: Staging | None = None
        self.register_buffer("prefill_kv", None, persistent=False)
        # the indexer's backend per decode batch size, and the library buffers every layer shares
        # (KVCache decides and allocates them once: indexer_plans; None when no plan uses one)
        self.plans = plans if plans is not None else indexer_plans(cfg, device)
        self.plan_runs = backends.plan_runs(self.plans)  # what a step picks its plan from
        for name in ("dg_schedule", "fi_row_states"):
            self.register_buffer(name, (shared or {}).get(name), persistent=False)
        # prefill's scores backend by chunk tokens (no buffer: DeepGEMM's prefill logits need none)
        self.prefill_plan = backends.prefill_plan(cfg.kernel_backend, device, cfg.index_heads)
        if cfg.offload:
            self.pool = GpuPool(cfg, device)
            if cfg.prefetch != "off":
                self.staging = Staging(cfg, device)
        if cfg.prefill_tokens > 0:  # in both modes (CacheConfig.prefill_tokens says why)
            # one extra row: padding tokens of a chunk are written there and never read
            self.prefill_kv = torch.zeros(
                cfg.prefill_tokens + 1, cfg.row_bytes, dtype=torch.uint8, device=device
            )
        # without the buffer: the host rows prefill read, copied under a later block's scoring
        # and after the last one (echo::prefill_indexer_topk_gather's ``copied``), summed
        self.register_buffer(
            "prefill_copied", torch.zeros(2, dtype=torch.int64, device=device), persistent=False
        )

    def store(
        self,
        rows: torch.Tensor,
        index_rows: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Write the tokens' rows through to the host pool and the indexer cache; a prefill also
        passes ``positions`` and keeps the rows on the device for its next chunks."""
        torch.ops.echo.offload(self.host_kv, self.index_k, rows, index_rows, slots)
        if self.prefill_kv is not None and positions is not None:
            dump = self.prefill_kv.shape[0] - 1
            dst = torch.where(slots >= 0, positions, torch.full_like(positions, dump))
            self.prefill_kv.index_copy_(0, dst, rows)

    def select(
        self,
        q_fp8: torch.Tensor,
        weights: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.staging is not None:  # the fused prefetch indexer (Triton only): same outputs
            return self.staging.select(self.index_k, self.host_kv, self.pool, q_fp8, weights,
                                       block_table, seq_lens, self.topk)  # fmt: skip
        plan = backends.plan_of(self.plan_runs, q_fp8.shape[0])
        return backends.indexer_select(
            plan, q_fp8, weights, self.index_k, block_table, seq_lens, self.topk,
            self.dg_schedule, self.fi_row_states,
        )  # fmt: skip

    def prefill_logits(self, q_fp8: torch.Tensor) -> str:
        """``echo::prefill_indexer_topk``'s ``logits_backend`` for this chunk's queries
        ``[T, Hi, 128]`` (from static shapes: a constant of the traced chunk bucket)."""
        return backends.prefill_logits_backend(self.prefill_plan, q_fp8.shape[0], q_fp8.shape[1])

    def prefill_select(
        self,
        q_fp8: torch.Tensor,  # [T, Hi, 128] uint8 (e4m3 bytes)
        weights: torch.Tensor,  # [T, Hi] fp32
        block_table: torch.Tensor,  # [1, P] int32: the request's pages
        positions: torch.Tensor,  # [T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's selections ``[T, topk]`` (token positions, -1 pad) and the
        request's rows ``[P * 64, row]`` by position, the same bytes at every selected position
        either way: the device prefill buffer's, or without it the selected rows alone, copied
        from the host pool while the indexer scores (docs/prefetch.md, "Prefill")."""
        backend = self.prefill_logits(q_fp8)
        if self.prefill_kv is None:
            sel, rows, copied = torch.ops.echo.prefill_indexer_topk_gather(
                q_fp8, weights, self.index_k, block_table, positions, self.topk, self.host_kv,
                logits_backend=backend,
            )  # fmt: skip
            self.prefill_copied.add_(copied)
            return sel, rows
        n = block_table.shape[1] * PAGE
        pos_all = torch.arange(n, device=block_table.device)
        slots_all = block_table[0, pos_all // PAGE].long() * PAGE + pos_all % PAGE
        rows = self.read(slots_all, pos_all)
        sel = torch.ops.echo.prefill_indexer_topk(
            q_fp8, weights, self.index_k, block_table, positions, self.topk, logits_backend=backend
        )
        return sel, rows

    def fetch(self, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pool is None:
            return self.host_kv, host_slots
        if self.staging is not None:
            return self.pool.gpu_kv, self.staging.recall(self.pool, self.host_kv, host_slots)
        return self.pool.gpu_kv, self.pool.recall(self.host_kv, host_slots)

    def read(self, host_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows of the request being prefilled, at token ``positions`` (host ``host_slots``):
        from the device-resident prefill buffer when there is one, else from the host pool."""
        if self.prefill_kv is not None:
            if positions.shape[0] > self.prefill_kv.shape[0] - 1:  # a shape: no sync, compiles
                raise ValueError(
                    f"prefill reads {positions.shape[0]} positions but the prefill buffer holds "
                    f"{self.prefill_kv.shape[0] - 1} (CacheConfig.prefill_tokens)"
                )
            return self.prefill_kv[positions]
        return self.host_kv[host_slots]


class KVCache(nn.Module):
    """Every layer's ``LayerKV``. Host slots are handed out by the scheduler (outside the graph)."""

    def __init__(self, cfg: CacheConfig, device: str | torch.device = "cpu"):
        super().__init__()
        self.config = cfg
        device = torch.device(device)
        host = allocate_host_rows(
            cfg.num_layers, cfg.host_tokens, cfg.row_bytes, device, pinned=cfg.offload
        )
        plans = indexer_plans(cfg, device)
        shared = _backend_buffers(cfg, plans, device)
        self.layers = nn.ModuleList(
            LayerKV(cfg, i, host[i], device, shared, plans) for i in range(cfg.num_layers)
        )
        # Buffers reachable from a compiled module are static inputs already; marking them too keeps
        # them static when the cache is passed some other way (a plain argument), so mutating them
        # never makes CUDA-graph trees skip a graph (docs/graph_notes.md, static inputs).
        for buf in self.buffers():
            torch._dynamo.mark_static_address(buf, guard=False)

    def begin_decode(self, seq_lens: torch.Tensor) -> None:
        """Once per decode step, before the layers: DeepGEMM's schedule of this step's lengths,
        which every layer's indexer reads (a no-op when this batch size does not use it)."""
        first = self.layers[0]
        plan = backends.plan_of(first.plan_runs, seq_lens.shape[0])
        if plan.scores == "deep_gemm" and first.dg_schedule is not None:
            dg_paged_mqa_schedule(seq_lens, first.dg_schedule)

    def release(self, host_slots: torch.Tensor) -> None:
        """Forget a finished request's host slots in every layer's GPU pool, and its prefetch
        threshold state (echo::release_layers: one launch for all layers). Call it before the
        pages are handed out again: a stale host->GPU entry would serve the old rows to the
        next owner. Freeing the pages is the scheduler's HostSlotAllocator's job."""
        pools = [layer.pool for layer in self.layers if layer.pool is not None]
        if not pools:
            return
        ema = [layer.staging.ema for layer in self.layers if layer.staging is not None]
        torch.ops.echo.release_layers(
            [p.gpu_free for p in pools], [p.gpu_priority for p in pools],
            [p.gpu_to_host for p in pools], [p.host_to_gpu for p in pools],
            [p.meta for p in pools], ema, host_slots,
        )  # fmt: skip

    @torch.no_grad()
    def warm_kernels(self) -> None:
        """Run the ops that serving calls outside the captured graphs once on nothing (every slot
        -1: no row is written, no map changes), so that their Triton kernels compile here and
        not on a request's path: echo::release_layers at a request's finish (echo::release's
        first call held the whole batch's step up by ~0.4 s on the H200) and echo::offload
        (prompt-KV loads)."""
        cfg, device = self.config, self.layers[0].host_kv.device
        nothing = torch.full((PAGE,), -1, dtype=torch.int64, device=device)
        rows = torch.zeros(PAGE, cfg.row_bytes, dtype=torch.uint8, device=device)
        index_rows = torch.zeros(PAGE, INDEX_ROW_BYTES, dtype=torch.uint8, device=device)
        self.release(nothing)
        for layer in self.layers:
            layer.store(rows, index_rows, nothing)

    @torch.no_grad()
    def load_prefill(self, host_slots: torch.Tensor) -> None:
        """Fill every layer's prefill buffer (when there is one) with the host rows of
        ``host_slots [n]``, positions ``[0, n)``: a prompt's cached prefix, which its prefill's
        later chunks read from there (runtime.prefix_cache). Without the buffer they read the
        host pool itself: nothing to do."""
        n = host_slots.shape[0]
        for layer in self.layers:
            if layer.prefill_kv is not None:
                layer.prefill_kv[:n] = layer.host_kv[host_slots]

    def reset_pools(self) -> None:
        """Empty every layer's GPU pool in place. Nothing is lost: the host pool is authoritative.
        Used after a failed step, whose half-applied recall may have left the maps inconsistent.
        The running hit/recall and prefetch totals stay (``reset_stats`` zeroes them)."""
        for layer in self.layers:
            if layer.pool is not None:
                layer.pool.reset()
            if layer.staging is not None:
                layer.staging.reset()

    def reset_stats(self) -> None:
        """Zero the running hit/recall totals (e.g. after the warm-up's padding steps)."""
        for layer in self.layers:
            if layer.pool is not None:
                layer.pool.totals.zero_()
            if layer.staging is not None:
                layer.staging.totals.zero_()
            layer.prefill_copied.zero_()

    def overflow(self) -> torch.Tensor:
        """The recalls that overflowed a GPU pool, summed over layers: an int32 scalar on the
        pools' device, taken without a host sync (a 0 on the CPU without offloading)."""
        words = [layer.pool.meta[C.OVERFLOW] for layer in self.layers if layer.pool is not None]
        if not words:  # no pool (GPU-only): nothing to read from the device
            return torch.zeros((), dtype=torch.int32)
        return torch.stack(words).sum(dtype=torch.int32)

    def layer_stats(self) -> list[dict[str, float]]:
        """Per-layer GPU-pool statistics (one host sync; call between steps)."""
        per = []
        for layer in self.layers:
            if layer.pool is not None:
                s = layer.pool.stats()
                per.append(s if layer.staging is None else {**s, **layer.staging.stats(s)})
        return per

    def stats(self) -> dict[str, float | list[float]]:
        """Pool usage (mean over layers), hit rate per layer, recalled rows per step and layer.
        Without offloading there is no GPU pool: empty lists and zeros."""
        per = self.layer_stats()
        n = max(len(per), 1)
        early, late = torch.stack([layer.prefill_copied for layer in self.layers]).sum(0).tolist()
        return {
            "gpu_pool_usage": sum(p["gpu_pool_usage"] for p in per) / n,
            "gpu_pool_usage_per_layer": [p["gpu_pool_usage"] for p in per],
            "hit_rate": [p["hit_rate"] for p in per],
            # the running totals the hit rate is made of, per layer: selected entries (lookups)
            # and those recalled from the host (misses); 1 - recalled / selected is the hit rate
            "selected_per_layer": [p["selected"] for p in per],
            "recalled_per_layer": [p["recalled"] for p in per],
            "recalled_rows_per_step": sum(p["recalled_rows_per_step"] for p in per) / n,
            "recalled_rows_per_step_per_layer": [p["recalled_rows_per_step"] for p in per],
            "overflow": sum(p["overflow"] for p in per),
            # prefetch (docs/prefetch.md), per layer; empty lists when prefetch is off
            **{k: [p[k] for p in per if k in p] for k in PREFETCH_STATS},
            # prefill without the device buffer: host rows it read (summed over layers) and the
            # share copied under a later query block's scoring (0 when nothing was read)
            "prefill_host_rows": float(early + late),
            "prefill_copy_overlap": early / (early + late) if early + late else 0.0,
        }


def indexer_plans(cfg: CacheConfig, device: torch.device) -> tuple[backends.Plan, ...]:
    """The indexer's backends per decode batch size. With prefetch every layer runs the fused
    Triton indexer (``Staging.select``), so no library serves it: all-Triton plans, and
    ``begin_decode`` launches no DeepGEMM schedule nobody reads."""
    backend = "triton" if cfg.offload and cfg.prefetch != "off" else cfg.kernel_backend
    plans = backends.plans_for(backend, cfg.max_batch, device)
    if cfg.index_heads is not None and cfg.index_heads not in backends.HEADS:
        # indexer_select would run Triton scores anyway (DeepGEMM refuses the head count)
        plans = tuple(replace(p, scores="triton") for p in plans)
    return plans


def _backend_buffers(
    cfg: CacheConfig, plans: tuple[backends.Plan, ...], device: torch.device
) -> dict[str, torch.Tensor | None]:
    """The static buffers the indexer's library backends need, allocated once outside any graph
    pool and shared by every layer: DeepGEMM's schedule, FlashInfer's top-k scratch."""
    out: dict[str, torch.Tensor | None] = {"dg_schedule": None, "fi_row_states": None}
    if any(p.scores == "deep_gemm" for p in plans):
        rows = schedule_rows(device)
        out["dg_schedule"] = torch.zeros(rows, 2, dtype=torch.int32, device=device)
    if any(p.topk == "flashinfer" for p in plans):
        out["fi_row_states"] = torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8, device=device)
    return out
