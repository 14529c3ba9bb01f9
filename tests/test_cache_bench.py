"""benchmarks/bench_cache_ops.py's own logic on CPU at tiny sizes: a fake graph timer that runs the
calls eagerly, the kernels interpreted (TRITON_INTERPRET=1). The GPU numbers need the H200; what
can be wrong without one (the scenarios' eviction counts, the amortized figures, the scoring, the
CLI) is checked here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import benchmarks.bench_cache_ops as bench
from benchmarks.cache_ops_check import BEFORE, NEW
from benchmarks.cuda_timer import GraphTiming
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool


class _Eager:
    def __init__(self, calls):
        self.calls = calls

    def replay(self) -> None:
        for c in self.calls:
            c()


def _fake_graph_time(calls, reps, before=None, warm=None, backend=None):
    before = before or (lambda: None)
    before()
    for c in calls:
        c()
    return GraphTiming([1.0], len(calls), _Eager(calls))


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "graph_time", _fake_graph_time)
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "N_G", 640)
    monkeypatch.setattr(bench, "B", 2)
    monkeypatch.setattr(bench, "TOPK", 64)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return GpuPool(CacheConfig(1, 4096, 640, 64, fmt="fp8", max_batch=2), "cpu")  # CAP 128


def test_free_scenarios_count_the_evictions_of_each_kernel_generation(tiny):
    gen = torch.Generator().manual_seed(0)
    # Full pool, calls ask for 5, 10, ..., 30 free slots. With the reserve (640 >> 6 = 10) the
    # first call evicts 15, the fourth 15 more; without it every call evicts 5. bench_free itself
    # asserts that the kernels' free count equals this rule's.
    new = bench.bench_free(tiny, 5, 6, gen, 1, NEW, 0)
    old = bench.bench_free(tiny, 5, 6, gen, 1, BEFORE, 0)
    assert new["evicting_calls"] == 2 and old["evicting_calls"] == 6
    steady = bench.bench_free(tiny, 5, 6, gen, 1, NEW, 20)
    assert steady["evicting_calls"] == 0 and steady["free_slots_before"] == 20


def test_amortized_figures_and_target_scoring():
    cap = 131072
    assert bench.refill_period(37, cap) == (37 + 200_000 // 64) // 37 == 85
    assert bench.amortized(100.0, 1.0, 37, cap) == pytest.approx((100 + 84) / 85)
    res = {
        "allocate_37": {"median_us": 2.0},
        "free_37": {"median_us": 9.0, "amortized_us": 4.0},
        "sglang_slice_concat": {"alloc_plus_free_wall_us": 20.0},
        "fp8.recall_37_misses": {"amortized_us": 12.5},
        "fp8.offload_64_rows": {"error": "boom"},  # a failed scenario scores None, not a crash
    }
    met = bench.targets_met(res)
    assert met["allocate_us"] and met["free_us"]
    assert met["alloc_plus_free_over_slice_concat"] and met["alloc_plus_free_us"] == 6.0
    assert met["recall_37_misses_us"] is False
    assert met["recall_2048_rows_GBps"] is None and met["offload_64_rows_us"] is None


def test_cli_help():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_cache_ops", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--reps" in r.stdout
