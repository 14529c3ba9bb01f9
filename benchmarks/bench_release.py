"""A finished request's release in every layer's GPU pool: one ``echo::release`` launch per layer
(and the prefetch threshold reset per layer), as ``KVCache.release`` did, against
``echo::release_layers``, one launch for all layers (what it does now), and on a GPU that op's
CUDA launcher alone (``launcher``: the op less its dispatch and input checks).

    python -m benchmarks.bench_release --out $OUT/release_h200.json

Release runs between decode steps, outside the CUDA graphs, so its cost is the host's: the
engine's loop is held up while the launches are made. Per request length (its host slots: whole
pages of 64) and way, median over ``--reps`` calls, each from the same pool state (restored
outside the timed window): ``host_us`` (the call returns: the time the engine loop waits) and
``total_us`` (the call and a device synchronize: when its work is done). The layers' pools are
full, every slot of the request resident in each, as when a request ends after its last step.
Checked first: every way leaves every layer's maps, meta and threshold state equal (ring order up
to the blocks' atomics).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from custom_ops import cache_layout as C
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.gpu_pool import GpuPool
from custom_ops.kv_format import PAGE
from custom_ops.prefetch_layout import EMA_ROWS

BUFFERS = ("gpu_free", "gpu_priority", "gpu_to_host", "host_to_gpu", "meta")


def make_layers(n_layers: int, n_g: int, n_h: int, device) -> tuple[list[GpuPool], list]:
    """``n_layers`` pools of ``n_g`` slots, each holding host slots 0 .. n_g - 1 (slot g in GPU
    slot g, stamp 0, the ring empty), and each layer's threshold state, all ones."""
    pools = []
    for _ in range(n_layers):
        pool = GpuPool(CacheConfig(1, n_h, n_g, 2048, max_batch=1), device)
        g = torch.arange(n_g, dtype=torch.int32, device=device)
        pool.host_to_gpu[:n_g] = g
        pool.gpu_to_host.copy_(g)
        pool.gpu_priority.zero_()
        pool.meta.zero_()  # HEAD 0, NFREE 0: every slot occupied
        pools.append(pool)
    ema = [torch.ones(EMA_ROWS, n_h // PAGE + 1, device=device) for _ in range(n_layers)]
    return pools, ema


def per_layer(pools, ema, slots: torch.Tensor) -> None:
    """The release as a launch per layer: echo::release, then the threshold reset."""
    slots32 = slots.to(torch.int32)
    h = slots.reshape(-1).long()
    for pool, e in zip(pools, ema, strict=True):
        pool.release(slots32)
        e.index_fill_(1, torch.where(h >= 0, h // PAGE, e.shape[1] - 1), 0.0)


def one_launch(pools, ema, slots: torch.Tensor) -> None:
    lists = [[getattr(p, name) for p in pools] for name in BUFFERS]
    torch.ops.echo.release_layers(*lists, ema, slots)


def launcher(pools, ema, slots: torch.Tensor) -> None:
    """echo::release_layers' CUDA launcher alone: the op's cost less its dispatch and checks."""
    from custom_ops.cache_kernels import release_layers_cuda

    release_layers_cuda(*[[getattr(p, name) for p in pools] for name in BUFFERS], ema, slots)


WAYS = {"per_layer": per_layer, "one_launch": one_launch, "launcher": launcher}


def snapshot(pools, ema) -> list[torch.Tensor]:
    return [getattr(p, n).clone() for p in pools for n in BUFFERS] + [e.clone() for e in ema]


def restore(pools, ema, snap: list[torch.Tensor]) -> None:
    live = [getattr(p, n) for p in pools for n in BUFFERS] + list(ema)
    for t, s in zip(live, snap, strict=True):
        t.copy_(s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state(pools, ema) -> list:
    """What every way must agree on: each layer's resident host slots, meta, ring contents (as a
    set) and threshold state."""
    out = []
    for p, e in zip(pools, ema, strict=True):
        head, nfree, n_g = int(p.meta[C.HEAD]), int(p.meta[C.NFREE]), p.gpu_free.numel()
        ring = p.gpu_free[(head + torch.arange(nfree, device=p.meta.device)) % n_g]
        resident = torch.nonzero(p.host_to_gpu >= 0).flatten()
        out.append((resident.tolist(), p.meta.tolist(), sorted(ring.tolist()), e.sum().item()))
    return out


def bench(n_layers: int, n_g: int, n_h: int, pages: list[int], reps: int, device) -> dict:
    pools, ema = make_layers(n_layers, n_g, n_h, device)
    snap = snapshot(pools, ema)
    res: dict = {}
    # (the launcher needs a GPU, or the interpreter: TRITON_INTERPRET=1)
    ways = {k: w for k, w in WAYS.items() if k != "launcher" or device.type == "cuda"}
    for n in pages:
        slots = torch.arange(n * PAGE, dtype=torch.int64, device=device)
        after = {}
        for name, way in ways.items():  # checked (and warmed: Triton compiles) first
            restore(pools, ema, snap)
            way(pools, ema, slots)
            sync(device)
            after[name] = state(pools, ema)
        row: dict = {
            "tokens": n * PAGE,
            "equal": all(a == after["per_layer"] for a in after.values()),
        }
        for name, way in ways.items():
            host, total = [], []
            for _ in range(reps):
                restore(pools, ema, snap)
                sync(device)
                t0 = time.perf_counter()
                way(pools, ema, slots)
                t1 = time.perf_counter()
                sync(device)
                t2 = time.perf_counter()
                host.append((t1 - t0) * 1e6)
                total.append((t2 - t0) * 1e6)
            row[name] = {"host_us": statistics.median(host), "total_us": statistics.median(total)}
        row["host_speedup"] = row["per_layer"]["host_us"] / row["one_launch"]["host_us"]
        res[str(n)] = row
        print(f"{n:6d} pages: per layer {row['per_layer']['host_us']:8.1f} us host "
              f"{row['per_layer']['total_us']:8.1f} total | one launch "
              f"{row['one_launch']['host_us']:7.1f} host {row['one_launch']['total_us']:7.1f} "
              f"total | equal {row['equal']}", flush=True)  # fmt: skip
    return res


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results JSON path")
    ap.add_argument("--layers", type=int, default=61, help="layers (V3.2: 61)")
    ap.add_argument("--gpu-tokens", type=int, default=200_000, help="GPU pool slots per layer")
    ap.add_argument("--host-tokens", type=int, default=1 << 21, help="host slots per layer")
    ap.add_argument("--pages", default="1,16,256,1600", help="request lengths in pages of 64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    pages = [int(p) for p in a.pages.split(",")]
    if max(pages) * PAGE > min(a.gpu_tokens, a.host_tokens):
        ap.error(f"--pages up to {max(pages)} need {max(pages) * PAGE} resident slots: more "
                 f"than --gpu-tokens {a.gpu_tokens} or --host-tokens {a.host_tokens}")  # fmt: skip
    with torch.no_grad():
        rows = bench(a.layers, a.gpu_tokens, a.host_tokens, pages, a.reps, device)
    out = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "layers": a.layers, "gpu_tokens": a.gpu_tokens, "host_tokens": a.host_tokens,
        "reps": a.reps, "by_pages": rows,
    }  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
