"""``POST /v1/responses`` (the OpenAI Responses API) through the official openai client over the
scripted fake engine: the response object and its event stream, instructions and input items
rendered as the chat route renders the same messages, thinking mode's reasoning item, a
json_schema format, function calls, the length limit, refused fields, a client that leaves."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from server_utils import running_server
from test_chat_thinking import BLOCK, ScriptedEngine, openai_client, say, scripted_server
from test_server import MODEL
from test_server_messages import CALL as WEATHER_CALL
from test_server_messages import PromptedEngine

from runtime.async_engine import AsyncEngine
from runtime.server import build_app

PING = {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HI = {"role": "user", "content": "Hi"}
CALL = {"type": "function_call", "call_id": "c1", "name": "ping", "arguments": "{}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedEngine]]:
    with scripted_server(tmp_path_factory) as s:
        yield s


def _prompt_tokens(client: openai.OpenAI, messages: list, **kw) -> int:  # noqa: ANN003
    """The chat route's prompt length for ``messages`` (the rendering the responses must share)."""
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **kw)
    return r.usage.prompt_tokens


def test_a_response_with_instructions(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, "Hello there!")
    r = client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", metadata={"k": "v"}, temperature=0.5
    )
    _strict(r, Response)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there!" and r.model == MODEL
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.metadata == {"k": "v"} and r.temperature == 0.5 and r.incomplete_details is None
    assert engine.params is not None and engine.params.temperature == 0.5
    # instructions are the system message, first; the prompt is the chat route's
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    u = r.usage
    assert u.input_tokens == _prompt_tokens(client, msgs)
    n = len(engine.script) + 1  # the script, then EOS
    assert (u.output_tokens, u.total_tokens) == (n, u.input_tokens + n)
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens == 0


def test_input_items_render_as_the_chat_messages(served: tuple[str, ScriptedEngine]) -> None:
    """Message items with text parts, a function call and its output: the chat route's prompt
    for the same conversation."""
    url, engine = served
    client = openai_client(url)
    say(engine, "ok")
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "Ping?"},
        {"type": "function_call", "call_id": "c1", "name": "ping", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "pong"},
    ]
    r = client.responses.create(model=MODEL, input=items, tools=[PING])
    call = {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Ping?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "pong"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in PING.items() if k != "type"}}
    assert r.usage.input_tokens == _prompt_tokens(client, msgs, tools=[chat_tool])
    assert r.output_text == "ok"


def _strict(obj: BaseModel, kind: type | object) -> None:
    """``obj`` as the openai client's types require it: the client parses without checking, so
    a missing required field would pass unseen (as ``usage.input_tokens_details``'s did)."""
    TypeAdapter(kind).validate_python(obj.model_dump(mode="json", warnings=False))


def _events(client: openai.OpenAI, **kw) -> list:  # noqa: ANN003
    events = list(client.responses.create(model=MODEL, stream=True, **kw))
    for e in events:
        _strict(e, ResponseStreamEvent)
    return events


def test_streamed_events_end_with_the_response(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, "Hello there!")
    events = _events(client, input="Hi")
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == "Hello there!"
    item_id = events[2].item.id
    assert all((e.item_id, e.output_index, e.content_index) == (item_id, 0, 0) for e in deltas)
    final = events[-1].response
    assert final.output_text == "Hello there!" and final.output[0].id == item_id
    assert final.usage.output_tokens == len(engine.script) + 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_effort_is_thinking_mode(
    served: tuple[str, ScriptedEngine], stream: bool
) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, "Let me see.</think>Four.")
    kw = dict(model=MODEL, input="2+2?", reasoning={"effort": "high"})
    if stream:
        events = _events(client, **{k: v for k, v in kw.items() if k != "model"})
        kinds = [e.type for e in events]
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == "Let me see."
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta"
        )
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    think, msg = r.output
    assert think.type == "reasoning" and think.summary == []
    assert [(c.type, c.text) for c in think.content] == [("reasoning_text", "Let me see.")]
    assert msg.type == "message" and r.output_text == "Four."
    n_think = len(engine.tokenizer.encode("Let me see.</think>", add_bos=False))
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= n_think
    # the prompt is rendered in thinking mode, as chat's chat_template_kwargs thinking
    msgs = [{"role": "user", "content": "2+2?"}]
    think_kw = {"extra_body": {"chat_template_kwargs": {"thinking": True}}}
    assert r.usage.input_tokens == _prompt_tokens(client, msgs, **think_kw)
    off = client.responses.create(model=MODEL, input="2+2?", reasoning={"effort": "none"})
    assert off.output_text == "Let me see.</think>Four." and len(off.output) == 1


