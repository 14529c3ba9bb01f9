"""The server's plain ASGI middlewares: API key, request-body cap, request ids, concurrency limit.

Plain ASGI (not ``BaseHTTPMiddleware``) so that ``receive``, which the handlers poll to notice a
client that left, reaches them untouched once the body is read, and streamed responses pass
through without buffering.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.messages_protocol import MESSAGES_PATH, error_response
from runtime.openai_protocol import APIError

# The routes that run a generation: the ones the concurrency limit counts.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", MESSAGES_PATH)


async def _refuse(err: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer ``err`` in the shape of the route asked for (Anthropic's on the Messages route)."""
    await error_response(err, scope["path"])(scope, receive, send)


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header) on
    ``/v1/*``, checked before the body is read."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.key = app, None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is not None and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            given = headers.get(b"x-api-key")
            if not bearer and not (given is not None and hmac.compare_digest(given, self.key)):
                msg = (
                    "invalid or missing API key (expected Authorization: Bearer <key> or "
                    "x-api-key: <key>)"
                )
                await _refuse(APIError(401, msg, code="invalid_api_key"), scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A 413 for a request body over ``max_bytes``, before any of it is parsed.

    The body is read here (at most ``max_bytes`` of it are held) and replayed to the app; later
    ``receive`` calls go to the server, so disconnect detection still works. A declared
    Content-Length over the cap is refused without reading anything."""

    def __init__(self, app: ASGIApp, max_bytes: int | None) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.max_bytes is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = f"the request body is over the server's limit of {self.max_bytes} bytes"
        await _refuse(APIError(413, msg, code="request_too_large"), scope, receive, send)


class RequestIdMiddleware:
    """Echo the client's ``X-Request-Id`` (or a new one) on every response, for log matching."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        # A header value echoed back must stay one printable line of bounded size.
        ok = 0 < len(given) <= 128 and all(0x21 <= c <= 0x7E for c in given)
        rid = given if ok else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ConcurrencyLimitMiddleware:
    """At most ``limit`` generation requests in flight (a stream counts until it ends); one more
    gets a 429 with ``Retry-After``, rather than queueing without bound. While ``accepting()``
    is false (the server drains or has stopped) nothing is counted: the request goes on to its
    handler, whose 503 says the server is going away, so no client is told to retry here."""

    def __init__(
        self, app: ASGIApp, limit: int | None, accepting: Callable[[], bool] = lambda: True
    ) -> None:
        self.app, self.limit, self.active, self.accepting = app, limit, 0, accepting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        counted = (
            self.limit is not None
            and scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope["path"] in GENERATION_PATHS
        )
        if not counted or not self.accepting():
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            msg = f"the server is at its limit of {self.limit} concurrent requests; retry later"
            err = APIError(429, msg, code="too_many_requests", type_="server_error")
            resp = error_response(err, scope["path"])
            resp.headers["Retry-After"] = "1"
            await resp(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
