"""One linear for several that read the same input: ``fuse_linears([a, b])`` is a module of their
type whose output is ``cat([a(x), b(x)], -1)``, so a decode step reads ``x`` once and launches one
GEMM (and, FP8, quantises ``x`` once) where it launched two.

The rule for each type (the parts' outputs stacked along ``out``; nothing is recomputed):
- ``nn.Linear`` (no bias): the weights concatenated along ``out``;
- ``FP8Linear``: the e4m3 weights and their 128 x 128 block scales concatenated along ``out``;
  every part but the last needs ``out % 128 == 0`` so that no scale block straddles two parts
  (the last may be ragged, as ``kv_a_proj_with_mqa``'s 576 rows are);
- ``AWQLinear`` (before ``repack``): ``qweight``, ``qzeros`` and ``scales`` concatenated along
  their packed output axis (AutoAWQ packs eight columns a word, within the word).
Anything else (mixed types, a bias, different inputs, a repacked AWQ module) is a ValueError that
names the reason; ``fusable`` answers the same question without raising.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.awq import AWQ_TENSORS, AWQLinear
from model.fp8_weights import BLOCK, FP8Linear


def _why_not(parts: Sequence[nn.Module]) -> str | None:
    """Why ``parts`` cannot be fused, or None."""
    if len(parts) < 2:
        return f"need at least two linears, got {len(parts)}"
    kind = type(parts[0])
    if kind not in (nn.Linear, FP8Linear, AWQLinear):
        return f"{kind.__name__} is not nn.Linear, FP8Linear or AWQLinear"
    if any(type(p) is not kind for p in parts):
        return f"mixed types {[type(p).__name__ for p in parts]}"
    if len({p.in_features for p in parts}) != 1:
        return f"different in_features {[p.in_features for p in parts]}"
    if kind is nn.Linear:
        if any(p.bias is not None for p in parts):
            return "a linear has a bias"
        if len({(p.weight.dtype, p.weight.device) for p in parts}) != 1:
            return "weights of different dtypes or devices"
    if kind is FP8Linear:
        if len({p.ue8m0 for p in parts}) != 1:
            return "different activation scale formats (ue8m0)"
        ragged = [p.out_features for p in parts[:-1] if p.out_features % BLOCK]
        if ragged:
            return f"out_features {ragged} not a multiple of {BLOCK} before the last part"
    if kind is AWQLinear:
        if any(p.repacked for p in parts):
            return "an AWQLinear is already repacked (fuse before repack)"
        if len({p.scales.dtype for p in parts}) != 1:
            return "different AWQ scales dtypes"
    return None


def fusable(parts: Sequence[nn.Module]) -> bool:
    return _why_not(parts) is None


def _cat_param(tensors: Sequence[torch.Tensor], dim: int) -> nn.Parameter:
    return nn.Parameter(torch.cat([t.detach() for t in tensors], dim), requires_grad=False)


@torch.no_grad()
def fuse_linears(parts: Sequence[nn.Module]) -> nn.Module:
    """One module computing ``cat([p(x) for p in parts], -1)`` (the module docstring)."""
    why = _why_not(parts)
    if why is not None:
        raise ValueError(f"fuse_linears: {why}")
    first, out = parts[0], sum(p.out_features for p in parts)
    if isinstance(first, FP8Linear):
        fused = FP8Linear(first.in_features, out, first.ue8m0, device="meta")
        fused.weight = _cat_param([p.weight for p in parts], 0)
        fused.weight_scale_inv = _cat_param([p.weight_scale_inv for p in parts], 0)
    elif isinstance(first, AWQLinear):
        fused = AWQLinear(first.in_features, out, first.scales.dtype, device="meta")
        for name in AWQ_TENSORS:
            setattr(fused, name, _cat_param([getattr(p, name) for p in parts], 1))
    else:
        fused = nn.Linear(first.in_features, out, bias=False, device="meta")
        fused.weight = _cat_param([p.weight for p in parts], 0)
    return fused
