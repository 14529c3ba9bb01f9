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

The fused MoE over the same steps is ``awq_pairs_moe.py``.

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
from custom_ops.awq_kernels import (
    _num_sms,
    _store,
    splitk_last_sum,
    splitk_sum_kernel,
)
from custom_ops.awq_pairs_steps import _group_part, _pair, _scale, _ss, _zz
from custom_ops.tile_counters import _COUNTERS, COUNTERS, reserve_counters  # noqa: F401
from custom_ops.tile_counters import counters as _counters
from custom_ops.tma import activations, descriptor, supported

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MODE_ASM, MODE_OPS, MODE_INTERPRET = 0, 1, 2
DEFAULT_MODE = MODE_INTERPRET if _INTERPRET else MODE_ASM


@triton.jit
def w4a16_p_kernel(
    x_ptr, qw_ptr, zs_ptr, out_ptr, y_ptr, cnt_ptr, qw_desc, zs_desc, x_desc,
    M, N, G, stride_xm, stride_os, stride_om, SPLIT_K,
    BN: tl.constexpr, BT: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr,
    FUSED: tl.constexpr, INTERPRET: tl.constexpr, SCALED: tl.constexpr = False,
    GROUP_DOT: tl.constexpr = False, TMA: tl.constexpr = 0,
):  # fmt: skip
    """out[split, m, n] = sum over this split's groups of x[m, k] W^T[k, n] (fp32 when SPLIT_K >
    1, else out's dtype). Grid: (cdiv(N, BN), cdiv(M, BT), SPLIT_K).

    FUSED (SPLIT_K > 1): the tile's last split to finish (an acq_rel counter per tile in
    ``cnt_ptr``, left at 0 again for the next launch) sums the fp32 partials in split order into
    ``y [M, N]`` (x's dtype): the order of ``splitk_sum_kernel``, so the same bits, one launch
    fewer.

    SCALED: the group's scale multiplies the 16-bit weights (W rounded to x's dtype, as AutoAWQ's
    and vLLM's kernels compute) and one accumulator runs over every group: no per-group partial
    product, its registers and its rescale (``p_config``'s wide tiles above M = 64).

    TMA (a bitmask: ``TMA_W``, ``TMA_ZS``, ``TMA_X``): these loads come by the tensor memory
    accelerator (``custom_ops/tma.py``), one bulk copy a tile issued by one thread instead of
    every thread's ``cp.async`` and its address arithmetic: the words (``qw_desc``: qweight_p as
    [G N, 16] in [BN, 16] blocks; rows past N read the next group's columns, or zeros past the
    end, and their outputs are never stored), the (zero point, scale) words (``zs_desc``: zs_p
    [G, N] in [1, BN] blocks), x's group tile with GROUP_DOT (``x_desc``: [BT, 128] blocks)."""
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
    x_base = x_ptr + offs_t[None, :].to(tl.int64) * stride_xm  # [1, BT]
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for g in range(g0, g1):
        col = g * N + offs_n  # [BN] (group, column) index
        if TMA & 1:  # TMA_W
            w = qw_desc.load([g * N + pid_n * BN, 0])
        else:
            w = tl.load(qw_ptr + col[:, None].to(tl.int64) * 16 + offs_p[None, :],
                        mask=n_mask[:, None], other=0)  # fmt: skip
        if TMA & 2:  # TMA_ZS
            zs = tl.reshape(zs_desc.load([g, pid_n * BN]), [BN])
        else:
            zs = tl.load(zs_ptr + col, mask=n_mask, other=0)  # [BN] (zero point, scale) words
        xg = None
        if TMA & 4 and GROUP_DOT:  # TMA_X
            xg = tl.trans(x_desc.load([pid_t * BT, g * 128]))
        zz = _zz(zs, FP16)
        if SCALED:
            acc = _group_part(acc, w, zz, x_base + g * 128, t_mask, FP16, MODE,
                              _ss(zs, FP16, INTERPRET), True, GROUP_DOT, xg)  # fmt: skip
        else:
            part = _group_part(tl.zeros([BN, BT], dtype=tl.float32), w, zz, x_base + g * 128,
                               t_mask, FP16, MODE, GROUP_DOT=GROUP_DOT, xg=xg)  # fmt: skip
            acc += part * _scale(zs)[:, None]
    mask = t_mask[None, :] & n_mask[:, None]
    tile_offs = offs_t[None, :] * stride_om + offs_n[:, None]
    _store(out_ptr + pid_k * stride_os + tile_offs, acc, mask, INTERPRET)
    if FUSED:
        tile = pid_t * tl.num_programs(0) + pid_n
        splitk_last_sum(out_ptr, y_ptr, cnt_ptr, tile, tile_offs, mask, stride_os, SPLIT_K,
                        BN, BT, INTERPRET)  # fmt: skip


