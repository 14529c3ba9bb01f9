"""The pair-layout W4A16 kernels (``echo::w4a16_linear_p``, ``echo::moe_w4a16_p``) on the H200,
side by side with what serves AWQ today, bf16, tinygemm and fbgemm, plus a launch sweep.

    python -m benchmarks.bench_awq_pairs --out $OUT/awq_pairs_h200.json [--budget-s 300]

1. Checks (PASS/FAIL, recorded; timings go on): at V3.2 shapes the kernel's inline-PTX mode equals
   its Triton-ops mode bit for bit, and both are within 1e-2 relative of the reference, SCALED
   too (and within 1e-2 of its own rounded weights); ``dequant_p`` equals the rounded reference
   weight bit for bit; the MoE (16 experts) the same against ``moe_w4a16_ref``.
2. Linear, K x N in ``bench_awq.LINEAR_SHAPES``, M in ``--batches``: bf16 ``F.linear``, tinygemm,
   the served path (``AWQLinear``'s dispatch now), the former Triton kernel, fbgemm's CUTLASS
   int4 GEMM where it imports, and the pair kernel: its heuristic (``p_config``) and every
   candidate of ``linear_candidates`` (``pair_best_us`` and its config, exact weights); from
   M = 32 the SCALED kernel's candidates too (``scaled_candidates``, W rounded to bf16).
   ``--no-sweeps``: the served configurations only.
3. Prefill, M in ``--prefill-batches``: bf16, the exact-weight pair kernel, the SCALED kernel's
   best wide tile, and the weight dequantised once then ``F.linear`` (served from
   ``awq_pairs_kernels.DEQUANT_MIN_M``), and the dequantisation alone.
4. MoE, 256 experts, top-8, T in ``--moe-batches``: the bf16 grouped Triton MoE (what the bf16
   model runs) and the pair MoE (served), heuristic and candidates, and the SCALED passes'
   candidates (``moe_scaled_candidates``).
``--extra JSON``: keys merged into the served configurations (linear and MoE), checked (PTX ==
ops, against the reference) and timed beside them as ``extra_us``; with sweeps, every linear
candidate is timed with them too (``extra_sweep``, ``extra_best_us``).
Each graph holds R calls over R weight copies (or routings), so weights come from HBM, not L2
(``bench_awq``'s method). A section stops starting new points once ``--budget-s`` is spent.
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
    LINEAR_SHAPES,
    TOPK,
    D,
    _fbgemm_pack_or_none,
    _time,
    awq_bytes,
    copies_for,
    copy_ceiling_gbps,
    rand_awq,
    rel_err,
    routings,
)
from custom_ops import awq as ops
from custom_ops import awq_kernels as K
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_pairs_moe as PM
from custom_ops import awq_repack as R
from custom_ops.awq_fbgemm import fbgemm_available, fbgemm_linear

START = time.monotonic()


def over(budget_s: float) -> bool:
    return time.monotonic() - START > budget_s


def linear_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """Launch configurations around ``p_config``: tile width, warps, stages, split-K depth."""
    bt = PK.tokens_tile(m)
    shapes = [(64, 4, 4), (128, 4, 4), (128, 4, 6), (128, 8, 4), (256, 8, 4)]
    if bt >= 64:
        shapes = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 3)]
    out = []
    for bn, warps, stages in shapes:
        for ppsm in (2, 4, 8):
            c = PK.p_config(m, n, k, sms, programs_per_sm=ppsm, bn=bn)
            c.update(num_warps=warps, num_stages=stages, SCALED=False)
            if c not in out:
                out.append(c)
    return out


def scaled_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """The SCALED kernel (one accumulator, W rounded to x's dtype) at M > 16: wider tiles, which
    the per-group partial product's registers ruled out, and several split-K depths."""
    bt, out = PK.tokens_tile(m), []
    for bn, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3)):
        for ppsm in (1, 2, 4):
            c = PK.p_config(m, n, k, sms, programs_per_sm=ppsm, bn=bn)
            c.update(BT=bt, num_warps=warps, num_stages=stages, FUSED=False, SCALED=True)
            if c not in out:
                out.append(c)
    return out


