"""The OpenAI Responses API's request (``POST /v1/responses``) and its translation into the chat
request the chat route runs (``runtime.server_chat``): ``input`` and ``instructions`` become
messages, ``text.format`` the response format, ``reasoning`` thinking mode, the flat function
tools chat's nested ones. The chat route's errors are renamed back to the fields the client sent
(``renamed``).

Nothing is stored: ``store: true`` (OpenAI's default) is answered unstored (the response says
``store: false``, as vLLM answers it without its store), ``previous_response_id`` is refused, as
are the fields
``UNSUPPORTED_RESPONSES`` lists, rather than silently ignored (``include`` but what ``INCLUDED``
names, which a response has anyway).
"""

from __future__ import annotations

from typing import Any

from runtime import chat_translation
from runtime.chat_translation import Origin, validated_chat
from runtime.json_words import field_value, json_type, type_named, type_value, value_named
from runtime.openai_protocol import APIError, ChatCompletionRequest, _Strict, refuse_unsupported


class ResponsesRequest(_Strict):
    model: str
    # a user message, or a list of items (chat_request); list[Any], not list[dict]: an item that
    # is not an object is _messages' 400 ("input[0] must be an item (an object), got string"),
    # not pydantic's "input.str"
    input: str | list[Any]
    instructions: str | None = None  # a system message, placed first
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": text | json_object | json_schema}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: thinking mode unless "none"
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "parameters", ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None  # returned as sent
    user: str | None = None
    store: bool | None = None  # nothing is stored: answered with store: false


# Fields of the Responses API this server does not implement, with the values that leave them off
# (openai_protocol.refuse_unsupported); any other value is a 400 naming the field.
UNSUPPORTED_RESPONSES: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "include": ([],),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "top_logprobs": (0,),
    "n": (1,),
}
# What ``include`` may ask for that a response here has anyway: a stateless client's reasoning to
# send back (the openai client's Responses tool runner always asks for it). The reasoning item's
# text is returned as it is, in its ``content``, and read back from an input item, so there is
# nothing to encrypt.
INCLUDED = ("reasoning.encrypted_content",)
# vLLM's sampling extensions, passed to the chat request as they are (its types and rules)
SAMPLING_EXTRAS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# a message item's roles (chat's tool message is a function_call_output item here)
ROLES = ("system", "developer", "user", "assistant")
# chat's field names -> the Responses field the client sent
_RENAMES = {
    "messages": "input",
    "response_format": "text",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "chat_template_kwargs": "reasoning",
}

# chat's words for its tool fields -> the items the client sent (a call_id, a call's item, an
# output: the messages' Origin.fields)
_TOOL_WORDS = {
    "a tool message": "a function_call_output item",
    "an assistant's tool_calls": "an assistant's function_call items",
    "reasoning_content or tool_calls": "a reasoning item or function_call items",
    "tool_choice: function.name": "tool_choice.name",
}


def check_responses(req: ResponsesRequest) -> None:
    """400 for what this server does not do, naming the field."""
    extra = req.model_extra or {}
    # (store: true, OpenAI's default, is answered unstored, as vLLM does: the response says
    # store: false; what would need a stored response, previous_response_id, is refused)
    if extra.get("previous_response_id") is not None:
        msg = (
            "previous_response_id is not supported: this server keeps no responses; send the "
            "conversation in input"
        )
        raise APIError(400, msg, param="previous_response_id")
    include = extra.get("include")
    if isinstance(include, list):  # (what it asks for beyond INCLUDED is refused)
        extra = {**extra, "include": [x for x in include if x not in INCLUDED]}
    refuse_unsupported(extra, UNSUPPORTED_RESPONSES)


def thinking(req: ResponsesRequest) -> bool:
    """``reasoning``'s effort turns thinking mode on (any effort but "none"; DeepSeek-V3.2 has
    one depth of thinking)."""
    if req.reasoning is None:
        return False
    effort = req.reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        msg = f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {value_named(effort)}"
        raise APIError(400, msg, param="reasoning")
    return effort != "none"


