"""The route bodies of the OpenAI-compatible server (``runtime.server`` wires them into the app):
completions and chat (n choices, prompt lists, echo, logprobs, stop_reason, usage), tokenize and
detokenize, and the Prometheus scrape."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import prometheus_client as prom
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.async_engine import AsyncEngine, RequestStream
from runtime.chat_template import normalise_messages, render_dsv32
from runtime.engine import StepOutput
from runtime.openai_protocol import (
    CONTEXT_CODE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_unsupported,
    sampling_params,
)
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams, SamplingParamsError
from runtime.server_metrics import ServerMetrics
from runtime.server_streams import failure, merged, sse
from runtime.structured_output import lark_grammar
from runtime.tokenizer import lone_surrogate
from runtime.tool_calls import ToolCall, ToolCallStream, ToolPlan, parse_tool_calls, plan_tools

logger = logging.getLogger(__name__)

Chunk = Callable[[int, StepOutput], "dict[str, Any] | None"]
Top = list[tuple[int, float]]  # one token's most likely (token id, logprob)
MAX_CHOICES = 64  # n x prompts in one request: each is an engine request


@dataclass
class _Choice:
    """One engine request of an HTTP request: a prompt (its index among the prompts) and a seed."""

    prompt_index: int
    ids: list[int]
    text: str  # the prompt's text, for echo
    params: SamplingParams


class Handlers:
    """The route bodies, sharing the engine, the tokenizer and the metrics."""

    def __init__(self, engine: AsyncEngine, model_names: list[str]) -> None:
        self.engine, self.model_names = engine, model_names
        self.model_name = model_names[0]  # the metrics' model_name label
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(self.model_name)
        # one token's text, by id: prompt_logprobs of a long prompt name ~21 tokens per position
        # (millions of decodes on the event loop otherwise); bounded by the vocabulary
        self._token_text: dict[int, str] = {}

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            msg = f"the model {name!r} does not exist; this server serves {served}"
            raise APIError(404, msg, param="model", code="model_not_found")

    def context_error(self, n_prompt: str, param: str) -> APIError:
        limit = self.engine.max_model_len
        msg = (
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{n_prompt} tokens, which leaves no room for a completion."
        )
        return APIError(400, msg, param=param, code=CONTEXT_CODE)

    async def encode(self, text: str, add_bos: bool, param: str) -> list[int]:
        """Token ids of a prompt, tokenised on a worker thread so a huge prompt cannot stall the
        event loop (and /health); one that cannot fit the context is refused before tokenising."""
        if (i := lone_surrogate(text)) is not None:
            msg = f"{param} contains a lone UTF-16 surrogate (U+{ord(text[i]):04X}) at index {i}"
            raise APIError(400, msg, param=param)
        bound = await asyncio.to_thread(self.tokenizer.min_tokens, text)
        if bound >= self.engine.max_model_len:
            raise self.context_error(f"at least {bound}", param)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_bos)

    def max_tokens(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        """Reject prompt + max_tokens over the context; a missing max_tokens (chat) becomes what
        the context leaves. Other bad values are left to SamplingParams to name."""
        limit = self.engine.max_model_len
        head = f"This model's maximum context length is {limit} tokens. However, "
        if max_tokens is None:
            if n_prompt >= limit:
                raise self.context_error(str(n_prompt), param)
            return limit - n_prompt
        if max_tokens >= 1 and n_prompt + max_tokens > limit:
            msg = (
                f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                f"{max_tokens} for the completion)."
            )
            raise APIError(400, head + msg, param=param, code=CONTEXT_CODE)
        return max_tokens

    async def start(
        self, rid: str, choices: list[_Choice], grammar_param: str = "response_format"
    ) -> list[RequestStream]:
        """Add every choice's request (ids ``rid-0``, ``rid-1``, ...; just ``rid`` for one); the
        choices of one prompt share its prefill when the engine can (``generate_group``). If one
        is refused, the ones already added are aborted."""
        streams: list[RequestStream] = []
        cids = [rid] if len(choices) == 1 else [f"{rid}-{i}" for i in range(len(choices))]
        try:
            i = 0
            while i < len(choices):
                c = choices[i]
                j = i + 1  # choices of one prompt are consecutive (prompt-major)
                while j < len(choices) and choices[j].prompt_index == c.prompt_index:
                    j += 1
                # with prompt_logprobs too: the group's one prefill computes them for all
                if j - i > 1 and self.engine.shares_prefill:
                    params = [x.params for x in choices[i:j]]
                    streams += await self.engine.generate_group(cids[i:j], c.ids, params)
                else:
                    for k in range(i, j):
                        ck = choices[k]
                        streams.append(await self.engine.generate(cids[k], ck.ids, ck.params))
                i = j
        except (ValueError, RuntimeError) as e:
            for st in streams:
                await st.aclose()
            if isinstance(e, ValueError):  # the engine's verdict (context, host pool, ...)
                param = grammar_param if "grammar" in str(e) else None
                raise APIError(400, str(e), param=param) from e
            raise APIError(503, str(e), type_="server_error") from e  # shut down
        return streams

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.token_string(i) for i in ids]

    def token_string(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def prompt_logprobs(
        self, ids: list[int], entries: list, top_n: int | None = None
    ) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then
        ``{token id: {"logprob", "rank", "decoded_token"}}`` of the token itself and the top N
        (``top_n``: the first N of the entries' alternatives, when they were computed for more,
        as echo with a larger ``logprobs`` asks)."""
        out: list[dict[str, Any] | None] = []
        for tok, e in zip(ids, entries, strict=True):
            if e is None:
                out.append(None)
                continue
            lp, rank, top = e
            top = top if top_n is None else top[:top_n]
            d = {str(t): {"logprob": v, "rank": r} for r, (t, v) in enumerate(top, 1)}
            d.setdefault(str(tok), {"logprob": lp, "rank": rank})
            for k, v in d.items():
                v["decoded_token"] = self.token_string(int(k))
            out.append(d)
        return out

    @staticmethod
    def choices_of(
        prompts: list[tuple[list[int], str]], params: SamplingParams, n: int
    ) -> list[_Choice]:
        """``n`` choices per prompt, prompt-major (the OpenAI index order). With a seed, choice
        ``j`` of a prompt samples with ``seed + j``, so the n choices differ yet reproduce."""
        if n * len(prompts) > MAX_CHOICES:
            msg = f"n x prompts must be at most {MAX_CHOICES}, got {n} x {len(prompts)}"
            raise APIError(400, msg, param="n")
        out = []
        for p, (ids, text) in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else _wrap_seed(params.seed + j)
                out.append(_Choice(p, ids, text, dataclasses.replace(params, seed=seed)))
        return out

    async def respond(
        self,
        request: Request,
        streams: list[RequestStream],
        choices: list[_Choice],
        req: CompletionRequest | ChatCompletionRequest,
        head: dict[str, Any],
        chunk: Chunk,
        final: Callable[[list[RequestOutput], dict[str, int], list[list[Top]]], dict[str, Any]],
        t0: float,
        first: Callable[[int], dict[str, Any] | None] | None = None,
        keep: Callable[[list[RequestOutput]], list[int]] | None = None,
    ) -> Response:
        """Collect the outputs into one JSON response, or stream them as SSE chunks. ``t0``:
        when the request arrived (perf_counter), for the latency histograms. Adds
        ``stop_reason`` to finished choices, and the usage the stream options ask for.
        ``keep`` (best_of, not streamed): which of the finished choices are returned, in order;
        ``choices`` is narrowed to them in place, since ``final`` reads it by returned index."""
        streaming, opts = bool(req.stream), req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        results = [RequestOutput() for _ in streams]
        times: list[list[float]] = [[] for _ in streams]  # outputs with tokens: TTFT, ITL
        tops: list[list[Top]] = [[] for _ in streams]  # top alternatives per token

        def add(i: int, out: StepOutput) -> None:
            results[i].add(out)
            tops[i] += out.new_top_logprobs or []
            if out.new_token_ids:
                times[i].append(time.perf_counter())

        def observe() -> None:
            now = time.perf_counter()
            for res, ts in zip(results, times, strict=True):
                if res.finish_reason is not None:
                    self.metrics.observe(res, t0, now, ts)

        def usage() -> dict[str, int]:
            # prompt tokens once per prompt, as OpenAI counts them; completions summed
            prompts = {c.prompt_index: len(c.ids) for c in choices}
            p, c = sum(prompts.values()), sum(r.completion_tokens for r in results)
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        if not streaming:
            async for i, out in merged(streams, request):
                add(i, out)
            if any(r.finish_reason is None for r in results):  # the client left
                return Response(status_code=499)
            observe()
            for r in results:
                if (err := failure(r.finish_reason)) is not None:
                    raise err
            if keep is not None:
                order = keep(results)
                results, tops = [results[i] for i in order], [tops[i] for i in order]
                choices[:] = [choices[i] for i in order]
            body = final(results, usage(), tops)
            for c, res in zip(body["choices"], results, strict=True):
                c["stop_reason"] = self.stop_reason(choices[c["index"]].params, res)
            return JSONResponse(body)

        async def events() -> AsyncIterator[str]:
            for i in range(len(streams) if first is not None else 0):
                if (c := first(i)) is not None:  # type: ignore[misc]
                    yield sse({**c, "usage": usage()} if continuous else c)
            async for i, out in merged(streams, request):
                add(i, out)
                if (err := failure(out.finish_reason)) is not None:
                    observe()
                    yield sse(err.body())  # the openai client raises APIError on it
                    return
                if (c := chunk(i, out)) is not None:
                    if out.finished:
                        c["choices"][0]["stop_reason"] = self.stop_reason(
                            choices[i].params, results[i]
                        )
                    yield sse({**c, "usage": usage()} if continuous else c)
            if any(r.finish_reason is None for r in results):  # the client left
                return
            observe()
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"

        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    def stop_reason(self, params: SamplingParams, res: RequestOutput) -> int | str | None:
        """vLLM's ``stop_reason``: the stop token id or stop string that ended the choice; None
        for EOS, a length limit, or an abort."""
        if res.finish_reason != "stop" or not res.token_ids:
            return None
        last = res.token_ids[-1]
        if last in params.stop_token_ids:
            return last
        if not params.stop or (last == self.tokenizer.eos_token_id and not params.ignore_eos):
            return None
        # The stop checker ends at the first complete stop string (earliest end, then the longer):
        # the same rule over the whole decoded output finds which one it was.
        full = self.tokenizer.decode(res.token_ids)
        hits = [(i + len(s), i, s) for s in params.stop if (i := full.find(s)) >= 0]
        return min(hits)[2] if hits else None

    async def prompts_of(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        """``(ids, text)`` per prompt: a string, a list of ids, or a list of either."""
        raw = req.prompt
        many = isinstance(raw, list) and raw and not isinstance(raw[0], int)
        items = list(raw) if many else [raw]  # type: ignore[arg-type]
        vocab = self.tokenizer.vocab_size
        out = []
        for p in items:
            if isinstance(p, str):
                ids = await self.encode(p, True, "prompt")
                out.append((ids, p))
                continue
            if not p or any(not 0 <= i < vocab for i in p):
                msg = f"prompt token ids must be a non-empty list of ids in [0, {vocab})"
                raise APIError(400, msg, param="prompt")
            text = self.tokenizer.decode(p) if req.echo else ""
            out.append((list(p), text))
        if not out:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        return out

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        check_unsupported(req)
        prompts = await self.prompts_of(req)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # the OpenAI default
        vocab = self.tokenizer.vocab_size
        params = sampling_params(req, max_tokens, req.logprobs is not None, vocab)
        for ids, _ in prompts:
            self.max_tokens(len(ids), max_tokens, "prompt")
        # echo with logprobs: the prompt's tokens come first in the logprobs, their entries from
        # the prompt_logprobs path (None for the first token, as OpenAI and vLLM return it)
        echo_lps = bool(req.echo) and req.logprobs is not None
        if echo_lps:
            want = max(req.logprobs or 0, req.prompt_logprobs or 0)
            params = dataclasses.replace(params, prompt_logprobs=want)
        n = req.n or 1
        best_of = req.best_of or n
        keep = None
        if best_of > n:  # ranked by cumulative logprob: every candidate reports its logprobs
            params = dataclasses.replace(params, logprobs=True)
            keep = functools.partial(best_of_order, best_of=best_of, n=n)
        choices = self.choices_of(prompts, params, best_of)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start(rid, choices)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
        }
        # NOTE: text_offset counts the token strings, not the text emitted so far: text held back
        # for a partial UTF-8 character or a possible stop string would make streamed offsets lag
        # the non-streamed ones.
        offsets = [0] * len(choices)

        def logprobs(
            i: int,
            token_ids: list[int],
            lps: list[float | None],
            start: int,
            top: list[Top | None] | None,
        ) -> dict | None:
            toks = self.token_strings(token_ids)
            starts = [start + sum(len(t) for t in toks[:k]) for k in range(len(toks))]
            offsets[i] = start + sum(len(t) for t in toks)
            if req.logprobs is None:
                return None
            alternatives = None
            if req.logprobs and top:
                alternatives = [
                    None if pos is None else {self.token_string(t): lp for t, lp in pos}
                    for pos in top
                ]
            return {
                "tokens": toks,
                "token_logprobs": lps,
                "top_logprobs": alternatives,
                "text_offset": starts,
            }

        def echoed(i: int, entries: list | None) -> tuple[list[int], list, list[Top | None]]:
            """echo with logprobs: the prompt's ids, logprobs and alternatives, to go before the
            generated ones. A prompt position's alternatives are its top N and the prompt token
            itself (OpenAI: up to logprobs + 1)."""
            if not echo_lps or entries is None:
                return [], [], []
            ids, lps, tops = choices[i].ids, [], []
            for tok, e in zip(ids, entries, strict=True):
                if e is None:
                    lps.append(None)
                    tops.append(None)
                    continue
                lp, _, alts = e
                alts = alts[: req.logprobs]
                lps.append(lp)
                tops.append(alts + [(tok, lp)] if all(t != tok for t, _ in alts) else alts)
            return list(ids), lps, tops

        def first(i: int) -> dict[str, Any] | None:  # echo: the prompt comes first
            if not req.echo or echo_lps:  # with logprobs, it comes with its logprobs (chunk)
                return None
            choice = {"index": i, "text": choices[i].text, "logprobs": None, "finish_reason": None}
            return {**head, "choices": [choice]}

        def chunk(i: int, out: StepOutput) -> dict[str, Any] | None:
            prompt_lps = out.prompt_logprobs
            if not (out.new_text or out.finished or req.logprobs is not None or prompt_lps):
                return None
            # echo with logprobs: the prompt and its logprobs come with the first token, as vLLM
            # streams them (the prompt's logprobs exist only once it is prefilled)
            e_ids, e_lps, e_tops = echoed(i, prompt_lps)
            text = (choices[i].text if e_ids else "") + out.new_text
            top = out.new_top_logprobs or [[] for _ in out.new_token_ids]
            lp = logprobs(
                i,
                e_ids + out.new_token_ids,
                e_lps + (out.new_logprobs or []),
                offsets[i],
                e_tops + top if e_ids else out.new_top_logprobs,
            )
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
            if prompt_lps is not None and req.prompt_logprobs is not None:  # with the first token
                choice["prompt_logprobs"] = self.prompt_logprobs(
                    choices[i].ids, prompt_lps, req.prompt_logprobs
                )
            return {**head, "choices": [choice]}

        def final(
            results: list[RequestOutput], usage: dict[str, int], tops: list[list[Top]]
        ) -> dict[str, Any]:
            out = []
            for i, res in enumerate(results):
                e_ids, e_lps, e_tops = echoed(i, res.prompt_logprobs)
                top = tops[i] or [[] for _ in res.token_ids]
                lp = logprobs(
                    i,
                    e_ids + res.token_ids,
                    e_lps + res.logprobs,
                    0,
                    e_tops + top if e_ids else tops[i],
                )
                text = (choices[i].text if req.echo else "") + res.text
                out.append(
                    {"index": i, "text": text, "finish_reason": res.finish_reason, "logprobs": lp}
                )
            if req.prompt_logprobs is not None:
                for c, res in zip(out, results, strict=True):
                    lps, ids = res.prompt_logprobs, choices[c["index"]].ids
                    c["prompt_logprobs"] = (
                        None if lps is None else self.prompt_logprobs(ids, lps, req.prompt_logprobs)
                    )
            return {**head, "choices": out, "usage": usage}

        return await self.respond(
            request, streams, choices, req, head, chunk, final, t0, first, keep
        )

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        check_unsupported(req)
        plan = _tool_plan(req)
        ids = await self.encode_chat(
            [m.model_dump() for m in req.messages], functions=plan.functions if plan else None
        )
        requested = (
            req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        )
        max_tokens = self.max_tokens(len(ids), requested, "messages")
        params = sampling_params(req, max_tokens, bool(req.logprobs), self.tokenizer.vocab_size)
        forced = plan is not None and plan.grammar_text is not None
        if forced:
            try:
                params = dataclasses.replace(params, grammar=_call_grammar(plan, params))
            except SamplingParamsError as e:  # e.g. min_tokens with a grammar
                raise APIError(400, str(e), param=e.param) from e
        choices = self.choices_of([(ids, "")], params, req.n or 1)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(rid, choices, "tool_choice" if forced else "response_format")
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }
        parsers = [ToolCallStream(plan.names) if plan else None for _ in choices]
        # prompt_logprobs (vLLM's, on chat too): the response's, not a choice's (the choices share
        # the prompt); streamed once, on the first chunk that has them
        sent_prompt_lps = [req.prompt_logprobs is None]

        def with_prompt_lps(body: dict[str, Any], entries: list | None) -> dict[str, Any]:
            if entries is None or sent_prompt_lps[0]:
                return body
            sent_prompt_lps[0] = True
            return {**body, "prompt_logprobs": self.prompt_logprobs(choices[0].ids, entries)}

        def calls_of(calls: list[ToolCall]) -> list[ToolCall]:
            return calls if plan is None or plan.parallel else calls[:1]

        def reason(finish: str | None, calls: list[ToolCall]) -> str | None:
            return "tool_calls" if calls and finish == "stop" else finish

        def entry(t: str, lp: float) -> dict[str, Any]:
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        def logprobs(token_ids: list[int], lps: list[float], top: list[Top] | None) -> dict | None:
            if not req.logprobs:
                return None
            toks = self.token_strings(token_ids)
            top = top or [[] for _ in toks]
            return {
                "content": [
                    {
                        **entry(t, lp),
                        "top_logprobs": [entry(self.token_string(i), v) for i, v in alts],
                    }
                    for t, lp, alts in zip(toks, lps, top, strict=True)
                ]
            }

        def chunk(i: int, out: StepOutput) -> dict[str, Any] | None:
            text, calls, parser = out.new_text, [], parsers[i]
            if parser is not None:  # the DSML block is held back and sent parsed at the end
                text = parser.feed(out.new_text)
                if out.finished:
                    rest, found = parser.finish()
                    text, calls = text + rest, calls_of(found)
            fresh_lps = out.prompt_logprobs is not None and not sent_prompt_lps[0]
            if not (text or out.finished or req.logprobs or fresh_lps):
                return None
            delta: dict[str, Any] = {"content": text} if text else {}
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
            if plan is None:
                return {"role": "assistant", "content": res.text}, res.finish_reason
            content, found = parse_tool_calls(res.text, plan.names)
            calls = calls_of(found)
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = [c.openai() for c in calls]
            return msg, reason(res.finish_reason, calls)

        def final(
            results: list[RequestOutput], usage: dict[str, int], tops: list[list[Top]]
        ) -> dict[str, Any]:
            out = []
            for i, res in enumerate(results):
                msg, finish = message(res)
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

        def first(i: int) -> dict[str, Any]:
            choice = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            return {**head, "choices": [choice]}

        return await self.respond(request, streams, choices, req, head, chunk, final, t0, first)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation: bool = True,
        functions: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation. The checkpoint's template renders plain conversations;
        tools, tool results, assistant tool calls and developer messages (and a checkpoint
        without a template, as DeepSeek-V3.2's own) use DeepSeek-V3.2's encoding
        (``runtime.chat_template``), which always ends where the assistant's reply starts."""
        for i, m in enumerate(messages):
            content = m.get("content")
            parts = content if isinstance(content, list) else [{"text": content}]
            for p in parts:
                text = p.get("text") if isinstance(p, dict) else None
                if isinstance(text, str) and (j := lone_surrogate(text)) is not None:
                    msg = f"messages[{i}].content contains a lone UTF-16 surrogate at index {j}"
                    raise APIError(400, msg, param="messages")
        tok = self.tokenizer
        try:
            messages = normalise_messages(messages)
            dsv32 = (
                functions
                or tok.chat_template is None
                or any(m["role"] in ("tool", "developer") or m["tool_calls"] for m in messages)
            )
            if dsv32:
                bos, eos = tok.bos_token or "", tok.eos_token or ""
                text = await asyncio.to_thread(render_dsv32, messages, functions, bos, eos)
            else:
                plain = [{"role": m["role"], "content": m["content"]} for m in messages]
                text = await asyncio.to_thread(tok.apply_chat_template, plain, add_generation)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return await self.encode(text, False, "messages")  # the template writes the BOS itself

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        if req.model is not None:
            self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            ids = await self.encode(req.prompt, req.add_special_tokens is not False, "prompt")
        else:
            msgs = [m.model_dump() for m in req.messages or []]
            ids = await self.encode_chat(msgs, req.add_generation_prompt is not False)
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
        }
        if req.return_token_strs:
            body["token_strs"] = self.token_strings(ids)
        return body

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        if req.model is not None:
            self.check_model(req.model)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= i < vocab for i in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, req.tokens)}

    async def prometheus(self) -> Response:
        try:
            snapshot = await self.engine.metrics()
        except Exception:  # still serve the counter and the histogram
            logger.exception("engine.metrics() failed")
            snapshot = {}
        # The engine averages its last steps whatever their age; this rate falls to 0 when idle.
        snapshot["tokens_per_s"] = self.engine.tokens_per_s()
        self.metrics.update(snapshot, self.engine.generation_tokens_total)
        body = prom.generate_latest(self.metrics.registry)
        return Response(body, media_type=prom.CONTENT_TYPE_LATEST)


