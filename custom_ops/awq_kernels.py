"""Triton kernels for AWQ 4-bit weights (W4A16): a dense GEMM and a fused, expert-grouped MoE.

Format (AutoAWQ "gemm", docs/model_notes.md): ``qweight int32 [K, N/8]``,
``qzeros int32 [K/128, N/8]``, ``scales fp16|bf16 [K/128, N]``; nibble i (bits 4i..4i+3) of word c
holds column ``8c + ORDER[i]``, ``ORDER = [0,2,4,6,1,3,5,7]``, so column offset ch sits at bit
``4 * REVERSE[ch]``, ``REVERSE = [0,4,1,5,2,6,3,7] = ch // 2 + 4 * (ch % 2)``.
``W^T[k, n] = (q - z) * s``; ``y = x @ W^T``.

Both kernels dequantise in the K loop: a K tile never crosses a group of 128 (``128 % BK == 0``), so
the integer tile ``q - z`` (exact in bf16/fp16) goes through ``tl.dot`` and the group's scale is
applied to the fp32 partial product, ``acc += dot(x, q - z) * s``: W is never rounded to 16 bits.

The MoE's pairs are grouped by expert by ``custom_ops.moe_align`` (static sizes, no host syncs);
blocks past the last expert exit at once.

NOTE: the Triton interpreter (CPU CI) multiplies bf16 tiles as their raw uint16 bits in ``tl.dot``,
converts int32 to bf16 wrongly and truncates fp32 to bf16. Launchers pass ``INTERPRET=True`` there:
both dot operands are converted to fp32 and bf16 stores are rounded by hand (same results).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_format import GROUP, PACK, check_awq, check_moe_inputs
from custom_ops.moe_align import moe_align

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- device helpers --------------------------------------------------------------------------


@triton.jit
def _awq_shifts(BN: tl.constexpr):
    """Bit offset of each of BN consecutive output columns inside its int32 word."""
    ch = tl.arange(0, BN) % 8
    return ((ch // 2) + (ch % 2) * 4) * 4


@triton.jit
def _w4_tile(qw_ptrs, qz_ptrs, s_ptrs, pn_mask, n_mask, shifts, DTYPE: tl.constexpr,
             MAGIC: tl.constexpr):
    """Load a packed [BK, BN/8] tile and its group's zeros and scales.

    Returns ``(w [BK, BN], zc fp32 [BN], s fp32 [BN])`` with ``w = q + c`` (exact in DTYPE) and
    ``zc = z + c``, so that ``x @ (q - z) = x @ w - rowsum(x) * zc``. MAGIC: ``c = 2^mantissa``
    (128 for bf16, 1024 for fp16): OR-ing the nibble into the mantissa of c *is* the 16-bit value
    ``c + q``, with no int->float conversion (those run at a quarter of the ALU rate and made the
    dequantisation, not HBM, the bottleneck). Else ``c = 0`` and ``w = q`` as int32.
    """
    p = tl.load(qw_ptrs, mask=pn_mask[None, :], other=0)  # [BK, BN/8] int32
    # Repeat each word 8 times along N: [BK, BN], word of column n is n // 8.
    p = tl.interleave(p, p)
    p = tl.interleave(p, p)
    p = tl.interleave(p, p)
    q = (p >> shifts[None, :]) & 0xF  # arithmetic shift is fine: only the low nibble is kept
    zw = tl.load(qz_ptrs, mask=n_mask, other=0)  # [BN] int32 (gathered word of each column)
    zc = ((zw >> shifts) & 0xF).to(tl.float32)
    s = tl.load(s_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    # NOTE: one return statement: Triton's code generator would also visit a return placed
    # after a constexpr-if whose body returned.
    if MAGIC:
        if DTYPE == tl.bfloat16:
            w = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
            zc = zc + 128.0
        else:
            w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
            zc = zc + 1024.0
    else:
        w = q
    return w, zc, s


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """``a [BM, BK] @ b [BK, BN]`` in fp32; b (int32 ``q`` or 16-bit) is cast to a's dtype,
    exact for small integers."""
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b.to(a.dtype))
    return out


@triton.jit
def _w4_step(acc, a, w_ptrs, z_ptrs, s_ptrs, pn_mask, n_mask, shifts, MAGIC: tl.constexpr,
             INTERPRET: tl.constexpr):
    """``acc += a @ W^T`` for one K tile inside one group: ``(a @ w - rowsum(a) * zc) * s``."""
    w, zc, s = _w4_tile(w_ptrs, z_ptrs, s_ptrs, pn_mask, n_mask, shifts, a.dtype, MAGIC)
    rs = tl.sum(a.to(tl.float32), axis=1)  # [BM]
    return acc + (_dot(a, w, INTERPRET) - rs[:, None] * zc[None, :]) * s[None, :]


@triton.jit
def _store(ptrs, acc, mask, INTERPRET: tl.constexpr):
    """Store fp32 ``acc`` in the pointee dtype (round to nearest even when narrowing)."""
    if INTERPRET:
        if ptrs.dtype.element_ty == tl.bfloat16:
            # The interpreter truncates fp32 -> bf16: round the fp32 bits to nearest-even first.
            u = acc.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            acc = u.to(tl.float32, bitcast=True)
    tl.store(ptrs, acc.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _round16(acc, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``acc`` rounded to the 16-bit DT (to nearest even) and back: what a 16-bit linear's
    output holds."""
    if INTERPRET:
        if DT == tl.bfloat16:  # the interpreter truncates fp32 -> bf16 (see the module NOTE)
            u = acc.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            out = u.to(tl.float32, bitcast=True)
        else:
            out = acc.to(DT).to(tl.float32)
    else:
        out = acc.to(DT).to(tl.float32)
    return out


