"""AWQ 4-bit weights (AutoAWQ "gemm" format, docs/model_notes.md): packing, round-to-nearest
quantisation, dequantisation, and the modules that replace ``nn.Linear`` and the stacked experts.

Format for a linear with in=K, out=N and groups of 128 along K:
``qweight int32 [K, N/8]``, ``qzeros int32 [K/128, N/8]`` (same packing), ``scales fp16|bf16
[K/128, N]``; nibble i (bits 4i..4i+3) of word c holds column ``8c + AWQ_ORDER[i]``,
``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``. ``W^T[k, n] = (q[k, n] - z[k//128, n]) * s[k//128, n]``
and ``y = x @ W^T``: the checkpoint is [in, out], the transpose of ``nn.Linear.weight``.

Integration (``model/loader.py``, ``model/checkpoint.py``):
- build the model on the meta device, then ``convert_to_awq(model, config.quantization)`` swaps
  every quantised ``nn.Linear`` for ``AWQLinear`` and every stacked ``Experts`` for ``AWQExperts``;
  their parameters carry the checkpoint's names (``qweight``, ``qzeros``, ``scales``; experts
  ``w13_*``/``w2_*`` with gate then up along the packed output axis, the last one);
- after loading, ``densify_awq(model)`` turns ``kv_b_proj`` back into a bf16 ``nn.Linear``: the MLA
  absorbed decode reads its weight as W_UK / W_UV;
- the checkpoint generator writes ``awq_quantize(weight [out, in])``;
- on CUDA, ``repack_awq_model(model)`` then prepares every ``AWQLinear`` for the fast kernels
  (``custom_ops/awq_repack.py``): core torch's int4 tinygemm weight for small M and, for larger M,
  the kernel measured fastest there (``R.LARGE_M_PATH``: the pair layout of
  ``echo::w4a16_linear_p``; or the former kernel on the AutoAWQ tensors); ``AWQLinear.forward``
  dispatches by M. The routed experts take
  the pair layout (``echo::moe_w4a16_p``, the fastest MoE kernel at every measured size).
"""

from __future__ import annotations

import torch
from torch import nn

import custom_ops  # noqa: F401  (registers torch.ops.echo.w4a16_linear / moe_w4a16)
from custom_ops import awq_pairs as P
from custom_ops import awq_repack as R
from custom_ops.awq import awq_dequantize_t, awq_unpack
from custom_ops.awq_format import AWQ_ORDER, AWQ_REVERSE_ORDER, GROUP, PACK
from model.quant_config import QuantConfig

AWQ_TENSORS = ("qweight", "qzeros", "scales")  # an AutoAWQ linear's (and expert block's) tensors

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "GROUP",
    "AWQExperts",
    "AWQLinear",
    "awq_dequantize",
    "awq_dequantize_t",
    "awq_pack",
    "awq_quantize",
    "awq_unpack",
    "convert_to_awq",
    "densify_awq",
    "repack_awq_model",
    "repacked_growth",
]

