"""FP8 block-scaled linear (``echo::fp8_linear``) vs bf16 at decode batch sizes, on one GPU (H200).

    python -m benchmarks.bench_fp8 --out $OUT/fp8_h200.json [--configs 'JSON list']

First checks the Triton kernel against its reference on the GPU (``check``: PASS/FAIL recorded,
the timings run regardless), then times at the DeepSeek-V3.2 shapes (K x N: 7168 x 4096,
16384 x 7168, 7168 x 2048, 2048 x 7168, 7168 x 576 (kv_a_proj, a ragged last scale block)) and
M = 1..128: bf16 ``F.linear`` on the dequantised weights (the dequantise-at-load path) against
the FP8 kernel with its heuristic config and each of ``--configs``; then the fused FP8 MoE
(``echo::moe_fp8``, 256 experts of V3.2's shapes, top-8, T = 1..128 tokens) against the grouped
bf16 MoE the bf16 model runs (``echo::moe_bf16``'s Triton kernel). CUDA-graph replays of R calls
over R weight copies / routings (more bytes than the 60 MB L2), median of 15; weight bytes read
per µs against a measured copy ceiling. JSON written after every shape.
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

from benchmarks.bench_awq import (
    I_MOE,
    TOPK,
    D,
    copies_for,
    copy_ceiling_gbps,
    graph_time_ms,
    rel_err,
    routings,
)
from custom_ops import awq_kernels as K
from custom_ops import fp8_linear as F8
from custom_ops import fp8_linear_kernels as FK
from custom_ops.awq_kernels import _num_sms
from model.fp8_weights import weight_dequant_fp8, weight_quant_fp8

SHAPES = [(7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168), (7168, 576)]  # (K, N)
START = time.monotonic()


def fp8_bytes(k: int, n: int) -> int:
    return k * n + (-(-n // 128)) * (k // 128) * 4


def rand_fp8(k: int, n: int, gen=None) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    return weight_quant_fp8(w, scale_fmt="ue8m0")


def check(result: dict) -> None:
    checks = result.setdefault("check", [])
    gen = torch.Generator("cuda").manual_seed(0)
    for k, n in (SHAPES[0], SHAPES[-1]):
        w8, ws = rand_fp8(k, n, gen)
        for m in (1, 16, 128):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            try:
                err = rel_err(
                    FK.fp8_linear_triton(x, w8, ws, True), F8.fp8_linear_ref(x, w8, ws, True)
                )
                ok = err < 5e-3  # fp8 MMA accumulation inside a K block, bf16 output
            except Exception as e:  # noqa: BLE001  (reported; the timings still run)
                err, ok = repr(e), False
            checks.append({"op": "fp8_linear", "K": k, "N": n, "M": m, "rel_err": err,
                           "bound": 5e-3, "pass": ok})  # fmt: skip
            print(f"  check fp8_linear {k}x{n} M={m}: {'PASS' if ok else 'FAIL'} {err}", flush=True)


def _time(calls) -> float:
    try:
        return graph_time_ms(calls) * 1e3
    except Exception as e:  # noqa: BLE001
        print(f"    timing failed: {e!r}", flush=True)
        return math.nan


def bench_shape(k: int, n: int, batches: list[int], hbm: float, extra: list[dict]) -> list[dict]:
    r8, rb = copies_for(fp8_bytes(k, n)), copies_for(2 * k * n)
    w8s = [rand_fp8(k, n) for _ in range(r8)]
    wbs = [weight_dequant_fp8(*w8s[i % r8], dtype=torch.bfloat16) for i in range(rb)]
    sms = _num_sms(torch.device("cuda"))
    rows = []
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = FK.fp8_config(m, n, k, sms)
        row = {"in": k, "out": n, "M": m, "config": cfg}
        row["fp8_us"] = _time(
            [lambda w=w, x=x, c=cfg: FK.fp8_linear_triton(x, *w, True, config=c) for w in w8s]
        )
        for i, e in enumerate(extra):
            c = {**cfg, **e}
            row[f"fp8_cfg{i}_us"] = _time(
                [lambda w=w, x=x, c=c: FK.fp8_linear_triton(x, *w, True, config=c) for w in w8s]
            )
        row["bf16_us"] = _time([lambda w=w, x=x: F.linear(x, w) for w in wbs])
        fp8_times = [v for key, v in row.items() if key.startswith("fp8") and not math.isnan(v)]
        best = min(fp8_times, default=math.nan)
        row.update(
            {
                "best_fp8_us": best,
                "speedup_vs_bf16": row["bf16_us"] / row["fp8_us"],
                "best_speedup_vs_bf16": row["bf16_us"] / best,
                "fp8_weight_GBps": fp8_bytes(k, n) / row["fp8_us"] / 1e3,
                "bf16_weight_GBps": 2 * k * n / row["bf16_us"] / 1e3,
            }
        )
        row["fp8_frac_hbm"] = row["fp8_weight_GBps"] / hbm
        row["bf16_frac_hbm"] = row["bf16_weight_GBps"] / hbm
        rows.append(row)
        print(
            f"  fp8 {k}x{n} M={m}: fp8 {row['fp8_us']:.1f} us (best {best:.1f}), "
            f"bf16 {row['bf16_us']:.1f} us, {row['best_speedup_vs_bf16']:.2f}x",
            flush=True,
        )
    return rows


def rand_experts(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ws = [rand_fp8(k, n) for _ in range(e)]
    return torch.stack([w for w, _ in ws]), torch.stack([sc for _, sc in ws])


def bench_moe(e: int, batches: list[int], hbm: float, result: dict) -> list[dict]:
    w13, s13 = rand_experts(e, 2 * I_MOE, D)
    w2, s2 = rand_experts(e, D, I_MOE)
    # the bf16 grouped MoE on the same (dequantised) weights
    w13b = torch.stack([weight_dequant_fp8(w13[j], s13[j], dtype=torch.bfloat16) for j in range(e)])
    w2b = torch.stack([weight_dequant_fp8(w2[j], s2[j], dtype=torch.bfloat16) for j in range(e)])
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(8, D, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(8, e, device="cuda", generator=gen).topk(TOPK, dim=-1).indices
    wt = torch.rand(8, TOPK, device="cuda", generator=gen)
    try:  # check first (the bf16 MoE computes the same model with 16-bit activations)
        err = rel_err(FK.moe_fp8_triton(x, ids, wt, w13, s13, w2, s2, True),
                      F8.moe_fp8_ref(x, ids, wt, w13, s13, w2, s2, True))  # fmt: skip
        ok = err < 5e-3
    except Exception as ex:  # noqa: BLE001
        err, ok = repr(ex), False
    result["check"].append({"op": "moe_fp8", "E": e, "T": 8, "rel_err": err, "bound": 5e-3,
                            "pass": ok})  # fmt: skip
    print(f"  check moe_fp8 E={e} T=8: {'PASS' if ok else 'FAIL'} {err}", flush=True)
    per_fp8, per_bf16 = 3 * D * I_MOE, 2 * 3 * D * I_MOE
    rows = []
    for t in batches:
        xt = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        routes = routings(t, e, 8)
        touched = sum(torch.unique(r[0]).numel() for r in routes) / len(routes)
        t8 = _time([lambda r=r, x=xt: FK.moe_fp8_triton(x, r[0], r[1], w13, s13, w2, s2, True)
                    for r in routes])  # fmt: skip
        tb = _time([lambda r=r, x=xt: K.moe_bf16_triton(x, r[0], r[1], w13b, w2b)
                    for r in routes])  # fmt: skip
        row = {"experts": e, "topk": TOPK, "T": t, "experts_touched": touched, "fp8_us": t8,
               "bf16_triton_us": tb, "speedup_vs_bf16_triton": tb / t8,
               "fp8_weight_GBps": touched * per_fp8 / t8 / 1e3,
               "bf16_weight_GBps": touched * per_bf16 / tb / 1e3}  # fmt: skip
        row["fp8_frac_hbm"] = row["fp8_weight_GBps"] / hbm
        rows.append(row)
        print(f"  moe E={e} T={t}: fp8 {t8:.1f} us, bf16 {tb:.1f} us ({tb / t8:.2f}x)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--experts", type=int, default=256, help="routed experts of the MoE (0: skip)")
    ap.add_argument(
        "--configs",
        default="[]",
        help="JSON list of partial configs of the FP8 kernel to time as well, e.g. "
        '\'[{"BM": 64}, {"BN": 64, "SPLIT_K": 4}]\' (merged into its heuristic)',
    )
    args = ap.parse_args()
    try:
        extra = json.loads(args.configs)
        if not isinstance(extra, list) or not all(isinstance(c, dict) for c in extra):
            raise ValueError
    except ValueError:
        raise SystemExit(
            f"bench_fp8: --configs must be a JSON list of objects, got {args.configs!r}"
        ) from None
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8: needs a CUDA GPU")
    import triton

    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA graph of R calls over R weight copies, median of 15 replays",
        "extra_configs": extra,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - START
        out.write_text(json.dumps(result, indent=1))

    hbm = copy_ceiling_gbps()
    result["hbm_copy_GBps"] = hbm
    try:
        check(result)
    except Exception as err:  # noqa: BLE001  (recorded; the timings go on)
        result.setdefault("check", []).append({"op": "check", "error": repr(err), "pass": False})
        print(f"check failed: {err!r}", flush=True)
    save()
    result["linear"] = []
    for k, n in SHAPES:
        try:
            result["linear"] += bench_shape(k, n, batches, hbm, extra)
        except Exception as err:  # noqa: BLE001
            result.setdefault("errors", []).append(f"fp8 {k}x{n}: {err!r}")
            print(f"fp8 {k}x{n} failed: {err!r}", flush=True)
        save()
        torch.cuda.empty_cache()
    result["moe"] = []
    if args.experts:
        try:
            result["moe"] = bench_moe(args.experts, batches, hbm, result)
        except Exception as err:  # noqa: BLE001
            result.setdefault("errors", []).append(f"moe E={args.experts}: {err!r}")
            print(f"moe failed: {err!r}", flush=True)
        save()
    fails = [c for c in result["check"] if not c["pass"]]
    print(f"\ncheck: {'PASS' if not fails else 'FAIL'} ({len(fails)} of {len(result['check'])})")
    print(
        f"{'K x N':>14} {'M':>4} {'bf16 us':>8} {'fp8 us':>8} {'best':>8} {'x bf16':>7} {'%HBM':>5}"
    )
    for r in result["linear"]:
        print(
            f"{r['in']:>6}x{r['out']:<7} {r['M']:>4} {r['bf16_us']:8.1f} {r['fp8_us']:8.1f} "
            f"{r['best_fp8_us']:8.1f} {r['best_speedup_vs_bf16']:7.2f} "
            f"{100 * r['fp8_frac_hbm']:5.0f}"
        )
    print(f"\nwrote {out} in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
