"""The ``/v1/chat/completions`` route body (n choices, tools and tool_choice, thinking mode's
reasoning, logprobs, ``prompt_logprobs``, ``echo``) and the encoding of a conversation (which
``/tokenize`` uses too)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from runtime.chat_reply import ReplyStream, read_reply
from runtime.chat_template import (
    normalise_messages,
    render_chat,
    reply_in_reasoning,
    thinking_of,
)
from runtime.engine import StepOutput
from runtime.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    check_unsupported,
    continuation,
    sampling_params,
)
from runtime.outputs import RequestOutput
from runtime.reasoning import thinking_params
from runtime.sampling_params import SamplingParams, SamplingParamsError
from runtime.server_base import HandlersBase, Top, _Choice
from runtime.structured_output import json_schema_problem, lark_grammar
from runtime.tool_calls import ToolCall, ToolPlan, plan_tools


@dataclass
class ChatPrompt:
    """A chat request's prompt (``ChatHandlers.chat_prompt``)."""

    ids: list[int]
    plan: ToolPlan | None
    in_reasoning: bool  # the reply starts inside the reasoning (thinking mode)
    msgs: list[dict[str, Any]]  # the messages as sent
    cont: bool  # the last message is continued
    max_tokens: int  # the reply's, checked against the context (what it leaves, when unset)


@dataclass
class ChatRun:
    """A chat request ready to run (``ChatHandlers.prepare_chat``)."""

    choices: list[_Choice]  # n of them, of the one prompt
    plan: ToolPlan | None
    in_reasoning: bool  # the reply starts inside the reasoning (thinking mode)
    grammar_param: str  # the field an engine's grammar error names
    msgs: list[dict[str, Any]]  # the messages as sent
    cont: bool  # the last message is continued


