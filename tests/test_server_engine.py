"""The OpenAI-compatible server over the REAL engine (tiny checkpoints, CPU, KV cache offloaded).

Every request is greedy, so a served response must equal offline ``LLM.generate()`` token for
token: completions and chat, streaming and not, 32 concurrent streams, and the AWQ checkpoint.
The GPU pool is the smallest the scheduler accepts (max_batch x index_topk rows per layer) and the
prompts are longer than top-k, so decoding evicts and recalls rows (the ``offline`` fixture checks
that the hit rate is below 1). After the requests end, or their clients disconnect, both pools are
empty again.

NOTE: the server batches requests differently from the offline run, and the CPU forward is not
batch-invariant: bf16 logits move by ~5e-7, and AWQ ones by up to ~0.04 (its CPU reference
matmuls run in fp32, then round to bf16, so the batch's summation order can flip a bf16 ulp).
Greedy tokens still match because every offline argmax wins by a margin well above that noise;
``offline_greedy`` checks it, so a prompt that would make these tests flaky fails there, by name.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch
from server_utils import running_server
from stop_cases import min_tokens_stops

from echo_compile.generation_result import GenerationResult
from echo_compile.llm import LLM
from model.awq import AWQExperts, AWQLinear
from runtime.async_engine import AsyncEngine
from runtime.sampling_params import SamplingParams
from runtime.scheduler import ScheduledBatch
from runtime.server import build_app

pytestmark = pytest.mark.aten_gemm  # CPU GEMMs without oneDNN (conftest.py)

MODEL = "tiny"
MAX_TOKENS = 8
# Top-1 minus top-2 logit every offline argmax must win by, and how far a served logprob may be
# from the offline one: a few times the batch-composition noise (see the NOTE above).
BF16_MARGIN, BF16_LOGPROB_TOL = 1e-4, 1e-3
AWQ_MARGIN, AWQ_LOGPROB_TOL = 0.09, 0.08  # margin: 2x the ~0.04 AWQ noise (NOTE above)
ENGINE_OPTIONS: dict[str, Any] = dict(
    device="cpu",
    compile=False,
    max_batch=8,
    host_tokens=64 * 64,
    gpu_tokens=8 * 32,  # max_batch x index_topk: the smallest pool, so offloading really evicts
    max_model_len=512,
    progress=False,
)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)


@dataclass(frozen=True)
class Case:
    """One request: a completion prompt (text or ids) or a chat conversation."""

    name: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(5, 512) for _ in range(n - 1)]  # BOS, then no special tokens


_FOX = "The quick brown fox jumps over the lazy dog while the server streams every token. "
_NUM = "Numbers 0123456789, punctuation (a) [b] {c}: hello world, hello there! "
CASES = [
    Case("text-fox", prompt=_FOX * 3),
    Case("text-num", prompt=_NUM * 2),
    Case("text-mix", prompt=_NUM + _FOX * 2),
    Case("ids-70", prompt=_ids(1, 70)),
    Case("ids-110", prompt=_ids(2, 110)),
    Case("ids-150", prompt=_ids(3, 150)),
    Case("chat-user", messages=[{"role": "user", "content": _FOX * 3}]),
    Case(
        "chat-system",
        messages=[
            {"role": "system", "content": _NUM},
            {"role": "user", "content": "Hello there! " + _FOX},
            {"role": "assistant", "content": "Hello world."},
            {"role": "user", "content": "Numbers, please!"},
        ],
    ),
]
BY_NAME = {c.name: c for c in CASES}
# The AWQ checkpoint's own prompts: argmax margins 0.62 and 0.50 alone (CASES' are 0.12 at most:
# ids-70 0.12, ids-110 0.08, the others below; measured with the tests' CPU GEMM, conftest.py)
AWQ_CASES = [Case("awq-ids-80a", prompt=_ids(8, 80)), Case("awq-ids-80b", prompt=_ids(9, 80))]


def prompt_ids(llm: LLM, case: Case) -> list[int]:
    """The ids the server builds: BOS + text for completions, the chat template for chat."""
    tok = llm.tokenizer
    if case.messages is not None:
        return tok.encode(tok.apply_chat_template(case.messages), add_bos=False)
    if isinstance(case.prompt, str):
        return tok.encode(case.prompt, add_bos=True)
    return list(case.prompt or [])


def offline_greedy(
    llm: LLM, cases: list[Case], min_margin: float = BF16_MARGIN
) -> dict[str, GenerationResult]:
    """``llm.generate`` over the cases; checks that every argmax wins by ``min_margin``."""
    margins: list[float] = []
    forward = llm.engine.runner.forward

    def recording(batch: ScheduledBatch) -> torch.Tensor:
        logits = forward(batch)
        if batch.is_decode:
            top = logits[: len(batch.requests)].float().topk(2, dim=-1).values
            margins.extend((top[:, 0] - top[:, 1]).tolist())
        return logits

    llm.engine.runner.forward = recording
    try:
        results = llm.generate([prompt_ids(llm, c) for c in cases], GREEDY)
    finally:
        llm.engine.runner.forward = forward
    assert min(margins) > min_margin, "a near-tie argmax: pick other prompts (see the docstring)"
    for c, r in zip(cases, results, strict=True):
        assert 60 <= len(r.prompt_token_ids) <= 150, (c.name, len(r.prompt_token_ids))
        assert r.finish_reason == "length" and len(r.token_ids) == MAX_TOKENS, c.name
    return {c.name: r for c, r in zip(cases, results, strict=True)}


# ---- what a client sees --------------------------------------------------------------------------
@dataclass
class Served:
    text: str
    tokens: list[str]  # token strings from the logprobs
    logprobs: list[float]
    finish_reason: str | None
    completion_tokens: int | None


async def ask(client: openai.AsyncOpenAI, case: Case, stream: bool, model: str = MODEL) -> Served:
    """Send ``case`` greedy with logprobs (streamed or not) and collect what comes back."""
    common: dict[str, Any] = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
    if stream:
        common["stream_options"] = {"include_usage": True}
    out = Served("", [], [], None, None)
    if case.is_chat:
        r = await client.chat.completions.create(messages=case.messages, logprobs=True, **common)
        if not stream:
            c = r.choices[0]
            items = c.logprobs.content
            return Served(
                c.message.content,
                [t.token for t in items],
                [t.logprob for t in items],
                c.finish_reason,
                r.usage.completion_tokens,
            )
        async for chunk in r:
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                out.text += c.delta.content or ""
                items = c.logprobs.content if c.logprobs else []
                out.tokens += [t.token for t in items]
                out.logprobs += [t.logprob for t in items]
                out.finish_reason = c.finish_reason or out.finish_reason
        return out
    r = await client.completions.create(prompt=case.prompt, logprobs=0, **common)
    if not stream:
        c = r.choices[0]
        return Served(
            c.text,
            c.logprobs.tokens,
            c.logprobs.token_logprobs,
            c.finish_reason,
            r.usage.completion_tokens,
        )
    async for chunk in r:
        if chunk.usage is not None:
            out.completion_tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            out.text += c.text
            out.tokens += c.logprobs.tokens if c.logprobs else []
            out.logprobs += c.logprobs.token_logprobs if c.logprobs else []
            out.finish_reason = c.finish_reason or out.finish_reason
    return out


def ask_all(url: str, requests: list[tuple[Case, bool]], model: str = MODEL) -> list[Served]:
    """Send every (case, stream) request at once, each from its own connection."""

    async def main() -> list[Served]:
        async with openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(ask(client, c, s, model) for c, s in requests))

    return asyncio.run(main())


def assert_same(
    llm: LLM, served: Served, ref: GenerationResult, what: str, lp_tol: float = BF16_LOGPROB_TOL
) -> None:
    strings = [llm.tokenizer.decode([i], skip_special_tokens=False) for i in ref.token_ids]
    assert served.text == ref.text, what
    assert served.tokens == strings, what
    assert served.logprobs == pytest.approx(ref.logprobs, abs=lp_tol), what  # batch rounding only
    assert (served.finish_reason, served.completion_tokens) == ("length", MAX_TOKENS), what


def metrics(aengine: AsyncEngine) -> dict[str, Any]:
    """``engine.metrics()`` read on the engine's loop thread. ``host_pool_usage`` is
    ``1 - pages.num_free / pages.num_pages``, so 0.0 means every host page is free."""
    return asyncio.run(aengine.metrics())


def wait_for(
    aengine: AsyncEngine, ok: Callable[[dict[str, Any]], bool], timeout_s: float = 15.0
) -> dict[str, Any]:
    """Poll the metrics until ``ok(metrics)`` or the timeout; returns the last metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(aengine)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_pools_empty(aengine: AsyncEngine) -> None:
    m = wait_for(aengine, lambda m: (m["running"], m["waiting"]) == (0.0, 0.0))
    assert (m["running"], m["waiting"]) == (0.0, 0.0), m
    # (the prefix cache's pages no request holds count as free)
    assert m["host_pool_usage"] == 0.0, m  # pages.num_free == pages.num_pages
    # Nothing runs, waits or is queued now, so the loop thread sleeps and the engine can be read.
    eng = aengine.engine
    s = eng.scheduler
    if s.prefix is not None:  # (LLM's default) every page still used is the cache's alone
        assert s.pages.num_used == s.prefix.num_pages == s.prefix.num_evictable, m
        # its GPU-pool rows stay mapped until it evicts them: evict all, then nothing is held
        assert s.reset_prefix_cache() == m["prefix_cache_pages"]
        m = metrics(aengine)
    assert m["gpu_pool_usage"] == 0.0, m  # no GPU pool row of any layer is held
    assert s.pages.num_free == s.pages.num_pages
    assert eng.cache.stats()["gpu_pool_usage_per_layer"] == [0.0] * len(eng.cache.layers)


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, offload=True, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def offline(llm: LLM) -> dict[str, GenerationResult]:
    """Offline greedy results, made on ``llm`` before the server wraps its engine."""
    refs = offline_greedy(llm, CASES)
    stats = llm.engine.cache.stats()
    assert all(h < 1.0 for h in stats["hit_rate"]) and stats["recalled_rows_per_step"] > 0, stats
    return refs


