"""Which of an FP8 checkpoint's weights a load keeps FP8 (``fp8_weights`` resolved against the
checkpoint: ``FP8Choice``, made once by ``fp8_choice`` and passed down to the sizing, the memory
checks and the load, whole or sharded)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from model.config import ModelConfig
from model.fp8_weights import resolve_fp8_weights
from model.shards import shard_files


def fp8_scaled_modules(
    path: Path, fp8_weights: str, files: dict[str, list[str]]
) -> set[str] | None:
    """The modules to keep FP8 (those the checkpoint gives a ``weight_scale_inv``; ``files``:
    its ``shard_files`` listing), for ``fp8_weights`` that ``resolve_fp8_weights`` did not
    resolve to ``"bf16"``. A checkpoint whose config.json says FP8 but that has no scales (its
    weights converted to bf16, e.g. by DeepSeek's fp8_cast_bf16.py, with config.json left as it
    was) is served as the bf16 it holds under ``"auto"`` (None), and is a ValueError under an
    explicit ``"fp8"``."""
    scaled = {n.removesuffix(".weight_scale_inv") for names in files.values()
              for n in names if n.endswith(".weight_scale_inv")}  # fmt: skip
    if not scaled and fp8_weights == "auto":
        return None
    if not scaled:
        raise ValueError(
            f"fp8_weights={fp8_weights!r}: {path} has no weight_scale_inv tensors, though its "
            "config.json declares an fp8 quantization_config (already converted to bf16? load "
            "them with fp8_weights='bf16' or 'auto', --fp8-weights bf16)"
        )
    return scaled


class FP8Choice(NamedTuple):
    """``fp8_weights`` resolved against one checkpoint (``fp8_choice``). Found once and passed
    down (``LLM``: ``weights`` to the sizing and the memory checks, the whole choice to the load,
    whole or sharded), as ``CheckpointMeta`` is: the load walks no shard listing for it again,
    and reads no shard index again (it takes ``shards``)."""

    weights: str  # what the load serves: "fp8" (kept FP8) or "bf16"
    modules: set[str] | None  # those kept FP8 (``fp8_scaled_modules``'); None: "bf16"
    # the shard listing (``shard_files``') the walk read, for the load; None: none read (the
    # options resolved to "bf16" without it), the load reads it
    shards: tuple[str, dict[str, list[str]]] | None = None


def fp8_choice(
    path: Path,
    config: ModelConfig,
    fp8_weights: str | FP8Choice,
    shards: tuple[str, dict[str, list[str]]] | None = None,
) -> FP8Choice:
    """What ``load_model`` serves for ``fp8_weights`` (``fp8_scaled_modules``' rule: "auto"
    keeps what the checkpoint holds), for the readers that must agree with the load before it
    (the memory plan, the sizing) and for the load itself; a choice already made is returned
    as given. ``shards``: the checkpoint's ``shard_files`` listing when the caller read it
    already (else it is read here, when the choice needs it)."""
    if isinstance(fp8_weights, FP8Choice):
        return fp8_weights
    if resolve_fp8_weights(fp8_weights, config, str(path)) == "bf16":  # (its ValueErrors)
        return FP8Choice("bf16", None)
    shards = shards or shard_files(path)
    scaled = fp8_scaled_modules(path, fp8_weights, shards[1])
    return FP8Choice("bf16" if scaled is None else "fp8", scaled, shards)
