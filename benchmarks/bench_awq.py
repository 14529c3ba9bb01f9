"""AWQ W4A16 vs bf16 at decode batch sizes, on one GPU (H200).

    python -m benchmarks.bench_awq --out $OUT/awq_h200.json [--sweep]

First checks each W4A16 path on the GPU against its reference (``check``: PASS/FAIL per path,
recorded, never aborting the timings), then times (CUDA-graph replays, median of many), at the
DeepSeek-V3.2 shapes (K x N: 7168 x 4096 = the shared expert's gate|up, 16384 x 7168 = o_proj,
7168 x 2048, 2048 x 7168; M = 1..128):
- the linear, side by side: bf16 ``F.linear``, core torch's int4 tinygemm
  (``aten._weight_int4pack_mm``), the pair-layout Triton kernel (``echo::w4a16_linear_p``, its
  default config ``p_config``: ``pairs_us``), the former AutoAWQ-layout kernel, fbgemm-gpu-genai's
  CUTLASS int4 GEMM (``fbgemm_us``, where it imports: an anchor; missing, the bench says so and
  goes on), and what ``AWQLinear`` dispatches to (``awq_us``: tinygemm up to
  ``custom_ops.awq_repack.TINYGEMM_MAX_M``, ``LARGE_M_PATH`` above); ``dispatch`` lists, per
  shape, the largest M where tinygemm beat both Triton kernels and, per shape and M, the fastest
  of tinygemm / pairs / former / fbgemm (``best_by_m``; the values for ``TINYGEMM_MAX_M`` and
  ``LARGE_M_PATH``);
- the fused W4A16 MoE (``awq_us``: the served pair-layout ``echo::moe_w4a16_p``, ``former_us``:
  the AutoAWQ-layout kernel) against the same Triton MoE with bf16 weights (the grouped kernel
  the bf16 model now runs) and, for 16 experts, the former all-experts bf16 computation.
Each graph runs R calls over R different weight copies (linear) or R different routings (MoE), so
weights are read from HBM, not from the 60 MB L2. Reports the weight bytes each call must read
over its time against a measured copy ceiling. ``--sweep`` also times candidate launch
configurations of the former MoE kernel (``benchmarks/bench_awq_pairs.py`` sweeps the pair
kernels).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.cuda_timer import graph_time
from custom_ops import awq as ops
from custom_ops import awq_kernels as K
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_pairs_moe as PM
from custom_ops import awq_repack as R
from custom_ops.awq_fbgemm import fbgemm_available, fbgemm_linear, fbgemm_pack

D, I_MOE, TOPK = 7168, 2048, 8
LINEAR_SHAPES = [(D, 4096), (16384, D), (D, 2048), (2048, D)]  # (K, N)
L2_BYTES = 60 << 20
# the linear paths timed side by side: each has a "<name>_us" column, named as in R.LINEAR_PATHS
# (awq_us looks the served path's column up by that name)
CANDIDATES = ("tinygemm", "pairs", "former", "fbgemm")
START = time.monotonic()


def graph_time_ms(calls, replays: int = 15) -> float:
    """Median time of one call (ms): all ``calls`` in one CUDA graph (benchmarks.cuda_timer)."""
    return graph_time(calls, replays).median_us / 1e3


def copy_ceiling_gbps() -> float:
    """An elementwise kernel over 1 GiB (read + write). A graph-captured ``copy_`` becomes a copy-
    engine memcpy node, which measured only ~2.8 TB/s in a first run: not the HBM ceiling."""
    n = 1 << 28  # fp32 elements, 1 GiB each way
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = graph_time_ms([lambda: torch.mul(src, 1.0, out=dst)] * 4)
    return 2 * 4 * n / ms / 1e6


def rand_awq(k: int, n: int, lead=(), sdtype=torch.float16, gen=None):
    def words(*shape):
        return torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, device="cuda",
                             generator=gen).to(torch.int32)  # fmt: skip

    s = (torch.rand((*lead, k // 128, n), device="cuda", generator=gen) * 2e-3 + 1e-4).to(sdtype)
    return words(*lead, k, n // 8), words(*lead, k // 128, n // 8), s


def awq_bytes(k: int, n: int) -> int:
    return k * n // 2 + (k // 128) * (n // 8) * 4 + (k // 128) * n * 2


def copies_for(nbytes: int) -> int:
    return max(2, min(64, math.ceil(4 * L2_BYTES / nbytes)))


# ---- linear ----------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fbgemm_pack_or_none(w):
    if not fbgemm_available():
        return None
    try:
        return fbgemm_pack(*w)
    except Exception as e:  # noqa: BLE001  (reported; the other paths go on)
        print(f"  fbgemm pack failed: {e!r}", flush=True)
        return None


def check_linear(result: dict) -> None:
    """Each W4A16 path against ``w4a16_linear_ref`` on the GPU: PASS/FAIL, recorded."""
    checks = result.setdefault("check", [])
    gen = torch.Generator("cuda").manual_seed(0)
    for k, n in LINEAR_SHAPES[:2]:
        w = rand_awq(k, n, gen=gen)
        p, tg = P.pair_awq(*w), R.tinygemm_pack(*w)
        fb = _fbgemm_pack_or_none(w)
        for m in (1, 3, 16, 128):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = ops.w4a16_linear_ref(x, *w)
            paths = {
                "pairs": lambda x=x, p=p: PK.w4a16_linear_p_triton(x, *p),
                "tinygemm": lambda x=x, tg=tg: R.tinygemm_linear(x, *tg),
                "former": lambda x=x, w=w: K.w4a16_linear_triton(x, *w),
            }
            if fb is not None:
                paths["fbgemm"] = lambda x=x, fb=fb: fbgemm_linear(x, *fb)
            for name, f in paths.items():
                # bound: bf16 output rounding, and tinygemm's bf16 scale/zero pairs
                bound = 2e-2 if name in ("tinygemm", "fbgemm") else 1e-2
                try:
                    err = rel_err(f(), ref)
                    ok = err < bound
                except Exception as e:  # a failing path is reported, the timings still run
                    err, ok = repr(e), False
                checks.append({"op": f"linear/{name}", "K": k, "N": n, "M": m, "rel_err": err,
                               "bound": bound, "pass": ok})  # fmt: skip
                print(f"  check linear {name} {k}x{n} M={m}: {'PASS' if ok else 'FAIL'} {err}")


def check_moe(result: dict) -> None:
    """The pair-layout and former fused MoE against ``moe_w4a16_ref`` on the GPU (16 experts of
    V3.2's shapes): PASS/FAIL, recorded."""
    checks = result.setdefault("check", [])
    gen = torch.Generator("cuda").manual_seed(1)
    e = 16
    w13, w2 = rand_awq(D, 2 * I_MOE, (e,), gen=gen), rand_awq(I_MOE, D, (e,), gen=gen)
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    for t in (1, 8, 64):
        x = torch.randn(t, D, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(TOPK, dim=-1).indices
        w = torch.rand(t, TOPK, device="cuda", generator=gen)
        ref = ops.moe_w4a16_ref(x, ids, w, *w13, *w2)
        for name, f in (
            ("pairs", lambda x=x, ids=ids, w=w: PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2)),
            ("former", lambda x=x, ids=ids, w=w: K.moe_w4a16_triton(x, ids, w, *w13, *w2)),
        ):
            try:
                err = rel_err(f(), ref)
                ok = err < 5e-3
            except Exception as ex:  # noqa: BLE001
                err, ok = repr(ex), False
            checks.append({"op": f"moe/{name}", "E": e, "T": t, "rel_err": err, "bound": 5e-3,
                           "pass": ok})  # fmt: skip
            print(f"  check moe {name} E={e} T={t}: {'PASS' if ok else 'FAIL'} {err}")


def _time(calls) -> float:
    try:
        return graph_time_ms(calls) * 1e3
    except Exception as e:  # noqa: BLE001  (one path failing must not stop the others)
        print(f"    timing failed: {e!r}", flush=True)
        return math.nan


def bench_linear(k: int, n: int, batches: list[int], hbm: float) -> list[dict]:
    rows = []
    ra, rb = copies_for(awq_bytes(k, n)), copies_for(2 * k * n)
    wa = [rand_awq(k, n) for _ in range(ra)]
    wp = [P.pair_awq(*w) for w in wa]
    try:
        wt = [R.tinygemm_pack(*w) for w in wa]
    except Exception as e:  # noqa: BLE001
        print(f"  tinygemm pack failed: {e!r}", flush=True)
        wt = []
    wf = [f for f in (_fbgemm_pack_or_none(w) for w in wa) if f is not None]
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(rb)]
    ba, bb = awq_bytes(k, n), 2 * k * n
    sms = K._num_sms(torch.device("cuda"))
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg_old = K.linear_config(m, n, k, sms)
        cfg = PK.p_config(m, n, k, sms)  # what echo::w4a16_linear_p launches
        row = {"in": k, "out": n, "M": m, "config": cfg_old, "pairs_config": cfg}
        row["former_us"] = _time(
            [lambda w=w, x=x, c=cfg_old: K.w4a16_linear_triton(x, *w, config=c) for w in wa]
        )
        # NOTE: "pairs_us", the name of the path in R.LINEAR_PATHS: awq_us below looks it up
        row["pairs_us"] = _time(
            [lambda w=w, x=x, c=cfg: PK.w4a16_linear_p_triton(x, *w, config=c) for w in wp]
        )
        row["tinygemm_us"] = (
            _time([lambda w=w, x=x: R.tinygemm_linear(x, *w) for w in wt]) if wt else math.nan
        )
        if wf:
            row["fbgemm_us"] = _time([lambda w=w, x=x: fbgemm_linear(x, *w) for w in wf])
        row["bf16_us"] = _time([lambda w=w, x=x: F.linear(x, w) for w in wb])
        use_tg = R.use_tinygemm(m, x.dtype, R.tinygemm_max_m(k, n)) and wt
        row["awq_path"] = "tinygemm" if use_tg else R.LARGE_M_PATH
        row["awq_us"] = row[f"{row['awq_path']}_us"]
        best = min(
            ((v, key) for key, v in row.items() if key.endswith("_us") and key != "bf16_us"
             and not math.isnan(v)),
            default=(math.nan, "none_us"),
        )  # fmt: skip
        row.update(
            {
                "best_w4_us": best[0],
                "best_w4_path": best[1].removesuffix("_us"),
                "speedup_vs_bf16": row["bf16_us"] / row["awq_us"],
                "best_speedup_vs_bf16": row["bf16_us"] / best[0],
                "awq_weight_GBps": ba / row["awq_us"] / 1e3,
                "bf16_weight_GBps": bb / row["bf16_us"] / 1e3,
            }
        )
        row["awq_frac_hbm"] = row["awq_weight_GBps"] / hbm
        row["bf16_frac_hbm"] = row["bf16_weight_GBps"] / hbm
        rows.append(row)
        print(
            f"  linear {k}x{n} M={m}: bf16 {row['bf16_us']:.1f}, tinygemm {row['tinygemm_us']:.1f}"
            f", pairs {row['pairs_us']:.1f}, former {row['former_us']:.1f} us "
            f"(best {best[1]} {row['best_speedup_vs_bf16']:.2f}x bf16)",
            flush=True,
        )
    del wa, wp, wt, wb, wf
    return rows


