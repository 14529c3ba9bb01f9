"""A checkpoint's fingerprint (model/checkpoint_meta.py, ``checkpoint_fingerprint``), which the
ranks of a dp/tp/ep job compare: it sees the model config, the generation config and the shard
listing, not the path (hosts may mount the same checkpoint elsewhere) nor the weights' bytes."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from model.checkpoint import resolve_model
from model.checkpoint_meta import checkpoint_fingerprint, read_checkpoint_meta
from model.shards import INDEX_FILE, shard_files


def fingerprint(path, generation_config="auto"):
    meta = read_checkpoint_meta(path)
    return checkpoint_fingerprint(meta, shard_files(meta.path), generation_config)


@pytest.fixture
def copy(tmp_path):
    """The tiny checkpoint copied to another directory."""
    dst = tmp_path / "copy"
    shutil.copytree(resolve_model("tiny"), dst)
    return dst


def _edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_the_same_checkpoint_at_another_path_has_the_same_fingerprint(copy):
    ours, theirs = fingerprint(resolve_model("tiny")), fingerprint(copy)
    assert ours == theirs
    assert repr(theirs) == f"{theirs.digest} ({copy})"  # (the path shown, not compared)
    assert len(ours.digest) == 12


def test_a_config_value_changes_the_fingerprint(copy):
    _edit_json(copy / "config.json", lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * 2))
    assert fingerprint(copy) != fingerprint(resolve_model("tiny"))


def test_a_generation_config_value_changes_the_fingerprint(copy):
    _edit_json(copy / "generation_config.json", lambda g: g.update(temperature=0.123))
    assert fingerprint(copy) != fingerprint(resolve_model("tiny"))


def test_the_shard_listing_changes_the_fingerprint(copy):
    """A tensor the index places in another shard (the listing only: no tensor is read)."""

    def move(index):
        name, file = next(iter(index["weight_map"].items()))
        others = sorted(set(index["weight_map"].values()) - {file})
        index["weight_map"][name] = others[0]

    _edit_json(copy / INDEX_FILE, move)
    assert fingerprint(copy) != fingerprint(resolve_model("tiny"))


def test_the_weights_bytes_are_not_compared(copy):
    """Documented (docs/multi_gpu.md): hashing them would take minutes on V3.2."""
    shard = json.loads((copy / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    tensors = load_file(copy / shard)
    tensors["model.norm.weight"] += 1
    save_file(tensors, str(copy / shard), metadata={"format": "pt"})
    assert fingerprint(copy) == fingerprint(resolve_model("tiny"))


@pytest.mark.parametrize("edit", ["changed", "absent", "not JSON"])
def test_a_generation_config_left_unread_is_left_out(copy, edit):
    """Under generation_config "none" the file is not read (the hint of its errors advises it
    for a file that is not JSON): ranks whose copies of it differ run alike, so the fingerprint
    leaves it out; under "auto" it is in."""
    gen = copy / "generation_config.json"
    if edit == "changed":
        _edit_json(gen, lambda g: g.update(temperature=0.123))
    elif edit == "absent":
        gen.unlink()
    else:
        gen.write_text("{")
    tiny = resolve_model("tiny")
    assert fingerprint(copy, "none") == fingerprint(tiny, "none")
    assert fingerprint(copy) != fingerprint(tiny)


def test_a_rank_build_compares_the_fingerprint_of_its_generation_config_option(copy, monkeypatch):
    """``build_distributed_engine`` hashes the generation config as its ``generation_config``
    option reads it: with "none", a rank whose generation_config.json is not JSON sends rank 0's
    fingerprint (it was refused: "checkpoint: rank 0 has ..., rank 1 has ...")."""
    import torch.distributed as dist

    from runtime.distributed.dist_engine import build_distributed_engine
    from runtime.distributed.process import DistContext
    from runtime.engine_config import EngineConfig

    class Sent(Exception):
        pass

    sent = []

    def gather(out, obj, group=None):  # (what this rank sends to the options check)
        if not isinstance(obj, dict):  # the start-up checks' error exchange (rank_errors)
            assert obj is None, obj
            out[:] = [None, None]
            return
        sent.append(obj["checkpoint"])
        raise Sent

    monkeypatch.setattr(dist, "all_gather_object", gather)
    (copy / "generation_config.json").write_text("{")
    ctx = DistContext(0, 2, 0, "cpu", "gloo", "0", None, 10.0)
    for path in (resolve_model("tiny"), copy):
        with pytest.raises(Sent):
            build_distributed_engine(
                str(path), EngineConfig(dp=2, device="cpu"), ctx=ctx, generation_config="none"
            )
    assert sent[0] == sent[1]
