"""Engine.add_request rejects bad prompts with an error that names the problem, and keeps what it
had already accepted."""

from __future__ import annotations

import pytest

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> Engine:
    model, _ = load_model(resolve_model("tiny"))
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 8, gpu_tokens=2 * model.config.index_topk)
    return Engine(model, model.config, None, cfg)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 2, True], "integers"),
        ([1, 2.0], "integers"),
        ([1, "2"], "integers"),
        ([1, -1], "must be in"),
        ([1, 10**6], "must be in"),
        ([], "empty"),
    ],
)
def test_bad_prompt_ids_are_rejected_and_nothing_is_lost(engine: Engine, ids, message) -> None:
    params = SamplingParams(max_tokens=2)
    engine.add_request("ok", [5, 6, 7], params)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", ids, params)
    assert "bad" not in engine.requests and "ok" in engine.requests
    engine.abort_request("ok")
    assert not engine.has_unfinished()


def test_int_subclasses_other_than_bool_are_ids(engine: Engine) -> None:
    import enum

    class Tok(enum.IntEnum):
        A = 7

    engine.add_request("enum", [5, Tok.A], SamplingParams(max_tokens=2))
    assert engine.requests["enum"].prompt_ids == [5, 7]
    engine.abort_request("enum")


def test_a_tokenizer_bos_past_the_model_vocabulary_is_refused_at_load(tmp_path) -> None:
    """tokenizer.json may add tokens past config.json's vocab_size: such a bos_token loaded, and
    then every text prompt was refused ('prompt token ids must be in [0, 512)')."""
    import json
    import shutil

    from runtime.engine_inputs import read_engine_inputs

    d = tmp_path / "ckpt"
    shutil.copytree(resolve_model("tiny"), d)
    tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    tok["added_tokens"].append({"id": vocab, "content": "<s>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": "<s>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json field 'bos_token': '<s>'"):
        read_engine_inputs(d, EngineConfig())