@triton.jit
def dequant_p_kernel(
    qw_ptr, zs_ptr, w_ptr, N, K,
    BN: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``W [N, K]`` (x's dtype) = ``(q - z) * s`` rounded once, the SCALED kernel's weights:
    program (group g, column tile) writes ``W[n, 128 g : 128 g + 128]``. Grid: (G, cdiv(N, BN))."""
    g = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    col = g * N + offs_n
    w = tl.load(qw_ptr + col[:, None].to(tl.int64) * 16 + tl.arange(0, 16)[None, :],
                mask=n_mask[:, None], other=0)  # fmt: skip
    zs = tl.load(zs_ptr + col, mask=n_mask, other=0)
    zz, ss = _zz(zs, FP16), _ss(zs, FP16, INTERPRET)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * K + g * 128 + tl.arange(0, 32)[None, :]
    for s in tl.static_range(4):
        lo, hi = _pair(w, zz, s, FP16, MODE, ss, True)
        a = tl.reshape(tl.join(lo, hi), [BN, 32])  # column 2 p + h = K row 32 s + 2 p + h
        tl.store(rows + 32 * s, a.to(w_ptr.dtype.element_ty), mask=n_mask[:, None])


def tokens_tile(m: int) -> int:
    """BT: the smallest token tile (the wgmma's N, at least 16) that covers m, at most 128."""
    return min(128, max(16, triton.next_power_of_2(m)))


DEQUANT_MIN_M = 257  # calls of more than 256 tokens: dequant_p, then F.linear (cuBLAS)


def uses_dequant(m: int) -> bool:
    """The large-M rule (prefill chunks), from the H200 run in
    ``benchmarks/results/gpu_session16/call1_awq_pairs_served_h200.json`` (the pair kernel on its
    BN = 64, 4-warp tile / the weight dequantised once then ``F.linear``, µs, the four V3.2
    shapes together): M = 256 227.3 / 268.6 (the pair kernel faster on every shape), M = 384
    398.0 / 324.9 and M = 512 442.7 / 366.7 (the dequantised path faster on every shape but
    7168 x 2048 at 384, 35.9 against 35.8): from M = 257 the pair kernel needs a third 128-token
    tile. At M = 4096 the dequantised path runs at 0.94-0.99x bf16 (``awq_served_h200.json``).
    One temporary weight in x's dtype per call ([N, K]: 235 MB at 16384 x 7168)."""
    return m >= DEQUANT_MIN_M


TMA_W, TMA_ZS, TMA_X = 1, 2, 4  # the TMA bitmask of w4a16_p_kernel
SCALED_MIN_WEIGHTS = 1 << 26  # at 65 <= M < 128, SCALED on linears this large (p_config)


def p_config(
    m: int, n: int, k: int, num_sms: int, programs_per_sm: int | None = None, bn: int | None = None
) -> dict:
    """Launch configuration of ``w4a16_p_kernel`` for [m, k] x [k, n], from the H200 sweep of the
    packed (zero point, scale) layout (``benchmarks/results/awq_pairs_zs_sweep_h200.json``; the
    four V3.2 shapes, M = 1, 16, 32, 64, 128; what this returns is the best candidate of each
    point or within 4% of it):
    - m <= 64: the exact-weight kernel, 4 warps, BN = 128 columns when N >= 4096, else 64 (at
      N = 2048 the 128-wide tile was 0.4-18% slower), 4 stages up to M = 32 and 3 at 64;
      m <= 16: SPLIT_K = min(8, G / 4) for the G = K / 128 groups, the split-K partials summed by
      the tile's last program (``FUSED``); above, split until about 2 programs per SM (SCALED lost
      at M = 32 and 64 on every shape: 9.9-36.0 µs at its best against 8.9-32.7, and 12.3-45.8
      against 11.3-41.5);
    - 64 < m <= 128: the exact kernel on BN = 64, 4 warps, 3 stages (M = 128: 24.1 / 15.7 /
      15.7 µs on 7168 x 4096, 7168 x 2048, 2048 x 7168 against SCALED's best 24.3 / 17.0 / 17.0),
      but below M = 128 SCALED (BN = 128, 8 warps, 3 stages) on linears of
      ``SCALED_MIN_WEIGHTS`` weights or more (16384 x 7168: 64.9 against 76.9); split until
      about 2 programs per SM;
    - 128 < m <= 256 (two 128-token tiles; above, ``uses_dequant``): the exact kernel on BN = 64,
      4 warps, 3 stages on every shape (no ``SCALED_MIN_WEIGHTS`` exception), which beat SCALED's
      best wide tile on every shape at M = 160, 192 and 256
      (``gpu_session16/call1_awq_pairs_served_h200.json``: 16384 x 7168 125.6-140.0 µs against
      152.6-153.7, 7168 x 2048 22.4-25.0 against 68.7-70.6).
    - ``GROUP_DOT`` (one MMA a group, ``awq_pairs_steps._group_part``) on the 16- and 128-token
      tiles (M <= 16, 64 < M <= 128) of linears below ``SCALED_MIN_WEIGHTS``, from H100 runs
      (``benchmarks/results/gpu_session41/call4_*``, two rounds, the four-slice kernel / GROUP_DOT
      at the rule's configuration): 1.10-1.32x on 7168 x 2048 at M = 1-16, 1.04-1.07x at M = 1
      and 16 on 7168 x 4096 and 2048 x 7168 (0.99-1.02x at 2-8), 0.99-1.14x at M = 96-128
      (7168 x 4096, M = 128: 24.5 / 25.2 against 22.8 / 22.1 µs); not at 32-64 tokens
      (0.98-0.99x on two of the three shapes), not on 16384 x 7168 (0.77-0.96x at M = 1 and
      16-128), not in the MoE (0.96-1.00x).
    - ``TMA`` (every load by the tensor memory accelerator) where GROUP_DOT runs a full 128-token
      tile (M = 128), from one H100 call (``benchmarks/results/gpu_session42/call1_*``, the rule's
      configuration / with TMA, µs): 7168 x 4096 22.3 / 20.0 and 22.7 / 20.1 (two runs),
      7168 x 2048 15.5 / 14.1, 2048 x 7168 15.6 / 13.9; not at M = 96 (0.98-1.02x) nor at
      M <= 64 (0.88-0.98x at M = 1-32, 0.96-1.06x at 64).
    - M = 128 on linears of ``SCALED_MIN_WEIGHTS`` weights or more: the exact kernel with
      GROUP_DOT and TMA like the smaller ones, not SCALED, from the H200 sweep at M = 128
      (``benchmarks/results/gpu_session43/call2_awq_sweep128_h200.json``, every candidate with
      GROUP_DOT and TMA beside it): 16384 x 7168 60.8 µs on BN = 64, SPLIT_K = 2 against 66.1
      for SCALED (the rule then) and 76.3 for the four-slice exact kernel's best tile; on the
      three smaller shapes the rule's tile was the best of the sweep with or without the keys.
    ``programs_per_sm`` / ``bn`` override the rule (the sweep's candidates)."""
    bt = tokens_tile(m)
    groups = k // GROUP
    if 64 < m < 128 and k * n >= SCALED_MIN_WEIGHTS:
        cfg = {"BN": bn or 128, "BT": bt, "num_warps": 8, "num_stages": 3, "SCALED": True}
    else:
        cfg = {"BN": bn or (128 if n >= 4096 and bt <= 64 else 64), "BT": bt, "num_warps": 4,
               "num_stages": 4 if bt <= 32 else 3, "SCALED": False}  # fmt: skip
        split = max(1, min(8, groups // 4))
    if bt > 16:
        programs_per_sm = programs_per_sm or 2
    if programs_per_sm is not None:
        tiles = triton.cdiv(n, cfg["BN"]) * triton.cdiv(m, bt)
        split = 1
        while tiles * split * 2 <= programs_per_sm * num_sms and split * 4 <= groups:
            split *= 2
        split = min(split, 32)
    if cfg["BN"] >= 256:
        cfg["num_warps"] = 8
    small = k * n < SCALED_MIN_WEIGHTS
    cfg["GROUP_DOT"] = m == 128 or (small and (bt == 16 or 64 < m < 128))
    if m == 128:  # a full 128-token tile: every load by TMA
        cfg["TMA"] = TMA_W | TMA_ZS | TMA_X
    return {**cfg, "SPLIT_K": split, "FUSED": bt == 16}


def _check_config(name: str, cfg: dict) -> None:
    if cfg["BN"] % 64 or cfg["BT"] < 16 or cfg["BT"] & (cfg["BT"] - 1) or cfg["SPLIT_K"] < 1:
        raise ValueError(
            f"{name}: bad config {cfg}: need BN a multiple of 64, BT a power of two >= 16, "
            "SPLIT_K >= 1"
        )


def _descriptors(x: torch.Tensor, qweight_p: torch.Tensor, zs_p: torch.Tensor, cfg: dict) -> tuple:
    """The ``TMA`` kernel's tensor descriptors (``w4a16_p_kernel``), None where its bit is off:
    the words as [G N, 16] in [BN, 16] blocks, the (zero point, scale) words [G, N] in [1, BN]
    blocks, x [M, K] in [BT, 128] blocks (a group's tokens; GROUP_DOT only)."""
    g, n, _ = qweight_p.shape
    tma, bn, name = int(cfg.get("TMA", 0)), cfg["BN"], "w4a16_linear_p"
    return (
        descriptor(name, qweight_p, [bn, 16], [g * n, 16]) if tma & TMA_W else None,
        descriptor(name, zs_p, [1, bn]) if tma & TMA_ZS else None,
        descriptor(name, x, [cfg["BT"], GROUP]) if tma & TMA_X and cfg.get("GROUP_DOT") else None,
    )


def w4a16_linear_p_triton(
    x: torch.Tensor, qweight_p: torch.Tensor, zs_p: torch.Tensor, config: dict | None = None,
    mode: int = DEFAULT_MODE,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ W^T -> [M, N]`` (x's dtype) with a pair-layout W4 weight; fp32 accumulation."""
    check_x16("w4a16_linear_p", x)
    m, k = x.shape
    n = check_pairs("w4a16_linear_p", qweight_p, zs_p, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is None and uses_dequant(m):
        config = {"DEQUANT": True}
    cfg = config or p_config(m, n, k, _num_sms(x.device))
    if cfg.get("DEQUANT"):  # many tokens: the weight once in x's dtype, then a dense GEMM
        return torch.nn.functional.linear(x, dequant_p_triton(qweight_p, zs_p, x.dtype, mode))
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
    tma = int(cfg.get("TMA", 0))
    if tma and not supported(x.device):
        tma = 0
    cfg = {**cfg, "TMA": tma}
    if tma & TMA_X:
        x = activations(x)
    descs = _descriptors(x, qweight_p, zs_p, cfg)
    w4a16_p_kernel[grid](
        x, qweight_p, zs_p, out, y, cnt, *descs, m, n, k // GROUP, x.stride(0), out.stride(0),
        out.stride(1), split, BN=cfg["BN"], BT=cfg["BT"], FP16=x.dtype == torch.float16,
        MODE=mode, FUSED=fused, INTERPRET=_INTERPRET, SCALED=cfg.get("SCALED", False),
        GROUP_DOT=cfg.get("GROUP_DOT", False), TMA=tma, num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 4),
    )  # fmt: skip
    if split == 1 or fused:
        return y
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](
        out, y, m * n, split, BLOCK=1024, INTERPRET=_INTERPRET, num_warps=4
    )
    return y


def dequant_p_triton(
    qweight_p: torch.Tensor, zs_p: torch.Tensor, dtype: torch.dtype, mode: int = DEFAULT_MODE,
) -> torch.Tensor:  # fmt: skip
    """``W [N, K]`` in ``dtype`` (bf16 or fp16): ``(q - z) * s`` rounded once, as the SCALED
    kernel computes with (``awq_pairs.dequantize_pairs_t(..., dtype)`` is its reference)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dequant_p: dtype must be bfloat16 or float16, got {dtype}")
    if qweight_p.dim() != 3:
        raise ValueError(
            f"dequant_p: qweight_p must be [K/128, N, 16], got {list(qweight_p.shape)}"
        )
    g = qweight_p.shape[0]
    n = check_pairs("dequant_p", qweight_p, zs_p, g * GROUP)
    w = torch.empty((n, g * GROUP), device=qweight_p.device, dtype=dtype)
    dequant_p_kernel[(g, triton.cdiv(n, 64))](
        qweight_p, zs_p, w, n, g * GROUP, BN=64, FP16=dtype == torch.float16, MODE=mode,
        INTERPRET=_INTERPRET, num_warps=4,
    )  # fmt: skip
    return w
