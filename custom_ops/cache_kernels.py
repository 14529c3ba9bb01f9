"""Launchers and launch configuration of the cache-manager ops' Triton kernels (cache_ref.py has
the semantics and the references; the kernels: cache_pool_kernels.py for the pool scans,
cache_list_kernels.py for recall's list ones, cache_release_kernels.py for release and offload,
cache_sync.py for how their programs coordinate). The configuration and switches are module
globals read at launch, so the benchmark and tests set them here.

All grids are static (sized by the pool, the list or the SM count); the live counts (how many to
allocate, how many misses) are read from device memory inside the kernels, so a CUDA graph
replays them with new values. No autotuning: these kernels mutate state.

Cross-program coordination, and why it is race-free:
- The free slots are a ring list (``gpu_free``, cache_ref.py): placement pops rank r at
  HEAD + r, evictions and releases push at HEAD + NFREE + j. Within one launch the positions
  popped and pushed are disjoint (free + freed <= N_G) and every program computes them from
  HEAD and NFREE read at its start and a rank, so no program reads what another writes.
- A kernel never reads a counter that another program of the same launch writes, except through
  the atomic that writes it (ranks: the old value of one atomicAdd per block is the block's
  base rank; the ranks inside a block come from a prefix sum).
- allocate is one program: it reads the counts, places, and writes HEAD, NFREE and IDX_HW
  itself (no rank atomic, no DONE protocol).
- The eviction/placement pass and release, whose results are totals over their programs, end
  with ``_last_program``: after a CTA barrier, one release/acquire atomic on meta[DONE]; the
  program that sees DONE == grid - 1 is the last, every other program's writes are visible to
  it, and it alone finalises (HEAD, free count, stats) and resets the scratch counters with
  atomic exchanges. So no separate reset launch is needed. The copy/output launch needs no
  totals: its last program (one of its own) finalises (clock, stats, NMISS; after a placement
  pass that evicted nothing, also HEAD, the free count and IDX_HW), which no other program of
  that launch reads.
- free and recall run as one launch each (FUSED, cache_fused_kernels.py): their phases are
  ranges of program ids, and a program waits (release/acquire counters in meta) only for
  programs with lower ids, which is what a launch boundary ordered (the recall's output reads
  the map before the lookup ends, RECALL_OUT_EARLY: a slot read there is final,
  cache_list_kernels._out_early). With FUSED off they are a
  launch per phase and hand values from one launch to the next through meta; launches on one
  stream are ordered.
- A launch with nothing to do (no eviction due, nothing to place) sees so in the counts it reads
  at its start, the same in every program: program 0 alone records it, nobody touches meta[DONE].

Byte offsets into the pools are computed in int64 (a 2M-row bf16 layer is 2.3 GB > 2 GiB).
"""

from __future__ import annotations

import functools

import torch
import triton

from custom_ops import cache_layout as C
from custom_ops.cache_fused_kernels import _free_kernel, _recall_kernel
from custom_ops.cache_list_kernels import _copy_out_kernel, _lookup_kernel
from custom_ops.cache_pool_kernels import _allocate_kernel, _evict_hist_kernel, _evict_place_kernel
from custom_ops.cache_release_kernels import (
    _offload_kernel,
    _release_kernel,
    _release_layers_kernel,
)
from custom_ops.cache_sync import PDL_AVAILABLE

