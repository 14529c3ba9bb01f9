"""The per-128 activation quantisation as Triton device functions (DeepSeek's ``act_quant``:
``amax / 448`` scales, ue8m0 rounded up to a power of two on the bits, exactly; e4m3 values,
round to nearest even), shared by the FP8 GEMM kernels (``fp8_linear_kernels.py``) and the
quantising kernel that feeds DeepGEMM (``backends/deep_gemm_gemm_kernels.py``).

NOTE: the Triton interpreter (CPU CI) rounds fp32 -> e4m3 wrongly when the rounding carries into
the next binade (124.3 -> 64 instead of 128), so under ``INTERPRET`` the value is first rounded to
the e4m3 grid by hand (a magic-number add, round to nearest even), which it then converts exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pow2_up(s):
    """The least power of two >= s (s > 0 finite, normal): the exponent bits, plus one unless
    the mantissa is zero."""
    b = s.to(tl.int32, bitcast=True)
    up = (b & 0x7F800000) + 0x00800000
    return tl.where((b & 0x007FFFFF) == 0, b, up).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v, INTERPRET: tl.constexpr):
    """fp32 ``v`` (already clamped to ±448) -> e4m3, round to nearest even."""
    if INTERPRET:
        e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # unbiased exponent of |v|
        ue = tl.maximum(e, -6) - 3  # exponent of the e4m3 ulp (subnormals below 2^-6)
        c = ((ue + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2^(ue + 23)
        v = (v + c) - c  # rounds to a multiple of 2^ue (fp32 add: nearest even)
    return v.to(tl.float8e4nv)


@triton.jit
def _quant_tile(x, UE8M0: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x [BM, 128]`` -> (e4m3 ``[BM, 128]``, fp32 row scales ``[BM]``): DeepSeek's
    ``act_quant`` of one K block (custom_ops/fp8_linear.py)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)  # [BM]
    s = tl.math.div_rn(amax, 448.0)
    if UE8M0:  # a power of two: x / s is x times 1 / s, both exact (one division a row)
        s = _pow2_up(s)
        v = x * tl.math.div_rn(1.0, s)[:, None]
    else:
        v = tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
    return _to_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0), INTERPRET), s