def test_json_schema_format_is_the_chat_response_format(
    served: tuple[str, ScriptedEngine],
) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, '{"a": 1}')
    fmt = {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model=MODEL, input="Give a", text={"format": fmt})
    assert engine.params is not None and engine.params.grammar is not None
    assert json.loads(r.output_text) == {"a": 1} and r.text.format.type == "json_schema"
    engine.params = None
    client.responses.create(model=MODEL, input="Give a")
    assert engine.params is not None and engine.params.grammar is None
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", text={"format": {"type": "xml"}})
    assert e.value.body["param"] == "text" and "text.format" in e.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call(served: tuple[str, ScriptedEngine], stream: bool) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, "\n\n" + BLOCK)
    kw = dict(input="Ping it", tools=[PING], tool_choice={"type": "function", "name": "ping"})
    if stream:
        events = _events(client, **kw)
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in done] == ["{}"]
        assert not [e for e in events if e.type == "response.output_text.delta"]
        r = events[-1].response
    else:
        r = client.responses.create(model=MODEL, **kw)
    assert engine.params is not None and engine.params.grammar is not None  # the forced call
    [call] = r.output
    assert (call.type, call.name, call.arguments) == ("function_call", "ping", "{}")
    assert call.call_id.startswith("call_") and r.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_is_incomplete(served: tuple[str, ScriptedEngine], stream: bool) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, "Hello there, how are you?")
    if stream:
        events = _events(client, input="Hi", max_output_tokens=3)
        assert events[-1].type == "response.incomplete"
        r = events[-1].response
    else:
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    assert r.output_text == engine.tokenizer.decode(engine.script[:3])


