"""echo::release_layers: a finished request's host slots forgotten in every layer's pool (and its
prefetch threshold state reset) in one launch, against the reference (echo::release per layer)
on fresh random states; its refusals; KVCache.release through it."""

from __future__ import annotations

import copy

import pytest
import torch

from custom_ops import cache_kernels as K
from custom_ops import cache_layout as L
from custom_ops import cache_ops as C
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool
from custom_ops.cache.invariants import check_pool, fill_random
from custom_ops.kv_format import PAGE
from custom_ops.prefetch_layout import EMA_ROWS

N_H = 4096


def _layers(n_layers: int, n_g: int, device: str, seed: int, forget: bool):
    """``n_layers`` pools of ``n_g`` slots over N_H host slots, each filled at random to its own
    occupancy, and (``forget``) each layer's threshold state, random and nonzero."""
    gen = torch.Generator().manual_seed(seed)
    pools = []
    for _ in range(n_layers):
        pool = GpuPool(CacheConfig(1, N_H, n_g, 32, max_batch=4), device)
        occ = int(torch.randint(1, n_g + 1, (1,), generator=gen))
        fill_random(pool, occ, gen)
        pools.append(pool)
    ema = [
        (torch.rand(EMA_ROWS, N_H // PAGE + 1, generator=gen) + 0.5).to(device)
        for _ in range(n_layers if forget else 0)
    ]
    return pools, ema, gen


def _args(pools, ema):
    return (
        [p.gpu_free for p in pools], [p.gpu_priority for p in pools],
        [p.gpu_to_host for p in pools], [p.host_to_gpu for p in pools],
        [p.meta for p in pools], ema,
    )  # fmt: skip


def _resident(p) -> dict[int, int]:
    h2g = p.host_to_gpu.long().cpu()
    h = torch.nonzero(h2g >= 0).flatten()
    return dict(zip(h.tolist(), p.gpu_priority.long().cpu()[h2g[h]].tolist(), strict=True))


def _ring(p) -> list[int]:
    n_g, head, nfree = p.gpu_free.numel(), int(p.meta[L.HEAD]), int(p.meta[L.NFREE])
    return p.gpu_free.cpu()[(head + torch.arange(nfree)) % n_g].tolist()


@pytest.mark.parametrize(
    "n_layers,n_g,m,forget",
    [(1, 64, 70, True), (3, 256, 300, True), (4, 1100, 1, False), (5, 2500, 3000, True)],
)
def test_release_layers_kernel_matches_the_reference(n_layers, n_g, m, forget, device):
    """Every layer ends as echo::release alone leaves it (residents, meta, the old ring kept and
    the same slots pushed behind it, as a set: their order comes from the blocks' atomics) and
    its threshold state equal to the reference's exactly; host slots past the pool or -1 are
    ignored."""
    pools, ema, gen = _layers(n_layers, n_g, device, seed=n_layers * 7 + m, forget=forget)
    slots = torch.randint(-1, N_H, (m,), generator=gen).to(device)
    ref_pools, ref_ema = copy.deepcopy(pools), [e.clone() for e in ema]
    for p in ref_pools:  # the reference of the reference: the one-layer op
        C.release_ref(p.gpu_free, p.gpu_priority, p.gpu_to_host, p.host_to_gpu, p.meta, slots)
    C.release_layers_ref(*_args(copy.deepcopy(pools), [e.clone() for e in ema]), slots)
    pages = torch.unique(slots[slots >= 0].cpu() // PAGE)
    for e in ref_ema:
        e[:, pages.to(device)] = 0.0
    old = [_ring(p) for p in pools]
    K.release_layers_cuda(*_args(pools, ema), slots)
    for i, (ker, ref) in enumerate(zip(pools, ref_pools, strict=True)):
        check_pool(ker)
        assert _resident(ker) == _resident(ref), i
        assert torch.equal(ker.meta, ref.meta), i
        assert _ring(ker)[: len(old[i])] == old[i] and sorted(_ring(ker)) == sorted(_ring(ref))
    for e, r in zip(ema, ref_ema, strict=True):
        assert torch.equal(e, r)
    assert all(not e[:, pages.to(device)].any() for e in ema)


def test_release_layers_reference_is_release_per_layer():
    """The op's reference (CPU's path) is echo::release on each layer, exactly (placement order
    included), and zeroes exactly the slots' page columns of every threshold state."""
    pools, ema, gen = _layers(3, 128, "cpu", seed=5, forget=True)
    slots = torch.randint(-1, N_H, (200,), generator=gen)
    ref = copy.deepcopy(pools)
    for p in ref:
        torch.ops.echo.release(p.gpu_free, p.gpu_priority, p.gpu_to_host, p.host_to_gpu, p.meta,
                               slots)  # fmt: skip
    before = [e.clone() for e in ema]
    torch.ops.echo.release_layers(*_args(pools, ema), slots)
    for p, r in zip(pools, ref, strict=True):
        for a, b in zip(_args([p], [])[:5], _args([r], [])[:5], strict=True):
            assert torch.equal(a[0], b[0])
    pages = set((slots[slots >= 0] // PAGE).tolist())
    kept = [c not in pages for c in range(ema[0].shape[1])]
    for e, b in zip(ema, before, strict=True):
        zeroed = set(torch.nonzero((e == 0).all(0)).flatten().tolist())
        assert zeroed == pages and torch.equal(e[:, kept], b[:, kept])


def test_release_layers_opcheck():
    pools, ema, gen = _layers(2, 64, "cpu", seed=1, forget=True)
    slots = torch.randint(-1, N_H, (100,), generator=gen)
    torch.library.opcheck(torch.ops.echo.release_layers.default, (*_args(pools, ema), slots))


@pytest.mark.parametrize(
    "bad,match",
    [
        ("short", "gpu_priority has 1 layers, meta 2"),
        ("none", "gpu_free has 0 layers, meta 0"),
        ("ema_count", "ema has 1 layers, meta 2"),
        ("size", r"host_to_gpu\[1\] is torch.int32 \[2048\]"),
        ("ema_shape", r"ema\[0\] must be contiguous float32 \[rows, 65\]"),
        ("slots", "host_slots must be int32/int64"),
    ],
)
def test_release_layers_refuses_mismatched_layers(bad, match):
    pools, ema, _ = _layers(2, 64, "cpu", seed=2, forget=True)
    args = list(_args(pools, ema))
    slots = torch.arange(64)
    if bad == "short":
        args[1] = args[1][:1]
    elif bad == "none":
        args = [[], [], [], [], [], []]
    elif bad == "ema_count":
        args[5] = args[5][:1]
    elif bad == "size":
        args[3] = [args[3][0], args[3][1][:2048]]
    elif bad == "ema_shape":
        args[5] = [e[:, :-1].contiguous() for e in args[5]]
    elif bad == "slots":
        slots = slots.float()
    with pytest.raises(ValueError, match=match):
        torch.ops.echo.release_layers(*args, slots)


def test_bench_release_runs_and_both_ways_agree(tmp_path):
    """benchmarks/bench_release.py on CPU at small sizes: both ways leave the same state, and the
    results file has a row per request length with both ways' times."""
    import json

    from benchmarks import bench_release as B

    out = tmp_path / "release.json"
    B.main(["--layers", "3", "--gpu-tokens", "2048", "--host-tokens", "4096", "--pages", "1,8",
            "--reps", "2", "--device", "cpu", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["by_pages"]
    assert list(rows) == ["1", "8"] and all(r["equal"] for r in rows.values())
    assert all(r[w]["host_us"] > 0 for r in rows.values() for w in ("per_layer", "one_launch"))
    with pytest.raises(SystemExit):  # a request longer than the pools
        B.main(["--gpu-tokens", "64", "--host-tokens", "128", "--pages", "2", "--device", "cpu"])
