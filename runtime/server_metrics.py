"""The server's Prometheus metrics, in a registry of their own (several apps can live in a process).

Two families (docs/server.md has the table):
- ``echo_*``: engine gauges (pools, hit rate per layer, recall), per-layer counters of GPU-pool
  lookups and misses (a scraper derives hit rates over any window from them), and the original
  request metrics, unlabelled as they always were;
- ``vllm:*``: the names a vLLM dashboard reads, labelled ``model_name``: running / waiting, prompt
  and generation token counters, per-request prompt / generation token histograms, prefix-cache
  queries and hits (tokens), TTFT / inter-token / end-to-end histograms, finished requests by
  ``finished_reason``, KV-cache usage.

Data parallel (``serve --dp N``): the snapshot is the deployment's (``runtime.distributed.
metrics.aggregate``: the ``echo_*`` series are over all ranks, unlabelled as on one GPU) with
each DP rank's own under ``"engines"``. The engine-side ``vllm:*`` series (running, waiting,
KV-cache usage, prefix-cache counters) carry vLLM's ``engine`` label, one series per DP rank,
``engine="0"`` on one GPU as vLLM labels its single engine; a dashboard sums over it. The request
metrics are the front end's own, over every engine, without it.
Plus the process metrics of ``prometheus_client`` (``process_*``, ``python_*``).
"""

from __future__ import annotations

from typing import Any

import prometheus_client as prom

from runtime.outputs import RequestOutput

