"""runtime.structured_output: a JSON schema's grammar as a token mask, through the tiny engine
(random weights: only the mask makes the output JSON), sampled with seeds: every output parses
and follows the schema, and ends with EOS once the grammar is complete."""

from __future__ import annotations

import json

import pytest
import torch
from engine_records import random_prompts, run, tiny

from runtime.engine import Engine, EngineConfig
from runtime.openai_protocol import APIError, response_grammar
from runtime.sampling_params import SamplingParams
from runtime.structured_output import StructuredOutput, json_schema_grammar, lark_grammar

pytest.importorskip("llguidance")  # in the test extra; the server says so when it is missing

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def valid(obj: object) -> bool:
    return (
        isinstance(obj, dict)
        and set(obj) == {"ok", "pick"}
        and isinstance(obj["ok"], bool)
        and obj["pick"] in ("red", "green", "blue")
    )


def test_engine_json_schema_outputs_parse_and_validate() -> None:
    model, tok = tiny("cpu")
    prompts = random_prompts([20, 35, 50, 27], model.config.vocab_size, seed=8)
    grammar = json_schema_grammar(SCHEMA)
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, grammar=grammar)
              for s in range(3)]  # fmt: skip
    params.append(SamplingParams(max_tokens=8, temperature=1.0, seed=9))
    cfg = EngineConfig(max_batch=4, host_tokens=64 * 16, gpu_tokens=4 * model.config.index_topk,
                       max_model_len=192, prefill_chunk=64, device="cpu")  # fmt: skip
    _, _, out = run(cfg, prompts, params)
    eos = model.config.eos_token_id
    texts = []
    for rid in ("r0", "r1", "r2"):
        ids = out[rid]
        assert ids[-1] == eos and len(ids) < 60, (rid, ids)  # complete, then EOS
        text = tok.decode(ids)
        assert valid(json.loads(text)), text
        texts.append(text)
    assert len(set(texts)) > 1  # the seeds still choose among what the grammar allows
    free = tok.decode(out["r3"], skip_special_tokens=False)
    assert len(out["r3"]) == 8 and not free.startswith('{"')  # unconstrained row: random tokens


def _one_request(lark: str, caplog: pytest.LogCaptureFixture) -> tuple[list[int], int]:
    """One sampled request r0 under the Lark grammar ``lark``, warnings captured: its output
    tokens and the model's EOS."""
    model, _ = tiny("cpu")
    prompts = random_prompts([20], model.config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=1, grammar=lark_grammar(lark))]
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 4, gpu_tokens=4 * model.config.index_topk,
                       max_model_len=128, prefill_chunk=64, device="cpu")  # fmt: skip
    with caplog.at_level("WARNING", logger="runtime.structured_output"):
        _, _, out = run(cfg, prompts, params)
    return out["r0"], model.config.eos_token_id


def test_a_grammar_the_matcher_fails_on_ends_with_eos_and_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A grammar that compiles but that the matcher fails on mid-way (an empty language: llguidance
    hits its item limit) ends the request with EOS, and a warning names the request and the
    matcher's error, so the output is not silently taken for one that matches."""
    out, eos = _one_request('start: x\nx: "a" x', caplog)
    assert out[-1] == eos and len(out) < 10
    assert "request r0: the grammar matcher failed" in caplog.text
    assert caplog.text.count("grammar matcher failed") == 1


def test_a_matcher_failing_while_it_computes_the_mask_is_logged_too(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parser limit met inside the mask computation (here the lexer's fuel, made tiny) leaves
    the matcher in error after the fill: that request too gets the EOS-only mask and the warning
    (it ended with EOS silently)."""
    import llguidance

    make, limits = llguidance.LLMatcher, llguidance.LLParserLimits(step_lexer_fuel=10)

    def starved(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        return make(*args, **kw, limits=limits)

    starved.validate_grammar = make.validate_grammar  # type: ignore[attr-defined]
    monkeypatch.setattr(llguidance, "LLMatcher", starved)
    out, eos = _one_request("start: /[a-z]+( [a-z]+)*/", caplog)
    assert out == [eos]
    assert "request r0: the grammar matcher failed (lexer error" in caplog.text


def test_min_p_is_relative_to_what_the_grammar_allows() -> None:
    """min_p with a grammar, sampled: min_p keeps the tokens near the best ALLOWED one. (It ran
    before the mask once: where min_p had dropped every allowed token the row was all -inf, and
    the sampler gave NaN logprobs and token 0, outside the grammar; the server answered 500.)"""
    model, tok = tiny("cpu")
    prompts = random_prompts([30, 30], model.config.vocab_size, seed=3)
    grammar = json_schema_grammar(SCHEMA)
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, grammar=grammar, min_p=0.5,
                             logprobs=True, top_logprobs=2) for s in (1, 2)]  # fmt: skip
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 8, gpu_tokens=2 * model.config.index_topk,
                       max_model_len=128, device="cpu")  # fmt: skip
    eng = Engine(model, model.config, tok, cfg)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    out: dict[str, list[int]] = {"r0": [], "r1": []}
    lps: list[float] = []
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
            lps += (o.new_logprobs or []) + [v for top in o.new_top_logprobs or [] for _, v in top]
    for rid in ("r0", "r1"):
        ids = out[rid]
        assert ids[-1] == model.config.eos_token_id, (rid, ids)
        assert valid(json.loads(tok.decode(ids))), tok.decode(ids)
    assert lps and all(-9999.0 <= lp <= 0.0 for lp in lps), lps  # no NaN


def test_mask_only_touches_constrained_rows_and_never_writes_its_input() -> None:
    model, tok = tiny("cpu")
    so = StructuredOutput(tok, model.config.vocab_size, model.config.eos_token_id)

    class R:  # the fields StructuredOutput reads
        def __init__(self, rid: str, grammar: str | None) -> None:
            self.request_id, self.output_ids = rid, []
            self.params = SamplingParams(grammar=grammar)

    reqs = [R("a", json_schema_grammar(SCHEMA)), R("b", None)]
    logits = torch.randn(2, model.config.vocab_size)
    given = logits.clone()
    out = so(reqs, given)
    assert torch.equal(given, logits) and torch.equal(out[1], logits[1])
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).lstrip().startswith("{") for t in allowed)
    assert so([reqs[1]], logits) is logits and not so.matchers  # dropped when absent


def test_response_format_mapping() -> None:
    assert response_grammar(None) is None and response_grammar({"type": "text"}) is None
    assert isinstance(response_grammar({"type": "json_object"}), str)
    assert isinstance(response_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
                      str)  # fmt: skip
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": "x"}):
        with pytest.raises(APIError) as e:
            response_grammar(bad)
        assert e.value.param == "response_format"
    model, tok = tiny("cpu")
    so = StructuredOutput(tok, model.config.vocab_size, model.config.eos_token_id)
    with pytest.raises(ValueError, match="grammar"):
        so.check(json_schema_grammar({"type": "nonsense"}))
