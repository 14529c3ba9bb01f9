"""Small-M W4A16 GEMV (echo::w4a16_gemv) vs bf16, tinygemm and the served path, on one GPU.

    python -m benchmarks.bench_awq_gemv --out $OUT/awq_gemv_h200.json [--batches 1,2,4,8,16]
        [--configs default,bn64,...] [--budget-s 90]

1. check: every named config of ``custom_ops.awq_gemv_kernels.GEMV_CONFIGS`` (CUDA-core FMA and
   tl.dot variants) against ``w4a16_linear_ref`` (the AutoAWQ dequantise-then-matmul) on the GPU,
   fresh random weights, two V3.2 shapes, M = 1, 3, 8, 16: PASS/FAIL each, recorded, never
   stopping the timings;
2. timings, side by side at each M on the four V3.2 shapes of bench_awq (K x N: 7168 x 4096,
   16384 x 7168, 7168 x 2048, 2048 x 7168): bf16 ``F.linear``, core torch's int4 tinygemm, the
   served path (``AWQLinear``'s dispatch: tinygemm up to ``TINYGEMM_MAX_M``, then
   ``LARGE_M_PATH``), the repacked GEMM kernel (``echo::w4a16_linear_r``, its default config),
   and the GEMV in every config (FMA where M <= FMA_MAX_M, tl.dot where M > 1). Each figure is
   a CUDA graph of R calls over R weight copies (together > 4x the 60 MB L2, as bench_awq), the
   median of 15 replays; weight bytes each call reads over its time give GB/s against a
   measured copy ceiling.
Each row also gives ``gemv_table_us``, the config ``CONFIG_BY_M`` picks now. ``summary`` names
the fastest GEMV config per (shape, M), its speed-up over bf16 and over the served path, and
the largest M where the GEMV beat tinygemm and the served path on every shape (``gemv_max_m``:
the value for ``custom_ops.awq_gemv.GEMV_MAX_M``). JSON is rewritten after every shape; past
``--budget-s`` the remaining shapes are skipped (listed in ``skipped``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

START = time.monotonic()
LINEAR_SHAPES = [(7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168)]  # (K, N)


def weight_bytes(path: str, k: int, n: int) -> int:
    """Bytes one call must read of its path's weight format."""
    g = k // 128
    if path == "bf16":
        return 2 * k * n
    if path == "tinygemm":
        return k * n // 2 + g * n * 4  # bf16 (scale, zero) pairs
    if path == "former":
        return k * n // 2 + g * (n // 8) * 4 + g * n * 2  # AutoAWQ qzeros int32, scales
    return k * n // 2 + g * n * 3  # repacked: uint8 zeros, 16-bit scales


def variants(m: int, names: list[str]) -> list[tuple[str, bool]]:
    """(config name, DOT) pairs worth timing at m: FMA up to FMA_MAX_M where its partial fits
    in 64 registers (``fma_partial_regs``: above, ptxas spills), tl.dot above one row."""
    from custom_ops.awq_gemv_kernels import FMA_MAX_M, fma_partial_regs

    out = []
    for name in names:
        if m == 1 or (m <= FMA_MAX_M and fma_partial_regs(m, name) <= 64):
            out.append((name, False))
        if m > 1:
            out.append((name, True))
    return out


def summarize(rows: list[dict]) -> dict:
    """Best GEMV per (shape, M) and the largest M where it beat tinygemm and the served path on
    every shape (0: never)."""
    best: dict = {}
    wins: dict[int, bool] = {}
    for r in rows:
        g = {key: v for key, v in r.items() if key.startswith("gemv/") and not math.isnan(v)}
        if not g:
            continue
        key = min(g, key=g.get)
        us = g[key]
        best.setdefault(f"{r['in']}x{r['out']}", {})[r["M"]] = {
            "config": key.removeprefix("gemv/").removesuffix("_us"),
            "us": us,
            "x_bf16": r["bf16_us"] / us,
            "x_served": r["served_us"] / us,
            "x_tinygemm": r["tinygemm_us"] / us,
            "frac_hbm": r["gemv_best_frac_hbm"],
        }
        beat = us < r["served_us"] and not us >= r["tinygemm_us"]  # a NaN tinygemm: no rival
        wins[r["M"]] = wins.get(r["M"], True) and beat
    max_m = 0
    for m in sorted(wins):
        if not wins[m]:
            break
        max_m = m
    return {"best_by_shape_m": best, "gemv_max_m": max_m}