# ---- dense W4A16 GEMM ------------------------------------------------------------------------


@triton.jit
def w4a16_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr,
    M, N, K, stride_xm, stride_os, stride_om, SPLIT_K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAGIC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[split, m, n] = sum over this split's K tiles of x[m, k] * W^T[k, n] (fp32 when
    SPLIT_K > 1, else directly in out's dtype). Grid: (cdiv(M, BM) * cdiv(N, BN), SPLIT_K)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_blocks = tl.cdiv(N, BN)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks
    N8 = N // 8

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_pn = pid_n * (BN // 8) + tl.arange(0, BN // 8)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    n_mask = offs_n < N
    pn_mask = offs_pn < N8
    shifts = _awq_shifts(BN)

    n_tiles = K // BK
    per_split = tl.cdiv(n_tiles, SPLIT_K)
    t0 = pid_k * per_split
    t1 = tl.minimum(t0 + per_split, n_tiles)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in range(t0, t1):
        k = t * BK + offs_k
        g = (t * BK) // 128
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0
        )
        acc = _w4_step(
            acc, x, qw_ptr + k[:, None] * N8 + offs_pn[None, :], qz_ptr + g * N8 + offs_n // 8,
            s_ptr + g * N + offs_n, pn_mask, n_mask, shifts, MAGIC, INTERPRET,
        )
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    _store(out, acc, m_mask[:, None] & n_mask[None, :], INTERPRET)


