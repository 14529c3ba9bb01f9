"""``prompt_logprobs`` (vLLM's): the log-probability of every prompt token after the first, its
rank, and the N most likely tokens at its position, from the prefill's logits.

A prefill normally computes the logits of its chunk's last token only (and throws them away:
decode samples every token). A request asking for prompt logprobs has each prefill chunk run with
the logits of all its tokens (``ModelRunner.prefill_logits``). NOTE: that prefill runs eagerly
(the compiled prefill graphs have a fixed ``[1, V]`` output); the decode steps that follow are the
usual compiled ones. The logits at position p predict prompt token p + 1, so the chunk
``[start, end)`` gives the entries of tokens ``start + 1 .. end``; ``Request.prefill_end`` is
``len(prompt) - 1``, so the prefill covers every prompt token after the first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (logprob of the prompt token, its rank (1 = most likely), the top N as (token id, logprob))
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


def prompt_logprobs(logits: torch.Tensor, next_ids: Sequence[int], top: int) -> list[PromptLogprob]:
    """Entries of ``next_ids`` (the token after each position) from ``logits`` fp32 ``[n, V]``
    (raw model logits: no sampling controls, no temperature). One host copy."""
    if logits.dim() != 2 or logits.shape[0] != len(next_ids):
        raise ValueError(
            f"prompt_logprobs: logits must be [n={len(next_ids)}, V], got {list(logits.shape)}"
        )
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(list(next_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0]  # [n]
    rank = (lp > chosen[:, None]).sum(dim=1) + 1  # [n]
    vals, idx = lp.topk(top, dim=-1) if top else (lp[:, :0], ids[:, None][:, :0])  # [n, top]
    chosen_l, rank_l, vals_l, idx_l = (t.cpu().tolist() for t in (chosen, rank, vals, idx))
    return [
        (c, r, list(zip(i, v, strict=True)))
        for c, r, i, v in zip(chosen_l, rank_l, idx_l, vals_l, strict=True)
    ]