# Launch configuration (chosen by reasoning, not measured: see docs/cache_ops.md; the benchmark
# can try others). Pool passes: 196 programs of 1024 slots at N_G = 200K, ~1.5 per SM, one atomic
# per block; a pass is latency-bound (a few dependent round trips), not bandwidth-bound.
SCAN_BLOCK = 1024  # pool slots (and miss ranks) per program of the eviction/placement pass
SCAN_WARPS = 4
LIST_BLOCK = 256  # list entries per program (lookup, output, release; docs/cache_ops.md: the sweep)
FREE_LIST_BLOCK = 256  # list entries per program of free's lookup (docs/cache_ops.md: the sweep)
LIST_WARPS = 4  # warps per lookup program (the benchmark also tries 8: more gathers in flight)
# Recall's lookup: a block with no miss skips the claim (its exchange, winner sum and append are
# three dependent round trips; in a steady step of 37 misses >= 475 of the 512 blocks have none).
LOOKUP_SKIP_CLEAN = True
PAD_BLOCK = 1024  # index-buffer entries per padding store
# allocate's one program: ranks per chunk (37 or 2048 slots are 1 or 2 dependent chunks) and
# its warps (8 ranks per thread at 4).
ALLOC_BLOCK = 1024
ALLOC_WARPS = 4
# 16-byte units per copy program and iteration (16 KB, 8 per thread at 4 warps): 264 programs
# then move a 2048-row fp8 recall (84K units) in one wave. The copy sweep of the H200 runs
# (benchmarks/results/cache_ops_h200.json, fp8.copy_2048_rows) moves by ~10% between runs: 1024
# units x 2 programs per SM was the fastest at 15:05 (40.8 GB/s), 1024 x 4 at 22:12 (41.9 GB/s,
# the default shape 37.0); the benchmark times 4 per SM on the whole recall as copy4.*.
COPY_UNITS = 1024
COPY_PROGRAMS_PER_SM = 2
COPY_WARPS = 4
COPY_EARLY = True  # issue the first list read beside the count's (False: after it, as before)
COPY_OWN_FINAL = True  # the copy launch's finalisation in a program of its own (False: program 0)
COPY_CACHE = ""  # cache modifier of the host-row loads ("" = default; ".cg": L2 only, no L1)
# The one-launch recall: each lookup program copies the rows of up to LOOKUP_COPY_ROWS of the
# misses it placed from the ring itself, right after its lookup (cache_fused_kernels.py), and
# the copy programs the rest; 0: the copy programs copy every row. LOOKUP_COPY_UNITS 16-byte
# units per iteration (4 warps: 16 words a thread). On the H200 (docs/cache_ops.md) 32 took the
# recall at hit rate 0.97 (B = 64, 3932 misses) from 81.7 to 66.3 us and left the 37- and
# 2048-miss periods as they were, but the one-call recall of 2048 misses with free slots (a new
# request's first decode step) from 46.6 to 52.9 us; unbounded (every placed row) that case was
# 2.1x slower: one program copied 512 rows.
LOOKUP_COPY_ROWS = 32  # (set at 512 list entries a block; at 256, 16 timed the same within the
# rounds' spread and 128 slower on 2048 misses, gpu_session27/call{3,4}_cache_ops_h100.json)
LOOKUP_COPY_UNITS = 512
# The same for echo::recall_staged. A staged miss's row is read from staging (HBM), not over
# PCIe, so starting it early in the lookup gains nothing, and the copy programs spread it wider:
# 0 was faster than 32 in each of 6 scenarios of one H100 run, by 0.4-1.1 us (hit rates 0.5 /
# 0.9 / 0.97, full pool and steady; benchmarks/bench_staged_recall.py, docs/prefetch.md).
LOOKUP_COPY_ROWS_STAGED = 0
# The one-launch recall's output programs write every entry whose GPU slot is already known (the
# hits) without waiting for the lookup, and wait only where their block holds a miss
# (cache_fused_kernels._recall_kernel); False: every output program waits for the lookup.
RECALL_OUT_EARLY = True
# A timing probe, never for serving: False drops the recall lookup's stamps of its hits (one
# scattered 4-byte store per selected entry into gpu_priority; the eviction order is then
# wrong). The benchmark's sweep (bench_cache_ops.sweep_one_launch) times the recall without
# them: the most that keeping the stamp beside host_to_gpu (the store in the sector the lookup
# already reads) could save.
PROBE_LOOKUP_STAMPS = True
# Programmatic dependent launch (sm_90) for the launches of free, recall (lookup, histogram,
# eviction/placement, copy) and allocate (its one program): each launch may start
# while the one before finishes, and its programs wait (griddepcontrol.wait) for it before their
# first read, so the results are those of the plain launches; what overlaps is the launch
# latency between dependent launches (the H200 run of 2026-12-01 15:05: free's three launches,
# 6.5 us of device time, two of them returning at once, took 7.9 us). Off: measured mixed in the
# third round (docs/cache_ops.md); the benchmark times it as pdl.*.
LAUNCH_PDL = False
# free and recall in one launch each (cache_fused_kernels.py: the phases are program ranges that
# wait for each other through counters in meta); False: the separate launches below, one per
# phase (then LAUNCH_PDL applies).
FUSED = True
# Their waits: nanoseconds of sleep between polls of a phase counter (0: spin; CUDA only).
WAIT_SLEEP_NS = 0
# Pool slots per program of the one-launch ops' histogram and pass (fewer programs: fewer of
# them waiting in a step that evicts nothing; more slots each when one evicts).
FUSED_SCAN_BLOCK = 1024


