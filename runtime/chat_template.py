"""DeepSeek-V3.2's own chat encoding, in its "chat" (non-thinking) and "thinking" modes, for
conversations the checkpoint's jinja template cannot render: thinking mode, tools, ``tool``
results, assistant ``tool_calls``, ``developer`` (and every conversation of a checkpoint without
one); ``render_chat`` picks between the two.

DeepSeek-V3.2 ships no jinja template for these; its release describes the prompt in Python
(``encoding/encoding_dsv32.py``). The layout rendered here follows it:

    <bos>{system}\\n\\n{tools block}
    <｜User｜>{user}<｜Assistant｜></think>{assistant}\\n\\n{DSML tool calls}<eos>
    \\n\\n<function_results>\\n<result>{tool}</result>...\\n</function_results>\\n\\n</think>

so that a tool result opens the assistant's next turn at once (no new ``<｜Assistant｜>``).

Thinking mode (``chat_template_kwargs`` ``thinking`` / ``enable_thinking``) differs only after the
last user (or developer) message: that turn opens ``<think>`` instead of closing it, the
assistant messages after it carry their reasoning (``{reasoning}</think>{content}...``, and must
have reasoning or tool calls), and their tool results open ``<think>`` again. Earlier turns are
rendered as in chat mode, their reasoning dropped.

The tool calls use the DSML tags of ``runtime.tool_calls`` (one source for rendering, parsing and
the grammar). NOTE: the instruction paragraph of the tools block is our wording of the release's
(the tags, their order and the ``string`` attribute rule are the model's format, kept exactly).
"""

from __future__ import annotations

import json
from typing import Any

from runtime.json_words import field_value, json_type, value_named
from runtime.tokenizer import Tokenizer, lone_surrogate
from runtime.tool_calls import render_calls

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK_START = "<think>"  # thinking mode: the reply starts with the reasoning
THINK_END = "</think>"  # chat mode: the reasoning is closed before the reply starts
THINKING_KEYS = ("thinking", "enable_thinking")  # chat_template_kwargs, as vLLM reads them
ROLES = ("system", "developer", "user", "assistant", "tool")

TOOLS_BLOCK = """## Tools

You can call the tools below to answer the user's question. To call them, write a \
"<｜DSML｜function_calls>" block as part of your reply, like this:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>

Write string values as they are, without quotes or escaping, and set string="true"; write \
numbers, booleans, arrays and objects as JSON and set string="false".

The available functions, as JSON schemas:
<functions>
{schemas}
</functions>
"""


def render_tools(functions: list[dict[str, Any]]) -> str:
    """The tools block of the system prompt: one JSON schema (the OpenAI ``function`` object) a
    line."""
    schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return TOOLS_BLOCK.format(schemas=schemas)


