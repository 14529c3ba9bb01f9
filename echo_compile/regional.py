"""Regional compilation of the feed-forward (opt-in, off by default): each layer's MLP or MoE is
called through one ``torch.compiler.nested_compile_region``, so that Dynamo traces and Inductor
compiles it once per module kind (dense MLP, MoE) and reuses that code in every later layer of
the kind, where the unrolled step compiles a copy per layer (docs/compile.md, "Warm-up time and
the layer count").

Why the feed-forward and not the whole layer: the attention writes the KV cache through custom
ops that mutate their inputs (``echo::offload``, the pool's recall), and torch 2.13 cannot reuse
a region that does: the second call of such a region is functionalized by
``torch.func.functionalize`` (auto_functionalize.FunctionalCallableWithEpilogue), whose C++
fallback refuses a non-ATen op with alias annotations ("Found a custom (non-ATen) operator whose
output has alias annotations: echo::offload(Tensor(a0!) host_kv, ...)"). The feed-forward
mutates nothing.

NOTE: CPU-checked only (logits ``torch.equal`` to the unrolled step, no graph break); on CUDA
the captured graph's cudagraph skips are not yet checked, hence off by default.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def _regional_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with its ``forward`` a nested compile region (one class, so one region, per
    feed-forward kind).

    NOTE: the region must be the class's method. An instance attribute ``mlp.forward =
    MethodType(region, mlp)`` traced without a break or an error, but Dynamo then called layer
    0's subgraph with layer 0's weights in every layer (torch 2.13): silently wrong logits."""
    if getattr(cls, "_echo_regional", False):
        return cls
    forward = torch.compiler.nested_compile_region(cls.forward)
    return type(cls.__name__, (cls,), {"forward": forward, "_echo_regional": True})


def mark_feed_forward_regions(model: nn.Module) -> None:
    """Make every layer's ``mlp`` of ``model`` (a ``DeepseekV32ForCausalLM``) a region: its
    class becomes a subclass whose ``forward`` is the region. It marks the model itself (an eager
    call is unchanged: a region is a no-op outside torch.compile); marking twice is the same as
    once."""
    for block in model.model.layers:
        block.mlp.__class__ = _regional_class(type(block.mlp))
