"""Host time of the scheduler's page allocator (runtime/host_slots.py) at a request's admission
and finish, on the CPU: the finishing step of a decode batch frees every finished request's pages
between two graph launches, with the GPU idle.

    python -m benchmarks.bench_host_slots [--pool-tokens N] [--context T] [--requests R]

Fills a host pool of N tokens with R requests of T tokens each (their pages interleaved, as
requests admitted and freed over time leave them), then times freeing them one by one and
allocating them again; ms per request, the median of --reps rounds."""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from custom_ops.kv_format import PAGE
from runtime.host_slots import HostSlotAllocator


def one_round(pool_pages: int, pages: int, requests: int, seed: int) -> tuple[float, float]:
    alloc = HostSlotAllocator(pool_pages)
    rng = random.Random(seed)
    held = [alloc.alloc(pages) for _ in range(requests)]
    # interleave: free every other request and refill, so later requests hold scattered pages
    for i in range(0, requests, 2):
        alloc.free(held[i])
    for i in range(0, requests, 2):
        held[i] = alloc.alloc(pages)
    rng.shuffle(held)
    t0 = time.perf_counter()
    for p in held:
        alloc.free(p)
    t_free = (time.perf_counter() - t0) / requests
    t0 = time.perf_counter()
    for _ in range(requests):
        alloc.alloc(pages)
    t_alloc = (time.perf_counter() - t0) / requests
    return t_free, t_alloc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool-tokens", type=int, default=64 * 100_000 + 64 * 40_000)
    p.add_argument("--context", type=int, default=90_000, help="tokens per request")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/host_slots_cpu.json")
    a = p.parse_args(argv)
    pages = -(-a.context // PAGE)
    pool_pages = a.pool_tokens // PAGE
    if pages * a.requests > pool_pages:
        raise SystemExit(f"{a.requests} requests of {pages} pages exceed the pool's {pool_pages}")
    rounds = [one_round(pool_pages, pages, a.requests, s) for s in range(a.reps)]
    res = {
        "pool_pages": pool_pages,
        "pages_per_request": pages,
        "requests": a.requests,
        "free_ms_per_request": 1e3 * statistics.median(r[0] for r in rounds),
        "alloc_ms_per_request": 1e3 * statistics.median(r[1] for r in rounds),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
        "python": platform.python_version(),
    }
    print(
        f"{a.requests} requests x {pages} pages, pool {pool_pages} pages: free "
        f"{res['free_ms_per_request']:.3f} ms, alloc {res['alloc_ms_per_request']:.3f} ms a request"
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
