"""The modules that replace ``nn.Linear`` and the stacked experts in an AWQ model: ``AWQLinear``
and ``AWQExperts`` (AutoAWQ "gemm" tensors, model/awq_quant.py; after ``repack`` on CUDA the
layouts of the fast kernels, ``custom_ops/awq_repack.py`` and ``custom_ops/awq_pairs.py``).
``AWQLinear.forward`` dispatches by M: core torch's int4 tinygemm weight for small M and, for
larger M, the kernel measured fastest there (``R.LARGE_M_PATH``: the pair layout of
``echo::w4a16_linear_p``; or the former kernel on the AutoAWQ tensors). The routed experts take
the pair layout (``echo::moe_w4a16_p``, the fastest MoE kernel at every measured size). Which
modules are swapped, and the passes after loading, are in model/awq_convert.py.
"""

from __future__ import annotations

import torch
from torch import nn

import custom_ops  # noqa: F401  (registers torch.ops.echo.w4a16_linear / moe_w4a16)
from custom_ops import awq_pairs as P
from custom_ops import awq_repack as R
from custom_ops.awq_format import GROUP, PACK
from model.awq_quant import awq_dequantize, awq_quantize

AWQ_TENSORS = ("qweight", "qzeros", "scales")  # an AutoAWQ linear's (and expert block's) tensors


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class AWQLinear(nn.Module):
    """``y = x @ W^T`` with an AWQ weight (no bias); x bf16/fp16 ``[..., in]`` -> ``[..., out]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scales_dtype: torch.dtype = torch.float16,
        device=None,
    ):
        super().__init__()
        if in_features % GROUP or out_features % PACK:
            raise ValueError(
                f"AWQLinear: need in_features % {GROUP} == 0 and out_features % "
                f"{PACK} == 0, got in={in_features}, out={out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        k, n = in_features, out_features
        self.qweight = _param((k, n // PACK), torch.int32, device)
        self.qzeros = _param((k // GROUP, n // PACK), torch.int32, device)
        self.scales = _param((k // GROUP, n), scales_dtype, device)

    repacked = False  # set by repack(): the load-time layouts are made
    tinygemm_max_m = -1  # calls of at most this many tokens go to tinygemm (repacked only)
    large_m = "former"  # the kernel of the other calls after repack(): R.LINEAR_PATHS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.repacked and R.use_tinygemm(x2.shape[0], x2.dtype, self.tinygemm_max_m):
            y = R.tinygemm_linear(x2, self.tg_weight, self.tg_scale_zero)
        elif self.repacked and self.large_m == "pairs":
            y = torch.ops.echo.w4a16_linear_p(x2, self.qweight_p, self.zs_p)
        else:
            y = torch.ops.echo.w4a16_linear(x2, self.qweight, self.qzeros, self.scales)
        return y.view(*x.shape[:-1], self.out_features)

    def repack(self, tinygemm_max_m: int = -1, large_m: str = "pairs") -> None:
        """Load-time layouts. ``large_m="pairs"``: replace ``qweight/qzeros/scales`` by the pair
        layout ``qweight_p/zs_p`` (``echo::w4a16_linear_p``, the measured winner above
        tinygemm's M); ``"former"``: keep them (``echo::w4a16_linear``). If ``tinygemm_max_m >= 1``
        also keep the tinygemm weight ``tg_weight/tg_scale_zero`` for bf16 calls of at most that
        many tokens (another int4 copy: the two layouts together are still half of bf16)."""
        if self.repacked:
            raise ValueError("AWQLinear.repack: already repacked")
        R.check_large_m_path(large_m)
        with torch.no_grad():
            parts = None
            if large_m == "pairs":
                parts = P.pair_awq(self.qweight, self.qzeros, self.scales)
            tg = None
            if tinygemm_max_m >= 1:
                tg = R.tinygemm_pack(self.qweight, self.qzeros, self.scales)
        if parts is not None:
            del self.qweight, self.qzeros, self.scales
            for name, t in zip(("qweight_p", "zs_p"), parts, strict=True):
                setattr(self, name, nn.Parameter(t, requires_grad=False))
        self.large_m = large_m
        if tg is not None:
            self.tg_weight = nn.Parameter(tg[0], requires_grad=False)
            self.tg_scale_zero = nn.Parameter(tg[1], requires_grad=False)
        self.tinygemm_max_m = tinygemm_max_m if tg is not None else -1
        self.repacked = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, scales_dtype: torch.dtype = torch.float16) -> AWQLinear:
        """Quantise a dense linear (round to nearest), e.g. for tests and benchmarks."""
        if linear.bias is not None:
            raise ValueError("AWQLinear.from_linear: linears with a bias are not supported")
        m = cls(linear.in_features, linear.out_features, scales_dtype, linear.weight.device)
        with torch.no_grad():
            for p, t in zip(
                (m.qweight, m.qzeros, m.scales),
                awq_quantize(linear.weight, scales_dtype),
                strict=True,
            ):
                p.copy_(t)
        return m

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The ``nn.Linear`` weight ``[out, in]`` this module computes with (the Triton path's)."""
        if self.repacked and self.large_m == "pairs":
            wt = P.dequantize_pairs_t(self.qweight_p, self.zs_p)
            return wt.t().contiguous().to(dtype)
        return awq_dequantize(self.qweight, self.qzeros, self.scales, dtype)

    def extra_repr(self) -> str:
        layout = (
            f", {self.large_m} kernel, tinygemm up to M={self.tinygemm_max_m}"
            if self.repacked
            else ""
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"w4a16 g{GROUP}{layout}"
        )


class AWQExperts(nn.Module):
    """The routed experts with AWQ weights, a drop-in for ``model.moe.Experts``.

    ``w13_qweight [E, D, 2I/8]``, ``w13_qzeros [E, D/128, 2I/8]``, ``w13_scales [E, D/128, 2I]``
    (gate columns then up columns), ``w2_qweight [E, I, D/8]``, ``w2_qzeros [E, I/128, D/8]``,
    ``w2_scales [E, I/128, D]``. ``forward(x [T, D], topk_ids [T, k], topk_weights [T, k])`` ->
    fp32 ``[T, D] = sum_j w[t, j] * down(silu(gate(x)) * up(x))`` through ``echo::moe_w4a16``.
    """

    def __init__(
        self,
        n_experts: int,
        dim: int,
        inter_dim: int,
        scales_dtype: torch.dtype = torch.float16,
        device=None,
    ):
        super().__init__()
        if dim % GROUP or inter_dim % GROUP:
            raise ValueError(
                f"AWQExperts: dim ({dim}) and inter_dim ({inter_dim}) must be multiples of {GROUP}"
            )
        self.n_experts, self.dim, self.inter_dim = n_experts, dim, inter_dim
        e, d, i = n_experts, dim, inter_dim
        self.w13_qweight = _param((e, d, 2 * i // PACK), torch.int32, device)
        self.w13_qzeros = _param((e, d // GROUP, 2 * i // PACK), torch.int32, device)
        self.w13_scales = _param((e, d // GROUP, 2 * i), scales_dtype, device)
        self.w2_qweight = _param((e, i, d // PACK), torch.int32, device)
        self.w2_qzeros = _param((e, i // GROUP, d // PACK), torch.int32, device)
        self.w2_scales = _param((e, i // GROUP, d), scales_dtype, device)

    repacked = False  # set by repack()

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.repacked:
            return torch.ops.echo.moe_w4a16_p(
                x,
                topk_ids,
                topk_weights,
                self.w13_qweight_p,
                self.w13_zs_p,
                self.w2_qweight_p,
                self.w2_zs_p,
            )
        return torch.ops.echo.moe_w4a16(
            x,
            topk_ids,
            topk_weights,
            self.w13_qweight,
            self.w13_qzeros,
            self.w13_scales,
            self.w2_qweight,
            self.w2_qzeros,
            self.w2_scales,
        )

    def repack(self) -> None:
        """Load-time: replace the AutoAWQ ``w13_*``/``w2_*`` tensors by the pair layout
        ``w13_qweight_p``, ``w13_zs_p`` (``[E, D/128, 2I(, 16)]``, ``[E, D/128, 2I]``) and the
        same for ``w2`` (``echo::moe_w4a16_p``: gate and up fused)."""
        if self.repacked:
            raise ValueError("AWQExperts.repack: already repacked")
        with torch.no_grad():  # both first: a refused weight leaves the module as it was
            parts = {
                pre: P.pair_awq_experts(*(getattr(self, f"{pre}_{s}") for s in AWQ_TENSORS))
                for pre in ("w13", "w2")
            }
        for pre, layout in parts.items():
            for suffix in AWQ_TENSORS:
                delattr(self, f"{pre}_{suffix}")
            for suffix, t in zip(("qweight_p", "zs_p"), layout, strict=True):
                setattr(self, f"{pre}_{suffix}", nn.Parameter(t, requires_grad=False))
        self.repacked = True

    @classmethod
    def from_dense(
        cls,
        w13_weight: torch.Tensor,
        w2_weight: torch.Tensor,
        scales_dtype: torch.dtype = torch.float16,
    ) -> AWQExperts:
        """Quantise stacked dense experts ``w13_weight [E, 2I, D]``, ``w2_weight [E, D, I]``."""
        e, two_i, d = w13_weight.shape
        m = cls(e, d, two_i // 2, scales_dtype, w13_weight.device)
        with torch.no_grad():
            for j in range(e):
                for pre, w in (("w13", w13_weight[j]), ("w2", w2_weight[j])):
                    qw, qz, s = awq_quantize(w, scales_dtype)
                    getattr(m, f"{pre}_qweight")[j].copy_(qw)
                    getattr(m, f"{pre}_qzeros")[j].copy_(qz)
                    getattr(m, f"{pre}_scales")[j].copy_(s)
        return m

    def dequantized_weights(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
        """``(w13_weight [E, 2I, D], w2_weight [E, D, I])`` as ``model.moe.Experts`` holds them."""
        if self.repacked:
            return tuple(
                P.dequantize_pairs_experts_t(
                    getattr(self, f"{pre}_qweight_p"), getattr(self, f"{pre}_zs_p")
                )
                .transpose(1, 2)
                .contiguous()
                .to(dtype)
                for pre in ("w13", "w2")
            )
        return (
            awq_dequantize(self.w13_qweight, self.w13_qzeros, self.w13_scales, dtype),
            awq_dequantize(self.w2_qweight, self.w2_qzeros, self.w2_scales, dtype),
        )

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, dim={self.dim}, inter_dim={self.inter_dim}, "
            f"w4a16 g{GROUP}"
        )
