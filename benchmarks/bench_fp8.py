"""FP8 block-scaled linear (``echo::fp8_linear``) vs bf16 at decode batch sizes, on one GPU (H200).

    python -m benchmarks.bench_fp8 --out $OUT/fp8_h200.json [--configs 'JSON list']

First checks the Triton kernels and, where it imports (SM90), DeepGEMM's (``echo::dg_fp8_linear``
/ ``echo::dg_moe_fp8``, with their quantising kernel) against the references on the GPU
(``check``: PASS/FAIL recorded, the timings run regardless; no DeepGEMM: said, and its columns
are left out), then times at the DeepSeek-V3.2 shapes (K x N: 7168 x 4096,
16384 x 7168, 7168 x 2048, 2048 x 7168, 7168 x 576 (kv_a_proj, a ragged last scale block)) and
M = 1..128: bf16 ``F.linear`` on the dequantised weights (the dequantise-at-load path) against
the FP8 kernel with its heuristic config and each of ``--configs``; then the fused FP8 MoE
(``echo::moe_fp8``, 256 experts of V3.2's shapes, top-8, T = 1..128 tokens) against the grouped
bf16 MoE the bf16 model runs (``echo::moe_bf16``'s Triton kernel), and, where DeepGEMM serves, the
DeepGEMM and bf16 MoEs again with their groupings' torch forms (``*_torch_group_us``).
CUDA-graph replays of R calls over R weight copies / routings (more bytes than the 60 MB L2),
median of 15; weight bytes read per µs against a measured copy ceiling. ``served_us`` is what
``echo::fp8_linear`` / ``echo::moe_fp8`` run (DeepGEMM where it suits, else Triton);
``dg_first_call_s`` the first DeepGEMM call of a shape (its JIT compile). JSON written after
every shape; a section that would start past ``--budget-s`` is skipped (recorded).
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
    torch_align,
)
from custom_ops import awq_kernels as K
from custom_ops import fp8_linear as F8
from custom_ops import fp8_linear_kernels as FK
from custom_ops.awq_kernels import _num_sms
from custom_ops.backends import deep_gemm_gemm as DG
from model.fp8_weights import weight_dequant_fp8, weight_quant_fp8

SHAPES = [(7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168), (7168, 576)]  # (K, N)
START = time.monotonic()


def fp8_bytes(k: int, n: int) -> int:
    return k * n + (-(-n // 128)) * (k // 128) * 4


def rand_fp8(k: int, n: int, gen=None) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    return weight_quant_fp8(w, scale_fmt="ue8m0")


# the DeepGEMM MoE quantises h = silu(g) * u to e4m3 between its GEMMs: the GEMM's ~7e-4
# difference from the reference moves ~1% of h to the neighbouring e4m3 value (a step of 6%),
# ~0.5% on the output (docs/quantization.md, "FP8 on the H200"); a misrouted row is O(1)
MOE_DG_BOUND = 1e-2


def _check_one(checks: list, op: str, fn, ref, bound: float = 5e-3, **where) -> None:
    try:
        err = rel_err(fn(), ref)
        ok = err < bound  # fp8 MMA accumulation inside a K block, bf16 output
    except Exception as e:  # noqa: BLE001  (reported; the timings still run)
        err, ok = repr(e), False
    checks.append({"op": op, **where, "rel_err": err, "bound": bound, "pass": ok})
    print(f"  check {op} {where}: {'PASS' if ok else 'FAIL'} {err}", flush=True)


def merged_config(cfg: dict, extra: dict, k: int) -> dict:
    """The heuristic's config with a ``--configs`` entry over it; ``SPLIT_K_X`` multiplies the
    heuristic's split (within the K blocks; 0.5 halves it)."""
    c = {**cfg, **extra}
    if "SPLIT_K_X" in c:
        c["SPLIT_K"] = max(1, min(int(cfg["SPLIT_K"] * c.pop("SPLIT_K_X")), k // 128))
    return c


def check(result: dict, dg: bool, extra: list[dict]) -> None:
    checks = result.setdefault("check", [])
    gen = torch.Generator("cuda").manual_seed(0)
    for k, n in (SHAPES[0], SHAPES[-1]):
        w8, ws = rand_fp8(k, n, gen)
        for m in (1, 4, 16, 128):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = F8.fp8_linear_ref(x, w8, ws, True)
            where = {"K": k, "N": n, "M": m}
            args = (x, w8, ws, True)
            _check_one(checks, "fp8_linear", lambda a=args: FK.fp8_linear_triton(*a), ref, **where)
            pre = {**FK.fp8_config(m, n, k, _num_sms(x.device)), "PREQUANT": True}
            _check_one(
                checks,
                "fp8_linear_prequant",
                lambda a=args, c=pre: FK.fp8_linear_triton(*a, config=c),
                ref,
                **where,
            )
            for i, e in enumerate(extra):  # each timed configuration computes the product too
                c = merged_config(FK.fp8_config(m, n, k, _num_sms(x.device)), e, k)
                _check_one(checks, f"fp8_linear_cfg{i}",
                           lambda a=args, c=c: FK.fp8_linear_triton(*a, config=c), ref, **where)
            if not dg:
                continue
            try:  # the quantising kernel: bit-exact e4m3 values and scales, DeepGEMM's layout
                from custom_ops.backends import deep_gemm_gemm_kernels as DK

                q, sf = DK.act_quant_dg(x, True)
                rq, rs = DG.act_quant_dg_ref(x, True)
                ok = bool(torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
                          and torch.equal(sf, rs) and sf.stride() == rs.stride())  # fmt: skip
            except Exception as e:  # noqa: BLE001
                ok = repr(e)
            checks.append({"op": "dg_act_quant", **where, "exact": ok, "pass": ok is True})
            print(f"  check dg_act_quant {where}: {'PASS' if ok is True else 'FAIL'}", flush=True)
            _check_one(checks, "dg_fp8_linear", lambda a=args: DG.dg_fp8_linear(*a), ref, **where)


def _time(calls) -> float:
    try:
        return graph_time_ms(calls) * 1e3
    except Exception as e:  # noqa: BLE001
        print(f"    timing failed: {e!r}", flush=True)
        return math.nan


def bench_shape(
    k: int, n: int, batches: list[int], hbm: float, extra: list[dict], dg: bool
) -> list[dict]:
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
            c = merged_config(cfg, e, k)
            row[f"fp8_cfg{i}"] = c
            row[f"fp8_cfg{i}_us"] = _time(
                [lambda w=w, x=x, c=c: FK.fp8_linear_triton(x, *w, True, config=c) for w in w8s]
            )
        pre = {**cfg, "PREQUANT": True}
        row["fp8_prequant_us"] = _time(
            [lambda w=w, x=x, c=pre: FK.fp8_linear_triton(x, *w, True, config=c) for w in w8s]
        )
        if dg and DG.linear_suits(m, n, k, x.dtype):
            t0 = time.monotonic()
            try:  # the first call JIT-compiles; an error is recorded, the shape goes on
                DG.dg_fp8_linear(x, *w8s[0], True)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001
                row["dg_error"] = repr(err)
            row["dg_first_call_s"] = time.monotonic() - t0
            row["fp8_dg_us"] = _time([lambda w=w, x=x: DG.dg_fp8_linear(x, *w, True) for w in w8s])
        # what a user's model runs: the op itself, whichever kernel it dispatches to
        row["served_us"] = _time(
            [lambda w=w, x=x: torch.ops.echo.fp8_linear(x, *w, True) for w in w8s]
        )
        row["bf16_us"] = _time([lambda w=w, x=x: F.linear(x, w) for w in wbs])
        fp8_times = [
            v for key, v in row.items()
            if key.startswith("fp8") and key.endswith("_us") and not math.isnan(v)
        ]  # fmt: skip
        best = min(fp8_times, default=math.nan)
        row.update(
            {
                "best_fp8_us": best,
                "speedup_vs_bf16": row["bf16_us"] / row["fp8_us"],
                "served_speedup_vs_bf16": row["bf16_us"] / row["served_us"],
                "best_speedup_vs_bf16": row["bf16_us"] / best,
                "fp8_weight_GBps": fp8_bytes(k, n) / row["fp8_us"] / 1e3,
                "bf16_weight_GBps": 2 * k * n / row["bf16_us"] / 1e3,
            }
        )
        row["fp8_frac_hbm"] = row["fp8_weight_GBps"] / hbm
        row["bf16_frac_hbm"] = row["bf16_weight_GBps"] / hbm
        rows.append(row)
        dg_us = row.get("fp8_dg_us", math.nan)
        cfgs = [row[f"fp8_cfg{i}_us"] for i in range(len(extra))]
        print(
            f"  fp8 {k}x{n} M={m}: triton {row['fp8_us']:.1f} us, prequant "
            f"{row['fp8_prequant_us']:.1f}, configs {' / '.join(f'{v:.1f}' for v in cfgs) or '-'}, "
            f"deep_gemm {dg_us:.1f} us (best {best:.1f}), served {row['served_us']:.1f}, "
            f"bf16 {row['bf16_us']:.1f} us, served {row['served_speedup_vs_bf16']:.2f}x",
            flush=True,
        )
    return rows


def rand_experts(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ws = [rand_fp8(k, n) for _ in range(e)]
    return torch.stack([w for w, _ in ws]), torch.stack([sc for _, sc in ws])


def bench_moe(
    e: int, batches: list[int], hbm: float, result: dict, dg: bool, extra: list[dict]
) -> list[dict]:
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
    if dg:
        ref = F8.moe_fp8_ref(x, ids, wt, w13, s13, w2, s2, True)
        args = (x, ids, wt, w13, s13, w2, s2, True)
        _check_one(result["check"], "dg_moe_fp8", lambda: DG.dg_moe_fp8(*args), ref, MOE_DG_BOUND,
                   E=e, T=8)  # fmt: skip
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
        # what a user's model runs: the op itself, whichever kernel it dispatches to
        ts = _time([lambda r=r, x=xt: torch.ops.echo.moe_fp8(x, r[0], r[1], w13, s13, w2, s2, True)
                    for r in routes])  # fmt: skip
        row = {"experts": e, "topk": TOPK, "T": t, "experts_touched": touched, "fp8_us": t8,
               "bf16_triton_us": tb, "speedup_vs_bf16_triton": tb / t8,
               "fp8_weight_GBps": touched * per_fp8 / t8 / 1e3,
               "bf16_weight_GBps": touched * per_bf16 / tb / 1e3}  # fmt: skip
        if dg and DG.moe_suits(t, D, I_MOE, xt.dtype):
            td = _time([lambda r=r, x=xt: DG.dg_moe_fp8(x, r[0], r[1], w13, s13, w2, s2, True)
                        for r in routes])  # fmt: skip
            row.update({"fp8_dg_us": td, "dg_speedup_vs_bf16_triton": tb / td,
                        "dg_weight_GBps": touched * per_fp8 / td / 1e3})  # fmt: skip
            # both MoEs with the groupings in their torch forms: what the kernels save
            dg_calls = [lambda r=r, x=xt: DG.dg_moe_fp8(x, r[0], r[1], w13, s13, w2, s2, True)
                        for r in routes]  # fmt: skip
            bf_calls = [lambda r=r, x=xt: K.moe_bf16_triton(x, r[0], r[1], w13b, w2b)
                        for r in routes]  # fmt: skip
            row["fp8_dg_torch_group_us"] = torch_align(lambda c=dg_calls: _time(c))
            row["bf16_triton_torch_group_us"] = torch_align(lambda c=bf_calls: _time(c))
        cfg = FK.moe_fp8_config(t * TOPK, e, TOPK)
        row["config"] = cfg
        for i, c in enumerate({**cfg, **x} for x in extra):
            row[f"fp8_cfg{i}"] = c
            row[f"fp8_cfg{i}_us"] = _time(
                [lambda r=r, x=xt, c=c: FK.moe_fp8_triton(x, r[0], r[1], w13, s13, w2, s2, True, c)
                 for r in routes]
            )  # fmt: skip
        row["served_us"], row["served_speedup_vs_bf16_triton"] = ts, tb / ts
        row["fp8_frac_hbm"] = row["fp8_weight_GBps"] / hbm
        rows.append(row)
        cfgs = " / ".join(f"{row[f'fp8_cfg{i}_us']:.1f}" for i in range(len(extra)))
        print(f"  moe E={e} T={t}: triton {t8:.1f} us (configs {cfgs or '-'}), deep_gemm "
              f"{row.get('fp8_dg_us', math.nan):.1f} us "
              f"(torch grouping {row.get('fp8_dg_torch_group_us', math.nan):.1f}), "
              f"bf16 {tb:.1f} us "
              f"(torch grouping {row.get('bf16_triton_torch_group_us', math.nan):.1f}; "
              f"served {tb / ts:.2f}x)", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,16,128", help="linear M values ('': none; each "
                    "JIT-compiles DeepGEMM kernels on a fresh machine: keep few)")  # fmt: skip
    ap.add_argument("--experts", type=int, default=256, help="routed experts of the MoE (0: skip)")
    ap.add_argument("--moe-batches", default="1,8,16,64,128", help="MoE token counts")
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="skip the sections that would start after this many seconds")  # fmt: skip
    ap.add_argument(
        "--configs",
        default="[]",
        help="JSON list of partial configs of the FP8 kernel to time as well, e.g. "
        '\'[{"BM": 64}, {"BN": 64, "SPLIT_K": 4}, {"PREQUANT": true, "SPLIT_K_X": 2}]\' '
        "(merged into its heuristic; SPLIT_K_X multiplies its split)",
    )
    ap.add_argument("--moe-configs", default="[]",
                    help='JSON list of partial configs of the Triton FP8 MoE to time as well, '
                    'e.g. \'[{"SPLIT_GU": 8, "num_warps": 8}]\'')  # fmt: skip
    args = ap.parse_args()

    def configs(flag: str, text: str) -> list[dict]:
        try:
            got = json.loads(text)
            if not isinstance(got, list) or not all(isinstance(c, dict) for c in got):
                raise ValueError
        except ValueError:
            raise SystemExit(
                f"bench_fp8: {flag} must be a JSON list of objects, got {text!r}"
            ) from None
        return got

    extra = configs("--configs", args.configs)
    moe_extra = configs("--moe-configs", args.moe_configs)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8: needs a CUDA GPU")
    import triton

    batches = [int(b) for b in args.batches.split(",") if b]  # '': no linears
    moe_batches = [int(b) for b in args.moe_batches.split(",")]
    dg = DG.available(0)
    if not dg:
        print("bench_fp8: DeepGEMM is not installed (or not SM90): its columns are skipped")
    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA graph of R calls over R weight copies, median of 15 replays",
        "extra_configs": extra,
        "moe_extra_configs": moe_extra,
        "deep_gemm": dg,
        "fp8_backend": F8.fp8_backend(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - START
        out.write_text(json.dumps(result, indent=1))

    hbm = copy_ceiling_gbps()
    result["hbm_copy_GBps"] = hbm
    try:
        check(result, dg, extra)
    except Exception as err:  # noqa: BLE001  (recorded; the timings go on)
        result.setdefault("check", []).append({"op": "check", "error": repr(err), "pass": False})
        print(f"check failed: {err!r}", flush=True)
    save()
    result["linear"] = []
    for k, n in SHAPES if batches else ():
        if time.monotonic() - START > args.budget_s:
            result.setdefault("skipped", []).append(f"fp8 {k}x{n}: past --budget-s")
            continue
        try:
            result["linear"] += bench_shape(k, n, batches, hbm, extra, dg)
        except Exception as err:  # noqa: BLE001
            result.setdefault("errors", []).append(f"fp8 {k}x{n}: {err!r}")
            print(f"fp8 {k}x{n} failed: {err!r}", flush=True)
        save()
        torch.cuda.empty_cache()
    result["moe"] = []
    if args.experts and time.monotonic() - START > args.budget_s:
        result.setdefault("skipped", []).append("moe: past --budget-s")
    elif args.experts:
        try:
            result["moe"] = bench_moe(args.experts, moe_batches, hbm, result, dg, moe_extra)
        except Exception as err:  # noqa: BLE001
            result.setdefault("errors", []).append(f"moe E={args.experts}: {err!r}")
            print(f"moe failed: {err!r}", flush=True)
        save()
    fails = [c for c in result["check"] if not c["pass"]]
    print(f"\ncheck: {'PASS' if not fails else 'FAIL'} ({len(fails)} of {len(result['check'])})")
    print(f"{'K x N':>14} {'M':>4} {'bf16 us':>8} {'triton':>8} {'preq':>8} {'configs':>8} "
          f"{'dg':>8} {'served':>8} {'x bf16':>7} {'%HBM':>5}")  # fmt: skip
    for r in result["linear"]:
        cfgs = [v for key, v in r.items() if key.startswith("fp8_cfg") and key.endswith("_us")]
        print(
            f"{r['in']:>6}x{r['out']:<7} {r['M']:>4} {r['bf16_us']:8.1f} {r['fp8_us']:8.1f} "
            f"{r['fp8_prequant_us']:8.1f} {min(cfgs, default=math.nan):8.1f} "
            f"{r.get('fp8_dg_us', math.nan):8.1f} {r['served_us']:8.1f} "
            f"{r['served_speedup_vs_bf16']:7.2f} {100 * r['fp8_frac_hbm']:5.0f}"
        )
    print(f"\nwrote {out} in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
