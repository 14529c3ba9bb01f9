"""W4A16 over the pair layout for many tokens: x is the wgmma's A operand and the dequantised
weight its B operand, through shared memory ("XA").

``w4a16_pairs_kernels.w4a16_p_kernel`` computes ``out^T = W x^T`` with the weight tile as the
MMA's A operand from registers, the tokens its N side: right for decode, where the tokens are
few. From ~64 tokens on the column tiles re-read x from L2 once each (``N / BN`` times: 57 MB
for 2048 x 7168 at M = 128 against a 7 MB weight), and the per-group partial product's registers
keep those tiles narrow. Here each program owns ``BM`` tokens x ``BN`` columns, ``out = x W^T``
as a dense GEMM: the tokens are the MMA's M side (64 per warpgroup), the weight tile of one K
slice is dequantised in registers with the same pair steps (``_pair``, SCALED: ``(q - z) * s``
rounded to x's dtype once, what ``dequant_p`` writes) and handed to the MMA as its B operand,
which Hopper's wgmma reads from shared memory (Triton stores it there). One accumulator runs
over every group, so the MMAs of consecutive K slices can stay in flight.

Numerics: SCALED's (the weights of ``dequant_p``), accumulated in fp32; the split-K partials are
fp32 and summed in split order by ``splitk_sum_kernel``, so the output does not depend on which
program ends first."""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.awq_kernels import _store, splitk_last_sum
from custom_ops.awq_pairs_steps import _pair, _ss, _zz


@triton.jit
def _slice(w, zz, ss, s: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr):
    """``[BN, 32]``: K rows ``32 s .. 32 s + 31`` of the group, SCALED's weights, in K order."""
    lo, hi = _pair(w, zz, s, FP16, MODE, ss, True)
    return tl.reshape(tl.join(lo, hi), [w.shape[0], 32])  # column 2 p + h = K row 32 s + 2 p + h


@triton.jit
def _group_tile(w, zz, ss, FP16: tl.constexpr, MODE: tl.constexpr):
    """``[BN, 128]``: the group's weights ``(q - z) * s`` (x's dtype) of the ``[BN, 16]`` words
    ``w``, in K order, so that one MMA takes the whole group. ``join`` stacks along a new last
    axis: ``[BN, 32, 2, 2]`` holds slice ``s_lo + 2 s_hi`` at ``[:, c, s_lo, s_hi]``, and the
    permute puts the slice index above the column (a relabelling of registers, no data moves)."""
    s0, s1 = _slice(w, zz, ss, 0, FP16, MODE), _slice(w, zz, ss, 1, FP16, MODE)
    s2, s3 = _slice(w, zz, ss, 2, FP16, MODE), _slice(w, zz, ss, 3, FP16, MODE)
    t = tl.join(tl.join(s0, s1), tl.join(s2, s3))
    return tl.reshape(tl.permute(t, (0, 3, 2, 1)), [w.shape[0], 128])


@triton.jit
def w4a16_p_xa_kernel(
    x_ptr, qw_ptr, zs_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, G, stride_xm, stride_os, stride_om, SPLIT_K,
    BN: tl.constexpr, BT: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr,
    FUSED: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over this split's groups of x[m, k] W^T[k, n], W = ``(q - z) * s``
    rounded to x's dtype (fp32 when SPLIT_K > 1, else out's dtype): ``w4a16_p_kernel``'s
    arguments and grid (cdiv(N, BN), cdiv(M, BT), SPLIT_K), BT tokens the MMA's M side (64 a
    warpgroup). FUSED: the tile's last split sums the partials (``splitk_last_sum``)."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_n = pid_n * BN + tl.arange(0, BN)
    t_mask = offs_t < M
    n_mask = offs_n < N
    per_split = tl.cdiv(G, SPLIT_K)
    g0 = pid_k * per_split
    g1 = tl.minimum(g0 + per_split, G)
    offs_p = tl.arange(0, 16)
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_xm + tl.arange(0, 128)[None, :]
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    for g in range(g0, g1):
        col = g * N + offs_n  # [BN] (group, column) index
        w = tl.load(qw_ptr + col[:, None].to(tl.int64) * 16 + offs_p[None, :],
                    mask=n_mask[:, None], other=0)  # fmt: skip
        zs = tl.load(zs_ptr + col, mask=n_mask, other=0)  # [BN] (zero point, scale) words
        xg = tl.load(x_rows + g * 128, mask=t_mask[:, None], other=0.0)  # [BT, 128]
        wt = _group_tile(w, _zz(zs, FP16), _ss(zs, FP16, INTERPRET), FP16, MODE)
        if MODE == 2:
            acc = tl.dot(xg.to(tl.float32), tl.trans(wt), acc)
        else:
            acc = tl.dot(xg, tl.trans(wt), acc)
    mask = t_mask[:, None] & n_mask[None, :]
    tile_offs = offs_t[:, None] * stride_om + offs_n[None, :]
    _store(out_ptr + pid_k * stride_os + tile_offs, acc, mask, INTERPRET)
    if FUSED:
        tile = pid_t * tl.num_programs(0) + pid_n
        splitk_last_sum(out_ptr, y_ptr, cnt_ptr, tile, tile_offs, mask, stride_os, SPLIT_K,
                        BT, BN, INTERPRET)  # fmt: skip
