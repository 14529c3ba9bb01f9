"""Tool calling in DeepSeek-V3.2's format (runtime.tool_calls, runtime.chat_template): the parser on
hand-written model outputs (streamed chunked anyhow equals non-streamed), the prompt rendering, the
forcing grammar, and a round trip with the official openai client through the real tiny engine,
whose random weights emit a call only because the grammar forces it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from server_utils import running_server
from text_copies import Piece

from runtime.chat_template import THINK_END, normalise_messages, render_dsv32, render_tools
from runtime.tool_calls import (
    CALLS_BEGIN,
    CALLS_END,
    ToolCallStream,
    parse_tool_calls,
    plan_tools,
    render_calls,
)

D = "｜DSML｜"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ping", "description": "no arguments"}},
]
NAMES = {"get_weather", "ping"}


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    ps = "\n".join(
        f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>' for k, s, v in params
    )
    return f'<{D}invoke name="{name}">\n{ps}\n</{D}invoke>'


def block(*invokes: str) -> str:
    return f"{CALLS_BEGIN}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


PARIS = invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"))


# ---- the parser --------------------------------------------------------------------------------
def test_parser_text_then_call() -> None:
    content, calls = parse_tool_calls("Let me look.\n\n" + block(PARIS), NAMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


def test_parser_several_calls_and_json_values() -> None:
    nested = invoke("get_weather", ("city", "true", 'a "b" <c>'), ("days", "false", "[1, {}]"))
    content, calls = parse_tool_calls("\n\n" + block(PARIS, invoke("ping"), nested), NAMES)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "ping", "get_weather"]
    assert json.loads(calls[1].arguments) == {}
    assert json.loads(calls[2].arguments) == {"city": 'a "b" <c>', "days": [1, {}]}
    assert len({c.id for c in calls}) == 3


MALFORMED = [
    "\n\n" + CALLS_BEGIN + "\n" + PARIS,  # the block never ends
    "\n\n" + block(PARIS) + "\nand more text",  # text after the block
    "\n\n" + block(invoke("get_weather", ("days", "false", "3 apples"))),  # not JSON
    "\n\n" + block(invoke("delete_all")),  # a function the request did not offer
    "\n\n" + block(PARIS + "stray", invoke("ping")),  # text between calls
    "\n\n" + block(invoke("get_weather", ("days", "false", "3"), ("days", "false", "4"))),
    "\n\n" + block(),  # no calls
    "\n\n" + block(f'<{D}invoke name="ping">\n<{D}parameter name="x">1</{D}parameter>'),
]


@pytest.mark.parametrize("text", MALFORMED, ids=range(len(MALFORMED)))
def test_parser_malformed_output_is_plain_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])
    assert streamed(text, 3) == (text, [])


def test_parser_no_block_is_content() -> None:
    assert parse_tool_calls("just < text >\n", NAMES) == ("just < text >\n", [])


def streamed(text: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    s = ToolCallStream(NAMES)
    shown = "".join(s.feed(text[i : i + size]) for i in range(0, len(text), size))
    rest, calls = s.finish()
    return (shown + rest) or None, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_streamed_equals_non_streamed(size: int) -> None:
    for text in [
        "Hi <｜DSML｜ there\n\n" + block(PARIS, invoke("ping")),
        "ends with a partial marker <｜DS",
        "trailing spaces   \n",
        *MALFORMED,
    ]:
        content, calls = parse_tool_calls(text, NAMES)
        assert streamed(text, size) == (content, [(c.name, c.arguments) for c in calls])


def test_stream_holds_back_the_block() -> None:
    s = ToolCallStream(NAMES)
    assert s.feed("Hello ") == "Hello"  # the space might precede the block
    assert s.feed("world\n\n<｜DS") == " world"
    assert s.feed("ML｜function_calls>\n") == ""
    assert s.feed(PARIS + "\n" + CALLS_END) == ""
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]


def test_stream_feeds_in_time_linear_in_the_text() -> None:
    # words, runs of held-back whitespace and partial opening tags that come to nothing, then
    # the block: each feed may look at its delta and the held-back partial tag only
    words = ["Hi", " there", "\n\n", "  ", "<｜DS", "ML｜", "x", " "]
    deltas = [Piece(words[i % len(words)]) for i in range(3000)]
    deltas += [Piece("\n\n" + CALLS_BEGIN[:7]), Piece(CALLS_BEGIN[7:] + "\n" + PARIS)]
    deltas += [Piece(c) for c in "\n" + CALLS_END]  # (inside the block too)
    text = "".join(deltas)
    Piece.copied = 0
    s = ToolCallStream(NAMES)
    shown = "".join(s.feed(d) for d in deltas)
    rest, calls = s.finish()
    content, want = parse_tool_calls(text, NAMES)
    assert shown + rest == content and [c.name for c in calls] == [c.name for c in want]
    # text += delta copied the text so far per delta: ~ 3000**2 / 2 * 4 characters
    assert Piece.copied <= len(text) + len(deltas) * len(CALLS_BEGIN), Piece.copied


# ---- the prompt --------------------------------------------------------------------------------
def test_render_conversation_with_calls_and_results() -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"days": 2}'}}
    msgs = normalise_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call, call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "a"},
            {"role": "tool", "content": "rain", "tool_call_id": "b"},
        ]
    )
    fns = [t["function"] for t in TOOLS]
    got = render_dsv32(msgs, fns, "<B>", "<E>")
    days = invoke("get_weather", ("days", "false", "2"))
    want = (
        "<B>Be brief.\n\n"
        + render_tools(fns)
        + "<｜User｜>Weather?<｜Assistant｜>"
        + THINK_END
        + "\n\n"
        + block(days, days)
        + "<E>"
        + "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>\n"
        "</function_results>\n\n" + THINK_END
    )
    assert got == want
    assert '"name": "get_weather"' in render_tools(fns) and "<functions>" in render_tools(fns)
    assert render_calls([("get_weather", {"days": 2})]) == block(days)


def _call(cid: str, days: int) -> dict:
    fn = {"name": "get_weather", "arguments": json.dumps({"days": days})}
    return {"id": cid, "type": "function", "function": fn}


def _answers(*results: tuple[str, str]) -> list:
    """A question, two calls (call_A, call_B) and the tool messages ``(tool_call_id, content)``."""
    calls = [_call("call_A", 1), _call("call_B", 2)]
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": cid, "content": c} for cid, c in results),
    ]


def test_render_pairs_results_with_calls_by_id() -> None:
    """The model reads results by position: results sent in another order than the calls (OpenAI
    matches them by tool_call_id) are rendered in the calls' order."""

    def render(*results: tuple[str, str]) -> str:
        return render_dsv32(normalise_messages(_answers(*results)), None, "", "")

    swapped = render(("call_B", "B2"), ("call_A", "A1"))
    assert swapped == render(("call_A", "A1"), ("call_B", "B2"))
    assert "<result>A1</result>\n<result>B2</result>" in swapped, swapped


