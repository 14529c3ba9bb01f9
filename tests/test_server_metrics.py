"""The server's Prometheus metrics from engine snapshots: no hit rate before a lookup, and the
counters a scraper derives rates from (GPU-pool lookups and misses per layer, vLLM's prefix-cache
queries and hits)."""

from __future__ import annotations

import prometheus_client as prom
from test_engines import PROMPTS, make

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.server_metrics import ServerMetrics


def scrape(met: ServerMetrics) -> dict[str, float]:
    text = prom.generate_latest(met.registry).decode()
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {k: float(v) for k, v in pairs}


def test_no_hit_rate_before_a_lookup_and_counters_follow_the_engine_totals():
    met = ServerMetrics("tiny", 512)
    snap = {"hit_rate": [1.0, 0.75], "gpu_pool_selected": [0.0, 8.0],
            "gpu_pool_recalled": [0.0, 2.0], "prefix_cache_queries": 64.0,
            "prefix_cache_hits": 32.0}  # fmt: skip
    met.update(snap, 0)
    lines = scrape(met)
    assert 'echo_gpu_pool_hit_rate{layer="0"}' not in lines  # no lookup: undefined, not 1.0
    assert lines['echo_gpu_pool_hit_rate{layer="1"}'] == 0.75
    assert lines['echo_gpu_pool_selected_total{layer="1"}'] == 8.0
    assert lines['echo_gpu_pool_recalled_total{layer="1"}'] == 2.0
    assert lines['echo_gpu_pool_selected_total{layer="0"}'] == 0.0
    assert lines['vllm:prefix_cache_queries_total{engine="0",model_name="tiny"}'] == 64.0
    assert lines['vllm:prefix_cache_hits_total{engine="0",model_name="tiny"}'] == 32.0
    met.update({**snap, "gpu_pool_selected": [4.0, 12.0]}, 0)  # totals grow: the counters too
    lines = scrape(met)
    assert lines['echo_gpu_pool_selected_total{layer="1"}'] == 12.0
    assert lines['echo_gpu_pool_selected_total{layer="0"}'] == 4.0
    met.update({**snap, "gpu_pool_selected": [4.0, 3.0]}, 0)  # reset_stats, then 3 more
    assert scrape(met)['echo_gpu_pool_selected_total{layer="1"}'] == 15.0
    met.update({**snap, "gpu_pool_selected": [0.0, 0.0]}, 0)  # reset_stats, nothing since
    lines = scrape(met)
    assert not any(k.startswith("echo_gpu_pool_hit_rate{") for k in lines)  # not the old rates


def test_long_latencies_land_in_finite_buckets():
    """A TTFT past 60 s (a 128K-context prefill) and a request past 300 s (a long generation)
    each land in a finite bucket of their histograms, not in +Inf alone: vLLM's bounds go up to
    2560 s (TTFT) and 7680 s (end to end)."""
    met = ServerMetrics("tiny", 512)
    met.observe(RequestOutput(prompt_tokens=3, finish_reason="stop"), 0.0, 5000.0, [2000.0, 2001])
    lines = scrape(met)
    for name, le in (
        ("vllm:time_to_first_token_seconds", "2560.0"),
        ("vllm:e2e_request_latency_seconds", "7680.0"),
        ("echo_request_latency_seconds", "7680.0"),
    ):
        buckets = {k: v for k, v in lines.items() if k.startswith(name + "_bucket")}
        assert [v for k, v in buckets.items() if f'le="{le}"' in k] == [1.0], name
        below = [v for k, v in buckets.items() if "+Inf" not in k and f'le="{le}"' not in k]
        assert below and max(below) == 0.0, name  # in the top finite bucket only


def test_inter_token_latency_takes_vllms_buckets():
    """vllm:inter_token_latency_seconds has vLLM's bounds, 10 ms to 80 s: a gap of 60 s between
    two outputs (a decode stalled behind a long prefill chunk) lands in the 80 s bucket, not in
    +Inf alone (the top finite bound was 5 s)."""
    met = ServerMetrics("tiny", 512)
    met.observe(RequestOutput(prompt_tokens=3, finish_reason="stop"), 0.0, 100.0, [1.0, 61.0])
    name = "vllm:inter_token_latency_seconds_bucket"
    le = {k.split('le="')[1].split('"')[0]: v for k, v in scrape(met).items() if k.startswith(name)}
    assert list(le) == [
        "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0",
        "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf",
    ]  # fmt: skip
    assert (le["40.0"], le["80.0"]) == (0.0, 1.0)


def test_engine_snapshot_has_the_totals_and_no_hit_rate_series_before_traffic():
    eng = make(load_model(resolve_model("tiny"))[0], compiled=False)
    met = ServerMetrics("tiny", 512)
    before = eng.metrics()
    n_layers = len(before["hit_rate"])
    assert n_layers > 0 and before["gpu_pool_selected"] == [0.0] * n_layers
    met.update(before, 0)
    assert not any(k.startswith("echo_gpu_pool_hit_rate") for k in scrape(met))
    eng.add_request("r0", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    after = eng.metrics()
    assert all(s > 0 for s in after["gpu_pool_selected"])
    for s, r, h in zip(after["gpu_pool_selected"], after["gpu_pool_recalled"], after["hit_rate"],
                       strict=True):  # fmt: skip
        assert h == 1.0 - r / s
    met.update(after, 0)
    lines = scrape(met)
    assert lines['echo_gpu_pool_selected_total{layer="0"}'] == after["gpu_pool_selected"][0]
    assert lines['echo_gpu_pool_hit_rate{layer="0"}'] == after["hit_rate"][0]
