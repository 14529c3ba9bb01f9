"""The fused W4A16 MoE over pair-layout experts (``echo::moe_w4a16_p``): ``awq_pairs_kernels``'
wgmma step (the weight tile as the register A operand, the pairs as its N side), applied to the
row blocks of one expert's pairs (``custom_ops.moe_align``); gate and up from one pass over x,
then the down projection weighted per pair, and at one token its own sum over the k experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.awq_format import GROUP
from custom_ops.awq_kernels import _store
from custom_ops.awq_pairs_kernels import _INTERPRET, DEFAULT_MODE, _check_config, _counters
from custom_ops.awq_pairs_steps import _group_part, _scale, _ss, _zz
from custom_ops.moe_align import moe_align


@triton.jit
def moe_p_kernel(
    a_ptr, w_ptr, zs_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    ws_ptr, cnt_ptr, topk_ids_ptr, sum_ptr, num_pairs, N, G, E, stride_am, stride_om, SPLIT_K,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr,
    SPLIT: tl.constexpr, SUM_K: tl.constexpr, TOPK: tl.constexpr, INTERPRET: tl.constexpr,
    SCALED: tl.constexpr = False, GROUP_DOT: tl.constexpr = False,
):  # fmt: skip
    """One row block (BT pairs of one expert, ``custom_ops.moe_align``) x BN output columns over
    pair-layout expert weights ``w [E, G, NW, 16]``, ``zs [E, G, NW]`` (NW = 2N when GATED:
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
    last.

    SCALED: the group's scale multiplies the 16-bit weights (W rounded to x's dtype) and one
    accumulator per projection runs over every group (``w4a16_p_kernel``'s SCALED)."""
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
    x_base = a_ptr + (ids // A_ROW_DIV)[None, :].to(tl.int64) * stride_am  # [1, BT]
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
        zs = tl.load(zs_ptr + zs_base + col, mask=n_mask, other=0)  # (zero point, scale) words
        zz = _zz(zs, FP16)
        if SCALED:
            acc = _group_part(acc, w, zz, x_base + g * 128, t_mask, FP16, MODE,
                              _ss(zs, FP16, INTERPRET), True, GROUP_DOT)  # fmt: skip
        else:
            part = _group_part(tl.zeros([BN, BT], dtype=tl.float32), w, zz, x_base + g * 128,
                               t_mask, FP16, MODE, GROUP_DOT=GROUP_DOT)  # fmt: skip
            acc += part * _scale(zs)[:, None]
        if GATED:
            w_up = tl.load(w_base + (col + N)[:, None].to(tl.int64) * 16 + offs_p[None, :],
                           mask=n_mask[:, None], other=0)  # fmt: skip
            zs_up = tl.load(zs_ptr + zs_base + col + N, mask=n_mask, other=0)
            zz_up = _zz(zs_up, FP16)
            if SCALED:
                acc_up = _group_part(acc_up, w_up, zz_up, x_base + g * 128, t_mask, FP16, MODE,
                                     _ss(zs_up, FP16, INTERPRET), True, GROUP_DOT)  # fmt: skip
            else:
                part_up = _group_part(tl.zeros([BN, BT], dtype=tl.float32), w_up, zz_up,
                                      x_base + g * 128, t_mask, FP16, MODE,
                                      GROUP_DOT=GROUP_DOT)  # fmt: skip
                acc_up += part_up * _scale(zs_up)[:, None]
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
            # NOTE: ids are in [0, E] (moe_align's contract); a negative one would count here
            # without a row block, and its token's counter would never reset
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
    """Launch configuration of ``moe_p_kernel`` (both GEMMs), BT = 16 pairs per row block, from
    the H200 sweep of the packed (zero point, scale) layout with 256 experts
    (``benchmarks/results/awq_pairs_zs_sweep_h200.json``): from 64 pairs (T = 8 at top-8) BN =
    128, 4 warps, 4 stages (T = 8 388.3 µs against 419.8 for BN = 64, T = 64 1527.6 against
    1667.9); below, BN = 64 (the smallest wgmma M: the most programs), 4 warps, 3 stages (T = 1
    82.0 against 83.2 for BN = 128; T = 2-4 not measured). SCALED was slower at T = 1-64 (90.4,
    445.4, 1788.0 µs at its best). From 16 to 32 pairs per expert on average BT = 32 (not
    measured). Above 32 (prefill chunks): SCALED, BN = 128 on 8 warps, BT = 64; at T = 2048 on 256
    experts (64 pairs per expert) 5985.7 µs against 8120.9 for the exact-weight BN = 64 tile and
    9143.9 for the bf16 grouped MoE (``awq_pairs_moe_scaled_h200.json``, before the packed
    layout)."""
    per_expert = num_pairs / n_experts
    if per_expert > 32:
        return {"BN": 128, "BT": 64, "num_warps": 8, "num_stages": 3, "SCALED": True}
    if per_expert > 16:
        return {"BN": 64, "BT": 32, "num_warps": 4, "num_stages": 3}
    if num_pairs >= 64:
        return {"BN": 128, "BT": 16, "num_warps": 4, "num_stages": 4}
    return {"BN": 64, "BT": 16, "num_warps": 4, "num_stages": 3}


# Split the gate/up pass until about this many programs. The H200 run of 256 experts
# (benchmarks/results/awq_pairs_moe_split_h200.json, µs unsplit -> this rule's split): T = 1
# 181.1 -> 153.7 (split 8; 4 was 152.1), T = 2 224.9 -> 214.2 (8; 4 was 208.2), T = 4 341.1 ->
# 319.4 (4), T = 8 523.0 -> 507.7 (2), T = 16 unsplit (846.6; splitting was slower).
GATE_UP_PROGRAMS = 4096
# The down pass sums each token's k expert rows itself (SUM_K) up to this many tokens; above it
# one torch sum after the launch. H200, 256 experts, alternating rounds, medians in µs, SUM_K vs
# the separate sum: T = 1 86.7 vs 91.0 (benchmarks/results/awq_parts_h200.json, 3 rounds, no
# overlap between them); before the masked partials (gpu_session12/call3_awq_parts_ab_h200.json,
# 5 rounds) T = 1 94.6 vs 98.3, T = 2 162.3 vs 162.3, T = 4 272.5 vs 269.3, T = 16 809.7 vs
# 811.5, T = 32 1330.7 vs 1308.5, T = 128 2148.9 vs 2065.0: the counters' atomics and barriers
# in every program cost more than the launch saves once the programs fill the GPU.
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
    w13_qweight_p: torch.Tensor, w13_zs_p: torch.Tensor, w2_qweight_p: torch.Tensor,
    w2_zs_p: torch.Tensor, config: dict | None = None, mode: int = DEFAULT_MODE,
) -> torch.Tensor:  # fmt: skip
    """Fused W4A16 MoE over pair-layout experts: fp32 ``[T, D] = sum_j w[t, j] *
    down_e(silu(gate_e(x_t)) * up_e(x_t))``; ``w13_* [E, D/128, 2I(, 16)]``, ``w2_* [E, I/128,
    D(, 16)]``."""
    from custom_ops.awq_format import check_moe_inputs, check_pair_experts

    check_moe_inputs(x, topk_ids, topk_weights)
    check_pair_experts("moe_w4a16_p (w13)", w13_qweight_p, w13_zs_p, x.shape[1])
    e, _, two_i, _ = w13_qweight_p.shape
    inter = two_i // 2
    check_pair_experts("moe_w4a16_p (w2)", w2_qweight_p, w2_zs_p, inter)
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
        INTERPRET=_INTERPRET, SCALED=cfg.get("SCALED", False),
        GROUP_DOT=cfg.get("GROUP_DOT", False), num_warps=cfg.get("num_warps", 4),
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
        x, w13_qweight_p, w13_zs_p, h, sorted_ids, block_expert, tw, ws, cnt,
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
        h, w2_qweight_p, w2_zs_p, y, sorted_ids, block_expert, tw, y, cnt,
        topk_ids, out, p, d, inter // GROUP, e, h.stride(0), y.stride(0), 1,
        A_ROW_DIV=1, GATED=False, MUL_WEIGHT=True, SPLIT=False, SUM_K=sum_k, TOPK=topk, **common,
    )  # fmt: skip
    return out if sum_k else y.view(t, topk, d).sum(1)  # [T, D] fp32
