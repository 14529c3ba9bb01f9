"""DeepGEMM's block-scaled FP8 GEMMs as ``echo::`` ops: ``dg_fp8_linear`` and ``dg_moe_fp8``.

Same format and numbers as ``echo::fp8_linear`` / ``echo::moe_fp8`` (custom_ops/fp8_linear.py):
weights e4m3 ``[N, K]`` with fp32 128 x 128 block scales, activations quantised per row and 128
along K (DeepSeek's ``act_quant``), one fp32 dot per K block scaled by both scales, output bf16.
That is exactly DeepGEMM's SM90 "1D2D" recipe ``(1, 128, 128)``:
``deep_gemm.fp8_gemm_nt((x8, sfa), (w8, sfb), d)`` and the grouped
``m_grouped_fp8_gemm_nt_masked``.

Layouts (DeepGEMM reads them in place, so no conversion kernel runs per call):
- weight scales ``sfb``: the checkpoint's ``weight_scale_inv`` fp32 ``[ceil(N/128), K/128]``
  (``[E, ., .]`` stacked), contiguous: on SM90 DeepGEMM takes them as they are (``check_sf_layout``
  with the contiguity check), so the load-time "conversion" is the identity; ``weight_sf_layout``
  states it and the CPU test checks it.
- activation scales ``sfa``: ``[M, K/128]`` fp32, MN-major and TMA-aligned: strides
  ``(1, align4(M))`` (grouped: ``[G, Mg, K/128]``, strides ``(K/128 * align4(Mg), 1,
  align4(Mg))``), the layout ``get_mn_major_tma_aligned_tensor`` returns unchanged. The quantising
  kernel (``deep_gemm_gemm_kernels.py``) writes them there directly.

The MoE (masked grouped GEMM, fixed shapes: graph-safe): each (token, slot) pair gets a row of its
expert's block ``[E, Mg, .]`` (``Mg`` = T rounded up to DeepGEMM's M alignment, since a tile of
one group must not spill into the next), ranked on the device (a stable sort, no host sync);
``masked_m`` = pairs per expert. gate/up GEMM -> bf16 -> ``silu(g) * u`` rounded to bf16 and
quantised in one kernel over the live rows -> down GEMM -> bf16 -> weighted fp32 sum over the k
slots. Transient memory ~ ``E * Mg * (3 D + 5 I)`` bytes, so ``MOE_MAX_TOKENS`` caps the tokens
of a call (larger calls use the Triton kernel).

Default kernels (CPU and any device without the library): the references of ``fp8_linear`` /
``moe_fp8``. The library is imported on the first CUDA call.
"""

from __future__ import annotations

import functools

import torch

from custom_ops.backends.deep_gemm_layout import (  # noqa: F401  (re-exported for callers)
    TMA_ALIGN,
    align_up,
    empty_sfa,
    sfa_layout,
    weight_sf_layout,
)
from custom_ops.fp8 import FP8_DTYPE
from custom_ops.fp8_linear_format import BLOCK, check_fp8_linear, check_moe_fp8
from custom_ops.fp8_linear_ref import act_quant_exact, fp8_linear_ref, moe_fp8_ref
from custom_ops.moe_align import expert_rows

MOE_MAX_TOKENS = 64  # dg_moe_fp8 above this many tokens falls back to Triton (memory, above)
N_ALIGN = 64  # N a multiple of this (DeepGEMM's block_n candidates; bf16 rows 16-byte aligned)


@functools.lru_cache(maxsize=1)
def _lib():
    import deep_gemm  # the optional [kernels] extra

    return deep_gemm


def _kernels():
    from custom_ops.backends import deep_gemm_gemm_kernels

    return deep_gemm_gemm_kernels


def m_alignment() -> int:
    """Rows per group of the masked GEMM's blocks: DeepGEMM's M alignment (128 if it cannot say)."""
    try:
        return int(_lib().get_mk_alignment_for_contiguous_layout())
    except Exception:  # an older build without the helper
        return 128