def moe_scaled_candidates(t: int) -> list[dict]:
    """The MoE's SCALED passes (W rounded to bf16): the rule's row block and twice it (at most
    128 pairs), 64 columns on 4 warps or 128 on 8."""
    bt = PM.moe_p_config(t * TOPK, 256)["BT"]
    tiles = ((64, 4), (128, 8))
    return [{"BN": bn, "BT": b, "num_warps": warps, "num_stages": 3, "SCALED": True}
            for b in sorted({bt, min(128, 2 * bt)}) for bn, warps in tiles]  # fmt: skip


def moe_candidates(t: int) -> list[dict]:
    bt = PM.moe_p_config(t * TOPK, 256)["BT"]
    out = []
    for bn, warps, stages in ((64, 4, 3), (64, 4, 4), (64, 4, 6), (128, 4, 4), (128, 8, 4)):
        out.append({"BN": bn, "BT": bt, "num_warps": warps, "num_stages": stages})
    return out


# ---- checks ----------------------------------------------------------------------------------


def record(result: dict, op: str, err, bound: float | None, **where) -> None:
    ok = err == 0.0 if bound is None else isinstance(err, float) and err < bound
    result.setdefault("check", []).append({"op": op, **where, "err": err, "bound": bound,
                                           "pass": ok})  # fmt: skip
    print(f"  check {op} {where}: {'PASS' if ok else 'FAIL'} {err}", flush=True)


