"""The server's robustness fixes and limits, over the fake engine of test_server, through HTTP:
lone surrogates, tokenising off the event loop, the early length check and the body cap, streamed
text_offset, graceful SIGTERM, the start-up line, the API key from the environment, the
decaying tokens/s, every unsupported parameter refused, and the context limit at its edge."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from server_utils import make_tokenizer_dir, running_server
from test_server import MAX_MODEL_LEN, MODEL, FakeEngine

from runtime.async_engine import AsyncEngine
from runtime.server import DEFAULT_MAX_BODY_BYTES, build_app
from runtime.server_lifecycle import DrainingServer, server_url, startup_summary
from runtime.tokenizer import Tokenizer

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


class SlowTokenizer:
    """A tokenizer whose ``encode`` takes ``delay_s`` and is counted: what a 20 MB prompt does."""

    def __init__(self, tok: Tokenizer, delay_s: float = 0.0) -> None:
        self._tok, self.delay_s, self.encodes = tok, delay_s, 0

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.encodes += 1
        time.sleep(self.delay_s)
        return self._tok.encode(text, add_bos)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def engine(tok: Tokenizer) -> FakeEngine:
    e = FakeEngine(tok)
    e.tokenizer = SlowTokenizer(tok)
    return e


@pytest.fixture(scope="module")
def aengine(engine: FakeEngine) -> Iterator[AsyncEngine]:
    a = AsyncEngine(engine)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def url(aengine: AsyncEngine) -> Iterator[str]:
    with running_server(build_app(aengine, MODEL)) as base:
        yield base


def _post(url: str, path: str, body: object, client: httpx.Client | None = None) -> httpx.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    post = (client or httpx).post
    return post(url + path, content=data, headers={"content-type": "application/json"}, timeout=30)


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    return err["message"]


# ---- lone surrogates: 400 naming the field, keep-alive connection intact -------------------------
def test_lone_surrogate_is_a_400_and_the_connection_survives(url: str, tok: Tokenizer) -> None:
    with httpx.Client() as client:
        raw = '{"model": "M", "prompt": "a\\ud83d", "max_tokens": 2}'.replace("M", MODEL)
        assert "surrogate" in _error(_post(url, C, raw, client), 400, "prompt")
        raw = (
            '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udc00"}]}'
        )
        msg = _error(_post(url, CHAT, raw % MODEL, client), 400, "messages")
        assert "messages[0].content" in msg and "surrogate" in msg
        assert _post(url, C, OK_C, client).status_code == 200  # same connection, still served
        # in a list of prompts, the message says which one (index 0 of prompt[1], not prompt)
        raw = json.dumps({**OK_C, "prompt": ["ok", "\ud83d"]})  # (ASCII: the escape is sent)
        assert "prompt[1] contains" in _error(_post(url, C, raw, client), 400, "prompt")
        # in a tool, tools is named (it was messages, at an index of the rendered prompt)
        tool = {"type": "function", "function": {"name": "f", "description": "\ud83d"}}
        raw = json.dumps({**OK_CHAT, "tools": [tool]})
        assert "tools[0] contains a lone" in _error(_post(url, CHAT, raw, client), 400, "tools")
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("x\ud83d")


# ---- tokenising off the loop, the early length check, the body cap -----------------------------
def test_tokenising_does_not_block_health(url: str, engine: FakeEngine) -> None:
    engine.tokenizer.delay_s = 1.5
    try:
        t = threading.Thread(target=lambda: _post(url, C, OK_C))
        t.start()
        time.sleep(0.2)  # the completion is tokenising now
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 0.8  # answered during the 1.5 s encode, not after it
        t.join()
    finally:
        engine.tokenizer.delay_s = 0.0


def test_prompt_far_over_the_context_is_refused_without_tokenising(
    url: str, engine: FakeEngine
) -> None:
    before = engine.tokenizer.encodes
    r = _post(url, C, {**OK_C, "prompt": "x" * 200_000})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    _error(r, 400, "prompt")
    assert engine.tokenizer.encodes == before
    assert _post(url, C, {**OK_C, "prompt": "word " * 300}).status_code == 400  # tokenised one
    assert engine.tokenizer.encodes == before + 1


def test_body_size_cap(aengine: AsyncEngine) -> None:
    assert DEFAULT_MAX_BODY_BYTES is not None  # a cap by default
    with running_server(build_app(aengine, MODEL, max_body_bytes=2000)) as base:
        big = json.dumps({**OK_C, "prompt": "a" * 3000})
        r = _post(base, C, big)
        assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 500):
                yield big[i : i + 500].encode()

        r = httpx.post(base + C, content=chunks(), timeout=10)
        assert r.status_code == 413
        assert _post(base, C, OK_C).status_code == 200
        ok = json.dumps(OK_C)
        small_chunks = (ok[i : i + 7].encode() for i in range(0, len(ok), 7))
        json_type = {"content-type": "application/json"}
        r = httpx.post(base + C, content=small_chunks, headers=json_type, timeout=10)
        assert r.status_code == 200, r.text
    with pytest.raises(ValueError, match="max_body_bytes"):
        build_app(aengine, MODEL, max_body_bytes=0)


# ---- streamed text_offset == non-streamed ------------------------------------------------------
def test_streamed_text_offset_equals_non_streamed(
    tok: Tokenizer, url: str, engine: FakeEngine
) -> None:
    # The fake model echoes the prompt reversed: feed it reversed ids so it writes text whose
    # non-ASCII characters are split over byte tokens, which the stream holds back.
    out_ids = tok.encode("a\u00e9b \u00fc\u00fc \u4e16x", add_bos=False)
    body = {"model": MODEL, "prompt": out_ids[::-1], "max_tokens": len(out_ids), "logprobs": 0}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    whole = client.completions.create(**body).choices[0].logprobs
    chunks = list(client.completions.create(**body, stream=True))
    streamed = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert any(c.choices[0].text == "" and c.choices[0].logprobs.tokens for c in chunks)  # held
    assert streamed == whole.text_offset
    lengths = [len(t) for t in whole.tokens]
    assert whole.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


# ---- graceful shutdown -------------------------------------------------------------------------
@pytest.fixture
def draining(tok: Tokenizer) -> Iterator[tuple[str, DrainingServer, FakeEngine]]:
    """A DrainingServer (grace 1 s) over its own slow fake engine, in a thread; at most two
    generation requests at once, so the test's two in-flight ones fill the limit."""
    engine = FakeEngine(tok, step_s=0.01)
    ae = AsyncEngine(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build_app(ae, MODEL, max_concurrent=2)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = DrainingServer(config, ae, grace_s=1.0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, engine
    finally:
        server.should_exit = True
        thread.join(10)
        ae.shutdown()
        sock.close()


def test_sigterm_stops_admitting_then_aborts_after_the_grace_period(draining) -> None:  # noqa: ANN001
    base, server, engine = draining
    long = {"model": MODEL, "prompt": list(range(10, 60)), "max_tokens": 200, "ignore_eos": True}
    short = {**long, "max_tokens": 10}
    events: list[str] = []
    results: dict[str, httpx.Response] = {}

    def stream() -> None:
        with httpx.stream("POST", base + C, json={**long, "stream": True}, timeout=30) as r:
            events.extend(line for line in r.iter_lines() if line)

    t_long = threading.Thread(target=stream)
    t_long.start()
    time.sleep(0.2)  # the long stream is generating (200 steps of 10 ms = 2 s > the 1 s grace)
    t_short = threading.Thread(target=lambda: results.setdefault("short", _post(base, C, short)))
    t_short.start()
    deadline = time.monotonic() + 5
    while len(engine.running) + len(engine.waiting) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)  # both admitted before the signal
    t0 = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    # not admitted, while the others still run: 503, not the full limit's 429 "retry later"
    r = _post(base, C, OK_C)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 503
    t_short.join(10)
    t_long.join(10)
    assert results["short"].json()["choices"][0]["finish_reason"] == "length"  # within the grace
    assert events[-1] == "data: [DONE]", events[-3:]  # the error event, then the stream's end
    last = json.loads(events[-2].removeprefix("data: "))
    assert "shutting down" in last["error"]["message"], events[-3:]
    assert 0.9 < time.monotonic() - t0 < 1.9  # aborted at the end of the grace, not at max_tokens
    assert not engine.running and not engine.waiting and engine.aborted  # every slot freed
    deadline = time.monotonic() + 5
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.should_exit  # uvicorn is told to exit once drained


def test_sigterm_ends_a_real_server_process(tmp_path: Path) -> None:
    """``serve`` in a child process with a stream in flight: SIGTERM, then exit within the grace."""
    script = tmp_path / "serve_fake.py"
    tests = Path(__file__).parent
    script.write_text(
        f"""
import sys
sys.path.insert(0, {str(tests)!r})
from server_utils import make_tokenizer_dir
from test_server import FakeEngine
from runtime.async_engine import AsyncEngine
from runtime.server import serve
from runtime.tokenizer import Tokenizer
tok = Tokenizer.from_dir(make_tokenizer_dir(__import__("pathlib").Path({str(tmp_path)!r}) / "t"))
serve(AsyncEngine(FakeEngine(tok, step_s=0.05)), "m", port=int(sys.argv[1]), grace_s=0.5)
"""
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cwd = Path(__file__).parent.parent
    proc = subprocess.Popen(
        [sys.executable, str(script), str(port)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120  # imports torch: slow on a busy machine
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {
            "model": "m",
            "prompt": list(range(10, 60)),
            "max_tokens": 200,  # 10 s of generation
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", base + C, json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            rest = [line for line in lines if line]
        assert "shutting down" in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - t0 < 6  # aborted after the 0.5 s grace, not at max_tokens
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    # the start-up line, with the address (uvicorn names it only when it binds the socket)
    assert f"serving 'm' on http://127.0.0.1:{port}, " in out and "max_model_len 256" in out


# ---- start-up line, API key from the environment, tokens/s -------------------------------------
def test_startup_summary_names_the_real_context() -> None:
    cfg = SimpleNamespace(
        device="cuda", host_tokens=1024, gpu_tokens=256, offload=True, max_batch=8
    )
    from runtime.sampling_params import SamplingParams

    plain = SamplingParams()
    ae = SimpleNamespace(
        engine=SimpleNamespace(config=cfg), max_model_len=1024, sampling_defaults=plain
    )
    line = startup_summary(ae, "tiny", asked_max_len=4096)  # type: ignore[arg-type]
    for part in (
        "'tiny'",
        "device cuda",
        "host pool 1024",
        "GPU pool 256",
        "offload on",
        "max_model_len 1024 (asked 4096; limited by the host pool size (--host-tokens))",
    ):
        assert part in line, line
    assert "asked" not in startup_summary(ae, "tiny", asked_max_len=1024)  # type: ignore[arg-type]
    assert "serving 'tiny', device" in line  # no address given: none named
    at = startup_summary(ae, "tiny", None, server_url("::1", 8000))  # type: ignore[arg-type]
    assert at.startswith("serving 'tiny' on http://[::1]:8000, device cuda"), at
    with socket.socket() as sock:  # --port 0: the port the socket got
        sock.bind(("127.0.0.1", 0))
        url = server_url("127.0.0.1", 0, sock)
        assert url == f"http://127.0.0.1:{sock.getsockname()[1]}" and not url.endswith(":0")
    assert "prefetch" not in line  # off: not named
    assert "sampling defaults" not in line  # SamplingParams()'s: not named
    ae.sampling_defaults = SamplingParams(temperature=0.6, top_p=0.95)
    assert "sampling defaults temperature=0.6 top_p=0.95 (generation_config.json)" in (
        startup_summary(ae, "tiny", None)  # type: ignore[arg-type]
    )
    lines = {
        "request": "prefetch request (64 rows/request, margin 2)",
        "global": "prefetch global (0.01 rows/context token, at most 512 rows/layer, margin 2)",
    }
    for mode, part in lines.items():
        on = SimpleNamespace(**vars(cfg), prefetch=mode, prefetch_cap=64, prefetch_ratio=0.01,
                             prefetch_margin=2.0)  # fmt: skip
        ae_on = SimpleNamespace(
            engine=SimpleNamespace(config=on), max_model_len=1024, sampling_defaults=plain
        )
        assert part in startup_summary(ae_on, "tiny", None), mode  # type: ignore[arg-type]


def test_context_errors_name_the_flags_to_raise(url: str) -> None:
    """A prompt over the context (a 100K-token one at the default --max-model-len 4096) is told
    which server flag sets the limit, as a text, token-id or chat prompt, with or without
    max_tokens; where the host pool caps it, --host-tokens is named too."""
    note = "(This server's limit: --max-model-len.)"
    long = {"model": MODEL, "prompt": list(range(5, 5 + MAX_MODEL_LEN))}
    for path, body in [
        (C, long),
        (C, {**long, "max_tokens": 4}),
        (C, {**long, "prompt": long["prompt"][:-10], "max_tokens": 20}),
        (C, {**long, "prompt": "word " * 2 * MAX_MODEL_LEN}),
        (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}),
        (C, {**long, "max_tokens": 0, "echo": True}),
    ]:
        r = _post(url, path, body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
        assert err["message"].startswith("This model's maximum context length is ")
        assert err["message"].endswith(note), err["message"]
    from runtime.server_base import HandlersBase

    cfg = SimpleNamespace(host_tokens=1024, max_model_len=4096)
    ae = SimpleNamespace(engine=SimpleNamespace(config=cfg), max_model_len=1024, tokenizer=None)
    h = HandlersBase(ae, [MODEL])  # type: ignore[arg-type]
    assert h.context_note == (
        " (This server's limit: --max-model-len, capped by the host pool size (--host-tokens).)"
    )


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from echo_compile.cli_args import parser
    from echo_compile.serve_args import serve_options

    monkeypatch.setenv("ECHO_COMPILE_API_KEY", "from-env")
    assert serve_options(parser().parse_args(["serve"]))["api_key"] == "from-env"
    args = parser().parse_args(["serve", "--api-key", "flag"])
    assert serve_options(args)["api_key"] == "flag"  # the flag wins
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")  # vLLM's variable: ours first
    assert serve_options(parser().parse_args(["serve"]))["api_key"] == "from-env"
    monkeypatch.delenv("ECHO_COMPILE_API_KEY")  # then vLLM's (it was dropped: no auth at all)
    assert serve_options(parser().parse_args(["serve"]))["api_key"] == "from-vllm"
    monkeypatch.delenv("VLLM_API_KEY")
    assert serve_options(parser().parse_args(["serve"]))["api_key"] is None
    with pytest.raises(ValueError, match="--max-concurrent"):
        serve_options(parser().parse_args(["serve", "--max-concurrent", "0"]))
    for flags, message in (
        (["--max-body-mb", "inf"], "--max-body-mb must be a finite number > 0, got inf"),
        (["--shutdown-grace", "nan"], "--shutdown-grace must be a finite number >= 0, got nan"),
        (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["--port", "-1"], "--port must be in [0, 65535], got -1"),
    ):  # (refused before the model loads; they were tracebacks, the port's after loading)
        with pytest.raises(ValueError, match=re.escape(message)):
            serve_options(parser().parse_args(["serve", *flags]))


def test_tokens_per_second_decays_when_idle(tok: Tokenizer) -> None:
    from runtime.sampling_params import SamplingParams

    ae = AsyncEngine(FakeEngine(tok, step_s=0.001))

    async def run() -> None:
        stream = await ae.generate("r", tok.encode("Hello world"), SamplingParams(max_tokens=3))
        _ = [o async for o in stream]

    try:
        asyncio.run(run())
        now = time.monotonic()
        assert ae.tokens_per_s(now) > 0
        assert ae.tokens_per_s(now + ae.RATE_WINDOW_S + 0.1) == 0.0  # idle for a window: 0
    finally:
        ae.shutdown()


# ---- every unsupported parameter is refused, its neutral value accepted ------------------------
# Listed here, not read from the server's table, so dropping a check fails this test.
UNSUPPORTED_BOTH = [
    ("functions", [{"name": "f"}], None),
    ("function_call", "auto", None),
    ("guided_json", {"type": "object"}, None),
    ("guided_regex", "a+", None),
    ("guided_choice", ["a"], None),
    ("guided_grammar", "root ::= 'a'", None),
    ("structured_outputs", {"json": {}}, None),
    ("use_beam_search", True, False),
    ("length_penalty", 0.5, 1.0),
    ("include_stop_str_in_output", True, False),
    ("return_tokens_as_token_ids", True, False),  # (was silently ignored)
    # vLLM's, silently ignored before
    ("allowed_token_ids", [1, 2], None),
    ("bad_words", ["Hello"], []),
    ("logits_processors", ["pkg.Proc"], []),
]
UNSUPPORTED_COMPLETION = [
    ("suffix", "end", None),
    # chat only (runtime.tool_calls)
    ("tools", [{"type": "function", "function": {"name": "f"}}], []),
    ("tool_choice", "required", "none"),
    ("parallel_tool_calls", True, None),
]
UNSUPPORTED_CHAT = [
    ("best_of", 2, 1),  # completions take it (tests/test_prefill_sharing.py)
    ("audio", {"voice": "x"}, None),
    ("modalities", ["text", "audio"], ["text"]),
    ("prediction", {"type": "content", "content": "x"}, None),
    ("web_search_options", {}, None),
    ("chat_template", "{{ messages }}", None),
    # vLLM's, silently ignored before
    ("add_special_tokens", True, False),
]
CASES = [(C, OK_C, *c) for c in UNSUPPORTED_BOTH + UNSUPPORTED_COMPLETION] + [
    (CHAT, OK_CHAT, *c) for c in UNSUPPORTED_BOTH + UNSUPPORTED_CHAT
]


@pytest.mark.parametrize(
    "path, ok, name, bad, neutral", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES]
)
def test_every_unsupported_parameter_is_refused(
    url: str, path: str, ok: dict, name: str, bad: object, neutral: object
) -> None:
    msg = _error(_post(url, path, {**ok, name: bad}), 400, name)
    assert name in msg
    r = _post(url, path, {**ok, name: neutral})
    assert r.status_code == 200, r.text


def test_add_special_tokens_on_completions(url: str, tok: Tokenizer) -> None:
    # vLLM's flag: false encodes a text prompt without the BOS (it was silently ignored, then
    # refused); token ids get no BOS added whatever it says
    text = "Hello world"
    for flag, bos in ((None, True), (True, True), (False, False)):
        body = {**OK_C, "prompt": text, "max_tokens": 1, "temperature": 0}
        if flag is not None:
            body["add_special_tokens"] = flag
        r = _post(url, C, body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_bos=bos)), flag
    r = _post(url, C, {**OK_C, "prompt": [5, 6], "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text
    _error(_post(url, C, {**OK_C, "add_special_tokens": "no"}), 400, "add_special_tokens")


# ---- the context limit at its edge -------------------------------------------------------------
def test_context_check_at_exactly_the_limit(url: str, tok: Tokenizer) -> None:
    ids = tok.encode("Hello world", add_bos=False)
    room = MAX_MODEL_LEN - len(ids)
    body = {"model": MODEL, "prompt": ids, "ignore_eos": True}
    r = _post(url, C, {**body, "max_tokens": room})  # prompt + max_tokens == limit: fits
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room
    r = _post(url, C, {**body, "max_tokens": room + 1})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN + 1) in r.json()["error"]["message"]
    assert (
        _post(url, C, {**body, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}).status_code == 400
    )

    # chat without max_tokens gets what the context leaves, down to one token; none is a 400
    def chat_of(n_tokens: int) -> list[dict[str, str]]:
        for k in range(4 * MAX_MODEL_LEN):
            msgs = [{"role": "user", "content": "9" * k}]
            if len(tok.encode(tok.apply_chat_template(msgs), add_bos=False)) == n_tokens:
                return msgs
        raise AssertionError(f"no conversation of {n_tokens} tokens")

    chat = {"model": MODEL, "ignore_eos": True}
    r = _post(url, CHAT, {**chat, "messages": chat_of(MAX_MODEL_LEN - 1)})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    r = _post(url, CHAT, {**chat, "messages": chat_of(MAX_MODEL_LEN)})
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_completions_default_max_tokens_over_the_context_says_it_was_not_set(url: str) -> None:
    """A completion without max_tokens gets OpenAI's 16; a prompt that leaves fewer is a 400, as
    vLLM answers it, whose message says the 16 is the default (the client sent none) and what
    max_tokens would fit. A prompt of the whole context leaves no room at all, named as such."""
    body = {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN - 10)}
    for stream in (False, True):
        r = _post(url, C, {**body, "stream": stream})
        msg = _error(r, 400, "prompt")
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert f"({MAX_MODEL_LEN - 10} in the prompt, 16 for the completion, " in msg, msg
        assert "the default max_tokens, as the request set none: set it to at most 10)" in msg
    msg = _error(_post(url, C, {**body, "max_tokens": 16}), 400, "prompt")  # sent: no such note
    assert "16 for the completion)." in msg, msg
    msg = _error(_post(url, C, {**body, "prompt": [5] * MAX_MODEL_LEN}), 400, "prompt")
    assert f"your prompt has {MAX_MODEL_LEN} tokens, which leaves no room" in msg, msg
    assert _post(url, C, {**body, "prompt": [5] * (MAX_MODEL_LEN - 16)}).status_code == 200


def test_api_key_is_checked_before_the_body_is_read(aengine: AsyncEngine) -> None:
    """Without the key, a body over the cap is a 401, not a 413: nothing was read."""
    app = build_app(aengine, MODEL, api_key="k", max_body_bytes=100)
    with running_server(app) as base:
        big = json.dumps({**OK_C, "prompt": "a" * 500})
        assert _post(base, C, big).status_code == 401
        r = httpx.post(base + C, content=big, headers={"authorization": "Bearer k"}, timeout=10)
        assert r.status_code == 413