def chat_request(req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request ``req`` asks for, and where each of its messages came from (``input[i]``
    or ``instructions``), for ``renamed``."""
    messages, where = _messages(req.input)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
        where.insert(0, Origin("instructions"))
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "user": req.user,
        "response_format": _response_format(req.text),
        "tools": None if req.tools is None else [_tool(i, t) for i, t in enumerate(req.tools)],
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "chat_template_kwargs": {"thinking": thinking(req)},
    }
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in SAMPLING_EXTRAS if k in extra})
    return validated_chat(body, where, _RENAMES, "input"), where


def renamed(e: APIError, where: list[str]) -> APIError:
    """The chat route's error ``e`` in the Responses request's names (``chat_translation``),
    its format and flat tools reworded."""
    msg = e.message
    if e.param == "tools":  # (the flat tools have no .function)
        msg = chat_translation.tools_flattened(msg, "parameters")
    # (also where tool_choice's error names it: a forced call and a format are one grammar each)
    msg = chat_translation.field_renamed(msg, "response_format", "text.format")
    return chat_translation.renamed(e, where, _RENAMES, msg, _TOOL_WORDS)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (whose rules check it)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"text.format must be an object, got {json_type(fmt)}", param="text")
    if fmt.get("type") != "json_schema":
        return fmt
    if "schema" not in fmt:
        raise APIError(400, "text.format: a json_schema format needs a schema", param="text")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A flat function tool as chat's nested one."""
    if tool.get("type") != "function":
        got = type_named(tool)
        msg = f"tools[{i}]: only function tools are supported, got {got}"
        raise APIError(400, msg, param="tools")
    if "function" in tool and "name" not in tool:
        msg = f'tools[{i}]: a Responses function tool is flat: {{"type": "function", "name", ...}}'
        raise APIError(400, msg, param="tools")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or "name" not in choice:
        msg = 'tool_choice: an object must be {"type": "function", "name": ...}'
        raise APIError(400, msg, param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text(content: Any, at: str, kinds: tuple[str, ...]) -> str | list[dict[str, Any]] | None:
    """A message's content (a string, or text parts of ``kinds``) as chat's. Chat joins a
    message's parts and names a lone surrogate in any of them as the message's content: here it
    names the part's own ``text`` (``{at}[j].text``) and the index in that text (a string
    content is left to chat's check, which names it ``at``)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        msg = f"{at} must be a string or a list of parts, got {json_type(content)}"
        raise APIError(400, msg, param="input")
    out = []
    for j, p in enumerate(content):
        text = chat_translation.part_text(p, f"{at}[{j}]", "input", kinds, "part")
        text = chat_translation.checked(text, f"{at}[{j}].text", "input")
        out.append({"type": "text", "text": text})
    return out


def _messages(items: str | list[Any]) -> tuple[list[dict[str, Any]], list[Origin]]:
    """Chat messages of ``input``, and the item each starts at. A reasoning item, an assistant
    message and function calls that follow one another are one assistant turn; a function
    call's output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [Origin("input")]
    msgs: list[dict[str, Any]] = []
    where: list[Origin] = []
    last = None  # the kind of the previous item
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            msg = f"{at} must be an item (an object), got {json_type(item)}"
            raise APIError(400, msg, param="input")
        kind = item.get("type", "message")
        turn = msgs[-1] if msgs and last in ("reasoning", "assistant", "function_call") else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                got = field_value(item, "role")
                msg = f"{at}.role must be one of {', '.join(ROLES)}, got {got}"
                if role == "tool":
                    msg += " (a tool's result is a function_call_output item)"
                raise APIError(400, msg, param="input")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            content = _text(item.get("content"), f"{at}.content", kinds)
            if role == "assistant" and turn is not None and last == "reasoning":
                turn["content"] = content
                # (the turn is named by its reasoning item: its content is this item's)
                where[-1].fields[".content"] = f"{at}.content"
            else:
                msgs.append({"role": role, "content": content})
                where.append(Origin(at))
            last = "assistant" if role == "assistant" else "message"
        elif kind == "function_call":
            call_id, name, args = (
                chat_translation.string_field(item, key, at, "input")
                for key in ("call_id", "name", "arguments")
            )
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}  # fmt: skip
            if turn is None:
                msgs.append({"role": "assistant", "content": None})
                where.append(Origin(at))
                turn = msgs[-1]
            calls, fields = turn.setdefault("tool_calls", []), where[-1].fields
            fields[f".tool_calls[{len(calls)}]"] = at
            fields[f".tool_calls[{len(calls)}].function.arguments"] = f"{at}.arguments"
            calls.append(call)
            fields[".tool_calls"] = "the function_call items " + ", ".join(
                fields[f".tool_calls[{j}]"] for j in range(len(calls))
            )
            last = "function_call"
        elif kind == "function_call_output":
            chat_translation.string_field(item, "call_id", at, "input")
            if item.get("output") is None:  # (_text takes None, a message's no content)
                got = field_value(item, "output")
                msg = f"{at}.output must be a string or a list of parts, got {got}"
                raise APIError(400, msg, param="input")
            output = _text(item["output"], f"{at}.output", ("input_text",))
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            where.append(Origin(at, {".tool_call_id": f"{at}.call_id", ".content": f"{at}.output"}))
            last = "function_call_output"
        elif kind == "reasoning":
            # (absent or null: no parts; another falsy value, "" or false, is no list of them)
            parts = item.get("content")
            parts = [] if parts is None else parts
            if not isinstance(parts, list):
                msg = f"{at}.content must be a list of parts, got {json_type(parts)}"
                raise APIError(400, msg, param="input")
            texts = []  # (each part's text, and where it is: chat's reasoning is them joined)
            for j, p in enumerate(parts):
                if not isinstance(p, dict):
                    msg = f"{at}.content[{j}] must be a part (an object), got {json_type(p)}"
                    raise APIError(400, msg, param="input")
                if p.get("type") != "reasoning_text":
                    continue
                text = chat_translation.string_field(p, "text", f"{at}.content[{j}]", "input")
                texts.append((text, f"{at}.content[{j}].text"))
            text = chat_translation.joined(texts, "input")
            # (content None until an assistant message after it gives its own, named after that
            # message: with none, chat has nothing of the client's there to refuse, so no error
            # names this item's .content for the turn's)
            msgs.append({"role": "assistant", "content": None, "reasoning": text})
            where.append(Origin(at))
            last = "reasoning"
        else:
            msg = (
                f"{at}.type must be message, function_call, function_call_output or reasoning, "
                f"got {type_value(item)}"
            )
            raise APIError(400, msg, param="input")
    if not msgs:
        raise APIError(400, "input must not be an empty list", param="input")
    return msgs, where
