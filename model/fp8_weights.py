"""FP8 block-quantised weights, the official DeepSeek-V3.2 checkpoint format (docs/model_notes.md).

A linear ``X`` with weight ``[out, in]`` is stored as ``X.weight`` (float8_e4m3fn, ``[out, in]``)
and ``X.weight_scale_inv`` (fp32, ``[ceil(out/128), ceil(in/128)]``), one scale per 128x128 block:
``W[i, j] = W8[i, j] * scale_inv[i // 128, j // 128]``. A ragged last block (e.g. the 576 rows of
``kv_a_proj_with_mqa``) is zero-padded to 128 when its scale is computed, i.e. its scale comes from
the real elements only.
"""

from __future__ import annotations

import math

import torch

from custom_ops.fp8 import FP8_DTYPE, FP8_MAX
from model.config import ModelConfig

BLOCK = 128
# how an FP8 checkpoint's weights are served (``resolve_fp8_weights``): the choices, default first
FP8_WEIGHTS = ("auto", "bf16", "fp8")


def resolve_fp8_weights(fp8_weights: str, config: ModelConfig, name: str = "the checkpoint") -> str:
    """The one rule for serving an FP8 checkpoint's weights: ``"fp8"`` (kept FP8, one byte a
    weight, ``FP8Linear`` / ``FP8Experts``) or ``"bf16"`` (dequantised at load: the reference the
    accuracy tests compare against). ``"auto"``, the default everywhere, keeps an FP8
    checkpoint FP8, as vLLM serves it, on every device (on the CPU the tiny model's generate is
    ~11% slower kept FP8: not enough for a second rule), and is ``"bf16"`` for any other
    checkpoint (nothing to dequantise; AWQ is read as AWQ whatever this says). An explicit
    ``"fp8"`` on a checkpoint that is not FP8 (``name``) and any other value are a ValueError."""
    if fp8_weights not in FP8_WEIGHTS:
        raise ValueError(
            f"fp8_weights must be one of {', '.join(map(repr, FP8_WEIGHTS))}, got {fp8_weights!r}"
        )
    is_fp8 = config.quantization is not None and config.quantization.method == "fp8"
    if fp8_weights == "fp8" and not is_fp8:
        raise ValueError(
            f"fp8_weights='fp8' needs an FP8 checkpoint; {name} is not one (its config.json has "
            "no fp8 quantization_config)"
        )
    if fp8_weights == "auto":
        return "fp8" if is_fp8 else "bf16"
    return fp8_weights


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` ([out, in])."""
    if len(shape) != 2:
        raise ValueError(f"FP8 block weights must be 2-d [out, in], got shape {tuple(shape)}")
    return math.ceil(shape[0] / block), math.ceil(shape[1] / block)


def _expand(s: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """Per-block scales [ob, ib] -> per-element [out, in] (ragged last blocks cropped)."""
    return s.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def weight_quant_fp8(
    w: torch.Tensor, block: int = BLOCK, scale_fmt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (``w8`` e4m3 ``[out, in]``, ``scale_inv`` fp32 ``scale_shape(w.shape)``).

    ``scale_inv = amax(|block|) / 448`` (with ``scale_fmt="ue8m0"`` rounded up to a power of two),
    ``w8 = e4m3(w / scale_inv)`` rounded to nearest. An all-zero block gets scale 1.
    """
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise ValueError(f"weight_quant_fp8: expected a bf16/fp16/fp32 weight, got {w.dtype}")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"weight_quant_fp8: scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    ob, ib = scale_shape(w.shape, block)
    out, inp = w.shape
    wp = torch.zeros(ob * block, ib * block, dtype=torch.float32, device=w.device)
    wp[:out, :inp] = w.float()  # NOTE: zero padding cannot raise a block's amax
    amax = wp.view(ob, block, ib, block).abs().amax(dim=(1, 3))  # [ob, ib]
    # NOTE: a device-tensor divisor, as in awq_quantize: the same scales on CPU and CUDA
    s = torch.where(amax > 0, amax / torch.tensor(FP8_MAX, device=w.device), torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    w8 = (w.float() / _expand(s, (out, inp), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w8, s


def is_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``scale`` is a positive finite power of two, i.e. representable as UE8M0 (an
    8-bit exponent, no mantissa), what ``scale_fmt="ue8m0"`` declares for every scale."""
    mantissa, _ = torch.frexp(scale.float())  # scale = mantissa * 2^e, mantissa in [0.5, 1)
    return (mantissa == 0.5) & torch.isfinite(scale)


def weight_dequant_fp8(
    w8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``weight_quant_fp8``: ``w8 * scale_inv`` per block, in ``dtype`` (fp32 math)."""
    if w8.dtype != FP8_DTYPE:
        raise ValueError(f"weight_dequant_fp8: expected a float8_e4m3fn weight, got {w8.dtype}")
    want = scale_shape(w8.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_dequant_fp8: weight {tuple(w8.shape)} needs scale_inv of shape {want}, "
            f"got {tuple(scale_inv.shape)}"
        )
    s = _expand(scale_inv.float().to(w8.device), tuple(w8.shape), block)
    return (w8.float() * s).to(dtype)


# ---- FP8 weights served as FP8 ---------------------------------------------------------------

DENSE_FP8 = ("kv_b_proj",)  # the MLA absorbs its 16-bit weight (W_UK / W_UV): dequantised


class FP8Linear(torch.nn.Module):
    """``y = x @ W^T`` computed in FP8 (``echo::fp8_linear``): the checkpoint's
    ``weight`` (e4m3 ``[out, in]``) and ``weight_scale_inv`` (fp32 ``[ceil(out/128), in/128]``)
    kept as they are, one byte per weight; the activations quantised per 128 (``ue8m0``: power-
    of-two scales, the V3.2 config's ``scale_fmt``), as DeepSeek's reference ``linear`` does with
    ``gemm_impl="fp8"``. x ``[..., in]`` bf16 -> ``[..., out]`` bf16."""

    def __init__(self, in_features: int, out_features: int, ue8m0: bool = True, device=None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(
                f"FP8Linear: in_features ({in_features}) must be a multiple of {BLOCK}"
            )
        self.in_features, self.out_features, self.ue8m0 = in_features, out_features, ue8m0
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False,
        )
        self.weight_scale_inv = torch.nn.Parameter(
            torch.empty(scale_shape((out_features, in_features)), dtype=torch.float32,
                        device=device),
            requires_grad=False,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.echo.fp8_linear(
            x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, self.ue8m0
        )  # [M, out]
        return y.view(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, ue8m0: bool = True) -> FP8Linear:
        """Quantise a dense linear (128 x 128 blocks), e.g. for tests and benchmarks."""
        m = cls(linear.in_features, linear.out_features, ue8m0, linear.weight.device)
        w8, s = weight_quant_fp8(linear.weight.detach(), scale_fmt="ue8m0" if ue8m0 else None)
        with torch.no_grad():
            m.weight.copy_(w8)
            m.weight_scale_inv.copy_(s)
        return m

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return weight_dequant_fp8(self.weight, self.weight_scale_inv, dtype=dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 "
            f"128x128 blocks, activations per 128{' (ue8m0)' if self.ue8m0 else ''}"
        )


class FP8Experts(torch.nn.Module):
    """The routed experts with FP8 weights, a drop-in for ``model.moe.Experts``:
    ``w13_weight`` e4m3 ``[E, 2I, D]`` (gate rows then up rows) with ``w13_weight_scale_inv``
    ``[E, 2I/128, D/128]``, ``w2_weight [E, D, I]`` with ``w2_weight_scale_inv [E, D/128, I/128]``
    (the checkpoint's tensors, stacked as docs/CONTRACTS.md says); ``forward`` is one call of
    ``echo::moe_fp8`` -> fp32 ``[T, D]``."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, ue8m0: bool = True, device=None):
        super().__init__()
        if dim % BLOCK or inter_dim % BLOCK:
            raise ValueError(
                f"FP8Experts: dim ({dim}) and inter_dim ({inter_dim}) must be multiples of {BLOCK}"
            )
        self.n_experts, self.dim, self.inter_dim, self.ue8m0 = n_experts, dim, inter_dim, ue8m0
        e, d, i = n_experts, dim, inter_dim

        def param(shape, dtype):
            return torch.nn.Parameter(
                torch.empty(shape, dtype=dtype, device=device), requires_grad=False
            )

        self.w13_weight = param((e, 2 * i, d), FP8_DTYPE)
        self.w13_weight_scale_inv = param((e, 2 * i // BLOCK, d // BLOCK), torch.float32)
        self.w2_weight = param((e, d, i), FP8_DTYPE)
        self.w2_weight_scale_inv = param((e, d // BLOCK, i // BLOCK), torch.float32)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.echo.moe_fp8(
            x, topk_ids, topk_weights, self.w13_weight, self.w13_weight_scale_inv,
            self.w2_weight, self.w2_weight_scale_inv, self.ue8m0,
        )  # fmt: skip

    @classmethod
    def from_dense(
        cls, w13_weight: torch.Tensor, w2_weight: torch.Tensor, ue8m0: bool = True
    ) -> FP8Experts:
        """Quantise stacked dense experts ``w13_weight [E, 2I, D]``, ``w2_weight [E, D, I]``
        (128 x 128 blocks, e.g. the benchmark's random weights). With I a multiple of 128 the
        blocks of the stacked ``[2I, D]`` are those of gate_proj and up_proj apart, so this equals
        quantising each checkpoint tensor on its own."""
        e, two_i, d = w13_weight.shape
        m = cls(e, d, two_i // 2, ue8m0, w13_weight.device)
        fmt = "ue8m0" if ue8m0 else None
        with torch.no_grad():
            for j in range(e):
                for w, w8, s in ((w13_weight[j], m.w13_weight, m.w13_weight_scale_inv),
                                 (w2_weight[j], m.w2_weight, m.w2_weight_scale_inv)):  # fmt: skip
                    q, sc = weight_quant_fp8(w.detach(), scale_fmt=fmt)
                    w8[j].copy_(q)
                    s[j].copy_(sc)
        return m

    def dequantized_weights(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
        """``(w13_weight [E, 2I, D], w2_weight [E, D, I])`` as ``model.moe.Experts`` holds them."""
        return tuple(
            torch.stack([weight_dequant_fp8(w[j], s[j], dtype=dtype) for j in range(w.shape[0])])
            for w, s in ((self.w13_weight, self.w13_weight_scale_inv),
                         (self.w2_weight, self.w2_weight_scale_inv))
        )  # fmt: skip


def convert_to_fp8(model: torch.nn.Module, fp8_modules: set[str], ue8m0: bool) -> list[str]:
    """Before loading: swap, in place, each 16-bit ``nn.Linear`` named in ``fp8_modules`` (the
    modules whose checkpoint weights are FP8: they have a ``weight_scale_inv``) for an
    ``FP8Linear`` on the same device (meta is fine), so the loader keeps their FP8 tensors.
    Skipped (they keep the dequantise-at-load path): ``kv_b_proj`` (absorbed by the MLA), fp32
    linears (``indexer.weights_proj``) and in_features not a multiple of 128. The stacked routed
    experts (``model.moe.Experts`` at ``...mlp.experts``, FP8 when its expert 0's gate_proj is)
    become ``FP8Experts``. Returns the converted names."""
    from model.moe import Experts

    done: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is Experts and f"{name}.0.gate_proj" in fp8_modules:
                if child.dim % BLOCK == 0 and child.inter_dim % BLOCK == 0:
                    e, d, i = child.n_experts, child.dim, child.inter_dim
                    setattr(parent, child_name, FP8Experts(e, d, i, ue8m0, child.w13_weight.device))
                    done.append(name)
                continue
            if (
                name not in fp8_modules
                or type(child) is not torch.nn.Linear
                or child.bias is not None
                or child.weight.dtype not in (torch.bfloat16, torch.float16)
                or child.in_features % BLOCK
                or any(p in name for p in DENSE_FP8)
            ):
                continue
            new = FP8Linear(child.in_features, child.out_features, ue8m0, child.weight.device)
            setattr(parent, child_name, new)
            done.append(name)
    return done