@pytest.mark.parametrize(
    "msgs, match",
    [
        (
            _answers(("call_A", "x"), ("call_C", "y")),
            r"messages\[3\].tool_call_id 'call_C' matches none",
        ),
        (
            _answers(("call_B", "x"), ("call_B", "y")),
            r"messages\[3\].tool_call_id 'call_B': messages\[2\]",
        ),
        ([{"role": "tool", "content": "x"}], "must follow an assistant's tool_calls"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
            + [{"role": "tool", "content": "x"}],
            "must follow",
        ),
        ([{"role": "robot", "content": "x"}], r"role must be one of .*, got 'robot'$"),
        # a role absent or no string, in JSON's words (it was "got None", "got 5")
        ([{"content": "x"}], r"^messages\[0\]\.role must be one of .*, got no role$"),
        ([{"role": None, "content": "x"}], r"^messages\[0\]\.role must be one of .*, got null$"),
        ([{"role": 5, "content": "x"}], r"^messages\[0\]\.role must be one of .*, got integer$"),
        ([{"role": "user", "content": None}], r"content must be a string .*, got null$"),
        ([{"role": "user"}], r"content must be a string .*, got no content$"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "content parts must be"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            "not JSON",
        ),
        # a list of conversations (vLLM's LLM.chat batches them) to LLM.chat: it takes one
        (
            [[{"role": "user", "content": "q"}]],
            r"^messages\[0\] must be a message \(an object\), got array$",
        ),
        ([None], r"^messages\[0\] must be a message \(an object\), got null$"),
    ],
)
def test_render_bad_messages_name_the_problem(msgs: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_dsv32(normalise_messages(msgs), None, "", "")


@pytest.mark.parametrize("role, got", [(None, "null"), (5, "integer"), ("bob", "'bob'")])
def test_render_names_a_bad_role_in_json_words(role: object, got: str) -> None:
    # render_dsv32 called with messages normalise_messages did not check (it was "got None",
    # "got 5")
    msgs = [{"role": "system", "content": "s"}, {"role": role, "content": "x"}]
    fns = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.role must be one of .*, got {got}$"):
        render_dsv32(msgs, fns, "", "")


# ---- the plan and the grammar ------------------------------------------------------------------
def _fn(parameters: dict) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize(
    "tools, choice, match",
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not one of the request"),
        (None, "required", "needs at least one tool"),
        (TOOLS, "sometimes", "tool_choice must be"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "must match"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, None, "used twice"),
        ([{"type": "retrieval"}], None, "tools\\[0\\]"),
        (TOOLS, {"type": "function", "function": {"name": ["f"]}}, "must be a string"),
        (_fn({"type": "object", "properties": {}, "required": [["a"]]}), "required", "list of"),
        (_fn({"type": "object", "properties": {}, "required": 5}), "required", "list of"),
        (
            _fn({"type": "object", "properties": {"a": {"type": "string", "minLength": [1]}}}),
            "required",
            "a.minLength",
        ),  # fmt: skip
        (
            _fn({"type": "object", "properties": {"a": {"type": "string", "maxLength": 1e999}}}),
            "required",
            "a.maxLength",
        ),  # fmt: skip
        # the grammar's regex would fail on it, quoting the grammar and naming tool_choice
        (
            _fn(
                {
                    "type": "object",
                    "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 1}},
                }
            ),
            "required",
            "a.minLength 3 is greater than maxLength 1",
        ),  # fmt: skip
        # a forced call wrote {} for a required name without a schema (breaking the tool's own
        # schema); a property schema 5 was "any JSON"; "objekt" was never read
        (_fn({"type": "object", "properties": {}, "required": ["zz"]}), "required", "'zz' is not"),
        (
            _fn({"type": "object", "properties": {}, "required": ["zz"]}),
            {"type": "function", "function": {"name": "f"}},
            "'zz' is not",
        ),  # fmt: skip
        (_fn({"type": "object", "properties": {"x": 5}}), "required", "parameter 'x' must be"),
        (_fn({"type": "objekt"}), None, "parameters must be a JSON schema object"),
    ],
)
def test_plan_refuses_bad_tools(tools: object, choice: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_tools(tools, choice, None)


def test_plan_modes() -> None:
    assert plan_tools(TOOLS, "none", None) is None and plan_tools(None, None, None) is None
    # auto leaves a required name properties does not declare to the model, as vLLM does
    assert plan_tools(_fn({"type": "object", "required": ["zz"]}), None, None) is not None
    auto = plan_tools(TOOLS, None, None)
    assert auto is not None and auto.grammar_text is None and auto.names == NAMES


def test_grammar_accepts_the_format_and_nothing_else() -> None:
    ll = pytest.importorskip("llguidance")
    from engine_records import tiny

    from runtime.structured_output import StructuredOutput, lark_grammar

    _, tok = tiny("cpu")
    so = StructuredOutput(tok, tok.vocab_size, tok.eos_token_id)
    named = {"type": "function", "function": {"name": "get_weather"}}

    def accepts(choice: object, parallel: bool | None, text: str) -> bool:
        plan = plan_tools(TOOLS, choice, parallel)
        assert plan is not None and plan.grammar_text is not None
        m = ll.LLMatcher(so.lltokenizer(), lark_grammar(plan.grammar_text), log_level=0)
        return m.consume_tokens(tok.encode(text, add_bos=False)) and m.is_accepting()

    unit = invoke(
        "get_weather", ("city", "true", "Rome"), ("unit", "true", "c"), ("days", "false", "7")
    )
    two = "\n\n" + block(PARIS, invoke("ping"))
    assert accepts("required", None, two)
    assert accepts(named, None, "\n\n" + block(unit))
    assert not accepts(named, None, two)  # ping is not the named function
    assert accepts("required", None, "\n\n" + block(unit, unit))
    assert not accepts(named, None, "\n\n" + block(unit, unit))  # named: exactly one call
    assert not accepts("required", False, two)  # parallel_tool_calls false: one call
    long = "\n\n" + block(PARIS.replace("Paris", "Parisian"))  # over maxLength 6
    assert accepts(named, None, "\n\n" + block(PARIS)) and not accepts(named, None, long)
    assert not accepts(named, None, "\n\n" + block(unit.replace(">7<", ">9<")))  # maximum 7


# what openai.pydantic_function_tool writes for a nested model and an enum: refs into $defs
REF_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "$defs": {
                "Loc": {
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "type": "object",
                    "additionalProperties": False,
                },
                "Unit": {"enum": ["c", "f"], "title": "Unit", "type": "string"},
            },
            "properties": {"loc": {"$ref": "#/$defs/Loc"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["loc", "unit"],
            "type": "object",
        },
    },
}


