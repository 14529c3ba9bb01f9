"""The run of a request translated into a chat request (the Responses API's, Anthropic's
Messages'): prepared as the chat route prepares one (``ChatHandlers.prepare_chat``), then its one
reply answered as a whole object or as its route's named SSE events, by a ``ReplyBuilder`` of the
route's shapes. The route's errors keep the client's field names (its ``renamed``)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.engine import StepOutput
from runtime.openai_protocol import APIError, ChatCompletionRequest
from runtime.outputs import RequestOutput
from runtime.server_chat import ChatHandlers, ChatRun
from runtime.server_streams import failure, outputs, sse

Event = dict[str, Any]  # one SSE event's data; its "type" is the event's name
logger = logging.getLogger(__name__)


class ReplyBuilder(Protocol):
    """A route's reply from one request's engine outputs: each call returns the stream's events
    so far; ``response`` is the whole object (after ``finish``); ``error`` the stream's last
    events when the request fails after the stream began (an engine failure, a shutdown's
    abort, an error in the handler)."""

    def start(self) -> list[Event]: ...
    def feed(self, out: StepOutput) -> list[Event]: ...
    def finish(self, res: RequestOutput, cached: int | None) -> list[Event]: ...
    def response(self) -> dict[str, Any]: ...
    def error(self, err: APIError) -> list[Event]: ...


class TranslatedHandlers(ChatHandlers):
    """What the translated routes share: the run of the chat request, whole or streamed."""

    async def run_translated(
        self,
        chat: ChatCompletionRequest,
        rid: str,
        request: Request,
        builder: Callable[[ChatRun], ReplyBuilder],
        renamed: Callable[[APIError], APIError],
    ) -> Response:
        t0 = time.perf_counter()
        try:  # (the chat route's errors, in the names the client sent)
            run = await self.prepare_chat(chat)
            [stream] = await self.start(rid, run.choices, run.grammar_param)
        except APIError as e:
            raise renamed(e) from e
        choice = run.choices[0]
        build = builder(run)
        res, times = RequestOutput(), []
        observed = False

        def add(out: StepOutput) -> list[Event]:
            res.add(out)
            if out.new_token_ids:
                times.append(time.perf_counter())
            return build.feed(out)

        def observe(unfinished: str | None = None) -> None:
            """Record the request once (``unfinished``: the reason it ended with, if it did not
            finish: "abort" when the client left)."""
            nonlocal observed
            if observed:
                return
            observed = True
            if unfinished is not None and res.finish_reason is None:
                res.finish_reason, res.prompt_tokens = unfinished, len(choice.ids)
            if res.finish_reason is not None:
                self.metrics.observe(res, t0, time.perf_counter(), times)

        def finish() -> list[Event]:
            cached = res.cached_tokens if self.engine.caches_prefixes else None
            return build.finish(res, cached)

        if not chat.stream:
            async with aclosing(outputs(stream, request)) as outs:  # (leaving aborts it)
                async for out in outs:
                    add(out)
            if res.finish_reason is None:  # the client left
                observe("abort")
                return Response(status_code=499)
            observe()
            if (err := failure(res.finish_reason, res.error)) is not None:
                raise err
            finish()
            return JSONResponse(build.response())

        async def events() -> AsyncIterator[str]:
            try:
                for e in build.start():
                    yield sse(e, e["type"])
                # (closed on leaving: aborts the request at once)
                async with aclosing(outputs(stream, request)) as outs:
                    async for out in outs:
                        for e in add(out):
                            yield sse(e, e["type"])
                        if (err := failure(out.finish_reason, out.error)) is not None:
                            observe(out.finish_reason)
                            for e in build.error(err):
                                yield sse(e, e["type"])
                            return
                if res.finish_reason is None:  # the client left
                    return
                observe()
                for e in finish():
                    yield sse(e, e["type"])
            except Exception as e:  # after the 200 went out: an error event, not a cut connection
                logger.exception("error in a stream")
                observe("error")
                err = e if isinstance(e, APIError) else APIError(
                    500, "internal server error", type_="server_error"
                )  # fmt: skip
                for e in build.error(err):
                    yield sse(e, e["type"])
            finally:  # also when the response is cancelled on a disconnect
                observe("abort")

        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
