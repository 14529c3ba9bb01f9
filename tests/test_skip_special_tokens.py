"""vLLM's ``skip_special_tokens`` and ``spaces_between_special_tokens``, end to end: the
incremental detokenizer, ``SamplingParams``, the ``LLM`` API and both server routes over the
real tiny engine (its DeepSeek byte-level tokenizer), streamed equal to non-streamed.

The tiny model is steered onto special tokens with ``logit_bias`` (+100 on two special and two
plain tokens) and ``frequency_penalty`` (so it moves from one to the next): greedy, it generates
``ri d<｜User｜><｜Assistant｜> d<｜User｜>ri<｜Assistant｜>``: two special tokens side by side.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_utils import make_tokenizer_dir, running_server
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from echo_compile.llm import LLM
from runtime.async_engine import AsyncEngine
from runtime.detokenize import RequestDetokenizer
from runtime.sampling_params import SamplingParams, SamplingParamsError
from runtime.server import build_app
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.aten_gemm  # CPU GEMMs without oneDNN (conftest.py)

MODEL = "tiny"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"  # the tiny tokenizer's ids 3 and 4
PROMPT = [0, 5, 6, 7]
STEER: dict[str, Any] = dict(
    max_tokens=8,
    temperature=0.0,
    logit_bias={3: 100, 4: 100, 300: 100, 301: 100},
    frequency_penalty=2.0,
)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


# ---- the detokenizer and SamplingParams --------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def test_sampling_params_defaults_and_types() -> None:
    p = SamplingParams()
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(SamplingParamsError, match=name) as e:
            SamplingParams(**{name: 0})
        assert e.value.param == name


def test_detokenizer_keeps_special_tokens_text_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("<|user|>Hello world<|end|><|assistant|> the fox<eos>", add_bos=False)
    prompt = tok.encode("<|system|>hi", add_bos=True)
    kept = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False)
    assert "".join(_stream(kept, ids)) == tok.decode(ids, skip_special_tokens=False)
    assert kept.text == "<|user|>Hello world<|end|><|assistant|> the fox<eos>"
    skipped = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(_stream(skipped, ids)) == "Hello world the fox"


def test_stop_string_naming_a_special_token_matches_only_when_kept(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world<|end|> the fox", add_bos=False)
    kept = IncrementalDetokenizer(tok, stop=("<|end|>",), skip_special_tokens=False)
    assert "".join(_stream(kept, ids)) == "Hello world" and kept.stop_string == "<|end|>"
    skipped = IncrementalDetokenizer(tok, stop=("<|end|>",))
    assert "".join(_stream(skipped, ids)) == "Hello world the fox" and not skipped.stopped


def test_request_detokenizer_passes_the_flags(tok: Tokenizer) -> None:
    ids = tok.encode("Hello<|end|><|assistant|>", add_bos=False)
    eos = {tok.eos_token_id}
    for skip, want in ((True, "Hello"), (False, "Hello<|end|><|assistant|>")):
        rd = RequestDetokenizer(tok, SamplingParams(skip_special_tokens=skip), [], eos)
        assert "".join(rd.add(t, k + 1)[0] for k, t in enumerate(ids)) == want
    # an EOS that ends the request adds no text, kept or not (as vLLM's detokenizer skips it)
    rd = RequestDetokenizer(tok, SamplingParams(skip_special_tokens=False), [], eos)
    hello = tok.encode("Hello", add_bos=False)
    assert "".join(rd.add(t, k + 1)[0] for k, t in enumerate(hello)) == "Hello"
    assert rd.add(tok.eos_token_id, len(hello) + 1) == ("", "stop")


def test_spaces_between_special_tokens_false_joins_adjacent_added_tokens() -> None:
    """vLLM's fast detokenizer's rule, seen through a decoder that does put spaces between
    tokens (WordPiece: ``[A] [B] hi``): false gives an added token after another its own text."""
    hf = HFTokenizer(models.WordLevel({"[A]": 0, "[B]": 1, "hi": 2, "[U]": 3}, unk_token="[U]"))
    hf.add_special_tokens(["[A]", "[B]"])
    hf.decoder = decoders.WordPiece()
    tok = Tokenizer(hf)
    ids = [2, 0, 1, 2, 1]
    assert tok.decode(ids, skip_special_tokens=False) == "hi [A] [B] hi [B]"
    spaced = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(spaced, ids)) == "hi [A] [B] hi [B]"
    joined = IncrementalDetokenizer(
        tok, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert "".join(_stream(joined, ids)) == "hi [A][B] hi [B]"
    # with the special tokens skipped the flag changes nothing (vLLM's)
    skip = IncrementalDetokenizer(tok, spaces_between_special_tokens=False)
    assert "".join(_stream(skip, ids)) == tok.decode(ids)


# ---- the LLM API over the real tiny engine -----------------------------------------------------
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, device="cpu", compile=False, max_batch=4, max_model_len=256, progress=False)


def test_llm_generate_and_stream_keep_special_tokens(llm: LLM) -> None:
    kept = llm.generate([PROMPT], SamplingParams(**STEER, skip_special_tokens=False))[0]
    skipped = llm.generate([PROMPT], SamplingParams(**STEER))[0]
    assert kept.token_ids == skipped.token_ids
    pairs = zip(kept.token_ids, kept.token_ids[1:])
    assert any(a in (3, 4) and b in (3, 4) for a, b in pairs)  # two special tokens side by side
    tok = llm.tokenizer
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)
    assert USER + ASSISTANT in kept.text
    assert skipped.text == tok.decode(kept.token_ids) and USER not in skipped.text
    params = SamplingParams(**STEER, skip_special_tokens=False)
    assert "".join(o.new_text for o in llm.generate_stream(PROMPT, params)) == kept.text
    # byte-level: no space between special tokens either way
    joined = SamplingParams(**STEER, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert llm.generate([PROMPT], joined)[0].text == kept.text


def test_llm_stop_string_naming_a_special_token(llm: LLM) -> None:
    ref = llm.generate([PROMPT], SamplingParams(**STEER, skip_special_tokens=False))[0]
    cut = ref.text.index(ASSISTANT)
    r = llm.generate(
        [PROMPT], SamplingParams(**STEER, skip_special_tokens=False, stop=[ASSISTANT])
    )[0]
    assert (r.text, r.finish_reason) == (ref.text[:cut], "stop")
    assert r.token_ids == ref.token_ids[: r.token_ids.index(4) + 1]
    r = llm.generate([PROMPT], SamplingParams(**STEER, stop=[ASSISTANT]))[0]  # skipped: no match
    assert r.finish_reason == "length" and r.token_ids == ref.token_ids


# ---- the server over the real tiny engine ------------------------------------------------------
@pytest.fixture(scope="module")
def url(llm: LLM) -> Iterator[str]:
    a = AsyncEngine(llm.engine)
    with running_server(build_app(a, MODEL)) as base:
        yield base
    a.shutdown()


def _post(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """One choice's text, finish_reason, stop_reason and logprobs (completions: tokens and
    text_offset; chat: tokens), the stream's chunks joined."""
    body = {"model": MODEL, **body}
    with httpx.Client(timeout=120) as http:
        if not body.get("stream"):
            r = http.post(url + route, json=body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            if "message" in c:
                toks = [e["token"] for e in (c["logprobs"] or {}).get("content") or []]
                return dict(text=c["message"]["content"], finish=c["finish_reason"],
                            stop=c["stop_reason"], tokens=toks)  # fmt: skip
            lp = c["logprobs"] or {}
            return dict(text=c["text"], finish=c["finish_reason"], stop=c["stop_reason"],
                        tokens=lp.get("tokens", []), offsets=lp.get("text_offset", []))  # fmt: skip
        out: dict[str, Any] = dict(text="", finish=None, stop=None, tokens=[], offsets=[])
        with http.stream("POST", url + route, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[len("data: ") :])["choices"]:
                    if "delta" in c:
                        out["text"] += c["delta"].get("content") or ""
                        content = (c.get("logprobs") or {}).get("content") or []
                        out["tokens"] += [e["token"] for e in content]
                    else:
                        out["text"] += c["text"]
                        lp = c.get("logprobs") or {}
                        out["tokens"] += lp.get("tokens", [])
                        out["offsets"] += lp.get("text_offset", [])
                    out["finish"] = c["finish_reason"] or out["finish"]
                    if c.get("stop_reason") is not None:
                        out["stop"] = c["stop_reason"]
        if "chat" in route:
            del out["offsets"]
        return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_server_keeps_special_tokens_streamed_as_not(url: str, llm: LLM, chat: bool) -> None:
    ref = llm.generate([PROMPT], SamplingParams(**STEER, skip_special_tokens=False))[0]
    bias = {str(k): v for k, v in STEER["logit_bias"].items()}
    body: dict[str, Any] = {**STEER, "logit_bias": bias, "skip_special_tokens": False}
    if chat:
        # the chat route renders a template: compare with the same prompt's ids through LLM
        route, messages = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
        body.update(messages=messages, logprobs=True)
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_bos=False)
        ref = llm.generate([ids], SamplingParams(**STEER, skip_special_tokens=False))[0]
    else:
        route = "/v1/completions"
        body.update(prompt=PROMPT, logprobs=0)
    assert USER in ref.text
    plain = _post(url, route, {**body, "skip_special_tokens": None})
    assert USER not in plain["text"]
    for stream in (False, True):
        for spaces in (None, False):  # false: the same text (byte-level)
            got = _post(url, route, {**body, "stream": stream,
                                     "spaces_between_special_tokens": spaces})  # fmt: skip
            assert got["text"] == ref.text, (stream, spaces)
            assert "".join(got["tokens"]) == ref.text
            if not chat:  # text_offset indexes each token's text in the text
                pairs = zip(got["offsets"], got["tokens"], strict=True)
                assert [got["text"][o : o + len(t)] for o, t in pairs] == got["tokens"]
        assert got["finish"] == "length" and got["stop"] is None


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_server_stop_string_naming_a_special_token(url: str, llm: LLM, chat: bool) -> None:
    bias = {str(k): v for k, v in STEER["logit_bias"].items()}
    body: dict[str, Any] = {**STEER, "logit_bias": bias, "stop": [ASSISTANT]}
    if chat:
        route, messages = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
        body["messages"] = messages
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_bos=False)
    else:
        route, ids = "/v1/completions", PROMPT
        body["prompt"] = PROMPT
    ref = llm.generate([ids], SamplingParams(**STEER, skip_special_tokens=False))[0]
    assert ASSISTANT in ref.text
    for stream in (False, True):
        got = _post(url, route, {**body, "stream": stream, "skip_special_tokens": False})
        assert (got["text"], got["finish"], got["stop"]) == (
            ref.text[: ref.text.index(ASSISTANT)],
            "stop",
            ASSISTANT,
        ), stream
        got = _post(url, route, {**body, "stream": stream})  # skipped: the string never shows
        assert (got["finish"], got["stop"]) == ("length", None), stream


@pytest.mark.parametrize("field", ["skip_special_tokens", "spaces_between_special_tokens"])
def test_server_refuses_a_non_boolean(url: str, field: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={field: "false"})  # fmt: skip
    assert e.value.body["param"] == field


def test_docs_list_the_fields_as_accepted() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "server.md").read_text(encoding="utf-8")
    refused = doc[doc.index("Refused with a 400 naming the parameter") :]
    refused = refused[: refused.index("## ")]
    assert "skip_special_tokens" not in refused
    assert "spaces_between_special_tokens" not in refused
    assert "`skip_special_tokens`" in doc and "`spaces_between_special_tokens`" in doc
