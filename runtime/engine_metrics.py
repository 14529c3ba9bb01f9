"""``Engine.metrics``: a snapshot of an engine's step and token counters, its decode gaps, its
pools' and prefix cache's totals (the server's /metrics, the benchmarks; a DP deployment combines
its ranks' in ``runtime.distributed.metrics``). It changes nothing."""

from __future__ import annotations

from collections import deque

from runtime.scheduler import Scheduler


def engine_metrics(
    scheduler: Scheduler,
    pool: dict,
    recent: deque[tuple[float, int]],
    *,
    generated_tokens: int,
    host_gap_s: float,
    host_gaps: int,
    decode_steps: int,
    decode_steps_ahead: int,
    gpu_idle_ms: float,
    gpu_idle_gaps: int,
    discarded_rows: int,
) -> dict[str, float | list[float]]:
    """Observability counters of an engine: its ``scheduler``, its cache's ``pool`` totals
    (``stats()``: syncs with the device), ``recent`` (time, tokens) of its last decode steps,
    for the token rate, and its counters (``Engine.__init__`` says what each counts)."""
    if len(recent) >= 2:
        dt = recent[-1][0] - recent[0][0]
        tps = sum(n for _, n in list(recent)[1:]) / dt if dt > 0 else 0.0
    else:
        tps = 0.0
    alloc, prefix = scheduler.pages, scheduler.prefix
    return {
        "running": float(scheduler.num_rows),
        "waiting": float(scheduler.num_waiting),  # a queued group: its n sequences
        "generated_tokens": float(generated_tokens),
        "tokens_per_s": tps,
        "host_pool_usage": scheduler.pages_in_use / alloc.num_pages,
        "gpu_pool_usage": pool["gpu_pool_usage"],
        "hit_rate": pool["hit_rate"],  # 1.0 for a layer with no lookup yet
        # per layer, the totals behind it (counters: a scraper derives rates from them)
        "gpu_pool_selected": pool["selected_per_layer"],
        "gpu_pool_recalled": pool["recalled_per_layer"],
        "recalled_rows_per_step": pool["recalled_rows_per_step"],
        "recall_overflow": float(pool["overflow"]),
        # mean host time from a decode step's tokens to the next decode step's call (GPU idle)
        "decode_host_gap_ms": 1e3 * host_gap_s / max(host_gaps, 1),
        # the counts behind that mean and the share below (a DP deployment weighs its ranks)
        "decode_host_gaps": float(host_gaps),
        "decode_steps": float(decode_steps),
        # asynchronous scheduling: the share of decode steps launched one token ahead (no
        # host gap: their gap is not in the mean above), and the rows of finished requests
        # they computed for nothing
        "decode_ahead_fraction": decode_steps_ahead / max(decode_steps, 1),
        # (CUDA) the device's mean idle time between back-to-back decode steps, as the GPU
        # timed it, and how many such gaps it averages (0 on a CPU)
        "decode_gpu_idle_ms": gpu_idle_ms / max(gpu_idle_gaps, 1),
        "decode_gpu_idle_gaps": float(gpu_idle_gaps),
        "discarded_rows": float(discarded_rows),
        # prefetch, per layer (empty lists when off; docs/prefetch.md)
        "prefetched_per_step": pool["prefetched_per_step"],
        "prefetch_precision": pool["prefetch_precision"],
        "prefetch_coverage": pool["prefetch_coverage"],
        # prefix caching: the share of looked-up prompt tokens found cached, and the host
        # pages the cache holds (EngineConfig.enable_prefix_caching; 0 when off)
        "prefix_cache_hit_rate": prefix.hits / prefix.queries if prefix and prefix.queries else 0.0,
        "prefix_cache_pages": float(prefix.num_pages if prefix else 0),
        # the totals behind that share: prompt tokens looked up, and found (vLLM's counters)
        "prefix_cache_queries": float(prefix.queries if prefix else 0),
        "prefix_cache_hits": float(prefix.hits if prefix else 0),
        # prefill without the device buffer (EngineConfig.prefill_buffer=False)
        "prefill_host_rows": pool["prefill_host_rows"],
        "prefill_copy_overlap": pool["prefill_copy_overlap"],
    }
