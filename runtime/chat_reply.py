"""A chat reply read into its parts: the reasoning (thinking mode, ``runtime.reasoning``), the
content, and the tool calls parsed from the content (``runtime.tool_calls``), whole or streamed.
The rules the chat route and the Responses route share: the reasoning comes first and the tool
parser sees the content only; a plan that is not parallel keeps the first call."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.reasoning import ReasoningStream, split_reasoning
from runtime.tool_calls import ToolCall, ToolCallStream, ToolPlan, parse_tool_calls


@dataclass
class Reply:
    reasoning: str | None  # None: not thinking mode ("" in a streamed delta)
    content: str | None  # None: no content (all reasoning, or only calls)
    calls: list[ToolCall] = field(default_factory=list)


def kept_calls(plan: ToolPlan | None, calls: list[ToolCall]) -> list[ToolCall]:
    """The calls a reply returns: all of them, or the first when the plan is not parallel
    (``parallel_tool_calls: false``, a named function)."""
    return calls if plan is None or plan.parallel else calls[:1]


def read_reply(text: str, in_reasoning: bool, plan: ToolPlan | None) -> Reply:
    """The parts of a whole reply (``in_reasoning``: it starts inside the reasoning)."""
    reasoning, content = split_reasoning(text) if in_reasoning else (None, text)
    if plan is None or content is None:
        return Reply(reasoning, content)
    content, found = parse_tool_calls(content, plan.names)
    return Reply(reasoning, content, kept_calls(plan, found))


class ReplyStream:
    """The streamed form of ``read_reply``: ``feed`` returns the parts' deltas that are safe to
    show (reasoning and content "" when none; the calls once, at the end). The deltas joined equal
    ``read_reply``'s parts ("" for None)."""

    def __init__(self, in_reasoning: bool, plan: ToolPlan | None) -> None:
        self.plan = plan
        self.thinker = ReasoningStream() if in_reasoning else None
        self.parser = ToolCallStream(plan.names) if plan is not None else None

    @property
    def thinking(self) -> bool:
        """Still inside the reasoning (``</think>`` not yet seen)."""
        return self.thinker is not None and self.thinker.thinking

    def feed(self, text: str, finished: bool) -> Reply:
        reasoning, calls = "", []
        if self.thinker is not None:  # the reasoning first; the tool parser sees the rest only
            reasoning, text = self.thinker.feed(text)
            if finished:
                reasoning += self.thinker.finish()[0]
        if self.parser is not None:  # the DSML block is held back and parsed at the end
            text = self.parser.feed(text)
            if finished:
                rest, found = self.parser.finish()
                text, calls = text + rest, kept_calls(self.plan, found)
        return Reply(reasoning, text, calls)
