"""AWQ weights repacked at load time for fast W4A16 kernels: ``echo::w4a16_linear_r`` (the
repacked "k-major" layout of ``awq_format.py``, Triton kernel in ``awq_repack_kernels.py``) and
the core-torch int4 tinygemm (``aten._weight_int4pack_mm``, torchao's int4 weight-only kernel),
with the small-M dispatch between them.

tinygemm computes ``W^T[k, n] = (q - 8) * scale + zero`` with one bf16 (scale, zero) pair per
(group, column). AWQ's ``(q - z) * s = (q - 8) * s + (8 - z) * s``, so ``scale = s`` and
``zero = (8 - z) * s``: exact in fp32, then rounded to bf16 (the checkpoint's fp16 scales lose 2
mantissa bits there; the Triton path keeps them exact). The packed tinygemm weight is
device-specific (``_convert_weight_to_int4pack`` on CUDA takes uint8 pairs, high nibble = even
k; the CPU variant takes int32 values), so it is made on the weight's own device.
"""

from __future__ import annotations

import torch

from custom_ops.awq import _moe_ref, awq_unpack
from custom_ops.awq_format import GROUP, PACK, WORDS, check_awq, check_repacked

TINYGEMM_INNER_K_TILES = 8  # K must be a multiple of 16 * 8 = 128: every AWQ linear is

# The served AWQLinear dispatch, from the H200 run in benchmarks/results/awq_pairs_h200.json (CUDA-
# graph replays over weight copies larger than L2; K x N = 7168 x 4096, 16384 x 7168, 7168 x 2048,
# 2048 x 7168; µs, the pair kernel's best launch configuration, which ``p_config`` now returns):
# - M = 1: tinygemm 10.8 / 34.3 / 7.3 / 6.9 against the pair kernel 13.5 / 31.5 / 11.3 / 9.3 (the
#   four shapes together 59.3 vs 65.6 µs);
# - M = 4: tinygemm 14.9 / 51.5 / 9.1 / 9.4 against 13.5 / 31.4 / 11.4 / 9.4 (84.9 vs 65.7);
# - M = 8 .. 128: the pair kernel beats tinygemm, the former and the repacked kernel on every
#   shape (M = 128: 29.9 / 104.2 / 19.1 / 19.4 against the former 39.3 / 152.9 / 23.8 / 25.3);
# - M = 2, 3 were not measured: tinygemm takes M = 1 only.
# So a linear keeps the tinygemm copy and the pair layout (two int4 copies, still half of bf16).
# benchmarks/bench_awq_pairs.py measures both; refill from its table.
TINYGEMM_MAX_M = 1
LARGE_M_PATH = "pairs"  # the kernel of calls above TINYGEMM_MAX_M: one of LINEAR_PATHS
LINEAR_PATHS = ("pairs", "former", "repacked")


def check_large_m_path(path: str) -> None:
    if path not in LINEAR_PATHS:
        raise ValueError(f"AWQ large-M path must be one of {', '.join(LINEAR_PATHS)}; got {path!r}")


def _triton():
    from custom_ops import awq_repack_kernels

    return awq_repack_kernels


# ---- repacking -------------------------------------------------------------------------------


def repack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ ``(qweight [K, N/8], qzeros [K/128, N/8], scales [K/128, N])`` -> the repacked
    ``(qweight_r int32 [K/128, N, 16], zeros_r uint8 [K/128, N], scales_r [K/128, N])``."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    check_awq("repack_awq", qweight, qzeros, scales, k, n)
    g = k // GROUP
    q = awq_unpack(qweight).to(torch.int64)  # [K, N], k = 128 g + 16 i + j
    q = q.view(g, PACK, WORDS, n).permute(0, 3, 2, 1)  # [G, N, 16 (j), 8 (i)]
    shifts = 4 * torch.arange(PACK, device=q.device, dtype=torch.int64)
    word = (q << shifts).sum(-1)  # [G, N, 16] in [0, 2^32)
    qweight_r = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()
    zeros_r = awq_unpack(qzeros).to(torch.uint8).contiguous()  # [G, N]
    return qweight_r, zeros_r, scales.contiguous()


def unpack_repacked(qweight_r: torch.Tensor) -> torch.Tensor:
    """int32 ``[G, N, 16]`` -> the 4-bit values ``q [K, N]`` (int32), undoing ``repack_awq``."""
    g, n, _ = qweight_r.shape
    shifts = 4 * torch.arange(PACK, device=qweight_r.device, dtype=torch.int32)
    # NOTE: >> is arithmetic on negative words; & 0xF keeps the nibble.
    q = (qweight_r.unsqueeze(-1) >> shifts) & 0xF  # [G, N, 16 (j), 8 (i)]
    return q.permute(0, 3, 2, 1).reshape(g * GROUP, n)


def dequantize_repacked_t(
    qweight_r: torch.Tensor, zeros_r: torch.Tensor, scales_r: torch.Tensor
) -> torch.Tensor:
    """fp32 ``W^T [K, N]`` of a repacked weight (exact: small integers times a 16-bit scale)."""
    q = unpack_repacked(qweight_r)
    z = zeros_r.to(torch.int32).repeat_interleave(GROUP, dim=0)
    return (q - z).float() * scales_r.float().repeat_interleave(GROUP, dim=0)


# ---- echo::w4a16_linear_r --------------------------------------------------------------------


