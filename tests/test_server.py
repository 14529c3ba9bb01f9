"""runtime.async_engine and runtime.server over a deterministic fake engine, through real HTTP.

The fake engine implements the Engine API honestly (validation, batching, abort, stop strings,
detokenisation) but its "model" emits the prompt ids reversed, then EOS, one token per step, so
every response is known in advance.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from server_utils import make_tokenizer_dir, running_server

from runtime.async_engine import AsyncEngine
from runtime.engine import StepOutput
from runtime.sampling_params import SamplingParams
from runtime.server import build_app
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer

MODEL = "fake-v32"
MAX_MODEL_LEN = 256


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    out: list[int] = field(default_factory=list)


class FakeEngine:
    """The Engine API over a model that outputs the prompt reversed, then EOS (repeating with
    ``ignore_eos``). Logprob of output token i is ``-i / 10``."""

    def __init__(self, tokenizer: Tokenizer, max_batch: int = 64, step_s: float = 0.002):
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, MODEL, MAX_MODEL_LEN
        self.max_batch, self.step_s = max_batch, step_s
        self.waiting: deque[_Req] = deque()
        self.running: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.fail_steps = 0  # the next n steps raise
        self.steps = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request_id in self.running or any(r.rid == request_id for r in self.waiting):
            raise ValueError(f"request id {request_id!r} is already in use")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt + max_tokens = {total} > max_model_len {self.max_model_len}")
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):  # as runtime.admission.check_request
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, prompt_token_ids)
        self.waiting.append(_Req(request_id, list(prompt_token_ids), params, detok))

    def abort_request(self, request_id: str) -> None:
        known = self.running.pop(request_id, None) is not None
        for r in list(self.waiting):
            if r.rid == request_id:
                self.waiting.remove(r)
                known = True
        if known:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[StepOutput]:
        time.sleep(self.step_s)
        self.steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("simulated engine crash")
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting.popleft()
            self.running[r.rid] = r
        outs = []
        for r in list(self.running.values()):
            cycle = self.cycle(r)
            tok = cycle[len(r.out) % len(cycle)]
            r.out.append(tok)
            text = r.detok.add(tok)
            p = r.params
            reason = None
            if r.detok.stopped or tok in p.stop_token_ids:
                reason = "stop"
            elif tok == self.tokenizer.eos_token_id and not p.ignore_eos:
                reason = "stop"
            elif len(r.out) >= p.max_tokens:
                reason = "length"
            if reason is not None:
                text += r.detok.flush()
                del self.running[r.rid]
            lp = [-(len(r.out) - 1) / 10] if p.logprobs else None
            out = StepOutput(
                r.rid, [tok], lp, text, reason is not None, reason, len(r.prompt), len(r.out)
            )
            out.stop_string = r.detok.stop_string
            outs.append(out)
        return outs

    def cycle(self, r: _Req) -> list[int]:
        """What the "model" outputs for ``r``, repeating: the prompt reversed, then EOS."""
        return r.prompt[::-1] + [self.tokenizer.eos_token_id]

    def metrics(self) -> dict[str, float | list[float]]:
        return {
            "running": float(len(self.running)),
            "waiting": float(len(self.waiting)),
            "tokens_per_s": 123.0,
            "host_pool_usage": 0.5,
            "gpu_pool_usage": 0.25,
            "hit_rate": [0.9, 0.8],
            "recalled_rows_per_step": 12.0,
        }


def expected(tok: Tokenizer, ids: list[int], max_tokens: int, stop: str | None = None):
    """(text, finish_reason, completion_tokens) the fake engine produces for ``ids``."""
    cycle = ids[::-1] + [tok.eos_token_id]
    out = cycle[:max_tokens]
    text = tok.decode(out)
    if stop is not None and stop in text:
        n = next(i for i in range(1, len(out) + 1) if stop in tok.decode(out[:i]))
        return text[: text.index(stop)], "stop", n
    return text, ("stop" if len(cycle) <= max_tokens else "length"), len(out)


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def engine(tok: Tokenizer) -> Iterator[FakeEngine]:
    yield FakeEngine(tok)


@pytest.fixture(scope="module")
def aengine(engine: FakeEngine) -> Iterator[AsyncEngine]:
    a = AsyncEngine(engine)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def url(aengine: AsyncEngine) -> Iterator[str]:
    with running_server(build_app(aengine, MODEL, api_key=None)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _wait_for(cond, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


PROMPT = "The quick brown fox jumps over the lazy dog."


# ---- completions and chat through the openai client --------------------------------------------
def test_completion(client: openai.OpenAI, tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    text, reason, n = expected(tok, ids, 5)
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 5)
    assert r.usage.total_tokens == len(ids) + 5 and r.model == MODEL
    assert r.object == "text_completion"


def test_completion_token_ids_until_eos_with_logprobs(client: openai.OpenAI, tok: Tokenizer):
    ids = tok.encode("Hello world", add_bos=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=50, logprobs=0)
    text, reason, n = expected(tok, ids, 50)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ids) + 1  # the reversed prompt, then EOS
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([-i / 10 for i in range(len(ids) + 1)])
    assert "".join(lp.tokens[:-1]) == text  # the last token is EOS (special, not in the text)


def test_completion_stop_string_and_extensions(client: openai.OpenAI, tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    full, _, _ = expected(tok, ids, 40)
    stop = full[8:11]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=[stop, "@@"])
    text, reason, n = expected(tok, ids, 40, stop)
    assert r.choices[0].text == text and reason == r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == n < 40
    # top_k / ignore_eos are extensions, passed in the body.
    short = tok.encode("Hi", add_bos=False)
    r = client.completions.create(
        model=MODEL,
        prompt=short,
        max_tokens=7,
        temperature=0,
        extra_body={"top_k": 3, "ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7


def test_completion_stream(client: openai.OpenAI, tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text, reason, _ = expected(tok, ids, 12)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == reason and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_chat(client: openai.OpenAI, tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tok.encode(tok.apply_chat_template(msgs), add_bos=False)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, logprobs=True)
    text, reason, n = expected(tok, ids, 6)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason and r.usage.prompt_tokens == len(ids)
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(
        [-i / 10 for i in range(6)]
    )
    # Without max_tokens the completion may use the rest of the context: here it ends at EOS.
    r = client.chat.completions.create(model=MODEL, messages=msgs)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(ids) + 1


def test_chat_logprobs_bytes_are_the_tokens_bytes(client: openai.OpenAI) -> None:
    """A token ending partway through a UTF-8 character has its own bytes in logprobs (OpenAI's),
    not U+FFFD's: the test tokenizer writes "日" as three byte tokens, which the fake model
    writes back reversed."""
    msgs = [{"role": "user", "content": "日"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, logprobs=True)
    got = [bytes(e.bytes) for e in r.choices[0].logprobs.content]
    assert "日".encode() in b"".join(reversed(got)), got
    assert "\ufffd".encode() not in got


def test_chat_stream(client: openai.OpenAI, tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Tell me about the lazy dog"}]
    ids = tok.encode(tok.apply_chat_template(msgs), add_bos=False)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected(tok, ids, 9)[0]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_sse_wire_format(url: str) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_sse_error_event_then_done(url: str, engine: FakeEngine) -> None:
    """A stream that fails ends with its error event, then ``data: [DONE]`` (vLLM's framing), so
    a raw SSE reader sees the stream end rather than a closed connection."""
    engine.fail_steps = 1
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert events[-3].startswith('data: {"error"'), events


def test_32_concurrent_streams(url: str, tok: Tokenizer) -> None:
    prompts = [f"Hello {i} world number {i * 7}" for i in range(32)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, stream=True
        )
        text, reason = "", None
        async for c in stream:
            text += c.choices[0].text
            reason = c.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(main())
    for p, (text, reason) in zip(prompts, results, strict=True):
        exp_text, exp_reason, _ = expected(tok, tok.encode(p), 20)
        assert (text, reason) == (exp_text, exp_reason)


def test_models_health_metrics(client: openai.OpenAI, url: str) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(url + "/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(lines['echo_gpu_pool_hit_rate{layer="0"}']) == 0.9
    assert float(lines['echo_gpu_pool_hit_rate{layer="1"}']) == 0.8
    assert float(lines["echo_recalled_rows_per_step"]) == 12.0
    assert float(lines["echo_tokens_per_second"]) > 0  # the server's own windowed rate
    assert float(lines["echo_generation_tokens_total"]) >= 2
    assert float(lines["echo_request_latency_seconds_count"]) >= 1
    for name in (
        "echo_running_requests",
        "echo_waiting_requests",
        "echo_host_pool_usage",
        "echo_gpu_pool_usage",
    ):
        assert name in lines


# ---- bad input: OpenAI-style 4xx, the server stays up ------------------------------------------
def _post(url: str, path: str, body: object, **kw: object) -> httpx.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.post(url + path, content=data, headers=headers, timeout=10)


C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        (C, "{not json", 400, None),
        (C, "[1, 2]", 400, None),
        (C, {"prompt": "Hello"}, 400, "model"),
        (C, {**OK_C, "temperature": "hot"}, 400, "temperature"),
        (C, {**OK_C, "max_tokens": "5"}, 400, "max_tokens"),
        (C, {**OK_C, "max_tokens": 2.5}, 400, "max_tokens"),
        (C, {**OK_C, "stream": "yes"}, 400, "stream"),
        (C, {**OK_C, "prompt": ["a", 3]}, 400, "prompt"),
        (C, {**OK_C, "prompt": [[]]}, 400, "prompt"),
        (C, {**OK_C, "prompt": [[1, 2], "a"]}, 400, "prompt"),
        (C, {**OK_C, "stop": 3}, 400, "stop"),
        (C, {**OK_C, "seed": True}, 400, "seed"),
        (C, {**OK_C, "temperature": -1}, 400, "temperature"),
        (C, {**OK_C, "top_p": 0}, 400, "top_p"),
        (C, {**OK_C, "top_k": -2}, 400, "top_k"),
        (C, {**OK_C, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (CHAT, {**OK_CHAT, "stream": False, "stream_options": {"include_usage": False}}, 400,
         "stream_options"),  # fmt: skip
        (C, {**OK_C, "max_tokens": 0}, 400, "max_tokens"),
        (C, {**OK_C, "stop": [""]}, 400, "stop"),
        (C, {**OK_C, "stop": ""}, 400, "stop"),  # (was read as no stop)
        (C, {**OK_C, "n": 0}, 400, "n"),
        (C, {**OK_C, "n": 65}, 400, "n"),  # over MAX_CHOICES
        (C, {**OK_C, "best_of": 65}, 400, "best_of"),  # its candidates over it (named n)
        (CHAT, {**OK_CHAT, "prompt_logprobs": 21}, 400, "prompt_logprobs"),  # over the cap
        (C, {**OK_C, "logprobs": 21}, 400, "logprobs"),  # over the cap of 20
        (C, {**OK_C, "logprobs": -1}, 400, "logprobs"),
        (C, {**OK_C, "presence_penalty": 2.5}, 400, "presence_penalty"),
        (C, {**OK_C, "frequency_penalty": "x"}, 400, "frequency_penalty"),
        (C, {**OK_C, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (C, {**OK_C, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        (C, {**OK_C, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # "²".isdigit() is True
        (C, {**OK_C, "logit_bias": {"100000": 1}}, 400, "logit_bias"),  # over the vocab
        (C, {**OK_C, "logit_bias": {"5": 500}}, 400, "logit_bias"),
        (C, {**OK_C, "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias"),  # one token twice
        (C, {**OK_C, "min_p": -0.1}, 400, "min_p"),
        (C, {**OK_C, "min_tokens": 3}, 400, "min_tokens"),  # over max_tokens = 2
        (CHAT, {**OK_CHAT, "min_tokens": 1.5}, 400, "min_tokens"),
        (C, {**OK_C, "model": "gpt-4"}, 404, "model"),
        (C, {**OK_C, "prompt": []}, 400, "prompt"),
        (C, {**OK_C, "prompt": [10**9]}, 400, "prompt"),
        (C, {**OK_C, "prompt": "word " * 300}, 400, "prompt"),  # over the context
        (C, {**OK_C, "max_tokens": 255}, 400, "prompt"),  # prompt + max_tokens over the context
        (C, {**OK_C, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),  # over the vocab
        # (these two reached the decode step and failed every request in the batch with a 500)
        (CHAT, {**OK_CHAT, "min_tokens": 1, "stop_token_ids": [600]}, 400, "stop_token_ids"),
        (CHAT, {**OK_CHAT, "top_k": 2**63}, 400, "top_k"),
        (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 3}]}, 400, "messages"),
        (CHAT, {**OK_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        (CHAT, {**OK_CHAT, "messages": []}, 400, "messages"),
        (CHAT, {**OK_CHAT, "messages": "hi"}, 400, "messages"),
        (CHAT, {**OK_CHAT, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
        (CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
        (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (CHAT, {**OK_CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
        (CHAT, {**OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (CHAT, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
        (CHAT, {**OK_CHAT, "model": "nope"}, 404, "model"),
    ],
)
def test_bad_input(url: str, path: str, body: object, status: int, param: str | None) -> None:
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param is not None and status == 400 and param not in ("messages", "prompt"):
        assert param in err["message"]  # the message names the field
    assert "None" not in err["message"]  # (JSON's null: SamplingParams' "or None" misled)


def test_json_sent_as_a_form_names_the_content_type(url: str) -> None:
    # curl -d without -H sends application/x-www-form-urlencoded: the body is a JSON object, so
    # "must be a JSON object" named the wrong problem
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(url + C, content=json.dumps(OK_C), headers=form, timeout=10)
    assert r.status_code == 400, r.text
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    # no Content-Type at all (requests.post(data=json.dumps(...))): the same 400, or, on a
    # FastAPI that parses such bodies, the request served
    r = httpx.post(url + C, content=json.dumps(OK_C), timeout=10)
    assert r.status_code == 200 or "got no Content-Type" in r.json()["error"]["message"], r.text
    # a JSON type with parameters or a +json suffix still parses
    for ctype in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = httpx.post(url + C, content=json.dumps(OK_C), headers={"content-type": ctype})
        assert r.status_code == 200, r.text
    r = _post(url, C, "[1, 2]")  # JSON, not an object: said so as before
    assert "must be a JSON object" in r.json()["error"]["message"]


def test_empty_body_is_named(url: str) -> None:
    # (it said "request body must be a JSON object: Field required"), whatever its Content-Type
    form = {"content-type": "application/x-www-form-urlencoded"}
    for path in (C, CHAT):
        r = _post(url, path, "")
        assert r.status_code == 400, r.text
        assert "body is empty" in r.json()["error"]["message"]
        r = httpx.post(url + path, content=b"", headers=form, timeout=10)
        assert "body is empty" in r.json()["error"]["message"], r.text


def test_context_error_code_and_server_survives(url: str, client: openai.OpenAI) -> None:
    r = _post(url, C, {**OK_C, "max_tokens": 255})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 300)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert httpx.get(url + "/nope").json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].text


def test_extra_fields_ignored_and_nulls_are_defaults(url: str) -> None:
    body = {**OK_C, "frobnicate": {"x": 1}, "temperature": None, "top_p": None, "user": "u"}
    r = _post(url, C, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- api key -------------------------------------------------------------------------------------
def test_api_key(aengine: AsyncEngine) -> None:
    with running_server(build_app(aengine, MODEL, api_key="sekrit")) as base:
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        r = httpx.post(base + C, json=OK_C)  # no header, and checked before the body
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(base + C, content="{bad").status_code == 401
        good = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage
        assert [m.id for m in good.models.list().data] == [MODEL]
        assert httpx.get(base + "/health").status_code == 200  # open without a key
        assert httpx.get(base + "/metrics").status_code == 200


# ---- the checkpoint's sampling defaults ---------------------------------------------------------
def test_unset_sampling_fields_take_the_engine_defaults(
    client: openai.OpenAI, engine: FakeEngine, aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A field the request leaves unset takes ``sampling_defaults`` (the checkpoint's
    generation_config.json, as vLLM reads it); one it sets wins, also for chat."""
    seen: list[SamplingParams] = []
    add = engine.add_request
    monkeypatch.setattr(
        engine, "add_request", lambda rid, ids, p: (seen.append(p), add(rid, ids, p))
    )
    defaults = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.1,
                              repetition_penalty=1.1)  # fmt: skip
    monkeypatch.setattr(aengine, "sampling_defaults", defaults)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0, top_p=1)
    msgs = [{"role": "user", "content": "Hi"}]
    client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=2, extra_body={"top_k": 5}
    )
    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    got = [tuple(getattr(p, f) for f in fields) for p in seen]
    assert got == [(0.6, 0.95, 20, 0.1, 1.1), (0.0, 1.0, 20, 0.1, 1.1), (0.6, 0.95, 5, 0.1, 1.1)]


