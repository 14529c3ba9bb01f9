"""``LLM.generate`` and ``LLM.chat`` over a batch (tiny checkpoint, CPU): a bad prompt or
conversation is an error naming its index, and nothing of the call stays queued; ``chat`` takes
one conversation or a list of them (vLLM's forms) and ``tools``, rendered as the server renders
them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from stop_cases import min_tokens_stops

from echo_compile.llm import LLM
from runtime.chat_template import normalise_messages, render_dsv32
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.aten_gemm  # CPU GEMMs without oneDNN (conftest.py)

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
HI = [{"role": "user", "content": "Hi"}]
BRIEF = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        "tiny", device="cpu", compile=False, offload=True, max_batch=8, host_tokens=64 * 64,
        gpu_tokens=8 * 32, max_model_len=1024, progress=False,
    )  # fmt: skip


def assert_nothing_queued(llm: LLM) -> None:
    assert not llm.engine.requests and not llm.engine.has_unfinished() and not llm._outputs


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ([], ValueError, "prompt 2: the prompt is empty"),
        ([5] * 1100, ValueError, r"prompt 2: prompt \(1100 tokens\) \+ max_tokens \(3\) = 1103"),
        ([5, 10**7], ValueError, r"prompt 2: prompt token ids must be in \[0, 512\)"),
        (5, TypeError, "prompt 2: a prompt must be a string or a list of token ids, got int"),
        (bytearray(b"Ho"), TypeError, "prompt 2: a prompt must be a string or a list"),
    ],
    ids=["empty", "over-context", "bad-id", "int", "bytearray"],
)
def test_generate_names_the_bad_prompt_and_queues_nothing(
    llm: LLM, bad: Any, error: type[Exception], message: str
) -> None:
    """A bad prompt of a batch is an error naming its index (it named the problem only), the
    prompts before it, already queued, are taken back, and the next call returns its own
    outputs only, those of a call that followed no error."""
    good = ["Hi", [5, 6, 7]]
    want = [r.token_ids for r in llm.generate(good, PARAMS)]
    with pytest.raises(error, match=message):
        llm.generate([*good, bad, "Ho"], PARAMS)
    assert_nothing_queued(llm)
    got = llm.generate(good, PARAMS)
    assert [r.token_ids for r in got] == want
    assert [len(r.prompt_token_ids) for r in got] == [len(llm.tokenizer.encode("Hi")), 3]
    assert_nothing_queued(llm)


def test_a_request_ending_with_an_error_says_why(llm: LLM) -> None:
    """A request left with no token to sample (min_tokens holding back every id, all of them
    stop_token_ids) ends with finish_reason "error" and its result says why, as the server's
    error response does (the reason was only logged); the others of the batch finish."""
    every = tuple(range(llm.engine.model_config.vocab_size))
    masked = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=every, temperature=0)
    bad, good = llm.generate([[5, 6, 7], [5, 6, 7]], [masked, PARAMS])
    assert (bad.finish_reason, bad.token_ids, bad.text) == ("error", [], "")
    assert bad.error is not None and "min_tokens 2" in bad.error and "stop_token_ids" in bad.error
    assert (good.finish_reason, len(good.token_ids), good.error) == ("length", 3, None)
    assert_nothing_queued(llm)


def test_chat_takes_one_conversation_or_a_list_of_them(llm: LLM) -> None:
    """A list of conversations (vLLM's batch form) is a list of results, one a conversation in
    order, each rendered as the conversation alone; one conversation is still one result. The
    params may be one a conversation (it was AttributeError: 'list' object has no attribute
    'get')."""
    one = llm.chat(HI, PARAMS)
    assert one.prompt_token_ids == llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(HI), add_bos=False
    )
    convs = [HI, BRIEF, HI]
    alone = [llm.chat(c, PARAMS).prompt_token_ids for c in convs]
    many = llm.chat(convs, PARAMS)
    assert isinstance(many, list) and [r.prompt_token_ids for r in many] == alone
    # the same batch of prompts through generate(): the same tokens
    assert [r.token_ids for r in many] == [r.token_ids for r in llm.generate(alone, PARAMS)]
    each = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 4)]
    assert [len(r.token_ids) for r in llm.chat(convs, each)] == [1, 2, 4]
    assert_nothing_queued(llm)


def test_chat_tools_are_rendered_as_the_server_renders_them(llm: LLM) -> None:
    """``tools=`` offers the functions in every conversation's prompt, in DeepSeek-V3.2's
    encoding (the server's render_chat with the tools' functions); it was a TypeError."""
    tok = llm.tokenizer
    want = render_dsv32(normalise_messages(BRIEF), [WEATHER["function"]], tok.bos_token,
                        tok.eos_token)  # fmt: skip
    assert '"name": "get_weather"' in want
    got = llm.chat([BRIEF, BRIEF], PARAMS, tools=[WEATHER])
    assert [r.prompt_token_ids for r in got] == [tok.encode(want, add_bos=False)] * 2
    assert llm.chat(BRIEF, PARAMS, tools=[WEATHER]).prompt_token_ids == got[0].prompt_token_ids
    assert (
        llm.chat(BRIEF, PARAMS, tools=[]).prompt_token_ids
        == llm.chat(BRIEF, PARAMS).prompt_token_ids
    )


def test_chat_template_kwargs_thinking_renders_thinking_mode(llm: LLM) -> None:
    """``chat_template_kwargs={"thinking": True}`` (vLLM's LLM.chat argument) renders
    DeepSeek-V3.2's thinking mode (the turn opens ``<think>``), ``enable_thinking`` too; a bad
    value is a ValueError naming the key; false is the default rendering."""
    tok = llm.tokenizer
    want = render_dsv32(normalise_messages(BRIEF), None, tok.bos_token, tok.eos_token, True)
    assert want.endswith("<｜Assistant｜><think>")
    for kw in ({"thinking": True}, {"enable_thinking": True}):
        got = llm.chat(BRIEF, PARAMS, chat_template_kwargs=kw).prompt_token_ids
        assert got == tok.encode(want, add_bos=False), kw
    off = llm.chat(BRIEF, PARAMS, chat_template_kwargs={"thinking": False}).prompt_token_ids
    assert off == llm.chat(BRIEF, PARAMS).prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_kwargs.thinking must be a boolean"):
        llm.chat(BRIEF, PARAMS, chat_template_kwargs={"thinking": "yes"})
    assert_nothing_queued(llm)


def test_chat_continues_the_final_message(llm: LLM) -> None:
    """``add_generation_prompt`` / ``continue_final_message`` (vLLM's LLM.chat arguments): the
    tiny checkpoint's template without the opened turn, or cut after the last message's content
    (no EOS); continuing needs ``add_generation_prompt=False``, as vLLM's; a conversation that
    does not end with the assistant's message is named."""
    tok, said = llm.tokenizer, {"role": "assistant", "content": "Hi"}
    head = f"{tok.bos_token}Be brief.<｜User｜>Hello"
    off = llm.chat(BRIEF, PARAMS, add_generation_prompt=False).prompt_token_ids
    assert off == tok.encode(head, add_bos=False)
    r = llm.chat([BRIEF + [said]], PARAMS, add_generation_prompt=False, continue_final_message=True)
    assert r[0].prompt_token_ids == tok.encode(head + "<｜Assistant｜>Hi", add_bos=False)
    assert len(r[0].token_ids) == 3  # (the continuation only)
    with pytest.raises(ValueError, match="conversation 0: continue_final_message and add_gen"):
        llm.chat(BRIEF + [said], PARAMS, continue_final_message=True)
    with pytest.raises(ValueError, match=r"conversation 1: continue_final_message needs the last"):
        conversations = [BRIEF + [said], BRIEF]
        llm.chat(conversations, PARAMS, add_generation_prompt=False, continue_final_message=True)
    assert_nothing_queued(llm)


@pytest.mark.parametrize(
    ("messages", "tools", "error", "message"),
    [
        ("Hi", None, TypeError, "messages must be a conversation .* got str"),
        ([], None, ValueError, "messages is empty"),
        ([HI, "Hi"], None, TypeError, "conversation 1: must be a list of message dicts, got str"),
        ([HI, [*HI, "Ho"]], None, ValueError, r"conversation 1: messages\[1\] must be a message"),
        ([HI, HI, [{"role": "robot", "content": "x"}]], None, ValueError,
         r"conversation 2: messages\[0\]\.role must be one of"),
        ([HI, [{"role": "user", "content": "fox " * 1200}]], None, ValueError,
         r"conversation 1: prompt \(\d+ tokens\) .* exceeds the model's context limit"),
        (HI, [{"type": "function"}], ValueError, r"tools\[0\]: must be"),
        ([HI], [WEATHER, {"type": "function", "function": {"name": "a b"}}], ValueError,
         r"tools\[1\]\.function\.name must match"),
        (HI, {"get_weather": WEATHER}, ValueError, "tools: must be a list"),
        ([HI], [{"type": "function", "function": {"name": "f", "description": "\ud83d"}}],
         ValueError, r"tools\[0\] contains a lone UTF-16 surrogate"),
    ],
    ids=["str", "empty", "not-a-list", "not-a-dict", "role", "over-context", "tool", "tool-name",
         "tools-dict", "tool-surrogate"],
)  # fmt: skip
def test_chat_refuses_bad_input_naming_it(
    llm: LLM, messages: Any, tools: Any, error: type[Exception], message: str
) -> None:
    """A bad conversation is a TypeError or ValueError naming its index, a bad tool names its
    entry, and nothing is queued; the next chat replies as before."""
    with pytest.raises(error, match=message):
        llm.chat(messages, PARAMS, tools=tools)
    assert_nothing_queued(llm)
    assert len(llm.chat([HI], PARAMS)) == 1


def test_a_failed_step_recovers_the_engine(llm: LLM, monkeypatch) -> None:
    """A step that raises (in the middle of a decode: a half-applied recall may leave the GPU
    pools' maps inconsistent) ends every request and resets the pools (Engine.recover, as the
    server's loop does; LLM only aborted its own requests), and the next call's tokens are those
    of a call that followed no error."""
    want = llm.generate(["Hi", [5, 6, 7]], PARAMS)
    runner, real = llm.engine.runner, llm.engine.runner.forward
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fault")
        return real(*a, **k)

    recovered = {"n": 0}
    real_recover = llm.engine.recover

    def recover() -> None:
        recovered["n"] += 1
        real_recover()

    monkeypatch.setattr(runner, "forward", failing)
    monkeypatch.setattr(llm.engine, "recover", recover)
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate(["Hi", [5, 6, 7]], PARAMS)
    assert recovered["n"] == 1
    assert_nothing_queued(llm)
    monkeypatch.setattr(runner, "forward", real)
    got = llm.generate(["Hi", [5, 6, 7]], PARAMS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_chat_names_a_lone_surrogate_by_message(llm: LLM) -> None:
    """A lone surrogate in a message is named by the message and its index in the caller's text
    (it was an index in the rendered prompt), as the server names it: one rule
    (chat_template.normalise_messages)."""
    convs = [HI, [BRIEF[0], {"role": "user", "content": "Hi \ud83d"}]]
    with pytest.raises(ValueError, match=r"conversation 1: messages\[1\]\.content contains a "
                       r"lone UTF-16 surrogate at index 3"):  # fmt: skip
        llm.chat(convs, PARAMS)
    assert_nothing_queued(llm)


def test_results_name_the_stop_that_ended_them(llm: LLM) -> None:
    """``GenerationResult.stop_reason`` is vLLM's ``CompletionOutput.stop_reason``, by the
    server's rule: the stop string the stop checker matched (with min_tokens, not the one that
    occurs first in the text), the stop token id, and None for EOS or a length limit."""
    prompt = "The cache holds"
    base = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    deltas = [o.new_text for o in llm.generate_stream(prompt, base)]
    case = min_tokens_stops(deltas)
    tok, eos = llm.generate([prompt], base)[0].token_ids[1], min(llm.engine.eos_token_ids)
    params = [
        replace(base, stop=(case.inside, case.later), min_tokens=case.min_tokens),
        replace(base, stop_token_ids=(tok,)),
        replace(base, ignore_eos=False, logit_bias={eos: 100.0}),  # EOS first
        base,
    ]
    got = llm.generate([prompt] * len(params), params)
    assert [(r.finish_reason, r.stop_reason) for r in got] == [
        ("stop", case.later), ("stop", tok), ("stop", None), ("length", None)
    ]  # fmt: skip
    assert got[2].token_ids == [eos]
