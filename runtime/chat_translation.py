"""A request of another API (Responses, Anthropic's Messages) translated into the chat request the
chat route runs: the translated body validated as chat's, and the chat route's errors renamed
back to the fields the client sent. ``where[k]`` is the field chat message k came from (e.g.
``input[2]``, ``system``, ``messages[1].content[0]``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from runtime.openai_protocol import APIError, ChatCompletionRequest


def validated_chat(
    body: dict[str, Any], where: list[str], renames: dict[str, str], items: str
) -> ChatCompletionRequest:
    """``body`` as a chat request; a field it fails on named as the client sent it
    (``renames``: chat's field -> the client's; ``items``: the field the messages came from)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a sampling extra's type, or a message's field
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        if loc[:1] == ["messages"] and len(loc) > 1 and loc[1].isdigit():
            at, param = where[int(loc[1])] + "".join(f".{x}" for x in loc[2:]), items
        else:
            at = param = renames.get(loc[0], loc[0]) if loc else items
        raise APIError(400, f"{at}: {err.get('msg')}", param=param) from e


def renamed(
    e: APIError, where: list[str], renames: dict[str, str], message: str | None = None
) -> APIError:
    """The chat route's error ``e`` in the client's names: its param (``renames``), the messages
    it names (``messages[k]`` -> ``where[k]``) and the field its text names, neither inside a
    value it quotes (``unquoted_sub``). ``message``: ``e``'s text with a route's own rewording
    done first."""
    param = renames.get(e.param or "", e.param)
    text = message or e.message
    msg = unquoted_sub(r"messages\[(?P<k>\d+)\]", lambda m: _at(where, int(m["k"])), text)
    if e.param in renames:
        msg = field_renamed(msg, e.param, param or "")
    return APIError(e.status, msg, param=param, code=e.code, type_=e.type)


# a quoted value (a repr the text echoes: 'a', "it's", 'a \'b\''), its opening quote not an
# apostrophe (``client's``)
_QUOTED = r"""(?<!\w)(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""


def unquoted_sub(pattern: str, repl: Callable[[re.Match[str]], str], text: str) -> str:
    """``re.sub(pattern, repl, text)`` outside quoted values: the error's own words and paths
    are rewritten, a value it echoes from the client (a stop string, a tool call id, a schema's
    text: ``got ['messages[0]']``) is kept whole. ``pattern``'s groups are read by name."""
    return re.sub(f"(?P<_quoted>{_QUOTED})|{pattern}", lambda m: m["_quoted"] or repl(m), text)


def field_renamed(text: str, field: str, name: str) -> str:
    """``text`` with each reference to the field ``field`` (a whole name, or a path's first part:
    ``stop``, ``stop[0]``, ``stop.x``) written ``name``. NOTE: not inside other words or names
    (``nonstop``, ``user-facing``, ``max_tokens`` for ``tokens``, ``x.stop``), nor anywhere in a
    quoted value (one the client sent: ``got ['stop', 'do not stop']``, ``'#/$defs/stop'``)."""
    ref = rf"(?<![\w.'\"-]){re.escape(field)}(?![\w'\"-])"
    return unquoted_sub(ref, lambda m: name, text)


def tools_flattened(text: str, schema: str) -> str:
    """``text`` with chat's tool paths as a route's flat tools name them (they have no
    ``function``): ``tools[i].function.parameters`` -> ``tools[i].<schema>`` (``input_schema`` on
    Messages), ``tools[i].function.name`` -> ``tools[i].name``. NOTE: only a path that starts at
    ``tools[i]``, outside quoted values: a parameter's name or a schema's text that holds
    ``.function.`` is the client's (``tools[0]: a.function.b.minLength must be ...``)."""

    def flat(m: re.Match[str]) -> str:
        return f"{m['at']}.{schema if m['params'] else ''}"

    path = r"(?P<at>(?<![\w.])tools\[\d+\])\.function\.(?P<params>parameters(?!\w))?"
    return unquoted_sub(path, flat, text)


def _at(where: list[str], k: int) -> str:
    return where[k] if k < len(where) else f"messages[{k}]"
