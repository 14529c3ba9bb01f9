"""What a start-up reads of a checkpoint directory before any weight: its path, model config and
generation config, with its tokenizer checked present (``CheckpointMeta``, read once by
``read_checkpoint_meta`` and passed down to the FP8 choice, the KV sizing, the memory checks, the
engine inputs and the load, whole or sharded); and the short hash of it and of the shard listing
that the ranks of a dp/tp/ep job compare (``checkpoint_fingerprint``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class CheckpointFingerprint:
    """A checkpoint's ``checkpoint_fingerprint``: equal where the digests are (the path is only
    shown: hosts may mount the same checkpoint at other paths)."""

    digest: str
    path: str = field(compare=False)

    def __repr__(self) -> str:  # (how check_same_options names it)
        return f"{self.digest} ({self.path})"


def checkpoint_fingerprint(
    meta: CheckpointMeta, shards: tuple[str, dict[str, list[str]]], generation_config: str = "auto"
) -> CheckpointFingerprint:
    """A short hash of what a start-up reads of a checkpoint before any weight: its model config
    (as parsed, ``ModelConfig``: a config.json key the engine ignores is left out), its
    generation config where ``generation_config`` (``LLM``'s option) is "auto" (under "none" the
    file is not read, so ranks whose copies of it differ, or lack it, or hold one that is not
    JSON, run alike) and its shard listing (``shards``, ``model.shards.shard_files``': the
    index's tensor -> file map, or the single file's tensor names). Nothing is read for it. The
    ranks of a dp/tp/ep job compare it (``check_same_options``): ranks given other checkpoints
    of the same shapes would build and mix their weights. Not the weights' bytes (minutes to hash
    on V3.2): two checkpoints with the same config and the same tensors in the same files (a
    fine-tune saved as its base was) have the same fingerprint."""
    gen = meta.generation_config
    index, files = shards
    listing = sorted((file, sorted(names)) for file, names in files.items())
    h = hashlib.sha256(repr(meta.config).encode())
    if generation_config != "auto":  # NOTE: "none": unread (UNREAD_HINT advises it for a bad one)
        h.update(b"unread")
    elif isinstance(gen, Exception):  # (unreadable: its error names the path, which may differ)
        h.update(b"invalid")
    else:
        h.update(json.dumps(gen, sort_keys=True).encode())
    h.update(json.dumps([index, listing]).encode())
    return CheckpointFingerprint(h.hexdigest()[:12], str(meta.path))
