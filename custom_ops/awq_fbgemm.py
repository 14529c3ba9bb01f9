"""AWQ weights through fbgemm-gpu-genai's int4 mixed-input GEMM (``fbgemm.bf16i4bf16_shuffled``,
CUTLASS tensor cores, bf16 activations): an anchor timed by ``benchmarks/bench_awq.py`` next to
tinygemm and the Triton kernels, not a served path (yet).

fbgemm's bf16 format, per group of 128 along K and output column n: signed int4 ``q'`` in
[-8, 7], ``W^T[k, n] = q' * scale + zero`` with bf16 (scale, zero), weights ``[N, K/2]`` int8 (two
values a byte, even k in the low nibble) pre-shuffled by ``fbgemm.preshuffle_i4``. AWQ's
``(q - z) * s = (q - 8) * s + (8 - z) * s`` maps exactly: ``q' = q - 8``, ``scale = s``,
``zero = (8 - z) * s`` (tinygemm's mapping; exact in fp32, then rounded to bf16 like it).
``fbgemm_pack_unshuffled`` (CPU-testable) builds everything but the shuffle.
"""

from __future__ import annotations

import functools
import importlib

import torch

from custom_ops.awq import awq_unpack
from custom_ops.awq_format import PACK, check_awq


@functools.cache
def fbgemm_available() -> bool:
    """fbgemm-gpu-genai imports and registers its int4 ops (on a CUDA machine)."""
    try:
        importlib.import_module("fbgemm_gpu.experimental.gen_ai")
    except Exception:  # not installed, or a build that does not load here
        return False
    return hasattr(torch.ops.fbgemm, "bf16i4bf16_shuffled")


def fbgemm_pack_unshuffled(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ tensors -> (int8 ``[N, K/2]`` packed signed nibbles, fp32 scale ``[K/128, N]``,
    fp32 zero ``[K/128, N]``), before fbgemm's shuffle and the bf16 rounding."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    check_awq("fbgemm_pack", qweight, qzeros, scales, k, n)
    q = (awq_unpack(qweight) - 8).t().contiguous().to(torch.int8)  # [N, K] in [-8, 7]
    packed = (q[:, 0::2] & 0xF) | (q[:, 1::2] << 4)  # low nibble = even k
    s = scales.float()
    return packed.contiguous(), s, (8 - awq_unpack(qzeros)).float() * s


def fbgemm_unpacked_weight_t(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """fp32 ``W^T [K, N]`` from the unshuffled format (the format's definition, for the tests)."""
    lo = (packed << 4) >> 4  # sign-extended low nibble (int8 arithmetic shift)
    hi = packed >> 4
    q = torch.stack([lo, hi], dim=-1).flatten(-2).t().float()  # [K, N]
    g = q.shape[0] // scale.shape[0]
    return q * scale.repeat_interleave(g, 0) + zero.repeat_interleave(g, 0)


def fbgemm_pack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """Load-time: the shuffled weight and bf16 (scale, zero) for ``fbgemm_linear`` (CUDA)."""
    packed, s, z = fbgemm_pack_unshuffled(qweight, qzeros, scales)
    wq, s_sh = torch.ops.fbgemm.preshuffle_i4(packed, s.to(torch.bfloat16))
    return wq, s_sh, z.to(torch.bfloat16)


def fbgemm_linear(x: torch.Tensor, wq, scale, zero) -> torch.Tensor:
    """``x [M, K] bf16 @ W^T -> [M, N] bf16``."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"fbgemm_linear: x must be bfloat16, got {x.dtype}")
    return torch.ops.fbgemm.bf16i4bf16_shuffled(x, wq, scale, zero)
