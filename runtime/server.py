"""OpenAI-compatible HTTP server over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``,
``POST /v1/messages`` (Anthropic's Messages API; all with SSE streaming),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET|HEAD /health``, ``GET /metrics`` (Prometheus),
``POST /tokenize``, ``POST /detokenize``, ``GET /version``. Every client error is an OpenAI-style
JSON body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (on
``/v1/messages``, Anthropic's ``{"type": "error", "error": {"type", "message"}}``). docs/server.md
describes the options, limits and metrics.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from runtime.async_engine import AsyncEngine
from runtime.messages_protocol import error_response
from runtime.openai_protocol import APIError, validation_error
from runtime.server_handlers import Handlers
from runtime.server_lifecycle import DEFAULT_GRACE_S, serve_app, server_url, startup_summary
from runtime.server_middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    ConcurrencyLimitMiddleware,
    RequestIdMiddleware,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # a 128K-token prompt is ~1 MB of text or of JSON ids


def build_app(
    async_engine: AsyncEngine,
    model_name: str | list[str],
    api_key: str | None = None,
    *,
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    max_concurrent: int | None = None,
    cors_origins: list[str] | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine``.

    - ``model_name``: the name(s) the model is served as; requests may use any of them.
    - ``api_key``: when set, every ``/v1/*`` route needs ``Authorization: Bearer <api_key>`` (or
      Anthropic's ``x-api-key: <api_key>``)
      (``/health``, ``/metrics``, ``/version``, ``/tokenize``, ``/detokenize`` stay open).
    - ``max_body_bytes``: a larger request body is refused with 413 before it is parsed.
    - ``max_concurrent``: at most this many generation requests at once; more get 429.
    - ``cors_origins``: allowed browser origins (``["*"]`` for any); None: no CORS headers.
    """
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"model_name must be a non-empty name or list of them, got {model_name!r}")
    if max_body_bytes is not None and max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1 or None, got {max_body_bytes}")
    if max_concurrent is not None and max_concurrent < 1:
        raise ValueError(f"max_concurrent must be >= 1 or None, got {max_concurrent}")
    app = FastAPI(title="echo-compile", docs_url=None, redoc_url=None, openapi_url=None)
    h = Handlers(async_engine, names)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(e, request.headers.get("content-type"))
        return error_response(err, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        err = APIError(500, "internal server error", type_="server_error")
        return error_response(err, request.url.path)

    # Added last = outermost. From the outside in: ids on every answer, CORS (preflights carry no
    # key), the key (before any body is read), the body cap, then the concurrency count (so a slow
    # upload holds no generation slot).
    app.add_middleware(
        ConcurrencyLimitMiddleware, limit=max_concurrent, accepting=lambda: async_engine.is_alive
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestIdMiddleware)
    app.post("/v1/completions")(h.completions)
    app.post("/v1/chat/completions")(h.chat)
    app.post("/v1/responses")(h.responses)
    app.post("/v1/messages")(h.messages)
    app.post("/v1/messages/count_tokens")(h.count_tokens)
    app.post("/tokenize")(h.tokenize)
    app.post("/detokenize")(h.detokenize)
    app.get("/metrics")(h.prometheus)

    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))

    def card(name: str) -> dict[str, Any]:
        # OpenAI's model object, and Anthropic's fields beside it (type, display_name, created_at)
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "echo-compile",
            "root": names[0],
            "max_model_len": async_engine.max_model_len,
            "type": "model",
            "display_name": name,
            "created_at": created_at,
        }

    @app.get("/v1/models")
    async def _models() -> dict[str, Any]:
        # (first_id, last_id, has_more: Anthropic's page; one page holds every name)
        return {"object": "list", "data": [card(n) for n in names], "first_id": names[0],
                "last_id": names[-1], "has_more": False}  # fmt: skip

    @app.get("/v1/models/{model_id:path}")
    async def _model(model_id: str) -> dict[str, Any]:
        h.check_model(model_id)
        return card(model_id)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def _health() -> Response:
        ok = async_engine.is_alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    @app.get("/version")
    async def _version() -> dict[str, str]:
        return {"version": _package_version()}

    return app


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("echo-compile")
    except PackageNotFoundError:  # run from a checkout that was not pip-installed
        return "unknown"


def serve(
    async_engine: AsyncEngine,
    model_name: str | list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    asked_max_len: int | None = None,
    sock: socket.socket | None = None,
    uvicorn_log_level: str = "info",
    **app_options: Any,
) -> None:
    """Serve until SIGTERM / Ctrl-C; then stop admitting, give in-flight requests ``grace_s``
    seconds, abort the rest, stop the engine loop and exit. ``app_options`` go to ``build_app``;
    ``asked_max_len``: the context the user asked for, so the start-up line can say when the
    engine gives less; ``sock``: ``host``:``port`` already bound (``bind_socket``, before the model
    loaded); ``uvicorn_log_level``: uvicorn's own log lines' level (its access lines are at
    info)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    try:
        app = build_app(async_engine, names, api_key, **app_options)
        url = server_url(host, port, sock)
        print(startup_summary(async_engine, ", ".join(names), asked_max_len, url), flush=True)
        serve_app(app, async_engine, host, port, grace_s, sock, uvicorn_log_level)
    finally:
        async_engine.shutdown()
