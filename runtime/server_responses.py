"""The ``POST /v1/responses`` route body (the OpenAI Responses API): the request translated into
a chat request (``runtime.responses_protocol``), run as the chat route runs one
(``runtime.server_translated``), and answered as a response object or its event stream
(``runtime.responses_output``)."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from runtime.responses_output import ResponseBuilder
from runtime.responses_protocol import ResponsesRequest, chat_request, check_responses, renamed
from runtime.server_chat import ChatRun
from runtime.server_translated import TranslatedHandlers


class ResponsesHandlers(TranslatedHandlers):
    """``/v1/responses`` over the chat route's preparation."""

    async def responses(self, req: ResponsesRequest, request: Request) -> Response:
        self.check_model(req.model)
        check_responses(req)
        chat, where = chat_request(req)
        rid = f"resp_{uuid.uuid4().hex}"

        def builder(run: ChatRun) -> ResponseBuilder:
            params = run.choices[0].params
            return ResponseBuilder(rid, req, params, run.in_reasoning, run.plan)

        return await self.run_translated(chat, rid, request, builder, lambda e: renamed(e, where))