@functools.cache
def pdl_supported() -> bool:
    """Whether this Triton has grid dependency control and the ``launch_pdl`` launch option (a
    Triton without them would refuse the option; LAUNCH_PDL then changes nothing)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return PDL_AVAILABLE and "launch_pdl" in CUDAOptions.__dataclass_fields__


def _pdl(device: torch.device) -> dict:
    """The launch options and the kernels' PDL constexpr: on only on CUDA (not the interpreter)."""
    on = LAUNCH_PDL and device.type == "cuda" and pdl_supported()
    return {"PDL": True, "launch_pdl": True} if on else {}


# ---- launchers ----------------------------------------------------------------------------------
def _words(t: torch.Tensor, name: str, state: bool) -> torch.Tensor:
    """uint8 [N, bytes] -> int32 [N, bytes / 4] view, so each thread moves 16-byte words. A state
    tensor (written in place) must already be aligned; an input is copied when it is not."""
    if t.shape[-1] % 4 or t.data_ptr() % 16 or not t.is_contiguous():
        if state:
            raise ValueError(f"{name} must be contiguous, 16-byte aligned, rows a multiple of 4 B")
        t = t.contiguous().clone()
    return t.view(torch.int32)


def _num_copy_programs(device: torch.device) -> int:
    # Enough programs that COPY_PROGRAMS_PER_SM x SMs x COPY_UNITS x 16 B are in flight (4.3 MB
    # at the defaults): PCIe latency is ~1-2 us, so at ~55 GB/s the copy needs >= ~110 KB
    # outstanding to run near link speed, and a 2048-row fp8 recall (1.3 MB) is then one wave.
    if device.type == "cuda":
        return COPY_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # TRITON_INTERPRET on CPU: few programs, several loop iterations each


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, block)),)


def _evict_place(
    gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, want, want_host,
    place: bool,
) -> None:  # fmt: skip
    n_g, cap = gpu_to_host.shape[0], indices.shape[0]
    _evict_place_kernel[_grid(n_g, SCAN_BLOCK)](
        gpu_priority,
        gpu_free,
        gpu_to_host,
        host_to_gpu,
        indices,
        meta,
        hist,
        stats,
        want,
        want_host,
        n_g,
        cap,
        C.reserve_slots(n_g),
        PLACE=place,
        BLOCK=SCAN_BLOCK,
        PAD=PAD_BLOCK,
        num_warps=SCAN_WARPS,
        **_pdl(gpu_free.device),
    )


def _hist(gpu_priority, meta, hist, want, n_g: int, cap: int) -> None:
    _evict_hist_kernel[_grid(n_g, SCAN_BLOCK)](
        gpu_priority,
        meta,
        hist,
        want,
        n_g,
        cap,
        BLOCK=SCAN_BLOCK,
        num_warps=SCAN_WARPS,
        **_pdl(gpu_priority.device),
    )


