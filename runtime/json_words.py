"""What a request's value is, in JSON's words, as an error says what it got instead: ``null``,
``boolean``, ``integer``, ... (``json_type``), a field's string quoted (``'image'``) or that it
is absent (``no role``: ``field_value``). Python's words (``None``, ``True``, ``{'a': 1}``,
``NoneType``) are not the client's. Below the routes' protocol modules (``openai_protocol``,
``tool_calls``, ``chat_translation``) and the chat rendering (``chat_template``, ``tokenizer``'s
``validate_messages``), which all say it so."""

from __future__ import annotations

from typing import Any


def json_type(value: Any) -> str:
    """The JSON type of a value of a request's body, as an error names what it got instead:
    null, boolean, integer, number, string, array or object (Python's names, ``NoneType``,
    ``bool``, ``list``, ``dict``, are not the client's)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # (before int: a bool is one)
        return "boolean"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object" if isinstance(value, dict) else type(value).__name__


def value_named(value: Any) -> str:
    """``value`` as an error says what it got: a string quoted (``'tool'``: the client's own
    word), another value by its JSON type (``null``, ``boolean``, ``object``: ``json_type``)."""
    return repr(value) if isinstance(value, str) else json_type(value)


def field_value(d: dict[str, Any], key: str) -> str:
    """``d[key]`` as an error says what it got (``value_named``), or ``no <key>`` where it is
    absent: ``got 'tool'``, ``got null``, ``got no role``."""
    return value_named(d[key]) if key in d else f"no {key}"


def type_value(d: dict[str, Any]) -> str:
    """The ``type`` of the object ``d`` as an error says what it got (``field_value``):
    ``'image'``, ``null``, ``integer``, ``no type``."""
    return field_value(d, "type")


def type_named(d: dict[str, Any]) -> str:
    """``type_value`` where the error names the object, not its ``type`` field (``at must be a
    text block, got ...``, ``tools[0]: only function tools are supported, got ...``): ``type
    'image'``, ``type null``, ``no type``."""
    return f"type {type_value(d)}" if "type" in d else type_value(d)