@triton.jit
def splitk_sum_kernel(part_ptr, out_ptr, numel, SPLIT_K, BLOCK: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """out[i] = sum_s part[s, i] (fp32), stored in out's dtype: one launch for sum and cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for sk in range(0, SPLIT_K):
        acc += tl.load(part_ptr + sk * numel + offs, mask=mask, other=0.0)
    _store(out_ptr + offs, acc, mask, INTERPRET)


@triton.jit
def splitk_last_sum(part_ptr, y_ptr, cnt_ptr, tile, tile_offs, mask, stride_ps, SPLIT_K,
                    R: tl.constexpr, C: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``splitk_sum_kernel`` inside the split-K kernel, for the ``[R, C]`` tile whose fp32 partial
    this program stored at ``part_ptr + split * stride_ps + tile_offs``: the tile's last split to
    finish (an acq_rel counter per tile at ``cnt_ptr``, ``custom_ops/tile_counters.py``) sums the
    partials in split order into ``y_ptr + tile_offs`` (y's dtype: the same bits as the separate
    launch) and sets the counter back to 0 for the next launch."""
    tl.debug_barrier()  # every thread's partial is stored before the counter moves
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if done == SPLIT_K - 1:
        total = tl.zeros([R, C], dtype=tl.float32)
        for sk in range(0, SPLIT_K):
            total += tl.load(part_ptr + sk * stride_ps + tile_offs, mask=mask, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
        _store(y_ptr + tile_offs, total, mask, INTERPRET)
        tl.atomic_xchg(cnt_ptr + tile, 0)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def linear_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int]:
    """Launch configuration of ``w4a16_gemm_kernel`` for an [m, k] x [k, n] product.

    From the H200 sweep in benchmarks/results/awq_h200.json (7168 -> 2048): BM=32 was slower than
    BM=64 at M=32; BN=128 with split-K to about one program per SM was best at M=128; the rest of
    the configurations were within noise of each other at M <= 64.
    """
    bm = 16 if m <= 16 else 64
    bn = 128 if m > 64 else 64
    bk = 128
    tiles = (m + bm - 1) // bm * ((n + bn - 1) // bn)
    split = 1
    # Decode GEMMs have few output tiles: split K until there is about one program per SM.
    while tiles * split < num_sms and split * 2 <= k // bk and split < 16:
        split *= 2
    return {"BM": bm, "BN": bn, "BK": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 3,
            "MAGIC": True}


def w4a16_linear_triton(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T`` with AWQ ``W``; fp32 accumulation; returns [M, N] in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"w4a16_linear: x must be 2-D [M, K], got shape {list(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"w4a16_linear: x must be float16 or bfloat16, got {x.dtype}")
    m, k = x.shape
    n = qweight.shape[-1] * PACK
    check_awq("w4a16_linear", qweight, qzeros, scales, k, n)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or linear_config(m, n, k, _num_sms(x.device))
    if GROUP % cfg["BK"] or cfg["BN"] % 16 or cfg["BM"] < 16:
        raise ValueError(
            f"w4a16_linear: bad config {cfg}: need 128 % BK == 0, BN % 16 == 0, BM >= 16"
        )
    split = cfg["SPLIT_K"]
    if split == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]), split)
    w4a16_gemm_kernel[grid](
        x, qweight, qzeros, scales, out, m, n, k, x.stride(0), out.stride(0), out.stride(1), split,
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], MAGIC=cfg.get("MAGIC", True),
        INTERPRET=_INTERPRET,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split == 1:
        return out[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](out, y, m * n, split, BLOCK=1024,
                                                   INTERPRET=_INTERPRET, num_warps=4)
    return y