def check(result: dict, extra: dict | None = None, shapes: list | None = None,
          moe: bool = True) -> None:  # fmt: skip
    """The kernels against their references on the linear ``shapes`` (default the first two of
    ``LINEAR_SHAPES``) and, with ``moe``, the pair MoE on 16 experts."""
    gen = torch.Generator("cuda").manual_seed(0)
    for k, n in shapes or LINEAR_SHAPES[:2]:
        w = rand_awq(k, n, gen=gen)
        p = P.pair_awq(*w)
        for m in (1, 5, 16, 77, 128):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = ops.w4a16_linear_ref(x, *w)
            try:
                cfg = {**PK.p_config(m, n, k, K._num_sms(x.device)), "FUSED": False}
                a = PK.w4a16_linear_p_triton(x, *p, config=cfg, mode=PK.MODE_ASM)
                b = PK.w4a16_linear_p_triton(x, *p, config=cfg, mode=PK.MODE_OPS)
                record(result, "linear/asm==ops", 0.0 if torch.equal(a, b) else 1.0, None,
                       K=k, N=n, M=m)  # fmt: skip
                record(result, "linear/pair", rel_err(a, ref), 1e-2, K=k, N=n, M=m)
                sc = {**cfg, "SCALED": True}  # W rounded to bf16: vs that weight, and vs exact
                sa = PK.w4a16_linear_p_triton(x, *p, config=sc, mode=PK.MODE_ASM)
                sb = PK.w4a16_linear_p_triton(x, *p, config=sc, mode=PK.MODE_OPS)
                w16 = P.dequantize_pairs_t(*p, dtype=torch.bfloat16)
                record(result, "linear/scaled asm==ops", 0.0 if torch.equal(sa, sb) else 1.0,
                       None, K=k, N=n, M=m)  # fmt: skip
                own = rel_err(sa, (x.float() @ w16).bfloat16())
                record(result, "linear/scaled vs its weights", own, 1e-2, K=k, N=n, M=m)
                record(result, "linear/scaled vs exact", rel_err(sa, ref), 1e-2, K=k, N=n, M=m)
                if extra:  # --extra's configuration: PTX == ops, and within the AWQ bound
                    ec = {**cfg, **extra}
                    ea = PK.w4a16_linear_p_triton(x, *p, config=ec, mode=PK.MODE_ASM)
                    eb = PK.w4a16_linear_p_triton(x, *p, config=ec, mode=PK.MODE_OPS)
                    record(result, "linear/extra asm==ops", 0.0 if torch.equal(ea, eb) else 1.0,
                           None, K=k, N=n, M=m)  # fmt: skip
                    record(result, "linear/extra", rel_err(ea, ref), 1e-2, K=k, N=n, M=m)
                    if ec.get("SCALED", False) == cfg.get("SCALED", False):  # same rounding
                        record(result, "linear/extra vs served config", rel_err(ea, a), 1e-3,
                               K=k, N=n, M=m)  # fmt: skip
                if cfg["SPLIT_K"] > 1:  # the fused reduction: the same bits, 20 times over
                    c = {**cfg, "FUSED": True}
                    same = all(torch.equal(PK.w4a16_linear_p_triton(x, *p, config=c), a)
                               for _ in range(20))  # fmt: skip
                    record(result, "linear/fused==unfused", 0.0 if same else 1.0, None,
                           K=k, N=n, M=m)  # fmt: skip
            except Exception as e:  # noqa: BLE001  (recorded; the timings go on)
                record(result, "linear/pair", repr(e), 1e-2, K=k, N=n, M=m)
        try:  # the large-M path's weight: bit for bit the rounded reference
            dq = PK.dequant_p_triton(*p, torch.bfloat16)
            w16 = P.dequantize_pairs_t(*p, dtype=torch.bfloat16).t().bfloat16()
            record(result, "dequant==ref", 0.0 if torch.equal(dq, w16) else 1.0, None, K=k, N=n)
            del dq, w16
        except Exception as e:  # noqa: BLE001
            record(result, "dequant==ref", repr(e), None, K=k, N=n)
    if not moe:
        return
    e = 16  # the reference dequantises every expert in fp32 (256 would need ~100 GB)
    w13, w2 = rand_awq(D, 2 * I_MOE, (e,), gen=gen), rand_awq(I_MOE, D, (e,), gen=gen)
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    for t in (1, 8, 64):
        x = torch.randn(t, D, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(TOPK, dim=-1).indices
        tw = torch.rand(t, TOPK, device="cuda", generator=gen)
        ref = ops.moe_w4a16_ref(x, ids, tw, *w13, *w2)
        try:
            a = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, mode=PK.MODE_ASM)
            b = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, mode=PK.MODE_OPS)
            record(result, "moe/asm==ops", 0.0 if torch.equal(a, b) else 1.0, None, E=e, T=t)
            record(result, "moe/pair", rel_err(a, ref), 5e-3, E=e, T=t)
            sc = {**PM.moe_p_config(t * TOPK, e), "SCALED": True}
            sa = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=sc, mode=PK.MODE_ASM)
            sb = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=sc, mode=PK.MODE_OPS)
            record(result, "moe/scaled asm==ops", 0.0 if torch.equal(sa, sb) else 1.0, None,
                   E=e, T=t)  # fmt: skip
            record(result, "moe/scaled vs exact", rel_err(sa, ref), 1e-2, E=e, T=t)
            if extra:  # --extra's configuration: PTX == ops, within the bound
                ec = {**PM.moe_p_config(t * TOPK, e), **extra}
                ea = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=ec, mode=PK.MODE_ASM)
                eb = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=ec, mode=PK.MODE_OPS)
                record(result, "moe/extra asm==ops", 0.0 if torch.equal(ea, eb) else 1.0, None,
                       E=e, T=t)  # fmt: skip
                record(result, "moe/extra", rel_err(ea, ref), 5e-3, E=e, T=t)
            c = {**PM.moe_p_config(t * TOPK, e), "SPLIT_K": 4}  # the split gate/up pass
            c4 = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=c)
            same = all(torch.equal(PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=c), c4)
                       for _ in range(10))  # fmt: skip
            record(result, "moe/split4", rel_err(c4, ref), 5e-3, E=e, T=t)
            record(result, "moe/split4 repeat", 0.0 if same else 1.0, None, E=e, T=t)
            # the down pass's own k-sum (SUM_K, served at decode) vs the separate torch sum
            cs = {**PM.moe_p_config(t * TOPK, e), "SUM_K": False}
            sep = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=cs)
            fused = [PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config={**cs, "SUM_K": True})
                     for _ in range(10)]  # fmt: skip
            record(result, "moe/sum_k vs separate sum", rel_err(fused[0], sep), 1e-6, E=e, T=t)
            same = all(torch.equal(f, fused[0]) for f in fused)
            record(result, "moe/sum_k repeat", 0.0 if same else 1.0, None, E=e, T=t)
        except Exception as err:  # noqa: BLE001
            record(result, "moe/pair", repr(err), 5e-3, E=e, T=t)
    del w13, w2, p13, p2


# ---- timings ---------------------------------------------------------------------------------


