"""A new request's checks before it is queued, each a ValueError naming what is wrong: its id,
prompt ids and token-id parameters against the vocabulary (``check_request``), a received prompt
KV against the cache (``check_received_kv``), a group's ids and prompt (``check_group``), and a
group of sequences of one prompt checked whole before any is queued (``queue_group``).
``Engine.add_request`` and ``Engine.add_request_group`` call them in that order."""

from __future__ import annotations

from collections.abc import Callable, Container

from runtime.prefill_sharing import split_group
from runtime.prompt_kv import PromptKVSource, check_source, check_uncut
from runtime.request import Request
from runtime.sampling_params import SamplingParams, truncate_prompt
from runtime.scheduler import Scheduler
from runtime.structured_output import StructuredOutput


def check_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    in_use: Container[str],
    vocab: int,
    max_model_len: int,
    structured_output: StructuredOutput,
) -> list[int]:
    """The prompt's ids as a list, truncated as ``params`` asks (``truncate_prompt``: before
    the context check and the prefix cache's lookup, which read the request's ids);
    ValueError naming what is wrong with a new request (``in_use``: the ids taken)."""
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")
    ids = truncate_prompt(list(prompt_token_ids), params, max_model_len)
    # builtins over the whole list first (100K-token prompts); the per-token check only when
    # some id is not a plain int (an int subclass other than bool is still accepted)
    if ids and not set(map(type, ids)) <= {int}:
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("prompt token ids must be integers")
    if ids and not (0 <= min(ids) and max(ids) < vocab):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(t >= vocab for t, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
    if params.grammar is not None:
        structured_output.check(params.grammar)
    return ids


def check_received_kv(
    prompt_kv: PromptKVSource,
    params: SamplingParams,
    num_prompt: int,
    ids: list[int],
    num_layers: int,
    row_bytes: int,
    fmt: str,
) -> None:
    """A request's received prompt KV (``add_request(..., prompt_kv=...)``) against its kept
    prompt ``ids`` (of the ``num_prompt`` it was given) and the cache's rows (``row_bytes`` of
    format ``fmt``): its layer count, token count (``len(ids) - 1``) and row width."""
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs needs a prefill: a request with prompt_kv has none")
    check_uncut(num_prompt, len(ids))
    check_source(prompt_kv, num_layers, max(len(ids) - 1, 0), row_bytes, fmt)


def check_group(
    request_ids: list[str],
    prompt_token_ids: list[int],
    params: list[SamplingParams],
    check: Callable[[str, list[int], SamplingParams], list[int]],
) -> list[int]:
    """The prompt the sequences of a group (``Engine.add_request_group``) share, each sequence
    ``check``-ed as a new request (``check_request``); ValueError unless there is one
    SamplingParams per id, the ids are distinct and every sequence truncates the prompt alike
    (one prefill serves them all)."""
    if len(request_ids) != len(params) or not request_ids:
        raise ValueError("add_request_group needs one SamplingParams per request id")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError("add_request_group: request ids must be distinct")
    ids = list(prompt_token_ids)
    kept = [check(rid, ids, p) for rid, p in zip(request_ids, params)]
    prompt = kept[0]
    if any(len(k) != len(prompt) for k in kept):  # (suffixes of ids; one prefill for all)
        raise ValueError("add_request_group: the sequences must truncate the prompt alike")
    return prompt


def queue_group(
    scheduler: Scheduler, reqs: list[Request], register: Callable[[Request], None]
) -> None:
    """Queue the sequences of one prompt (``Engine.add_request_group``), split into groups the
    pools can serve at once, each sharing its prefill (a one-token prompt: separate requests);
    all are checked before any is queued, and each is ``register``-ed once queued."""
    parts = split_group(reqs, scheduler.cfg.max_running, scheduler.pages.num_pages)
    shared = [len(part) > 1 and reqs[0].prefill_end >= 1 for part in parts]
    for part, share in zip(parts, shared):  # check all before queueing any
        for r in part:
            scheduler.check(r)
        if share:
            scheduler.check_group(part)
    for part, share in zip(parts, shared):
        if share:
            scheduler.add_group(part)
        else:
            for r in part:
                scheduler.add(r)
        for r in part:
            register(r)
