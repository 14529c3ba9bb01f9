"""The pair linear's zero-point / scale load variants side by side (PREFETCH 0, 3, 4 of w4a16_p_kernel at
this commit) over split-K depths and tile widths, 3 alternating rounds; an experiment, reverted after it (docs/quantization.md)."""
import json, math, sys, statistics
import torch
import torch.nn.functional as F
from benchmarks.bench_awq import LINEAR_SHAPES, _time, awq_bytes, copies_for, rand_awq
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_kernels as K

out = {}
sms = K._num_sms(torch.device("cuda"))
for k, n in LINEAR_SHAPES[:2]:
    wp = [P.pair_awq(*rand_awq(k, n)) for _ in range(copies_for(awq_bytes(k, n)))]
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base = PK.p_config(m, n, k, sms)
        cfgs = []
        for pf in (0, 4, 3):
            for split in (4, 6, 7, 8, 12, 16):
                for bn, w in ((64, 4), (128, 4)):
                    cfgs.append({**base, "BN": bn, "num_warps": w, "SPLIT_K": split, "PREFETCH": pf})
        res = {i: [] for i in range(len(cfgs))}
        for r in range(3):
            for i, c in enumerate(cfgs):
                res[i].append(_time([lambda w=w, x=x, c=c: PK.w4a16_linear_p_triton(x, *w, config=c) for w in wp]))
        rows = [{"config": c, "us": statistics.median(res[i]), "rounds": res[i]} for i, c in enumerate(cfgs)]
        out[f"{k}x{n}_M{m}"] = rows
        for pf in (0, 4, 3):
            best = min((r for r in rows if r["config"]["PREFETCH"] == pf), key=lambda r: r["us"])
            print(k, n, m, "pf", pf, f"{best['us']:.1f}", {kk: best["config"][kk] for kk in ("BN", "num_warps", "SPLIT_K")}, flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