# ---- fused MoE -------------------------------------------------------------------------------


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, z_ptr, s_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    num_pairs, N, K, E,
    stride_am, stride_we, stride_wk, stride_wn, stride_ze, stride_se, stride_om,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, W4: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAGIC: tl.constexpr,
    INTERPRET: tl.constexpr, ROUND16: tl.constexpr = False,
):
    """One row block (pairs of one expert) x BN output columns.

    Row r of the block is pair ``p = sorted_ids[r]``; it reads A row ``p // A_ROW_DIV`` and writes
    out row ``p``. GATED: the weight has 2N output columns (gate then up), out = silu(gate) * up
    (fp32). MUL_WEIGHT: out = acc * topk_w[p]. W4: AWQ weight [E, K, 2N/8 or N/8] (+ zeros,
    scales); else a 16-bit weight [E, N_total, K] addressed through (stride_wk, stride_wn).
    ROUND16: the products are rounded to A's dtype first (16-bit linears, ``moe_bf16``).
    Grid: (max_blocks, cdiv(N, BN)).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BM + tl.arange(0, BM))  # [BM] pair indices
    row_mask = ids < num_pairs
    a_rows = ids // A_ROW_DIV

    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * stride_we
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    if W4:
        NW = N * 2 if GATED else N  # columns of the (gate|up) weight
        offs_pn = pid_n * (BN // 8) + tl.arange(0, BN // 8)
        pn_mask = offs_pn < N // 8
        shifts = _awq_shifts(BN)
        z_base = z_ptr + e64 * stride_ze
        s_base = s_ptr + e64 * stride_se

    for k0 in range(0, K, BK):
        k = k0 + offs_k
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=row_mask[:, None], other=0.0
        )
        if W4:
            g = k0 // 128
            acc = _w4_step(
                acc, a, w_base + k[:, None] * stride_wk + offs_pn[None, :],
                z_base + g * (NW // 8) + offs_n // 8, s_base + g * NW + offs_n,
                pn_mask, n_mask, shifts, MAGIC, INTERPRET,
            )
            if GATED:
                acc_up = _w4_step(
                    acc_up, a, w_base + k[:, None] * stride_wk + (N // 8 + offs_pn)[None, :],
                    z_base + g * (NW // 8) + (N + offs_n) // 8, s_base + g * NW + N + offs_n,
                    pn_mask, n_mask, shifts, MAGIC, INTERPRET,
                )
        else:
            w = tl.load(
                w_base + k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                mask=n_mask[None, :], other=0.0,
            )
            acc += _dot(a, w, INTERPRET)
            if GATED:
                wu = tl.load(
                    w_base + k[:, None] * stride_wk + (N + offs_n)[None, :] * stride_wn,
                    mask=n_mask[None, :], other=0.0,
                )
                acc_up += _dot(a, wu, INTERPRET)

    if ROUND16:
        acc = _round16(acc, a_ptr.dtype.element_ty, INTERPRET)
        if GATED:
            acc_up = _round16(acc_up, a_ptr.dtype.element_ty, INTERPRET)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, fp32
    if MUL_WEIGHT:
        tw = tl.load(topk_w_ptr + ids, mask=row_mask, other=0.0)
        acc = acc * tw[:, None]
    out = out_ptr + ids[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    _store(out, acc, row_mask[:, None] & n_mask[None, :], INTERPRET)


def moe_config(num_pairs: int, n_experts: int) -> dict[str, int]:
    """Launch configuration of ``moe_gemm_kernel`` (both GEMMs), from the H200 sweep in
    benchmarks/results/awq_h200.json: BM=16 up to 16 pairs per expert, else 64; with BM=16, BN=128
    beat BN=64 by 10-15% (BK=128 / 8 warps for a handful of pairs, BK=64 / 4 warps beyond)."""
    if num_pairs > 16 * n_experts:  # BM=32 was slower than BM=64 (E=16: T=64 vs T=128)
        return {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3, "MAGIC": True}
    if num_pairs <= 64:
        return {"BM": 16, "BN": 128, "BK": 128, "num_warps": 8, "num_stages": 3, "MAGIC": True}
    return {"BM": 16, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "MAGIC": True}


def _launch_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, ...], n_experts: int, inter: int,
    config: dict[str, int] | None,
) -> torch.Tensor:
    """Shared by the W4 and 16-bit paths; ``w13``/``w2`` are (qweight, qzeros, scales) or
    (weight,)."""
    t, d = x.shape
    topk = topk_ids.shape[1]
    p = t * topk
    w4 = len(w13) == 3
    cfg = config or moe_config(p, n_experts)
    if GROUP % cfg["BK"] or cfg["BN"] % 16 or cfg["BM"] < 16:
        raise ValueError(f"moe: bad config {cfg}: need 128 % BK == 0, BN % 16 == 0, BM >= 16")
    if x.stride(1) != 1:
        x = x.contiguous()
    sorted_ids, block_expert = moe_align(topk_ids, n_experts, cfg["BM"])
    n_blocks = block_expert.numel()
    tw = topk_weights.reshape(-1).float().contiguous()  # [P]
    common = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], MAGIC=cfg.get("MAGIC", True),
                  INTERPRET=_INTERPRET, ROUND16=not w4,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    def strides(w: tuple[torch.Tensor, ...]) -> tuple[int, int, int, int, int]:
        if w4:  # qweight [E, K, N/8], qzeros [E, G, N/8], scales [E, G, N]
            return w[0].stride(0), w[0].stride(1), 1, w[1].stride(0), w[2].stride(0)
        return w[0].stride(0), w[0].stride(2), w[0].stride(1), 0, 0  # weight [E, N, K]

    def zs(w: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return (w[1], w[2]) if w4 else (w[0], w[0])

    h = torch.empty((p, inter), device=x.device, dtype=x.dtype)  # silu(gate) * up per pair
    moe_gemm_kernel[(n_blocks, triton.cdiv(inter, cfg["BN"]))](
        x, w13[0], *zs(w13), h, sorted_ids, block_expert, tw, p, inter, d, n_experts,
        x.stride(0), *strides(w13), h.stride(0),
        A_ROW_DIV=topk, GATED=True, MUL_WEIGHT=False, W4=w4, **common,
    )
    # NOTE: zeros, not empty: a skipped pair's (id == E) row is never written
    y = torch.zeros((p, d), device=x.device, dtype=torch.float32)  # weighted expert outputs
    moe_gemm_kernel[(n_blocks, triton.cdiv(d, cfg["BN"]))](
        h, w2[0], *zs(w2), y, sorted_ids, block_expert, tw, p, d, inter, n_experts,
        h.stride(0), *strides(w2), y.stride(0),
        A_ROW_DIV=1, GATED=False, MUL_WEIGHT=True, W4=w4, **common,
    )
    return y.view(t, topk, d).sum(1)  # [T, D] fp32


def moe_w4a16_triton(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13_qweight: torch.Tensor, w13_qzeros: torch.Tensor, w13_scales: torch.Tensor,
    w2_qweight: torch.Tensor, w2_qzeros: torch.Tensor, w2_scales: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Fused AWQ MoE: fp32 ``sum_j w[t,j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``,
    ``e = topk_ids[t, j]``."""
    check_moe_inputs(x, topk_ids, topk_weights)
    if w13_qweight.dim() != 3:
        raise ValueError(
            f"moe_w4a16: w13_qweight must be [E, D, 2I/8], got {list(w13_qweight.shape)}"
        )
    e, d = w13_qweight.shape[:2]
    inter = w13_qweight.shape[2] * PACK // 2
    if d != x.shape[1]:
        raise ValueError(f"moe_w4a16: x has D={x.shape[1]} but w13_qweight has D={d}")
    check_awq("moe_w4a16 (w13)", w13_qweight, w13_qzeros, w13_scales, d, 2 * inter, (e,))
    check_awq("moe_w4a16 (w2)", w2_qweight, w2_qzeros, w2_scales, inter, d, (e,))
    if inter % PACK:
        raise ValueError(f"moe_w4a16: the intermediate size {inter} must be a multiple of {PACK}")
    return _launch_moe(
        x, topk_ids, topk_weights, (w13_qweight, w13_qzeros, w13_scales),
        (w2_qweight, w2_qzeros, w2_scales), e, inter, config,
    )


