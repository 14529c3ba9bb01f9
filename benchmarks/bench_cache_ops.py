"""Cache-manager ops on one GPU, each captured in a CUDA graph, per layer.

    python -m benchmarks.bench_cache_ops --out benchmarks/results/cache_ops_h200.json

Sizes of the issue: N_G = 200K GPU slots, N_H = 2M host slots (2^21), B = 64, k = 2048. Each
measurement captures R consecutive calls (with their own inputs) in one graph and reports the
median over replays of graph time / R; the pool state is restored before every replay (outside
the timed window), so each replay does the same work. Every scenario is checked once after timing
(invariants, counts, rows), so no number comes from a broken path; a failed check is recorded
under the scenario's name and the run goes on.

Order: (1) correctness first: every kernel against its reference at full size, both row formats
(``checks``: PASS/FAIL); (2) timings, each op (free and recall in one launch each, the
default) beside the pre-issue-18 kernels (``before.*``, benchmarks/cache_kernels_before.py, with
their own int8 free flags), as a launch per phase (``launches.*``, cache_kernels.FUSED off) and
so with programmatic dependent launch (``pdl.*``), and the one-launch recall with its lookup
programs copying none of the rows they place, the copy programs all of them
(``copy_programs.*``, cache_kernels.LOOKUP_COPY_ROWS = 0); each with its kernel launches broken
down (``launches``: per kernel, launches per call and device us per launch, from the CUDA
profiler);
(3) SGLang's slice/concat free-list allocator as the baseline, same run; (4) a few launch
configurations of the new kernels (``sweep``); (5) the targets of issue 18 (``targets_met``).

Evictions take a reserve (cache_ops.evict_target: needed + N_G/64), so a step's cost depends on
whether it refills: ``*_steady`` never evicts, ``*_refill`` is one call that evicts. With P = the
steps one refill lasts at that miss count, ``*_period`` captures whole refill periods from a full
pool (P calls at 37, one refill and P - 1 steady steps; 4 periods of 2 calls at 2048, every
other call evicting: 2048 + 3125 slots the first time, 971 + 3125 after) in one graph,
and its per-call median is ``*.amortized_us``, the figure the targets are scored on (per step, as
the paper's totals). It is timed like every other scenario, R calls in one graph, as a decode step
replays its layers' ops; ``*.amortized_from_parts_us`` = (refill + (P - 1) x steady) / P from the
two parts, whose one-call refill graph also pays a graph launch the period's calls share.

Reported: allocate (37 and 2048 slots), free (37), recall at ~37 misses and at hit rates 0.97 /
0.9 / 0.5, recall of 2048 misses, offload of 64 rows, the recall copy bandwidth against
cudaMemcpyAsync of the same bytes, and the slice/concat baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.cache_ops_check import (
    BEFORE,
    COPY_PROGRAMS,
    LAUNCHES,
    NEW,
    PDL,
    Kernels,
    kernels_vs_reference,
    launch_breakdown,
)
from benchmarks.cuda_timer import graph_time
from custom_ops import cache_kernels as K
from custom_ops import cache_layout as C
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool
from custom_ops.cache.host_pool import allocate_host_rows
from custom_ops.cache.invariants import check_pool, fill_random
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE

N_G, N_H, B, TOPK = 200_000, 2_097_152, 64, 2048
DEV = torch.device("cuda")
STEADY_FREE = 4096  # free slots before a *_steady run: its calls never need an eviction
TARGETS = {  # issue 18 (replacing the earlier targets); per layer, per step, H200
    "allocate_us": 3.0,  # allocate 37
    "free_us": 5.0,  # free 37, amortized over the reserve's refill period
    "alloc_plus_free_over_slice_concat": 1 / 3,  # (allocate 37 + free 37) / baseline, same run
    "recall_37_misses_us": 12.0,  # the whole op, amortized
    "recall_2048_rows_GBps": 40.0,  # the whole op, all misses, amortized
    "offload_64_rows_us": 4.3,  # keep (the paper's ~4.3 us; 1.7 us before issue 18)
}


def snapshot(pool: GpuPool, rows: bool = False) -> dict[str, torch.Tensor]:
    """The pool's buffers; ``rows`` adds gpu_kv (needed to check rows after a replay; restoring
    its 131-230 MB also flushes the 60 MB L2, so no replay reads rows cached by the last)."""
    return {n: b.clone() for n, b in pool.named_buffers() if rows or n != "gpu_kv"}


def restore(pool: GpuPool, snap: dict[str, torch.Tensor]) -> None:
    for n, t in snap.items():
        getattr(pool, n).copy_(t)


def reset(pool: GpuPool, snap: dict[str, torch.Tensor], impl: Kernels) -> None:
    """Before a run (and each replay): the pool as snapshotted, and the state of the kernel
    generation's own (the old kernels' free flags) set from it."""
    restore(pool, snap)
    impl.prepare(pool)


def time_graph(
    calls: list[Callable[[], object]], before: Callable[[], None], reps: int, launches: bool = True
) -> dict:
    """Median per-call time (us) of ``calls`` captured in one CUDA graph (benchmarks.cuda_timer;
    only the first call warms up: the calls mutate the pool, ``before`` restores it), the
    kernel launches of one replay (``launches``), and the graph, replayed once more by the
    callers to check its result."""
    t = graph_time(calls, reps, before, warm=1)
    r = t.summary() | {"graph": t.graph}
    if launches:
        try:
            r["launches"] = launch_breakdown(t.graph.replay, before, len(calls))
        except Exception as e:  # the profiler is a bonus: never lose the timing to it
            r["launches"] = {"error": f"{type(e).__name__}: {e}"}
    return r


def public(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "graph"}


def make_pool(fmt: str, gen: torch.Generator, resident_from: int) -> tuple[GpuPool, torch.Tensor]:
    """A full pool holding random host slots of [0, resident_from); misses come from above."""
    cfg = CacheConfig(1, N_H, N_G, TOPK, fmt=fmt, max_batch=B)
    host = allocate_host_rows(1, N_H, cfg.row_bytes, DEV, pinned=True)[0]
    host.random_(0, 256)  # a kernel writing the pinned pool over PCIe
    pool = GpuPool(cfg, DEV)
    fill_random(pool, N_G, gen, host_kv=host, host_slots=torch.arange(resident_from))
    return pool, host


def refill_period(n: int, cap: int) -> int:
    """Steps of n misses (or frees) that one eviction with the reserve covers."""
    return max(NEW.evicts(n, N_G, cap) // n, 1)


def amortized(refill_us: float, steady_us: float, n: int, cap: int) -> float:
    p = refill_period(n, cap)
    return (refill_us + (p - 1) * steady_us) / p


def set_amortized(res: dict, key: str, n: int, cap: int, refill: str = "_refill") -> dict | None:
    """``res[key]``'s amortized figures: ``amortized_us`` from the ``key_period`` scenario (whole
    refill periods in one graph), ``amortized_from_parts_us`` from ``key + refill`` and
    ``key_steady``. Returns ``res[key]`` (None when it was not timed)."""
    row = res.get(key)
    if not (isinstance(row, dict) and "median_us" in row):
        return None
    period, st, rf = (res.get(f"{key}{s}", {}) for s in ("_period", "_steady", refill))
    if "median_us" in period:
        row["amortized_us"] = period["median_us"]
    if "median_us" in st and "median_us" in rf:
        row["amortized_from_parts_us"] = amortized(rf["median_us"], st["median_us"], n, cap)
    return row


def recall_steps(
    pool: GpuPool, n_steps: int, n_miss: int, fresh: torch.Tensor, gen: torch.Generator
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Selections [B, k] of a decode run: the hits of step s are drawn from step s-1's selection
    (on the GPU for sure after its recall), the misses are fresh host slots."""
    total = B * TOPK
    res = torch.nonzero(pool.host_to_gpu.cpu() >= 0).flatten()
    prev = res[torch.randperm(res.numel(), generator=gen)[:total]]
    steps = []
    for _ in range(n_steps):
        hits = prev[torch.randperm(total, generator=gen)[: total - n_miss]]
        sel = torch.cat([hits, fresh[:n_miss]])
        fresh = fresh[n_miss:]
        sel = sel[torch.randperm(total, generator=gen)]
        steps.append(sel.int().view(B, TOPK).to(DEV))
        prev = sel
    return steps, fresh


