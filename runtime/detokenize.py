"""When a request stops, and the text it streams: EOS, stop token ids, stop strings, max_tokens."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from model.config import ModelConfig
from runtime.sampling_params import UNREAD_HINT, SamplingParams
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer


def eos_ids(
    model_config: ModelConfig, tokenizer: Tokenizer | None, generation_config: Any = None
) -> frozenset[int]:
    """The ids that end a request as its EOS (unless ``ignore_eos``), those vLLM stops on:
    config.json's ``eos_token_id`` (all of a list), the tokenizer's EOS and, given the parsed
    ``generation_config.json`` (None: the file is not read), its ``eos_token_id`` (an id or a
    list). V3.2 names id 1 in all three."""
    ids = {model_config.eos_token_id, *model_config.eos_token_ids}
    vocab = model_config.vocab_size
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        tokenizer.check_vocab(vocab)  # (an EOS past it: an IndexError in every masking step)
        ids.add(tokenizer.eos_token_id)
    gen = generation_config.get("eos_token_id") if isinstance(generation_config, dict) else None
    more = gen if isinstance(gen, list) else [] if gen is None else [gen]
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in more):
        # (an id past the vocabulary would fail every decode step that masks EOS, min_tokens')
        raise ValueError(
            f"generation_config.json field 'eos_token_id': expected a token id in [0, {vocab}) "
            f"or a list of them, got {gen!r} {UNREAD_HINT}"
        )
    return frozenset(ids | set(more))


class RequestDetokenizer:
    """Feeds a request's generated tokens to the incremental detokenizer and decides when it
    finishes. Without a tokenizer (benchmarks) only token-level rules apply and no text is made.
    ``stop_string``: the stop string that ended the request (None: it ended otherwise, or goes
    on), as the stop checker matched it, min_tokens' rule included."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        params: SamplingParams,
        prompt_ids: list[int],
        eos_token_ids: Collection[int],
    ):
        self.params = params
        self.eos = eos_token_ids
        self.stop_string: str | None = None
        self.detok = (
            IncrementalDetokenizer(
                tokenizer,
                params.stop,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                min_tokens=params.min_tokens,
            )
            if tokenizer is not None
            else None
        )

    def add(self, token_id: int, num_generated: int) -> tuple[str, str | None]:
        """Returns (text delta, finish reason or None)."""
        p = self.params
        if (token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids:
            return (self.detok.flush() if self.detok else ""), "stop"
        text = self.detok.add(token_id) if self.detok else ""
        if self.detok is not None and self.detok.stopped:
            self.stop_string = self.detok.stop_string
            return text, "stop"
        if num_generated >= p.max_tokens:
            if self.detok is None:
                return text, "length"
            text += self.detok.flush()
            # the held-back tail (an unfinished character) may complete a stop string only now
            self.stop_string = self.detok.stop_string
            return text, "stop" if self.detok.stopped else "length"
        return text, None
