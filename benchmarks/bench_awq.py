"""AWQ W4A16 vs bf16 at decode batch sizes, on one GPU (H200).

    python -m benchmarks.bench_awq --out benchmarks/results/awq_h200.json [--sweep]

Times (CUDA-graph replays, median of many) the W4A16 linear against ``torch.nn.functional.linear``
in bf16, and the fused W4A16 MoE against the same Triton MoE with bf16 weights (and, for 16
experts, the dense all-experts bf16 ``model.moe.Experts`` computation), at the DeepSeek-V3.2
shapes (hidden 7168, moe_intermediate 2048, top-8). Each graph runs R calls over R different weight
copies (linear) or R different routings (MoE), so weights are read from HBM, not from the 60 MB L2.
Reports the weight bytes each call must read over its time against a measured copy ceiling.
``--sweep`` also times candidate launch configurations (to tune ``awq_kernels.*_config``).
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
from custom_ops import awq_kernels as K

D, I_MOE, TOPK = 7168, 2048, 8
L2_BYTES = 60 << 20
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


def rand_awq(k: int, n: int, lead=(), sdtype=torch.float16):
    qw = torch.randint(-(2**31), 2**31, (*lead, k, n // 8), dtype=torch.int64, device="cuda")
    qz = torch.randint(-(2**31), 2**31, (*lead, k // 128, n // 8), dtype=torch.int64, device="cuda")
    s = (torch.rand((*lead, k // 128, n), device="cuda") * 2e-3 + 1e-4).to(sdtype)
    return qw.to(torch.int32), qz.to(torch.int32), s


def awq_bytes(k: int, n: int) -> int:
    return k * n // 2 + (k // 128) * (n // 8) * 4 + (k // 128) * n * 2


def copies_for(nbytes: int) -> int:
    return max(2, min(64, math.ceil(4 * L2_BYTES / nbytes)))


# ---- linear ----------------------------------------------------------------------------------


def bench_linear(
    k: int, n: int, batches: list[int], hbm: float, config=None, with_bf16: bool = True
) -> list[dict]:
    rows = []
    ra, rb = copies_for(awq_bytes(k, n)), copies_for(2 * k * n) if with_bf16 else 0
    wa = [rand_awq(k, n) for _ in range(ra)]
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(rb)]
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = config or K.linear_config(m, n, k, K._num_sms(x.device))
        t_awq = graph_time_ms(
            [lambda w=w, x=x, c=cfg: K.w4a16_linear_triton(x, *w, config=c) for w in wa]
        )
        i2f = {**cfg, "MAGIC": False}
        t_i2f = (
            graph_time_ms(
                [lambda w=w, x=x, c=i2f: K.w4a16_linear_triton(x, *w, config=c) for w in wa]
            )
            if with_bf16
            else math.nan
        )
        t_bf16 = graph_time_ms([lambda w=w, x=x: F.linear(x, w) for w in wb]) if wb else math.nan
        ba, bb = awq_bytes(k, n), 2 * k * n
        rows.append(
            {
                "in": k,
                "out": n,
                "M": m,
                "awq_us": t_awq * 1e3,
                "bf16_us": t_bf16 * 1e3,
                "awq_int2float_dequant_us": t_i2f * 1e3,
                "speedup_vs_bf16": t_bf16 / t_awq,
                "awq_weight_GBps": ba / t_awq / 1e6,
                "bf16_weight_GBps": bb / t_bf16 / 1e6,
                "awq_frac_hbm": ba / t_awq / 1e6 / hbm,
                "bf16_frac_hbm": bb / t_bf16 / 1e6 / hbm,
                "config": cfg,
            }
        )
    del wa, wb
    return rows


# ---- MoE -------------------------------------------------------------------------------------


def routings(t: int, e: int, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(r):
        ids = torch.rand(t, e, device="cuda").topk(TOPK, dim=-1).indices.to(torch.int32)
        out.append((ids, torch.rand(t, TOPK, device="cuda")))
    return out


def dense_all_experts(x, ids, w, w13, w2):
    """model/moe.py ``Experts`` (bf16): every expert on every token, then gather."""
    inter = w13.shape[1] // 2
    gu = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, T, 2I]
    h = F.silu(gu[..., :inter].float()) * gu[..., inter:].float()
    y = torch.matmul(h.to(x.dtype), w2.transpose(1, 2))  # [E, T, D]
    idx = ids.long().unsqueeze(-1).expand(*ids.shape, x.shape[1])
    return (y.transpose(0, 1).gather(1, idx).float() * w.unsqueeze(-1)).sum(1)


def bench_moe(
    e: int, batches: list[int], hbm: float, with_bf16: bool = True, config=None
) -> list[dict]:
    rows = []
    w13, w2 = rand_awq(D, 2 * I_MOE, (e,)), rand_awq(I_MOE, D, (e,))
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
        t_awq = graph_time_ms(
            [
                lambda r=r, x=x, c=cfg: K.moe_w4a16_triton(x, r[0], r[1], *w13, *w2, config=c)
                for r in routes
            ]
        )
        row = {
            "experts": e,
            "topk": TOPK,
            "T": t,
            "experts_touched": touched,
            "awq_us": t_awq * 1e3,
            "awq_weight_GBps": touched * per_expert_awq / t_awq / 1e6,
            "config": cfg,
        }
        row["awq_frac_hbm"] = row["awq_weight_GBps"] / hbm
        if with_bf16:
            i2f = {**cfg, "MAGIC": False}
            row["awq_int2float_dequant_us"] = 1e3 * graph_time_ms(
                [
                    lambda r=r, x=x, c=i2f: K.moe_w4a16_triton(x, r[0], r[1], *w13, *w2, config=c)
                    for r in routes
                ]
            )
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
            f"  moe E={e} T={t}: awq {t_awq * 1e3:.1f} us"
            + (f", bf16 triton {row['bf16_triton_us']:.1f} us" if with_bf16 else ""),
            flush=True,
        )
    return rows


# ---- sweep -----------------------------------------------------------------------------------


def linear_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    out = []
    for bm in [16 if m <= 16 else 32 if m <= 32 else 64] + ([128] if m > 64 else []):
        tiles_m = (m + bm - 1) // bm
        for bn, bk, warps, stages in [
            (64, 128, 4, 3),
            (128, 128, 4, 3),
            (128, 64, 4, 4),
            (256, 64, 8, 3),
        ]:
            for waves in (1, 2, 4):
                tiles = tiles_m * ((n + bn - 1) // bn)
                split = 1
                while tiles * split < waves * sms and split * 2 <= k // bk and split < 32:
                    split *= 2
                out.append(
                    {
                        "BM": bm,
                        "BN": bn,
                        "BK": bk,
                        "SPLIT_K": split,
                        "num_warps": warps if bm < 128 else 8,
                        "num_stages": stages,
                    }
                )
    uniq = {json.dumps(c, sort_keys=True): c for c in out}
    return list(uniq.values())


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
    res = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = [
        ("moe256", 1),
        ("linear", 1),
        ("moe256", 128),
        ("linear", 128),
        ("moe256", 16),
        ("moe16", 128),
        ("linear", 16),
        ("linear", 64),
        ("moe16", 8),
    ]
    for kind, size in jobs:
        if time.monotonic() - START > budget_s:
            print(f"sweep: budget reached, skipping {kind} {size} and later", flush=True)
            break
        best = None
        if kind == "linear":
            for cfg in linear_candidates(size, 2048, D, sms):
                try:
                    row = bench_linear(D, 2048, [size], hbm, cfg, with_bf16=False)[0]
                except Exception as err:  # a config that does not compile: note it, go on
                    res.append({"kind": kind, "size": size, "config": cfg, "error": repr(err)})
                    continue
                res.append({"kind": kind, "size": size, "config": cfg, "us": row["awq_us"]})
                best = min(best or (1e9, ""), (row["awq_us"], json.dumps(cfg)))
        else:
            e = 256 if kind == "moe256" else 16
            for cfg in moe_candidates(size, e):
                try:
                    row = bench_moe(e, [size], hbm, with_bf16=False, config=cfg)[0]
                except Exception as err:
                    res.append({"kind": kind, "size": size, "config": cfg, "error": repr(err)})
                    continue
                res.append({"kind": kind, "size": size, "config": cfg, "us": row["awq_us"]})
                best = min(best or (1e9, ""), (row["awq_us"], json.dumps(cfg)))
        print(f"sweep {kind} size={size}: best {best}", flush=True)
    return res


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--experts", default="16,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop sweeping after this")
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
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    hbm = copy_ceiling_gbps()
    result["hbm_copy_GBps"] = hbm
    print(f"{result['device']}: copy ceiling {hbm:.0f} GB/s", flush=True)
    result["linear"] = []
    for k, n in [(D, 2048), (2048, D), (16384, D)]:
        try:
            result["linear"] += bench_linear(k, n, batches, hbm)
        except Exception as err:
            result.setdefault("errors", []).append(f"linear {k}x{n}: {err!r}")
            print(f"linear {k}x{n} failed: {err!r}", flush=True)
        save()
    result["moe"] = []
    for e in [int(x) for x in args.experts.split(",")]:
        try:
            result["moe"] += bench_moe(e, batches, hbm)
        except Exception as err:
            result.setdefault("errors", []).append(f"moe E={e}: {err!r}")
            print(f"moe E={e} failed: {err!r}", flush=True)
        torch.cuda.empty_cache()
        save()
    if args.sweep:
        result["sweep"] = sweep(hbm, args.budget_s)
        save()

    print(
        f"\n{'linear in x out':>16} {'M':>4} {'awq us':>8} {'i2f us':>8} {'bf16 us':>8} "
        f"{'x bf16':>7} {'awq %HBM':>8} {'bf16 %HBM':>9}"
    )
    for r in result["linear"]:
        print(
            f"{r['in']:>7}x{r['out']:<8} {r['M']:>4} {r['awq_us']:8.1f} "
            f"{r['awq_int2float_dequant_us']:8.1f} {r['bf16_us']:8.1f} "
            f"{r['speedup_vs_bf16']:7.2f} {100 * r['awq_frac_hbm']:8.0f} "
            f"{100 * r['bf16_frac_hbm']:9.0f}"
        )
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
