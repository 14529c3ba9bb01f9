"""vLLM's ``truncate_prompt_tokens``: a request runs on its prompt's last N tokens (-1: the
context's), truncated where it enters the engine, before the context check and the prefix cache's
lookup; the offline ``LLM`` returns the truncated prompt ids, and the server's usage, ``echo`` and
``prompt_logprobs`` read the truncated prompt (through the official openai client)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import openai
import pytest
from server_utils import running_server

from echo_compile.generation_result import GenerationResult
from echo_compile.llm import LLM
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.async_engine import AsyncEngine
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams, SamplingParamsError, truncate_prompt
from runtime.server import build_app

pytestmark = pytest.mark.aten_gemm  # CPU GEMMs without oneDNN (conftest.py)

MODEL = "tiny"
LIMIT = 256  # max_model_len of the engines here
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(5, 512) for _ in range(n - 1)]  # BOS, then no special tokens


# ---- SamplingParams and the rule ---------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -2, 1.5, "8", True])
def test_truncate_prompt_tokens_is_validated(bad: Any) -> None:
    with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens must be null, -1 or an"):
        SamplingParams(truncate_prompt_tokens=bad)
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    ids = list(range(10))
    assert truncate_prompt(ids, SamplingParams(), 8) is ids  # unset: never cut
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=3), 8) == [7, 8, 9]
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=-1), 8) == ids[2:]
    assert truncate_prompt(ids[:5], SamplingParams(truncate_prompt_tokens=-1), 8) == ids[:5]
    with pytest.raises(SamplingParamsError, match=r"\(9\) is greater than the context limit"):
        truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=9), 8)


# ---- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Engine:
    model, _ = load_model(resolve_model("tiny"))
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 12, gpu_tokens=2 * model.config.index_topk,
                       max_model_len=LIMIT, enable_prefix_caching=True)  # fmt: skip
    return Engine(model, model.config, None, cfg)


def _drain(engine: Engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_the_engine_truncates_before_the_context_check_and_the_prefix_cache(
    engine: Engine,
) -> None:
    """A prompt over the context runs on its last N tokens (max_tokens=None fills what they
    leave); a prompt truncated to a prompt served before finds that prompt's pages cached."""
    long = _ids(1, 400)  # over LIMIT
    with pytest.raises(ValueError, match="context"):
        engine.add_request("whole", long, GREEDY)
    engine.add_request("cut", long, SamplingParams(max_tokens=None, truncate_prompt_tokens=200))
    assert engine.requests["cut"].prompt_ids == long[-200:]
    assert engine.requests["cut"].params.max_tokens == LIMIT - 200
    engine.abort_request("cut")
    with pytest.raises(SamplingParamsError, match="greater than the context limit"):
        engine.add_request("over", long, SamplingParams(truncate_prompt_tokens=LIMIT + 1))

    kept = long[-150:]
    engine.add_request("first", kept, GREEDY)
    first = _drain(engine)["first"]
    engine.add_request("again", _ids(2, 30) + kept, replace(GREEDY, truncate_prompt_tokens=150))
    again = _drain(engine)["again"]
    assert again[0].cached_tokens >= 128 and again[-1].prompt_tokens == 150  # 2 full pages
    assert [o.new_token_ids for o in again] == [o.new_token_ids for o in first]

    group = [SamplingParams(max_tokens=2, truncate_prompt_tokens=n) for n in (100, 101)]
    with pytest.raises(ValueError, match="truncate the prompt alike"):
        engine.add_request_group(["g0", "g1"], long, group)
    assert not engine.has_unfinished()


# ---- the LLM API and the server (one engine: the server wraps it after the offline runs) -------
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, device="cpu", compile=False, max_batch=4, host_tokens=64 * 24,
               gpu_tokens=4 * 32, max_model_len=LIMIT, progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def offline(llm: LLM) -> dict[str, GenerationResult]:
    """The greedy results of the last 100 tokens of a 300-token prompt, given whole with
    ``truncate_prompt_tokens`` and given cut."""
    long = _ids(3, 300)
    params = replace(GREEDY, prompt_logprobs=0)
    cut, whole = llm.generate(
        [long[-100:], long], [params, replace(params, truncate_prompt_tokens=100)]
    )
    return {"cut": cut, "whole": whole}


def test_llm_returns_the_truncated_prompt(offline: dict[str, GenerationResult]) -> None:
    cut, whole = offline["cut"], offline["whole"]
    assert whole.prompt_token_ids == cut.prompt_token_ids and len(whole.prompt_token_ids) == 100
    assert whole.stats.prompt_tokens == 100
    assert whole.token_ids == cut.token_ids and len(whole.prompt_logprobs) == 100


@pytest.fixture(scope="module")
def url(llm: LLM, offline: dict[str, GenerationResult]) -> Iterator[str]:
    a = AsyncEngine(llm.engine)  # from here on only its loop thread calls the engine
    with running_server(build_app(a, MODEL)) as base:
        yield base
    a.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_completions_truncate_the_prompt(
    url: str, llm: LLM, offline: dict[str, GenerationResult], stream: bool
) -> None:
    """A 300-token prompt (over the context) with ``truncate_prompt_tokens: 100``: the offline
    result of its last 100 tokens; usage, echo and prompt_logprobs count those 100."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    long, ref = _ids(3, 300), offline["cut"]
    body: dict[str, Any] = dict(
        model=MODEL,
        prompt=long,
        max_tokens=4,
        temperature=0.0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 100, "prompt_logprobs": 0},
    )
    echoed = llm.tokenizer.decode(long[-100:], skip_special_tokens=False)
    if stream:
        chunks = list(
            client.completions.create(**body, stream=True, stream_options={"include_usage": True})
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        plps = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
        plps = next(p for p in plps if p)
    else:
        r = client.completions.create(**body)
        text, usage, plps = r.choices[0].text, r.usage, r.choices[0].model_extra["prompt_logprobs"]
    assert text == echoed + llm.tokenizer.decode(ref.token_ids)
    assert usage.prompt_tokens == 100 and usage.completion_tokens == 4
    assert len(plps) == 100 and plps[0] is None
    assert [int(next(iter(p))) for p in plps[1:]] == long[-99:]  # (rank-0 token: the prompt's)


def test_chat_truncates_the_prompt_and_bad_values_are_400s(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hello world " * 200}]  # over the context
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 40})  # fmt: skip
    assert r.usage.prompt_tokens == 40
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded"
    for bad, why in [(0, "must be null, -1 or an integer >= 1"), ("8", "valid integer"),
                     (LIMIT + 1, "greater than the context limit")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": bad})  # fmt: skip
        assert err.value.body["param"] == "truncate_prompt_tokens", err.value.body
        assert why in err.value.body["message"], err.value.body
    # -1: the context's last LIMIT tokens, which leave nothing to generate (as vLLM's)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=_ids(4, 300), max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert err.value.body["code"] == "context_length_exceeded"
