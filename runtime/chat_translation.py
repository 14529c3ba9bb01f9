"""A request of another API (Responses, Anthropic's Messages) translated into the chat request the
chat route runs: the translated body validated as chat's, and the chat route's errors renamed
back to the fields the client sent. ``where[k]`` is the field chat message k came from (e.g.
``input[2]``, ``system``, ``messages[1].content[0]``): an ``Origin`` where the translation moved
fields under it (a tool result's id, an assistant's tool calls)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from runtime.json_words import json_type, type_named
from runtime.openai_protocol import APIError, ChatCompletionRequest
from runtime.tokenizer import lone_surrogate


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


def checked(text: str, at: str, param: str) -> str:
    """``text``, one of the texts a translation joins into one chat field, at the client's path
    ``at``: a lone surrogate in it is a 400 naming that path and the index in its own text
    (chat's words), where chat's check would name the joined field (at an index of the join,
    or with no word of which part)."""
    if (j := lone_surrogate(text)) is not None:
        raise APIError(400, f"{at} contains a lone UTF-16 surrogate at index {j}", param=param)
    return text


def part_text(p: Any, at: str, param: str, kinds: tuple[str, ...], noun: str) -> str:
    """The string ``text`` of the text part at ``at`` (a Messages ``text`` block, a Responses
    ``input_text`` / ``output_text`` part: ``kinds``, ``noun`` "block" / "part"), unchecked for
    surrogates (``checked``, under the caller's path); a 400 that says what is wrong: the part
    (``at must be a text block, got type 'image'``, ``at must be an input_text part, got
    string``) or, of a part that is one, its text (``string_field``'s ``at.text must be a
    string, got null``; of a part with no type, ``got no type``)."""
    if not isinstance(p, dict) or p.get("type") not in kinds:
        got = type_named(p) if isinstance(p, dict) else json_type(p)
        kind = " or ".join(kinds)
        raise APIError(400, f"{at} must be {_article(kind)} {kind} {noun}, got {got}", param=param)
    return string_field(p, "text", at, param)


def string_field(d: dict[str, Any], key: str, at: str, param: str) -> str:
    """``d[key]``, a string, where ``d`` is the object at ``at``; else a 400 naming the field
    and what it holds in JSON's words (``json_type``), or that it is absent: ``input[1].text
    must be a string, got null`` / ``got no text``."""
    value = d.get(key)
    if not isinstance(value, str):
        got = json_type(value) if key in d else f"no {key}"
        raise APIError(400, f"{at}.{key} must be a string, got {got}", param=param)
    return value


def _article(word: str) -> str:
    """``word``'s indefinite article: an input_text part, a text block."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def joined(texts: list[tuple[str, str]], param: str) -> str:
    """The texts a translation joins into one chat field (a Messages turn's thinking blocks, a
    Responses reasoning item's parts: chat's ``reasoning``), each ``(text, the client's path of
    it)``, each ``checked``."""
    return "".join([checked(text, at, param) for text, at in texts])


class Origin(str):
    """The client's field a chat message came from (the string: ``input[2]``), with the client's
    paths of chat's fields under the message that the translation moved (``fields``: a path
    under ``messages[k]`` -> the client's, e.g. ``.tool_call_id`` -> ``input[2].call_id``,
    ``.tool_calls[0]`` -> ``input[3]``); a path not in ``fields`` is taken to be under the
    string's field."""

    fields: dict[str, str]

    def __new__(cls, at: str, fields: dict[str, str] | None = None) -> Origin:
        self = super().__new__(cls, at)
        self.fields = dict(fields or {})
        return self


def renamed(
    e: APIError,
    where: list[str],
    renames: dict[str, str],
    message: str | None = None,
    words: dict[str, str] | None = None,
) -> APIError:
    """The chat route's error ``e`` in the client's names: its param (``renames``), the paths
    under the messages it names (``messages[k]...`` -> ``where[k]``, or its ``Origin.fields``),
    the field its text names, and chat's words for its tool fields (``words``: a phrase ->
    the route's, e.g. ``"a tool message"`` -> ``"a tool_result block"``), none inside a value it
    quotes (``unquoted_sub``). ``message``: ``e``'s text with a route's own rewording done
    first."""
    param = renames.get(e.param or "", e.param)
    text = message or e.message
    if words:  # (chat's words, before the paths around them are the client's)
        phrases = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        text = unquoted_sub(f"(?P<w>{phrases})", lambda m: words[m["w"]], text)
    path = r"messages\[(?P<k>\d+)\](?P<rest>(?:\.\w+|\[\d+\])*)"
    msg = unquoted_sub(path, lambda m: _at(where, int(m["k"]), m["rest"]), text)
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


def _at(where: list[str], k: int, rest: str) -> str:
    """The client's path of chat's ``messages[k]<rest>``: the longest start of ``rest`` that
    ``where[k]``'s ``Origin.fields`` moves, else ``rest`` under ``where[k]``."""
    if k >= len(where):
        return f"messages[{k}]{rest}"
    fields: dict[str, str] = getattr(where[k], "fields", {})
    parts = re.findall(r"\.\w+|\[\d+\]", rest)
    for n in range(len(parts), 0, -1):
        if (head := "".join(parts[:n])) in fields:
            return fields[head] + "".join(parts[n:])
    return str(where[k]) + rest
