"""Load one TP rank's shard of a DeepSeek-V3.2 checkpoint (docs/multi_gpu.md).

The model is built on the meta device with the TP blocks of ``model.parallel`` (the same
parameter names, ``1/tp`` of the feed-forward intermediate features), and each checkpoint tensor
of a dense MLP, shared expert or routed expert is read only in this rank's rows or columns
(``safe_open(...).get_slice``: the other ranks' parts are never read). Everything else
(attention, indexer, norms, router, embeddings, LM head) is read whole. The three formats:
- bf16 ``weight [out, in]``; FP8 ``weight`` + ``weight_scale_inv [out/128, in/128]`` (a shard
  must hold whole 128x128 blocks); AWQ ``qweight [in, out/8]``, ``qzeros [in/128, out/8]``,
  ``scales [in/128, out]`` (whole 128-row groups, whole packed int32 words).
``gate_proj``/``up_proj`` are split along their output features, ``down_proj`` along its input.
The name mapping, the FP8 dequantisation and every missing/unexpected/misshapen check are
``model.weight_placer``'s (through ``model.loader.load_weights``), applied to the sliced tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from model.checkpoint_meta import CheckpointMeta, checkpoint_meta
from model.config import ModelConfig
from model.fp8_choice import FP8Choice, fp8_choice
from model.loader import (
    LoadExtras,
    _cast_half_params,
    _init_non_persistent_buffers,
    finish_loaded_model,
    load_weights,
)
from model.parallel import QUANT_BLOCK, TPGroup, parallelize_ffn, shard_dim

FP8_BLOCK = AWQ_GROUP = QUANT_BLOCK
_FFN = re.compile(
    r"model\.layers\.\d+\.mlp\.(?:shared_experts\.|experts\.\d+\.)?"
    r"(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv|qweight|qzeros|scales)"
)
# (axis of the output features, axis of the input features) of each stored tensor kind
_AXES = {
    "weight": (0, 1),
    "weight_scale_inv": (0, 1),
    "qweight": (1, 0),
    "qzeros": (1, 0),
    "scales": (1, 0),
}


_ROUTED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(.*)")


def local_expert_name(name: str, g: TPGroup, n_experts: int) -> str | None:
    """Expert parallel: checkpoint name ``name`` with its expert index made local to rank
    ``g.rank``; None for another rank's expert (never read); ``name`` itself for the rest."""
    m = _ROUTED.fullmatch(name)
    if m is None:
        return name
    per = n_experts // g.size
    e = int(m.group(2)) - g.rank * per
    return f"{m.group(1)}.{e}.{m.group(3)}" if 0 <= e < per else None


def shard_axis(name: str) -> int | None:
    """The axis along which checkpoint tensor ``name`` is split over TP ranks, or None (whole)."""
    m = _FFN.fullmatch(name)
    if m is None:
        return None
    proj, kind = m.groups()
    out_axis, in_axis = _AXES[kind]
    return in_axis if proj == "down_proj" else out_axis


def _block_rows(name: str, dtype: str) -> int:
    """Rows (along the split axis) that must stay together: an FP8 weight's 128x128 scale block,
    an AWQ group of 128 input rows; 1 for anything else."""
    if dtype.startswith("F8"):  # safetensors' dtype name (F8_E4M3)
        return FP8_BLOCK
    if name.endswith(".qweight") and name.split(".")[-2] == "down_proj":
        return AWQ_GROUP
    return 1


def _read_axis(name: str, g: TPGroup, ep: bool) -> int | None:
    """The axis along which this rank reads a part of tensor ``name``; None: it reads it whole
    (``ep``: routed experts are read whole, the caller picks the rank's experts)."""
    if g.size == 1 or (ep and _ROUTED.fullmatch(name)):
        return None
    return shard_axis(name)


def read_shard(f, name: str, file: str, g: TPGroup, ep: bool = False) -> torch.Tensor:
    """This rank's part of tensor ``name`` from the open safetensors file ``f`` (``ep``: routed
    experts are read whole, the caller picks the rank's experts)."""
    axis = _read_axis(name, g, ep)
    if axis is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    shape = sl.get_shape()
    n = shape[axis]
    block = _block_rows(name, sl.get_dtype())
    # (the model's dimensions were checked when it was built: this is the file's tensor)
    part = shard_dim(n, g.size, f"tensor {name!r} in {file}: axis {axis}", block)
    idx = [slice(None)] * len(shape)
    idx[axis] = slice(g.rank * part, (g.rank + 1) * part)
    return sl[tuple(idx)]


