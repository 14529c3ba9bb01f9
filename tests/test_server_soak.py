"""The soak: 64 concurrent mixed requests through the REAL tiny engine (CPU, KV cache offloaded,
the smallest GPU pool, so decoding evicts and recalls), using every parameter the server added:
penalties, logit_bias, min_p, min_tokens, n, best_of, a list of prompts, logprobs / top_logprobs,
prompt_logprobs (completions and chat), echo (with and without logprobs), stop strings,
response_format, tools (auto and forced), streamed and not. Every one is answered 200 with the
choices it asked for and no error event; afterwards nothing is held: host pages all free (no
reference left on any), GPU pools empty, and the engine's per-request state (requests,
detokenisers, control slots, grammar matchers, prefill groups) is gone."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import running_server
from test_server_engine import _FOX, _NUM, _ids, assert_pools_empty

from echo_compile.llm import LLM
from runtime.async_engine import AsyncEngine
from runtime.server import build_app

MODEL = "tiny"
N_REQUESTS = 64
KINDS = 8  # request kinds, below; request i is kind i % KINDS, streamed when (i // KINDS) is even
# get_weather (tests/test_server_tools.py), inlined: importing that file needs the openai client
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def served(request) -> Iterator[tuple[str, AsyncEngine]]:
    pytest.importorskip("llguidance")  # response_format and forced tool calls
    llm = LLM(
        MODEL, device="cpu", compile=False, offload=True, max_batch=8, host_tokens=128 * 64,
        gpu_tokens=8 * 32, max_model_len=1024, progress=False, async_scheduling=request.param,
    )  # fmt: skip  # a tools prompt is ~700 tokens; the GPU pool is max_batch x index_topk
    engine = AsyncEngine(llm.engine)
    try:
        with running_server(build_app(engine, MODEL)) as base:
            yield base, engine
    finally:
        engine.shutdown()


def request(i: int) -> tuple[str, dict[str, Any]]:
    """Request ``i``: (path, body)."""
    rng = random.Random(1000 + i)
    kind, stream = i % KINDS, (i // KINDS) % 2 == 0
    other = (i // (2 * KINDS)) % 2 == 1  # each kind's variant, streamed and not
    b: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": i,
        "presence_penalty": rng.choice([0.0, 1.0]),
        "frequency_penalty": rng.choice([0.0, 0.5]),
        "repetition_penalty": rng.choice([1.0, 1.2]),
        "min_p": rng.choice([0.0, 0.1]),
        "min_tokens": rng.choice([0, 2]),
        "logit_bias": {str(rng.randrange(5, 500)): 3.0},
        "n": rng.choice([1, 2]),
        "stream": stream,
        "stop": rng.choice([None, ["the"]]),
    }
    msgs = [{"role": "user", "content": _FOX if i % 2 else _NUM}]
    chat = {"messages": msgs, "logprobs": True, "top_logprobs": 2}
    if kind == 0:  # chat, top logprobs, sometimes prompt_logprobs
        return "/v1/chat/completions", {**b, **chat, "prompt_logprobs": None if other else 1}
    if kind == 1:  # a list of two prompts
        return "/v1/completions", {**b, "prompt": [_ids(i, 60), _ids(i + 100, 70)], "logprobs": 2}
    if kind == 2:  # echo
        return "/v1/completions", {**b, "prompt": _ids(i, 80), "echo": True}
    if kind == 3:  # best_of (> n only when not streamed: a 400 otherwise)
        best_of = b["n"] + (0 if stream else 1)
        return "/v1/completions", {**b, "prompt": _ids(i, 70), "best_of": best_of, "logprobs": 1}
    if kind == 4:  # structured output (a grammar takes no min_tokens)
        fmt = {"type": "json_object"} if not other else {
            "type": "json_schema", "json_schema": {"schema": TOOL["function"]["parameters"]}
        }  # fmt: skip
        return "/v1/chat/completions", {**b, **chat, "min_tokens": 0, "response_format": fmt}
    if kind == 5:  # tools, auto: the model writes text
        return "/v1/chat/completions", {**b, "messages": msgs, "tools": [TOOL]}
    if kind == 6:  # tools, forced by the grammar (4 tokens: cut short, returned as content)
        named = {"type": "function", "function": {"name": "get_weather"}}
        choice = named if other else "required"
        return "/v1/chat/completions", {
            **b, "messages": msgs, "tools": [TOOL], "tool_choice": choice, "min_tokens": 0,
            "parallel_tool_calls": False,
        }  # fmt: skip
    # echo with logprobs and prompt_logprobs
    body = {**b, "prompt": _ids(i, 75), "echo": True, "logprobs": 2, "prompt_logprobs": 2}
    return "/v1/completions", body


def choices_wanted(body: dict[str, Any]) -> int:
    p = body.get("prompt")
    prompts = len(p) if isinstance(p, list) and isinstance(p[0], list) else 1
    return body["n"] * prompts


def check_choice(body: dict[str, Any], c: dict[str, Any], top: dict[str, Any]) -> None:
    """What a finished choice (non-streamed) must carry for its request's parameters."""
    if body.get("echo") and body.get("logprobs") is not None:
        lp, n_prompt = c["logprobs"], len(body["prompt"])
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) > n_prompt, lp
        assert None not in lp["token_logprobs"][1:]
        assert len(c["prompt_logprobs"]) == n_prompt
    if body.get("prompt_logprobs") and "messages" in body:
        assert top["prompt_logprobs"][0] is None and len(top["prompt_logprobs"]) > 10


