"""OpenAI-compatible HTTP server over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). Every client error is an
OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.async_engine import AsyncEngine, RequestStream
from runtime.engine import StepOutput
from runtime.openai_protocol import (
    CONTEXT_CODE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
    sampling_params,
    validation_error,
)
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _failure(reason: str | None) -> APIError | None:
    if reason == "error":
        return APIError(500, "generation failed in the engine", type_="server_error")
    if reason == "abort":
        return APIError(503, "the request was aborted (server shutting down)", type_="server_error")
    return None


async def _outputs(stream: RequestStream, request: Request) -> AsyncIterator[StepOutput]:
    """The stream's outputs; stops early, aborting the request, if the client disconnects."""
    # NOTE: nothing tells a handler that its client left: a non-streaming one never writes before
    # the end, and a streaming one only learns it when a write fails. So poll, whether or not
    # outputs arrive meanwhile.
    task: asyncio.Future[StepOutput] | None = None
    last_poll = time.monotonic()
    try:
        while True:
            task = asyncio.ensure_future(stream.__anext__())
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if time.monotonic() - last_poll >= DISCONNECT_POLL_S:
                    last_poll = time.monotonic()
                    if await request.is_disconnected():
                        logger.info("client disconnected: aborting %s", stream.request_id)
                        return
                if done:
                    break
            try:
                out = task.result()
            except StopAsyncIteration:
                return
            yield out
            if out.finished:
                return
    finally:
        if task is not None and not task.done():
            task.cancel()
        await stream.aclose()  # no-op if finished; otherwise aborts: frees the request's slots


class _Metrics:
    """Prometheus metrics in a registry of their own (several apps can live in one process)."""

    GAUGES = {  # engine.metrics() key -> (metric name, help)
        "running": ("echo_running_requests", "Requests being decoded"),
        "waiting": ("echo_waiting_requests", "Requests waiting for admission"),
        "tokens_per_s": ("echo_tokens_per_second", "Recent generation throughput"),
        "host_pool_usage": ("echo_host_pool_usage", "Fraction of the host KV pool in use"),
        "gpu_pool_usage": ("echo_gpu_pool_usage", "Fraction of the GPU KV pools in use"),
        "recalled_rows_per_step": ("echo_recalled_rows_per_step", "KV rows recalled per step"),
    }

    def __init__(self) -> None:
        r = self.registry = prom.CollectorRegistry()
        self.gauges = {k: prom.Gauge(n, h, registry=r) for k, (n, h) in self.GAUGES.items()}
        self.hit_rate = prom.Gauge("echo_gpu_pool_hit_rate", "GPU pool hits", ["layer"], registry=r)
        self.tokens = prom.Counter("echo_generation_tokens", "Generated tokens", registry=r)
        self.prefetch = {  # per-layer prefetch metrics (docs/prefetch.md)
            k: prom.Gauge(f"echo_{k}", h, ["layer"], registry=r)
            for k, h in (("prefetched_per_step", "KV rows staged by prefetch per step"),
                         ("prefetch_precision", "Staged rows then selected / staged"),
                         ("prefetch_coverage", "Misses served from staging / misses"))
        }  # fmt: skip
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
        self.latency = prom.Histogram(
            "echo_request_latency_seconds",
            "End-to-end request latency",
            registry=r,
            buckets=buckets,
        )
        self._tokens_seen = 0

    def update(self, snapshot: dict[str, Any], tokens_total: int) -> None:
        for key, gauge in self.gauges.items():
            if isinstance(snapshot.get(key), (int, float)):
                gauge.set(snapshot[key])
        for layer, rate in enumerate(snapshot.get("hit_rate") or []):
            self.hit_rate.labels(layer=str(layer)).set(rate)
        for key, gauge in self.prefetch.items():
            for layer, v in enumerate(snapshot.get(key) or []):
                gauge.labels(layer=str(layer)).set(v)
        self.tokens.inc(max(tokens_total - self._tokens_seen, 0))
        self._tokens_seen = max(tokens_total, self._tokens_seen)