@pytest.mark.parametrize(
    ("kw", "param", "match"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"background": True}, "background", "background is not supported"),
        ({"include": ["message.output_text.logprobs"]}, "include", "include is not supported"),
        (  # what it asks beyond reasoning.encrypted_content (which a response has anyway)
            {"include": ["reasoning.encrypted_content", "file_search_call.results"]},
            "include",
            "include is not supported",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools", r"tools\[0\]: only function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input",
            r"input\[0\]\.content\[0\] must be an input_text part, got type 'input_image'$",
        ),
        (
            {"input": [HI, {"role": "assistant", "content": ["Hello"]}]},
            "input",
            r"^input\[1\]\.content\[0\] must be an output_text part, got string$",
        ),
        (  # JSON's type names, not Python's
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]},
            "input",
            r"^input\[0\]\.content\[0\]\.text must be a string, got null$",
        ),
        (  # a part that is one, whose text is not a string: named as its text
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input",
            r"^input\[0\]\.content\[0\]\.text must be a string, got integer$",
        ),
        (
            {"input": [HI, {"role": "assistant", "content": [{"type": "output_text"}]}]},
            "input",
            r"^input\[1\]\.content\[0\]\.text must be a string, got no text$",
        ),
        (
            {"input": [{"role": "robot", "content": "x"}]},
            "input",
            r"^input\[0\]\.role must be one of system, developer, user, assistant, got 'robot'$",
        ),
        # a role absent or no string, in JSON's words (was "got None", "got True", "got {'a': 1}")
        ({"input": [{"content": "x"}]}, "input",
         r"^input\[0\]\.role must be one of system, developer, user, assistant, got no role$"),
        ({"input": [{"type": "message", "role": None, "content": "x"}]}, "input",
         r"^input\[0\]\.role must be one of .*, got null$"),
        ({"input": [{"role": True, "content": "x"}]}, "input",
         r"^input\[0\]\.role must be one of .*, got boolean$"),
        ({"input": [HI, {"role": {"a": 1}, "content": "x"}]}, "input",
         r"^input\[1\]\.role must be one of .*, got object$"),
        (  # chat's role, not the Responses API's: a tool's result is an item of its own
            {
                "input": [HI, CALL, {"role": "tool", "content": "pong", "tool_call_id": "c1"}],
                "tools": [PING],
            },
            "input",
            r"^input\[2\]\.role must be one of system, developer, user, assistant, got 'tool' "
            r"\(a tool's result is a function_call_output item\)$",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", r"input\[0\]\.type"),
        ({"input": []}, "input", "must not be an empty list"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"reasoning": {"effort": "huge"}}, "reasoning",
         r"^reasoning\.effort must be one of none, .*, xhigh, got 'huge'$"),
        # in JSON's words (they were "got True", "got 3")
        ({"reasoning": {"effort": True}}, "reasoning", r"^reasoning\.effort .*, got boolean$"),
        ({"reasoning": {"effort": 3}}, "reasoning", r"^reasoning\.effort .*, got integer$"),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [PING]},
            "tool_choice",
            "not one of the request's tools",
        ),
        (  # (one grammar a request: named as the client's text.format, not chat's field)
            {
                "tools": [PING],
                "tool_choice": "required",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
            },
            "tool_choice",
            r"^tool_choice required or a named function cannot be combined with text\.format$",
        ),
        ({"instructions": 5}, "instructions", "instructions"),
        # a tool's type and a format that is no object, in JSON's words (they were "got type
        # None", "got 'json'", "got []")
        (
            {"tools": [{"name": "ping", "parameters": {}}]},
            "tools",
            r"^tools\[0\]: only function tools are supported, got no type$",
        ),
        (
            {"tools": [{**PING, "type": None}]},
            "tools",
            r"^tools\[0\]: only function tools are supported, got type null$",
        ),
        (
            {"tools": [{"type": "web_search"}]},
            "tools",
            r"^tools\[0\]: only function tools are supported, got type 'web_search'$",
        ),
        ({"text": {"format": "json"}}, "text", r"^text\.format must be an object, got string$"),
        ({"text": {"format": []}}, "text", r"^text\.format must be an object, got array$"),
        # the chat route's own checks, in JSON's words (they were "got None", "got 5")
        ({"text": {"format": {"type": None}}}, "text",
         r"^text\.format\.type must be text, json_object or json_schema, got null$"),
        ({"text": {"format": {"type": "xml"}}}, "text",
         r"^text\.format\.type must be text, json_object or json_schema, got 'xml'$"),
        ({"text": {"format": {}}}, "text", r"^text\.format\.type must be .*, got no type$"),
        ({"tool_choice": {"type": "function", "name": 5}, "tools": [PING]}, "tool_choice",
         r"^tool_choice\.name must be a string, got integer$"),
        ({"tool_choice": {"type": "function", "name": None}, "tools": [PING]}, "tool_choice",
         r"^tool_choice\.name must be a string, got null$"),
    ],  # fmt: skip
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_requests_are_a_400_naming_the_field(
    served: tuple[str, ScriptedEngine], kw: dict, param: str, match: str
) -> None:
    url, engine = served
    say(engine, "x")
    body = {"model": MODEL, "input": "Hi", **kw}
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert re.search(match, err["message"]), err


THOUGHT = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]}