async def one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, int, set[int]]:
    path, b = request(i)
    if not b["stream"]:
        r = await client.post(url + path, json=b)
        body = r.json()
        assert r.status_code == 200, (i, body)
        for c in body["choices"]:
            check_choice(b, c, body)
        return r.status_code, choices_wanted(b), {c["index"] for c in body["choices"]}
    seen: set[int] = set()
    async with client.stream("POST", url + path, json=b) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, (i, chunk)
                seen |= {c["index"] for c in chunk["choices"] if c.get("finish_reason")}
        return r.status_code, choices_wanted(b), seen


def test_soak_64_mixed_requests_then_nothing_held(served: tuple[str, AsyncEngine]) -> None:
    url, aengine = served

    async def main() -> list[tuple[int, int, set[int]]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, url, i) for i in range(N_REQUESTS)))

    results = asyncio.run(main())
    assert [s for s, _, _ in results] == [200] * N_REQUESTS
    assert [seen == set(range(want)) for _, want, seen in results] == [True] * N_REQUESTS
    assert_pools_empty(aengine)  # running / waiting 0, host and GPU pool usage 0
    eng = aengine.engine  # idle now: its loop thread sleeps, so it can be read
    pages = eng.scheduler.pages
    assert [p for p in range(pages.num_pages) if pages.refs(p)] == []  # no shared page left
    assert (eng.requests, eng._detok, eng._seeds) == ({}, {}, {})
    assert eng.sampling_controls.slots == {} and eng.structured_output.matchers == {}
    assert (eng.scheduler.groups, eng.scheduler._group_of) == ({}, {})
    # asynchronous scheduling: no step left in flight (few steps of this mix run ahead: most
    # of its batches hold a grammar, or change by an admission)
    assert eng._in_flight is None


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_masked_alternatives_are_finite_logprobs(
    served: tuple[str, AsyncEngine], stream: bool
) -> None:
    """Under a grammar, a position where one token is allowed has top alternatives of logprob
    -inf, which JSON cannot carry: they come as -9999.0, as vLLM sends them. Sampled with min_p,
    which once dropped every allowed token there (NaN logprobs: a 500; the soak found it)."""
    url, _ = served
    fmt = {"type": "json_schema", "json_schema": {"schema": TOOL["function"]["parameters"]}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": _FOX}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 3, "response_format": fmt, "seed": 1, "min_p": 0.5,
            "stream": stream}  # fmt: skip
    with httpx.Client(timeout=120) as http:
        if stream:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            assert r.status_code == 200 and all("error" not in c for c in chunks), chunks
            entries = [e for c in chunks for ch in c["choices"] if ch.get("logprobs")
                       for e in ch["logprobs"]["content"]]  # fmt: skip
        else:
            r = http.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            entries = r.json()["choices"][0]["logprobs"]["content"]
    # '{"city":"' is forced by the grammar: its positions have one allowed token
    alts = [a["logprob"] for e in entries for a in e["top_logprobs"]]
    assert len(entries) == 6 and -9999.0 in alts and min(alts) == -9999.0, alts