class ChatHandlers(HandlersBase):
    """``/v1/chat/completions`` and the encoding of a conversation."""

    async def chat_prompt(self, req: ChatCompletionRequest) -> ChatPrompt:
        """``req``'s prompt rendered and encoded, and the room the context leaves its reply
        checked; no sampling parameter and no grammar (``/v1/messages/count_tokens`` counts it
        so: compiling a forced call's or a response format's grammar would change no count)."""
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        thinking = request_thinking(req.chat_template_kwargs)
        msgs = [m.model_dump() for m in req.messages]
        # (a prompt to truncate may be longer than the context: its ids are counted)
        fits = req.truncate_prompt_tokens is None
        gen, cont = continuation(req)
        ids = await self.encode_chat(msgs, gen, plan, fits, thinking, cont)
        # (only the new text is the reply, as vLLM's: a continued message's start is not in it)
        in_reasoning = reply_in_reasoning(msgs, thinking, cont)
        ids = self.truncated(ids, req)
        max_tokens = self.max_tokens(len(ids), getattr(req, req.max_tokens_field), "messages")
        return ChatPrompt(ids, plan, in_reasoning, msgs, cont, max_tokens)

    async def prepare_chat(self, req: ChatCompletionRequest) -> ChatRun:
        """``req`` made ready to run: its prompt (``chat_prompt``), its sampling parameters
        (a forced call's or a response format's grammar; after the reasoning in thinking mode)
        and its choices. The Responses route runs its requests through it too."""
        p = await self.chat_prompt(req)
        plan = p.plan
        vocab, defaults = self.tokenizer.vocab_size, self.engine.sampling_defaults
        params = sampling_params(req, p.max_tokens, bool(req.logprobs), vocab, defaults)
        forced = plan is not None and plan.grammar_text is not None
        if forced:
            try:
                params = dataclasses.replace(params, grammar=_call_grammar(plan, params))
            except SamplingParamsError as e:  # e.g. min_tokens with a grammar
                raise APIError(400, str(e), param=e.param) from e
        if p.in_reasoning:  # the forced block or JSON follows the reasoning, in the content
            params = thinking_params(params)
        choices = self.choices_of([(p.ids, "")], params, req.n or 1)
        grammar_param = "tool_choice" if forced else "response_format"
        return ChatRun(choices, plan, p.in_reasoning, grammar_param, p.msgs, p.cont)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        check_unsupported(req)
        run = await self.prepare_chat(req)
        choices, plan, in_reasoning = run.choices, run.plan, run.in_reasoning
        echo = echoed(run.msgs, bool(req.echo), run.cont and in_reasoning)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(rid, choices, run.grammar_param)
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }
        replies = [ReplyStream(in_reasoning, plan) for _ in choices]
        # prompt_logprobs (vLLM's, on chat too): the response's, not a choice's (the choices share
        # the prompt); streamed once, on the first chunk that has them
        sent_prompt_lps = [req.prompt_logprobs is None]

        def with_prompt_lps(body: dict[str, Any], entries: list | None) -> dict[str, Any]:
            if entries is None or sent_prompt_lps[0]:
                return body
            sent_prompt_lps[0] = True
            return {**body, "prompt_logprobs": self.prompt_logprobs(choices[0].ids, entries)}

        def reason(finish: str | None, calls: list[ToolCall]) -> str | None:
            return "tool_calls" if calls and finish == "stop" else finish

        def entry(token_id: int, lp: float) -> dict[str, Any]:
            # the token's own bytes: its text is U+FFFD when it ends inside a UTF-8 character
            b = list(self.tokenizer.token_bytes(token_id))
            return {"token": self.token_string(token_id), "logprob": lp, "bytes": b}

        def logprobs(token_ids: list[int], lps: list[float], top: list[Top] | None) -> dict | None:
            if not req.logprobs:
                return None
            top = top or [[] for _ in token_ids]
            return {
                "content": [
                    {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts]}
                    for t, lp, alts in zip(token_ids, lps, top, strict=True)
                ]
            }

        def chunk(i: int, out: StepOutput) -> dict[str, Any] | None:
            part = replies[i].feed(out.new_text, out.finished)
            reasoning, text, calls = part.reasoning or "", part.content or "", part.calls
            fresh_lps = out.prompt_logprobs is not None and not sent_prompt_lps[0]
            if not (text or reasoning or out.finished or req.logprobs or fresh_lps):
                return None
            delta: dict[str, Any] = with_reasoning({}, reasoning) if reasoning else {}
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [c.openai(k) for k, c in enumerate(calls)]
            choice = {
                "index": i,
                "delta": delta,
                "finish_reason": reason(out.finish_reason, calls),
                "logprobs": logprobs(
                    out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs
                ),
            }
            return with_prompt_lps({**head, "choices": [choice]}, out.prompt_logprobs)

        def message(res: RequestOutput) -> tuple[dict[str, Any], str | None]:
            reply = read_reply(res.text, in_reasoning, plan)
            msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.reasoning is not None:
                msg = with_reasoning(msg, reply.reasoning)
            if reply.calls:
                msg["tool_calls"] = [c.openai() for c in reply.calls]
            return msg, reason(res.finish_reason, reply.calls)

        def final(
            results: list[RequestOutput], usage: dict[str, int], tops: list[list[Top]]
        ) -> dict[str, Any]:
            out = []
            for i, res in enumerate(results):
                msg, finish = message(res)
                if echo is not None:  # after the calls are parsed out (vLLM's order)
                    msg["content"] = echo[1] + (msg["content"] or "")  # ("", not null: vLLM's)
                    if echo[0]:
                        msg = with_reasoning(msg, echo[0] + (msg.get("reasoning") or ""))
                out.append(
                    {
                        "index": i,
                        "message": msg,
                        "logprobs": logprobs(res.token_ids, res.logprobs, tops[i]),
                        "finish_reason": finish,
                    }
                )
            body = {**head, "object": "chat.completion", "choices": out, "usage": usage}
            return with_prompt_lps(body, results[0].prompt_logprobs if results else None)

        def first() -> list[dict[str, Any]]:
            # each choice's role, then (vLLM's order) each choice's echo, without logprobs
            deltas = [{"role": "assistant", "content": ""}]
            if echo is not None and any(echo):
                delta = with_reasoning({}, echo[0]) if echo[0] else {}
                deltas.append({**delta, "content": echo[1]} if echo[1] else delta)
            return [
                {**head, "choices": [{"index": i, "delta": d, "logprobs": None,
                                      "finish_reason": None}]}
                for d in deltas for i in range(len(choices))
            ]  # fmt: skip

        return await self.respond(request, streams, choices, req, head, chunk, final, t0, first)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation: bool = True,
        plan: ToolPlan | None = None,
        within_context: bool = True,
        thinking: bool = False,
        continue_final: bool = False,
    ) -> list[int]:
        """Token ids of a conversation offering ``plan``'s tools (``tool_plan``), rendered by
        ``runtime.chat_template.render_chat`` (the checkpoint's template, or DeepSeek-V3.2's
        encoding; in its thinking mode when ``thinking``; the last message left open when
        ``continue_final``)."""
        functions = plan.functions if plan is not None else None
        args = (self.tokenizer, messages, add_generation, functions, thinking, continue_final)
        try:  # (a lone surrogate in a message: normalise_messages names it)
            text = await asyncio.to_thread(render_chat, *args)
        except ValueError as e:
            flag = "continue_final_message"  # (chat_template names its rules' errors so)
            msg, param = str(e), "messages"
            if msg.startswith(flag):
                param = flag
                if continue_final and messages and messages[-1].get("prefix"):
                    # DeepSeek's prefix: true asked for it: name the field the client sent
                    param = f"messages[{len(messages) - 1}].prefix"
                    msg = f"{param} (a continue_final_message): {msg[len(flag) :].lstrip(': ')}"
            raise APIError(400, msg, param=param) from e
        # (the template writes the BOS itself)
        return await self.encode(text, False, "messages", within_context)


