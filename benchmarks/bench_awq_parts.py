"""Where the AWQ MoE's and linear's time goes at decode sizes, on the H200.

    python -m benchmarks.bench_awq_parts --out $OUT/awq_parts_h200.json [--budget-s 240]

1. ``moe_align`` alone: its torch form (about twenty small launches) against the one-program
   Triton kernel (``custom_ops.moe_align``), T in ``--moe-batches``, 256 experts, top-8; checked
   equal (PASS/FAIL recorded).
2. The whole MoE op, bf16 grouped and pair W4A16 (served configuration), each with either
   grouping, side by side, and the pair MoE with its sum over the k experts as a separate torch
   launch (``SUM_K`` off) instead of in the down pass; and the pair MoE's kernel launches of one
   call in launch order with their device time (CUDA profiler over one graph replay): the op's
   median minus their sum is the gaps between launches.
   Then ``--ab-rounds`` alternating rounds of bf16 / pair / pair with the separate sum (their
   medians and spread: the noise of a single timing).
3. The pair MoE's configurations at ``--sweep-batches``: gate/up split, tile width, stages.
4. Linear, the four V3.2 shapes at M in ``--batches``: the pair kernel (served configuration)
   and, as the floor of a read of the same bytes, ``torch.sum`` over its int4 words.
Graphs hold R calls over R routings (MoE) or weight copies (linear), as ``bench_awq``'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_awq import (
    I_MOE,
    LINEAR_SHAPES,
    TOPK,
    D,
    _time,
    awq_bytes,
    copies_for,
    rand_awq,
    routings,
    torch_align,
)
from benchmarks.cuda_timer import graph_time
from custom_ops import awq_kernels as K
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_pairs_moe as PM
from custom_ops import moe_align as A

START = time.monotonic()
E = 256


def over(budget_s: float) -> bool:
    return time.monotonic() - START > budget_s


def kernel_sequence(calls: list, replays: int = 3) -> list[dict]:
    """The kernels one of ``calls`` launches, in launch order, with their device time (µs,
    median over the calls of ``replays`` graph replays); the calls must launch the same kernels."""
    from torch.profiler import ProfilerActivity, profile

    t = graph_time(calls, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            t.graph.replay()
        torch.cuda.synchronize()
    ev = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    n = len(calls) * replays
    if not ev or len(ev) % n:
        return [{"error": f"{len(ev)} kernel events for {n} calls"}]
    per = len(ev) // n
    return [
        {
            "kernel": ev[i].name[:80],
            "us": statistics.median(ev[c * per + i].time_range.elapsed_us() for c in range(n)),
        }
        for i in range(per)
    ]


def bench_moe(
    result: dict, batches: list[int], sweep_batches: list[int], budget_s: float, ab_rounds: int
):
    w13, w2 = rand_awq(D, 2 * I_MOE, (E,)), rand_awq(I_MOE, D, (E,))
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    del w13, w2
    w13b = torch.randn(E, 2 * I_MOE, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2b = torch.randn(E, D, I_MOE, device="cuda", dtype=torch.bfloat16) * 0.02
    per_expert = awq_bytes(D, 2 * I_MOE) + awq_bytes(I_MOE, D)
    rows = result.setdefault("moe", [])
    for t in batches:
        if over(budget_s):
            print(f"  moe: budget spent, T >= {t} not timed", flush=True)
            break
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        routes = routings(t, E, 8)
        touched = sum(torch.unique(ids).numel() for ids, _ in routes) / len(routes)
        same = all(
            all(
                torch.equal(a, b)
                for a, b in zip(A.moe_align_kernel(r[0], E, 16), A.moe_align_torch(r[0], E, 16))
            )  # fmt: skip
            for r in routes
        )
        result.setdefault("check", []).append({"op": "moe_align kernel == torch", "T": t,
                                               "pass": same})  # fmt: skip
        print(f"  check moe_align T={t}: {'PASS' if same else 'FAIL'}", flush=True)
        row: dict = {"T": t, "experts": E, "topk": TOPK, "experts_touched": touched}
        for name, fn in (("kernel", A.moe_align_kernel), ("torch", A.moe_align_torch)):
            row[f"align_{name}_us"] = _time([lambda r=r, f=fn: f(r[0], E, 16) for r in routes])

        def bf16(x=x, routes=routes):
            return [lambda r=r: K.moe_bf16_triton(x, r[0], r[1], w13b, w2b) for r in routes]

        def pair(cfg=None, x=x, routes=routes):
            return [lambda r=r: PM.moe_w4a16_p_triton(x, r[0], r[1], *p13, *p2, config=cfg)
                    for r in routes]  # fmt: skip

        row["bf16_us"] = _time(bf16())
        row["bf16_torch_align_us"] = torch_align(lambda: _time(bf16()))
        row["pair_us"] = _time(pair())
        row["pair_torch_align_us"] = torch_align(lambda: _time(pair()))
        sep = {**PM.moe_p_config(t * TOPK, E), "SUM_K": False}
        row["pair_separate_sum_us"] = _time(pair(sep))  # the k-sum as a torch launch
        row["pair_x_bf16"] = row["bf16_us"] / row["pair_us"]
        row["pair_x_bf16_torch_align"] = row["bf16_torch_align_us"] / row["pair_torch_align_us"]
        row["pair_weight_GBps"] = touched * per_expert / row["pair_us"] / 1e3
        try:
            row["pair_kernels"] = kernel_sequence(pair())
            row["bf16_kernels"] = kernel_sequence(bf16())
        except Exception as e:  # noqa: BLE001  (recorded; the timings go on)
            row["pair_kernels"] = [{"error": repr(e)}]
        ksum = sum(k.get("us", 0.0) for k in row["pair_kernels"])
        row["pair_kernels_sum_us"] = ksum
        # the same three again in alternating rounds (fresh graphs each): the spread between
        # rounds is the noise any one of the timings above carries
        ab: dict = {"bf16": [], "pair": [], "pair_separate_sum": []}
        for _ in range(ab_rounds):
            ab["bf16"].append(_time(bf16()))
            ab["pair"].append(_time(pair()))
            ab["pair_separate_sum"].append(_time(pair(sep)))
        if ab_rounds:
            med = {k: statistics.median(v) for k, v in ab.items()}
            row.update(ab_rounds=ab, ab_median_us=med, ab_pair_x_bf16=med["bf16"] / med["pair"])
            print(f"    {ab_rounds} rounds, median (min-max) us: " + ", ".join(
                f"{k} {med[k]:.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in ab.items())
                + f"; pair x bf16 {row['ab_pair_x_bf16']:.2f}", flush=True)  # fmt: skip
        if t in sweep_batches:
            base = PM.moe_p_config(t * TOPK, E)
            sweep = []
            for bn, warps, stages in ((64, 4, 3), (64, 4, 4), (64, 4, 6), (128, 4, 4), (128, 8, 4)):
                for sk in (1, 2, 4, 8, 14):
                    if over(budget_s):
                        break
                    c = {**base, "BN": bn, "num_warps": warps, "num_stages": stages,
                         "SPLIT_K": sk}  # fmt: skip
                    sweep.append({"config": c, "us": _time(pair(c))})
            row["pair_sweep"] = sweep
            best = min(sweep, key=lambda s: s["us"])
            row["pair_sweep_best"] = best
            print(f"    sweep best {best['us']:.1f} {best['config']}", flush=True)
        rows.append(row)
        print(f"  moe T={t} ({touched:.0f} experts): align kernel {row['align_kernel_us']:.1f} "
              f"torch {row['align_torch_us']:.1f} | bf16 {row['bf16_us']:.1f} "
              f"(torch align {row['bf16_torch_align_us']:.1f}) | pair {row['pair_us']:.1f} "
              f"(torch align {row['pair_torch_align_us']:.1f}, separate k-sum "
              f"{row['pair_separate_sum_us']:.1f}) x bf16 {row['pair_x_bf16']:.2f} "
              f"| pair kernels sum {ksum:.1f}", flush=True)  # fmt: skip
        for k in row["pair_kernels"]:
            print(f"      {k}", flush=True)


def bench_linear(result: dict, batches: list[int], budget_s: float):
    rows = result.setdefault("linear", [])
    if not batches:
        return
    sms = K._num_sms(torch.device("cuda"))
    for k, n in LINEAR_SHAPES:
        if over(budget_s):
            print("  linear: budget spent", flush=True)
            break
        wp = [P.pair_awq(*rand_awq(k, n)) for _ in range(copies_for(awq_bytes(k, n)))]
        nbytes = awq_bytes(k, n)
        floor = _time([lambda w=w: torch.sum(w[0]) for w in wp])
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = PK.p_config(m, n, k, sms)
            calls = [lambda w=w, x=x, c=cfg: PK.w4a16_linear_p_triton(x, *w, config=c) for w in wp]
            row = {"in": k, "out": n, "M": m, "config": cfg, "pair_us": _time(calls),
                   "read_floor_us": floor, "bytes": nbytes}  # fmt: skip
            row["pair_GBps"] = nbytes / row["pair_us"] / 1e3
            row["floor_GBps"] = nbytes / floor / 1e3
            try:
                row["pair_kernels"] = kernel_sequence(calls)
            except Exception as e:  # noqa: BLE001
                row["pair_kernels"] = [{"error": repr(e)}]
            rows.append(row)
            print(f"  linear {k}x{n} M={m}: pair {row['pair_us']:.1f} us "
                  f"({row['pair_GBps']:.0f} GB/s), torch.sum read floor {floor:.1f} us "
                  f"({row['floor_GBps']:.0f} GB/s), kernels {row['pair_kernels']}",
                  flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moe-batches", default="1,2,4,8,16")
    ap.add_argument("--sweep-batches", default="1,2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--ab-rounds", type=int, default=5, help="alternating rounds per T")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/awq_parts_h200.json"))
    args = ap.parse_args()
    ints = lambda s: [int(b) for b in s.split(",") if b]  # noqa: E731
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.bench_awq_parts " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "method": "CUDA-graph replays of R calls over R routings / weight copies, median",
    }  # fmt: skip

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - START
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    bench_moe(
        result, ints(args.moe_batches), ints(args.sweep_batches), args.budget_s, args.ab_rounds
    )
    save()
    bench_linear(result, ints(args.batches), args.budget_s)
    save()
    print(f"done in {time.monotonic() - START:.0f} s -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
