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
from benchmarks.cache_ops_check import BEFORE, COPY_PROGRAMS, NEW, PDL, kernels_vs_reference
from benchmarks.cuda_timer import GraphTiming
from custom_ops import cache_kernels as K
from custom_ops import cache_layout as C
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool
from custom_ops.cache.invariants import check_pool, fill_random


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
    # amortized_us is the period scenario's median; the parts' formula is kept beside it
    parts = {
        "free_37": {"median_us": 9.0},
        "free_37_period": {"median_us": 5.5},
        "free_37_steady": {"median_us": 1.0},
        "free_37_refill": {"median_us": 100.0},
    }
    row = bench.set_amortized(parts, "free_37", 37, cap)
    assert row["amortized_us"] == 5.5
    assert row["amortized_from_parts_us"] == pytest.approx((100 + 84) / 85)
    assert bench.set_amortized({"free_37": {"error": "boom"}}, "free_37", 37, cap) is None
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
    # A generation's scoring (pdl.*) takes its own figures and the defaults' where it has none.
    pdl = bench.targets_met({**res, "pdl.allocate_37": {"median_us": 4.0}}, "pdl.")
    assert pdl["allocate_us"] is False and pdl["free_us"] and pdl["alloc_plus_free_us"] == 8.0


def test_new_vs_pairs_only_ops_timed_both_ways():
    res = {
        "allocate_37": {"median_us": 3.0},
        "before.allocate_37": {"median_us": 4.0},
        "free_37": {"median_us": 9.0},  # no before.* figure: not paired
        "fp8.recall_37_misses_steady": {"median_us": 12.0},
        "before.fp8.recall_37_misses_steady": {"error": "boom"},
    }
    assert bench.new_vs(res, "before") == {
        "allocate_37": {"new_us": 3.0, "before_us": 4.0, "ratio": 0.75}
    }
    assert bench.new_vs({**res, "pdl.free_37": {"median_us": 4.5}}, "pdl") == {
        "free_37": {"new_us": 9.0, "pdl_us": 4.5, "ratio": 2.0}
    }


@pytest.mark.parametrize("module", ["bench_cache_ops", "bench_row_stride"])
def test_cli_help(module):
    r = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--reps" in r.stdout


def test_pdl_generation_sets_its_switch_only_during_a_call(tiny, monkeypatch):
    """PDL is NEW's module with LAUNCH_PDL set per call (a graph captures the launches chosen
    then), and the module is left as it was."""
    seen = []
    orig = K.allocate_cuda
    monkeypatch.setattr(
        K, "allocate_cuda", lambda *a: (seen.append(K.LAUNCH_PDL), orig(*a))[1]
    )  # fmt: skip
    fill_random(tiny, 320, torch.Generator().manual_seed(1))
    want = torch.nonzero(tiny.host_to_gpu < 0).flatten()[:12].int()
    n = torch.tensor([4], dtype=torch.int32)
    PDL.allocate(tiny, want, n)  # on the CPU the launchers leave PDL out (interpreter)
    NEW.allocate(tiny, want[4:], n)
    check_pool(tiny)
    assert seen == [True, False] and not K.LAUNCH_PDL


def test_before_kernels_run_on_flags_of_their_own(tiny):
    """The frozen pre-issue-18 kernels take an int8 free flag, not the ring: BEFORE builds it
    from the pool (prepare), runs on it, and rebuilds the ring from the result (settle)."""
    fill_random(tiny, 600, torch.Generator().manual_seed(3))
    free = set(torch.nonzero(tiny.gpu_priority == -1).flatten().tolist())
    BEFORE.prepare(tiny)
    flag = BEFORE.state(tiny)[0]
    assert flag.dtype == torch.int8 and set(torch.nonzero(flag).flatten().tolist()) == free
    want = torch.nonzero(tiny.host_to_gpu < 0).flatten()[:30].int()
    BEFORE.allocate(tiny, want, torch.tensor([30], dtype=torch.int32))
    BEFORE.settle(tiny)
    check_pool(tiny)
    assert int(tiny.meta[C.NFREE]) == 10 and bool((tiny.host_to_gpu[want.long()] >= 0).all())