def load_shard_weights(
    model: nn.Module,
    path: Path,
    config: ModelConfig,
    device,
    g: TPGroup,
    ep: bool = False,
    progress: Callable[[int, int], None] | None = None,
    shards: tuple[str, dict[str, list[str]]] | None = None,
):
    """``model.loader.load_weights`` for one rank: each tensor's shard read. The MTP layer is not
    read (it is not served); with ``ep``, nor are other ranks' experts. ``progress``:
    ``load_weights``' (the bytes of the rank's parts); ``shards``: ``load_weights``'."""

    def local(name: str) -> str | None:  # the rank's name of a tensor; None: not read here
        return local_expert_name(name, g, config.n_routed_experts) if ep else name

    def read(f, name: str, file: str) -> torch.Tensor:
        return read_shard(f, name, str(path / file), g, ep)

    def read_bytes(name: str, n: int) -> int:  # (read_shard's part: 1/g.size of the axis)
        return n if _read_axis(name, g, ep) is None else n // g.size

    load_weights(
        model, path, config, device, keep_mtp=False, local=local, read=read,
        read_bytes=read_bytes, progress=progress, shards=shards,
    )  # fmt: skip


def build_sharded_model(
    config: ModelConfig,
    g: TPGroup,
    dtype: torch.dtype = torch.bfloat16,
    ep: bool = False,
    fp8_modules: set[str] | None = None,
):
    """The rank's model on the meta device: TP (``ep``: EP routed experts) feed-forward blocks,
    AWQ modules if quantised; ``fp8_modules`` (the checkpoint's modules with a
    ``weight_scale_inv``): those linears and experts FP8-resident (``model.fp8_weights``), each
    holding its shard's weight rows/columns and their 128x128 block scales."""
    from model.model import DeepseekV32ForCausalLM

    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
        parallelize_ffn(model, config, g, ep)
    _cast_half_params(model, dtype)
    if fp8_modules is not None:
        from model.fp8_weights import convert_to_fp8

        convert_to_fp8(model, fp8_modules, config.quantization.scale_fmt == "ue8m0")
    if config.quantization is not None and config.quantization.method == "awq":
        from model.awq_convert import convert_to_awq

        convert_to_awq(model, config.quantization)
    return model


def load_sharded_model(
    path_or_name: str | Path | CheckpointMeta,
    g: TPGroup,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    ep: bool = False,
    fp8_weights: str | FP8Choice = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[nn.Module, LoadExtras]:
    """``model.loader.load_model`` for TP rank ``g.rank`` of ``g.size``: only its shard read
    (``ep``: its routed experts whole instead of a slice of every expert). ``path_or_name``: as
    ``load_model``'s. ``fp8_weights``
    (FP8 checkpoints): ``"auto"`` (default) / ``"fp8"`` keep the weights FP8, ``"bf16"``
    dequantises them at load (``model.fp8_weights.resolve_fp8_weights``), or the
    ``model.fp8_choice.FP8Choice`` already made; FP8 or not, each
    shard cut on 128x128 block boundaries (a split that is not is refused when the model is built,
    naming the feed-forward size; ``read_shard`` checks each tensor again as it reads it).
    ``progress``: ``model.loader.load_weights``'."""
    path, config, _ = checkpoint_meta(path_or_name)
    choice = fp8_choice(path, config, fp8_weights)
    model = build_sharded_model(config, g, dtype, ep, choice.modules)
    load_shard_weights(model, path, config, device, g, ep, progress, choice.shards)
    finish_loaded_model(model, config, device, dtype)
    return model, LoadExtras(config, path)


def shard_model(full: nn.Module, g: TPGroup, ep: bool = False) -> nn.Module:
    """Rank ``g.rank``'s model cut from a whole in-memory 16-bit model (the benchmark's random
    weights, which have no checkpoint to read slices from): the same parameters as
    ``load_sharded_model`` gives from that model's checkpoint. A parameter that differs from the
    whole one along one axis is this rank's part of it there (the gate and up halves of stacked
    ``w13`` each split separately; EP: the rank's experts); the rest is copied whole."""
    config = full.config
    if config.quantization is not None:
        raise ValueError("shard_model: the whole model must be 16-bit (quantised: load a shard)")
    dtype = next(p.dtype for p in full.parameters() if p.is_floating_point())
    device = next(full.parameters()).device
    model = build_sharded_model(config, g, dtype, ep)
    model.to_empty(device=device)
    whole = dict(full.state_dict())
    with torch.no_grad():
        for name, t in model.state_dict().items():
            w = whole[name]
            diff = [i for i, (a, b) in enumerate(zip(t.shape, w.shape, strict=True)) if a != b]
            if not diff:
                t.copy_(w)
                continue
            (axis,) = diff
            n = t.shape[axis]
            if ".w13_" in name and not ep:  # [gate rows | up rows]: this rank's rows of each
                halves = [h.narrow(axis, g.rank * n // 2, n // 2) for h in w.chunk(2, dim=axis)]
                t.copy_(torch.cat(halves, dim=axis))
            else:
                t.copy_(w.narrow(axis, g.rank * n, n))
    _init_non_persistent_buffers(model)
    model.requires_grad_(False)
    return model.eval()
