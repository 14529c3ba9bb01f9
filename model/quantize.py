"""Quantise a 16-bit model in memory into exactly what the loader serves for a quantised
checkpoint of it: the benchmark's random weights (``echo-compile bench --weights awq|fp8``)
served as a user would serve ``make-checkpoint --awq|--fp8`` of them.

No rule lives here; each has one home, used as the loader and the checkpoint writer use it:
- the config a quantised checkpoint declares: ``model.checkpoint.with_quantization`` (AWQ: the
  QuantTrio exclusions ``awq_modules_to_not_convert``; FP8: ``scale_fmt: ue8m0``);
- which modules become which type: ``convert_to_awq`` / ``convert_to_fp8``, run on a meta-device
  copy of the model (for FP8 with the modules the writer gives a ``weight_scale_inv``,
  ``stored_tensor_specs``, where the loader reads them from the shard index);
- the quantisation: ``awq_quantize`` / ``weight_quant_fp8`` (through ``AWQLinear.from_linear``,
  ``AWQExperts.from_dense``, ``FP8Linear.from_linear``, ``FP8Experts.from_dense``), what the
  writer stores;
- after the weights are in: ``model.loader.finish_loaded_model`` (AWQ: ``kv_b_proj`` densified,
  the fast int4 layouts on CUDA).
FP8 modules the loader dequantises at load (``kv_b_proj``, see ``convert_to_fp8``) keep a 16-bit
weight that went through e4m3 and back, as the loader's ``weight_dequant_fp8`` gives it.
``tests/test_bench_weights.py`` checks the result equals the loaded checkpoint, tensor for tensor.
"""

from __future__ import annotations

import re

import torch
from torch import nn

WEIGHTS = ("bf16", "awq", "fp8")  # bf16: as built; awq / fp8: served as those checkpoints
_EXPERT_SLICE = re.compile(r"(.*\.mlp\.experts)\.\d+\.")  # checkpoint name of one expert


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    return weights


def weights_format(model: nn.Module) -> str:
    """``bf16``, ``awq`` or ``fp8``: the format ``model``'s config declares (a model this module
    quantised to FP8 serves it as FP8)."""
    q = model.config.quantization
    return "bf16" if q is None else q.method


@torch.no_grad()
def quantize_in_memory(model: nn.Module, weights: str) -> list[str]:
    """Quantise ``model`` (a 16-bit ``DeepseekV32ForCausalLM`` with its weights in, on any device)
    in place to ``weights`` (``"bf16"``: unchanged); its ``config`` then declares the
    quantisation, as a loaded checkpoint's does. Returns the names of the quantised modules."""
    from model.checkpoint import with_quantization

    check_weights(weights)
    if weights == "bf16":
        return []
    if model.config.quantization is not None:
        raise ValueError(
            "quantize_in_memory: the model is already quantised "
            f"({model.config.quantization.method}); it needs 16-bit weights"
        )
    config = with_quantization(model.config, weights == "fp8", weights == "awq")
    shell = _meta_copy(config)
    if weights == "awq":
        names = _to_awq(model, shell, config)
    else:
        names = _to_fp8(model, shell, config)
    model.config = config
    device = next(model.parameters()).device
    dtype = model.lm_head.weight.dtype  # the 16-bit dtype (lm_head is never quantised)
    from model.loader import finish_loaded_model

    finish_loaded_model(model, config, device, dtype)
    return names


def _meta_copy(config) -> nn.Module:
    """The model's module tree on the meta device (no memory), to run the converters on."""
    from model.model import DeepseekV32ForCausalLM

    with torch.device("meta"):
        return DeepseekV32ForCausalLM(config)


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _to_awq(model: nn.Module, shell: nn.Module, config) -> list[str]:
    from model.awq import AWQExperts, AWQLinear
    from model.awq_convert import convert_to_awq

    names = convert_to_awq(shell, config.quantization)
    for name in names:
        old, kind = model.get_submodule(name), type(shell.get_submodule(name))
        if kind is AWQLinear:
            new: nn.Module = AWQLinear.from_linear(old)  # fp16 scales, as the writer stores
        else:
            new = AWQExperts.from_dense(old.w13_weight, old.w2_weight)
        _swap(model, name, new)
    return names


def _to_fp8(model: nn.Module, shell: nn.Module, config) -> list[str]:
    from model.checkpoint import stored_tensor_specs
    from model.fp8_weights import (
        FP8Experts,
        FP8Linear,
        convert_to_fp8,
        weight_dequant_fp8,
        weight_quant_fp8,
    )

    suffix = ".weight_scale_inv"
    scaled = {n.removesuffix(suffix) for n in stored_tensor_specs(config) if n.endswith(suffix)}
    ue8m0 = config.quantization.scale_fmt == "ue8m0"
    names = convert_to_fp8(shell, scaled, ue8m0)
    for name in names:
        old, kind = model.get_submodule(name), type(shell.get_submodule(name))
        if kind is FP8Linear:
            new: nn.Module = FP8Linear.from_linear(old, ue8m0)
        else:
            new = FP8Experts.from_dense(old.w13_weight, old.w2_weight, ue8m0)
        _swap(model, name, new)
    # the rest of the FP8-stored linears: dequantised at load (model/weight_placer.py,
    # WeightPlacer._dequant)
    for name in sorted(scaled - set(names)):
        experts = _EXPERT_SLICE.match(name)
        if experts is not None and _in_model(model, experts.group(1)):
            if not isinstance(model.get_submodule(experts.group(1)), FP8Experts):
                raise ValueError(f"quantize_in_memory: {experts.group(1)} cannot be served FP8")
            continue  # a slice of experts converted above
        if not _in_model(model, name):
            continue  # a layer the model does not hold (MTP)
        m = model.get_submodule(name)
        if not isinstance(m, nn.Linear):
            raise ValueError(f"quantize_in_memory: {name} ({type(m).__name__}) cannot stay FP8")
        w8, s = weight_quant_fp8(m.weight, scale_fmt=config.quantization.scale_fmt)
        m.weight.copy_(weight_dequant_fp8(w8, s))
    return names


def _in_model(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
