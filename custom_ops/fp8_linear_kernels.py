"""Triton kernels of ``echo::fp8_linear`` and ``echo::moe_fp8`` (custom_ops/fp8_linear.py): FP8
block-scaled GEMMs with the per-128 activation quantisation fused into their loop.

Each program owns a [BM, BN] output tile (``128 % BN == 0``, so one weight scale per K block) and a
range of K blocks (split-K for the few output tiles of decode). Per K block of 128 it loads the x
tile in 16 bits, computes the rows' scales (``amax / 448``, ue8m0: the next power of two from the
fp32 bits, exact), converts to e4m3 in registers, and runs one fp8 ``tl.dot`` against the e4m3
weight tile (1 byte per weight read from HBM), then ``acc += (dot * s_x) * s_w`` in fp32 (the
reference's order). Re-quantising x in every N tile costs ``BM * 128`` elements per ``BN * 128``
weight bytes, no extra launch or buffer; with ue8m0 scales it is one division a row and an exact
multiply per element. ``PREQUANT`` quantises x once, in a launch of its own, instead (the
launch configuration says where); ``FUSED`` split-K sums the partials in each tile's last
program (``custom_ops/tile_counters.py``) instead of a second launch.

The fused MoE below runs the same K-block step over the row blocks of ``moe_align``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_kernels import (
    _num_sms,
    _round16,
    _store,
    splitk_last_sum,
    splitk_sum_kernel,
)
from custom_ops.fp8_linear_format import BLOCK, check_fp8_linear
from custom_ops.fp8_quant_kernels import _quant_tile
from custom_ops.moe_align import moe_align
from custom_ops.tile_counters import counters
from custom_ops.tma import activations, descriptor, supported

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _fp8_dot(x8, w, INTERPRET: tl.constexpr):
    """``x8 [BM, 128] @ w [BN, 128]^T`` in fp32 (e4m3 operands)."""
    if INTERPRET:
        d = tl.dot(x8.to(tl.float32), tl.trans(w.to(tl.float32)))
    else:
        d = tl.dot(x8, tl.trans(w))
    return d


@triton.jit
def _fp8_dot_t(w, x8, INTERPRET: tl.constexpr):
    """``w [BN, 128] @ x8 [BM, 128]^T`` in fp32: the product transposed, so that the weight tile
    is the MMA's M operand (Hopper's wgmma needs M >= 64) and the few tokens its N."""
    if INTERPRET:
        d = tl.dot(w.to(tl.float32), tl.trans(x8.to(tl.float32)))
    else:
        d = tl.dot(w, tl.trans(x8))
    return d


@triton.jit
def fp8_linear_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, xs_ptr, y_ptr, cnt_ptr, x_desc, w_desc,
    M, N, K, stride_xm, stride_os, stride_om, SPLIT_K, stride_xs_m, stride_xs_kb,
    BM: tl.constexpr, BN: tl.constexpr, UE8M0: tl.constexpr, INTERPRET: tl.constexpr,
    PREQUANT: tl.constexpr = False, FUSED: tl.constexpr = False, SWAP: tl.constexpr = False,
    TMA: tl.constexpr = False,
):  # fmt: skip
    """out[split, m, n] over this split's K blocks. Grid: (cdiv(N, BN), cdiv(M, BM), SPLIT_K).
    SWAP: each K block's product is computed transposed (``w @ x8^T``, [BN, BM]: the weight
    tile as the MMA's M operand, wgmma on Hopper from BN = 64) and the accumulator transposed
    back once at the end; the same sums in the same order of K blocks.
    PREQUANT: x is already e4m3 with its scales at ``xs_ptr`` (``act_quant_dg``), so the loop
    only loads, multiplies and scales. FUSED (SPLIT_K > 1): the tile's last split sums the fp32
    partials in split order into ``y [M, N]`` (``w4a16_p_kernel``'s counter protocol,
    ``custom_ops.tile_counters``): the bits of ``splitk_sum_kernel``, one launch fewer.
    TMA: the x and weight tiles come by tensor descriptors (``custom_ops/tma.py``; x_desc and
    w_desc in [BM, 128] and [BN, 128] blocks, zeros past M and N as the masked loads give)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, 128)
    m_mask = offs_m < M
    n_mask = offs_n < N
    KB = K // 128
    per_split = tl.cdiv(KB, SPLIT_K)
    kb0 = pid_k * per_split
    kb1 = tl.minimum(kb0 + per_split, KB)
    nb = (pid_n * BN) // 128  # the tile's weight-scale row (128 % BN == 0)
    if SWAP:
        acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(kb0, kb1):
        if TMA:
            x = x_desc.load([pid_m * BM, kb * 128])
            w = w_desc.load([pid_n * BN, kb * 128])  # [BN, 128] e4m3
        else:
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kb * 128 + offs_k[None, :],
                mask=m_mask[:, None], other=0.0,
            )  # fmt: skip
            w = tl.load(
                w_ptr + offs_n[:, None].to(tl.int64) * K + kb * 128 + offs_k[None, :],
                mask=n_mask[:, None],
                other=0.0,
            )  # fmt: skip  [BN, 128] e4m3
        if PREQUANT:
            x8 = x
            s = tl.load(xs_ptr + offs_m * stride_xs_m + kb * stride_xs_kb, mask=m_mask, other=0.0)
        else:
            x8, s = _quant_tile(x.to(tl.float32), UE8M0, INTERPRET)  # [BM, 128] e4m3, [BM]
        sw = tl.load(ws_ptr + nb * KB + kb)
        if SWAP:
            acc_t += (_fp8_dot_t(w, x8, INTERPRET) * s[None, :]) * sw
        else:
            acc += (_fp8_dot(x8, w, INTERPRET) * s[:, None]) * sw
    if SWAP:
        acc = tl.trans(acc_t)
    mask = m_mask[:, None] & n_mask[None, :]
    tile_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    _store(out_ptr + pid_k * stride_os + tile_offs, acc, mask, INTERPRET)
    if FUSED:
        tile = pid_m * tl.num_programs(0) + pid_n
        splitk_last_sum(out_ptr, y_ptr, cnt_ptr, tile, tile_offs, mask, stride_os, SPLIT_K,
                        BM, BN, INTERPRET)  # fmt: skip


