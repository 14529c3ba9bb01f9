"""An Anthropic Messages API message built from a chat request's engine outputs: its content
blocks (a ``thinking`` block in thinking mode, a ``text`` block, ``tool_use`` blocks), its
``stop_reason`` and usage, and, streamed, Anthropic's events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). The
usage is Anthropic's: ``input_tokens`` the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those read from it, the same in ``message_start``, ``message_delta``
and the whole message.

The reply is read by ``runtime.chat_reply.ReplyStream`` whether it is streamed or not, so the
message a stream adds up to is the one a non-streamed request gets.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from runtime.chat_reply import ReplyStream
from runtime.engine import StepOutput
from runtime.messages_protocol import anthropic_body
from runtime.openai_protocol import APIError
from runtime.outputs import RequestOutput
from runtime.tool_calls import ToolPlan

Event = dict[str, Any]


class MessageBuilder:
    """Feed it the engine's outputs of one request (``feed``), then ``finish``; each returns the
    stream's events so far. ``response`` is the message at any point. ``stop_string``: the stop
    sequence that ended a finished request (None: it ended otherwise)."""

    def __init__(
        self,
        mid: str,
        model: str,
        n_prompt: int,
        in_reasoning: bool,
        plan: ToolPlan | None,
        stop_string: Callable[[RequestOutput], Any],
    ) -> None:
        self.mid, self.model, self.stop_string = mid, model, stop_string
        self.n_prompt = n_prompt
        self.reply = ReplyStream(in_reasoning, plan)
        self.content: list[dict[str, Any]] = []  # the blocks (the last one may be open)
        self.open = False
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, int] = _usage(n_prompt, 0, 0)
        self.started = False  # message_start was sent

    def start(self) -> list[Event]:
        """Nothing yet: ``message_start`` comes with the first output (``_begin``)."""
        return []

    def feed(self, out: StepOutput) -> list[Event]:
        events = self._begin(out.cached_tokens)
        part = self.reply.feed(out.new_text, out.finished)
        if part.reasoning:
            events += self._delta("thinking", part.reasoning)
        if part.content:
            events += self._delta("text", part.content)
        if out.finished:  # (the calls come once, at the end: each block whole)
            events += self._close()
        for call in part.calls:
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                     "name": call.name, "input": {}}  # fmt: skip
            events += self._open(block)
            block["input"] = json.loads(call.arguments)
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events.append(self._event("content_block_delta", delta=delta))
            events += self._close()
        return events

    def finish(self, res: RequestOutput, cached: int | None) -> list[Event]:
        """``res``: the finished request; ``cached``: its prompt tokens from the prefix cache
        (None: the engine caches none)."""
        stop = self.stop_string(res)
        if res.finish_reason == "length":
            self.stop_reason = "max_tokens"
        elif any(b["type"] == "tool_use" for b in self.content):
            self.stop_reason = "tool_use"
        elif isinstance(stop, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", stop
        else:
            self.stop_reason = "end_turn"
        events = self._begin(cached or 0)
        self.usage = _usage(res.prompt_tokens, res.completion_tokens, cached or 0)
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [
            *events,
            {"type": "message_delta", "delta": delta, "usage": dict(self.usage)},
            {"type": "message_stop"},
        ]

    def response(self) -> dict[str, Any]:
        return {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [dict(b) for b in self.content],
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": dict(self.usage),
        }

    def error(self, err: APIError) -> list[Event]:
        """The stream's ``error`` event, its last: the request failed after the stream began
        (``overloaded_error`` for a shutdown's 503, ``api_error`` for a 500)."""
        return [anthropic_body(err)]

    def _begin(self, cached: int) -> list[Event]:
        """``message_start`` and a ``ping``, once, before the first output's events. NOTE: it
        waits for that output because its usage splits the prompt into
        ``cache_read_input_tokens`` (``cached``: the prefix cache's hit, known once the request
        is scheduled) and ``input_tokens`` (the rest), as the final usage does: sent before, it
        could only say the whole prompt was uncached."""
        if self.started:
            return []
        self.started = True
        self.usage = _usage(self.n_prompt, 0, cached)
        return [{"type": "message_start", "message": self.response()}, {"type": "ping"}]

    # ---- the open block: the thinking's or the text's, streamed -------------------------------
    def _delta(self, kind: str, delta: str) -> list[Event]:
        events: list[Event] = []
        if not (self.open and self.content[-1]["type"] == kind):
            events += self._close()
            empty = {"type": kind, kind: ""}
            if kind == "thinking":  # (no signature: nothing here is signed)
                empty["signature"] = ""
            events += self._open(empty)
        self.content[-1][kind] += delta
        name = "thinking_delta" if kind == "thinking" else "text_delta"
        return [*events, self._event("content_block_delta", delta={"type": name, kind: delta})]

    def _open(self, block: dict[str, Any]) -> list[Event]:
        self.content.append(block)
        self.open = True
        return [self._event("content_block_start", content_block=dict(block))]

    def _close(self) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        return [self._event("content_block_stop")]

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "index": len(self.content) - 1, **fields}


def _usage(n_prompt: int, n_output: int, cached: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache."""
    return {
        "input_tokens": n_prompt - cached,
        "output_tokens": n_output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