def render_dsv32(
    messages: list[dict[str, Any]],
    functions: list[dict[str, Any]] | None,
    bos: str,
    eos: str,
    thinking: bool = False,
    add_generation: bool = True,
    continue_final: bool = False,
) -> str:
    """The prompt of ``messages`` (normalised: ``role``, ``content`` str, ``reasoning`` str,
    assistant ``tool_calls`` as ``[(name, arguments dict)]``) with ``functions`` offered, in
    thinking or chat mode, ending where the assistant's reply starts (the reply's opening:
    ``<｜Assistant｜></think>`` or ``<think>``, after tool results ``\n\n</think>``); without
    that opening when not ``add_generation``. ``continue_final``: the last message (an assistant
    message without tool calls: ``render_chat`` checks it) is left open after that opening, its
    reasoning and content written as far as they go (``<think>{reasoning}`` while it has no
    content, else ``{reasoning}</think>{content}``; chat mode drops the reasoning), no
    ``<eos>``, for the model to continue. Raises ``ValueError`` naming the first bad message."""
    final = messages[-1] if continue_final else None
    messages = messages[:-1] if continue_final else messages
    out = [bos]
    first = 0  # the index of messages[0] in the caller's list (a system prompt merged away)
    if functions:
        has_system = bool(messages) and messages[0]["role"] == "system"
        system = messages[0]["content"] if has_system else ""
        out.append(system + ("\n\n" if system else "") + render_tools(functions))
        messages, first = (messages[1:], 1) if has_system else (messages, 0)
    # thinking mode only changes the turn after the last user message (the reference's rule)
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")),
                    default=-1)  # fmt: skip

    def opening(i: int) -> str:  # how the assistant's turn after message i starts
        return THINK_START if thinking and i >= last_user else THINK_END

    open_turn = False  # whether the text so far ends where an assistant reply starts
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        prev = messages[i - 1]["role"] if i else None
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if role == "system":
            out.append(content)
            open_turn = False
        elif role in ("user", "developer"):
            # V3.2 wraps a developer message as a user turn introducing the user's words
            text = content if role == "user" else f"\n\n# The user's message is: {content}"
            out += [f"{USER}{text}", f"{ASSISTANT}{opening(i)}"]
            open_turn = True
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if thinking and i > last_user:
                if not (m.get("reasoning") or calls):
                    msg = (
                        f"messages[{i + first}]: in thinking mode an assistant message after the "
                        "last user message needs reasoning_content or tool_calls"
                    )
                    raise ValueError(msg)
                out.append(m.get("reasoning", "") + THINK_END)
            out.append(content + (f"\n\n{render_calls(calls)}" if calls else "") + eos)
            open_turn = False
        elif role == "tool":
            if prev not in ("assistant", "tool") or not _after_calls(messages, i):
                msg = f"messages[{i + first}]: a tool message must follow an assistant's tool_calls"
                raise ValueError(msg)
            if prev == "assistant":
                out.append("\n\n<function_results>")
            out.append(f"\n<result>{content}</result>")
            if nxt != "tool":
                out += ["\n</function_results>", f"\n\n{opening(i)}"]
                open_turn = True
        else:
            got = field_value(m, "role")
            msg = f"messages[{i + first}].role must be one of {', '.join(ROLES)}, got {got}"
            raise ValueError(msg)
    if not open_turn:  # e.g. a system prompt alone: open the assistant's turn
        out.append(f"{ASSISTANT}{opening(len(messages))}")
    # out[-1] is now the reply's opening
    if final is not None:
        if opening(len(messages)) == THINK_START:  # the reasoning is open, and stays open
            reasoning, content = final["reasoning"], final["content"]
            out.append(reasoning + (THINK_END + content if content else ""))
        else:
            out.append(final["content"])
    elif not add_generation:
        out.pop()
    return "".join(out)


def _after_calls(messages: list[dict[str, Any]], i: int) -> bool:
    """Whether the run of tool messages ending at ``i`` answers at most as many calls as the
    assistant message before the run made."""
    j = i
    while j > 0 and messages[j - 1]["role"] == "tool":
        j -= 1
    if j == 0 or messages[j - 1]["role"] != "assistant":
        return False
    return i - j < len(messages[j - 1].get("tool_calls") or [])


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as ``render_dsv32`` (and the jinja templates) read them: content a
    string (a list of text parts joined by newlines; an assistant's null content is ""), an
    assistant's ``tool_calls`` as ``[(name, arguments dict)]`` and its ``reasoning`` (its
    ``reasoning_content``, DeepSeek's name, or ``reasoning``, vLLM's; "" when none), and the
    tool results after them in the calls' order (``_in_call_order``). Raises ``ValueError``
    naming the first bad message."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            # (e.g. a conversation nested one list too deep: it was an AttributeError on
            # list.get)
            raise ValueError(f"messages[{i}] must be a message (an object), got {json_type(m)}")
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in ROLES:
            got = field_value(m, "role")
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {got}")
        if isinstance(content, list):
            texts = [p.get("text") if isinstance(p, dict) else None for p in content]
            kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
            if any(
                k != "text" or not isinstance(t, str) for k, t in zip(kinds, texts, strict=True)
            ):
                msg = f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}"
                raise ValueError(msg)
            for t in texts:
                _no_lone_surrogate(t, i)  # type: ignore[arg-type]
            content = "\n".join(texts)  # type: ignore[arg-type]
        elif isinstance(content, str):
            _no_lone_surrogate(content, i)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            got = field_value(m, "content")
            msg = f"messages[{i}].content must be a string or a list of text parts, got {got}"
            raise ValueError(msg)
        if calls and role != "assistant":
            raise ValueError(f"messages[{i}]: only an assistant message has tool_calls")
        out.append(
            {
                "role": role,
                "content": content,
                "reasoning": _reasoning_of(m, i),
                "tool_calls": _calls_of(calls or [], i),
            }
        )
    for start, end in _result_runs(messages):
        out[start:end] = [out[k] for k in _in_call_order(messages, start, end)]
    return out