@pytest.fixture(scope="module")
def aengine(llm: LLM, offline: dict[str, GenerationResult]) -> Iterator[AsyncEngine]:
    a = AsyncEngine(llm.engine)  # from here on only its loop thread calls the engine
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def url(aengine: AsyncEngine) -> Iterator[str]:
    with running_server(build_app(aengine, MODEL)) as base:
        yield base


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_greedy_responses_equal_offline_generate(
    url: str, llm: LLM, offline: dict[str, GenerationResult], chat: bool
) -> None:
    names = ["chat-user", "chat-system"] if chat else ["text-fox", "ids-110"]
    requests = [(BY_NAME[n], stream) for n in names for stream in (False, True)]
    for (case, stream), served in zip(requests, ask_all(url, requests), strict=True):
        assert_same(llm, served, offline[case.name], f"{case.name} stream={stream}")


def test_32_concurrent_streams_then_pools_empty(
    url: str, llm: LLM, offline: dict[str, GenerationResult], aengine: AsyncEngine
) -> None:
    requests = [(CASES[i % len(CASES)], True) for i in range(32)]
    served = ask_all(url, requests)
    for i, ((case, _), s) in enumerate(zip(requests, served, strict=True)):
        assert_same(llm, s, offline[case.name], f"client {i} ({case.name})")
    assert_pools_empty(aengine)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_stop_token_ids_and_stop_strings_through_the_real_engine(
    url: str, offline: dict[str, GenerationResult], aengine: AsyncEngine, stream: bool
) -> None:
    """The server's finish logic is the engine's: a stop token id or a stop string ends the
    served greedy generation where the offline one shows it first."""
    # a completion case whose greedy output has a token that is new after the first one
    case, k = next(
        (c, i)
        for c in CASES
        if not c.is_chat
        for i in range(1, MAX_TOKENS)
        if offline[c.name].token_ids[i] not in offline[c.name].token_ids[:i]
    )
    ref = offline[case.name]
    j = next(i for i in range(1, len(ref.text) - 1) if ref.text.find(ref.text[i : i + 2]) == i)
    base = {
        "model": MODEL,
        "prompt": case.prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }

    def post(extra: dict[str, Any]) -> tuple[str, str | None, int | None]:
        body = {**base, **extra}
        if stream:
            body["stream_options"] = {"include_usage": True}
        text, reason, used = "", None, None
        with httpx.Client(timeout=120) as http:
            if not stream:
                r = http.post(url + "/v1/completions", json=body).json()
                return (
                    r["choices"][0]["text"],
                    r["choices"][0]["finish_reason"],
                    r["usage"]["completion_tokens"],
                )
            with http.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    for c in chunk["choices"]:
                        text += c["text"]
                        reason = c["finish_reason"] or reason
                    if chunk.get("usage"):
                        used = chunk["usage"]["completion_tokens"]
        return text, reason, used

    text, reason, used = post({"stop_token_ids": [ref.token_ids[k]]})
    assert (reason, used) == ("stop", k + 1)
    text, reason, _ = post({"stop": [ref.text[j : j + 2]]})
    assert (text, reason) == (ref.text[:j], "stop")
    assert_pools_empty(aengine)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_aborts_and_frees_slots(url: str, aengine: AsyncEngine, stream: bool) -> None:
    assert_pools_empty(aengine)
    tokens_before = aengine.generation_tokens_total
    max_tokens = 400  # seconds of CPU decode if it ran to the end
    body = {
        "model": MODEL,
        "prompt": _ids(7, 80),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }

    async def client(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(client(http))
            deadline = time.monotonic() + 30
            while True:  # until the request decodes (or the client ends: the test then fails)
                m = await aengine.metrics()
                if m["gpu_pool_usage"] > 0.0 or task.done() or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            task.cancel()  # closes the connection: the client is gone mid-generation
            await asyncio.gather(task, return_exceptions=True)
            return m

    busy = asyncio.run(main())
    # The pool checks below can fail: while the request decodes it holds host pages and GPU rows.
    assert busy["running"] == 1.0, busy
    assert busy["host_pool_usage"] > 0.0 and busy["gpu_pool_usage"] > 0.0, busy
    assert_pools_empty(aengine)
    assert aengine.generation_tokens_total - tokens_before < max_tokens  # aborted before the end


def test_offload_on_off_same_tokens(url: str, offline: dict[str, GenerationResult]) -> None:
    gpu_only = LLM(MODEL, offload=False, **ENGINE_OPTIONS)
    assert gpu_only.engine.cache.stats()["hit_rate"] == []  # really no GPU pool
    refs = offline_greedy(gpu_only, CASES)
    for c in CASES:  # same requests in the same batches: lossless means bit-identical
        assert refs[c.name].token_ids == offline[c.name].token_ids, c.name
        assert refs[c.name].logprobs == offline[c.name].logprobs, c.name
    requests = [(BY_NAME["ids-150"], False), (BY_NAME["chat-system"], True)]
    for (case, _), served in zip(requests, ask_all(url, requests), strict=True):
        assert_same(gpu_only, served, refs[case.name], case.name)


def test_llm_chat_renders_as_the_server(tmp_path) -> None:  # noqa: ANN001
    """``LLM.chat`` renders a conversation as the server does: with the checkpoint's template,
    and for a checkpoint without one (DeepSeek-V3.2's release ships none) with V3.2's own
    encoding, where it raised "has no chat_template"."""
    import shutil

    from model.checkpoint import resolve_model
    from runtime.chat_template import normalise_messages, render_dsv32

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=2, temperature=0)
    src, bare = resolve_model(MODEL), tmp_path / "no-template"
    shutil.copytree(src, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    for path in (src, bare):
        llm = LLM(str(path), offload=True, **ENGINE_OPTIONS)
        tok = llm.tokenizer
        if path == src:
            text = tok.apply_chat_template(msgs)
        else:
            assert tok.chat_template is None
            text = render_dsv32(normalise_messages(msgs), None, tok.bos_token, tok.eos_token)
        out = llm.chat(msgs, params)
        assert out.prompt_token_ids == tok.encode(text, add_bos=False)
        assert len(out.token_ids) == 2


def test_streams_and_generate_of_one_llm_interleave() -> None:
    """Two ``generate_stream`` iterators read in turn, and a ``generate()`` call while one is
    paused: every request gets all its tokens, those of a run alone (a step driven by one
    caller sets the others' outputs aside; they were dropped, and the streams then hung)."""
    import itertools

    llm = LLM(MODEL, offload=True, **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15]]
    want = [r.token_ids for r in llm.generate(prompts, params)]
    a, b = (llm.generate_stream(p, params) for p in prompts[:2])
    got: list[list[int]] = [[], []]
    for i, (oa, ob) in enumerate(itertools.zip_longest(a, b)):
        got[0] += oa.new_token_ids if oa else []
        got[1] += ob.new_token_ids if ob else []
        if i == 1:  # both streams paused mid-way
            assert llm.generate([prompts[2]], params)[0].token_ids == want[2]
    assert got == want[:2]
    assert not llm.engine.has_unfinished() and not llm._outputs


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        (None, None, "prompts must be a string, a list of token ids or a list of either"),
        ({"prompt": "Hi"}, None, "prompts must be"),
        (["Hi", {"prompt_token_ids": [5, 6]}], None, "a prompt must be a string or a list"),
        (b"Hi", None, "prompts must be a string, a list of token ids or a list of either"),
        (["Hi", bytearray(b"Ho")], None, "a prompt must be a string or a list"),
        (["Hi", memoryview(b"Ho")], None, "a prompt must be a string or a list"),
        (["Hi"], {"max_tokens": 3}, "params must be a SamplingParams, a list of them or None"),
        (["Hi", "Ho"], [SamplingParams(), "x"], "params must be a SamplingParams"),
    ],
)
def test_llm_generate_refuses_arguments_of_the_wrong_type(
    llm: LLM, prompts: Any, params: Any, message: str
) -> None:
    """A prompt or params of the wrong type (a vLLM prompt dict, params as a dict) is one
    TypeError naming the argument, before any request is queued (it was a KeyError, an
    AttributeError on a str, or a ValueError about token ids; bytes were read as token ids)."""
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_max_tokens_none_generates_up_to_the_context_limit(llm: LLM) -> None:
    """max_tokens=None (vLLM's "up to the context"): the engine fills in what the limit leaves
    after the prompt; a prompt that leaves nothing, or a min_tokens past it, is refused naming it
    and nothing is queued (it was "max_tokens must be an integer >= 1")."""
    limit = llm.engine.max_model_len  # 512
    prompt = [5 + i % 400 for i in range(limit - 6)]
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    r = llm.generate([prompt], params)[0]
    assert len(r.token_ids) == 6 and r.finish_reason == "length"
    assert [o.new_token_ids for o in llm.generate_stream(prompt, params)][-1]  # the stream too
    with pytest.raises(ValueError, match=r"max_tokens=None: the prompt \(512 tokens\) leaves "
                                         r"nothing .* context limit of 512"):
        llm.generate([[5] * limit], params)
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=6\]"):
        llm.generate([prompt], SamplingParams(max_tokens=None, min_tokens=7))
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_default_max_tokens_is_capped_at_the_context(llm: LLM, monkeypatch) -> None:
    """A request without params takes the checkpoint's max_new_tokens (the engine's sampling
    defaults), capped at what the context leaves, as vLLM caps it: a max_new_tokens of 100000
    refused every prompt ("exceeds the model's context limit"). Given params are not capped."""
    big = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    monkeypatch.setattr(llm.engine, "sampling_defaults", big)
    prompt = [5 + i % 400 for i in range(llm.engine.max_model_len - 5)]
    assert len(llm.generate([prompt])[0].token_ids) == 5
    assert sum(len(o.new_token_ids) for o in llm.generate_stream(prompt)) == 5
    with pytest.raises(ValueError, match="exceeds the model's context limit"):
        llm.generate([prompt], big)
    assert not llm.engine.has_unfinished() and not llm.engine.requests


