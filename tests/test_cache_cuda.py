"""GPU tests of the cache manager (run on the H200: ``pytest -m cuda tests/test_cache_cuda.py``).

- the pinned host pool is UVA memory that kernels read and write, one allocation per layer;
- every Triton kernel matches its reference at full size (N_G = 200K, N_H = 2M, B = 64,
  k = 2048; the bf16 host layer is 2.3 GB, so row offsets pass 2 GiB) on fresh random inputs;
- recall captured in a CUDA graph replays correctly with new selections (live counters);
- a decode step of store + fetch compiled with mode="reduce-overhead" and fullgraph=True has no
  graph break and no cudagraph skip, and matches eager execution.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_cache_ops import CacheStep, assert_same_up_to_ties, selection, state

from custom_ops import cache_kernels as K
from custom_ops import cache_layout as L
from custom_ops import cache_ops as C
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool
from custom_ops.cache.host_pool import PinnedRows, allocate_host_rows
from custom_ops.cache.invariants import check_pool, fill_random
from custom_ops.cache.kv_cache import KVCache
from custom_ops.cache_ref import offload_ref
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE

pytestmark = pytest.mark.cuda

# Full sizes of the issue; ECHO_CACHE_TEST_SMALL=1 shrinks them (to dry-run this file on a CPU).
SMALL = os.environ.get("ECHO_CACHE_TEST_SMALL") == "1"
N_G, N_H, B, TOPK = (3000, 16384, 8, 64) if SMALL else (200_000, 2_097_152, 64, 2048)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def host_rows(n_h: int, row: int) -> torch.Tensor:
    """A random host layer: pinned UVA memory on CUDA, filled by a GPU kernel writing over PCIe."""
    if DEV == "cuda":
        host = allocate_host_rows(1, n_h, row, torch.device(DEV), pinned=True)[0]
    else:
        host = torch.empty(n_h, row, dtype=torch.uint8)
    return host.random_(0, 256)


def full_pool(fmt: str, gen: torch.Generator):
    cfg = CacheConfig(1, N_H, N_G, TOPK, fmt=fmt, max_batch=B)
    host = host_rows(N_H, cfg.row_bytes)
    pool = GpuPool(cfg, DEV)
    fill_random(pool, N_G, gen, host_kv=host)
    return pool, host


def test_pinned_host_pool_is_uva(caplog):
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    with caplog.at_level("INFO", logger="custom_ops.cache.host_pool"):
        layers = allocate_host_rows(2, 4096, 656, torch.device("cuda"), pinned=True)
    assert "2 layers x 4096 rows x 656 B = 0.0 GiB pinned in" in caplog.text
    assert all(t.is_cuda and t.shape == (4096, 656) for t in layers)
    assert layers[0].data_ptr() != layers[1].data_ptr()
    assert not bool(layers[0].any())  # zeroed at allocation
    before = torch.cuda.memory_allocated()
    pr = PinnedRows(4096, 656, torch.device("cuda"))
    dev_view, cpu_view = pr.cuda(), pr.cpu()
    assert torch.cuda.memory_allocated() == before  # the pool is host memory, not device memory
    assert dev_view.data_ptr() == pr.dptr and cpu_view.data_ptr() == pr.ptr
    src = torch.randint(0, 256, (4096, 656), dtype=torch.uint8)
    cpu_view.copy_(src)  # host writes, GPU reads
    assert torch.equal((dev_view + 0).cpu(), src)  # read by a kernel, through UVA
    rows = torch.randint(0, 256, (64, 656), dtype=torch.uint8, device="cuda")
    irows = torch.zeros(64, INDEX_ROW_BYTES, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(4096, device="cuda")[:64]
    index_k = torch.zeros(4096 // PAGE, INDEX_PAGE_BYTES, dtype=torch.uint8, device="cuda")
    K.offload_cuda(dev_view, index_k, rows, irows, slots)  # GPU kernel writes host memory
    torch.cuda.synchronize()
    assert torch.equal(cpu_view[slots.cpu()], rows.cpu())


@pytest.mark.parametrize("mode", ["one-launch", "launches", "pdl", "copy-programs"])
def test_full_size_steady_recall_pops_the_ring(mode, monkeypatch):
    """A recall of 37 misses with free slots to spare (the steady step of issue 18) takes the
    ring's 37 entries from HEAD (the last program moves HEAD: the handoff), evicts nothing, in
    one launch, in a launch per phase and with programmatic dependent launch; eagerly and
    replayed from a CUDA graph, and matches the reference up to placement (the miss list's order
    comes from the lookup blocks' atomics)."""
    monkeypatch.setattr(K, "FUSED", mode in ("one-launch", "copy-programs"))
    monkeypatch.setattr(K, "LAUNCH_PDL", mode == "pdl")
    if mode == "copy-programs":  # no lookup program copies a row
        monkeypatch.setattr(K, "LOOKUP_COPY_ROWS", 0)
    gen = torch.Generator().manual_seed(SEED + 1)
    print(f"seed {SEED + 1}")
    cfg = CacheConfig(1, N_H, N_G, TOPK, fmt="fp8", max_batch=B)
    host = host_rows(N_H, cfg.row_bytes)
    pool = GpuPool(cfg, DEV)
    fill_random(pool, N_G - min(4096, N_G // 8), gen, host_kv=host)
    hs = selection(pool, gen, B, TOPK, B * TOPK - 37, 37, pad=False)
    ref, ker, graphed = copy.deepcopy(pool), copy.deepcopy(pool), copy.deepcopy(pool)
    C.recall_ref(host, ref.gpu_kv, *state(ref), ref.indices, ref.miss_host, ref.meta, ref.totals,
                 hs)  # fmt: skip
    out = K.recall_cuda(host, ker.gpu_kv, *state(ker), ker.indices, ker.miss_host, ker.meta,
                        ker.hist, ker.totals, hs)  # fmt: skip
    runs = [(ker, out)]
    if DEV == "cuda":  # the kernels are compiled by the eager call: capture, then replay
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            g_out = K.recall_cuda(host, graphed.gpu_kv, *state(graphed), graphed.indices,
                                  graphed.miss_host, graphed.meta, graphed.hist, graphed.totals,
                                  hs)  # fmt: skip
        g.replay()
        torch.cuda.synchronize()
        runs.append((graphed, g_out))
    head = int(pool.meta[L.HEAD])
    popped = pool.gpu_free[(head + torch.arange(37, device=DEV)) % N_G].sort().values
    for p, o in runs:
        check_pool(p, selected=hs, gpu_slots=o, host_kv=host)
        assert int(p.meta[L.LAST_EVICT]) == 0 and int(p.meta[L.LAST_MISS]) == 37
        assert int(p.meta[L.HEAD]) == (head + 37) % N_G
        miss = pool.host_to_gpu[hs.flatten().long()] < 0
        assert torch.equal(o.flatten()[miss].sort().values, popped)
        assert torch.equal(p.gpu_kv[o.flatten().long()], host[hs.flatten().long()])
        assert_same_up_to_ties(pool, ref, p)


@pytest.mark.parametrize(
    "fused, lookup_rows", [(True, K.LOOKUP_COPY_ROWS), (True, 0), (False, 0)],
    ids=["one-launch", "copy-programs", "launches"],
)  # fmt: skip
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_full_size_kernels_match_reference(fmt, fused, lookup_rows, monkeypatch):
    monkeypatch.setattr(K, "FUSED", fused)
    monkeypatch.setattr(K, "LOOKUP_COPY_ROWS", lookup_rows)
    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    pool, host = full_pool(fmt, gen)
    check_pool(pool, host_kv=host)
    # recall at hit rates 0.97 (with duplicates) and 0.5, then again on the state it left
    for hits, misses, dups in (
        (B * TOPK * 97 // 100, B * TOPK * 3 // 100, 500),
        (B * TOPK // 2, B * TOPK // 2, 0),
    ):
        hs = selection(pool, gen, B, TOPK, hits, misses, dups, pad=False)
        ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
        o_ref = C.recall_ref(
            host, ref.gpu_kv, *state(ref), ref.indices, ref.miss_host, ref.meta, ref.totals, hs
        )
        o_ker = K.recall_cuda(
            host,
            ker.gpu_kv,
            *state(ker),
            ker.indices,
            ker.miss_host,
            ker.meta,
            ker.hist,
            ker.totals,
            hs,
        )
        check_pool(ker, selected=hs, gpu_slots=o_ker, host_kv=host)
        valid = hs >= 0
        assert torch.equal(ker.gpu_kv[o_ker[valid].long()], host[hs[valid].long()])
        assert_same_up_to_ties(pool, ref, ker)
        del ref, o_ref
        pool = ker
    # free then allocate
    cap = pool.capacity
    prot = selection(pool, gen, B, TOPK, B * TOPK // 4, 0)  # leaves enough evictable slots
    n = torch.tensor([cap * 2 // 3], dtype=torch.int32, device=DEV)
    ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
    C.free_ref(*state(ref), ref.indices, ref.meta, ref.totals, prot, n)
    K.free_cuda(*state(ker), ker.indices, ker.meta, ker.hist, ker.totals, prot, n)
    check_pool(ker)
    assert_same_up_to_ties(pool, ref, ker)
    pool = ker
    non = torch.nonzero(pool.host_to_gpu < 0).flatten()
    want = non[torch.randperm(non.numel(), generator=gen)[:cap].to(DEV)].int()
    ref, ker = copy.deepcopy(pool), copy.deepcopy(pool)
    C.allocate_ref(*state(ref), ref.indices, ref.meta, want, n)
    K.allocate_cuda(*state(ker), ker.indices, ker.meta, want, n)
    check_pool(ker)
    # one program popping the ring's head in want order: exactly the reference
    assert torch.equal(ref.host_to_gpu, ker.host_to_gpu) and torch.equal(ref.meta, ker.meta)
    assert torch.equal(ker.indices[: int(n)], ker.host_to_gpu[want[: int(n)].long()])
    # release a large list with duplicates and out-of-pool entries
    lst = torch.randint(-1, N_H, (B * TOPK,), generator=gen).to(DEV)
    ref, ker = copy.deepcopy(ker), ker
    C.release_ref(*state(ref), ref.meta, lst)
    K.release_cuda(*state(ker), ker.meta, lst)
    check_pool(ker)  # (no row check: allocate maps slots, copying rows is recall's job)
    assert torch.equal(ref.host_to_gpu, ker.host_to_gpu) and torch.equal(ref.meta, ker.meta)


@pytest.mark.parametrize("fmt,t", [("fp8", 64), ("bf16", 2048)])
def test_offload_kernel_full_size(fmt, t):
    gen = torch.Generator().manual_seed(SEED + t)
    row = 656 if fmt == "fp8" else 1152
    host = host_rows(N_H, row)
    index_k = torch.randint(0, 256, (N_H // PAGE, INDEX_PAGE_BYTES), dtype=torch.uint8, device=DEV)
    rows = torch.randint(0, 256, (t, row), dtype=torch.uint8, device=DEV)
    irows = torch.randint(0, 256, (t, INDEX_ROW_BYTES), dtype=torch.uint8, device=DEV)
    slots = torch.randperm(N_H, generator=gen)[:t]
    slots[:8] = torch.arange(N_H - 8, N_H)  # the last rows: byte offsets past 2 GiB in bf16
    slots[8:12] = -1
    slots = slots.to(DEV)
    h_ref, i_ref = host + 0, index_k.clone()  # a kernel reads the pinned rows (no memcpy)
    offload_ref(h_ref, i_ref, rows, irows, slots)
    K.offload_cuda(host, index_k, rows, irows, slots)
    assert torch.equal(host, h_ref) and torch.equal(index_k, i_ref)


def test_recall_in_cuda_graph_replays_with_new_selections():
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(SEED + 1)
    pool, host = full_pool("fp8", gen)
    static_hs = selection(pool, gen, B, TOPK, B * TOPK - 37, 37)
    pool.recall(host, static_hs)  # warm-up: compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pool.recall(host, static_hs)
    for step, misses in enumerate((37, 4000, 37)):  # every replay reads the live counters
        static_hs.copy_(selection(pool, gen, B, TOPK, B * TOPK - misses, misses))
        ref = copy.deepcopy(pool)
        o_ref = C.recall_ref(
            host,
            ref.gpu_kv,
            *state(ref),
            ref.indices,
            ref.miss_host,
            ref.meta,
            ref.totals,
            static_hs,
        )
        before = copy.deepcopy(pool)
        graph.replay()
        torch.cuda.synchronize()
        check_pool(pool, selected=static_hs, gpu_slots=out, host_kv=host)
        assert int(pool.meta[L.LAST_MISS]) == misses, step
        assert_same_up_to_ties(before, ref, pool)
        assert torch.equal(pool.gpu_kv[out.flatten().long()], ref.gpu_kv[o_ref.flatten().long()])


def test_compiled_step_reduce_overhead_no_skips():
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = CacheConfig(2, 65536, 8192, 256, fmt="fp8", max_batch=8)
    step = torch.compile(CacheStep(KVCache(cfg, "cuda")), mode="reduce-overhead", fullgraph=True)
    eager = CacheStep(KVCache(cfg, "cuda"))  # same (empty) start state
    gen = torch.Generator().manual_seed(SEED + 2)
    written = torch.randperm(65536, generator=gen)
    pos = 0
    with torch.no_grad():
        for i in range(5):
            new = written[pos : pos + 8].cuda()
            pos += 8
            rows = torch.randint(0, 256, (8, 656), dtype=torch.uint8, device="cuda")
            irows = torch.randint(0, 256, (8, INDEX_ROW_BYTES), dtype=torch.uint8, device="cuda")
            seen = written[:pos]
            hs = seen[torch.randint(0, pos, (8, 256), generator=gen)].int().cuda()
            hs[torch.rand(8, 256, generator=gen) < 0.1] = -1
            got = step(rows, irows, new, hs).clone()
            want = eager(rows, irows, new, hs)
            assert torch.equal(got, want), i
    for layer in step._orig_mod.cache.layers:
        check_pool(layer.pool, host_kv=layer.host_kv)
    print(dict(counters["inductor"]), dict(counters["graph_break"]))
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"]["cudagraph_partitions"] == 0
    assert not counters["graph_break"]
