"""Host time of the scheduler's page allocator (runtime/host_slots.py) at requests' finishes and
admissions, on the CPU: that work runs between two decode steps, with the GPU idle.

    python -m benchmarks.bench_host_slots [--pool-tokens N] [--context T] [--requests R]

Two patterns, ms per request, the median of --reps rounds:
- burst: R requests of T tokens hold the pool; all finish in one step (frees, in random order),
  then R are admitted (allocs);
- churn: the pool holds R requests; each step one random request finishes and one is admitted
  (a free and an alloc per step, as steady serving with a waiting queue does).
Plus the prefix cache (runtime/prefix_cache.py) on one request of T tokens: registering its
pages, matching its whole prompt from scratch, and continuing a remembered match (what a waiting
request costs each schedule).
"""

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
from runtime.prefix_cache import PrefixCache


def burst(pool_pages: int, pages: int, requests: int, seed: int) -> tuple[float, float]:
    alloc = HostSlotAllocator(pool_pages)
    held = [alloc.alloc(pages) for _ in range(requests)]
    random.Random(seed).shuffle(held)
    t0 = time.perf_counter()
    for p in held:
        alloc.free(p)
    t_free = (time.perf_counter() - t0) / requests
    t0 = time.perf_counter()
    for _ in range(requests):
        alloc.alloc(pages)
    return t_free, (time.perf_counter() - t0) / requests


def churn(pool_pages: int, pages: int, requests: int, seed: int, steps: int = 64) -> float:
    alloc = HostSlotAllocator(pool_pages)
    held = [alloc.alloc(pages) for _ in range(requests)]
    rng = random.Random(seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        alloc.free(held.pop(rng.randrange(len(held))))
        held.append(alloc.alloc(pages))
    return (time.perf_counter() - t0) / steps


def prefix_cache(pool_pages: int, pages: int, seed: int) -> tuple[float, float, float]:
    """Seconds to register ``pages`` pages of one sequence, to match them from scratch, and to
    continue a match that found them all."""
    alloc = HostSlotAllocator(pool_pages)
    cache = PrefixCache(alloc)
    rng = random.Random(seed)
    tokens = [rng.randrange(129280) for _ in range(pages * PAGE)]
    held = alloc.alloc(pages)
    t0 = time.perf_counter()
    cache.register(tokens, held, 0, pages)
    t1 = time.perf_counter()
    found = cache.match(tokens, pages)
    t2 = time.perf_counter()
    cache.match(tokens, pages, found)
    t3 = time.perf_counter()
    assert found == held
    return t1 - t0, t2 - t1, t3 - t2


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
    rounds = [burst(pool_pages, pages, a.requests, s) for s in range(a.reps)]
    cycles = [churn(pool_pages, pages, a.requests, s) for s in range(a.reps)]
    prefix = [prefix_cache(pool_pages, pages, s) for s in range(a.reps)]
    res = {
        "pool_pages": pool_pages,
        "pages_per_request": pages,
        "requests": a.requests,
        "burst_free_ms_per_request": 1e3 * statistics.median(r[0] for r in rounds),
        "burst_alloc_ms_per_request": 1e3 * statistics.median(r[1] for r in rounds),
        "churn_free_and_alloc_ms": 1e3 * statistics.median(cycles),
        "prefix_register_ms": 1e3 * statistics.median(r[0] for r in prefix),
        "prefix_match_ms": 1e3 * statistics.median(r[1] for r in prefix),
        "prefix_match_continued_ms": 1e3 * statistics.median(r[2] for r in prefix),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
        "python": platform.python_version(),
    }
    print(
        f"{a.requests} requests x {pages} pages, pool {pool_pages} pages: burst free "
        f"{res['burst_free_ms_per_request']:.3f} ms, alloc {res['burst_alloc_ms_per_request']:.3f} "
        f"ms a request; churn {res['churn_free_and_alloc_ms']:.3f} ms a free + alloc; prefix "
        f"cache on one request: register {res['prefix_register_ms']:.3f} ms, match "
        f"{res['prefix_match_ms']:.3f} ms, continued {res['prefix_match_continued_ms']:.4f} ms"
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
