"""Per-request sampling controls applied to a decode step's logits before ``runtime.sampler``:
presence / frequency / repetition penalties, ``logit_bias``, ``min_tokens`` and ``min_p``.

The token counts the penalties need are kept on the device: one ``[V]`` int32 row per request in
a slot buffer, updated each step from the tokens the request gained since (usually one), so a step
moves a few ints to the device, not the whole history. A request's slot is freed once a decode
step runs without it (finished, aborted, or paused), and rebuilt from its host-side token lists if
it comes back, so the state can never go stale or leak. A step launched one token ahead (the
engine's asynchronous scheduling) passes each row's newest token as a device tensor: it is counted
on the device, and the host list's copy of it is skipped when it arrives.

No host syncs: the host only reads its own lists and parameters; every tensor op is batched over
the rows that use a control (rows that use none are untouched, and a batch with none costs
nothing). Order within a row: repetition, frequency and presence penalties; then ``logit_bias``;
then ``min_tokens`` (EOS and the stop ids to -inf); then ``min_p`` (on the temperature-scaled
distribution, sampled rows only). Greedy rows take the argmax of the result and report its
log-softmax as their logprob.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.request import Request


FP32 = torch.finfo(torch.float32)


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # pinned + non_blocking: a pageable copy would wait for the step's graph to finish
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


class SamplingControls:
    """Callable ``(requests, logits [B, V] fp32) -> logits``: the input when no row uses a control,
    else a new tensor (the input may be a CUDA graph's output buffer: it is never written).
    ``eos_token_ids`` are the tokens ``min_tokens`` holds back besides the stop ids."""

    def __init__(self, eos_token_ids: Collection[int]) -> None:
        self.eos = sorted(eos_token_ids)
        self.counts: torch.Tensor | None = None  # [capacity, V] int32: times generated
        self.in_prompt: torch.Tensor | None = None  # [capacity, V] bool: in the prompt
        self.slots: dict[str, tuple[int, int]] = {}  # request id -> (slot, outputs counted)

    def __call__(
        self,
        requests: Sequence[Request],
        logits: torch.Tensor,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``pending``: the step runs one token ahead of the requests' lists (the engine's
        asynchronous scheduling): each request's newest token, int64 [len(requests)] on the
        device, is not in its ``output_ids`` yet; it is counted here, on the device, and
        ``min_tokens`` counts it too."""
        rows = [i for i, r in enumerate(requests) if r.params.has_controls]
        live = {requests[i].request_id for i in rows}
        for rid in [k for k in self.slots if k not in live]:
            del self.slots[rid]  # not in this step: rebuilt from its lists if it returns
        if not rows:
            return logits
        reqs = [requests[i] for i in rows]
        index = _to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
        newest = None if pending is None else pending.index_select(0, index)
        slots = self._update(reqs, logits.shape[1], logits.device, newest)
        x = self.apply(
            logits[rows],
            self.counts[slots],
            self.in_prompt[slots],
            reqs,
            ahead=int(pending is not None),
        )
        return logits.index_put((index,), x)

    # ---- state -----------------------------------------------------------------------------
    def _update(
        self,
        reqs: list[Request],
        vocab: int,
        device: torch.device,
        newest: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Slots of ``reqs``, their counts brought up to date; [A] int64 on the device.
        ``newest``: each one's token not in its lists yet ([A] on the device), counted too."""
        self._reserve(sum(r.request_id not in self.slots for r in reqs), vocab, device)
        assert self.counts is not None and self.in_prompt is not None
        used = {s for s, _ in self.slots.values()}
        free = iter(s for s in range(self.counts.shape[0]) if s not in used)
        slot_of, tok_slots, toks, fresh, prompt_slots, prompt_toks = [], [], [], [], [], []
        for r in reqs:
            slot, seen = self.slots.get(r.request_id, (-1, 0))
            if slot < 0:
                slot, seen = next(free), 0
                fresh.append(slot)
                prompt_slots += [slot] * len(r.prompt_ids)
                prompt_toks += r.prompt_ids
            new = r.output_ids[seen:]
            tok_slots += [slot] * len(new)
            toks += new
            # (the token ``newest`` counts is its next output: not to be counted again)
            self.slots[r.request_id] = (slot, len(r.output_ids) + (newest is not None))
            slot_of.append(slot)
        if fresh:
            f = _to_device(torch.tensor(fresh, dtype=torch.int64), device)
            self.counts[f] = 0
            self.in_prompt[f] = False
            if prompt_toks:
                pairs = torch.tensor([prompt_slots, prompt_toks], dtype=torch.int64)
                idx = _to_device(pairs, device)
                self.in_prompt[idx[0], idx[1]] = True
        if toks:
            idx = _to_device(torch.tensor([tok_slots, toks], dtype=torch.int64), device)
            ones = torch.ones(idx.shape[1], dtype=torch.int32, device=device)
            self.counts.index_put_((idx[0], idx[1]), ones, accumulate=True)
        slot_t = _to_device(torch.tensor(slot_of, dtype=torch.int64), device)
        if newest is not None:
            ones = torch.ones(len(slot_of), dtype=torch.int32, device=device)
            self.counts.index_put_((slot_t, newest), ones, accumulate=True)
        return slot_t

    def _reserve(self, n: int, vocab: int, device: torch.device) -> None:
        """Room for ``n`` more slots (doubling, so a growing batch reallocates log-many times)."""
        have = 0 if self.counts is None else self.counts.shape[0]
        c = self.counts
        if c is not None and (c.shape[1], c.device) != (vocab, device):
            self.slots.clear()  # another model or device: start afresh
            have = 0
        if have and have - len(self.slots) >= n:
            return
        cap = max(8, 2 * (len(self.slots) + n))
        counts = torch.zeros(cap, vocab, dtype=torch.int32, device=device)
        in_prompt = torch.zeros(cap, vocab, dtype=torch.bool, device=device)
        if have:
            assert self.counts is not None and self.in_prompt is not None
            counts[:have] = self.counts
            in_prompt[:have] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt

    # ---- the controls ----------------------------------------------------------------------
    def apply(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        in_prompt: torch.Tensor,
        reqs: Sequence[Request],
        ahead: int = 0,
    ) -> torch.Tensor:
        """The controls on rows ``x`` [A, V] fp32 of ``reqs``, given their generated-token
        ``counts`` [A, V] int32 and prompt membership ``in_prompt`` [A, V] bool; ``ahead``: each
        has that many outputs more than its list holds (asynchronous scheduling)."""
        ps = [r.params for r in reqs]
        host = torch.tensor(
            [
                [p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.temperature]
                + [math.log(p.min_p) if p.min_p > 0 and not p.greedy else -math.inf]
                for p in ps
            ],
            dtype=torch.float32,
        )
        v = _to_device(host, x.device)
        rep, freq, pres, temp, log_min_p = (v[:, i : i + 1] for i in range(5))  # [A, 1] each
        if any(p.repetition_penalty != 1 for p in ps):
            seen = in_prompt | (counts > 0)
            # NOTE: in fp32 a penalty past fp32 max is inf (0 * inf: NaN), one under 1e-45 is 0
            # (-inf * 0: NaN) and a small one sends x / rep to +inf (inf - inf: a NaN softmax, a
            # garbage token, a 500 on the logprobs): keep all finite; -inf (a mask) stays -inf.
            rep = rep.clamp(min=FP32.tiny, max=FP32.max)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x).clamp(max=FP32.max)
        if any(p.frequency_penalty or p.presence_penalty for p in ps):
            c = counts.to(torch.float32)
            x = x - freq * c - pres * (c > 0).to(torch.float32)
        bias = [(i, t, b) for i, p in enumerate(ps) for t, b in p.logit_bias]
        masked = [
            (i, t)
            for i, r in enumerate(reqs)
            if len(r.output_ids) + ahead < r.params.min_tokens
            for t in ([] if r.params.ignore_eos else self.eos)
            + list(r.params.stop_token_ids)
        ]
        # (x is a copy of the batch's rows: in-place writes on it are safe)
        if bias:
            b = torch.tensor([[i, t] for i, t, _ in bias], dtype=torch.int64).T
            vals = torch.tensor([val for _, _, val in bias], dtype=torch.float32)
            b, vals = _to_device(b, x.device), _to_device(vals, x.device)
            x.index_put_((b[0], b[1]), vals, accumulate=True)
        if masked:
            m = _to_device(torch.tensor(masked, dtype=torch.int64).T, x.device)
            x[m[0], m[1]] = float("-inf")
        if any(p.min_p > 0 and not p.greedy for p in ps):
            # p_v >= min_p * p_max  <=>  x_v / t >= x_max / t + log(min_p)
            top = x.max(dim=-1, keepdim=True).values
            off = torch.isinf(log_min_p)  # rows without min_p (and greedy ones, where t = 0)
            threshold = torch.where(off, float("-inf"), top + temp * log_min_p.clamp(min=-1e30))
            x = x.masked_fill(x < threshold, float("-inf"))
        return x
