"""``POST /v1/messages`` (Anthropic's Messages API) over the scripted fake engine, through httpx
and through Anthropic's own SDK (``anthropic``, a test dependency): the message and its event
stream checked against Anthropic's documented shapes, written down here as the spec;
``system``, content blocks and a tool_use round trip rendered as the chat route renders the same
messages; thinking; the ``max_tokens`` and ``stop_sequences`` stop reasons; errors in
Anthropic's shape; its auth header and the concurrency limit.

The spec (docs.anthropic.com, "Messages" and "Streaming Messages"):

- a message: ``{"id": "msg_...", "type": "message", "role": "assistant", "model", "content":
  [blocks], "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use",
  "stop_sequence": str | null, "usage": {"input_tokens", "output_tokens",
  "cache_creation_input_tokens", "cache_read_input_tokens"}}``; blocks ``{"type": "text",
  "text"}``, ``{"type": "thinking", "thinking", "signature"}``, ``{"type": "tool_use", "id":
  "toolu_...", "name", "input": {...}}``.
- a stream: ``message_start`` (the message, content [] and stop_reason null), ``ping``, per block
  ``content_block_start`` (index, content_block empty) / ``content_block_delta`` (index, delta
  ``text_delta`` {text} | ``thinking_delta`` {thinking} | ``input_json_delta`` {partial_json}) /
  ``content_block_stop`` (index), then ``message_delta`` ({stop_reason, stop_sequence}, usage)
  and ``message_stop``; each as ``event: <type>`` and ``data: {"type": <type>, ...}``.
- an error: ``{"type": "error", "error": {"type": "invalid_request_error" | ..., "message"}}``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from server_utils import running_server
from test_chat_thinking import BLOCK, ScriptedEngine, say, scripted_server
from test_server import MODEL, _Req

from runtime.async_engine import AsyncEngine
from runtime.server import build_app
from runtime.step_output import StepOutput
from runtime.tool_calls import CALLS_BEGIN, CALLS_END

D = "｜DSML｜"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}  # fmt: skip
# a parameter whose name reads like chat's tool path, and a bad bound to be named
DOTTED = {"a.function.parameters": {"type": "string", "minLength": -1}}
DOTTED_SCHEMA = {"type": "object", "properties": DOTTED}
WEATHER = {"name": "weather", "description": "The weather.", "input_schema": WEATHER_SCHEMA}
CHAT_WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather.",
                                                  "parameters": WEATHER_SCHEMA}}  # fmt: skip
CALL = (f'{CALLS_BEGIN}\n<{D}invoke name="weather">\n<{D}parameter name="city" string="true">'
        f"Paris</{D}parameter>\n</{D}invoke>\n{CALLS_END}")  # fmt: skip
USAGE_KEYS = {"input_tokens", "output_tokens", "cache_creation_input_tokens",
              "cache_read_input_tokens"}  # fmt: skip


class PromptedEngine(ScriptedEngine):
    """The scripted engine that keeps the last request's prompt ids."""

    prompt: list[int] = []

    def cycle(self, r: _Req) -> list[int]:
        self.prompt = list(r.prompt)
        return super().cycle(r)


class CachingEngine(PromptedEngine):
    """The prompted engine with a prefix cache that serves the first ``cached`` prompt tokens."""

    config = SimpleNamespace(enable_prefix_caching=True)  # (AsyncEngine.caches_prefixes)
    cached = 0

    def step(self) -> list[StepOutput]:
        outs = super().step()
        for out in outs:
            out.cached_tokens = min(self.cached, out.prompt_tokens)
        return outs


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, PromptedEngine]]:
    with scripted_server(tmp_path_factory, PromptedEngine) as s:
        yield s


def _post(url: str, **body) -> httpx.Response:  # noqa: ANN003
    body = {"model": MODEL, "max_tokens": 1000, **body}
    headers = {"anthropic-version": "2023-06-01"}  # (accepted and ignored)
    return httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=30)


def _message(url: str, **body) -> dict:  # noqa: ANN003
    r = _post(url, **body)
    assert r.status_code == 200, r.text
    m = r.json()
    assert set(m) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence",
                      "usage"}, m  # fmt: skip
    assert re.fullmatch(r"msg_\w+", m["id"]) and (m["type"], m["role"]) == ("message", "assistant")
    assert m["model"] == MODEL and set(m["usage"]) == USAGE_KEYS
    return m


def _events(url: str, **body) -> list[dict]:  # noqa: ANN003
    """The stream's events' data, each checked against its ``event:`` line."""
    body = {"model": MODEL, "max_tokens": 1000, "stream": True, **body}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().split("\n\n")
    assert frames[-1] == ""
    out = []
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}", frame
        out.append(event)
    return out


def _streamed_message(events: list[dict]) -> dict:
    """The message the events add up to, as the Anthropic SDK accumulates it, checking the
    events' order and indices on the way."""
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    m = events[0]["message"]
    assert m["content"] == [] and m["stop_reason"] is None and m["stop_sequence"] is None
    open_at = None
    for e in events[2:-2]:
        if e["type"] == "content_block_start":
            assert open_at is None and e["index"] == len(m["content"])
            m["content"].append(dict(e["content_block"]))
            open_at, partial = e["index"], ""
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_at
            block, d = m["content"][open_at], e["delta"]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            else:
                assert d["type"] == "input_json_delta"
                partial += d["partial_json"]
                block["input"] = json.loads(partial)
        else:
            assert e == {"type": "content_block_stop", "index": open_at}
            open_at = None
    assert open_at is None
    delta = events[-2]
    assert set(delta["delta"]) == {"stop_reason", "stop_sequence"}
    return {**m, **delta["delta"], "usage": delta["usage"]}


