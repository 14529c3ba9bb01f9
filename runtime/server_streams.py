"""Reading engine output streams for an HTTP response: disconnect detection, several choices (n,
a list of prompts) merged into one sequence, failures as API errors, SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from runtime.async_engine import RequestStream
from runtime.engine import StepOutput
from runtime.openai_protocol import APIError

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event (``event``: its name, as the Responses API names its events)."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def failure(reason: str | None, error: str | None = None) -> APIError | None:
    """The API error a finish reason means, if it is one (``error``: the engine's account of
    an "error", ``StepOutput.error``)."""
    if reason == "error":
        msg = "generation failed in the engine" + (f": {error}" if error else "")
        return APIError(500, msg, type_="server_error")
    if reason == "abort":
        msg = "the request was aborted: the server is shutting down (its grace period ended)"
        return APIError(503, msg, type_="server_error")
    return None


async def outputs(
    stream: RequestStream, request: Request, poll: bool = True
) -> AsyncIterator[StepOutput]:
    """The stream's outputs; stops early, aborting the request, if the client disconnects
    (checked when ``poll``)."""
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
                if poll and time.monotonic() - last_poll >= DISCONNECT_POLL_S:
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


async def merged(
    streams: Sequence[RequestStream], request: Request
) -> AsyncIterator[tuple[int, StepOutput]]:
    """``(choice index, output)`` of all streams as they come. Ends when every stream finished, or
    as soon as one ends unfinished (the client left): leaving early aborts every unfinished one."""
    queue: asyncio.Queue[tuple[int, StepOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            # every choice polls: choice 0 may finish first, and the others must still notice
            # a client that left
            async for out in outputs(stream, request, poll=True):
                queue.put_nowait((i, out))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    finished = [False] * len(streams)
    try:
        left = len(streams)
        while left:
            i, out = await queue.get()
            if out is None:
                if not finished[i]:
                    return  # the client left (or the stream was closed): stop them all
                left -= 1
                continue
            finished[i] = out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