def bench_recall(
    pool, host, n_miss, n_steps, fresh, gen, reps, impl: Kernels = NEW
) -> tuple[dict, torch.Tensor]:
    steps, fresh = recall_steps(pool, n_steps, n_miss, fresh, gen)
    snap = snapshot(pool, rows=True)
    outs: list[torch.Tensor] = []

    def call(hs):
        return lambda: outs.append(impl.recall(pool, host, hs))

    r = time_graph([call(hs) for hs in steps], lambda: reset(pool, snap, impl), reps)
    # Check one replay: every miss recalled once, the last selection on the GPU, rows right.
    reset(pool, snap, impl)
    r["graph"].replay()
    torch.cuda.synchronize()
    impl.settle(pool)
    out = outs[-1]
    if K.PROBE_LOOKUP_STAMPS:  # (the probe leaves the hits unstamped: the check would fail)
        check_pool(pool, selected=steps[-1], gpu_slots=out)
    assert int(pool.totals[C.RECALLED] - snap["totals"][C.RECALLED]) == n_miss * n_steps
    assert torch.equal(pool.gpu_kv[out.flatten().long()], host[steps[-1].flatten().long()])
    evicted = int(pool.totals[C.EVICTED] - snap["totals"][C.EVICTED])
    restore(pool, snap)
    row = host.shape[1]
    r.update(
        misses_per_step=n_miss,
        hit_rate=1 - n_miss / (B * TOPK),
        recalled_bytes_per_step=n_miss * row,
        effective_GBps=n_miss * row / (r["median_us"] * 1e3),
        evicted_per_graph=evicted,
        free_slots_before=int(snap["meta"][C.NFREE]),
    )
    return public(r), fresh


