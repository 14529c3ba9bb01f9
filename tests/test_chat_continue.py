"""vLLM's ``add_generation_prompt`` and ``continue_final_message`` (runtime.chat_template): the
prompt against hand-written strings (DeepSeek-V3.2's encoding in chat and thinking mode, the
tiny checkpoint's jinja template and the test tokenizer's), and through the server with the
openai client (``extra_body``) and ``/tokenize``: the reply is the continuation only, the errors
are 400s naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import BOS, EOS, make_tokenizer_dir
from test_chat_thinking import BLOCK, CALL, PING, ScriptedEngine, fake_server, openai_client, say
from test_server import MODEL

from model.checkpoint import CHAT_TEMPLATE as TINY_TEMPLATE
from runtime.chat_template import normalise_messages, render_chat, render_dsv32
from runtime.tokenizer import Tokenizer

U, A = "<｜User｜>", "<｜Assistant｜>"
HI = {"role": "user", "content": "Hi"}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": "pong"}
RESULTS = "\n\n<function_results>\n<result>pong</result>\n</function_results>"


def render(msgs: list, thinking: bool = False, gen: bool = True, cont: bool = False) -> str:
    return render_dsv32(normalise_messages(msgs), None, "<B>", "<E>", thinking, gen, cont)


def said(content: str | None, reasoning: str | None = None, **kw) -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, **kw}


# ---- DeepSeek-V3.2's encoding ------------------------------------------------------------------
def test_continued_message_in_chat_mode_is_left_open() -> None:
    assert render([HI, said("Hel")], cont=True) == f"<B>{U}Hi{A}</think>Hel"
    # chat mode drops the reasoning, as for any earlier turn
    assert render([HI, said("Hel", "why")], cont=True) == f"<B>{U}Hi{A}</think>Hel"
    # after tool results the turn is already open; after a closed turn it is opened
    calls = said(None, tool_calls=[CALL])
    want = f"<B>{U}Hi{A}</think>\n\n{BLOCK}<E>{RESULTS}\n\n</think>The"
    assert render([HI, calls, TOOL, said("The")], cont=True) == want
    sys = {"role": "system", "content": "S"}
    assert render([sys, said("Hel")], cont=True) == f"<B>S{A}</think>Hel"


@pytest.mark.parametrize(
    ("reasoning", "content", "tail"),
    [
        ("why", "Hel", "<think>why</think>Hel"),  # content: the reasoning closed before it
        ("why", None, "<think>why"),  # no content yet: the reasoning stays open
        (None, "Hel", "<think></think>Hel"),
        (None, None, "<think>"),  # nothing yet: the generation prompt
    ],
)
def test_continued_message_in_thinking_mode(reasoning, content, tail) -> None:
    # (an assistant message after the last user needs reasoning or tool calls unless continued)
    assert render([HI, said(content, reasoning)], True, cont=True) == f"<B>{U}Hi{A}{tail}"


def test_without_the_generation_prompt_nothing_opens_the_reply() -> None:
    for thinking in (False, True):
        assert render([HI], thinking, gen=False) == f"<B>{U}Hi"
    sys = {"role": "system", "content": "S"}
    assert render([sys], gen=False) == "<B>S"
    calls = said(None, tool_calls=[CALL])
    assert render([HI, calls, TOOL], gen=False) == f"<B>{U}Hi{A}</think>\n\n{BLOCK}<E>{RESULTS}"


# ---- render_chat: the rules and the jinja templates --------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok._tok, BOS, EOS, chat_template=template)


@pytest.mark.parametrize(
    ("msgs", "gen", "tools", "match"),
    [
        ([HI, said("x")], True, None, "continue_final_message and add_generation_prompt cannot"),
        ([HI], False, None, r"the assistant's, messages\[0\] is a user message"),
        ([HI, said("x"), HI], False, None, r"messages\[2\] is a user message"),
        ([HI, said(None, tool_calls=[CALL])], False, None, r"messages\[1\] has tool_calls"),
        ([HI, said("x")], False, None, None),
        ([HI, said("x")], False, [PING["function"]], None),
    ],
)
def test_continue_final_message_rules(tok: Tokenizer, msgs, gen, tools, match) -> None:
    for t in (tok, with_template(tok, None)):  # a jinja template, and DeepSeek-V3.2's encoding
        if match is None:
            assert render_chat(t, msgs, gen, tools, continue_final=True).endswith("x")
            continue
        with pytest.raises(ValueError, match=match) as e:
            render_chat(t, msgs, gen, tools, continue_final=True)
        assert str(e.value).startswith("continue_final_message")  # (the server's param)


def test_tiny_checkpoint_template_is_cut_after_the_final_content(tok: Tokenizer) -> None:
    tiny = with_template(tok, TINY_TEMPLATE)
    msgs = [{"role": "system", "content": "Be brief."}, HI, said("Hello")]
    head = f"{BOS}Be brief.{U}Hi{A}"
    assert render_chat(tiny, msgs, False) == head + f"Hello{EOS}"
    assert render_chat(tiny, msgs, False, continue_final=True) == head + "Hello"
    assert render_chat(tiny, msgs[:2], False) == f"{BOS}Be brief.{U}Hi"
    # trailing whitespace the template keeps is kept; the content's last occurrence is cut at
    msgs = [{"role": "user", "content": "Hello "}, said("Hello ")]
    assert render_chat(tiny, msgs, False, continue_final=True) == f"{BOS}{U}Hello {A}Hello "


def test_a_trimming_template_keeps_its_trim(tok: Tokenizer) -> None:
    trims = with_template(
        tok, "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | trim }}[end]{% endfor %}"
    )
    got = render_chat(trims, [HI, said("  Hello \n")], False, continue_final=True)
    assert got == "[user]Hi[end][assistant]Hello"


def test_a_content_the_template_does_not_render_cannot_be_continued(tok: Tokenizer) -> None:
    upper = with_template(tok, "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(ValueError, match=r"does not render messages\[1\]\.content as it is"):
        render_chat(upper, [HI, said("hello")], False, continue_final=True)
    with pytest.raises(ValueError, match=r"messages\[1\]\.content is empty"):
        render_chat(tok, [HI, said(" ")], False, continue_final=True)


# ---- through the server ------------------------------------------------------------------------
class RecordingEngine(ScriptedEngine):
    """``ScriptedEngine`` that keeps the last prompt it was given."""

    prompt: list[int] = []

    def add_request(self, request_id, prompt_token_ids, params):
        self.prompt = list(prompt_token_ids)
        super().add_request(request_id, prompt_token_ids, params)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RecordingEngine]]:
    path: Path = make_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    engine = RecordingEngine(Tokenizer.from_dir(path))
    with fake_server(engine) as base:
        yield base, engine


CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
THINK = {"chat_template_kwargs": {"thinking": True}}


def _tokenize(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/tokenize", json=body, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_continues_the_final_message(served, stream: bool) -> None:
    url, engine = served
    say(engine, " there!")
    msgs = [HI, said("Hello")]
    kw = dict(model=MODEL, messages=msgs, extra_body=CONTINUE)
    if stream:
        chunks = list(openai_client(url).chat.completions.create(**kw, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        content = openai_client(url).chat.completions.create(**kw).choices[0].message.content
    assert content == " there!"  # the continuation only, as vLLM's
    # the test tokenizer's template, cut after the content: no <|end|>, no new turn
    want = engine.tokenizer.encode(f"{BOS}<|user|>Hi<|end|><|assistant|>Hello", add_bos=False)
    assert engine.prompt == want
    assert _tokenize(url, {"messages": msgs, **CONTINUE}).json()["tokens"] == want


def test_chat_without_the_generation_prompt(served) -> None:
    url, engine = served
    say(engine, "x")
    extra = {"add_generation_prompt": False}
    openai_client(url).chat.completions.create(model=MODEL, messages=[HI], extra_body=extra)
    want = engine.tokenizer.encode(f"{BOS}<|user|>Hi<|end|>", add_bos=False)
    assert engine.prompt == want
    assert _tokenize(url, {"messages": [HI], **extra}).json()["tokens"] == want


def test_thinking_mode_continuation_is_split_by_where_it_starts(served) -> None:
    url, engine = served
    client = openai_client(url)
    bos, eos = engine.tokenizer.bos_token, engine.tokenizer.eos_token
    # continuing the content: the reply is all content (its reasoning was closed in the prompt)
    say(engine, " world</think>!")
    msgs = [HI, said("Hello", "greet")]
    m = (
        client.chat.completions.create(model=MODEL, messages=msgs, extra_body={**CONTINUE, **THINK})
        .choices[0]
        .message
    )
    assert m.content == " world</think>!" and getattr(m, "reasoning_content", None) is None
    want = render_dsv32(normalise_messages(msgs), None, bos, eos, True, False, True)
    assert want.endswith(f"{A}<think>greet</think>Hello")
    assert engine.prompt == engine.tokenizer.encode(want, add_bos=False)
    # continuing the reasoning: split at </think> as a thinking reply
    say(engine, " more.</think>Hi!")
    msgs = [HI, said(None, "greet")]
    m = (
        client.chat.completions.create(model=MODEL, messages=msgs, extra_body={**CONTINUE, **THINK})
        .choices[0]
        .message
    )
    assert (m.reasoning_content, m.content) == (" more.", "Hi!")
    chunks = client.chat.completions.create(
        model=MODEL, messages=msgs, extra_body={**CONTINUE, **THINK}, stream=True
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == " more."
    assert "".join(d.content or "" for d in deltas) == "Hi!"


@pytest.mark.parametrize(
    ("msgs", "extra", "match"),
    [
        ([HI, said("x")], {"continue_final_message": True}, "add_generation_prompt defaults"),
        ([HI, said("x")], {**CONTINUE, "add_generation_prompt": True}, "cannot both be true"),
        ([HI], CONTINUE, r"messages\[0\] is a user message"),
        ([HI, said(None, tool_calls=[CALL])], CONTINUE, r"messages\[1\] has tool_calls"),
    ],
    ids=["default-generation-prompt", "both", "user-last", "tool-calls"],
)
def test_bad_continuations_are_a_400_naming_the_field(served, msgs, extra, match) -> None:
    url, engine = served
    say(engine, "x")
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(url).chat.completions.create(model=MODEL, messages=msgs, extra_body=extra)
    err = e.value.body
    assert err["param"] == "continue_final_message"
    assert re.search(match, err["message"])
    r = _tokenize(url, {"messages": msgs, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_deepseek_prefix_true_continues_the_last_message(served) -> None:
    """DeepSeek's API's chat prefix completion: ``"prefix": true`` on the last message, the
    assistant's, continues it as continue_final_message does (ignored once: a new turn began);
    on any other message it is a 400 naming it."""
    url, engine = served
    say(engine, " there!")
    msgs = [HI, {**said("Hello"), "prefix": True}]
    c = openai_client(url).chat.completions.create(model=MODEL, messages=msgs)
    assert c.choices[0].message.content == " there!"
    want = engine.tokenizer.encode(f"{BOS}<|user|>Hi<|end|><|assistant|>Hello", add_bos=False)
    assert engine.prompt == want
    assert _tokenize(url, {"messages": msgs}).json()["tokens"] == want
    for bad, i in (([{**HI, "prefix": True}], 0), ([HI, {**said("x"), "prefix": True}, HI], 1)):
        with pytest.raises(openai.BadRequestError) as e:
            openai_client(url).chat.completions.create(model=MODEL, messages=bad)
        assert e.value.body["param"] == f"messages[{i}].prefix"
        assert _tokenize(url, {"messages": bad}).status_code == 400


@pytest.mark.parametrize(
    ("last", "match"),
    [(said(None, tool_calls=[CALL]), "has tool_calls"), (said("  "), "content is empty")],
    ids=["tool-calls", "empty"],
)
def test_a_prefix_that_cannot_continue_names_prefix(served, last: dict, match: str) -> None:
    """``prefix: true`` on a last message that cannot be continued: the 400 names the field the
    client sent (``messages[i].prefix``), not vLLM's ``continue_final_message`` it never sent."""
    url, engine = served
    say(engine, "x")
    msgs = [HI, {**last, "prefix": True}]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(url).chat.completions.create(model=MODEL, messages=msgs)
    err = e.value.body
    assert err["param"] == "messages[1].prefix"
    assert err["message"].startswith("messages[1].prefix") and re.search(match, err["message"])
    r = _tokenize(url, {"messages": msgs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].prefix"


# ---- echo (vLLM's): the last message, the assistant's, before the reply ------------------------
def _create(url: str, msgs: list, extra: dict, stream: bool, **kw):
    """(content, reasoning, chunks) of a chat request, joined over the deltas when streamed."""
    r = openai_client(url).chat.completions.create(
        model=MODEL, messages=msgs, extra_body={"echo": True, **extra}, stream=stream, **kw
    )
    if not stream:
        m = r.choices[0].message
        return m.content, getattr(m, "reasoning_content", None), [r]
    chunks = list(r)
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == 0]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return content, reasoning or None, chunks


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_continued_message_before_the_reply(served, stream: bool) -> None:
    url, engine = served
    say(engine, " there!")
    content, _, chunks = _create(url, [HI, said("Hello")], CONTINUE, stream, n=2)
    assert content == "Hello there!"
    if stream:  # vLLM's: every choice's role, then every choice's echo, without logprobs
        heads = [c.choices[0] for c in chunks[:4]]
        assert [(h.index, h.delta.role, h.delta.content) for h in heads] == [
            (0, "assistant", ""), (1, "assistant", ""), (0, None, "Hello"), (1, None, "Hello")
        ]  # fmt: skip
        assert all(h.logprobs is None for h in heads)
    # a new turn after the assistant's message echoes it too (vLLM's rule: the reply's role)
    content, _, _ = _create(url, [HI, said("Hello")], {}, stream)
    assert content == "Hello there!"
    # the user's message is not the reply's role: nothing echoed
    assert _create(url, [HI], {}, stream)[0] == " there!"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_has_no_logprobs_and_counts_no_tokens(served, stream: bool) -> None:
    """vLLM's chat echo: the logprobs and usage are the generated tokens' only; n choices each
    start with the message (its text parts joined as the template joins them)."""
    url, engine = served
    say(engine, " there!")
    parts = said([{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}])
    kw = dict(logprobs=True, top_logprobs=1, n=2)
    opts = {"stream_options": {"include_usage": True}} if stream else {}
    content, _, chunks = _create(url, [HI, parts], {**CONTINUE, **opts}, stream, **kw)
    assert content == "Hel\nlo there!"
    generated = len(engine.tokenizer.encode(" there!", add_bos=False)) + 1  # (and the EOS)
    if stream:
        choices = [c.choices[0] for c in chunks if c.choices]
        assert {c.index for c in choices} == {0, 1}
        lps = [e for c in choices if c.index == 0 and c.logprobs for e in c.logprobs.content]
        usage = chunks[-1].usage
    else:
        assert [c.message.content for c in chunks[0].choices] == ["Hel\nlo there!"] * 2
        lps, usage = chunks[0].choices[0].logprobs.content, chunks[0].usage
    assert "".join(e.token for e in lps).startswith(" there!") and len(lps) == generated
    assert usage.completion_tokens == 2 * generated


@pytest.mark.parametrize("stream", [False, True])
def test_echo_in_thinking_mode_puts_back_the_part_continued(served, stream: bool) -> None:
    url, engine = served
    extra = {**CONTINUE, **THINK}
    # continuing the content: the content echoed (vLLM's), the reply all content
    say(engine, " world")
    got = _create(url, [HI, said("Hello", "greet")], extra, stream)[:2]
    assert got == ("Hello world", None)
    # continuing the reasoning (no rule in vLLM): its reasoning before the reply's
    say(engine, " more.</think>Hi!")
    assert _create(url, [HI, said(None, "greet")], extra, stream)[:2] == ("Hi!", "greet more.")
    # a reasoning never closed: the content is "" (vLLM's echo makes it a string), not null
    say(engine, " more.")
    content, reasoning, _ = _create(url, [HI, said(None, "greet")], extra, stream)
    assert (content, reasoning) == ("", "greet more.")


def test_echo_must_be_a_boolean(served) -> None:
    url, engine = served
    body = {"model": MODEL, "messages": [HI, said("x")], "echo": "yes"}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