def dispatch_table(rows: list[dict]) -> dict:
    """Per shape: the largest M at which tinygemm beat both Triton kernels (0: never)."""
    out = {}
    for r in rows:
        key = f"{r['in']}x{r['out']}"
        out.setdefault(key, 0)
        if r["tinygemm_us"] < min(r["pairs_us"], r["former_us"]) and r["M"] > out[key]:
            out[key] = r["M"]
    return out


def best_by_m(rows: list[dict]) -> dict:
    """Per shape and M: the fastest candidate (NaN or missing timings lose)."""
    out: dict = {}
    for r in rows:
        cands = {p: r[f"{p}_us"] for p in CANDIDATES
                 if not math.isnan(r.get(f"{p}_us", math.nan))}  # fmt: skip
        out.setdefault(f"{r['in']}x{r['out']}", {})[r["M"]] = min(cands, key=cands.get, default="")
    return out


# ---- MoE -------------------------------------------------------------------------------------


def routings(t: int, e: int, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(r):
        ids = torch.rand(t, e, device="cuda").topk(TOPK, dim=-1).indices.to(torch.int32)
        out.append((ids, torch.rand(t, TOPK, device="cuda")))
    return out


def torch_align(fn):
    """``fn()`` with the MoE groupings (``moe_align``, ``expert_rows``) forced to their torch
    forms, the one-program kernels' baseline."""
    from custom_ops import moe_align as A

    keep = A.KERNEL_MAX_PAIRS
    A.KERNEL_MAX_PAIRS = 0
    try:
        return fn()
    finally:
        A.KERNEL_MAX_PAIRS = keep


def dense_all_experts(x, ids, w, w13, w2):
    """model/moe.py ``Experts`` (bf16): every expert on every token, then gather."""
    inter = w13.shape[1] // 2
    gu = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, T, 2I]
    h = F.silu(gu[..., :inter].float()) * gu[..., inter:].float()
    y = torch.matmul(h.to(x.dtype), w2.transpose(1, 2))  # [E, T, D]
    idx = ids.long().unsqueeze(-1).expand(*ids.shape, x.shape[1])
    return (y.transpose(0, 1).gather(1, idx).float() * w.unsqueeze(-1)).sum(1)