def allocate_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, want_host, n):
    """1 launch of one program: pop min(n, free) slots off the ring's head, in want order."""
    _allocate_kernel[(1,)](
        gpu_free,
        gpu_priority,
        gpu_to_host,
        host_to_gpu,
        indices,
        meta,
        want_host,
        n,
        gpu_to_host.shape[0],
        indices.shape[0],
        want_host.numel(),
        BLOCK=ALLOC_BLOCK,
        PAD=PAD_BLOCK,
        num_warps=ALLOC_WARPS,
        **_pdl(gpu_free.device),
    )


def free_cuda(
    gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, protect, n
):
    """1 launch (FUSED), else 3: protect, histogram, eviction; the last two return at once when
    the free slots (the reserve) already cover n."""
    p = protect.reshape(-1)
    n_g, cap = gpu_to_host.shape[0], indices.shape[0]
    if FUSED:
        n_look, n_scan = _grid(p.numel(), FREE_LIST_BLOCK)[0], _grid(n_g, FUSED_SCAN_BLOCK)[0]
        _free_kernel[(n_look + 2 * n_scan,)](
            p, host_to_gpu, gpu_priority, gpu_free, gpu_to_host, indices, meta, hist, stats, n,
            p.numel(), n_g, cap, C.reserve_slots(n_g), n_look, n_scan,
            LIST_BLOCK=FREE_LIST_BLOCK, SCAN_BLOCK=FUSED_SCAN_BLOCK, PAD=PAD_BLOCK,
            SLEEP_NS=_sleep_ns(p.device), num_warps=LIST_WARPS,
        )  # fmt: skip
        return
    _lookup_kernel[_grid(p.numel(), FREE_LIST_BLOCK)](
        p,
        host_to_gpu,
        gpu_priority,
        indices,
        meta,
        stats,
        p.numel(),
        indices.shape[0],
        MISSES=False,
        BLOCK=FREE_LIST_BLOCK,
        num_warps=LIST_WARPS,
        **_pdl(p.device),
    )
    _hist(gpu_priority, meta, hist, n, gpu_to_host.shape[0], indices.shape[0])
    _evict_place(
        gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, n, indices,
        place=False,
    )  # fmt: skip


def recall_cuda(
    host_kv,
    gpu_kv,
    gpu_free,
    gpu_priority,
    gpu_to_host,
    host_to_gpu,
    indices,
    miss_host,
    meta,
    hist,
    stats,
    host_slots,
    stage_kv=None,
    host_stage=None,
    stage_host=None,
    stage_ctr=None,
    pf_stats=None,
) -> torch.Tensor:
    """1 launch (FUSED), else 4: lookup (protect hits, claim misses), histogram (returns at once
    unless an eviction is due), eviction + placement in one pass, row copy + output (whose last
    program finalises a placement that evicted nothing: the handoff). With the staging state
    (echo::recall_staged: ``stage_kv``, ``host_stage``, ``stage_host``, ``stage_ctr``,
    ``pf_stats``) a miss staged in the current epoch is copied from staging and counted as
    promoted (``staging_args``)."""
    stg = staging_args(stage_kv, host_stage, stage_host, stage_ctr, pf_stats)
    hs = host_slots.reshape(-1)
    total, cap, n_g = hs.numel(), indices.shape[0], gpu_to_host.shape[0]
    out = torch.empty_like(host_slots)
    if FUSED:
        _recall_fused(
            host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, miss_host,
            meta, hist, stats, hs, out.view(-1), stg,
        )  # fmt: skip
        return out
    n_miss = meta[C.NMISS : C.NMISS + 1]  # the live miss count, as a pointer
    _lookup_kernel[_grid(total, LIST_BLOCK)](
        hs,
        host_to_gpu,
        gpu_priority,
        miss_host,
        meta,
        stats,
        total,
        cap,
        MISSES=True,
        BLOCK=LIST_BLOCK,
        SKIP_CLEAN=LOOKUP_SKIP_CLEAN,
        num_warps=LIST_WARPS,
        **_pdl(hs.device),
    )
    _hist(gpu_priority, meta, hist, n_miss, n_g, cap)
    _evict_place(
        gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, meta, hist, stats, n_miss,
        miss_host, place=True,
    )  # fmt: skip
    copy_rows(
        host_kv, gpu_kv, miss_host, host_to_gpu, meta, stats, hs, out.view(-1),
        staging=stg,
    )  # fmt: skip
    return out


