"""Anthropic's Messages API's request (``POST /v1/messages``, what the Anthropic SDK and Claude
Code send) and its translation into the chat request the chat route runs
(``runtime.server_chat``): ``system`` and the content blocks become chat messages (a
``tool_result`` block a tool message, an assistant's ``thinking`` block its reasoning),
``thinking`` thinking mode, the tools and tool_choice chat's, ``output_format`` (structured
outputs) chat's ``response_format``; a last assistant turn is continued (Anthropic's prefill:
chat's ``continue_final_message``). The chat route's errors are
renamed back to the fields the client sent (``renamed``), and every error of the route is
answered in Anthropic's shape (``error_response``).

A field this route cannot honour (``UNSUPPORTED_MESSAGES``; ``thread``, with Anthropic's
``thread_unsupported_request`` code, ``check_messages``) is a 400 naming it, and so are
images, documents and Anthropic's server tools; any other field it does not know is ignored
(Claude Code sends some), as on the other routes. ``cache_control`` is accepted and ignored (the
prefix cache needs no marks); ``thinking.budget_tokens`` is accepted, not enforced
(``max_tokens`` caps the thinking and the reply together).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse

from runtime import chat_translation
from runtime.chat_translation import Origin, validated_chat
from runtime.json_words import field_value, json_type, type_named, type_value
from runtime.openai_protocol import APIError, ChatCompletionRequest, _Strict, refuse_unsupported

MESSAGES_PATH = "/v1/messages"


class MessagesRequest(_Strict):
    model: str
    # {"role": user | assistant, "content": str | blocks}; list[Any], not list[dict]: a turn that
    # is not an object is _messages' 400 ("messages[0] must be a message (an object), got
    # string"), not pydantic's "messages.0"
    messages: list[Any]
    max_tokens: int  # required, as Anthropic's API requires it
    # a string or text blocks; list[Any], not list[dict]: a block that is not an object is
    # _text's 400 ("system[0] must be a text block, got string"), not pydantic's "system.str"
    system: str | list[Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None  # {"name", "description", "input_schema"}
    tool_choice: dict[str, Any] | None = None  # {"type": auto | any | tool | none, "name"}
    thinking: dict[str, Any] | None = None  # {"type": "enabled", "budget_tokens"} | adaptive | ...
    metadata: dict[str, Any] | None = None  # {"user_id"}: chat's user
    # structured outputs, {"type": "json_schema", "schema"}: the beta's field, and the GA one's
    # (what the SDK's messages.create(output_config=...) and messages.parse send; effort ignored)
    output_format: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format", "effort"}


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a message's fields without ``max_tokens`` (what
    Claude Code sends to size its context); counted as the message's prompt renders."""

    max_tokens: int = 1  # (not Anthropic's field here: one token of room for the render's check)
    # stream: false (or absent) is taken, a count has nothing to stream; true is check_count's 400


# Fields of the Messages API this server cannot honour, with the values that leave them off
# (openai_protocol.refuse_unsupported): any other value is a 400 naming the field. Any other field
# is ignored, as the other routes and DeepSeek's own Anthropic endpoint do (Claude Code sends
# fields such as context_management and service_tier, which change nothing asked of the model).
UNSUPPORTED_MESSAGES: dict[str, tuple[Any, ...]] = {
    "container": (),  # Anthropic's code-execution container
    "mcp_servers": ([],),  # tools run by Anthropic's servers
}
# chat's field names -> the Messages field the client sent
_RENAMES = {
    "max_tokens": "max_tokens",
    "stop": "stop_sequences",
    "chat_template_kwargs": "thinking",
    "parallel_tool_calls": "tool_choice",
    "user": "metadata",
    "continue_final_message": "messages",
}
# chat's words for its tool fields -> the blocks the client sent (a tool_use_id, a call's
# block: the messages' Origin.fields)
_TOOL_WORDS = {
    "a tool message": "a tool_result block",
    "an assistant's tool_calls": "an assistant's tool_use blocks",
    "reasoning_content or tool_calls": "a thinking block or tool_use blocks",
    "has tool_calls": "has tool_use blocks",
    # chat's tool_choice values -> the Messages types the client sent (required: any; a named
    # function: tool)
    "tool_choice: required needs": "tool_choice: type any needs",
    "tool_choice required or a named function": "tool_choice of type any or tool",
}
# chat's error on a named function that is not a tool: the name is the Messages choice's own field
_CHOICE_NAME = re.compile(r"^tool_choice: (?=.* is not one of the request's tools$)")
# Anthropic's error type of each status (its other 4xx: invalid_request_error)
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_body(e: APIError) -> dict[str, Any]:
    """``e`` in Anthropic's error shape (its message names the field; there is no ``param``)."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    error = {"type": kind, "message": e.message}
    if e.details is not None:
        error["details"] = e.details
    return {"type": "error", "error": error}


def error_response(e: APIError, path: str) -> JSONResponse:
    """The answer to ``e`` on the route ``path``: Anthropic's shape on the Messages route and
    its sub-paths (``count_tokens``, or one this server lacks), OpenAI's elsewhere."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return JSONResponse(anthropic_body(e), status_code=e.status)
    return e.response()