INF = float("inf")
# echo_request_latency_seconds: its first bounds as they always were, then vLLM's top ones, so a
# long generation (a 128K context's prefill alone can pass 300 s) lands in a finite bucket
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 480, 960, 1920, 7680, INF)
# vLLM's own bounds (vllm/v1/metrics/loggers.py), so a vLLM dashboard's quantiles read the same
VLLM_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0, INF,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, INF,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, INF,
)  # fmt: skip


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's bounds for per-request token counts (its ``build_1_2_5_buckets``): 1, 2, 5, 10,
    20, 50, ... up to ``max_model_len``, no count can pass (+Inf is added by the histogram)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    GAUGES = {  # engine.metrics() key -> (metric name, help)
        "running": ("echo_running_requests", "Requests admitted: prefilling or decoding"),
        "waiting": ("echo_waiting_requests", "Requests waiting for admission"),
        "tokens_per_s": ("echo_tokens_per_second", "Generation throughput over the last window"),
        "host_pool_usage": ("echo_host_pool_usage", "Fraction of the host KV pool requests hold"),
        "gpu_pool_usage": ("echo_gpu_pool_usage", "Fraction of the GPU KV pools in use"),
        "recalled_rows_per_step": ("echo_recalled_rows_per_step", "KV rows recalled per step"),
        "decode_host_gap_ms": (
            "echo_decode_host_gap_ms",
            "Mean host time from a decode step's tokens to the next decode step's call",
        ),
        "decode_gpu_idle_ms": (
            "echo_decode_gpu_idle_ms",
            "Mean GPU idle time between back-to-back decode steps, as the GPU timed it",
        ),
        "decode_ahead_fraction": (
            "echo_decode_ahead_fraction",
            "Share of decode steps launched before the last step's tokens were read",
        ),
        "prefix_cache_hit_rate": (
            "echo_prefix_cache_hit_rate",
            "Share of looked-up prompt tokens found in the prefix cache",
        ),
        "prefix_cache_pages": ("echo_prefix_cache_pages", "Host KV pages the prefix cache holds"),
        "prefill_host_rows": (
            "echo_prefill_host_rows",
            "KV rows prefill copied from the host pool, over all layers (no prefill buffer)",
        ),
        "prefill_copy_overlap": (
            "echo_prefill_copy_overlap",
            "Share of those rows copied while a later query block was being scored",
        ),
    }
    VLLM_GAUGES = {  # engine.metrics() key -> vLLM name
        "running": ("vllm:num_requests_running", "Requests admitted: prefilling or decoding"),
        "waiting": ("vllm:num_requests_waiting", "Requests waiting for admission"),
        "host_pool_usage": ("vllm:kv_cache_usage_perc", "Fraction of the KV cache requests hold"),
    }

    def __init__(self, model_name: str, max_model_len: int) -> None:
        """``max_model_len``: the context limit, the top bound of the token histograms."""
        r = self.registry = prom.CollectorRegistry()
        self.model_name = model_name
        prom.ProcessCollector(registry=r)
        prom.PlatformCollector(registry=r)
        prom.GCCollector(registry=r)
        self.gauges = {k: prom.Gauge(n, h, registry=r) for k, (n, h) in self.GAUGES.items()}
        self.hit_rate = prom.Gauge(
            "echo_gpu_pool_hit_rate",
            "GPU pool hit rate (1 - recalled / selected); no series before a layer's first lookup",
            ["layer"],
            registry=r,
        )
        self.layer_counters = {  # engine.metrics() key -> per-layer counter (rates: the scraper's)
            "gpu_pool_selected": prom.Counter(
                "echo_gpu_pool_selected",
                "KV entries decode selected (GPU pool lookups), per layer",
                ["layer"],
                registry=r,
            ),
            "gpu_pool_recalled": prom.Counter(
                "echo_gpu_pool_recalled",
                "Selected KV entries not in the GPU pool, recalled from host (misses), per layer",
                ["layer"],
                registry=r,
            ),
        }
        self.tokens = prom.Counter("echo_generation_tokens", "Generated tokens", registry=r)
        self.prefetch = {  # per-layer prefetch metrics (docs/prefetch.md)
            k: prom.Gauge(f"echo_{k}", h, ["layer"], registry=r)
            for k, h in (("prefetched_per_step", "KV rows staged by prefetch per step"),
                         ("prefetch_precision", "Staged rows then selected / staged"),
                         ("prefetch_coverage", "Misses served from staging / misses"))
        }  # fmt: skip
        self.latency = prom.Histogram(
            "echo_request_latency_seconds",
            "End-to-end request latency",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        labels = ["model_name"]
        per_engine = ["model_name", "engine"]  # vLLM's labels for what each DP engine reports
        self.v_gauges = {
            k: prom.Gauge(n, h, per_engine, registry=r) for k, (n, h) in self.VLLM_GAUGES.items()
        }
        self.v_prompt = prom.Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=r)
        self.v_generation = prom.Counter(
            "vllm:generation_tokens", "Generated tokens", labels, registry=r
        )
        tokens = token_buckets(max_model_len)
        self.v_prompt_hist = prom.Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per finished request",
            labels,
            registry=r,
            buckets=tokens,
        )
        self.v_generation_hist = prom.Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request",
            labels,
            registry=r,
            buckets=tokens,
        )
        self.v_ttft = prom.Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to the first token",
            labels,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.v_itl = prom.Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two output tokens",
            labels,
            registry=r,
            buckets=ITL_BUCKETS,
        )
        self.v_e2e = prom.Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            registry=r,
            buckets=VLLM_E2E_BUCKETS,
        )
        self.v_finished = prom.Counter(
            "vllm:request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.v_prefix = {  # engine.metrics() key -> vLLM counter (tokens, as vLLM counts them)
            "prefix_cache_queries": prom.Counter(
                "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                per_engine, registry=r,
            ),
            "prefix_cache_hits": prom.Counter(
                "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", per_engine,
                registry=r,
            ),
        }  # fmt: skip
        self._tokens_seen = 0
        self._rate_layers: set[int] = set()  # the layers with a hit-rate series
        # (counter key, layer, DP engine) -> that engine's total last seen
        self._seen: dict[tuple[str, str, int], float] = {}

    def update(self, snapshot: dict[str, Any], tokens_total: int) -> None:
        """Engine gauges from ``engine.metrics()`` (a DP deployment's: its ranks' own under
        ``"engines"``), the generation counter from the total."""
        engines = snapshot.get("engines") or [snapshot]  # one GPU: itself, engine "0"
        for key, gauge in self.gauges.items():
            if isinstance(snapshot.get(key), (int, float)):
                gauge.set(snapshot[key])
        for i, eng in enumerate(engines):
            for key, gauge in self.v_gauges.items():
                if isinstance(eng.get(key), (int, float)):
                    gauge.labels(self.model_name, str(i)).set(eng[key])
        selected = snapshot.get("gpu_pool_selected")
        for layer, rate in enumerate(snapshot.get("hit_rate") or []):
            if selected is not None and layer < len(selected) and not selected[layer]:
                # no lookup yet (or since engine.reset_stats()): a hit rate is undefined (the
                # engine says 1.0), so the layer has no series
                if layer in self._rate_layers:
                    self.hit_rate.remove(str(layer))
                    self._rate_layers.discard(layer)
                continue
            self.hit_rate.labels(layer=str(layer)).set(rate)
            self._rate_layers.add(layer)
        # counters advance by each engine's own growth: one rank's reset_stats() then restarts
        # its part alone (its total summed with the others' would look like a fall of all)
        for i, eng in enumerate(engines):
            for key, counter in self.layer_counters.items():
                for layer, total in enumerate(eng.get(key) or []):
                    self._advance(counter.labels(layer=str(layer)), (key, str(layer), i), total)
            for key, counter in self.v_prefix.items():
                if isinstance(eng.get(key), (int, float)):
                    self._advance(counter.labels(self.model_name, str(i)), (key, "", i), eng[key])
        for key, gauge in self.prefetch.items():
            for layer, v in enumerate(snapshot.get(key) or []):
                gauge.labels(layer=str(layer)).set(v)
        new = max(tokens_total - self._tokens_seen, 0)
        self.tokens.inc(new)
        self.v_generation.labels(self.model_name).inc(new)
        self._tokens_seen = max(tokens_total, self._tokens_seen)

    def _advance(self, counter: Any, key: tuple[str, str, int], total: float) -> None:
        """Move a counter to the engine's running ``total``. A total below the last one seen was
        reset (``engine.reset_stats()``): count it from 0 again, as Prometheus reads a reset."""
        seen = self._seen.get(key, 0.0)
        counter.inc(total - seen if total >= seen else total)
        self._seen[key] = total

    def observe(self, res: RequestOutput, t0: float, t_end: float, times: list[float]) -> None:
        """One finished request: ``t0`` when it arrived, ``t_end`` when its answer was done,
        ``times`` when each output with new tokens reached the server (perf_counter)."""
        m = self.model_name
        self.latency.observe(t_end - t0)
        self.v_e2e.labels(m).observe(t_end - t0)
        self.v_prompt.labels(m).inc(res.prompt_tokens)
        self.v_prompt_hist.labels(m).observe(res.prompt_tokens)
        self.v_generation_hist.labels(m).observe(res.completion_tokens)
        self.v_finished.labels(m, str(res.finish_reason)).inc()
        if times:
            self.v_ttft.labels(m).observe(times[0] - t0)
        for a, b in zip(times, times[1:], strict=False):
            self.v_itl.labels(m).observe(b - a)
