"""The ``POST /v1/messages`` route body (Anthropic's Messages API): the request translated into a
chat request (``runtime.messages_protocol``), run as the chat route runs one
(``runtime.server_translated``), and answered as a message or its event stream
(``runtime.messages_output``). Its errors are answered in Anthropic's shape by the app's
handlers (``messages_protocol.error_response``)."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from runtime.messages_output import MessageBuilder
from runtime.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    check_count,
    check_messages,
    format_field,
    renamed,
)
from runtime.openai_protocol import APIError
from runtime.outputs import RequestOutput
from runtime.server_chat import ChatRun
from runtime.server_translated import TranslatedHandlers


class MessagesHandlers(TranslatedHandlers):
    """``/v1/messages`` over the chat route's preparation."""

    async def messages(self, req: MessagesRequest, request: Request) -> Response:
        self.check_model(req.model)
        check_messages(req)
        chat, where = chat_request(req)
        fmt = format_field(req)
        mid = f"msg_{uuid.uuid4().hex}"

        def builder(run: ChatRun) -> MessageBuilder:
            choice = run.choices[0]

            def stop_string(res: RequestOutput) -> int | str | None:
                return self.stop_reason(res, choice.params)

            return MessageBuilder(
                mid, req.model, len(choice.ids), run.in_reasoning, run.plan, stop_string
            )

        return await self.run_translated(
            chat, mid, request, builder, lambda e: renamed(e, where, fmt)
        )

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        """``/v1/messages/count_tokens``: the prompt's tokens as ``messages`` renders it (its
        system, tools, thinking); a prompt past the context is the same 400 as there. Only the
        prompt is prepared (``chat_prompt``): no grammar is compiled."""
        self.check_model(req.model)
        check_messages(req)
        check_count(req)
        chat, where = chat_request(req)
        try:
            prompt = await self.chat_prompt(chat)
        except APIError as e:
            raise renamed(e, where, format_field(req)) from e
        return {"input_tokens": len(prompt.ids)}
