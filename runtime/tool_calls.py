"""Tool calling in DeepSeek-V3.2's format: the request's ``tools`` / ``tool_choice``, the DSML
tool-call block (rendered into prompts, parsed back out of the model's text, streamed), and the
llguidance grammar that forces a call for ``tool_choice`` ``required`` or a named function.

The model writes its calls after its reply text as one block (the tags are plain text to the
tokenizer, not special tokens)::

    \\n\\n<｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="true"`` values are raw text, the others JSON. An output whose block is incomplete or
does not parse (or calls a function the request did not offer) is returned as plain content, so a
client never receives a half-parsed call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.json_words import field_value
from runtime.tokenizer import lone_surrogate

DSML = "｜DSML｜"
CALLS_BEGIN, CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE_END, PARAM_END = f"</{DSML}invoke>", f"</{DSML}parameter>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_INVOKE = re.compile(
    re.escape(f"<{DSML}invoke") + r' name="([^"]*)">(.*?)' + re.escape(INVOKE_END), re.S
)
_PARAM = re.compile(
    re.escape(f"<{DSML}parameter")
    + r' name="([^"]*)" string="(true|false)">(.*?)'
    + re.escape(PARAM_END),
    re.S,
)


def _invoke_open(name: str) -> str:
    return f'<{DSML}invoke name="{name}">'


def _param_open(key: str, is_str: bool) -> str:
    return f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as the OpenAI API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


# ---- the request's tools -----------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: the functions offered in the prompt, and the grammar
    that forces a call (None for ``auto``: the model chooses)."""

    functions: list[dict[str, Any]]
    grammar_text: str | None  # a Lark grammar (llguidance's syntax)
    parallel: bool
    # the schema of each value the grammar writes as JSON: (function, parameter) -> its schema
    json_values: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


def plan_tools(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The plan of ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (None: no tools, or
    ``tool_choice: "none"``, so the prompt offers none and the output is plain text). Raises
    ``ValueError("<param>: <problem>")``."""
    functions = functions_of(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError('tool_choice: an object must be {"type": "function", "function": ...}')
        name = fn.get("name")
        if not isinstance(name, str):
            got = field_value(fn, "name")
            raise ValueError(f"tool_choice: function.name must be a string, got {got}")
        if name not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice: {name!r} is not one of the request's tools")
        forced = [f for f in functions if f["name"] == name]
    elif choice in ("none", "auto", "required"):
        forced = functions if choice == "required" else None
    else:
        raise ValueError(f"tool_choice must be none, auto, required or a function, got {choice!r}")
    if choice == "none" or not functions:
        if forced is not None:
            raise ValueError("tool_choice: required needs at least one tool")
        return None
    # a named function is called exactly once (OpenAI's "forced function"; vLLM's too)
    multi = parallel is not False and not isinstance(choice, dict)
    if forced is None:
        return ToolPlan(functions, None, multi)
    for f in forced:  # (auto leaves such a tool to the model, as vLLM does)
        params = f.get("parameters", {})
        declared = params.get("properties", {})
        # a forced call writes the declared properties only: a required name without one was a
        # call that broke the tool's own schema ({} for required ["zz"])
        if missing := [r for r in params.get("required", []) if r not in declared]:
            i = functions.index(f)
            raise ValueError(f"tools[{i}]: required parameter {missing[0]!r} is not in properties")
    json_values: dict[tuple[str, str], dict[str, Any]] = {}
    return ToolPlan(functions, call_grammar(forced, multi, json_values), multi, json_values)


def functions_of(tools: Any) -> list[dict[str, Any]]:
    """The ``function`` objects of OpenAI ``tools``, checked (``ValueError`` naming the entry)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f'tools[{i}]: must be {{"type": "function", "function": {{...}}}}')
        # (found only in the rendered prompt, it named the conversation at an index of text the
        # caller never wrote)
        if lone_surrogate(json.dumps(fn, ensure_ascii=False)) is not None:
            raise ValueError(f"tools[{i}] contains a lone UTF-16 surrogate")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}")
        if name in seen:
            raise ValueError(f"tools[{i}]: the function name {name!r} is used twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if (
            not isinstance(params, dict)
            or not isinstance(params.get("properties", {}), dict)
            or params.get("type", "object") != "object"  # (arguments are an object's fields)
        ):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        for key in params.get("properties", {}):
            if not key or any(c in key for c in '"<>\n'):
                raise ValueError(f"tools[{i}]: parameter name {key!r} cannot be written in DSML")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"tools[{i}].function.parameters.required must be a list of names")
        for key, sub in params.get("properties", {}).items():
            if not isinstance(sub, dict):  # (5 was read as "any JSON value")
                raise ValueError(f"tools[{i}]: the schema of parameter {key!r} must be an object")
            for bound in ("minLength", "maxLength"):
                v = sub.get(bound) if isinstance(sub, dict) else None
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(
                        f"tools[{i}]: {key}.{bound} must be a non-negative integer, got {v!r}"
                    )
            # (checked here, not left to the grammar: its error quotes the whole grammar and names
            # tool_choice, not the tool)
            lo, hi = (
                sub.get(b) if isinstance(sub, dict) else None for b in ("minLength", "maxLength")
            )
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"tools[{i}]: {key}.minLength {lo} is greater than maxLength {hi}")
        seen.add(name)
        out.append(fn)
    return out