def fp8_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int]:
    """Launch configuration: BM the smallest MMA tile covering m (16, 32, 64); split-K, its
    partials summed by the tile's last program (FUSED).

    At M <= 16 on K < 16384 (``gpu_session21``, calls 1 and 2, docs/quantization.md): the product
    transposed (SWAP: the weight tile is the wgmma's M operand), 8 warps, 4 stages, and the
    smallest power-of-two split that gives about one wave (tiles x split >= 0.95 x SMs) of
    programs of at most 8 K blocks each. Against the rule before (split until two programs per
    SM, x's tile as the MMA's M, 3 stages; the same run, µs at M = 1 / 4 / 8 / 16): 7168 x 4096,
    split 8 (was 16), 13.2 / 13.6 / 13.7 / 14.6 against 16.7 / 17.2 / 17.4 / 18.1; 7168 x 2048,
    split 8 (16), 9.9-10.7 against 10.8-11.6; 2048 x 7168, split 4 (8), 9.7-10.3 against
    12.6-13.5 (4 warps, 3 stages 8.9-9.9); 7168 x 576 keeps split 16 (halving it: 8.2-8.8
    against 7.6-7.8). At M = 33-128 (H100) the branches below say theirs: x quantised first on
    64-column tiles, split-K to one wave on K < 16384 (128-row tiles on 8 warps above M = 64),
    split-K 4 / 2 on K = 16384 (M <= 64 / above), both with x and the weight by TMA (on
    K = 16384 not at M = 65-127: the comment at its branch says why; one H100
    call, ``benchmarks/results/gpu_session42/call1_fp8_tma_h100.json``, the rule's configuration
    / with TMA at M = 64 and 128, µs: 7168 x 4096 22.2 / 20.5, 26.9 / 23.6; 16384 x 7168
    58.6 / 58.8, 71.8 / 67.3; 7168 x 2048 17.4 / 16.6, 18.1 / 17.3; 2048 x 7168 13.9 / 13.6,
    13.7 / 12.0; 7168 x 576 12.4 / 11.5, 15.1 / 15.0; at M <= 16, 0.96-1.02x: not taken).
    Everywhere else
    (M <= 16 on K = 16384, M = 17-32, M > 128) the last rule: split until about two programs
    per SM (at M = 17-32 on K < 16384 with SWAP: the H100 run cited at the return below).
    Timed at M = 1-32 on the H200 (``bench_fp8 --configs``, docs/quantization.md, call 2 on 4
    warps and call 5 on the 8-warp default; M > 128 keeps the first guess, 4 warps and BN
    128):
    - FUSED against a separate sum on 4 warps (call 2): at M = 1 2.2 µs less on 7168 x 576 and
      7168 x 2048, more on 2048 x 7168 and 16384 x 7168, and from M = 4 0.1-4.8 µs more on every
      shape; on the 8-warp default (``gpu_session18`` call 4, M = 1-16) 0.5-2.4 µs less on every
      8-warp shape (2048 x 7168 at M = 16 aside, 13.8 against 13.6); on 16384 x 7168 (4 warps,
      PREQUANT, BN 128) 0.1 µs less at M = 1, 0.5-1.5 more at M = 4-16 (DeepGEMM's from M = 8);
    - 8 warps beat or tied 4 at every shape and M but one (7168 x 4096: 16.9-17.6 against
      17.2-20.7 µs at M <= 16; 7168 x 2048, M = 1: 10.8 against 10.6);
    - BN 64 beat 128 on N = 576 (7.8-8.2 against 8.1-8.8 µs) and on 16384 x 7168 (call 2:
      44.1-47.5 against 50.0-51.8; with PREQUANT, call 5: 37.9-40.2 against 39.6-43.9, and
      ``gpu_session18`` call 4: 38.9-40.7 against 39.7-43.5) and lost on N = 2048;
    - x quantised first (PREQUANT, 4 warps) beat 8 warps without it on K = 16384 (40.4-42.8
      against 44.5-46.6 µs; the unfused 4-warp kernel, 41.4-49.6, came close at M = 1 only)
      and lost on 7168 x 2048 (12.7-15.8 against 10.8-11.5 µs)."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 64 if (n <= 1024 or k >= 16384) and bm <= 32 else 128
    tiles = -(-m // bm) * -(-n // bn)
    kb = k // BLOCK
    split = 1
    if bm == 16 and k < 16384:  # decode: one wave, each program at most 8 K blocks, SWAP
        while split < 16 and split * 2 <= kb and (tiles * split < 0.95 * num_sms
                                                  or -(-kb // split) > 8):  # fmt: skip
            split *= 2
        return {"BM": bm, "BN": bn, "SPLIT_K": split, "FUSED": True, "PREQUANT": False,
                "SWAP": True, "num_warps": 8, "num_stages": 4}  # fmt: skip
    if k < 16384 and 32 < m <= 128:
        # M = 33-128 on K < 16384 (H100, gpu_session34 calls 1 and 2, docs/quantization.md): x
        # quantised first, 64-column tiles, 4 stages, the smallest power-of-two split-K (at most
        # 8: 16 was slower on 7168 x 576, 13.1-13.9 µs against 11.8-12.3) that gives one wave of
        # 64-row tiles (tiles x split >= SMs); above M = 64, 128-row tiles on 8 warps with that
        # split (as many warps as the 64-row wave). Against the rule below (64 x 128 tiles, x
        # quantised in every N tile; call 1, µs at M = 64 / 128): 7168 x 4096 22.1 / 26.5
        # against 40.0 / 47.4, 7168 x 2048 17.3 / 18.1 against 24.5 / 37.9, 2048 x 7168 13.9 /
        # 13.7 against 27.1 / 30.9, 7168 x 576 12.3 / 15.2 against 19.5 / 27.5 (this rule's
        # configurations as call 2 timed them)
        tiles = -(-m // 64) * -(-n // 64)
        while split < 8 and split * 2 <= kb and tiles * split < num_sms:
            split *= 2
        wide = m > 64
        return {"BM": 128 if wide else 64, "BN": 64, "SPLIT_K": split, "FUSED": True,
                "PREQUANT": True, "num_warps": 8 if wide else 4, "num_stages": 4,
                "TMA": True}  # fmt: skip
    if k >= 16384 and 32 < m <= 128:
        # K = 16384 at M = 33-128 (H100, gpu_session32 call 3, docs/quantization.md): 64 x 64
        # tiles, x quantised first: split-K 2 gave 65.1 / 72.0 µs against the rule below's
        # 81.9 / 86.1 at M = 64 / 128 (at M = 32 62.1 against 54.4: the rule below keeps it);
        # split-K 4 up to M = 64 (gpu_session34 call 2: 54.8 / 56.5 against split 2's 62.9 /
        # 64.4 at M = 48 / 64; 75.7 / 81.3 against 67.2 / 70.7 at M = 96 / 128). NOTE: not past
        # the M measured: a prefill chunk's split-K would need a tile counter per output tile
        # (more than ``tile_counters.COUNTERS`` from ~37K rows on N = 7168) and fp32 partials
        # of split x M x N; the rule below splits no tile there. TMA at M <= 64 and 128 only:
        # on the H200 at M = 96 it took 75.1 µs against 60.1 with pointer loads (at 48 / 64 /
        # 128 43.4 / 45.7 / 58.4 against 44.7 / 46.8 / 63.2; gpu_session43/call1_fp8_h200.json)
        return {"BM": 64, "BN": 64, "SPLIT_K": 4 if m <= 64 else 2, "FUSED": True,
                "PREQUANT": True, "num_warps": 4, "num_stages": 3,
                "TMA": m <= 64 or m == 128}  # fmt: skip
    while tiles * split < 2 * num_sms and split * 2 <= kb and split < 16:
        split *= 2
    # M = 17-32 on K < 16384: the product transposed (SWAP) as at decode. H100, gpu_session36
    # call 3 (docs/quantization.md), µs at M = 32 with SWAP against without: 7168 x 4096 23.7
    # against 28.9, 7168 x 2048 15.8 against 18.0, 2048 x 7168 17.7 against 20.9, 7168 x 576
    # 9.3 against 9.8 (on 16384 x 7168 it lost: 60.0 against 52.2)
    return {
        "BM": bm, "BN": bn, "SPLIT_K": split, "FUSED": True, "PREQUANT": k >= 16384,
        "SWAP": bm == 32 and k < 16384,
        "num_warps": 8 if bm <= 32 and k < 16384 else 4, "num_stages": 3,
    }  # fmt: skip


def fp8_linear_triton(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool,
    config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] -> [M, N]`` with FP8 block-scaled weights (see custom_ops/fp8_linear.py).
    ``config["PREQUANT"]``: quantise x in a launch of its own first (``act_quant_dg``)."""
    check_fp8_linear(x, w8, w_scale)
    m, k = x.shape
    n = w8.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    cfg = config or fp8_config(m, n, k, _num_sms(x.device))
    prequant = bool(cfg.get("PREQUANT", False))
    xs = x  # any pointer: unused unless prequant
    if prequant:
        from custom_ops.backends.deep_gemm_gemm_kernels import act_quant_dg

        x, xs = act_quant_dg(x, ue8m0)
    bm, bn, split = cfg["BM"], cfg["BN"], cfg["SPLIT_K"]
    if BLOCK % bn or bn < 16 or bm < 16 or split < 1:
        raise ValueError(f"fp8_linear: bad config {cfg}: need 128 % BN == 0, BN, BM >= 16")
    if split == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=out_dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    fused = split > 1 and cfg.get("FUSED", False)
    y = out[0] if split == 1 else torch.empty((m, n), device=x.device, dtype=out_dtype)
    cnt = counters(x.device, grid[0] * grid[1]) if fused else out
    tma = bool(cfg.get("TMA", False)) and supported(x.device)
    descs = (None, None)
    if tma:
        x = activations(x)
        descs = descriptor("fp8_linear", x, [bm, BLOCK]), descriptor("fp8_linear", w8, [bn, BLOCK])
    fp8_linear_kernel[grid](
        x, w8, w_scale, out, xs, y, cnt, *descs, m, n, k, x.stride(0), out.stride(0), out.stride(1),
        split, xs.stride(0), xs.stride(-1), BM=bm, BN=bn, UE8M0=ue8m0, INTERPRET=_INTERPRET,
        PREQUANT=prequant, FUSED=fused, SWAP=bool(cfg.get("SWAP", False)), TMA=tma,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    if split == 1 or fused:
        return y
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](
        out, y, m * n, split, BLOCK=1024, INTERPRET=_INTERPRET, num_warps=4
    )
    return y