def test_grammar_follows_refs_into_defs() -> None:
    """Each %json value is compiled alone, so it carries the $defs its refs need; an enum behind
    a ref is written as a string, as an inline one is."""
    ll = pytest.importorskip("llguidance")
    from engine_records import tiny

    from runtime.structured_output import StructuredOutput, lark_grammar

    _, tok = tiny("cpu")
    so = StructuredOutput(tok, tok.vocab_size, tok.eos_token_id)
    plan = plan_tools([REF_TOOL], "required", None)
    assert plan is not None and plan.grammar_text is not None
    grammar = lark_grammar(plan.grammar_text)
    so.check(grammar)  # the engine's compile: "Pointer '/$defs/Loc' does not exist" before

    def accepts(*params: tuple[str, str, str]) -> bool:
        m = ll.LLMatcher(so.lltokenizer(), grammar, log_level=0)
        text = "\n\n" + block(invoke("weather", *params))
        return m.consume_tokens(tok.encode(text, add_bos=False)) and m.is_accepting()

    loc = ("loc", "false", '{"city":"Rome"}')
    assert accepts(loc, ("unit", "true", "c"))
    assert not accepts(loc, ("unit", "true", "k"))  # not one of the enum's values
    assert not accepts(("loc", "false", '{"town":"Rome"}'), ("unit", "true", "c"))