def bench_allocate(pool, n, calls, gen, reps, impl: Kernels = NEW) -> dict:
    fill_random(pool, N_G // 2, gen)  # half full, free slots scattered
    snap = snapshot(pool)
    non = torch.nonzero(pool.host_to_gpu.cpu() < 0).flatten()
    non = non[torch.randperm(non.numel(), generator=gen)[: n * calls]].int().to(DEV)
    wants = [non[i * n : (i + 1) * n] for i in range(calls)]
    cnt = torch.tensor([n], dtype=torch.int32, device=DEV)
    r = time_graph(
        [(lambda w=w: impl.allocate(pool, w, cnt)) for w in wants],
        lambda: reset(pool, snap, impl),
        reps,
    )
    reset(pool, snap, impl)
    r["graph"].replay()
    torch.cuda.synchronize()
    impl.settle(pool)
    check_pool(pool)
    assert int(snap["meta"][C.NFREE] - pool.meta[C.NFREE]) == n * calls
    restore(pool, snap)
    return {**public(r), "n": n, "free_slots_before": N_G // 2}


def bench_free(pool, n, calls, gen, reps, impl: Kernels = NEW, free_before: int = 0) -> dict:
    """free(protect = 131072 residents, ·) calls from a pool with ``free_before`` free slots.
    Full pool: call i asks for n (i + 1) free slots, so without a reserve each call evicts n;
    with it the first call evicts n + the reserve and the next ones find enough. Otherwise every
    call asks for n (no call needs an eviction: the steady state)."""
    fill_random(pool, N_G - free_before, gen)
    snap = snapshot(pool)
    res = torch.nonzero(pool.host_to_gpu.cpu() >= 0).flatten()
    protect = res[torch.randperm(res.numel(), generator=gen)[: B * TOPK]].int().view(B, TOPK)
    protect = protect.to(DEV)
    asks = [n * (i + 1) if free_before == 0 else n for i in range(calls)]
    cnts = [torch.tensor([a], dtype=torch.int32, device=DEV) for a in asks]
    r = time_graph(
        [(lambda c=c: impl.free(pool, protect, c)) for c in cnts],
        lambda: reset(pool, snap, impl),
        reps,
    )
    reset(pool, snap, impl)
    r["graph"].replay()
    torch.cuda.synchronize()
    impl.settle(pool)
    check_pool(pool)
    free, evictions = free_before, 0
    for a in asks:  # the free count the eviction rule of ``impl`` leads to
        take = impl.evicts(max(a - free, 0), N_G, pool.capacity)
        free, evictions = free + take, evictions + (take > 0)
    assert int(pool.meta[C.NFREE]) == free, (int(pool.meta[C.NFREE]), free)
    restore(pool, snap)
    return {**public(r), "n": n, "protected": B * TOPK, "free_slots_before": free_before,
            "evicting_calls": evictions}  # fmt: skip


def bench_offload(host, t, calls, gen, reps) -> dict:
    row = host.shape[1]
    index_k = torch.zeros(N_H // PAGE, INDEX_PAGE_BYTES, dtype=torch.uint8, device=DEV)
    rows = torch.randint(0, 256, (t, row), dtype=torch.uint8, device=DEV)
    irows = torch.randint(0, 256, (t, INDEX_ROW_BYTES), dtype=torch.uint8, device=DEV)
    slots = [torch.randperm(N_H, generator=gen)[:t].to(DEV) for _ in range(calls)]
    r = time_graph(
        [(lambda s=s: torch.ops.echo.offload(host, index_k, rows, irows, s)) for s in slots],
        lambda: None,
        reps,
    )
    torch.cuda.synchronize()
    assert torch.equal(host[slots[-1]], rows)
    return {**public(r), "rows": t}


def bench_copy(host, n_rows, calls, gen, reps, configs=None) -> dict:
    """The recall row copy alone (the gather kernel, the new one in its default configuration
    or each of ``configs``, and the pre-issue-18 one) against cudaMemcpyAsync of the same bytes
    from a contiguous pinned buffer, all in CUDA graphs."""
    from benchmarks import cache_kernels_before as KB

    row = host.shape[1]
    gpu_kv = torch.zeros(N_G, row, dtype=torch.uint8, device=DEV)
    h2g = torch.full((N_H,), -1, dtype=torch.int32, device=DEV)
    # Distinct rows for every call of the graph: no call reads rows another left in L2.
    src = torch.randperm(N_H, generator=gen)[: n_rows * calls].view(calls, n_rows).to(DEV)
    dst = torch.randperm(N_G, generator=gen)[:n_rows].to(DEV)
    h2g[src] = dst.int().repeat(calls, 1)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)
    meta = torch.zeros(C.META_LEN, dtype=torch.int32, device=DEV)
    meta[C.LAST_ALLOC] = n_rows
    stats = torch.zeros(C.STATS_LEN, dtype=torch.int64, device=DEV)
    dummy = torch.zeros(1, dtype=torch.int32, device=DEV)
    n_copy = K._num_copy_programs(DEV)
    row_w = row // 4
    hw, gw = host.view(torch.int32), gpu_kv.view(torch.int32)

    def old_kernel(miss_host: torch.Tensor) -> None:
        KB._copy_out_kernel[(n_copy,)](
            hw, gw, miss_host, h2g, dummy, dummy, meta, stats, 0, n_copy, ROW_W=row_w,
            ROW_WP=1 << (row_w - 1).bit_length(), RPI=KB.ROWS_PER_ITER, BLOCK=KB.LIST_BLOCK,
            num_warps=4,
        )  # fmt: skip

    def new_kernel(miss_host: torch.Tensor, cfg: dict) -> None:
        K.copy_rows(host, gpu_kv, miss_host, h2g, meta, stats, dummy[:0], dummy, **cfg)

    nbytes = n_rows * row
    out: dict = {"rows": n_rows, "bytes": nbytes}

    def timed(name: str, fn: Callable[[torch.Tensor], None]) -> None:
        gpu_kv.zero_()
        t = time_graph([(lambda m=m: fn(m)) for m in src.int()], flush.zero_, reps, False)
        torch.cuda.synchronize()
        ok = torch.equal(gpu_kv[dst], host[src[-1]])
        out[f"{name}_us"] = t["median_us"]
        out[f"{name}_GBps"] = nbytes / (t["median_us"] * 1e3)
        out[f"{name}_check"] = "PASS" if ok else "FAIL"

    timed("gather_kernel", lambda m: new_kernel(m, {}))
    timed("before_gather_kernel", old_kernel)
    for cfg in configs or []:
        tag = "_".join(f"{k}{v}" for k, v in cfg.items())
        timed(f"gather_{tag}", lambda m, cfg=cfg: new_kernel(m, cfg))
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    mem = time_graph(
        [lambda: dev_buf.copy_(pinned, non_blocking=True)] * calls, flush.zero_, reps, False
    )
    out["memcpy_async_us"] = mem["median_us"]
    out["memcpy_async_GBps"] = nbytes / (mem["median_us"] * 1e3)
    return out


class SlicingAllocator:
    """SGLang's TokenToKVPoolAllocator: a tensor free list, alloc = slice, free = concat."""

    def __init__(self, size: int):
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64, device=DEV)

    def alloc(self, need: int) -> torch.Tensor | None:
        if need > len(self.free_slots):  # a Python int: no sync
            return None
        out, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        return out

    def free(self, idx: torch.Tensor) -> None:
        self.free_slots = torch.cat((self.free_slots, idx))


def bench_sglang(n: int, iters: int, rounds: int = 5) -> dict:
    """Eager alloc + free pairs (SGLang runs them outside its CUDA graphs): wall time per pair
    with the queue kept busy, and GPU time per pair, in ``rounds`` rounds of ``iters`` pairs;
    the figures are the rounds' medians (one round of 2000 pairs measured 16-28 us a pair
    across runs of 2026-12-04/05: the host's launch rate), each round kept."""
    a = SlicingAllocator(N_G)
    for _ in range(50):
        a.free(a.alloc(n))
    walls, gpus = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a.free(a.alloc(n))
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6 / iters)
        gpus.append(start.elapsed_time(end) * 1e3 / iters)
    return {
        "n": n,
        "alloc_plus_free_wall_us": statistics.median(walls),
        "alloc_plus_free_gpu_us": statistics.median(gpus),
        "rounds_wall_us": walls,
        "rounds_gpu_us": gpus,
        "free_list_len": len(a.free_slots),
    }


