"""Triton W4A16 kernels over the pair layout (``awq_format.py``): the weight is the wgmma's A
operand, dequantised in registers; the tokens are its N side.

Computed transposed, ``out^T [N, M] = W [N, K] @ x^T [K, M]``: the weight tile ``[BN, 32]`` of
one K slice is the MMA's A operand, which Hopper's wgmma takes from registers, and the few tokens
are its N side (BT = 16 at decode, where an ``x @ W^T`` MMA would pad M to 64). In the pair
layout, bits ``4 s`` and ``16 + 4 s`` of word p hold K rows ``32 s + 2 p`` and ``+ 1`` of the
group, so one 32-bit operation on a word gives two 16-bit operand values side by side, exactly the
register pair the MMA wants (no shuffle: Triton lowers ``join`` + ``reshape`` of the two halves to
the dot-operand layout itself):
- ``(w >> 4 s) & 0x000F000F | 0x43004300`` is the bf16 pair ``(128 + q_lo, 128 + q_hi)``, exact
  (the magic-number trick: a nibble OR-ed into the mantissa of 128); one LOP3 after one shift;
- ``sub.rn.bf16x2`` with ``(128 + z, 128 + z)`` gives ``(q - z)`` for both, exact;
so each pair of weights costs about two instructions (``INLINE_ASM``: the two are one PTX
``lop3`` and one ``sub``, the halves read back as two bf16 with no conversion). The group's scale
multiplies the fp32 partial product, so W itself is never rounded. fp16 activations use the same
steps with 1024 (``0x6400``). Everything else is Triton's: the words go through shared memory on
the software pipeline's ``cp.async`` copies (``num_stages``), the x slices are the wgmma's B
operand there too.

``MODE`` chooses how a pair is formed: 0, inline PTX (the CUDA default); 1, the same bit
operations in Triton's own ops (CUDA; the tests compare 0 and 1 bit for bit); 2, fp32 values for
the Triton interpreter (CPU CI), which cannot run PTX and mishandles 16-bit dot operands
(``awq_kernels`` NOTE). The three give the same ``(q - z)`` values exactly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_format import GROUP, check_pairs, check_x16
from custom_ops.awq_kernels import _num_sms, _store, splitk_sum_kernel
from custom_ops.moe_align import moe_align

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MODE_ASM, MODE_OPS, MODE_INTERPRET = 0, 1, 2
DEFAULT_MODE = MODE_INTERPRET if _INTERPRET else MODE_ASM


@triton.jit
def _pair(w, zz, s: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr):
    """``(q - z)`` of the nibbles at bits ``4 s`` (lo) and ``16 + 4 s`` (hi) of each word ``w``
    (int32 [R, C]); ``zz`` is ``(c + z) * 0x10001`` (the 16-bit pair ``(c + z, c + z)``, c the
    magic number). Returns ``(lo, hi)``, 16-bit (fp32 under MODE 2)."""
    if MODE == 0:
        if FP16:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; "
                "sub.rn.f16x2 t, t, $3; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [w >> (4 * s), zz], dtype=(tl.float16, tl.float16), is_pure=True,
                pack=1,
            )  # fmt: skip
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; "
                "sub.rn.bf16x2 t, t, $3; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [w >> (4 * s), zz], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                pack=1,
            )  # fmt: skip
    elif MODE == 1:
        dt = tl.float16 if FP16 else tl.bfloat16
        magic = 0x6400 if FP16 else 0x4300
        c = (zz & 0xFFFF).to(tl.int16).to(dt, bitcast=True)  # c + z, exact
        lo = ((((w >> (4 * s)) & 0xF) | magic).to(tl.int16).to(dt, bitcast=True)) - c
        hi = ((((w >> (16 + 4 * s)) & 0xF) | magic).to(tl.int16).to(dt, bitcast=True)) - c
    else:
        c = ((zz & 0xFFFF) - (0x6400 if FP16 else 0x4300)).to(tl.float32)  # z
        lo = ((w >> (4 * s)) & 0xF).to(tl.float32) - c
        hi = ((w >> (16 + 4 * s)) & 0xF).to(tl.float32) - c
    return lo, hi


@triton.jit
def _group_part(part, w, zz, x_cols, t_mask, FP16: tl.constexpr, MODE: tl.constexpr):
    """``part [BN, BT] += W_g [BN, 128] @ x_g^T [128, BT]`` for one group: ``w [BN, 16]`` its
    words, ``x_cols [32, BT]`` pointers to x[token, group start + c] (c < 32)."""
    for s in tl.static_range(4):
        xs = tl.load(x_cols + 32 * s, mask=t_mask[None, :], other=0.0)  # [32, BT]
        lo, hi = _pair(w, zz, s, FP16, MODE)
        a = tl.reshape(tl.join(lo, hi), [w.shape[0], 32])  # column 2 p + h = K row 32 s + 2 p + h
        if MODE == 2:
            part = tl.dot(a, xs.to(tl.float32), part)
        else:
            part = tl.dot(a, xs, part)
    return part


@triton.jit
def _zz(z_ptrs, n_mask, FP16: tl.constexpr):
    """The 16-bit pair ``(c + z, c + z)`` as int32 [BN, 16] (broadcast along the words)."""
    z = tl.load(z_ptrs, mask=n_mask, other=0).to(tl.int32)
    zz = (z + (0x6400 if FP16 else 0x4300)) * 0x10001
    return zz[:, None] + tl.zeros([z_ptrs.shape[0], 16], dtype=tl.int32)


@triton.jit
def w4a16_p_kernel(
    x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, G, stride_xm, stride_os, stride_om, SPLIT_K,
    BN: tl.constexpr, BT: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr,
    FUSED: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over this split's groups of x[m, k] W^T[k, n] (fp32 when SPLIT_K >
    1, else out's dtype). Grid: (cdiv(N, BN), cdiv(M, BT), SPLIT_K).

    FUSED (SPLIT_K > 1): the tile's last split to finish (an acq_rel counter per tile in
    ``cnt_ptr``, left at 0 again for the next launch) sums the fp32 partials in split order into
    ``y [M, N]`` (x's dtype): the order of ``splitk_sum_kernel``, so the same bits, one launch
    fewer."""
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
        col = g * N + offs_n  # [BN] (group, column) index
        w = tl.load(qw_ptr + col[:, None].to(tl.int64) * 16 + offs_p[None, :],
                    mask=n_mask[:, None], other=0)  # fmt: skip
        zz = _zz(z_ptr + col, n_mask, FP16)
        sc = tl.load(s_ptr + col, mask=n_mask, other=0.0).to(tl.float32)
        part = _group_part(tl.zeros([BN, BT], dtype=tl.float32), w, zz, x_cols + g * 128,
                           t_mask, FP16, MODE)  # fmt: skip
        acc += part * sc[:, None]
    mask = t_mask[None, :] & n_mask[:, None]
    tile_offs = offs_t[None, :] * stride_om + offs_n[:, None]
    _store(out_ptr + pid_k * stride_os + tile_offs, acc, mask, INTERPRET)
    if FUSED:
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        tile = pid_t * tl.num_programs(0) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BN, BT], dtype=tl.float32)
            for sk in range(0, SPLIT_K):
                total += tl.load(out_ptr + sk * stride_os + tile_offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            _store(y_ptr + tile_offs, total, mask, INTERPRET)
            tl.atomic_xchg(cnt_ptr + tile, 0)


_COUNTERS: dict = {}
COUNTERS = 1 << 16  # tiles per launch the counter buffer holds (decode needs a few hundred)


def reserve_counters(device: torch.device) -> torch.Tensor:
    """Make the device's tile counters of the fused split-K reductions now: zeros, and zeros
    again after every launch (its last programs reset them), so one buffer serves every call on
    the device's stream (two streams must not run these kernels at once). ``repack_awq_model``
    calls this at load time: made during a ``torch.compile(mode="reduce-overhead")`` warm-up it
    would live in the CUDA-graph memory pool, which later graphs may reuse."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The counters of ``n`` tiles (made here for a direct call of the op; never regrown: a
    graph captured earlier holds the buffer's address)."""
    if n > COUNTERS:
        raise ValueError(f"w4a16 pair kernels: {n} split-K tiles in one launch, at most {COUNTERS}")
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if device not in _COUNTERS and capturing:
        raise RuntimeError("w4a16 pair kernels: reserve_counters(device) before CUDA-graph capture")
    return reserve_counters(device)


def tokens_tile(m: int) -> int:
    """BT: the smallest token tile (the wgmma's N, at least 16) that covers m, at most 128."""
    return min(128, max(16, triton.next_power_of_2(m)))


def p_config(
    m: int, n: int, k: int, num_sms: int, programs_per_sm: int | None = None, bn: int | None = None
) -> dict:
    """Launch configuration of ``w4a16_p_kernel`` for [m, k] x [k, n], from the H200 sweep
    (``benchmarks/results/awq_pairs_h200.json``, the four V3.2 shapes, M = 1..128; the best
    configuration of each point is what this returns, or within 10% of it):
    - m <= 32: BN = 64, 4 warps, 4 stages, SPLIT_K = min(8, G / 4) for the G = K / 128 groups
      (8 at K = 7168 and 16384, 4 at K = 2048);
      and the split-K partials summed by the tile's last program (``FUSED``) at BT = 16, which
      measured 0.15-0.72 µs faster on all four shapes at M <= 16 and slower from M = 32;
    - m > 32: 3 stages; BN = 128 with 8 warps at BT = 64, BN = 64 with 4 warps at BT = 128; split
      until about ``programs_per_sm`` = 2 programs per SM.
    ``programs_per_sm`` / ``bn`` override the rule (the sweep's candidates)."""
    bt = tokens_tile(m)
    groups = k // GROUP
    if bt <= 32:
        cfg = {"BN": bn or 64, "BT": bt, "num_warps": 4, "num_stages": 4}
        split = max(1, min(8, groups // 4))
    else:
        wide = bt == 64
        cfg = {"BN": bn or (128 if wide else 64), "BT": bt, "num_warps": 8 if wide else 4,
               "num_stages": 3}  # fmt: skip
        split = None
        programs_per_sm = programs_per_sm or 2
    if programs_per_sm is not None:
        tiles = triton.cdiv(n, cfg["BN"]) * triton.cdiv(m, bt)
        split = 1
        while tiles * split * 2 <= programs_per_sm * num_sms and split * 4 <= groups:
            split *= 2
        split = min(split, 32)
    if cfg["BN"] >= 256:
        cfg["num_warps"] = 8
    return {**cfg, "SPLIT_K": split, "FUSED": bt == 16}


def _check_config(name: str, cfg: dict) -> None:
    if cfg["BN"] % 64 or cfg["BT"] < 16 or cfg["BT"] & (cfg["BT"] - 1) or cfg["SPLIT_K"] < 1:
        raise ValueError(
            f"{name}: bad config {cfg}: need BN a multiple of 64, BT a power of two >= 16, "
            "SPLIT_K >= 1"
        )


def w4a16_linear_p_triton(
    x: torch.Tensor, qweight_p: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
    config: dict | None = None, mode: int = DEFAULT_MODE,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ W^T -> [M, N]`` (x's dtype) with a pair-layout W4 weight; fp32 accumulation."""
    check_x16("w4a16_linear_p", x)
    m, k = x.shape
    n = check_pairs("w4a16_linear_p", qweight_p, zeros, scales, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or p_config(m, n, k, _num_sms(x.device))
    _check_config("w4a16_linear_p", cfg)
    split = cfg["SPLIT_K"]
    if split == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BT"]), split)
    fused = split > 1 and cfg.get("FUSED", False)
    y = out[0] if split == 1 else torch.empty((m, n), device=x.device, dtype=x.dtype)
    cnt = _counters(x.device, grid[0] * grid[1]) if fused else out
    w4a16_p_kernel[grid](
        x, qweight_p, zeros, scales, out, y, cnt, m, n, k // GROUP, x.stride(0), out.stride(0),
        out.stride(1), split, BN=cfg["BN"], BT=cfg["BT"], FP16=x.dtype == torch.float16,
        MODE=mode, FUSED=fused, INTERPRET=_INTERPRET, num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 4),
    )  # fmt: skip
    if split == 1 or fused:
        return y
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](
        out, y, m * n, split, BLOCK=1024, INTERPRET=_INTERPRET, num_warps=4
    )
    return y


# ---- fused MoE ---------------------------------------------------------------------------------


@triton.jit
def moe_p_kernel(
    a_ptr, w_ptr, z_ptr, s_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    ws_ptr, cnt_ptr, topk_ids_ptr, sum_ptr, num_pairs, N, G, E, stride_am, stride_om, SPLIT_K,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr,
    SPLIT: tl.constexpr, SUM_K: tl.constexpr, TOPK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One row block (BT pairs of one expert, ``custom_ops.moe_align``) x BN output columns over
    pair-layout expert weights ``w [E, G, NW, 16]``, ``z``/``s [E, G, NW]`` (NW = 2N when GATED:
    gate columns, then up columns, both from one pass over x). Pair ``p = sorted_ids[r]`` reads A
    row ``p // A_ROW_DIV`` and writes out row ``p``; GATED: out = silu(gate) * up (fp32, stored
    in out's dtype); MUL_WEIGHT: out = acc * topk_w[p].
    Grid: (max_blocks, cdiv(N, BN), SPLIT_K); blocks past the last expert exit at once.

    SPLIT (GATED, few pairs: the pass over D is long and the programs are few): split z of the
    groups stores its fp32 gate and up partials in ``ws [SPLIT_K, 2, max_blocks * BT, N]``; the
    tile's last split (``w4a16_p_kernel``'s counter protocol) sums them in split order and applies
    ``silu(gate) * up``.

    SUM_K (the down pass, decode sizes): after storing its weighted rows, a program counts them
    on a counter per (token, column tile) in ``cnt``; the program that brings a token's counter
    to the number of its pairs this rank computes (ids below E in ``topk_ids [T, TOPK]``) sums
    the token's rows in j order into ``sum [T, N]`` and resets the counter. So the sum over the
    k experts needs no launch of its own, and its order does not depend on which program ends
    last."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    ids = tl.load(sorted_ids_ptr + pid_b * BT + tl.arange(0, BT))  # [BT] pair indices
    t_mask = ids < num_pairs
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    offs_p = tl.arange(0, 16)
    NW = 2 * N if GATED else N
    x_cols = (a_ptr + (ids // A_ROW_DIV)[None, :].to(tl.int64) * stride_am
              + tl.arange(0, 32)[:, None])  # fmt: skip
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * G * NW * 16
    zs_base = e64 * G * NW
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BN, BT], dtype=tl.float32)
    g0, g1 = 0, G
    if SPLIT:
        per_split = tl.cdiv(G, SPLIT_K)
        g0 = pid_k * per_split
        g1 = tl.minimum(g0 + per_split, G)
    for g in range(g0, g1):
        col = g * NW + offs_n
        w = tl.load(w_base + col[:, None].to(tl.int64) * 16 + offs_p[None, :],
                    mask=n_mask[:, None], other=0)  # fmt: skip
        zz = _zz(z_ptr + zs_base + col, n_mask, FP16)
        sc = tl.load(s_ptr + zs_base + col, mask=n_mask, other=0.0).to(tl.float32)
        part = _group_part(tl.zeros([BN, BT], dtype=tl.float32), w, zz, x_cols + g * 128,
                           t_mask, FP16, MODE)  # fmt: skip
        acc += part * sc[:, None]
        if GATED:
            w_up = tl.load(w_base + (col + N)[:, None].to(tl.int64) * 16 + offs_p[None, :],
                           mask=n_mask[:, None], other=0)  # fmt: skip
            zz_up = _zz(z_ptr + zs_base + col + N, n_mask, FP16)
            sc_up = tl.load(s_ptr + zs_base + col + N, mask=n_mask, other=0.0).to(tl.float32)
            part_up = _group_part(tl.zeros([BN, BT], dtype=tl.float32), w_up, zz_up,
                                  x_cols + g * 128, t_mask, FP16, MODE)  # fmt: skip
            acc_up += part_up * sc_up[:, None]
    if SPLIT:
        slots = tl.num_programs(0) * BT
        rows = pid_b * BT + tl.arange(0, BT)
        ws = ws_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]  # [BN, BT]: split 0, gate
        k64 = pid_k.to(tl.int64)
        # NOTE: the pairs' rows only: a row block holds BT slots for a few pairs at decode (one of
        # 16 at T = 1), and unmasked partials of the padding rows were most of the pass's L2 traffic
        ws_mask = n_mask[:, None] & t_mask[None, :]
        tl.store(ws + (2 * k64) * slots * N, acc, mask=ws_mask)
        tl.store(ws + (2 * k64 + 1) * slots * N, acc_up, mask=ws_mask)
        tl.debug_barrier()  # every thread's partials are stored before the counter moves
        tile = pid_b * tl.num_programs(1) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done != SPLIT_K - 1:
            return
        acc = tl.zeros([BN, BT], dtype=tl.float32)
        acc_up = tl.zeros([BN, BT], dtype=tl.float32)
        for sk in range(0, SPLIT_K):
            sk64 = tl.full([], sk, tl.int64)
            acc += tl.load(ws + (2 * sk64) * slots * N, mask=ws_mask, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            acc_up += tl.load(ws + (2 * sk64 + 1) * slots * N, mask=ws_mask, other=0.0,
                              cache_modifier=".cg")  # fmt: skip
        tl.atomic_xchg(cnt_ptr + tile, 0)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, fp32
    if MUL_WEIGHT:
        tw = tl.load(topk_w_ptr + ids, mask=t_mask, other=0.0)
        acc = acc * tw[None, :]
    if SUM_K:  # the pairs of each token this rank computes, read before the barrier below
        tok = ids // TOPK  # [BT]: distinct tokens (a token picks an expert once)
        need = tl.zeros([BT], dtype=tl.int32)
        for j in range(TOPK):
            ej = tl.load(topk_ids_ptr + tok * TOPK + j, mask=t_mask, other=E)
            need += (ej < E).to(tl.int32)
    out = out_ptr + ids[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    _store(out, acc, t_mask[None, :] & n_mask[:, None], INTERPRET)
    if SUM_K:
        tl.debug_barrier()  # every thread's rows are stored before the counters move
        ctr = cnt_ptr + tok * tl.num_programs(1) + pid_n
        done = tl.atomic_add(ctr, 1, mask=t_mask, sem="acq_rel")  # [BT]
        last = t_mask & (done == need - 1)
        if tl.max(last.to(tl.int32), axis=0) > 0:
            tl.debug_barrier()  # the counters' acquire orders the whole CTA's loads below
            total = tl.zeros([BN, BT], dtype=tl.float32)
            for j in range(TOPK):
                ej = tl.load(topk_ids_ptr + tok * TOPK + j, mask=last, other=E)
                row = (tok * TOPK + j).to(tl.int64)
                total += tl.load(out_ptr + row[None, :] * stride_om + offs_n[:, None],
                                 mask=(last & (ej < E))[None, :] & n_mask[:, None], other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            sums = sum_ptr + tok[None, :].to(tl.int64) * N + offs_n[:, None]
            tl.store(sums, total, mask=last[None, :] & n_mask[:, None])
            tl.atomic_xchg(ctr, 0, mask=last)


def moe_p_config(num_pairs: int, n_experts: int) -> dict:
    """Launch configuration of ``moe_p_kernel`` (both GEMMs): BN = 64 (the smallest wgmma M: the
    most programs), 4 warps, 3 stages, BT = 16 pairs per row block: the best of the H200 sweep
    at every T = 1..128 with 256 experts (``benchmarks/results/awq_pairs_h200.json``; 4 and 6
    stages, BN = 128 were slower). Above 16 / 32 pairs per expert on average (prefill chunks, not
    measured) BT = 32 / 64, so an expert's pairs share fewer weight reads."""
    per_expert = num_pairs / n_experts
    bt = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return {"BN": 64, "BT": bt, "num_warps": 4, "num_stages": 3}


# Split the gate/up pass until about this many programs. The H200 run of 256 experts
# (benchmarks/results/awq_pairs_moe_split_h200.json, µs unsplit -> this rule's split): T = 1
# 181.1 -> 153.7 (split 8; 4 was 152.1), T = 2 224.9 -> 214.2 (8; 4 was 208.2), T = 4 341.1 ->
# 319.4 (4), T = 8 523.0 -> 507.7 (2), T = 16 unsplit (846.6; splitting was slower).
GATE_UP_PROGRAMS = 4096
# The down pass sums each token's k expert rows itself (SUM_K) up to this many tokens; above it
# one torch sum after the launch. H200, 256 experts, alternating rounds, medians in µs
# (benchmarks/results/awq_parts_h200.json, 3 rounds): T = 1 86.7 vs 91.0 (no overlap between
# the rounds), T = 2 152.0 vs 151.1, T = 4 264.9 vs 264.2; before the masked partials
# (gpu_session12/call3_awq_parts_ab_h200.json, 5 rounds) also T = 32 1330.7 vs 1308.5 and
# T = 128 2148.9 vs 2065.0: the counters' atomics and barriers in every program cost more than
# the launch saves once the programs fill the GPU.
SUM_K_MAX_TOKENS = 1


def gate_up_split(programs: int, groups: int, target: int | None = None) -> int:
    """SPLIT_K of the gate/up pass: with ``programs`` (touched experts x column tiles) below
    ``target``, split the D/128 groups (at least 4 a split, at most 8 splits) toward it."""
    target = GATE_UP_PROGRAMS if target is None else target
    split = 1
    while programs * split * 2 <= target and split * 8 <= groups and split < 8:
        split *= 2
    return split


def moe_w4a16_p_triton(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13_qweight_p: torch.Tensor, w13_zeros: torch.Tensor, w13_scales: torch.Tensor,
    w2_qweight_p: torch.Tensor, w2_zeros: torch.Tensor, w2_scales: torch.Tensor,
    config: dict | None = None, mode: int = DEFAULT_MODE,
) -> torch.Tensor:  # fmt: skip
    """Fused W4A16 MoE over pair-layout experts: fp32 ``[T, D] = sum_j w[t, j] *
    down_e(silu(gate_e(x_t)) * up_e(x_t))``; ``w13_* [E, D/128, 2I(, 16)]``, ``w2_* [E, I/128,
    D(, 16)]``."""
    from custom_ops.awq_format import check_moe_inputs, check_pair_experts

    check_moe_inputs(x, topk_ids, topk_weights)
    check_pair_experts("moe_w4a16_p (w13)", w13_qweight_p, w13_zeros, w13_scales, x.shape[1])
    e, _, two_i, _ = w13_qweight_p.shape
    inter = two_i // 2
    check_pair_experts("moe_w4a16_p (w2)", w2_qweight_p, w2_zeros, w2_scales, inter)
    t, d = x.shape
    if w2_qweight_p.shape[0] != e or w2_qweight_p.shape[2] != d or two_i % 2:
        raise ValueError(
            f"moe_w4a16_p: w2 {list(w2_qweight_p.shape)} does not match w13 "
            f"{list(w13_qweight_p.shape)} and D={d}"
        )
    topk = topk_ids.shape[1]
    p = t * topk
    cfg = config or moe_p_config(p, e)
    _check_config("moe_w4a16_p", {**cfg, "SPLIT_K": 1})
    if x.stride(1) != 1:
        x = x.contiguous()
    topk_ids = topk_ids.contiguous()  # the down pass's SUM_K reads row t at t * k
    sorted_ids, block_expert = moe_align(topk_ids, e, cfg["BT"])
    n_blocks = block_expert.numel()
    tw = topk_weights.reshape(-1).float().contiguous()  # [P]
    common = dict(
        BN=cfg["BN"], BT=cfg["BT"], FP16=x.dtype == torch.float16, MODE=mode,
        INTERPRET=_INTERPRET, num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 4),
    )  # fmt: skip
    h = torch.empty((p, inter), device=x.device, dtype=x.dtype)  # silu(gate) * up per pair
    n_tiles = triton.cdiv(inter, cfg["BN"])
    split = cfg.get("SPLIT_K")
    if split is None:  # programs: row blocks that hold pairs (each expert's, at least one) x tiles
        split = gate_up_split(max(min(e, p), triton.cdiv(p, cfg["BT"])) * n_tiles, d // GROUP)
        if p > e:  # measured only with fewer pairs than experts (decode on many experts)
            split = 1
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"moe_w4a16_p: SPLIT_K must be an int >= 1, got {split!r}")
    if split > 1:
        ws = torch.empty((split, 2, n_blocks * cfg["BT"], inter), device=x.device,
                         dtype=torch.float32)  # fmt: skip
        cnt = _counters(x.device, n_blocks * n_tiles)
    else:
        ws = cnt = h
    moe_p_kernel[(n_blocks, n_tiles, split)](
        x, w13_qweight_p, w13_zeros, w13_scales, h, sorted_ids, block_expert, tw, ws, cnt,
        topk_ids, h, p, inter, d // GROUP, e, x.stride(0), h.stride(0), split,
        A_ROW_DIV=topk, GATED=True, MUL_WEIGHT=False, SPLIT=split > 1, SUM_K=False, TOPK=topk,
        **common,
    )  # fmt: skip
    d_tiles = triton.cdiv(d, cfg["BN"])
    sum_k = cfg.get("SUM_K", t <= SUM_K_MAX_TOKENS)
    # NOTE: zeros, not empty: a skipped pair's (id == E) row is never written, nor, with SUM_K,
    # the sum of a token whose every pair is skipped; with SUM_K no skipped row is read
    y = (torch.empty if sum_k else torch.zeros)((p, d), device=x.device, dtype=torch.float32)
    out = torch.zeros((t, d), device=x.device, dtype=torch.float32) if sum_k else y
    cnt = _counters(x.device, t * d_tiles) if sum_k else y
    moe_p_kernel[(n_blocks, d_tiles, 1)](
        h, w2_qweight_p, w2_zeros, w2_scales, y, sorted_ids, block_expert, tw, y, cnt,
        topk_ids, out, p, d, inter // GROUP, e, h.stride(0), y.stride(0), 1,
        A_ROW_DIV=1, GATED=False, MUL_WEIGHT=True, SPLIT=False, SUM_K=sum_k, TOPK=topk, **common,
    )  # fmt: skip
    return out if sum_k else y.view(t, topk, d).sum(1)  # [T, D] fp32