@pytest.mark.parametrize("params", [{"max_tokens": 3}, [SamplingParams(max_tokens=3)]])
def test_llm_generate_stream_refuses_params_of_the_wrong_type(llm: LLM, params: Any) -> None:
    """generate_stream's params, as generate()'s: a dict or a list is a TypeError naming the
    argument, nothing queued (it was AttributeError: 'dict' object has no attribute
    'logit_bias', from inside the engine)."""
    with pytest.raises(TypeError, match="params must be a SamplingParams or None"):
        next(llm.generate_stream("Hi", params))
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_llm_generate_returns_top_and_prompt_logprobs_as_the_stream() -> None:
    """``generate()`` keeps what the request asked for and its stream carries: each token's
    top_logprobs and the prompt_logprobs (they were computed, then dropped)."""
    llm = LLM(MODEL, offload=True, **ENGINE_OPTIONS)
    params = SamplingParams(
        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, prompt_logprobs=2
    )
    r = llm.generate([[5, 6, 7, 8, 9]], params)[0]
    outs = list(llm.generate_stream([5, 6, 7, 8, 9], params))
    assert r.top_logprobs == [t for o in outs for t in o.new_top_logprobs]
    assert len(r.top_logprobs) == 4 and all(len(t) == 3 for t in r.top_logprobs)
    assert [t[0][0] for t in r.top_logprobs] == r.token_ids  # greedy: the top-1 is the token
    assert r.prompt_logprobs == outs[0].prompt_logprobs and len(r.prompt_logprobs) == 5
    plain = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert plain.top_logprobs is None and plain.prompt_logprobs is None


