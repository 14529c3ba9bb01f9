"""The decode indexer by backend (Triton, DeepGEMM, FlashInfer) on one GPU, side by side.

    python -m benchmarks.bench_backends --out $OUT/bench_backends.json

1. Warm-up (printed): each library kernel's first call JIT-compiles (minutes on a fresh machine).
2. Correctness of each library op against its reference at every size (PASS/FAIL printed and
   recorded; a failure never stops the timings): DeepGEMM scores within 2^-10 of each score's term
   magnitude, FlashInfer top-k + fix-up the exact stable-sort set (also on tie-heavy scores).
3. Timings at B = 1 / 16 / 64 and 32K / 100K context (64 index heads x 128, top-2048; median over
   CUDA-graph replays, benchmarks/cuda_timer.py): scores (µs, TB/s of keys read), top-k (µs; the
   library call alone, with the fix-up, Triton, torch.topk), the whole selection per plan; and
   the ``auto_table`` the measurements suggest (custom_ops/backends/select.py reads one like it).
4. ``--step-batches``: the compiled decode step (bench model, offloading) with ``auto`` vs
   ``triton`` (echo_compile.bench.harness, as benchmarks/bench_step.py; '' skips it).
``--dry-run``: the same code at toy sizes on CPU (Triton interpreter, the library ops' reference
kernels, no timings).
"""

from __future__ import annotations

import argparse
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
from custom_ops import indexer_kernels as ik  # noqa: E402
from custom_ops.backends import flashinfer_ops as fio  # noqa: E402
from custom_ops.backends import select as sel  # noqa: E402
from custom_ops.backends import ties  # noqa: E402
from custom_ops.backends.deep_gemm_ops import logits_width, schedule_rows  # noqa: E402
from custom_ops.indexer import indexer_topk  # noqa: E402
from tests.test_decode_kernels import _gen, _tie_scores, make_indexer_inputs  # noqa: E402
from tests.test_decode_kernels import scores_ref as scores_ref_mag  # noqa: E402

BATCHES, CTXS, HI, TOPK = (1, 16, 64), (32_768, 100_032), 64, 2048
DEV = "cuda"
START = time.monotonic()
fi_defaults = dict(fio.OPTIONS)  # each timing that switches an option restores these
PLANS = {
    "triton": sel.Plan("triton", "triton"),
    "deep_gemm": sel.Plan("deep_gemm", "triton"),
    "flashinfer": sel.Plan("triton", "flashinfer"),
    "deep_gemm+flashinfer": sel.Plan("deep_gemm", "flashinfer"),
}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


def us(fn, n_calls: int) -> float:
    if DEV == "cpu":  # dry run: exercise the code path only
        fn()
        return float("nan")
    return graph_time([fn] * n_calls, 7, warm=1).median_us


def have(lib: str) -> bool:
    return DEV == "cpu" or sel.installed(lib)  # dry run: the ops' CPU kernels stand in


