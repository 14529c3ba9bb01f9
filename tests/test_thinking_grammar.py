"""A grammar that starts after the reasoning (``SamplingParams.grammar_after_reasoning``, thinking
mode's ``response_format`` and forced tool calls, as vLLM starts structured output after its
reasoning parser sees ``</think>``): through the tiny engine, whose random weights write
``</think>`` only because a logits processor forces its tokens (seven of them: the tiny tokenizer
has no ``</think>`` token, so the end spans tokens), the reasoning is sampled as without a grammar
and the content after ``</think>`` follows it; the matcher rebuilt after a drop skips the
reasoning too; and the server's chat route and ``LLM.chat`` in thinking mode, with the openai
client."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import openai
import pytest
import torch
from engine_records import random_prompts, tiny
from server_utils import running_server
from test_structured_output import SCHEMA, valid

from runtime.chat_template import THINK_END
from runtime.engine import Engine, EngineConfig
from runtime.reasoning import split_reasoning, thinking_params
from runtime.request import Request
from runtime.sampling_params import SamplingParams
from runtime.structured_output import StructuredOutput, json_schema_grammar

pytest.importorskip("llguidance")

AT = 4  # the output index the forced </think> starts at


def force_think_end(
    think_ids: list[int], eos: int, which: Callable[[Request], bool] = lambda r: True
) -> Callable[[Sequence[Request], torch.Tensor], torch.Tensor]:
    """A logits processor: ``which`` requests write ``think_ids`` (``</think>``) from output index
    ``AT`` on, and no EOS before it."""

    def proc(reqs: Sequence[Request], logits: torch.Tensor) -> torch.Tensor:
        for i, r in enumerate(reqs):
            k = len(r.output_ids) - AT
            if not which(r) or k >= len(think_ids):
                continue
            if k < 0:
                logits[i, eos] = float("-inf")
            else:
                logits[i] = float("-inf")
                logits[i, think_ids[k]] = 0.0
        return logits

    return proc


def _cfg() -> EngineConfig:
    model, _ = tiny("cpu")
    return EngineConfig(max_batch=4, host_tokens=64 * 16, gpu_tokens=4 * model.config.index_topk,
                        max_model_len=192, prefill_chunk=64, device="cpu")  # fmt: skip


def test_the_reasoning_is_free_and_the_content_follows_the_grammar() -> None:
    """r0 (grammar after the reasoning, </think> forced) samples its reasoning exactly as r1 (the
    same request without a grammar) does, then writes JSON that follows the schema and ends with
    EOS. r2 (grammar after the reasoning, never writes </think>) is never masked: it equals r3
    (no grammar) and runs to max_tokens."""
    model, tok = tiny("cpu")
    eos = model.config.eos_token_id
    think = tok.encode(THINK_END, add_bos=False)
    assert len(think) > 1  # the end spans tokens
    prompt = random_prompts([30], model.config.vocab_size, seed=5)[0]
    grammar = json_schema_grammar(SCHEMA)
    gated = SamplingParams(max_tokens=80, seed=4, grammar=grammar, grammar_after_reasoning=True)
    free = SamplingParams(max_tokens=AT + len(think), seed=4)
    params = [gated, free, replace(gated, max_tokens=12, seed=7),
              SamplingParams(max_tokens=12, seed=7)]  # fmt: skip
    eng = Engine(model, model.config, tok, _cfg())
    eng.logits_processors.append(force_think_end(think, eos, lambda r: r.request_id in "r0 r1"))
    out: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", prompt, p)
        out[f"r{i}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    r0, r1 = out["r0"], out["r1"]
    n = AT + len(think)
    assert r0[:n] == r1 and r1[AT:] == think  # the reasoning unmasked, as without a grammar
    reasoning, content = split_reasoning(tok.decode(r0))
    assert reasoning == tok.decode(r0[:AT]) and not reasoning.startswith("{")
    assert r0[-1] == eos and content is not None and valid(json.loads(content)), content
    assert out["r2"] == out["r3"] and len(out["r2"]) == 12  # never masked: no </think>


class _R:  # the fields StructuredOutput reads
    def __init__(self, rid: str, params: SamplingParams, output_ids: list[int]) -> None:
        self.request_id, self.params, self.output_ids = rid, params, output_ids


def test_a_rebuilt_matcher_skips_the_reasoning_too() -> None:
    """A step without the request drops its grammar state; the rebuild finds where </think>
    ended in the output and starts the grammar there: at every length, the same mask as the state
    kept step by step (a rebuild that fed the reasoning to the matcher failed it: EOS only)."""
    model, tok = tiny("cpu")
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA), grammar_after_reasoning=True)
    think = tok.encode(THINK_END, add_bos=False)
    text = tok.encode('hmm, {"ok": no', add_bos=False)
    out = text + think + tok.encode('{"ok":', add_bos=False)
    kept = StructuredOutput(tok, vocab, eos)
    logits = torch.randn(1, vocab)
    for n in range(len(out) + 1):
        r = _R("a", params, out[:n])
        rebuilt = StructuredOutput(tok, vocab, eos)
        rebuilt([_R("a", params, out[: n // 2])], logits)  # a state of some earlier step...
        rebuilt([], logits)  # ...dropped
        got, want = rebuilt([r], logits), kept([r], logits)
        assert torch.equal(got, want), n
        if n < len(text) + len(think):  # no mask before </think> is complete
            assert got is logits, n
        else:
            allowed = torch.isfinite(got[0]).nonzero().flatten().tolist()
            assert eos not in allowed and allowed, n  # the JSON goes on
            if n == len(text) + len(think):
                assert all(tok.decode([t]).lstrip().startswith("{") for t in allowed)


def test_the_reasoning_is_read_once_however_long() -> None:
    """Step by step, the search for </think> reads each new output token once (a rescan of the
    output so far per step is quadratic in a long reasoning, and it runs in every decode step),
    and none once the grammar has started."""
    model, tok = tiny("cpu")
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA), grammar_after_reasoning=True)
    words = tok.encode("so, </thi maybe <not> yet </ then", add_bos=False)
    think = tok.encode(THINK_END, add_bos=False)
    out = [words[i % len(words)] for i in range(2000)] + think + tok.encode('{"ok":', add_bos=False)
    reads = []

    class Counting(StructuredOutput):
        def _token_bytes(self, token_id: int) -> bytes:
            reads.append(token_id)
            return super()._token_bytes(token_id)

    so, logits = Counting(tok, vocab, eos), torch.randn(1, vocab)
    for n in range(1, len(out) + 1):
        got = so([_R("a", params, out[:n])], logits)
        assert (got is logits) == (n < 2000 + len(think)), n
    assert reads == out[: 2000 + len(think)]


def test_text_after_think_end_in_the_same_token_is_left_outside_the_grammar() -> None:
    """A token that carries text after </think> (no such token in V3.2's tokenizer): the grammar
    starts at the next token, as vLLM's, so the mask then is that of a fresh grammar."""
    model, tok = tiny("cpu")
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    joined = tok.encode("x", add_bos=False)[0]

    class Tok:  # the tiny tokenizer, with one token reading "</think>\n"
        def __init__(self) -> None:
            self._tok = tok._tok

        def token_bytes(self, t: int) -> bytes:
            return (THINK_END + "\n").encode() if t == joined else tok.token_bytes(t)

    params = SamplingParams(grammar=json_schema_grammar(SCHEMA), grammar_after_reasoning=True)
    so = StructuredOutput(Tok(), vocab, eos)  # type: ignore[arg-type]
    logits = torch.randn(1, vocab)
    assert so([_R("a", params, [7])], logits) is logits
    got = so([_R("a", params, [7, joined])], logits)
    fresh = StructuredOutput(tok, vocab, eos)([_R("b", SamplingParams(grammar=params.grammar), [])],
                                              logits)  # fmt: skip
    assert torch.equal(got, fresh)


def test_thinking_params_sets_the_flag_only_with_a_grammar() -> None:
    plain = SamplingParams()
    assert thinking_params(plain) is plain
    assert thinking_params(SamplingParams(grammar="x")).grammar_after_reasoning


def test_a_non_boolean_grammar_after_reasoning_is_refused() -> None:
    with pytest.raises(ValueError, match="grammar_after_reasoning must be a boolean"):
        SamplingParams(grammar_after_reasoning=1)  # type: ignore[arg-type]


# ---- the server and LLM.chat, over the real tiny engine ----------------------------------------
def _llm():  # noqa: ANN202
    """The tiny checkpoint's LLM with the processor that forces </think> in every request."""
    from echo_compile.llm import LLM

    llm = LLM(
        "tiny", device="cpu", compile=False, offload=True, max_batch=4, host_tokens=64 * 64,
        gpu_tokens=4 * 32, max_model_len=2048, progress=False,
    )  # fmt: skip
    tok = llm.tokenizer
    think = tok.encode(THINK_END, add_bos=False)
    llm.engine.logits_processors.append(force_think_end(think, tok.eos_token_id))
    return llm


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from runtime.async_engine import AsyncEngine
    from runtime.server import build_app

    engine = AsyncEngine(_llm().engine)
    try:
        with running_server(build_app(engine, "tiny")) as base:
            yield base
    finally:
        engine.shutdown()


THINK = {"chat_template_kwargs": {"thinking": True}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_server_json_response_after_the_reasoning(url: str, stream: bool) -> None:
    """response_format json_schema in thinking mode (a 400 before): the reasoning comes back as
    reasoning_content, the content is the JSON the grammar forced after </think>."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    kw = dict(model="tiny", messages=MSGS, max_tokens=80, seed=2, response_format=fmt,
              extra_body=THINK)  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        reason = chunks[-1].choices[0].finish_reason
    else:
        c = client.chat.completions.create(**kw).choices[0]
        reasoning, content, reason = c.message.reasoning_content, c.message.content, c.finish_reason
    assert reason == "stop" and reasoning and not reasoning.startswith("{"), reasoning
    assert valid(json.loads(content)), content


def test_server_forced_tool_call_after_the_reasoning(url: str) -> None:
    """tool_choice required in thinking mode (a 400 before): the call block is forced after
    </think> and parsed from the content."""
    from test_server_tools import TOOLS, _weather_args

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    c = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS[:1], tool_choice="required",
        parallel_tool_calls=False, max_tokens=300, seed=3, extra_body=THINK,
    ).choices[0]  # fmt: skip
    assert c.finish_reason == "tool_calls" and not c.message.content, c.message
    assert c.message.reasoning_content
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    _weather_args(c.message.tool_calls[0])


def test_llm_chat_in_thinking_mode_starts_the_grammar_after_the_reasoning() -> None:
    """LLM.chat with thinking on and a grammar in its params constrains the content only, as the
    server does (from the first token, the forced </think> fell outside the grammar: the request
    ended with an error)."""
    llm = _llm()
    params = SamplingParams(max_tokens=80, seed=2, grammar=json_schema_grammar(SCHEMA))
    for out in (
        llm.chat(MSGS, params, chat_template_kwargs={"thinking": True}),
        llm.chat([MSGS], [params], chat_template_kwargs={"thinking": True})[0],
    ):
        reasoning, content = split_reasoning(out.text)
        assert out.finish_reason == "stop" and reasoning, out
        assert content is not None and valid(json.loads(content)), out.text


def test_llm_chat_continuing_an_answer_starts_the_grammar_at_once() -> None:
    """A continued final message with content in thinking mode has its reasoning closed in the
    prompt: the reply is content, so the grammar starts at its first token (gated, it waited for
    a </think> that never came, and the reply was unconstrained)."""
    from echo_compile.llm import LLM

    llm = LLM(
        "tiny", device="cpu", compile=False, offload=True, max_batch=4, host_tokens=64 * 64,
        gpu_tokens=4 * 32, max_model_len=2048, progress=False,
    )  # fmt: skip
    msgs = [*MSGS, {"role": "assistant", "content": "Here:"}]
    params = SamplingParams(max_tokens=80, seed=2, grammar=json_schema_grammar(SCHEMA))
    out = llm.chat(
        msgs, params, chat_template_kwargs={"thinking": True}, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    assert out.finish_reason == "stop" and valid(json.loads(out.text)), out.text