def w4a16_linear_r_ref(
    x: torch.Tensor, qweight_r: torch.Tensor, zeros_r: torch.Tensor, scales_r: torch.Tensor
) -> torch.Tensor:
    """Reference: ``(x.float() @ W^T).to(x.dtype)``; the same numbers as ``w4a16_linear_ref`` on
    the AutoAWQ tensors it was repacked from."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            "w4a16_linear_r: x must be a 2-D float16 or bfloat16 tensor, "
            f"got {x.dtype} {list(x.shape)}"
        )
    check_repacked("w4a16_linear_r", qweight_r, zeros_r, scales_r, x.shape[1])
    return (x.float() @ dequantize_repacked_t(qweight_r, zeros_r, scales_r)).to(x.dtype)


@torch.library.custom_op("echo::w4a16_linear_r", mutates_args=())
def w4a16_linear_r(
    x: torch.Tensor, qweight_r: torch.Tensor, zeros_r: torch.Tensor, scales_r: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` with a repacked W4 weight; the reference by default, Triton
    on CUDA."""
    return w4a16_linear_r_ref(x, qweight_r, zeros_r, scales_r)


@w4a16_linear_r.register_kernel("cuda")
def _(x, qweight_r, zeros_r, scales_r):
    return _triton().w4a16_linear_r_triton(x, qweight_r, zeros_r, scales_r)


@w4a16_linear_r.register_fake
def _(x, qweight_r, zeros_r, scales_r):
    return x.new_empty((x.shape[0], qweight_r.shape[1]))


# ---- echo::moe_w4a16_r ----------------------------------------------------------------------


def repack_awq_experts(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked AutoAWQ experts ``[E, K, N/8]``, ``[E, K/128, N/8]``, ``[E, K/128, N]`` ->
    ``(qweight_r [E, K/128, N, 16], zeros_r [E, K/128, N], scales_r [E, K/128, N])``."""
    if qweight.dim() != 3:
        raise ValueError(
            f"repack_awq_experts: qweight must be [E, K, N/8], got {list(qweight.shape)}"
        )
    parts = [repack_awq(qweight[e], qzeros[e], scales[e]) for e in range(qweight.shape[0])]
    return tuple(torch.stack(list(t)) for t in zip(*parts, strict=True))  # type: ignore[return-value]


def _dequantize_experts_t(qw: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if qw.dim() != 4 or z.dim() != 3 or s.dim() != 3:
        raise ValueError(
            f"moe_w4a16_r: need qweight_r [E, K/128, N, 16], zeros_r/scales_r [E, K/128, N], got "
            f"{list(qw.shape)}, {list(z.shape)}, {list(s.shape)}"
        )
    return torch.stack([dequantize_repacked_t(qw[e], z[e], s[e]) for e in range(qw.shape[0])])


def moe_w4a16_r_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight_r: torch.Tensor,
    w13_zeros_r: torch.Tensor,
    w13_scales_r: torch.Tensor,
    w2_qweight_r: torch.Tensor,
    w2_zeros_r: torch.Tensor,
    w2_scales_r: torch.Tensor,
) -> torch.Tensor:
    """Reference for ``echo::moe_w4a16_r``: the numerics of ``moe_w4a16_ref`` (the same fp32
    weights, so the same numbers as on the AutoAWQ tensors the experts were repacked from)."""
    w13_t = _dequantize_experts_t(w13_qweight_r, w13_zeros_r, w13_scales_r)  # [E, D, 2I]
    w2_t = _dequantize_experts_t(w2_qweight_r, w2_zeros_r, w2_scales_r)  # [E, I, D]
    if w13_t.shape[1] != x.shape[1] or w2_t.shape[2] != x.shape[1]:
        raise ValueError(
            f"moe_w4a16_r: x has D={x.shape[1]}, weights give {w13_t.shape[1]} / {w2_t.shape[2]}"
        )
    return _moe_ref(x, topk_ids, topk_weights, w13_t, w2_t)


@torch.library.custom_op("echo::moe_w4a16_r", mutates_args=())
def moe_w4a16_r(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight_r: torch.Tensor,
    w13_zeros_r: torch.Tensor,
    w13_scales_r: torch.Tensor,
    w2_qweight_r: torch.Tensor,
    w2_zeros_r: torch.Tensor,
    w2_scales_r: torch.Tensor,
) -> torch.Tensor:
    """Routed experts over repacked W4 weights: ``x [T, D] -> fp32 [T, D]``, as
    ``echo::moe_w4a16``; the reference by default, Triton on CUDA (gate and up fused)."""
    w = (w13_qweight_r, w13_zeros_r, w13_scales_r, w2_qweight_r, w2_zeros_r, w2_scales_r)
    return moe_w4a16_r_ref(x, topk_ids, topk_weights, *w)


@moe_w4a16_r.register_kernel("cuda")
def _(x, topk_ids, topk_weights, w13_qweight_r, w13_zeros_r, w13_scales_r, w2_qweight_r,
      w2_zeros_r, w2_scales_r):  # fmt: skip
    w = (w13_qweight_r, w13_zeros_r, w13_scales_r, w2_qweight_r, w2_zeros_r, w2_scales_r)
    return _triton().moe_w4a16_r_triton(x, topk_ids, topk_weights, *w)


@moe_w4a16_r.register_fake
def _(x, topk_ids, topk_weights, w13_qweight_r, w13_zeros_r, w13_scales_r, w2_qweight_r,
      w2_zeros_r, w2_scales_r):  # fmt: skip
    return x.new_empty(x.shape, dtype=torch.float32)


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
