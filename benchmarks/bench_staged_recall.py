"""Where the staged recall's time goes (issue 15): echo::recall_staged after a perfect prefetch
(every miss of the step staged, as ``bench_prefetch``'s ``recall_all_staged``) against the plain
recall of the same step, at the microbenchmark's sizes (B = 16, 128K context, top-2048, pool 300K)
and hit rates, with a full pool (the recall evicts) and with free slots (``steady``: it does not).

Timed side by side in one run, in ``--rounds`` rounds (the order reversed every other round):
- ``plain``: echo::recall (PCIe reads);
- ``staged``: echo::recall_staged as the op runs it (the recall's launch alone: staged entries
  are tagged with their step's epoch, so nothing is emptied after it; docs/prefetch.md);
- ``plain_self0`` / ``staged_self32``: the lookup programs copying none / up to 32 of the rows
  they placed (``LOOKUP_COPY_ROWS`` / ``LOOKUP_COPY_ROWS_STAGED``; the defaults are 32 / 0);
- ``per_phase``: the recall as a launch per phase, with its kernels' device times from the
  profiler (``launches``), staged and plain.

    python -m benchmarks.bench_staged_recall --out benchmarks/results/staged_recall_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

if "--dry-run" in sys.argv:
    import os

    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import bench_prefetch as bp  # noqa: E402
from benchmarks.cache_ops_check import launch_breakdown  # noqa: E402
from benchmarks.cuda_timer import graph_time  # noqa: E402
from custom_ops import cache_kernels as ck  # noqa: E402
from custom_ops import prefetch_kernels as pk  # noqa: E402


def settings(**kw):
    """Set cache_kernels switches for one timing; returns the old values to restore."""
    old = {k: getattr(ck, k) for k in kw}
    for k, v in kw.items():
        setattr(ck, k, v)
    return old


def variants(s: bp.Setup, st) -> dict:
    """name -> (cache_kernels settings, the call, the state before each replay)."""

    def staged():
        pk.recall_staged_cuda(*bp.recall_args(s, st, s.sel))

    def plain():
        s.pool.recall(s.host, s.sel)

    def restage():
        bp.stage_all_misses(s, st)

    return {
        "plain": ({}, plain, s.restore),
        "staged": ({}, staged, restage),
        "plain_self0": ({"LOOKUP_COPY_ROWS": 0}, plain, s.restore),
        "staged_self32": ({"LOOKUP_COPY_ROWS_STAGED": 32}, staged, restage),
    }


def time_one(cfg: dict, fn, before, reps: int, dry: bool) -> float:
    old = settings(**cfg)
    try:
        if dry:
            before()
            fn()
            return float("nan")
        return graph_time([fn], reps, before, warm=1).median_us
    finally:
        settings(**old)


def per_phase(s: bp.Setup, st, reps: int) -> dict:
    """The recall as a launch per phase, staged and plain: its median and its kernels."""
    out = {}
    for name, (_, fn, before) in variants(s, st).items():
        if name not in ("plain", "staged"):
            continue
        old = settings(FUSED=False)
        try:
            t = graph_time([fn], reps, before, warm=1)
            out[name] = {"median_us": t.median_us,
                         "launches": launch_breakdown(t.graph.replay, before, 1)}  # fmt: skip
        finally:
            settings(**old)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/staged_recall_h200.json")
    ap.add_argument("--hit-rates", default="0.5,0.9,0.97")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fmt", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU, the code paths only")
    a = ap.parse_args()
    dry = a.dry_run
    dev = torch.device("cpu" if dry else "cuda")
    sz = bp.TOY if dry else bp.FULL
    n_stage = sz["B"] * max(64, int(sz["ctx"] * 0.004))  # bench_prefetch: cap 64, budget 0.004
    res: dict = {
        "device": "cpu (interpreter)" if dry else torch.cuda.get_device_name(dev),
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sizes": sz | {"fmt": a.fmt}, "lookup_copy_rows": ck.LOOKUP_COPY_ROWS,
        "lookup_copy_rows_staged": ck.LOOKUP_COPY_ROWS_STAGED, "results": {},
    }  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    s = bp.Setup(sz, a.fmt, dev, n_stage)
    for h in [float(x) for x in a.hit_rates.split(",") if x]:
        for steady in (True, False):
            s.set_hit_rate(h, steady=steady)
            st = bp.all_staged(s, n_stage)
            key = f"h{h}" + ("_steady" if steady else "")
            r = res["results"][key] = {"misses": s.n_miss, "rounds": []}
            vs = variants(s, st)
            names = list(vs)
            for i in range(a.rounds):
                rnd = {}
                for name in names if i % 2 == 0 else names[::-1]:
                    cfg, fn, before = vs[name]
                    rnd[name] = time_one(cfg, fn, before, a.reps, dry)
                r["rounds"].append(rnd)
                print(key, i, json.dumps({k: round(v, 2) for k, v in rnd.items()}), flush=True)
            r["median_us"] = {n: statistics.median(x[n] for x in r["rounds"]) for n in names}
            if not dry:
                r["per_phase"] = per_phase(s, st, a.reps)
                print(key, "per phase", json.dumps(r["per_phase"]), flush=True)
            out.write_text(json.dumps(res, indent=2))
    out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