# ---- rendering and parsing ---------------------------------------------------------------------
def render_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The DSML block of ``(name, arguments)`` calls (an assistant message's ``tool_calls``)."""
    invokes = []
    for name, args in calls:
        params = "\n".join(
            _param_open(k, isinstance(v, str))
            + (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
            + PARAM_END
            for k, v in args.items()
        )
        invokes.append(f"{_invoke_open(name)}\n{params}\n{INVOKE_END}")
    return CALLS_BEGIN + "\n" + "\n".join(invokes) + "\n" + CALLS_END


class _Malformed(Exception):
    pass


def parse_tool_calls(text: str, names: set[str] | None) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a model's output: the text before the first DSML block (trailing
    whitespace dropped; None when empty and there are calls) and the block's calls. Without a
    block, or when it is malformed (see the module docstring), ``(text, [])``. ``names``: the
    functions offered (None: any)."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return text, []
    try:
        calls = _parse_block(text[start:], names)
    except _Malformed:
        return text, []
    return text[:start].rstrip() or None, calls


def _parse_block(block: str, names: set[str] | None) -> list[ToolCall]:
    end = block.find(CALLS_END)
    if end < 0 or block[end + len(CALLS_END) :].strip():
        raise _Malformed  # unfinished, or text after the block
    body = block[len(CALLS_BEGIN) : end]
    calls, pos = [], 0
    for inv in _INVOKE.finditer(body):
        name, inner = inv.group(1), inv.group(2)
        if body[pos : inv.start()].strip() or (names is not None and name not in names):
            raise _Malformed
        pos = inv.end()
        args: dict[str, Any] = {}
        ppos = 0
        for p in _PARAM.finditer(inner):
            key, is_str, raw = p.groups()
            if inner[ppos : p.start()].strip() or key in args:
                raise _Malformed
            ppos = p.end()
            try:
                args[key] = raw if is_str == "true" else json.loads(raw)
            except json.JSONDecodeError as e:
                raise _Malformed from e
        if inner[ppos:].strip():
            raise _Malformed
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    if not calls or body[pos:].strip():
        raise _Malformed
    return calls


class ToolCallStream:
    """The streamed form of ``parse_tool_calls``: ``feed`` returns the content that is safe to
    show (text that could start the DSML block, and trailing whitespace, are held back); once the
    block starts nothing more is shown until ``finish``, which returns the rest of the content and
    the calls. Content shown plus ``finish``'s equals the non-streamed content, calls likewise.

    NOTE: a feed costs its delta plus the held-back tail that could start the block, never the
    text so far (a reply of 100K tokens rescanned per delta took seconds on the event loop): the
    block can only start in that tail or the delta, and held-back whitespace is kept as pieces."""

    def __init__(self, names: set[str] | None) -> None:
        self.names, self.sent, self.in_block = names, 0, False
        self._pieces: list[str] = []  # the text so far, joined by ``finish`` (or ``text``)
        self._space: list[str] = []  # held back: whitespace that might precede the block
        self._partial = ""  # held back after it: a proper prefix of the block's opening tag

    @property
    def text(self) -> str:
        """Everything fed so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def feed(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        if self.in_block:
            return ""
        # (an opening tag before this delta would have started the block already, so one that
        # ends in it starts in the held-back partial tag)
        tail = self._partial + delta
        start = tail.find(CALLS_BEGIN)
        if start >= 0:
            self.in_block, self._partial = True, ""
            return self._show(tail[:start])
        keep = _partial_marker(tail)
        self._partial = tail[len(tail) - keep :]
        return self._show(tail[: len(tail) - keep])

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_tool_calls(self.text, self.names)
        rest = (content or "")[self.sent :]
        self.sent = len(content or "")
        return rest, calls

    def _show(self, visible: str) -> str:
        """The held-back whitespace and ``visible`` up to their trailing whitespace, which is
        held back instead."""
        shown = visible.rstrip()
        if not shown:
            self._space.append(visible)
            return ""
        out = "".join(self._space) + shown
        self._space = [visible[len(shown) :]]
        self.sent += len(out)
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``CALLS_BEGIN``."""
    for n in range(min(len(CALLS_BEGIN) - 1, len(text)), 0, -1):
        if text.endswith(CALLS_BEGIN[:n]):
            return n
    return 0


# ---- the grammar that forces a call ------------------------------------------------------------
_PLAIN_STRING_KEYS = {"type", "description", "title", "minLength", "maxLength"}
_DEFS = ("$defs", "definitions")  # where a schema's "$ref"s point (pydantic writes "$defs")


def call_grammar(
    functions: list[dict[str, Any]],
    multi: bool,
    json_values: dict[tuple[str, str], dict[str, Any]] | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) of a DSML block calling ``functions``: one call, or
    one or more when ``multi``. Each call writes the function's parameters in the schema's order,
    the required ones always, and its values follow their schemas: plain strings as raw text
    (``string="true"``; no ``<`` in them), enums of strings as one of their values, everything
    else as compact JSON (``%json``, so the arguments validate against the schema; each such
    schema, with the parameters' ``$defs`` its refs need, goes into ``json_values``)."""
    rules, alts = [], []
    for k, fn in enumerate(functions):
        schema = fn.get("parameters") or {}
        required = set(schema.get("required", []))
        defs = {d: schema[d] for d in _DEFS if isinstance(schema.get(d), dict)}
        parts = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            rule = f"p{k}_{j}"
            sub = sub if isinstance(sub, dict) else {}
            value, json_schema = _value_rule(f"{rule}v", sub, defs, rules)
            is_str = json_schema is None
            if json_values is not None and json_schema is not None:
                json_values[fn["name"], key] = json_schema
            rules.append(
                f"{rule}: {_lit(_param_open(key, is_str))} {value} {_lit(PARAM_END + chr(10))}"
            )
            parts.append(rule if key in required else f"{rule}?")
        body = " ".join(parts) if parts else _lit("\n")  # V3.2 writes "\n\n" for no arguments
        head, tail = _lit(_invoke_open(fn["name"]) + "\n"), _lit(INVOKE_END + "\n")
        rules.append(f"inv{k}: {head} {body} {tail}")
        alts.append(f"inv{k}")
    rules.append("inv: " + " | ".join(alts))
    calls = "inv+" if multi else "inv"
    start = f"start: {_lit(chr(10) * 2 + CALLS_BEGIN + chr(10))} {calls} {_lit(CALLS_END)}"
    return "\n".join([start, *rules])


def _value_rule(
    name: str, sub: dict[str, Any], defs: dict[str, Any], rules: list[str]
) -> tuple[str, dict[str, Any] | None]:
    """The grammar of one parameter value, adding the rules it needs: ``(rule, None)`` for a value
    written as a string, ``(rule, its JSON schema)`` for one written as JSON. ``defs``: the
    parameters schema's ``$defs`` / ``definitions``, which a ``%json`` schema is compiled alone
    (its refs resolve against its own root) and so carries along."""
    json_schema = {**sub, **_merged_defs(sub, defs)}
    sub = _deref(sub, defs)
    enum = sub.get("enum")
    if (
        sub.get("type") == "string"
        and isinstance(enum, list)
        and enum
        and all(isinstance(e, str) and "<" not in e for e in enum)
    ):
        return "(" + " | ".join(_lit(e) for e in enum) + ")", None
    if sub.get("type") == "string" and set(sub) <= _PLAIN_STRING_KEYS:
        lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
        rules.append(f"{name.upper()}: /[^<]{{{lo},{'' if hi is None else int(hi)}}}/")
        return name.upper(), None
    # NOTE: compact JSON, as response_format's: free whitespace lets a weak model pad forever
    compact = {**json_schema, "x-guidance": {"whitespace_flexible": False}}
    rules.append(f"{name}: %json {json.dumps(compact, ensure_ascii=False)}")
    return name, compact


def _merged_defs(sub: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``defs`` with ``sub``'s own ``$defs`` / ``definitions`` over them (none: ``{}``)."""
    own = {d: sub[d] for d in _DEFS if isinstance(sub.get(d), dict)}
    return {d: {**defs.get(d, {}), **own.get(d, {})} for d in {*defs, *own}}


def _deref(sub: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``sub`` with a local ``$ref`` (``#/$defs/Name``, ``#/definitions/Name``) followed, so the
    string shortcuts see the schema it names (a pydantic enum is one); ``sub`` itself when the ref
    has sibling constraints, points elsewhere, or loops."""
    seen: set[str] = set()
    while isinstance(ref := sub.get("$ref"), str) and set(sub) <= {"$ref", "description", "title"}:
        where, _, name = ref.removeprefix("#/").partition("/")
        target = defs.get(where, {}).get(name.replace("~1", "/").replace("~0", "~"))
        if ref in seen or not isinstance(target, dict):
            return sub
        seen.add(ref)
        sub = target
    return sub


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a Lark string literal: JSON's escapes
