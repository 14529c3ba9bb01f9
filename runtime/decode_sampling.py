"""A decode step's tokens, sampled on the device: the grammar's mask, the sampling controls, the
engine's logits processors, then ``runtime.sampler.sample``, with each row's token, logprob, top
alternatives (with the chosen token's logprob among them) and (when checked) unusable-logits
stage put in one tensor on its way to the host
(``runtime.readback.SampledStep``; no host sync here)."""

from __future__ import annotations

import torch

from runtime.readback import SampledStep, to_host
from runtime.sampler import LogitsProcessor, bad_stage, prepare_batch, sample, unusable_rows
from runtime.sampling_controls import SamplingControls
from runtime.scheduler import ScheduledBatch
from runtime.structured_output import StructuredOutput

LOGPROB_FLOOR = -9999.0  # reported in place of -inf (a masked-out token), as vLLM does


def sample_decode(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    seeds: dict[str, int],
    structured_output: StructuredOutput,
    sampling_controls: SamplingControls,
    logits_processors: list[LogitsProcessor],
    pending: torch.Tensor | None = None,
    started: torch.cuda.Event | None = None,
) -> SampledStep:
    """Sample a decode step's tokens on the device (no host sync); ``seeds``: per request id, its
    ``request_seed``; ``pending``: the step is one token ahead of the requests' host-side lists
    (``Engine._decode``), their newest tokens (int64 [len(batch.requests)] on the device)."""
    reqs, ahead = batch.requests, pending is not None
    generated = [len(r.output_ids) + ahead for r in reqs]
    sb = prepare_batch(
        [r.params for r in reqs], [seeds[r.request_id] for r in reqs], generated, logits.device,
    )  # fmt: skip
    # The grammar's mask first: min_p is relative to the best token the grammar allows (after
    # it, a row whose allowed tokens min_p had all dropped was all -inf: NaN, token 0). The
    # other controls leave a masked -inf at -inf, so for them the order does not matter.
    logits = sampling_controls(reqs, structured_output(reqs, logits.float()), pending)
    # with processors: which rows were unusable before them, then after each (as each
    # returns: a later one may write in place). Before them also when a row's own parameters
    # may have masked every token at this token (a grammar, min_tokens' stop ids before
    # min_tokens): such a row, sampled from all -inf, was token 0 with a NaN logprob. (No
    # host sync either way: the column goes to the host with the tokens; a batch without
    # such rows computes nothing.)
    checks = logits_processors or any(
        r.params.may_mask_every_token(n) for r, n in zip(reqs, generated)
    )
    stages = [unusable_rows(logits)] if checks else []
    for proc in logits_processors:
        out = proc(reqs, logits)
        # floating point on the logits' device too: .float() would turn integer or bool
        # logits into other numbers without a word, and another device fails in sample()
        # with an error that does not name the processor
        if (
            not isinstance(out, torch.Tensor)
            or out.shape != logits.shape
            or not out.is_floating_point()
            or out.device != logits.device
        ):
            got = (
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ValueError(
                f"logits processor {proc!r} must return a floating-point tensor of shape "
                f"{tuple(logits.shape)} on {logits.device}, got {got}"
            )
        logits = out.float()
        stages.append(unusable_rows(logits))
    tok, lp = sample(
        logits,
        sb.temperature,
        sb.top_k,
        sb.top_p,
        sb.seeds,
        sb.steps,
        all_greedy=sb.all_greedy,
        filters=sb.filters,
    )
    # a token masked out (min_p, a grammar, min_tokens' EOS mask) has logprob -inf, which JSON
    # cannot carry: reported logprobs are floored at LOGPROB_FLOOR, as vLLM does
    lp = lp.clamp(min=LOGPROB_FLOOR)
    n_top = max(r.params.top_logprobs for r in reqs)
    cols = [tok.double()[:, None], lp.double()[:, None]]
    if n_top:
        # top alternatives: log_softmax of the logits sampled from, before temperature /
        # top-k / top-p (what a greedy row's own logprob is computed from); then the chosen
        # token's logprob in that same distribution (a sampled row's ``lp`` is of the processed
        # one), for a top-N list that adds the chosen token (completions' N + 1 rule)
        raw = torch.log_softmax(logits, dim=-1)
        top = raw.topk(n_top, dim=-1)
        chosen = raw.gather(1, tok[:, None]).clamp(min=LOGPROB_FLOOR)
        cols += [top.indices.double(), top.values.clamp(min=LOGPROB_FLOOR).double()]
        cols.append(chosen.double())
    checked = bool(stages)
    if checked:  # an unusable row fails its request when read (Engine._complete)
        cols.append(bad_stage(stages).double()[:, None])
    host, copied = to_host(torch.cat(cols, 1), timed=True)
    return SampledStep(batch, tok, host, n_top, copied, ahead, started, checked)
