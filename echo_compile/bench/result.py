"""What a run of ``echo-compile bench`` records: one system's result on one workload
(``SystemResult``, with its latency percentiles and the decode indexer's plans by batch size),
the environment it ran in, and the JSON-safe form the results file is written in."""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass, field

import torch

from custom_ops.backends.select import plan_runs


@dataclass
class SystemResult:
    system: str
    gpu_pool_tokens: int
    mode: str
    rate: float
    requests: int
    throughput_tok_s: float
    effective_batch: float
    max_batch: int
    decode_steps: int
    generated_tokens: int
    wall_s: float
    inject_s: float
    serve_s: float  # wall - inject: the time the throughput divides by
    steps_s: float  # of which in engine steps (decode, and prefill in full mode)
    add_s: float  # and in taking requests in (engine.add_request: checks, queueing)
    step_ms_median: float
    step_ms: dict[str, float] = field(default_factory=dict)  # percentiles, mean and max
    ttft_s: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    hit_rate: list[float] = field(default_factory=list)
    recalled_rows_per_step: float = 0.0
    # mean host time a decode step from the last step's tokens to its call (engine.metrics():
    # the GPU idles at least that long)
    decode_host_gap_ms: float = 0.0
    # asynchronous scheduling: whether on, the share of decode steps launched one token ahead
    # (no host gap: not in the mean above) and the rows of finished requests they computed
    async_scheduling: bool = False
    decode_ahead_fraction: float = 0.0
    discarded_rows: int = 0
    # (CUDA) the GPU's mean idle time between back-to-back decode steps, as it timed it with
    # events, over decode_gpu_idle_gaps gaps (0 gaps: not measured, a CPU run)
    decode_gpu_idle_ms: float = 0.0
    decode_gpu_idle_gaps: int = 0
    warmup_s: float = 0.0
    # the GPU pool rows each decoding request has per layer (N_G / effective batch): the hit rate
    # means something only next to it (docs/prefetch.md, "Locality")
    pool_rows_per_request: float = 0.0
    prefetch: str = "off"
    # the staging limits of a prefetching run (0 without prefetch): rows per request and layer
    # (the staging buffer is max_batch x it) and the global mode's rows per context token
    prefetch_cap: int = 0
    prefetch_ratio: float = 0.0
    prefetched_per_step: list[float] = field(default_factory=list)
    prefetch_precision: list[float] = field(default_factory=list)
    prefetch_coverage: list[float] = field(default_factory=list)
    # who computed the decode indexer, by batch sizes (kernel_backend as resolved: a missing
    # library, a CPU or a head count DeepGEMM refuses gives triton): {"1-16": "deep_gemm/triton"}
    indexer_plans: dict[str, str] = field(default_factory=dict)
    # the model's weights (--weights): bf16, or served as an AWQ / FP8 checkpoint of them, and
    # the bytes of its parameters on the device
    weights: str = "bf16"
    weight_bytes: int = 0


def plan_labels(plans) -> dict[str, str]:
    """``LayerKV.plans`` (one per batch size 1..N) as runs of equal plans (``plan_runs``), each
    labelled by its sizes: {"1-63": "deep_gemm/triton", "64": "deep_gemm/flashinfer"}."""
    runs = plan_runs(plans)
    ends = [first - 1 for first, _ in runs[1:]] + [len(plans)]
    return {
        (f"{first}-{end}" if end > first else str(first)): f"{p.scores}/{p.topk}"
        for (first, p), end in zip(runs, ends)
    }


def json_safe(x):
    """``x`` with every non-finite float as a string ("inf": a rate of all requests at once), so
    the file is JSON every parser reads (``float()`` reads the strings back)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def percentiles(xs: list[float], scale: float = 1.0) -> dict[str, float]:
    """p50 / p90 / p99 and the mean of ``xs`` times ``scale`` (an empty dict for no samples)."""
    if not xs:
        return {}
    t = torch.tensor(xs, dtype=torch.float64) * scale
    return {f"p{q}": float(torch.quantile(t, q / 100)) for q in (50, 90, 99)} | {
        "mean": float(t.mean())
    }


def environment() -> dict:
    """The date, the library versions and the device a results file records."""
    import triton

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = "cpu"
    return env