# ---- disconnects and crashes -------------------------------------------------------------------
def _aborted_count(url: str) -> float:
    """``vllm:request_success_total{finished_reason="abort"}`` from /metrics (0 before any)."""
    key = f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}} '
    lines = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_disconnect_mid_stream_aborts(url: str, engine: FakeEngine) -> None:
    body = {
        "model": MODEL,
        "prompt": list(range(10, 110)),
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": True,
    }
    engine.step_s = 0.01  # 1.5 s of generation: far longer than noticing the disconnect takes
    aborted = _aborted_count(url)
    try:
        with httpx.stream("POST", url + C, json=body, timeout=10) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            rid = json.loads(first.removeprefix("data: "))["id"]
        assert _wait_for(lambda: rid in engine.aborted), "the engine never saw abort_request"
        assert rid not in engine.running
        assert _wait_for(lambda: _aborted_count(url) == aborted + 1)  # counted as an abort
    finally:
        engine.step_s = 0.002


def test_disconnect_non_streaming_aborts(url: str, engine: FakeEngine) -> None:
    before = set(engine.aborted)
    body = {"model": MODEL, "prompt": list(range(10, 110)), "max_tokens": 150, "ignore_eos": True}
    engine.step_s = 0.01
    try:
        # Control: a client that waits the whole ~1.5 s gets its answer (the polling does not
        # mistake a quiet connection for a gone one).
        r = httpx.post(url + C, json=body, timeout=30)
        assert r.json()["choices"][0]["finish_reason"] == "length" and set(engine.aborted) == before
        aborted = _aborted_count(url)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + C, json=body, timeout=0.3)
        assert _wait_for(lambda: set(engine.aborted) - before, timeout_s=5)
        assert not engine.running
        assert _wait_for(lambda: _aborted_count(url) == aborted + 1)  # counted as an abort
    finally:
        engine.step_s = 0.002


