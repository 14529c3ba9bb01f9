"""What ``LLM.generate()`` / ``LLM.chat()`` return for one request (``GenerationResult``, its
``RequestStats``), and how one request's step outputs are collected into it
(``ResultAccumulator``)."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from runtime.engine import StepOutput
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams


@dataclass
class RequestStats:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # time to first token
    latency_s: float  # arrival to finish
    itl_s: list[float] = field(default_factory=list)  # inter-token latencies


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None  # params.logprobs: each generated token's
    stats: RequestStats
    # params.top_logprobs > 0: per generated token, that many most likely (token id, logprob)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # params.prompt_logprobs: [None, (logprob, rank, top) of prompt token 1, ...]
    prompt_logprobs: list | None = None
    # finish_reason "error": why (no token left to sample: its own parameters or a logits
    # processor, named), as the server's error response says it; None otherwise
    error: str | None = None
    # vLLM's CompletionOutput.stop_reason: the stop token id (generation_config.json's other EOS
    # ids too) or stop string that ended it; None for the tokenizer's EOS, a length limit or an
    # error (RequestOutput.stop_reason, as the server's)
    stop_reason: int | str | None = None


class ResultAccumulator:
    """One request of a ``generate()`` call: its step outputs (``RequestOutput``) and arrival;
    ``eos_token_id`` (the tokenizer's) and ``eos_token_ids`` (``Engine.eos_token_ids``) are the
    engine's, for ``stop_reason``."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        eos_token_ids: Collection[int],
    ):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.eos_token_id, self.eos_token_ids = eos_token_id, eos_token_ids  # for stop_reason
        self.out = RequestOutput()
        self.t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.out.finished

    def add(self, out: StepOutput) -> None:
        self.out.add(out)

    def result(self) -> GenerationResult:
        o, t = self.out, self.out.token_times
        stats = RequestStats(
            len(self.prompt_ids),
            len(o.token_ids),
            (t[0] - self.t0) if t else 0.0,
            (t[-1] - self.t0) if t else 0.0,
            [b - a for a, b in zip(t, t[1:])],
        )
        return GenerationResult(
            self.request_id,
            self.prompt_ids,
            o.text,
            o.token_ids,
            o.finish_reason,
            o.logprobs if self.params.logprobs else None,
            stats,
            o.top_logprobs if self.params.top_logprobs else None,
            o.prompt_logprobs,
            o.error,
            o.stop_reason(self.params, self.eos_token_id, self.eos_token_ids),
        )
