"""The AWQ pair kernels at decode sizes, one launch each inside a profiler range, for Nsight
Compute (stall reasons, bytes in flight, occupancy: why they read int4 weights at ~2 TB/s):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats python -m benchmarks.profile_awq_pairs

Profiled (after a warm-up of each): the linear 16384 x 7168 at M = 1 and 16 with the served
configuration, and the MoE (256 experts, top-8) at T = 1 (its gate/up and down launches).
"""

from __future__ import annotations

import torch

from benchmarks.bench_awq import I_MOE, TOPK, D, rand_awq, routings
from custom_ops import awq_kernels as K
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_pairs_moe as PM


def main() -> None:
    k, n = 16384, D
    w = P.pair_awq(*rand_awq(k, n))
    sms = K._num_sms(torch.device("cuda"))
    calls = []
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = PK.p_config(m, n, k, sms)
        calls.append(
            (
                f"linear {k}x{n} M={m} {cfg}",
                lambda x=x, c=cfg: PK.w4a16_linear_p_triton(x, *w, config=c),
            )
        )
    e = 256
    p13 = P.pair_awq_experts(*rand_awq(D, 2 * I_MOE, (e,)))
    p2 = P.pair_awq_experts(*rand_awq(I_MOE, D, (e,)))
    x1 = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    ((ids, tw),) = routings(1, e, 1)
    calls.append((f"moe T=1 top-{TOPK}", lambda: PM.moe_w4a16_p_triton(x1, ids, tw, *p13, *p2)))
    for _, f in calls:
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, f in calls:
        torch.cuda.nvtx.range_push(name)
        f()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(name, flush=True)
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