def _reasoning_of(m: dict[str, Any], i: int) -> str:
    """A message's reasoning: ``reasoning_content`` or ``reasoning`` (one of them, or both
    equal; null is none)."""
    given = {k: m[k] for k in ("reasoning_content", "reasoning") if m.get(k) is not None}
    for k, v in given.items():
        if not isinstance(v, str):
            raise ValueError(f"messages[{i}].{k} must be a string, got {type(v).__name__}")
        _no_lone_surrogate(v, i, k)
    if len(set(given.values())) > 1:
        raise ValueError(f"messages[{i}]: reasoning_content and reasoning differ (give one)")
    return next(iter(given.values()), "")


def _no_lone_surrogate(text: str, i: int, key: str = "content") -> None:
    """A ValueError naming message ``i`` where ``text`` (its content or one of its text parts)
    holds a lone surrogate (JSON allows ``"\\ud83d"``; UTF-8 cannot encode it): the index is the
    caller's, not one in the rendered prompt."""
    if (j := lone_surrogate(text)) is not None:
        raise ValueError(f"messages[{i}].{key} contains a lone UTF-16 surrogate at index {j}")


def _result_runs(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of tool messages right after an assistant message."""
    runs, i = [], 1
    while i < len(messages):
        end = i
        while end < len(messages) and messages[end].get("role") == "tool":
            end += 1
        if end > i and messages[i - 1].get("role") == "assistant":
            runs.append((i, end))
        i = end + 1
    return runs


def _in_call_order(messages: list[dict[str, Any]], start: int, end: int) -> list[int]:
    """The indices of the tool messages ``start..end`` in the order of the calls they answer, by
    ``tool_call_id`` (OpenAI lets a client send results in any order): the model reads the
    results by position. Unchanged when the calls carry no ids or a result has no
    ``tool_call_id`` (paired by position). Raises ``ValueError`` for an id that answers none of
    the calls, or a call answered twice."""
    calls = messages[start - 1].get("tool_calls") or []
    call_ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
    run = list(range(start, end))
    if not any(isinstance(c, str) for c in call_ids):
        return run
    answered: dict[str, int] = {}
    for k in run:
        cid = messages[k].get("tool_call_id")
        if cid is None:
            continue
        where = f"messages[{k}].tool_call_id {cid!r}"
        if cid not in call_ids:
            raise ValueError(f"{where} matches none of messages[{start - 1}].tool_calls")
        if cid in answered:
            raise ValueError(f"{where}: messages[{answered[cid]}] already answers that call")
        answered[cid] = k
    if len(answered) < len(run):
        return run
    return sorted(run, key=lambda k: call_ids.index(messages[k]["tool_call_id"]))


def _calls_of(calls: list[Any], i: int) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', ...}}}}")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not JSON: {e}") from e
        if not isinstance(args, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object")
        out.append((fn["name"], args))
    return out


def thinking_of(kwargs: dict[str, Any] | None) -> bool:
    """Whether ``chat_template_kwargs`` ask for thinking mode: ``thinking`` or ``enable_thinking``
    true (vLLM reads both for DeepSeek-V3.1/V3.2). Other keys are ignored, as vLLM's V3.2
    encoding ignores them. Raises ``ValueError`` naming a bad value."""
    if kwargs is None:
        return False
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {json_type(kwargs)}")
    for key in THINKING_KEYS:
        if kwargs.get(key) is not None and not isinstance(kwargs[key], bool):
            got = value_named(kwargs[key])
            raise ValueError(f"chat_template_kwargs.{key} must be a boolean, got {got}")
    return any(kwargs.get(key) for key in THINKING_KEYS)


def reply_in_reasoning(
    messages: list[dict[str, Any]], thinking: bool, continue_final: bool = False
) -> bool:
    """Whether the reply to a conversation ``render_chat`` rendered starts inside its reasoning
    (to be split off at ``</think>``): in thinking mode, unless it continues a final message
    that has content, whose reasoning ``render_dsv32`` closed before it."""
    if not (thinking and continue_final and messages):
        return thinking
    return not normalise_messages(messages[-1:])[0]["content"]


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation: bool = True,
    functions: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    continue_final: bool = False,
) -> str:
    """The prompt text of an OpenAI-style conversation (its BOS included), as the server and
    ``LLM.chat`` render it: the checkpoint's jinja template for a plain conversation, and
    DeepSeek-V3.2's encoding (``render_dsv32``) for thinking mode, tools, tool results, assistant
    tool calls or developer messages, and for any conversation of a checkpoint without a
    template, as DeepSeek-V3.2's own release ships none.

    ``add_generation`` (vLLM's ``add_generation_prompt``): end with the assistant's turn opened.
    ``continue_final`` (vLLM's ``continue_final_message``): leave the last message, an
    assistant's, open for the model to continue (``render_dsv32``; a jinja template's rendering
    cut after the message's content, ``_cut_after``); it excludes ``add_generation``, as vLLM's
    does. Raises ``ValueError`` naming the problem (a message, or ``continue_final_message``)."""
    messages = normalise_messages(messages)
    if continue_final:
        _check_continuable(messages, add_generation)
    dsv32 = (
        thinking
        or functions
        or tokenizer.chat_template is None
        or any(m["role"] in ("tool", "developer") or m["tool_calls"] for m in messages)
    )
    if dsv32:
        bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
        return render_dsv32(messages, functions, bos, eos, thinking, add_generation, continue_final)
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(plain, add_generation)
    return _cut_after(text, plain[-1]["content"], len(plain) - 1) if continue_final else text


def _check_continuable(messages: list[dict[str, Any]], add_generation: bool) -> None:
    """The rules of ``continue_final_message`` (vLLM's, and what DeepSeek-V3.2's encoding can
    continue), each a ``ValueError`` starting with its name."""
    if add_generation:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true (vLLM's rule; "
            "add_generation_prompt defaults to true: set it to false)"
        )
    last = len(messages) - 1
    if last < 0 or messages[last]["role"] != "assistant":
        got = f"messages[{last}] is a {messages[last]['role']} message" if last >= 0 else "none"
        msg = f"continue_final_message needs the last message to be the assistant's, {got}"
        raise ValueError(msg)
    if messages[last]["tool_calls"]:
        msg = f"continue_final_message: messages[{last}] has tool_calls, which cannot be continued"
        raise ValueError(msg)


def _cut_after(text: str, content: str, i: int) -> str:
    """``text`` (a jinja template's rendering without the generation prompt) cut right after the
    last message's ``content``, dropping the end of turn the template wrote after it: the rule
    of HF's ``apply_chat_template`` (which vLLM uses), that finds the content's last occurrence
    with its outer whitespace stripped (templates often trim), and keeps the trailing whitespace
    only where the template kept it."""
    core = content.strip()
    if not core:  # (the last occurrence of "" is the end of the text: nothing would be cut)
        msg = f"continue_final_message: messages[{i}].content is empty: nothing to continue"
        raise ValueError(msg)
    at = text.rfind(core)
    if at < 0:
        msg = (
            f"continue_final_message: the chat template does not render messages[{i}].content "
            "as it is, so where it ends cannot be found"
        )
        raise ValueError(msg)
    end = at + len(content.lstrip())
    return text[:end] if text[at:end] == content.lstrip() else text[: at + len(core)]