def test_engine_crash_fails_requests_and_keeps_serving(
    client: openai.OpenAI, engine: FakeEngine, url: str
) -> None:
    engine.fail_steps = 1
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    engine.fail_steps = 1
    with pytest.raises(openai.APIError, match="generation failed"):
        list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True))
    assert not engine.running and not engine.waiting  # failed requests were aborted
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert httpx.get(url + "/health").status_code == 200


def _finished_count(url: str, reason: str) -> float:
    """``vllm:request_success_total{finished_reason=reason}`` from /metrics (0 before any)."""
    key = f'vllm:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}} '
    lines = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_engine_crash_counts_every_choice_as_an_error(
    url: str, engine: FakeEngine, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash fails each of the ``n`` choices: /metrics counts all of them, streamed or not (the
    stream used to end at the first choice's error event and count only that one)."""
    step = engine.step

    def crash_once_all_three_are_in() -> list[StepOutput]:
        if len(engine.waiting) + len(engine.running) == 3:
            monkeypatch.setattr(engine, "step", step)
            raise RuntimeError("simulated engine crash")
        return step()

    monkeypatch.setattr(engine, "step", crash_once_all_three_are_in)
    monkeypatch.setattr(engine, "recover", lambda: None, raising=False)
    errors, e2e = _finished_count(url, "error"), _e2e_count(url)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "n": 3, "stream": stream}
    r = httpx.post(url + C, json=body, timeout=10)
    assert r.status_code == (200 if stream else 500)  # streamed: an error event after the 200
    assert _finished_count(url, "error") - errors == 3
    assert _e2e_count(url) - e2e == 3


def _e2e_count(url: str) -> float:
    key = f'vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}} '
    lines = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


# ---- AsyncEngine directly ----------------------------------------------------------------------
def test_async_engine_contract(tok: Tokenizer) -> None:
    engine = FakeEngine(tok, step_s=0.001)
    ae = AsyncEngine(engine)

    async def main() -> None:
        with pytest.raises(ValueError, match="empty"):
            await ae.generate("a", [], SamplingParams())
        ids = tok.encode("Hello world", add_bos=False)
        stream = await ae.generate("b", ids, SamplingParams(max_tokens=4))
        # (a long request: a short one may have finished, freeing its id, by the second add)
        long = await ae.generate("dup", ids, SamplingParams(max_tokens=200, ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            await ae.generate("dup", ids, SamplingParams())
        await long.aclose()
        outs = [o async for o in stream]
        assert [o.new_token_ids[0] for o in outs] == ids[::-1][:4]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        # Early close aborts; an explicit abort ends the stream with "abort".
        stream = await ae.generate("c", ids, SamplingParams(max_tokens=100, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()
        stream = await ae.generate("d", ids, SamplingParams(max_tokens=100, ignore_eos=True))
        ae.abort("d")
        last = [o async for o in stream][-1]
        assert last.finish_reason == "abort" and last.prompt_tokens == len(ids)
        assert (await ae.metrics())["gpu_pool_usage"] == 0.25
        # shutdown ends open streams with "abort" and refuses new requests.
        stream = await ae.generate("e", ids, SamplingParams(max_tokens=200, ignore_eos=True))
        await asyncio.get_running_loop().run_in_executor(None, ae.shutdown)
        assert [o async for o in stream][-1].finish_reason == "abort"
        with pytest.raises(RuntimeError, match="shut down"):
            await ae.generate("f", ids, SamplingParams())

    asyncio.run(main())
    assert _wait_for(lambda: {"c", "d"} <= set(engine.aborted))
    assert not ae.is_alive


def test_a_malformed_async_request_fails_only_its_caller(tok: Tokenizer) -> None:
    """A request id that is not a str, or params that are not SamplingParams, is a TypeError
    to the caller; the requests in flight and the ones added in the same tick run on (the
    unhashable id failed on the loop thread: its generate() hung and everyone else ended with
    "error"). params=None takes the engine's defaults, as LLM.generate does."""
    engine = FakeEngine(tok, step_s=0.001)
    ae = AsyncEngine(engine)
    ids = tok.encode("Hello world", add_bos=False)

    async def main() -> None:
        victim = await ae.generate("v", ids, SamplingParams(max_tokens=60, ignore_eos=True))
        first = await victim.__anext__()
        bad = [
            asyncio.ensure_future(ae.generate(["x"], ids, SamplingParams())),  # type: ignore[arg-type]
            asyncio.ensure_future(ae.generate("p", ids, {"max_tokens": 3})),  # type: ignore[arg-type]
        ]
        good = asyncio.ensure_future(ae.generate("g", ids, None))
        done, pending = await asyncio.wait([*bad, good], timeout=10)
        assert not pending
        for f, what in zip(bad, ("request_id must be a str", "params must be a SamplingParams")):
            with pytest.raises(TypeError, match=what):
                f.result()
        outs = [o async for o in good.result()]
        assert outs[-1].finish_reason == "stop" and outs[-1].completion_tokens == len(ids) + 1
        rest = [o async for o in victim]
        assert rest[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in [first, *rest]) == 60

    asyncio.run(main())
    ae.shutdown()


def test_a_stream_whose_request_ended_never_aborts_a_new_request_of_its_id(tok: Tokenizer) -> None:
    """Aborted by id and its final output unread, a stream still looks open; closing or dropping
    it then must not abort the request that reuses the id (its abort is bound to its own queue)."""
    engine = FakeEngine(tok, step_s=0.001)
    ae = AsyncEngine(engine)
    ids = tok.encode("Hello world", add_bos=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main() -> None:
        old = await ae.generate("job", ids, params)
        await old.__anext__()
        ae.abort("job")
        assert _wait_for(lambda: "job" in engine.aborted)
        new = await ae.generate("job", ids, params)
        await old.aclose()
        del old
        gc.collect()
        outs = [o async for o in new]
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == 40

    asyncio.run(main())
    ae.shutdown()