def check(result: dict, names: list[str]) -> None:
    from benchmarks.bench_awq import rand_awq, rel_err
    from custom_ops import awq as ops
    from custom_ops import awq_gemv_kernels as GK
    from custom_ops import awq_repack as R

    checks = result.setdefault("check", [])
    gen = torch.Generator("cuda").manual_seed(17)
    for k, n in LINEAR_SHAPES[:2]:
        w = rand_awq(k, n, gen=gen)
        r = R.repack_awq(*w)
        for m in (1, 3, 8, 16):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = ops.w4a16_linear_ref(x, *w)
            for name, dot in variants(m, names):
                cfg = GK.gemv_config(m, n, k, GK._num_sms(x.device), name, dot)
                try:
                    y = GK.w4a16_gemv_triton(x, *r, config=cfg)
                    err = rel_err(y, ref)
                    # bf16 output rounding only (exact fp32 weights); deterministic
                    ok = err < 1e-2 and torch.equal(y, GK.w4a16_gemv_triton(x, *r, config=cfg))
                except Exception as e:  # noqa: BLE001  (recorded; the timings still run)
                    err, ok = repr(e), False
                tag = f"{name}/{'dot' if dot else 'fma'}"
                checks.append({"op": f"gemv/{tag}", "K": k, "N": n, "M": m, "config": cfg,
                               "rel_err": err, "bound": 1e-2, "pass": ok})  # fmt: skip
                print(f"  check gemv {tag} {k}x{n} M={m}: {'PASS' if ok else 'FAIL'} {err}")
        del w, r
    torch.cuda.empty_cache()


def bench_shape(k: int, n: int, batches: list[int], names: list[str], hbm: float) -> list[dict]:
    from benchmarks.bench_awq import _time, copies_for, rand_awq
    from custom_ops import awq_gemv_kernels as GK
    from custom_ops import awq_kernels as K
    from custom_ops import awq_repack as R
    from custom_ops import awq_repack_kernels as RK

    reps = copies_for(weight_bytes("former", k, n))
    wa = [rand_awq(k, n) for _ in range(reps)]
    wr = [R.repack_awq(*w) for w in wa]
    try:
        wt = [R.tinygemm_pack(*w) for w in wa]
    except Exception as e:  # noqa: BLE001
        print(f"  tinygemm pack failed: {e!r}", flush=True)
        wt = []
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(copies_for(2 * k * n))]  # fmt: skip
    sms = K._num_sms(torch.device("cuda"))
    rows = []
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row: dict = {"in": k, "out": n, "M": m, "copies": reps, "configs": {}}
        row["bf16_us"] = _time([lambda w=w, x=x: F.linear(x, w) for w in wb])
        row["tinygemm_us"] = (
            _time([lambda w=w, x=x: R.tinygemm_linear(x, *w) for w in wt]) if wt else math.nan
        )
        row["former_us"] = _time([lambda w=w, x=x: K.w4a16_linear_triton(x, *w) for w in wa])
        row["repacked_us"] = _time([lambda w=w, x=x: RK.w4a16_linear_r_triton(x, *w) for w in wr])
        row["served_path"] = "tinygemm" if R.use_tinygemm(m, x.dtype) and wt else R.LARGE_M_PATH
        row["served_us"] = row[f"{row['served_path']}_us"]
        for name, dot in variants(m, names):
            cfg = GK.gemv_config(m, n, k, sms, name, dot)
            tag = f"gemv/{name}/{'dot' if dot else 'fma'}_us"
            row["configs"][tag] = cfg
            row[tag] = _time(
                [lambda w=w, x=x, c=cfg: GK.w4a16_gemv_triton(x, *w, config=c) for w in wr]
            )
        _, t_name, t_dot = next(t for t in GK.CONFIG_BY_M if m <= t[0])  # the dispatch table's
        row["gemv_table"] = f"gemv/{t_name}/{'dot' if t_dot else 'fma'}_us"
        row["gemv_table_us"] = row.get(row["gemv_table"], math.nan)  # NaN: not swept
        gemv = {key: v for key, v in row.items() if key.startswith("gemv/") and not math.isnan(v)}
        best_key = min(gemv, key=gemv.get) if gemv else ""
        best = gemv.get(best_key, math.nan)
        gb = {
            p: weight_bytes(p, k, n) / row[f"{p}_us"] / 1e3
            for p in ("bf16", "tinygemm", "former", "repacked")
        }
        gb["gemv_best"] = weight_bytes("gemv", k, n) / best / 1e3
        row["weight_GBps"] = gb
        row["gemv_best_frac_hbm"] = gb["gemv_best"] / hbm
        row["gemv_best"] = best_key.removeprefix("gemv/").removesuffix("_us")
        rows.append(row)
        print(
            f"  {k}x{n} M={m}: bf16 {row['bf16_us']:.1f} tinygemm {row['tinygemm_us']:.1f} "
            f"served({row['served_path']}) {row['served_us']:.1f} repacked "
            f"{row['repacked_us']:.1f} | gemv best {row['gemv_best']} {best:.1f} us = "
            f"{row['bf16_us'] / best:.2f}x bf16, {gb['gemv_best']:.0f} GB/s",
            flush=True,
        )
    del wa, wr, wt, wb
    torch.cuda.empty_cache()
    return rows