def test_llm_takes_the_checkpoint_sampling_defaults() -> None:
    """``generation_config="auto"``: a request without params samples as the checkpoint's
    generation_config.json says (the tiny one: top_p 0.95); "none": SamplingParams()'s."""
    from model.checkpoint import GENERATION_CONFIG

    llm = LLM(MODEL, offload=True, **ENGINE_OPTIONS)
    want = SamplingParams(
        temperature=GENERATION_CONFIG["temperature"], top_p=GENERATION_CONFIG["top_p"]
    )
    assert llm.engine.sampling_defaults == want != SamplingParams()
    seen: list[SamplingParams] = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, ids, p: (seen.append(p), add(rid, ids, p))[1]
    llm.generate("Hi")
    stream = llm.generate_stream("Hi")
    next(stream)
    stream.close()
    assert seen == [want, want]  # requests without params
    plain = LLM(MODEL, offload=True, generation_config="none", **ENGINE_OPTIONS)
    assert plain.engine.sampling_defaults == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be auto or none"):
        LLM(MODEL, generation_config="vllm", **ENGINE_OPTIONS)


def test_awq_checkpoint_offloaded_generates_and_serves() -> None:
    awq = LLM("tiny-awq", offload=True, **ENGINE_OPTIONS)
    cases = AWQ_CASES
    refs = offline_greedy(awq, cases, AWQ_MARGIN)
    # The 4-bit weights are really used: AWQ modules, and logprobs unlike the bf16 model's.
    assert any(isinstance(m, (AWQLinear, AWQExperts)) for m in awq.engine.runner.model.modules())
    bf16 = LLM(MODEL, offload=True, **ENGINE_OPTIONS)
    for c, b in zip(cases, bf16.generate([prompt_ids(bf16, c) for c in cases], GREEDY)):
        assert refs[c.name].logprobs != pytest.approx(b.logprobs, abs=1e-2), c.name
    assert awq.engine.cache.stats()["recalled_rows_per_step"] > 0
    a = AsyncEngine(awq.engine)
    try:
        with running_server(build_app(a, "tiny-awq")) as base:
            requests = [(c, s) for c in cases for s in (False, True)]
            for (case, stream), served in zip(
                requests, ask_all(base, requests, "tiny-awq"), strict=True
            ):
                what = f"{case.name} stream={stream}"
                assert_same(awq, served, refs[case.name], what, AWQ_LOGPROB_TOL)
        assert_pools_empty(a)
    finally:
        a.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_sampling_controls_through_the_real_engine(
    url: str, llm: LLM, aengine: AsyncEngine, stream: bool
) -> None:
    """logit_bias forces a token, min_tokens holds back an EOS pushed to the top, the penalties
    are accepted: the controls reach the engine's sampler through the openai client."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    eos = llm.engine.model_config.eos_token_id

    def tokens(**kw: Any) -> tuple[list[int], str | None]:
        body = dict(model=MODEL, prompt=_ids(5, 70), max_tokens=6, temperature=0.0, logprobs=0)
        body.update(kw)
        if not stream:
            c = client.completions.create(**body).choices[0]
            return [_token_id(llm, t) for t in c.logprobs.tokens], c.finish_reason
        ids, reason = [], None
        for chunk in client.completions.create(**body, stream=True):
            c = chunk.choices[0]
            ids += [_token_id(llm, t) for t in (c.logprobs.tokens if c.logprobs else [])]
            reason = c.finish_reason or reason
        return ids, reason

    assert tokens(logit_bias={"300": 100})[0] == [300] * 6
    ids, reason = tokens(logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert len(ids) == 4 and ids[-1] == eos and eos not in ids[:3] and reason == "stop"
    ids, _ = tokens(presence_penalty=2.0, frequency_penalty=2.0,
                    extra_body={"repetition_penalty": 2.0, "min_p": 0.1})  # fmt: skip
    assert len(ids) == 6 and len(set(ids)) == 6  # penalised greedy: no token twice
    assert_pools_empty(aengine)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_min_tokens_stop_reason_names_the_stop_string_that_stopped(
    url: str, aengine: AsyncEngine, stream: bool
) -> None:
    """With min_tokens, a stop string whose first occurrence ends in the first min_tokens tokens'
    text does not stop the choice, a later one does: the text is cut before the later one and
    stop_reason names the string that stopped it (it named the whole text's first stop string,
    here the one held back)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    body: dict[str, Any] = dict(model=MODEL, prompt=BY_NAME["text-mix"].prompt, max_tokens=16,
                                temperature=0.0)  # fmt: skip
    # the text each token completes, as the engine streams it (logprobs: a chunk per token)
    chunks = [c.choices[0] for c in client.completions.create(**body, logprobs=0, stream=True)]
    assert all(len(c.logprobs.tokens) == 1 for c in chunks)
    deltas = [c.text for c in chunks]
    full = "".join(deltas)
    case = min_tokens_stops(deltas)

    def ask(stop: list[str]) -> tuple[str, str | None, str | int | None]:
        kw = dict(stop=stop, extra_body={"min_tokens": case.min_tokens})
        if not stream:
            c = client.completions.create(**body, **kw).choices[0]
            return c.text, c.finish_reason, c.model_extra["stop_reason"]
        text, reason, why = "", None, None
        for chunk in client.completions.create(**body, **kw, stream=True):
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
                why = c.model_extra.get("stop_reason") or why
        return text, reason, why

    assert ask([case.inside]) == (full[: case.again], "stop", case.inside)
    assert ask([case.inside, case.later]) == (full[: case.cut], "stop", case.later)
    assert_pools_empty(aengine)


