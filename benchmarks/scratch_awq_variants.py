"""The pair linear's zero-point / scale load variants side by side (PREFETCH 0-4 of w4a16_p_kernel at
this commit), alternating rounds; an experiment, reverted after it (docs/quantization.md)."""
import json, math, sys, statistics
import torch
import torch.nn.functional as F
from benchmarks.bench_awq import LINEAR_SHAPES, _time, awq_bytes, copies_for, rand_awq
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_kernels as K

out = {}
sms = K._num_sms(torch.device("cuda"))
for k, n in LINEAR_SHAPES:
    wp = [P.pair_awq(*rand_awq(k, n)) for _ in range(copies_for(awq_bytes(k, n)))]
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(2 * k * n))]
    for m in (1, 16, 32, 128):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = PK.p_config(m, n, k, sms)
        pfs = (0, 3, 4) if not cfg["SCALED"] else (0, 4)
        ref = PK.w4a16_linear_p_triton(x, *wp[0], config={**cfg, "PREFETCH": 0})
        eq = {pf: bool(torch.equal(PK.w4a16_linear_p_triton(x, *wp[0], config={**cfg, "PREFETCH": pf}), ref)) for pf in pfs}
        res = {pf: [] for pf in pfs}
        res["bf16"] = []
        for r in range(5):
            res["bf16"].append(_time([lambda w=w, x=x: F.linear(x, w) for w in wb]))
            for pf in pfs:
                c = {**cfg, "PREFETCH": pf}
                res[pf].append(_time([lambda w=w, x=x, c=c: PK.w4a16_linear_p_triton(x, *w, config=c) for w in wp]))
        med = {str(kk): statistics.median(v) for kk, v in res.items()}
        out[f"{k}x{n}_M{m}"] = {"median_us": med, "rounds": {str(kk): v for kk, v in res.items()}, "equal_to_0": {str(p): e for p, e in eq.items()}, "cfg": cfg}
        print(k, n, m, " ".join(f"{kk}:{v:.1f}" for kk, v in med.items()), eq, flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
