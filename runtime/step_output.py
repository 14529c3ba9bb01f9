"""What a step reports per request (``StepOutput``), and how the engine builds it: a sampled
token's output (``token_output``), or the error that ends a request whose logits were unusable
(``unusable_logits_message``, ``error_output``)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.prompt_logprobs import PromptLogprob
from runtime.readback import TopLogprobs
from runtime.request import Request
from runtime.sampler import LogitsProcessor


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # per new token, its params.top_logprobs most likely (token id, logprob); None when not asked
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # params.prompt_logprobs, on a request's first output: [None, entry of prompt token 1, ...]
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # prompt tokens served from the prefix cache (EngineConfig.enable_prefix_caching)
    cached_tokens: int = 0
    # finish_reason "error": what went wrong, when the engine knows (a logits processor's output)
    error: str | None = None
    # per new token, its logprob in new_top_logprobs' distribution (the raw log-softmax, before
    # temperature / top-k / top-p; new_logprobs' is after them for a sampled token): what a top
    # list that adds the chosen token puts beside the top ones; None with new_top_logprobs
    new_top_chosen: list[float] | None = None
    # the stop string that ended the request, as its stop checker matched it (min_tokens' rule
    # included): vLLM's stop_reason when a stop string ended it; None when anything else did
    stop_string: str | None = None


def token_output(
    r: Request,
    tok: int,
    lp: float,
    top: TopLogprobs | None,
    raw: float | None,
    text: str,
    reason: str | None,
    stop_string: str | None = None,
) -> StepOutput:
    """The output of ``r``'s token ``tok`` (appended already), its logprob ``lp``, alternatives
    ``top`` and its own logprob ``raw`` in their distribution, detokenized ``text``, finish
    ``reason`` (None: it goes on) and the ``stop_string`` that ended it, if one did."""
    return StepOutput(
        r.request_id,
        [tok],
        [lp] if r.params.logprobs else None,
        text,
        reason is not None,
        reason,
        len(r.prompt_ids),
        len(r.output_ids),
        None if top is None else [top],
        # with the first token: None for the first prompt token, then the prefill's
        r.prompt_logprobs_out() if len(r.output_ids) == 1 else None,
        r.cached_tokens,
        new_top_chosen=None if top is None else [raw],
        stop_string=stop_string,
    )


def unusable_logits_message(req: Request, stage: int, processors: list[LogitsProcessor]) -> str:
    """Why ``req``'s row of a decode step had unusable logits (``bad_stage``'s ``stage``),
    naming the processor (stage 1: the request's own parameters, or the model)."""
    why = "NaN or +inf logits, or every logit -inf (no token left to sample)"
    if stage == 1:
        # NOTE: every row of a checked step is checked (a processor, or another row that may
        # mask): name this request's own parameters only, and only those that could mask
        before = " before the logits processors" if processors else ""
        own = req.params.masking(len(req.output_ids))  # (the token was never appended)
        what = f"no token could be sampled{before}: " + (
            f"its own parameters masked every token ({'; '.join(own)}), or the model's "
            "logits were NaN or +inf"
            if own
            else f"the model's logits were unusable ({why})"
        )
    else:
        proc = processors[stage - 2]
        what = f"logits processor {proc!r} returned {why} for this request's row"
    return f"request {req.request_id!r}: {what}"


def error_output(req: Request, msg: str) -> StepOutput:
    """The last output of ``req``, finished with finish_reason "error" and message ``msg``:
    no new token."""
    n = len(req.output_ids)
    return StepOutput(
        req.request_id, [], [] if req.params.logprobs else None, "", True, "error",
        len(req.prompt_ids), n, [] if req.params.top_logprobs else None,
        req.prompt_logprobs_out() if n == 0 else None, req.cached_tokens, msg,
        [] if req.params.top_logprobs else None,
    )  # fmt: skip
