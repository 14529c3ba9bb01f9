"""The ``POST /v1/responses`` route body (the OpenAI Responses API): the request translated into
a chat request (``runtime.responses_protocol``), run as the chat route runs one
(``ChatHandlers.prepare_chat``: prompt, sampling parameters, grammar), and answered as a response
object or its event stream (``runtime.responses_output``)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.engine import StepOutput
from runtime.openai_protocol import APIError
from runtime.outputs import RequestOutput
from runtime.responses_output import Event, ResponseBuilder
from runtime.responses_protocol import ResponsesRequest, chat_request, check_responses, renamed
from runtime.server_chat import ChatHandlers
from runtime.server_streams import failure, outputs, sse

logger = logging.getLogger(__name__)


class ResponsesHandlers(ChatHandlers):
    """``/v1/responses`` over the chat route's preparation."""

    async def responses(self, req: ResponsesRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        check_responses(req)
        chat, where = chat_request(req)
        rid = f"resp_{uuid.uuid4().hex}"
        try:  # (the chat route's errors, in the names the client sent)
            run = await self.prepare_chat(chat)
            [stream] = await self.start(rid, run.choices, run.grammar_param)
        except APIError as e:
            raise renamed(e, where) from e
        choice = run.choices[0]
        build = ResponseBuilder(rid, req, choice.params, run.in_reasoning, run.plan)
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

        if not req.stream:
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
                            yield sse(build.error(err), "error")
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
                yield sse(build.error(err), "error")
            finally:  # also when the response is cancelled on a disconnect
                observe("abort")

        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