def _chat_prompt(url: str, engine: PromptedEngine, messages: list, **kw) -> list[int]:  # noqa: ANN003
    """The chat route's prompt ids for ``messages`` (the rendering Messages must share)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, **kw}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).is_success
    return engine.prompt


def test_a_message_with_a_system_prompt(served: tuple[str, PromptedEngine]) -> None:
    url, engine = served
    say(engine, "Hello there!")
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    m = _message(url, system=system, messages=[{"role": "user", "content": "Hi"}],
                 temperature=0.5, top_k=7, metadata={"user_id": "u1"})  # fmt: skip
    assert m["content"] == [{"type": "text", "text": "Hello there!"}]
    assert (m["stop_reason"], m["stop_sequence"]) == ("end_turn", None)
    assert engine.params is not None
    assert (engine.params.temperature, engine.params.top_k) == (0.5, 7)
    prompt = engine.prompt
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompt == _chat_prompt(url, engine, chat)
    n = len(engine.script) + 1  # the script, then EOS
    usage = {"input_tokens": len(prompt), "output_tokens": n, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0}  # fmt: skip
    assert m["usage"] == usage


def test_the_stream_adds_up_to_the_message(served: tuple[str, PromptedEngine]) -> None:
    url, engine = served
    say(engine, "Hello there!")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    events = _events(url, messages=msgs)
    kinds = [e["type"] for e in events]
    n = kinds.count("content_block_delta")
    assert n > 1 and kinds == ["message_start", "ping", "content_block_start",
                               *["content_block_delta"] * n, "content_block_stop",
                               "message_delta", "message_stop"]  # fmt: skip
    assert events[2] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}  # fmt: skip
    assert events[3]["delta"]["type"] == "text_delta"
    assert events[-1] == {"type": "message_stop"}
    streamed = _streamed_message(events)
    whole = _message(url, messages=msgs)
    assert {k: v for k, v in streamed.items() if k != "id"} == {
        k: v for k, v in whole.items() if k != "id"
    }
    assert events[0]["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_thinking(served: tuple[str, PromptedEngine], stream: bool) -> None:
    url, engine = served
    say(engine, "Let me see.</think>Four.")
    body = dict(messages=[{"role": "user", "content": "2+2?"}],
                thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    m = _streamed_message(_events(url, **body)) if stream else _message(url, **body)
    assert m["content"] == [
        {"type": "thinking", "thinking": "Let me see.", "signature": ""},
        {"type": "text", "text": "Four."},
    ]
    think = {"chat_template_kwargs": {"thinking": True}}
    assert engine.prompt == _chat_prompt(url, engine, body["messages"], **think)
    off = _message(url, messages=body["messages"], thinking={"type": "disabled"})
    assert off["content"] == [{"type": "text", "text": "Let me see.</think>Four."}]


def test_adaptive_thinking_is_thinking_mode(served: tuple[str, PromptedEngine]) -> None:
    """``{"type": "adaptive"}`` (the SDK's ThinkingConfigAdaptiveParam: what Claude Code sends for
    newer models) is thinking mode, as ``enabled`` is; another type is a 400 naming them."""
    url, engine = served
    say(engine, "Let me see.</think>Four.")
    msgs = [{"role": "user", "content": "2+2?"}]
    m = _message(url, messages=msgs, thinking={"type": "adaptive", "display": "summarized"})
    assert [b["type"] for b in m["content"]] == ["thinking", "text"]
    assert m["content"][0]["thinking"] == "Let me see."
    r = _post(url, messages=msgs, thinking={"type": "sometimes"})
    assert r.status_code == 400
    assert "enabled, adaptive or disabled" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip(served: tuple[str, PromptedEngine], stream: bool) -> None:
    """The call comes back as a tool_use block; the tool_use and its tool_result sent back
    render as the chat route's assistant tool call and tool message."""
    url, engine = served
    say(engine, "\n\n" + CALL)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    body = dict(messages=ask, tools=[WEATHER], tool_choice={"type": "auto"})
    m = _streamed_message(_events(url, **body)) if stream else _message(url, **body)
    [use] = m["content"]
    assert set(use) == {"type", "id", "name", "input"} and re.fullmatch(r"toolu_\w+", use["id"])
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "weather", {"city": "Paris"})
    assert (m["stop_reason"], m["stop_sequence"]) == ("tool_use", None)
    assert engine.params is not None and engine.params.grammar is None  # auto: not forced
    say(engine, "Sunny.")
    result = {"type": "tool_result", "tool_use_id": use["id"],
              "content": [{"type": "text", "text": "sunny"}]}  # fmt: skip
    turns = [*ask, {"role": "assistant", "content": [use]},
             {"role": "user", "content": [result, {"type": "text", "text": "Thanks"}]}]  # fmt: skip
    m = _message(url, messages=turns, tools=[WEATHER])
    assert m["content"] == [{"type": "text", "text": "Sunny."}] and m["stop_reason"] == "end_turn"
    call = {"id": use["id"], "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    chat = [*ask, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": use["id"], "content": "sunny"},
            {"role": "user", "content": "Thanks"}]  # fmt: skip
    assert engine.prompt == _chat_prompt(url, engine, chat, tools=[CHAT_WEATHER])


def test_tool_choice_any_and_tool_force_a_call(served: tuple[str, PromptedEngine]) -> None:
    url, engine = served
    say(engine, "\n\n" + BLOCK)
    ping = {"name": "ping", "input_schema": {"type": "object", "properties": {}}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "ping"}):
        engine.params = None
        m = _message(url, messages=[{"role": "user", "content": "Ping"}], tools=[ping],
                     tool_choice=choice)  # fmt: skip
        assert engine.params is not None and engine.params.grammar is not None
        assert [(b["type"], b["name"], b["input"]) for b in m["content"]] == [
            ("tool_use", "ping", {})
        ]