def bench_linear(
    k: int, n: int, batches: list[int], hbm: float, budget_s: float, sweeps: bool = True,
    scaled_min_m: int = 32, extra: dict | None = None,
) -> list[dict]:  # fmt: skip
    rows = []
    wa = [rand_awq(k, n) for _ in range(copies_for(awq_bytes(k, n)))]
    wp = [P.pair_awq(*w) for w in wa]
    wt = [R.tinygemm_pack(*w) for w in wa]
    wf = [f for f in (_fbgemm_pack_or_none(w) for w in wa) if f is not None]
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(copies_for(2 * k * n))]  # fmt: skip
    sms = K._num_sms(torch.device("cuda"))
    for m in batches:
        if over(budget_s):
            print(f"  linear {k}x{n}: budget spent, M >= {m} not timed", flush=True)
            break
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row: dict = {"in": k, "out": n, "M": m}
        row["bf16_us"] = _time([lambda w=w, x=x: F.linear(x, w) for w in wb])
        row["tinygemm_us"] = _time([lambda w=w, x=x: R.tinygemm_linear(x, *w) for w in wt])
        row["former_us"] = _time([lambda w=w, x=x: K.w4a16_linear_triton(x, *w) for w in wa])
        if wf:
            row["fbgemm_us"] = _time([lambda w=w, x=x: fbgemm_linear(x, *w) for w in wf])
        cfg = PK.p_config(m, n, k, sms)  # served; pair_us times it unfused, pair_fused_us fused
        row["pair_config"] = cfg
        row["pair_us"] = _time([lambda w=w, x=x, c={**cfg, "FUSED": False}:
                                PK.w4a16_linear_p_triton(x, *w, config=c) for w in wp])  # fmt: skip
        if cfg["SPLIT_K"] > 1:  # the same config, partials summed by the tile's last program
            row["pair_fused_us"] = _time([lambda w=w, x=x, c={**cfg, "FUSED": True}:
                                          PK.w4a16_linear_p_triton(x, *w, config=c)
                                          for w in wp])  # fmt: skip
        pair_served = "pair_fused_us" if cfg.get("FUSED") and cfg["SPLIT_K"] > 1 else "pair_us"
        row["pair_served_us"] = row[pair_served]
        if extra:  # the served configuration with --extra's keys, fused as served
            c = {**cfg, **extra, "FUSED": pair_served == "pair_fused_us"}
            row["extra_config"] = c
            row["extra_us"] = _time([lambda w=w, x=x, c=c: PK.w4a16_linear_p_triton(x, *w, config=c)
                                     for w in wp])  # fmt: skip
        served_tg = R.use_tinygemm(m, x.dtype, R.tinygemm_max_m(k, n))
        row["served_path"] = "tinygemm" if served_tg else R.LARGE_M_PATH
        row["served_us"] = row[{"pairs": pair_served}.get(row["served_path"],
                                                          f"{row['served_path']}_us")]  # fmt: skip
        def us(c: dict, x=x) -> float:
            return _time([lambda w=w: PK.w4a16_linear_p_triton(x, *w, config=c) for w in wp])

        sweep, extra_sweep = [], []
        for c in linear_candidates(m, n, k, sms) if sweeps else ():
            sweep.append({"config": c, "us": us(c)})
            if extra:
                extra_sweep.append({"config": {**c, **extra}, "us": us({**c, **extra})})
        if extra_sweep:  # every candidate with --extra's keys too
            eb = min(extra_sweep, key=lambda s: s["us"] if not math.isnan(s["us"]) else math.inf)
            row.update(extra_sweep=extra_sweep, extra_best_us=eb["us"],
                       extra_best_config=eb["config"])  # fmt: skip
        ok = [s for s in sweep if not math.isnan(s["us"])] + [{"config": cfg, "us": row["pair_us"]}]
        best = min(ok, key=lambda s: s["us"] if not math.isnan(s["us"]) else math.inf)
        row.update(pair_best_us=best["us"], pair_best_config=best["config"], pair_sweep=sweep)
        if sweeps and m >= scaled_min_m:
            ss = []
            for c in scaled_candidates(m, n, k, sms):
                calls = [lambda w=w, c=c, x=x: PK.w4a16_linear_p_triton(x, *w, config=c)
                         for w in wp]  # fmt: skip
                ss.append({"config": c, "us": _time(calls)})
            sb = min(ss, key=lambda s: s["us"] if not math.isnan(s["us"]) else math.inf)
            row.update(scaled_best_us=sb["us"], scaled_best_config=sb["config"],
                       scaled_sweep=ss, scaled_best_x_bf16=row["bf16_us"] / sb["us"])
        bf = row["bf16_us"]
        row["pair_x_bf16"] = bf / row["pair_us"]
        row["pair_best_x_bf16"] = bf / row["pair_best_us"]
        row["served_x_bf16"] = bf / row["served_us"]
        row["pair_best_weight_GBps"] = awq_bytes(k, n) / row["pair_best_us"] / 1e3
        row["pair_best_frac_hbm"] = row["pair_best_weight_GBps"] / hbm
        rows.append(row)
        print(f"  linear {k}x{n} M={m}: bf16 {bf:.1f} tinygemm {row['tinygemm_us']:.1f} served "
              f"{row['served_us']:.1f} extra {row.get('extra_us', math.nan):.1f} fbgemm "
              f"{row.get('fbgemm_us', math.nan):.1f} pair "
              f"{row['pair_us']:.1f} fused {row.get('pair_fused_us', math.nan):.1f} best "
              f"{row['pair_best_us']:.1f} "
              f"({row['pair_best_x_bf16']:.2f}x bf16) {best['config']} scaled best "
              f"{row.get('scaled_best_us', math.nan):.1f} {row.get('scaled_best_config')}",
              flush=True)  # fmt: skip
    return rows