def staging_args(stage_kv, host_stage, stage_host, stage_ctr, pf_stats) -> tuple | None:
    """The STAGED copy's arguments (cache_list_kernels._move_units), or None without staging:
    stage_kv as words, host_stage, the tags stage_host, the epoch word (stage_ctr's last), pf_stats
    and S."""
    if stage_kv is None:
        return None
    return (_words(stage_kv, "stage_kv", True), host_stage, stage_host, stage_ctr[-1:], pf_stats,
            stage_kv.shape[0])  # fmt: skip


def _unstaged(gpu_words, host_to_gpu, stats) -> tuple:
    """Placeholders for the staging arguments without STAGED (never read)."""
    return (gpu_words, host_to_gpu, host_to_gpu, host_to_gpu, stats, 0)


def _sleep_ns(device: torch.device) -> int:
    return WAIT_SLEEP_NS if device.type == "cuda" else 0  # (no inline PTX in the interpreter)


def _recall_fused(
    host_kv, gpu_kv, gpu_free, gpu_priority, gpu_to_host, host_to_gpu, indices, miss_host, meta,
    hist, stats, hs, out, stg,
) -> None:  # fmt: skip
    if host_kv.shape[1] % 16:
        raise ValueError(f"recall: row width {host_kv.shape[1]} B must be a multiple of 16")
    total, n_g = hs.numel(), gpu_to_host.shape[0]
    n_look, n_scan = _grid(total, LIST_BLOCK)[0], _grid(n_g, FUSED_SCAN_BLOCK)[0]
    n_copy, n_out = _num_copy_programs(hs.device), triton.cdiv(total, LIST_BLOCK)
    staged = stg is not None
    gpu_words = _words(gpu_kv, "gpu_kv", True)
    stg = stg or _unstaged(gpu_words, host_to_gpu, stats)
    _recall_kernel[(n_look + 2 * n_scan + n_copy + n_out + 1,)](
        _words(host_kv, "host_kv", True), gpu_words, hs, host_to_gpu, gpu_priority, gpu_free,
        gpu_to_host, indices, miss_host, meta, hist, stats, out, *stg[:5],
        total, n_g, indices.shape[0], C.reserve_slots(n_g), n_look, n_scan, n_copy, n_out, stg[5],
        UPR=host_kv.shape[1] // 16, UNITS=COPY_UNITS, LIST_BLOCK=LIST_BLOCK,
        SCAN_BLOCK=FUSED_SCAN_BLOCK, PAD=PAD_BLOCK, SKIP_CLEAN=LOOKUP_SKIP_CLEAN,
        EARLY=COPY_EARLY, CACHE=COPY_CACHE, STAGED=staged, SLEEP_NS=_sleep_ns(hs.device),
        SELF_ROWS=LOOKUP_COPY_ROWS_STAGED if staged else LOOKUP_COPY_ROWS,
        LOOK_UNITS=LOOKUP_COPY_UNITS, OUT_EARLY=RECALL_OUT_EARLY, STAMP=PROBE_LOOKUP_STAMPS,
        num_warps=LIST_WARPS,
    )  # fmt: skip


