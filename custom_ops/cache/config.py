"""``CacheConfig``: the geometry of the KV cache (host pool, GPU pools, indexer cache), validated
once; every cache-state module and the runtime build from it."""

from __future__ import annotations

from dataclasses import dataclass

from custom_ops.backends.select import DEFAULT_BACKEND, check_backend
from custom_ops.kv_format import PAGE, ROW_BYTES, check_fmt

PREFETCH_MARGIN = 2.0  # the default (docs/prefetch.md, "The threshold": the measurement behind it)


def check_prefetch(
    mode: str,
    cap: int,
    ratio: float,
    offload: bool,
    margin: float = 0.0,
    host_tokens: int | None = None,
) -> None:
    """The prefetch options' one rule (CacheConfig, and EngineConfig at construction);
    ``host_tokens`` None: the host pool's size not known yet, ``prefetch_cap`` not bounded."""
    if mode not in ("off", "request", "global"):
        raise ValueError(f"prefetch must be 'off', 'request' or 'global', got {mode!r}")
    if mode != "off" and not offload:
        raise ValueError(
            f"prefetch={mode!r} needs offloading (offload=True): without a host pool there is "
            "nothing to prefetch"
        )
    if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
        raise ValueError(f"prefetch_cap must be a positive integer, got {cap!r}")
    # NOTE: the staging buffer has max_batch x prefetch_cap rows a layer, whatever the mode. A
    # request stages only its own context tokens, and its whole context is in the host pool
    # (it reserves its pages at admission), so it never stages more than host_tokens rows:
    # a larger cap only allocates rows no request can fill (10M: 92 GB on the tiny model)
    if mode != "off" and host_tokens is not None and cap > host_tokens:
        raise ValueError(
            f"prefetch_cap must be at most host_tokens ({host_tokens}, the most rows a request "
            f"can stage), got {cap}"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        # more than one staged row per context token stages nothing more (the candidates are
        # context tokens), and the kernels take the budget as an int32
        raise ValueError(
            f"prefetch_ratio must be in (0, 1] (staged rows per context token), got {ratio!r}"
        )
    if (
        isinstance(margin, bool)
        or not isinstance(margin, (int, float))
        or not 0 <= margin < float("inf")
    ):
        raise ValueError(f"prefetch_margin must be a finite number >= 0, got {margin!r}")


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
    # it the same way, so offloading cannot change a prefill's numerics (with different graphs the
    # last bits differed and top-k near-ties picked other tokens). The cost is
    # prefill_tokens x row_bytes of device memory per layer (4096 tokens: 4.7 MB bf16, 2.7 MB fp8).
    # 0: no buffer (EngineConfig.prefill_buffer=False), in both modes alike: a prefill chunk copies
    # the rows its queries select from host_kv (echo::prefill_indexer_topk_gather).
    prefill_tokens: int = 0
    # who computes the decode indexer's scores and top-k (custom_ops/backends/select.py)
    kernel_backend: str = DEFAULT_BACKEND
    # the model's index heads (None: not known); DeepGEMM's kernel takes only some counts, and a
    # plan that could never use it neither builds its schedule nor allocates for it
    index_heads: int | None = None
    # Lossless decode prefetch (docs/prefetch.md; only with offload): "off", "request" (at most
    # prefetch_cap rows per request and layer) or "global" (prefetch_ratio x the batch's context
    # rows per layer, at most max_batch x prefetch_cap, the staging buffer's size).
    prefetch: str = "off"
    prefetch_cap: int = 64
    prefetch_ratio: float = 1 / 512
    # threshold = EMA of the k-th score + prefetch_margin x EMA of its distance from that EMA
    # (0: ECHO's threshold; docs/prefetch.md, "The threshold")
    prefetch_margin: float = PREFETCH_MARGIN

    def __post_init__(self) -> None:
        check_fmt(self.fmt)
        check_backend(self.kernel_backend)
        check_prefetch(
            self.prefetch,
            self.prefetch_cap,
            self.prefetch_ratio,
            self.offload,
            self.prefetch_margin,
            self.host_tokens,
        )
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
                f"(topk={self.topk}); gpu_tokens (--gpu-tokens) >= max_batch x topk = "
                f"{self.max_batch * self.topk} serves a full decode batch (`echo-compile plan "
                "--model DIR` shows the pools that fit a GPU)"
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
