"""A checkpoint directory's safetensors shards, read before any tensor is: which file holds which
tensor (the index's weight map, or the single file's names), each shard's header held against
it, and each tensor's bytes (its span in its file, whatever its dtype: the load's progress)."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json(path: Path, what: str) -> Any:
    """The JSON file at ``path``; its absence or invalid JSON a ValueError naming it (``what``:
    what it holds)."""
    if not path.is_file():
        raise ValueError(f"{path.parent}: no {path.name} ({what})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def shard_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """(index file name, {shard file: [tensor names]}) of the checkpoint at ``path``."""
    if (path / INDEX_FILE).is_file():
        index = read_json(path / INDEX_FILE, "the shard index")
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError(f"{path / INDEX_FILE}: expected a 'weight_map' of tensor -> file")
        files: dict[str, list[str]] = defaultdict(list)
        for name, f in wm.items():
            files[f].append(name)
        for f, names in files.items():
            if not (path / f).is_file():
                raise ValueError(
                    f"{path / INDEX_FILE} names shard {f!r} (e.g. for tensor {names[0]!r}), "
                    f"but {path / f} does not exist"
                )
        return INDEX_FILE, dict(files)
    if (path / SINGLE_FILE).is_file():
        with open_shard(path, SINGLE_FILE) as f:
            return SINGLE_FILE, {SINGLE_FILE: list(f.keys())}
    raise ValueError(f"{path}: no {INDEX_FILE} or {SINGLE_FILE}")


def open_shard(path: Path, file: str):
    """``safe_open`` of one shard, its failure a ValueError naming the file."""
    try:
        return safe_open(str(path / file), framework="pt", device="cpu")
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path / file}: not a readable safetensors file ({e})") from e


def shard_header(file: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's header, ``{tensor name: {"dtype", "shape", "data_offsets"}}`` (its
    ``__metadata__`` left out): read where ``open_shard`` accepted the file, which checks the
    header against the file (offsets contiguous, each span the size its dtype and shape give,
    the file as long as they say)."""
    with open(file, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))  # (safetensors: a little-endian u64 length)
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header


def tensor_bytes(entry: dict[str, Any]) -> int:
    """A tensor's bytes in its file, from its header entry (``shard_header``): its
    ``data_offsets`` [start, end), whatever its dtype (a table of bytes per dtype name counted 0
    for a name it lacked, C64 or F8_E4M3FNUZ, and the load's bar fell short of what it read)."""
    start, end = entry["data_offsets"]
    return end - start


def checked_shards(
    path: Path, listing: tuple[str, dict[str, list[str]]] | None = None
) -> tuple[str, dict[str, list[str]], set[str], dict[str, int]]:
    """``shard_files``, with every shard's header read and held against the index before any tensor
    is: an unreadable shard (a truncated download, a git-lfs pointer) or one that lacks or adds a
    tensor is found in seconds, not after the shards before it were read (minutes on V3.2). Also
    returns, from the same headers, the names stored as e4m3 (``WeightPlacer.check_names``) and each
    tensor's bytes (``tensor_bytes``: the load's progress). ``listing``: ``shard_files``' result
    where the caller already read it (the index is not read again), else read here."""
    index, files = listing or shard_files(path)
    fp8: set[str] = set()
    nbytes: dict[str, int] = {}
    for file, names in files.items():
        with open_shard(path, file):  # (the file checked against its header: then read that)
            header = shard_header(path / file)
        keys = set(header)
        fp8.update(n for n, entry in header.items() if entry["dtype"] == "F8_E4M3")
        nbytes.update((n, tensor_bytes(entry)) for n, entry in header.items())
        missing = [name for name in names if name not in keys]
        if missing:
            raise ValueError(
                f"missing tensor {missing[0]!r}: {path / index} places it in {path / file}, "
                "which does not contain it"
            )
        extra = sorted(keys - set(names))
        if extra:
            raise ValueError(
                f"unexpected tensor {extra[0]!r} in {path / file}: not listed for this file "
                f"in {path / index}"
            )
    return index, files, fp8, nbytes
