"""The reasoning of a thinking-mode reply (DeepSeek-V3.2's ``chat_template_kwargs`` ``thinking``)
split from its content, as vLLM's ``deepseek_v3`` reasoning parser splits it.

The prompt ends with ``<think>``, so the reply starts inside the reasoning and ``</think>`` ends
it: the text before is the reasoning, the text after the content (None when empty). A reply that
never writes ``</think>`` (``max_tokens`` hit, or a stop string, while thinking) is all
reasoning, its content None. The tool-call parser reads the content only. A grammar
(``response_format``, a forced tool call) constrains the content only: ``thinking_params``.
"""

from __future__ import annotations

import dataclasses

from runtime.chat_template import THINK_END
from runtime.sampling_params import SamplingParams


def thinking_params(params: SamplingParams) -> SamplingParams:
    """``params`` of a thinking-mode request (the server's chat route, ``LLM.chat``): a grammar
    starts after ``</think>`` (``grammar_after_reasoning``), as vLLM starts structured output
    after its reasoning parser sees the reasoning end; from the first token it would force the
    JSON or the call block into the reasoning."""
    if params.grammar is None or params.grammar_after_reasoning:
        return params
    return dataclasses.replace(params, grammar_after_reasoning=True)


def split_reasoning(text: str) -> tuple[str, str | None]:
    """``(reasoning, content)`` of a thinking-mode reply."""
    reasoning, end, content = text.partition(THINK_END)
    return reasoning, (content or None) if end else None


class ReasoningStream:
    """The streamed form of ``split_reasoning``: ``feed`` returns ``(reasoning, content)`` deltas
    that are safe to show (a tail that could start ``</think>`` is held back), ``finish`` the
    held-back rest. The deltas joined equal ``split_reasoning``'s parts ("" for None)."""

    def __init__(self) -> None:
        self.held, self.thinking = "", True

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.thinking:
            return "", delta
        text = self.held + delta
        reasoning, end, content = text.partition(THINK_END)
        if end:
            self.held, self.thinking = "", False
            return reasoning, content
        keep = _partial_end(text)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The held-back text: reasoning, since ``</think>`` never completed."""
        rest, self.held = self.held, ""
        return rest, ""


def _partial_end(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``</think>``."""
    for n in range(min(len(THINK_END) - 1, len(text)), 0, -1):
        if text.endswith(THINK_END[:n]):
            return n
    return 0
