"""The chat route's errors about tool calls and tool results, through the translated routes over
the scripted fake engine: each named in the vocabulary the client wrote (Messages: ``tool_use``
blocks and a ``tool_result``'s ``tool_use_id``; Responses: ``function_call`` items, a
``function_call_output``'s ``call_id`` and ``output``), not chat's ``tool_calls`` /
``tool_call_id`` (``messages_protocol._TOOL_WORDS``, ``responses_protocol._TOOL_WORDS`` and the
messages' ``chat_translation.Origin``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from test_chat_thinking import ScriptedEngine, say, scripted_server
from test_server import MODEL

USE = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
WEATHER = {"name": "weather", "input_schema": {"type": "object", "properties": {}}}
PING = {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}
CALL = {"type": "function_call", "call_id": "c1", "name": "ping", "arguments": "{}"}
HI = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedEngine]]:
    with scripted_server(tmp_path_factory) as s:
        yield s


def _result(tool_use_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "sunny"}


@pytest.mark.parametrize(
    ("body", "want"),
    [
        (  # an id that answers no call (the system prompt is chat's messages[0])
            {"system": "Be brief.", "messages": [
                HI, {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [_result("toolu_9")]}]},
            "messages[2].content[0].tool_use_id 'toolu_9' matches none of the tool_use blocks of "
            "messages[1]",
        ),
        (  # a call answered twice
            {"messages": [HI, {"role": "assistant", "content": [USE]},
                          {"role": "user", "content": [_result("toolu_1"), _result("toolu_1")]}]},
            "messages[2].content[1].tool_use_id 'toolu_1': messages[2].content[0] already "
            "answers that call",
        ),
        (  # a result after no call
            {"messages": [{"role": "user", "content": [_result("toolu_1")]}]},
            "messages[0].content[0]: a tool_result block must follow an assistant's tool_use "
            "blocks",
        ),
        (  # a prefill (the last assistant turn, continued) that is a tool call
            {"messages": [HI, {"role": "assistant", "content": [USE]}]},
            "messages: messages[1] has tool_use blocks, which cannot be continued",
        ),
        (  # thinking mode: an earlier assistant turn after the last user turn, of text only
            {"thinking": {"type": "adaptive"}, "messages": [
                HI, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "messages[1]: in thinking mode an assistant message after the last user message "
            "needs a thinking block or tool_use blocks",
        ),
    ],
    ids=["unmatched-id", "answered-twice", "no-call", "prefilled-call", "thinking"],
)  # fmt: skip
def test_messages_names_tool_use_blocks(
    served: tuple[str, ScriptedEngine], body: dict, want: str
) -> None:
    url, engine = served
    say(engine, "x")
    body = {"model": MODEL, "max_tokens": 10, "tools": [WEATHER], **body}
    r = httpx.post(url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == want


def _output(call_id: str, output: str = "pong") -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


@pytest.mark.parametrize(
    ("body", "param", "want"),
    [
        (  # an id that answers no call (instructions are chat's messages[0])
            {"instructions": "Be brief.",
             "input": [HI, CALL, {**CALL, "call_id": "c2"}, _output("c9")]},
            "input",
            "input[3].call_id 'c9' matches none of the function_call items input[1], input[2]",
        ),
        (  # an output after no call
            {"input": [HI, _output("c1")]},
            "input",
            "input[1]: a function_call_output item must follow an assistant's function_call "
            "items",
        ),
        (  # a call's arguments, that the client sends as a JSON string
            {"input": [HI, CALL, {**CALL, "call_id": "c2", "arguments": "[1]"}, _output("c1")]},
            "input",
            "input[2].arguments must be a JSON object",
        ),
        (  # an output holding a lone surrogate (JSON allows "\ud83d")
            {"input": [HI, CALL, _output("c1", "\ud83d")]},
            "input",
            "input[2].output contains a lone UTF-16 surrogate at index 0",
        ),
        (
            {"tools": [PING], "tool_choice": {"type": "function", "name": 5}},
            "tool_choice",
            "tool_choice.name must be a string, got integer",
        ),
        (  # thinking mode: an earlier assistant message after the last user message
            {"reasoning": {"effort": "high"}, "input": [
                HI, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "input",
            "input[1]: in thinking mode an assistant message after the last user message needs "
            "a reasoning item or function_call items",
        ),
    ],
    ids=["unmatched-id", "no-call", "arguments", "output", "tool-choice-name", "thinking"],
)  # fmt: skip
def test_responses_names_function_call_items(
    served: tuple[str, ScriptedEngine], body: dict, param: str, want: str
) -> None:
    url, engine = served
    say(engine, "x")
    body = {"model": MODEL, "input": "Hi", **body}
    # (json.dumps escapes a lone surrogate, which UTF-8 cannot encode)
    r = httpx.post(url + "/v1/responses", content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"]) == (want, param)
