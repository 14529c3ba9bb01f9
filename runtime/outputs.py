"""``RequestOutput``: one request's generation accumulated from its per-step ``StepOutput`` s, the
one accumulator behind offline ``generate()`` and the server's non-streaming responses."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection

    from runtime.engine import StepOutput
    from runtime.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # empty unless the request asked for them
    # per token, its params.top_logprobs most likely (token id, logprob); empty unless asked
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # per token, its own logprob in top_logprobs' distribution (StepOutput.new_top_chosen)
    top_chosen: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each output
    finish_reason: str | None = None  # None: not finished (or the stream was left early)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # params.prompt_logprobs: [None, (logprob, rank, top) of prompt token 1, ...]
    prompt_logprobs: list | None = None
    error: str | None = None  # finish_reason "error": what went wrong, when the engine says
    stop_string: str | None = None  # the stop string that ended it (StepOutput.stop_string)
    # the text's pieces, one per step, joined when ``text`` is read: ``str +=`` on an attribute
    # copies the whole text each step (CPython reuses the buffer only for a local), quadratic in
    # the output's length
    _pieces: list[str] = field(default_factory=list, repr=False)

    def add(self, out: StepOutput) -> None:
        if out.new_text:
            self._pieces.append(out.new_text)
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.top_logprobs += out.new_top_logprobs or []
        self.top_chosen += out.new_top_chosen or []
        self.token_times.append(time.perf_counter())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.error = out.error
        self.stop_string = out.stop_string

    @property
    def text(self) -> str:
        """The text so far (its pieces joined once, then kept joined)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def stop_reason(
        self, params: SamplingParams, eos_token_id: int | None, eos_token_ids: Collection[int]
    ) -> int | str | None:
        """vLLM's ``stop_reason`` for this request run with ``params`` by an engine whose EOS is
        ``eos_token_id`` (the tokenizer's; None: none) and whose EOS ids are ``eos_token_ids``:
        the stop token id or stop string that ended it; None for the tokenizer's EOS, a length
        limit, an error or an abort. As in vLLM, only the tokenizer's EOS is "EOS" there: its
        scheduler checks it first (``check_stop``), so a ``stop_token_ids`` entry that is that id
        reports None too (unless ``ignore_eos``), and the checkpoint's other EOS ids are folded
        into the request's ``stop_token_ids`` (``SamplingParams.update_from_generation_config``,
        unless ``ignore_eos``), so each reports its id. The stop string is the one the engine's
        stop checker matched (``stop_string``): with ``min_tokens`` an earlier occurrence of it,
        or of another, may lie in the text before it. The one rule behind the server's
        ``stop_reason`` and ``GenerationResult.stop_reason``."""
        if self.finish_reason != "stop" or not self.token_ids:
            return None
        last, eos_stops = self.token_ids[-1], not params.ignore_eos
        if eos_stops and last == eos_token_id:
            return None
        if last in params.stop_token_ids or (eos_stops and last in eos_token_ids):
            return last
        return self.stop_string

    def usage(self) -> dict[str, int]:
        p, c = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
