"""``echo::w4a16_gemv``: the small-M (M <= 16) W4A16 linear over the repacked layout of
``awq_format.py`` (the same tensors as ``echo::w4a16_linear_r``), a split-K, memory-bound Triton
GEMV (``awq_gemv_kernels.py``, imported on the first CUDA call).

Numerics: per group of 128, ``(sum x q - z sum x) * s`` in fp32 (on the ``tl.dot`` path with an
offset c added to q and z that cancels), one rounding to x's dtype: the reference
``w4a16_linear_r_ref``'s ``x @ ((q - z) s)`` up to fp32 rounding (the tests' tolerance), not bit
for bit. Deterministic: split-K partials are summed in a
fixed order by a second launch, no atomics.

Dispatch: ``GEMV_MAX_M`` is the one switch. ``use_gemv(m, dtype)`` says whether a call of m rows
should take this op; at 0 (now) no call does, because the kernel has not been timed on the H200
yet: ``python -m benchmarks.bench_awq_gemv --out $OUT/awq_gemv_h200.json`` measures it against
bf16, tinygemm and the served path, and the lead sets ``GEMV_MAX_M`` (and the config name, see
``awq_gemv_kernels.GEMV_CONFIGS``) from that run. A caller holding the repacked tensors then
routes ``m <= GEMV_MAX_M`` here.
"""

from __future__ import annotations

import torch

from custom_ops.awq_repack import w4a16_linear_r_ref

GEMV_MAX_M = 0  # calls of at most this many rows take echo::w4a16_gemv (0: none; at most 16)
GEMV_LIMIT = 16  # the kernel's own limit (awq_gemv_kernels.MAX_M, not imported: Triton is lazy)


def _triton():
    """The Triton kernel, imported on the first CUDA call (not when the op registers)."""
    from custom_ops import awq_gemv_kernels

    return awq_gemv_kernels


def use_gemv(m: int, x_dtype: torch.dtype, max_m: int = GEMV_MAX_M) -> bool:
    """The dispatch rule: the GEMV for 16-bit calls of at most ``max_m`` (<= 16) rows."""
    if not 0 <= max_m <= GEMV_LIMIT:
        raise ValueError(f"w4a16_gemv: max_m must be in [0, {GEMV_LIMIT}], got {max_m}")
    return x_dtype in (torch.float16, torch.bfloat16) and 1 <= m <= max_m


def w4a16_gemv_ref(
    x: torch.Tensor, qweight_r: torch.Tensor, zeros_r: torch.Tensor, scales_r: torch.Tensor
) -> torch.Tensor:
    """Reference: ``w4a16_linear_r_ref`` (fp32 dequantise, then matmul), for M <= 16 rows."""
    if x.dim() == 2 and not 1 <= x.shape[0] <= GEMV_LIMIT:
        raise ValueError(f"w4a16_gemv: serves 1 <= M <= {GEMV_LIMIT} rows, got M={x.shape[0]}")
    return w4a16_linear_r_ref(x, qweight_r, zeros_r, scales_r)


@torch.library.custom_op("echo::w4a16_gemv", mutates_args=())
def w4a16_gemv(
    x: torch.Tensor, qweight_r: torch.Tensor, zeros_r: torch.Tensor, scales_r: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` (M <= 16) with a repacked W4 weight; the reference by
    default, the Triton GEMV on CUDA."""
    return w4a16_gemv_ref(x, qweight_r, zeros_r, scales_r)


@w4a16_gemv.register_kernel("cuda")
def _(x, qweight_r, zeros_r, scales_r):
    return _triton().w4a16_gemv_triton(x, qweight_r, zeros_r, scales_r)


@w4a16_gemv.register_fake
def _(x, qweight_r, zeros_r, scales_r):
    return x.new_empty((x.shape[0], qweight_r.shape[1]))