# ---- through the real engine with the openai client --------------------------------------------
@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    pytest.importorskip("llguidance")
    from echo_compile.llm import LLM
    from runtime.async_engine import AsyncEngine
    from runtime.server import build_app

    llm = LLM(
        "tiny", device="cpu", compile=False, offload=True, max_batch=4, host_tokens=64 * 64,
        gpu_tokens=4 * 32, max_model_len=2048, progress=False,
    )  # fmt: skip
    engine = AsyncEngine(llm.engine)
    try:
        with running_server(build_app(engine, "tiny")) as base:
            yield base
    finally:
        engine.shutdown()


def _weather_args(call: object) -> dict:
    """The call's arguments, checked against SCHEMA by hand (no jsonschema dependency)."""
    args = json.loads(call.function.arguments)  # type: ignore[attr-defined]
    assert isinstance(args, dict) and {"city", "days"} <= set(args) <= {"city", "unit", "days"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 6
    assert type(args["days"]) is int and 1 <= args["days"] <= 7
    assert args.get("unit", "c") in ("c", "f")
    return args


NAMED = {"type": "function", "function": {"name": "get_weather"}}


# NOTE: each DSML tag is ~25 byte-level tokens of the tiny tokenizer, so one forced call is ~150
# decode steps: one mode per case keeps this file fast. SCHEMA's strings are bounded (maxLength,
# enum): a free string the random weights would write until max_tokens (docs/server.md, tools).
@pytest.mark.parametrize(
    "stream, choice", [(False, NAMED), (True, "required")], ids=["named", "required-stream"]
)
def test_forced_tool_call_round_trip(url: str, stream: bool, choice: object) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="tiny", messages=msgs, tools=TOOLS[:1], max_tokens=300, seed=3)
    kw.update(tool_choice=choice, parallel_tool_calls=False)
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [t for d in deltas for t in (d.tool_calls or [])]
        content = "".join(d.content or "" for d in deltas)
        reason = chunks[-1].choices[0].finish_reason
        assert [t.index for t in calls] == [0] and calls[0].id.startswith("call_")
    else:
        c = client.chat.completions.create(**kw).choices[0]
        calls, content, reason = c.message.tool_calls, c.message.content, c.finish_reason
    assert reason == "tool_calls" and not content and len(calls) == 1, (content, calls)
    assert calls[0].function.name == "get_weather"
    args = _weather_args(calls[0])
    # the round trip: the call and its result go back into the conversation
    back = [
        *msgs,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear"}'},
    ]
    r = client.chat.completions.create(model="tiny", messages=back, tools=TOOLS, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    first = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=1)
    # the tools block, the call and its result are in the prompt
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 100