@pytest.mark.parametrize(
    ("items", "want"),
    [
        (  # the message after a reasoning item is one chat message with it; its content, its own
            [HI, THOUGHT, {"role": "assistant", "content": "a\ud800"}, HI],
            "input[2].content contains a lone UTF-16 surrogate at index 1",
        ),
        (  # ... and so is a function call after them; a part names its own text
            [HI, THOUGHT, {"role": "assistant", "content": [{"type": "output_text", "text": "a"},
             {"type": "output_text", "text": "\udc00"}]},
             CALL, HI],
            "input[2].content[1].text contains a lone UTF-16 surrogate at index 0",
        ),
        (  # a message's first text part, not chat's content of the parts joined
            [{"role": "user", "content": [{"type": "input_text", "text": "a\ud800"},
                                          {"type": "input_text", "text": "b"}]}],
            "input[0].content[0].text contains a lone UTF-16 surrogate at index 1",
        ),
        (  # its second, and the index in that part's own text
            [HI, {"role": "user", "content": [{"type": "input_text", "text": "ok"},
                                              {"type": "input_text", "text": "xy\ud800"}]}],
            "input[1].content[1].text contains a lone UTF-16 surrogate at index 2",
        ),
        (  # a string content is the content itself
            [HI, {"role": "user", "content": "Hi\ud800"}],
            "input[1].content contains a lone UTF-16 surrogate at index 2",
        ),
        (  # a function_call_output's output parts name theirs
            [HI, CALL, {"type": "function_call_output", "call_id": "c1",
                        "output": [{"type": "input_text", "text": "p"},
                                   {"type": "input_text", "text": "\ud800"}]}],
            "input[2].output[1].text contains a lone UTF-16 surrogate at index 0",
        ),
        (  # a reasoning item's part, and the index in its own text (not chat's reasoning)
            [HI, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "ok"},
                                                   {"type": "reasoning_text", "text": "x\ud800"}]},
             HI],
            "input[1].content[1].text contains a lone UTF-16 surrogate at index 1",
        ),
        (
            [HI, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}, HI],
            "input[1].content[0].text must be a string, got integer",
        ),
        (  # what a text part's error says of its text, as the other parts' do
            [HI, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": None}]},
             HI],
            "input[1].content[0].text must be a string, got null",
        ),
        (
            [HI, {"type": "reasoning", "content": [{"type": "reasoning_text"}]}, HI],
            "input[1].content[0].text must be a string, got no text",
        ),
        (
            [HI, CALL, {"type": "function_call_output", "call_id": 1, "output": "pong"}],
            "input[2].call_id must be a string, got integer",
        ),
        # an output that is null or absent, named with what was sent (it was chat's tool
        # message's error, with no word of it)
        ([HI, CALL, {"type": "function_call_output", "call_id": "c1", "output": None}],
         "input[2].output must be a string or a list of parts, got null"),
        ([HI, CALL, {"type": "function_call_output", "call_id": "c1"}],
         "input[2].output must be a string or a list of parts, got no output"),
        ([HI, CALL, {"type": "function_call_output", "call_id": "c1", "output": 5}],
         "input[2].output must be a string or a list of parts, got integer"),
        # what was sent instead, in JSON's words (the route's own 400, not pydantic's
        # "input.str ...", which named the wrong alternative of input)
        (["hi"], "input[0] must be an item (an object), got string"),
        ([HI, None], "input[1] must be an item (an object), got null"),
        (  # (a part with no type: "got no type", not "got type None")
            [{"role": "user", "content": [{"text": "Hi"}]}],
            "input[0].content[0] must be an input_text part, got no type",
        ),
        (
            [{"role": "user", "content": {"type": "input_text", "text": "Hi"}}],
            "input[0].content must be a string or a list of parts, got object",
        ),
        (
            [HI, {"type": "function_call", "call_id": "c1", "arguments": "{}"}],
            "input[1].name must be a string, got no name",
        ),
        (
            [HI, {"type": "function_call", "call_id": "c1", "name": "ping", "arguments": {}}],
            "input[1].arguments must be a string, got object",
        ),
        (
            [HI, {"type": "reasoning", "content": "thought"}, HI],
            "input[1].content must be a list of parts, got string",
        ),
        (
            [HI, {"type": "reasoning", "content": ["thought"]}, HI],
            "input[1].content[0] must be a part (an object), got string",
        ),
        # a falsy content that is not absent or null is no list of parts either (it was read
        # as none)
        ([HI, {"type": "reasoning", "content": ""}, HI],
         "input[1].content must be a list of parts, got string"),
        ([HI, {"type": "reasoning", "content": 0}, HI],
         "input[1].content must be a list of parts, got integer"),
        ([HI, {"type": "reasoning", "content": False}, HI],
         "input[1].content must be a list of parts, got boolean"),
        # an item's type that is no string (it was "got None")
        ([{"type": None, "role": "user", "content": "Hi"}],
         "input[0].type must be message, function_call, function_call_output or reasoning, "
         "got null"),
        ([HI, {"type": 3}],
         "input[1].type must be message, function_call, function_call_output or reasoning, "
         "got integer"),
    ],
    ids=["message", "message-and-call", "first-part", "second-part", "string-content",
         "output-part", "reasoning-part", "reasoning-text", "reasoning-null-text",
         "reasoning-no-text", "call-id", "null-output", "no-output", "integer-output",
         "string-item", "null-item", "untyped-part",
         "object-content", "call-no-name", "call-object-arguments", "reasoning-string",
         "reasoning-string-part", "reasoning-empty-string", "reasoning-zero",
         "reasoning-false", "null-type", "integer-type"],
)  # fmt: skip
def test_an_error_names_the_input_item_it_is_about(
    served: tuple[str, ScriptedEngine], items: list, want: str
) -> None:
    url, engine = served
    say(engine, "x")
    # (json.dumps escapes a lone surrogate, which UTF-8 cannot encode)
    body = json.dumps({"model": MODEL, "input": items, "tools": [PING]})
    r = httpx.post(url + "/v1/responses", content=body, timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"]) == (want, "input")


@pytest.mark.parametrize(
    ("items", "thinking"),
    [([HI, THOUGHT], False), ([HI, THOUGHT, CALL, {"type": "function_call_output",
                                                    "call_id": "c1", "output": "pong"}], True)],
    ids=["last", "before-a-call"],
)  # fmt: skip
def test_a_reasoning_item_with_no_message_after_it_is_a_turn_with_no_content(
    served: tuple[str, ScriptedEngine], items: list, thinking: bool
) -> None:
    """Its turn is chat's assistant message with a null content (its reasoning the item's
    text): chat has nothing of the client's at that message's content, so none of its rules
    can fail there and name it after the reasoning item (``input[k].content``, the item's
    parts); an assistant message after the item brings its own content, named after it."""
    url, engine = served
    client = openai_client(url)
    say(engine, "ok")
    kw = {"reasoning": {"effort": "high"}} if thinking else {}
    r = client.responses.create(model=MODEL, input=items, tools=[PING], **kw)
    call = {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    turn = {"role": "assistant", "content": None, "reasoning": "r"}
    output = {"role": "tool", "tool_call_id": "c1", "content": "pong"}
    msgs = [HI, {**turn, "tool_calls": [call]}, output] if thinking else [HI, turn]
    chat_tool = {"type": "function", "function": {k: v for k, v in PING.items() if k != "type"}}
    think = {"extra_body": {"chat_template_kwargs": {"thinking": True}}} if thinking else {}
    assert r.usage.input_tokens == _prompt_tokens(client, msgs, tools=[chat_tool], **think)


def test_a_client_that_leaves_aborts_the_request(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    say(engine, "Hello")
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 150, "ignore_eos": True,
            "stream": True}  # fmt: skip
    engine.step_s = 0.01  # 1.5 s of generation: far longer than noticing the disconnect takes
    try:
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=10) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines) == "event: response.created"
            rid = json.loads(next(lines).removeprefix("data: "))["response"]["id"]
        deadline = time.monotonic() + 5
        while rid not in engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rid in engine.aborted and rid not in engine.running
    finally:
        engine.step_s = 0.002