def bench_moe(
    e: int, batches: list[int], hbm: float, with_bf16: bool = True, config=None,
    with_i2f: bool = False,
) -> list[dict]:  # fmt: skip
    rows = []
    w13, w2 = rand_awq(D, 2 * I_MOE, (e,)), rand_awq(I_MOE, D, (e,))
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    per_expert_awq = awq_bytes(D, 2 * I_MOE) + awq_bytes(I_MOE, D)
    per_expert_bf16 = 2 * 3 * D * I_MOE
    if with_bf16:
        w13b = torch.randn(e, 2 * I_MOE, D, device="cuda", dtype=torch.bfloat16) * 0.02
        w2b = torch.randn(e, D, I_MOE, device="cuda", dtype=torch.bfloat16) * 0.02
    for t in batches:
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        routes = routings(t, e, 8)
        touched = statistics.mean(torch.unique(ids).numel() for ids, _ in routes)
        cfg = config or K.moe_config(t * TOPK, e)
        pcfg = PM.moe_p_config(t * TOPK, e)  # what echo::moe_w4a16_p launches
        t_former = graph_time_ms(
            [
                lambda r=r, x=x, c=cfg: K.moe_w4a16_triton(x, r[0], r[1], *w13, *w2, config=c)
                for r in routes
            ]
        )
        t_awq = (
            _time(
                [
                    lambda r=r, x=x, c=pcfg: PM.moe_w4a16_p_triton(
                        x, r[0], r[1], *p13, *p2, config=c
                    )
                    for r in routes
                ]
            )
            / 1e3
        )
        if math.isnan(t_awq):  # the pair kernel failed: report the former one as served
            t_awq = t_former
        row = {
            "experts": e,
            "topk": TOPK,
            "T": t,
            "experts_touched": touched,
            "awq_us": t_awq * 1e3,
            "former_us": t_former * 1e3,
            "pairs_speedup_vs_former": t_former / t_awq,
            "awq_weight_GBps": touched * per_expert_awq / t_awq / 1e6,
            "config": cfg,
            "pairs_config": pcfg,
        }
        row["awq_frac_hbm"] = row["awq_weight_GBps"] / hbm
        if with_i2f:
            i2f = {**cfg, "MAGIC": False}
            row["awq_int2float_dequant_us"] = 1e3 * graph_time_ms(
                [
                    lambda r=r, x=x, c=i2f: K.moe_w4a16_triton(x, r[0], r[1], *w13, *w2, config=c)
                    for r in routes
                ]
            )
        if with_bf16:
            t_b = graph_time_ms(
                [
                    lambda r=r, x=x: K.moe_bf16_triton(x, r[0], r[1], w13b, w2b, config=config)
                    for r in routes
                ]
            )
            row.update(
                {
                    "bf16_triton_us": t_b * 1e3,
                    "speedup_vs_bf16_triton": t_b / t_awq,
                    "bf16_weight_GBps": touched * per_expert_bf16 / t_b / 1e6,
                }
            )
            row["bf16_frac_hbm"] = row["bf16_weight_GBps"] / hbm
            if e <= 16:
                t_d = graph_time_ms(
                    [lambda r=r, x=x: dense_all_experts(x, r[0], r[1], w13b, w2b) for r in routes]
                )
                row.update(
                    {"bf16_dense_all_experts_us": t_d * 1e3, "speedup_vs_bf16_dense": t_d / t_awq}
                )
        rows.append(row)
        print(
            f"  moe E={e} T={t}: pairs {t_awq * 1e3:.1f} us, former {t_former * 1e3:.1f} us"
            + (f", bf16 triton {row['bf16_triton_us']:.1f} us" if with_bf16 else ""),
            flush=True,
        )
    return rows