def echoed(messages: list[dict[str, Any]], echo: bool, continues_reasoning: bool
           ) -> tuple[str, str] | None:  # fmt: skip
    """vLLM's chat ``echo``: ``(reasoning, content)`` put before every choice's reply (None
    without echo). vLLM's rule: the last message's content (text parts joined as the template
    joins them) when its role is the reply's, here always the assistant's, whether it is
    continued or a new turn follows it. Where vLLM has no rule, ``continues_reasoning`` (thinking
    mode continuing a message that has reasoning and no content yet): the message's reasoning
    before the reply's, so the echoed message is whole."""
    if not echo:
        return None
    if not messages or messages[-1].get("role") != "assistant":
        return "", ""
    last = normalise_messages(messages[-1:])[0]
    return (last["reasoning"] if continues_reasoning else ""), last["content"]


def request_thinking(kwargs: dict[str, Any] | None) -> bool:
    """``thinking_of`` a request's ``chat_template_kwargs``, its error a 400 naming the field."""
    try:
        return thinking_of(kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from e


def with_reasoning(body: dict[str, Any], reasoning: str) -> dict[str, Any]:
    """``body`` (a message or a delta) with the reasoning under both names clients read:
    ``reasoning_content`` (DeepSeek's API, SGLang, older vLLM) and ``reasoning`` (vLLM's
    now)."""
    return {**body, "reasoning_content": reasoning, "reasoning": reasoning}


def tool_plan(tools: Any, tool_choice: Any, parallel: bool | None = None) -> ToolPlan | None:
    """``plan_tools`` of a request's fields (chat, and a chat ``/tokenize``), its error a 400
    naming the field."""
    try:
        return plan_tools(tools, tool_choice, parallel)
    except ValueError as e:
        param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise APIError(400, str(e), param=param) from e


def _call_grammar(plan: ToolPlan, params: SamplingParams) -> str:
    """The llguidance grammar forcing the plan's call; one grammar a request."""
    if params.grammar is not None:
        msg = "tool_choice required or a named function cannot be combined with response_format"
        raise APIError(400, msg, param="tool_choice")
    try:
        grammar = lark_grammar(plan.grammar_text or "")
    except ValueError as e:
        raise APIError(400, f"tool_choice: {e}", param="tool_choice") from e
    # a schema the grammar cannot compile is the tool's fault: named here, before the engine
    # compiles the whole grammar (whose error would quote the grammar, not the tool)
    names = [f["name"] for f in plan.functions]
    for (name, key), schema in plan.json_values.items():
        if (problem := json_schema_problem(schema)) is not None:
            where = f"tools[{names.index(name)}].function.parameters.properties.{key}"
            raise APIError(400, f"{where}: the schema does not compile: {problem}", param="tools")
    return grammar
