"""EngineConfig: the engine's options, and the one place where the cache, scheduler and bucket
configurations are derived from them and the model's config (``Engine`` and
``echo_compile.compile`` both build their runner from it, runtime.model_runner.build_runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from custom_ops.backends.select import DEFAULT_BACKEND, check_backend
from custom_ops.cache.config import PREFETCH_MARGIN, CacheConfig, check_prefetch
from custom_ops.kv_format import pages_for
from model.config import ModelConfig
from runtime.request import PAGE
from runtime.scheduler_config import SchedulerConfig

# A compiled prefill has fixed shapes: its block table always spans max_model_len (see
# ModelRunner.prefill_inputs). The sparse prefill ops read only each query's causal prefix of it
# (the indexer skips token tiles past a query block's last position, the top-k reads each query's
# p + 1 scores, attention only the selected rows), so a compiled prefill costs what the prompt
# needs whatever the context limit: prefill is compiled by default for every max_model_len.


def default_decode_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, 48, 64, 80, ... up to max_batch (docs/compile.md, why it captures)."""
    out, b = [], 1
    while b < min(max_batch, 32):
        out.append(b)
        b *= 2
    b = 32
    while b < max_batch:
        out.append(b)
        b += 16
    out.append(max_batch)
    return tuple(sorted(set(out)))


def default_prefill_buckets(chunk: int) -> tuple[int, ...]:
    out, b = [], 16
    while b < chunk:
        out.append(b)
        b *= 2
    out.append(chunk)
    return tuple(out)


