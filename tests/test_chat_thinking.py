"""DeepSeek-V3.2's thinking mode (``chat_template_kwargs`` ``thinking``): the prompt rendered by
the release's rules (runtime.chat_template, against hand-written strings), the reasoning split
from the reply (runtime.reasoning; streamed chunked anyhow equals non-streamed), and the server's
``reasoning_content`` / ``reasoning`` through the openai client over a scripted fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from server_utils import make_tokenizer_dir, running_server
from test_server import MODEL, FakeEngine, _Req
from text_copies import Piece

from runtime.async_engine import AsyncEngine
from runtime.chat_template import (
    THINK_END,
    normalise_messages,
    render_dsv32,
    render_tools,
    thinking_of,
)
from runtime.reasoning import ReasoningStream, split_reasoning
from runtime.sampling_params import SamplingParams
from runtime.server import build_app
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import CALLS_BEGIN, CALLS_END

U, A, D = "<｜User｜>", "<｜Assistant｜>", "｜DSML｜"
CALL = {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
BLOCK = f'{CALLS_BEGIN}\n<{D}invoke name="ping">\n\n</{D}invoke>\n{CALLS_END}'


def render(msgs: list, thinking: bool, functions: list | None = None) -> str:
    return render_dsv32(normalise_messages(msgs), functions, "<B>", "<E>", thinking)


# ---- the prompt --------------------------------------------------------------------------------
def test_one_turn_opens_think_in_thinking_mode_only() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert render(msgs, True) == f"<B>S{U}Hi{A}<think>"
    assert render(msgs, False) == f"<B>S{U}Hi{A}</think>"


def test_history_reasoning_is_dropped_before_the_last_user_message() -> None:
    msgs = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "one and one"},
        {"role": "developer", "content": "2+2?"},
    ]
    want = f"<B>{U}1+1?{A}</think>2<E>{U}\n\n# The user's message is: 2+2?{A}<think>"
    assert render(msgs, True) == want
    assert render(msgs, False) == want.replace("<think>", "</think>")


def test_tool_turn_after_the_last_user_keeps_its_reasoning() -> None:
    """The current turn's assistant message carries its reasoning before ``</think>``, and its
    tool results reopen ``<think>``; in chat mode neither."""
    fns = [PING["function"]]
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "reasoning": "call ping", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "pong"},
    ]
    results = "\n\n<function_results>\n<result>pong</result>\n</function_results>\n\n"
    head = "<B>S\n\n" + render_tools(fns) + f"{U}Go{A}"
    assert render(msgs, True, fns) == (
        head + "<think>call ping</think>\n\n" + BLOCK + "<E>" + results + "<think>"
    )
    assert render(msgs, False, fns) == head + "</think>\n\n" + BLOCK + "<E>" + results + "</think>"


@pytest.mark.parametrize(
    ("msgs", "match"),
    [
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            r"messages\[1\]: in thinking mode an assistant message after the last user",
        ),
        (
            [{"role": "assistant", "content": "b", "reasoning_content": "x", "reasoning": "y"}],
            r"messages\[0\]: reasoning_content and reasoning differ",
        ),
        (
            [{"role": "assistant", "content": "b", "reasoning_content": 5}],
            r"messages\[0\].reasoning_content must be a string",
        ),
    ],
    ids=["no-reasoning", "both-differ", "not-a-string"],
)
def test_bad_reasoning_is_named(msgs: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render(msgs, True)


def test_tool_message_error_names_the_callers_index_after_a_merged_system() -> None:
    """With tools, the system prompt merges into the tools block; a bad tool message was named
    at its index in the list without it (messages[1] for the third message)."""
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Go"},
        {"role": "tool", "content": "pong"},
    ]
    with pytest.raises(ValueError, match=r"^messages\[2\]: a tool message must follow"):
        render(msgs, False, [PING["function"]])


def test_thinking_of_reads_vllms_keys() -> None:
    assert thinking_of(None) is False and thinking_of({}) is False
    assert thinking_of({"thinking": True}) and thinking_of({"enable_thinking": True})
    assert thinking_of({"thinking": False, "foo": 1}) is False  # other keys: ignored, as vLLM
    # what was sent, in JSON's words (it was "got 1", "got list")
    with pytest.raises(ValueError, match=r"\.enable_thinking must be a boolean, got integer$"):
        thinking_of({"enable_thinking": 1})
    with pytest.raises(ValueError, match=r"kwargs\.thinking must be a boolean, got 'yes'$"):
        thinking_of({"thinking": "yes"})
    with pytest.raises(ValueError, match=r"chat_template_kwargs must be an object, got array$"):
        thinking_of([])  # type: ignore[arg-type]


# ---- the reasoning split -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("hmm</think>Four.", ("hmm", "Four.")),
        ("hmm</think>", ("hmm", None)),
        ("still thinking</thi", ("still thinking</thi", None)),  # cut by max_tokens
        ("a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_split_reasoning(text: str, want: tuple) -> None:
    assert split_reasoning(text) == want


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("text", ["hmm</think>Four.", "never closed </thin", "<</think>>"])
def test_streamed_split_equals_non_streamed(text: str, size: int) -> None:
    s, parts = ReasoningStream(), []
    for k in range(0, len(text), size):
        parts.append(s.feed(text[k : k + size]))
    parts.append(s.finish())
    reasoning, content = split_reasoning(text)
    assert "".join(p[0] for p in parts) == reasoning
    assert "".join(p[1] for p in parts) == (content or "")


def test_streamed_split_in_time_linear_in_the_text() -> None:
    # a long reasoning with partial </think>s that come to nothing, then the content: each feed
    # may look at its delta and the held-back partial tag only
    words = ["Hmm", " so", " </th", "in", "k", "\n", "</", "x"]
    deltas = [Piece(words[i % len(words)]) for i in range(3000)]
    deltas += [Piece("</thi"), Piece("nk>Four"), Piece(".")]
    text = "".join(deltas)
    Piece.copied = 0
    s = ReasoningStream()
    parts = [s.feed(d) for d in deltas] + [s.finish()]
    reasoning, content = split_reasoning(text)
    assert "".join(p[0] for p in parts) == reasoning and content == "Four."
    assert "".join(p[1] for p in parts) == content
    # held + delta per feed; text += delta copied the text so far: ~ 3000**2 / 2 * 3 characters
    assert Piece.copied <= len(text) + len(deltas) * len(THINK_END), Piece.copied


# ---- through the server ------------------------------------------------------------------------
class ScriptedEngine(FakeEngine):
    """The fake engine whose "model" writes ``script`` (token ids), then EOS."""

    script: list[int] = []
    params: SamplingParams | None = None  # the last request's

    def cycle(self, r: _Req) -> list[int]:
        self.params = r.params
        return [*self.script, self.tokenizer.eos_token_id]


@contextmanager
def fake_server(engine: ScriptedEngine) -> Iterator[str]:
    """The real HTTP server over ``engine``; yields its base URL."""
    engine.max_model_len = 4096  # (the tools block alone is ~650 tokens of this tokenizer)
    a = AsyncEngine(engine)
    try:
        with running_server(build_app(a, MODEL, api_key=None)) as base:
            yield base
    finally:
        a.shutdown()


@contextmanager
def scripted_server(
    factory: pytest.TempPathFactory, cls: type[ScriptedEngine] = ScriptedEngine
) -> Iterator[tuple[str, ScriptedEngine]]:
    """A ``cls`` engine on the tiny test tokenizer behind ``fake_server``: (base URL, engine);
    the served fixtures of the chat, Responses and Messages tests."""
    engine = cls(Tokenizer.from_dir(make_tokenizer_dir(factory.mktemp("tok"))))
    with fake_server(engine) as base:
        yield base, engine


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedEngine]]:
    with scripted_server(tmp_path_factory) as s:
        yield s


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)


THINK = {"chat_template_kwargs": {"thinking": True}}
HI = [{"role": "user", "content": "Hi"}]


def say(engine: ScriptedEngine, text: str) -> None:
    """The scripted engine's next replies: ``text``'s tokens, then EOS."""
    engine.script = engine.tokenizer.encode(text, add_bos=False)


def test_reasoning_is_split_from_the_content(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, "Let me see.</think>Hello there!")
    r = client.chat.completions.create(model=MODEL, messages=HI, extra_body=THINK, n=2)
    for c in r.choices:
        m = c.message
        assert (m.reasoning_content, m.reasoning) == ("Let me see.", "Let me see.")
        assert m.content == "Hello there!" and c.finish_reason == "stop"
    # the prompt is rendered in thinking mode (the test tokenizer's jinja template has none)
    tok = engine.tokenizer
    want = render_dsv32(normalise_messages(HI), None, tok.bos_token, tok.eos_token, True)
    assert r.usage.prompt_tokens == len(tok.encode(want, add_bos=False))
    t = httpx.post(url + "/tokenize", json={"messages": HI, **THINK}, timeout=30).json()
    assert t["tokens"] == tok.encode(want, add_bos=False)
    # streamed: the reasoning in reasoning deltas, then the content; the same text
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=HI, extra_body=THINK, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    assert reasoning == "Let me see." and "".join(d.content or "" for d in deltas) == "Hello there!"
    kinds = [
        "r" if getattr(d, "reasoning_content", None) else "c" for d in deltas if d.content or
        getattr(d, "reasoning_content", None)
    ]  # fmt: skip
    assert kinds == sorted(kinds, reverse=True)  # no reasoning after content
    # without thinking: unchanged, the whole text is content and no reasoning field
    plain = client.chat.completions.create(model=MODEL, messages=HI).choices[0].message
    assert plain.content == "Let me see.</think>Hello there!"
    assert "reasoning_content" not in plain.model_dump(exclude_unset=True)


def test_max_tokens_while_thinking_is_all_reasoning(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    say(engine, "Let me see.</think>Hello there!")
    n = len(engine.tokenizer.encode("Let me", add_bos=False))
    want = engine.tokenizer.decode(engine.script[:n])
    kw = dict(model=MODEL, messages=HI, extra_body=THINK, max_tokens=n)
    c = openai_client(url).chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    assert c.message.reasoning_content == want
    chunks = list(openai_client(url).chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == want
    assert not "".join(d.content or "" for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_from_the_content_only(
    served: tuple[str, ScriptedEngine], stream: bool
) -> None:
    url, engine = served
    say(engine, "I should ping.</think>\n\n" + BLOCK)
    kw = dict(model=MODEL, messages=HI, extra_body=THINK, tools=[PING])
    if stream:
        deltas = [
            c.choices[0].delta
            for c in openai_client(url).chat.completions.create(**kw, stream=True)
            if c.choices
        ]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [t for d in deltas for t in (d.tool_calls or [])]
    else:
        m = openai_client(url).chat.completions.create(**kw).choices[0].message
        reasoning, content, calls = m.reasoning_content, m.content, m.tool_calls
    assert reasoning == "I should ping." and not content
    assert [t.function.name for t in calls] == ["ping"]


def test_bad_chat_template_kwargs_are_a_400(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    say(engine, "x")
    client = openai_client(url)
    for bad in ({"thinking": "yes"}, {"enable_thinking": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=HI, extra_body={"chat_template_kwargs": bad}
            )
        assert e.value.body["param"] == "chat_template_kwargs", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=HI, extra_body={"chat_template_kwargs": 5}
        )
    assert e.value.body["param"] == "chat_template_kwargs"
    # a key this model does not read is ignored, as vLLM's V3.2 encoding ignores it
    r = client.chat.completions.create(
        model=MODEL, messages=HI, extra_body={"chat_template_kwargs": {"foo": 1}}
    )
    assert r.choices[0].message.content == "x"


@pytest.mark.parametrize(
    ("extra", "script"),
    [
        ({"tools": [PING], "tool_choice": "required"}, "\n\n" + BLOCK),
        (
            {"tools": [PING], "tool_choice": {"type": "function", "function": {"name": "ping"}}},
            "\n\n" + BLOCK,
        ),
        ({"response_format": {"type": "json_object"}}, '{"a":1}'),
    ],
    ids=["required", "named", "json"],
)
def test_a_grammar_starts_after_the_reasoning_in_thinking_mode(
    served: tuple[str, ScriptedEngine], extra: dict, script: str
) -> None:
    """A forced call or a response format in thinking mode (a 400 once): the engine gets the
    grammar marked to start after </think> (grammar_after_reasoning; the real engine's side is
    tests/test_thinking_grammar.py), and the reply's content after the reasoning is the call or
    the JSON. Without thinking the grammar starts at the first token, as before."""
    url, engine = served
    say(engine, "Let me see.</think>" + script)
    c = openai_client(url).chat.completions.create(
        model=MODEL, messages=HI, extra_body=THINK, **extra
    )
    m = c.choices[0].message
    assert engine.params is not None and engine.params.grammar is not None
    assert engine.params.grammar_after_reasoning
    assert m.reasoning_content == "Let me see."
    if "tools" in extra:
        assert c.choices[0].finish_reason == "tool_calls" and not m.content
        assert [t.function.name for t in m.tool_calls] == ["ping"]
    else:
        assert c.choices[0].finish_reason == "stop" and m.content == '{"a":1}'
    say(engine, script)
    r = openai_client(url).chat.completions.create(model=MODEL, messages=HI, **extra)
    assert r.choices[0].finish_reason in ("stop", "tool_calls")
    assert not engine.params.grammar_after_reasoning


def test_a_continued_answer_in_thinking_mode_has_its_grammar_from_the_first_token(
    served: tuple[str, ScriptedEngine],
) -> None:
    """continue_final_message with content: the reasoning is closed in the prompt, so the reply
    is content and a response format's grammar starts at once, not after a </think> that never
    comes."""
    url, engine = served
    say(engine, '1}')
    msgs = [*HI, {"role": "assistant", "content": '{"a":'}]
    extra = {**THINK, "continue_final_message": True, "add_generation_prompt": False}
    c = openai_client(url).chat.completions.create(
        model=MODEL, messages=msgs, extra_body=extra, response_format={"type": "json_object"}
    )
    assert engine.params is not None and engine.params.grammar is not None
    assert not engine.params.grammar_after_reasoning
    assert c.choices[0].message.content == "1}"