@pytest.mark.parametrize("stream", [False, True])
def test_output_format_is_chats_json_schema_response_format(
    served: tuple[str, PromptedEngine], stream: bool
) -> None:
    """``output_format`` (structured outputs) is chat's ``response_format`` json_schema: the same
    grammar reaches the engine, and the reply's text is the JSON; in thinking mode the grammar
    starts after the reasoning, as on chat."""
    url, engine = served
    say(engine, '{"city":"Paris"}')
    ask = [{"role": "user", "content": "Weather where?"}]
    fmt = {"type": "json_schema", "schema": WEATHER_SCHEMA}
    body = dict(messages=ask, output_format=fmt)
    m = _streamed_message(_events(url, **body)) if stream else _message(url, **body)
    assert m["content"] == [{"type": "text", "text": '{"city":"Paris"}'}]
    assert json.loads(m["content"][0]["text"]) == {"city": "Paris"}
    params = engine.params
    assert params is not None and params.grammar is not None
    assert not params.grammar_after_reasoning
    chat = {"type": "json_schema", "json_schema": {"name": "output", "schema": WEATHER_SCHEMA}}
    assert engine.prompt == _chat_prompt(url, engine, ask, response_format=chat)
    assert engine.params is not None and engine.params.grammar == params.grammar
    assert json.loads(params.grammar)["grammars"][0]["json_schema"]["required"] == ["city"]
    say(engine, 'Paris, then.</think>{"city":"Paris"}')
    think = {"type": "enabled", "budget_tokens": 64}
    m = _message(url, messages=ask, output_format=fmt, thinking=think)
    assert m["content"] == [
        {"type": "thinking", "thinking": "Paris, then.", "signature": ""},
        {"type": "text", "text": '{"city":"Paris"}'},
    ]
    assert engine.params is not None and engine.params.grammar == params.grammar
    assert engine.params.grammar_after_reasoning  # (the JSON follows </think>)
    _chat_prompt(url, engine, ask, response_format=chat, chat_template_kwargs={"thinking": True})
    assert engine.params.grammar_after_reasoning


def test_output_format_through_the_anthropic_sdk(served: tuple[str, PromptedEngine]) -> None:
    """The SDK's ``output_config={"format": ...}`` (the GA form; ``messages.parse`` sends it too)
    and the beta's ``output_format`` (sent as an extra field) ask for the same grammar."""
    url, engine = served
    client = _anthropic(url)
    say(engine, '{"city":"Paris"}')
    ask = [{"role": "user", "content": "Weather where?"}]
    fmt = {"type": "json_schema", "schema": WEATHER_SCHEMA}
    m = client.messages.create(model=MODEL, max_tokens=64, messages=ask,
                               output_config={"format": fmt})  # fmt: skip
    assert [b.type for b in m.content] == ["text"]
    assert json.loads(m.content[0].text) == {"city": "Paris"}
    assert engine.params is not None and engine.params.grammar is not None
    grammar, engine.params = engine.params.grammar, None
    m = client.beta.messages.create(model=MODEL, max_tokens=64, messages=ask,
                                    extra_body={"output_format": fmt})  # fmt: skip
    assert json.loads(m.content[0].text) == {"city": "Paris"}
    assert engine.params is not None and engine.params.grammar == grammar


def test_a_format_the_grammar_check_refuses_names_output_format() -> None:
    """The engine's grammar check (a schema llguidance cannot compile: chat's response_format
    error) names the field the format came in, as Anthropic's shape has no param."""
    from runtime.messages_protocol import anthropic_body, renamed
    from runtime.openai_protocol import APIError

    e = APIError(400, "the grammar does not compile: bad $ref", param="response_format")
    for field in ("output_format", "output_config.format"):
        msg = anthropic_body(renamed(e, [], field))["error"]["message"]
        assert msg == f"{field}: the grammar does not compile: bad $ref"
    # (a value of the client's schema the error quotes is left as sent)
    bad = "the grammar does not compile: Pointer '/$defs/response_format/a' does not exist"
    for field in ("output_format", "output_config.format"):
        msg = anthropic_body(renamed(APIError(400, bad, param="response_format"), [], field))
        assert msg["error"]["message"] == f"{field}: {bad}"


def test_a_thinking_block_sent_back_is_the_reasoning(served: tuple[str, PromptedEngine]) -> None:
    """An assistant turn's thinking block is its reasoning; a last assistant turn is continued
    (Anthropic's prefill), as chat's continue_final_message."""
    url, engine = served
    say(engine, " there")
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet",
                                                "signature": ""},
                                               {"type": "text", "text": "Hello"}]}]  # fmt: skip
    think = {"type": "enabled", "budget_tokens": 2000}
    m = _message(url, messages=turns, thinking=think)
    assert m["content"] == [{"type": "text", "text": " there"}]
    chat = [turns[0], {"role": "assistant", "content": "Hello", "reasoning": "greet"}]
    kw = {"chat_template_kwargs": {"thinking": True}, "continue_final_message": True,
          "add_generation_prompt": False}  # fmt: skip
    assert engine.prompt == _chat_prompt(url, engine, chat, **kw)
    # a redacted_thinking block (Anthropic's encrypted reasoning, in a conversation begun there)
    # has nothing to read: the turn renders as without it
    redacted = {"type": "redacted_thinking", "data": "EmwKAhgBEgy..."}
    turns[1]["content"].insert(1, redacted)
    m = _message(url, messages=turns, thinking=think)
    assert engine.prompt == _chat_prompt(url, engine, chat, **kw)


