"""Triton split-K GEMV for W4A16 at small M (M <= 16), over the repacked layout of
``awq_format.py`` (``qweight_r int32 [G, N, 16]``, ``zeros_r uint8 [G, N]``, ``scales_r [G, N]``;
nibble i of word j of (g, n) is ``q[128 g + 16 i + j, n]``). Issue 17: the GEMM-shaped kernels
read int4 weights at 200-500 GB/s; at M <= 16 the work is a weight stream, so this kernel is
built around keeping HBM busy.

Why it is shaped this way:
- layout: the repacked one, reused (no second copy). A program's tile for one group is one
  contiguous ``BN * 64``-byte block (4-16 KB): each thread loads 16 contiguous bytes, and
  consecutive groups of a K slice sit ``N * 64`` bytes apart, which costs nothing once a block
  is a few KB (DRAM pages and channel interleave are far smaller). A layout with the whole
  (BN x K slice) tile contiguous would tie the weights to one BN and forbid sweeping it;
- memory-level parallelism: the next ``DEPTH`` groups' words are loaded before the current
  group is computed (register double buffering; no dot sits behind the load, so Triton's
  pipeliner cannot be relied on), and split-K makes several programs per SM resident;
- ``DOT=False`` (one row by ``CONFIG_BY_M``; up to 8 to measure): CUDA-core FMAs. A nibble
  becomes an fp32 ``q 2^b`` in place with two operations (``(w & 0xF << b) | 0x4B000000`` read
  as fp32 is ``2^23 + q 2^b``, minus ``2^23``; the upper four nibbles from ``w >> 16``), against
  x pre-scaled by ``2^-b`` (exact); each row does one FMA per weight into a ``[BM, 16, BN]``
  partial; the zero point and the scale are applied once per (group, column):
  ``acc += (sum_k x q - rowsum(x) * z) * s`` after a reduction over the 16 words;
- ``DOT=True`` (M padded to 16; from two rows by ``CONFIG_BY_M``): ``0x4300 | q`` (bf16
  ``128 + q``, exact) or ``0x6400 | q`` (fp16 ``1024 + q``) as the ``tl.dot`` operand per K slice
  of 16, as ``awq_repack_kernels``;
- split-K partials in fp32, reduced by a second tiny launch in a fixed order (deterministic:
  the engine runs deterministic, and atomics would make a run differ from the next).

NOTE: under the Triton interpreter (CPU CI) the dot operands are fp32 and bf16 stores are
rounded by hand (``_dot`` / ``_store`` of awq_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.awq_format import GROUP, check_repacked
from custom_ops.awq_kernels import _dot, _num_sms, _store, splitk_sum_kernel

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_M = 16  # the rows one program covers (BM <= 16); larger M goes to the GEMM kernels
# 0x4B000000, the fp32 bits of 2^23, passed as an argument: in a register, ``(w & mask) | MAGIC``
# is one LOP3 (SASS takes one immediate per LOP3; Triton 3.6's ptxas split the constant form in
# two). The kernel argument is not specialised, so it stays a register.
FP32_MAGIC = 0x4B000000
FMA_MAX_M = 8  # DOT=False keeps a [BM, 16, BN] fp32 partial: BM > 8 spills at useful BN


@triton.jit
def _load_words(qw_ptr, g, g1, N, w_off, n_mask, DOT: tl.constexpr):
    """The words of group g (zeros past the split's last group g1): ``[16, BN]`` for tl.dot,
    ``[1, 16, BN]`` for the FMA path (loaded in 3-D so that the dequantised tile already has the
    layout of the ``[BM, 16, BN]`` partial: no per-nibble layout conversion through shared
    memory)."""
    # NOTE: the group test as a vector: the interpreter rejects a [16, BN] & scalar mask
    live = n_mask & ((n_mask.to(tl.int32) * 0 + g) < g1)  # [BN]
    # NOTE: g * N * 16 = the words before group g, < K N / 8: int32 up to K N of 2^34
    if DOT:
        mask = live[None, :]
    else:
        mask = live[None, None, :]
    return tl.load(qw_ptr + (w_off + g * N * 16), mask=mask, other=0)


@triton.jit
def _group_fma(w, x_rows, m_mask, magic, BM: tl.constexpr, BN: tl.constexpr):
    """``(sum_k x[m, k] q[k, n] [BM, BN], rowsum(x) [BM])`` for one group on CUDA cores;
    ``w [1, 16, BN]``, ``x_rows [BM, 16, 1]`` pointers."""
    part = tl.zeros([BM, 16, BN], dtype=tl.float32)
    xs = tl.zeros([BM, 16, 1], dtype=tl.float32)
    wh = w >> 16  # nibbles 4..7 at bits 0..15 (the garbage above is masked off below)
    for i in tl.static_range(8):
        xi = tl.load(x_rows + 16 * i, mask=m_mask[:, None, None], other=0.0).to(tl.float32)
        xs += xi
        # The nibble in place, b = 4 (i % 4) <= 12: (src & 0xF << b) | 0x4B000000 read as fp32 is
        # 2^23 + q 2^b (exact: q 2^b < 2^16), minus 2^23 is q 2^b; one LOP3 and one FADD per
        # weight, no shift (extracting the nibble first added a shift and a bit-field extract
        # per weight on the INT pipe, half the FP32 rate on Hopper). x 2^-b is exact for
        # every 16-bit x (bf16's smallest bit is 2^-133: 2^-145 stays above fp32's 2^-149), so
        # x 2^-b * q 2^b = x q.
        if i < 4:
            src = w
        else:
            src = wh
        b = 4 * (i % 4)
        qf = ((src & (0xF << b)) | magic).to(tl.float32, bitcast=True) - 8388608.0
        part += (xi * (1.0 / (1 << b))) * qf  # [BM, 16, 1] x [1, 16, BN]: BM FMAs per weight
    return tl.sum(part, axis=1), tl.sum(tl.sum(xs, axis=2), axis=1)


@triton.jit
def _group_mma(w, x_rows, m_mask, BM: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr):
    """``(sum_k x[m, k] (c + q[k, n]), rowsum(x))`` for one group with tl.dot (c = 128 for bf16
    x, 1024 for fp16: the 16-bit magic number that makes ``c + q`` one OR; here a constant: in
    a register, as FP32_MAGIC is, ptxas emitted a shift and a bit-field extract per nibble)."""
    part = tl.zeros([BM, BN], dtype=tl.float32)
    xs = tl.zeros([BM], dtype=tl.float32)
    for i in tl.static_range(8):
        xi = tl.load(x_rows + 16 * i, mask=m_mask[:, None], other=0.0)  # [BM, 16]
        q = (w >> (4 * i)) & 0xF  # [16, BN]: W^T rows 16 i .. 16 i + 15 of the group, + z
        if x_rows.dtype.element_ty == tl.bfloat16:
            wq = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
        else:
            wq = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
        part += _dot(xi, wq, INTERPRET)
        xs += tl.sum(xi.to(tl.float32), axis=1)
    return part, xs


# NOTE: M, G and SPLIT_K unspecialised: one compile per config serves every shape and split
# (the bench sweeps many configs in one short run); N and the strides stay specialised (their
# divisibility by 16 lets the scale / zero loads vectorise).
@triton.jit(do_not_specialize=["M", "G", "SPLIT_K", "MAGIC"])
def w4a16_gemv_kernel(
    x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr,
    M, N, G, stride_xm, stride_os, stride_om, SPLIT_K, MAGIC,
    BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr, DEPTH: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over this split's groups of x[m, k] W^T[k, n] (fp32 when
    SPLIT_K > 1, else out's dtype), all M <= BM rows at once. Grid: (cdiv(N, BN), SPLIT_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_j = tl.arange(0, 16)
    n_mask = offs_n < N
    m_mask = offs_m < M
    per_split = tl.cdiv(G, SPLIT_K)
    g0 = pid_k * per_split
    g1 = tl.minimum(g0 + per_split, G)
    # words: contiguous along j (16 per column and group)
    if DOT:
        w_off = offs_n[None, :].to(tl.int64) * 16 + offs_j[:, None]  # [16, BN]
        x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_j[None, :]  # [BM, 16]
    else:
        w_off = offs_n[None, None, :].to(tl.int64) * 16 + offs_j[None, :, None]  # [1, 16, BN]
        x_rows = x_ptr + offs_m[:, None, None] * stride_xm + offs_j[None, :, None]  # [BM, 16, 1]
    # NOTE: the words of the next DEPTH groups are in flight while a group is computed
    wa = _load_words(qw_ptr, g0, g1, N, w_off, n_mask, DOT)
    if DEPTH == 2:
        wb = _load_words(qw_ptr, g0 + 1, g1, N, w_off, n_mask, DOT)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for g in range(g0, g1):
        w = wa
        if DEPTH == 2:
            wa = wb
            wb = _load_words(qw_ptr, g + 2, g1, N, w_off, n_mask, DOT)
        else:
            wa = _load_words(qw_ptr, g + 1, g1, N, w_off, n_mask, DOT)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)  # [BN]
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        if DOT:
            part, xs = _group_mma(w, x_rows + g * 128, m_mask, BM, BN, INTERPRET)
            if x_rows.dtype.element_ty == tl.bfloat16:
                zc = z + 128.0
            else:
                zc = z + 1024.0
        else:
            part, xs = _group_fma(w, x_rows + g * 128, m_mask, MAGIC, BM, BN)
            zc = z
        acc += (part - xs[:, None] * zc[None, :]) * s[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    _store(out, acc, m_mask[:, None] & n_mask[None, :], INTERPRET)


# ---- configurations --------------------------------------------------------------------------
# Named launch configurations, swept side by side by benchmarks/bench_awq_gemv.py (none timed
# yet). SPLIT_K is derived per shape from PROGRAMS_PER_SM (``split_for``), DOT from M
# (``gemv_config``). Reasoning for the default: BN = 128 is an 8 KB word block per group and
# program; ~4 programs per SM with the next group prefetched keep ~64 KB per SM outstanding,
# what 4.8 TB/s at ~1 us latency asks (~36 KB per SM). Registers from ptxas (``--sass`` with
# Triton 3.6, the H200's; benchmarks/results/awq_gemv_sass.json): FMA BN = 128, 4 warps: 96 at
# M = 1, 168 at M = 2, 247 at M = 4 (2 programs per SM fit), 255 at M = 8; with 8 warps ("w8")
# 72 / 121 / 171 / 244. tl.dot BN = 128: 167 (4 warps), 100 (8 warps). "bn256" (FMA, 4 warps):
# 168 at M = 1, with 8 columns per thread (x's conversion and 2^-b scaling shared by twice the
# weights).
GEMV_CONFIGS: dict[str, dict] = {
    "default": dict(BN=128, DEPTH=1, num_warps=4, num_stages=1, PROGRAMS_PER_SM=4),
    "depth2": dict(BN=128, DEPTH=2, num_warps=4, num_stages=1, PROGRAMS_PER_SM=4),
    "bn64": dict(BN=64, DEPTH=1, num_warps=4, num_stages=1, PROGRAMS_PER_SM=8),
    "w8": dict(BN=128, DEPTH=2, num_warps=8, num_stages=1, PROGRAMS_PER_SM=2),
    "bn256": dict(BN=256, DEPTH=1, num_warps=4, num_stages=1, PROGRAMS_PER_SM=2),
    "bn256_w8": dict(BN=256, DEPTH=1, num_warps=8, num_stages=1, PROGRAMS_PER_SM=2),
    "bn64_d2_p16": dict(BN=64, DEPTH=2, num_warps=4, num_stages=1, PROGRAMS_PER_SM=16),
    "stages3": dict(BN=128, DEPTH=1, num_warps=4, num_stages=3, PROGRAMS_PER_SM=4),
}
# bench_awq_gemv's time budget: ~5 compiles per config (FMA at BM = 1, 2, 4, 8 and tl.dot)
SWEPT_BY_DEFAULT = ("default", "depth2", "bn64", "w8", "bn256")
# The config and path each M takes (the one dispatch table: refill it from bench_awq_gemv's
# ``summary.best_by_shape_m``): (largest M, config name, DOT).
# By instruction counts (``python -m benchmarks.bench_awq_gemv --sass``, sm_90, Triton 3.6, the
# whole kernel per weight word of one group step): the FMA path issues ~54 at M = 1 but ~71 at
# M = 2 and ~105 at M = 4 (one FMA per row and weight, plus the x conversions), the tl.dot path
# ~65 at any M <= 16 (most of them the shuffles that move the unpacked bf16 pairs into the MMA
# operand layout). So FMAs for one row, tl.dot from two; the bench times both at M = 2, 4, 8.
CONFIG_BY_M: tuple[tuple[int, str, bool], ...] = (
    (1, "default", False),
    (MAX_M, "default", True),
)


def fma_partial_regs(m: int, name: str) -> int:
    """fp32 registers per thread of the FMA path's ``[BM, 16, BN]`` partial for config
    ``name`` at m rows. Above 64, ptxas (Triton 3.6, awq_gemv_sass.json) spilled in 4 of the 6
    cases and gave the other 2 all 255 registers; the bench skips such variants."""
    c = GEMV_CONFIGS[name]
    return max(1, triton.next_power_of_2(m)) * 16 * c["BN"] // (32 * c["num_warps"])


def split_for(n: int, k: int, bn: int, programs_per_sm: int, num_sms: int) -> int:
    """SPLIT_K giving about ``programs_per_sm * num_sms`` programs, with at least 2 groups per
    split (a split of one group has no next group to prefetch) and at most 64 splits (the fp32
    partials stay small against the weights: 64 * M * N * 4 bytes)."""
    groups = k // GROUP
    tiles = -(-n // bn)
    want = max(1, -(-programs_per_sm * num_sms // tiles))
    split = max(1, min(want, groups // 2, 64))
    # every split gets cdiv(groups, split) groups: drop splits that would be left empty
    return -(-groups // -(-groups // split))


def gemv_config(m: int, n: int, k: int, num_sms: int, name: str | None = None,
                dot: bool | None = None) -> dict:  # fmt: skip
    """The launch configuration for [m, k] x [k, n]: config ``name`` of ``GEMV_CONFIGS`` and
    path ``dot``, each taken from ``CONFIG_BY_M`` when None."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"w4a16_gemv: serves 1 <= M <= {MAX_M} rows, got M={m}")
    _, by_m_name, by_m_dot = next(row for row in CONFIG_BY_M if m <= row[0])
    name = by_m_name if name is None else name
    if name not in GEMV_CONFIGS:
        raise ValueError(f"w4a16_gemv: unknown config {name!r}; one of {', '.join(GEMV_CONFIGS)}")
    base = GEMV_CONFIGS[name]
    use_dot = by_m_dot if dot is None else dot
    bm = 16 if use_dot else max(1, triton.next_power_of_2(m))
    split = split_for(n, k, base["BN"], base["PROGRAMS_PER_SM"], num_sms)
    return {
        "BM": bm, "BN": base["BN"], "SPLIT_K": split, "DOT": use_dot, "DEPTH": base["DEPTH"],
        "num_warps": base["num_warps"], "num_stages": base["num_stages"],
    }  # fmt: skip


def check_gemv_config(m: int, cfg: dict) -> None:
    bm, bn, split, dot = cfg["BM"], cfg["BN"], cfg["SPLIT_K"], cfg["DOT"]
    ok = (
        bn % 16 == 0 and bn & (bn - 1) == 0 and bm & (bm - 1) == 0 and m <= bm <= MAX_M
        and split >= 1 and cfg.get("DEPTH", 1) in (1, 2) and (bm >= 16 if dot else bm <= 8)
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"w4a16_gemv: bad config {cfg} for M={m}: need BN a power of 2 >= 16, BM a power of "
            f"2 with M <= BM <= {MAX_M} (16 with DOT, <= {FMA_MAX_M} without), SPLIT_K >= 1, "
            "DEPTH 1 or 2"
        )


def w4a16_gemv_triton(
    x: torch.Tensor, qweight_r: torch.Tensor, zeros_r: torch.Tensor, scales_r: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ W^T -> [M, N]`` (x's dtype, M <= 16) with a repacked W4 weight; fp32
    accumulation, deterministic."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"w4a16_gemv: x must be 2-D float16 or bfloat16, got {x.dtype} {list(x.shape)}"
        )
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"w4a16_gemv: serves 1 <= M <= {MAX_M} rows, got M={m}")
    n = check_repacked("w4a16_gemv", qweight_r, zeros_r, scales_r, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or gemv_config(m, n, k, _num_sms(x.device))
    check_gemv_config(m, cfg)
    split = cfg["SPLIT_K"]
    if split == 1:
        out = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    w4a16_gemv_kernel[(triton.cdiv(n, cfg["BN"]), split)](
        x, qweight_r, zeros_r, scales_r, out, m, n, k // GROUP, x.stride(0), out.stride(0),
        out.stride(1), split, FP32_MAGIC, BM=cfg["BM"], BN=cfg["BN"], DOT=cfg["DOT"],
        DEPTH=cfg.get("DEPTH", 1), INTERPRET=_INTERPRET,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 1),
    )  # fmt: skip
    if split == 1:
        return out[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](
        out, y, m * n, split, BLOCK=1024, INTERPRET=_INTERPRET, num_warps=4
    )
    return y