def bench_prefill(k: int, n: int, batches: list[int], budget_s: float) -> list[dict]:
    """Prefill token counts: bf16 ``F.linear``, the pair kernel (``p_config``'s tile), the
    SCALED kernel's best wide tile, and the weight dequantised once (``dequant_p``) then
    ``F.linear`` (cuBLAS), and the dequantisation alone."""
    rows, sms = [], K._num_sms(torch.device("cuda"))
    wp = [P.pair_awq(*rand_awq(k, n)) for _ in range(2)]
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    for m in batches:
        if over(budget_s):
            print(f"  prefill {k}x{n}: budget spent, M >= {m} not timed", flush=True)
            break
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row: dict = {"in": k, "out": n, "M": m}
        row["bf16_us"] = _time([lambda w=w, x=x: F.linear(x, w) for w in wb])
        # the exact-weight kernel on its own best tile at BT = 128 (BN 64, 4 warps: the rule
        # before SCALED), not on the SCALED rule's BN 128 / 8 warps, which it never won
        cfg = {**PK.p_config(m, n, k, sms, bn=64), "SCALED": False, "num_warps": 4}
        row["pair_us"] = _time([lambda w=w, x=x, c=cfg: PK.w4a16_linear_p_triton(x, *w, config=c)
                                for w in wp])  # fmt: skip
        best = (math.inf, None)
        for bn, warps, stages in ((128, 8, 3), (128, 8, 4), (256, 8, 3)):
            c = {"BN": bn, "BT": 128, "SPLIT_K": 1, "num_warps": warps, "num_stages": stages,
                 "FUSED": False, "SCALED": True}  # fmt: skip
            us = _time([lambda w=w, x=x, c=c: PK.w4a16_linear_p_triton(x, *w, config=c)
                        for w in wp])  # fmt: skip
            if us < best[0]:
                best = (us, c)
        row["scaled_best_us"], row["scaled_best_config"] = best
        row["dequant_mm_us"] = _time([lambda w=w, x=x: PK.w4a16_linear_p_triton(
            x, *w, config={"DEQUANT": True}) for w in wp])  # fmt: skip
        row["dequant_us"] = _time([lambda w=w: PK.dequant_p_triton(*w, torch.bfloat16)
                                   for w in wp])  # fmt: skip
        for key in ("pair", "scaled_best", "dequant_mm"):
            row[f"{key}_x_bf16"] = row["bf16_us"] / row[f"{key}_us"]
        rows.append(row)
        print(f"  prefill {k}x{n} M={m}: bf16 {row['bf16_us']:.1f} pair {row['pair_us']:.1f} "
              f"scaled {row['scaled_best_us']:.1f} {best[1]} dequant+mm "
              f"{row['dequant_mm_us']:.1f} (dequant {row['dequant_us']:.1f})", flush=True)
    return rows