# ---- fused FP8 MoE ---------------------------------------------------------------------------


@triton.jit
def fp8_moe_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    part_ptr, cnt_ptr, num_pairs, N, K, E, stride_am, stride_om, SPLIT_K,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, UE8M0: tl.constexpr, INTERPRET: tl.constexpr,
    SPLIT: tl.constexpr = False,
):  # fmt: skip
    """One row block (pairs of one expert, ``custom_ops.moe_align``) x BN output columns of the
    expert's FP8 weight ``w [E, NW, K]`` (scales ``ws [E, NW/128, K/128]``; NW = 2N when GATED:
    gate rows then up rows, both from one quantised x tile). Each product is rounded to 16 bits
    as the reference's FP8 linears return it; GATED: out = silu(gate) * up; MUL_WEIGHT: out =
    acc * topk_w[p]. Grid: (max_blocks, cdiv(N, BN), SPLIT_K).

    SPLIT (decode: few row blocks, a long pass over K): split z of the K blocks stores its fp32
    partials (gate and up when GATED) in ``part [SPLIT_K, 1 + GATED, max_blocks * BM, N]``; the
    tile's last split (``fp8_linear_kernel``'s counter protocol) sums them in split order and
    goes on as an unsplit program would."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BM + tl.arange(0, BM))
    row_mask = ids < num_pairs
    a_rows = (ids // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, 128)
    n_mask = offs_n < N
    NW = 2 * N if GATED else N
    KB = K // 128
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * NW * K
    ws_base = ws_ptr + e64 * (NW // 128) * KB
    nb = (pid_n * BN) // 128
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    kb0, kb1 = 0, KB
    if SPLIT:
        per_split = tl.cdiv(KB, SPLIT_K)
        kb0 = tl.program_id(2) * per_split
        kb1 = tl.minimum(kb0 + per_split, KB)
    for kb in range(kb0, kb1):
        x = tl.load(
            a_ptr + a_rows[:, None] * stride_am + kb * 128 + offs_k[None, :],
            mask=row_mask[:, None], other=0.0,
        ).to(tl.float32)  # fmt: skip
        x8, s = _quant_tile(x, UE8M0, INTERPRET)
        w = tl.load(w_base + offs_n[:, None].to(tl.int64) * K + kb * 128 + offs_k[None, :],
                    mask=n_mask[:, None], other=0.0)  # fmt: skip
        acc += (_fp8_dot(x8, w, INTERPRET) * s[:, None]) * tl.load(ws_base + nb * KB + kb)
        if GATED:
            wu = tl.load(
                w_base + (N + offs_n)[:, None].to(tl.int64) * K + kb * 128 + offs_k[None, :],
                mask=n_mask[:, None], other=0.0,
            )  # fmt: skip
            su = tl.load(ws_base + (N // 128 + nb) * KB + kb)
            acc_up += (_fp8_dot(x8, wu, INTERPRET) * s[:, None]) * su
    if SPLIT:
        slots = tl.num_programs(0) * BM
        rows = pid_m * BM + tl.arange(0, BM)
        part = part_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]  # split 0, gate
        k64 = tl.program_id(2).to(tl.int64) * (2 if GATED else 1)  # the split's first part
        p_mask = row_mask[:, None] & n_mask[None, :]  # the pairs' rows only
        tl.store(part + k64 * slots * N, acc, mask=p_mask)
        if GATED:
            tl.store(part + (k64 + 1) * slots * N, acc_up, mask=p_mask)
        tl.debug_barrier()  # every thread's partials are stored before the counter moves
        tile = pid_m * tl.num_programs(1) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done != SPLIT_K - 1:
            return
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros([BM, BN], dtype=tl.float32)
        for sk in range(0, SPLIT_K):
            sk64 = tl.full([], sk, tl.int64) * (2 if GATED else 1)
            acc += tl.load(part + sk64 * slots * N, mask=p_mask, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            if GATED:
                acc_up += tl.load(part + (sk64 + 1) * slots * N, mask=p_mask, other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
        tl.atomic_xchg(cnt_ptr + tile, 0)
    acc = _round16(acc, a_ptr.dtype.element_ty, INTERPRET)
    if GATED:
        acc_up = _round16(acc_up, a_ptr.dtype.element_ty, INTERPRET)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, fp32
    if MUL_WEIGHT:
        tw = tl.load(topk_w_ptr + ids, mask=row_mask, other=0.0)
        acc = acc * tw[:, None]
    out = out_ptr + ids[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    _store(out, acc, row_mask[:, None] & n_mask[None, :], INTERPRET)


def moe_fp8_config(num_pairs: int, n_experts: int, topk: int) -> dict[str, int]:
    """BM = 16 while experts get few pairs (decode), else 64; BN = 128 (one weight-scale block;
    16 KB of e4m3 weights per K block and program). One token (``num_pairs <= topk``): the
    gate/up pass split 4 ways on 8 warps. H200, 256 experts (``bench_fp8 --moe-configs``,
    docs/quantization.md, call 3): at T = 1 122.9 µs against 157.7 unsplit (split 8: 128.4); at
    T = 2, 4 and 16 every split was slower (split 4 on 8 warps: 219.9 against 206.1 at T = 2), at
    T = 8 split 4 on 4 warps was within 1% (675.9 against 680.8). BM = 64 on 8 warps: 16
    experts, T = 64 / 128, 335.8 / 508.7 µs against 573.6 / 847.7 on 4 (call 7)."""
    bm = 64 if num_pairs > 16 * n_experts else 16
    if num_pairs <= topk:
        return {"BM": bm, "BN": 128, "SPLIT_GU": 4, "num_warps": 8, "num_stages": 3}
    return {"BM": bm, "BN": 128, "num_warps": 8 if bm == 64 else 4, "num_stages": 3}


def moe_fp8_triton(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    ue8m0: bool, config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """Fused FP8 MoE: fp32 ``[T, D]``; ``w13 [E, 2I, D]``, ``w2 [E, D, I]`` e4m3 with their
    128 x 128 block scales (custom_ops/fp8_linear.py ``moe_fp8_ref``)."""
    from custom_ops.fp8_linear_format import check_moe_fp8

    e, inter, d = check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    t, topk = topk_ids.shape
    p = t * topk
    cfg = config or moe_fp8_config(p, e, topk)
    if BLOCK % cfg["BN"] or cfg["BN"] < 16 or cfg["BM"] < 16:
        raise ValueError(f"moe_fp8: bad config {cfg}: need 128 % BN == 0, BN, BM >= 16")
    if x.stride(1) != 1:
        x = x.contiguous()
    sorted_ids, block_expert = moe_align(topk_ids, e, cfg["BM"])
    n_blocks = block_expert.numel()
    tw = topk_weights.reshape(-1).float().contiguous()
    common = dict(
        BM=cfg["BM"], BN=cfg["BN"], UE8M0=ue8m0, INTERPRET=_INTERPRET,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    h = torch.empty((p, inter), device=x.device, dtype=x.dtype)
    y = torch.zeros((p, d), device=x.device, dtype=torch.float32)  # skipped pairs' rows: 0
    for a, w, ws, out, n, k, split, gated in (
        (x, w13, w13_scale, h, inter, d, cfg.get("SPLIT_GU", 1), True),
        (h, w2, w2_scale, y, d, inter, cfg.get("SPLIT_DOWN", 1), False),
    ):
        if not config:  # the heuristic's split, within this weight's K blocks
            split = max(1, min(split, k // BLOCK))
        if not isinstance(split, int) or not 1 <= split <= k // BLOCK:
            raise ValueError(f"moe_fp8: a split must be an int in 1..{k // BLOCK}, got {split!r}")
        tiles = triton.cdiv(n, cfg["BN"])
        part = cnt = out  # any pointers: unused unless split
        if split > 1:
            part = torch.empty((split, 2 if gated else 1, n_blocks * cfg["BM"], n),
                               device=x.device, dtype=torch.float32)  # fmt: skip
            cnt = counters(x.device, n_blocks * tiles)
        fp8_moe_kernel[(n_blocks, tiles, split)](
            a, w, ws, out, sorted_ids, block_expert, tw, part, cnt, p, n, k, e,
            a.stride(0), out.stride(0), split, A_ROW_DIV=topk if gated else 1, GATED=gated,
            MUL_WEIGHT=not gated, SPLIT=split > 1, **common,
        )  # fmt: skip
    return y.view(t, topk, d).sum(1)
