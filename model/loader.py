"""Load a Hugging Face DeepSeek-V3.2 checkpoint directory into ``DeepseekV32ForCausalLM``.

The model is built on the meta device, materialised on the target device, and every checkpoint
tensor is placed by an explicit name mapping (docs/CONTRACTS.md; ``model.weight_placer``, which
raises ``ValueError`` naming the tensor and the file for every problem), shard by shard; a shard
the index names that is not there is a ``ValueError`` too (``model.shards``). The MTP layers
(``>= num_hidden_layers``) are kept aside, unconverted, in ``LoadExtras.mtp``.
A caller that shows the load's progress passes ``progress(n, total)``: called after each tensor
is read, ``n`` its bytes, ``total`` those the whole load reads, both from the shards' headers
before any tensor is read (a tensor's span in its file, whatever its dtype: ``tensor_bytes``), so
the ``n`` sum to ``total`` (the bar is the caller's: ``runtime.progress``).
Shards are read one after another: reading ahead in threads was measured slower
(benchmarks/bench_load.py; docs/model_notes.md, "Loading the shards").
The checkpoint's meta read before any weight is ``model.checkpoint_meta``'s, the FP8 weights kept
FP8 ``model.fp8_choice``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.checkpoint_meta import CheckpointMeta, checkpoint_meta
from model.config import ModelConfig
from model.fp8_choice import FP8Choice, fp8_choice
from model.shards import checked_shards, open_shard
from model.weight_placer import FLOAT_DTYPES, WeightPlacer


@dataclass
class LoadExtras:
    """What ``load_model`` returns besides the model."""

    config: ModelConfig
    path: Path  # its tokenizer and generation config: runtime.engine_inputs
    # MTP layers (``model.layers.{num_hidden_layers + k}.*``) exactly as stored, on the CPU.
    mtp: dict[str, torch.Tensor] = field(default_factory=dict)


def load_weights(
    model: nn.Module,
    path: str | Path,
    config: ModelConfig,
    device: str | torch.device = "cpu",
    keep_mtp: bool = True,
    local: Callable[[str], str | None] | None = None,
    read: Callable[[Any, str, str], torch.Tensor] | None = None,
    read_bytes: Callable[[str, int], int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    shards: tuple[str, dict[str, list[str]]] | None = None,
) -> dict[str, torch.Tensor]:
    """Materialise ``model`` (built on the meta device) on ``device`` and fill it from the
    checkpoint at ``path``; returns the MTP tensors kept aside (none read if not ``keep_mtp``).
    Raises ``ValueError`` on any missing / unexpected / misshapen tensor, the names checked
    before any tensor is read. One rank's shard (``model.shard_loader``): ``local(name)`` is the
    model's name of checkpoint tensor ``name``, None for one not read here, and ``read(f, name,
    file)`` reads its part from the open shard ``f`` (default: all of it), ``read_bytes(name,
    n)`` the bytes of that part of the ``n``-byte tensor (default: ``n``). ``progress(n, total)``
    (module docstring): after each tensor read, ``n`` its bytes as read (``read_bytes`` of its
    bytes in the file, ``tensor_bytes``), ``total`` the sum of every ``n`` of this load.
    ``shards``: the checkpoint's ``shard_files`` listing where the caller already read it
    (``FP8Choice.shards``), else read here."""
    path = Path(path)
    local = local or (lambda name: name)
    index, files, fp8, nbytes = checked_shards(path, shards)
    model.to_empty(device=device)  # (before the loader, which holds the parameters)
    loader = WeightPlacer(model, config, path)
    here = {f: [n for n in map(local, names) if n is not None] for f, names in files.items()}
    loader.check_names(here, {n for n in map(local, fp8) if n is not None}, index)
    # (checkpoint name, the model's name) of every tensor read, shard by shard
    todo = {
        file: [(n, ours) for n in names
               if (keep_mtp or not loader.is_mtp(n)) and (ours := local(n)) is not None]
        for file, names in files.items()
    }  # fmt: skip
    size = read_bytes or (lambda name, n: n)
    total = sum(size(n, nbytes[n]) for todo_f in todo.values() for n, _ in todo_f)
    for file, names in todo.items():
        with open_shard(path, file) as f:
            for name, ours in names:
                t = f.get_tensor(name) if read is None else read(f, name, file)
                loader.add(ours, t, file)  # (the copy is the read: get_tensor maps the file)
                if progress is not None:
                    progress(size(name, nbytes[name]), total)
    loader.finish(index)
    _init_non_persistent_buffers(model)
    return loader.mtp


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """``to_empty`` leaves buffers uninitialised: the model recomputes those not in the checkpoint
    (rope frequencies, Hadamard matrices) in its ``init_buffers()``."""
    persistent = set(model.state_dict(keep_vars=True))
    computed = [name for name, _ in model.named_buffers() if name not in persistent]
    init = getattr(model, "init_buffers", None)
    if callable(init):
        init()
    elif computed:
        raise TypeError(
            f"{type(model).__name__} has non-persistent buffers ({computed[0]}, ...) but no "
            "init_buffers() method to recompute them after to_empty()"
        )


def _cast_half_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the model's 16-bit float parameters ``dtype`` (fp32 ones, e.g. the router bias,
    stay fp32)."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"load_model: dtype must be bfloat16, float16 or float32, got {dtype}")
    for m in model.modules():
        for k, p in list(m.named_parameters(recurse=False)):
            if p.dtype in (torch.bfloat16, torch.float16) and p.dtype != dtype:
                setattr(m, k, nn.Parameter(p.to(dtype), requires_grad=False))


def load_model(
    path_or_name: str | Path | CheckpointMeta,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    keep_mtp: bool = True,
    fp8_weights: str | FP8Choice = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[nn.Module, LoadExtras]:
    """Load a checkpoint directory (or a built-in name: ``tiny``, ``tiny-fp8``, ``tiny-awq``; or
    its ``CheckpointMeta``, already read) as ``DeepseekV32ForCausalLM`` on ``device``; ``dtype``
    is the dtype of its 16-bit weights.
    ``keep_mtp=False`` skips reading the MTP layer (a whole MoE block plus embed/head copies).
    ``fp8_weights`` (FP8 checkpoints, ``model.fp8_weights.resolve_fp8_weights``): ``"auto"``
    (default) and ``"fp8"`` keep the linears FP8 (``model.fp8_weights.FP8Linear``), ``"bf16"``
    dequantises every FP8 weight at load (the reference); or the ``FP8Choice`` already made
    for this checkpoint (``fp8_choice``). ``progress``: ``load_weights``'."""
    from model.model import DeepseekV32ForCausalLM

    path, config, _ = checkpoint_meta(path_or_name)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    _cast_half_params(model, dtype)
    awq = config.quantization is not None and config.quantization.method == "awq"
    choice = fp8_choice(path, config, fp8_weights)
    scaled = choice.modules
    if scaled is not None:
        from model.fp8_weights import convert_to_fp8

        convert_to_fp8(model, scaled, config.quantization.scale_fmt == "ue8m0")
    if awq:
        from model.awq_convert import convert_to_awq

        convert_to_awq(model, config.quantization)  # NOTE: after the cast: scales stay fp16
    mtp = load_weights(model, path, config, device, keep_mtp, progress=progress,
                       shards=choice.shards)
    finish_loaded_model(model, config, device, dtype)
    return model, LoadExtras(config, path, mtp)


def finish_loaded_model(
    model: nn.Module, config: ModelConfig, device: str | torch.device, dtype: torch.dtype
) -> None:
    """After the weights are in (whole or sharded loader): AWQ's kv_b_proj densified and, on
    CUDA, MLA's a-projections fused and the fast int4 layouts, and the split-K kernels' tile
    counters; frozen, eval mode."""
    if config.quantization is not None and config.quantization.method == "awq":
        from model.awq_convert import densify_awq, repack_awq_model

        densify_awq(model, dtype=dtype)  # kv_b_proj -> bf16 weight (MLA reads W_UK / W_UV)
        if torch.device(device).type == "cuda":  # the fast layouts (CPU keeps the AutoAWQ one)
            # MLA's projections of x as one GEMM (build_runner fuses every other format's),
            # here because AutoAWQ tensors can be fused and repacked ones cannot
            # (docs/model_notes.md, MLA)
            model.fuse_a_projections()
            repack_awq_model(model)
    if torch.device(device).type == "cuda":  # outside any CUDA-graph pool (tile_counters)
        from custom_ops.tile_counters import reserve_counters

        reserve_counters(device)
    model.requires_grad_(False)
    model.eval()