SASS_OPS = ("FFMA", "FADD", "FMUL", "LOP3", "SHF", "SGXT", "PRMT", "SHFL", "BAR", "HMMA", "STL")


def sass_report(names: list[str], batches: list[int]) -> list[dict]:
    """No GPU needed: compile the GEMV for sm_90 (Triton's bundled ptxas) per config and M, and
    read registers, spill stack and instruction counts of the cubin (the loop body appears once:
    counts per 32-bit weight word are per group step). ``--sass``."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops import awq_gemv_kernels as GK

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "z_ptr": "*u8", "s_ptr": "*fp16",
           "out_ptr": "*fp32", "M": "i32", "N": "i32", "G": "i32", "stride_xm": "i32",
           "stride_os": "i32", "stride_om": "i32", "SPLIT_K": "i32", "MAGIC": "i32",
           "BM": "constexpr", "BN": "constexpr", "DOT": "constexpr", "DEPTH": "constexpr",
           "INTERPRET": "constexpr"}  # fmt: skip
    # 16-byte aligned pointers and N / strides divisible by 16, as every V3.2 launch has
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 8, 9, 10)}
    rows = []
    for name in names:
        for m in batches:
            # every valid path, spilling FMA variants included (what ``variants`` skips)
            paths = ([False] if m <= GK.FMA_MAX_M else []) + ([True] if m > 1 else [])
            for dot in paths:
                c = GK.gemv_config(m, 4096, 7168, 132, name, dot)
                consts = {"BM": c["BM"], "BN": c["BN"], "DOT": c["DOT"], "DEPTH": c["DEPTH"],
                          "INTERPRET": False}  # fmt: skip
                row = {"config": name, "path": "dot" if dot else "fma", "M": m, "launch": c}
                try:
                    src = ASTSource(GK.w4a16_gemv_kernel, sig, consts, attrs)
                    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={
                        "num_warps": c["num_warps"], "num_stages": c["num_stages"]})  # fmt: skip
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(k.asm["cubin"])
                        f.flush()
                        res = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", f.name],
                                             capture_output=True, text=True).stdout  # fmt: skip
                        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", f.name],
                                              capture_output=True, text=True).stdout  # fmt: skip
                    for key in ("REG", "STACK"):
                        hit = re.search(rf"{key}:(\d+)", res)
                        row[key.lower()] = int(hit.group(1)) if hit else None
                    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)",
                                     sass, re.M)  # fmt: skip
                    words = 16 * c["BN"] / (32 * c["num_warps"])  # per thread and group
                    row["per_word"] = {o: round(ops.count(o) / words, 1) for o in SASS_OPS}
                    row["per_word"]["all"] = round(len(ops) / words, 1)  # every instruction
                except Exception as e:  # noqa: BLE001  (reported; the other configs go on)
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    from custom_ops.awq_gemv_kernels import GEMV_CONFIGS, MAX_M, SWEPT_BY_DEFAULT

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the JSON results file")
    ap.add_argument("--batches", default="1,2,4,8,16", help=f"M values, each <= {MAX_M}")
    ap.add_argument(
        "--configs",
        default=",".join(SWEPT_BY_DEFAULT),
        help=f"names from awq_gemv_kernels.GEMV_CONFIGS ({', '.join(GEMV_CONFIGS)}); default "
        f"{','.join(SWEPT_BY_DEFAULT)} (each config costs ~5 Triton compiles, ~1 s each)",
    )
    ap.add_argument("--budget-s", type=float, default=90.0, help="skip the shapes left after this")
    ap.add_argument(
        "--sass",
        action="store_true",
        help="no GPU: compile each config for sm_90 and write registers, spills and instruction "
        "counts per weight word to --out (works on the CPU machine)",
    )
    args = ap.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not all(1 <= b <= MAX_M for b in args.batches):
        ap.error(f"--batches must lie in 1..{MAX_M}, got {args.batches}")
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in GEMV_CONFIGS]
    if unknown or not args.configs:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(GEMV_CONFIGS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.sass:
        import triton

        meta = {
            "target": "sm_90, compiled without a GPU (Triton's bundled ptxas)",
            "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "shape": "K x N = 7168 x 4096 (split only; the code does not depend on the shape)",
        }
        rows = sass_report(args.configs, args.batches)
        Path(args.out).write_text(json.dumps({**meta, "sass": rows}, indent=1))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_awq_gemv: needs a CUDA GPU")
    import triton

    from benchmarks.bench_awq import copy_ceiling_gbps
    from custom_ops import awq_gemv_kernels as GK

    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA graph of R calls over R weight copies (> 4x L2), median of 15 replays",
        "gemv_configs": {c: GK.GEMV_CONFIGS[c] for c in args.configs},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - START
        out.write_text(json.dumps(result, indent=1))

    hbm = copy_ceiling_gbps()
    result["hbm_copy_GBps"] = hbm
    print(f"{result['device']}: copy ceiling {hbm:.0f} GB/s", flush=True)
    try:
        check(result, args.configs)
    except Exception as err:  # noqa: BLE001  (recorded; the timings go on)
        result.setdefault("check", []).append({"op": "check", "error": repr(err), "pass": False})
        print(f"check failed: {err!r}", flush=True)
    save()
    result["linear"] = []
    for k, n in LINEAR_SHAPES:
        if time.monotonic() - START > args.budget_s:
            result.setdefault("skipped", []).append(f"{k}x{n}")
            print(f"budget spent: {k}x{n} skipped", flush=True)
            continue
        try:
            result["linear"] += bench_shape(k, n, args.batches, args.configs, hbm)
        except Exception as err:  # noqa: BLE001
            result.setdefault("errors", []).append(f"{k}x{n}: {err!r}")
            print(f"{k}x{n} failed: {err!r}", flush=True)
        result["summary"] = summarize(result["linear"])
        save()
    fails = [c for c in result["check"] if not c["pass"]]
    print(f"\ncheck: {'PASS' if not fails else 'FAIL'} ({len(fails)} of {len(result['check'])})")
    print(f"\n{'K x N':>12} {'M':>3} {'bf16':>6} {'tgemm':>6} {'served':>6} {'gemv':>6} "
          f"{'x bf16':>6} {'x srv':>6} {'%HBM':>5}  best config")  # fmt: skip
    summary = result.get("summary", summarize([]))
    for r in result["linear"]:
        b = summary["best_by_shape_m"].get(f"{r['in']}x{r['out']}", {}).get(r["M"])
        if b is None:
            continue
        print(
            f"{r['in']:>5}x{r['out']:<6} {r['M']:>3} {r['bf16_us']:6.1f} {r['tinygemm_us']:6.1f} "
            f"{r['served_us']:6.1f} {b['us']:6.1f} {b['x_bf16']:6.2f} {b['x_served']:6.2f} "
            f"{100 * b['frac_hbm']:5.0f}  {b['config']}"
        )
    print(f"gemv_max_m (beat tinygemm and served on every shape): "
          f"{summary['gemv_max_m']}")  # fmt: skip
    save()
    print(f"\nwrote {out} in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