def check_messages(req: MessagesRequest) -> None:
    """400 for a field this server cannot honour, naming it; other unknown fields are ignored.

    ``thread`` (server-held conversation state: ``{"type": "continue", "previous_message_id"}``
    sends only the new turn) is refused, as the Responses route refuses
    ``previous_response_id``: this server keeps no messages. Ignored, a continued turn would run
    on its last messages alone. The error carries Anthropic's ``thread_unsupported_request``
    code, on which the SDK's tool runner (which asks for a thread by default) sends the turn
    again with the whole conversation and no ``thread``."""
    extra = req.model_extra or {}
    if extra.get("thread") is not None:
        msg = (
            "thread is not supported: this server keeps no messages; send the whole "
            "conversation in messages, without thread"
        )
        details = {"error_code": "thread_unsupported_request"}
        raise APIError(400, msg, param="thread", details=details)
    refuse_unsupported(extra, UNSUPPORTED_MESSAGES)


def check_count(req: CountTokensRequest) -> None:
    """400 for what a token count cannot do, naming it: ``stream: true`` (a count is one
    number, nothing to stream; ``false`` is taken, as a client that sends a message's fields
    may)."""
    if req.stream:
        msg = "stream: a token count is not streamed; send stream false or leave it out"
        raise APIError(400, msg, param="stream")


def thinking(req: MessagesRequest) -> bool:
    """``thinking``'s type: "enabled" and "adaptive" (the model decides how much to think: the
    SDK's and Claude Code's choice for newer models) turn thinking mode on (DeepSeek-V3.2 has one
    depth of thinking: ``budget_tokens`` is checked, not enforced), "disabled" leaves it off."""
    if req.thinking is None:
        return False
    kind = req.thinking.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        got = type_value(req.thinking)
        msg = f"thinking.type must be enabled, adaptive or disabled, got {got}"
        raise APIError(400, msg, param="thinking")
    budget = req.thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        # (an integer out of range is said as sent; another value by its JSON type)
        got = budget if type(budget) is int else field_value(req.thinking, "budget_tokens")
        msg = f"thinking.budget_tokens must be an integer >= 1, got {got}"
        raise APIError(400, msg, param="thinking")
    return True