# ---- sweep -----------------------------------------------------------------------------------


def moe_candidates(t: int, e: int) -> list[dict]:
    per = t * TOPK / e
    bms = [16] + ([32] if per > 8 else []) + ([64] if per > 24 else [])
    out = []
    for bm in bms:
        for bn, bk, warps, stages in [
            (32, 128, 4, 3),
            (64, 128, 4, 3),
            (64, 128, 4, 4),
            (128, 64, 4, 3),
            (128, 128, 8, 3),
        ]:
            out.append({"BM": bm, "BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages})
    return out


def sweep(hbm: float, budget_s: float) -> list[dict]:
    """The former MoE kernel's launch candidates (``moe_candidates``); the pair kernels have
    their own sweep in ``benchmarks/bench_awq_pairs.py``."""
    res = []
    jobs = [("moe256", 1), ("moe256", 128), ("moe256", 16), ("moe16", 128), ("moe16", 8)]
    for kind, size in jobs:
        if time.monotonic() - START > budget_s:
            print(f"sweep: budget reached, skipping {kind} {size} and later", flush=True)
            break
        best = None
        e = 256 if kind == "moe256" else 16
        for cfg in moe_candidates(size, e):
            try:
                row = bench_moe(e, [size], hbm, with_bf16=False, config=cfg)[0]
            except Exception as err:
                res.append({"kind": kind, "size": size, "config": cfg, "error": repr(err)})
                continue
            # the candidates are the former kernel's (awq_kernels.moe_config)
            res.append({"kind": kind, "size": size, "config": cfg, "us": row["former_us"]})
            best = min(best or (1e9, ""), (row["former_us"], json.dumps(cfg)))
        print(f"sweep {kind} size={size}: best {best}", flush=True)
    return res


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--experts", default="16,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop sweeping after this")
    ap.add_argument("--int2float", action="store_true", help="also the MoE's int->float dequant")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_awq: needs a CUDA GPU")
    import triton

    batches = [int(b) for b in args.batches.split(",")]
    props = torch.cuda.get_device_properties(0)
    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA graph of R calls over R weight copies / routings, median of 15 replays",
        "hbm_reference_GBps": 4300,
        "fbgemm": fbgemm_available(),
    }
    if not result["fbgemm"]:
        print("bench_awq: fbgemm-gpu-genai is not installed (or does not load): no fbgemm column")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - START
        out.write_text(json.dumps(result, indent=1))

    hbm = copy_ceiling_gbps()
    result["hbm_copy_GBps"] = hbm
    print(f"{result['device']}: copy ceiling {hbm:.0f} GB/s", flush=True)
    for check in (check_linear, check_moe):
        try:
            check(result)
        except Exception as err:  # noqa: BLE001  (a failing check is recorded; timings go on)
            result.setdefault("check", []).append({"op": check.__name__, "error": repr(err),
                                                   "pass": False})  # fmt: skip
            print(f"{check.__name__} failed: {err!r}", flush=True)
    save()
    result["linear"] = []
    for k, n in LINEAR_SHAPES:
        try:
            result["linear"] += bench_linear(k, n, batches, hbm)
        except Exception as err:
            result.setdefault("errors", []).append(f"linear {k}x{n}: {err!r}")
            print(f"linear {k}x{n} failed: {err!r}", flush=True)
        result["dispatch"] = {
            "tinygemm_max_m_by_shape": dispatch_table(result["linear"]),
            "best_by_m": best_by_m(result["linear"]),
            "in_use": {"max_m": R.TINYGEMM_MAX_M, "max_weights": R.TINYGEMM_MAX_WEIGHTS},
            "large_m_path_in_use": R.LARGE_M_PATH,
        }
        save()
        torch.cuda.empty_cache()
    result["moe"] = []
    for e in [int(x) for x in args.experts.split(",")]:
        try:
            result["moe"] += bench_moe(e, batches, hbm, with_i2f=args.int2float)
        except Exception as err:
            result.setdefault("errors", []).append(f"moe E={e}: {err!r}")
            print(f"moe E={e} failed: {err!r}", flush=True)
        torch.cuda.empty_cache()
        save()
    if args.sweep:
        result["sweep"] = sweep(hbm, args.budget_s)
        save()

    fails = [c for c in result["check"] if not c["pass"]]
    print(f"\ncheck: {'PASS' if not fails else 'FAIL'} ({len(fails)} of {len(result['check'])})")
    print(
        f"\n{'linear K x N':>16} {'M':>4} {'bf16':>7} {'tinygemm':>8} {'pairs':>7} "
        f"{'former':>7} {'served':>7} {'x bf16':>7} {'best':>14} {'x bf16':>6} {'%HBM':>5}"
    )
    for r in result["linear"]:
        print(
            f"{r['in']:>7}x{r['out']:<8} {r['M']:>4} {r['bf16_us']:7.1f} {r['tinygemm_us']:8.1f} "
            f"{r['pairs_us']:7.1f} {r['former_us']:7.1f} {r['awq_us']:7.1f} "
            f"{r['speedup_vs_bf16']:7.2f} {r['best_w4_path']:>14} "
            f"{r['best_speedup_vs_bf16']:6.2f} {100 * r['awq_frac_hbm']:5.0f}"
        )
    print(f"dispatch (largest M where tinygemm won, per shape): {result.get('dispatch')}")
    print(
        f"\n{'moe E':>6} {'T':>4} {'touched':>7} {'awq us':>8} {'i2f us':>8} {'bf16 us':>8} "
        f"{'x bf16':>7} {'awq %HBM':>8} {'bf16 %HBM':>9} {'dense us':>9}"
    )
    for r in result["moe"]:
        print(
            f"{r['experts']:>6} {r['T']:>4} {r['experts_touched']:7.1f} {r['awq_us']:8.1f} "
            f"{r.get('awq_int2float_dequant_us', float('nan')):8.1f} "
            f"{r.get('bf16_triton_us', float('nan')):8.1f} "
            f"{r.get('speedup_vs_bf16_triton', float('nan')):7.2f} "
            f"{100 * r['awq_frac_hbm']:8.0f} {100 * r.get('bf16_frac_hbm', float('nan')):9.0f} "
            f"{r.get('bf16_dense_all_experts_us', float('nan')):9.1f}"
        )
    print(f"\nwrote {out} in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
