"""The ``/v1/completions`` route body: prompt lists, n choices, best_of, echo, logprobs
(``text_offset`` equal streamed or not) and ``prompt_logprobs``."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from runtime.engine import StepOutput
from runtime.openai_protocol import APIError, CompletionRequest, check_unsupported, sampling_params
from runtime.outputs import RequestOutput
from runtime.server_base import HandlersBase, Top


class CompletionHandlers(HandlersBase):
    """``/v1/completions``."""

    async def prompts_of(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        """``(ids, text)`` per prompt: a string, a list of ids, or a list of either."""
        raw = req.prompt
        many = isinstance(raw, list) and raw and not isinstance(raw[0], int)
        items = list(raw) if many else [raw]  # type: ignore[arg-type]
        vocab = self.tokenizer.vocab_size
        out = []
        # vLLM's add_special_tokens (default true): false encodes a text prompt without the BOS
        # (token-id prompts never get one added)
        special = (req.model_extra or {}).get("add_special_tokens")
        if special is not None and not isinstance(special, bool):
            msg = f"add_special_tokens must be true or false, got {special!r}"
            raise APIError(400, msg, param="add_special_tokens")
        for k, p in enumerate(items):
            if isinstance(p, str):
                # (in a list, the index alone would not say which prompt)
                where = f"prompt[{k}]" if many else None
                # (a prompt to truncate may be longer than the context: its ids are counted)
                fits = req.truncate_prompt_tokens is None
                ids = await self.encode(p, special is not False, "prompt", fits, where)
                kept = self.truncated(ids, req)
                # echo: the text of the prompt the request ran on
                cut = kept is not ids and bool(req.echo)
                out.append((kept, self.tokenizer.decode(kept, False) if cut else p))
                continue
            if not p or any(not 0 <= i < vocab for i in p):
                msg = f"prompt token ids must be a non-empty list of ids in [0, {vocab})"
                raise APIError(400, msg, param="prompt")
            kept = self.truncated(list(p), req)
            # (echo: their text with the special tokens, as vLLM decodes a token-id prompt)
            text = self.tokenizer.decode(kept, skip_special_tokens=False) if req.echo else ""
            out.append((kept, text))
        if not out:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        return out

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        check_unsupported(req)
        prompts = await self.prompts_of(req)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # the OpenAI default
        # echo with max_tokens 0: the prompt alone, as vLLM returns it; the engine generates one
        # token, which respond() drops (max_tokens 0 without echo stays a 400)
        prompt_only = bool(req.echo) and max_tokens == 0
        if prompt_only:
            self.prompt_only_fits(len(ids) for ids, _ in prompts)
            max_tokens = 1
        vocab = self.tokenizer.vocab_size
        defaults = self.engine.sampling_defaults
        params = sampling_params(req, max_tokens, req.logprobs is not None, vocab, defaults)
        for ids, _ in prompts:
            self.max_tokens(len(ids), max_tokens, "prompt", defaulted=req.max_tokens is None)
        # echo with logprobs: the prompt's tokens come first in the logprobs, their entries from
        # the prompt_logprobs path (None for the first token, as OpenAI and vLLM return it)
        echo_lps = bool(req.echo) and req.logprobs is not None
        if echo_lps:
            want = max(req.logprobs or 0, req.prompt_logprobs or 0)
            params = dataclasses.replace(params, prompt_logprobs=want)
        n = req.n or 1
        best_of = req.best_of or n
        keep = None
        if best_of > n:  # ranked by cumulative logprob: every candidate reports its logprobs
            params = dataclasses.replace(params, logprobs=True)
            keep = functools.partial(best_of_order, best_of=best_of, n=n)
        # the candidates are best_of's when it asks for more than n (the 400 must name it)
        choices = self.choices_of(prompts, params, best_of, "best_of" if best_of > n else "n")
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start(rid, choices)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
        }
        # NOTE: text_offset counts the token strings, not the text emitted so far: text held back
        # for a partial UTF-8 character or a possible stop string would make streamed offsets lag
        # the non-streamed ones.
        offsets = [0] * len(choices)

        def logprobs(
            i: int,
            token_ids: list[int],
            lps: list[float | None],
            start: int,
            top: list[Top | None] | None,
            chosen: list[float | None],
        ) -> dict | None:
            """``chosen``: per token, its logprob in ``top``'s distribution, which its
            ``top_logprobs`` entry takes (None: its own, ``lps``'; logprobs 0 has no ``top``)."""
            toks = self.token_strings(token_ids)
            # running sums (echo of a 100K-token prompt: a sum per token was quadratic, minutes)
            starts = list(itertools.accumulate(map(len, toks), initial=start))
            offsets[i] = starts.pop()
            if req.logprobs is None:
                return None
            # None where the token has no logprob (an echoed prompt's first)
            tops = top or [[] for _ in token_ids]
            alternatives = [
                None
                if pos is None or own is None
                else top_entries(pos, tok, own if raw is None else raw, self.token_string)
                for tok, own, pos, raw in zip(token_ids, lps, tops, chosen, strict=True)
            ]
            return {
                "tokens": toks,
                "token_logprobs": lps,
                "top_logprobs": alternatives,
                "text_offset": starts,
            }

        def echoed(i: int, entries: list | None) -> tuple[list[int], list, list[Top | None]]:
            """echo with logprobs: the prompt's ids, logprobs and top N alternatives, to go before
            the generated ones (``logprobs`` adds the prompt token itself, as it adds a chosen
            one)."""
            if not echo_lps or entries is None:
                return [], [], []
            ids, lps, tops = choices[i].ids, [], []
            for e in entries:
                if e is None:
                    lps.append(None)
                    tops.append(None)
                    continue
                lp, _, alts = e
                lps.append(lp)
                tops.append(alts[: req.logprobs])
            return list(ids), lps, tops

        def first() -> list[dict[str, Any]]:  # echo: the prompt comes first
            if not req.echo or echo_lps:  # with logprobs, it comes with its logprobs (chunk)
                return []
            return [
                {**head, "choices": [{"index": i, "text": c.text, "logprobs": None,
                                      "finish_reason": None}]}
                for i, c in enumerate(choices)
            ]  # fmt: skip

        def chunk(i: int, out: StepOutput) -> dict[str, Any] | None:
            prompt_lps = out.prompt_logprobs
            if not (out.new_text or out.finished or req.logprobs is not None or prompt_lps):
                return None
            # echo with logprobs: the prompt and its logprobs come with the first token, as vLLM
            # streams them (the prompt's logprobs exist only once it is prefilled)
            e_ids, e_lps, e_tops = echoed(i, prompt_lps)
            text = (choices[i].text if e_ids else "") + out.new_text
            top = out.new_top_logprobs or [[] for _ in out.new_token_ids]
            raw = out.new_top_chosen or [None] * len(out.new_token_ids)
            lp = logprobs(
                i,
                e_ids + out.new_token_ids,
                e_lps + (out.new_logprobs or []),
                offsets[i],
                e_tops + top if e_ids else out.new_top_logprobs,
                e_lps + raw,  # (a prompt token's logprob is of its top N's distribution)
            )
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
            if prompt_lps is not None and req.prompt_logprobs is not None:  # with the first token
                choice["prompt_logprobs"] = self.prompt_logprobs(
                    choices[i].ids, prompt_lps, req.prompt_logprobs
                )
            return {**head, "choices": [choice]}

        def final(
            results: list[RequestOutput], usage: dict[str, int], tops: list[list[Top]]
        ) -> dict[str, Any]:
            out = []
            for i, res in enumerate(results):
                e_ids, e_lps, e_tops = echoed(i, res.prompt_logprobs)
                top = tops[i] or [[] for _ in res.token_ids]
                raw = res.top_chosen or [None] * len(res.token_ids)
                lp = logprobs(
                    i,
                    e_ids + res.token_ids,
                    e_lps + res.logprobs,
                    0,
                    e_tops + top if e_ids else tops[i],
                    e_lps + raw,
                )
                text = (choices[i].text if req.echo else "") + res.text
                out.append(
                    {"index": i, "text": text, "finish_reason": res.finish_reason, "logprobs": lp}
                )
            if req.prompt_logprobs is not None:
                for c, res in zip(out, results, strict=True):
                    lps, ids = res.prompt_logprobs, choices[c["index"]].ids
                    c["prompt_logprobs"] = (
                        None if lps is None else self.prompt_logprobs(ids, lps, req.prompt_logprobs)
                    )
            return {**head, "choices": out, "usage": usage}

        return await self.respond(
            request, streams, choices, req, head, chunk, final, t0, first, keep, prompt_only
        )


def top_entries(
    top: Top, token: int, logprob: float, text: Callable[[int], str]
) -> dict[str, float]:
    """One position's ``top_logprobs`` (OpenAI's legacy rule, as vLLM keeps it): its top N
    (``top``), then the chosen ``token`` itself with its ``logprob`` when it is not among them (up
    to N + 1 entries; N = 0: the chosen token alone), keyed by their strings (``text``).
    ``logprob`` must be of the top N's distribution (a sampled token's reported logprob is after
    temperature / top-k / top-p, theirs before: ``StepOutput.new_top_chosen``). NOTE:
    a chosen token whose string is a top one's (byte pieces all read "\ufffd") leaves that entry
    as it is, as vLLM writes them (the chosen first, the top N over it): its own logprob put
    under that string claimed a likelier token's place."""
    out = {text(t): v for t, v in top}
    out.setdefault(text(token), logprob)
    return out


def best_of_order(results: list[RequestOutput], best_of: int, n: int) -> list[int]:
    """best_of: of each prompt's ``best_of`` consecutive candidates, the ``n`` with the highest
    cumulative logprob (the sum of their tokens' logprobs, as vLLM ranks them), best first; ties
    keep the candidates' order. Indices into ``results``, prompt-major."""
    out = []
    for start in range(0, len(results), best_of):
        group = range(start, start + best_of)
        out += sorted(group, key=lambda i: -sum(results[i].logprobs))[:n]
    return out
