"""The pair layout's dequantisation steps (``awq_format.py``), shared by the W4A16 linear
(``awq_pairs_kernels``, whose module docstring explains the steps and ``MODE``) and the fused MoE
(``awq_pairs_moe``): a pair of weights from its word, a group's slices and their MMAs."""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.awq_kernels import _round16


@triton.jit
def _pair(w, zz, s: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr, ss=None,
          SCALED: tl.constexpr = False):  # fmt: skip
    """``(q - z)`` of the nibbles at bits ``4 s`` (lo) and ``16 + 4 s`` (hi) of each word ``w``
    (int32 [R, C]); ``zz`` is ``(c + z) * 0x10001`` (the 16-bit pair ``(c + z, c + z)``, c the
    magic number). Returns ``(lo, hi)``, 16-bit (fp32 under MODE 2). SCALED: ``(q - z) * s``
    instead, rounded to 16 bits once (``ss``: the 16-bit pair ``(s, s)`` of the group's scale in
    x's dtype, ``_ss``); one more instruction per pair, and W is rounded to x's dtype."""
    if MODE == 0:
        dt: tl.constexpr = tl.float16 if FP16 else tl.bfloat16
        op: tl.constexpr = "f16x2" if FP16 else "bf16x2"
        # bf16, SCALED: "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA;
        # sub.rn.bf16x2 t, t, $3; mul.rn.bf16x2 t, t, $4; mov.b32 {$0, $1}, t; }"
        asm: tl.constexpr = (
            "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, "
            + ("0x64006400" if FP16 else "0x43004300") + ", 0xEA; sub.rn." + op + " t, t, $3; "
            + ("mul.rn." + op + " t, t, $4; " if SCALED else "") + "mov.b32 {$0, $1}, t; }"
        )  # fmt: skip
        args = [w >> (4 * s), zz, ss] if SCALED else [w >> (4 * s), zz]
        lo, hi = tl.inline_asm_elementwise(
            asm, "=h,=h,r,r,r" if SCALED else "=h,=h,r,r", args, dtype=(dt.value, dt.value),
            is_pure=True, pack=1,
        )  # fmt: skip
    elif MODE == 1:
        dt = tl.float16 if FP16 else tl.bfloat16
        magic = 0x6400 if FP16 else 0x4300
        c = (zz & 0xFFFF).to(tl.int16).to(dt, bitcast=True)  # c + z, exact
        lo = ((((w >> (4 * s)) & 0xF) | magic).to(tl.int16).to(dt, bitcast=True)) - c
        hi = ((((w >> (16 + 4 * s)) & 0xF) | magic).to(tl.int16).to(dt, bitcast=True)) - c
        if SCALED:
            sc = (ss & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
            lo = (lo.to(tl.float32) * sc.to(tl.float32)).to(dt)  # exact product, one rounding
            hi = (hi.to(tl.float32) * sc.to(tl.float32)).to(dt)
    else:
        dt = tl.float16 if FP16 else tl.bfloat16
        c = ((zz & 0xFFFF) - (0x6400 if FP16 else 0x4300)).to(tl.float32)  # z
        lo = ((w >> (4 * s)) & 0xF).to(tl.float32) - c
        hi = ((w >> (16 + 4 * s)) & 0xF).to(tl.float32) - c
        if SCALED:  # the interpreter's fp32 -> bf16 truncates: _round16 rounds to nearest
            sc = (ss & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
            lo = _round16(lo * sc, dt, True)
            hi = _round16(hi * sc, dt, True)
    return lo, hi


@triton.jit
def _group_part(part, w, zz, x_base, t_mask, FP16: tl.constexpr, MODE: tl.constexpr, ss=None,
                SCALED: tl.constexpr = False, GROUP_DOT: tl.constexpr = False,
                xg=None):  # fmt: skip
    """``part [BN, BT] += W_g [BN, 128] @ x_g^T [128, BT]`` for one group: ``w [BN, 16]`` its
    words, ``x_base [1, BT]`` pointers to x[token, group start]. SCALED: W_g carries the group's
    scale (``_pair``). By default four MMAs of 32 K rows, each waited for before the next
    slice's weights are formed; GROUP_DOT: the group's 128 K rows as one operand
    (``_group_tile``), one MMA and one wait a group."""
    if GROUP_DOT:
        if xg is None:
            xg = tl.load(x_base + tl.arange(0, 128)[:, None], mask=t_mask[None, :], other=0.0)
        a = _group_tile(w, zz, ss, FP16, MODE, SCALED)
        if MODE == 2:
            part = tl.dot(a, xg.to(tl.float32), part)
        else:
            part = tl.dot(a, xg, part)
    else:
        x_cols = x_base + tl.arange(0, 32)[:, None]  # [32, BT]
        for s in tl.static_range(4):
            xs = tl.load(x_cols + 32 * s, mask=t_mask[None, :], other=0.0)  # [32, BT]
            a = _slice(w, zz, ss, s, FP16, MODE, SCALED)
            if MODE == 2:
                part = tl.dot(a, xs.to(tl.float32), part)
            else:
                part = tl.dot(a, xs, part)
    return part


@triton.jit
def _slice(w, zz, ss, s: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr,
           SCALED: tl.constexpr):  # fmt: skip
    """``[BN, 32]``: K rows ``32 s .. 32 s + 31`` of the group, in K order."""
    lo, hi = _pair(w, zz, s, FP16, MODE, ss, SCALED)
    return tl.reshape(tl.join(lo, hi), [w.shape[0], 32])  # column 2 p + h = K row 32 s + 2 p + h


@triton.jit
def _group_tile(w, zz, ss, FP16: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr):
    """``[BN, 128]``: the whole group's weights in K order, so one MMA takes the group. ``join``
    stacks along a new last axis: ``[BN, 32, 2, 2]`` holds slice ``s_lo + 2 s_hi`` at
    ``[:, c, s_lo, s_hi]``, and the permute puts the slice index above the column (registers
    relabelled: in the sm_90 code the tile is the wgmma's register operand with no shared-memory
    round trip)."""
    s0, s1 = _slice(w, zz, ss, 0, FP16, MODE, SCALED), _slice(w, zz, ss, 1, FP16, MODE, SCALED)
    s2, s3 = _slice(w, zz, ss, 2, FP16, MODE, SCALED), _slice(w, zz, ss, 3, FP16, MODE, SCALED)
    t = tl.join(tl.join(s0, s1), tl.join(s2, s3))
    return tl.reshape(tl.permute(t, (0, 3, 2, 1)), [w.shape[0], 128])


@triton.jit
def _zz(zs, FP16: tl.constexpr):
    """The 16-bit pair ``(c + z, c + z)`` of the zero points in ``zs [BN]`` (the ``zs_p`` words:
    z in bits 0..7) as int32 [BN, 16] (broadcast along the words)."""
    zz = ((zs & 0xFF) + (0x6400 if FP16 else 0x4300)) * 0x10001
    return zz[:, None] + tl.zeros([zs.shape[0], 16], dtype=tl.int32)


@triton.jit
def _scale(zs):
    """The scales in ``zs [BN]`` (fp16 in bits 16..31), as fp32."""
    return (zs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ss(zs, FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """The 16-bit pair ``(s, s)`` of the scales in ``zs [BN]``, rounded to x's dtype, as int32
    [BN, 16]."""
    dt = tl.float16 if FP16 else tl.bfloat16
    s = _round16(_scale(zs), dt, INTERPRET).to(dt)  # exact: already a dt value
    bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (bits * 0x10001)[:, None] + tl.zeros([zs.shape[0], 16], dtype=tl.int32)
