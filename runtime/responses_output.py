"""A Responses API response built from a chat request's engine outputs: its output items (a
``reasoning`` item in thinking mode, a ``message``, ``function_call`` items) and, streamed, the
events the openai client's typed stream parses (``response.created`` ... ``response.completed``,
or ``response.failed`` when the request fails after the stream began).

The reply is read by ``runtime.chat_reply.ReplyStream`` whether it is streamed or not, so the
response a stream ends with is the one a non-streamed request gets.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from runtime.chat_reply import ReplyStream
from runtime.engine import StepOutput
from runtime.openai_protocol import APIError
from runtime.outputs import RequestOutput
from runtime.responses_protocol import ResponsesRequest
from runtime.sampling_params import SamplingParams
from runtime.tool_calls import ToolCall, ToolPlan

Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """Feed it the engine's outputs of one request (``feed``), then ``finish``; each returns the
    stream's events so far. ``response`` is the response object at any point."""

    def __init__(
        self,
        rid: str,
        req: ResponsesRequest,
        params: SamplingParams,
        in_reasoning: bool,
        plan: ToolPlan | None,
    ) -> None:
        self.rid, self.req, self.params = rid, req, params
        self.created_at = int(time.time())
        self.reply = ReplyStream(in_reasoning, plan)
        self.output: list[dict[str, Any]] = []  # the items, open or done
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.text = ""  # the open item's text so far
        self.seq = 0
        self.reasoning_tokens = 0  # the tokens of the steps that ended inside the reasoning
        self.calls: list[ToolCall] = []  # parsed at the end
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.failure: dict[str, str] | None = None  # the response's error, once it failed

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]  # fmt: skip

    def feed(self, out: StepOutput) -> list[Event]:
        if self.reply.thinking:
            self.reasoning_tokens += len(out.new_token_ids)
        part = self.reply.feed(out.new_text, out.finished)
        events: list[Event] = []
        if part.reasoning:
            events += self._delta("reasoning", part.reasoning)
        if part.content:
            events += self._delta("message", part.content)
        if out.finished:
            self.calls = part.calls
        return events

    def finish(self, res: RequestOutput, cached: int | None) -> list[Event]:
        """``res``: the finished request; ``cached``: its prompt tokens from the prefix cache
        (None: the engine caches none)."""
        incomplete = res.finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        if not self.output and not self.calls:  # (an empty reply is an empty message)
            events += self._open("message") + self._close("completed")
        for call in self.calls:
            item = {"type": "function_call", "id": _item_id("fc"), "call_id": call.id,
                    "name": call.name, "arguments": "", "status": "in_progress"}  # fmt: skip
            k = len(self.output)
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=k, item=item))
            where = {"item_id": item["id"], "output_index": k}
            delta = call.arguments
            events.append(self._event("response.function_call_arguments.delta", **where,
                                      delta=delta))  # fmt: skip
            events.append(self._event("response.function_call_arguments.done", **where,
                                      arguments=delta))  # fmt: skip
            item.update(arguments=delta, status="completed")
            events.append(self._event("response.output_item.done", output_index=k, item=item))
        self.status = "incomplete" if incomplete else "completed"
        p, c = res.prompt_tokens, res.completion_tokens
        self.usage = {
            "input_tokens": p,
            # (cache_write_tokens: required by the openai client's types; this server bills none)
            "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
            "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": p + c,
        }
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, self._event(kind, response=self.response())]

    def response(self) -> dict[str, Any]:
        req = self.req
        effort = (req.reasoning or {}).get("effort")
        cut = self.status == "incomplete"
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": self.failure,
            "model": req.model,
            "output": [dict(x) for x in self.output],
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "tools": req.tools or [],
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "reasoning": None if req.reasoning is None else {"effort": effort, "summary": None},
            "store": False,
            "background": False,
            "previous_response_id": None,
            "truncation": "disabled",
            "user": req.user,
            "usage": self.usage,
        }

    # ---- the open item: a reasoning item's or a message's text, streamed ---------------------
    def _delta(self, kind: str, delta: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed") + self._open(kind)
        self.text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else (
            "response.output_text.delta")  # fmt: skip
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, self._event(name, **self._where(), delta=delta, **extra)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1,
                "content_index": 0}  # fmt: skip

    def _part(self) -> dict[str, Any]:
        assert self.open is not None
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return _text_part(self.text)

    def _open(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
        else:
            item = {"type": "message", "id": _item_id("msg"), "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
        self.output.append(item)
        self.open, self.text = item, ""
        added = self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=dict(item))  # fmt: skip
        part = self._event("response.content_part.added", **self._where(), part=self._part())
        return [added, part]

    def _close(self, status: str) -> list[Event]:
        item = self.open
        if item is None:
            return []
        where, part = self._where(), self._part()
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=self.text)
        else:
            done = self._event("response.output_text.done", **where, text=self.text, logprobs=[])
        item.update(content=[part], status=status)
        self.open = None
        return [
            done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=where["output_index"],
                        item=dict(item)),
        ]  # fmt: skip

    def error(self, err: APIError) -> list[Event]:
        """The stream's last events when the request failed after the stream began: the open
        item closed ``incomplete``, then ``response.failed``, its response ``failed`` with the
        ``error`` (``code``, ``message``), as the Responses API ends a response that fails."""
        events = self._close("incomplete")
        self.status = "failed"
        code = "server_error" if err.status >= 500 else err.code or err.type  # (the API's code)
        self.failure = {"code": code, "message": err.message}
        return [*events, self._event("response.failed", response=self.response())]

    def _event(self, kind: str, **fields: Any) -> Event:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}