def _token_id(llm: LLM, text: str) -> int:
    """The id of a token string as the server reports it (byte-level tokens map one to one)."""
    ids = [i for i in range(llm.tokenizer.vocab_size)
           if llm.tokenizer.decode([i], skip_special_tokens=False) == text]  # fmt: skip
    assert ids, text
    return ids[0]


def test_n_choices_reproduce_single_requests_with_seed_plus_j(
    url: str, llm: LLM, aengine: AsyncEngine
) -> None:
    """n = 3 sampled choices through the real engine: choice j is what one request with seed + j
    gives, so the choices differ (almost surely) yet reproduce."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    body = dict(model=MODEL, prompt=_ids(6, 80), max_tokens=6, temperature=1.0, logprobs=0)
    r = client.completions.create(**body, n=3, seed=7)
    many = [c.logprobs.tokens for c in r.choices]
    single = [
        client.completions.create(**body, seed=7 + j).choices[0].logprobs.tokens for j in range(3)
    ]
    assert many == single and len({tuple(t) for t in many}) > 1
    assert_pools_empty(aengine)


def test_top_logprobs_through_the_real_engine(url: str, aengine: AsyncEngine) -> None:
    """Completions ``logprobs: 3`` and chat ``top_logprobs: 2``, streamed and not: N alternatives
    per token, sorted, the greedy choice first with its own logprob."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    body = dict(model=MODEL, prompt=_ids(7, 70), max_tokens=4, temperature=0.0, logprobs=3)
    lp = client.completions.create(**body).choices[0].logprobs
    for tok, chosen, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(alts) <= 3 and max(alts.values()) == alts[tok] == chosen
    streamed = [c.choices[0].logprobs for c in client.completions.create(**body, stream=True)]
    assert [a for s in streamed if s for a in s.top_logprobs] == lp.top_logprobs
    msgs = [{"role": "user", "content": "Numbers, please! " * 4}]
    for stream in (False, True):
        kw = dict(model=MODEL, messages=msgs, max_tokens=3, temperature=0.0, logprobs=True,
                  top_logprobs=2)  # fmt: skip
        if stream:
            content = [e for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices[0].logprobs for e in c.choices[0].logprobs.content]  # fmt: skip
        else:
            content = client.chat.completions.create(**kw).choices[0].logprobs.content
        assert len(content) == 3
        for e in content:
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
            assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob
    assert_pools_empty(aengine)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_json_schema_response_through_the_real_engine(
    url: str, aengine: AsyncEngine, stream: bool
) -> None:
    """response_format json_schema with the openai client: the random model's output parses and
    follows the schema because the grammar masks its tokens; a schema that does not compile is
    a 400 naming response_format."""
    pytest.importorskip("llguidance")
    from test_structured_output import SCHEMA, valid

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    msgs = [{"role": "user", "content": "Answer in JSON. " + _FOX}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, response_format=fmt)
    for seed in (1, 2):
        if stream:
            chunks = list(client.chat.completions.create(**kw, seed=seed, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            c = client.chat.completions.create(**kw, seed=seed).choices[0]
            text, reason = c.message.content, c.finish_reason
        assert valid(json.loads(text)) and reason == "stop", text
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**kw, "response_format": bad})
    assert e.value.body["param"] == "response_format"
    assert_pools_empty(aengine)
