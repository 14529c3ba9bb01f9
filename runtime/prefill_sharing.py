"""n sequences of one prompt that share its prefill (``n > 1`` and ``best_of``).

A group is a hidden **head** request that only prefills the prompt, and its **members**: the n
sequences the caller sees, each with its own id, seed and stream. The layout of the host pool:

- the prompt tokens ``[0, prefill_end)`` are written once, by the head's prefill (its chunks, its
  numerics: exactly what a lone request's prefill writes);
- the ``s = prefill_end // 64`` pages those tokens fill completely are shared read-only: every
  member's block table starts with the head's first ``s`` pages (``HostSlotAllocator.share``), so
  the host slots of one prompt's worth are held once, not n times;
- the last, partly filled prompt page (tokens ``[64 s, prefill_end)``) is copied on write: each
  member owns a page ``s`` of its own, into which the head's rows are copied when the prefill
  ends (``fork``), and the member's own tokens go there and into its further own pages. No page is
  ever written by two sequences.

Reference counts free a shared page once, after the last of its holders ends (finish, abort or a
disconnect, in any order); the head gives up its references at the fork (or when every member
left before it). The GPU pools cache host rows by host slot, so members selecting a shared token
hit one GPU-pool row: the cache manager's invariants (one GPU slot per host slot, recall of a
host slot listed twice in a batch done once) hold as they are, and the union of a batch's
selections only shrinks. With prefetch on, the members also share one prefetch threshold (keyed
by the first host page): that changes only what is prefetched, never what is attended.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from custom_ops.kv_format import PAGE, pages_for
from runtime.prompt_kv import read_prompt_kv
from runtime.request import Request


@dataclass
class PrefillGroup:
    head: Request  # prefills the prompt, never decodes; not in Engine.requests
    members: list[Request]  # the sequences; admitted with the head, running after the fork
    admitted: bool = False

    @property
    def shared_pages(self) -> int:
        """Pages of the prompt that every member holds read-only: the full ones."""
        return self.head.prefill_end // PAGE

    def pages_needed(self) -> int:
        """Host pages the whole group takes at admission: the head's prompt pages, and each
        member's own pages (its copy of the last prompt page and its generated tokens)."""
        own = sum(pages_for(m.max_total_tokens) - self.shared_pages for m in self.members)
        return pages_for(self.head.prefill_end) + own

    def copied_positions(self) -> range:
        """Prompt positions each member gets a copy of at the fork (its page ``s``)."""
        return range(self.shared_pages * PAGE, self.head.prefill_end)


def head_of(members: list[Request]) -> Request:
    """The hidden prefill request of ``members`` (one prompt; ids unique among the engine's).
    When members ask for ``prompt_logprobs``, the head's prefill computes them once, for the
    largest N asked; ``share_prompt_logprobs`` hands them out at the fork."""
    first = members[0]
    asked = [m.params.prompt_logprobs for m in members if m.params.prompt_logprobs is not None]
    params = first.params
    if asked:
        params = dataclasses.replace(params, prompt_logprobs=max(asked))
    return Request(f"{first.request_id}#prefill", first.prompt_ids, params)


def share_prompt_logprobs(head: Request, members: list[Request]) -> None:
    """At the fork: each member asking for ``prompt_logprobs`` gets the head's entries, with its
    own N of alternatives (the head computed the largest; a top-k's first N are the top N)."""
    for m in members:
        n = m.params.prompt_logprobs
        if n is not None:
            m.prompt_logprobs = [(lp, rank, top[:n]) for lp, rank, top in head.prompt_logprobs]


def split_group(reqs: list[Request], max_rows: int, num_pages: int) -> list[list[Request]]:
    """``reqs`` (one prompt) in consecutive parts that can each be admitted at once: at most
    ``max_rows`` decode rows, and host pages for the prompt once plus each sequence's own pages
    (``PrefillGroup.pages_needed``) within ``num_pages``. Parts of one make separate requests."""
    prefill_end = reqs[0].prefill_end
    own = max(pages_for(r.max_total_tokens) for r in reqs) - prefill_end // PAGE
    rows = max(1, min(max_rows, (num_pages - pages_for(prefill_end)) // own))
    return [reqs[i : i + rows] for i in range(0, len(reqs), rows)]


def copy_rows(cache: torch.nn.Module, src: list[int], dst: list[int]) -> None:
    """The fork's copy on write: host slots ``dst`` of ``cache`` (a ``KVCache``) get the latent
    and indexer rows of ``src`` in every layer (the same bytes, through the write path prefill
    uses, ``LayerKV.store``), so each sequence owns the prompt's last, partly filled page."""
    device = cache.layers[0].index_k.device
    if device.type == "cuda":
        # NOTE: the host rows are read by the CPU, and the last prefill chunk's kernels may still
        # be writing them through UVA (a prefill step ends without a host sync)
        torch.cuda.synchronize(device)
    rows = read_prompt_kv(cache.layers, src)
    slots = torch.tensor(dst, dtype=torch.int64, device=device)
    for i, layer in enumerate(cache.layers):
        kv, index = rows.chunk(i, 0, len(src))
        layer.store(kv.to(device), index.to(device), slots)