@pytest.mark.parametrize("impl", [NEW, COPY_PROGRAMS], ids=["new", "copy_programs"])
def test_gpu_check_stage_passes_on_the_interpreted_kernels(tiny, impl):
    """The benchmark's correctness stage (recall, free, allocate, steady recall against the
    references) at a tiny size, for the defaults and the copy programs copying every row: every
    verdict PASS,
    so a FAIL on the H200 is the GPU's."""
    gen = torch.Generator().manual_seed(2)
    host = torch.randint(0, 256, (4096, 656), dtype=torch.uint8, generator=gen)
    fill_random(tiny, 640, gen, host_kv=host, host_slots=torch.arange(2048))
    res = torch.nonzero(tiny.host_to_gpu >= 0).flatten()
    hs = torch.cat([res[:100], torch.arange(3000, 3006)]).int().view(2, 53)
    protect = res[torch.randperm(res.numel(), generator=gen)[:64]].int()
    want = torch.arange(3100, 3140).int()
    out = kernels_vs_reference(tiny, host, hs, protect, want, 64, impl)
    assert {k: v["verdict"] for k, v in out.items()} == dict.fromkeys(
        ("recall", "free", "allocate", "recall_steady"), "PASS"
    ), out


def test_recall_period_chain_recalls_distinct_rows_per_call(tiny, monkeypatch):
    """recall_all_misses with calls > 1: distinct fresh rows per call in one graph, counted and
    checked inside (totals, invariants, the last call's rows); from a full pool each call here
    evicts min(misses + reserve, CAP) = CAP = 128 (at full size 2048 + 3125, so every other call
    refills)."""
    monkeypatch.setattr(bench, "N_H", 4096)
    gen = torch.Generator().manual_seed(4)
    host = torch.randint(0, 256, (4096, 656), dtype=torch.uint8, generator=gen)
    r = bench.recall_all_misses(tiny, host, torch.arange(2048, 4096), 1, gen, NEW, 0, 4)
    assert r["calls_per_graph"] == 4 and r["rows"] == 128
    assert r["evicted_per_graph"] == 4 * 128


def test_slice_concat_baseline_is_the_median_of_its_rounds(tiny, monkeypatch):
    """The SGLang baseline runs in rounds; its figures are the rounds' medians, each round kept,
    and the free list stays whole (every allocation freed)."""

    class Event:  # a fake CUDA event: GPU time per round of 10, 30, 20, 50, 40 us a pair
        gpu = iter([10, 30, 20, 50, 40])

        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return next(Event.gpu) * 4 / 1e3  # ms for the round's 4 pairs

    monkeypatch.setattr(torch.cuda, "Event", Event)
    out = bench.bench_sglang(3, 4, rounds=5)
    assert out["rounds_gpu_us"] == pytest.approx([10, 30, 20, 50, 40])
    assert out["alloc_plus_free_gpu_us"] == pytest.approx(30)
    assert len(out["rounds_wall_us"]) == 5 and out["alloc_plus_free_wall_us"] > 0
    assert out["free_list_len"] == bench.N_G


def test_sweep_times_the_stamp_probe_on_the_steady_step(tiny, monkeypatch):
    """The sweep's PROBE_LOOKUP_STAMPS row has its 37-miss steady figure, not an error: on a
    refill period the eviction takes hits the probe left unstamped, which later steps recall
    again (the misses' count fails, as the pool check did); the defaults' row keeps every
    figure. The 2048-miss calls and free (which the probe leaves alike) are faked here."""
    monkeypatch.setattr(bench, "N_H", 4096)
    monkeypatch.setattr(bench, "N_G", 1024)  # (room for 16 steps of 37 misses and the hits)
    monkeypatch.setattr(bench, "STEADY_FREE", 600)  # (so that the steady step evicts nothing)
    pool = GpuPool(CacheConfig(1, 4096, 1024, 64, fmt="fp8", max_batch=2), "cpu")
    fake = lambda *a, **k: {"median_us": 1.0}  # noqa: E731
    monkeypatch.setattr(bench, "recall_all_misses", fake)
    monkeypatch.setattr(bench, "bench_free", fake)
    gen = torch.Generator().manual_seed(4)
    host = torch.randint(0, 256, (4096, 656), dtype=torch.uint8, generator=gen)
    box = {"fresh": torch.arange(2048, 4096)}  # (the faked 2048-miss calls' only)

    def recall(n_miss, calls, free_before):
        def run():
            fill_random(pool, 1024 - free_before, gen, host_kv=host, host_slots=torch.arange(2048))
            fresh = torch.arange(2048, 4096)  # (not resident: misses, as many as each run needs)
            return bench.bench_recall(pool, host, n_miss, calls, fresh, gen, 1)[0]

        return run

    out = bench.sweep_one_launch(pool, host, recall, box, 1, gen)
    for rnd in (0, 1):
        assert out[f"round{rnd}_PROBE_LOOKUP_STAMPS_False"] == {"recall_37_steady_us": 1.0}
        assert set(out[f"round{rnd}_default"]) == {
            "recall_37_steady_us", "recall_37_period_us", "recall_2048_period_us",
            "recall_2048_steady_us", "free_37_steady_us", "free_37_period_us",
        }, out[f"round{rnd}_default"]  # fmt: skip
    assert K.PROBE_LOOKUP_STAMPS  # (the defaults restored)
