"""One ``engine.metrics()`` snapshot for a data-parallel deployment from every DP rank's own.

Each DP rank owns its requests and its KV pools, so no rank's snapshot stands for the whole:
counters and counts add up, fractions of equal-sized pools average, a mean is weighted by the
count behind it, and a rate is recomputed from the summed totals (the GPU-pool hit rate per
layer is ``1 - sum(recalled) / sum(selected)``, not a mean of the ranks' rates). Every key of
``Engine.metrics()`` has its rule here; a key without one is an error, not a silent rank 0.
"""

from __future__ import annotations

from typing import Any

# added over the ranks (per layer for the lists)
SUM = frozenset({
    "running", "waiting", "generated_tokens", "tokens_per_s", "recalled_rows_per_step",
    "recall_overflow", "decode_host_gaps", "decode_steps", "decode_gpu_idle_gaps",
    "discarded_rows", "prefix_cache_pages", "prefix_cache_queries", "prefix_cache_hits",
    "prefill_host_rows", "gpu_pool_selected", "gpu_pool_recalled", "prefetched_per_step",
})  # fmt: skip
# averaged over the ranks: fractions of pools every rank sizes alike (check_same_options), and
# prefetch shares whose counts the snapshot does not carry
MEAN = frozenset({"host_pool_usage", "gpu_pool_usage", "prefetch_precision", "prefetch_coverage"})
# a mean or share -> the count it is over (a rank that did none of it weighs nothing)
WEIGHTED = {
    "decode_host_gap_ms": "decode_host_gaps",
    "decode_ahead_fraction": "decode_steps",
    "decode_gpu_idle_ms": "decode_gpu_idle_gaps",
    "prefill_copy_overlap": "prefill_host_rows",
}
# recomputed from the summed totals, as Engine.metrics() computes them
DERIVED = frozenset({"hit_rate", "prefix_cache_hit_rate"})


def _add(values: list) -> Any:
    if isinstance(values[0], list):
        return [float(sum(col)) for col in zip(*values, strict=True)]
    return float(sum(values))


def _scale(total: Any, by: float) -> Any:
    return [v * by for v in total] if isinstance(total, list) else total * by


def aggregate(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The deployment's snapshot from the DP ranks' ``Engine.metrics()`` (in DP rank order),
    with those under ``"engines"`` (the server labels them ``engine="<dp rank>"``, as vLLM does
    its data-parallel engines). Raises ``ValueError`` naming a key without a rule."""
    if not snapshots:
        raise ValueError("no engine snapshots to aggregate")
    out: dict[str, Any] = {}
    for key in snapshots[0]:
        values = [s[key] for s in snapshots]
        if key in SUM:
            out[key] = _add(values)
        elif key in MEAN:
            out[key] = _scale(_add(values), 1 / len(values))
        elif key in WEIGHTED:
            weights = [s[WEIGHTED[key]] for s in snapshots]
            w = sum(weights)
            out[key] = sum(v * x for v, x in zip(values, weights, strict=True)) / w if w else 0.0
        elif key not in DERIVED:
            raise ValueError(f"engine metric {key!r} has no rule to combine the DP ranks' values")
    sel, rec = out.get("gpu_pool_selected"), out.get("gpu_pool_recalled")
    if "hit_rate" in snapshots[0] and sel is not None and rec is not None:
        # 1.0 for a layer no rank looked up yet, as one engine says
        out["hit_rate"] = [1.0 - r / s if s else 1.0 for s, r in zip(sel, rec, strict=True)]
    if "prefix_cache_hit_rate" in snapshots[0]:
        q = out.get("prefix_cache_queries", 0.0)
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0.0) / q if q else 0.0
    out["engines"] = list(snapshots)
    return out
