"""Experiment: the pair linear with each (zero point, scale) packed in one int32 word per group and
column (bits 0-7 z, bits 16-31 the scale's bits), so its load takes the cp.async pipeline like the
weights, against ``w4a16_p_kernel`` on the same tiles, alternating rounds (unfused split-K: both
then run ``splitk_sum_kernel``)."""
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from benchmarks.bench_awq import LINEAR_SHAPES, _time, awq_bytes, copies_for, rand_awq
from custom_ops import awq_kernels as K
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops.awq_kernels import _store, splitk_sum_kernel
from custom_ops.awq_kernels import _round16
from custom_ops.awq_pairs_kernels import _group_part


@triton.jit
def _zz(z):
    """(128 + z, 128 + z) bf16 pairs as int32 [BN, 16], from the zero points' values."""
    zz = ((z & 0xFF) + 0x4300) * 0x10001
    return zz[:, None] + tl.zeros([z.shape[0], 16], dtype=tl.int32)


@triton.jit
def _ss(s):
    """(s, s) bf16 pairs as int32 [BN, 16], from fp16 scales."""
    s = _round16(s.to(tl.float32), tl.bfloat16, False).to(tl.bfloat16)
    bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (bits * 0x10001)[:, None] + tl.zeros([s.shape[0], 16], dtype=tl.int32)


@triton.jit
def packed_kernel(
    x_ptr, qw_ptr, zs_ptr, out_ptr, M, N, G, stride_xm, stride_os, stride_om, SPLIT_K,
    BN: tl.constexpr, BT: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = pid_t * BT + tl.arange(0, BT)
    n_mask = offs_n < N
    t_mask = offs_t < M
    per_split = tl.cdiv(G, SPLIT_K)
    g0 = pid_k * per_split
    g1 = tl.minimum(g0 + per_split, G)
    offs_p = tl.arange(0, 16)
    x_cols = x_ptr + offs_t[None, :].to(tl.int64) * stride_xm + tl.arange(0, 32)[:, None]
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for g in range(g0, g1):
        col = g * N + offs_n
        zs = tl.load(zs_ptr + col, mask=n_mask, other=0)
        z = zs & 0xFF
        sc = (zs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        w = tl.load(qw_ptr + col[:, None].to(tl.int64) * 16 + offs_p[None, :],
                    mask=n_mask[:, None], other=0)  # fmt: skip
        if SCALED:
            acc = _group_part(acc, w, _zz(z), x_cols + g * 128, t_mask, False, 0,
                              _ss(sc), True)  # fmt: skip
        else:
            part = _group_part(tl.zeros([BN, BT], dtype=tl.float32), w, _zz(z),
                               x_cols + g * 128, t_mask, False, 0)  # fmt: skip
            acc += part * sc.to(tl.float32)[:, None]
    mask = t_mask[None, :] & n_mask[:, None]
    tile_offs = offs_t[None, :] * stride_om + offs_n[:, None]
    _store(out_ptr + pid_k * stride_os + tile_offs, acc, mask, False)


def pack_zs(zeros, scales):
    """uint8 zeros [G, N] and fp16 scales [G, N] -> int32 [G, N]: z | scale bits << 16."""
    halves = torch.stack([zeros.to(torch.int16), scales.view(torch.int16)], dim=-1)
    return halves.contiguous().view(torch.int32).squeeze(-1)


def packed_linear(x, qw, zs, cfg):
    m, k = x.shape
    n = qw.shape[1]
    split = cfg["SPLIT_K"]
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BT"]), split)
    packed_kernel[grid](x, qw, zs, out, m, n, k // 128, x.stride(0), out.stride(0), out.stride(1),
                        split, BN=cfg["BN"], BT=cfg["BT"], SCALED=cfg["SCALED"],
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    if split == 1:
        return out[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](out, y, m * n, split, BLOCK=1024,
                                                   INTERPRET=False, num_warps=4)  # fmt: skip
    return y


def main():
    out = {}
    sms = K._num_sms(torch.device("cuda"))
    for k, n in LINEAR_SHAPES:
        wp = [P.pair_awq(*rand_awq(k, n)) for _ in range(copies_for(awq_bytes(k, n)))]
        wz = [(w[0], pack_zs(w[1], w[2])) for w in wp]
        for m in (1, 16, 32, 64, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfgs = [{**PK.p_config(m, n, k, sms), "FUSED": False}]
            if m <= 16:
                cfgs.append({**cfgs[0], "BN": 128})
            row = {}
            for ci, cfg in enumerate(cfgs):
                a = PK.w4a16_linear_p_triton(x, *wp[0], config=cfg)
                b = packed_linear(x, *wz[0], cfg)
                res = {"pair": [], "packed": []}
                for _ in range(5):
                    res["pair"].append(_time([lambda w=w, c=cfg: PK.w4a16_linear_p_triton(
                        x, *w, config=c) for w in wp]))  # fmt: skip
                    res["packed"].append(_time([lambda w=w, c=cfg: packed_linear(x, *w, c)
                                                for w in wz]))  # fmt: skip
                med = {kk: statistics.median(v) for kk, v in res.items()}
                row[f"cfg{ci}"] = {"config": cfg, "equal": bool(torch.equal(a, b)), "median_us": med,
                                   "rounds": res}  # fmt: skip
                print(k, n, m, cfg["BN"], cfg["SCALED"], f"pair {med['pair']:.1f} packed "
                      f"{med['packed']:.1f} equal {torch.equal(a, b)}", flush=True)
            out[f"{k}x{n}_M{m}"] = row
            json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