def chat_request(req: MessagesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request ``req`` asks for, and where each of its messages came from
    (``system``, ``messages[i]``, ``messages[i].content[j]``), for ``renamed``."""
    messages, where = _messages(req.messages)
    if req.system is not None:
        system = _text(req.system, "system", "system")
        messages.insert(0, {"role": "system", "content": system})
        where.insert(0, Origin("system", {".content": "system"}))  # (a string is system itself)
    choice = req.tool_choice or {}
    user = (req.metadata or {}).get("user_id")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "stream": req.stream,
        "user": user if isinstance(user, str) else None,
        "tools": None if req.tools is None else [_tool(i, t) for i, t in enumerate(req.tools)],
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": False if choice.get("disable_parallel_tool_use") else None,
        "chat_template_kwargs": {"thinking": thinking(req)},
        "response_format": _response_format(req),
    }
    if req.messages[-1].get("role") == "assistant":  # Anthropic's prefill: the reply continues it
        body.update(add_generation_prompt=False, continue_final_message=True)
    return validated_chat(body, where, _RENAMES, "messages"), where


def renamed(e: APIError, where: list[str], fmt: str = "output_format") -> APIError:
    """The chat route's error ``e`` in the Messages request's names (``chat_translation``), its
    tools' fields reworded; ``fmt``: the field the structured output came in (``format_field``)."""
    msg = e.message
    if e.param == "tools":  # (the tools have no .function; their schema is input_schema)
        msg = chat_translation.tools_flattened(msg, "input_schema")
    elif e.param == "tool_choice":
        msg = _CHOICE_NAME.sub("tool_choice.name: ", msg)
    # (also where tool_choice's error names it: a forced call and a format are one grammar each)
    msg = chat_translation.field_renamed(msg, "response_format", fmt)
    if e.param == "response_format" and not msg.startswith(fmt):  # the engine's grammar check
        msg = f"{fmt}: {msg}"  # (Anthropic's shape has no param: the message names the field)
    renames = {**_RENAMES, "response_format": fmt}
    return chat_translation.renamed(e, where, renames, msg, _TOOL_WORDS)


def format_field(req: MessagesRequest) -> str:
    """The field ``req``'s structured output came in: ``output_format`` (the beta's) or
    ``output_config.format`` (the GA form)."""
    if req.output_format is None and (req.output_config or {}).get("format") is not None:
        return "output_config.format"
    return "output_format"


def _response_format(req: MessagesRequest) -> dict[str, Any] | None:
    """Chat's ``response_format`` of the structured output ``{"type": "json_schema", "schema"}``
    (None: free text). The chat route compiles its grammar; in thinking mode the grammar starts
    after the reasoning (``runtime.reasoning.thinking_params``), as on chat."""
    config = (req.output_config or {}).get("format")
    if req.output_format is not None and config is not None:
        msg = "output_format and output_config.format cannot both be given (they are one format)"
        raise APIError(400, msg, param="output_format")
    at, fmt = format_field(req), req.output_format if req.output_format is not None else config
    if fmt is None:
        return None
    if not isinstance(fmt, dict):  # (output_config's format: output_format is an object)
        raise APIError(400, f"{at} must be an object, got {json_type(fmt)}", param=at)
    if fmt.get("type") != "json_schema":
        got = type_value(fmt)
        raise APIError(400, f"{at}.type must be json_schema, got {got}", param=at)
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, f"{at}.schema must be a JSON schema object", param=at)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Messages tool as chat's function tool. Its ``type`` absent is a custom tool, as
    Anthropic's; a ``type`` sent is a string (null is no custom tool: it was taken as one)."""
    if "type" in tool and not isinstance(tool["type"], str):
        msg = f"tools[{i}].type must be custom (or absent), got {json_type(tool['type'])}"
        raise APIError(400, msg, param="tools")
    if tool.get("type") not in (None, "custom"):
        got = type_named(tool)
        msg = f"tools[{i}]: only custom tools (name, input_schema) are supported, got {got}"
        raise APIError(400, msg, param="tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise APIError(400, f"tools[{i}].input_schema: Field required", param="tools")
    # (in chat's order: the prompt shows the function as JSON)
    fn = {"name": tool.get("name"), "description": tool.get("description"),
          "parameters": tool["input_schema"]}  # fmt: skip
    if fn["description"] is None:
        del fn["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        name = chat_translation.string_field(choice, "name", "tool_choice", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    named = {"auto": "auto", "any": "required", "none": "none"}
    if not isinstance(kind, str) or kind not in named:  # (a list or object: unhashable)
        got = type_value(choice)
        msg = f"tool_choice.type must be auto, any, tool or none, got {got}"
        raise APIError(400, msg, param="tool_choice")
    return named[kind]


def _text(content: Any, at: str, param: str) -> str | list[dict[str, Any]]:
    """A string, or text blocks as chat's text parts (``_text_part``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        msg = f"{at} must be a string or a list of text blocks, got {json_type(content)}"
        raise APIError(400, msg, param=param)
    return [_text_part(b, f"{at}[{j}]", param) for j, b in enumerate(content)]


def _text_part(b: Any, at: str, param: str, text_at: str | None = None) -> dict[str, Any]:
    """The text block at ``at`` as chat's text part (its ``cache_control`` ignored). Chat joins
    a message's parts and names a lone surrogate in any of them as the message's content: here
    it names the block's own ``text`` (``text_at``: a string content's own path, where the
    string was made one block)."""
    text = chat_translation.part_text(b, at, param, ("text",), "block")
    text = chat_translation.checked(text, text_at or f"{at}.text", param)
    return {"type": "text", "text": text}


def _blocks(content: Any, at: str) -> list[dict[str, Any]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        msg = f"{at} must be a string or a list of blocks, got {json_type(content)}"
        raise APIError(400, msg, param="messages")
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            msg = f"{at}[{j}] must be a block (an object), got {json_type(b)}"
            raise APIError(400, msg, param="messages")
    if not content:  # (a turn of no blocks was no message at all: the turns around it joined)
        raise APIError(400, f"{at}: at least one block is required", param="messages")
    return content


def _messages(turns: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat messages of ``messages``, and the field each came from. A user turn's
    ``tool_result`` blocks are tool messages and its text blocks a user message, in their order;
    an assistant turn's thinking is its reasoning, its ``tool_use`` blocks its tool calls."""
    if not turns:
        raise APIError(400, "messages: at least one message is required", param="messages")
    msgs: list[dict[str, Any]] = []
    where: list[str] = []
    for i, turn in enumerate(turns):
        at = f"messages[{i}]"
        if not isinstance(turn, dict):
            msg = f"{at} must be a message (an object), got {json_type(turn)}"
            raise APIError(400, msg, param="messages")
        role = turn.get("role")
        if role not in ("user", "assistant"):
            msg = f"{at}.role must be user or assistant, got {field_value(turn, 'role')}"
            raise APIError(400, msg, param="messages")
        blocks = _blocks(turn.get("content"), f"{at}.content")
        # (a string content, made one text block, is its own text's path)
        text_at = f"{at}.content" if isinstance(turn.get("content"), str) else None
        if role == "assistant":
            origin = Origin(at)
            msgs.append(_assistant(blocks, origin, text_at))
            where.append(origin)
            continue
        texts: list[dict[str, Any]] | None = None  # the open user message's parts
        for j, b in enumerate(blocks):
            bat, kind = f"{at}.content[{j}]", b.get("type")
            if kind == "tool_result":
                chat_translation.string_field(b, "tool_use_id", bat, "messages")
                content = b.get("content")  # (optional: a result with no output)
                output = _text("" if content is None else content, f"{bat}.content", "messages")
                msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": output})
                where.append(Origin(bat, {".tool_call_id": f"{bat}.tool_use_id"}))
                texts = None
            elif kind == "text":
                if texts is None:
                    texts = []
                    msgs.append({"role": "user", "content": texts})
                    where.append(at if j == 0 else bat)
                texts.append(_text_part(b, bat, "messages", text_at))
            else:
                raise APIError(400, _refused(bat, b, "text or tool_result"), param="messages")
    return msgs, where


def _assistant(
    blocks: list[dict[str, Any]], at: Origin, text_at: str | None = None
) -> dict[str, Any]:
    """An assistant turn as a chat message: its text, reasoning and tool calls (each call's
    block, and the calls, in ``at.fields``); ``text_at``: as ``_text_part``'s."""
    texts, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        bat, kind = f"{at}.content[{j}]", b.get("type")
        if kind == "text":
            texts.append(_text_part(b, bat, "messages", text_at))
        elif kind == "thinking":
            thinking = chat_translation.string_field(b, "thinking", bat, "messages")
            reasoning.append((thinking, f"{bat}.thinking"))
        elif kind == "redacted_thinking":  # Anthropic's encrypted reasoning: nothing to read
            continue  # (a conversation begun on Anthropic's API goes on here without it)
        elif kind == "tool_use":
            call_id, name, args = b.get("id"), b.get("name"), b.get("input")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, dict)):
                msg = f"{bat}: a tool_use block needs a string id and name and an object input"
                raise APIError(400, msg, param="messages")
            fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
            at.fields[f".tool_calls[{len(calls)}]"] = bat
            calls.append({"id": call_id, "type": "function", "function": fn})
        else:
            allowed = "text, thinking, redacted_thinking or tool_use"
            raise APIError(400, _refused(bat, b, allowed), param="messages")
    msg: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if reasoning:
        msg["reasoning"] = chat_translation.joined(reasoning, "messages")
    if calls:
        msg["tool_calls"] = calls
        at.fields[".tool_calls"] = f"the tool_use blocks of {at}"
    return msg


def _refused(at: str, block: dict[str, Any], allowed: str) -> str:
    """Why the block at ``at`` is refused: its type is not ``allowed`` in its turn (what it got
    in JSON's words: ``'image'``, ``null``, ``no type``), or is one this server never reads."""
    kind = block.get("type")
    if kind in ("image", "document"):
        return f"{at}: {kind} blocks are not supported by this server (text only)"
    return f"{at}.type must be {allowed} here, got {type_value(block)}"
