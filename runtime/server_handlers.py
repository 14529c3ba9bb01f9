"""The route bodies of the OpenAI-compatible server (``runtime.server`` wires them into the app):
``Handlers`` composes completions (``runtime.server_completions``), chat
(``runtime.server_chat``), responses (``runtime.server_responses``) and messages
(``runtime.server_messages``, both over chat's) over what they share (``runtime.server_base``),
and adds tokenize, detokenize and the Prometheus scrape."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import prometheus_client as prom
from fastapi.responses import PlainTextResponse, Response

from runtime.engine import EngineClosed
from runtime.openai_protocol import APIError, DetokenizeRequest, TokenizeRequest, continuation
from runtime.server_chat import request_thinking, tool_plan
from runtime.server_completions import CompletionHandlers
from runtime.server_messages import MessagesHandlers
from runtime.server_responses import ResponsesHandlers

logger = logging.getLogger(__name__)


class Handlers(CompletionHandlers, ResponsesHandlers, MessagesHandlers):
    """The route bodies, sharing the engine, the tokenizer and the metrics."""

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        if req.model is not None:
            self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None and (req.tools is not None or req.tool_choice is not None):
            raise APIError(400, "tools and tool_choice need messages, not prompt", param="tools")
        if req.prompt is not None:
            bos = req.add_special_tokens is not False
            ids = await self.encode(req.prompt, bos, "prompt", within_context=False)
        else:
            msgs = [m.model_dump() for m in req.messages or []]
            gen, cont = continuation(req)
            plan = tool_plan(req.tools, req.tool_choice)  # as the chat renders it
            thinking = request_thinking(req.chat_template_kwargs)
            ids = await self.encode_chat(msgs, gen, plan, False, thinking, cont)
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
        }
        if req.return_token_strs:
            # the vocabulary's pieces ("Ġworld"), as vLLM's convert_ids_to_tokens: not decoded
            body["token_strs"] = [self.tokenizer.token_piece(i) for i in ids]
        return body

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        if req.model is not None:
            self.check_model(req.model)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= i < vocab for i in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
        # special tokens kept, as vLLM's decode (HF's default): /tokenize's BOS comes back
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    async def prometheus(self) -> Response:
        try:
            snapshot = await self.engine.metrics()
        except EngineClosed as e:
            # a scrape during or after shutdown (or once a multi-rank engine failed): the target
            # is down, as /health says; one log line, not a traceback per scrape
            if not self._told_closed:
                self._told_closed = True
                logger.warning("/metrics answers 503 from now on: %s", str(e).splitlines()[0])
            return PlainTextResponse("engine stopped\n", status_code=503)
        except Exception:  # still serve the counter and the histogram
            logger.exception("engine.metrics() failed")
            snapshot = {}
        # The engine averages its last steps whatever their age; this rate falls to 0 when idle.
        snapshot["tokens_per_s"] = self.engine.tokens_per_s()
        self.metrics.update(snapshot, self.engine.generation_tokens_total)
        body = prom.generate_latest(self.metrics.registry)
        return Response(body, media_type=prom.CONTENT_TYPE_LATEST)