def moe_bf16_triton(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13_weight: torch.Tensor, w2_weight: torch.Tensor, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The same fused MoE with 16-bit weights ``w13_weight [E, 2I, D]``, ``w2_weight [E, D, I]``."""
    check_moe_inputs(x, topk_ids, topk_weights)
    if w13_weight.dim() != 3 or w2_weight.dim() != 3:
        raise ValueError("moe_bf16: w13_weight must be [E, 2I, D] and w2_weight [E, D, I]")
    e, two_i, d = w13_weight.shape
    inter = two_i // 2
    if d != x.shape[1] or tuple(w2_weight.shape) != (e, d, inter) or two_i % 2:
        raise ValueError(
            f"moe_bf16: shapes do not match: x {list(x.shape)}, w13 {list(w13_weight.shape)}, "
            f"w2 {list(w2_weight.shape)}"
        )
    if w13_weight.dtype != x.dtype or w2_weight.dtype != x.dtype:
        raise ValueError(f"moe_bf16: weights must have x's dtype {x.dtype}")
    if d % GROUP or inter % GROUP:
        raise ValueError(f"moe_bf16: D={d} and I={inter} must be multiples of {GROUP}")
    return _launch_moe(x, topk_ids, topk_weights, (w13_weight,), (w2_weight,), e, inter, config)