def copy_rows(
    host_kv,
    gpu_kv,
    miss_host,
    host_to_gpu,
    meta,
    stats,
    hs,
    out,
    units: int | None = None,
    programs_per_sm: int | None = None,
    warps: int | None = None,
    early: bool | None = None,
    cache: str | None = None,
    staging: tuple | None = None,
) -> None:
    """Recall's last launch: rows of miss_host[:meta[LAST_ALLOC]] -> their GPU slots (with
    ``staging``, ``staging_args``' tuple: from ``stage_kv[host_stage[h]]`` where h is staged in
    the current epoch; else from the host), and out = host_to_gpu[hs]. The other keyword
    arguments override the module's copy configuration (the benchmark tries a few)."""
    if host_kv.shape[1] % 16:
        raise ValueError(f"recall: row width {host_kv.shape[1]} B must be a multiple of 16")
    n_copy = _num_copy_programs(hs.device)
    if programs_per_sm is not None and hs.device.type == "cuda":
        n_copy = programs_per_sm * torch.cuda.get_device_properties(hs.device).multi_processor_count
    total = hs.numel()
    staged = staging is not None
    gpu_words = _words(gpu_kv, "gpu_kv", True)
    stg = staging or _unstaged(gpu_words, host_to_gpu, stats)
    _copy_out_kernel[(n_copy + triton.cdiv(total, LIST_BLOCK) + int(COPY_OWN_FINAL),)](
        _words(host_kv, "host_kv", True),
        gpu_words,
        miss_host,
        host_to_gpu,
        hs,
        out,
        meta,
        stats,
        *stg[:5],
        total,
        n_copy,
        miss_host.shape[0],
        stg[5],
        UPR=host_kv.shape[1] // 16,
        UNITS=units or COPY_UNITS,
        BLOCK=LIST_BLOCK,
        EARLY=COPY_EARLY if early is None else early,
        CACHE=COPY_CACHE if cache is None else cache,
        OWN_FINAL=COPY_OWN_FINAL,  # the grid has the finalising program of its own
        STAGED=staged,
        num_warps=warps or COPY_WARPS,
        **_pdl(hs.device),
    )


def release_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, host_slots) -> None:
    hs = host_slots.reshape(-1)
    _release_kernel[_grid(hs.numel(), LIST_BLOCK)](
        hs,
        host_to_gpu,
        gpu_to_host,
        gpu_priority,
        gpu_free,
        meta,
        hs.numel(),
        host_to_gpu.shape[0],
        gpu_to_host.shape[0],
        BLOCK=LIST_BLOCK,
        num_warps=4,
    )


def release_layers_cuda(gpu_free, gpu_priority, gpu_to_host, host_to_gpu, meta, ema,
                        host_slots) -> None:  # fmt: skip
    """echo::release_layers' CUDA path: one launch, a grid row per layer; the layers' buffers
    reach it as a table of their addresses (one small pinned copy)."""
    hs = host_slots.reshape(-1)
    cols = [host_to_gpu, gpu_to_host, gpu_priority, gpu_free, meta] + ([ema] if ema else [])
    ptrs = [[t.data_ptr() for t in col] for col in cols]
    pinned = hs.is_cuda  # (the interpreter tests run it on CPU tensors)
    table = torch.tensor(ptrs, dtype=torch.int64, pin_memory=pinned)
    table = table.to(hs.device, non_blocking=True)
    n_layers = len(meta)
    _release_layers_kernel[(_grid(hs.numel(), LIST_BLOCK)[0], n_layers)](
        hs,
        table,
        hs.numel(),
        host_to_gpu[0].shape[0],
        gpu_to_host[0].shape[0],
        n_layers,
        ema[0].shape[1] if ema else 0,
        FORGET=bool(ema),
        EMA_ROWS=ema[0].shape[0] if ema else 1,
        BLOCK=LIST_BLOCK,
        num_warps=4,
    )


def offload_cuda(host_kv, index_k, rows, index_rows, slots) -> None:
    """echo::offload's CUDA path (kv_cache.py): rows [T, row] -> host_kv, index rows [T, 132] ->
    the paged indexer cache, for slots >= 0."""
    t = slots.shape[0]
    if t == 0:
        return
    row_w = host_kv.shape[1] // 4
    _offload_kernel[(t,)](
        _words(host_kv, "host_kv", True),
        index_k.view(torch.int32),
        _words(rows, "rows", False),
        _words(index_rows, "index_rows", False),
        slots.contiguous(),
        ROW_W=row_w,
        ROW_WP=triton.next_power_of_2(row_w),
        num_warps=2,
    )