@pytest.mark.parametrize(
    ("blocks", "want"),
    [
        ([{"type": "thinking", "thinking": "\ud800", "signature": ""}],
         "messages[1].content[0].thinking contains a lone UTF-16 surrogate at index 0"),
        (  # the index is in the block's own text, not in the turn's thinking joined
            [{"type": "text", "text": "A"}, {"type": "thinking", "thinking": "ok"},
             {"type": "thinking", "thinking": "b\udc00"}],
            "messages[1].content[2].thinking contains a lone UTF-16 surrogate at index 1",
        ),
    ],
    ids=["one-block", "second-block"],
)  # fmt: skip
def test_a_lone_surrogate_in_a_thinking_block_names_the_block(
    served: tuple[str, PromptedEngine], blocks: list, want: str
) -> None:
    """Not chat's messages[i].reasoning, a field the client never sent."""
    url, engine = served
    say(engine, "x")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": blocks},
             {"role": "user", "content": "Go on"}]  # fmt: skip
    # (json.dumps escapes a lone surrogate, which UTF-8 cannot encode)
    body = json.dumps({"model": MODEL, "max_tokens": 10, "messages": turns})
    r = httpx.post(url + "/v1/messages", content=body, timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    error = {"type": "invalid_request_error", "message": want}
    assert r.json() == {"type": "error", "error": error}


TOOL_TURNS = [{"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                 "name": "weather", "input": {"city": "Paris"}}]}]
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        (  # after a tool_result: the block's own text, not the tool_result's shape of it
            {"messages": [*TOOL_TURNS, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "text", "text": "\ud800"}]}]},
            "messages[2].content[1].text contains a lone UTF-16 surrogate at index 0",
        ),
        (  # the second text block of a turn, not the turn's content
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "A"},
                                                       {"type": "text", "text": "b\udc00"}]}]},
            "messages[0].content[1].text contains a lone UTF-16 surrogate at index 1",
        ),
        (  # an assistant turn's text block
            {"messages": [*HI, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "ok"}, {"type": "text", "text": "\udfff"}]},
                {"role": "user", "content": "Go on"}]},
            "messages[1].content[1].text contains a lone UTF-16 surrogate at index 0",
        ),
        (  # a string content is its own text
            {"messages": [*HI, {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "x\ud800"}]},
            "messages[2].content contains a lone UTF-16 surrogate at index 1",
        ),
        (  # a tool_result's text blocks
            {"messages": [*TOOL_TURNS, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\ud800"}]}
            ]}]},
            "messages[2].content[0].content[1].text contains a lone UTF-16 surrogate at index 0",
        ),
        (  # system: a string, its blocks
            {"system": "\ud800", "messages": HI},
            "system contains a lone UTF-16 surrogate at index 0",
        ),
        (
            {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "\ud800"}],
             "messages": HI},
            "system[1].text contains a lone UTF-16 surrogate at index 0",
        ),
    ],
    ids=["after-tool-result", "second-text", "assistant-text", "string", "tool-result-text",
         "system", "system-text"],
)  # fmt: skip
def test_a_lone_surrogate_in_a_text_block_names_the_block(
    served: tuple[str, PromptedEngine], fields: dict, want: str
) -> None:
    """A text block's own path, messages[i].content[j].text, wherever it stands in its turn (it
    was the chat message's content under the field the message began at: after a tool_result
    block, messages[2].content[1].content, a field the client never sent)."""
    url, engine = served
    say(engine, "x")
    body = json.dumps({"model": MODEL, "max_tokens": 10, "tools": [WEATHER], **fields})
    r = httpx.post(url + "/v1/messages", content=body, timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": want}}  # fmt: skip


@pytest.mark.parametrize(
    "block, want",
    [
        ({"type": "text", "text": 5}, "messages[2].content[1].text must be a string, got integer"),
        ({"type": "text"}, "messages[2].content[1].text must be a string, got no text"),
        # JSON's type names, not Python's (NoneType, bool, float, dict)
        ({"type": "text", "text": None}, "messages[2].content[1].text must be a string, got null"),
        ({"type": "text", "text": True},
         "messages[2].content[1].text must be a string, got boolean"),
        ({"type": "text", "text": 0.5}, "messages[2].content[1].text must be a string, got number"),
        ({"type": "text", "text": {}}, "messages[2].content[1].text must be a string, got object"),
    ],
)  # fmt: skip
def test_a_text_block_with_no_string_text_names_the_block(
    served: tuple[str, PromptedEngine], block: dict, want: str
) -> None:
    """Its index in the turn (a block after a tool_result block was named content[0]), and what
    is wrong with it: a text block's text that is not a string is named as the text (it was "must
    be a text block with a string text, got type 'text'", of a block that is one)."""
    url, _ = served
    turns = [*TOOL_TURNS, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}, block]}]  # fmt: skip
    r = _post(url, messages=turns, tools=[WEATHER])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == want


@pytest.mark.parametrize(
    "fields, want",
    [
        ({"system": [{"type": "text", "text": ["Be brief."]}]},
         "system[0].text must be a string, got array"),
        ({"system": [{"type": "image"}]}, "system[0] must be a text block, got type 'image'"),
        # (a block with no type: "got no type", not "got type None")
        ({"system": [{"text": "Be brief."}]}, "system[0] must be a text block, got no type"),
        # (a block that is no object: the system prompt's own 400, not pydantic's "system.str")
        ({"system": ["Be brief."]}, "system[0] must be a text block, got string"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]}]}]},
         "messages[0].content[0].content[0].text must be a string, got no text"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": ["Sunny"]}]}]},
         "messages[0].content[0].content[0] must be a text block, got string"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [None]}]}]},
         "messages[0].content[0].content[0] must be a text block, got null"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": None, "content": "Sunny"}]}]},
         "messages[0].content[0].tool_use_id must be a string, got null"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": 5}, {"type": "text", "text": "Hello"}]}]},
         "messages[1].content[0].thinking must be a string, got integer"),
    ],
)  # fmt: skip
def test_a_system_or_tool_result_text_block_names_what_is_wrong(
    served: tuple[str, PromptedEngine], fields: dict, want: str
) -> None:
    """The system prompt's and a tool result's text blocks, worded as a turn's."""
    url, _ = served
    r = _post(url, **{"messages": [{"role": "user", "content": "Hi"}], **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == want


@pytest.mark.parametrize(
    "turns, want",
    [
        # a block with no type, or a type that is no string: said in JSON's words (it was
        # "got type None", "got None")
        ([{"role": "user", "content": [{"text": "Hi"}]}],
         "messages[0].content[0].type must be text or tool_result here, got no type"),
        ([{"role": "user", "content": [{"type": None, "text": "Hi"}]}],
         "messages[0].content[0].type must be text or tool_result here, got null"),
        ([*HI, {"role": "assistant", "content": [{"type": 5}]}],
         "messages[1].content[0].type must be text, thinking, redacted_thinking or tool_use "
         "here, got integer"),
        ([{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"text": "Sunny"}]}]}],
         "messages[0].content[0].content[0] must be a text block, got no type"),
        ([{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": None}]}]}],
         "messages[0].content[0].content[0] must be a text block, got type null"),
        # a content that is no string or list, or a block that is no object: what it is
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}],
         "messages[0].content[0].content must be a string or a list of text blocks, got integer"),
        ([{"role": "user", "content": {"type": "text", "text": "Hi"}}],
         "messages[0].content must be a string or a list of blocks, got object"),
        ([{"role": "user", "content": ["Hi"]}],
         "messages[0].content[0] must be a block (an object), got string"),
        # a turn that is no object: the route's own 400, not pydantic's "messages.0: Input
        # should be a valid dictionary"
        (["hi"], "messages[0] must be a message (an object), got string"),
        ([*HI, None], "messages[1] must be a message (an object), got null"),
    ],
)  # fmt: skip
def test_a_block_or_content_of_the_wrong_type_is_named_in_json_words(
    served: tuple[str, PromptedEngine], turns: list, want: str
) -> None:
    """What was sent instead, by its JSON type or as absent, as a text's errors say it."""
    url, _ = served
    r = _post(url, messages=turns)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == want


