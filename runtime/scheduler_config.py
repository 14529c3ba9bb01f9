"""SchedulerConfig: the scheduler's limits and policy switches, checked where they are made.

The largest decode bucket, the context limit, the host and per-layer GPU pool sizes, the prefill
chunk, and whether decode steps take turns with prefill chunks and full pages go to the prefix
cache; ``max_running``, the decode rows the GPU pools serve at once. ``EngineConfig`` derives it
(``EngineConfig.scheduler_config``); ``runtime.scheduler.Scheduler`` runs by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from custom_ops.cache.config import max_decode_rows


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int  # the largest decode bucket
    max_model_len: int  # longest prompt + output a request may have
    host_tokens: int  # host KV pool rows (a multiple of PAGE)
    topk: int  # index_topk: rows a request selects per layer per step
    gpu_tokens: int | None = None  # per-layer GPU pool rows when offloading; None = GPU-only
    prefill_chunk: int = 2048
    # a decode step of the requests past their prefill between two prefill chunks (False: every
    # pending prefill chunk first)
    decode_during_prefill: bool = True
    # keep sequences' full computed pages for later prompts that start with them
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.max_batch <= 0 or self.prefill_chunk <= 0 or self.max_model_len <= 0:
            raise ValueError(
                "SchedulerConfig: max_batch, prefill_chunk and max_model_len must be positive"
            )
        if self.gpu_tokens is not None and self.gpu_tokens < self.topk:
            raise ValueError(
                f"GPU pool of {self.gpu_tokens} tokens per layer cannot hold one selection "
                f"of {self.topk}"
            )

    @property
    def max_running(self) -> int:
        """Decode rows the GPU pools can serve at once (B x topk <= N_G)."""
        return max_decode_rows(self.max_batch, self.topk, self.gpu_tokens)