def test_an_engine_failure(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    client = openai_client(url)
    say(engine, "Hello")
    engine.fail_steps = 1
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=MODEL, input="Hi")
    engine.fail_steps = 1
    events = _events(client, input="Hi")
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert "generation failed" in events[-1].response.error.message
    assert client.responses.create(model=MODEL, input="Hi").output_text == "Hello"


def test_an_engine_shut_down_mid_stream_ends_it_with_response_failed(
    served: tuple[str, ScriptedEngine],
) -> None:
    """The engine closed while a response streams (a shutdown's grace period over): the stream
    ends as the Responses API ends a failed response, the open item closed ``incomplete`` with
    the text so far, then ``response.failed`` with a ``server_error``; the openai client's
    types parse every event."""
    _, scripted = served
    engine = ScriptedEngine(scripted.tokenizer, step_s=0.01)
    say(engine, "Hello " * 100)
    a = AsyncEngine(engine)
    try:
        with running_server(build_app(a, MODEL)) as base:
            stream = openai_client(base).responses.create(model=MODEL, input="Hi", stream=True)
            events = []
            for e in stream:
                _strict(e, ResponseStreamEvent)
                events.append(e)
                if e.type == "response.output_text.delta" and len(events) == 6:
                    a.shutdown()  # (the engine loop ends every open stream with "abort")
    finally:
        a.shutdown()
    kinds = [e.type for e in events]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.failed"], kinds  # fmt: skip
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "shutting down" in failed.error.message
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [item] = failed.output
    assert item.status == "incomplete" and item.content[0].text == text != ""


