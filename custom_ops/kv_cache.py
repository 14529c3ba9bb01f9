"""The KV cache the model talks to: per layer, the host KV pool rows, the paged indexer key cache
and (when offloading) the GPU pool that caches recently selected rows.

The model calls four methods per layer and never knows whether offloading is on:
``store`` (echo::offload), ``select`` (echo::indexer_topk), ``fetch`` (echo::recall, or the
device-resident pool itself when offloading is off) and ``read`` (prefill's gather of a request's
rows). Every tensor here is a module buffer allocated once, so torch.compile treats it as static
and CUDA graphs replay over it; each layer has buffers of its own (views of one shared base would
make Inductor clone the whole base, compile_notes.md §1.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from custom_ops import attention as _attention  # noqa: F401  (registers echo::sparse_mla_decode)
from custom_ops.host_pool import allocate_host_rows
from custom_ops.indexer import indexer_topk
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE, ROW_BYTES, check_fmt


@dataclass(frozen=True)
class CacheConfig:
    num_layers: int
    host_tokens: int  # N_H: host KV pool rows per layer (a multiple of the 64-token page)
    gpu_tokens: int  # N_G: GPU pool rows per layer when offloading (ignored otherwise)
    topk: int  # the model's index_topk
    fmt: str = "bf16"  # KV row format: "bf16" (1152 B) or "fp8" (656 B)
    offload: bool = True  # False: the whole KV pool lives in device memory (GPU-only policy)
    max_batch: int = 64  # the largest decode batch (bounds the fixed-size recall buffers)
    # Rows of the device-resident buffer that holds the KV of the request being prefilled (its
    # longest context), so prefill chunks read their context from the device, not back over PCIe.
    # NOTE: GPU-only has it too (runtime.engine_config builds both alike): then prefill's store and
    # read are the same ops in both modes, both compile the same prefill graph and Inductor fuses
    # it the same way, so offloading cannot change a prefill's numerics (issue 13 item 0: with
    # different graphs the last bits differed and top-k near-ties picked other tokens). The cost is
    # prefill_tokens x row_bytes of device memory per layer (4096 tokens: 4.7 MB bf16, 2.7 MB fp8).
    # 0: no buffer, prefill reads its context from host_kv.
    prefill_tokens: int = 0

    def __post_init__(self) -> None:
        check_fmt(self.fmt)
        if self.num_layers <= 0:
            raise ValueError(f"CacheConfig.num_layers must be positive, got {self.num_layers}")
        if self.host_tokens <= 0 or self.host_tokens % PAGE:
            raise ValueError(
                f"CacheConfig.host_tokens must be a positive multiple of {PAGE}, "
                f"got {self.host_tokens}"
            )
        if self.topk <= 0 or self.max_batch <= 0:
            raise ValueError("CacheConfig.topk and max_batch must be positive")
        if self.prefill_tokens < 0:
            raise ValueError(f"CacheConfig.prefill_tokens must be >= 0, got {self.prefill_tokens}")
        if self.offload and self.gpu_tokens < self.topk:
            raise ValueError(
                f"CacheConfig.gpu_tokens={self.gpu_tokens} cannot hold one request's selection "
                f"(topk={self.topk})"
            )

    @property
    def row_bytes(self) -> int:
        return ROW_BYTES[self.fmt]

    @property
    def max_decode_rows(self) -> int:
        """Decode rows one step may have (see ``max_decode_rows``)."""
        return max_decode_rows(self.max_batch, self.topk, self.gpu_tokens if self.offload else None)


def max_decode_rows(max_batch: int, topk: int, gpu_tokens: int | None) -> int:
    """The one home of the GPU-pool capacity rule B x topk <= N_G: the guaranteed recall needs every
    row's selection on the GPU at once, so a step decodes at most N_G // topk rows (and at most
    ``max_batch``). ``gpu_tokens`` None: no GPU pool (GPU-only), only ``max_batch`` bounds it."""
    if gpu_tokens is None:
        return max_batch
    return min(max_batch, gpu_tokens // topk)


@torch.library.custom_op("echo::offload", mutates_args=("host_kv", "index_k"))
def offload(
    host_kv: torch.Tensor,  # [N_H, row] uint8
    index_k: torch.Tensor,  # [N_H // 64, 8448] uint8
    rows: torch.Tensor,  # [T, row] uint8
    index_rows: torch.Tensor,  # [T, 132] uint8
    slots: torch.Tensor,  # [T] int64 host slots, -1 = padding (nothing written)
) -> None:
    if rows.shape[0] != slots.shape[0] or index_rows.shape != (rows.shape[0], INDEX_ROW_BYTES):
        raise ValueError(
            "offload: rows [T, row], index_rows [T, 132] and slots [T] must agree on T"
        )
    if rows.shape[1] != host_kv.shape[1]:
        raise ValueError(f"offload: row width {rows.shape[1]} != pool row width {host_kv.shape[1]}")
    if host_kv.is_cuda:
        from custom_ops import cache_kernels

        cache_kernels.offload_cuda(host_kv, index_k, rows, index_rows, slots)
        return
    offload_ref(host_kv, index_k, rows, index_rows, slots)


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


@offload.register_fake
def _(host_kv, index_k, rows, index_rows, slots) -> None:
    return None


class LayerKV(nn.Module):
    """One layer's cache state (see the module docstring)."""

    def __init__(
        self, cfg: CacheConfig, layer_id: int, host_kv: torch.Tensor, device: torch.device
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
        self.register_buffer("prefill_kv", None, persistent=False)
        if cfg.offload:
            from custom_ops.gpu_pool import GpuPool

            self.pool = GpuPool(cfg, device)
        if cfg.prefill_tokens > 0:  # in both modes (CacheConfig.prefill_tokens says why)
            # one extra row: padding tokens of a chunk are written there and never read
            self.prefill_kv = torch.zeros(
                cfg.prefill_tokens + 1, cfg.row_bytes, dtype=torch.uint8, device=device
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
        return indexer_topk(q_fp8, weights, self.index_k, block_table, seq_lens, self.topk)

    def fetch(self, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pool is None:
            return self.host_kv, host_slots
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
        self.layers = nn.ModuleList(LayerKV(cfg, i, host[i], device) for i in range(cfg.num_layers))
        # Buffers reachable from a compiled module are static inputs already; marking them too keeps
        # them static when the cache is passed some other way (a plain argument), so mutating them
        # never makes CUDA-graph trees skip a graph (compile_notes.md §2.1).
        for buf in self.buffers():
            torch._dynamo.mark_static_address(buf, guard=False)

    def release(self, host_slots: torch.Tensor) -> None:
        """Forget a finished request's host slots in every layer's GPU pool (echo::release).
        Call it before the pages are handed out again: a stale host->GPU entry would serve the
        old rows to the next owner. Freeing the pages is the scheduler's HostSlotAllocator's job."""
        for layer in self.layers:
            if layer.pool is not None:
                layer.pool.release(host_slots.to(torch.int32))

    def reset_pools(self) -> None:
        """Empty every layer's GPU pool in place. Nothing is lost: the host pool is authoritative.
        Used after a failed step, whose half-applied recall may have left the maps inconsistent."""
        for layer in self.layers:
            if layer.pool is not None:
                layer.pool.reset()

    def reset_stats(self) -> None:
        """Zero the running hit/recall totals (e.g. after the warm-up's padding steps)."""
        for layer in self.layers:
            if layer.pool is not None:
                layer.pool.totals.zero_()

    def layer_stats(self) -> list[dict[str, float]]:
        """Per-layer GPU-pool statistics (one host sync; call between steps)."""
        return [layer.pool.stats() for layer in self.layers if layer.pool is not None]

    def stats(self) -> dict[str, float | list[float]]:
        """Pool usage (mean over layers), hit rate per layer, recalled rows per step and layer.
        Without offloading there is no GPU pool: empty lists and zeros."""
        per = self.layer_stats()
        n = max(len(per), 1)
        return {
            "gpu_pool_usage": sum(p["gpu_pool_usage"] for p in per) / n,
            "gpu_pool_usage_per_layer": [p["gpu_pool_usage"] for p in per],
            "hit_rate": [p["hit_rate"] for p in per],
            "recalled_rows_per_step": sum(p["recalled_rows_per_step"] for p in per) / n,
            "recalled_rows_per_step_per_layer": [p["recalled_rows_per_step"] for p in per],
            "overflow": sum(p["overflow"] for p in per),
        }
