"""Calibrate the bench's locality model (model/locality.py): for a few knob values λ, the real
indexer's consecutive-step top-k overlap per layer, and the GPU-pool hit rate per layer at pools of
~1.5x, ~4x and ~10x top-k rows per request (docs/prefetch.md, "Locality model").

    python -m benchmarks.calibrate_locality --out $OUT/calibrate_locality_h200.json  (H200, < 150 s)
    python -m benchmarks.calibrate_locality --dry-run --out /tmp/cal.json          (CPU, tiny)

Decode-only, as the bench: each request's prompt KV is injected (``RandomPromptKV``), then a few
eager decode steps run (eager: ``OverlapProbe`` wraps each layer's ``select``, which a compiled
step never calls back). The selections are the indexer's own on the planted weights: nothing is
injected into them. Per knob the warm-up runs until the pool is full (every layer, or a cap of
steps; the usage is recorded: below ~95% nothing was evicted yet and the hit rate is an unbounded
pool's over the warm-up), then the stats are reset and the measured steps give the hit rate
(engine metrics) and the overlap (|S_t ∩ S_t-1| / |S_t-1| per
request and layer, averaged). The weights are planted in place, λ increasing from 0 (0 = the
weights as drawn); the overlap comes from the first pool's engine (the attended set is the exact
top-k whatever the pool: lossless). Prints the λ whose deep-layer mean overlap is closest to the
published ~42% (35-50%, TensorRT-LLM, SWE-Bench 64K) and the layers 0-1 overlap next to ~1-2%.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from custom_ops.kv_format import PAGE, pages_for
from echo_compile.bench.harness import System
from echo_compile.bench.locality import OverlapProbe
from echo_compile.bench.model_builder import build_model
from echo_compile.bench.result import environment
from echo_compile.bench.workload import Workload
from model.locality import BENCH_LOCALITY, FIRST_LOCAL_LAYER, plant_locality

PUBLISHED = {"deep": (0.35, 0.50), "layers_0_1": (0.01, 0.02)}
TARGET_DEEP = 0.42
GPU = dict(
    preset="bench", requests=4, ctx=65_536, warm=4, steps=6, knobs="0,0.8,0.9,0.93,0.95,0.97"
)
TOY = dict(preset="tiny", requests=2, ctx=1_024, warm=2, steps=4, knobs="0,0.9")
MULTS = (1.5, 4.0, 10.0)


def pool_rows(requests: int, topk: int, mult: float) -> int:
    """A GPU pool of ``mult`` x top-k rows per request per layer, in whole pages."""
    return pages_for(int(requests * topk * mult)) * PAGE


FULL = 0.95  # pool usage (every layer) at which the warm-up ends: the pool's reserve stays free


def warm_cap(mult: float, warm: int) -> int:
    """The most warm-up steps: a pool of ``mult`` x top-k rows per request fills once the misses
    reach its rows; at most top-k misses a step, ~1/5 of them at high locality, so 5 x ``mult``
    steps, plus ``warm`` (the least warm-up)."""
    return warm + math.ceil(5 * mult)


def _usage(eng) -> list[float]:
    return list(eng.cache.stats()["gpu_pool_usage_per_layer"])


def run_knob(suts: list[System], wl: Workload, caps: list[int], steps: int, warm: int = 2) -> dict:
    """One workload on every engine: per engine the hit rate of the measured steps, after a
    warm-up of at least ``warm`` steps that lasts until every layer's pool is full (``FULL``) or
    ``caps[k]`` steps have run; on the first engine the overlap of the measured steps."""
    out: dict = {"hit_rate": [], "gpu_pool_usage": [], "warm_steps": [], "overlap": None}
    for k, (sut, cap) in enumerate(zip(suts, caps)):
        eng = sut.engine
        eng.reset_stats()
        wl = replace(wl, output_len=cap + steps + 1)
        prompts = sut._prompts(wl)
        for i in range(wl.requests):
            sut._add(wl, i, prompts[i])
        while eng.num_decode_steps < warm or (
            eng.num_decode_steps < cap and min(_usage(eng)) < FULL
        ):
            eng.step()
        out["warm_steps"].append(eng.num_decode_steps)
        eng.cache.reset_stats()  # the hit rate of the measured steps alone
        probe = OverlapProbe(eng.cache) if k == 0 else None
        try:
            for _ in range(steps):
                eng.step()
        finally:
            if probe is not None:
                probe.close()
        m = eng.metrics()
        out["hit_rate"].append(list(m["hit_rate"]))
        # below 1: the pool had not filled, nothing was evicted yet, and the hit rate is that of
        # an unbounded pool over the warm-up's history (the high-λ, 10x case can be so)
        out["gpu_pool_usage"].append(_usage(eng))
        if probe is not None:
            out["overlap"] = probe.overlap()
        for i in range(wl.requests):  # done: their remaining tokens would measure nothing
            eng.abort_request(f"r{i}")
        assert not eng.has_unfinished()
    return out


def summarize(overlap: list[float]) -> dict:
    deep = overlap[FIRST_LOCAL_LAYER:]
    return {
        "layers_0_1": sum(overlap[:2]) / max(len(overlap[:2]), 1),
        "deep": sum(deep) / len(deep) if deep else None,
    }


def best_knob(rows: list[dict]) -> float | None:
    """The λ whose mean deep-layer overlap is closest to TARGET_DEEP."""
    scored = [(abs(r["summary"]["deep"] - TARGET_DEEP), r["locality"]) for r in rows
              if r["summary"]["deep"] is not None]  # fmt: skip
    return min(scored)[1] if scored else None


def interpolated_knob(rows: list[dict]) -> float | None:
    """The λ where the mean deep-layer overlap crosses TARGET_DEEP, linear between the two
    measured knobs around it (None if no two consecutive knobs bracket it)."""
    pts = [(r["locality"], r["summary"]["deep"]) for r in rows if r["summary"]["deep"] is not None]
    for (l0, o0), (l1, o1) in zip(pts, pts[1:]):
        if o0 <= TARGET_DEEP <= o1 and o1 > o0:
            return l0 + (l1 - l0) * (TARGET_DEEP - o0) / (o1 - o0)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny preset on CPU (a smoke test)")
    ap.add_argument("--knobs", default=None, help="comma-separated λ values in [0, 1)")
    ap.add_argument("--ctx", type=int, default=None, help="context tokens per request")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="measured decode steps")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--kv-format", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=120.0,
        help="start no further knob after this many seconds (the JSON keeps what was measured)",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="benchmarks/results/calibrate_locality.json")
    a = ap.parse_args(argv)
    p = dict(TOY if a.dry_run else GPU)
    for k in ("knobs", "ctx", "requests", "steps"):
        if getattr(a, k) is not None:
            p[k] = getattr(a, k)
    try:
        knobs = sorted(float(x) for x in str(p["knobs"]).split(",") if x)
    except ValueError:
        ap.error(f"--knobs: expected comma-separated numbers, got {p['knobs']!r}")
    if not knobs or any(not 0.0 <= x < 1.0 for x in knobs):
        ap.error(f"--knobs: each λ must be in [0, 1), got {p['knobs']!r}")
    if p["ctx"] < 1 or p["requests"] < 1 or p["steps"] < 2:
        ap.error("--ctx and --requests must be >= 1, --steps >= 2 (overlap needs two steps)")
    device = a.device or ("cpu" if a.dry_run else "cuda")
    if p["preset"] == "bench" and not device.startswith("cuda"):
        ap.error("the bench preset needs a CUDA device: use --dry-run for the CPU smoke test")

    t0 = time.perf_counter()
    model = build_model(p["preset"], a.layers, a.experts, device)  # λ = 0: planted below
    cfg = model.config
    topk, b, ctx = cfg.index_topk, p["requests"], p["ctx"]
    if ctx <= topk:
        ap.error(f"--ctx {ctx} must exceed top-k {topk} (else every step selects everything)")
    pools = [pool_rows(b, topk, m) for m in MULTS]
    caps = [warm_cap(m, p["warm"]) for m in MULTS]
    out_len = max(caps) + p["steps"] + 1
    wl = Workload(requests=b, min_ctx=ctx, max_ctx=ctx, output_len=out_len)
    host = b * pages_for(ctx + out_len) * PAGE
    out = {
        "environment": environment(),
        "params": p | {"layers": cfg.num_hidden_layers, "topk": topk, "kv_format": a.kv_format},
        "published_overlap": PUBLISHED,
        "first_local_layer": FIRST_LOCAL_LAYER,
        "bench_locality_default": BENCH_LOCALITY,
        "pools": [
            {"gpu_tokens": n, "rows_per_request": n / b, "warm_cap": w} for n, w in zip(pools, caps)
        ],  # fmt: skip
        "results": [],
    }
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out["elapsed_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(out, indent=1))

    suts = [
        System(
            model,
            "offload-eager",
            n,
            host,
            a.kv_format,
            ctx + out_len + PAGE,
            b,
            (),
            device,
            0.0,
            0,
            compile=False,
        )  # fmt: skip
        for n in pools
    ]
    for lam in knobs:
        if out["results"] and time.perf_counter() - t0 > a.budget_s:
            out["skipped_knobs"] = [x for x in knobs if x >= lam]
            print(f"budget of {a.budget_s:.0f} s spent: knobs {out['skipped_knobs']} not run")
            break
        plant_locality(model, lam)  # in place; 0 (first, as drawn) changes nothing
        r = run_knob(suts, wl, caps, p["steps"], p["warm"])
        row = {"locality": lam, **r, "summary": summarize(r["overlap"])}
        out["results"].append(row)
        save()
        ov = " ".join(f"{x:.3f}" for x in r["overlap"])
        hits = "; ".join(
            f"{n / b:.0f} rows/req: "
            + " ".join(f"{h:.2f}" for h in hr)
            + f" (pool {min(us):.0%}-{max(us):.0%} full)"
            for n, hr, us in zip(pools, r["hit_rate"], r["gpu_pool_usage"])
        )
        print(f"λ {lam:.2f}: overlap per layer {ov} | hit rate {hits}", flush=True)
    best = best_knob(out["results"])
    out["best_locality"] = best
    out["interpolated_locality"] = interpolated_knob(out["results"])
    save()
    if best is not None:
        row = next(r for r in out["results"] if r["locality"] == best)
        s = row["summary"]
        print(
            f"best λ = {best} (deep-layer overlap {s['deep']:.3f}, target {TARGET_DEEP}, "
            f"published 0.35-0.50; layers 0-1 {s['layers_0_1']:.3f}, published 0.01-0.02)"
        )
    if out["interpolated_locality"] is not None:
        print(f"interpolated λ for overlap {TARGET_DEEP}: {out['interpolated_locality']:.3f}")
    print(f"wrote {path} ({out['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
