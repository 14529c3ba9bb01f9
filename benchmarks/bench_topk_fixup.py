"""The exact top-k's tie fix-up by kernel variant (custom_ops/backends/ties_config.py), one GPU.

    python -m benchmarks.bench_topk_fixup --out $OUT/bench_topk_fixup.json

1. Checks (PASS/FAIL printed and recorded; a failure never stops the timings): every variant's
   ``ties_kernels.fixup`` against ``ties.threshold_select_ref`` / ``kth_from_indices_ref`` on
   tie-heavy scores ("zeros": ~1% positive, the k-th value 0 inside a run of ~99% exact zeros of
   both signs; "ties": five integer values; and "randn") at B = 1 / 16 / 64 x 32K / 100K, with
   mixed live lengths (empty, shorter than k, full), from a top-k that breaks ties its own way;
   with FlashInfer installed, also the whole ``echo::fi_topk`` per variant against the stable
   sort (``ties.stable_select_ref``).
2. Timings (benchmarks/cuda_timer.py: R calls in one CUDA graph, median over replays), largest
   size first, full live lengths: the fix-up alone per variant ("warm": the same scores each call,
   as after the library read them; at B = 64, 100K also "cold": 8 rotating copies, 205 MB, past
   the L2), the kth launch alone, and with FlashInfer the library call alone and the whole op per
   variant. Targets (issue 16, B = 64, 100K): fix-up <= 12 us, whole op <= 80 us.
``--budget-s`` stops the timings (recorded as skipped) before a run overstays; ``--dry-run``: the
same code at toy sizes on CPU (Triton interpreter, fi_topk's reference kernel, no timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import sys
import time
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:  # read when the kernels are defined, so before importing them
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.cuda_timer import graph_time  # noqa: E402
from custom_ops.backends import flashinfer_ops as fio  # noqa: E402
from custom_ops.backends import select as sel  # noqa: E402
from custom_ops.backends import ties, ties_kernels  # noqa: E402
from custom_ops.backends.ties_config import DEFAULT_FIXUP, FIXUP_VARIANTS  # noqa: E402

BATCHES, CTXS, TOPK, DEV = (64, 16, 1), (100_032, 32_768), 2048, "cuda"
KINDS = ("zeros", "ties", "randn")
TIMED_KINDS = ("randn", "zeros")
TARGETS = {"fixup_us": 12.0, "fi_topk_us": 80.0}  # at B = 64, 100K
START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


def scores_of(kind: str, B: int, L: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "zeros":  # after a ReLU: mostly exact zeros (both signs), the k-th among them
        s = (torch.randn(B, L, generator=gen, device=DEV) - 2.3).relu()
    elif kind == "ties":  # a few distinct values: the k-th value inside a long run of ties
        s = torch.randint(-2, 3, (B, L), generator=gen, device=DEV).float()
    else:
        return torch.randn(B, L, generator=gen, device=DEV)
    neg = torch.rand(B, L, generator=gen, device=DEV) < 0.5
    return torch.where((s == 0) & neg, -0.0, s).contiguous()


def case(B: int, L: int, kind: str, mixed: bool, gen: torch.Generator) -> dict:
    P = -(-L // 64)
    bt = torch.randperm(B * P + 7, generator=gen, device=DEV)[: B * P].view(B, P).int()
    sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
    if mixed and B > 1:  # empty, shorter than k, random, full
        sl = torch.randint(1, L + 1, (B,), generator=gen, device=DEV).int()
        sl[0], sl[1 % B], sl[-1] = 0, min(L, TOPK // 2 + 3), L
    s = scores_of(kind, B, L, gen)
    # a library top-k with its own tie order: torch.topk of the live scores, -1 past the length
    live = torch.arange(L, device=DEV)[None, :] < sl[:, None]
    raw = torch.topk(torch.where(live, s, float("-inf")), min(TOPK, L), dim=1).indices.int()
    raw = torch.where(torch.arange(raw.shape[1], device=DEV)[None, :] < sl[:, None], raw, -1)
    return {"s": s, "bt": bt, "sl": sl, "raw": raw.contiguous()}


def with_refs(c: dict) -> dict:
    """The references, once per case: the fix-up's (from the library's kth) and the definition."""
    c["kth_ref"] = ties.kth_from_indices_ref(c["s"], c["raw"])
    c["want"] = ties.threshold_select_ref(c["s"], c["bt"], c["sl"], c["kth_ref"], TOPK)
    c["stable"] = ties.stable_select_ref(c["s"], c["bt"], c["sl"], TOPK)
    return c


def verdict(host, kth, want_host, want_kth) -> tuple[bool, str]:
    ok_h, ok_k = torch.equal(host, want_host), torch.equal(kth, want_kth)
    return ok_h and ok_k, "" if ok_h and ok_k else f"host equal {ok_h}, kth equal {ok_k}"


def check_fixup(c: dict, name: str) -> tuple[bool, str]:
    host, kth = ties_kernels.fixup(c["s"], c["bt"], c["sl"], c["raw"], TOPK, FIXUP_VARIANTS[name])
    return verdict(host, kth, c["want"], c["kth_ref"])


def fi_topk(c: dict, name: str, states: torch.Tensor):
    fio.OPTIONS["fixup"] = name
    try:
        return torch.ops.echo.fi_topk(c["s"], c["bt"], c["sl"], TOPK, states)
    finally:
        fio.OPTIONS["fixup"] = DEFAULT_FIXUP


def check_whole(c: dict, name: str, states: torch.Tensor) -> tuple[bool, str]:
    return verdict(*fi_topk(c, name, states), *c["stable"])


def run_checks(res: dict, names: list[str], states, save) -> None:
    gen = torch.Generator(device=DEV).manual_seed(16)
    for B in BATCHES:
        for L in CTXS:
            for kind in KINDS:
                c = with_refs(case(B, L, kind, mixed=True, gen=gen))
                if not torch.equal(c["want"], c["stable"][0]):  # the premise of the fix-up
                    log(f"B={B} L={L} {kind}: the references disagree")
                    res["checks"].append({"B": B, "L": L, "kind": kind, "path": "references",
                                          "variant": None, "pass": False})  # fmt: skip
                paths = [("fixup", check_fixup)]
                if res["flashinfer"] and DEV == "cuda":  # a library that fails: the fix-up alone
                    try:
                        t0 = time.monotonic()
                        fio.library_positions(c["s"], c["bt"], c["sl"], TOPK, states)
                        torch.cuda.synchronize()
                        log(f"FlashInfer at B={B} L={L}: {time.monotonic() - t0:.1f} s (JIT)")
                    except Exception as e:
                        res["flashinfer"] = False
                        res["flashinfer_error"] = f"{type(e).__name__}: {e}"[:2000]
                        traceback.print_exc()
                if res["flashinfer"]:
                    paths.append(("fi_topk", lambda c, n: check_whole(c, n, states)))
                for path, fn in paths:
                    for name in names:
                        rec = {"B": B, "L": L, "kind": kind, "path": path, "variant": name}
                        try:
                            rec["pass"], why = fn(c, name)
                            if why:
                                rec["why"] = why
                        except Exception as e:
                            rec["pass"], rec["error"] = False, f"{type(e).__name__}: {e}"[:1000]
                            traceback.print_exc()
                        res["checks"].append(rec)
                        verdict = "PASS" if rec["pass"] else "FAIL " + rec.get("why", "")
                        log(f"check B={B} L={L} {kind} {path} {name}: {verdict}")
                save()


def timed(fn, reps: int) -> float:
    if DEV == "cpu":  # dry run: exercise the code path only
        fn()
        return float("nan")
    return graph_time([fn] * 20, reps, warm=1).median_us


def timed_rotating(fns: list, reps: int) -> float:
    if DEV == "cpu":
        fns[0]()
        return float("nan")
    return graph_time(fns * 3, reps, warm=len(fns)).median_us


def time_into(row: dict, group: str, name: str | None, fn, reps: int, rotate: bool = False):
    try:
        v = timed_rotating(fn, reps) if rotate else timed(fn, reps)
    except Exception as e:  # record it and go on
        v = None
        row[f"{group}_{name}_error"] = f"{type(e).__name__}: {e}"[:1000]
        traceback.print_exc()
    if name is None:
        row[group] = v
    else:
        row.setdefault(group, {})[name] = v


def time_row(row: dict, c: dict, names, fi: bool, states, reps: int, cold: bool) -> None:
    s, bt, sl, raw = c["s"], c["bt"], c["sl"], c["raw"]
    time_into(row, "kth_us", None, lambda: ties_kernels.kth_from_indices(s, raw), reps)
    for n in names:
        cfg = FIXUP_VARIANTS[n]
        fn = functools.partial(ties_kernels.fixup, s, bt, sl, raw, TOPK, cfg)
        time_into(row, "fixup_us", n, fn, reps)
    if fi:
        if DEV == "cuda":  # the library itself (a dry run has only fi_topk's reference kernel)
            fn = functools.partial(fio.library_positions, s, bt, sl, TOPK, states)
            time_into(row, "flashinfer_alone_us", None, fn, reps)
        for n in names:
            time_into(row, "fi_topk_us", n, functools.partial(fi_topk, c, n, states), reps)
    if cold:
        copies = [s] + [s.clone() for _ in range(7)]  # 8 x 25.6 MB at B = 64, 100K: past the L2
        for n in names:
            cfg = FIXUP_VARIANTS[n]
            fns = [functools.partial(ties_kernels.fixup, x, bt, sl, raw, TOPK, cfg) for x in copies]
            time_into(row, "fixup_cold_us", n, fns, reps, rotate=True)


def run_timings(res: dict, names, fi: bool, states, reps: int, budget_s: float, save) -> None:
    gen = torch.Generator(device=DEV).manual_seed(61)
    for B in BATCHES:
        for L in CTXS:
            for kind in TIMED_KINDS:
                row: dict = {"B": B, "L": L, "kind": kind}
                res["timings"].append(row)
                if res["timings"][:-1] and time.monotonic() - START > budget_s:  # not the 1st
                    row["skipped"] = f"past --budget-s {budget_s}"
                    log(f"B={B} L={L} {kind}: skipped (budget)")
                    continue
                c = case(B, L, kind, mixed=False, gen=gen)
                cold = B == max(BATCHES) and L == max(CTXS) and kind == TIMED_KINDS[0]
                time_row(row, c, names, fi, states, reps, cold)
                figures = {k: v for k, v in row.items() if k.endswith("_us")}
                log(f"B={B} L={L} {kind}: {json.dumps(figures)}")
                save()


def summary(res: dict) -> None:
    ok = [r for r in res["timings"] if "skipped" not in r]
    best = {}
    for r in ok:
        fx = {n: v for n, v in r.get("fixup_us", {}).items() if v == v and v is not None}
        if fx:
            best[f"B={r['B']},L={r['L']},{r['kind']}"] = min(fx, key=fx.get)
    res["fastest_fixup_variant"] = best
    top = [r for r in ok if r["B"] == max(BATCHES) and r["L"] == max(CTXS)]
    met = {}
    for r in top:
        d = r.get("fixup_us", {}).get(DEFAULT_FIXUP)
        w = r.get("fi_topk_us", {}).get(DEFAULT_FIXUP)
        met[r["kind"]] = {
            "fixup_us_default": d,
            "fixup_le_12us": d is not None and d <= TARGETS["fixup_us"],
            "fi_topk_us_default": w,
            "fi_topk_le_80us": w is not None and w <= TARGETS["fi_topk_us"],
        }
    res["targets_met"] = met


def print_table(res: dict, names: list[str]) -> None:
    """Markdown, µs: the fix-up alone per variant, then the whole op per variant."""
    for group in ("fixup_us", "fi_topk_us"):
        rows = [r for r in res["timings"] if r.get(group)]
        if not rows:
            continue
        print(f"\n{group} | " + " | ".join(names))
        for r in rows:
            cells = [r[group].get(n) for n in names]
            vals = " | ".join("-" if v is None or v != v else f"{v:.1f}" for v in cells)
            print(f"B={r['B']} L={r['L']} {r['kind']} | {vals}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default=",".join(FIXUP_VARIANTS), help="names to run")
    ap.add_argument("--reps", type=int, default=15, help="timed graph replays per figure")
    ap.add_argument("--budget-s", type=float, default=80.0, help="no new timing row after this")
    ap.add_argument("--no-flashinfer", action="store_true", help="the fix-up alone, no library")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU, interpreter")
    args = ap.parse_args(argv)
    global BATCHES, CTXS, TOPK, DEV
    if args.dry_run:
        BATCHES, CTXS, TOPK, DEV = (3,), (320,), 16, "cpu"
    names = [n for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIXUP_VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(FIXUP_VARIANTS)}")
    fi = not args.no_flashinfer and (DEV == "cpu" or sel.installed("flashinfer"))
    props = torch.cuda.get_device_properties(0) if DEV == "cuda" else None
    try:
        fi_version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        fi_version = None
    res: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name if props else "cpu (dry run: interpreter, no timings)",
        "sm_count": props.multi_processor_count if props else None,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "flashinfer-python": fi_version,
        },  # fmt: skip
        "flashinfer": fi,
        "sizes": {"batches": BATCHES, "ctxs": CTXS, "topk": TOPK},
        "default_variant": DEFAULT_FIXUP,
        "variants": {n: dataclasses.asdict(FIXUP_VARIANTS[n]) for n in names},
        "targets": TARGETS,
        "method": "median over replays of a CUDA graph of 20 calls / 20 (cold: 24 calls "
        "rotating over 8 copies of the scores)",
        "checks": [],
        "timings": [],
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str))

    save()
    states = torch.zeros(fio.ROW_STATES_BYTES, dtype=torch.uint8, device=DEV)
    if fi:
        log("the first fi_topk call per shape JIT-compiles FlashInfer (minutes on a fresh machine)")
    run_checks(res, names, states, save)
    res["all_pass"] = all(r["pass"] for r in res["checks"])
    log(f"{sum(r['pass'] for r in res['checks'])}/{len(res['checks'])} checks passed")
    save()
    run_timings(res, names, res["flashinfer"], states, args.reps, args.budget_s, save)
    summary(res)
    save()
    print_table(res, names)
    log(f"targets at B={max(BATCHES)}, L={max(CTXS)}: {json.dumps(res['targets_met'])}")
    log(f"fastest fix-up per size: {json.dumps(res['fastest_fixup_variant'])}; wrote {args.out}")


if __name__ == "__main__":
    main()