Chunk = Callable[[StepOutput], "dict[str, Any] | None"]


class _Handlers:
    """The route bodies, sharing the engine, the tokenizer and the metrics."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.tokenizer
        self.metrics = _Metrics()

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            msg = f"the model {name!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, msg, param="model", code="model_not_found")

    def max_tokens(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        """Reject prompt + max_tokens over the context; a missing max_tokens (chat) becomes what
        the context leaves. Other bad values are left to SamplingParams to name."""
        limit = self.engine.max_model_len
        head = f"This model's maximum context length is {limit} tokens. However, "
        if max_tokens is None:
            if n_prompt >= limit:
                msg = f"your prompt has {n_prompt} tokens, which leaves no room for a completion."
                raise APIError(400, head + msg, param=param, code=CONTEXT_CODE)
            return limit - n_prompt
        if max_tokens >= 1 and n_prompt + max_tokens > limit:
            msg = (
                f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                f"{max_tokens} for the completion)."
            )
            raise APIError(400, head + msg, param=param, code=CONTEXT_CODE)
        return max_tokens

    async def start(self, rid: str, ids: list[int], params: SamplingParams) -> RequestStream:
        try:
            return await self.engine.generate(rid, ids, params)
        except ValueError as e:  # the engine's verdict (context, host pool, ...): no known field
            raise APIError(400, str(e)) from e
        except RuntimeError as e:  # shut down
            raise APIError(503, str(e), type_="server_error") from e

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    async def respond(
        self,
        request: Request,
        stream: RequestStream,
        streaming: bool,
        include_usage: bool,
        head: dict[str, Any],
        chunk: Chunk,
        final: Callable[[RequestOutput], dict[str, Any]],
        t0: float,
        first: dict | None = None,
    ) -> Response:
        """Collect the outputs into one JSON response, or stream them as SSE chunks. ``t0``:
        when the request arrived (perf_counter), for the latency histogram."""
        if not streaming:
            res = RequestOutput()
            async for out in _outputs(stream, request):
                res.add(out)
            if res.finish_reason is None:  # the client left: nobody reads this
                return Response(status_code=499)
            self.metrics.latency.observe(time.perf_counter() - t0)
            if (err := _failure(res.finish_reason)) is not None:
                raise err
            return JSONResponse(final(res))

        async def events() -> AsyncIterator[str]:
            if first is not None:
                yield _sse(first)
            res = RequestOutput()
            async for out in _outputs(stream, request):
                res.add(out)
                if (err := _failure(out.finish_reason)) is not None:
                    yield _sse(err.body())  # the openai client raises APIError on it
                    return
                if (c := chunk(out)) is not None:
                    yield _sse(c)
            if res.finish_reason is None:  # the client left
                return
            self.metrics.latency.observe(time.perf_counter() - t0)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": res.usage()})
            yield "data: [DONE]\n\n"

        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        check_unsupported(req)
        if isinstance(req.prompt, str):
            ids = self.tokenizer.encode(req.prompt, add_bos=True)
        else:
            ids, vocab = list(req.prompt), self.tokenizer.vocab_size
            if not ids or any(not 0 <= i < vocab for i in ids):
                msg = f"prompt token ids must be a non-empty list of ids in [0, {vocab})"
                raise APIError(400, msg, param="prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # the OpenAI default
        params = sampling_params(req, max_tokens, logprobs=req.logprobs is not None)
        self.max_tokens(len(ids), max_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.start(rid, ids, params)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        offset = [0]  # text emitted so far, for text_offset

        def logprobs(token_ids: list[int], lps: list[float], start: int) -> dict | None:
            if req.logprobs is None:
                return None
            toks = self.token_strings(token_ids)
            offsets = [start + sum(len(t) for t in toks[:i]) for i in range(len(toks))]
            return {
                "tokens": toks,
                "token_logprobs": lps,
                "top_logprobs": None,
                "text_offset": offsets,
            }

        def chunk(out: StepOutput) -> dict[str, Any] | None:
            if not (out.new_text or out.finished or req.logprobs is not None):
                return None
            lp = logprobs(out.new_token_ids, out.new_logprobs or [], offset[0])
            offset[0] += len(out.new_text)
            choice = {
                "index": 0,
                "text": out.new_text,
                "logprobs": lp,
                "finish_reason": out.finish_reason,
            }
            return {**head, "choices": [choice]}

        def final(res: RequestOutput) -> dict[str, Any]:
            choice = {
                "index": 0,
                "text": res.text,
                "finish_reason": res.finish_reason,
                "logprobs": logprobs(res.token_ids, res.logprobs, 0),
            }
            return {**head, "choices": [choice], "usage": res.usage()}

        usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self.respond(request, stream, bool(req.stream), usage, head, chunk, final, t0)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        check_unsupported(req)
        try:
            text = self.tokenizer.apply_chat_template([m.model_dump() for m in req.messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        ids = self.tokenizer.encode(text, add_bos=False)  # the template writes the BOS itself
        requested = (
            req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        )
        max_tokens = self.max_tokens(len(ids), requested, "messages")
        params = sampling_params(req, max_tokens, logprobs=bool(req.logprobs))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.start(rid, ids, params)
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }

        def logprobs(token_ids: list[int], lps: list[float]) -> dict | None:
            if not req.logprobs:
                return None
            toks = self.token_strings(token_ids)
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(toks, lps, strict=True)
                ]
            }

        def chunk(out: StepOutput) -> dict[str, Any] | None:
            if not (out.new_text or out.finished or req.logprobs):
                return None
            delta = {"content": out.new_text} if out.new_text else {}
            choice = {
                "index": 0,
                "delta": delta,
                "finish_reason": out.finish_reason,
                "logprobs": logprobs(out.new_token_ids, out.new_logprobs or []),
            }
            return {**head, "choices": [choice]}

        def final(res: RequestOutput) -> dict[str, Any]:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": res.text},
                "logprobs": logprobs(res.token_ids, res.logprobs),
                "finish_reason": res.finish_reason,
            }
            return {**head, "object": "chat.completion", "choices": [choice], "usage": res.usage()}

        first_choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self.respond(
            request,
            stream,
            bool(req.stream),
            usage,
            head,
            chunk,
            final,
            t0,
            first={**head, "choices": [first_choice]},
        )

    async def prometheus(self) -> Response:
        try:
            snapshot = await self.engine.metrics()
        except Exception:  # still serve the counter and the histogram
            logger.exception("engine.metrics() failed")
            snapshot = {}
        self.metrics.update(snapshot, self.engine.generation_tokens_total)
        body = prom.generate_latest(self.metrics.registry)
        return Response(body, media_type=prom.CONTENT_TYPE_LATEST)


class _APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on ``/v1/*``. A plain ASGI middleware, so the key is
    checked before the body is parsed and ``receive`` (disconnect detection) is left untouched."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.key = app, None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is not None and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                msg = "invalid or missing API key (expected Authorization: Bearer <key>)"
                await APIError(401, msg, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine``, serving the model as ``model_name``.

    ``api_key``: when set, every ``/v1/*`` route needs ``Authorization: Bearer <api_key>``
    (``/health`` and ``/metrics`` stay open)."""
    app = FastAPI(title="echo-compile", docs_url=None, redoc_url=None, openapi_url=None)
    h = _Handlers(async_engine, model_name)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, "internal server error", type_="server_error").response()

    app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    app.post("/v1/completions")(h.completions)
    app.post("/v1/chat/completions")(h.chat)
    app.get("/metrics")(h.prometheus)

    @app.get("/v1/models")
    async def _models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "echo-compile",
            "max_model_len": async_engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def _health() -> Response:
        ok = async_engine.is_alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    return app


def serve(
    async_engine: AsyncEngine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
) -> None:
    """Serve until interrupted, then stop the engine loop."""
    try:
        app = build_app(async_engine, model_name, api_key)
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        async_engine.shutdown()
