"""The server's extra endpoints, headers, limits and metrics, over the fake engine of test_server:
/tokenize, /detokenize, /version, /v1/models/{id}, HEAD /health, X-Request-Id, CORS, several
served model names, the concurrency limit, and the vLLM-named metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_utils import BOS, make_tokenizer_dir, running_server
from test_server import MAX_MODEL_LEN, MODEL, FakeEngine, expected

from runtime.async_engine import AsyncEngine
from runtime.server import build_app
from runtime.tokenizer import Tokenizer

ALIAS = "deepseek-ai/DeepSeek-V3.2"
PROMPT = "The quick brown fox jumps over the lazy dog."
C = "/v1/completions"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def engine(tok: Tokenizer) -> FakeEngine:
    return FakeEngine(tok)


@pytest.fixture(scope="module")
def aengine(engine: FakeEngine) -> Iterator[AsyncEngine]:
    a = AsyncEngine(engine)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def url(aengine: AsyncEngine) -> Iterator[str]:
    app = build_app(aengine, [MODEL, ALIAS], cors_origins=["https://ui.example"])
    with running_server(app) as base:
        yield base


def test_tokenize_and_detokenize(url: str, tok: Tokenizer) -> None:
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    # the vocabulary's pieces, as vLLM's (convert_ids_to_tokens), not decoded text: "Ġ" for the
    # space, a split "ö" as its two bytes' characters (decoded one at a time: two U+FFFD)
    assert body["token_strs"][0] == BOS and "".join(body["token_strs"][1:]) == "Hello\u0120world"
    r = httpx.post(url + "/tokenize", json={"prompt": "wörld", "return_token_strs": True})
    assert "".join(r.json()["token_strs"][1:]) == "w\u00c3\u00b6rld"
    r = httpx.post(url + "/tokenize", json={"prompt": "Hi", "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode("Hi", add_bos=False)
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(url + "/tokenize", json={"model": ALIAS, "messages": msgs})
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(msgs), add_bos=False)
    r = httpx.post(url + "/detokenize", json={"tokens": tok.encode("Hello world", add_bos=False)})
    assert r.json() == {"prompt": "Hello world"}
    # a text longer than the context is counted (it is for the client to compare), as vLLM does
    long = "Hello world " * MAX_MODEL_LEN * 8  # long enough for the bound refusing prompts
    for body in ({"prompt": long}, {"messages": [{"role": "user", "content": long}]}):
        r = httpx.post(url + "/tokenize", json=body)
        assert r.status_code == 200 and r.json()["count"] > MAX_MODEL_LEN, r.text
    # bad input names the field
    assert httpx.post(url + "/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == (
        "tokens"
    )
    r = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": msgs})
    assert r.status_code == 400
    r = httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_version_models_and_head_health(url: str) -> None:
    assert isinstance(httpx.get(url + "/version").json()["version"], str)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS  # an id with a slash
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.head(url + "/health")
    assert r.status_code == 200 and r.content == b""


def test_several_served_names(url: str, tok: Tokenizer) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=ALIAS, prompt="Hello", max_tokens=3)
    assert r.model == ALIAS and r.choices[0].text == expected(tok, tok.encode("Hello"), 3)[0]
    with pytest.raises(openai.NotFoundError, match=ALIAS):  # the error lists the served names
        client.completions.create(model="other", prompt="Hello", max_tokens=3)


def test_request_id_header(url: str) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    r = httpx.post(url + C, json=body, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.post(url + C, json=body)
    assert len(r.headers["x-request-id"]) == 32
    r = httpx.post(url + C, json={**body, "model": "nope"}, headers={"X-Request-Id": "e-1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "e-1"  # on errors too
    r = httpx.get(url + "/health", headers={"X-Request-Id": "x" * 500})
    assert r.headers["x-request-id"] != "x" * 500  # over-long ids are replaced, not echoed


def test_cors(url: str, aengine: AsyncEngine) -> None:
    pre = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(url + C, headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = httpx.get(url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    with running_server(build_app(aengine, MODEL)) as base:  # off by default
        r = httpx.get(base + "/health", headers={"Origin": "https://ui.example"})
        assert "access-control-allow-origin" not in r.headers


def test_concurrency_limit(aengine: AsyncEngine, engine: FakeEngine) -> None:
    long = {"model": MODEL, "prompt": list(range(10, 60)), "max_tokens": 60, "ignore_eos": True}
    engine.step_s = 0.01
    try:
        with running_server(build_app(aengine, MODEL, max_concurrent=1)) as base:
            with httpx.stream("POST", base + C, json={**long, "stream": True}, timeout=30) as r:
                lines = r.iter_lines()
                next(lines)  # the first request is generating
                busy = httpx.post(base + C, json={**long, "max_tokens": 1})
                assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
                assert "limit of 1" in busy.json()["error"]["message"]
                assert httpx.get(base + "/health").status_code == 200  # not counted
                list(lines)
            r = httpx.post(base + C, json={**long, "max_tokens": 1})
            assert r.status_code == 200  # a slot is free again once the stream ended
    finally:
        engine.step_s = 0.002
    with pytest.raises(ValueError, match="max_concurrent"):
        build_app(aengine, MODEL, max_concurrent=0)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln[:1] != "#")
    }


def test_vllm_named_metrics(url: str, tok: Tokenizer) -> None:
    label = f'{{model_name="{MODEL}"}}'
    before = _metrics(url)
    ids = tok.encode("Hello world", add_bos=False)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=MODEL, prompt=ids, max_tokens=4)  # "length"
    list(client.completions.create(model=MODEL, prompt=ids, max_tokens=50, stream=True))  # "stop"
    time.sleep(0.05)
    m = _metrics(url)

    def delta(name: str) -> float:
        return m.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f"vllm:prompt_tokens_total{label}") == 2 * len(ids)
    assert delta(f"vllm:generation_tokens_total{label}") == 4 + len(ids) + 1
    length = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    stop = f'vllm:request_success_total{{finished_reason="stop",model_name="{MODEL}"}}'
    assert delta(length) == 1 and delta(stop) == 1
    assert delta(f"vllm:time_to_first_token_seconds_count{label}") == 2
    assert delta(f"vllm:inter_token_latency_seconds_count{label}") == 3 + len(ids)
    assert delta(f"vllm:e2e_request_latency_seconds_count{label}") == 2
    # the engine-side series carry vLLM's engine label: "0" for one engine, as vLLM's
    per_engine = f'{{engine="0",model_name="{MODEL}"}}'
    assert m[f"vllm:kv_cache_usage_perc{per_engine}"] == 0.5  # the fake engine's host usage
    assert f"vllm:num_requests_running{per_engine}" in m
    assert f"vllm:num_requests_waiting{per_engine}" in m
    assert "process_cpu_seconds_total" in m and "python_gc_collections_total" in str(m)
    assert delta("echo_generation_tokens_total") == 4 + len(ids) + 1  # the original names stay


def test_metrics_during_and_after_shutdown_answer_503_with_one_log_line(
    tok: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """A scrape queued while the engine shuts down, and every scrape after, is a 503 (the
    target is down, as /health says) with one short warning in all: each logged a traceback."""
    engine = FakeEngine(tok)
    aengine = AsyncEngine(engine)
    gate, in_step = threading.Event(), threading.Event()
    step = engine.step

    def held_step() -> list:
        in_step.set()
        gate.wait(10)
        return step()

    with running_server(build_app(aengine, MODEL, api_key=None)) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        engine.step = held_step  # type: ignore[method-assign]
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
        threading.Thread(target=lambda: httpx.post(url + C, json=body), daemon=True).start()
        assert in_step.wait(10)  # the loop is in a step: the scrape waits behind it
        scraped: list[httpx.Response] = []
        scrape = threading.Thread(target=lambda: scraped.append(httpx.get(url + "/metrics")))
        scrape.start()
        assert _wait_for(lambda: bool(aengine._commands))
        stop = threading.Thread(target=aengine.shutdown)
        stop.start()
        assert _wait_for(lambda: aengine._stopping)
        gate.set()
        stop.join(10)
        scrape.join(10)
        after = [httpx.get(url + "/metrics") for _ in range(2)]
        assert httpx.get(url + "/health").status_code == 503
    for r in scraped + after:
        assert (r.status_code, r.text) == (503, "engine stopped\n")
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    told = [r for r in caplog.records if r.name == "runtime.server_handlers"]
    assert len(told) == 1 and "shut down" in told[0].getMessage(), told


@pytest.mark.parametrize("dp", [1, 2])
def test_metrics_once_a_multi_rank_engine_failed_answer_503(
    tok: Tokenizer, dp: int, caplog: pytest.LogCaptureFixture
) -> None:
    """``serve --dp/--tp``: once the driver's group failed (a rank gone), a scrape is a 503
    naming nothing more, not a traceback per scrape (dp > 1), nor rank 0's numbers alone as if
    all were well (dp == 1)."""
    from types import SimpleNamespace

    from runtime.distributed.driver import DriverEngine

    fake = FakeEngine(tok)
    inner = SimpleNamespace(
        ctx=SimpleNamespace(rank=0, timeout_s=60.0), engine=fake, dp=dp, metrics=fake.metrics
    )
    driver = DriverEngine(inner)  # type: ignore[arg-type]
    aengine = AsyncEngine(driver)  # type: ignore[arg-type]
    try:
        with running_server(build_app(aengine, MODEL, api_key=None)) as url:
            with driver._lock:  # as a failed step or heartbeat does
                driver._fail(RuntimeError("rank 1 is gone"))
            got = [httpx.get(url + "/metrics") for _ in range(2)]
        assert [(r.status_code, r.text) for r in got] == [(503, "engine stopped\n")] * 2
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        told = [r.getMessage() for r in caplog.records if r.name == "runtime.server_handlers"]
        assert len(told) == 1 and "rank 1 is gone" in told[0], told
    finally:
        aengine.shutdown()
        driver.close()


def _wait_for(cond, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_concurrent_requests_counted_once(url: str) -> None:
    """Parallel non-streamed requests all answered; the e2e histogram counts each once."""
    before = _metrics(url)
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3}
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(httpx.post(url + C, json=body).status_code))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8
    key = f'vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}'
    assert _metrics(url)[key] - before.get(key, 0.0) == 8


# ---- n > 1, a list of prompts, echo ------------------------------------------------------------
def test_n_choices_and_prompt_lists(url: str, tok: Tokenizer) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    a, b = tok.encode("Hello world"), tok.encode("The lazy dog")
    r = client.completions.create(
        model=MODEL, prompt=["Hello world", "The lazy dog"], max_tokens=4, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt-major
    texts = [c.text for c in r.choices]
    assert texts == [expected(tok, a, 4)[0]] * 2 + [expected(tok, b, 4)[0]] * 2
    assert r.usage.prompt_tokens == len(a) + len(b)  # once per prompt, not per choice
    assert r.usage.completion_tokens == 16
    r = client.completions.create(model=MODEL, prompt=[b, b[:2]], max_tokens=3)
    assert [c.text for c in r.choices] == [expected(tok, b, 3)[0], expected(tok, b[:2], 3)[0]]
    # streamed: every chunk names its choice; each choice's text and finish are whole
    two = ["Hello world", "The lazy dog"]
    chunks = list(client.completions.create(model=MODEL, prompt=two, max_tokens=5, n=2,
                                            stream=True))  # fmt: skip
    by = {
        i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)
    }
    assert by == {0: expected(tok, a, 5)[0], 1: expected(tok, a, 5)[0],
                  2: expected(tok, b, 5)[0], 3: expected(tok, b, 5)[0]}  # fmt: skip
    done = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(done) == [0, 1, 2, 3]
    # chat n=3
    msgs = [{"role": "user", "content": "Hi there"}]
    ids = tok.encode(tok.apply_chat_template(msgs), add_bos=False)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=3)
    assert [c.message.content for c in r.choices] == [expected(tok, ids, 4)[0]] * 3
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=3,
                                                 stream=True))  # fmt: skip
    assert {c.choices[0].index for c in chunks if c.choices[0].delta.role} == {0, 1, 2}


def test_echo(url: str, tok: Tokenizer) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ids = tok.encode("Hello world")
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True)
    assert r.choices[0].text == "Hello world" + expected(tok, ids, 3)[0]
    ids2 = tok.encode("lazy dog", add_bos=False)
    r = client.completions.create(model=MODEL, prompt=ids2, max_tokens=3, echo=True)
    assert r.choices[0].text == "lazy dog" + expected(tok, ids2, 3)[0]
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3,
                                            echo=True, stream=True))  # fmt: skip
    assert chunks[0].choices[0].text == "Hello world"
    assert "".join(c.choices[0].text for c in chunks) == "Hello world" + expected(tok, ids, 3)[0]


class _CountedStr(str):
    """A token string that counts how often its length is taken."""

    lens = 0

    def __len__(self) -> int:
        _CountedStr.lens += 1
        return super().__len__()


def test_text_offset_takes_each_token_length_once(
    url: str, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``text_offset`` is a running sum: each token's string is measured once, not once per
    later token (echo with logprobs of a 100K-token prompt, whose tokens go through the same
    sum, took minutes). Checked by counting, on 200 generated tokens, where a sum per token
    measures ~20000 strings."""
    from runtime.server_base import HandlersBase

    real = HandlersBase.token_strings
    monkeypatch.setattr(
        HandlersBase, "token_strings", lambda self, ids: [_CountedStr(t) for t in real(self, ids)]
    )
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 5, add_bos=False)[:50]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 200, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    _CountedStr.lens = 0
    r = httpx.post(url + C, json=body, timeout=30)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert len(tokens) == 200
    assert offsets == [sum(map(str.__len__, tokens[:k])) for k in range(len(tokens))]
    assert _CountedStr.lens <= 2 * len(tokens)