def act_quant_dg_ref(x: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the quantising kernel: (e4m3 ``[M, K]``, scales ``[M, K/128]`` in the
    DeepGEMM layout), values as ``act_quant_exact``."""
    x8, s = act_quant_exact(x, ue8m0)
    return x8, sfa_layout(s)


def linear_suits(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Shapes DeepGEMM's dense FP8 GEMM runs here: bf16 x, K in 128 blocks, N in 64 columns."""
    return dtype == torch.bfloat16 and m >= 1 and k % BLOCK == 0 and n % N_ALIGN == 0


def moe_suits(t: int, d: int, inter: int, dtype: torch.dtype) -> bool:
    return (
        dtype == torch.bfloat16 and 1 <= t <= MOE_MAX_TOKENS and d % N_ALIGN == 0
        and inter % BLOCK == 0 and d % BLOCK == 0
    )  # fmt: skip


# ---- echo::dg_fp8_linear ---------------------------------------------------------------------


@torch.library.custom_op("echo::dg_fp8_linear", mutates_args=())
def dg_fp8_linear(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool
) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` through DeepGEMM's ``fp8_gemm_nt``; default kernel: the reference."""
    return fp8_linear_ref(x, w8, w_scale, ue8m0)


@dg_fp8_linear.register_kernel("cuda")
def _(x, w8, w_scale, ue8m0):
    check_fp8_linear(x, w8, w_scale)
    m, k = x.shape
    n = w8.shape[0]
    if not linear_suits(m, n, k, x.dtype):
        raise ValueError(
            f"dg_fp8_linear: DeepGEMM needs bf16 x, K % {BLOCK} == 0 and N % {N_ALIGN} == 0; got "
            f"{x.dtype} M={m} N={n} K={k}"
        )
    x8, sfa = _kernels().act_quant_dg(x, ue8m0)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    _lib().fp8_gemm_nt((x8, sfa), (w8, weight_sf_layout(w_scale)), out)
    return out


@dg_fp8_linear.register_fake
def _(x, w8, w_scale, ue8m0):  # as the reference (the CUDA kernel takes bf16 x only)
    dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    return x.new_empty((x.shape[0], w8.shape[0]), dtype=dtype)


# ---- echo::dg_moe_fp8 ------------------------------------------------------------------------


@torch.library.custom_op("echo::dg_moe_fp8", mutates_args=())
def dg_moe_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    ue8m0: bool,
) -> torch.Tensor:
    """Routed FP8 experts through DeepGEMM's masked grouped GEMM: ``x [T, D] -> fp32 [T, D]``;
    default kernel: ``moe_fp8``'s reference."""
    return moe_fp8_ref(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0)


def masked_gemm_ref(a, b, d, masked_m, expected_m: int) -> None:
    """What ``deep_gemm.m_grouped_fp8_gemm_nt_masked`` computes, in torch (the CPU stand-in of
    the tests): ``d[g, :masked_m[g]] = fp8 block GEMM of a[g] rows and b[g]`` in bf16; rows past
    ``masked_m[g]`` are left as they are. Reads the scales through their strides, as DeepGEMM."""
    (a8, sfa), (w8, ws) = a, b
    for g in range(a8.shape[0]):
        m = int(masked_m[g])
        if m == 0:
            continue
        xf = a8[g, :m].float().unflatten(-1, (-1, BLOCK)).transpose(0, 1)  # [KB, m, 128]
        wf = w8[g].float().unflatten(-1, (-1, BLOCK)).permute(1, 2, 0)  # [KB, 128, N]
        part = torch.bmm(xf, wf) * sfa[g, :m].t().unsqueeze(-1)  # [KB, m, N]
        wsn = ws[g].repeat_interleave(BLOCK, dim=0)[: w8.shape[1]].t()  # [KB, N]
        d[g, :m] = (part * wsn.unsqueeze(1)).sum(0).to(d.dtype)


def moe_pipeline(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0, gemm, mg):
    """The DeepGEMM MoE (module docstring) with ``gemm`` the masked grouped GEMM and ``mg`` rows
    per expert block; the quantising kernel is the Triton one."""
    e, inter, d = check_moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    t, k = topk_ids.shape
    K = _kernels()
    rows, masked_m = expert_rows(topk_ids, e, mg)
    src = torch.arange(t * k, device=x.device) // k  # the token of each pair
    expected_m = max(1, -(-t * k // e))  # a hint for DeepGEMM's config: mean pairs per expert
    g = e + 1  # the experts' blocks and one more, whose first row is the skipped pairs' dump
    a8 = torch.empty((g, mg, d), dtype=FP8_DTYPE, device=x.device)
    sfa = empty_sfa(g, mg, d // BLOCK, x.device)
    K.quant_rows(x, src, rows, a8.view(g * mg, d), sfa, mg, ue8m0, gated=False)
    gu = torch.empty((g, mg, 2 * inter), dtype=torch.bfloat16, device=x.device)
    gemm((a8[:e], sfa[:e]), (w13, w13_scale), gu[:e], masked_m, expected_m)
    h8 = torch.empty((g, mg, inter), dtype=FP8_DTYPE, device=x.device)
    sfh = empty_sfa(g, mg, inter // BLOCK, x.device)
    K.quant_rows(gu.view(g * mg, 2 * inter), rows, rows, h8.view(g * mg, inter), sfh, mg, ue8m0,
                 gated=True)  # fmt: skip
    y = torch.empty((g, mg, d), dtype=torch.bfloat16, device=x.device)
    y[e].zero_()  # a skipped pair reads a zero row (its weight times garbage could be NaN)
    gemm((h8[:e], sfh[:e]), (w2, w2_scale), y[:e], masked_m, expected_m)
    yp = y.view(g * mg, d).index_select(0, rows).float()  # [T * k, D], pair order
    return (yp * topk_weights.reshape(-1, 1).float()).view(t, k, d).sum(1)


@dg_moe_fp8.register_kernel("cuda")
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0):
    t = x.shape[0]
    if not moe_suits(t, w13.shape[2], w2.shape[2], x.dtype):
        raise ValueError(
            f"dg_moe_fp8: needs bf16 x, 1 <= T <= {MOE_MAX_TOKENS}, D % {N_ALIGN} == 0; got "
            f"{x.dtype} T={t} D={w13.shape[2]}"
        )
    lib = _lib()
    # upstream's name; this wheel (sgl-deep-gemm 0.1.5.post1) has fp8_m_grouped_gemm_nt_masked
    gemm = getattr(lib, "m_grouped_fp8_gemm_nt_masked", None) or lib.fp8_m_grouped_gemm_nt_masked
    mg = align_up(t, m_alignment())
    return moe_pipeline(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0, gemm, mg)


@dg_moe_fp8.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0):
    return x.new_empty(x.shape, dtype=torch.float32)


# ---- selection -------------------------------------------------------------------------------


@functools.cache
def available(device_index: int = 0) -> bool:
    """DeepGEMM imports and the device is SM90 (the fp32-scale 1D2D kernels used here); decided
    once per process, outside any traced step."""
    from custom_ops.backends.select import installed

    if not torch.cuda.is_available() or not installed("deep_gemm"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9
