"""The metrics of a data-parallel deployment cover every rank (runtime/distributed/metrics.py):
counters summed, rates recomputed from the summed totals, pool fractions averaged; the server
labels the engine-side vLLM series per DP rank (``engine``, as vLLM does) and keeps one GPU's
output as it was but for ``engine="0"``. The gloo test drives two DP ranks as ``serve --dp 2``
does and checks the driver's snapshot against the ranks' own engines."""

from __future__ import annotations

import prometheus_client as prom
import pytest
import torch
from distributed_workers import metrics_worker
from driver_workers import metrics_error_worker, reset_stats_worker
from engine_records import random_prompts

from runtime.distributed.metrics import DERIVED, MEAN, SUM, WEIGHTED, aggregate
from runtime.distributed.process import spawn
from runtime.server_metrics import ServerMetrics


def scrape(met: ServerMetrics) -> dict[str, float]:
    text = prom.generate_latest(met.registry).decode()
    return _parse(text)


def _parse(text: str) -> dict[str, float]:
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {k: float(v) for k, v in pairs}


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


def test_server_labels_engine_series_per_dp_rank_and_sums_the_rest():
    a = _snap()
    b = _snap(running=2.0, gpu_pool_selected=[0.0, 24.0], gpu_pool_recalled=[0.0, 3.0],
              prefix_cache_queries=2.0, prefix_cache_hits=0.0)  # fmt: skip
    met = ServerMetrics("tiny", 512)
    met.update(aggregate([a, b]), 0)
    lines = scrape(met)
    assert lines['vllm:num_requests_running{engine="0",model_name="tiny"}'] == 1.0
    assert lines['vllm:num_requests_running{engine="1",model_name="tiny"}'] == 2.0
    assert lines['vllm:prefix_cache_queries_total{engine="1",model_name="tiny"}'] == 2.0
    assert lines["echo_running_requests"] == 3.0
    assert lines['echo_gpu_pool_selected_total{layer="1"}'] == 32.0
    assert lines['echo_gpu_pool_hit_rate{layer="1"}'] == 1.0 - 7.0 / 32.0
    # rank 1 alone resets (reset_stats on its engine) then does 6 more: only its part restarts
    b2 = dict(b, gpu_pool_selected=[0.0, 6.0], gpu_pool_recalled=[0.0, 1.0])
    met.update(aggregate([a, b2]), 0)
    assert scrape(met)['echo_gpu_pool_selected_total{layer="1"}'] == 38.0  # (not 32 + 14)
    # one GPU: the same series, vLLM's engine="0" on the engine-side vllm:* ones
    one = ServerMetrics("tiny", 512)
    one.update(a, 0)
    lines = scrape(one)
    assert lines['vllm:num_requests_running{engine="0",model_name="tiny"}'] == 1.0
    assert lines["echo_running_requests"] == 1.0
    assert not any('engine="1"' in k for k in lines)


def test_driver_metrics_cover_every_dp_rank(tmp_path):
    """Two DP ranks, four requests: the driver's snapshot (what /metrics reads) is the sum of
    the two engines' own, each rank's own under "engines"; it was rank 0's alone."""
    opts = dict(dp=2, max_batch=4, host_tokens=64 * 16, max_model_len=256, prefill_chunk=64,
                gpu_tokens=128)  # fmt: skip
    spawn(metrics_worker, 2, str(tmp_path), opts, random_prompts([40, 90, 60, 120], 512, 5), 60.0)
    r0, r1 = (torch.load(tmp_path / f"metrics_rank{r}.pt") for r in range(2))
    assert set(r0["owner"].values()) == {0, 1}  # both ranks served requests
    got, own = r0["driver"], [r0["own"], r1["own"]]
    assert got["engines"] == own
    assert all(o["generated_tokens"] > 0 for o in own)
    assert got["generated_tokens"] == own[0]["generated_tokens"] + own[1]["generated_tokens"]
    for key in ("gpu_pool_selected", "gpu_pool_recalled"):
        assert got[key] == [x + y for x, y in zip(own[0][key], own[1][key], strict=True)]
    sel, rec = got["gpu_pool_selected"], got["gpu_pool_recalled"]
    assert got["hit_rate"] == [1.0 - r / s if s else 1.0 for s, r in zip(sel, rec, strict=True)]
    lines = _parse(r0["scrape"])
    assert lines['echo_gpu_pool_selected_total{layer="0"}'] == sel[0]
    assert 'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"}' in lines


def test_a_failed_metrics_read_does_not_stop_the_followers(tmp_path):
    spawn(metrics_error_worker, 2, str(tmp_path))
    assert (tmp_path / "rank1.txt").read_text() == "2 ['metrics', 'step']"


def test_driver_reset_stats_resets_every_rank(tmp_path):
    """/metrics sums every rank's counters: a reset through the driver reaches every rank (it
    reached rank 0's engine alone)."""
    spawn(reset_stats_worker, 2, str(tmp_path))
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text() == "['reset_stats', 'step']"
