"""When a request stops, and the text it streams: EOS, stop token ids, stop strings, max_tokens."""

from __future__ import annotations

from runtime.sampling_params import SamplingParams
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestDetokenizer:
    """Feeds a request's generated tokens to the incremental detokenizer and decides when it
    finishes. Without a tokenizer (benchmarks) only token-level rules apply and no text is made."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        params: SamplingParams,
        prompt_ids: list[int],
        eos_token_id: int | None,
    ):
        self.params = params
        self.eos = eos_token_id
        self.detok = (
            IncrementalDetokenizer(tokenizer, params.stop, prompt_ids)
            if tokenizer is not None
            else None
        )

    def add(self, token_id: int, num_generated: int) -> tuple[str, str | None]:
        """Returns (text delta, finish reason or None)."""
        p = self.params
        if (token_id == self.eos and not p.ignore_eos) or token_id in p.stop_token_ids:
            return (self.detok.flush() if self.detok else ""), "stop"
        text = self.detok.add(token_id) if self.detok else ""
        if self.detok is not None and self.detok.stopped:
            return text, "stop"
        if num_generated >= p.max_tokens:
            if self.detok is None:
                return text, "length"
            text += self.detok.flush()
            # the held-back tail (an unfinished character) may complete a stop string only now
            return text, "stop" if self.detok.stopped else "length"
        return text, None
