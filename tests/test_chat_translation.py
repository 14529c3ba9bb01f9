"""``runtime.chat_translation.renamed``: the chat route's error in the client's names renames the
field where the text refers to it, and leaves prose, other names and the client's values be."""

from __future__ import annotations

import pytest

from runtime import messages_protocol, responses_protocol
from runtime.chat_translation import renamed
from runtime.openai_protocol import APIError


@pytest.mark.parametrize(
    "param, renames, text, want",
    [
        # a value the client sent, and a word holding the field's name
        (
            "stop",
            {"stop": "stop_sequences"},
            "stop must be a non-empty string or a list of them, got ['nonstop', 'stop', '']",
            "stop_sequences must be a non-empty string or a list of them, "
            "got ['nonstop', 'stop', '']",
        ),
        # a longer name holding it, and a path of another field ending in it
        (
            "tokens",
            {"tokens": "count"},
            "tokens must be <= max_tokens (tools.tokens), got 3; tokens[0] too",
            "count must be <= max_tokens (tools.tokens), got 3; count[0] too",
        ),
        # prose: a one-letter field, and the field's name in words
        (
            "n",
            {"n": "count"},
            "n must be an integer >= 1 when sampling is on, not n-ary",
            "count must be an integer >= 1 when sampling is on, not n-ary",
        ),
        (
            "user",
            {"user": "metadata"},
            "user is too long: a username-like, user-facing id is expected",
            "metadata is too long: a username-like, user-facing id is expected",
        ),
        # the field's name inside a value the client sent, not at its start
        (
            "stop",
            {"stop": "stop_sequences"},
            "stop must be a non-empty string or a list of them, "
            "got ['do not stop now', \"it's stop time\"]",
            "stop_sequences must be a non-empty string or a list of them, "
            "got ['do not stop now', \"it's stop time\"]",
        ),
        (
            "response_format",
            {"response_format": "output_format"},
            "response_format: the grammar does not compile: Pointer '/$defs/response_format/a' "
            "does not exist; the client's response_format",
            "output_format: the grammar does not compile: Pointer '/$defs/response_format/a' "
            "does not exist; the client's output_format",
        ),
    ],
    ids=["stop", "tokens", "n", "user", "stop-in-value", "format-in-value"],
)
def test_renames_only_references_to_the_field(
    param: str, renames: dict[str, str], text: str, want: str
) -> None:
    e = renamed(APIError(400, text, param=param), [], renames)
    assert (e.message, e.param) == (want, renames[param])


def test_messages_route_keeps_stop_values() -> None:
    e = APIError(400, "stop must be a non-empty string or a list of them, got ['nonstop', '']",
                 param="stop")  # fmt: skip
    out = messages_protocol.renamed(e, ["messages[0]"])
    assert out.param == "stop_sequences"
    assert out.message == (
        "stop_sequences must be a non-empty string or a list of them, got ['nonstop', '']"
    )


def test_responses_route_renames_format_and_messages() -> None:
    e = APIError(400, "response_format.type must be text, got 'response_format'",
                 param="response_format")  # fmt: skip
    out = responses_protocol.renamed(e, ["input[0]"])
    assert (out.message, out.param) == ("text.format.type must be text, got 'response_format'",
                                        "text")  # fmt: skip
    e = APIError(400, "messages[1]: messages must alternate", param="messages")
    out = responses_protocol.renamed(e, ["instructions", "input[0]"])
    assert (out.message, out.param) == ("input[0]: input must alternate", "input")


@pytest.mark.parametrize(
    "param, text, want",
    [
        # a tool call id the client sent, echoed in quotes: the paths around it are renamed
        (
            "messages",
            "messages[3].tool_call_id 'messages[0]' matches none of messages[2].tool_calls",
            "input[2].tool_call_id 'messages[0]' matches none of input[1].tool_calls",
        ),
        # a stop string of the client's, in a repr list (escaped quotes and all)
        (
            "stop",
            "stop must be a non-empty string or a list of them, got ['messages[1]', \"it's "
            "messages[2]\", 'a \\'messages[0]\\'', '']",
            "stop must be a non-empty string or a list of them, got ['messages[1]', \"it's "
            "messages[2]\", 'a \\'messages[0]\\'', '']",
        ),
    ],
    ids=["tool-call-id", "stop-values"],
)
def test_messages_inside_a_quoted_value_are_the_clients(param: str, text: str, want: str) -> None:
    """``messages[k]`` is renamed where the error names chat's message k, not inside a value
    it echoes from the client (the rule ``field_renamed`` keeps: ``unquoted_sub``)."""
    where = ["instructions", "input[0]", "input[1]", "input[2]"]
    e = renamed(APIError(400, text, param=param), where, {})
    assert e.message == want


KEY = "tools[0]: a.function.parameters.minLength must be a non-negative integer, got -1"
QUOTED = "tools[2]: parameter name 'tools[0].function.x\"' cannot be written in DSML"


@pytest.mark.parametrize(
    "text, messages, responses",
    [
        ("tools[1].function.parameters must be a JSON schema object",
         "tools[1].input_schema must be a JSON schema object",
         "tools[1].parameters must be a JSON schema object"),
        ("tools[0].function.parameters.required must be a list of names",
         "tools[0].input_schema.required must be a list of names",
         "tools[0].parameters.required must be a list of names"),
        ("tools[10].function.name must match [A-Za-z0-9_-]{1,64}",
         "tools[10].name must match [A-Za-z0-9_-]{1,64}",
         "tools[10].name must match [A-Za-z0-9_-]{1,64}"),
        # a parameter's name holding .function., bare or quoted: the client's, kept
        (KEY, KEY, KEY),
        (QUOTED, QUOTED, QUOTED),
    ],
    ids=["parameters", "parameters-path", "name", "bare-key", "quoted-key"],
)  # fmt: skip
def test_tool_paths_are_the_flat_tools_and_nothing_else(
    text: str, messages: str, responses: str
) -> None:
    """Chat's ``tools[i].function.`` paths in the routes' flat tools' names (Messages: the
    schema is ``input_schema``; Responses: ``parameters``), only where the path starts at
    ``tools[i]`` and outside quoted values."""
    out = messages_protocol.renamed(APIError(400, text, param="tools"), ["messages[0]"])
    assert (out.message, out.param) == (messages, "tools")
    out = responses_protocol.renamed(APIError(400, text, param="tools"), ["input[0]"])
    assert (out.message, out.param) == (responses, "tools")
