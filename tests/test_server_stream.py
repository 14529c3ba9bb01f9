"""Streaming as an OpenAI / vLLM client sees it, over the fake engine of test_server: split UTF-8
characters and stop strings across token boundaries, n choices, ``stream_options``, disconnects
of n choices, and an error raised after the stream started."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_utils import make_tokenizer_dir, running_server
from test_server import MODEL, FakeEngine, _finished_count, _wait_for

from runtime.async_engine import AsyncEngine
from runtime.server import build_app
from runtime.server_base import HandlersBase
from runtime.tokenizer import Tokenizer

C, CHAT = "/v1/completions", "/v1/chat/completions"
# outside the tokenizer's ASCII training text: each character is 2-4 byte tokens
WIDE = "a\u00e9b\u20acc\U0001f600d \u00e9\u20ac\U0001f600 end"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def engine(tok: Tokenizer) -> FakeEngine:
    return FakeEngine(tok)


@pytest.fixture(scope="module")
def url(engine: FakeEngine) -> Iterator[str]:
    a = AsyncEngine(engine)
    with running_server(build_app(a, MODEL)) as base:
        yield base
    a.shutdown()


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)


def events(url: str, path: str, body: dict) -> list[str]:
    """The raw SSE ``data:`` payloads of a streamed request, ``[DONE]`` included."""
    with httpx.stream("POST", url + path, json={"model": MODEL, **body}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    assert raw.endswith("\n\n"), raw[-200:]
    return [e.removeprefix("data: ") for e in raw.split("\n\n")[:-1]]


def test_split_utf8_and_stop_strings_stream_as_the_whole_text(
    client: openai.OpenAI, tok: Tokenizer
) -> None:
    """The fake model echoes the prompt ids reversed, so it generates WIDE's ids, whose wide
    characters are split over byte tokens: no delta has U+FFFD, the deltas join to the
    non-streamed text, for n choices, with stop strings that span those tokens."""
    ids = tok.encode(WIDE, add_bos=False)
    assert len(ids) > len(WIDE) + 6 and tok.decode(ids) == WIDE  # the characters are split
    prompt = ids[::-1]
    for stop in (None, ["\u20acc\U0001f600"], ["\U0001f600 e", "zz"], ["\u00e9\u20ac"]):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=len(ids), n=2, stop=stop)
        whole = client.completions.create(**kw)
        texts, finishes, usage = ["", ""], [[], []], None
        opts = {"include_usage": True}
        for ch in client.completions.create(**kw, stream=True, stream_options=opts):
            if not ch.choices:
                usage = ch.usage
                continue
            (c,) = ch.choices
            assert "\ufffd" not in c.text, (stop, c.text)
            texts[c.index] += c.text
            finishes[c.index] += [c.finish_reason] if c.finish_reason else []
        cut = WIDE[: min([WIDE.find(s) for s in stop or () if s in WIDE] or [len(WIDE)])]
        for c in whole.choices:
            assert (c.text, texts[c.index]) == (cut, cut), stop
            assert finishes[c.index] == [c.finish_reason], stop
        assert usage == whole.usage, stop  # the stop ended the request at the same token


def test_include_usage_and_continuous_usage_stats(url: str) -> None:
    """vLLM: the usage chunk (empty choices) comes only with ``include_usage``, and
    ``continuous_usage_stats`` adds usage to every chunk only with it too."""
    chat = {"max_tokens": 4, "n": 2, "stream": True}
    body, messages = {**chat, "prompt": "Hello world"}, [{"role": "user", "content": "Hi"}]
    for opts, every, last in [
        (None, False, False),
        ({"include_usage": False}, False, False),
        ({"continuous_usage_stats": True}, False, False),
        ({"include_usage": False, "continuous_usage_stats": True}, False, False),
        ({"include_usage": True}, False, True),
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    ]:
        for path, b in [(C, body), (CHAT, {**chat, "messages": messages})]:
            got = events(url, path, {**b, "stream_options": opts} if opts else b)
            assert got[-1] == "[DONE]"
            chunks = [json.loads(e) for e in got[:-1]]
            tail = chunks[-1]
            assert (tail["choices"] == [] and tail.get("usage") is not None) == last, (opts, path)
            body_chunks = chunks[:-1] if last else chunks
            assert all((c.get("usage") is not None) == every for c in body_chunks), (opts, path)


@pytest.mark.parametrize("path", [C, CHAT], ids=["completions", "chat"])
def test_an_error_after_the_stream_started_is_an_sse_error_event(
    url: str, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A handler bug raised while chunks are made (after chat's first chunk went out) ends the
    stream with an error event and ``[DONE]``, not a cut connection; the request is aborted,
    and /metrics counts its choice as an error (it counted an abort)."""
    calls = []
    errors, aborts = _finished_count(url, "error"), _finished_count(url, "abort")

    def broken(self: HandlersBase, token_id: int) -> str:
        calls.append(token_id)
        raise RuntimeError("token string bug")

    monkeypatch.setattr(HandlersBase, "token_string", broken)
    body = {"max_tokens": 50, "ignore_eos": True, "stream": True}
    body |= {"prompt": "Hello world", "logprobs": 0} if path == C else {"messages": [
        {"role": "user", "content": "Hi"}], "logprobs": True}  # fmt: skip
    got = events(url, path, body)
    assert calls and got[-1] == "[DONE]", got
    err = json.loads(got[-2])["error"]
    assert (err["message"], err["type"]) == ("internal server error", "server_error"), err
    assert _wait_for(lambda: not engine.running and not engine.waiting)
    assert _wait_for(lambda: _finished_count(url, "error") == errors + 1)
    assert _finished_count(url, "abort") == aborts
    # the openai client raises it as an API error
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    create = client.completions.create if path == C else client.chat.completions.create
    kw = {k: v for k, v in body.items() if k not in ("stream", "ignore_eos")}
    with pytest.raises(openai.APIError, match="internal server error"):
        list(create(model=MODEL, stream=True, extra_body={"ignore_eos": True}, **kw))


def test_a_disconnect_aborts_every_choice(url: str, engine: FakeEngine) -> None:
    """A client leaving a stream of n=3 choices aborts all three in the engine."""
    body = {"model": MODEL, "prompt": list(range(10, 110)), "max_tokens": 150, "n": 3,
            "ignore_eos": True, "stream": True}  # fmt: skip
    engine.step_s = 0.01  # 1.5 s of generation: far longer than noticing the disconnect takes
    try:
        with httpx.stream("POST", url + C, json=body, timeout=10) as r:
            rid = json.loads(next(r.iter_lines()).removeprefix("data: "))["id"]
        assert _wait_for(lambda: {f"{rid}-{j}" for j in range(3)} <= set(engine.aborted))
        assert not engine.running and not engine.waiting
    finally:
        engine.step_s = 0.002