def versions() -> dict:
    out = {"torch": torch.__version__, "triton": triton.__version__}
    for dist in ("sgl-deep-gemm", "apache-tvm-ffi", "flashinfer-python"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


class Inputs:
    """One indexer cache for the largest size; each (B, L) takes the first B rows and L tokens."""

    def __init__(self, b_max: int, l_max: int):
        self.P = -(-l_max // 64)
        self.full = make_indexer_inputs(b_max, self.P, HI, [l_max] * b_max, _gen(11, DEV))
        dev = torch.device(DEV)
        self.sched = torch.zeros(schedule_rows(dev), 2, dtype=torch.int32, device=dev)
        self.states = torch.zeros(fio.ROW_STATES_BYTES, dtype=torch.uint8, device=dev)

    def at(self, B: int, L: int) -> dict:
        f, P = self.full, -(-L // 64)
        sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
        bt = f["block_table"][:B, :P].contiguous()
        return dict(q_fp8=f["q_fp8"][:B], weights=f["weights"][:B].contiguous(),
                    index_cache=f["index_cache"], block_table=bt, seq_lens=sl)  # fmt: skip


def args_of(inp: dict) -> list:
    return [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]


def dg_scores(inp: dict, sched: torch.Tensor) -> torch.Tensor:
    width = logits_width(inp["block_table"].shape[1] * 64)
    return torch.ops.echo.dg_paged_mqa_logits(*args_of(inp), sched, width)


def warm_up(data: Inputs, res: dict) -> None:
    """First calls at every shape: the libraries JIT-compile per shape class (minutes)."""
    for B in BATCHES:
        for L in CTXS:
            inp = data.at(B, L)
            if have("deep_gemm"):
                log(f"warm-up DeepGEMM B={B} L={L} (the first call JIT-compiles: minutes)")
                torch.ops.echo.dg_paged_mqa_schedule(inp["seq_lens"], data.sched)
                dg_scores(inp, data.sched)
            if have("flashinfer"):
                log(f"warm-up FlashInfer B={B} L={L} (the first call JIT-compiles: minutes)")
                s = torch.ops.echo.index_scores(*args_of(inp))
                torch.ops.echo.fi_topk(s, inp["block_table"], inp["seq_lens"], TOPK, data.states)
            if DEV == "cuda":
                torch.cuda.synchronize()
    res["warmup_s"] = time.monotonic() - START


def check(name: str, ok: bool, row: dict, detail: str = "") -> None:
    row[f"{name}_ok"] = bool(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name} B={row['B']} L={row['L']} {detail}", flush=True)


def bench_size(data: Inputs, B: int, L: int) -> dict:
    inp = data.at(B, L)
    args, bt, sl = args_of(inp), inp["block_table"], inp["seq_lens"]
    bytes_read = B * L * 132 + B * HI * 128
    row: dict = {"B": B, "L": L, "bytes_read": bytes_read, "scores_us": {}, "topk_us": {}}
    row["select_us"] = {}
    tri = torch.ops.echo.index_scores(*args)
    # --- correctness (recorded, never fatal)
    ref, mag = scores_ref_mag(inp)
    live = torch.isfinite(ref)
    if have("deep_gemm"):
        try:
            torch.ops.echo.dg_paged_mqa_schedule(sl, data.sched)
            s = dg_scores(inp, data.sched)[:, : ref.shape[1]]
            err = float(((s - ref).abs() / mag.clamp(min=1e-30))[live].max())
            row["deep_gemm_max_err_over_term_magnitude"] = err
            check("deep_gemm_scores", err <= 2**-10, row, f"err {err:.2e}")
        except Exception as e:
            row["deep_gemm_error"] = f"{type(e).__name__}: {e}"[:2000]
            check("deep_gemm_scores", False, row, row["deep_gemm_error"][:200])
    if have("flashinfer"):
        for kind in ("scores", "ties"):
            try:
                s = tri if kind == "scores" else _tie_scores(B, L, _gen(12), kind).to(DEV)
                got = torch.ops.echo.fi_topk(s, bt, sl, TOPK, data.states)
                want = ties.stable_select_ref(s, bt, sl, TOPK)
                exact = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                check(f"flashinfer_topk_{kind}", exact, row)
            except Exception as e:
                row[f"flashinfer_{kind}_error"] = f"{type(e).__name__}: {e}"[:2000]
                check(f"flashinfer_topk_{kind}", False, row, row[f"flashinfer_{kind}_error"][:200])
        if DEV == "cuda":  # the "library ties" mode: information, not a check of ours
            for kind in ("scores", "ties"):
                s = tri if kind == "scores" else _tie_scores(B, L, _gen(12), kind).to(DEV)
                try:
                    fio.OPTIONS["ties"] = "library"
                    got = torch.ops.echo.fi_topk(s, bt, sl, TOPK, data.states)
                    want = ties.stable_select_ref(s, bt, sl, TOPK)
                    row[f"library_ties_exact_{kind}"] = bool(
                        torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                    )
                except Exception as e:
                    row[f"library_ties_{kind}_error"] = f"{type(e).__name__}: {e}"[:2000]
                finally:
                    fio.OPTIONS.update(fi_defaults)
                log(f"library ties {kind}: exact {row.get(f'library_ties_exact_{kind}')}")
    del ref, mag, live
    # --- timings
    cfg = ik.IndexerConfig()
    timed = {
        ("scores_us", "triton"): lambda: ik.index_scores(*args, cfg) if DEV == "cuda" else tri,
        ("topk_us", "triton"): lambda: torch.ops.echo.topk_from_scores(tri, bt, sl, TOPK),
        ("topk_us", "torch.topk"): lambda: torch.topk(tri, TOPK, dim=1),
    }
    if have("deep_gemm"):
        timed["scores_us", "deep_gemm"] = lambda: dg_scores(inp, data.sched)
        timed["scores_us", "deep_gemm_schedule"] = lambda: torch.ops.echo.dg_paged_mqa_schedule(
            sl, data.sched
        )
    if have("flashinfer"):
        timed["topk_us", "flashinfer+fixup"] = lambda: torch.ops.echo.fi_topk(
            tri, bt, sl, TOPK, data.states
        )
        if DEV == "cuda":  # the library call alone and the whole op, in both of its modes
            for safe in (True, False):

                def raw(safe=safe):
                    fio.OPTIONS["dsa_graph_safe"] = safe
                    return fio.library_positions(tri, bt, sl, TOPK, data.states)

                def whole(safe=safe):
                    fio.OPTIONS["dsa_graph_safe"] = safe
                    return torch.ops.echo.fi_topk(tri, bt, sl, TOPK, data.states)

                raw()  # a first call per mode (JIT)
                timed["topk_us", f"flashinfer_alone_graph_safe={safe}"] = raw
                timed["topk_us", f"flashinfer+fixup_graph_safe={safe}"] = whole

            def library_ties():
                fio.OPTIONS["ties"] = "library"
                return torch.ops.echo.fi_topk(tri, bt, sl, TOPK, data.states)

            timed["topk_us", "flashinfer+sort (library ties)"] = library_ties
    for (group, name), fn in timed.items():
        try:
            row[group][name] = us(fn, 20)
        except Exception as e:
            row[group][name] = None
            row[f"{group}_{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        finally:
            fio.OPTIONS.update(fi_defaults)
    row["scores_tb_s"] = {
        k: bytes_read / v / 1e6 for k, v in row["scores_us"].items() if v and "schedule" not in k
    }
    for name, plan in PLANS.items():
        if (plan.scores == "deep_gemm" and not have("deep_gemm")) or (
            plan.topk == "flashinfer" and not have("flashinfer")
        ):
            continue
        if name == "triton":
            fn = functools.partial(indexer_topk, *args, TOPK)
        else:
            fn = functools.partial(sel.indexer_select, plan, *args, TOPK, data.sched, data.states)
        try:
            row["select_us"][name] = us(fn, 10)
        except Exception as e:
            row["select_us"][name] = None
            row[f"select_{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
    log(
        f"B={B} L={L}: scores {fmt(row['scores_us'])} | topk {fmt(row['topk_us'])} | "
        f"select {fmt(row['select_us'])}"
    )
    return row


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())


def suggest_auto_table(rows: list[dict]) -> dict:
    """Per half, the faster backend at each batch size at the longest context (the serving
    case): the data for select.AUTO_TABLE."""
    out: dict = {"scores": [], "topk": []}
    longest = max(r["L"] for r in rows)
    for r in sorted((r for r in rows if r["L"] == longest), key=lambda r: r["B"]):
        for half, lib, key in (
            ("scores", "deep_gemm", "deep_gemm"),
            ("topk", "flashinfer", "flashinfer+fixup"),
        ):
            t, lib_t = r[f"{half}_us"].get("triton"), r[f"{half}_us"].get(key)
            ok = r.get(f"{lib}_scores_ok" if half == "scores" else "flashinfer_topk_ties_ok")
            best = lib if (t and lib_t and lib_t < t and ok) else "triton"
            out[half].append((r["B"], best))
    return out


def bench_step(res: dict, batches: list[int], ctx: int, steps: int, backends: list[str]) -> None:
    from dataclasses import asdict

    from echo_compile.bench.harness import System
    from echo_compile.bench.model_builder import build_model
    from echo_compile.bench.workload import Workload

    model = build_model("bench", 4, 16, DEV)
    per_req = -(-(ctx + steps + 64) // 64) * 64
    out = res["step"] = {"ctx": ctx, "steps": steps, "rows": []}
    bmax = max(batches)
    for backend in backends:
        log(f"decode step: building the compiled {backend} engine (buckets {batches})")
        pool = max(bmax * model.config.index_topk, 200_000)
        sut = System(
            model, "offload", pool, bmax * per_req, "fp8", per_req, bmax,
            tuple(batches), DEV, 1.0, kernel_backend=backend,
        )  # fmt: skip
        plans = sut.engine.cache.layers[0].plans
        for b in batches:
            r = asdict(sut.run(Workload(requests=b, min_ctx=ctx, max_ctx=ctx, output_len=steps)))
            row = {"backend": backend, "batch": b, "plan": str(plans[b - 1])}
            row |= {"step_ms_median": r["step_ms_median"], "step_ms": r["step_ms"]}
            out["rows"].append(row)
            log(f"step {row}")
        sut.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU, interpreter")
    ap.add_argument("--step-batches", default="16,64", help="decode-step batches ('' skips)")
    ap.add_argument("--step-ctx", type=int, default=32_768)
    ap.add_argument("--step-steps", type=int, default=16)
    ap.add_argument("--step-backends", default="triton,auto", help="engines the step compares")
    ap.add_argument("--no-ops", action="store_true", help="skip the per-op timings (step only)")
    args = ap.parse_args()
    global BATCHES, CTXS, HI, TOPK, DEV
    if args.dry_run:
        BATCHES, CTXS, HI, TOPK, DEV = (1, 3), (256, 320), 16, 32, "cpu"
    props = torch.cuda.get_device_properties(0) if DEV == "cuda" else None
    res: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name if props else "cpu (dry run: interpreter, no timings)",
        "sm_count": props.multi_processor_count if props else None,
        "versions": versions(),
        "available": {lib: have(lib) for lib in ("deep_gemm", "flashinfer")},
        "sizes": {"heads": HI, "topk": TOPK, "batches": BATCHES, "ctxs": CTXS},
        "rows": [],
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str))

    save()
    data = Inputs(max(BATCHES), max(CTXS)) if not args.no_ops else None
    try:
        if data is not None:
            warm_up(data, res)
    except Exception as e:  # a library that fails to build: record it, time the rest
        res["warmup_error"] = f"{type(e).__name__}: {e}"[:2000]
        traceback.print_exc()
    save()
    t0 = time.monotonic()
    for B in BATCHES if data is not None else ():
        for L in CTXS:
            try:
                res["rows"].append(bench_size(data, B, L))
            except Exception as e:
                res["rows"].append({"B": B, "L": L, "error": f"{type(e).__name__}: {e}"[:2000]})
                traceback.print_exc()
            save()
    res["kernels_timed_s"] = time.monotonic() - t0
    ok_rows = [r for r in res["rows"] if "error" not in r]
    if ok_rows:
        res["auto_table"] = suggest_auto_table(ok_rows)
        log(f"suggested AUTO_TABLE (per B at the longest context): {res['auto_table']}")
    del data
    save()
    batches = [int(x) for x in args.step_batches.split(",") if x.strip()]
    if batches and DEV == "cuda":
        try:
            backends = [b.strip() for b in args.step_backends.split(",") if b.strip()]
            bench_step(res, batches, args.step_ctx, args.step_steps, backends)
        except Exception as e:
            res["step_error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        save()
    checks = [(k, v) for r in res["rows"] for k, v in r.items() if k.endswith("_ok")]
    # a size or the step that raised is a failure too, not a check that was never made
    errors = [r for r in res["rows"] if "error" in r]
    errors += [k for k in ("warmup_error", "step_error") if k in res]
    res["all_pass"] = all(v for _, v in checks) and not errors
    save()
    log(f"{sum(v for _, v in checks)}/{len(checks)} checks passed; wrote {args.out}")


if __name__ == "__main__":
    main()
