"""What a start-up reads of a checkpoint directory before any weight: its path, model config and
generation config, with its tokenizer checked present (``CheckpointMeta``, read once by
``read_checkpoint_meta`` and passed down to the FP8 choice, the KV sizing, the memory checks, the
engine inputs and the load, whole or sharded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from model.checkpoint import resolve_model
from model.config import ModelConfig
from model.shards import read_json


class CheckpointMeta(NamedTuple):
    """What a start-up reads of a checkpoint directory before any weight
    (``read_checkpoint_meta``). Read once and passed down (``LLM``: to the FP8 choice, the KV
    sizing, the memory checks, the engine inputs and the load), not cached: engines of other
    checkpoints may live in the same process."""

    path: Path
    config: ModelConfig
    # {} when absent; the ValueError naming it when it is not valid JSON (raised only where it
    # is used: generation_config "none" skips it)
    generation_config: Any


def read_checkpoint_meta(path_or_name: str | Path) -> CheckpointMeta:
    """A checkpoint directory's path, model config and generation config, with its tokenizer
    checked present: what every loader (whole or sharded) reads first."""
    path = resolve_model(path_or_name)
    raw = read_json(_require(path, "config.json"), "model config")
    if not isinstance(raw, dict):  # NOTE: from_dict would fail on it with an AttributeError
        raise ValueError(f"{path}/config.json: expected a JSON object, not {type(raw).__name__}")
    config = ModelConfig.from_dict(raw)
    _require(path, "tokenizer.json")
    gen = path / "generation_config.json"
    try:
        generation_config = read_json(gen, "generation config") if gen.is_file() else {}
    except ValueError as e:  # NOTE: raised only where it is used: generation_config "none" skips it
        generation_config = e
    return CheckpointMeta(path, config, generation_config)


def checkpoint_meta(source: str | Path | CheckpointMeta) -> CheckpointMeta:
    """``source``'s meta: as given where it was already read, else ``read_checkpoint_meta``'s."""
    return source if isinstance(source, CheckpointMeta) else read_checkpoint_meta(source)


def _require(path: Path, name: str) -> Path:
    if not (path / name).is_file():
        raise ValueError(f"{path}: no {name} (not a Hugging Face checkpoint directory?)")
    return path / name