DENSE_AFTER_LOAD = ("kv_b_proj",)  # AWQ in the checkpoint, dense bf16 in the model (W_UK / W_UV)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """4-bit integers ``[..., K, N]`` (0..15) -> int32 words ``[..., K, N/8]`` in AWQ order."""
    n = values.shape[-1]
    if n % PACK:
        raise ValueError(f"awq_pack: the last dim ({n}) must be a multiple of {PACK}")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(f"awq_pack: values must be an integer tensor, got {values.dtype}")
    v = values.to(torch.int64)
    if v.numel() and (v.min() < 0 or v.max() > 15):
        raise ValueError(f"awq_pack: values must lie in 0..15, got [{v.min()}, {v.max()}]")
    v = v.unflatten(-1, (n // PACK, PACK))  # [..., K, N/8, 8]
    word = torch.zeros(v.shape[:-1], dtype=torch.int64, device=v.device)
    for i, ch in enumerate(AWQ_ORDER):
        word |= v[..., ch] << (4 * i)
    # [0, 2^32) -> the int32 with the same bits (words with nibble 7 >= 8 are negative)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_quantize(
    weight: torch.Tensor, scales_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit quantisation of ``weight [out, in]`` per group of 128
    along ``in`` -> ``(qweight [in, out/8], qzeros [in/128, out/8], scales [in/128, out])``.

    The range of each group is widened to contain 0 (so the zero point is a 4-bit integer) and the
    scale is rounded *up* to ``scales_dtype``; then every element satisfies ``|w - w_hat| <= s/2``.
    """
    if weight.dim() != 2:
        raise ValueError(f"awq_quantize: weight must be 2-D [out, in], got {list(weight.shape)}")
    n, k = weight.shape
    if k % GROUP or n % PACK:
        raise ValueError(
            f"awq_quantize: need in % {GROUP} == 0 and out % {PACK} == 0, got [out={n}, in={k}]"
        )
    if scales_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"awq_quantize: scales_dtype must be float16 or bfloat16, got {scales_dtype}"
        )
    w = weight.float().t().reshape(k // GROUP, GROUP, n)  # [G, 128, N]
    wmax = w.amax(dim=1).clamp_min(0)  # [G, N]
    wmin = w.amin(dim=1).clamp_max(0)
    fi = torch.finfo(scales_dtype)
    # NOTE: divided by a device tensor, not a Python number: CUDA divides by a host scalar as a
    # multiply by its reciprocal (not correctly rounded), so GPU-quantised scales would differ in
    # the last bit from a CPU-written checkpoint's
    s = ((wmax - wmin) / torch.tensor(15.0, device=w.device)).clamp_min(fi.tiny)
    # NOTE: times (1 + eps) before round-to-nearest gives a stored scale >= s: the 16 levels cover
    # [wmin, wmax], so only the clamp of a .5 tie can touch 0 or 15 (still within s/2).
    scales = (s * (1 + fi.eps)).to(scales_dtype)  # [G, N]
    sf = scales.float()
    z = (-torch.round(wmin / sf)).clamp(0, 15)  # [G, N]
    q = (torch.round(w / sf.unsqueeze(1)) + z.unsqueeze(1)).clamp(0, 15)  # [G, 128, N]
    qweight = awq_pack(q.reshape(k, n).to(torch.int32))
    return qweight, awq_pack(z.to(torch.int32)), scales


def awq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The ``nn.Linear`` weight ``[..., out, in]`` in ``dtype`` (one rounding of the exact fp32
    values). Leading dims (experts) are kept. ``awq_dequantize_t`` gives fp32 ``[..., in, out]``."""
    return awq_dequantize_t(qweight, qzeros, scales).transpose(-1, -2).contiguous().to(dtype)


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


def _is_stacked_experts(m: nn.Module) -> bool:
    w13, w2 = getattr(m, "w13_weight", None), getattr(m, "w2_weight", None)
    return isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3


def convert_to_awq(
    model: nn.Module, quant_config: QuantConfig, scales_dtype: torch.dtype = torch.float16
) -> list[str]:
    """Swap, in place, every ``nn.Linear`` (except ``lm_head``, which AWQ checkpoints keep 16-bit)
    and every stacked experts module (``w13_weight``/``w2_weight``) whose qualified name is not
    skipped by ``quant_config.awq_skips`` for ``AWQLinear`` / ``AWQExperts`` on the same device
    (meta is fine). Returns the converted names. ``scales_dtype``: the checkpoint's scales dtype."""
    if quant_config.method != "awq":
        raise ValueError(
            f"convert_to_awq: quant_config.method is {quant_config.method!r}, not 'awq'"
        )
    done: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            # NOTE: "name." so that "mlp.gate." matches the router module "...mlp.gate" itself.
            if child_name == "lm_head" or quant_config.awq_skips(name + "."):
                continue
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(
                        f"convert_to_awq: {name} has a bias; AWQ linears here have none"
                    )
                try:
                    new: nn.Module = AWQLinear(
                        child.in_features, child.out_features, scales_dtype, child.weight.device
                    )
                except ValueError as e:  # a 16-bit module config.json did not list as such
                    raise ValueError(
                        f"convert_to_awq: {name}: {e}; if the checkpoint keeps it 16-bit, "
                        "config.json's quantization_config.modules_to_not_convert must name it "
                        f"(it names {list(quant_config.modules_to_not_convert)})"
                    ) from e
            elif _is_stacked_experts(child):
                e, two_i, d = child.w13_weight.shape
                try:
                    new = AWQExperts(e, d, two_i // 2, scales_dtype, child.w13_weight.device)
                except ValueError as err:
                    raise ValueError(f"convert_to_awq: {name}: {err}") from err
            else:
                continue
            setattr(parent, child_name, new)
            done.append(name)
    return done


def densify_awq(
    model: nn.Module,
    patterns: tuple[str, ...] = DENSE_AFTER_LOAD,
    dtype: torch.dtype = torch.bfloat16,
) -> list[str]:
    """After loading: replace each ``AWQLinear`` whose name contains one of ``patterns`` with a
    bias-free ``nn.Linear`` holding the dequantised weight in ``dtype``. Returns the names."""
    done: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, AWQLinear) or not any(p in name for p in patterns):
                continue
            dense = nn.Linear(
                child.in_features,
                child.out_features,
                bias=False,
                dtype=dtype,
                device=child.qweight.device,
            )
            dense.weight = nn.Parameter(child.dequantized_weight(dtype), requires_grad=False)
            setattr(parent, child_name, dense)
            done.append(name)
    return done


def _tinygemm_max_m(m: AWQLinear, cuda: bool | None) -> int:
    """``repack_awq_model``'s default ``tinygemm_max_m`` for ``m`` (``cuda`` None: by the
    weight's device): ``custom_ops.awq_repack.tinygemm_max_m`` of its size on CUDA, -1 elsewhere."""
    if cuda is None:
        cuda = m.qweight.device.type == "cuda"
    return R.tinygemm_max_m(m.in_features, m.out_features) if cuda else -1


def repack_awq_model(
    model: nn.Module,
    tinygemm_max_m: int | None = None,
    large_m: str | None = None,
    cuda: bool | None = None,
) -> list[str]:
    """After loading (and ``densify_awq``): ``AWQLinear.repack`` every AWQ linear of ``model``
    and ``AWQExperts.repack`` every block of routed experts. ``tinygemm_max_m``: linear calls of
    at most this many tokens use tinygemm (default ``custom_ops.awq_repack.tinygemm_max_m`` of
    the linear's size on CUDA, none elsewhere; -1 = never; ``cuda``: which of the two defaults,
    None: by the weights' device); ``large_m``: the kernel of the other calls (default
    ``R.LARGE_M_PATH``, the measured winner). Returns the names."""
    large = R.LARGE_M_PATH if large_m is None else large_m
    R.check_large_m_path(large)
    done: list[str] = []
    for name, m in list(model.named_modules()):
        try:
            if isinstance(m, AWQExperts) and not m.repacked:
                m.repack()
                done.append(name)
            if isinstance(m, AWQLinear) and not m.repacked:
                max_m = tinygemm_max_m if tinygemm_max_m is not None else _tinygemm_max_m(m, cuda)
                m.repack(max_m, large)
                done.append(name)
        except ValueError as err:  # e.g. pack_zs refusing a scale: say which module
            raise ValueError(f"repack_awq_model: {name}: {err}") from err
    for dev in {p.device for p in model.parameters() if p.device.type == "cuda"}:
        P.reserve_counters(dev)  # before any torch.compile warm-up could make them in its pool
    return done


def _nbytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def repacked_growth(model: nn.Module) -> int:
    """Bytes ``repack_awq_model`` would add to the parameters of ``model`` on a GPU (the pair
    layout's packed zero points and scales are larger than AutoAWQ's, and the small linears keep
    a tinygemm copy too): the memory plan's weights on a GPU (runtime/distributed/plan.py).
    Nothing is allocated and ``model`` is left as it is: each distinct AWQ module shape is
    repacked once as a meta stand-in (a block of experts as one expert, times their count)."""
    growth: dict[tuple, int] = {}
    total = 0
    for m in model.modules():
        if isinstance(m, AWQExperts) and not m.repacked:
            key: tuple = ("experts", m.dim, m.inter_dim, m.w13_scales.dtype)
            if key not in growth:
                one = AWQExperts(1, m.dim, m.inter_dim, m.w13_scales.dtype, "meta")
                before = _nbytes(one)
                one.repack()
                growth[key] = _nbytes(one) - before
            total += growth[key] * m.n_experts
        elif isinstance(m, AWQLinear) and not m.repacked:
            max_m = _tinygemm_max_m(m, cuda=True)
            key = ("linear", m.in_features, m.out_features, m.scales.dtype, max_m)
            if key not in growth:
                one = AWQLinear(m.in_features, m.out_features, m.scales.dtype, "meta")
                before = _nbytes(one)
                one.repack(max_m, R.LARGE_M_PATH)
                growth[key] = _nbytes(one) - before
            total += growth[key]
    return total
