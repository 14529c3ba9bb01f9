"""AWQ weights repacked at load time for core torch's int4 tinygemm (``aten._weight_int4pack_mm``,
torchao's int4 weight-only kernel), and the AWQLinear dispatch between tinygemm (small M) and the
large-M paths (the pair layout of ``awq_pairs.py`` or the former AutoAWQ kernel of ``awq.py``).

tinygemm computes ``W^T[k, n] = (q - 8) * scale + zero`` with one bf16 (scale, zero) pair per
(group, column). AWQ's ``(q - z) * s = (q - 8) * s + (8 - z) * s``, so ``scale = s`` and
``zero = (8 - z) * s``: exact in fp32, then rounded to bf16 (the checkpoint's fp16 scales lose 2
mantissa bits there; the Triton paths keep them exact). The packed tinygemm weight is
device-specific (``_convert_weight_to_int4pack`` on CUDA takes uint8 pairs, high nibble = even
k; the CPU variant takes int32 values), so it is made on the weight's own device.
"""

from __future__ import annotations

import torch

from custom_ops.awq import awq_unpack
from custom_ops.awq_format import GROUP, PACK, check_awq

TINYGEMM_INNER_K_TILES = 8  # K must be a multiple of 16 * 8 = 128: every AWQ linear is

# The served AWQLinear dispatch, from the H200 sweep of the packed (zero point, scale) layout in
# benchmarks/results/awq_pairs_zs_sweep_h200.json (CUDA-graph replays over weight copies larger
# than L2; K x N = 7168 x 4096, 16384 x 7168, 7168 x 2048, 2048 x 7168; µs, the pair kernel in
# the configuration ``p_config`` serves):
# - M = 1: tinygemm 10.9 / 35.2 / 7.3 / 6.8 against the pair kernel 10.2 / 26.9 / 8.5 / 7.6:
#   tinygemm wins on the two linears of 14.7M weights and loses on the larger two;
# - M = 16: tinygemm 35.9 / 142.0 / 20.0 / 20.6 against 12.6 / 29.6 / 10.6 / 9.0; before the
#   packed layout (awq_pairs_h200.json) tinygemm already lost at M = 4 on every shape but
#   7168 x 2048 (8.7 vs 10.9 µs); M = 2-15 were not measured with the packed layout.
# So a linear of fewer than TINYGEMM_MAX_WEIGHTS weights keeps a tinygemm copy for M = 1 beside
# the pair layout (two int4 copies, still half of bf16); a larger one keeps the pair layout only.
# benchmarks/bench_awq_pairs.py measures both; refill from its table.
TINYGEMM_MAX_M = 1
TINYGEMM_MAX_WEIGHTS = 1 << 24


def tinygemm_max_m(k: int, n: int) -> int:
    """The tinygemm calls' largest M for a CUDA linear of k x n weights (-1: none, and no
    tinygemm copy is kept)."""
    return TINYGEMM_MAX_M if k * n < TINYGEMM_MAX_WEIGHTS else -1


LARGE_M_PATH = "pairs"  # the kernel of calls above TINYGEMM_MAX_M: one of LINEAR_PATHS
LINEAR_PATHS = ("pairs", "former")


def check_large_m_path(path: str) -> None:
    if path not in LINEAR_PATHS:
        raise ValueError(f"AWQ large-M path must be one of {', '.join(LINEAR_PATHS)}; got {path!r}")


# ---- tinygemm --------------------------------------------------------------------------------


def tinygemm_pack(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ tensors -> ``(packed weight, scale_and_zero bf16 [K/128, N, 2])`` for
    ``aten._weight_int4pack_mm`` on qweight's device (CUDA or CPU)."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    check_awq("tinygemm_pack", qweight, qzeros, scales, k, n)
    q = awq_unpack(qweight).t().contiguous()  # [N, K] int32 values 0..15
    if q.device.type == "cuda":
        pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # [N, K/2], high = even k
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, TINYGEMM_INNER_K_TILES)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, TINYGEMM_INNER_K_TILES)
    s = scales.float()  # [G, N]
    zero = (8 - awq_unpack(qzeros)).float() * s  # (q - z) s = (q - 8) s + (8 - z) s
    return packed, torch.stack([s, zero], dim=-1).to(torch.bfloat16).contiguous()


def tinygemm_linear(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] bf16 @ W^T -> [M, N] bf16`` through core torch's int4 tinygemm."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"tinygemm_linear: x must be bfloat16, got {x.dtype}")
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scale_zero)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


def use_tinygemm(m: int, x_dtype: torch.dtype, max_m: int = TINYGEMM_MAX_M) -> bool:
    """The dispatch rule: tinygemm for bf16 calls of at most ``max_m`` tokens."""
    return x_dtype == torch.bfloat16 and m <= max_m