@pytest.mark.parametrize(
    "fields, want",
    [
        # a field's type that is missing or no string, said in JSON's words (it was "got None",
        # "got 5"); a string quoted, as before
        ({"tool_choice": {}}, "tool_choice.type must be auto, any, tool or none, got no type"),
        ({"tool_choice": {"type": None}},
         "tool_choice.type must be auto, any, tool or none, got null"),
        ({"tool_choice": {"type": "sometimes"}},
         "tool_choice.type must be auto, any, tool or none, got 'sometimes'"),
        # (an unhashable type: the same 400, not a 500 from the lookup of it)
        ({"tool_choice": {"type": ["auto"]}},
         "tool_choice.type must be auto, any, tool or none, got array"),
        ({"thinking": {"budget_tokens": 1024}},
         "thinking.type must be enabled, adaptive or disabled, got no type"),
        ({"thinking": {"type": True}},
         "thinking.type must be enabled, adaptive or disabled, got boolean"),
        # a tool choice's name absent or no string (it was "a tool choice needs a name", with
        # no word of what was sent)
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}},
         "tool_choice.name must be a string, got no name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": None}},
         "tool_choice.name must be a string, got null"),
        # budget_tokens in JSON's words (it was "got None", "got True", "got '8'"); an integer
        # out of range as sent
        ({"thinking": {"type": "enabled"}},
         "thinking.budget_tokens must be an integer >= 1, got no budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": None}},
         "thinking.budget_tokens must be an integer >= 1, got null"),
        ({"thinking": {"type": "enabled", "budget_tokens": True}},
         "thinking.budget_tokens must be an integer >= 1, got boolean"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1.5}},
         "thinking.budget_tokens must be an integer >= 1, got number"),
        ({"thinking": {"type": "enabled", "budget_tokens": "8"}},
         "thinking.budget_tokens must be an integer >= 1, got '8'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}},
         "thinking.budget_tokens must be an integer >= 1, got 0"),
        ({"output_format": {"schema": {}}}, "output_format.type must be json_schema, got no type"),
        ({"output_format": {"type": None, "schema": {}}},
         "output_format.type must be json_schema, got null"),
        ({"output_config": {"format": {"type": 1, "schema": {}}}},
         "output_config.format.type must be json_schema, got integer"),
        ({"output_config": {"format": "json"}},
         "output_config.format must be an object, got string"),
        # a tool's type sent and no string names the field (null was taken as a custom tool)
        ({"tools": [{**WEATHER, "type": 5}]},
         "tools[0].type must be custom (or absent), got integer"),
        ({"tools": [WEATHER, {**WEATHER, "type": None}]},
         "tools[1].type must be custom (or absent), got null"),
        ({"tools": [{**WEATHER, "type": ["custom"]}]},
         "tools[0].type must be custom (or absent), got array"),
        ({"tools": [{**WEATHER, "type": "bash_20250124"}]},
         "tools[0]: only custom tools (name, input_schema) are supported, got type "
         "'bash_20250124'"),
    ],
)  # fmt: skip
def test_a_type_of_the_wrong_kind_is_named_in_json_words(
    served: tuple[str, PromptedEngine], fields: dict, want: str
) -> None:
    """``tool_choice``, ``thinking``, ``output_format`` and a tool's ``type``, as a block's."""
    url, _ = served
    r = _post(url, messages=HI, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == want


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_and_stop_sequences(served: tuple[str, PromptedEngine], stream: bool) -> None:
    url, engine = served
    say(engine, "Hello there, how are you?")
    hi = [{"role": "user", "content": "Hi"}]

    def ask(**kw) -> dict:  # noqa: ANN003
        return _streamed_message(_events(url, **kw)) if stream else _message(url, **kw)

    m = ask(messages=hi, max_tokens=3)
    assert (m["stop_reason"], m["stop_sequence"]) == ("max_tokens", None)
    assert m["usage"]["output_tokens"] == 3
    assert m["content"] == [{"type": "text", "text": engine.tokenizer.decode(engine.script[:3])}]
    m = ask(messages=hi, stop_sequences=["zzz", "how"])
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "how")
    assert m["content"] == [{"type": "text", "text": "Hello there, "}]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"max_tokens": None}, r"max_tokens"),
        ({"output_format": {"type": "json_schema"}}, r"^output_format\.schema must be a JSON"),
        (
            {"output_format": {"type": "json_object", "schema": {}}},
            r"^output_format\.type must be json_schema, got 'json_object'",
        ),  # fmt: skip
        ({"output_format": "json"}, r"^output_format"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": []}}},
            r"^output_config\.format\.schema must be a JSON schema object",
        ),  # fmt: skip
        (
            {
                "output_format": {"type": "json_schema", "schema": {}},
                "output_config": {"format": {"type": "json_schema", "schema": {}}},
            },
            r"^output_format and output_config\.format cannot both be given",
        ),  # fmt: skip
        (
            {
                "output_format": {"type": "json_schema", "schema": WEATHER_SCHEMA},
                "tools": [WEATHER],
                "tool_choice": {"type": "any"},
            },
            r"^tool_choice of type any or tool cannot be combined with output_format$",
        ),  # fmt: skip
        ({"mcp_servers": [{"url": "x"}]}, r"^mcp_servers is not supported"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "see"},
                            {"type": "image", "source": {"type": "base64", "data": "x"}},
                        ],
                    }
                ]
            },
            r"^messages\[0\]\.content\[1\]: image blocks are not supported",
        ),  # fmt: skip
        ({"messages": [{"role": "system", "content": "x"}]}, r"messages\[0\]\.role must be user"),
        # a role absent or no string, in JSON's words (was "got None", "got True", "got {'a': 1}")
        (
            {"messages": [{"content": "x"}]},
            r"^messages\[0\]\.role must be user or assistant, got no role$",
        ),
        ({"messages": [{"role": None, "content": "x"}]}, r"\.role must be .*, got null$"),
        ({"messages": [{"role": True, "content": "x"}]}, r"\.role must be .*, got boolean$"),
        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, r"\.role must be .*, got object$"),
        ({"messages": [{"role": "system", "content": "x"}]}, r"\.role must be .*, got 'system'$"),
        ({"messages": []}, r"at least one message"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "A"},
                    {"role": "user", "content": []},
                ]
            },
            r"^messages\[2\]\.content: at least one block",
        ),  # fmt: skip
        ({"system": [{"type": "image"}]}, r"^system\[0\] must be a text block"),
        ({"thinking": {"type": "enabled"}}, r"^thinking\.budget_tokens must be an integer"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            r"^tools\[0\]: only custom tools",
        ),  # fmt: skip
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
            r"^tool_choice\.name: 'nope' is not one of the request's tools$",
        ),  # fmt: skip
        (  # (chat's required: named as the client's type any)
            {"tools": [], "tool_choice": {"type": "any"}},
            r"^tool_choice: type any needs at least one tool$",
        ),  # fmt: skip
        ({"tool_choice": {"type": "sometimes"}}, r"^tool_choice\.type must be auto, any"),
        (
            {"tools": [{**WEATHER, "input_schema": {"type": "object", "properties": []}}]},
            r"^tools\[0\]\.input_schema must be a JSON schema object$",
        ),  # fmt: skip
        (  # a parameter's name is the client's, though it holds .function.
            {"tools": [{**WEATHER, "input_schema": DOTTED_SCHEMA}]},
            r"^tools\[0\]: a\.function\.parameters\.minLength must be a non-negative integer",
        ),  # fmt: skip
        ({"stop_sequences": "how"}, r"^stop_sequences"),
        ({"stop_sequences": ["nonstop", ""]}, r"^stop_sequences must .* got \['nonstop', ''\]$"),
        (
            {"stop_sequences": ["do not stop now", ""]},
            r"^stop_sequences must .* got \['do not stop now', ''\]$",
        ),  # fmt: skip
        ({"max_tokens": 0}, r"max_tokens"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "x", "input": "{}"}],
                    },
                ]
            },
            r"^messages\[1\]\.content\[0\]: a tool_use block needs",
        ),  # fmt: skip
    ],
    ids=lambda v: None,
)
def test_bad_requests_are_anthropic_shaped_400s(
    served: tuple[str, PromptedEngine], body: dict, match: str
) -> None:
    url, engine = served
    say(engine, "x")
    body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    r = _post(url, **body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error", err
    assert set(err["error"]) == {"type", "message"} and err["error"]["type"] == (
        "invalid_request_error"
    )
    assert re.search(match, err["error"]["message"]), err


def test_other_errors_are_anthropic_shaped(served: tuple[str, PromptedEngine]) -> None:
    url, engine = served
    r = _post(url, model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/messages", content="{bad", timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error"
    say(engine, "Hello")
    engine.fail_steps = 1
    r = _post(url, messages=[{"role": "user", "content": "Hi"}])
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    engine.fail_steps = 1
    events = _events(url, messages=[{"role": "user", "content": "Hi"}])
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert "generation failed" in events[-1]["error"]["message"]
    # the other routes keep OpenAI's shape
    r = httpx.post(url + "/v1/chat/completions", json={"model": "nope", "messages": []})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_x_api_key_and_the_concurrency_limit(served: tuple[str, PromptedEngine]) -> None:
    _, scripted = served
    engine = ScriptedEngine(scripted.tokenizer, step_s=0.01)
    say(engine, "Hello " * 60)  # ~0.6 s of generation: the second request comes meanwhile
    a = AsyncEngine(engine)
    body = {"model": MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": "Hi"}]}
    key = {"x-api-key": "sekrit", "anthropic-version": "2023-06-01"}
    try:
        app = build_app(a, MODEL, api_key="sekrit", max_concurrent=1)
        with running_server(app) as base:
            url = base + "/v1/messages"
            r = httpx.post(url, json=body, headers={"x-api-key": "wrong"}, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert "x-api-key" in r.json()["error"]["message"]
            bearer = {"Authorization": "Bearer sekrit"}
            assert httpx.post(url, json=body, headers=bearer, timeout=30).is_success
            # (x-api-key opens the OpenAI routes too)
            models = httpx.get(base + "/v1/models", headers={"x-api-key": "sekrit"}, timeout=30)
            assert models.is_success
            with httpx.stream("POST", url, json={**body, "stream": True}, headers=key,
                              timeout=30) as r:  # fmt: skip
                lines = r.iter_lines()
                next(lines)  # the first request is generating
                busy = httpx.post(url, json={**body, "max_tokens": 1}, headers=key, timeout=30)
                assert busy.status_code == 429 and "limit of 1" in busy.text
                assert busy.json()["error"]["type"] == "rate_limit_error"
                list(lines)
            assert httpx.post(url, json={**body, "max_tokens": 1}, headers=key).is_success
    finally:
        a.shutdown()


def test_a_tool_result_without_content(served: tuple[str, PromptedEngine]) -> None:
    """A ``tool_result``'s content is optional: an empty tool message."""
    url, engine = served
    say(engine, "ok")
    use = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [use]},
             {"role": "user", "content": [{"type": "tool_result",
                                           "tool_use_id": "toolu_1"}]}]  # fmt: skip
    _message(url, messages=turns, tools=[WEATHER])
    call = {"id": "toolu_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    chat = [turns[0], {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": ""}]  # fmt: skip
    assert engine.prompt == _chat_prompt(url, engine, chat, tools=[CHAT_WEATHER])


def test_a_tool_use_id_that_reads_like_a_path_is_echoed_as_sent(
    served: tuple[str, PromptedEngine],
) -> None:
    """A tool_result whose tool_use_id answers no call: the error names the blocks by the
    client's indices (the system prompt is chat's messages[0]), and the id it quotes back is the
    client's, even one that reads like a path (it was renamed too: 'system')."""
    url, engine = served
    say(engine, "ok")
    use = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "messages[0]", "content": "sunny"}
    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [use]},
             {"role": "user", "content": [result]}]  # fmt: skip
    r = _post(url, system="Be brief.", messages=turns, tools=[WEATHER])
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("messages[2].content[0].") and "'messages[0]'" in msg, msg
    assert "matches none of the tool_use blocks of messages[1]" in msg, msg