def best_of_order(results: list[RequestOutput], best_of: int, n: int) -> list[int]:
    """best_of: of each prompt's ``best_of`` consecutive candidates, the ``n`` with the highest
    cumulative logprob (the sum of their tokens' logprobs, as vLLM ranks them), best first; ties
    keep the candidates' order. Indices into ``results``, prompt-major."""
    out = []
    for start in range(0, len(results), best_of):
        group = range(start, start + best_of)
        out += sorted(group, key=lambda i: -sum(results[i].logprobs))[:n]
    return out


def _tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    try:
        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ValueError as e:
        param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise APIError(400, str(e), param=param) from e


def _call_grammar(plan: ToolPlan, params: SamplingParams) -> str:
    """The llguidance grammar forcing the plan's call; one grammar a request."""
    if params.grammar is not None:
        msg = "tool_choice required or a named function cannot be combined with response_format"
        raise APIError(400, msg, param="tool_choice")
    try:
        return lark_grammar(plan.grammar_text or "")
    except ValueError as e:
        raise APIError(400, f"tool_choice: {e}", param="tool_choice") from e


def _wrap_seed(seed: int) -> int:
    """``seed + j`` kept in int64 (SamplingParams' range), wrapping like the C type would."""
    return (seed + 2**63) % 2**64 - 2**63
