"""Expert-parallel MoE on one GPU: one EP rank's grouped experts with foreign picks skipped
(the skip id, model/parallel.py ``EPMoE``) against the former EP form and the TP form.

    python -m benchmarks.bench_ep_moe --out $OUT/ep_moe_h200.json [--ep 8] [--tokens 64,256,512]

First checks, on the GPU, the Triton MoE kernels (``moe_bf16_triton``, ``moe_fp8_triton``) with
skip ids against their references (PASS/FAIL recorded; the timings run regardless), including that
a token whose every pick is skipped gets an exact zero. Then, for a rank of ``--ep`` ranks of
V3.2's MoE (256 experts, top-8, D = 7168, I = 2048) and T gathered tokens (every rank's rows, as
the all-gather hands them over: 8 ranks x 8 / 32 / 64 requests), times in CUDA graphs (R calls
over R routings, median of 15):
- ``ep_skip``: the rank's E/ep experts, foreign picks = the skip id (what EP runs now);
- ``ep_zero_weight``: the same experts, foreign picks sent to local expert 0 with weight 0 (the
  form before: every pick computed, most of them by expert 0);
- ``tp``: all 256 experts with I/ep features each (a TP rank's share of every pick);
- ``zeros``: the memset of the ``[T*k, D]`` fp32 output the launchers now start from.
bf16 weights, and FP8 for ``ep_skip`` / ``ep_zero_weight``. JSON written after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path

import torch

START = time.monotonic()
E, TOPK, D, I_MOE = 256, 8, 7168, 2048


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _skip_routing(t: int, n_local: int, first: int, gen=None):
    """V3.2-like routing of ``t`` tokens (8 distinct of 256 experts), seen from the rank holding
    experts ``[first, first + n_local)``: (skip ids, zero-weight ids, weights)."""
    ids = torch.rand(t, E, device="cuda", generator=gen).topk(TOPK, dim=-1).indices
    w = torch.rand(t, TOPK, device="cuda", generator=gen)
    local = ids - first
    mine = (local >= 0) & (local < n_local)
    skip = torch.where(mine, local, torch.full_like(local, n_local)).to(torch.int32)
    zero = torch.where(mine, local, torch.zeros_like(local)).to(torch.int32)
    return skip, zero, torch.where(mine, w, torch.zeros_like(w))


def check(result: dict) -> None:
    from custom_ops import awq as ops
    from custom_ops import awq_kernels as K
    from custom_ops import fp8_linear as F8
    from custom_ops import fp8_linear_kernels as FK
    from model.fp8_weights import weight_quant_fp8

    checks = result.setdefault("check", [])
    gen = torch.Generator("cuda").manual_seed(0)
    e, d, inter = 8, 1024, 512
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=gen) * 0.03).bfloat16()
    w2 = (torch.randn(e, d, inter, device="cuda", generator=gen) * 0.03).bfloat16()
    q13 = [weight_quant_fp8(w13[j].float(), scale_fmt="ue8m0") for j in range(e)]
    q2 = [weight_quant_fp8(w2[j].float(), scale_fmt="ue8m0") for j in range(e)]
    f13, s13 = torch.stack([q[0] for q in q13]), torch.stack([q[1] for q in q13])
    f2, s2 = torch.stack([q[0] for q in q2]), torch.stack([q[1] for q in q2])
    for t in (1, 16, 100):
        x = torch.randn(t, d, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(4, dim=-1).indices
        skip = torch.rand(t, 4, device="cuda", generator=gen) < 0.5
        skip[0] = True  # token 0: every pick foreign -> an exact zero row
        ids = ids.masked_fill(skip, e).to(torch.int32)
        w = torch.rand(t, 4, device="cuda", generator=gen)
        cases = {
            "moe_bf16": (K.moe_bf16_triton, ops.moe_bf16_ref, (w13, w2)),
            "moe_fp8": (FK.moe_fp8_triton, F8.moe_fp8_ref, (f13, s13, f2, s2, True)),
        }
        for op, (run, ref, ws) in cases.items():
            try:
                y, r = run(x, ids, w, *ws), ref(x, ids, w, *ws)
                err = _rel(y, r)
                zero_row = bool((y[0] == 0).all())
                ok = err < 5e-3 and zero_row and bool(torch.isfinite(y).all())
            except Exception as ex:  # noqa: BLE001  (recorded; the timings still run)
                err, zero_row, ok = repr(ex), False, False
            checks.append({"op": op, "T": t, "rel_err": err, "bound": 5e-3,
                           "all_skipped_row_zero": zero_row, "pass": ok})  # fmt: skip
            print(f"  check {op} skip ids T={t}: {'PASS' if ok else 'FAIL'} {err}", flush=True)


def _time(calls) -> float:
    from benchmarks.cuda_timer import graph_time

    try:
        return graph_time(calls, 15).median_us
    except Exception as e:  # noqa: BLE001  (one path failing must not stop the others)
        print(f"    timing failed: {e!r}", flush=True)
        return math.nan


def bench(ep: int, tokens: list[int], result: dict, save) -> None:
    from custom_ops import awq_kernels as K
    from custom_ops import fp8_linear_kernels as FK

    n_local, first = E // ep, 0
    gen = torch.Generator("cuda").manual_seed(1)

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.02).bfloat16()

    w13, w2 = rnd(n_local, 2 * I_MOE, D), rnd(n_local, D, I_MOE)  # the rank's experts, whole
    t13, t2 = rnd(E, 2 * I_MOE // ep, D), rnd(E, D, I_MOE // ep)  # a TP rank's share of all
    # FP8: bytes stand in for weights (timing only), scales of one
    f13 = torch.randint(0, 120, w13.shape, device="cuda", dtype=torch.uint8).view(
        torch.float8_e4m3fn
    )
    f2 = torch.randint(0, 120, w2.shape, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
    s13 = torch.ones(n_local, 2 * I_MOE // 128, D // 128, device="cuda")
    s2 = torch.ones(n_local, D // 128, I_MOE // 128, device="cuda")
    rows = result.setdefault("rows", [])
    for t in tokens:
        x = torch.randn(t, D, device="cuda", generator=gen).bfloat16()
        routes = [_skip_routing(t, n_local, first, gen) for _ in range(4)]
        own = sum(int((r[0] < n_local).sum()) for r in routes) / len(routes)
        tp_routes = [(torch.rand(t, E, device="cuda").topk(TOPK, -1).indices.to(torch.int32),
                      torch.rand(t, TOPK, device="cuda")) for _ in range(4)]  # fmt: skip
        row = {"ep": ep, "T": t, "pairs": t * TOPK, "own_pairs": own}
        row["ep_skip_us"] = _time([lambda r=r, x=x: K.moe_bf16_triton(x, r[0], r[2], w13, w2)
                                   for r in routes])  # fmt: skip
        row["ep_zero_weight_us"] = _time([lambda r=r, x=x: K.moe_bf16_triton(x, r[1], r[2], w13, w2)
                                          for r in routes])  # fmt: skip
        row["tp_us"] = _time([lambda r=r, x=x: K.moe_bf16_triton(x, r[0], r[1], t13, t2)
                              for r in tp_routes])  # fmt: skip
        row["fp8_ep_skip_us"] = _time(
            [
                lambda r=r, x=x: FK.moe_fp8_triton(x, r[0], r[2], f13, s13, f2, s2, True)
                for r in routes
            ]
        )
        row["fp8_ep_zero_weight_us"] = _time(
            [
                lambda r=r, x=x: FK.moe_fp8_triton(x, r[1], r[2], f13, s13, f2, s2, True)
                for r in routes
            ]
        )
        row["zeros_us"] = _time(
            [lambda n=t * TOPK: torch.zeros((n, D), device="cuda", dtype=torch.float32)] * 4
        )
        row["skip_speedup"] = row["ep_zero_weight_us"] / row["ep_skip_us"]
        rows.append(row)
        save()
        print(
            f"  ep={ep} T={t}: skip {row['ep_skip_us']:.1f} us, zero-weight "
            f"{row['ep_zero_weight_us']:.1f} us ({row['skip_speedup']:.2f}x), tp "
            f"{row['tp_us']:.1f} us, fp8 skip {row['fp8_ep_skip_us']:.1f} / zero-weight "
            f"{row['fp8_ep_zero_weight_us']:.1f} us, zeros {row['zeros_us']:.1f} us",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ep", type=int, default=8, help="EP ranks (the rank holds 256/ep experts)")
    ap.add_argument("--tokens", default="64,256,512", help="gathered tokens per MoE call")
    a = ap.parse_args(argv)
    if E % a.ep or (I_MOE // a.ep) % 128:
        raise SystemExit(f"bench_ep_moe: --ep {a.ep} must divide 256 experts and 2048/128 blocks")
    tokens = [int(x) for x in a.tokens.split(",") if x]
    if not torch.cuda.is_available():
        raise SystemExit("bench_ep_moe: needs a CUDA GPU")
    import triton

    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA graph of R calls over R routings, median of 15 replays",
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - START
        out.write_text(json.dumps(result, indent=1))

    try:
        check(result)
    except Exception as err:  # noqa: BLE001  (recorded; the timings go on)
        result.setdefault("check", []).append({"op": "check", "error": repr(err), "pass": False})
    save()
    try:
        bench(a.ep, tokens, result, save)
    except Exception as err:  # noqa: BLE001
        result.setdefault("errors", []).append(repr(err))
        print(f"timings failed: {err!r}", flush=True)
    save()
    fails = [c for c in result["check"] if not c["pass"]]
    print(f"check: {'PASS' if not fails else 'FAIL'} ({len(fails)} of {len(result['check'])})")
    print(f"wrote {out} ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