def test_fields_it_need_not_honour_are_ignored(served: tuple[str, PromptedEngine]) -> None:
    """What Claude Code sends beside the message (context_management, a service tier, fields of
    later API versions) is ignored, as DeepSeek's Anthropic endpoint ignores it: the message is
    the one without them."""
    url, engine = served
    say(engine, "Hello there!")
    hi = [{"role": "user", "content": "Hi"}]
    m = _message(
        url, messages=hi, max_tokens=16, service_tier="priority", some_future_field={"a": 1},
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
    )  # fmt: skip
    assert m["content"] == [{"type": "text", "text": "Hello there!"}]


def _anthropic(url: str):  # noqa: ANN202
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=30)


def test_the_official_anthropic_client_reads_the_message_and_its_stream(
    served: tuple[str, PromptedEngine],
) -> None:
    """Through Anthropic's own SDK (what Claude Code and its users call): the message parses into
    its types, and ``messages.stream`` assembles the same message from the events, thinking and
    a tool call included."""
    url, engine = served
    client = _anthropic(url)
    say(engine, "Hello there!")
    hi = [{"role": "user", "content": "Hi"}]
    m = client.messages.create(model=MODEL, max_tokens=64, messages=hi, system="Be brief.")
    assert m.content[0].type == "text" and m.content[0].text == "Hello there!"
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == len(engine.script) + 1  # EOS
    say(engine, "Let me see.</think>Four.")
    with client.messages.stream(
        model=MODEL, max_tokens=64, messages=hi, thinking={"type": "enabled", "budget_tokens": 32}
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "Four." and [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Let me see." and final.stop_reason == "end_turn"
    say(engine, "\n\n" + CALL)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ask, tools=[WEATHER]) as s:
        final = s.get_final_message()
    [use] = final.content
    assert (use.type, use.name, use.input) == ("tool_use", "weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="mcp_servers is not supported") as bad:
        client.messages.create(
            model=MODEL, max_tokens=8, messages=hi, extra_body={"mcp_servers": [{"u": 1}]}
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def test_the_sdk_s_tool_runner_asks_for_a_thread_and_gets_the_whole_conversation(
    served: tuple[str, PromptedEngine],
) -> None:
    """The Anthropic SDK's tool runner (``client.beta.messages.tool_runner``) asks for a
    server-held thread (``thread: {"type": "create"}``), then sends only the new turn, the
    tool_result, with ``thread: {"type": "continue", ...}``. This server keeps no messages: the
    thread is refused with Anthropic's ``thread_unsupported_request`` code, on which the SDK
    sends every turn whole. Ignored, the continued turn was a lone tool_result, a 400."""
    import anthropic
    from anthropic import beta_tool

    url, engine = served
    client = _anthropic(url)
    hi = [{"role": "user", "content": "Weather in Paris?"}]
    with pytest.raises(anthropic.BadRequestError, match="thread is not supported") as e:
        client.beta.messages.create(
            model=MODEL, max_tokens=8, messages=hi, extra_body={"thread": {"type": "create"}}
        )
    assert e.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}

    @beta_tool
    def weather(city: str) -> str:
        """The weather."""
        say(engine, "Sunny.")  # the model's next reply, once it has the result
        return f"sunny in {city}"

    say(engine, "\n\n" + CALL)
    replies = list(client.beta.messages.tool_runner(
        model=MODEL, max_tokens=200, messages=hi, tools=[weather]
    ))  # fmt: skip
    assert [b.type for b in replies[0].content] == ["tool_use"]
    assert [(b.type, b.text) for b in replies[1].content] == [("text", "Sunny.")]
    # the last turn rendered the whole conversation: the call and its result too
    prompt = engine.tokenizer.decode(engine.prompt)
    assert "Weather in Paris?" in prompt and "sunny in Paris" in prompt


def test_an_engine_shut_down_mid_stream_ends_it_with_an_overloaded_error(
    served: tuple[str, PromptedEngine],
) -> None:
    """The engine closed while a message streams (a shutdown's grace period over): its last
    event is Anthropic's ``error``, an ``overloaded_error`` (the server going away), which the
    Anthropic SDK raises on, after the text so far."""
    import anthropic

    _, scripted = served
    engine = ScriptedEngine(scripted.tokenizer, step_s=0.01)
    say(engine, "Hello " * 100)
    a = AsyncEngine(engine)
    hi = [{"role": "user", "content": "Hi"}]
    text = []
    try:
        with (
            running_server(build_app(a, MODEL)) as base,
            pytest.raises(anthropic.APIStatusError) as err,
            _anthropic(base).messages.stream(model=MODEL, max_tokens=200, messages=hi) as s,
        ):
            for t in s.text_stream:
                text.append(t)
                if len(text) == 2:
                    a.shutdown()  # (the engine loop ends every open stream with "abort")
    finally:
        a.shutdown()
    assert len(text) >= 2 and err.value.body["type"] == "error", err.value.body
    assert err.value.body["error"]["type"] == "overloaded_error"
    assert "shutting down" in err.value.body["error"]["message"]


def test_count_tokens_is_the_prompt_messages_renders(served: tuple[str, PromptedEngine]) -> None:
    """``/v1/messages/count_tokens`` (Claude Code sizes its context with it; the SDK's
    ``messages.count_tokens``): the tokens of the prompt a message with the same system, turns,
    tools and thinking renders to; the route's other sub-paths answer in Anthropic's shape."""
    url, engine = served
    say(engine, "Hello there!")
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    body = dict(system="Be brief.", messages=turns, tools=[WEATHER],
                thinking={"type": "enabled", "budget_tokens": 16})  # fmt: skip
    _message(url, **body)
    rendered = list(engine.prompt)
    n = _anthropic(url).messages.count_tokens(model=MODEL, **body).input_tokens
    assert n == len(rendered) > 0
    without = _anthropic(url).messages.count_tokens(model=MODEL, messages=turns).input_tokens
    assert 0 < without < n
    r = httpx.post(url + "/v1/messages/count_tokens", json={"model": "nope", "messages": turns})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/messages/batches", json={}, timeout=30)
    assert r.status_code in (404, 405) and r.json()["type"] == "error"


def test_count_tokens_takes_stream_false_and_refuses_true(
    served: tuple[str, PromptedEngine],
) -> None:
    """A count has nothing to stream: ``stream: false`` (a message's fields sent as they are)
    is counted as if absent (it was pydantic's "stream: Input should be None"), ``true`` is a
    400 that says so, in Anthropic's shape."""
    url, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    counts = []
    for extra in ({}, {"stream": False}):
        r = httpx.post(url + "/v1/messages/count_tokens", json={**body, **extra}, timeout=30)
        assert r.status_code == 200, r.text
        counts.append(r.json()["input_tokens"])
    assert counts[0] == counts[1] > 0
    r = httpx.post(url + "/v1/messages/count_tokens", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message":
        "stream: a token count is not streamed; send stream false or leave it out"}}  # fmt: skip


def test_count_tokens_is_the_prefill_of_a_forced_call_with_system_and_thinking(
    served: tuple[str, PromptedEngine],
) -> None:
    """The count is the prompt the create route prefills, for a request whose tool_choice forces
    a tool (a grammar on the create route), with a system prompt and thinking."""
    url, engine = served
    say(engine, "Let me see.</think>\n\n" + CALL)
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    body = dict(system="Be brief.", messages=turns, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "weather"},
                thinking={"type": "enabled", "budget_tokens": 16})  # fmt: skip
    m = _message(url, **body)
    assert engine.params is not None and engine.params.grammar is not None  # (forced)
    assert [b["type"] for b in m["content"]] == ["thinking", "tool_use"]
    n = _anthropic(url).messages.count_tokens(model=MODEL, **body).input_tokens
    assert n == len(engine.prompt) == m["usage"]["input_tokens"]