def recall_all_misses(
    pool: GpuPool, host: torch.Tensor, fresh: torch.Tensor, reps: int, gen: torch.Generator,
    impl: Kernels = NEW, free_before: int = 0, calls: int = 1,
) -> dict:  # fmt: skip
    """Recalls of 2048 rows, all misses (B = 1), from a pool with ``free_before`` free slots (0:
    the first call must evict; with the reserve it is the refill step): the op's own bandwidth.
    ``calls`` > 1: that many recalls of distinct fresh rows in one graph (from a full pool, at
    2048 misses every other one refills: whole refill periods)."""
    n = min(2048, pool.capacity)  # 2048 at full size
    fill_random(pool, N_G - free_before, gen, host_kv=host, host_slots=torch.arange(N_H // 2))
    snap = snapshot(pool, rows=True)
    pick = fresh[torch.randperm(fresh.numel(), generator=gen)[: n * calls]].int().to(DEV)
    sels = list(pick.view(calls, 1, n))
    outs: list[torch.Tensor] = []
    r = time_graph(
        [lambda hs=hs: outs.append(impl.recall(pool, host, hs)) for hs in sels],
        lambda: reset(pool, snap, impl),
        reps,
    )
    reset(pool, snap, impl)
    r["graph"].replay()
    torch.cuda.synchronize()
    impl.settle(pool)
    if K.PROBE_LOOKUP_STAMPS:
        check_pool(pool, selected=sels[-1], gpu_slots=outs[-1])
    assert int(pool.meta[C.LAST_MISS]) == n
    assert int(pool.totals[C.RECALLED] - snap["totals"][C.RECALLED]) == n * calls
    assert torch.equal(pool.gpu_kv[outs[-1].flatten().long()], host[sels[-1].flatten().long()])
    evicted = int(pool.totals[C.EVICTED] - snap["totals"][C.EVICTED])
    restore(pool, snap)
    return {**public(r), "rows": n, "GBps": n * host.shape[1] / (r["median_us"] * 1e3),
            "free_slots_before": free_before, "evicted_per_graph": evicted}  # fmt: skip


def bench_format(
    fmt: str, step: Callable, gen: torch.Generator, reps: int, fresh_all: torch.Tensor, res: dict
) -> None:
    pool, host = make_pool(fmt, gen, N_H // 2)
    fresh = fresh_all[torch.randperm(fresh_all.numel(), generator=gen)]
    cap = pool.capacity

    def check(impl: Kernels, fresh: torch.Tensor) -> dict:
        (hs,), rest = recall_steps(pool, 1, B * TOPK * 3 // 100, fresh, gen)
        res_ = torch.nonzero(pool.host_to_gpu.cpu() >= 0).flatten()
        protect = res_[torch.randperm(res_.numel(), generator=gen)[: B * TOPK]].int().to(DEV)
        want = rest[:2048].int().to(DEV)
        out = kernels_vs_reference(pool, host, hs, protect, want, min(8192, cap), impl)
        fill_random(pool, N_G, gen, host_kv=host, host_slots=torch.arange(N_H // 2))
        return out

    step(f"checks.{fmt}", lambda: check(NEW, fresh))
    fresh = fresh[B * TOPK :]  # the check's misses are not fresh any more
    if fmt == "fp8":  # the switched paths the benchmark times, checked the same way
        step("checks.fp8_pdl", lambda f=fresh: check(PDL, f))
        fresh = fresh[B * TOPK :]
    step(f"checks.{fmt}_copy_programs", lambda f=fresh: check(COPY_PROGRAMS, f))
    fresh = fresh[B * TOPK :]
    box = {"fresh": fresh}

    def recall(n_miss: int, calls: int, free_before: int, impl: Kernels = NEW) -> Callable:
        def run() -> dict:
            fill_random(pool, N_G - free_before, gen, host_kv=host,
                        host_slots=torch.arange(N_H // 2))  # fmt: skip
            r, box["fresh"] = bench_recall(pool, host, n_miss, calls, box["fresh"], gen, reps,
                                           impl)  # fmt: skip
            return r

        return run

    p37 = refill_period(37, cap)
    step(f"{fmt}.recall_37_misses", recall(37, 16, 0))
    step(f"{fmt}.recall_37_misses_steady", recall(37, 16, STEADY_FREE))
    step(f"{fmt}.recall_37_misses_refill", recall(37, 1, 0))
    step(f"{fmt}.recall_37_misses_period", recall(37, p37, 0))
    step(f"before.{fmt}.recall_37_misses", recall(37, 16, 0, BEFORE))
    alts = (("pdl.", PDL), ("launches.", LAUNCHES)) if fmt == "fp8" else ()
    for tag, impl in (*alts, ("copy_programs.", COPY_PROGRAMS)):
        step(f"{tag}{fmt}.recall_37_misses", recall(37, 16, 0, impl))
        step(f"{tag}{fmt}.recall_37_misses_steady", recall(37, 16, STEADY_FREE, impl))
        step(f"{tag}{fmt}.recall_37_misses_refill", recall(37, 1, 0, impl))
        step(f"{tag}{fmt}.recall_37_misses_period", recall(37, p37, 0, impl))
    for tag in ("", "pdl.", "launches.", "copy_programs."):
        set_amortized(res, f"{tag}{fmt}.recall_37_misses", 37, cap)
    n97 = B * TOPK * 3 // 100
    step(f"{fmt}.recall_hit_0.97", recall(n97, 8, 0))
    step(f"before.{fmt}.recall_hit_0.97", recall(n97, 8, 0, BEFORE))
    step(f"launches.{fmt}.recall_hit_0.97", recall(n97, 8, 0, LAUNCHES))
    step(f"copy_programs.{fmt}.recall_hit_0.97", recall(n97, 8, 0, COPY_PROGRAMS))
    if fmt == "fp8":
        step("fp8.recall_hit_0.9", recall(B * TOPK // 10, 4, 0))
        step("fp8.recall_hit_0.5", recall(B * TOPK // 2, 2, 0))
        step("copy_programs.fp8.recall_hit_0.9", recall(B * TOPK // 10, 4, 0, COPY_PROGRAMS))
        step("copy_programs.fp8.recall_hit_0.5", recall(B * TOPK // 2, 2, 0, COPY_PROGRAMS))
    step(f"{fmt}.offload_64_rows", lambda: bench_offload(host, 64, 32, gen, reps))
    for n_rows in (r for r in (2048, 65536) if r * 8 <= N_H and r <= N_G):
        cfgs = None
        if fmt == "fp8" and n_rows == 2048:  # the copy configurations to try (units x programs)
            cfgs = [dict(units=u, programs_per_sm=p) for u in (256, 512, 1024) for p in (2, 4)]
            cfgs += [dict(early=False), dict(cache=".cg"), dict(units=1024, cache=".cg")]
        step(f"{fmt}.copy_{n_rows}_rows",
             lambda n=n_rows, c=cfgs: bench_copy(host, n, 8, gen, reps, c))  # fmt: skip
    n2k = min(2048, cap)
    p2k = 4 * refill_period(n2k, cap)  # 8 calls at full size: four refills, four steady steps
    for tag, impl in (("", NEW), ("before.", BEFORE), ("pdl.", PDL), ("launches.", LAUNCHES),
                      ("copy_programs.", COPY_PROGRAMS)):  # fmt: skip
        if tag in ("pdl.", "launches.") and fmt != "fp8":
            continue
        for name, free, calls in (
            ("", 0, 1), ("_steady", n2k + STEADY_FREE, 1), ("_period", 0, p2k)
        ):  # fmt: skip
            if tag == "before." and name:
                continue
            step(f"{tag}{fmt}.recall_2048_misses{name}",
                 lambda i=impl, f=free, c=calls: recall_all_misses(
                     pool, host, box["fresh"], reps, gen, i, f, c))  # fmt: skip
    for tag in ("", "pdl.", "launches.", "copy_programs."):
        rf = set_amortized(res, f"{tag}{fmt}.recall_2048_misses", n2k, cap, "")
        if rf and "amortized_us" in rf:
            rf["amortized_GBps"] = n2k * host.shape[1] / (rf["amortized_us"] * 1e3)
    if fmt == "fp8":
        step("sweep_one_launch", lambda: sweep_one_launch(pool, host, recall, box, reps, gen))
        bench_pool_ops(pool, step, gen, reps, res)


def sweep_one_launch(pool, host, recall: Callable, box: dict, reps: int, gen) -> dict:
    """The one-launch recall and free (the default) at a few launch configurations, each a
    change of one cache_kernels setting from the defaults: list entries per program of free's
    lookup (FREE_LIST_BLOCK) and of recall's lookup and output (LIST_BLOCK), pool slots per
    histogram / pass program (FUSED_SCAN_BLOCK), rows each lookup program copies itself
    (LOOKUP_COPY_ROWS), the output before the lookup ends or after it (RECALL_OUT_EARLY), and
    the probe without the lookup's stamps of its hits (PROBE_LOOKUP_STAMPS: wrong eviction order,
    timed only: what a stamp beside host_to_gpu could at most save; on the 37-miss steady step
    alone, where nothing is evicted). Each is timed on whole refill periods (the amortized
    figures) and on the steady step (37 misses; 2048 in one call), in two rounds, so that a
    configuration's figures come from two points of the run."""
    out = {}
    cap = pool.capacity
    n2k = min(2048, cap)
    names = ("FREE_LIST_BLOCK", "LIST_BLOCK", "FUSED_SCAN_BLOCK", "LOOKUP_COPY_ROWS",
             "RECALL_OUT_EARLY", "PROBE_LOOKUP_STAMPS")
    defaults = {n: getattr(K, n) for n in names}
    configs = ({"FREE_LIST_BLOCK": 512}, {"LIST_BLOCK": 512}, {"FUSED_SCAN_BLOCK": 512},
               {"FUSED_SCAN_BLOCK": 2048},
               {"LOOKUP_COPY_ROWS": 0}, {"LOOKUP_COPY_ROWS": 16}, {"LOOKUP_COPY_ROWS": 128},
               {"RECALL_OUT_EARLY": not defaults["RECALL_OUT_EARLY"]},
               {"PROBE_LOOKUP_STAMPS": False}, {})  # fmt: skip
    for rnd in range(2):
        for change in configs:
            for n, v in {**defaults, **change}.items():
                setattr(K, n, v)
            name = f"round{rnd}_" + ("_".join(f"{n}_{v}" for n, v in change.items()) or "default")
            figures = {
                "recall_37_steady_us": lambda: recall(37, 16, STEADY_FREE)()["median_us"],
                "recall_37_period_us": lambda: recall(37, refill_period(37, cap), 0)()["median_us"],
                "recall_2048_period_us": lambda: recall_all_misses(
                    pool, host, box["fresh"], reps, gen, NEW, 0, 4 * refill_period(n2k, cap)
                )["median_us"],
                # one call with free slots: a new request's first decode step
                "recall_2048_steady_us": lambda: recall_all_misses(
                    pool, host, box["fresh"], reps, gen, NEW, n2k + STEADY_FREE, 1
                )["median_us"],
                "free_37_steady_us": lambda: bench_free(
                    pool, 37, 32, gen, reps, NEW, STEADY_FREE
                )["median_us"],
                "free_37_period_us": lambda: bench_free(
                    pool, 37, refill_period(37, cap), gen, reps, NEW, 0
                )["median_us"],
            }
            if not K.PROBE_LOOKUP_STAMPS:
                # NOTE: the probe times the steady step alone: a period's eviction takes hits
                # the probe left unstamped, which the next steps then recall again (other work
                # than the defaults', and the misses' count fails); the 2048-miss calls have no
                # hits and free stamps its own, so the probe changes neither
                figures = {"recall_37_steady_us": figures["recall_37_steady_us"]}
            try:
                out[name] = {k: f() for k, f in figures.items()}
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {e}"}
    for n, v in defaults.items():
        setattr(K, n, v)
    return out


def bench_pool_ops(pool: GpuPool, step: Callable, gen: torch.Generator, reps: int,
                   res: dict) -> None:  # fmt: skip
    cap = pool.capacity
    n = min(2048, cap)  # 16 calls of 2048 fit the 100K free slots
    calls = min(16, N_G // 2 // n)
    for tag, impl in (("", NEW), ("before.", BEFORE), ("pdl.", PDL), ("launches.", LAUNCHES)):
        step(f"{tag}allocate_37", lambda i=impl: bench_allocate(pool, 37, 32, gen, reps, i))
        step(f"{tag}allocate_2048", lambda i=impl: bench_allocate(pool, n, calls, gen, reps, i))
        step(f"{tag}free_37",
             lambda i=impl: bench_free(pool, 37, min(32, cap // 37), gen, reps, i))  # fmt: skip
    for tag, impl in (("", NEW), ("pdl.", PDL), ("launches.", LAUNCHES)):
        step(f"{tag}free_37_steady",
             lambda i=impl: bench_free(pool, 37, 32, gen, reps, i, STEADY_FREE))  # fmt: skip
        step(f"{tag}free_37_refill", lambda i=impl: bench_free(pool, 37, 1, gen, reps, i, 0))
        step(f"{tag}free_37_period",
             lambda i=impl: bench_free(pool, 37, refill_period(37, cap), gen, reps, i, 0))
        set_amortized(res, f"{tag}free_37", 37, cap)
    # The one-launch ops' scan and list blocks: sweep_one_launch (on whole refill periods).
    sweep = {}
    # allocate's one program: ranks per chunk (2048 slots: 2 dependent chunks at 1024) x warps.
    defaults = K.ALLOC_BLOCK, K.ALLOC_WARPS
    for block, warps in ((2048, 4), (2048, 8), (1024, 8), defaults):  # the default last
        K.ALLOC_BLOCK, K.ALLOC_WARPS = block, warps
        try:
            sweep[f"alloc_block_{block}_warps_{warps}"] = {
                "allocate_37_us": bench_allocate(pool, 37, 32, gen, reps)["median_us"],
                "allocate_2048_us": bench_allocate(pool, n, calls, gen, reps)["median_us"],
            }
        except Exception as e:
            sweep[f"alloc_block_{block}_warps_{warps}"] = {"error": f"{type(e).__name__}: {e}"}
    K.ALLOC_BLOCK, K.ALLOC_WARPS = defaults
    # Warps per lookup program (more gathers of host_to_gpu in flight per SM).
    default = K.LIST_WARPS
    for warps in (8, 4):  # the default (4) last
        K.LIST_WARPS = warps
        try:
            sweep[f"list_warps_{warps}"] = {
                "free_37_steady_us": bench_free(pool, 37, 32, gen, reps, NEW, STEADY_FREE)[
                    "median_us"
                ],
            }
        except Exception as e:
            sweep[f"list_warps_{warps}"] = {"error": f"{type(e).__name__}: {e}"}
    K.LIST_WARPS = default
    step("sweep", lambda: sweep)


def targets_met(res: dict, tag: str = "") -> dict:
    """The targets, scored on the figures of the generation ``tag`` ("" = the defaults; "pdl.":
    with LAUNCH_PDL), each falling back to the default's where that generation was not timed."""

    def get(key: str, field: str = "median_us") -> float | None:
        v = res.get(f"{tag}{key}", {})
        if not (isinstance(v, dict) and field in v):
            v = res.get(key, {})
        return v.get(field) if isinstance(v, dict) else None

    alloc, free = get("allocate_37"), get("free_37", "amortized_us")
    base = get("sglang_slice_concat", "alloc_plus_free_wall_us")
    rec37 = get("fp8.recall_37_misses", "amortized_us")
    gbps = get("fp8.recall_2048_misses", "amortized_GBps")
    off = get("fp8.offload_64_rows")
    met = {
        "allocate_us": None if alloc is None else alloc <= TARGETS["allocate_us"],
        "free_us": None if free is None else free <= TARGETS["free_us"],
        "alloc_plus_free_over_slice_concat": None
        if None in (alloc, free, base)
        else (alloc + free) / base <= TARGETS["alloc_plus_free_over_slice_concat"],
        "recall_37_misses_us": None if rec37 is None else rec37 <= TARGETS["recall_37_misses_us"],
        "recall_2048_rows_GBps": None if gbps is None else gbps >= TARGETS["recall_2048_rows_GBps"],
        "offload_64_rows_us": None if off is None else off <= TARGETS["offload_64_rows_us"],
    }
    if None not in (alloc, free, base):
        met["alloc_plus_free_us"] = alloc + free
        met["alloc_plus_free_over_slice_concat_ratio"] = (alloc + free) / base
    return met


def new_vs(res: dict, tag: str) -> dict:
    """Median us of each op timed with both the new kernels and ``tag``'s (before: the kernels
    before issue 18; pdl: with LAUNCH_PDL), and new / theirs."""
    out = {}
    for k, v in res.items():
        c = res.get(f"{tag}.{k}")
        if isinstance(v, dict) and isinstance(c, dict) and "median_us" in v and "median_us" in c:
            out[k] = {
                "new_us": v["median_us"],
                f"{tag}_us": c["median_us"],
                "ratio": v["median_us"] / c["median_us"],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/cache_ops_h200.json")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1234)
    props = torch.cuda.get_device_properties(DEV)
    import triton

    res: dict = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "sizes": {"N_G": N_G, "N_H": N_H, "B": B, "k": TOPK},
        "method": "per call, per layer: median over replays of a CUDA graph of R calls "
        "/ R; state restored before each replay",
        "reserve_slots": NEW.evicts(1, N_G, N_G) - 1,
        "pdl_supported": K.pdl_supported(),  # False: the pdl.* runs are the defaults' launches
        "targets": TARGETS,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(res, indent=2))

    def step(name: str, fn: Callable[[], dict]) -> None:
        t0 = time.time()
        try:
            res[name] = fn()
        except Exception as e:  # record the failure and go on: later numbers still count
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name}: {json.dumps(res[name])}  ({time.time() - t0:.1f} s)", flush=True)
        save()

    fresh_all = torch.arange(N_H // 2, N_H)  # never resident at the start: misses
    for fmt in ("fp8", "bf16"):
        bench_format(fmt, step, gen, args.reps, fresh_all, res)
        torch.cuda.empty_cache()
    step("sglang_slice_concat", lambda: bench_sglang(37, 2000))

    res["targets_met"] = targets_met(res)
    res["targets_met_pdl"] = targets_met(res, "pdl.")
    res["targets_met_launches"] = targets_met(res, "launches.")
    res["targets_met_copy_programs"] = targets_met(res, "copy_programs.")
    res["new_vs_before"] = new_vs(res, "before")
    res["new_vs_pdl"] = new_vs(res, "pdl")
    res["new_vs_launches"] = new_vs(res, "launches")
    res["new_vs_copy_programs"] = new_vs(res, "copy_programs")
    save()
    print("\n| op (per layer) | median us | amortized us | launches us | pdl us | before us "
          "| copy_programs us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    gens = ("launches.", "pdl.", "before.", "copy_programs.")
    for k, v in res.items():
        if isinstance(v, dict) and "median_us" in v and not k.startswith(gens):
            others = [res.get(f"{t}{k}", {}).get("median_us") for t in gens]
            cells = [v["median_us"], v.get("amortized_us"), *others]
            print(f"| {k} | " + " | ".join("" if x is None else f"{x:.2f}" for x in cells) + " |")
    checks = {
        k: {op: c.get("verdict") for op, c in v.items()}
        for k, v in res.items()
        if k.startswith("checks.") and isinstance(v, dict) and "error" not in v
    }
    print("checks:", checks)
    print("targets met:", res["targets_met"])
    print("targets met with PDL:", res["targets_met_pdl"])
    print("targets met as a launch per phase:", res["targets_met_launches"])
    print("targets met, the copy programs copying every row:", res["targets_met_copy_programs"])
    for tag in ("before", "launches", "pdl", "copy_programs"):
        print(f"new vs {tag}:", {k: round(v["ratio"], 3) for k, v in res[f"new_vs_{tag}"].items()})


if __name__ == "__main__":
    main()
