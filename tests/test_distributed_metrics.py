"""The metrics of a data-parallel deployment cover every rank (runtime/distributed/metrics.py):
counters summed, rates recomputed from the summed totals, pool fractions averaged."""

from __future__ import annotations

import pytest

from runtime.distributed.metrics import DERIVED, MEAN, SUM, WEIGHTED, aggregate


def _snap(**kw) -> dict:
    base = {
        "running": 1.0, "waiting": 0.0, "generated_tokens": 10.0, "host_pool_usage": 0.5,
        "hit_rate": [1.0, 0.5], "gpu_pool_selected": [0.0, 8.0], "gpu_pool_recalled": [0.0, 4.0],
        "decode_host_gap_ms": 2.0, "decode_host_gaps": 3.0, "prefix_cache_hit_rate": 0.5,
        "prefix_cache_queries": 8.0, "prefix_cache_hits": 4.0,
    }  # fmt: skip
    return {**base, **kw}


def test_aggregate_sums_counters_and_recomputes_rates_from_the_totals():
    a = _snap()
    b = _snap(running=2.0, waiting=3.0, generated_tokens=5.0, host_pool_usage=0.25,
              hit_rate=[1.0, 0.875], gpu_pool_selected=[0.0, 24.0], gpu_pool_recalled=[0.0, 3.0],
              decode_host_gap_ms=0.0, decode_host_gaps=0.0, prefix_cache_hit_rate=0.0,
              prefix_cache_queries=2.0, prefix_cache_hits=0.0)  # fmt: skip
    m = aggregate([a, b])
    assert (m["running"], m["waiting"], m["generated_tokens"]) == (3.0, 3.0, 15.0)
    assert m["gpu_pool_selected"] == [0.0, 32.0] and m["gpu_pool_recalled"] == [0.0, 7.0]
    # over all lookups (1 - 7/32), not the mean of the ranks' rates (0.6875); 1.0 untouched
    assert m["hit_rate"] == [1.0, 1.0 - 7.0 / 32.0]
    assert m["host_pool_usage"] == 0.375  # equal pools: the mean
    assert m["decode_host_gap_ms"] == 2.0  # a rank with no gap weighs nothing (not 1.0)
    assert m["prefix_cache_hit_rate"] == 4.0 / 10.0
    assert m["engines"] == [a, b]
    with pytest.raises(ValueError, match="'new_metric' has no rule"):
        aggregate([_snap(new_metric=1.0)])


def test_every_engine_metric_has_one_rule():
    from test_engines import make

    from model.checkpoint import resolve_model
    from model.loader import load_model

    keys = set(make(load_model(resolve_model("tiny"))[0], compiled=False).metrics())
    rules = [SUM, MEAN, set(WEIGHTED), DERIVED]
    assert keys == set().union(*rules)  # no rule for a key the engine lacks
    assert sum(len(r) for r in rules) == len(keys)  # and none with two
    assert set(WEIGHTED.values()) <= SUM