def test_count_tokens_compiles_no_grammar(
    served: tuple[str, PromptedEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """count_tokens renders and counts the prompt only: with every grammar compile made to raise,
    a forced tool's and an output format's requests are counted, and counted as before."""
    url, engine = served
    forced = dict(system="Be brief.", messages=[{"role": "user", "content": "Weather?"}],
                  tools=[WEATHER], tool_choice={"type": "any"},
                  thinking={"type": "enabled", "budget_tokens": 16})  # fmt: skip
    schema = {"type": "json_schema", "schema": WEATHER_SCHEMA}
    fmt = dict(messages=[{"role": "user", "content": "Weather?"}], output_config={"format": schema})
    client = _anthropic(url)
    before = [client.messages.count_tokens(model=MODEL, **b).input_tokens for b in (forced, fmt)]

    def compile_(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a grammar was compiled")

    import runtime.server_chat
    import runtime.structured_output

    for mod, name in [(runtime.server_chat, "lark_grammar"),
                      (runtime.server_chat, "json_schema_problem"),
                      (runtime.structured_output, "json_schema_grammar")]:  # fmt: skip
        monkeypatch.setattr(mod, name, compile_)
    # (the create route compiles them: the patches bite)
    say(engine, "x")
    assert _post(url, **forced).status_code == 500 and _post(url, **fmt).status_code == 500
    after = [client.messages.count_tokens(model=MODEL, **b).input_tokens for b in (forced, fmt)]
    assert after == before and all(n > 0 for n in after)


def test_usage_reads_the_prefix_cache_the_same_throughout(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache,
    ``cache_read_input_tokens`` those read from it; message_start, message_delta and the whole
    message say the same, and the SDK's streamed message too."""
    with scripted_server(tmp_path_factory, CachingEngine) as (url, engine):
        say(engine, "Hello there!")
        engine.cached = 4
        hi = [{"role": "user", "content": "Hi, how are you doing today?"}]
        events = _events(url, messages=hi)
        n = len(engine.prompt)
        assert n > 4
        read = {"input_tokens": n - 4, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 4}  # fmt: skip
        out = len(engine.script) + 1  # the script, then EOS
        assert events[0]["message"]["usage"] == {**read, "output_tokens": 0}
        assert events[-2]["usage"] == {**read, "output_tokens": out}
        assert _message(url, messages=hi)["usage"] == {**read, "output_tokens": out}
        with _anthropic(url).messages.stream(model=MODEL, max_tokens=64, messages=hi) as s:
            usage = s.get_final_message().usage
        assert (usage.input_tokens, usage.cache_read_input_tokens) == (n - 4, 4)


def test_the_anthropic_client_lists_and_retrieves_the_models(
    served: tuple[str, PromptedEngine],
) -> None:
    """``GET /v1/models`` and ``/v1/models/{id}`` serve Anthropic's model objects too (``type``,
    ``display_name``, ``created_at`` as RFC 3339; the page's ``first_id`` / ``last_id`` /
    ``has_more``) beside OpenAI's fields, so its SDK's ``models.list`` / ``retrieve`` parse them
    with no field missing."""
    import datetime as dt

    url, _ = served
    client = _anthropic(url)
    page = client.models.list()
    assert [m.id for m in page.data] == [MODEL] and page.has_more is False
    assert page.first_id == page.last_id == MODEL
    for m in (page.data[0], client.models.retrieve(MODEL)):
        assert m.id == MODEL and m.type == "model" and m.display_name == MODEL
        assert isinstance(m.created_at, dt.datetime) and m.created_at.tzinfo is not None
        assert abs(m.created_at.timestamp() - time.time()) < 3600  # the server's start
