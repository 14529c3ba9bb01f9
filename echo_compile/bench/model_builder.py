"""The model ``echo-compile bench`` serves: deterministic random weights at the ``bench`` or
``tiny`` preset, the locality model planted in them, served as bf16 or as an AWQ / FP8 checkpoint
of them would be; and the bytes those weights take on the device."""

from __future__ import annotations

import torch

from model.quantize import check_weights, quantize_in_memory


def build_model(
    preset: str,
    layers: int,
    experts: int,
    device: str,
    locality: float = 0.0,
    weights: str = "bf16",
) -> torch.nn.Module:
    """The benchmark model with deterministic random weights, built directly on ``device``:
    ``bench`` (real V3.2 attention/indexer dims, ``layers`` and ``experts`` chosen) or ``tiny``;
    ``locality`` > 0 plants the locality model (model/locality.py) into the weights.
    ``weights`` ``awq`` / ``fp8``: those bf16 weights (locality planted) then quantised in memory
    into what the loader serves for an AutoAWQ / official FP8 checkpoint of them
    (``model.quantize``; FP8 as ``fp8_weights="fp8"``: e4m3 weights, 128 x 128 block scales)."""
    from model.model import DeepseekV32ForCausalLM
    from model.presets import preset_config

    check_weights(weights)  # before any work
    if preset == "bench":
        cfg = preset_config("bench", num_layers=layers, n_experts=experts)
    else:
        cfg = preset_config("tiny")
    with torch.device(device):
        model = DeepseekV32ForCausalLM(cfg)
    model.random_init_(seed=0, locality=locality).eval()
    quantize_in_memory(model, weights)
    return model


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of ``model``'s parameters (on its device) by dtype, and their ``total``: AWQ's int32
    words and fp16 scales, FP8's e4m3 weights and fp32 block scales, the 16-bit rest."""
    out: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return dict(sorted(out.items())) | {"total": sum(out.values())}
