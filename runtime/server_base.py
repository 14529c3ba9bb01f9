"""What every route body of the OpenAI-compatible server shares (``runtime.server_handlers``
composes them): the engine and the tokenizer, prompt checks against the context, starting a
request's choices, token strings, ``prompt_logprobs`` shaping, and collecting the outputs into one
JSON response or an SSE stream (usage, ``stop_reason``, latency metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.async_engine import AsyncEngine, RequestStream
from runtime.engine import StepOutput
from runtime.openai_protocol import CONTEXT_CODE, APIError, ChatCompletionRequest, CompletionRequest
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams, SamplingParamsError, truncate_prompt
from runtime.server_lifecycle import limit_reasons
from runtime.server_metrics import ServerMetrics
from runtime.server_streams import failure, merged, sse
from runtime.tokenizer import lone_surrogate

Chunk = Callable[[int, StepOutput], "dict[str, Any] | None"]
Top = list[tuple[int, float]]  # one token's most likely (token id, logprob)
logger = logging.getLogger(__name__)
MAX_CHOICES = 64  # n x prompts in one request: each is an engine request


@dataclass
class _Choice:
    """One engine request of an HTTP request: a prompt (its index among the prompts) and a seed."""

    prompt_index: int
    ids: list[int]
    text: str  # the prompt's text, for echo
    params: SamplingParams


class HandlersBase:
    """The engine, the tokenizer and the metrics, and what the route bodies do with them."""

    def __init__(self, engine: AsyncEngine, model_names: list[str]) -> None:
        self.engine, self.model_names = engine, model_names
        self.model_name = model_names[0]  # the metrics' model_name label
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(self.model_name, engine.max_model_len)
        self._told_closed = False  # /metrics logged that the engine stopped (it does so once)
        # one token's text, by id: prompt_logprobs of a long prompt name ~21 tokens per position
        # (millions of decodes on the event loop otherwise); bounded by the vocabulary
        self._token_text: dict[int, str] = {}
        # the server flags behind max_model_len, named by the 400s that quote it (a 100K-token
        # prompt sent to a server started with the defaults is told what to raise)
        why = limit_reasons(getattr(engine, "engine", None), engine.max_model_len)
        capped = f", capped by {' and '.join(why)}" if why else ""
        self.context_note = f" (This server's limit: --max-model-len{capped}.)"

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            msg = f"the model {name!r} does not exist; this server serves {served}"
            raise APIError(404, msg, param="model", code="model_not_found")

    def context_error(self, n_prompt: str, param: str) -> APIError:
        limit = self.engine.max_model_len
        msg = (
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{n_prompt} tokens, which leaves no room for a completion.{self.context_note}"
        )
        return APIError(400, msg, param=param, code=CONTEXT_CODE)

    async def encode(
        self,
        text: str,
        add_bos: bool,
        param: str,
        within_context: bool = True,
        where: str | None = None,
    ) -> list[int]:
        """Token ids of a prompt, tokenised on a worker thread so a huge prompt cannot stall the
        event loop (and /health); one that cannot fit the context is refused before tokenising
        (``within_context=False``, /tokenize: any text the body limit lets in is counted).
        ``where``: how the messages name the text (e.g. ``prompt[2]``; default ``param``)."""
        if (i := lone_surrogate(text)) is not None:
            at = where or param
            msg = f"{at} contains a lone UTF-16 surrogate (U+{ord(text[i]):04X}) at index {i}"
            raise APIError(400, msg, param=param)
        if within_context:
            bound = await asyncio.to_thread(self.tokenizer.min_tokens, text)
            if bound >= self.engine.max_model_len:
                raise self.context_error(f"at least {bound}", param)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_bos)

    def truncated(
        self, ids: list[int], req: CompletionRequest | ChatCompletionRequest
    ) -> list[int]:
        """The prompt's ids as the request runs them: vLLM's ``truncate_prompt_tokens`` keeps the
        last N (``runtime.sampling_params.truncate_prompt``, which the engine applies again to no
        effect), before the context checks read the prompt's length."""
        try:
            only = SamplingParams(truncate_prompt_tokens=req.truncate_prompt_tokens)
            return truncate_prompt(ids, only, self.engine.max_model_len)
        except SamplingParamsError as e:
            raise APIError(400, str(e), param=e.param) from e

    def max_tokens(
        self, n_prompt: int, max_tokens: int | None, param: str, defaulted: bool = False
    ) -> int:
        """Reject prompt + max_tokens over the context; a missing max_tokens (chat) becomes what
        the context leaves. Other bad values are left to SamplingParams to name. ``defaulted``:
        ``max_tokens`` is the default of a request that set none (completions' 16, refused over
        the context as vLLM refuses it), which the 400 says, with the most that would fit."""
        limit = self.engine.max_model_len
        head = f"This model's maximum context length is {limit} tokens. However, "
        if (max_tokens is None or defaulted) and n_prompt >= limit:
            raise self.context_error(str(n_prompt), param)
        if max_tokens is None:
            return limit - n_prompt
        if max_tokens >= 1 and n_prompt + max_tokens > limit:
            why = ""
            if defaulted:
                room = limit - n_prompt
                why = f", the default max_tokens, as the request set none: set it to at most {room}"
            msg = (
                f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                f"{max_tokens} for the completion{why}).{self.context_note}"
            )
            raise APIError(400, head + msg, param=param, code=CONTEXT_CODE)
        return max_tokens

    def prompt_only_fits(self, prompt_lengths: Iterable[int]) -> None:
        """``echo`` with ``max_tokens: 0``: the engine computes one token past the prompt (then
        dropped), so the prompt must leave room for it. NOTE: vLLM accepts a prompt of the whole
        context here."""
        limit = self.engine.max_model_len
        for n in prompt_lengths:
            if n >= limit:
                msg = (
                    f"This model's maximum context length is {limit} tokens. However, echo with "
                    f"max_tokens 0 takes a prompt of at most {limit - 1} tokens here (one token is "
                    f"computed past the prompt, then dropped), and this prompt has {n}."
                    + self.context_note
                )
                raise APIError(400, msg, param="prompt", code=CONTEXT_CODE)

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

    def stop_reason(self, res: RequestOutput, params: SamplingParams) -> int | str | None:
        """vLLM's ``stop_reason`` of a finished choice (``RequestOutput.stop_reason``)."""
        return res.stop_reason(params, self.engine.eos_token_id, self.engine.eos_token_ids)

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
        prompts: list[tuple[list[int], str]], params: SamplingParams, n: int, param: str = "n"
    ) -> list[_Choice]:
        """``n`` choices per prompt, prompt-major (the OpenAI index order). With a seed, choice
        ``j`` of a prompt samples with ``seed + j``, so the n choices differ yet reproduce.
        ``param``: the field that asked for the ``n`` (``best_of`` when it is larger)."""
        if n * len(prompts) > MAX_CHOICES:
            msg = f"{param} x prompts must be at most {MAX_CHOICES}, got {n} x {len(prompts)}"
            raise APIError(400, msg, param=param)
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
        first: Callable[[], list[dict[str, Any]]] | None = None,
        keep: Callable[[list[RequestOutput]], list[int]] | None = None,
        prompt_only: bool = False,
    ) -> Response:
        """Collect the outputs into one JSON response, or stream them as SSE chunks. ``t0``:
        when the request arrived (perf_counter), for the latency histograms. Adds
        ``stop_reason`` to finished choices, and the usage the stream options ask for.
        ``first``: the chunks streamed before any output (chat's roles and echo, an echoed
        prompt).
        ``keep`` (best_of, not streamed): which of the finished choices are returned, in order;
        ``choices`` is narrowed to them in place, since ``final`` reads it by returned index.
        ``prompt_only`` (``echo`` with ``max_tokens: 0``): each request generated one token,
        which is dropped from every output before anything reads it (text, logprobs, usage)."""
        streaming, opts = bool(req.stream), req.stream_options
        include_usage = bool(opts and opts.include_usage)
        # vLLM's rule: continuous_usage_stats counts only with include_usage
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        results = [RequestOutput() for _ in streams]
        times: list[list[float]] = [[] for _ in streams]  # outputs with tokens: TTFT, ITL

        def add(i: int, out: StepOutput) -> StepOutput:
            if prompt_only:  # (a dropped EOS or stop string did not end it: the length did)
                out = dataclasses.replace(
                    out, new_token_ids=[], new_text="", completion_tokens=0,
                    new_logprobs=None if out.new_logprobs is None else [],
                    new_top_logprobs=None if out.new_top_logprobs is None else [],
                    new_top_chosen=None if out.new_top_chosen is None else [],
                    finish_reason="length" if out.finish_reason == "stop" else out.finish_reason,
                    stop_string=None,
                )  # fmt: skip
            results[i].add(out)
            if out.new_token_ids:
                times[i].append(time.perf_counter())
            return out

        observed = False

        def observe(unfinished: str | None = None) -> None:
            """Record the finished choices once; ``unfinished``: the reason the others ended with
            ("abort": the client left, and leaving aborted them, server_streams.merged; a stream
            that fails ends them all with its error)."""
            nonlocal observed
            if observed:
                return
            observed = True
            now = time.perf_counter()
            for res, ts, choice in zip(results, times, choices, strict=True):
                if unfinished is not None and res.finish_reason is None:
                    res.finish_reason = unfinished
                    res.prompt_tokens = len(choice.ids)  # (0 before its first output)
                if res.finish_reason is not None:
                    self.metrics.observe(res, t0, now, ts)

        def usage() -> dict:
            # prompt tokens once per prompt, as OpenAI counts them; completions summed
            prompts = {c.prompt_index: len(c.ids) for c in choices}
            p, c = sum(prompts.values()), sum(r.completion_tokens for r in results)
            out: dict = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
            if self.engine.caches_prefixes:  # OpenAI's field, as vLLM fills it
                cached = {ch.prompt_index: r.cached_tokens for ch, r in zip(choices, results)}
                out["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
            return out

        if not streaming:
            async for i, out in merged(streams, request):
                add(i, out)
            if any(r.finish_reason is None for r in results):  # the client left
                observe("abort")
                return Response(status_code=499)
            observe()
            for r in results:
                if (err := failure(r.finish_reason, r.error)) is not None:
                    raise err
            if keep is not None:
                order = keep(results)
                results = [results[i] for i in order]
                choices[:] = [choices[i] for i in order]
            body = final(results, usage(), [r.top_logprobs for r in results])
            for c, res in zip(body["choices"], results, strict=True):
                c["stop_reason"] = self.stop_reason(res, choices[c["index"]].params)
            return JSONResponse(body)

        async def events() -> AsyncIterator[str]:
            try:
                for c in first() if first is not None else []:
                    yield sse({**c, "usage": usage()} if continuous else c)
                # (closed on leaving: aborts the unfinished choices at once, an error too)
                async with aclosing(merged(streams, request)) as outs:
                    async for i, out in outs:
                        out = add(i, out)
                        if (err := failure(out.finish_reason, out.error)) is not None:
                            observe(out.finish_reason)  # the choices still going end with it
                            yield sse(err.body())  # the openai client raises APIError on it
                            yield "data: [DONE]\n\n"  # the stream's end, as in vLLM
                            return
                        if (c := chunk(i, out)) is not None:
                            if out.finished:
                                c["choices"][0]["stop_reason"] = self.stop_reason(
                                    results[i], choices[i].params
                                )
                            yield sse({**c, "usage": usage()} if continuous else c)
                if any(r.finish_reason is None for r in results):  # the client left
                    return
                observe()
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"
            except Exception as e:  # after the 200 went out: an error event, not a cut connection
                logger.exception("error in a stream")
                observe("error")  # the choices still going end with it
                err = e if isinstance(e, APIError) else APIError(
                    500, "internal server error", type_="server_error"
                )  # fmt: skip
                yield sse(err.body())
                yield "data: [DONE]\n\n"
            finally:  # also when the response is cancelled on a disconnect
                observe("abort")

        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _wrap_seed(seed: int) -> int:
    """``seed + j`` kept in int64 (SamplingParams' range), wrapping like the C type would."""
    return (seed + 2**63) % 2**64 - 2**63
