"""Structured output: a request's ``SamplingParams.grammar`` (an llguidance grammar, e.g. from a
JSON schema) applied as a token mask before sampling.

llguidance (small, dependency-free Rust wheels; its matcher is what vLLM and SGLang also offer)
keeps one matcher per request. Each decode step the matcher consumes the tokens its request gained
since the last step, fills a bit per allowed token into a pinned host buffer, and the buffer goes to
the device in one copy, where disallowed tokens' logits become -inf; after the grammar is complete
only EOS is allowed. NOTE: the mask is computed on the host from the grammar state, so this is the
one part of sampling that needs the sampled tokens on the host first: it runs between steps, at the
step's existing sync, never inside the captured graph. A matcher is dropped once a step runs
without its request and rebuilt from the request's tokens if it returns (as the sampling controls'
state is). The import is lazy: llguidance is needed only when a request has a grammar.

A grammar with ``SamplingParams.grammar_after_reasoning`` (thinking mode, as vLLM's structured
output waits for its reasoning parser) starts after the reasoning: until the output's text holds
``</think>`` (found as ``runtime.reasoning`` splits the reply, so also when ``</think>`` spans
several tokens) no mask is applied and no matcher exists; the grammar starts, fresh, at the token
after the one that completed ``</think>``, and a rebuild finds that token again from the output.
NOTE: text a token carries after ``</think>`` (only with a tokenizer that has no ``</think>``
token of its own; DeepSeek-V3.2's has) is left outside the grammar, as in vLLM, which starts at
the next token id too: it stays at the head of the content.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from runtime.reasoning import ReasoningStream

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from runtime.request import Request
    from runtime.tokenizer import Tokenizer


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object). Raises ``ValueError``
    when llguidance is missing or the schema is not a JSON object."""
    ll = _llguidance()
    try:
        # NOTE: compact separators, no free whitespace: with flexible whitespace a weak model
        # can pad forever and never finish the object (a schema's x-guidance may still ask)
        return ll.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False},
        )
    except (ValueError, TypeError) as e:
        raise ValueError(f"not a JSON schema: {e}") from e


def json_schema_problem(schema: dict[str, Any]) -> str | None:
    """Why llguidance cannot compile the JSON schema ``schema`` (None: it can), e.g. a ``$ref``
    to a definition it does not have. Raises ``ValueError`` when llguidance is missing."""
    ll = _llguidance()
    msg = ll.LLMatcher.validate_grammar(ll.grammar_from("json_schema", json.dumps(schema)))
    return msg if msg and not msg.startswith("WARNING") else None


def lark_grammar(text: str) -> str:
    """The llguidance grammar of a Lark grammar in llguidance's dialect (``ValueError`` when
    llguidance is missing or the text does not parse)."""
    try:
        return _llguidance().grammar_from("lark", text)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"the grammar does not parse: {e}") from e


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # an optional dependency: only structured output needs it
        raise ValueError(
            "structured output needs the llguidance package (pip install llguidance)"
        ) from e
    return llguidance


@dataclass
class _Grammar:
    """One request's grammar state. ``start``: the output index the grammar starts at (None while
    a ``grammar_after_reasoning`` request is still reasoning, ``thinking`` then reads its text);
    ``seen``: output tokens read so far (by ``thinking`` before the start, by ``matcher`` after);
    ``logged``: the matcher's failure is already logged."""

    start: int | None
    matcher: Any = None
    seen: int = 0
    logged: bool = False
    thinking: ReasoningStream = field(default_factory=ReasoningStream)


class StructuredOutput:
    """Callable ``(requests, logits [B, V]) -> logits``: masks the rows of requests that have a
    grammar (a new tensor then; the input unchanged), else returns the input."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_id: int | None):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab_size, eos_token_id
        self._lltok: Any = None
        # request id -> its grammar's state (the matcher once the grammar has started)
        self.matchers: dict[str, _Grammar] = {}

    def lltokenizer(self) -> Any:
        if self._lltok is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            ll = _llguidance()
            self._lltok = ll.LLTokenizer(
                self.tokenizer._tok.to_str(), n_vocab=self.vocab, eos_token=self.eos
            )
        return self._lltok

    def check(self, grammar: str) -> None:
        """``ValueError`` naming the problem when ``grammar`` does not compile, or when the model
        has no EOS token (a finished grammar could not end the request)."""
        if self.eos is None:
            raise ValueError("structured output needs a model with an EOS token (eos_token_id)")
        ll = _llguidance()
        msg = ll.LLMatcher.validate_grammar(grammar, self.lltokenizer())
        if msg and not msg.startswith("WARNING"):
            raise ValueError(f"the grammar does not compile: {msg}")

    def __call__(self, requests: Sequence[Request], logits: torch.Tensor) -> torch.Tensor:
        live = {r.request_id for r in requests if r.params.grammar is not None}
        for rid in [k for k in self.matchers if k not in live]:
            del self.matchers[rid]
        rows = [i for i, r in enumerate(requests) if self._started(r) is not None]
        if not rows:
            return logits
        ll = _llguidance()
        from llguidance.torch import fill_next_token_bitmask

        words = (self.vocab + 31) // 32
        bits = torch.full((len(rows), words), -1, dtype=torch.int32)
        if logits.is_cuda:
            bits = bits.pin_memory()
        for k, i in enumerate(rows):
            r = requests[i]
            g = self.matchers[r.request_id]
            if g.matcher is None:
                g.matcher = ll.LLMatcher(self.lltokenizer(), r.params.grammar, log_level=0)
            matcher = g.matcher
            matcher.consume_tokens(r.output_ids[g.seen :])
            g.seen = len(r.output_ids)
            if not matcher.is_error() and self.eos is not None:
                fill_next_token_bitmask(matcher, bits, k)
            if matcher.is_error() or self.eos is None:
                # (a token forced off the grammar by a logits processor, a parser limit met while
                # consuming or computing the mask): end the request with EOS rather than fail
                # the step, and so every request in it
                if matcher.is_error() and not g.logged:
                    g.logged = True
                    logger.warning(
                        "request %s: the grammar matcher failed (%s); the request ends here with "
                        "EOS and its output may not match the grammar",
                        r.request_id,
                        matcher.get_error(),
                    )
                bits[k] = 0
                if self.eos is not None:
                    word, bit = divmod(self.eos, 32)
                    bits[k, word] = -(2**31) if bit == 31 else 1 << bit
        mask = bits.to(logits.device, non_blocking=True)  # [A, W] int32
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((mask[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, : logits.shape[1]]
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        masked = logits[index].masked_fill(allowed == 0, float("-inf"))
        return logits.index_put((index,), masked)

    def _started(self, r: Request) -> int | None:
        """The output index ``r``'s grammar starts at, None while it has not (no grammar, or a
        ``grammar_after_reasoning`` one before ``</think>``). Reads the output's text from where
        it left off, so a state rebuilt after a drop finds the same start."""
        if r.params.grammar is None:
            return None
        g = self.matchers.get(r.request_id)
        if g is None:
            g = _Grammar(None if r.params.grammar_after_reasoning else 0)
            self.matchers[r.request_id] = g
        while g.start is None and g.seen < len(r.output_ids):
            # (a token's own bytes: one ending inside a UTF-8 character cannot hide the ASCII
            # of </think>, whose bytes never occur inside another character's)
            piece = self._token_bytes(r.output_ids[g.seen]).decode(errors="replace")
            g.thinking.feed(piece)
            g.seen += 1
            if not g.thinking.thinking:  # this token completed </think>
                g.start = g.seen
        return g.start

    def _token_bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        return self.tokenizer.token_bytes(token_id)