def test_responses_count_against_the_concurrency_limit(served: tuple[str, ScriptedEngine]) -> None:
    _, scripted = served
    engine = ScriptedEngine(scripted.tokenizer, step_s=0.01)
    say(engine, "Hello")
    a = AsyncEngine(engine)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 60, "ignore_eos": True}
    try:
        with running_server(build_app(a, MODEL, max_concurrent=1)) as base:
            url = base + "/v1/responses"
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
                lines = r.iter_lines()
                next(lines)  # the first request is generating
                busy = httpx.post(url, json={**body, "max_output_tokens": 1}, timeout=30)
                assert busy.status_code == 429 and "limit of 1" in busy.text
                list(lines)
            assert httpx.post(url, json={**body, "max_output_tokens": 1}, timeout=30).is_success
    finally:
        a.shutdown()


def test_store_true_openai_s_default_is_answered_unstored(
    served: tuple[str, ScriptedEngine],
) -> None:
    """``store: true`` (what OpenAI's API assumes when it is left out, and what agent frameworks
    send) is served, as vLLM serves it without its store; the response says it was not stored."""
    url, engine = served
    say(engine, "Hello there!")
    r = openai_client(url).responses.create(model=MODEL, input="Hi", store=True)
    _strict(r, Response)
    assert r.status == "completed" and r.store is False and r.output_text == "Hello there!"


def test_the_openai_client_s_tool_runner_asks_for_the_reasoning_and_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The openai client's Responses tool runner sends every request with ``include:
    ["reasoning.encrypted_content"]`` (a stateless client's reasoning to send back). A response
    here has its reasoning in the clear anyway, so it is taken: the runner's call, its output
    and the reasoning item go back as input, and the run ends with the model's answer. Refused,
    the runner stopped at its first request."""
    from openai.lib._tools import pydantic_responses_function_tool
    from openai.lib.responses_tool_runner import RegisteredFunction, ResponsesToolRunner

    class Weather(BaseModel):
        city: str

    def weather(args: Weather) -> str:
        say(engine, "Done.</think>Sunny.")  # the model's next reply, once it has the result
        return f"sunny in {args.city}"

    tool = pydantic_responses_function_tool(Weather, name="weather")
    runner = ResponsesToolRunner(functions=[RegisteredFunction.from_tool(tool, execute=weather)])
    params = {"model": MODEL, "input": "Weather in Paris?", "reasoning": {"effort": "low"}}
    with scripted_server(tmp_path_factory, PromptedEngine) as (url, engine):
        say(engine, "Hmm.</think>\n\n" + WEATHER_CALL)
        r = runner.run(openai_client(url), params)  # type: ignore[arg-type]
    assert r.status == "completed" and r.output_text == "Sunny."
    # the last turn rendered the whole run: the reasoning, the call and its result
    prompt = engine.tokenizer.decode(engine.prompt)
    assert "Hmm." in prompt and "sunny in Paris" in prompt