def test_tool_requests_refused_with_the_param(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    unknown = {"type": "function", "function": {"name": "x"}}
    json_fmt = {"type": "json_object"}
    dangling = _fn({"type": "object", "properties": {"a": {"$ref": "#/$defs/Gone"}}})[0]
    bad = [
        (dict(tools=TOOLS, tool_choice=unknown), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools"),
        (dict(tools=TOOLS, tool_choice="required", response_format=json_fmt), "tool_choice"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages"),
        (dict(tools=TOOLS, tool_choice="required", extra_body={"min_tokens": 2}), "min_tokens"),
        (dict(tools=[*TOOLS, dangling], tool_choice="required"), "tools"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": "tiny", "messages": msgs, **extra})
        assert e.value.body["param"] == param, e.value.body
    # the bad schema is named, and the grammar it sits in is not quoted
    message = e.value.body["message"]
    assert message.startswith("tools[2].function.parameters.properties.a: "), message
    assert "%json" not in message, message
    # auto: the random model writes text (a DSML block takes far more than 4 tokens)
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == 4 or c.finish_reason == "stop"
    none = client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert none.usage.prompt_tokens < r.usage.prompt_tokens  # none: no tools block


def test_developer_role_and_content_parts_through_the_server(url: str) -> None:
    """A developer message (V3.2 renders it as a user turn introducing the words) and a list of
    text parts, through the openai client and /tokenize + /detokenize (special tokens kept): the
    same prompt, rendered as V3.2 does."""
    import httpx

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": [{"type": "text", "text": "Paris"},
                                          {"type": "text", "text": "weather?"}]},
    ]  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length")
    t = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=30).json()
    assert t["count"] == r.usage.prompt_tokens
    d = httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}, timeout=30)
    text = d.json()["prompt"]
    assert (
        "You are terse.<｜User｜>\n\n# The user's message is: Paris\nweather?<｜Assistant｜>"
        in (text)
    ), text


def test_tokenize_renders_tools_as_the_chat_does(url: str) -> None:
    """/tokenize of messages with tools counts the tools block, as the chat's prompt has it
    (vLLM's chat tokenize takes tools); tool_choice none offers none, as in the chat."""
    import httpx

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    for choice in (None, "none"):
        r = client.chat.completions.create(
            model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=1
        )
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": choice}
        t = httpx.post(url + "/tokenize", json=body, timeout=30).json()
        assert t["count"] == r.usage.prompt_tokens, (choice, t)
    bad = httpx.post(url + "/tokenize", json={"prompt": "hi", "tools": TOOLS}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text