@dataclass(frozen=True)
class EngineConfig:
    """Engine options (the ``LLM(...)`` keyword arguments)."""

    max_batch: int = 8  # largest decode batch (the largest captured bucket)
    host_tokens: int = 16384  # host KV pool rows per layer
    gpu_tokens: int = 1024  # GPU pool rows per layer when offloading
    kv_format: str = "bf16"  # "bf16" | "fp8"
    offload: bool = True
    max_model_len: int = 4096
    prefill_chunk: int = 2048
    decode_buckets: tuple[int, ...] | None = None  # default: 1, 2, 4, ... max_batch
    device: str = "cpu"
    # compiled engines only: compile the prefill chunks too (one graph per chunk bucket).
    # None: yes, for every context limit (see prefill_compiled); False: eager prefill
    compile_prefill: bool | None = None
    # decode indexer kernels: "triton" | "deep_gemm" | "flashinfer" | "auto" (per half and batch
    # size by measured speed); a missing library falls back to Triton (docs/backends.md)
    kernel_backend: str = DEFAULT_BACKEND
    # lossless decode prefetch with offloading (docs/prefetch.md): "off" | "request" | "global"
    prefetch: str = "off"
    prefetch_cap: int = 64  # rows per request and layer ("request"); staging rows = max_batch x it
    prefetch_ratio: float = 1 / 512  # "global": budget rows per context token of the batch
    # the threshold's margin over the EMA of the k-th score, in EMAs of the k-th score's distance
    # from it (0: ECHO's threshold)
    prefetch_margin: float = PREFETCH_MARGIN
    # multi-process serving (docs/multi_gpu.md): dp data-parallel attention ranks (each with its
    # own requests and KV cache), the feed-forward blocks tensor-parallel over tp ranks
    dp: int = 1
    tp: int = 1
    # ep > 1: the routed experts split by expert over ep ranks instead (dense and shared TP)
    ep: int = 1
    # seconds a collective may wait for the other ranks before the engine stops with RankFailure
    collective_timeout_s: float = 300.0
    # the requests past their prefill decode a step between two prefill chunks, so a long prompt
    # does not stall them (False: prefill first; runtime/scheduler.py)
    decode_during_prefill: bool = True
    # launch the next decode step before reading the last one's tokens when the batch does not
    # depend on them, so the host's work between steps overlaps the device's (Engine.step; one
    # process only)
    async_scheduling: bool = False
    # keep the prompt being prefilled on the device (max_model_len rows a layer, in both modes so
    # both compile the same prefill graph); False: each chunk copies from the host pool only the
    # rows its queries select, under the indexer's scoring (docs/prefetch.md, "Prefill"), and
    # that memory is saved
    prefill_buffer: bool = True
    # keep sequences' full computed 64-token pages in the host pool for later prompts that start
    # with the same tokens, and skip their prefill (runtime/prefix_cache.py; each DP rank its own
    # cache, requests placed where their prompt is cached: runtime/distributed/balance.py). Off
    # for an engine built directly; LLM (and so serve and generate) turns it on unless told not
    # to, as vLLM does (--no-enable-prefix-caching)
    enable_prefix_caching: bool = False
    # compiled engines only: compile the decode step once for every bucket, its batch dim
    # symbolic (two Dynamo graphs, B = 1 and B >= 2, a CUDA graph captured per bucket), where
    # the default compiles each bucket on its own (docs/compile.md, "One compile for every
    # decode bucket?")
    dynamic_decode: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in (
            *("max_batch", "host_tokens", "gpu_tokens", "max_model_len", "prefill_chunk"),
            *("dp", "tp", "ep"),
        ):
            positive_int(name)
        if self.dp > 1 and self.tp > 1 and self.dp != self.tp:
            raise ValueError(
                f"dp={self.dp} and tp={self.tp}: with both above 1 they must be equal (every rank "
                "is one data-parallel attention rank and one tensor-parallel feed-forward rank; "
                "attention is not split over heads)"
            )
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"collective_timeout_s must be a positive number, got {t!r}")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(
                f"tp={self.tp} and ep={self.ep}: split the feed-forward one way, by tp or by ep"
            )
        if self.ep > 1 and self.dp > 1 and self.dp != self.ep:
            raise ValueError(f"dp={self.dp} and ep={self.ep}: with both above 1 they must be equal")
        if self.host_tokens % PAGE:
            raise ValueError(f"host_tokens must be a multiple of {PAGE}, got {self.host_tokens}")
        if self.prefill_chunk % 16:
            raise ValueError(f"prefill_chunk must be a multiple of 16, got {self.prefill_chunk}")
        if self.kv_format not in ("bf16", "fp8"):
            raise ValueError(f"kv_format must be 'bf16' or 'fp8', got {self.kv_format!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload must be True or False, got {self.offload!r}")
        if not isinstance(self.decode_during_prefill, bool):
            raise ValueError(
                f"decode_during_prefill must be True or False, got {self.decode_during_prefill!r}"
            )
        if not isinstance(self.prefill_buffer, bool):
            raise ValueError(f"prefill_buffer must be True or False, got {self.prefill_buffer!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )
        if not isinstance(self.dynamic_decode, bool):
            raise ValueError(f"dynamic_decode must be True or False, got {self.dynamic_decode!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True or False, got {self.async_scheduling!r}"
            )
        if self.async_scheduling and max(self.dp, self.tp, self.ep) > 1:
            raise ValueError(
                "async_scheduling needs dp = tp = ep = 1: the ranks agree on every step before "
                "it runs (runtime/distributed/step_sync.py), one step at a time"
            )
        check_prefetch(
            self.prefetch,
            self.prefetch_cap,
            self.prefetch_ratio,
            self.offload,
            self.prefetch_margin,
            self.host_tokens,
        )
        if self.compile_prefill not in (None, True, False):
            raise ValueError(
                f"compile_prefill must be True, False or None, got {self.compile_prefill!r}"
            )
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        check_backend(self.kernel_backend)
        b = self.decode_buckets
        if b is not None and (
            not isinstance(b, (tuple, list))
            or not b
            or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in b)
        ):
            raise ValueError(f"decode_buckets must be a list of positive integers, got {b!r}")
        self.buckets  # noqa: B018 (checks their order against max_batch)

    @property
    def world_size(self) -> int:
        """Processes (GPUs) the configuration runs on."""
        return max(self.dp, self.tp, self.ep)

    @property
    def ffn_ranks(self) -> int:
        """Ranks the feed-forward blocks are split over (by tp or by ep)."""
        return max(self.tp, self.ep)

    @property
    def buckets(self) -> tuple[int, ...]:
        b = self.decode_buckets or default_decode_buckets(self.max_batch)
        if b[-1] != self.max_batch or list(b) != sorted(set(b)):
            raise ValueError(
                f"decode_buckets must be increasing and end at max_batch ({self.max_batch}), "
                f"got {b}"
            )
        return tuple(b)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return default_prefill_buckets(self.prefill_chunk)

    def model_len(self, model_config: ModelConfig) -> int:
        """The context limit a request gets: a request reserves its pages at admission, so it can
        never be longer than the host pool, nor than the model's positions."""
        return min(self.max_model_len, model_config.max_position_embeddings, self.host_tokens)

    def prefill_compiled(self, model_config: ModelConfig) -> bool:
        """The one prefill-compile policy of a compiled engine (``LLM``, ``echo_compile.compile``,
        the bench): ``compile_prefill`` when set, else compiled, for any ``max_model_len``."""
        if self.compile_prefill is not None:
            return self.compile_prefill
        return True

    def cache_config(self, model_config: ModelConfig) -> CacheConfig:
        max_len = self.model_len(model_config)
        return CacheConfig(
            num_layers=model_config.num_hidden_layers,
            host_tokens=self.host_tokens,
            gpu_tokens=self.gpu_tokens,
            topk=model_config.index_topk,
            fmt=self.kv_format,
            offload=self.offload,
            max_batch=self.max_batch,
            # the prefill buffer in BOTH modes, so that offloading and GPU-only compile the same
            # prefill graph (CacheConfig.prefill_tokens); whole pages, as the block table reads
            prefill_tokens=pages_for(max_len) * PAGE if self.prefill_buffer else 0,
            kernel_backend=self.kernel_backend,
            index_heads=model_config.index_n_heads,
            prefetch=self.prefetch,
            prefetch_cap=self.prefetch_cap,
            prefetch_ratio=float(self.prefetch_ratio),
            prefetch_margin=float(self.prefetch_margin),
        )

    def scheduler_config(self, model_config: ModelConfig) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch=self.max_batch,
            max_model_len=self.model_len(model_config),
            host_tokens=self.host_tokens,
            topk=model_config.index_topk,
            gpu_tokens=self.gpu_tokens if self.offload else None,
            prefill_chunk=self.prefill_chunk,
            decode_during_prefill=self.decode_during_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
        )