def bench_moe(
    batches: list[int], hbm: float, budget_s: float, sweeps: bool = True, extra: dict | None = None
) -> list[dict]:
    e, rows = 256, []
    w13, w2 = rand_awq(D, 2 * I_MOE, (e,)), rand_awq(I_MOE, D, (e,))
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    del w13, w2
    w13b = torch.randn(e, 2 * I_MOE, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2b = torch.randn(e, D, I_MOE, device="cuda", dtype=torch.bfloat16) * 0.02
    per_expert = awq_bytes(D, 2 * I_MOE) + awq_bytes(I_MOE, D)
    for t in batches:
        if over(budget_s):
            print(f"  moe: budget spent, T >= {t} not timed", flush=True)
            break
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        routes = routings(t, e, 8)
        touched = sum(torch.unique(ids).numel() for ids, _ in routes) / len(routes)
        row: dict = {"experts": e, "topk": TOPK, "T": t, "experts_touched": touched}
        row["bf16_us"] = _time([lambda r=r, x=x: K.moe_bf16_triton(x, r[0], r[1], w13b, w2b)
                                for r in routes])  # fmt: skip

        def pair_us(c: dict, x=x, routes=routes) -> float:
            return _time([lambda r=r: PM.moe_w4a16_p_triton(x, r[0], r[1], *p13, *p2, config=c)
                          for r in routes])  # fmt: skip

        cfg = PM.moe_p_config(t * TOPK, e)
        row["pair_config"] = cfg
        row["pair_us"] = pair_us(cfg)
        if extra:  # the served configuration with --extra's keys
            row["extra_config"] = {**cfg, **extra}
            row["extra_us"] = pair_us(row["extra_config"])
        sweep = [{"config": c, "us": pair_us(c)} for c in moe_candidates(t)] if sweeps else []
        scaled = [{"config": c, "us": pair_us(c)} for c in moe_scaled_candidates(t)]
        if scaled:
            sb = min(scaled, key=lambda s: s["us"] if not math.isnan(s["us"]) else math.inf)
            row.update(scaled_best_us=sb["us"], scaled_best_config=sb["config"],
                       scaled_sweep=scaled, scaled_best_x_bf16=row["bf16_us"] / sb["us"])
        if sweeps and t <= 16:  # the gate/up pass split over D (few programs otherwise)
            for sk in (2, 4, 8):
                sweep.append(
                    {"config": {**cfg, "SPLIT_K": sk}, "us": pair_us({**cfg, "SPLIT_K": sk})}
                )
                row[f"pair_split{sk}_us"] = sweep[-1]["us"]
        ok = [s for s in sweep if not math.isnan(s["us"])] + [{"config": cfg, "us": row["pair_us"]}]
        best = min(ok, key=lambda s: s["us"] if not math.isnan(s["us"]) else math.inf)
        row.update(pair_best_us=best["us"], pair_best_config=best["config"], pair_sweep=sweep)
        row["pair_x_bf16"] = row["bf16_us"] / row["pair_us"]
        row["pair_best_x_bf16"] = row["bf16_us"] / row["pair_best_us"]
        row["pair_best_weight_GBps"] = touched * per_expert / row["pair_best_us"] / 1e3
        row["pair_best_frac_hbm"] = row["pair_best_weight_GBps"] / hbm
        rows.append(row)
        print(f"  moe T={t} ({touched:.0f} experts): bf16 {row['bf16_us']:.1f} "
              f"pair {row['pair_us']:.1f} extra {row.get('extra_us', math.nan):.1f} best "
              f"{row['pair_best_us']:.1f} scaled best "
              f"{row.get('scaled_best_us', math.nan):.1f} {row.get('scaled_best_config')} "
              f"({row['pair_best_x_bf16']:.2f}x bf16) {best['config']} split 2/4/8: "
              f"{row.get('pair_split2_us', math.nan):.1f} / "
              f"{row.get('pair_split4_us', math.nan):.1f} / "
              f"{row.get('pair_split8_us', math.nan):.1f}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,4,8,16,32,64,128")
    ap.add_argument("--moe-batches", default="1,8,16,32,64,128")
    ap.add_argument("--prefill-batches", default="256,1024,4096",
                    help="token counts of the prefill section ('' skips it)")
    ap.add_argument("--shapes", default="",
                    help="K x N pairs of the linear sections, e.g. 16384x7168,2048x7168 "
                         "(default: bench_awq.LINEAR_SHAPES)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--no-sweeps", action="store_true",
                    help="time the served configurations only (no launch-configuration sweeps)")
    ap.add_argument("--extra", default="",
                    help='JSON keys merged into the served configuration, timed beside it as '
                         'extra_us (e.g. {"GROUP_DOT":true})')  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_awq_pairs: needs a CUDA GPU")
    import triton

    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.bench_awq_pairs " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "method": "CUDA graph of R calls over R weight copies / routings, median of 15 replays",
        "fbgemm": fbgemm_available(),
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - START
        out.write_text(json.dumps(result, indent=1))

    result["hbm_copy_GBps"] = hbm = copy_ceiling_gbps()
    extra = json.loads(args.extra or "{}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    check(result, extra, shapes, moe=bool(args.moe_batches))  # on the shapes timed
    save()
    result["linear"], result["prefill"] = [], []
    for k, n in (shapes or LINEAR_SHAPES) if args.batches else ():
        result["linear"] += bench_linear(k, n, [int(b) for b in args.batches.split(",") if b], hbm,
                                         args.budget_s * 0.5, not args.no_sweeps,
                                         extra=extra)
        save()
        torch.cuda.empty_cache()
    for k, n in (shapes or LINEAR_SHAPES) if args.prefill_batches else ():
        result["prefill"] += bench_prefill(
            k, n, [int(b) for b in args.prefill_batches.split(",") if b], args.budget_s * 0.75
        )
        save()
        torch.cuda.empty_cache()
    result["moe"] = bench_moe(
        [int(b) for b in args.moe_batches.split(",") if b], hbm, args.budget_s, not args.no_sweeps,
        extra,
    )
    save()
    fails = [c for c in result["check"] if not c["pass"]]
    print(f"\ncheck: {'PASS' if not fails else 'FAIL'} ({len(fails)} of {len(result['check'])})")
    print(f"{'linear K x N':>14} {'M':>4} {'bf16':>6} {'tinyg':>6} {'served':>6} {'fbgemm':>6} "
          f"{'pair':>6} {'fused':>6} {'best':>6} {'x bf16':>6}")  # fmt: skip
    for r in result["linear"]:
        print(f"{r['in']:>6}x{r['out']:<7} {r['M']:>4} {r['bf16_us']:6.1f} {r['tinygemm_us']:6.1f} "
              f"{r['served_us']:6.1f} {r.get('fbgemm_us', math.nan):6.1f} {r['pair_us']:6.1f} "
              f"{r.get('pair_fused_us', math.nan):6.1f} {r['pair_best_us']:6.1f} "
              f"{r['pair_best_x_bf16']:6.2f}")  # fmt: skip
    print(f"{'scaled K x N':>14} {'M':>4} {'bf16':>6} {'pair':>6} {'scaled':>6} {'x bf16':>6}")
    for r in result["linear"]:
        if "scaled_best_us" in r:
            print(f"{r['in']:>6}x{r['out']:<7} {r['M']:>4} {r['bf16_us']:6.1f} "
                  f"{r['pair_best_us']:6.1f} {r['scaled_best_us']:6.1f} "
                  f"{r['scaled_best_x_bf16']:6.2f}")  # fmt: skip
    print(f"{'extra K x N':>14} {'M':>4} {'bf16':>6} {'pair':>6} {'extra':>6} {'x pair':>8}")
    for r in result["linear"]:
        if "extra_us" in r:
            print(f"{r['in']:>6}x{r['out']:<7} {r['M']:>4} {r['bf16_us']:6.1f} "
                  f"{r['pair_served_us']:6.1f} {r['extra_us']:6.1f} "
                  f"{r['pair_served_us'] / r['extra_us']:8.3f} sweep best "
                  f"{r['pair_best_us']:.1f} / with extra {r.get('extra_best_us', math.nan):.1f} "
                  f"{r.get('extra_best_config', '')}")  # fmt: skip
    print(f"{'prefill K x N':>14} {'M':>5} {'bf16':>8} {'pair':>8} {'scaled':>8} {'deq+mm':>8}")
    for r in result["prefill"]:
        print(f"{r['in']:>6}x{r['out']:<7} {r['M']:>5} {r['bf16_us']:8.1f} {r['pair_us']:8.1f} "
              f"{r['scaled_best_us']:8.1f} {r['dequant_mm_us']:8.1f}")  # fmt: skip
    print(f"{'moe T':>6} {'bf16':>8} {'pair':>8} {'best':>8} {'x bf16':>6} {'scaled':>8} "
          f"{'extra':>8}")  # fmt: skip
    for r in result["moe"]:
        print(f"{r['T']:>6} {r['bf16_us']:8.1f} {r['pair_us']:8.1f} "
              f"{r['pair_best_us']:8.1f} {r['pair_best_x_bf16']:6.2f} "
              f"{r.get('scaled_best_us', math.nan):8.1f} {r.get('extra_us', math.nan):8.1f}")
    print(f"wrote {out} in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