def test_token_id_prompts_decode_with_their_special_tokens(url: str, tok: Tokenizer) -> None:
    """/detokenize and echo of a token-id prompt give its special tokens' text, as vLLM's
    (``tokenizer.decode(ids)``, HF's default skip_special_tokens=False): /tokenize then
    /detokenize returns the BOS it added (echo's logprobs' text_offset counted it already).
    (A generated special token stays skipped, vLLM's skip_special_tokens default.)"""
    ids = tok.encode("Hello world")
    r = httpx.post(url + "/detokenize", json={"tokens": ids})
    assert r.json() == {"prompt": BOS + "Hello world"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)
    assert r.choices[0].text == BOS + "Hello world"


def test_echo_with_max_tokens_0_returns_the_prompt_alone(url: str, tok: Tokenizer) -> None:
    """vLLM's echo with max_tokens 0: the prompt's text and nothing generated, finish_reason
    length, no completion tokens; streamed the same (with logprobs: test_prompt_logprobs.py)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ids = tok.encode("Hello world")
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=0, echo=True)
    assert r.choices[0].text == "Hello world" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=0,
                                            echo=True, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    first = expected(tok, ids, 1)[0]  # the dropped token's text as a stop string: still length
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=0, echo=True,
                                  stop=[first])  # fmt: skip
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("Hello world", "length")
    assert r.choices[0].model_extra.get("stop_reason") is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # without echo: refused
        client.completions.create(model=MODEL, prompt="Hello world", max_tokens=0)
    full = [5] * MAX_MODEL_LEN  # the whole context: no room for the token computed past it
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_MODEL_LEN - 1} tokens here"):
        client.completions.create(model=MODEL, prompt=full, max_tokens=0, echo=True)
    r = client.completions.create(model=MODEL, prompt=full[1:], max_tokens=0, echo=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (MAX_MODEL_LEN - 1, 0)


def test_one_refused_choice_aborts_the_others(url: str, engine: FakeEngine) -> None:
    """The engine refuses the second choice: a 400, and the first one is aborted, not left
    running."""
    before, add = set(engine.aborted), engine.add_request
    calls: list[str] = []

    def flaky_add(rid, ids, params):  # noqa: ANN001, ANN202
        calls.append(rid)
        if len(calls) == 2:
            raise ValueError("the host pool is full")
        return add(rid, ids, params)

    engine.add_request = flaky_add  # type: ignore[method-assign]
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 50, "n": 3, "ignore_eos": True}
        r = httpx.post(url + C, json=body)
    finally:
        engine.add_request = add  # type: ignore[method-assign]
    assert r.status_code == 400 and "host pool is full" in r.json()["error"]["message"]
    assert len(calls) == 2 and calls[0].endswith("-0")
    assert _wait(lambda: calls[0] in set(engine.aborted) - before)
    assert not engine.running


def _wait(cond, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_choice_seeds() -> None:
    from runtime.sampling_params import SamplingParams
    from runtime.server_handlers import Handlers as _Handlers

    choices = _Handlers.choices_of([([1], ""), ([2], "")], SamplingParams(seed=2**63 - 1), 2)
    assert [c.params.seed for c in choices] == [2**63 - 1, -(2**63), 2**63 - 1, -(2**63)]
    assert [c.prompt_index for c in choices] == [0, 0, 1, 1]
    assert [c.params.seed for c in _Handlers.choices_of([([1], "")], SamplingParams(), 2)] == [
        None,
        None,
    ]


# ---- stop_reason, continuous usage -------------------------------------------------------------
def test_stop_reason(url: str, tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    full, _, _ = expected(tok, ids, 40)
    stop = full[8:11]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40}
    r = httpx.post(url + C, json={**body, "stop": ["@@", stop]}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == stop
    stop_id = ids[::-1][3]  # the fake model's 4th output token
    r = httpx.post(url + C, json={**body, "stop_token_ids": [stop_id]}).json()["choices"][0]
    assert r["stop_reason"] == stop_id
    r = httpx.post(url + C, json={**body, "max_tokens": 3}).json()["choices"][0]
    assert r["finish_reason"] == "length" and r["stop_reason"] is None
    r = httpx.post(url + C, json=body).json()["choices"][0]  # EOS
    assert r["finish_reason"] == "stop" and r["stop_reason"] is None
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.completions.create(**body, stop=stop, stream=True))
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_stop_reason_of_a_request_ended_by_an_eos_id(tok: Tokenizer) -> None:
    """vLLM's rule: a choice that ended on the tokenizer's EOS has no stop_reason, even when
    stop_token_ids names it (vLLM checks that EOS first) or its text is a stop string; one that
    ended on another of the engine's EOS ids (generation_config.json may add them, which vLLM
    folds into stop_token_ids) has that id (tests/test_stop_reason_eos.py: end to end)."""
    from runtime.outputs import RequestOutput
    from runtime.sampling_params import SamplingParams

    ids = tok.encode("Hello world")
    eos, other_eos = tok.eos_token_id, ids[-1]
    eos_token_ids = frozenset({eos, other_eos})

    def why(last: int, matched: str | None = None, **fields) -> int | str | None:
        res = RequestOutput(token_ids=[*ids[:-1], last], finish_reason="stop", stop_string=matched)
        return res.stop_reason(SamplingParams(**fields), eos, eos_token_ids)

    text = tok.decode([eos], skip_special_tokens=False)
    assert why(eos) is None and why(eos, text, stop=(text,)) is None
    assert why(eos, stop_token_ids=(eos,)) is None
    assert why(eos, stop_token_ids=(eos,), ignore_eos=True) == eos
    assert why(other_eos) == other_eos
    assert why(other_eos, stop_token_ids=(other_eos,)) == other_eos
    # under ignore_eos that token did not end it as EOS: the stop string did
    text = tok.decode([other_eos])
    assert why(other_eos, text, stop=(text,), ignore_eos=True) == text


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_stop_reason_is_the_stop_string_the_checker_matched(stream: bool) -> None:
    """Without min_tokens too, the stop string that ended a choice is the one the stop checker
    matched in the streamed text, which a SentencePiece-style tokenizer decodes with the prompt
    as context: the output's first token is " world" there, "world" alone. stop_reason was
    found again in the output decoded alone: "world" of the two, none of " world" alone."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "\u2581Hello": 3, "\u2581world": 4}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    raw.add_special_tokens(["<s>", "</s>"])
    sp = Tokenizer(raw, bos_token="<s>", eos_token="</s>")
    assert sp.decode([4]) == "world"  # (the leading space is stripped at a decode's start)
    a = AsyncEngine(FakeEngine(sp))  # its "model" writes the prompt reversed: " world" first
    try:
        with running_server(build_app(a, MODEL)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            for stop in ([" world"], ["world", " world"]):
                kw = dict(model=MODEL, prompt="Hello world", max_tokens=4, stop=stop)
                if stream:
                    *_, last = client.completions.create(**kw, stream=True)
                    c = last.choices[0]
                else:
                    c = client.completions.create(**kw).choices[0]
                assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", " world")
                assert stream or c.text == ""
    finally:
        a.shutdown()


def test_continuous_usage_stats(url: str, tok: Tokenizer) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ids = tok.encode("Hello world")
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5,
                                            stream=True, stream_options=opts))  # fmt: skip
    seen = [c.usage.completion_tokens for c in chunks if c.choices]
    assert (
        seen == sorted(seen)
        and seen[-1] == 5
        and all(c.usage.prompt_tokens == len(ids) for c in chunks)
    )
    plain = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5,
                                           stream=True))  # fmt: skip
    assert all(c.usage is None for c in plain)
